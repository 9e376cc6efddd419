"""``hora timeline``: the summary as text for people, and the command's subcommands.

``hora timeline summarize FILE`` prints a few sentences (how much of a step is communication,
whether it overlaps backward, which rank is the straggler) and short tables; ``--json`` prints
:meth:`~hora.tools.timeline.Summary.to_dict` for tools. ``merge`` writes one Chrome trace of all
ranks; ``plot`` draws a few steps (:mod:`hora.tools.timeline_plot`). The numbers come from
:mod:`hora.tools.timeline`; this module only presents them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from hora.tools.arguments import positive
from hora.tools.timeline import (
    FusionSummary,
    Summary,
    TimelineError,
    load,
    summarize,
    write_merged,
)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> str:
    """Columns aligned: the first to the left, the rest to the right."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def line(cells: Sequence[str]) -> str:
        first = str(cells[0]).ljust(widths[0])
        rest = [str(c).rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return (indent + "  ".join([first, *rest])).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def _fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    return f"{ms:.2f}"


def _fmt_share(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _answers(s: Summary) -> list[str]:
    """Plain sentences: communication per step, overlap with backward, the straggler."""
    out: list[str] = []
    if s.step_ms_median is not None and s.comm_share is not None:
        comm = s.comm_ms_per_step_median or 0.0
        out.append(
            f"A step takes {_fmt_ms(s.step_ms_median)} ms (median); communication runs for "
            f"{_fmt_ms(comm)} ms of it, {_fmt_share(s.comm_share)} of step time overall."
        )
    else:
        out.append(
            "No training steps were recorded (no OPTIMIZER_STEP markers from "
            "hvd.DistributedOptimizer), so step time and communication share are unknown."
        )
    if s.overlap_share is not None:
        overlap = s.overlap_share
        verdict = (
            "most of it is hidden behind backward"
            if overlap >= 0.5
            else "some of it is hidden behind backward"
            if overlap >= 0.1
            else "almost none of it overlaps backward"
        )
        out.append(f"{_fmt_share(overlap)} of communication time falls inside BACKWARD: {verdict}.")
    elif s.has_steps:
        out.append("There are no BACKWARD markers, so overlap with backward is unknown.")
    st = s.straggler
    if st is None:
        out.append(
            "With one rank (or no collective seen on two ranks) there is no straggler to find."
        )
    elif st.clear:
        out.append(
            f"Rank {st.rank} is the straggler: it submitted last in {st.last_count} of "
            f"{st.compared} collectives ({_fmt_share(st.share)}); the other ranks waited "
            f"{_fmt_ms(st.wait_ms_mean)} ms for it each time ({_fmt_ms(st.wait_ms_total)} ms in all)."
        )
        if any(r.steady_calls for r in s.per_rank):
            out.append(
                "In the steady state the others wait for it inside the collective, so part of "
                "their communication time is this wait."
            )
    else:
        out.append(
            f"No rank stands out as a straggler: the rank submitting last most often, rank "
            f"{st.rank}, was last in only {_fmt_share(st.share)} of {st.compared} collectives."
        )
    return out


def format_summary(s: Summary, top: int = 10) -> str:
    """The summary as text for people: a few sentences, then short tables."""
    extra = len(s.files) - 1
    files = f"{s.files[0]}" + (f" (+{extra} more file{'s' if extra > 1 else ''})" if extra else "")
    parts = [f"Timeline {files}: {len(s.ranks)} rank(s)."]
    parts += [f"Note: {w}" for w in s.warnings]
    parts.append("")
    parts += _answers(s)
    if s.has_steps:
        parts += _steps(s)
    if len(s.ranks) > 1:
        parts += _waits(s)
    parts += _tensors(s, top)
    if s.fusion is not None:
        parts += ["", _fusion(s.fusion)]
    if s.per_rank:
        parts.append(_steady_state(s))
    return "\n".join(parts)


def _section(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A table after a blank line and its title."""
    return ["", title, _table(headers, rows)]


def _steps(s: Summary) -> list[str]:
    """The table of training steps: each rank's medians, then all ranks'."""
    rows = [
        [
            *map(str, (r.rank, r.steps)),
            *map(_fmt_ms, (r.step_ms_median, r.backward_ms_median, r.optimizer_step_ms_median)),
            _fmt_ms(r.comm_ms_per_step_median),
            *map(_fmt_share, (r.comm_share, r.overlap_share)),
        ]
        for r in s.per_rank
    ]
    rows.append(
        [
            "all",
            str(sum(r.steps for r in s.per_rank)),
            _fmt_ms(s.step_ms_median),
            "",
            "",
            _fmt_ms(s.comm_ms_per_step_median),
            _fmt_share(s.comm_share),
            _fmt_share(s.overlap_share),
        ]
    )
    headers = ["rank", "steps", "step", "backward", "opt.step", "comm", "comm share", "in backward"]
    title = "Steps (medians in ms; comm = collectives and fusion-buffer copies):"
    return _section(title, headers, rows)


def _waits(s: Summary) -> list[str]:
    """The table of waiting for the last rank to submit, per rank."""
    rows = [
        [
            *map(str, (r.rank, r.calls, r.negotiated_calls, r.steady_calls, r.last_count)),
            *map(_fmt_ms, (r.wait_ms_total, r.wait_ms_mean, r.wait_ms_median)),
        ]
        for r in s.per_rank
    ]
    headers = ["rank", "calls", "negotiated", "steady", "last", "wait total", "mean", "median"]
    compared = s.compared_collectives
    title = f"Waiting for the last rank to submit ({compared} collectives compared; ms):"
    return _section(title, headers, rows)


def _tensors(s: Summary, top: int) -> list[str]:
    """The ``top`` tensors by collective time, or that there were no collectives."""
    if not s.tensors:
        return ["", "No collectives were recorded."]
    shown = s.tensors[:top]
    more = len(s.tensors) - len(shown)
    rows = [
        [
            t.name,
            t.op,
            str(t.calls),
            *map(_fmt_ms, (t.collective_ms, t.collective_ms_mean, t.wait_ms)),
            _fmt_share(t.fused_share),
        ]
        for t in shown
    ]
    headers = ["tensor", "op", "calls", "collective", "per call", "waiting", "fused"]
    title = (
        f"Top {len(shown)} of {len(s.tensors)} tensors by collective time "
        "(ms per rank, summed over calls):"
    )
    lines = _section(title, headers, rows)
    if more:
        lines.append(f"  ... and {more} more (--top N shows more).")
    return lines


def _fusion(f: FusionSummary) -> str:
    """One sentence on the fusion batches of one rank."""
    return (
        f"Fusion (rank {f.rank}): {f.batches} batches, {f.tensors_per_batch_mean:.1f} tensors "
        f"per batch (at most {f.tensors_per_batch_max}), "
        f"{_fmt_bytes(f.bytes_per_batch_mean)} per batch (at most "
        f"{_fmt_bytes(f.bytes_per_batch_max)}); {_fmt_share(f.fused_call_share)} of calls "
        "shared their batch with another tensor."
    )


def _steady_state(s: Summary) -> str:
    """One sentence on the steady state: how often each rank entered and left it, and the
    share of calls that skipped negotiation."""
    entries = {r.steady_state_entries for r in s.per_rank}
    exits = {r.steady_state_exits for r in s.per_rank}
    steady = sum(r.steady_calls for r in s.per_rank)
    calls = sum(r.negotiated_calls + r.steady_calls for r in s.per_rank)
    if len(entries) == 1 and len(exits) == 1:
        counts = f"entered {entries.pop()} time(s) and left {exits.pop()} time(s) on each rank"
    else:
        counts = "entered/left " + ", ".join(
            f"rank {r.rank}: {r.steady_state_entries}/{r.steady_state_exits}" for r in s.per_rank
        )
    share = f"; {_fmt_share(steady / calls)} of calls skipped negotiation" if calls else ""
    return f"Steady state: {counts}{share}."


# ---------------------------------------------------------------------------------- command


def _source(files: list[str]) -> str | list[str]:
    """One file: ``PATH`` and its rank siblings; several: exactly those."""
    return files[0] if len(files) == 1 else files


def _summarize(args: argparse.Namespace) -> int:
    summary = summarize(load(_source(args.files)))
    if args.json:
        print(json.dumps(summary.to_dict(top=args.top), indent=2))
    else:
        print(format_summary(summary, top=args.top))
    return 0


def _merge(args: argparse.Namespace) -> int:
    timeline = load(_source(args.files))
    count = write_merged(timeline, args.output)
    for warning in timeline.warnings:
        print(f"hora timeline merge: note: {warning}", file=sys.stderr)
    print(
        f"wrote {args.output}: {count} events of {len(timeline.ranks)} rank(s) from "
        f"{len(timeline.files)} file(s); open it in https://ui.perfetto.dev or chrome://tracing."
    )
    return 0


def _plot(args: argparse.Namespace) -> int:
    from hora.tools.timeline_plot import plot

    timeline = load(_source(args.files))
    window = plot(timeline, args.output, steps=args.steps)
    if window.steps:
        what = f"steps {window.first_step + 1} to {window.first_step + window.steps}"
    else:
        what = "the whole run (no OPTIMIZER_STEP markers)"
    span_ms = (window.end_us - window.start_us) / 1000
    print(f"wrote {args.output}: {what}, {span_ms:.1f} ms, {len(timeline.ranks)} rank(s).")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``hora timeline`` subcommand; errors become one message and exit status 1."""
    try:
        status: int = args.timeline_handler(args)
    except TimelineError as exc:
        print(f"hora timeline {args.timeline_command}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # writing the output: a missing folder, no permission, a full disk
        where = f" '{exc.filename}'" if exc.filename else ""
        print(
            f"hora timeline {args.timeline_command}: cannot write{where}: {exc.strerror or exc}. "
            "Check that its folder exists and is writable.",
            file=sys.stderr,
        )
        return 1
    return status


# Every subcommand reads the same files.
_FILES_HELP = (
    "the timeline PATH (its .rank<r> files next to it are read too), or several files to "
    "read exactly"
)


def add_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``timeline`` to the ``hora`` command's subparsers; returns its parser."""
    timeline = commands.add_parser(
        "timeline",
        help="summarize, merge or plot a timeline written with HORA_TIMELINE",
        description="Read the per-rank files that HORA_TIMELINE=PATH writes (PATH and its "
        "PATH.rank<r> siblings, or one merged PATH) and summarize, merge or plot them.",
    )
    sub = timeline.add_subparsers(dest="timeline_command", required=True, metavar="ACTION")
    _add_summarize(sub)
    _add_merge(sub)
    _add_plot(sub)
    timeline.set_defaults(handler=run)
    return timeline


def _subcommand(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    handler: Callable[[argparse.Namespace], int],
    help: str,
    description: str,
) -> argparse.ArgumentParser:
    """Add subcommand ``name``, which reads the timeline's files and runs ``handler``."""
    parser = sub.add_parser(name, help=help, description=description)
    parser.add_argument("files", nargs="+", metavar="FILE", help=_FILES_HELP)
    parser.set_defaults(timeline_handler=handler)
    return parser


def _add_summarize(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    summary = _subcommand(
        sub,
        "summarize",
        _summarize,
        help="step time, communication share, overlap with backward, straggler, top tensors",
        description="Summarize a timeline: how much of a step is communication, whether it "
        "overlaps backward, which rank the others wait for, the costliest tensors and fusion.",
    )
    summary.add_argument("--json", action="store_true", help="print the summary as JSON")
    summary.add_argument(
        "--top", type=positive, default=10, metavar="N", help="tensors to list (default 10)"
    )


def _add_merge(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    merge = _subcommand(
        sub,
        "merge",
        _merge,
        help="write all ranks into one Chrome-trace file",
        description="Merge the ranks' files into one Chrome-trace JSON file for Perfetto or "
        "chrome://tracing. Files cut short by a crash are read up to their last whole event.",
    )
    merge.add_argument("-o", "--output", required=True, metavar="OUT", help="file to write")


def _add_plot(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plot = _subcommand(
        sub,
        "plot",
        _plot,
        help="draw a few steps of every rank as a PNG (needs matplotlib)",
        description="Draw a Gantt chart of a few training steps from the middle of the run: "
        "per rank, a row of training markers, one of waiting, one of communication. Needs "
        "matplotlib: pip install 'hora[plot]'.",
    )
    plot.add_argument("-o", "--output", required=True, metavar="OUT.png", help="PNG to write")
    plot.add_argument(
        "--steps", type=positive, default=3, metavar="N", help="steps to draw (default 3)"
    )
