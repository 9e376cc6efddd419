"""The benchmarks' charts (benchmarks/charts.py), each drawn from a small fixed result in the
shape its benchmark writes with ``--json``, and what a chart does without matplotlib."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def benchmark_module(name: str) -> ModuleType:
    """benchmarks/<name>.py, loaded from its file (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where dataclasses look their module up
    spec.loader.exec_module(module)
    return module


charts = benchmark_module("charts")

pytestmark = pytest.mark.timeout(60)

MIB = 1024 * 1024
FACTS = {
    "date": "2025-01-01 12:00 UTC",
    "machine": "2 CPUs (a test CPU), Linux, Python 3.11",
    "hora_version": "0.1.0",
    "hora_revision": "abc1234",
    "torch_version": "2.13.0+cpu",
    "load_before": [1.2, 1.0, 0.9],
    "load_after": [1.9, 1.3, 1.0],
}


def training_results() -> dict[str, Any]:
    def model(name: str, ratio: float, blocks: list[float]) -> dict[str, Any]:
        return {
            "model": name,
            "parameters": 1_863_690,
            "parameter_tensors": 6,
            "ratio": ratio,
            "ratio_blocks": blocks,
        }

    return {
        **FACTS,
        "world_size": 2,
        "device": "cpu",
        "ddp_backend": "gloo",
        "goal": 1.05,
        "iters": 40,
        "block": 10,
        "warmup": 5,
        "batch_size": None,
        "models": [
            model("mlp", 1.02, [0.97, 1.01, 1.04, 1.08]),
            model("resnet", 0.96, [0.93, 0.95, 0.97, 1.0]),
        ],
    }


def bandwidth_results(with_mpi: bool) -> dict[str, Any]:
    rows = []
    for nbytes, hora_s, raw_s in [(MIB, 0.001, 0.0012), (16 * MIB, 0.010, 0.016)]:
        row = {
            "bytes": nbytes,
            "hora_busbw_GBps": nbytes / hora_s / 1e9,
            "raw_busbw_GBps": nbytes / raw_s / 1e9,
            "hora_samples_s": [hora_s * 0.9, hora_s, hora_s * 1.2],
            "raw_samples_s": [raw_s * 0.95, raw_s, raw_s * 1.1],
        }
        if with_mpi:
            row.update(mpi_busbw_GBps=nbytes / 0.0008 / 1e9, mpi_samples_s=[0.0008, 0.0009])
        rows.append(row)
    return {**FACTS, "world_size": 2, "data_path": "shm", "allreduce_bandwidth": rows}


def zero_jobs() -> list[dict[str, Any]]:
    def mode(state_mib: float, rss_mib: float, step_s: float) -> dict[str, Any]:
        return {
            "state_bytes": state_mib * MIB,
            "peak_rss_bytes": rss_mib * MIB,
            "step_s": step_s,
            "step_s_range": [step_s * 0.9, step_s * 1.1],
        }

    def job(ranks: int) -> dict[str, Any]:
        row: dict[str, Any] = {"model": "10m", "parameters": 10_500_000}
        row["hora"] = mode(80, 600, 0.108)
        for name in ("zero1", "zero2", "zero2-overlap", "torch-zero"):
            row[name] = mode(80 / ranks, 520, 0.100)
        return {
            **FACTS,
            "world_size": ranks,
            "batch_size": 16,
            "reps": 3,
            "steps": 3,
            "modes": ["hora", "zero1", "zero2", "zero2-overlap", "torch-zero"],
            "models": [row],
        }

    return [job(2), job(4)]


def elastic_results() -> dict[str, Any]:
    launched = 1000.0
    events: list[dict[str, Any]] = []
    for worker in (0, 1, 2):
        events.append(
            {
                "t": 1006.0,
                "event": "joined",
                "worker": worker,
                "rank": worker,
                "size": 3,
                "round": 0,
            }
        )
        for step in range(1, 21):
            events.append(
                {
                    "t": 1006.1 + step * 0.01,
                    "event": "step",
                    "step": step,
                    "worker": worker,
                    "rank": worker,
                    "size": 3,
                    "round": 0,
                }
            )
    events.append({"t": 1006.31, "event": "killed", "worker": 2, "rank": 2, "round": 0})
    for worker in (0, 1):
        events.append(
            {
                "t": 1006.55,
                "event": "joined",
                "worker": worker,
                "rank": worker,
                "size": 2,
                "round": 1,
            }
        )
        for step in range(21, 41):
            events.append(
                {
                    "t": 1006.4 + step * 0.01,
                    "event": "step",
                    "step": step,
                    "worker": worker,
                    "rank": worker,
                    "size": 2,
                    "round": 1,
                }
            )
    job = {
        "recovery_s": 0.30,
        "job_s": 7.5,
        "launched": launched,
        "events": events,
        "driver": ["horarun: round 1: 2 workers on 2 hosts, reason: rank 2 was killed by SIGKILL"],
    }
    return {
        **FACTS,
        "np": 3,
        "steps": 40,
        "kill_at": 20,
        "killed_rank": 2,
        "commit_every": 5,
        "samples": {"hora": [job], "torchrun": []},
        "medians": {"torchrun": {"recovery_s": 3.8}},
    }


CHARTS: dict[str, Callable[[str], bool]] = {
    "training": lambda path: charts.training_vs_ddp(training_results(), path),
    "bandwidth": lambda path: charts.bandwidth_by_size(
        bandwidth_results(False),
        [("hora", "hora_busbw_GBps", "hora_samples_s"), ("raw", "raw_busbw_GBps", "raw_samples_s")],
        path,
    ),
    "bandwidth with mpi4py": lambda path: charts.bandwidth_by_size(
        bandwidth_results(True),
        [
            ("hora", "hora_busbw_GBps", "hora_samples_s"),
            ("raw", "raw_busbw_GBps", "raw_samples_s"),
            ("mpi4py", "mpi_busbw_GBps", "mpi_samples_s"),
        ],
        path,
    ),
    "zero": lambda path: charts.zero_modes(zero_jobs(), path),
    "elastic": lambda path: charts.elastic_rounds(elastic_results(), path),
}


@pytest.mark.parametrize("name", list(CHARTS))
def test_a_chart_is_written_as_a_png(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    image = pytest.importorskip("matplotlib.image")
    path = tmp_path / "chart.png"
    assert CHARTS[name](str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = image.imread(path).shape[:2]
    assert width > 500 and height > 300
    assert capsys.readouterr().out == f"chart: wrote {path}\n"


def test_without_matplotlib_a_chart_is_skipped_with_the_extra_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import raises ImportError
    path = tmp_path / "chart.png"
    assert not charts.training_vs_ddp(training_results(), str(path))
    assert not path.exists()
    assert capsys.readouterr().out == (
        f"chart skipped ({path}): matplotlib is not installed. Install it "
        "(pip install 'hora[plot]') and run the benchmark again for the chart.\n"
    )


def test_the_elastic_chart_draws_the_median_job() -> None:
    jobs = [{"recovery_s": s, "events": [{}]} for s in (0.5, 0.2, 0.3, 0.9)]
    assert charts.median_job(jobs) == jobs[2]
    assert charts.median_job([{"recovery_s": 1.0, "events": []}]) is None


def test_worker_spans_follow_a_survivor_through_two_rounds() -> None:
    events = elastic_results()["samples"]["hora"][0]["events"]
    spans = charts.worker_spans(events, "0", launched=1000.0)
    assert [(kind, number) for kind, _, _, number in spans] == [
        ("start", 0),
        ("train", 0),
        ("gap", 1),
        ("train", 1),
    ]
    assert spans[0][1] == 0.0 and spans[0][2] == pytest.approx(6.0)
    assert spans[2][1] == pytest.approx(6.3) and spans[2][2] == pytest.approx(6.55)
    assert charts.worker_rows(events) == ["0", "1", "2"]
    assert charts.round_facts(events) == {0: (3, 1, 20), 1: (2, 21, 40)}


def test_block_ratios_pair_adjacent_blocks() -> None:
    training = benchmark_module("training")
    hora = [1.0, 1.0, 2.0, 2.0, 1.0]
    ddp = [2.0, 2.0, 2.0, 2.0, 0.5]
    assert training.block_ratios(hora, ddp, block=2) == [2.0, 1.0, 0.5]


def test_elastic_events_parse_into_fields() -> None:
    elastic = benchmark_module("elastic_recovery")
    text = (
        "12.5 step step 3 worker 41 rank 0 size 3 round 0\n13.0 killed worker 41 rank 2 round 0\n"
    )
    assert elastic.parse_events(text) == [
        {"t": 12.5, "event": "step", "step": 3, "worker": 41, "rank": 0, "size": 3, "round": 0},
        {"t": 13.0, "event": "killed", "worker": 41, "rank": 2, "round": 0},
    ]
