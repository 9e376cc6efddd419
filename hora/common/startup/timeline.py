"""A rank's timeline over a session's life: opened at ``init`` (``HORA_TIMELINE``) or by
``hvd.start_timeline``, closed by ``hvd.stop_timeline`` or at ``shutdown``, where rank 0 merges
the ranks' files once every rank has closed its own.

The file format and its writer are :mod:`hora.common.vocabulary.timeline_writer`'s; this module decides
when a timeline starts and ends. It knows the engine only as the holder of the timeline.
"""

from __future__ import annotations

import logging
import os

from hora.common.engine import Engine
from hora.common.job.store import StoreClient
from hora.common.job.store_keys import GenerationKeys
from hora.common.runtime import Session, runtime, session
from hora.common.vocabulary.timeline_writer import Timeline, merge, rank_path

logger = logging.getLogger("hora")

# How long rank 0 waits at shutdown for the other ranks' timeline files to be closed.
TIMELINE_MERGE_WAIT_S = 5.0


def open_timeline(current: Session, path: str, mark_cycles: bool) -> None:
    """Start writing ``path``'s file for this rank (closing any timeline before it).

    Raises:
        ValueError: the file cannot be created; the message names the rank and the file.
    """
    engine = current.engine
    previous = engine.timeline
    try:
        engine.timeline = Timeline(path, engine.rank, mark_cycles)
    except OSError as exc:
        raise ValueError(
            f"rank {engine.rank}: cannot write the timeline file "
            f"{rank_path(path, engine.rank)} ({exc.strerror or exc}). Point HORA_TIMELINE "
            "(or hvd.start_timeline, or horarun --timeline-filename) at a directory this "
            "rank can write to."
        ) from exc
    if previous is not None:
        previous.close()
    current.timeline_path = path


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a timeline (every rank calls it; rank r > 0 writes the same name with
    ``.rank<r>`` before its extension: ``timeline.rank1.json``).

    See docs/profiling.md. A timeline already running is closed first.

    Raises:
        ValueError: ``init`` has not been called, or the file cannot be created.
    """
    with runtime().lock:
        open_timeline(session(), os.fspath(file_path), mark_cycles)


def stop_timeline() -> None:
    """Stop writing the timeline and close this rank's file (valid JSON from then on)."""
    with runtime().lock:
        current = runtime().session
        if current is not None and current.engine.timeline is not None:
            timeline, current.engine.timeline = current.engine.timeline, None
            timeline.close()


def current_timeline() -> Timeline | None:
    """The timeline being written, if any (cheap enough for a per-gradient hook)."""
    current = runtime().session
    return current.engine.timeline if current is not None else None


def finish_timeline(current: Session) -> None:
    """Close this rank's timeline; rank 0 merges the ranks' files if the job ended well."""
    engine = current.engine
    if engine.timeline is not None:
        engine.timeline.close()
        engine.timeline = None
    path, current.timeline_path = current.timeline_path, None
    if path is None or engine.failure is not None:
        return
    try:
        _merge_when_closed(engine, current.store, path, current.generation)
    except Exception as exc:  # never fail a shutdown over the timeline
        _left_unmerged(path, f"merging failed: {exc}")


def _merge_when_closed(engine: Engine, store: StoreClient, path: str, generation: int) -> None:
    keys = GenerationKeys(generation)
    if engine.size > 1:
        if engine.rank != 0:
            store.set_signed(keys.timeline_closed(engine.rank), b"")
            return
        closed = [
            store.wait(keys.timeline_closed(r), TIMELINE_MERGE_WAIT_S)
            for r in range(1, engine.size)
        ]
        if not all(closed):
            why = f"not every rank closed its file within {TIMELINE_MERGE_WAIT_S:.0f} s"
            _left_unmerged(path, why)
            return
    if not merge(path, range(engine.size)):
        _left_unmerged(path, "some rank's file was not found")


def _left_unmerged(path: str, why: str) -> None:
    logger.warning(
        "the timeline's rank files next to %s were left as they are (%s); "
        "hora timeline summarize reads them together.",
        path,
        why,
    )
