"""How long the steady state's batches wait for their peers, and who hears of a late one.

A rank starts a batch as soon as its own tensors are there and waits inside the allreduce for
ranks still busy elsewhere (evaluating, writing a checkpoint). As a wait in negotiation, that
is no failure, however long: batches get their own timeout, HORA_STALL_SHUTDOWN_TIME_SECONDS
(the job then ends as a stalled one would), or days where that is 0. Dead peers are still
noticed at once (a closed connection, the launcher's record of the exit). Past the stall check
time, a rank that waits records so in the store, and a rank that keeps others waiting reads the
record before it warns, so that a pause on every rank at once is no stall.

This module knows the settings, the store and batches' names; not schedules' buffers, nor when
a batch starts or lands (:mod:`.replay`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from hora.common.engine.timing import PARKED_WAIT_S
from hora.common.job.store import StoreClient
from hora.common.job.store_keys import GenerationKeys
from hora.common.transport import Pending, TransportError
from hora.common.vocabulary.config import Settings
from hora.common.vocabulary.message import Request

logger = logging.getLogger("hora")


def steady_batch_timeout_s(settings: Settings) -> float:
    """The time limit a steady-state batch's allreduce is started with (the longest limit of
    any operation the engine starts)."""
    shutdown_s = settings.stall_limit_s
    return shutdown_s if shutdown_s > 0 else PARKED_WAIT_S


class Waits:
    """The steady state's limits and stall records for one rank.

    Args:
        settings: engine settings.
        rank: this rank.
        store: the job's store (stall records), and ``keys`` its generation's keys.

    Attributes:
        batch_timeout_s: the time limit each batch's allreduce is started with.
        stall_after_s: how long a steady-state wait lasts before it counts as a stall (0: never).
    """

    def __init__(
        self, settings: Settings, rank: int, store: StoreClient, keys: GenerationKeys
    ) -> None:
        self._rank = rank
        self._store = store
        self._keys = keys
        self._shutdown_s = settings.stall_limit_s
        self.batch_timeout_s = steady_batch_timeout_s(settings)
        self.stall_after_s = settings.stall_check_time_s if settings.stall_check_enabled else 0.0

    def wait_for_peers(self, pending: Pending, batch_id: int, batch: list[Request]) -> None:
        """Wait for a batch's allreduce (``batch_id``: its number, the same on every rank) until
        the stall check time; past it, record that this rank waits for it.

        Only a rank that waits inside the batch's allreduce knows that another rank is late;
        the late rank reads the record before it warns (see :meth:`peers_wait`), so that a
        pause on every rank at once, such as an evaluation, is no stall.
        """
        stall_after = self.stall_after_s
        if not stall_after:
            return
        if pending.wait(stall_after):
            return
        shown = name_list([r.name for r in batch])
        try:
            self._store.mark(self._keys.steady_wait(batch_id))
        except Exception as exc:  # a lost store fails the batch on its own
            logger.debug("rank %d could not record its wait: %s", self._rank, exc)
        if self._rank == 0:
            logger.warning(
                "rank 0 has waited %.0f s for other ranks to submit %s (steady state); the ranks "
                "that keep it waiting log which tensors they have not submitted.",
                stall_after,
                shown,
            )

    def peers_wait(self, batch_id: int) -> bool:
        """Whether another rank has recorded that it waits for batch ``batch_id``."""
        try:
            return self._store.marked(self._keys.steady_wait(batch_id))
        except Exception:  # a lost store fails the job elsewhere
            return False

    def error(self, batch: list[Request], exc: TransportError) -> TransportError:
        """Name the batch and the limit when a steady-state batch waited past its timeout."""
        return stalled(self._shutdown_s, [r.name for r in batch], self._rank, exc)


def stalled(limit_s: float, names: Sequence[str], rank: int, exc: TransportError) -> TransportError:
    """``exc``, a wait for ``names`` on ``rank`` that timed out, as a stall that ended the job
    at ``HORA_STALL_SHUTDOWN_TIME_SECONDS`` (``limit_s``; 0: ``exc`` as it is)."""
    if limit_s <= 0 or "timed out" not in str(exc).lower():
        return exc
    return TransportError(
        f"some ranks did not submit {name_list(names)} within HORA_STALL_SHUTDOWN_TIME_SECONDS "
        f"({limit_s:g} s) while rank {rank} waited for them; the job is shut down as stalled "
        f"({exc})"
    )


def name_list(names: Sequence[str]) -> str:
    """Tensor names for a message (the first five)."""
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
