"""The fast path's call signature: equal for the same call, different for any difference the
members must agree on, and ``None`` for a call the lane cannot run."""

from __future__ import annotations

import torch

from hora.common.ops import direct, submission
from hora.common.ops.fast_path import header
from hora.common.process_sets import global_process_set
from hora.common.vocabulary.message import ReduceOp, RequestType

ALLREDUCE = RequestType.ALLREDUCE
SUM = {"reduce_op": ReduceOp.SUM, "prescale": 1.0, "postscale": 1.0}


def test_the_same_call_signs_alike_and_every_difference_shows() -> None:
    base = header(ALLREDUCE, "allreduce.x", [torch.ones(2, 3)], SUM)
    assert base is not None and len(base) == 3
    assert all(-(1 << 63) <= word < 1 << 63 for word in base)  # each fits its 64-bit word
    assert header(ALLREDUCE, "allreduce.x", [torch.zeros(2, 3)], dict(SUM)) == base
    others = [
        header(ALLREDUCE, "allreduce.y", [torch.ones(2, 3)], SUM),
        header(ALLREDUCE, "allreduce.x", [torch.ones(3, 2)], SUM),
        header(ALLREDUCE, "allreduce.x", [torch.ones(2, 3, dtype=torch.float64)], SUM),
        header(ALLREDUCE, "allreduce.x", [torch.ones(2, 3)], {**SUM, "reduce_op": ReduceOp.MAX}),
        header(ALLREDUCE, "allreduce.x", [torch.ones(2, 3)], {**SUM, "prescale": 2.0}),
        header(ALLREDUCE, "allreduce.x", [torch.ones(2, 3), torch.ones(1)], SUM),
        header(RequestType.BROADCAST, "allreduce.x", [torch.ones(2, 3)], {"root_rank": 0}),
    ]
    assert all(other is not None and other != base for other in others)
    assert len(set(others)) == len(others)


def test_equal_values_of_other_types_sign_apart() -> None:
    as_int = header(RequestType.BROADCAST, "b", [torch.ones(1)], {"root_rank": 1})
    as_float = header(RequestType.BROADCAST, "b", [torch.ones(1)], {"root_rank": 1.0})
    assert as_int != as_float
    assert header(RequestType.BROADCAST, "b", [torch.ones(1)], {"root_rank": 1}) == as_int


def test_calls_the_lane_cannot_run_have_no_signature() -> None:
    assert header(RequestType.ALLGATHER, "g", [torch.ones(1)], {}) is None
    assert header(ALLREDUCE, "a", [torch.ones(1)], {**SUM, "reduce_op": ReduceOp.ADASUM}) is None
    mixed = [torch.ones(1), torch.ones(1, dtype=torch.float64)]
    assert header(ALLREDUCE, "a", mixed, SUM) is None
    assert header(RequestType.BARRIER, "barrier", [], {}) is not None


def test_a_direct_allreduce_signs_as_the_general_path() -> None:
    # A rank whose call takes the direct path and one whose call takes the general path (its
    # tensor requires a gradient, say) must sign alike, or neither runs on the lane.
    for dtype, shape in ((torch.float32, (1,)), (torch.int64, (2, 3)), (torch.float16, ())):
        tensor = torch.zeros(shape, dtype=dtype)
        for op, scales in ((ReduceOp.SUM, (1, 1)), (ReduceOp.AVERAGE, (0.5, 4.0))):
            fields = submission.reduction(ALLREDUCE, [tensor], op, global_process_set, *scales)
            general = header(ALLREDUCE, "allreduce.noname.7", [tensor], fields)
            pre, post = (float(s) for s in scales)
            assert direct.sign("allreduce.noname.7", tensor, op, pre, post) == general
