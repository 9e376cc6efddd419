"""Autotune's decisions: which settings it tries, in what order, and which one it keeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from hora.common.engine.autotune import Autotuner, Candidate, candidates
from hora.common.engine.steady.schedule import BUCKET_BYTES, FIRST_BUCKET_BYTES

MIB = 1024 * 1024


def test_the_default_comes_first_and_the_fusion_threshold_caps_the_rest() -> None:
    found = candidates(128 * MIB)
    assert found[0] == Candidate(FIRST_BUCKET_BYTES, BUCKET_BYTES)
    assert len(found) == len(set(found)) == 9
    capped = candidates(2 * MIB)
    assert all(c.bucket_bytes <= 2 * MIB and c.first_bucket_bytes <= 2 * MIB for c in capped)
    assert len(capped) == len(set(capped)) < len(found)


def _tune(tuner: Autotuner, step_s: dict[Candidate, float]) -> None:
    while not tuner.done:
        current = tuner.current
        local = tuner.step_finished(step_s[current])
        if local is not None:
            tuner.scored(local, local * 1.1)  # the slowest rank's median, as exchanged


def test_it_keeps_the_fastest_and_logs_every_trial(tmp_path: Path) -> None:
    log = tmp_path / "autotune.csv"
    tuner = Autotuner(128 * MIB, warmup=2, steps=3, log_path=str(log), rank=0)
    all_candidates = candidates(128 * MIB)
    fastest = all_candidates[4]
    times = {c: (0.010 if c == fastest else 0.020) for c in all_candidates}
    _tune(tuner, times)
    assert tuner.current == fastest
    assert len(tuner.trials) == len(all_candidates)
    rows = log.read_text().splitlines()
    assert rows[0].startswith("trial,first_batch_bytes,batch_bytes")
    assert len(rows) == 1 + len(all_candidates) + 1
    assert rows[-1].endswith(",chosen") and f",{fastest.bucket_bytes}," in rows[-1]
    assert "11.000" in rows[-1]  # the slowest rank's median of the chosen one, in ms


def test_ties_keep_the_default_and_only_rank_0_logs(tmp_path: Path) -> None:
    log = tmp_path / "rank1.csv"
    tuner = Autotuner(128 * MIB, warmup=0, steps=1, log_path=str(log), rank=1)
    _tune(tuner, {c: 0.01 for c in candidates(128 * MIB)})
    assert tuner.current == candidates(128 * MIB)[0]
    assert not log.exists()


def test_warmup_steps_are_not_measured() -> None:
    tuner = Autotuner(128 * MIB, warmup=2, steps=2)
    assert tuner.step_finished(9.0) is None and tuner.step_finished(9.0) is None
    assert tuner.step_finished(1.0) is None
    assert tuner.step_finished(3.0) == 2.0


def test_a_search_cut_short_logs_the_fastest_so_far_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "autotune.csv"
    tuner = Autotuner(128 * MIB, warmup=1, steps=2, log_path=str(log), rank=0)
    all_candidates = candidates(128 * MIB)
    times = {all_candidates[0]: 0.030, all_candidates[1]: 0.010}
    while len(tuner.trials) < 2:
        local = tuner.step_finished(times[tuner.current])
        if local is not None:
            tuner.scored(local, local)
    with caplog.at_level("WARNING", logger="hora"):
        tuner.end()
    rows = log.read_text().splitlines()
    assert rows[-1].endswith(",best-so-far") and f",{all_candidates[1].bucket_bytes}," in rows[-1]
    assert "10.000" in rows[-1]
    assert "autotune did not finish" in caplog.text and "2 of 9 settings" in caplog.text
    assert "HORA_AUTOTUNE_STEPS_PER_SAMPLE" in caplog.text
    tuner.end()  # a second end (hvd.shutdown, then exit) writes nothing more
    assert log.read_text().splitlines() == rows


def test_a_finished_search_ends_quietly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tuner = Autotuner(128 * MIB, warmup=0, steps=1, log_path=str(tmp_path / "a.csv"), rank=0)
    _tune(tuner, {c: 0.01 for c in candidates(128 * MIB)})
    with caplog.at_level("WARNING", logger="hora"):
        tuner.end()
    assert "autotune" not in caplog.text
