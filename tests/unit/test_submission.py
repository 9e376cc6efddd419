"""The framework-neutral submission layer, in one process (a job of one rank): names, request
fields, result shapes, handles and the checks every adapter relies on."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import hora.torch as hvd
from hora.common import basics
from hora.common.ops import submission
from hora.common.process_sets import ProcessSet, global_process_set
from hora.common.vocabulary.errors import HoraValueError
from hora.common.vocabulary.message import ReduceOp, RequestType

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def one_rank() -> Iterator[None]:
    hvd.init()
    try:
        yield
    finally:
        hvd.shutdown()


def _requests(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record the requests handed to the engine (and still hand them on)."""
    seen: list[Any] = []
    engine = basics.engine()
    enqueue = engine.enqueue

    def recording(entries: list[Any], posted: bool = False) -> None:
        seen.extend(entry.request for entry in entries)
        enqueue(entries, posted)

    monkeypatch.setattr(engine, "enqueue", recording)
    return seen


def test_names_fields_and_result_shapes(one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _requests(monkeypatch)
    tensors = [torch.ones(3)]
    fields = submission.reduction(
        RequestType.ALLREDUCE, tensors, ReduceOp.SUM, global_process_set, 2.0, 0.5
    )
    single = submission.submit(
        RequestType.ALLREDUCE, tensors, [None], "w", global_process_set, False, **fields
    )
    grouped = submission.submit(
        RequestType.ALLGATHER,
        [torch.ones(1, 2), torch.zeros(2, 2, dtype=torch.int32)],
        [None, None],
        None,
        global_process_set,
        grouped=True,
    )
    assert [r.name for r in seen] == [
        "allreduce.w",
        "grouped_allgather.noname.1_1of2",  # the first unnamed call of the global set
        "grouped_allgather.noname.1_2of2",
    ]
    first = seen[0]
    assert (first.dtype, first.shape, first.device, first.process_set_id) == (
        "float32",
        (3,),
        "cpu",
        0,
    )
    assert (first.reduce_op, first.prescale, first.postscale) == (ReduceOp.SUM, 2.0, 0.5)
    assert seen[1].group == ("grouped_allgather.noname.1", 2)
    assert seen[2].dtype == "int32"

    # One rank: the sum of one tensor, scaled; a grouped call's results come as a list.
    assert torch.equal(submission.wait(submission.register(single)), torch.ones(3))
    gathered = submission.wait(submission.register(grouped))
    assert isinstance(gathered, list) and [t.shape for t in gathered] == [(1, 2), (2, 2)]


def test_handles_are_waited_for_once(one_rank: None) -> None:
    handle = hvd.allreduce_async(torch.ones(2), name="once")
    assert isinstance(submission.poll(handle), bool)
    assert submission.wait(handle) is not None
    assert submission.wait(handle) is None
    with pytest.raises(ValueError, match="was not created or has been cleared"):
        submission.poll(handle)


def test_post_turns_results_into_the_callers_result(one_rank: None) -> None:
    handle = submission.submit(
        RequestType.BROADCAST,
        [torch.arange(3.0)],
        [None],
        "b",
        global_process_set,
        root_rank=0,
    )
    total = submission.wait(submission.register(handle, post=lambda results: results[0].sum()))
    assert total.item() == 3.0


@pytest.mark.parametrize(
    ("tensor", "error", "match"),
    [
        (torch.ones(4, 4).t(), HoraValueError, "contiguous"),
        (torch.ones(2).to_sparse(), HoraValueError, "sparse"),
        ([1.0, 2.0], TypeError, "expects a torch.Tensor, got list"),
    ],
)
def test_tensors_the_engine_cannot_take(
    one_rank: None, tensor: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        submission.submit(RequestType.ALLREDUCE, [tensor], [None], "t", global_process_set)


def test_unregistered_process_set_is_named(one_rank: None) -> None:
    with pytest.raises(HoraValueError, match="Allgather: .* is not registered"):
        submission.submit(RequestType.ALLGATHER, [torch.ones(1)], [None], "x", ProcessSet([0]))


def test_reductions_checked_against_dtypes(one_rank: None) -> None:
    with pytest.raises(HoraValueError, match="Average is not defined for bool"):
        submission.check_reduction(
            RequestType.ALLREDUCE, [torch.ones(1, dtype=torch.bool)], ReduceOp.AVERAGE
        )
    with pytest.raises(HoraValueError, match="Reducescatter currently only supports"):
        submission.check_reduction(RequestType.REDUCESCATTER, [torch.ones(1)], ReduceOp.ADASUM)
    with pytest.raises(HoraValueError, match="floating-point tensors only"):
        submission.check_reduction(
            RequestType.ALLREDUCE, [torch.ones(1, dtype=torch.int64)], ReduceOp.ADASUM
        )


def test_resolve_op(one_rank: None) -> None:
    assert submission.resolve_op(None, None, RequestType.ALLREDUCE) == ReduceOp.AVERAGE
    assert submission.resolve_op(hvd.Max, None, RequestType.ALLREDUCE) == ReduceOp.MAX
    with pytest.warns(DeprecationWarning):
        assert submission.resolve_op(None, False, RequestType.ALLREDUCE) == ReduceOp.SUM
    with pytest.raises(HoraValueError, match="supersedes average"):
        submission.resolve_op(hvd.Sum, True, RequestType.ALLREDUCE)
    with pytest.raises(HoraValueError, match="unknown reduction op 'mean'"):
        submission.resolve_op("mean", None, RequestType.ALLREDUCE)


def test_join_and_barrier_alone(one_rank: None) -> None:
    submission.barrier(global_process_set)
    assert submission.join() == 0


def test_a_repeated_grouped_call_reuses_its_requests_while_its_tensors_stay_alike(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _requests(monkeypatch)
    tensors = [torch.ones(3), torch.ones(2, 2)]
    hvd.grouped_allreduce_(tensors, name="same", op=hvd.Sum)
    hvd.grouped_allreduce_(tensors, name="same", op=hvd.Sum)
    assert [r is s for r, s in zip(seen[:2], seen[2:])] == [True, True]
    # Another shape, dtype or reduction is described anew.
    hvd.grouped_allreduce_([torch.ones(3), torch.ones(4)], name="same", op=hvd.Sum)
    assert seen[-1].shape == (4,) and seen[-2] == seen[0]
    hvd.grouped_allreduce_([torch.ones(3, dtype=torch.float64), torch.ones(4)], name="same")
    assert seen[-2].dtype == "float64" and seen[-2].reduce_op == ReduceOp.AVERAGE
    # The checks still apply to a call made before with acceptable tensors.
    with pytest.raises(HoraValueError, match="contiguous"):
        hvd.grouped_allreduce_([torch.ones(3), torch.ones(4, 2).t()], name="same", op=hvd.Sum)
    with pytest.raises(HoraValueError, match="sparse"):
        hvd.grouped_allreduce_([torch.ones(3), torch.ones(4).to_sparse()], name="same")
    with pytest.raises(TypeError, match="torch.Tensor"):
        hvd.grouped_allreduce_([torch.ones(3), [1.0]], name="same", op=hvd.Sum)  # type: ignore[list-item]


def test_unnamed_calls_are_numbered_per_process_set_and_session() -> None:
    from hora.common.runtime import Session

    unused: Any = None
    first, second = (Session(unused, unused, unused, generation) for generation in (0, 1))
    assert [first.unnamed_call_number(0) for _ in range(3)] == [1, 2, 3]
    # A process set's calls do not move the global set's numbers, nor the other way round.
    assert [
        first.unnamed_call_number(5),
        first.unnamed_call_number(5),
        first.unnamed_call_number(0),
    ] == [1, 2, 4]
    # A new session (init after shutdown, a new elastic round) starts again from 1.
    assert [second.unnamed_call_number(0), second.unnamed_call_number(5)] == [1, 1]
    # Through the API: a new session names its first unnamed call as the first one.
    hvd.shutdown()
    hvd.init()
    seen: list[Any] = []
    real_enqueue = basics.engine().enqueue
    basics.engine().enqueue = lambda entries, posted=False: (  # type: ignore[method-assign]
        seen.extend(entries),
        real_enqueue(entries, posted),
    )
    hvd.allreduce(torch.ones(1))
    assert seen[0].request.name == "allreduce.noname.1"
