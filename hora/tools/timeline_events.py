"""Reading hora timelines: the events, loading the per-rank files, and merging them.

A timeline is the Chrome-trace JSON that ``HORA_TIMELINE=PATH`` makes every rank write (see
docs/timeline-format.md): ``PATH`` for rank 0, ``PATH`` with ``.rank<r>`` before the extension for
the others, or one merged ``PATH`` after a clean exit. :func:`load` reads ``PATH`` and whichever
siblings exist, forgiving what a killed process leaves behind (no closing ``]``, a trailing
comma, a half-written last line). :func:`summarize` answers the questions people open a timeline
for: how much of a step is communication, whether it overlaps backward, which rank the others
wait for, which tensors cost the most, and how well fusion works. :func:`merge` writes one trace
of all ranks. (:func:`summarize` lives in :mod:`hora.tools.timeline`, which re-exports what is
here.) This module reads files only; it knows the event names of the format, not the engine
that wrote them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hora.common.vocabulary import safe_files
from hora.common.vocabulary import timeline_writer as common_timeline
from hora.common.vocabulary.timeline_writer import rank_path

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
