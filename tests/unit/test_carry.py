"""Small allreduces carried in the exchange: the slot's encoding, the decision every rank makes
from it, and the local reduction against the collective's arithmetic."""

from __future__ import annotations

import pytest
import torch

from hora.common.engine import carry
from hora.common.engine.buffers import dtype_name
from hora.common.engine.handles import Entry, Handle
from hora.common.vocabulary.message import ReduceOp, Request, RequestType, Response

from ..multiproc.references import DTYPES, assert_same, expected_allreduce, rank_input


def _request(
    name: str,
    tensor: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    set_id: int = 0,
    prescale: float = 1.0,
    postscale: float = 1.0,
) -> Request:
    dtype = dtype_name(tensor.dtype)
    assert dtype is not None
    return Request(
        name=name,
        kind=RequestType.ALLREDUCE,
        dtype=dtype,
        shape=tuple(tensor.shape),
        process_set_id=set_id,
        reduce_op=op,
        prescale=prescale,
        postscale=postscale,
    )


def _entry(request: Request, tensor: torch.Tensor) -> Entry:
    return Entry(request, tensor, None, Handle(1, 1, request.kind))


def _carrier_with(threshold: int, *entries: Entry) -> carry.Carrier:
    carrier = carry.Carrier(threshold)
    carrier.add(list(entries))
    return carrier


def test_the_slot_round_trips_items_of_any_process_set() -> None:
    a, b = torch.arange(3, dtype=torch.float32), torch.tensor([7], dtype=torch.int64)
    ra, rb = _request("allreduce.loss", a), _request("allreduce.count", b, set_id=2)
    carrier = _carrier_with(1024, _entry(ra, a), _entry(rb, b))
    carrier.slot.after(1)  # an earlier cycle asked for room
    section, wanted = carrier.section()
    assert len(section) == carrier.slot.size >= wanted > 0
    items = carry.parse(section)
    assert items == {ra.key: a.numpy().tobytes(), rb.key: b.numpy().tobytes()}


def test_items_that_do_not_fit_stay_behind_and_ask_for_room() -> None:
    tensors = [torch.full((200,), float(i)) for i in range(3)]  # 800 bytes each
    entries = [_entry(_request(f"t{i}", t), t) for i, t in enumerate(tensors)]
    carrier = _carrier_with(1024, *entries)
    section, wanted = carrier.section()
    assert section == b"" and wanted > 2400  # no slot yet: nothing rides, all are wanted
    carrier.slot.after(wanted // 2)
    section, _ = carrier.section()
    assert 0 < len(carry.parse(section)) < 3
    carrier.slot.after(wanted)
    section, _ = carrier.section()
    assert set(carry.parse(section)) == {e.request.key for e in entries}


def test_only_small_cpu_allreduces_ride() -> None:
    small, large = torch.ones(4), torch.ones(1024)
    carrier = carry.Carrier(64)
    assert carrier.carries(_request("s", small), small)
    assert not carrier.carries(_request("l", large), large)
    assert not carrier.carries(_request("a", small, op=ReduceOp.ADASUM), small)
    empty = torch.ones(0)
    assert not carrier.carries(_request("e", empty), empty)
    gather = Request(name="g", kind=RequestType.ALLGATHER, shape=(4,))
    assert not carrier.carries(gather, small)
    off = _carrier_with(0, _entry(_request("s", small), small))
    off.slot.after(4096)
    assert off.section()[1] == 0


def test_the_carrier_forgets_what_is_no_longer_pending() -> None:
    x = torch.ones(2)
    first, second = _request("first", x), _request("second", x)
    carrier = _carrier_with(1024, _entry(first, x), _entry(second, x))
    carrier.keep_only({second.key: None})
    carrier.slot.after(1)
    assert set(carry.parse(carrier.section()[0])) == {second.key}


def test_the_bytes_are_read_at_submission() -> None:
    x = torch.ones(2)
    request = _request("x", x)
    carrier = _carrier_with(1024, _entry(request, x))
    x.fill_(5.0)  # a caller must not do this, but the carried bytes are already taken
    carrier.slot.after(1)
    assert carry.parse(carrier.section()[0])[request.key] == torch.ones(2).numpy().tobytes()


def test_a_malformed_slot_is_an_error() -> None:
    x = torch.ones(2)
    carrier = _carrier_with(1024, _entry(_request("x", x), x))
    carrier.slot.after(1)
    section = carrier.section()[0]
    with pytest.raises(ValueError, match="past the end"):
        carry.parse(section[:15])


def _response(requests: dict[int, Request], **fields: object) -> Response:
    template = requests[min(requests)]
    return Response(
        kind=template.kind,
        names=[template.name],
        requests=[requests],
        process_set_id=template.process_set_id,
        **fields,  # type: ignore[arg-type]
    )


def test_a_response_is_carried_only_when_every_member_sent_its_bytes() -> None:
    x = torch.ones(3)
    request = _request("x", x)
    data = x.numpy().tobytes()
    response = _response({0: request, 1: request, 2: request})
    everyone = [{request.key: data}] * 3
    assert carry.carried_parts(response, (0, 1, 2), everyone) == [data] * 3
    missing = [{request.key: data}, {}, {request.key: data}]
    assert carry.carried_parts(response, (0, 1, 2), missing) is None
    short = [{request.key: data}, {request.key: data[:4]}, {request.key: data}]
    assert carry.carried_parts(response, (0, 1, 2), short) is None
    # A non-member's missing bytes do not matter.
    assert carry.carried_parts(response, (0, 2), missing) == [data] * 2
    joined = _response({0: request, 2: request}, joined_ranks=frozenset({1}))
    assert carry.carried_parts(joined, (0, 1, 2), everyone) is None
    failed = _response({0: request, 1: request, 2: request}, error="mismatch")
    assert carry.carried_parts(failed, (0, 1, 2), everyone) is None


OPS = {
    "Sum": ReduceOp.SUM,
    "Average": ReduceOp.AVERAGE,
    "Min": ReduceOp.MIN,
    "Max": ReduceOp.MAX,
    "Product": ReduceOp.PRODUCT,
}


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_local_reduction_matches_the_collectives_result(
    dtype: torch.dtype, op: str, size: int
) -> None:
    if dtype == torch.bool and op == "Average":
        pytest.skip("average of bool is refused at submission")
    inputs = [rank_input(r, f"{dtype}.{op}", (3, 4), dtype) for r in range(size)]
    request = _request("x", inputs[0], OPS[op])
    parts = [t.contiguous().view(torch.uint8).numpy().tobytes() for t in inputs]
    assert_same(carry.reduce_parts(request, parts), expected_allreduce(inputs, op))


@pytest.mark.parametrize(
    ("dtype", "op", "pre", "post"),
    [
        (torch.float32, "Sum", 0.5, 3.0),
        (torch.bfloat16, "Average", 2.0, 0.5),
        (torch.int32, "Sum", 0.5, 1.5),
        (torch.int16, "Max", 2.5, -0.5),
        (torch.int64, "Average", 1.0, 1.0),
    ],
)
def test_the_local_reduction_applies_scale_factors_as_the_collective_does(
    dtype: torch.dtype, op: str, pre: float, post: float
) -> None:
    inputs = [rank_input(r, f"scaled.{dtype}", (5,), dtype) for r in range(3)]
    request = _request("x", inputs[0], OPS[op], prescale=pre, postscale=post)
    parts = [t.view(torch.uint8).numpy().tobytes() for t in inputs]
    assert_same(carry.reduce_parts(request, parts), expected_allreduce(inputs, op, pre, post))
