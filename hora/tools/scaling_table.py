"""The scaling table: speedup and efficiency from measured throughputs, as text, CSV and PNG.

This module owns the table's arithmetic and its three forms: aligned text for the terminal,
``scaling.csv`` under :data:`CSV_COLUMNS`, and ``scaling.png`` (throughput and efficiency against
workers, one line per model, with matplotlib when it is installed). It knows measurements, not how
they were taken: :mod:`hora.tools.scaling` runs the jobs and fills them in.

The table is of weak scaling, as Horovod's: the batch size is per worker, so ``np`` workers train
on ``np`` times the samples per step. Speedup is total throughput over that of the smallest world
size measured for the model; efficiency is speedup over the growth in workers (per-worker
throughput over the smallest world size's), 100% at the smallest world size by definition.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hora.common.vocabulary import safe_files

RESULT_FORMAT = 1  # the benchmark's --json layout this module reads
# A throughput whose 95% interval exceeds this share of it is reported as noisy.
NOISY_INTERVAL = 0.25

CSV_COLUMNS = (
    "model",
    "unit",
    "workers",
    "threads_per_worker",
    "batch_size",
    "batches_per_iter",
    "seconds_per_iter",
    "batch_time_ms",
    "throughput_total",
    "throughput_total_ci95",
    "throughput_per_worker",
    "speedup",
    "efficiency_percent",
    "communication_share_percent",
)


@dataclass(frozen=True)
class Measurement:
    """One job's figures, as the benchmark measured them on rank 0.

    Attributes:
        model: the benchmark's model name.
        unit: what the throughput counts (``img`` or ``samples``).
        workers: the job's world size.
        batch_size: per worker.
        batches_per_iter: batches in one timed iteration.
        seconds_per_iter: mean time of one timed iteration.
        throughput_total: samples per second over all workers (mean of the iterations).
        throughput_total_ci95: half-width of its 95% interval (1.96 standard deviations).
        threads_per_worker: torch's intra-op threads in each worker (the benchmark shares a
            host's cores among its workers); 0 when not known.
        communication_share: fraction of the job's time spent communicating, from its timeline;
            ``None`` when not measured.
    """

    model: str
    unit: str
    workers: int
    batch_size: int
    batches_per_iter: int
    seconds_per_iter: float
    throughput_total: float
    throughput_total_ci95: float
    threads_per_worker: int = 0
    communication_share: float | None = None

    @classmethod
    def from_result(
        cls, result: dict[str, Any], communication_share: float | None = None
    ) -> Measurement:
        """Read the benchmark's ``--json`` result.

        Raises:
            ValueError: the result is not in a layout this hora knows.
        """
        if result.get("format") != RESULT_FORMAT:
            raise ValueError(
                f"result format {result.get('format')!r}, expected {RESULT_FORMAT}: the benchmark "
                "and hora bench come from different hora versions"
            )
        seconds = [float(s) for s in result["seconds_per_iter"]]
        return cls(
            model=str(result["model"]),
            unit=str(result["unit"]),
            workers=int(result["workers"]),
            batch_size=int(result["batch_size"]),
            batches_per_iter=int(result["num_batches_per_iter"]),
            seconds_per_iter=sum(seconds) / len(seconds),
            throughput_total=float(result["rate_total_mean"]),
            throughput_total_ci95=float(result["rate_total_interval"]),
            threads_per_worker=int(result.get("threads_per_worker", 0)),
            communication_share=communication_share,
        )


@dataclass(frozen=True)
class Row:
    """One line of the table: a measurement compared with its model's smallest world size.

    Attributes:
        measurement: the job's figures.
        baseline_workers: the smallest world size measured for this model.
        speedup: total throughput over the baseline's.
        efficiency: speedup over ``workers / baseline_workers`` (1.0 is perfect scaling).
    """

    measurement: Measurement
    baseline_workers: int
    speedup: float
    efficiency: float

    @property
    def throughput_per_worker(self) -> float:
        return self.measurement.throughput_total / self.measurement.workers

    @property
    def batch_time_ms(self) -> float:
        return 1000.0 * self.measurement.seconds_per_iter / self.measurement.batches_per_iter


def scaling_rows(measurements: Sequence[Measurement]) -> list[Row]:
    """Speedup and efficiency of each measurement against its model's smallest world size.

    Models keep the order in which they first appear; within a model, rows go by world size.

    Example:
        >>> one = Measurement("mlp", "samples", 1, 32, 8, 1.0, 100.0, 2.0)
        >>> two = Measurement("mlp", "samples", 2, 32, 8, 1.25, 160.0, 4.0)
        >>> [(r.speedup, r.efficiency) for r in scaling_rows([two, one])]
        [(1.0, 1.0), (1.6, 0.8)]

    Raises:
        ValueError: two measurements of one model at one world size, or a throughput that is
            not positive.
    """
    by_model: dict[str, list[Measurement]] = {}
    for measurement in measurements:
        if not measurement.throughput_total > 0:
            raise ValueError(
                f"{measurement.model} at np={measurement.workers}: throughput "
                f"{measurement.throughput_total} is not positive"
            )
        by_model.setdefault(measurement.model, []).append(measurement)
    rows = []
    for model, group in by_model.items():
        group.sort(key=lambda m: m.workers)
        for first, second in zip(group, group[1:]):
            if first.workers == second.workers:
                raise ValueError(f"{model} was measured twice at np={first.workers}")
        baseline = group[0]
        for measurement in group:
            speedup = measurement.throughput_total / baseline.throughput_total
            growth = measurement.workers / baseline.workers
            rows.append(Row(measurement, baseline.workers, speedup, speedup / growth))
    return rows


def _percent(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{100.0 * fraction:.1f}%"


def format_table(rows: Sequence[Row]) -> str:
    """The table as aligned text, one line per row, models separated by a blank line."""
    header = (
        "model",
        "workers",
        "threads",
        "iter (s)",
        "batch (ms)",
        "total/s",
        "per worker/s",
        "unit",
        "speedup",
        "efficiency",
        "comm share",
    )
    cells: list[tuple[str, ...]] = []
    for row in rows:
        m = row.measurement
        cells.append(
            (
                m.model,
                str(m.workers),
                str(m.threads_per_worker or "?"),
                f"{m.seconds_per_iter:.3f}",
                f"{row.batch_time_ms:.1f}",
                f"{m.throughput_total:.1f} ±{m.throughput_total_ci95:.1f}",
                f"{row.throughput_per_worker:.1f}",
                m.unit,
                f"{row.speedup:.2f}x",
                _percent(row.efficiency),
                _percent(m.communication_share),
            )
        )
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(header))]

    def render(line: tuple[str, ...]) -> str:
        # Text columns (model, unit) align left, figures right.
        parts = [
            value.ljust(width) if index in (0, 7) else value.rjust(width)
            for index, (value, width) in enumerate(zip(line, widths))
        ]
        return "  ".join(parts).rstrip()

    lines = [render(header)]
    previous = None
    for row, line in zip(rows, cells):
        if previous is not None and row.measurement.model != previous:
            lines.append("")
        previous = row.measurement.model
        lines.append(render(line))
    return "\n".join(lines)


def noisy_rows(rows: Sequence[Row], limit: float = NOISY_INTERVAL) -> list[Row]:
    """The rows whose throughput's 95% interval is wider than ``limit`` times the throughput."""
    return [
        row
        for row in rows
        if row.measurement.throughput_total_ci95 > limit * row.measurement.throughput_total
    ]


def noise_note(rows: Sequence[Row]) -> str | None:
    """A warning naming the noisy rows and what to do, or ``None`` when every row is steady."""
    noisy = noisy_rows(rows)
    if not noisy:
        return None
    named = ", ".join(
        f"{r.measurement.model} np={r.measurement.workers} "
        f"(±{100.0 * r.measurement.throughput_total_ci95 / r.measurement.throughput_total:.0f}%)"
        for r in noisy
    )
    return (
        f"Noisy: {named}. Their iterations ran at widely different speeds, so speedup and "
        "efficiency are uncertain. Other load on the machine is the usual cause: run the study "
        "on an otherwise idle machine, or with more --num-iters."
    )


def write_csv(rows: Sequence[Row], path: Path) -> None:
    """One line per row under :data:`CSV_COLUMNS`; an unmeasured communication share is empty."""
    with safe_files.create(path) as file:
        writer = csv.writer(file)
        writer.writerow(CSV_COLUMNS)
        for row in rows:
            m = row.measurement
            share = "" if m.communication_share is None else f"{100.0 * m.communication_share:.2f}"
            writer.writerow(
                (
                    m.model,
                    m.unit,
                    m.workers,
                    m.threads_per_worker or "",
                    m.batch_size,
                    m.batches_per_iter,
                    f"{m.seconds_per_iter:.6f}",
                    f"{row.batch_time_ms:.3f}",
                    f"{m.throughput_total:.3f}",
                    f"{m.throughput_total_ci95:.3f}",
                    f"{row.throughput_per_worker:.3f}",
                    f"{row.speedup:.4f}",
                    f"{100.0 * row.efficiency:.2f}",
                    share,
                )
            )


def plot(rows: Sequence[Row], path: Path, title: str) -> None:
    """Throughput and efficiency against workers, one line per model, as a PNG.

    Raises:
        ModuleNotFoundError: matplotlib is not installed.
    """
    # The object-oriented API without pyplot: no global figure state and no GUI backend.
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator

    figure = Figure(figsize=(11, 4.8), layout="constrained")
    throughput, efficiency = figure.subplots(1, 2)
    models = list(dict.fromkeys(row.measurement.model for row in rows))
    workers = sorted({row.measurement.workers for row in rows})
    colors = [f"C{i}" for i in range(len(models))]
    for model, color in zip(models, colors):
        mine = [row for row in rows if row.measurement.model == model]
        x = [row.measurement.workers for row in mine]
        base = mine[0].measurement
        throughput.errorbar(
            x,
            [row.measurement.throughput_total for row in mine],
            yerr=[row.measurement.throughput_total_ci95 for row in mine],
            marker="o",
            capsize=3,
            color=color,
            label=f"{model} ({base.unit}/s)",
        )
        throughput.plot(
            x,
            [base.throughput_total * w / base.workers for w in x],
            linestyle=":",
            color=color,
            alpha=0.6,
        )
        efficiency.plot(x, [100.0 * row.efficiency for row in mine], marker="o", color=color)
    efficiency.axhline(100.0, color="grey", linestyle="--", linewidth=1)
    highest = max(100.0 * row.efficiency for row in rows)
    efficiency.set_ylim(0, max(110.0, highest * 1.1))
    # Models differ by orders of magnitude, and linear scaling runs away from a flat line: a
    # log scale keeps every line readable once the plotted values span more than 8x.
    plotted = [row.measurement.throughput_total for row in rows]
    plotted += [r.measurement.throughput_total / r.efficiency for r in rows]  # the dotted lines
    if max(plotted) / min(plotted) > 8:
        throughput.set_yscale("log")
    else:
        throughput.set_ylim(bottom=0)
    for axes in (throughput, efficiency):
        if workers[-1] / workers[0] >= 8:
            axes.set_xscale("log", base=2)
        axes.xaxis.set_major_locator(FixedLocator(workers))
        axes.xaxis.set_minor_locator(NullLocator())
        axes.set_xticklabels([str(w) for w in workers])
        axes.set_xlabel("workers (np)")
        axes.grid(True, alpha=0.3)
    throughput.set_ylabel("total throughput per second")
    throughput.set_title("Throughput (dotted: linear scaling)")
    efficiency.set_ylabel("scaling efficiency (%)")
    efficiency.set_title("Scaling efficiency")
    # One legend for both panels, below them, so that it covers no line.
    figure.legend(loc="outside lower center", ncols=len(models))
    figure.suptitle(title)
    with safe_files.replacing(path) as file:
        figure.savefig(file, format=path.suffix.lstrip(".") or "png", dpi=110)
