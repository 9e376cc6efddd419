"""Horovod's ``horovod.torch.mpi_ops`` autograd ``Function`` classes on real processes, reached
as ``hvd.mpi_ops`` (no import of their own), with Horovod's ``apply`` argument order.

One job per world size runs every call with a backward pass; each rank feeds its own upstream
gradient, so a gradient that is not reduced across ranks shows. The tests compare each result
and gradient with references rebuilt here from every rank's inputs, and with what hora's public
(differentiable) collective gave for the same inputs in the same job.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from .jobs import run_job

F64 = torch.float64


def _upstream(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The gradient rank ``rank`` sends back into a result of ``shape``: differs by rank."""
    count = 1
    for n in shape:
        count *= n
    return (torch.arange(count, dtype=F64) + 1).reshape(shape) * (rank + 1)


def _input(rank: int, shape: tuple[int, ...], offset: float = 0.0) -> torch.Tensor:
    return _upstream(rank, shape) * 0.5 - offset


def _set_members(size: int) -> list[int]:
    """A process set that is not the whole job: rank 0 and the last rank, or the last alone."""
    return [0, size - 1] if size > 2 else [size - 1]


def _grad_of(apply: Any, x: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply(leaf)`` and the leaf's gradient under this rank's upstream gradient."""
    leaf = x.clone().requires_grad_()
    y = apply(leaf)
    (y * _upstream(rank, tuple(y.shape))).sum().backward()
    assert leaf.grad is not None
    return y.detach(), leaf.grad


def _functions_worker() -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    hvd.init(process_sets="dynamic")
    rank, size = hvd.rank(), hvd.size()
    m = hvd.mpi_ops  # no `import hora.torch.mpi_ops`: as in Horovod, the package has it
    ps = hvd.global_process_set
    out: dict[str, Any] = {}

    def both(name: str, ours: Any, public: Any, x: torch.Tensor) -> None:
        out[name] = _grad_of(ours, x, rank)
        out[f"{name}.public"] = _grad_of(public, x, rank)

    x = _input(rank, (3,))
    both(
        "allreduce",
        lambda t: m.HorovodAllreduce.apply(t, None, "imp.allreduce", hvd.Sum, 1.0, 1.0, ps),
        lambda t: hvd.allreduce(t, name="imp.allreduce.public", op=hvd.Sum),
        x,
    )
    both(
        "allreduce.scaled",
        lambda t: m.HorovodAllreduce.apply(t, None, "imp.scaled", hvd.Average, 2.0, 0.25, ps),
        lambda t: hvd.allreduce(
            t, name="imp.scaled.public", prescale_factor=2.0, postscale_factor=0.25
        ),
        x,
    )
    rows = _input(rank, (rank + 1, 2))  # uneven first dimensions
    both(
        "allgather",
        lambda t: m.HorovodAllgather.apply(t, "imp.allgather", ps),
        lambda t: hvd.allgather(t, name="imp.allgather.public"),
        rows,
    )
    both(
        "broadcast",
        lambda t: m.HorovodBroadcast.apply(t, size - 1, "imp.broadcast", ps),
        lambda t: hvd.broadcast(t, size - 1, name="imp.broadcast.public"),
        x,
    )
    both(
        "reducescatter",
        lambda t: m.HorovodReducescatter.apply(t, "imp.reducescatter", hvd.Sum, ps, 1.0, 1.0),
        lambda t: hvd.reducescatter(t, name="imp.reducescatter.public", op=hvd.Sum),
        _input(rank, (2 * size + 1, 2)),
    )
    splits = [(rank + dest) % 2 + 1 for dest in range(size)]
    both(
        "alltoall",
        lambda t: m.HorovodAlltoall.apply(t, torch.tensor(splits), "imp.alltoall", ps)[0],
        lambda t: hvd.alltoall(t, torch.tensor(splits), name="imp.alltoall.public")[0],
        _input(rank, (sum(splits), 2)),
    )

    # Grouped forms: one call, a tuple of results, a gradient for each input.
    a = _input(rank, (2,)).requires_grad_()
    b = _input(rank, (rank + 1, 3)).requires_grad_()  # gathered only: its rows differ by rank
    c = _input(rank, (2, 3)).requires_grad_()  # reduced only
    reduced = m.HorovodGroupedAllreduce.apply(None, "imp.grouped", hvd.Sum, 1.0, 1.0, ps, a, c)
    gathered = m.HorovodGroupedAllgather.apply("imp.grouped_allgather", ps, a, b)
    total = sum((y * _upstream(rank, tuple(y.shape))).sum() for y in (*reduced, *gathered))
    total.backward()
    out["grouped"] = {
        "reduced": [y.detach() for y in reduced],
        "gathered": [y.detach() for y in gathered],
        "grads": [a.grad, b.grad, c.grad],
    }

    # A process set without rank 1; the gradient's rows are those of the rank within the set.
    edges = hvd.add_process_set(_set_members(size))
    if edges.included():
        out["set.allgather"] = _grad_of(
            lambda t: m.HorovodAllgather.apply(t, "imp.set.allgather", edges), rows, rank
        )
    hvd.barrier()
    hvd.remove_process_set(edges)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def job(request: pytest.FixtureRequest) -> dict[str, Any]:
    size = request.param
    return {"size": size, "ranks": run_job(_functions_worker, size)}


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _check_against_public(job: dict[str, Any], name: str) -> None:
    for observed in job["ranks"]:
        ours, public = observed[name], observed[f"{name}.public"]
        _same(ours[0], public[0])
        _same(ours[1], public[1])


@pytest.mark.timeout(120)
def test_allreduce_function_sums_and_reduces_the_gradient(job: dict[str, Any]) -> None:
    size = job["size"]
    expected = sum(_input(r, (3,)) for r in range(size))
    expected_grad = sum(_upstream(r, (3,)) for r in range(size))
    for observed in job["ranks"]:
        result, grad = observed["allreduce"]
        _same(result, expected)
        _same(grad, expected_grad)
    _check_against_public(job, "allreduce")


@pytest.mark.timeout(120)
def test_allreduce_function_applies_both_scale_factors_twice(job: dict[str, Any]) -> None:
    size = job["size"]
    mean = sum(_input(r, (3,)) for r in range(size)) / size
    mean_grad = sum(_upstream(r, (3,)) for r in range(size)) / size
    for observed in job["ranks"]:
        result, grad = observed["allreduce.scaled"]
        _same(result, mean * 0.5)
        _same(grad, mean_grad * 0.5)
    _check_against_public(job, "allreduce.scaled")


@pytest.mark.timeout(120)
def test_allgather_function_gives_each_rank_its_rows_of_the_averaged_gradient(
    job: dict[str, Any],
) -> None:
    size = job["size"]
    gathered = torch.cat([_input(r, (r + 1, 2)) for r in range(size)])
    rows = gathered.shape[0]
    averaged = sum(_upstream(r, (rows, 2)) for r in range(size)) / size
    for rank, observed in enumerate(job["ranks"]):
        result, grad = observed["allgather"]
        _same(result, gathered)
        start = sum(r + 1 for r in range(rank))
        _same(grad, averaged[start : start + rank + 1])
    _check_against_public(job, "allgather")


@pytest.mark.timeout(120)
def test_broadcast_function_sends_the_gradient_to_the_root_only(job: dict[str, Any]) -> None:
    size = job["size"]
    root = size - 1
    averaged = sum(_upstream(r, (3,)) for r in range(size)) / size
    for rank, observed in enumerate(job["ranks"]):
        result, grad = observed["broadcast"]
        _same(result, _input(root, (3,)))
        _same(grad, averaged if rank == root else torch.zeros(3, dtype=F64))
    _check_against_public(job, "broadcast")


@pytest.mark.timeout(120)
def test_reducescatter_and_alltoall_functions_match_the_public_ops(job: dict[str, Any]) -> None:
    size = job["size"]
    total = sum(_input(r, (2 * size + 1, 2)) for r in range(size))
    start = 0
    for rank, observed in enumerate(job["ranks"]):
        count = 3 if rank == 0 else 2  # 2 * size + 1 rows: rank 0 gets the extra row
        _same(observed["reducescatter"][0], total[start : start + count])
        start += count
    _check_against_public(job, "reducescatter")
    _check_against_public(job, "alltoall")
    for rank, observed in enumerate(job["ranks"]):
        # The gradient came back through the splits: one value per row this rank sent.
        received, grad = observed["alltoall"]
        sent = sum((rank + dest) % 2 + 1 for dest in range(size))
        assert grad.shape == (sent, 2)
        assert received.shape[0] == sum((src + rank) % 2 + 1 for src in range(size))


@pytest.mark.timeout(120)
def test_grouped_functions_reduce_and_gather_every_input(job: dict[str, Any]) -> None:
    size = job["size"]
    a_sum = sum(_input(r, (2,)) for r in range(size))
    c_sum = sum(_input(r, (2, 3)) for r in range(size))
    a_gathered = torch.cat([_input(r, (2,)) for r in range(size)])
    b_gathered = torch.cat([_input(r, (r + 1, 3)) for r in range(size)])
    b_rows = b_gathered.shape[0]
    c_grad = sum(_upstream(r, (2, 3)) for r in range(size))
    for rank, observed in enumerate(job["ranks"]):
        grouped = observed["grouped"]
        _same(grouped["reduced"][0], a_sum)
        _same(grouped["reduced"][1], c_sum)
        _same(grouped["gathered"][0], a_gathered)
        _same(grouped["gathered"][1], b_gathered)
        _same(grouped["grads"][2], c_grad)
        # a: through the allreduce (upstream summed) and the allgather (upstream averaged,
        # this rank's rows); both add up.
        a_grad = sum(_upstream(r, (2,)) for r in range(size)) + (
            sum(_upstream(r, (2 * size,)) for r in range(size)) / size
        ).narrow(0, 2 * rank, 2)
        _same(grouped["grads"][0], a_grad)
        start = sum(r + 1 for r in range(rank))
        b_grad = (sum(_upstream(r, (b_rows, 3)) for r in range(size)) / size)[
            start : start + rank + 1
        ]
        _same(grouped["grads"][1], b_grad)


@pytest.mark.timeout(120)
def test_allgather_function_in_a_process_set_uses_the_set_ranks(job: dict[str, Any]) -> None:
    size = job["size"]
    members = _set_members(size)
    gathered = torch.cat([_input(r, (r + 1, 2)) for r in members])
    rows = gathered.shape[0]
    averaged = sum(_upstream(r, (rows, 2)) for r in members) / len(members)
    for rank, observed in enumerate(job["ranks"]):
        if rank not in members:
            assert "set.allgather" not in observed
            continue
        result, grad = observed["set.allgather"]
        _same(result, gathered)
        start = sum(r + 1 for r in members[: members.index(rank)])
        _same(grad, averaged[start : start + rank + 1])
