"""What ``hora.run`` and its workers leave for each other in the job's store.

The call goes one way: :func:`pickled_call` pickles the function and its arguments with
cloudpickle, keeping the file name of the code it sends by value, and the launcher posts it
under :data:`FUNCTION_KEY` (signed with the job secret) for :mod:`hora.runner.task` to load. The
outcomes come back: each rank of a static or MPI job posts ``("ok", value)`` or ``("error",
text)`` under :func:`result_key`, each worker of an elastic job under :func:`worker_result_key`
with the round it ran in; :func:`collect` and :func:`collect_round` read them back, by rank, as
the results of the ranks that returned and the error text of the others.

This module knows the store's keys and the pickles; it does not start, plan or watch a job, nor
decide what a failure raises (:mod:`hora.runner.api` does).
"""

from __future__ import annotations

import io
import types
from collections import ChainMap
from collections.abc import Callable
from typing import Any

import cloudpickle

from hora.common.job.rounds import ROUND_KEY, RoundPlan, plan_key
from hora.common.job.store import StoreClient

FUNCTION_KEY = "run/function"


def result_key(rank: int) -> str:
    """Where a static job's (or an MPI job's) rank posts its outcome."""
    return f"run/result/{rank}"


def worker_result_key(worker_id: str) -> str:
    """Where an elastic job's worker (``host:slot``) posts its outcome, with its round and
    rank."""
    return f"run/result/worker/{worker_id}"


def pickled_call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """The function and its arguments as the workers load them: cloudpickle's pickle, with the
    file name of every code object it sends by value kept.

    cloudpickle names such code ``<dynamic-code>`` (a function of ``__main__``, of a notebook,
    or of a module registered with ``register_pickle_by_value``), so a worker's traceback would
    not say where the failing line is; with the name kept it shows the user's file and line
    (and the line's text, where the file is there too).
    """
    with io.BytesIO() as file:
        _CallPickler(file).dump((func, args, kwargs))
        return file.getvalue()


# How cloudpickle pickles a code object: a constructor and its arguments (without the file name).
_reduce_code = cloudpickle.Pickler.dispatch_table[types.CodeType]


def _code_keeping_file(code: types.CodeType) -> tuple[Any, ...]:
    build, arguments = _reduce_code(code)
    return _code_with_file, (build, arguments, code.co_filename)


def _code_with_file(build: Any, arguments: tuple[Any, ...], filename: str) -> types.CodeType:
    """A code object as cloudpickle builds it, with its file name back (runs on the worker)."""
    code: types.CodeType = build(*arguments)
    return code.replace(co_filename=filename)


class _CallPickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle is untyped
    dispatch_table = ChainMap(
        {types.CodeType: _code_keeping_file}, cloudpickle.Pickler.dispatch_table
    )


def final_round(client: StoreClient) -> RoundPlan | None:
    """The newest round the driver published (``None``: none formed)."""
    if not client.check(ROUND_KEY):
        return None
    number = int(client.get_signed(ROUND_KEY))
    return RoundPlan.from_json(client.get_signed(plan_key(number)))


def collect_round(
    client: StoreClient, final: RoundPlan | None
) -> tuple[dict[int, Any], dict[int, str]]:
    """The outcomes the final round's workers posted, by their rank in it."""
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    if final is None:
        return results, errors
    for worker_id in final.ranked():
        rank = final.workers[worker_id].rank
        key = worker_result_key(worker_id)
        posted = cloudpickle.loads(client.get_signed(key)) if client.check(key) else None
        # A worker that never called hvd.init() posts round -1: it is matched by its id.
        if posted is None or posted[0] not in (final.number, -1):
            errors[rank] = f"worker {worker_id} ended without a result in round {final.number}"
            continue
        status, value = cloudpickle.loads(posted[2])
        if status == "ok":
            results[rank] = value
        else:
            errors[rank] = value
    return results, errors


def collect(
    client: StoreClient, ranks: range, missing: Callable[[int], str]
) -> tuple[dict[int, Any], dict[int, str]]:
    """The results of the ranks that posted one, and the error text of the others."""
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    for rank in ranks:
        key = result_key(rank)
        if client.check(key):
            status, value = cloudpickle.loads(client.get_signed(key))
            if status == "ok":
                results[rank] = value
            else:
                errors[rank] = value
        else:
            errors[rank] = missing(rank)
    return results, errors
