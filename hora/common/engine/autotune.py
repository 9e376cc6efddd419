"""Autotune: try batch sizes for the steady state online and keep the fastest.

With the steady state (see hora.common.engine.steady) a training step is a replayed schedule, and what
decides its speed is how the step's gradients are cut into batches: small first batches start
communication early in backward, large ones cost fewer collectives. Horovod's autotune tunes
the fusion threshold and the cycle time for its negotiation; in hora's steady state no cycles
run, so the knobs that matter are the first batch's size and the other batches' size (capped
by the fusion threshold).

The tuner tries each candidate for ``warmup`` steps (not measured) and then ``steps`` measured
steps, one step being one period of the schedule. Every rank measures its own step times; at the
end of a candidate the ranks agree on its score (the slowest rank's median step, exchanged with
one small allreduce at the same point of the schedule on every rank), so every rank makes the
same choice. After the last candidate the fastest one stays. Rank 0 logs every trial as CSV.

This module decides; the engine measures, exchanges and rebuilds the schedule.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from typing import IO

from hora.common.engine.steady.schedule import BUCKET_BYTES, FIRST_BUCKET_BYTES
from hora.common.vocabulary import safe_files

logger = logging.getLogger("hora")

KIB = 1024
MIB = 1024 * 1024
# Candidate (first batch, other batches) sizes; the default comes first.
_FIRSTS = (FIRST_BUCKET_BYTES, 256 * KIB, 4 * MIB)
_OTHERS = (BUCKET_BYTES, 4 * MIB, 64 * MIB)

LOG_HEADER = "trial,first_batch_bytes,batch_bytes,median_step_ms,slowest_rank_median_step_ms,status"


@dataclass(frozen=True)
class Candidate:
    """One way of cutting the period into batches."""

    first_bucket_bytes: int
    bucket_bytes: int


def candidates(fusion_threshold_bytes: int) -> list[Candidate]:
    """The settings tried, default first; sizes above the fusion threshold are left out."""
    limit = max(fusion_threshold_bytes, 1)
    found: list[Candidate] = []
    for other in _OTHERS:
        for first in _FIRSTS:
            candidate = Candidate(min(first, other, limit), min(other, limit))
            if candidate not in found:
                found.append(candidate)
    return found


@dataclass
class Autotuner:
    """Walks through the candidates; see the module docstring.

    Args:
        fusion_threshold_bytes: the job's fusion threshold (the largest batch).
        warmup: steps after each change that are not measured.
        steps: measured steps per candidate.
        log_path: where rank 0 writes the trials as CSV (``None``: nowhere).
        rank: this process's rank.
    """

    fusion_threshold_bytes: int
    warmup: int = 3
    steps: int = 10
    log_path: str | None = None
    rank: int = 0
    trials: list[tuple[Candidate, float]] = field(default_factory=list)
    _durations: list[float] = field(default_factory=list)
    _seen: int = 0
    _index: int = 0
    _chosen: Candidate | None = None
    _ended: bool = False

    def __post_init__(self) -> None:
        self._candidates = candidates(self.fusion_threshold_bytes)
        self._log_file: IO[str] | None = None
        if self.log_path and self.rank == 0:
            # Kept open while trials run: a new file (mode HORA_FILE_MODE), never a planted link.
            self._log_file = safe_files.create(self.log_path, buffering=1)
            self._log_file.write(LOG_HEADER + "\n")

    @property
    def current(self) -> Candidate:
        """The setting to use now."""
        return self._chosen if self._chosen is not None else self._candidates[self._index]

    @property
    def done(self) -> bool:
        return self._chosen is not None

    def step_finished(self, duration_s: float) -> float | None:
        """Record one step of the current candidate.

        Returns:
            This rank's median step time (s) when the candidate's last measured step is in:
            the engine then exchanges it and calls :meth:`scored`. ``None`` otherwise.
        """
        if self.done:
            return None
        self._seen += 1
        if self._seen <= self.warmup:
            return None
        self._durations.append(duration_s)
        if len(self._durations) < self.steps:
            return None
        return statistics.median(self._durations)

    def scored(self, local_median_s: float, slowest_median_s: float) -> Candidate:
        """Take the agreed score of the current candidate; return the setting to use next."""
        candidate = self._candidates[self._index]
        self.trials.append((candidate, slowest_median_s))
        self._log(len(self.trials), candidate, local_median_s, slowest_median_s, "tried")
        self._durations = []
        self._seen = 0
        if self._index + 1 < len(self._candidates):
            self._index += 1
            return self._candidates[self._index]
        # Ties go to the earlier candidate, so the default stays unless another is faster.
        best, score = min(self.trials, key=lambda trial: trial[1])
        self._chosen = best
        self._log(0, best, float("nan"), score, "chosen")
        logger.info(
            "autotune chose batches of %d bytes (first %d bytes): %.2f ms per step",
            best.bucket_bytes,
            best.first_bucket_bytes,
            score * 1000,
        )
        return best

    def end(self) -> None:
        """The job is ending: if the search has not finished, log the fastest setting tried so
        far (a ``best-so-far`` row on rank 0's CSV, and a warning) so that a run cut short still
        says what it learned."""
        if self.done or self._ended:
            return
        self._ended = True
        tried, total = len(self.trials), len(self._candidates)
        if self.rank == 0:
            if self.trials:
                best, score = min(self.trials, key=lambda trial: trial[1])
                found = (
                    f"the fastest so far is batches of {best.bucket_bytes} bytes (first "
                    f"{best.first_bucket_bytes} bytes): {score * 1000:.2f} ms per step"
                )
                self._log(0, best, float("nan"), score, "best-so-far")
            else:
                found = "no setting was measured"
            per_candidate = self.warmup + self.steps
            logger.warning(
                "autotune did not finish: the job ended after %d of %d settings were tried; %s. "
                "The search takes about %d steps in all (%d per setting): run more steps, or "
                "lower HORA_AUTOTUNE_WARMUP_SAMPLES and HORA_AUTOTUNE_STEPS_PER_SAMPLE.",
                tried,
                total,
                found,
                total * per_candidate,
                per_candidate,
            )
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _log(
        self, trial: int, candidate: Candidate, local_s: float, slowest_s: float, status: str
    ) -> None:
        log = self._log_file
        if log is None:
            return
        local = "" if local_s != local_s else f"{local_s * 1000:.3f}"  # NaN: not a measurement
        log.write(
            f"{trial},{candidate.first_bucket_bytes},{candidate.bucket_bytes},{local},"
            f"{slowest_s * 1000:.3f},{status}\n"
        )
        if status == "chosen":
            log.close()
            self._log_file = None
