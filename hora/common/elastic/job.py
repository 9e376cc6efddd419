"""The elastic job as ``hvd.elastic.run`` and the elastic states see it.

The loop (:mod:`.loop`) and the states (:mod:`.state`) ask the job a few questions: whether this
process runs in an elastic job at all, which round it is in, the driver's latest host-change
notice; and they ask it for two things: a new round (this round's collectives failed) and a
place in the next round (``hvd.shutdown(); hvd.init()``).
:class:`~hora.common.runtime.ElasticJob` names them, and :func:`job` answers with the
process's (``Runtime.elastic_job``): :class:`DriverJob`,
``horarun``'s elastic driver through the job's store, unless something else was put there (a
test that simulates rounds without a driver does).
"""

from __future__ import annotations

import logging

from hora.common.job import rounds
from hora.common.job.round_plan import RoundPlan
from hora.common.runtime import ElasticJob, runtime
from hora.common.startup.lifecycle import init, shutdown

logger = logging.getLogger("hora")


class DriverJob:
    """An elastic ``horarun``'s job: its driver publishes the rounds and host-change notices in
    the job's store (:mod:`hora.common.job.rounds`)."""

    def active(self) -> bool:
        return rounds.active()

    def current_round(self) -> RoundPlan | None:
        return rounds.progress().plan

    def host_update(self) -> tuple[int, int]:
        """The store client is made once per process (``Runtime.elastic_store``). A store
        that cannot be read counts as "no notice" (the engine notices a lost store on its
        own)."""
        state = runtime()
        try:
            if state.elastic_store is None:
                state.elastic_store = rounds.base_store()
            return rounds.read_host_update(state.elastic_store)
        except Exception as exc:  # a missed notice is seen at the next check
            logger.warning("hora elastic: could not read the host-change notice: %s", exc)
            return 0, 0

    def request_reset(self) -> None:
        rounds.request_reset()

    def rejoin(self) -> None:
        shutdown()
        # A new session numbers unnamed collectives from the start, as the new workers do.
        init()


def job() -> ElasticJob:
    """The elastic job this process runs in (``Runtime.elastic_job``; :class:`DriverJob`
    unless something else was put there)."""
    state = runtime()
    if state.elastic_job is None:
        state.elastic_job = DriverJob()
    return state.elastic_job
