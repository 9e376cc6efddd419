"""The timeline: per-rank Chrome-trace files of what the engine and the optimizer did.

The format is specified in docs/timeline-format.md. Each rank writes its own file, one event per
line, so a file stays readable (by :func:`read_events`, Perfetto and ``chrome://tracing``) after
the process dies. At a normal shutdown rank 0 merges the ranks' files into one.

Writing costs one formatted line per event: names are escaped once per row, and events are
buffered and written out every :data:`FLUSH_INTERVAL_S`, after every optimizer step, and when
the engine goes idle.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hora.common.vocabulary import safe_files

# Rows (tids) that are not tensors.
TRAINING_ROW = 0
ENGINE_ROW = 1
_FIRST_TENSOR_ROW = 2
# Buffered events reach the file at least this often (and after every optimizer step, and at
# every stop).
FLUSH_INTERVAL_S = 0.25


def rank_path(path: str | os.PathLike[str], rank: int) -> Path:
    """The file rank ``rank`` writes for a timeline at ``path`` (rank 0: ``path`` itself)."""
    base = Path(path)
    if rank == 0:
        return base
    if base.suffix:
        return base.with_name(f"{base.stem}.rank{rank}{base.suffix}")
    return base.with_name(f"{base.name}.rank{rank}")


class Timeline:
    """One rank's timeline file, open for writing; safe to use from several threads.

    Args:
        path: the job's timeline path (rank 0's file); this rank writes :func:`rank_path`.
        rank: this process's rank.
        mark_cycles: whether the engine marks every negotiation cycle.
    """

    def __init__(self, path: str | os.PathLike[str], rank: int, mark_cycles: bool = False) -> None:
        self.path = Path(path)
        self.rank = rank
        self.mark_cycles = mark_cycles
        self.file_path = rank_path(path, rank)
        # A new file renamed onto the name: a link planted there is replaced, not followed.
        self._file = safe_files.create(self.file_path, buffering=1 << 16)
        self._lock = threading.Lock()
        self._rows: dict[str, int] = {}
        self._closed = False
        self._last_flush = time.monotonic()
        self._wall0_us = time.time_ns() // 1000
        self._mono0_ns = time.perf_counter_ns()
        self._file.write("[\n")
        self._metadata("process_name", None, {"name": f"rank {rank}"})
        self._metadata("process_sort_index", None, {"sort_index": rank})
        self._metadata("thread_name", TRAINING_ROW, {"name": "training"})
        self._metadata("thread_name", ENGINE_ROW, {"name": "engine"})
        self._file.flush()

    def now(self) -> int:
        """Microseconds since the Unix epoch, from a monotonic clock."""
        return self._wall0_us + (time.perf_counter_ns() - self._mono0_ns) // 1000

    def _metadata(self, name: str, tid: int | None, args: dict[str, Any]) -> None:
        event: dict[str, Any] = {"name": name, "ph": "M", "pid": self.rank, "args": args}
        if tid is not None:
            event["tid"] = tid
        self._file.write(json.dumps(event) + ",\n")

    def row(self, name: str) -> int:
        """The row (tid) of a tensor, named on first use."""
        tid = self._rows.get(name)
        if tid is None:
            with self._lock:
                tid = self._rows.get(name)
                if tid is None:
                    tid = _FIRST_TENSOR_ROW + len(self._rows)
                    self._rows[name] = tid
                    if not self._closed:
                        self._metadata("thread_name", tid, {"name": name})
        return tid

    def complete(
        self, tid: int, name: str, start_us: int, end_us: int, args: str | None = None
    ) -> None:
        """A ``"ph": "X"`` event; ``args`` is a JSON object's text (built by the caller)."""
        line = (
            f'{{"name":"{name}","ph":"X","pid":{self.rank},"tid":{tid},"ts":{start_us},'
            f'"dur":{max(end_us - start_us, 0)}' + (f',"args":{args}' if args else "") + "},\n"
        )
        self._write(line)

    def instant(
        self, tid: int, name: str, ts_us: int | None = None, args: str | None = None
    ) -> None:
        """A ``"ph": "i"`` event on one row."""
        ts = self.now() if ts_us is None else ts_us
        line = (
            f'{{"name":"{name}","ph":"i","s":"t","pid":{self.rank},"tid":{tid},"ts":{ts}'
            + (f',"args":{args}' if args else "")
            + "},\n"
        )
        self._write(line)

    def _write(self, line: str) -> None:
        with self._lock:
            if self._closed:
                return
            self._file.write(line)
            now = time.monotonic()
            if now - self._last_flush >= FLUSH_INTERVAL_S:
                self._file.flush()
                self._last_flush = now

    def flush(self) -> None:
        with self._lock:
            if not self._closed:
                self._file.flush()

    def close(self) -> None:
        """Write the closing event and ``]``; later events are dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            end = {"name": "timeline_end", "ph": "M", "pid": self.rank, "args": {"ts": self.now()}}
            self._file.write(json.dumps(end) + "\n]\n")
            self._file.close()


def read_file(path: str | os.PathLike[str]) -> tuple[list[Any], bool, bool]:
    """The entries of one timeline file: ``(entries, closed, dropped_tail)``.

    ``closed`` says whether the array was closed (the writer stopped normally); ``dropped_tail``
    whether a half-written last line was left out (the writer was killed while writing it).
    A merged trace in the ``{"traceEvents": [...]}`` form is read too.

    Raises:
        ValueError: the file cannot be read, is not a timeline, or is damaged before its end.
    """
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ValueError(f"cannot read timeline file '{source}': {exc.strerror}.") from exc
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        return _read_unfinished(source, text)
    if isinstance(whole, list):
        return whole, True, False
    if isinstance(whole, dict) and isinstance(whole.get("traceEvents"), list):
        return whole["traceEvents"], True, False
    raise ValueError(f"'{source}' is JSON but not a Chrome trace (an array of events).")


def _read_unfinished(path: Path, text: str) -> tuple[list[Any], bool, bool]:
    """Read event by event what a writer left: maybe no ``]``, maybe a half-written last line."""
    decoder = json.JSONDecoder()
    start = len(text) - len(text.lstrip())
    if start == len(text):
        return [], False, False
    if text[start] != "[":
        raise ValueError(
            f"'{path}' is not a hora timeline: it should start with '[' (a Chrome-trace JSON "
            f"array) but starts with {text[start : start + 20]!r}."
        )
    entries: list[Any] = []
    pos = start + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos == len(text):
            return entries, False, False
        if text[pos] == "]":
            return entries, True, False
        try:
            entry, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            if "\n" not in text[pos:].rstrip():  # the last line, cut off while being written
                return entries, False, True
            line = text.count("\n", 0, pos) + 1
            raise ValueError(
                f"'{path}', line {line}: not a JSON trace event ({exc.msg}). Only the last "
                "line of a timeline may be incomplete; this file looks damaged."
            ) from exc
        entries.append(entry)


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of one timeline file, also of one whose writer died mid-line.

    Raises:
        ValueError: see :func:`read_file`.
    """
    return [e for e in read_file(path)[0] if isinstance(e, dict)]


def rank_files(path: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(rank, file)`` for ``path`` and every ``.rank<r>`` sibling that exists, by rank."""
    base = Path(path)
    stem = base.stem if base.suffix else base.name
    pattern = re.compile(re.escape(stem) + r"\.rank(\d+)" + re.escape(base.suffix) + "$")
    parent = base.parent if str(base.parent) else Path(".")
    found = [(0, base)] if base.is_file() else []
    if parent.is_dir():
        for candidate in parent.iterdir():
            match = pattern.match(candidate.name)
            if match and candidate.is_file():
                found.append((int(match.group(1)), candidate))
    return sorted(found)


def merge(path: str | os.PathLike[str], expected_ranks: Iterable[int] | None = None) -> bool:
    """Merge the ranks' files of a timeline into ``path`` and delete the parts.

    Returns:
        Whether it merged (``False``: some expected rank's file is missing; nothing changed).
    """
    # Only this user's own files: in a shared directory, another user could put a file there
    # whose name looks like a rank's.
    files = [(rank, file) for rank, file in rank_files(path) if safe_files.owned_by_this_user(file)]
    if expected_ranks is not None:
        wanted = set(expected_ranks)
        if not wanted <= {rank for rank, _ in files}:
            return False
        files = [(rank, file) for rank, file in files if rank in wanted]
    with safe_files.replacing(path) as out:
        out.write(b"[\n")
        first = True
        for _, file in files:
            for event in read_events(file):
                line = ("" if first else ",\n") + json.dumps(event, separators=(",", ":"))
                out.write(line.encode())
                first = False
        out.write(b"\n]\n")
    for rank, file in files:
        if rank != 0:
            file.unlink(missing_ok=True)
    return True
