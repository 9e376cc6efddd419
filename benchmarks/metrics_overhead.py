"""What publishing live metrics costs a training step.

Usage::

    .venv/bin/python benchmarks/metrics_overhead.py              # np=2, three models
    .venv/bin/python benchmarks/metrics_overhead.py --models mlp --steps 200

Relaunches itself on ``--np`` workers through horarun. For each model of the training benchmark
(``benchmarks/training.py``) it trains one model with ``hvd.DistributedOptimizer`` and times
blocks of steps alternately without and with live metrics on every rank (``hvd.metrics.start``
with TensorBoard event files and a Prometheus endpoint before a block, ``hvd.metrics.stop``
after it; each step also calls ``hvd.metrics.log_step`` with its batch size and a loss value), so
that drift in the machine's load falls on both alike. A step's time is the slowest rank's; the
table shows medians, their ratio, and the overhead: the median over neighbouring blocks of
their ratio, minus 1, which drift in the machine's load between blocks does not move. Goal:
under 2 %.

The engine's counters are always kept (a clock read and a few additions per collective); what
is switched is everything else: the step records, the event files, the Prometheus metrics.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness
import training

GOAL = 0.02


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=2, help="workers (default 2)")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=sorted(training.MODELS),
        default=["mlp", "resnet", "transformer"],
    )
    parser.add_argument("--steps", type=int, default=120, help="timed steps per setting")
    parser.add_argument("--block", type=int, default=10, help="steps per block (default 10)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument(
        "--batch-size", type=int, default=None, help="samples per worker (default: the model's)"
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="leave metrics off in the 'on' blocks too: the overhead then shows the noise floor",
    )
    args = parser.parse_args(argv)
    if min(args.np, args.steps, args.block, args.batch_size or 1) < 1 or args.warmup < 0:
        parser.error("--np, --steps, --block and --batch-size must be at least 1")
    return args


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def publish_cost(spec: str, batch: int, repeats: int = 500) -> float:
    """Seconds one step's publishing takes on this rank, timed directly: the step record of
    ``DistributedOptimizer.step()`` and a ``log_step``, into both sinks."""
    import hora.torch as hvd

    hvd.metrics.start(spec)
    publisher = hvd.metrics.current
    assert publisher is not None
    started = time.perf_counter()
    for _ in range(repeats):
        publisher.optimizer_stepped()
        hvd.metrics.log_step(batch_size=batch, loss=0.5)
    elapsed = time.perf_counter() - started
    hvd.metrics.stop()
    return elapsed / repeats


def bench_model(
    name: str, args: argparse.Namespace, spec: str
) -> tuple[list[float], list[float], float]:
    """Step times (s, slowest rank) without and with live metrics, and the publishing time
    of one step (s, slowest rank)."""
    import hora.torch as hvd

    batch = args.batch_size or training.MODELS[name].batch_size
    step = training.hora_step(training.MODELS[name], args.batch_size)
    for _ in range(args.warmup):
        step()
    times: dict[bool, list[float]] = {False: [], True: []}
    order = [False, True]
    while min(len(t) for t in times.values()) < args.steps:
        for published in order:
            if published and not args.control:
                hvd.metrics.start(spec)
            block = []
            for _ in range(args.block):
                block.append(step())
                if published:
                    # log_step's own time counts as part of the step.
                    started = time.perf_counter()
                    hvd.metrics.log_step(batch_size=batch, loss=0.5)
                    block[-1] += time.perf_counter() - started
            if published:
                hvd.metrics.stop()
            times[published] += block
        order.reverse()
    # Every rank ran the same steps: per step, the slowest rank's time (gathered once, after
    # timing, so that no extra collective disturbs the steady state between blocks).
    gathered = hvd.allgather_object((times[False], times[True], publish_cost(spec, batch)))
    off = [max(ranks) for ranks in zip(*(g[0] for g in gathered))]
    on = [max(ranks) for ranks in zip(*(g[1] for g in gathered))]
    return off, on, max(g[2] for g in gathered)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "HORA_RANK" not in os.environ:
        forwarded = harness.step_block_arguments(args)
        if args.control:
            forwarded.append("--control")
        return harness.relaunch(__file__, args.np, forwarded)
    import hora.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rank = hvd.rank()
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        # Rank r serves PORT + its local rank; the event files go to rank 0's directory.
        shared = hvd.broadcast_object((directory, _free_port()), root_rank=0)
        spec = f"tensorboard:{shared[0]},prometheus:{shared[1]}"
        for name in args.models:
            rows.append((name, *bench_model(name, args, spec)))
        hvd.shutdown()
    if rank == 0:
        _report(rows, args)
    return 0


def paired_ratio(off: list[float], on: list[float], block: int) -> float:
    """The median over neighbouring blocks (the k-th without and the k-th with metrics ran one
    right after the other) of their median steps' ratio: load that drifts between blocks
    cancels out."""
    ratios = []
    for start in range(0, min(len(off), len(on)) - block + 1, block):
        without = statistics.median(off[start : start + block])
        ratios.append(statistics.median(on[start : start + block]) / without)
    return statistics.median(ratios)


def _report(
    rows: list[tuple[str, list[float], list[float], float]], args: argparse.Namespace
) -> None:
    print(
        f"live metrics overhead, {args.np} ranks, {training.batch_label(args.batch_size)}, "
        f"{args.steps} steps per setting in blocks of {args.block} (slowest rank); "
        + (
            "control run: metrics off in both"
            if args.control
            else "TensorBoard + Prometheus on every rank"
        )
    )
    header = (
        "model",
        "off ms",
        "on ms",
        "on/off",
        "paired",
        "overhead",
        "publish",
        "goal",
        "result",
    )
    lines = []
    for name, off, on, cost in rows:
        off_ms, on_ms = statistics.median(off) * 1000, statistics.median(on) * 1000
        paired = paired_ratio(off, on, args.block)
        lines.append(
            (
                name,
                f"{off_ms:.2f}",
                f"{on_ms:.2f}",
                f"{on_ms / off_ms:.4f}",
                f"{paired:.4f}",
                f"{paired - 1:+.2%}",
                f"{cost * 1e6:.0f} us {cost * 1000 / off_ms:.2%}",
                f"< {GOAL:.0%}",
                harness.verdict(paired - 1 < GOAL),
            )
        )
    print("\n".join(harness.table(header, lines)))
    print(
        "off/on ms: median steps; on/off: their ratio; paired: the median ratio of neighbouring "
        "blocks (the overhead and the verdict use it); publish: one step's publishing timed "
        "directly, and its share of the step off"
    )


if __name__ == "__main__":
    sys.exit(main())
