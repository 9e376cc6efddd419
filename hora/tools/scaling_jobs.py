"""One job of a scaling study (``hora bench scaling``): the synthetic benchmark at one world size.

This module owns what a study runs and reads back: :class:`StudySettings`, the :class:`Job` of one
model at one world size (its ``horarun`` command running :mod:`hora.tools.synthetic_benchmark`, its
environment, the files it writes), :func:`run_job` (run it, keep its log, stop it past the
timeout, read its figures from the benchmark's ``--json`` file) and :func:`communication_share`
(from :mod:`hora.tools.timeline`'s summary of the timeline the job wrote). It does not know the
study's order, progress bar, table or command line (:mod:`hora.tools.scaling` does), and never
imports torch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hora.common.vocabulary import safe_files
from hora.common.vocabulary.settings_table import TIMELINE
from hora.tools import timeline
from hora.tools.scaling_table import Measurement

BENCHMARK_MODULE = "hora.tools.synthetic_benchmark"


TAIL_LINES = 25


class ScalingError(RuntimeError):
    """The study cannot go on; the message says which job and what to do."""


@dataclass(frozen=True)
class StudySettings:
    """What ``hora bench scaling`` runs and where it writes.

    Attributes:
        world_sizes: the ``np`` of each job, ascending.
        models: the benchmark's models, in the table's order.
        batch_size: per worker.
        num_iters: timed iterations per job.
        num_batches_per_iter: batches per timed iteration.
        num_warmup_batches: batches before timing starts.
        output_dir: where the table, the plot and each job's files go.
        threads_per_worker: torch threads in each worker; ``None`` lets the benchmark share
            each host's cores among its workers.
        hosts: ``horarun -H`` (``None``: this machine).
        hostfile: ``horarun --hostfile``.
        timeline: record each job's timeline to measure its communication share.
        job_timeout_s: a job running longer is stopped and the study fails.
        progress: show a progress bar on a terminal.
    """

    world_sizes: tuple[int, ...] = (1, 2, 4)
    models: tuple[str, ...] = ("resnet",)
    batch_size: int = 32
    num_iters: int = 10
    num_batches_per_iter: int = 8
    num_warmup_batches: int = 5
    output_dir: Path = Path("hora-scaling")
    threads_per_worker: int | None = None
    hosts: str | None = None
    hostfile: str | None = None
    timeline: bool = True
    job_timeout_s: float = 900.0
    progress: bool = True


@dataclass(frozen=True)
class Job:
    """One run of the benchmark: a model at a world size, and the files it writes."""

    model: str
    workers: int
    output_dir: Path

    @property
    def name(self) -> str:
        return f"{self.model}-np{self.workers}"

    @property
    def result_path(self) -> Path:
        return self.output_dir / f"{self.name}.result.json"

    @property
    def timeline_path(self) -> Path:
        return self.output_dir / f"{self.name}.timeline.json"

    @property
    def log_path(self) -> Path:
        return self.output_dir / f"{self.name}.log"

    def command(self, settings: StudySettings) -> list[str]:
        """``horarun`` running the benchmark, both under this Python."""
        launcher = [sys.executable, "-m", "hora.runner.launch", "-np", str(self.workers)]
        if settings.hostfile is not None:
            launcher += ["--hostfile", settings.hostfile]
        elif settings.hosts is not None:
            launcher += ["-H", settings.hosts]
        return [
            *launcher,
            sys.executable,
            "-m",
            BENCHMARK_MODULE,
            *("--model", self.model, "--batch-size", str(settings.batch_size)),
            *("--num-warmup-batches", str(settings.num_warmup_batches)),
            *("--num-batches-per-iter", str(settings.num_batches_per_iter)),
            *("--num-iters", str(settings.num_iters)),
            *("--json", str(self.result_path.resolve())),
            *(
                ["--threads-per-worker", str(settings.threads_per_worker)]
                if settings.threads_per_worker is not None
                else []
            ),
        ]

    def environment(self, settings: StudySettings) -> dict[str, str]:
        """This environment, with the job's timeline (or none) and this hora importable."""
        env = dict(os.environ)
        for name in TIMELINE.environ_names:
            env.pop(name, None)
        if settings.timeline:
            env[TIMELINE.env] = str(self.timeline_path.resolve())
        # The workers import the hora that runs this study, even from a checkout that is not
        # installed (python -m puts only the working folder on sys.path).
        package_root = Path(__file__).resolve().parents[2]
        if package_root.name not in ("site-packages", "dist-packages"):
            path = [str(package_root), env.get("PYTHONPATH", "")]
            env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
        return env

    def remove_outputs(self) -> None:
        """Delete what an earlier run of this job left, so that nothing stale is read."""
        timeline = self.timeline_path
        stale = [self.result_path, self.log_path, timeline]
        stale += timeline.parent.glob(f"{timeline.stem}.rank*{timeline.suffix}")
        for path in stale:
            path.unlink(missing_ok=True)


def _stop(process: subprocess.Popen[str], grace_s: float = 20.0) -> None:
    """End ``horarun``: SIGTERM lets it stop its workers; SIGKILL if it does not in time."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_job(job: Job, settings: StudySettings, on_output: Callable[[str], None]) -> Measurement:
    """Run ``job`` through ``horarun``; its output goes to ``job.log_path``.

    Args:
        job: the model and world size.
        settings: the study's settings.
        on_output: called with each line of the job's output as it comes (for progress only:
            the figures come from the result file).

    Returns:
        The job's figures, without the communication share.

    Raises:
        ScalingError: the job failed, ran past the timeout, or wrote no usable result.
    """
    job.remove_outputs()
    command = job.command(settings)
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    timed_out = threading.Event()

    def expire() -> None:
        timed_out.set()
        _stop(process)

    with safe_files.create(job.log_path, buffering=1) as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=job.environment(settings),
            text=True,
            bufsize=1,
        )
        timer = threading.Timer(settings.job_timeout_s, expire)
        timer.daemon = True
        timer.start()
        try:
            for line in process.stdout or ():
                log.write(line)
                tail.append(line.rstrip("\n"))
                on_output(line.rstrip("\n"))
            code = process.wait()
        finally:
            timer.cancel()
            _stop(process)  # on Ctrl-C or an error above; a no-op once the job has ended
    if timed_out.is_set():
        raise ScalingError(
            _job_failure(job, f"ran past --job-timeout {settings.job_timeout_s:g} s", tail)
            + "\nRaise --job-timeout, or use fewer --num-iters, for a longer study."
        )
    if code != 0:
        raise ScalingError(_job_failure(job, f"failed (horarun exited with {code})", tail))
    return _read_result(job, tail)


def _job_failure(job: Job, what: str, tail: Sequence[str]) -> str:
    shown = "\n".join(f"    {line}" for line in tail) or "    (no output)"
    return (
        f"hora bench scaling: the {job.model} job at np={job.workers} {what}.\n"
        f"Last lines of its output:\n{shown}\n"
        f"Its whole output is in {job.log_path}; the command is on that file's first line, to run "
        "it alone."
    )


def _read_result(job: Job, tail: Sequence[str]) -> Measurement:
    try:
        result = json.loads(job.result_path.read_text())
    except FileNotFoundError:
        raise ScalingError(
            _job_failure(job, f"ended without writing its result to {job.result_path}", tail)
            + "\nRank 0 writes it: with -H or --hostfile, --output-dir must be on a file system "
            "that rank 0's host (the first one) shares with this machine."
        ) from None
    except json.JSONDecodeError as exc:
        raise ScalingError(
            f"{job.result_path} is not valid JSON ({exc}); run the study again."
        ) from exc
    try:
        return Measurement.from_result(result)
    except (KeyError, ValueError, TypeError, ZeroDivisionError) as exc:
        raise ScalingError(f"{job.result_path} cannot be read: {exc}.") from exc


def communication_share(timeline_path: Path) -> tuple[float | None, str | None]:
    """The communication share of the job whose timeline is at ``timeline_path``.

    Returns:
        ``(share, None)``, or ``(None, why it is unavailable)``.
    """
    if not timeline_path.exists():
        return None, (
            f"the job wrote no timeline at {timeline_path} (HORA_TIMELINE); with -H or "
            "--hostfile, rank 0 writes it on the first host, which must share --output-dir with "
            "this machine"
        )
    try:
        summary = timeline.summarize(timeline.load(timeline_path))
    except Exception as exc:  # the table is still worth having without it
        return None, f"{timeline_path} cannot be summarized ({type(exc).__name__}: {exc})"
    if summary.comm_share is None:
        # The summarizer's warning, less what it says about its own report.
        why = summary.warnings[-1].split("; ")[0] if summary.warnings else "no training steps"
        return None, f"{timeline_path} gives no communication share: {why}"
    return summary.comm_share, None
