"""``op=hvd.Adasum`` on real processes: allreduce, grouped allreduce and DistributedOptimizer
against the same tree computed in one process, and Horovod's constraints as clear errors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hora.common.engine import adasum

from .jobs import assert_raised, error_of, run_job
from .references import rank_input

# Tensors of a fused batch: lengths below, at and above the number of ranks, odd and even.
LENGTHS = (1, 3, 4, 17, 1000)
DTYPES = (torch.float32, torch.float64, torch.float16)
TOLERANCE = {
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
}


def _input(rank: int, name: str, length: int, dtype: torch.dtype) -> torch.Tensor:
    if name.endswith(".zero") and rank == 0:
        return torch.zeros(length, dtype=dtype)  # a zero gradient keeps its factor at 1
    return rank_input(rank, name, (length,), dtype)


def _expected(size: int, names: list[str], lengths: list[int], dtype: torch.dtype) -> torch.Tensor:
    vectors = [
        torch.cat([_input(r, n, k, dtype).double() for n, k in zip(names, lengths)])
        for r in range(size)
    ]
    return adasum.reference(vectors, lengths)


def _adasum_worker() -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    hvd.init()
    rank = hvd.rank()
    out: dict[str, Any] = {}
    for dtype in DTYPES:
        label = str(dtype).removeprefix("torch.")
        names = [f"{label}.{k}" for k in LENGTHS] + [f"{label}.zero"]
        tensors = [_input(rank, n, k, dtype) for n, k in zip(names, [*LENGTHS, 5])]
        out[f"single.{label}"] = hvd.allreduce(tensors[3], op=hvd.Adasum, name=names[3])
        out[f"grouped.{label}"] = hvd.grouped_allreduce(tensors, op=hvd.Adasum)
        # Async calls of one cycle are fused into one buffer: each tensor keeps its factors.
        handles = [
            hvd.allreduce_async(t, op=hvd.Adasum, name=f"async.{n}") for n, t in zip(names, tensors)
        ]
        out[f"fused.{label}"] = [hvd.synchronize(h) for h in handles]
    scaled = _input(rank, "scaled", 8, torch.float64)
    out["scaled"] = hvd.allreduce(scaled, op=hvd.Adasum, prescale_factor=0.5, postscale_factor=3)
    hvd.shutdown()
    return out


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda np: f"np{np}")
def job(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    np = request.param
    return np, run_job(_adasum_worker, np)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert actual.dtype == dtype, what
    torch.testing.assert_close(actual.double(), expected, **TOLERANCE[dtype], msg=what)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allreduce_matches_the_adasum_tree_of_one_process(job: Any, dtype: torch.dtype) -> None:
    np, ranks = job
    label = str(dtype).removeprefix("torch.")
    names = [f"{label}.{k}" for k in LENGTHS] + [f"{label}.zero"]
    lengths = [*LENGTHS, 5]
    expected = _expected(np, names, lengths, dtype)
    pieces = list(expected.split(lengths))
    for rank, observed in enumerate(ranks):
        single = _expected(np, [names[3]], [lengths[3]], dtype)
        _close(observed[f"single.{label}"], single, dtype, f"rank {rank} single")
        for form in ("grouped", "fused"):
            for name, result, want in zip(names, observed[f"{form}.{label}"], pieces):
                _close(result, want, dtype, f"rank {rank} {form} {name}")


@pytest.mark.timeout(180)
def test_every_rank_gets_the_same_bits(job: Any) -> None:
    _, ranks = job
    for observed in ranks[1:]:
        for a, b in zip(observed["grouped.float32"], ranks[0]["grouped.float32"]):
            assert torch.equal(a, b)


@pytest.mark.timeout(180)
def test_scale_factors_apply_before_and_after(job: Any) -> None:
    np, ranks = job
    vectors = [_input(r, "scaled", 8, torch.float64) * 0.5 for r in range(np)]
    expected = adasum.reference(vectors, [8]) * 3
    for observed in ranks:
        _close(observed["scaled"], expected, torch.float64, "scaled")


def test_orthogonal_gradients_add_and_parallel_ones_average() -> None:
    orthogonal = [torch.eye(4, dtype=torch.float64)[r] for r in range(4)]
    assert torch.equal(adasum.reference(orthogonal, [4]), torch.ones(4, dtype=torch.float64))
    parallel = [torch.full((3,), 2.0, dtype=torch.float64) for _ in range(4)]
    assert torch.equal(adasum.reference(parallel, [3]), parallel[0])


def _constraints_worker() -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    pair = hvd.ProcessSet([0])
    hvd.init(process_sets=[pair])
    out: dict[str, Any] = {
        "allreduce": error_of(lambda: hvd.allreduce(torch.ones(4), op=hvd.Adasum)),
        "optimizer": error_of(
            lambda: hvd.DistributedOptimizer(
                torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), op=hvd.Adasum
            )
        ),
        "integers": error_of(
            lambda: hvd.allreduce(torch.ones(4, dtype=torch.int32), op=hvd.Adasum)
        ),
        "reducescatter": error_of(lambda: hvd.reducescatter(torch.ones(4), op=hvd.Adasum)),
    }
    if pair.included():
        out["process_set"] = error_of(
            lambda: hvd.allreduce(torch.ones(4), op=hvd.Adasum, process_set=pair)
        )
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_horovods_constraints_are_clear_errors(np: int) -> None:
    ranks = run_job(_constraints_worker, np)
    for observed in ranks:
        if np == 3:
            for case in ("allreduce", "optimizer"):
                assert_raised(observed[case], NotImplementedError, "non-power of 2", "3 ranks")
        else:
            assert observed["allreduce"] is None and observed["optimizer"] is None
        assert_raised(observed["reducescatter"], RuntimeError, "only supports AVERAGE and SUM")
    for observed in ranks[:1]:
        if np == 2:
            assert_raised(observed["integers"], ValueError, "floating-point tensors only")
            assert_raised(observed["process_set"], NotImplementedError, "non-global process set")


STEPS = 3


def _model() -> torch.nn.ModuleList:
    torch.manual_seed(7)
    # The last layer is not used (see _loss): it gets no gradient, yet every rank submits it.
    layers = [torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2), torch.nn.Linear(2, 2)]
    return torch.nn.ModuleList(layers)


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def _loss(model: torch.nn.ModuleList, rank: int, step: int) -> torch.Tensor:
    x = rank_input(rank, f"x.{step}", (6, 4))
    y = rank_input(rank, f"y.{step}", (6, 2))
    return torch.nn.functional.mse_loss(model[2](model[1](model[0](x))), y)


def _optimizer_worker(kind: str) -> list[torch.Tensor]:
    import hora.torch as hvd

    hvd.init()
    model = _model()
    optimizer = hvd.DistributedOptimizer(
        _optimizer(kind, model.parameters()),
        named_parameters=model.named_parameters(),
        op=hvd.Adasum,
    )
    for step in range(STEPS):
        optimizer.zero_grad()
        _loss(model, hvd.rank(), step).backward()
        optimizer.step()
    hvd.shutdown()
    return [p.detach().clone() for p in model.parameters()]


def _one_process(kind: str, size: int) -> list[torch.Tensor]:
    """Every rank's optimizer steps on its own gradient from the shared weights; the updates
    are combined per parameter by the Adasum tree; every rank keeps its own optimizer state."""
    shared = [p.detach().clone() for p in _model().parameters()]
    replicas = [_model() for _ in range(size)]
    optimizers = [_optimizer(kind, m.parameters()) for m in replicas]
    for step in range(STEPS):
        deltas = []
        for rank, (model, optimizer) in enumerate(zip(replicas, optimizers)):
            with torch.no_grad():
                for p, value in zip(model.parameters(), shared):
                    p.copy_(value)
            optimizer.zero_grad()
            _loss(model, rank, step).backward()
            optimizer.step()
            deltas.append([p.detach() - s for p, s in zip(model.parameters(), shared)])
        for i, value in enumerate(shared):
            combined = adasum.reference(
                [d[i].reshape(-1).double() for d in deltas], [value.numel()]
            )
            value += combined.reshape(value.shape).to(value.dtype)
    return shared


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np", [2, 4])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_distributed_optimizer_combines_each_ranks_update(np: int, kind: str) -> None:
    ranks = run_job(_optimizer_worker, np, kind)
    expected = _one_process(kind, np)
    for rank, params in enumerate(ranks):
        for got, want in zip(params, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")
        for got, first in zip(params, ranks[0]):
            assert torch.equal(got, first)
