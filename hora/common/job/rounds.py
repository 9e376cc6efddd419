"""Elastic jobs: how ``horarun``'s elastic driver and its workers agree on who trains.

An elastic job runs in numbered *rounds*. A round is one fixed set of workers with fixed ranks;
every membership change (a worker lost, hosts added or removed, a collective that failed) ends it
and the driver publishes the next one. Everything goes through the job's store, signed with the
job secret (:mod:`hora.common.job.store`):

``elastic/round``
    the newest round's number (decimal), written by the driver after its plan.
``elastic/round/<n>/plan``
    round ``n``'s :class:`RoundPlan`, as JSON: the world size, the host-update number it already
    accounts for, and one :class:`Assignment` per worker id (``host:slot``).
``elastic/round/<n>/reset``
    written by a worker whose collective failed in round ``n`` although no process ended (a
    network fault, say); the driver then starts round ``n + 1`` with the same workers.
``elastic/hosts-updated``
    the driver's latest host-change notice, as JSON ``{"number": k, "flags": f}`` (``f``: 1 hosts
    added, 2 removed, 3 both). Rank 0 reads it in ``State.check_host_updates()``.

Each round's engine keeps its own keys under the store prefix ``r<n>/`` (failure reports, exit
reports, process groups), so nothing of a failed round leaks into the next. A worker joins a
round in :func:`join` (called by ``hvd.init()``): it waits for a round newer than the last one it
took part in, finds its assignment, and meets the round's other workers at a barrier; a round
replaced while its workers gather is abandoned for the newer one. A worker that the newest round
leaves out (its host was removed) ends with exit status 0.

Past the barrier, ``hvd.init()`` still waits for the round's other workers while they connect
(the settings they compare, Gloo's rendezvous, shared memory). Until :func:`formed`, every such
wait on the round's store ends as soon as the round is lost (:func:`lost`: a failure reported in
it, or a newer round), and :func:`round_lost` tells ``hvd.init()`` to join the next round instead
of failing: a worker that dies while the others connect costs them a new round, not a timeout.

This module knows the store and the protocol; the driver lives in :mod:`hora.runner.elastic`
and the worker API (``hvd.elastic``) in :mod:`hora.torch.elastic`.
"""

from __future__ import annotations

import json
import logging
import os
import time

from hora.common.job import store_keys as keys
from hora.common.job.round_plan import Assignment as Assignment
from hora.common.job.round_plan import RoundPlan as RoundPlan
from hora.common.job.round_plan import host_of as host_of
from hora.common.job.store import AuthenticationError, StoreClient, read_failure, tampering
from hora.common.job.topology import Topology
from hora.common.runtime import RoundProgress, runtime
from hora.common.vocabulary import settings_table as table
from hora.common.vocabulary.config import raw, read
from hora.common.vocabulary.settings_table import ELASTIC, ELASTIC_ID, ELASTIC_TIMEOUT

logger = logging.getLogger("hora")

# Set to "1" in every worker an elastic horarun starts.
ELASTIC_VAR = ELASTIC.env
# The worker's stable name in the job, "host:slot" (slot: its index among the host's slots).
WORKER_ID_VAR = ELASTIC_ID.env
# How long a worker waits for a round that includes it, and for that round's other workers.
DEFAULT_TIMEOUT_S = ELASTIC_TIMEOUT.default

ROUND_KEY = keys.ELASTIC_ROUND
UPDATES_KEY = keys.ELASTIC_HOST_UPDATES
HOSTS_ADDED = 1
HOSTS_REMOVED = 2

# How often a waiting worker looks at the store.
POLL_S = 0.02
# How long a worker whose round failed to form waits for the driver to say that the round is lost
# (a peer's death reaches the survivors' connections a moment before horarun sees the exit).
LOSS_GRACE_S = 5.0


plan_key = keys.elastic_plan
reset_key = keys.elastic_reset
round_prefix = keys.elastic_round_prefix
arrived_key = keys.elastic_arrived


# ---------------------------------------------------------------- driver side


def publish_round(store: StoreClient, plan: RoundPlan) -> None:
    """Make ``plan`` the newest round (the plan first, then the round number)."""
    store.set_signed(plan_key(plan.number), plan.to_json())
    store.set_signed(ROUND_KEY, str(plan.number).encode())


def reset_requested(store: StoreClient, number: int) -> bool:
    """Whether a worker of round ``number`` asked for a new round (a forged request is
    logged and ignored: it must not burn the job's reset limit)."""
    try:
        return store.marked(reset_key(number))
    except AuthenticationError as exc:
        logger.error("%s", tampering(exc))
        return False


def publish_host_update(store: StoreClient, number: int, flags: int) -> None:
    store.set_signed(UPDATES_KEY, json.dumps({"number": number, "flags": flags}).encode())


# ---------------------------------------------------------------- worker side


def active() -> bool:
    """Whether this process was started by an elastic ``horarun``."""
    return read(ELASTIC) is True


def timeout_s() -> float:
    """``HORA_ELASTIC_TIMEOUT`` (or Horovod's twin) in seconds.

    Raises:
        SettingError: (a ValueError) it is not a number.
    """
    return read(ELASTIC_TIMEOUT)


class WorkerRemoved(SystemExit):
    """This worker is not part of the job's newest round: its host was removed. Exit status 0."""

    def __init__(self, worker_id: str, number: int) -> None:
        super().__init__(0)
        self.message = (
            f"hora elastic: worker {worker_id} is not part of round {number} (its host was "
            "removed from the job); it exits."
        )


def progress() -> RoundProgress:
    """The elastic rounds this process took part in, across ``hvd.init()`` calls (the
    process's runtime keeps them)."""
    return runtime().rounds


def request_reset() -> None:
    """Ask the driver for a new round (this round's collectives failed). Best effort."""
    plan = progress().plan
    if plan is not None:
        try:
            base_store().mark(reset_key(plan.number))
        except Exception:  # the driver also notices exits on its own
            logger.debug("could not ask the elastic driver for a new round", exc_info=True)


def read_host_update(store: StoreClient) -> tuple[int, int]:
    """The driver's latest host-change notice, ``(number, flags)``; ``(0, 0)`` when none."""
    if not store.check(UPDATES_KEY):
        return 0, 0
    body = json.loads(store.get_signed(UPDATES_KEY))
    return int(body["number"]), int(body["flags"])


def base_store() -> StoreClient:
    """The job's store, without any round's prefix."""
    addr = raw(table.RENDEZVOUS_ADDR) or ""
    port = read(table.RENDEZVOUS_PORT) or 0
    secret = raw(table.SECRET_KEY) or ""
    if not addr or not secret:
        raise ValueError(
            f"{ELASTIC_VAR}=1 but {table.RENDEZVOUS_ADDR.env} or {table.SECRET_KEY.env} is not "
            "set: elastic workers must be started by horarun --min-np/--max-np/"
            "--host-discovery-script."
        )
    return StoreClient(addr, port, secret, timeout_s=60.0)


def join(wait_s: float | None = None) -> tuple[Topology, StoreClient]:
    """Wait for a round newer than this process's last one that includes it; meet its workers.

    Returns:
        This worker's topology in the round, and a store client under the round's prefix whose
        waits end once the round is lost, until :func:`formed`.

    Raises:
        WorkerRemoved: the newest round leaves this worker out.
        TimeoutError: no such round formed within ``HORA_ELASTIC_TIMEOUT``.
    """
    worker_id = os.environ.get(WORKER_ID_VAR, "")
    if not worker_id:
        raise ValueError(f"{ELASTIC_VAR}=1 but {WORKER_ID_VAR} is not set.")
    limit = timeout_s() if wait_s is None else wait_s
    base = base_store()
    deadline = time.monotonic() + limit
    joined = progress()
    while True:
        plan = _newest_round(base, joined.last_round, deadline, worker_id)
        assignment = plan.workers.get(worker_id)
        if assignment is None:
            raise WorkerRemoved(worker_id, plan.number)
        store = StoreClient(
            base.addr, base.port, base.secret, base.timeout_s, prefix=round_prefix(plan.number)
        )
        if _gather(base, store, plan, assignment.rank, deadline, worker_id):
            break
        logger.debug("round %d was replaced while its workers gathered", plan.number)
        joined.last_round = plan.number
    joined.last_round = plan.number
    joined.plan = plan
    # Until hvd.init() is done, the others' deaths end its waits on the round's store.
    number = plan.number
    store.end_waits_when(lambda: lost(base, number))
    joined.forming = store
    topology = Topology(
        rank=assignment.rank,
        size=assignment.size,
        local_rank=assignment.local_rank,
        local_size=assignment.local_size,
        cross_rank=assignment.cross_rank,
        cross_size=assignment.cross_size,
        hostname=assignment.hostname,
        rendezvous_addr=base.addr,
        rendezvous_port=base.port,
        secret=base.secret,
        source=f"horarun (elastic, round {plan.number})",
        store_prefix=round_prefix(plan.number),
    )
    return topology, store


def formed() -> None:
    """``hvd.init()`` is done with the round it joined (it formed, or init failed): its store's
    waits no longer end when the round is lost (the engine handles failures from here on)."""
    joined = progress()
    if joined.forming is not None:
        joined.forming.end_waits_when(None)
        joined.forming = None


def lost(base: StoreClient, number: int) -> str:
    """Why round ``number`` cannot form or go on, ``""`` when nothing says so: the failure
    reported in it (the driver records a worker's death there), or the newer round that
    replaced it.

    Args:
        base: the job's store without a round's prefix (not the round's own connection: this
            is called between the slices of that connection's waits).

    Raises:
        AuthenticationError: the round's failure report or the round number was not written
            by this job.
    """
    said = read_failure(base.under(round_prefix(number)))
    if said:
        return said
    newest = _current_round(base)
    if newest > number:
        return f"round {number} was replaced by round {newest}"
    return ""


def round_lost(wait_s: float = LOSS_GRACE_S) -> str:
    """Why the round this process joined last is lost, waiting up to ``wait_s`` for the driver
    to say so; ``""`` when it did not (the round's trouble is something else)."""
    plan = progress().plan
    if plan is None:
        return ""
    base = base_store()
    deadline = time.monotonic() + wait_s
    while True:
        why = lost(base, plan.number)
        if why or time.monotonic() > deadline:
            return why
        time.sleep(POLL_S * 5)


def _current_round(base: StoreClient) -> int:
    if not base.check(ROUND_KEY):
        return -1
    return int(base.get_signed(ROUND_KEY))


def _newest_round(base: StoreClient, after: int, deadline: float, worker_id: str) -> RoundPlan:
    while True:
        number = _current_round(base)
        if number > after:
            return RoundPlan.from_json(base.get_signed(plan_key(number)))
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"hora elastic: worker {worker_id} waited {timeout_s():g} s for the driver to "
                f"form a new round after round {after}. Is horarun still running? Its output "
                "says whether it waits for hosts (see --elastic-timeout)."
            )
        time.sleep(POLL_S)


def _gather(
    base: StoreClient,
    store: StoreClient,
    plan: RoundPlan,
    rank: int,
    deadline: float,
    worker_id: str,
) -> bool:
    """Meet the round's other workers; ``False`` when a newer round replaced it meanwhile."""
    store.mark(arrived_key(rank))
    everyone = [arrived_key(r) for r in range(plan.size)]
    while not store.all_marked(everyone):
        if _current_round(base) > plan.number:
            return False
        if time.monotonic() > deadline:
            missing = [r for r in range(plan.size) if not store.marked(arrived_key(r))]
            names = [w for w in plan.ranked() if plan.workers[w].rank in missing]
            raise TimeoutError(
                f"hora elastic: worker {worker_id} (rank {rank} of round {plan.number}) waited "
                f"{timeout_s():g} s for ranks {missing} ({', '.join(names)}) to join."
            )
        time.sleep(POLL_S)
    return True
