"""Submission order and volume: ranks submit named ops in different orders, and hundreds of small
async allreduces at once, repeatedly (fusion and the response cache at work).

The job runs twice inside each worker: with default settings, then, after ``shutdown`` and a
second ``init``, with a response cache smaller than the number of names and a tiny fusion
threshold, so cache eviction and unfused execution are exercised too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from .jobs import run_job
from .references import all_inputs, assert_same, expected_allreduce, rank_input

OUT_OF_ORDER = {
    "a": ((3,), torch.float32),
    "b": ((2, 5), torch.float64),
    "c": ((7,), torch.int32),
}
MANY = 200
ITERATIONS = 3
MANY_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)
SMALL_SETTINGS = {"HORA_CACHE_CAPACITY": "16", "HORA_FUSION_THRESHOLD": "64"}


def _submission_order(rank: int) -> list[str]:
    """Rank 0: a, b, c; rank 1: c, b, a; rank 2: b, c, a."""
    return [["a", "b", "c"], ["c", "b", "a"], ["b", "c", "a"]][rank % 3]


def _many_spec(index: int) -> tuple[tuple[int, ...], torch.dtype, str]:
    return (1 + index % 7,), MANY_DTYPES[index % len(MANY_DTYPES)], ("Sum", "Max")[index % 2]


def _many_key(phase: str, iteration: int, index: int) -> str:
    return f"many.{phase}.{iteration}.{index}"


def _phase(hvd: Any, rank: int, phase: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    handles = {}
    for name in _submission_order(rank):
        shape, dtype = OUT_OF_ORDER[name]
        handles[name] = hvd.allreduce_async(
            rank_input(rank, f"{phase}.{name}", shape, dtype), name=f"{phase}.{name}", op=hvd.Sum
        )
    out["out_of_order"] = {name: hvd.synchronize(handle) for name, handle in handles.items()}
    # The same names every iteration (cache hits after the first), new values each time.
    for iteration in range(ITERATIONS):
        handles = {}
        for index in range(MANY):
            shape, dtype, op = _many_spec(index)
            key = _many_key(phase, iteration, index)
            handles[key] = hvd.allreduce_async(
                rank_input(rank, key, shape, dtype), name=f"many.{index}", op=getattr(hvd, op)
            )
        out.update({key: hvd.synchronize(handle) for key, handle in handles.items()})
    return out


def _ordering_worker() -> dict[str, Any]:
    import os

    import hora.torch as hvd

    hvd.init()
    rank = hvd.rank()
    out = {"default": _phase(hvd, rank, "default")}
    hvd.shutdown()
    os.environ.update(SMALL_SETTINGS)
    hvd.init()
    out["small"] = _phase(hvd, rank, "small")
    hvd.shutdown()
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda np: f"np{np}")
def job(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    np = request.param
    return np, run_job(_ordering_worker, np)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", ["default", "small"])
def test_ops_submitted_in_different_orders_all_complete(job: Any, phase: str) -> None:
    np, ranks = job
    for rank, observed in enumerate(ranks):
        results = observed[phase]["out_of_order"]
        for name, (shape, dtype) in OUT_OF_ORDER.items():
            expected = expected_allreduce(all_inputs(np, f"{phase}.{name}", shape, dtype), "Sum")
            assert_same(results[name], expected, f"rank {rank} {name}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", ["default", "small"])
def test_many_small_async_allreduces_repeated(job: Any, phase: str) -> None:
    np, ranks = job
    for iteration in range(ITERATIONS):
        for index in range(MANY):
            shape, dtype, op = _many_spec(index)
            key = _many_key(phase, iteration, index)
            expected = expected_allreduce(all_inputs(np, key, shape, dtype), op)
            for rank, observed in enumerate(ranks):
                assert_same(observed[phase][key], expected, f"rank {rank} {key}")
