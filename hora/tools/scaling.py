"""Scaling studies (``hora bench scaling``): the synthetic benchmark at several world sizes, as one
table of throughput, speedup, scaling efficiency and communication share.

This module owns the study: the jobs it runs, in order (one ``horarun`` per model and world size,
each run by :mod:`hora.tools.scaling_jobs`), following them with a progress bar, stopping at the
first failure, the report, and the command line. A job's figures and communication share come
from :mod:`hora.tools.scaling_jobs`; :mod:`hora.tools.scaling_table` turns them into the table,
the CSV and the plot. It never imports torch, so ``hora`` starts fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from hora.common.vocabulary import safe_files
from hora.tools.arguments import not_negative, positive
from hora.tools.scaling_jobs import (
    BENCHMARK_MODULE,
    TAIL_LINES,
    Job,
    ScalingError,
    StudySettings,
    communication_share,
    run_job,
)
from hora.tools.scaling_table import (
    Measurement,
    Row,
    format_table,
    noise_note,
    plot,
    scaling_rows,
    write_csv,
)

__all__ = [
    "BENCHMARK_MODULE",
    "CSV_NAME",
    "MODELS",
    "PLOT_NAME",
    "TAIL_LINES",
    "Job",
    "ScalingError",
    "StudySettings",
    "add_arguments",
    "add_parser",
    "communication_share",
    "main",
    "parse_world_sizes",
    "run_job",
    "run_study",
]

MODELS = ("mlp", "resnet", "transformer")
CSV_NAME = "scaling.csv"
PLOT_NAME = "scaling.png"

# Rank 0's lines (as horarun prefixes them) that show how far a job has got.
_PHASES = {"[0]<stdout>:Running warmup...": "warmup", "[0]<stdout>:Running benchmark...": "timing"}
_ITERATION = re.compile(r"^\[0\]<stdout>:Iter #(\d+): ([\d.]+) (\S+)/sec per worker$")


class _Progress:
    """The study's progress bar: one step per timed iteration of every job, on a terminal only;
    one line per finished job in any case."""

    def __init__(self, settings: StudySettings, jobs: int) -> None:
        from tqdm import tqdm

        self.iterations = settings.num_iters
        self.jobs = jobs
        self.done = 0  # iterations of the jobs that have finished
        # disable=None: a bar on a terminal, nothing in a log file or a pipe.
        self.bar: Any = tqdm(
            total=jobs * self.iterations,
            unit="iter",
            disable=None if settings.progress else True,
            file=sys.stderr,
            dynamic_ncols=True,
        )

    def start(self, index: int, job: Job) -> None:
        self.bar.set_description(f"[{index}/{self.jobs}] {job.model} np={job.workers}")
        self.bar.set_postfix_str("starting")

    def output(self, line: str) -> None:
        """Follow the job through rank 0's output."""
        if line in _PHASES:
            self.bar.set_postfix_str(_PHASES[line])
        elif match := _ITERATION.match(line):
            self.bar.update(self.done + int(match.group(1)) + 1 - self.bar.n)
            self.bar.set_postfix_str(f"{float(match.group(2)):.1f} {match.group(3)}/s per worker")

    def finish(self, job: Job, measurement: Measurement, seconds: float) -> None:
        self.done += self.iterations
        self.bar.update(self.done - self.bar.n)
        self.bar.write(
            f"hora bench scaling: {job.model} np={job.workers}: "
            f"{measurement.throughput_total:.1f} {measurement.unit}/s in {seconds:.0f} s",
            file=sys.stderr,
        )

    def close(self) -> None:
        self.bar.close()


def run_study(settings: StudySettings, out: TextIO | None = None) -> list[Row]:
    """Run every job, then print the table and write ``scaling.csv`` and ``scaling.png``.

    Returns:
        The table's rows.

    Raises:
        ScalingError: a job failed; the study stops there.
    """
    out = out if out is not None else sys.stdout
    safe_files.make_directories(settings.output_dir)
    jobs = [
        Job(model, workers, settings.output_dir)
        for model in settings.models
        for workers in settings.world_sizes
    ]
    measurements, notes = _measure(jobs, settings)
    rows = scaling_rows(measurements)
    _report(rows, notes, settings, out)
    return rows


def _measure(
    jobs: list[Job], settings: StudySettings
) -> tuple[list[Measurement], dict[str, list[str]]]:
    """Every job's figures, in order, and why a job's communication share is missing (each
    reason once, with the jobs it applies to)."""
    measurements = []
    notes: dict[str, list[str]] = {}
    progress = _Progress(settings, len(jobs))
    try:
        for index, job in enumerate(jobs, 1):
            progress.start(index, job)
            started = time.monotonic()
            measurement = run_job(job, settings, progress.output)
            share: float | None = None
            why: str | None = "not measured (--no-timeline)"
            if settings.timeline:
                share, why = communication_share(job.timeline_path)
            if why is not None:
                notes.setdefault(why, []).append(job.name)
            measurements.append(dataclasses.replace(measurement, communication_share=share))
            progress.finish(job, measurement, time.monotonic() - started)
    finally:
        progress.close()
    return measurements, notes


def _report(
    rows: list[Row], notes: dict[str, list[str]], settings: StudySettings, out: TextIO
) -> None:
    """Print the table with its caption, legend and notes; write the CSV and the plot."""
    csv_path = settings.output_dir / CSV_NAME
    write_csv(rows, csv_path)
    print(_caption(settings), file=out)
    print(file=out)
    print(format_table(rows), file=out)
    print(file=out)
    print(_legend(settings), file=out)
    noise = noise_note(rows)
    if noise is not None:
        print(noise, file=out)
    for why, names in notes.items():
        print(f"comm n/a for {', '.join(names)}: {why}.", file=out)
    print(f"Wrote {csv_path}", file=out)
    plot_path = settings.output_dir / PLOT_NAME
    try:
        plot(rows, plot_path, _plot_title(settings))
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("matplotlib"):
            raise
        print(
            f"No {PLOT_NAME}: matplotlib is not installed. Install it (pip install 'hora[plot]') "
            "and run the study again for the plot.",
            file=out,
        )
    else:
        print(f"Wrote {plot_path}", file=out)


def _caption(settings: StudySettings) -> str:
    where = settings.hosts or settings.hostfile or "this machine"
    threads = (
        f"{settings.threads_per_worker} thread(s) per worker"
        if settings.threads_per_worker is not None
        else "each host's cores shared among its workers"
    )
    return (
        f"hora bench scaling on {where}: synthetic benchmark, batch size {settings.batch_size} "
        f"per worker, {settings.num_iters} iterations of {settings.num_batches_per_iter} batches "
        f"after {settings.num_warmup_batches} warmup batches, {threads}"
    )


def _legend(settings: StudySettings) -> str:
    smallest = settings.world_sizes[0]
    comm = (
        "comm share: communication time over training-step time on all ranks, from each "
        "job's timeline (hora.tools.timeline; warmup steps included)."
        if settings.timeline
        else "comm share: not measured (--no-timeline)."
    )
    return (
        f"Speedup: total throughput over np={smallest}'s. Efficiency: speedup over "
        f"np/{smallest} (100% is linear scaling). total/s: mean ±95% interval.\n{comm}"
    )


def _plot_title(settings: StudySettings) -> str:
    import platform

    where = settings.hosts or settings.hostfile or platform.node()
    threads = (
        f", {settings.threads_per_worker} thread(s) per worker"
        if settings.threads_per_worker is not None
        else ""
    )
    return (
        f"hora synthetic benchmark on {where}: batch {settings.batch_size} per worker, "
        f"{settings.num_iters}x{settings.num_batches_per_iter} batches{threads}"
    )


def parse_world_sizes(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``: distinct, ascending, each at least 1.

    Raises:
        argparse.ArgumentTypeError: with what is wrong and an example.
    """
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of worker counts, such as 1,2,4"
        ) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give worker counts of at least 1, e.g. 1,2,4")
    return tuple(sorted(set(sizes)))


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 seconds")
    return value


def add_parser(studies: Any) -> argparse.ArgumentParser:
    """Add ``scaling`` to ``hora bench``'s subcommands (``studies``, from ``add_subparsers``)."""
    parser: argparse.ArgumentParser = studies.add_parser(
        "scaling",
        help="throughput, speedup and efficiency of the synthetic benchmark at several np",
        description="Run the synthetic benchmark (hora.tools.synthetic_benchmark, as "
        "examples/pytorch_synthetic_benchmark.py) through horarun for each model and world size, "
        f"then print the scaling table and write {CSV_NAME} and {PLOT_NAME} to --output-dir. "
        "Batch sizes are per worker (weak scaling). A failed job stops the study.",
        epilog="Example: hora bench scaling --np 1,2,4 --model resnet mlp --output-dir scaling",
    )
    add_arguments(parser)
    parser.set_defaults(handler=main)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hora bench scaling``'s flags."""
    defaults = StudySettings()
    _add_workload_arguments(parser, defaults)
    _add_where_arguments(parser, defaults)


# The counts each job runs with: the flags, the setting they set, its type and what it counts.
_COUNTS: tuple[tuple[tuple[str, ...], str, Callable[[str], int], str], ...] = (
    (("--batch-size",), "batch_size", positive, "batch size per worker"),
    (("--num-iters",), "num_iters", positive, "timed iterations per job"),
    (("--num-batches-per-iter",), "num_batches_per_iter", positive, "batches per timed iteration"),
    (
        ("--warmup", "--num-warmup-batches"),
        "num_warmup_batches",
        not_negative,
        "batches before timing starts",
    ),
)


def _add_workload_arguments(parser: argparse.ArgumentParser, defaults: StudySettings) -> None:
    """What each job runs: the world sizes, the models, the batches and iterations."""
    parser.add_argument(
        "--np",
        dest="world_sizes",
        type=parse_world_sizes,
        default=defaults.world_sizes,
        metavar="N,N,...",
        help="world sizes to run (default 1,2,4); speedup is relative to the smallest",
    )
    parser.add_argument(
        "--model",
        dest="models",
        nargs="+",
        choices=MODELS,
        default=list(defaults.models),
        help="models to run, one table section and one plotted line each (default resnet)",
    )
    for flags, dest, kind, what in _COUNTS:
        default = getattr(defaults, dest)
        parser.add_argument(
            *flags,
            dest=dest,
            type=kind,
            default=default,
            metavar="N",
            help=f"{what} (default {default})",
        )


def _add_where_arguments(parser: argparse.ArgumentParser, defaults: StudySettings) -> None:
    """Where the jobs run and write, and how the study follows them."""
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=defaults.output_dir,
        metavar="DIR",
        help=f"where {CSV_NAME}, {PLOT_NAME} and each job's log, result and timeline go "
        f"(default ./{defaults.output_dir})",
    )
    parser.add_argument(
        "--threads-per-worker",
        type=positive,
        default=None,
        metavar="N",
        help="torch threads in each worker; 1 makes each added worker add a core, as a GPU "
        "would (default: each host's cores shared among its workers, so np=1 uses them all)",
    )
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument(
        "-H", "--hosts", default=None, help="horarun -H: hosts and slots, e.g. node1:4,node2:4"
    )
    hosts.add_argument("--hostfile", default=None, help="horarun --hostfile")
    parser.add_argument(
        "--no-timeline",
        dest="timeline",
        action="store_false",
        help="do not record timelines (no communication share; no timeline overhead)",
    )
    parser.add_argument(
        "--job-timeout",
        type=_positive_seconds,
        default=defaults.job_timeout_s,
        metavar="SECONDS",
        help=f"stop the study when one job runs longer (default {defaults.job_timeout_s:g})",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    """Run ``hora bench scaling`` from its parsed flags; returns the exit status."""
    settings = StudySettings(
        world_sizes=tuple(args.world_sizes),
        models=tuple(dict.fromkeys(args.models)),
        batch_size=args.batch_size,
        num_iters=args.num_iters,
        num_batches_per_iter=args.num_batches_per_iter,
        num_warmup_batches=args.num_warmup_batches,
        output_dir=args.output_dir,
        threads_per_worker=args.threads_per_worker,
        hosts=args.hosts,
        hostfile=args.hostfile,
        timeline=args.timeline,
        job_timeout_s=args.job_timeout,
        progress=not args.no_progress,
    )
    try:
        run_study(settings)
    except ScalingError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hora bench scaling: interrupted; no table written.", file=sys.stderr)
        return 130
    return 0
