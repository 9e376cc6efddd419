"""``hora bench scaling``'s arithmetic and reports: speedup, efficiency, the table and the CSV."""

from __future__ import annotations

import argparse
import csv
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from hora.cli import build_parser
from hora.tools.scaling import communication_share, parse_world_sizes
from hora.tools.scaling_table import (
    CSV_COLUMNS,
    Measurement,
    format_table,
    noise_note,
    noisy_rows,
    scaling_rows,
    write_csv,
)

pytestmark = pytest.mark.timeout(30)


def _measure(model: str, workers: int, total: float, share: float | None = None) -> Measurement:
    return Measurement(
        model=model,
        unit="img",
        workers=workers,
        batch_size=32,
        batches_per_iter=8,
        seconds_per_iter=32 * 8 * workers / total if total else float("inf"),
        throughput_total=total,
        throughput_total_ci95=0.05 * total,
        communication_share=share,
    )


def test_speedup_and_efficiency_are_relative_to_the_smallest_world_size() -> None:
    totals = {1: 100.0, 2: 180.0, 4: 300.0}
    rows = scaling_rows([_measure("resnet", n, t) for n, t in totals.items()])
    assert [r.measurement.workers for r in rows] == [1, 2, 4]
    for row in rows:
        n = row.measurement.workers
        assert row.baseline_workers == 1
        assert row.speedup == pytest.approx(totals[n] / totals[1])
        assert row.efficiency == pytest.approx(totals[n] / (n * totals[1]))
        assert row.throughput_per_worker == pytest.approx(totals[n] / n)
    assert rows[0].speedup == 1.0 and rows[0].efficiency == 1.0
    # Perfect weak scaling doubles the throughput with the workers: efficiency 100%.
    perfect = scaling_rows([_measure("mlp", 1, 50.0), _measure("mlp", 2, 100.0)])
    assert perfect[1].efficiency == pytest.approx(1.0)


def test_the_baseline_is_the_smallest_world_size_measured_per_model() -> None:
    rows = scaling_rows(
        [
            _measure("mlp", 8, 640.0),
            _measure("resnet", 1, 10.0),
            _measure("mlp", 2, 200.0),
            _measure("resnet", 2, 15.0),
        ]
    )
    # Models keep their first appearance's order; rows go by world size within a model.
    assert [(r.measurement.model, r.measurement.workers) for r in rows] == [
        ("mlp", 2),
        ("mlp", 8),
        ("resnet", 1),
        ("resnet", 2),
    ]
    mlp2, mlp8, resnet1, resnet2 = rows
    assert mlp2.baseline_workers == 2 and mlp2.efficiency == 1.0
    assert mlp8.speedup == pytest.approx(3.2)
    assert mlp8.efficiency == pytest.approx(3.2 / 4)
    assert resnet1.efficiency == 1.0
    assert resnet2.efficiency == pytest.approx(0.75)


def test_batch_time_is_the_iteration_time_over_its_batches() -> None:
    (row,) = scaling_rows([_measure("mlp", 1, 256.0)])
    assert row.measurement.seconds_per_iter == pytest.approx(1.0)
    assert row.batch_time_ms == pytest.approx(1000.0 / 8)


def test_a_world_size_measured_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="mlp was measured twice at np=2"):
        scaling_rows([_measure("mlp", 2, 10.0), _measure("mlp", 2, 11.0)])


def test_a_throughput_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="mlp at np=2: throughput 0.0 is not positive"):
        scaling_rows([_measure("mlp", 1, 10.0), _measure("mlp", 2, 0.0)])


def _result(**changes: Any) -> dict[str, Any]:
    """A result as the benchmark's --json writes it."""
    result = {
        "format": 1,
        "model": "resnet",
        "unit": "img",
        "workers": 2,
        "batch_size": 16,
        "num_batches_per_iter": 4,
        "seconds_per_iter": [0.5, 0.7, 0.6],
        "rate_per_worker_mean": 107.0,
        "rate_total_mean": 214.0,
        "rate_total_interval": 12.5,
        "threads_per_worker": 3,
    }
    result.update(changes)
    return result


def test_a_measurement_reads_the_benchmark_result() -> None:
    m = Measurement.from_result(_result(), communication_share=0.25)
    assert (m.model, m.unit, m.workers, m.batch_size, m.batches_per_iter) == (
        "resnet",
        "img",
        2,
        16,
        4,
    )
    assert m.seconds_per_iter == pytest.approx(0.6)
    assert (m.throughput_total, m.throughput_total_ci95) == (214.0, 12.5)
    assert m.communication_share == 0.25
    assert m.threads_per_worker == 3


def test_a_result_of_another_format_is_refused() -> None:
    with pytest.raises(ValueError, match="result format 2, expected 1"):
        Measurement.from_result(_result(format=2))


def test_the_csv_has_one_row_per_measurement_under_the_documented_columns(
    tmp_path: Path,
) -> None:
    rows = scaling_rows(
        [_measure("mlp", 1, 100.0, share=0.0), _measure("mlp", 2, 150.0, share=0.125)]
        + [_measure("resnet", 1, 20.0), _measure("resnet", 2, 38.0)]
    )
    path = tmp_path / "scaling.csv"
    write_csv(rows, path)
    with path.open(newline="") as file:
        reader = csv.DictReader(file)
        assert tuple(reader.fieldnames or ()) == CSV_COLUMNS
        lines = list(reader)
    assert [(line["model"], int(line["workers"])) for line in lines] == [
        ("mlp", 1),
        ("mlp", 2),
        ("resnet", 1),
        ("resnet", 2),
    ]
    for line, row in zip(lines, rows):
        assert float(line["throughput_total"]) == pytest.approx(row.measurement.throughput_total)
        assert float(line["throughput_per_worker"]) == pytest.approx(row.throughput_per_worker)
        assert float(line["speedup"]) == pytest.approx(row.speedup, abs=1e-4)
        assert float(line["efficiency_percent"]) == pytest.approx(100 * row.efficiency, abs=0.01)
    assert [line["communication_share_percent"] for line in lines] == ["0.00", "12.50", "", ""]
    assert float(lines[3]["efficiency_percent"]) == pytest.approx(95.0)


def test_the_text_table_shows_each_row_and_marks_an_unmeasured_share() -> None:
    rows = scaling_rows([_measure("mlp", 1, 100.0, share=0.1), _measure("mlp", 4, 300.0)])
    table = format_table(rows).splitlines()
    assert table[0].split()[:2] == ["model", "workers"]
    first, second = (line.split() for line in table[1:])
    assert first[:2] == ["mlp", "1"] and second[:2] == ["mlp", "4"]
    assert first[-3:] == ["1.00x", "100.0%", "10.0%"]
    assert second[-3:] == ["3.00x", "75.0%", "n/a"]


@pytest.mark.parametrize(
    ("text", "sizes"), [("1,2,4", (1, 2, 4)), ("4,1,2,2", (1, 2, 4)), ("8", (8,))]
)
def test_world_sizes_are_distinct_and_ascending(text: str, sizes: tuple[int, ...]) -> None:
    assert parse_world_sizes(text) == sizes


@pytest.mark.parametrize(
    ("text", "message"),
    [("1,two", "not a comma-separated list"), ("0,2", "at least 1"), (",", "at least 1")],
)
def test_bad_world_sizes_say_what_to_give(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse_world_sizes(text)


def test_the_hora_command_parses_a_scaling_study() -> None:
    args = build_parser().parse_args(
        ["bench", "scaling", "--np", "2,1", "--model", "mlp", "resnet", "--warmup", "0"]
        + ["--num-iters", "3", "-H", "localhost:2", "--output-dir", "out", "--no-timeline"]
    )
    assert args.world_sizes == (1, 2)
    assert args.models == ["mlp", "resnet"]
    assert (args.num_warmup_batches, args.num_iters, args.hosts) == (0, 3, "localhost:2")
    assert args.output_dir == Path("out") and args.timeline is False
    assert args.handler.__module__ == "hora.tools.scaling"


def test_the_hora_command_refuses_a_zero_batch_size(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "scaling", "--batch-size", "0"])
    assert "--batch-size: '0': must be at least 1" in capsys.readouterr().err


def test_rows_with_a_wide_interval_are_called_noisy() -> None:
    steady = _measure("mlp", 1, 100.0)  # ±5%
    noisy = dataclasses.replace(_measure("mlp", 2, 150.0), throughput_total_ci95=60.0)
    rows = scaling_rows([steady, noisy])
    assert [r.measurement.workers for r in noisy_rows(rows)] == [2]
    note = noise_note(rows)
    assert note is not None and note.startswith("Noisy: mlp np=2 (±40%).")
    assert "more --num-iters" in note
    assert noise_note(rows[:1]) is None


def test_a_missing_timeline_gives_no_share_and_says_why(tmp_path: Path) -> None:
    share, why = communication_share(tmp_path / "mlp-np2.timeline.json")
    assert share is None
    assert why is not None and f"the job wrote no timeline at {tmp_path}" in why


def test_a_timeline_without_steps_gives_no_share_and_says_why(tmp_path: Path) -> None:
    path = tmp_path / "mlp-np2.timeline.json"
    path.write_text(
        '[\n{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0"}}\n]\n'
    )
    share, why = communication_share(path)
    assert share is None
    assert why is not None and why.startswith(f"{path} gives no communication share: ")
