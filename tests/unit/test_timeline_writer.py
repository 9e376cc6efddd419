"""The timeline writer and its file-level helpers (format: docs/timeline-format.md)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from hora.common.vocabulary import timeline_writer as tl


def test_a_closed_timeline_is_one_valid_json_array(tmp_path: Path) -> None:
    writer = tl.Timeline(tmp_path / "t.json", rank=0)
    row = writer.row("allreduce.grad.w")
    assert writer.row("allreduce.grad.w") == row and row >= 2
    start = writer.now()
    assert abs(start / 1e6 - time.time()) < 5
    writer.complete(row, "ALLREDUCE", start, start + 250, '{"batch":1,"tensors":1,"bytes":40}')
    writer.instant(tl.ENGINE_ROW, "CYCLE_START")
    writer.close()
    writer.complete(row, "ALLREDUCE", start, start + 1)  # after close: dropped
    events = json.loads((tmp_path / "t.json").read_text())
    names = {(e["name"], e.get("args", {}).get("name")) for e in events if e["ph"] == "M"}
    assert ("thread_name", "allreduce.grad.w") in names and ("process_name", "rank 0") in names
    (collective,) = [e for e in events if e["ph"] == "X"]
    assert collective["dur"] == 250 and collective["tid"] == row and collective["pid"] == 0
    assert collective["args"] == {"batch": 1, "tensors": 1, "bytes": 40}
    assert [e["name"] for e in events if e["ph"] == "i"] == ["CYCLE_START"]


def test_a_file_whose_writer_died_is_still_readable(tmp_path: Path) -> None:
    writer = tl.Timeline(tmp_path / "t.json", rank=3)
    writer.complete(tl.TRAINING_ROW, "BACKWARD", 10, 20)
    writer.flush()
    # The process dies here: no closing ']', and a half-written line at the end.
    with open(writer.file_path, "a", encoding="utf-8") as file:
        file.write('{"name":"ALLRED')
    events = tl.read_events(writer.file_path)
    assert [e["name"] for e in events if e["ph"] == "X"] == ["BACKWARD"]
    assert writer.file_path.name == "t.rank3.json"


def test_rank_files_and_merge(tmp_path: Path) -> None:
    base = tmp_path / "trace.json"
    assert tl.rank_path(base, 0) == base
    assert tl.rank_path(tmp_path / "trace", 2) == tmp_path / "trace.rank2"
    for rank in range(3):
        writer = tl.Timeline(base, rank)
        writer.complete(tl.TRAINING_ROW, "OPTIMIZER_STEP", 100 * rank, 100 * rank + 5)
        writer.close()
    (tmp_path / "trace.rankx.json").write_text("[]")  # not a rank file
    assert [r for r, _ in tl.rank_files(base)] == [0, 1, 2]
    assert not tl.merge(base, range(4))  # rank 3 missing: nothing changes
    assert tl.rank_path(base, 1).exists()
    assert tl.merge(base, range(3))
    events = json.loads(base.read_text())
    assert sorted(e["pid"] for e in events if e["name"] == "OPTIMIZER_STEP") == [0, 1, 2]
    assert [r for r, _ in tl.rank_files(base)] == [0]
