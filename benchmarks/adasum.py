"""What ``op=hvd.Adasum`` costs: hora's Adasum against raw ``torch.distributed`` (Gloo) sums and
hora's own Average, side by side in one job.

Run it (the number of workers must be a power of two)::

    .venv/bin/python benchmarks/adasum.py [--np 2|4] [--json results.json]

Each row reduces eight float32 tensors that together hold the given size: hora as one grouped
Adasum allreduce and as one grouped Average allreduce, raw Gloo as one ``all_reduce`` of a flat
buffer of that size (the sum, without Adasum's dot products, which raw Gloo does not offer).
Adasum moves about as many bytes as a ring allreduce but in ``log2(ranks)`` rounds of exchanges
with partners, and computes each tensor's dot product and norms in float64 at every level. The
goal is that this costs at most three times raw Gloo's sum of the same bytes. Blocks alternate
as in benchmarks/collectives.py; times are medians of the slowest rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as _dist

import hora.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness
from collectives import Comparison, duration, scaled, size_label

dist: Any = _dist

MIB = 1024 * 1024
# Total bytes per row, and how many times each is timed (per library).
SIZES = {256 * 1024: 60, 4 * MIB: 30, 32 * MIB: 10}
TENSORS = 8
GOAL = 3.0
RAW_PREFIX = "raw-adasum/"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=2, help="workers (a power of two)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write results here")
    parser.add_argument(
        "--repeats", type=float, default=1.0, metavar="FACTOR", help="scale repetition counts"
    )
    return parser.parse_args(argv)


def grouped(tensors: list[torch.Tensor], op: Any, name: str) -> Callable[[], object]:
    # Copies: the inputs stay the same random gradients, call after call.
    return lambda: hvd.grouped_allreduce([t.clone() for t in tensors], op=op, name=name)


def raw_sum(flat: torch.Tensor) -> Callable[[], object]:
    return lambda: dist.all_reduce(flat.clone())


def bench(timer: Comparison, factor: float) -> list[dict[str, Any]]:
    rows = []
    for nbytes, reps in SIZES.items():
        count = nbytes // 4 // TENSORS
        # Independent random gradients: Adasum's factors are neither 1 nor 1/2.
        generator = torch.Generator().manual_seed(dist.get_rank())
        tensors = [torch.randn(count, generator=generator) for _ in range(TENSORS)]
        raw = raw_sum(torch.cat(tensors))
        runs = scaled(reps, factor)
        adasum = grouped(tensors, hvd.Adasum, f"adasum.{nbytes}")
        adasum_times, raw_times = timer.run(adasum, raw, runs, warmup=2, block=5)
        average = grouped(tensors, hvd.Average, f"average.{nbytes}")
        average_times, _ = timer.run(average, raw, runs, warmup=2, block=5)
        adasum_s, raw_s = statistics.median(adasum_times), statistics.median(raw_times)
        ratio = adasum_s / raw_s
        rows.append(
            {
                "bytes": nbytes,
                "adasum_s": adasum_s,
                "average_s": statistics.median(average_times),
                "raw_s": raw_s,
                "ratio": ratio,
                "pass": ratio <= GOAL,
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]], size: int) -> str:
    header = ("8 tensors of", "hora Adasum", "hora Average", "raw gloo sum", "Adasum/raw", "goal")
    lines = [
        (
            size_label(r["bytes"]),
            duration(r["adasum_s"]),
            duration(r["average_s"]),
            duration(r["raw_s"]),
            f"{r['ratio']:.2f}x",
            f"<= {GOAL:g}x {harness.verdict(r['pass'])}",
        )
        for r in rows
    ]
    title = f"Adasum on {size} ranks, float32, medians of the slowest rank"
    return "\n".join([title, *harness.table(header, lines)])


def worker(args: argparse.Namespace) -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    harness.init_raw_group(rank, size, RAW_PREFIX, timeout_s=60)
    started = time.perf_counter()
    rows = bench(Comparison(settle_s=0.05), args.repeats)
    if rank == 0:
        print(format_table(rows, size), flush=True)
        print(f"run time {time.perf_counter() - started:.1f} s", flush=True)
        if args.json:
            harness.write_json(args.json, {"world_size": size, "rows": rows})
    dist.barrier()
    dist.destroy_process_group()
    hvd.shutdown()


def main() -> int:
    args = parse_args()
    if "HORA_RANK" not in os.environ:
        forwarded = ["--repeats", str(args.repeats)]
        if args.json:
            forwarded += ["--json", os.path.abspath(args.json)]
        # Not collectives.relaunch: that one starts collectives.py.
        return harness.relaunch(__file__, args.np, forwarded)
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
