"""The pure parts of the steady state: finding the period, cutting it into batches, codes."""

from __future__ import annotations

from hora.common.engine.steady.schedule import (
    DEVIATED,
    FOLLOWING,
    MAX_PERIOD,
    History,
    blocked_code,
    build_schedule,
    cuts_from,
)
from hora.common.vocabulary.message import ReduceOp, Request, RequestType, Response


def _response(name: str, numel: int = 10, **fields: object) -> Response:
    request = Request(name=name, kind=RequestType.ALLREDUCE, shape=(numel,), **fields)  # type: ignore[arg-type]
    return Response(
        RequestType.ALLREDUCE, [name], [{0: request, 1: request}], request.process_set_id
    )


def _history(names: list[str], repeats: int = 2) -> History:
    history = History(repeats=repeats)
    for name in names:
        history.record(_response(name))
    return history


def test_a_sequence_seen_twice_in_a_row_is_a_period() -> None:
    period = _history(["a", "b", "c", "a", "b", "c"]).period()
    assert period is not None
    assert [r.names[0] for r in period] == ["a", "b", "c"]


def test_a_sequence_seen_once_is_not_a_period() -> None:
    assert _history(["x", "a", "b", "c"]).period() is None
    assert _history(["a", "b", "a", "c"]).period() is None
    assert _history([]).period() is None


def test_a_repetition_inside_a_step_is_not_a_period() -> None:
    # A step of six tensors whose last three were agreed in the same order as the next step's
    # first three: "d e f" repeats, but the step also has "a b c".
    steps = ["a", "b", "c", "d", "e", "f", "d", "e", "f"]
    assert _history(steps).period() is None
    # Once the whole step repeats, it is the period.
    period = _history(steps + ["a", "b", "c"] + ["d", "e", "f", "a", "b", "c"]).period()
    assert period is not None
    assert [r.names[0] for r in period] == ["d", "e", "f", "a", "b", "c"]
    # Names seen before the repetitions that belong to the period do not stop it.
    assert _history(["b", "c", "a", "b", "c", "a", "b", "c"]).period() is not None


def test_more_repeats_are_needed_after_deviations() -> None:
    names = ["a", "b"] * 2
    assert _history(names, repeats=3).period() is None
    assert _history(names + ["a", "b"], repeats=3).period() is not None


def test_a_long_run_of_new_names_stays_bounded_and_a_period_is_still_found() -> None:
    # Unnamed calls give every call a new name: the history keeps a bounded tail of them, and
    # a training loop that starts afterwards is recognised as before (after three steps: what
    # precedes the repetitions must belong to the period).
    history = _history([f"noname.{i}" for i in range(4 * MAX_PERIOD)])
    assert len(history.responses) <= (history.repeats + 1) * MAX_PERIOD
    assert history.period() is None
    for name in ["a", "b", "c"] * 3:
        history.record(_response(name))
    period = history.period()
    assert period is not None
    assert [r.names[0] for r in period] == ["a", "b", "c"]


def test_a_name_seen_again_after_the_longest_period_is_no_period() -> None:
    names = [f"n{i}" for i in range(MAX_PERIOD)]
    history = _history(["x", *names, "x", *names, "x"], repeats=2)
    assert history.period() is None
    # After a clear, earlier names are forgotten.
    history.clear()
    history.record(_response("x"))
    assert history.period() is None


def test_a_change_in_a_request_breaks_the_period() -> None:
    history = _history(["a", "b"])
    history.record(_response("a"))
    history.record(_response("b", numel=11))
    assert history.period() is None


def test_anything_but_a_global_floating_sum_or_average_allreduce_clears_the_history() -> None:
    for response in (
        _response("m", reduce_op=ReduceOp.MAX),
        _response("i", dtype="int32"),
        _response("p", process_set_id=1),
        Response(RequestType.BROADCAST, ["b"], [{0: Request("b", RequestType.BROADCAST)}]),
    ):
        history = _history(["a", "b", "a", "b"])
        history.record(response)
        assert history.responses == []


def test_batches_close_past_the_first_bucket_then_past_the_next() -> None:
    mib = 1024 * 1024 // 4  # float32 elements in one MiB
    period = [
        _response("small", 10),
        _response("big", mib),  # crosses the first bucket's mark: closes batch 0
        _response("c", 10),
        _response("d", 10),
    ]
    schedule = build_schedule(period, 64 * 1024 * 1024)
    assert [[r.name for r in b] for b in schedule.batches] == [["small", "big"], ["c", "d"]]


def test_batches_respect_the_fusion_threshold_cuts_and_fusion_keys() -> None:
    period = [_response("a"), _response("b"), _response("c", prescale=0.5), _response("d")]
    by_threshold = build_schedule(period[:2], 40)  # 40 bytes: one tensor per batch
    assert [[r.name for r in b] for b in by_threshold.batches] == [["a"], ["b"]]
    cut = build_schedule(period[:2], 1 << 20, {"b"})
    assert [[r.name for r in b] for b in cut.batches] == [["a"], ["b"]]
    keyed = build_schedule(period, 1 << 20)
    assert [[r.name for r in b] for b in keyed.batches] == [["a", "b"], ["c"], ["d"]]


def test_the_schedule_expects_its_own_requests_only() -> None:
    period = [_response("a"), _response("b", 1 << 20), _response("c")]
    schedule = build_schedule(period, 1 << 30)
    a, b, c = (r.template() for r in period)
    assert schedule.expects(a) and schedule.expects(c)
    schedule.advance()
    # "a" already ran in this period: a rank submitting it now is in the next one.
    assert schedule.expects(a) and schedule.expects(c)
    assert not schedule.expects(Request("c", RequestType.ALLREDUCE, shape=(11,)))
    assert not schedule.expects(Request("z", RequestType.ALLREDUCE, shape=(10,)))
    schedule.advance()
    assert schedule.position == 0 and schedule.expects(a)


def test_codes_of_blocked_ranks_become_cuts() -> None:
    batch = [Request(n, RequestType.ALLREDUCE) for n in ("a", "b", "c")]
    assert cuts_from(batch, [FOLLOWING, DEVIATED]) == set()
    assert cuts_from(batch, [blocked_code(1), FOLLOWING]) == {"b"}
    assert cuts_from(batch, [blocked_code(2), blocked_code(1)]) == {"b", "c"}
    # Out of the range a code can carry exactly: cut before every tensor of the batch.
    assert cuts_from(batch, [blocked_code(5000)]) == {"b", "c"}
