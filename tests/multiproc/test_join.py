"""``hvd.join`` on real processes: rank 0 runs out of data first; the others' allreduces still
complete with rank 0 contributing zeros, and every rank learns the same last-joined rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from .jobs import assert_raised, error_of, run_job
from .references import assert_same, expected_allreduce, rank_input

STEPS = 5
RANK0_STEPS = 2
SHAPE = (3, 2)


def _steps(rank: int) -> int:
    return RANK0_STEPS if rank == 0 else STEPS


def _join_worker() -> dict[str, Any]:
    import time

    import torch

    import hora.torch as hvd

    hvd.init()
    rank = hvd.rank()
    out: dict[str, Any] = {}
    for step in range(_steps(rank)):
        for op in ("Average", "Sum"):
            name = f"join.{op}.{step}"
            out[name] = hvd.allreduce(
                rank_input(rank, name, SHAPE, torch.float64), name=name, op=getattr(hvd, op)
            )
    # Stagger the ranks that finish together, so the last to join is the highest rank.
    if rank > 0:
        time.sleep(0.5 * rank)
    out["last_joined"] = hvd.join()
    out["after_join"] = hvd.allreduce(torch.full((2,), rank + 1.0), op=hvd.Sum, name="after")
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_joined_rank_contributes_zeros_and_join_agrees_on_last_rank(np: int) -> None:
    ranks = run_job(_join_worker, np)

    for step in range(STEPS):
        for op in ("Average", "Sum"):
            name = f"join.{op}.{step}"
            contributors = [r for r in range(np) if step < _steps(r)]
            inputs = [rank_input(r, name, SHAPE, torch.float64) for r in contributors]
            # Average still divides by the full job size while rank 0 has joined.
            expected = expected_allreduce(inputs, op, size=np)
            for rank in contributors:
                assert_same(ranks[rank][name], expected, f"rank {rank} {name}")
            if step >= RANK0_STEPS:
                assert name not in ranks[0]

    assert [observed["last_joined"] for observed in ranks] == [np - 1] * np
    for observed in ranks:
        assert_same(observed["after_join"], torch.full((2,), float(sum(range(1, np + 1)))))


def _join_in_turn_worker() -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict[str, Any] = {"averages": [], "gather_errors": [], "broadcast_errors": [], "last": []}
    for first in range(size):
        # Every rank in turn joins first; the others average, gather and broadcast meanwhile.
        if rank == first:
            out["last"].append(hvd.join())
        else:
            for dtype in (torch.int32, torch.float32):
                x = rank_input(first, "join.x", (5,), dtype)  # the same on every rank
                out["averages"].append(hvd.allreduce(x, name=f"avg.{dtype}", op=hvd.Average))
            # Named differently on each rank (as unnamed ops are, once ranks made different
            # numbers of calls): no name is ever complete, yet each fails at once.
            out["gather_errors"].append(
                error_of(lambda: hvd.allgather(torch.ones(2, 2), name=f"gather.{rank}"))
            )
            out["broadcast_errors"].append(
                error_of(lambda: hvd.broadcast(torch.ones(2), 0, name="joined.broadcast"))
            )
            out["last"].append(hvd.join())
        out.setdefault("agreed", []).append(hvd.allgather_object(out["last"][-1]))
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_while_a_rank_has_joined_other_ops_fail_at_once_and_averages_are_exact(np: int) -> None:
    ranks = run_job(_join_in_turn_worker, np)
    for rank, observed in enumerate(ranks):
        averages = iter(observed["averages"])
        for first in range(np):
            assert observed["agreed"][first] == [observed["last"][first]] * np
            assert observed["last"][first] != first
            if rank == first:
                continue
            for dtype in (torch.int32, torch.float32):
                x = rank_input(first, "join.x", (5,), dtype)
                # (size - 1) ranks contribute x, the joined one zeros; Average divides by size.
                if dtype.is_floating_point:
                    expected = x * (np - 1) / np
                else:
                    expected = torch.div(x * (np - 1), np, rounding_mode="trunc")
                assert torch.equal(next(averages), expected), (rank, first, dtype)
        for error in observed["gather_errors"] + observed["broadcast_errors"]:
            assert_raised(error, RuntimeError, "joined: only allreduce is supported with join")


def _process_set_while_joined_worker() -> dict[str, Any]:
    import hora.torch as hvd

    hvd.init()
    out: dict[str, Any] = {}
    if hvd.rank() == 0:
        hvd.join()
    else:
        # Rank 0 has joined and never submits it: refused on every other rank, registered
        # nowhere (every rank keeps the same table of sets).
        out["refused"] = error_of(lambda: hvd.add_process_set([1]))
        hvd.join()
    added = hvd.add_process_set([1])
    out["added_id"] = added.process_set_id
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_a_process_set_change_while_a_rank_has_joined_is_refused_everywhere(np: int) -> None:
    ranks = run_job(_process_set_while_joined_worker, np, env={"HORA_DYNAMIC_PROCESS_SETS": "1"})
    for observed in ranks[1:]:
        assert_raised(observed["refused"], RuntimeError, "rank 0 joined")
    assert len({observed["added_id"] for observed in ranks}) == 1
