"""allgather, broadcast, alltoall, reducescatter, barrier and the object helpers on real processes.

One job per world size runs every call; each test checks one behaviour against references rebuilt
in this process from every rank's input.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from .jobs import assert_raised, error_of, run_job
from .references import (
    all_inputs,
    assert_same,
    expected_allreduce,
    rank_input,
    reducescatter_rows,
)


def _alltoall_splits(rank: int, size: int) -> list[int]:
    """Rows ``rank`` sends to each rank: uneven, and zero for some pairs."""
    return [(rank + 2 * dest) % 3 for dest in range(size)]


def _reducescatter_dim0(size: int) -> int:
    """A first dimension that does not divide evenly: 5 rows for 2 ranks, 8 for 3."""
    return 3 * size - 1


def _collectives_worker() -> dict[str, Any]:
    import time

    import torch

    import hora.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    def mine(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return rank_input(rank, name, shape, dtype)

    out: dict[str, Any] = {}

    # allgather: rank r sends r + 1 rows.
    out["allgather"] = hvd.allgather(mine("allgather", (rank + 1, 3)), name="allgather")
    out["allgather_int"] = hvd.synchronize(
        hvd.allgather_async(mine("allgather_int", (rank + 1,), torch.int64), name="allgather_int")
    )
    out["grouped_allgather"] = hvd.grouped_allgather(
        [
            mine("grouped_allgather.0", (rank + 1, 2)),
            mine("grouped_allgather.1", (2 * rank + 1,), torch.int32),
        ],
        name="grouped_allgather",
    )
    scalar = torch.tensor(1.0)
    out["allgather_scalar"] = error_of(lambda: hvd.allgather(scalar, name="scalar"))
    out["allgather_async_scalar"] = error_of(lambda: hvd.allgather_async(scalar, name="scalar"))
    out["grouped_allgather_scalar"] = error_of(lambda: hvd.grouped_allgather([scalar]))

    # broadcast from either root: a new tensor, in place, and async.
    for root in (0, 1):
        x = mine(f"broadcast.{root}", (4,))
        out[f"broadcast.{root}"] = hvd.broadcast(x, root_rank=root, name=f"broadcast.{root}")
        out[f"broadcast.{root}.input_unchanged"] = torch.equal(x, mine(f"broadcast.{root}", (4,)))
        y = mine(f"broadcast_.{root}", (2, 3), torch.int64)
        out[f"broadcast_.{root}.returns_input"] = (
            hvd.broadcast_(y, root_rank=root, name=f"broadcast_.{root}") is y
        )
        out[f"broadcast_.{root}"] = y
        out[f"broadcast_async.{root}"] = hvd.synchronize(
            hvd.broadcast_async(
                mine(f"broadcast_async.{root}", (3,)),
                root_rank=root,
                name=f"broadcast_async.{root}",
            )
        )
        z = mine(f"broadcast_async_.{root}", (3,), torch.float64)
        hvd.synchronize(hvd.broadcast_async_(z, root_rank=root, name=f"broadcast_async_.{root}"))
        out[f"broadcast_async_.{root}"] = z

    # alltoall with uneven splits (one spare row that is not sent) and with equal parts.
    splits = _alltoall_splits(rank, size)
    source = mine("alltoall", (sum(splits) + 1, 2))
    out["alltoall"] = hvd.alltoall(source, splits=splits, name="alltoall")
    out["alltoall_tensor_splits"] = hvd.alltoall(
        source, splits=torch.tensor(splits, dtype=torch.int32), name="alltoall_tensor_splits"
    )
    out["alltoall_equal"] = hvd.alltoall(
        mine("alltoall_equal", (2 * size, 3), torch.int64), name="alltoall_equal"
    )
    out["alltoall_async"] = hvd.synchronize(
        hvd.alltoall_async(mine("alltoall_async", (size, 2)), name="alltoall_async")
    )

    # reducescatter with a first dimension that does not divide evenly.
    dim0 = _reducescatter_dim0(size)
    for op in ("Sum", "Average"):
        out[f"reducescatter.{op}"] = hvd.reducescatter(
            mine(f"reducescatter.{op}", (dim0, 3)), name=f"reducescatter.{op}", op=getattr(hvd, op)
        )
    out["reducescatter_int"] = hvd.synchronize(
        hvd.reducescatter_async(
            mine("reducescatter_int", (dim0,), torch.int32), name="reducescatter_int", op=hvd.Sum
        )
    )
    out["grouped_reducescatter"] = hvd.grouped_reducescatter(
        [
            mine("grouped_reducescatter.0", (dim0, 2)),
            mine("grouped_reducescatter.1", (size + 1,), torch.float64),
        ],
        name="grouped_reducescatter",
        op=hvd.Sum,
    )

    # barrier: nobody leaves before the last rank (rank 0, after a nap) has arrived.
    if rank == 0:
        time.sleep(1.0)
    out["barrier_entered"] = time.time()
    hvd.barrier()
    out["barrier_left"] = time.time()

    # Non-root ranks may pass anything: the default name does not depend on the object's type.
    sent = {"from": rank, "tensor": mine("object", (2,))}
    out["broadcast_object"] = hvd.broadcast_object(sent if rank == 1 else None, root_rank=1)
    out["broadcast_object_named"] = hvd.broadcast_object(
        sent if rank == 0 else None, root_rank=0, name="config"
    )
    out["allgather_object"] = hvd.allgather_object({"rank": rank, "items": list(range(rank))})
    hvd.shutdown()
    return out


@pytest.fixture(
    scope="module",
    params=[(2, False), (3, False), (2, True), (3, True)],
    ids=lambda p: f"np{p[0]}" + ("-mpi" if p[1] else ""),
)
def job(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    np, mpi = request.param
    return np, run_job(_collectives_worker, np, mpi=mpi)


def _gathered(np: int, name: str, rows: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.cat([rank_input(r, name, rows(r), dtype) for r in range(np)])


@pytest.mark.timeout(120)
def test_allgather_concatenates_different_first_dimensions(job: Any) -> None:
    np, ranks = job
    expected = _gathered(np, "allgather", lambda r: (r + 1, 3))
    expected_int = _gathered(np, "allgather_int", lambda r: (r + 1,), torch.int64)
    for observed in ranks:
        assert_same(observed["allgather"], expected)
        assert_same(observed["allgather_int"], expected_int)


@pytest.mark.timeout(120)
def test_grouped_allgather_returns_a_list(job: Any) -> None:
    np, ranks = job
    expected = [
        _gathered(np, "grouped_allgather.0", lambda r: (r + 1, 2)),
        _gathered(np, "grouped_allgather.1", lambda r: (2 * r + 1,), torch.int32),
    ]
    for observed in ranks:
        assert isinstance(observed["grouped_allgather"], list)
        assert len(observed["grouped_allgather"]) == 2
        for actual, wanted in zip(observed["grouped_allgather"], expected):
            assert_same(actual, wanted)


@pytest.mark.timeout(120)
def test_allgather_async_of_a_scalar_raises_value_error(job: Any) -> None:
    _, ranks = job
    for observed in ranks:
        assert_raised(observed["allgather_async_scalar"], ValueError, "rank-zero tensor")


@pytest.mark.timeout(120)
def test_allgather_of_a_scalar_raises_value_error(job: Any) -> None:
    _, ranks = job
    for observed in ranks:
        assert_raised(observed["allgather_scalar"], ValueError, "rank-zero tensor")
        assert_raised(observed["grouped_allgather_scalar"], ValueError, "rank-zero tensor")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("root", [0, 1])
def test_broadcast_forms_copy_the_root_tensor(job: Any, root: int) -> None:
    _, ranks = job
    for rank, observed in enumerate(ranks):
        assert_same(observed[f"broadcast.{root}"], rank_input(root, f"broadcast.{root}", (4,)))
        assert observed[f"broadcast.{root}.input_unchanged"], f"rank {rank}"
        assert observed[f"broadcast_.{root}.returns_input"]
        assert_same(
            observed[f"broadcast_.{root}"],
            rank_input(root, f"broadcast_.{root}", (2, 3), torch.int64),
        )
        assert_same(
            observed[f"broadcast_async.{root}"], rank_input(root, f"broadcast_async.{root}", (3,))
        )
        assert_same(
            observed[f"broadcast_async_.{root}"],
            rank_input(root, f"broadcast_async_.{root}", (3,), torch.float64),
        )


@pytest.mark.timeout(120)
def test_alltoall_with_splits_returns_output_and_received_splits(job: Any) -> None:
    np, ranks = job
    splits = [_alltoall_splits(r, np) for r in range(np)]
    sources = [rank_input(r, "alltoall", (sum(splits[r]) + 1, 2)) for r in range(np)]
    for me, observed in enumerate(ranks):
        pieces = []
        for src in range(np):
            offset = sum(splits[src][:me])
            pieces.append(sources[src][offset : offset + splits[src][me]])
        received = torch.tensor([splits[src][me] for src in range(np)], dtype=torch.int32)
        for key in ("alltoall", "alltoall_tensor_splits"):
            output, received_splits = observed[key]
            assert_same(output, torch.cat(pieces), f"rank {me} {key}")
            assert_same(received_splits.to(torch.int32), received, f"rank {me} {key} splits")


@pytest.mark.timeout(120)
def test_alltoall_without_splits_sends_equal_parts(job: Any) -> None:
    np, ranks = job
    for me, observed in enumerate(ranks):
        assert isinstance(observed["alltoall_equal"], torch.Tensor)
        expected = torch.cat(
            [
                rank_input(src, "alltoall_equal", (2 * np, 3), torch.int64)[2 * me : 2 * me + 2]
                for src in range(np)
            ]
        )
        assert_same(observed["alltoall_equal"], expected)
        output, received = observed["alltoall_async"]
        assert_same(
            output,
            torch.cat(
                [rank_input(src, "alltoall_async", (np, 2))[me : me + 1] for src in range(np)]
            ),
        )
        assert received.tolist() == [1] * np


def _scattered(full: torch.Tensor, np: int, rank: int) -> torch.Tensor:
    rows = reducescatter_rows(full.shape[0], np)
    return full[sum(rows[:rank]) : sum(rows[: rank + 1])]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_reducescatter_gives_the_first_ranks_an_extra_row(job: Any, op: str) -> None:
    np, ranks = job
    dim0 = _reducescatter_dim0(np)
    full = expected_allreduce(all_inputs(np, f"reducescatter.{op}", (dim0, 3)), op)
    for rank, observed in enumerate(ranks):
        assert observed[f"reducescatter.{op}"].shape[0] == reducescatter_rows(dim0, np)[rank]
        assert_same(observed[f"reducescatter.{op}"], _scattered(full, np, rank))
        full_int = expected_allreduce(
            all_inputs(np, "reducescatter_int", (dim0,), torch.int32), "Sum"
        )
        assert_same(observed["reducescatter_int"], _scattered(full_int, np, rank))


@pytest.mark.timeout(120)
def test_grouped_reducescatter_returns_a_list(job: Any) -> None:
    np, ranks = job
    dim0 = _reducescatter_dim0(np)
    full = [
        expected_allreduce(all_inputs(np, "grouped_reducescatter.0", (dim0, 2)), "Sum"),
        expected_allreduce(
            all_inputs(np, "grouped_reducescatter.1", (np + 1,), torch.float64), "Sum"
        ),
    ]
    for rank, observed in enumerate(ranks):
        assert isinstance(observed["grouped_reducescatter"], list)
        for actual, wanted in zip(observed["grouped_reducescatter"], full):
            assert_same(actual, _scattered(wanted, np, rank))


@pytest.mark.timeout(120)
def test_barrier_waits_for_the_last_rank(job: Any) -> None:
    _, ranks = job
    last_arrival = max(observed["barrier_entered"] for observed in ranks)
    assert all(observed["barrier_left"] >= last_arrival for observed in ranks)


@pytest.mark.timeout(120)
def test_object_helpers(job: Any) -> None:
    np, ranks = job
    for observed in ranks:
        for key, root in [("broadcast_object", 1), ("broadcast_object_named", 0)]:
            assert observed[key]["from"] == root
            assert_same(observed[key]["tensor"], rank_input(root, "object", (2,)))
        assert observed["allgather_object"] == [
            {"rank": r, "items": list(range(r))} for r in range(np)
        ]
