"""Deterministic mode: the same bits at every world size, and what that costs.

Run it with::

    .venv/bin/python benchmarks/deterministic.py [--models mlp resnet transformer]
        [--steps 200] [--studies bitwise cost] [--json results.json]

Two studies, each made of ``horarun`` jobs this script starts (it runs as their worker too):

1. bitwise: the three models of benchmarks/training.py (MLP, ResNet, transformer) train
   ``--steps`` steps in deterministic mode (``DistributedOptimizer(deterministic=True)``, SGD
   with momentum) on a fixed synthetic data set, with ``K = 4`` micro-batches of 16 samples at
   ``-np 1, 2, 4`` and with ``K = 12`` micro-batches of 8 at ``-np 1, 2, 3, 4``. Rank 0 saves
   every parameter, optimizer state tensor and buffer (the ResNet's batch norm statistics,
   tracked with ``track_running_stats``) at the end; the report compares each run with the
   ``-np 1`` run of its ``K``, ``torch.equal`` on every tensor (the largest difference where one
   differs). Every process uses one intra-op thread.
2. cost: at ``-np 2`` each model trains in three modes on the same global batch of 64 samples:
   ``normal`` (``DistributedOptimizer`` as usual: each rank one forward and backward pass over
   its 32 samples, gradients averaged by allreduce), ``det K=2`` (one micro-batch of 32 per
   rank: the cost of the combination alone) and ``det K=4`` (two micro-batches of 16 per rank,
   as in the bitwise study). Steps are timed in blocks of ``--block`` steps after a barrier,
   the modes' blocks alternating (normal, K=2, K=4, K=4, K=2, normal, ...) so that drift in
   the machine's load falls on all alike; a step's time is that of its slowest rank. The table
   gives each mode's median samples/s with the interquartile range of its blocks' medians, and
   the ratio of ``det K=4``'s throughput to ``normal``'s: the median of the ratios of adjacent
   blocks (each pair ran within a second or so of each other), with their interquartile range (``--json`` also keeps every step, and the ratios' lowest and
   highest). On a shared machine the load changes within seconds: short blocks, many of them.
   ``CPU ms/step`` is the processor time a step takes in each mode (the process's, all its
   threads, the slowest rank's median): the work, whatever else the machine runs.
   Goal: ``det K=4 / normal >= 0.85`` for the ResNet and the transformer (the MLP's time goes
   into reading its 1.9 M weights, whatever the batch, so a second micro-batch costs it more,
   and its 7.6 MB of gradients are gathered only once backward is over). ``combine ms`` is rank 0's median ``synchronize()`` (gather and tree) in ``det K=4``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hora.torch as hvd
from hora.torch import deterministic

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness
import training

MODELS = ("mlp", "resnet", "transformer")
SEED = training.SEED
SAMPLES = 1536  # the data set: 16 steps of 96 (K=12) or 24 of 64 (K=4) per epoch
# The bitwise study: K, micro-batch size, world sizes.
BITWISE = ((4, 16, (1, 2, 4)), (12, 8, (1, 2, 3, 4)))
# The cost study: global batch, np, and each mode's K (0: normal mode) and micro-batch size.
COST_BATCH = 64
COST_NP = 2
COST_MODES = (("normal", 0, 0), ("det K=2", 2, 32), ("det K=4", 4, 16))
GOAL = 0.85  # det K=4 throughput / normal throughput (ResNet and transformer)
GOAL_MODELS = ("resnet", "transformer")


# ---------------------------------------------------------------- data and models


def dataset(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed synthetic data set of model ``name``: inputs and labels."""
    spec = training.MODELS[name]
    generator = torch.Generator().manual_seed(SEED + 1)
    inputs = spec.make_inputs(SAMPLES, generator)
    labels = torch.randint(0, training.CLASSES, (SAMPLES,), generator=generator)
    return inputs, labels


def build(name: str, leaves: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Model ``name`` from the benchmark's seed and its optimizer: deterministic over ``leaves``
    micro-batches, or the usual one (``leaves`` 0)."""
    torch.manual_seed(SEED)
    model = training.MODELS[name].build()
    extra: dict[str, Any] = {"deterministic": True, "microbatches": leaves} if leaves else {}
    optimizer = hvd.DistributedOptimizer(
        training.sgd(model), named_parameters=model.named_parameters(), **extra
    )
    if leaves:
        optimizer.track_running_stats(model)  # type: ignore[attr-defined]
    return model, optimizer


def deterministic_step(
    model: nn.Module,
    optimizer: Any,
    data: tuple[torch.Tensor, torch.Tensor],
    step: deterministic.Step,
) -> float:
    """One step over this rank's micro-batches; returns the seconds ``synchronize()`` took."""
    inputs, labels = data
    optimizer.zero_grad()
    for microbatch in step:
        with optimizer.microbatch(microbatch):
            rows = list(microbatch.indices)
            F.cross_entropy(model(inputs[rows]), labels[rows]).backward()
    started = time.perf_counter()
    optimizer.synchronize()
    combined = time.perf_counter() - started
    with optimizer.skip_synchronize():
        optimizer.step()
    return combined


def next_step(sampler: deterministic.DeterministicSampler) -> deterministic.Step:
    """The sampler's next step, into the next epoch when this one is done."""
    if sampler.step == sampler.steps_per_epoch:
        sampler.set_epoch(sampler.epoch + 1)
    return next(sampler.steps())


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter, every optimizer state tensor, then every buffer (the ResNet's batch norm
    statistics), in a fixed order."""
    tensors = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        for key in sorted(optimizer.state[p]):
            value = optimizer.state[p][key]
            if isinstance(value, torch.Tensor):
                tensors.append(value.clone())
    return tensors + [b.clone() for b in model.buffers()]


# ---------------------------------------------------------------- the bitwise study


def train_worker(args: argparse.Namespace) -> None:
    """Train each model ``--steps`` steps in deterministic mode; rank 0 saves the result."""
    hvd.init()
    torch.set_num_threads(1)
    leaves, size = args.k, args.microbatch_size
    results: dict[str, Any] = {"world_size": hvd.size()}
    for name in args.models:
        model, optimizer = build(name, leaves)
        data = dataset(name)
        sampler = deterministic.DeterministicSampler(range(SAMPLES), leaves, size, seed=SEED)
        started = time.perf_counter()
        for _ in range(args.steps):
            deterministic_step(model, optimizer, data, next_step(sampler))
            sampler.record_step()
        results[name] = {
            "tensors": state_tensors(model, optimizer),
            "seconds": time.perf_counter() - started,
        }
    if hvd.rank() == 0:
        torch.save(results, args.out)
    hvd.shutdown()


def run_job(np: int, arguments: list[str]) -> None:
    command = [sys.executable, "-m", "hora.runner.launch", "-np", str(np)]
    command += [sys.executable, os.path.abspath(__file__), *arguments]
    subprocess.run(command, check=True)


def difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[bool, float]:
    """Whether two runs' tensors are bitwise equal, and their largest absolute difference."""
    same = len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    largest = max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))
    return same, largest


def bitwise_study(args: argparse.Namespace, folder: str) -> list[dict[str, Any]]:
    rows = []
    for leaves, size, sizes in BITWISE:
        runs: dict[int, dict[str, Any]] = {}
        for np in sizes:
            out = os.path.join(folder, f"k{leaves}-np{np}.pt")
            forwarded = ["--worker", "train", "--k", str(leaves), "--microbatch-size", str(size)]
            forwarded += ["--steps", str(args.steps), "--out", out, "--models", *args.models]
            run_job(np, forwarded)
            runs[np] = torch.load(out)
            for name in args.models:
                same, largest = difference(
                    runs[sizes[0]][name]["tensors"], runs[np][name]["tensors"]
                )
                rows.append(
                    {
                        "model": name,
                        "k": leaves,
                        "microbatch_size": size,
                        "np": np,
                        "tensors": len(runs[np][name]["tensors"]),
                        "bitwise_equal_to_np1": same,
                        "max_abs_diff": largest,
                        "seconds": runs[np][name]["seconds"],
                    }
                )
                print(
                    f"K={leaves} np={np} {name}: {'bitwise equal' if same else 'DIFFERS'} to "
                    f"np={sizes[0]} ({runs[np][name]['seconds']:.1f} s)",
                    flush=True,
                )
    return rows


def bitwise_table(rows: list[dict[str, Any]], steps: int) -> list[str]:
    header = ("model", "K", "micro-batch", "np", "tensors", "vs np 1", "max |diff|", "train s")
    lines = [
        f"bitwise study: {steps} steps, SGD with momentum, torch.equal on every parameter, "
        "optimizer state tensor and buffer against the -np 1 run of the same K"
    ]
    body = [
        (
            r["model"],
            str(r["k"]),
            str(r["microbatch_size"]),
            str(r["np"]),
            str(r["tensors"]),
            "equal" if r["bitwise_equal_to_np1"] else "DIFFERS",
            f"{r['max_abs_diff']:.1e}",
            f"{r['seconds']:.1f}",
        )
        for r in rows
    ]
    return lines + harness.table(header, body)


# ---------------------------------------------------------------- the cost study


@dataclass
class Mode:
    """One way of training a model in the cost study, and its timings on this rank."""

    name: str
    leaves: int
    run: Callable[[], float]
    totals: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    combines: list[float] = field(default_factory=list)


def normal_mode(name: str, data: tuple[torch.Tensor, torch.Tensor]) -> Mode:
    """The usual DistributedOptimizer: each rank one pass over its share of the global batch."""
    model, optimizer = build(name, 0)
    inputs, labels = data
    share = COST_BATCH // hvd.size()
    starts = itertools.cycle(range(0, SAMPLES - COST_BATCH + 1, COST_BATCH))

    def run() -> float:
        first = next(starts) + hvd.rank() * share
        rows = slice(first, first + share)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs[rows]), labels[rows]).backward()
        optimizer.step()
        return 0.0

    return Mode("normal", 0, run)


def deterministic_mode(
    label: str, name: str, data: tuple[torch.Tensor, torch.Tensor], leaves: int, size: int
) -> Mode:
    """Deterministic mode over ``leaves`` micro-batches of ``size`` samples."""
    model, optimizer = build(name, leaves)
    sampler = deterministic.DeterministicSampler(range(SAMPLES), leaves, size, seed=SEED)

    def run() -> float:
        combined = deterministic_step(model, optimizer, data, next_step(sampler))
        sampler.record_step()
        return combined

    return Mode(label, leaves, run)


def cost_modes(name: str) -> list[Mode]:
    data = dataset(name)
    return [
        deterministic_mode(label, name, data, leaves, size) if leaves else normal_mode(name, data)
        for label, leaves, size in COST_MODES
    ]


def run_block(mode: Mode, count: int) -> None:
    hvd.barrier()
    mode.run()  # absorbs the skew with which ranks leave the barrier
    for _ in range(count):
        started, cpu = time.perf_counter(), time.process_time()
        combined = mode.run()
        mode.totals.append(time.perf_counter() - started)
        mode.cpu.append(time.process_time() - cpu)
        mode.combines.append(combined)


def slowest(times: list[float]) -> list[float]:
    maximum = hvd.allreduce(torch.tensor(times, dtype=torch.float64), op=hvd.Max, name="slowest")
    return [float(t) for t in maximum]


def block_medians(times: list[float], block: int) -> list[float]:
    return [statistics.median(times[i : i + block]) for i in range(0, len(times), block)]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """The lower quartile, the median and the upper quartile of ``values``."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    low, middle, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, middle, high


def cost_worker(args: argparse.Namespace) -> None:
    hvd.init()
    torch.set_num_threads(1)
    results: dict[str, Any] = {"models": []}
    for name in args.models:
        modes = cost_modes(name)
        for mode in modes:
            hvd.barrier()
            for _ in range(args.warmup):
                mode.run()
        order = [*modes, *reversed(modes)]
        for mode in itertools.cycle(order):
            if len(mode.totals) < args.cost_steps:
                run_block(mode, min(args.block, args.cost_steps - len(mode.totals)))
            if all(len(m.totals) >= args.cost_steps for m in modes):
                break
        row: dict[str, Any] = {"model": name}
        for mode in modes:
            steps = slowest(mode.totals)
            medians = block_medians(steps, args.block)
            slow, _, fast = quartiles(medians)
            row[mode.name] = {
                "samples_per_s": COST_BATCH / statistics.median(steps),
                "interquartile": [COST_BATCH / fast, COST_BATCH / slow],
                "block_medians_s": medians,
                "step_s": steps,
                "combine_s": statistics.median(mode.combines),
                "cpu_s": statistics.median(slowest(mode.cpu)),
            }
        normal, det = row["normal"]["block_medians_s"], row["det K=4"]["block_medians_s"]
        ratios = [n / d for n, d in zip(normal, det)]
        row["ratio_blocks"] = list(quartiles(ratios))
        row["ratio"] = row["ratio_blocks"][1]
        row["ratio_extremes"] = [min(ratios), max(ratios)]
        results["models"].append(row)
    if hvd.rank() == 0:
        harness.write_json(args.out, results)
    hvd.shutdown()


def cost_table(results: dict[str, Any], args: argparse.Namespace) -> list[str]:
    header = (
        "model",
        *(label for label, _, _ in COST_MODES),
        "K=4/normal",
        "combine ms",
        "CPU ms/step",
        "goal",
    )
    body = []
    for row in results["models"]:
        cells = [row["model"]]
        for label, _, _ in COST_MODES:
            low, high = row[label]["interquartile"]
            cells.append(f"{row[label]['samples_per_s']:.0f} ({low:.0f}-{high:.0f})")
        low, median, high = row["ratio_blocks"]
        cells.append(f"{row['ratio']:.2f}x ({low:.2f}-{high:.2f})")
        cells.append(f"{row['det K=4']['combine_s'] * 1e3:.1f}")
        cells.append(" / ".join(f"{row[label]['cpu_s'] * 1e3:.0f}" for label, _, _ in COST_MODES))
        goal = row["model"] in GOAL_MODELS
        cells.append(harness.verdict(row["ratio"] >= GOAL) if goal else "-")
        body.append(tuple(cells))
    title = (
        f"cost study: -np {COST_NP}, global batch {COST_BATCH}, samples/s (median; interquartile "
        f"range of the blocks' medians), {args.cost_steps} steps per mode in blocks of "
        f"{args.block}, "
        f"slowest rank; goal det K=4 >= {GOAL}x normal for {', '.join(GOAL_MODELS)}"
    )
    return [title, *harness.table(header, body)]


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--steps", type=int, default=200, help="steps of the bitwise study")
    parser.add_argument(
        "--studies", nargs="+", choices=("bitwise", "cost"), default=["bitwise", "cost"]
    )
    parser.add_argument("--cost-steps", type=int, default=200, help="timed steps per mode")
    parser.add_argument("--block", type=int, default=2, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per mode")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write results here")
    # The workers' own arguments.
    parser.add_argument("--worker", choices=("train", "cost"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--microbatch-size", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.worker == "train":
        train_worker(args)
        return 0
    if args.worker == "cost":
        cost_worker(args)
        return 0
    started = time.perf_counter()
    results: dict[str, Any] = {**harness.versions(), **harness.run_facts()}
    lines = []
    with tempfile.TemporaryDirectory(prefix="hora-deterministic-") as folder:
        if "bitwise" in args.studies:
            rows = bitwise_study(args, folder)
            results["bitwise"] = rows
            lines += bitwise_table(rows, args.steps)
        if "cost" in args.studies:
            out = os.path.join(folder, "cost.json")
            forwarded = ["--worker", "cost", "--out", out, "--models", *args.models]
            forwarded += ["--cost-steps", str(args.cost_steps), "--block", str(args.block)]
            forwarded += ["--warmup", str(args.warmup)]
            run_job(COST_NP, forwarded)
            with open(out, encoding="utf-8") as saved:
                cost = json.load(saved)
            results["cost"] = cost
            lines += cost_table(cost, args)
    lines.append(
        f"hora {results['hora_version']} ({results['hora_revision']}), torch "
        f"{results['torch_version']}, 1 thread per process, {os.cpu_count()} CPUs, "
        f"{time.perf_counter() - started:.0f} s; load average {os.getloadavg()[0]:.2f}"
    )
    print("\n".join(lines))
    if args.json:
        harness.write_json(args.json, results)
    bitwise_ok = all(r["bitwise_equal_to_np1"] for r in results.get("bitwise", []))
    return 0 if bitwise_ok else 1


if __name__ == "__main__":
    sys.exit(main())
