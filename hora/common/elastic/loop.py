"""``hvd.elastic.run``: run a training function again after every change of the job.

The wrapper's loop, in an elastic worker (``horarun --min-np/--max-np/--host-discovery-script``
sets ``HORA_ELASTIC=1``)::

    while True:
        state.sync()                        # everyone takes rank 0's state
        return func(state, *args, **kwargs)
      on HoraInternalError:                 # a collective failed (a peer died, ...)
        state.restore()                     # back to the last commit
        ask the driver for a new round      # in case no process died (a network fault)
      on HostsUpdatedInterrupt:             # hosts were added or removed
        state.save()                        # keep the (consistent) progress since the commit
      hvd.shutdown(); hvd.init()            # join the next round (WorkerRemoved: exit 0)
      state.on_reset()                      # state.reset(), then the reset callbacks
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from hora.common import basics
from hora.common.elastic.job import job
from hora.common.runtime import runtime
from hora.common.vocabulary.errors import HoraInternalError, HostsUpdatedInterrupt

logger = logging.getLogger("hora")

F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")


class Resumable(Protocol):
    """What the loop does with a state (:class:`~hora.common.elastic.state.State` has it all)."""

    def sync(self) -> None:
        """Make every rank's state rank 0's."""

    def save(self) -> None:
        """Keep the current state as the one to go back to."""

    def restore(self) -> None:
        """Go back to the last saved state."""

    def on_reset(self) -> None:
        """The job re-formed."""


def reset_count() -> int:
    """How many times ``hvd.elastic.run`` has re-formed the job in this process."""
    return runtime().elastic_resets


def round_number() -> int:
    """The number of the elastic job's current round: 0 for the first, one more at every change.

    The driver numbers rounds for the whole job, so every worker of a round sees the same
    number, a worker that joins later included. Outside an elastic job, and in a job that was
    started again (after every worker was lost), it starts from 0.

    Example:
        >>> if hvd.elastic.round_number() == 0:
        ...     print("the job as it was launched")
    """
    plan = job().current_round()
    return plan.number if plan is not None else 0


def _reset() -> None:
    """Leave the current round and join the next one (``hvd.shutdown(); hvd.init()``)."""
    job().rejoin()


def _progress_of(state: object) -> str:
    saved = getattr(state, "_saved_state", None)
    if not isinstance(saved, dict):
        return ""
    shown = [f"{key}={saved[key]!r}" for key in ("epoch", "batch") if key in saved]
    return f" ({', '.join(shown)})" if shown else ""


def run(func: F) -> F:
    """Decorator: run ``func(state, *args, **kwargs)`` until it returns, surviving resets.

    In an elastic job the wrapper synchronizes ``state`` from rank 0 and calls ``func``. When a
    collective fails (``HoraInternalError``, alias ``HorovodInternalError``) it restores the
    last commit, tells the driver, and joins the job's next round; when
    :meth:`State.check_host_updates` raises ``HostsUpdatedInterrupt`` it keeps the current
    progress (saves it) and joins the next round. Either way it calls ``state.on_reset()`` and
    starts over: sync, then ``func``. A worker whose host was removed from the job leaves with
    exit status 0 (``hora.common.job.rounds.WorkerRemoved``, a ``SystemExit``, propagates).

    Differences from Horovod:

    * hora always synchronizes after a reset. ``HostsUpdatedInterrupt.skip_sync`` is still set
      (``True`` when hosts were only removed) but ignored: skipping the sync deadlocked Horovod
      when workers that skipped met new workers that did not (Horovod issue #3494).
    * After a ``HostsUpdatedInterrupt`` the state is saved before the reset, so the plain
      attributes (``epoch``, ``batch``) stay consistent with the model and sampler, which
      Horovod also keeps at their current values. (All ranks raise it at the same collective,
      so all hold the same state.)

    Outside an elastic job (a static ``horarun``, ``hora.run``, any other launcher) the
    wrapper calls ``state.sync()`` and then ``func`` once; errors propagate unchanged.

    Rule (Horovod's): call no collective (``broadcast_parameters``, ``allreduce``, ...)
    between ``hvd.init()`` and the decorated function. A worker that joins a running job
    starts in the function's ``state.sync()``, where the other workers are; a collective of
    its own before that would wait for partners that never come. Put such work inside the
    function. (hora re-numbers unnamed collectives at every reset, so ``hvd.allreduce(x)``
    and ``hvd.broadcast_object(obj)`` without a name do match between old and new workers
    inside the function.)

    hora warns (on the ``hora`` logger) when this process ran collectives before it first
    entered an elastic function.

    Each reset is counted (:func:`reset_count`) and logged at INFO on the ``hora`` logger
    (``HORA_LOG_LEVEL=info`` shows it).

    Example:
        >>> @hvd.elastic.run
        ... def train(state):
        ...     for state.epoch in range(state.epoch, epochs):
        ...         ...
        ...         state.commit()
        >>> train(hvd.elastic.TorchState(model, optimizer, epoch=0))
    """
    return run_fn(func, _reset)


def run_fn(func: F, reset: Callable[[], None]) -> F:
    """:func:`run` with a reset of the caller's own: Horovod's ``horovod.common.elastic.run_fn``.

    Between two rounds the loop calls ``reset()`` where :func:`run` calls
    ``hvd.shutdown(); hvd.init()``; a framework adapter passes one that also resets its own
    objects. ``reset`` calls ``hvd.shutdown()`` and ``hvd.init()`` itself: it must leave hora
    initialized in the job's next round.

    Args:
        func: the training function, ``func(state, *args, **kwargs)``.
        reset: called, without arguments, to leave a round and join the next one.

    Returns:
        The wrapped function.

    Example:
        >>> def reset():
        ...     hvd.shutdown()
        ...     hvd.init()
        >>> train = hora.common.elastic.run_fn(train, reset)
    """

    @functools.wraps(func)
    def wrapper(state: Resumable, *args: object, **kwargs: object) -> object:
        if not job().active():
            state.sync()
            return func(state, *args, **kwargs)
        return _elastic_loop(func, state, args, kwargs, reset)

    return wrapper  # type: ignore[return-value]


def _check_no_early_collectives() -> None:
    """Warn when collectives ran before the first elastic function (Horovod's rule)."""
    state = runtime()
    if state.elastic_entered:
        return
    state.elastic_entered = True
    current = state.session
    early = current.engine.handles_made if current is not None else 0
    if early:
        logger.warning(
            "hora elastic: %d collective operation(s) ran before the first hvd.elastic.run "
            "function. A worker that joins the job later starts in that function's "
            "state.sync(), and will not run them with the others: the job would hang. Move "
            "them into the function (or into State.sync).",
            early,
        )


def _elastic_loop(
    func: Callable[..., R],
    state: Resumable,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    reset: Callable[[], None],
) -> R:
    _check_no_early_collectives()
    must_reset = False
    cause = ""
    while True:
        joining = False
        try:
            if must_reset:
                joining = True
                reset()
                joining = False
                state.on_reset()
                runtime().elastic_resets += 1
                must_reset = False
                _log_reset(state, cause)
            state.sync()
            return func(state, *args, **kwargs)
        except HoraInternalError as exc:
            # The round is lost. Roll back to the last commit (every surviving rank holds one;
            # rank 0's is what everyone syncs to) and tell the driver, which may not know yet.
            logger.debug("elastic: a collective failed: %s", exc)
            if not joining:
                state.restore()
            # else joining the next round failed although the round was not lost (hvd.init()
            # itself joins the round after a lost one): the state was already rolled back, or
            # saved, before that reset, and hora is not running to restore with.
            job().request_reset()
            cause = "a failed collective; resuming from the last commit"
        except HostsUpdatedInterrupt:
            state.save()
            cause = "a change of hosts; resuming where the job was"
        must_reset = True


def _log_reset(state: object, cause: str) -> None:
    plan = job().current_round()
    round_number = plan.number if plan is not None else -1
    rank = basics.rank() if basics.is_initialized() else -1
    logger.info(
        "rank %d: round %d: reset %d after %s%s",
        rank,
        round_number,
        runtime().elastic_resets,
        cause,
        _progress_of(state),
    )
