"""Worker side of ``hora.run``: fetch the function from the job's store, run it, post the outcome.

Every worker runs ``python -m hora.runner.task`` (with the job's ``executable``) and finds the
store in one of three ways, one per driver of :mod:`hora.runner.api`:

* a static job's worker (``horarun``'s variables): the store and its rank from the topology;
  the outcome goes under its rank;
* an elastic job's worker: the job's store without a round's prefix; its rank changes from round
  to round, so the outcome goes under its worker id (``host:slot``) with the round and rank it
  last trained in, and the launcher keeps those of the final round. A worker that the newest
  round leaves out (its host was removed) posts nothing and exits with status 0;
* under ``mpirun`` (``--mpi``): rank 0 reads the store's address and secret from its standard
  input (``mpirun`` forwards it to rank 0 alone) and sends them to the other ranks over MPI, so
  the secret is on no command line and in no environment; the outcome goes under the MPI rank.

The function, its arguments and the outcomes are signed with the job secret; a value that fails
the check is never unpickled.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

import cloudpickle

MPI_FLAG = "--mpi"


def main(argv: list[str] | None = None) -> int:
    from hora.common.job.rounds import active

    arguments = sys.argv[1:] if argv is None else argv
    if arguments == [MPI_FLAG]:
        return _run_under_mpi()
    if active():
        return _run_elastic()
    return _run_static()


def _run_static() -> int:
    from hora.common.job.store import StoreClient
    from hora.common.job.topology import detect
    from hora.common.vocabulary.config import start_timeout_s
    from hora.runner.api import result_key

    topology = detect()
    store = StoreClient(
        topology.rendezvous_addr,
        topology.rendezvous_port,
        topology.secret,
        start_timeout_s(),
    )
    where = f"rank {topology.rank}, host {topology.hostname}"
    call = _load(store, where)
    if call is None:
        return 1
    code, blob = _call(*call)
    store.set_signed(result_key(topology.rank), blob)
    _shut_down()
    return code


def _run_elastic() -> int:
    import os

    from hora.common.job.rounds import WORKER_ID_VAR, WorkerRemoved, base_store, progress
    from hora.runner.api import worker_result_key

    worker_id = os.environ.get(WORKER_ID_VAR, "")
    store = base_store()
    call = _load(store, f"worker {worker_id}")
    if call is None:
        return 1
    try:
        code, blob = _call(*call)
    except WorkerRemoved as removed:
        print(removed.message, file=sys.stderr, flush=True)
        return 0
    plan = progress().plan
    # The round and rank this worker last trained in; none when the function never called
    # hvd.init() (the launcher then matches the worker id against the final round).
    round_number = -1 if plan is None else plan.number
    rank = -1 if plan is None else plan.workers[worker_id].rank
    store.set_signed(worker_result_key(worker_id), cloudpickle.dumps((round_number, rank, blob)))
    _shut_down()
    return code


def _run_under_mpi() -> int:
    from mpi4py import MPI

    from hora.common.job.store import StoreClient
    from hora.common.vocabulary.config import start_timeout_s
    from hora.runner.api import result_key

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    line = sys.stdin.readline().split() if rank == 0 else None
    addr, port, secret = world.bcast(line, root=0)
    store = StoreClient(addr, int(port), secret, start_timeout_s())
    call = _load(store, f"MPI rank {rank}, host {MPI.Get_processor_name()}")
    if call is None:
        return 1
    code, blob = _call(*call)
    store.set_signed(result_key(rank), blob)
    _shut_down()
    return code


def _load(store: Any, where: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]] | None:
    """The function and its arguments; ``None`` (after saying why) when the value in the store
    is not the job's."""
    from hora.common.job.store import AuthenticationError
    from hora.runner.api import FUNCTION_KEY

    try:
        payload = store.get_signed(FUNCTION_KEY)
    except AuthenticationError as exc:
        print(f"hora.run worker ({where}): {exc}. The function was not loaded.", file=sys.stderr)
        return None
    fn, args, kwargs = cloudpickle.loads(payload)
    return fn, args, kwargs


def _call(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, bytes]:
    """Run the function; the exit status and the pickled outcome, ``("ok", value)`` or
    ``("error", text)``.

    Raises:
        WorkerRemoved: an elastic job's newest round leaves this worker out.
    """
    from hora.common.job.rounds import WorkerRemoved

    try:
        outcome = ("ok", fn(*args, **kwargs))
        code = 0
    except WorkerRemoved:
        raise
    except BaseException as exc:  # reported to the caller with the traceback
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        print(text, file=sys.stderr, end="")
        outcome = ("error", f"{type(exc).__name__}: {exc}\n{text}")
        code = 1
    try:
        return code, cloudpickle.dumps(outcome)
    except Exception as exc:
        return 1, cloudpickle.dumps(("error", f"the result could not be pickled: {exc}"))


def _shut_down() -> None:
    try:
        from hora.common.startup.lifecycle import shutdown

        shutdown()
    except Exception:  # the outcome is already posted
        pass


if __name__ == "__main__":
    sys.exit(main())
