"""What writing a timeline costs a training step.

Usage::

    .venv/bin/python benchmarks/timeline_overhead.py              # np=2, the three models
    .venv/bin/python benchmarks/timeline_overhead.py --models mlp --steps 120

Relaunches itself on ``--np`` workers through horarun. For each model of the training benchmark
(``benchmarks/training.py``) it trains one model with ``hvd.DistributedOptimizer`` and times
blocks of steps alternately without and with a timeline (``hvd.start_timeline`` before a block,
``hvd.stop_timeline`` after it), so that drift in the machine's load falls on both alike. A step's
time is the slowest rank's; the table shows medians and the overhead ``with / without - 1``.
Goal: under 5 %.

``calls`` is not a model: a step of it is :data:`CALLS` synchronous 1 KiB allreduces, the calls
that the fast path (``HORA_FAST_PATH=1``) runs on the caller's thread, so that its rows price
what the timeline adds to a call that takes tens of microseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness
import training

GOAL = 0.05
CALLS = 50
RAW_PREFIX = "timeline-overhead-raw"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=2, help="workers (default 2)")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=[*sorted(training.MODELS), "calls"],
        default=sorted(training.MODELS),
    )
    parser.add_argument("--steps", type=int, default=80, help="timed steps per setting")
    parser.add_argument("--block", type=int, default=10, help="steps per block (default 10)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument(
        "--batch-size", type=int, default=None, help="samples per worker (default: the model's)"
    )
    args = parser.parse_args(argv)
    if min(args.np, args.steps, args.block, args.batch_size or 1) < 1 or args.warmup < 0:
        parser.error("--np, --steps, --block and --batch-size must be at least 1")
    return args


def calls_step() -> Callable[[], float]:
    """A step of :data:`CALLS` synchronous 1 KiB allreduces, each under its own name."""
    import hora.torch as hvd

    tensor = torch.ones(256)

    def step() -> float:
        start = time.perf_counter()
        for index in range(CALLS):
            hvd.allreduce(tensor, name=f"call.{index}", op=hvd.Sum)
        return time.perf_counter() - start

    return step


def bench_model(name: str, args: argparse.Namespace, directory: str) -> tuple[float, float, int]:
    """Median step (s) without and with a timeline, and the timeline's size in bytes."""
    import hora.torch as hvd

    step = (
        calls_step()
        if name == "calls"
        else training.hora_step(training.MODELS[name], args.batch_size)
    )
    for _ in range(args.warmup):
        step()
    path = os.path.join(directory, f"{name}.json")
    times: dict[bool, list[float]] = {False: [], True: []}
    order = [False, True]
    while min(len(t) for t in times.values()) < args.steps:
        for traced in order:
            if traced:
                hvd.start_timeline(path)
            block = [step() for _ in range(args.block)]
            if traced:
                hvd.stop_timeline()
            times[traced] += harness.slowest_rank(block)
        order.reverse()
    size = os.path.getsize(path)
    return statistics.median(times[False]), statistics.median(times[True]), size


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "HORA_RANK" not in os.environ:
        return harness.relaunch(__file__, args.np, harness.step_block_arguments(args))
    import hora.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    harness.init_raw_group(hvd.rank(), hvd.size(), RAW_PREFIX, timeout_s=300)
    rows = []
    rank, size = hvd.rank(), hvd.size()
    with tempfile.TemporaryDirectory() as directory:
        shared = [directory]
        torch.distributed.broadcast_object_list(shared, src=0)
        for name in args.models:
            rows.append((name, *bench_model(name, args, shared[0])))
        torch.distributed.barrier()
        hvd.shutdown()  # merges the last timeline's files while they still exist
    if rank == 0:
        print(
            f"timeline overhead, {size} ranks, {training.batch_label(args.batch_size)}, "
            f"medians of {args.steps} steps per setting (slowest rank)"
        )
        header = f"{'model':<12} {'off ms':>8} {'on ms':>8} {'overhead':>9} {'KB/s':>7}  goal      result"
        print(header)
        print("-" * len(header))
        for name, off, on, size in rows:
            overhead = on / off - 1
            rate = size / (args.steps * on) / 1024
            print(
                f"{name:<12} {off * 1000:8.1f} {on * 1000:8.1f} {overhead:+9.1%} "
                f"{rate:7.0f}  < {GOAL:.0%}     {harness.verdict(overhead < GOAL)}"
            )
        print("KB/s: rank 0's timeline written per second of traced training")
    return 0


if __name__ == "__main__":
    sys.exit(main())
