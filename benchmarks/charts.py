"""The benchmarks' results as PNG charts: hora's training speed relative to DDP (training.py),
allreduce bus bandwidth by message size (collectives.py), memory and step time per ZeRO mode
(zero.py), and the rounds of an elastic job over time (elastic_recovery.py).

Each chart reads the results dictionary its benchmark writes with ``--json`` (the same keys),
and nothing else: no torch, no hora. matplotlib is optional (``pip install 'hora[plot]'``); it
is imported only to draw, through its object-oriented API on the Agg backend (no pyplot, no
display), and without it a chart is skipped with a line saying how to get it.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from typing import Any

INSTALL_HINT = "pip install 'hora[plot]'"
DPI = 110
# Caption lines under each chart, in points.
CAPTION_FONT_PT = 7.5
CAPTION_LINE_PT = 10.0

MIB = 1024 * 1024

Painter = Callable[[Any], None]


def draw(
    path: str,
    size_in: tuple[float, float],
    results: dict[str, Any],
    paint: Painter,
    notes: Sequence[str],
) -> bool:
    """Draw a chart with ``paint(figure)`` above a small-print caption (``notes``, then the
    run's date, machine and versions), and write it to ``path`` as a PNG.

    Returns:
        Whether the chart was written (``False``: matplotlib is missing, and it said so).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        if not (exc.name or "matplotlib").startswith("matplotlib"):
            raise
        print(
            f"chart skipped ({path}): matplotlib is not installed. Install it "
            f"({INSTALL_HINT}) and run the benchmark again for the chart.",
            flush=True,
        )
        return False
    columns = int(size_in[0] * 72 / (CAPTION_FONT_PT * 0.52))
    lines = [part for note in [*notes, run_line(results)] for part in textwrap.wrap(note, columns)]
    caption_in = (len(lines) * CAPTION_LINE_PT + 10) / 72
    figure = Figure(figsize=(size_in[0], size_in[1] + caption_in), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    chart, caption = figure.subfigures(2, 1, height_ratios=[size_in[1], caption_in])
    paint(chart)
    caption.text(
        0.01,
        0.5,
        "\n".join(lines),
        fontsize=CAPTION_FONT_PT,
        color="0.3",
        ha="left",
        va="center",
        linespacing=1.25,
    )
    figure.savefig(path, format="png", dpi=DPI)
    print(f"chart: wrote {path}", flush=True)
    return True


def run_line(results: dict[str, Any]) -> str:
    """The caption's last line: when, where and what ran."""
    revision = results.get("hora_revision")
    hora = f"hora {results.get('hora_version', '?')}" + (f" ({revision})" if revision else "")
    parts = [
        results.get("date", "date not recorded"),
        results.get("machine", f"{results.get('cpus', '?')} CPUs"),
        hora,
        f"torch {results.get('torch_version', '?')}",
    ]
    if results.get("load_before") and results.get("load_after"):
        parts.append(
            f"load average {results['load_before'][0]:.1f} before, "
            f"{results['load_after'][0]:.1f} after"
        )
    return "Run: " + " · ".join(parts)


def size_label(nbytes: int) -> str:
    if nbytes >= MIB:
        return f"{nbytes // MIB} MiB"
    if nbytes >= 1024:
        return f"{nbytes // 1024} KiB"
    return f"{nbytes} B"


# ---------------------------------------------------------------- training.py

FASTER, SLOWER = "#55a868", "#c44e52"


def training_vs_ddp(results: dict[str, Any], path: str) -> bool:
    """hora's training throughput relative to DDP's, one bar per model, from 1.0 (parity);
    error bars span the ratios of the run's pairs of adjacent hora and DDP blocks."""
    models = results["models"]
    pairs = min(len(m.get("ratio_blocks") or [None]) for m in models)
    notes = [
        f"Bars: DDP's median step time / hora's (slowest rank; {results['iters']} timed steps "
        f"per model and mode, in alternating blocks of {results['block']}). Error bars: the "
        f"lowest and highest ratio of the run's {pairs} pairs of adjacent hora and DDP blocks.",
        f"benchmarks/training.py --iters {results['iters']} --block {results['block']} "
        f"--warmup {results['warmup']}; {batch_words(results)}, 1 thread per process.",
    ]

    def paint(figure: Any) -> None:
        axes = figure.subplots()
        x = list(range(len(models)))
        ratios = [m["ratio"] for m in models]
        low = [min(m.get("ratio_blocks") or [m["ratio"]]) for m in models]
        high = [max(m.get("ratio_blocks") or [m["ratio"]]) for m in models]
        colors = [FASTER if r >= 1 else SLOWER for r in ratios]
        axes.bar(x, [r - 1 for r in ratios], bottom=1.0, color=colors, width=0.6, zorder=2)
        axes.errorbar(
            x,
            ratios,
            yerr=[[r - lo for r, lo in zip(ratios, low)], [hi - r for r, hi in zip(ratios, high)]],
            fmt="none",
            ecolor="black",
            capsize=5,
            linewidth=1,
            zorder=3,
        )
        for i, (ratio, top) in enumerate(zip(ratios, high)):
            axes.annotate(
                f"{ratio:.3f}x",
                (i, top),
                xytext=(0, 6),
                textcoords="offset points",
                ha="center",
                fontsize=9,
            )
        axes.axhline(1.0, color="black", linewidth=1.2, zorder=1, label="DDP (1.0x)")
        goal = results.get("goal")
        if goal and results["world_size"] > 1:
            axes.axhline(goal, color="0.4", linestyle="--", linewidth=1, label=f"goal {goal:g}x")
        bottom, top = min(*low, 1.0), max(*high, goal or 1.0)
        margin = max(top - bottom, 0.1) * 0.12
        axes.set_ylim(max(0.0, bottom - margin), top + 1.5 * margin)
        axes.set_xticks(x, [model_label(m) for m in models])
        axes.set_ylabel("hora throughput / DDP throughput (x)")
        axes.grid(True, axis="y", alpha=0.3)
        axes.set_axisbelow(True)
        figure.legend(
            handles=training_legend(axes, colors), loc="outside right upper", fontsize=8.5
        )
        axes.set_title(training_title(results))

    return draw(path, (10, 5.2), results, paint, notes)


def training_legend(axes: Any, colors: list[str]) -> list[Any]:
    from matplotlib.patches import Patch

    lines, _ = axes.get_legend_handles_labels()
    shown = [Patch(color=FASTER, label="hora faster than DDP")]
    if SLOWER in colors:
        shown.append(Patch(color=SLOWER, label="hora slower than DDP"))
    return [*shown, *lines]


def model_label(row: dict[str, Any]) -> str:
    millions = row["parameters"] / 1e6
    return f"{row['model']}\n{millions:.2g} M params\n{row['parameter_tensors']} tensors"


def batch_words(results: dict[str, Any]) -> str:
    size = results.get("batch_size")
    return f"batch {size} per worker" if size else "each model's own batch per worker"


def training_title(results: dict[str, Any]) -> str:
    device = results.get("device", "cpu")
    where = "CPU" if device == "cpu" else f"GPU ({device})"
    return (
        "Training throughput of hora relative to PyTorch DDP\n"
        f"{results['world_size']} workers, {where}, DDP over {results['ddp_backend']}"
    )


# ---------------------------------------------------------------- collectives.py


def bandwidth_by_size(
    results: dict[str, Any], series: Sequence[tuple[str, str, str]], path: str
) -> bool:
    """Allreduce bus bandwidth against message size (log x), one line per library.

    Args:
        results: collectives.py's results (``allreduce_bandwidth`` rows, ``world_size``).
        series: ``(label, bandwidth key, samples key)`` for each line, the first hora's and
            the second its raw peer's (the labels give their ratio); a band shows the range of
            the samples' bandwidths.
    """
    rows = results["allreduce_bandwidth"]
    ranks = results["world_size"]
    calls = ", ".join(f"{size_label(r['bytes'])} {len(r[series[0][2]])}" for r in rows)
    notes = [
        "Bus bandwidth = 2 (n-1)/n x bytes / time. Lines: medians of the slowest rank's time "
        "per call; bands: the range of all calls. Libraries alternate in blocks of 5 calls.",
        f"Calls per size and library: {calls}. benchmarks/collectives.py"
        f"{results.get('options', '')}.",
    ]

    def paint(figure: Any) -> None:
        axes = figure.subplots()
        sizes = [row["bytes"] for row in rows]
        for index, (label, key, samples_key) in enumerate(series):
            color = f"C{index}"
            axes.plot(sizes, [row[key] for row in rows], marker="o", color=color, label=label)
            if all(samples_key in row for row in rows):
                low, high = zip(*(bandwidth_range(row, samples_key, ranks) for row in rows))
                axes.fill_between(sizes, low, high, color=color, alpha=0.15, linewidth=0)
        first, second = series[0][1], series[1][1]
        for row in rows:
            axes.text(
                row["bytes"],
                0.97,
                f"{row[first] / row[second]:.2f}x",
                transform=axes.get_xaxis_transform(),
                ha="center",
                va="top",
                fontsize=9,
                color="C0",
            )
        axes.set_xscale("log", base=2)
        axes.set_xticks(sizes, [size_label(s) for s in sizes])
        axes.minorticks_off()
        axes.set_ylim(bottom=0, top=axes.get_ylim()[1] * 1.1)
        axes.set_xlabel("message size (one float32 allreduce, in place)")
        axes.set_ylabel("bus bandwidth (GB/s)")
        axes.grid(True, alpha=0.3)
        figure.legend(loc="outside lower center", ncols=len(series), fontsize=9)
        where = " on one host" if results.get("data_path") == "shm" else ""
        axes.set_title(
            f"Allreduce bus bandwidth by message size, {ranks} ranks{where}\n"
            f"(figures at the top: {series[0][0]} over {series[1][0]})",
            fontsize=11,
        )

    return draw(path, (9, 5.0), results, paint, notes)


def bandwidth_range(row: dict[str, Any], samples_key: str, ranks: int) -> tuple[float, float]:
    """The lowest and highest bus bandwidth (GB/s) of a row's timed calls."""
    moved = 2 * (ranks - 1) / ranks * row["bytes"]
    samples = row[samples_key]
    return moved / max(samples) / 1e9, moved / min(samples) / 1e9


# ---------------------------------------------------------------- zero.py

ZERO_MODES = ("hora", "zero1", "zero2", "zero2-overlap", "torch-zero")
ZERO_LABELS = {
    "hora": "hora, unsharded",
    "zero1": "hora ZeRO-1",
    "zero2": "hora ZeRO-2",
    "zero2-overlap": "hora ZeRO-2, gather overlapping the next forward",
    "torch-zero": "torch ZeroRedundancyOptimizer + DDP",
}

Cells = list[tuple[dict[str, Any], dict[str, Any]]]  # (job, its row of one model)


def zero_modes(jobs: Sequence[dict[str, Any]], path: str) -> bool:
    """Memory per rank (peak resident set, and the optimizer state within it) and step time,
    per ZeRO mode: one column per model, bars grouped by the number of ranks.

    Args:
        jobs: zero.py's results, one per ``--np`` (each with its ``models`` rows).
    """
    models = list(dict.fromkeys(row["model"] for job in jobs for row in job["models"]))
    modes = list(jobs[0].get("modes", ZERO_MODES))
    first = jobs[0]
    ranks = " ".join(str(job["world_size"]) for job in jobs)
    notes = [
        "Memory: light bar = peak resident set of a rank (the largest; the process included), "
        "solid bar = the optimizer state a rank holds. Step time: median of every timed step "
        "(slowest rank); error bars: range.",
        f"benchmarks/zero.py --np {ranks} --reps {first['reps']} --steps {first['steps']} "
        f"--batch-size {first['batch_size']}: {first['reps']} blocks of {first['steps']} timed "
        "steps per mode, modes alternating.",
    ]

    def paint(figure: Any) -> None:
        grid = figure.subplots(2, len(models), squeeze=False)
        for column, model in enumerate(models):
            cells = [(job, row) for job in jobs for row in job["models"] if row["model"] == model]
            zero_memory(grid[0][column], cells, modes)
            zero_steps(grid[1][column], cells, modes)
            millions = cells[0][1]["parameters"] / 1e6
            grid[0][column].set_title(f"{model} model ({millions:.1f} M parameters)")
        grid[0][0].set_ylabel("memory per rank (MiB)")
        grid[1][0].set_ylabel("step time (ms)")
        zero_legend(figure, modes)
        figure.suptitle(
            "ZeRO modes: memory per rank and step time "
            f"(Adam, batch {first['batch_size']} per rank, 1 thread per process)"
        )

    run = {**first, "load_after": jobs[-1].get("load_after")}
    return draw(path, (max(10.0, 4.6 * len(models) + 1.4), 7.4), run, paint, notes)


def zero_offsets(modes: Sequence[str]) -> tuple[float, list[float]]:
    """Each mode's bar width and its offset from its group's centre."""
    width = 0.8 / len(modes)
    return width, [(i - (len(modes) - 1) / 2) * width for i in range(len(modes))]


def zero_memory(axes: Any, cells: Cells, modes: Sequence[str]) -> None:
    width, offsets = zero_offsets(modes)
    for index, (mode, offset) in enumerate(zip(modes, offsets)):
        x = [group + offset for group in range(len(cells))]
        peak = [row[mode]["peak_rss_bytes"] / MIB for _, row in cells]
        state = [row[mode]["state_bytes"] / MIB for _, row in cells]
        axes.bar(x, peak, width, color=f"C{index}", alpha=0.35, zorder=2)
        axes.bar(x, state, width, color=f"C{index}", zorder=3)
    zero_groups(axes, cells)


def zero_steps(axes: Any, cells: Cells, modes: Sequence[str]) -> None:
    width, offsets = zero_offsets(modes)
    for index, (mode, offset) in enumerate(zip(modes, offsets)):
        x = [group + offset for group in range(len(cells))]
        median = [row[mode]["step_s"] * 1e3 for _, row in cells]
        low = [row[mode]["step_s_range"][0] * 1e3 for _, row in cells]
        high = [row[mode]["step_s_range"][1] * 1e3 for _, row in cells]
        axes.bar(x, median, width, color=f"C{index}", zorder=2)
        axes.errorbar(
            x,
            median,
            yerr=[[m - lo for m, lo in zip(median, low)], [hi - m for m, hi in zip(median, high)]],
            fmt="none",
            ecolor="black",
            capsize=2,
            linewidth=0.8,
            zorder=3,
        )
    zero_groups(axes, cells)


def zero_groups(axes: Any, cells: Cells) -> None:
    axes.set_xticks(range(len(cells)), [ranks_label(job) for job, _ in cells])
    axes.grid(True, axis="y", alpha=0.3)
    axes.set_axisbelow(True)


def ranks_label(job: dict[str, Any]) -> str:
    """A group's label: its ranks, and the CPUs they shared when there were fewer."""
    ranks, cpus = job["world_size"], job.get("cpus")
    return f"{ranks} ranks" + (f"\n(on {cpus} CPUs)" if cpus and ranks > cpus else "")


def zero_legend(figure: Any, modes: Sequence[str]) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=f"C{i}", label=ZERO_LABELS.get(m, m)) for i, m in enumerate(modes)]
    handles += [
        Patch(color="0.75", label="light: peak resident set"),
        Patch(color="0.35", label="solid: optimizer state"),
    ]
    figure.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=9)


# ---------------------------------------------------------------- elastic_recovery.py

ROUND_COLORS = ("#4c72b0", "#55a868", "#8172b3", "#937860")
GAP_COLOR = "#dd8452"
START_COLOR = "#c8c8c8"
KILL_COLOR = "#c44e52"

Span = tuple[str, float, float, int]  # kind, start (s since launch), end, round


def elastic_rounds(results: dict[str, Any], path: str) -> bool:
    """The rounds of one elastic hora job over time, one row per worker process: start-up, the
    steps of each round, the kill, and the survivors' way into the next round. The job drawn is
    the one whose recovery time was the median of the run's hora jobs."""
    job = median_job(results["samples"]["hora"])
    if job is None:
        print(f"chart skipped ({path}): the results hold no job events.", flush=True)
        return False
    events, launched = job["events"], job["launched"]
    joined = min(e["t"] for e in events if e["event"] == "joined") - launched
    torchrun = results.get("medians", {}).get("torchrun", {}).get("recovery_s")
    beside = f" (torchrun's restart of the same job: {torchrun:.2f} s)" if torchrun else ""
    notes = [
        f"Launched at 0 s; the workers joined round 0 from {joined:.2f} s on, after start-up "
        "(Python, torch, the job's rendezvous). Bars: what each worker process did; ticks: its steps, "
        f"black every {results.get('commit_every', 5)} steps at a commit. Recovery: the kill "
        f"to the first step of the next round{beside}.",
        f"benchmarks/elastic_recovery.py --repeats {len(results['samples']['hora'])}: the hora "
        "job with the median recovery time; horarun -np 3 --min-np 2 with three loopback hosts.",
    ]

    def paint(figure: Any) -> None:
        axes = figure.subplots()
        timeline_panel(axes, job, results.get("commit_every", 5))
        axes.set_xlabel("seconds since the job was launched")
        timeline_legend(figure)
        figure.suptitle(
            f"An elastic job losing a worker: rounds over time ({results.get('np', 3)} "
            f"workers, rank {results.get('killed_rank', 2)} killed at step "
            f"{results.get('kill_at', 20)} of {results.get('steps', 40)})"
        )

    return draw(path, (10, 4.6), results, paint, notes)


def median_job(jobs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The job whose recovery time is the median (the lower of the two middle ones)."""
    with_events = sorted((j for j in jobs if j.get("events")), key=lambda j: j["recovery_s"])
    return with_events[(len(with_events) - 1) // 2] if with_events else None


def worker_rows(events: Sequence[dict[str, Any]]) -> list[str]:
    """The workers, in the order of the first rank each had."""
    first: dict[str, int] = {}
    for event in events:
        if "worker" in event and "rank" in event:
            first.setdefault(str(event["worker"]), int(event["rank"]))
    return sorted(first, key=lambda worker: first[worker])


def worker_spans(events: Sequence[dict[str, Any]], worker: str, launched: float) -> list[Span]:
    """One worker's bars: ``start`` (launch to joining its first round), ``train`` (joining a
    round to its last step in it) and ``gap`` (its last step of one round to joining the
    next), in seconds since ``launched``."""
    mine = [e for e in events if str(e.get("worker")) == worker]
    spans: list[Span] = []
    end = 0.0
    for number in sorted({int(e["round"]) for e in mine if "round" in e}):
        times = {
            kind: [e["t"] - launched for e in mine if e["event"] == kind and e["round"] == number]
            for kind in ("joined", "step")
        }
        if not times["joined"] or not times["step"]:
            continue
        spans.append(("gap" if spans else "start", end, times["joined"][0], number))
        end = max(times["step"])
        spans.append(("train", times["joined"][0], end, number))
    return spans


def round_facts(events: Sequence[dict[str, Any]]) -> dict[int, tuple[int, int, int]]:
    """Per round: the workers that trained in it, and its first and last step."""
    facts: dict[int, tuple[int, int, int]] = {}
    for e in events:
        if e["event"] == "step":
            size, low, high = facts.get(e["round"], (e["size"], e["step"], e["step"]))
            facts[e["round"]] = (size, min(low, e["step"]), max(high, e["step"]))
    return facts


def timeline_panel(axes: Any, job: dict[str, Any], commit_every: int) -> None:
    events, launched = job["events"], job["launched"]
    workers = worker_rows(events)
    facts = round_facts(events)
    labelled: set[int] = set()
    for y, worker in enumerate(workers):
        for kind, start, end, number in worker_spans(events, worker, launched):
            color = {"start": START_COLOR, "gap": GAP_COLOR}.get(
                kind, ROUND_COLORS[number % len(ROUND_COLORS)]
            )
            axes.broken_barh([(start, end - start)], (y - 0.3, 0.6), facecolors=color, zorder=2)
            if kind == "train" and number not in labelled:
                labelled.add(number)
                size, low, high = facts[number]
                axes.text(
                    (start + end) / 2,
                    y - 0.38,
                    f"round {number}: {size} workers\nsteps {low}-{high}",
                    ha="center",
                    va="bottom",
                    fontsize=8.5,
                )
        step_ticks(axes, events, worker, launched, y, commit_every)
    failure_marks(axes, job, workers)
    axes.set_yticks(range(len(workers)), [f"worker {i}" for i in range(len(workers))])
    axes.set_ylim(len(workers) - 0.1, -1.0)
    steps = [e["t"] - launched for e in events if e["event"] == "step"]
    first = min(e["t"] for e in events if e["event"] == "joined") - launched
    margin = 0.06 * (max(steps) - first)
    axes.set_xlim(first - margin, max(steps) + margin)
    axes.grid(True, axis="x", alpha=0.3)
    axes.set_axisbelow(True)


def step_ticks(
    axes: Any,
    events: Sequence[dict[str, Any]],
    worker: str,
    launched: float,
    y: int,
    commit_every: int,
) -> None:
    """A white tick at each of a worker's steps, black where it committed."""
    mine = [e for e in events if e["event"] == "step" and str(e["worker"]) == worker]
    plain = [e["t"] - launched for e in mine if e["step"] % commit_every]
    commits = [e["t"] - launched for e in mine if not e["step"] % commit_every]
    axes.vlines(plain, y - 0.3, y + 0.3, colors="white", linewidth=0.6, zorder=3)
    axes.vlines(commits, y - 0.3, y + 0.3, colors="black", linewidth=1.4, zorder=3)


def failure_marks(axes: Any, job: dict[str, Any], workers: list[str]) -> None:
    """The kill (a cross on its worker, a line through the panel), the recovery time, and the
    launcher's line about the next round."""
    launched = job["launched"]
    kills = [e for e in job["events"] if e["event"] == "killed"]
    if not kills:
        return
    at = kills[0]["t"] - launched
    axes.axvline(at, color=KILL_COLOR, linestyle="--", linewidth=1, zorder=1)
    if str(kills[0].get("worker")) in workers:
        y = workers.index(str(kills[0]["worker"]))
        axes.plot([at], [y], marker="X", markersize=11, color=KILL_COLOR, zorder=4)
        axes.annotate(
            "SIGKILL",
            (at, y),
            xytext=(9, 0),
            textcoords="offset points",
            va="center",
            fontsize=8.5,
            color=KILL_COLOR,
        )
    recovered = at + job["recovery_s"]
    below = len(workers) - 0.45
    axes.annotate(
        "",
        (recovered, below),
        xytext=(at, below),
        arrowprops={"arrowstyle": "<->", "color": "black", "linewidth": 0.8},
    )
    axes.text(
        (at + recovered) / 2,
        below - 0.05,
        f"recovery {job['recovery_s'] * 1e3:.0f} ms",
        ha="center",
        va="bottom",
        fontsize=8.5,
    )
    for line in job.get("driver", [])[:1]:
        # On the killed worker's row, which is empty after the kill, at the right.
        axes.text(
            0.99,
            len(workers) - 1,
            textwrap.fill(line, 46),
            transform=axes.get_yaxis_transform(),
            ha="right",
            va="center",
            multialignment="left",
            fontsize=7.5,
            family="monospace",
            bbox={"facecolor": "white", "edgecolor": "0.6", "linewidth": 0.6},
            zorder=5,
        )


def timeline_legend(figure: Any) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        Patch(color=START_COLOR, label="start-up"),
        Patch(color=ROUND_COLORS[0], label="round 0 (sync, then steps)"),
        Patch(color=ROUND_COLORS[1], label="round 1 (sync, then steps)"),
        Patch(color=GAP_COLOR, label="failure noticed, state restored, next round joined"),
        Line2D([], [], color=KILL_COLOR, linestyle="--", marker="X", label="worker killed"),
    ]
    figure.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8.5)
