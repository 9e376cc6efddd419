"""Reading hora timelines: loading the per-rank files, merging them, and summarizing a job.

A timeline is the Chrome-trace JSON that ``HORA_TIMELINE=PATH`` makes every rank write (see
docs/timeline-format.md): ``PATH`` for rank 0, ``PATH`` with ``.rank<r>`` before the extension for
the others, or one merged ``PATH`` after a clean exit. :func:`load` reads ``PATH`` and whichever
siblings exist, forgiving what a killed process leaves behind (no closing ``]``, a trailing
comma, a half-written last line). :func:`summarize` answers the questions people open a timeline
for: how much of a step is communication, whether it overlaps backward, which rank the others
wait for, which tensors cost the most, and how well fusion works. :func:`merge` writes one trace
of all ranks. This module reads files only; it knows the event names of the format, not the
engine that wrote them.

Example:
    >>> from hora.tools import timeline
    >>> summary = timeline.summarize(timeline.load("/tmp/timeline.json"))
    >>> summary.straggler.rank if summary.straggler else None
    2
"""

from __future__ import annotations

import bisect
import json
import os
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hora.common import safe_files
from hora.common import timeline_writer as common_timeline
from hora.common.timeline_writer import rank_path

# Rows (``tid``) of a rank's trace.
TRAINING_ROW = 0
ENGINE_ROW = 1
FIRST_TENSOR_ROW = 2

BACKWARD = "BACKWARD"
OPTIMIZER_STEP = "OPTIMIZER_STEP"
# A call's negotiation; written as NEGOTIATE_<OP> (NEGOTIATE_ALLREDUCE, ...), as Horovod names
# it, and read back as this one phase (timelines of older hora versions wrote NEGOTIATE alone).
NEGOTIATE = "NEGOTIATE"
WAIT_FOR_BATCH = "WAIT_FOR_BATCH"
QUEUE = "QUEUE"
MEMCPY_IN = "MEMCPY_IN_FUSION_BUFFER"
MEMCPY_OUT = "MEMCPY_OUT_FUSION_BUFFER"
STEADY_STATE_ENTER = "STEADY_STATE_ENTER"
STEADY_STATE_LEAVE = "STEADY_STATE_LEAVE"
# The phase that starts each call: its start is the moment the rank submitted the tensor.
SUBMIT_PHASES = frozenset({NEGOTIATE, WAIT_FOR_BATCH})
WAIT_PHASES = frozenset({NEGOTIATE, WAIT_FOR_BATCH, QUEUE})
MEMCPY_PHASES = frozenset({MEMCPY_IN, MEMCPY_OUT})
# Every other complete event on a tensor row is the collective itself (ALLREDUCE, ALLGATHER, ...).

Span = tuple[float, float]


class TimelineError(Exception):
    """A timeline cannot be read; the message names the file and says what to do."""


@dataclass(slots=True)  # not frozen: a frozen dataclass is slow to build, and files are big
class Event:
    """One trace event.

    Attributes:
        name: the event's name (``NEGOTIATE``, ``BACKWARD``, ``thread_name``, ...); every
            ``NEGOTIATE_<OP>`` is read as ``NEGOTIATE``, the op being in ``args``.
        ph: its Chrome-trace phase: ``X`` complete, ``i`` instant, ``M`` metadata.
        rank: the ``pid``, which is the rank.
        tid: the row within the rank.
        ts: start, microseconds since the Unix epoch.
        dur: duration in microseconds (0 for all but complete events).
        args: the event's ``args``.
        raw: the event as it was read, for :func:`merge`.
    """

    name: str
    ph: str
    rank: int
    tid: int
    ts: float
    dur: float
    args: dict[str, Any]
    raw: dict[str, Any] = field(repr=False, compare=False)

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclass(frozen=True)
class SourceFile:
    """What was read from one file.

    Attributes:
        path: the file.
        events: events read from it (before duplicates were dropped).
        closed: the array ended with ``]``; ``False`` means the writer never stopped (a crash).
        dropped_tail: a half-written last line was ignored.
        ranks: the ranks (``pid``) its events belong to.
    """

    path: str
    events: int
    closed: bool
    dropped_tail: bool
    ranks: tuple[int, ...]


@dataclass
class Timeline:
    """The events of one job, from one or more files.

    Attributes:
        files: what was read from each file, in the order read.
        events: every event, duplicates dropped, sorted by rank, then time.
        row_names: ``(rank, tid)`` -> the row's ``thread_name`` (a tensor's full name).
        warnings: things a reader should know (a file cut short, a rank without a file).
    """

    files: list[SourceFile]
    events: list[Event]
    row_names: dict[tuple[int, int], str]
    warnings: list[str]

    @property
    def ranks(self) -> list[int]:
        """The ranks that have at least one event."""
        return sorted({e.rank for e in self.events})

    def rank_events(self, rank: int) -> list[Event]:
        """One rank's events, sorted by time."""
        return [e for e in self.events if e.rank == rank]

    def row_name(self, rank: int, tid: int) -> str:
        """The row's name; rows without ``thread_name`` metadata are called ``row <tid>``."""
        return self.row_names.get((rank, tid), f"row {tid}")


# ---------------------------------------------------------------------------------- reading


def rank_files(path: str | os.PathLike[str]) -> list[Path]:
    """``path`` (if it exists) and its ``.rank<r>`` siblings, in rank order."""
    return [file for _, file in common_timeline.rank_files(path)]


def load(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> Timeline:
    """Read a timeline: ``PATH`` and its ``.rank<r>`` siblings, or an explicit list of files.

    Args:
        path: the path given to ``HORA_TIMELINE`` (its siblings are found next to it), or a
            list of files to read exactly.

    Returns:
        The job's events. Files a killed process left unfinished are read up to their last
        complete line; :attr:`Timeline.warnings` says which.

    Raises:
        TimelineError: no file exists, or a file is not a Chrome-trace JSON array.

    Example:
        >>> tl = load("/tmp/timeline.json")   # also reads /tmp/timeline.rank1.json, ...
        >>> tl.ranks
        [0, 1]
    """
    warnings: list[str] = []
    files = _files_to_read(path, warnings)
    sources: list[SourceFile] = []
    events: list[Event] = []
    seen: set[tuple[Any, ...]] = set()
    row_names: dict[tuple[int, int], str] = {}
    for file in files:
        raw_events, closed, dropped_tail = _read_array(file)
        ranks, skipped = _add_events(raw_events, events, seen, row_names)
        sources.append(
            SourceFile(str(file), len(raw_events), closed, dropped_tail, tuple(sorted(ranks)))
        )
        warnings += _file_warnings(file, len(raw_events), closed, dropped_tail, skipped)
    events.sort(key=lambda e: (e.rank, e.ts, -e.dur))
    warnings += _missing_rank_warnings(events)
    return Timeline(sources, events, row_names, warnings)


def _add_events(
    raw_events: list[Any],
    events: list[Event],
    seen: set[tuple[Any, ...]],
    row_names: dict[tuple[int, int], str],
) -> tuple[set[int], int]:
    """Add one file's entries to ``events``; returns the ranks they belong to and the skips.

    Entries that are not trace events are skipped and counted. Only an event an earlier file
    already had (its identity is in ``seen``) is a duplicate and dropped: a merged file next to
    a part left behind. Within one file, two equal events are two events, so this file's
    identities join ``seen`` only at the end. ``thread_name`` metadata also names its row in
    ``row_names``.
    """
    ranks: set[int] = set()
    skipped = 0
    keys: set[tuple[Any, ...]] = set()
    for raw in raw_events:
        event = _event(raw)
        if event is None:
            skipped += 1
            continue
        ranks.add(event.rank)
        key = _identity(event)
        if key in seen:
            continue
        keys.add(key)
        if event.ph == "M" and event.name == "thread_name":
            label = event.args.get("name")
            if isinstance(label, str):
                row_names[(event.rank, event.tid)] = label
        events.append(event)
    seen |= keys
    return ranks, skipped


def _file_warnings(
    file: Path, count: int, closed: bool, dropped_tail: bool, skipped: int
) -> list[str]:
    """What a reader should know about one file: cut short, or holding non-events."""
    warnings: list[str] = []
    if not closed:
        what = "was cut short" if count else "is empty"
        warnings.append(
            f"'{file}' {what} (no closing ']': its process was probably killed); "
            f"read {count} events"
            + (", ignoring a half-written last line." if dropped_tail else ".")
        )
    if skipped:
        warnings.append(f"'{file}': ignored {skipped} entries that are not trace events.")
    return warnings


def _missing_rank_warnings(events: list[Event]) -> list[str]:
    """A warning naming the ranks below the highest one present that have no events."""
    present = {e.rank for e in events}
    if present:
        missing = sorted(set(range(max(present) + 1)) - present)
        if missing:
            listed = ", ".join(str(r) for r in missing)
            return [f"no events for rank(s) {listed}; the summary leaves them out."]
    return []


def _files_to_read(
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], warnings: list[str]
) -> list[Path]:
    """The files of a timeline (see :func:`load`); a missing rank 0 file is a warning."""
    if isinstance(path, (str, os.PathLike)):
        files = rank_files(path)
        if not files:
            raise TimelineError(
                f"no timeline at '{os.fspath(path)}', and no '{rank_path(path, 1).name}'-style "
                "rank files next to it.\nRun the job with HORA_TIMELINE="
                f"{os.fspath(path)} (or horarun --timeline-filename) to write one."
            )
        if not Path(path).is_file():
            warnings.append(
                f"'{os.fspath(path)}' (rank 0's file) does not exist; read only its rank files."
            )
        return files
    files = [Path(p) for p in path]
    if not files:
        raise TimelineError("no timeline files given.")
    for file in files:
        if not file.is_file():
            raise TimelineError(f"no timeline file at '{file}'.")
    return files


def _read_array(path: Path) -> tuple[list[Any], bool, bool]:
    """The entries of one file's JSON array: ``(entries, closed, dropped_tail)``."""
    try:
        return common_timeline.read_file(path)
    except ValueError as exc:
        raise TimelineError(str(exc)) from exc


def _event(raw: Any) -> Event | None:
    if not isinstance(raw, dict):
        return None
    name, ph = raw.get("name", ""), raw.get("ph")
    if not isinstance(ph, str) or not isinstance(name, str):
        return None
    try:
        rank = int(raw.get("pid", 0))
        tid = int(raw.get("tid", 0))
        ts = float(raw.get("ts", 0.0))
        dur = float(raw.get("dur", 0.0)) if ph == "X" else 0.0
    except (TypeError, ValueError):
        return None
    args = raw.get("args")
    if name.startswith(NEGOTIATE + "_"):
        name = NEGOTIATE
    return Event(name, ph, rank, tid, ts, dur, args if isinstance(args, dict) else {}, raw)


def _identity(event: Event) -> tuple[Any, ...]:
    """Equal for the same event read from two files."""
    if event.ph == "M":
        return ("M", event.name, event.rank, event.tid, json.dumps(event.args, sort_keys=True))
    return (event.ph, event.name, event.rank, event.tid, event.ts, event.dur)


# ---------------------------------------------------------------------------------- merging


def merge(timeline: Timeline) -> list[dict[str, Any]]:
    """All ranks' events as one Chrome trace: metadata first, then everything by time.

    Every rank gets a ``process_name`` ("rank r") and a ``process_sort_index`` if its file had
    none, so trace viewers list the ranks in order.
    """
    metadata = [e.raw for e in timeline.events if e.ph == "M"]
    named = {(e.rank, e.name) for e in timeline.events if e.ph == "M"}
    for rank in timeline.ranks:
        if (rank, "process_name") not in named:
            metadata.append(
                {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
            )
        if (rank, "process_sort_index") not in named:
            metadata.append(
                {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}
            )
    timed = sorted((e for e in timeline.events if e.ph != "M"), key=lambda e: (e.ts, e.rank))
    return metadata + [e.raw for e in timed]


def write_merged(timeline: Timeline, out: str | os.PathLike[str]) -> int:
    """Write :func:`merge`'s trace to ``out``, one event per line; returns the event count."""
    merged = merge(timeline)
    lines = ",\n".join(json.dumps(e, separators=(", ", ": ")) for e in merged)
    safe_files.write(out, f"[\n{lines}\n]\n")
    return len(merged)


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
