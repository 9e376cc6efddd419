"""Sharded optimizer state (ZeRO stages 1 and 2) against the unsharded ``DistributedOptimizer``
and PyTorch's ``ZeroRedundancyOptimizer`` with DDP: memory, bytes on the wire and step time.

Run it with::

    .venv/bin/python benchmarks/zero.py [--np 2 4] [--models 10m 50m] [--steps 3] [--reps 3]
        [--batch-size 16] [--json results.json]

It starts itself through ``horarun`` once for each ``--np`` (2 and 4 by default) and each
worker prints nothing until rank 0 prints the table of its job. Under ``horarun`` it runs one
job's part only::

    .venv/bin/horarun -np 2 .venv/bin/python benchmarks/zero.py [--models ...]

Two models, stacks of ``Linear(w, w) + ReLU`` layers with a 10-way head (10m: w=1024, 10
layers, 10.5 M parameters; 50m: w=2048, 12 layers, 50.4 M), train with Adam on a fixed random
batch per rank (cross entropy), one intra-op thread per process, in five modes:

1. hora: ``hvd.DistributedOptimizer(Adam)`` (allreduce of every gradient);
2. zero1: the same with ``shard_optimizer_state=True``;
3. zero2: the same with ``shard_optimizer_state=True, shard_gradients=True``;
4. zero2-overlap: zero2 with ``optimizer.overlap_gather_with_forward(model)`` (each bucket of
   gathered parameters is written in just before the next forward pass reaches it);
5. torch-zero: ``torch.distributed.optim.ZeroRedundancyOptimizer(Adam)`` over a
   ``DistributedDataParallel`` model, both on torch.distributed's Gloo (default buckets).

Each rep builds each mode's model anew from one seed (the previous mode's objects freed first),
takes one untimed step, then times ``--steps`` steps. The modes' blocks alternate
(A B C D D C B A ...), so drift in the machine's load falls on all alike. Per mode it reports:

* optimizer-state bytes on a rank: the tensors in ``optimizer.state`` (for torch-zero, in its
  local optimizer's), the largest over ranks. Goal: at most ``1/N`` of hora's, plus 1%.
* peak RSS of a rank: its resident set before the first block, plus the most the block's peak
  resident set (``VmHWM``, reset with ``/proc/self/clear_refs`` after glibc's free heap is
  returned with ``malloc_trim``) rose above the resident set at the block's start, building the
  model and the optimizer's first step included; the largest over ranks and reps. (Buffers a
  mode keeps in the engine after its block, such as the steady state's fusion buffers, stay in
  the process; measuring growth keeps them out of the next mode's figure.)
* bytes on the wire per step and rank, in the ring model that Gloo and NCCL follow (an
  allreduce of ``B`` bytes sends ``2 (N-1)/N B`` from every rank, a reducescatter of ``B`` or
  an allgather into ``B`` sends ``(N-1)/N B``, a broadcast ``(N-1)/N B`` on average), from the
  bytes that entered collectives: hora's allreduces from its engine's counters (less the
  reducescatter inputs, which they count too), the sharded optimizer's reducescatters and
  allgathers counted where it submits them (a wrapper around
  ``hora.torch.ops.reducescatter_async`` and ``allgather_async``), and torch-zero's DDP
  allreduce and parameter broadcasts from the parameters' sizes (torch counts no bytes). On one
  host hora moves these bytes through shared memory; the figure is what a network would carry.
  Goal: within 1% of hora's.
* step time: the slowest rank's time of each timed step; median, and the range of all steps.
  Goal: at most 1.05x hora's, and at most torch-zero's.

And two checks, on an evenly spaced sample of 100,000 parameters after each block: whether every
rank holds the same values, and how far the other modes' are from hora's (every block takes the
same steps on the same data from the same start).

``--plot PATH`` also draws memory per rank (peak RSS, and the optimizer state) and step time per
mode as a PNG chart, a column per model and a group of bars per ``--np``; ``--docs`` draws
docs/images/zero_modes.png (see charts.py)::

    .venv/bin/python benchmarks/zero.py --np 2 4 --docs
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as _dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import hora.torch as hvd
from hora.common import basics
from hora.torch import ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import charts
import harness

MODES = ("hora", "zero1", "zero2", "zero2-overlap", "torch-zero")
SHARDED = ("zero1", "zero2", "zero2-overlap")
SEED = 1234
LEARNING_RATE = 1e-4
CLASSES = 10
RAW_PREFIX = "raw-zero-bench/"
STATE_GOAL = 1.01  # sharded state <= unsharded / N * this
WIRE_GOAL = 0.01  # |sharded wire / unsharded wire - 1| <= this
STEP_GOAL = 1.05  # sharded step time <= unsharded's * this
SAMPLED = 100_000  # parameters compared between ranks and modes
CHART = "zero_modes.png"  # under docs/images/ with --docs

dist: Any = _dist


@dataclass(frozen=True)
class ModelSpec:
    name: str
    width: int
    layers: int

    def build(self) -> nn.Module:
        torch.manual_seed(SEED)
        stack: list[nn.Module] = []
        for _ in range(self.layers):
            stack += [nn.Linear(self.width, self.width), nn.ReLU()]
        return nn.Sequential(*stack, nn.Linear(self.width, CLASSES))


MODELS = {"10m": ModelSpec("10m", 1024, 10), "50m": ModelSpec("50m", 2048, 12)}


# ---------------------------------------------------------------- counting


@dataclass
class Submitted:
    """Bytes that entered the sharded optimizer's collectives (see the module docstring)."""

    reducescatter: int = 0
    allgather: int = 0


SUBMITTED = Submitted()


def count_submissions() -> None:
    """Wrap the two collectives the sharded optimizer submits, to add up their bytes."""
    reducescatter, allgather = ops.reducescatter_async, ops.allgather_async

    def counted_reducescatter(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> int:
        SUBMITTED.reducescatter += tensor.numel() * tensor.element_size()
        return reducescatter(tensor, *args, **kwargs)

    def counted_allgather(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> int:
        handle = allgather(tensor, *args, **kwargs)
        # The gathered tensor: every rank's part (this rank's size times N, within a few
        # elements; the exact total is the bucket, which the optimizer knows).
        SUBMITTED.allgather += tensor.numel() * tensor.element_size()
        return handle

    ops.reducescatter_async = counted_reducescatter  # type: ignore[assignment]
    ops.allgather_async = counted_allgather  # type: ignore[assignment]


def allreduced_bytes() -> int:
    """Bytes hora's engine has counted as reduced since it started: allreduce results and
    reducescatter inputs."""
    totals, _ = basics.engine().counters.take()
    return totals.reduced_bytes


def summed(value: int) -> int:
    """``value`` added up over the ranks (over the raw group)."""
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor)
    return int(tensor.item())


def largest(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def state_bytes(state: Any) -> int:
    return sum(
        v.numel() * v.element_size()
        for entries in state.values()
        for v in entries.values()
        if isinstance(v, torch.Tensor)
    )


def peak_rss_reset() -> None:
    """Return freed heap memory to the system (glibc keeps it otherwise, and a mode would
    inherit the previous mode's), then restart the peak resident set from the current one."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    return _status_bytes("VmHWM:")


def rss_bytes() -> int:
    return _status_bytes("VmRSS:")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


# This process's resident set before the first block: the base of every mode's peak.
BASELINE: list[int] = []


# ---------------------------------------------------------------- modes


@dataclass
class Built:
    """One mode's model and optimizer, and how its bytes on the wire are counted."""

    model: nn.Module
    optimizer: Any
    state: Callable[[], Any]


def build(mode: str, spec: ModelSpec) -> Built:
    module = spec.build()
    if mode == "torch-zero":
        ddp = DistributedDataParallel(module)
        zero = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.Adam, lr=LEARNING_RATE
        )
        return Built(ddp, zero, lambda: zero.optim.state)
    options: dict[str, Any] = {}
    if mode != "hora":
        options = {"shard_optimizer_state": True, "shard_gradients": mode != "zero1"}
    optimizer = hvd.DistributedOptimizer(
        torch.optim.Adam(module.parameters(), lr=LEARNING_RATE),
        named_parameters=module.named_parameters(),
        **options,
    )
    if mode == "zero2-overlap":
        optimizer.overlap_gather_with_forward(module)
    return Built(module, optimizer, lambda: optimizer.state)


def train_step(built: Built, inputs: torch.Tensor, labels: torch.Tensor) -> None:
    built.optimizer.zero_grad()
    F.cross_entropy(built.model(inputs), labels).backward()
    built.optimizer.step()


@dataclass
class Samples:
    """What the blocks of one mode measured (this rank's, then combined over ranks)."""

    step_s: list[float] = field(default_factory=list)
    peak_rss: list[int] = field(default_factory=list)
    state: list[int] = field(default_factory=list)
    wire: list[float] = field(default_factory=list)
    agree: list[bool] = field(default_factory=list)
    difference: list[float] = field(default_factory=list)


def sampled(model: nn.Module) -> torch.Tensor:
    """About ``SAMPLED`` of the model's parameters, evenly spaced (small enough to keep and
    compare without changing the other modes' memory)."""
    values = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return values[:: max(1, values.numel() // SAMPLED)].clone()


def ranks_agree(values: torch.Tensor) -> bool:
    high, low = values.double(), values.double().clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return bool(torch.equal(high, low))


def run_block(
    mode: str,
    spec: ModelSpec,
    steps: int,
    batch_size: int,
    samples: Samples,
    reference: dict[str, torch.Tensor],
) -> None:
    """Build ``mode``, take one untimed step, then time ``steps`` steps (see the docstring)."""
    rank, size = hvd.rank(), hvd.size()
    generator = torch.Generator().manual_seed(SEED + 1 + rank)
    inputs = torch.randn(batch_size, spec.width, generator=generator)
    labels = torch.randint(0, CLASSES, (batch_size,), generator=generator)
    gc.collect()
    peak_rss_reset()
    start_rss = rss_bytes()
    built = build(mode, spec)
    train_step(built, inputs, labels)
    dist.barrier()
    allreduced, submitted = allreduced_bytes(), Submitted(**vars(SUBMITTED))
    times = []
    for _ in range(steps):
        hvd.barrier()
        start = time.perf_counter()
        train_step(built, inputs, labels)
        times.append(time.perf_counter() - start)
    growth = peak_rss_bytes() - start_rss
    samples.step_s.extend(harness.slowest_rank(times))
    samples.peak_rss.append(int(largest(BASELINE[0] + growth)))
    samples.state.append(int(largest(state_bytes(built.state()))))
    share = (size - 1) / size
    if mode == "torch-zero":
        # DDP allreduces every gradient; ZeRO broadcasts each rank's updated parameters.
        parameter_bytes = sum(p.numel() * p.element_size() for p in built.model.parameters())
        wire = steps * (2 * share * parameter_bytes + share * parameter_bytes)
    else:
        scattered = SUBMITTED.reducescatter - submitted.reducescatter
        # The engine's counter holds the reducescatters' inputs too: the rest was allreduced.
        reduced = allreduced_bytes() - allreduced - scattered
        gathered = summed(SUBMITTED.allgather - submitted.allgather)
        wire = 2 * share * reduced + share * scattered + share * gathered
    samples.wire.append(wire / steps)
    if mode == "zero2-overlap":
        built.optimizer.finish_parameter_gather()  # the last step's gathers: no forward follows
    values = sampled(built.model.module if mode == "torch-zero" else built.model)
    samples.agree.append(ranks_agree(values))
    if mode == "hora":
        reference[spec.name] = values
    elif spec.name in reference:
        samples.difference.append(float((values - reference[spec.name]).abs().max()))
    # The unsharded optimizer's gradient hooks hold it (and so the model) from autograd's side,
    # where the garbage collector sees no cycle: remove them, or every block's model would stay.
    for handle in getattr(built.optimizer, "_hooks", []):
        handle.remove()
    del built, values
    gc.collect()


def bench_model(spec: ModelSpec, args: argparse.Namespace) -> dict[str, Any]:
    samples = {mode: Samples() for mode in MODES}
    reference: dict[str, torch.Tensor] = {}
    for rep in range(args.reps):
        order = MODES if rep % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            run_block(mode, spec, args.steps, args.batch_size, samples[mode], reference)
    reference.clear()
    row: dict[str, Any] = {
        "model": spec.name,
        "parameters": sum(p.numel() for p in spec.build().parameters()),
    }
    for mode in MODES:
        s = samples[mode]
        row[mode] = {
            "step_s": statistics.median(s.step_s),
            "step_s_range": [min(s.step_s), max(s.step_s)],
            "step_samples_s": s.step_s,
            "peak_rss_bytes": max(s.peak_rss),
            "peak_rss_range": [min(s.peak_rss), max(s.peak_rss)],
            "state_bytes": max(s.state),
            "wire_bytes_per_step": statistics.median(s.wire),
            "ranks_agree": all(s.agree),
            "max_abs_diff_vs_hora": max(s.difference) if s.difference else None,
        }
    size = hvd.size()
    base = row["hora"]
    for mode in SHARDED:
        m = row[mode]
        m["state_ratio"] = m["state_bytes"] / base["state_bytes"]
        m["wire_ratio"] = m["wire_bytes_per_step"] / base["wire_bytes_per_step"]
        m["step_ratio"] = m["step_s"] / base["step_s"]
        m["step_vs_torch_zero"] = m["step_s"] / row["torch-zero"]["step_s"]
        m["goals"] = {
            "state": m["state_ratio"] <= STATE_GOAL / size,
            "wire": abs(m["wire_ratio"] - 1) <= WIRE_GOAL,
            "step_vs_hora": m["step_ratio"] <= STEP_GOAL,
            "step_vs_torch_zero": m["step_vs_torch_zero"] <= 1.0,
        }
    return row


# ---------------------------------------------------------------- report


def mib(value: float) -> str:
    return f"{value / 2**20:,.1f}"


def format_table(results: dict[str, Any]) -> str:
    size = results["world_size"]
    title = (
        f"ZeRO: hora {results['hora_version']} ({results['hora_revision']}), torch "
        f"{results['torch_version']}, {size} ranks on {results['cpus']} CPUs"
        f"{' (oversubscribed)' if size > (results['cpus'] or 0) else ''}, Adam, batch "
        f"{results['batch_size']} per rank, 1 thread per process; {results['reps']} reps of "
        f"{results['steps']} steps per mode, alternating"
    )
    header = (
        "model",
        "mode",
        "state MiB/rank",
        "peak RSS MiB",
        "wire MiB/step",
        "step ms (median)",
        "step ms (range)",
        "vs hora",
        "goals",
    )
    rows: list[tuple[str, ...]] = []
    for r in results["models"]:
        for mode in MODES:
            m = r[mode]
            goals = m.get("goals")
            verdict = (
                " ".join(f"{k}:{harness.verdict(v)}" for k, v in goals.items()) if goals else ""
            )
            low, high = m["step_s_range"]
            rows.append(
                (
                    f"{r['model']} ({r['parameters'] / 1e6:.1f} M)" if mode == MODES[0] else "",
                    mode,
                    mib(m["state_bytes"]),
                    mib(m["peak_rss_bytes"]),
                    mib(m["wire_bytes_per_step"]),
                    f"{m['step_s'] * 1e3:.0f}",
                    f"{low * 1e3:.0f}-{high * 1e3:.0f}",
                    f"{m['step_s'] / r['hora']['step_s']:.3f}x",
                    verdict,
                )
            )
    checks = []
    for r in results["models"]:
        agree = {mode: r[mode]["ranks_agree"] for mode in MODES}
        differences = {mode: r[mode]["max_abs_diff_vs_hora"] for mode in (*SHARDED, "torch-zero")}
        shown = ", ".join(
            f"{mode} {value:.1e}" for mode, value in differences.items() if value is not None
        )
        checks.append(f"{r['model']}: ranks agree {agree}; max |param - hora's| {shown}")
    notes = (
        "goals (zero1, zero2, zero2-overlap): state <= hora/N + 1%; wire within 1% of hora's; step <= 1.05x "
        "hora's (step_vs_hora) and <= torch-zero's (step_vs_torch_zero)\n"
        f"run time {results['elapsed_s']:.1f} s; load average {results['load_before'][0]:.2f} "
        f"before, {results['load_after'][0]:.2f} after"
    )
    return "\n".join([title, *harness.table(header, rows), *checks, notes])


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--np", type=int, nargs="+", default=[2, 4], help="job sizes to run (default 2 4)"
    )
    parser.add_argument(
        "--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="default: both"
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per block (default 3)")
    parser.add_argument("--reps", type=int, default=3, help="blocks per mode (default 3)")
    parser.add_argument(
        "--batch-size", type=int, default=16, help="samples per rank and step (default 16)"
    )
    parser.add_argument("--json", metavar="PATH", default=None, help="also write results here")
    harness.add_chart_options(parser, CHART)
    args = parser.parse_args(argv)
    if min(args.np) < 2 or args.steps < 1 or args.reps < 1 or args.batch_size < 1:
        parser.error("--np must be at least 2; --steps, --reps and --batch-size at least 1")
    return args


def worker(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    load_before = os.getloadavg()
    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    harness.init_raw_group(rank, size, RAW_PREFIX, timeout_s=600)
    count_submissions()
    peak_rss_reset()
    BASELINE.append(rss_bytes())
    results: dict[str, Any] = {
        **harness.versions(rank == 0),
        **harness.run_facts(),
        "world_size": size,
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "reps": args.reps,
        "baseline_rss_bytes": BASELINE[0],
        "modes": list(MODES),
        "models": [bench_model(MODELS[name], args) for name in args.models],
    }
    # Run under horarun by hand (one job): its chart; relaunched, main() draws every job's.
    chart = harness.chart_path(args, CHART)
    draw = (lambda r: charts.zero_modes([r], chart)) if chart else None
    harness.report(results, started, rank, format_table, args.json, draw)
    dist.destroy_process_group()
    hvd.shutdown()


def main() -> int:
    args = parse_args()
    if "HORA_RANK" in os.environ:
        worker(args)
        return 0
    forwarded = ["--models", *args.models, "--steps", str(args.steps)]
    forwarded += ["--reps", str(args.reps), "--batch-size", str(args.batch_size)]
    collected = []
    status = 0
    with tempfile.TemporaryDirectory(prefix="hora-zero-bench-") as folder:
        for np in args.np:
            path = os.path.join(folder, f"np{np}.json")
            status = harness.relaunch(__file__, np, [*forwarded, "--json", path]) or status
            if os.path.exists(path):
                with open(path) as f:
                    collected.append(json.load(f))
    if args.json:
        harness.write_json(args.json, collected)
    chart = harness.chart_path(args, CHART)
    if chart and collected:
        charts.zero_modes(collected, chart)
    return status


if __name__ == "__main__":
    sys.exit(main())
