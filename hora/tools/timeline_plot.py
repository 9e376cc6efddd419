"""A Gantt-style picture of a few training steps of a timeline: ``hora timeline plot``.

Each rank gets three rows: training markers (``BACKWARD``, ``OPTIMIZER_STEP``), waiting
(``NEGOTIATE``, ``WAIT_FOR_BATCH``, ``QUEUE``) and communication (fusion-buffer copies and the
collective). The window is a few consecutive steps from the middle of the run, where the job is
past its warm-up. matplotlib is optional (``pip install 'hora[plot]'``); this module imports it
only when asked to draw. It reads a loaded :class:`~hora.tools.timeline.Timeline` and nothing else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hora.common.vocabulary import safe_files
from hora.tools.timeline import (
    BACKWARD,
    FIRST_TENSOR_ROW,
    MEMCPY_IN,
    MEMCPY_OUT,
    NEGOTIATE,
    OPTIMIZER_STEP,
    QUEUE,
    TRAINING_ROW,
    WAIT_FOR_BATCH,
    Timeline,
    TimelineError,
)

INSTALL_HINT = (
    "drawing a timeline needs matplotlib, which is not installed in this environment: "
    "pip install 'hora[plot]' (or pip install matplotlib)."
)
COLLECTIVE = "collective"
COLORS = {
    BACKWARD: "#4c72b0",
    OPTIMIZER_STEP: "#dd8452",
    NEGOTIATE: "#c44e52",
    WAIT_FOR_BATCH: "#e8a0a2",
    QUEUE: "#a0a0a0",
    MEMCPY_IN: "#8172b3",
    COLLECTIVE: "#55a868",
    MEMCPY_OUT: "#937860",
}
WAITING = (NEGOTIATE, WAIT_FOR_BATCH, QUEUE)
LANES = ("training", "waiting", "communication")


@dataclass(frozen=True)
class PlotWindow:
    """The time drawn.

    Attributes:
        start_us: left edge, microseconds since the epoch.
        end_us: right edge.
        steps: complete steps inside it (0 when the timeline has no ``OPTIMIZER_STEP`` markers
            and the whole timeline is drawn).
        first_step: index of the first step drawn (0 is the first complete step).
    """

    start_us: float
    end_us: float
    steps: int
    first_step: int


def choose_window(timeline: Timeline, steps: int) -> PlotWindow:
    """``steps`` consecutive steps from the middle of the lowest rank's run, or everything."""
    if steps < 1:
        raise TimelineError(f"--steps must be at least 1 (got {steps}).")
    timed = [e for e in timeline.events if e.ph == "X"]
    if not timed:
        raise TimelineError("the timeline has no timed events to plot.")
    lowest = min(e.rank for e in timed)
    ends = sorted(
        e.end
        for e in timed
        if e.rank == lowest and e.tid == TRAINING_ROW and e.name == OPTIMIZER_STEP
    )
    complete = len(ends) - 1
    if complete < 1:
        return PlotWindow(min(e.ts for e in timed), max(e.end for e in timed), 0, 0)
    shown = min(steps, complete)
    first = (complete - shown) // 2
    return PlotWindow(ends[first], ends[first + shown], shown, first)


def _lane(name: str, tid: int) -> tuple[str, str] | None:
    """(lane, color key) of an event, or ``None`` for events not drawn."""
    if tid == TRAINING_ROW:
        return ("training", name) if name in (BACKWARD, OPTIMIZER_STEP) else None
    if tid < FIRST_TENSOR_ROW:
        return None
    if name in WAITING:
        return "waiting", name
    if name in (MEMCPY_IN, MEMCPY_OUT):
        return "communication", name
    return "communication", COLLECTIVE


def plot(timeline: Timeline, out: str | os.PathLike[str], steps: int = 3) -> PlotWindow:
    """Draw ``steps`` steps of every rank into the PNG ``out``.

    Raises:
        TimelineError: matplotlib is missing (the message says how to install it), or there is
            nothing to draw.

    Example:
        >>> plot(load("/tmp/timeline.json"), "/tmp/steps.png", steps=3)
        PlotWindow(start_us=..., end_us=..., steps=3, first_step=23)
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise TimelineError(INSTALL_HINT) from None

    window = choose_window(timeline, steps)
    ranks = timeline.ranks
    bars = _bars(timeline, window)
    rows = [(rank, lane) for rank in ranks for lane in LANES]
    figure = Figure(figsize=(12, 1.2 + 0.45 * len(rows)), layout="constrained")
    axes: Any = figure.subplots()
    for i in range(1, len(ranks), 2):  # shade every other rank, to keep its rows together
        start = i * len(LANES) - 0.5
        axes.axhspan(start, start + len(LANES), color="#f2f2f2", zorder=0)
    for y, row_key in enumerate(rows):
        for key, spans in bars.get(row_key, {}).items():
            axes.broken_barh(spans, (y - 0.4, 0.8), facecolors=COLORS[key], linewidth=0)
    for boundary in _step_boundaries(timeline, window, min(ranks)):
        axes.axvline(boundary, color="black", linestyle=":", linewidth=0.8)
    axes.set_yticks(range(len(rows)), [f"rank {r} {lane}" for r, lane in rows])
    axes.set_ylim(len(rows) - 0.5, -0.5)
    axes.set_xlim(0, (window.end_us - window.start_us) / 1000)
    axes.set_xlabel("ms")
    axes.set_title(_title(window, min(ranks)))
    used = {key for row in bars.values() for key in row}
    labels = {COLLECTIVE: "collective (ALLREDUCE, ...)"}
    legend = [Patch(color=COLORS[k], label=labels.get(k, k)) for k in COLORS if k in used]
    if legend:
        figure.legend(handles=legend, loc="outside lower center", ncols=min(len(legend), 4))
    with safe_files.replacing(out) as file:
        figure.savefig(file, format=Path(out).suffix.lstrip(".") or "png", dpi=110)
    return window


def _bars(
    timeline: Timeline, window: PlotWindow
) -> dict[tuple[int, str], dict[str, list[tuple[float, float]]]]:
    """The bars to draw: ``bars[(rank, lane)][color key] = [(start_ms, width_ms)]``.

    Events are clipped to the window; times are milliseconds from its left edge.
    """
    bars: dict[tuple[int, str], dict[str, list[tuple[float, float]]]] = {}
    for e in timeline.events:
        if e.ph != "X" or e.end < window.start_us or e.ts > window.end_us:
            continue
        placed = _lane(e.name, e.tid)
        if placed is None:
            continue
        lane, key = placed
        start = max(e.ts, window.start_us)
        end = min(e.end, window.end_us)
        # A bar narrower than the line width still shows as a thin mark.
        width = max(end - start, (window.end_us - window.start_us) * 1e-4)
        row = bars.setdefault((e.rank, lane), {})
        row.setdefault(key, []).append(((start - window.start_us) / 1000, width / 1000))
    return bars


def _title(window: PlotWindow, rank: int) -> str:
    """The plot's title: the steps drawn, whose ends (``rank``'s) are the dotted lines."""
    if window.steps:
        return (
            f"hora timeline: steps {window.first_step + 1} to {window.first_step + window.steps} "
            f"(dotted lines: rank {rank}'s step ends)"
        )
    return "hora timeline: the whole run (no OPTIMIZER_STEP markers, so no steps)"


def _step_boundaries(timeline: Timeline, window: PlotWindow, rank: int) -> list[float]:
    return [
        (e.end - window.start_us) / 1000
        for e in timeline.events
        if e.rank == rank
        and e.ph == "X"
        and e.tid == TRAINING_ROW
        and e.name == OPTIMIZER_STEP
        and window.start_us <= e.end <= window.end_us
    ]
