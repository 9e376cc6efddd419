"""The timeline reader and summary (hora/tools/timeline*.py) on timelines built here.

``_job`` writes the files a 3-rank job would, in the format of docs/timeline-format.md, with
known numbers: a 50 ms step; rank 2 reaches backward 20 ms after the others; tensor ``a`` runs
alone, during rank 2's backward; ``b`` and ``c`` are fused after backward.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from hora import cli
from hora.tools import timeline as tl
from hora.tools.timeline_plot import INSTALL_HINT, choose_window, plot

pytestmark = pytest.mark.timeout(30)

MS = 1000.0  # microseconds
T0 = 1_763_900_000_000_000.0
STEP = 50 * MS
LATE = 20 * MS
BACKWARD = 10 * MS


@dataclass
class Trace:
    """One rank's file, event by event, as the writer lays it out."""

    rank: int
    events: list[dict[str, Any]] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.meta("process_name", 0, name=f"rank {self.rank}")
        self.meta("thread_name", 0, name="training")
        self.meta("thread_name", 1, name="engine")

    def meta(self, kind: str, tid: int, **args: Any) -> None:
        self.events.append({"name": kind, "ph": "M", "pid": self.rank, "tid": tid, "args": args})

    def row(self, tensor: str) -> int:
        if tensor not in self.rows:
            self.rows[tensor] = len(self.rows) + 2
            self.meta("thread_name", self.rows[tensor], name=tensor)
        return self.rows[tensor]

    def x(self, name: str, tid: int, start: float, end: float, **args: Any) -> None:
        event = {"name": name, "ph": "X", "pid": self.rank, "tid": tid, "ts": start}
        self.events.append({**event, "dur": end - start, "args": args})

    def instant(self, name: str, ts: float) -> None:
        event = {"name": name, "ph": "i", "s": "t", "pid": self.rank, "tid": 1, "ts": ts}
        self.events.append(event)

    def text(self, closed: bool = True) -> str:
        lines = "".join(json.dumps(e) + ",\n" for e in self.events)
        if not closed:
            return "[\n" + lines
        end = {"name": "timeline_end", "ph": "M", "pid": self.rank, "args": {}}
        return "[\n" + lines + json.dumps(end) + "\n]\n"


def _call(
    trace: Trace, tensor: str, submit: float, batch: int, span: tuple[float, float], **op: Any
) -> None:
    """One allreduce of ``tensor``: submitted at ``submit``, its batch runs over ``span``."""
    tid = trace.row(tensor)
    start, end = span
    first = "NEGOTIATE_ALLREDUCE" if batch < 2 else "WAIT_FOR_BATCH"
    trace.x(first, tid, submit, start, op="ALLREDUCE")
    trace.x("MEMCPY_IN_FUSION_BUFFER", tid, start, start + 0.5 * MS, batch=batch)
    trace.x("ALLREDUCE", tid, start + 0.5 * MS, end - 0.5 * MS, batch=batch, **op)
    trace.x("MEMCPY_OUT_FUSION_BUFFER", tid, end - 0.5 * MS, end, batch=batch)


def _job(
    size: int = 3, steps: int = 10, late_rank: int | None = 2, training: bool = True
) -> list[Trace]:
    traces = [Trace(r) for r in range(size)]
    for trace in traces:
        if size > 1:
            trace.instant("STEADY_STATE_ENTER", T0 + 60 * MS)
        for k in range(steps):
            base = T0 + k * STEP
            late = LATE if trace.rank == late_rank else 0.0
            backward = (base + late, base + late + BACKWARD)
            if training:
                trace.x("BACKWARD", 0, *backward)
                trace.x("OPTIMIZER_STEP", 0, backward[1], base + 37 * MS)
            # 'a' runs alone once the late rank submits it: inside the late rank's backward.
            a = (base + 22 * MS, base + 25 * MS)
            _call(trace, "allreduce.grad.a", backward[0] + 2 * MS, 2 * k, a, tensors=1, bytes=1024)
            bc = (base + 30 * MS, base + 36 * MS)
            for name in ("allreduce.grad.b", "allreduce.grad.c"):
                _call(trace, name, backward[1], 2 * k + 1, bc, tensors=2, bytes=8192)
    return traces


def _write(tmp_path: Path, traces: list[Trace], closed: dict[int, bool] | None = None) -> Path:
    path = tmp_path / "timeline.json"
    for trace in traces:
        text = trace.text(closed=(closed or {}).get(trace.rank, True))
        tl.rank_path(path, trace.rank).write_text(text)
    return path


def test_rank_files_are_named_before_the_extension(tmp_path: Path) -> None:
    assert tl.rank_path("out/timeline.json", 0) == Path("out/timeline.json")
    assert tl.rank_path("out/timeline.json", 3) == Path("out/timeline.rank3.json")
    assert tl.rank_path("trace", 1) == Path("trace.rank1")
    for name in ("timeline.json", "timeline.rank2.json", "timeline.rank10.json"):
        (tmp_path / name).write_text("[]")
    for name in ("timeline.rank1.json.bak", "other.rank1.json", "timeline.rankx.json"):
        (tmp_path / name).write_text("[]")
    found = tl.rank_files(tmp_path / "timeline.json")
    assert [p.name for p in found] == [
        "timeline.json",
        "timeline.rank2.json",
        "timeline.rank10.json",
    ]


def test_summary_of_a_job_with_a_late_rank(tmp_path: Path) -> None:
    summary = tl.summarize(tl.load(_write(tmp_path, _job())))

    assert summary.ranks == [0, 1, 2]
    assert summary.warnings == []
    assert summary.step_ms_median == pytest.approx(STEP / MS)
    # Per step, 'a' communicates 3 ms and the fused 'b'+'c' 6 ms: 9 of 50 ms.
    assert summary.comm_ms_per_step_median == pytest.approx(9.0)
    assert summary.comm_share == pytest.approx(9 / 50)
    # Only on rank 2 does communication ('a', 3 of 9 ms) fall inside backward.
    assert summary.overlap_share == pytest.approx(3 / 27)
    late = summary.per_rank[2]
    assert late.overlap_share == pytest.approx(3 / 9)
    assert summary.per_rank[0].overlap_share == 0.0
    assert [r.steps for r in summary.per_rank] == [9, 9, 9]
    assert late.backward_ms_median == pytest.approx(BACKWARD / MS)
    assert summary.per_rank[0].optimizer_step_ms_median == pytest.approx(27.0)

    straggler = summary.straggler
    assert straggler is not None
    assert (straggler.rank, straggler.last_count, straggler.compared) == (2, 30, 30)
    assert straggler.clear
    assert straggler.wait_ms_mean == pytest.approx(LATE / MS)
    assert straggler.wait_ms_total == pytest.approx(30 * LATE / MS)
    assert summary.per_rank[0].wait_ms_mean == pytest.approx(LATE / MS)
    assert summary.per_rank[0].wait_ms_total == pytest.approx(30 * LATE / MS)
    assert summary.per_rank[1].wait_ms_median == pytest.approx(LATE / MS)
    assert late.wait_ms_median == 0.0
    assert late.wait_ms_total == 0.0
    assert [r.last_count for r in summary.per_rank] == [0, 0, 30]
    assert [(r.negotiated_calls, r.steady_calls) for r in summary.per_rank] == [(3, 27)] * 3
    assert [r.steady_state_entries for r in summary.per_rank] == [1, 1, 1]

    assert [t.name for t in summary.tensors] == [
        "allreduce.grad.b",
        "allreduce.grad.c",
        "allreduce.grad.a",
    ]
    b = summary.tensors[0]
    assert (b.op, b.calls, b.fused_share) == ("ALLREDUCE", 10, 1.0)
    assert b.collective_ms == pytest.approx(10 * 5.0)  # ALLREDUCE of 5 ms, 10 calls
    assert summary.tensors[2].collective_ms_mean == pytest.approx(2.0)
    assert summary.tensors[2].fused_share == 0.0

    fusion = summary.fusion
    assert fusion is not None
    assert (fusion.rank, fusion.batches, fusion.tensors_per_batch_max) == (0, 20, 2)
    assert fusion.tensors_per_batch_mean == pytest.approx(1.5)
    assert fusion.bytes_per_batch_mean == pytest.approx((1024 + 8192) / 2)
    assert fusion.bytes_per_batch_max == 8192
    assert fusion.fused_call_share == pytest.approx(2 / 3)


def test_negotiation_spans_of_earlier_versions_are_read_alike(tmp_path: Path) -> None:
    # hora wrote NEGOTIATE before it took Horovod's NEGOTIATE_<OP> names: both are one phase.
    (tmp_path / "new").mkdir()
    (tmp_path / "old").mkdir()
    current = tl.summarize(tl.load(_write(tmp_path / "new", _job())))
    traces = _job()
    for trace in traces:
        for event in trace.events:
            if event["name"] == "NEGOTIATE_ALLREDUCE":
                event["name"] = "NEGOTIATE"
    earlier = tl.summarize(tl.load(_write(tmp_path / "old", traces)))
    assert [(r.negotiated_calls, r.steady_calls) for r in earlier.per_rank] == [(3, 27)] * 3
    assert [r.wait_ms_total for r in earlier.per_rank] == [
        r.wait_ms_total for r in current.per_rank
    ]


def test_the_text_answers_the_three_questions(tmp_path: Path) -> None:
    text = tl_text(tl.summarize(tl.load(_write(tmp_path, _job()))))
    assert "A step takes 50.0 ms (median); communication runs for 9.00 ms of it, 18%" in text
    assert "11% of communication time falls inside BACKWARD" in text
    assert "Rank 2 is the straggler: it submitted last in 30 of 30 collectives (100%)" in text
    assert "waited 20.0 ms for it each time" in text
    assert "Fusion (rank 0): 20 batches, 1.5 tensors per batch (at most 2)" in text


def tl_text(summary: tl.Summary, top: int = 10) -> str:
    from hora.tools.timeline_report import format_summary

    return format_summary(summary, top=top)


def test_a_killed_rank_file_without_bracket_is_read(tmp_path: Path) -> None:
    traces = _job()
    # Rank 2 died during step 6: its file stops there, with a trailing comma and no ']'.
    cut = next(i for i, e in enumerate(traces[2].events) if e.get("ts", 0) >= T0 + 6 * STEP)
    traces[2].events = traces[2].events[:cut]
    path = _write(tmp_path, traces, closed={2: False})
    assert tl.rank_path(path, 2).read_text().rstrip().endswith(",")

    timeline = tl.load(path)
    crashed = [f for f in timeline.files if not f.closed]
    assert [Path(f.path).name for f in crashed] == ["timeline.rank2.json"]
    assert crashed[0].events == cut
    assert "timeline.rank2.json' was cut short" in " ".join(timeline.warnings)

    summary = tl.summarize(timeline)
    assert [r.steps for r in summary.per_rank] == [9, 9, 5]
    assert summary.straggler is not None and summary.straggler.rank == 2
    # Calls after the crash exist on ranks 0 and 1 only; they are compared between those two.
    assert summary.straggler.compared == 30
    assert summary.straggler.last_count == 18


def test_a_half_written_last_line_is_ignored(tmp_path: Path) -> None:
    traces = _job(size=2, late_rank=None)
    path = _write(tmp_path, traces, closed={1: False})
    rank1 = tl.rank_path(path, 1)
    whole = rank1.read_text()
    half = json.dumps(traces[1].events[-1])[:25]
    rank1.write_text(whole + half)

    timeline = tl.load(path)
    source = next(f for f in timeline.files if f.path == str(rank1))
    assert (source.closed, source.dropped_tail, source.events) == (
        False,
        True,
        len(traces[1].events),
    )
    assert "ignoring a half-written last line" in " ".join(timeline.warnings)
    assert len(timeline.rank_events(1)) == len(traces[1].events)


def test_a_damaged_line_in_the_middle_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    lines = Trace(0).text().splitlines()
    lines[2] = lines[2][:10]
    path.write_text("\n".join(lines))
    with pytest.raises(tl.TimelineError, match=r"timeline.json', line 3: not a JSON trace event"):
        tl.load(path)


def test_a_file_that_is_not_a_trace_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello\n")
    with pytest.raises(tl.TimelineError, match="should start with '\\['"):
        tl.load(path)
    path.write_text('{"a": 1}')
    with pytest.raises(tl.TimelineError, match="not a Chrome trace"):
        tl.load(path)


def test_an_empty_file_and_a_missing_rank_are_reported(tmp_path: Path) -> None:
    traces = _job(size=3)
    path = _write(tmp_path, [traces[0], traces[2]])
    tl.rank_path(path, 1).write_text("")  # a rank killed before it wrote anything
    timeline = tl.load(path)
    assert timeline.ranks == [0, 2]
    warnings = " ".join(timeline.warnings)
    assert "timeline.rank1.json' is empty" in warnings
    assert "no events for rank(s) 1" in warnings


def test_missing_rank_zero_file_reads_the_others(tmp_path: Path) -> None:
    path = _write(tmp_path, _job(size=3))
    path.unlink()
    timeline = tl.load(path)
    assert timeline.ranks == [1, 2]
    assert "(rank 0's file) does not exist" in " ".join(timeline.warnings)


def test_a_missing_timeline_says_how_to_write_one(tmp_path: Path) -> None:
    with pytest.raises(tl.TimelineError, match="Run the job with HORA_TIMELINE="):
        tl.load(tmp_path / "timeline.json")
    with pytest.raises(tl.TimelineError, match="no timeline file at"):
        tl.load([tmp_path / "a.json"])


def test_a_merged_file_next_to_leftover_rank_files_counts_each_event_once(tmp_path: Path) -> None:
    traces = _job()
    (tmp_path / "parts").mkdir()
    separate = tl.load(_write(tmp_path / "parts", traces))
    merged_path = tmp_path / "timeline.json"
    tl.write_merged(separate, merged_path)
    # A rank file that was not deleted after the merge.
    tl.rank_path(merged_path, 2).write_text(traces[2].text())

    both = tl.load(merged_path)
    assert len(both.files) == 2
    assert len(both.events) == len(separate.events) + 3  # the process_sort_index merge added
    assert tl.summarize(both).to_dict()["per_rank"] == tl.summarize(separate).to_dict()["per_rank"]


def test_equal_events_within_one_file_are_all_kept(tmp_path: Path) -> None:
    trace = Trace(0)
    trace.instant("CYCLE_START", T0)
    trace.instant("CYCLE_START", T0)  # two cycles within one microsecond
    timeline = tl.load(_write(tmp_path, [trace]))
    assert [e.name for e in timeline.events].count("CYCLE_START") == 2


def test_merge_writes_one_valid_trace_of_every_rank(tmp_path: Path) -> None:
    traces = _job()
    for trace in traces:  # drop process_name: merge must add one per rank
        trace.events = [e for e in trace.events if e["name"] != "process_name"]
    path = _write(tmp_path, traces, closed={1: False})
    out = tmp_path / "merged.json"
    count = tl.write_merged(tl.load(path), out)

    events = json.loads(out.read_text())
    assert len(events) == count
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    timed = [e["ts"] for e in events if e["ph"] != "M"]
    assert timed == sorted(timed)
    assert all(e["ph"] == "M" for e in events[: len(events) - len(timed)])
    assert sum(len(t.events) for t in traces) + 6 == count - 2  # + sort indexes; - end marks
    reread, original = tl.summarize(tl.load([out])), tl.summarize(tl.load(path))
    for part in ("per_rank", "straggler", "tensors", "fusion", "step_ms_median", "comm_share"):
        assert reread.to_dict()[part] == original.to_dict()[part], part


def test_without_optimizer_markers_tensors_and_fusion_are_still_reported(tmp_path: Path) -> None:
    summary = tl.summarize(tl.load(_write(tmp_path, _job(training=False))))
    assert summary.step_ms_median is None
    assert summary.comm_share is None and summary.overlap_share is None
    assert "no training steps" in " ".join(summary.warnings)
    assert summary.straggler is not None and summary.straggler.rank == 2
    assert len(summary.tensors) == 3
    assert summary.fusion is not None and summary.fusion.batches == 20
    text = tl_text(summary)
    assert "No training steps were recorded" in text
    assert "Top 3 of 3 tensors" in text
    assert "Steps (medians" not in text


def test_one_rank_has_no_straggler(tmp_path: Path) -> None:
    summary = tl.summarize(tl.load(_write(tmp_path, _job(size=1, late_rank=None))))
    assert summary.straggler is None
    assert summary.per_rank[0].wait_ms_mean is None
    assert summary.step_ms_median == pytest.approx(50.0)
    assert "there is no straggler to find" in tl_text(summary)


def test_no_rank_stands_out_when_the_last_one_alternates(tmp_path: Path) -> None:
    traces = _job(size=2, late_rank=None)
    for trace in traces:  # each rank submits 'a' 1 ms late in every other step
        for e in trace.events:
            if (
                e["name"] in ("NEGOTIATE_ALLREDUCE", "WAIT_FOR_BATCH")
                and e["tid"] == trace.rows["allreduce.grad.a"]
            ):
                step = round((e["ts"] - T0) // STEP)
                if step % 2 == trace.rank:
                    e["ts"] += 1 * MS
    summary = tl.summarize(tl.load(_write(tmp_path, traces)))
    straggler = summary.straggler
    assert straggler is not None
    assert not straggler.clear
    # 'b' and 'c' are submitted at the same moment everywhere: ties, last for nobody.
    assert (straggler.last_count, straggler.compared) == (5, 30)
    assert [r.last_count for r in summary.per_rank] == [5, 5]
    assert "No rank stands out as a straggler" in tl_text(summary)


def test_cli_summarize_text_json_and_top(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, _job())
    assert cli.main(["timeline", "summarize", str(path), "--top", "1"]) == 0
    text = capsys.readouterr().out
    assert "Rank 2 is the straggler" in text
    assert "Top 1 of 3 tensors" in text and "allreduce.grad.b" in text
    assert "allreduce.grad.a" not in text

    assert cli.main(["timeline", "summarize", str(path), "--json", "--top", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["straggler"]["rank"] == 2
    assert data["straggler"]["wait_ms_mean"] == pytest.approx(20.0)
    assert [t["name"] for t in data["tensors"]] == ["allreduce.grad.b", "allreduce.grad.c"]
    assert [r["rank"] for r in data["per_rank"]] == [0, 1, 2]

    # Several files are read exactly as given: here, ranks 0 and 2 only.
    assert cli.main(["timeline", "summarize", str(path), str(tl.rank_path(path, 2)), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"] == [0, 2]


def test_cli_errors_are_one_message_and_status_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "timeline.json"
    assert cli.main(["timeline", "summarize", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hora timeline summarize: no timeline at")
    assert "HORA_TIMELINE=" in err
    with pytest.raises(SystemExit):
        cli.main(["timeline", "summarize", str(missing), "--top", "0"])
    assert "must be at least 1" in capsys.readouterr().err


def test_cli_merge(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, _job(), closed={2: False})
    out = tmp_path / "all.json"
    assert cli.main(["timeline", "merge", str(path), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"wrote {out}" in captured.out and "3 rank(s) from 3 file(s)" in captured.out
    assert "timeline.rank2.json' was cut short" in captured.err
    assert {e["pid"] for e in json.loads(out.read_text())} == {0, 1, 2}

    # A missing folder is made; a path through a file cannot be.
    made = tmp_path / "missing" / "all.json"
    assert cli.main(["timeline", "merge", str(path), "-o", str(made)]) == 0
    assert {e["pid"] for e in json.loads(made.read_text())} == {0, 1, 2}
    capsys.readouterr()
    (tmp_path / "a-file").write_text("")
    nowhere = tmp_path / "a-file" / "all.json"
    assert cli.main(["timeline", "merge", str(path), "-o", str(nowhere)]) == 1
    err = capsys.readouterr().err
    assert f"hora timeline merge: cannot write '{nowhere}': Not a directory" in err


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_plot_draws_steps_from_the_middle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    timeline = tl.load(_write(tmp_path, _job()))
    window = choose_window(timeline, steps=3)
    # 9 complete steps; the middle 3 are steps 4..6 (index 3), between OPTIMIZER_STEP ends.
    assert (window.steps, window.first_step) == (3, 3)
    assert window.start_us == T0 + 3 * STEP + 37 * MS
    assert window.end_us - window.start_us == 3 * STEP
    out = tmp_path / "steps.png"
    assert plot(timeline, out, steps=3) == window
    width, height = _png_size(out)
    assert width > 800 and height > 400

    assert cli.main(["timeline", "plot", str(tmp_path / "timeline.json"), "-o", str(out)]) == 0
    assert "steps 4 to 6, 150.0 ms, 3 rank(s)" in capsys.readouterr().out


def test_plot_without_steps_draws_the_whole_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    timeline = tl.load(_write(tmp_path, _job(training=False, steps=2)))
    window = plot(timeline, tmp_path / "all.png", steps=3)
    assert window.steps == 0
    assert window.start_us == T0 + 2 * MS  # rank 0 submits 'a' first
    assert _png_size(tmp_path / "all.png")[0] > 800


def test_plot_without_matplotlib_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, _job(steps=3))
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import raises ImportError
    assert cli.main(["timeline", "plot", str(path), "-o", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err
    assert INSTALL_HINT in err and "pip install 'hora[plot]'" in err
    assert err.strip().splitlines() == [f"hora timeline plot: {INSTALL_HINT}"]
    assert not (tmp_path / "x.png").exists()
