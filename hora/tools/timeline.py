"""Summarizing a hora timeline: how much of a step is communication, whether it overlaps
backward, which rank the others wait for, which tensors cost the most, and how well fusion works.

Reading and merging the files is :mod:`hora.tools.timeline_events`'s; its names are re-exported
here, so ``hora.tools.timeline`` is the one module tools import.

Example:
    >>> from hora.tools import timeline
    >>> summary = timeline.summarize(timeline.load("/tmp/timeline.json"))
    >>> summary.straggler.rank if summary.straggler else None
    2
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hora.common.vocabulary.timeline_writer import rank_path
from hora.tools.timeline_events import (
    BACKWARD,
    ENGINE_ROW,
    FIRST_TENSOR_ROW,
    MEMCPY_IN,
    MEMCPY_OUT,
    MEMCPY_PHASES,
    NEGOTIATE,
    OPTIMIZER_STEP,
    QUEUE,
    STEADY_STATE_ENTER,
    STEADY_STATE_LEAVE,
    SUBMIT_PHASES,
    TRAINING_ROW,
    WAIT_FOR_BATCH,
    WAIT_PHASES,
    Event,
    SourceFile,
    Span,
    Timeline,
    TimelineError,
    load,
    merge,
    rank_files,
    write_merged,
)

__all__ = [
    "rank_path",
    "BACKWARD",
    "ENGINE_ROW",
    "Event",
    "FIRST_TENSOR_ROW",
    "FusionSummary",
    "MEMCPY_IN",
    "MEMCPY_OUT",
    "MEMCPY_PHASES",
    "NEGOTIATE",
    "OPTIMIZER_STEP",
    "QUEUE",
    "RankSummary",
    "STEADY_STATE_ENTER",
    "STEADY_STATE_LEAVE",
    "SUBMIT_PHASES",
    "SourceFile",
    "Span",
    "Straggler",
    "Summary",
    "TRAINING_ROW",
    "TensorSummary",
    "Timeline",
    "TimelineError",
    "WAIT_FOR_BATCH",
    "WAIT_PHASES",
    "load",
    "merge",
    "rank_files",
    "summarize",
    "write_merged",
]

# ---------------------------------------------------------------------------------- intervals


def _union(spans: Iterable[Span]) -> list[Span]:
    """Sorted, disjoint spans covering the same time as ``spans``."""
    out: list[Span] = []
    for start, end in sorted(spans):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def _clip(union: list[Span], lo: float, hi: float, starts: list[float] | None = None) -> list[Span]:
    """The part of a disjoint, sorted ``union`` inside ``[lo, hi]``; ``starts`` are its starts."""
    if starts is None:
        starts = [s for s, _ in union]
    i = max(bisect.bisect_right(starts, lo) - 1, 0)
    out: list[Span] = []
    while i < len(union) and union[i][0] < hi:
        start, end = max(union[i][0], lo), min(union[i][1], hi)
        if end > start:
            out.append((start, end))
        i += 1
    return out


def _length(union: Iterable[Span]) -> float:
    return sum(end - start for start, end in union)


def _overlap(a: list[Span], b: list[Span]) -> float:
    """Time covered by both of two disjoint, sorted unions."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            total += end - start
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


# ---------------------------------------------------------------------------------- summary


@dataclass
class RankSummary:
    """One rank's numbers. Times are milliseconds; shares are fractions (0.25 is 25%).

    Attributes:
        rank: the rank.
        steps: complete training steps (``OPTIMIZER_STEP`` end to the next one's end).
        step_ms_median: median step time; ``None`` without two ``OPTIMIZER_STEP`` events.
        backward_ms_median: median ``BACKWARD`` duration.
        optimizer_step_ms_median: median ``OPTIMIZER_STEP`` duration (includes waiting for the
            allreduces).
        comm_ms_per_step_median: median time per step with a collective or a fusion-buffer copy
            running (overlapping calls count once).
        comm_share: that time over all steps, divided by the steps' time.
        overlap_share: the share of that communication time that falls inside ``BACKWARD``.
        calls: collective calls (one per tensor per call).
        negotiated_calls: calls that went through negotiation (``NEGOTIATE``).
        steady_calls: calls in the steady state (``WAIT_FOR_BATCH``).
        wait_ms_total: over every collective compared across ranks, the time from this rank's
            submit to the last rank's submit.
        wait_ms_mean: ``wait_ms_total`` per compared collective.
        wait_ms_median: the median of those waits (less swayed by start-up, when ranks arrive
            at their first collectives far apart).
        last_count: collectives in which this rank alone submitted last.
        steady_state_entries: ``STEADY_STATE_ENTER`` marks.
        steady_state_exits: ``STEADY_STATE_LEAVE`` marks.
    """

    rank: int
    steps: int
    step_ms_median: float | None
    backward_ms_median: float | None
    optimizer_step_ms_median: float | None
    comm_ms_per_step_median: float | None
    comm_share: float | None
    overlap_share: float | None
    calls: int
    negotiated_calls: int
    steady_calls: int
    wait_ms_total: float
    wait_ms_mean: float | None
    wait_ms_median: float | None
    last_count: int
    steady_state_entries: int
    steady_state_exits: int


@dataclass
class Straggler:
    """The rank the others wait for.

    Attributes:
        rank: the rank that submitted last in the most collectives (ties count for nobody).
        last_count: in how many.
        compared: collectives compared across ranks (the *n*-th call of a name on each rank).
        share: ``last_count / compared``.
        wait_ms_total: over the collectives it was last in, the others' mean wait for it, summed.
        wait_ms_mean: ``wait_ms_total / last_count``: how long the others waited each time.
        clear: ``share`` is at least midway between chance (1 / ranks) and always; otherwise no
            single rank stands out.
    """

    rank: int
    last_count: int
    compared: int
    share: float
    wait_ms_total: float
    wait_ms_mean: float
    clear: bool


@dataclass
class TensorSummary:
    """One tensor name (a timeline row), averaged over the ranks that have it.

    Attributes:
        name: the tensor's full name, e.g. ``allreduce.grad.fc1.weight``.
        op: its collective (``ALLREDUCE``, ...).
        calls: calls per rank (the most on any rank).
        collective_ms: time in the collective per rank, summed over calls.
        collective_ms_mean: per call.
        wait_ms: ``NEGOTIATE`` + ``WAIT_FOR_BATCH`` + ``QUEUE`` time per rank, summed over calls.
        fused_share: share of its calls that ran in a batch with other tensors.
    """

    name: str
    op: str
    calls: int
    collective_ms: float
    collective_ms_mean: float
    wait_ms: float
    fused_share: float


@dataclass
class FusionSummary:
    """How tensors were fused into batches, on one rank (every rank runs the same batches).

    Attributes:
        rank: the rank counted (the lowest present).
        batches: collectives run (fused batches, including batches of one tensor).
        tensors_per_batch_mean: mean tensors per batch.
        tensors_per_batch_max: the most tensors in one batch.
        bytes_per_batch_mean: mean bytes per batch.
        bytes_per_batch_max: the most bytes in one batch.
        fused_call_share: share of calls that shared their batch with another tensor.
    """

    rank: int
    batches: int
    tensors_per_batch_mean: float
    tensors_per_batch_max: int
    bytes_per_batch_mean: float
    bytes_per_batch_max: int
    fused_call_share: float


@dataclass
class Summary:
    """What :func:`summarize` found. ``to_dict()`` gives the same as plain JSON data.

    Attributes:
        files: the files read.
        ranks: the ranks present.
        warnings: from :func:`load`, plus anything the analysis could not do.
        step_ms_median: median step time over every rank's steps.
        comm_ms_per_step_median: median communication time per step, every rank's steps.
        comm_share: communication time over step time, all ranks.
        overlap_share: share of communication time inside ``BACKWARD``, all ranks.
        per_rank: one :class:`RankSummary` per rank.
        straggler: the rank submitted last most often; ``None`` with one rank or no shared calls.
        compared_collectives: collectives compared across ranks for waits.
        tensors: every tensor, most collective time first.
        fusion: batch statistics; ``None`` if the events carry no ``batch`` numbers.
    """

    files: list[str]
    ranks: list[int]
    warnings: list[str]
    step_ms_median: float | None
    comm_ms_per_step_median: float | None
    comm_share: float | None
    overlap_share: float | None
    per_rank: list[RankSummary]
    straggler: Straggler | None
    compared_collectives: int
    tensors: list[TensorSummary]
    fusion: FusionSummary | None

    @property
    def has_steps(self) -> bool:
        return self.step_ms_median is not None

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        """Plain data for ``json.dumps``; ``top`` keeps only the first ``top`` tensors."""
        data = asdict(self)
        if top is not None:
            data["tensors"] = data["tensors"][:top]
        return data


@dataclass
class _RankData:
    """One rank's events, sorted into what the summary needs (times in microseconds)."""

    steps: list[float] = field(default_factory=list)  # OPTIMIZER_STEP ends
    optimizer_steps: list[float] = field(default_factory=list)  # their durations
    backward: list[Span] = field(default_factory=list)
    comm: list[Span] = field(default_factory=list)
    submits: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    negotiated: int = 0
    steady: int = 0
    entries: int = 0
    exits: int = 0

    def add_training(self, e: Event) -> None:
        """A complete event on the training row; only steps and ``BACKWARD`` are kept."""
        if e.name == OPTIMIZER_STEP:
            self.steps.append(e.end)
            self.optimizer_steps.append(e.dur)
        elif e.name == BACKWARD:
            self.backward.append((e.ts, e.end))

    def add_steady_state(self, e: Event) -> None:
        """A ``STEADY_STATE_ENTER`` or ``STEADY_STATE_LEAVE`` mark."""
        if e.name == STEADY_STATE_ENTER:
            self.entries += 1
        else:
            self.exits += 1

    def add_tensor(self, e: Event, row_name: str) -> None:
        """A complete event on the tensor row called ``row_name``.

        A call's submit phase (``NEGOTIATE`` or ``WAIT_FOR_BATCH``) counts the call and records
        when it was submitted; ``QUEUE`` counts for neither; everything else (the collective, the
        fusion-buffer copies) is communication.
        """
        if e.name in SUBMIT_PHASES:
            self.submits[row_name].append(e.ts)
            if e.name == NEGOTIATE:
                self.negotiated += 1
            else:
                self.steady += 1
        elif e.name not in WAIT_PHASES:
            self.comm.append((e.ts, e.end))


def _rank_data(timeline: Timeline, rank: int, events: list[Event]) -> _RankData:
    """Sort one rank's events into what the summary needs."""
    data = _RankData()
    for e in events:
        if e.ph == "X" and e.tid == TRAINING_ROW:
            data.add_training(e)
        elif e.ph in ("i", "I") and e.name in (STEADY_STATE_ENTER, STEADY_STATE_LEAVE):
            data.add_steady_state(e)
        elif e.ph == "X" and e.tid >= FIRST_TENSOR_ROW:
            data.add_tensor(e, timeline.row_name(rank, e.tid))
    data.steps.sort()
    data.backward = _union(data.backward)
    data.comm = _union(data.comm)
    for times in data.submits.values():
        times.sort()
    return data


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ms(us: float | None) -> float | None:
    return None if us is None else us / 1000.0


def summarize(timeline: Timeline) -> Summary:
    """The summary of a loaded timeline.

    Works with whatever markers are present: without ``OPTIMIZER_STEP`` (a script that does not
    use ``DistributedOptimizer``) the step fields are ``None`` and a warning says so, while the
    per-tensor, wait and fusion numbers are still computed.

    Example:
        >>> s = summarize(load("/tmp/timeline.json"))
        >>> f"{s.comm_share:.0%} of a step is communication"
        '12% of a step is communication'
    """
    warnings = list(timeline.warnings)
    ranks = timeline.ranks
    by_rank: dict[int, list[Event]] = defaultdict(list)
    for e in timeline.events:
        by_rank[e.rank].append(e)
    data = {r: _rank_data(timeline, r, by_rank[r]) for r in ranks}

    waits, last_counts, compared, straggler = _waits(data, ranks)
    per_rank: list[RankSummary] = []
    all_steps: list[float] = []
    all_comm_per_step: list[float] = []
    total_comm = total_time = total_overlap = overlap_base = 0.0
    for r in ranks:
        d = data[r]
        steps = [b - a for a, b in zip(d.steps, d.steps[1:])]
        starts = [s for s, _ in d.comm]
        comm_per_step = [_length(_clip(d.comm, a, b, starts)) for a, b in zip(d.steps, d.steps[1:])]
        comm_in_steps = _clip(d.comm, d.steps[0], d.steps[-1]) if steps else d.comm
        comm_time = _length(comm_in_steps)
        overlap = _overlap(comm_in_steps, d.backward) if d.backward else None
        all_steps += steps
        all_comm_per_step += comm_per_step
        if steps:
            total_comm += comm_time
            total_time += d.steps[-1] - d.steps[0]
        if overlap is not None:
            total_overlap += overlap
            overlap_base += comm_time
        rank_waits = waits.get(r, [])
        per_rank.append(
            RankSummary(
                rank=r,
                steps=len(steps),
                step_ms_median=_ms(_median(steps)),
                backward_ms_median=_ms(_median([b - a for a, b in d.backward])),
                optimizer_step_ms_median=_ms(_median(d.optimizer_steps)),
                comm_ms_per_step_median=_ms(_median(comm_per_step)),
                comm_share=comm_time / (d.steps[-1] - d.steps[0]) if steps else None,
                overlap_share=overlap / comm_time if overlap is not None and comm_time else None,
                calls=d.negotiated + d.steady,
                negotiated_calls=d.negotiated,
                steady_calls=d.steady,
                wait_ms_total=sum(rank_waits) / 1000.0,
                wait_ms_mean=_ms(statistics.fmean(rank_waits)) if rank_waits else None,
                wait_ms_median=_ms(_median(rank_waits)),
                last_count=last_counts.get(r, 0),
                steady_state_entries=d.entries,
                steady_state_exits=d.exits,
            )
        )
    if ranks and not all_steps:
        warnings.append(
            "no training steps: the timeline has fewer than two OPTIMIZER_STEP events per rank "
            "(they come from hvd.DistributedOptimizer), so step times and communication shares "
            "are not known; per-tensor, wait and fusion numbers are below."
        )
    return Summary(
        files=[f.path for f in timeline.files],
        ranks=ranks,
        warnings=warnings,
        step_ms_median=_ms(_median(all_steps)),
        comm_ms_per_step_median=_ms(_median(all_comm_per_step)),
        comm_share=total_comm / total_time if total_time else None,
        overlap_share=total_overlap / overlap_base if overlap_base else None,
        per_rank=per_rank,
        straggler=straggler,
        compared_collectives=compared,
        tensors=_tensors(timeline, by_rank),
        fusion=_fusion(by_rank, ranks),
    )


def _waits(
    data: dict[int, _RankData], ranks: list[int]
) -> tuple[dict[int, list[float]], dict[int, int], int, Straggler | None]:
    """Compare submits: the *n*-th call of a name on each rank is one collective.

    Returns each rank's waits (microseconds), how often each rank was last, the number of
    collectives compared, and the straggler.
    """
    waits: dict[int, list[float]] = defaultdict(list)
    last_counts: Counter[int] = Counter()
    waited_for: dict[int, float] = defaultdict(float)  # last rank -> others' mean waits, summed
    compared = 0
    names = sorted({name for r in ranks for name in data[r].submits})
    for name in names:
        calls = max(len(data[r].submits.get(name, [])) for r in ranks)
        for n in range(calls):
            submits = {
                r: data[r].submits[name][n] for r in ranks if len(data[r].submits.get(name, [])) > n
            }
            if len(submits) < 2:
                continue
            compared += 1
            order = sorted(submits, key=lambda r: submits[r])
            last_rank = order[-1]
            last = submits[last_rank]
            for r, t in submits.items():
                waits[r].append(last - t)
            if submits[order[-2]] == last:
                continue  # a tie: no rank was last
            last_counts[last_rank] += 1
            others = [last - t for r, t in submits.items() if r != last_rank]
            waited_for[last_rank] += statistics.fmean(others)
    straggler = None
    if last_counts:
        rank, count = max(last_counts.items(), key=lambda kv: (kv[1], -kv[0]))
        share = count / compared
        chance = 1.0 / len(ranks)
        straggler = Straggler(
            rank=rank,
            last_count=count,
            compared=compared,
            share=share,
            wait_ms_total=waited_for[rank] / 1000.0,
            wait_ms_mean=waited_for[rank] / count / 1000.0,
            clear=share >= (chance + 1.0) / 2,
        )
    return waits, dict(last_counts), compared, straggler


def _tensors(timeline: Timeline, by_rank: dict[int, list[Event]]) -> list[TensorSummary]:
    calls: dict[str, Counter[int]] = defaultdict(Counter)
    collective: dict[str, float] = defaultdict(float)
    collective_calls: dict[str, int] = defaultdict(int)
    fused: dict[str, int] = defaultdict(int)
    waited: dict[str, float] = defaultdict(float)
    ops: dict[str, str] = {}
    present: dict[str, set[int]] = defaultdict(set)
    for rank, events in by_rank.items():
        for e in events:
            if e.ph != "X" or e.tid < FIRST_TENSOR_ROW:
                continue
            name = timeline.row_name(rank, e.tid)
            present[name].add(rank)
            if e.name in SUBMIT_PHASES:
                calls[name][rank] += 1
                op = e.args.get("op")
                if isinstance(op, str):
                    ops.setdefault(name, op)
            if e.name in WAIT_PHASES:
                waited[name] += e.dur
            elif e.name not in MEMCPY_PHASES:
                ops[name] = e.name
                collective[name] += e.dur
                collective_calls[name] += 1
                tensors = e.args.get("tensors")
                if isinstance(tensors, int) and tensors > 1:
                    fused[name] += 1
    out = []
    for name, ranks in present.items():
        n_ranks = len(ranks)
        per_rank_ms = collective[name] / n_ranks / 1000.0
        out.append(
            TensorSummary(
                name=name,
                op=ops.get(name, "?"),
                calls=max(calls[name].values(), default=0),
                collective_ms=per_rank_ms,
                collective_ms_mean=(
                    collective[name] / collective_calls[name] / 1000.0
                    if collective_calls[name]
                    else 0.0
                ),
                wait_ms=waited[name] / n_ranks / 1000.0,
                fused_share=fused[name] / collective_calls[name] if collective_calls[name] else 0.0,
            )
        )
    out.sort(key=lambda t: (-t.collective_ms, t.name))
    return out


def _fusion(by_rank: dict[int, list[Event]], ranks: list[int]) -> FusionSummary | None:
    for rank in ranks:
        batches: dict[Any, tuple[int, int]] = {}  # batch -> (tensors, bytes)
        rows: dict[Any, set[int]] = defaultdict(set)
        calls = fused_calls = 0
        for e in by_rank[rank]:
            if (
                e.ph != "X"
                or e.tid < FIRST_TENSOR_ROW
                or e.name in WAIT_PHASES
                or e.name in MEMCPY_PHASES
            ):
                continue
            batch = e.args.get("batch")
            if batch is None:
                continue
            rows[batch].add(e.tid)
            tensors = e.args.get("tensors")
            size = e.args.get("bytes")
            batches[batch] = (
                tensors if isinstance(tensors, int) else 0,
                size if isinstance(size, int) else 0,
            )
        if not batches:
            continue
        counts = [t or len(rows[b]) for b, (t, _) in batches.items()]
        sizes = [size for _, size in batches.values()]
        calls = sum(counts)
        fused_calls = sum(c for c in counts if c > 1)
        return FusionSummary(
            rank=rank,
            batches=len(batches),
            tensors_per_batch_mean=statistics.fmean(counts),
            tensors_per_batch_max=max(counts),
            bytes_per_batch_mean=statistics.fmean(sizes),
            bytes_per_batch_max=max(sizes),
            fused_call_share=fused_calls / calls if calls else 0.0,
        )
    return None
