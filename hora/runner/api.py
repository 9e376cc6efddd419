"""``hora.run``: run a Python function on N local worker processes and collect the results.

The function and its arguments travel to the workers through the job's store, signed with the
job secret; results come back the same way. The job (store, secret, supervisor, the workers'
environment) is built by :class:`hora.runner.job.Job`, as ``horarun``'s is.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import cloudpickle

from hora.runner.hosts import assign_slots, parse_hosts
from hora.runner.job import Job
from hora.runner.supervisor import OutputForwarder, Supervisor

FUNCTION_KEY = "run/function"


def result_key(rank: int) -> str:
    return f"run/result/{rank}"


class HoraRunError(RuntimeError):
    """One or more workers of :func:`run` failed.

    Attributes:
        results: the results of the ranks that returned, by rank.
        errors: the error text of the ranks that raised or died, by rank.
    """

    def __init__(self, message: str, results: dict[int, Any], errors: dict[int, str]) -> None:
        super().__init__(message)
        self.results = results
        self.errors = errors


def run(
    fn: Any,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    np: int = 1,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    prefix_output: bool = True,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``np`` processes on this machine.

    Each worker is a fresh Python process with the topology variables set, so ``fn`` calls
    ``hvd.init()`` itself, as a training script would.

    Args:
        fn: a function (closures and lambdas work: it is sent with cloudpickle).
        args: positional arguments for ``fn``.
        kwargs: keyword arguments for ``fn``.
        np: number of worker processes.
        env: extra environment variables for the workers.
        timeout_s: stop the workers and raise ``TimeoutError`` after this long.
        prefix_output: prefix forwarded output lines with ``[rank]<stream>:``.

    Returns:
        The value ``fn`` returned on each rank, in rank order.

    Raises:
        HoraRunError: a worker raised or exited abnormally; the message names the rank.

    Example:
        >>> def work():
        ...     import hora.torch as hvd
        ...     hvd.init()
        ...     return hvd.rank()
        >>> hora.run(work, np=2)
        [0, 1]
    """
    slots = assign_slots(parse_hosts(f"localhost:{np}"), np)
    payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    base = dict(os.environ)
    base.update(env or {})
    command = [sys.executable, "-m", "hora.runner.task"]
    with Job.open(command, base_env=base, forwarder=OutputForwarder(prefix=prefix_output)) as job:
        job.server.client.set_signed(FUNCTION_KEY, payload)
        for slot in slots:
            job.spawn(slot, slot.env())
        codes = job.supervisor.wait(timeout_s)
        results, errors = _collect(job, codes, np)
    if errors:
        summary = "\n".join(f"rank {r}: {text}" for r, text in sorted(errors.items()))
        raise HoraRunError(
            f"hora.run: {len(errors)} of {np} ranks failed.\n{summary}", results, errors
        )
    return [results[r] for r in range(np)]


def _collect(job: Job, codes: dict[int, int], np: int) -> tuple[dict[int, Any], dict[int, str]]:
    """The results of the ranks that returned one, and the error text of the others."""
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    client = job.server.client
    for rank in range(np):
        key = result_key(rank)
        if client.check(key):
            status, value = cloudpickle.loads(client.get_signed(key))
            if status == "ok":
                results[rank] = value
            else:
                errors[rank] = value
        elif codes.get(rank, 0) != 0:
            errors[rank] = _exit_text(job.supervisor, rank, codes[rank])
        else:
            errors[rank] = f"rank {rank} exited without returning a result"
    return results, errors


def _exit_text(supervisor: Supervisor, rank: int, code: int) -> str:
    from hora.runner.supervisor import describe_exit

    worker = supervisor.workers[rank]
    tail = "\n".join(f"    {line}" for line in worker.stderr_tail)
    return f"the process {describe_exit(code)}" + (f"; last stderr lines:\n{tail}" if tail else "")
