from hora.common.engine.fusion import plan
from hora.common.engine.negotiation import InlineSlot, MessageTable, ResponseCache, validate
from hora.common.process_sets import ProcessSetTable
from hora.common.vocabulary.message import CycleMessage, ReduceOp, Request, RequestType


def _req(name: str = "allreduce.x", **fields: object) -> Request:
    defaults: dict[str, object] = dict(kind=RequestType.ALLREDUCE, dtype="float32", shape=(4,))
    defaults.update(fields)
    return Request(name=name, **defaults)  # type: ignore[arg-type]


def test_request_round_trips_through_the_wire() -> None:
    req = _req(splits=(1, 2), group=("g", 2), prescale=0.5, reduce_op=ReduceOp.MAX)
    message = CycleMessage((req,), (), "bye")
    requests, shutdown, orderly = CycleMessage.decode_payload(message.encode_payload())
    assert requests == (req,) and shutdown == "bye" and not orderly
    called = CycleMessage((), (), "rank 1 called hvd.shutdown()", orderly=True)
    assert CycleMessage.decode_payload(called.encode_payload()) == (
        (),
        "rank 1 called hvd.shutdown()",
        True,
    )
    assert CycleMessage().encode_payload() == b""


def test_ready_only_when_every_member_submitted_in_arrival_order() -> None:
    table = MessageTable(ProcessSetTable(3))
    cache = ResponseCache(16)
    for rank in range(3):
        table.add(rank, _req("allreduce.b"))
    table.add(0, _req("allreduce.a"))
    table.add(1, _req("allreduce.a"))
    assert [r.names for r in table.ready(cache)] == [["allreduce.b"]]
    table.add(2, _req("allreduce.a"))
    assert [r.names for r in table.ready(cache)] == [["allreduce.a"]]
    assert not table


def test_shape_mismatch_names_tensor_and_ranks() -> None:
    requests = {0: _req(shape=(4,)), 1: _req(shape=(5,)), 2: _req(shape=(4,))}
    error = validate("allreduce.x", requests, ProcessSetTable(3), {})
    assert error is not None
    assert "'allreduce.x'" in error
    assert "ranks 0, 2: allreduce float32 [4]" in error
    assert "rank 1: allreduce float32 [5]" in error


def test_allgather_allows_different_first_dimension_only() -> None:
    ps = ProcessSetTable(2)
    ok = {
        0: _req(kind=RequestType.ALLGATHER, shape=(1, 3)),
        1: _req(kind=RequestType.ALLGATHER, shape=(2, 3)),
    }
    assert validate("allgather.x", ok, ps, {}) is None
    bad = {
        0: _req(kind=RequestType.ALLGATHER, shape=(1, 3)),
        1: _req(kind=RequestType.ALLGATHER, shape=(1, 4)),
    }
    assert "allows the first dimension to differ" in (validate("allgather.x", bad, ps, {}) or "")


def test_broadcast_root_must_agree_and_be_a_member() -> None:
    ps = ProcessSetTable(2)
    req = {
        0: _req(kind=RequestType.BROADCAST, root_rank=0),
        1: _req(kind=RequestType.BROADCAST, root_rank=1),
    }
    assert "broadcast root ranks" in (validate("b", req, ps, {}) or "")
    req = {
        0: _req(kind=RequestType.BROADCAST, root_rank=5),
        1: _req(kind=RequestType.BROADCAST, root_rank=5),
    }
    assert "root rank 5 is not a member" in (validate("b", req, ps, {}) or "")


def test_cache_bits_are_identical_across_replicas_and_evict_lru() -> None:
    replicas = [ResponseCache(2), ResponseCache(2)]
    for cache in replicas:
        for name in ("a", "b", "a", "c"):
            cache.put(name, {0: _req(name)})
    assert replicas[0].bit_for(_req("a"), 0) == replicas[1].bit_for(_req("a"), 0)
    assert replicas[0].bit_for(_req("b"), 0) is None  # least recently used, evicted
    assert replicas[0].bit_for(_req("c", shape=(9,)), 0) is None  # changed request: no hit
    bit = replicas[0].bit_for(_req("c"), 0)
    assert bit is not None and replicas[1].expand(bit, 0) == _req("c")


def test_join_lets_allreduce_proceed_and_reports_last_rank() -> None:
    table = MessageTable(ProcessSetTable(2))
    cache = ResponseCache(0)
    table.add(0, Request("join.noname", RequestType.JOIN))
    table.add(1, _req())
    (response,) = table.ready(cache)
    assert response.error is None and response.joined_ranks == frozenset({0})
    table.add(1, _req("allgather.y", kind=RequestType.ALLGATHER, shape=(1,)))
    (response,) = table.ready(cache)
    assert response.error is not None and "only allreduce is supported with join" in response.error
    table.add(1, Request("join.noname", RequestType.JOIN))
    (response,) = table.ready(cache)
    assert response.kind == RequestType.JOIN and response.last_joined_rank == 1


def test_join_fails_other_ops_at_once_even_when_ranks_named_them_differently() -> None:
    # Three ranks; rank 1 joined. Ranks 0 and 2 numbered their unnamed allgathers differently
    # (their handle counters diverged), so neither name will ever be complete: each must fail
    # at once instead of waiting for a rank that joined.
    table = MessageTable(ProcessSetTable(3))
    cache = ResponseCache(0)
    table.add(1, Request("join.noname", RequestType.JOIN))
    table.add(0, _req("allgather.noname.7", kind=RequestType.ALLGATHER, shape=(1,)))
    table.add(2, _req("allgather.noname.9", kind=RequestType.ALLGATHER, shape=(1,)))
    responses = table.ready(cache)
    assert sorted(r.names[0] for r in responses) == ["allgather.noname.7", "allgather.noname.9"]
    assert all("rank 1 joined" in (r.error or "") for r in responses)
    # An allreduce still waits for the members that have not joined.
    table.add(0, _req("allreduce.y"))
    assert table.ready(cache) == []
    table.add(2, _req("allreduce.y"))
    (response,) = table.ready(cache)
    assert response.error is None and response.joined_ranks == frozenset({1})


def test_names_belong_to_their_process_set() -> None:
    sets = ProcessSetTable(4)
    sets.add(1, (0, 1))
    sets.add(2, (2, 3))
    table = MessageTable(sets)
    cache = ResponseCache(16)
    # The same unnamed op in two disjoint sets at once: two operations, not one.
    for rank in (0, 2):
        set_id = 1 if rank < 2 else 2
        table.add(rank, _req("allreduce.noname.3", process_set_id=set_id))
    assert table.ready(cache) == []
    table.add(3, _req("allreduce.noname.3", process_set_id=2))
    (second,) = table.ready(cache)
    assert second.error is None and second.process_set_id == 2
    table.add(1, _req("allreduce.noname.3", process_set_id=1))
    (first,) = table.ready(cache)
    assert first.error is None and first.process_set_id == 1
    # Each set's entry has its own cache bit.
    bits = {
        cache.bit_for(_req("allreduce.noname.3", process_set_id=set_id), rank)
        for set_id, rank in ((1, 0), (2, 2))
    }
    assert len(bits) == 2 and None not in bits


def test_grouped_requests_are_released_together() -> None:
    table = MessageTable(ProcessSetTable(2))
    group = ("grouped_allreduce.g", 2)
    for rank in range(2):
        table.add(rank, _req("g_1of2", group=group))
    assert table.ready(ResponseCache(0)) == []
    for rank in range(2):
        table.add(rank, _req("g_2of2", group=group))
    assert [r.names[0] for r in table.ready(ResponseCache(0))] == ["g_1of2", "g_2of2"]


def test_fusion_packs_compatible_allreduces_up_to_threshold() -> None:
    table = MessageTable(ProcessSetTable(1))
    names = ["a", "b", "c", "d"]
    for name in names:
        dtype = "float64" if name == "b" else "float32"
        table.add(0, _req(name, shape=(256,), dtype=dtype))  # 1 KiB (2 KiB for float64)
    responses = table.ready(ResponseCache(0))
    batches = plan(responses, threshold_bytes=2048)
    assert [[r.names[0] for r in batch] for batch in batches] == [["a", "c"], ["b"], ["d"]]
    assert [len(b) for b in plan(responses, threshold_bytes=0)] == [1, 1, 1, 1]


def test_inline_slot_follows_the_requests_of_recent_cycles() -> None:
    slot = InlineSlot()
    assert slot.size == 0
    slot.after(1)
    assert slot.size == InlineSlot.STEP
    slot.after(InlineSlot.STEP + 1)
    assert slot.size == 2 * InlineSlot.STEP
    slot.after(100 * InlineSlot.LARGEST)  # a burst: the rest goes in a second allgather
    assert slot.size == InlineSlot.LARGEST
    slot.after(10)  # sized from the last cycle with requests, not the largest ever
    assert slot.size == InlineSlot.STEP
    for _ in range(InlineSlot.KEEP_CYCLES - 1):
        slot.after(0)
    assert slot.size == InlineSlot.STEP  # kept through a short pause
    slot.after(0)
    assert slot.size == 0  # idle exchanges shrink back to the bare header
