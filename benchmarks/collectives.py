"""hora against raw ``torch.distributed`` (Gloo), side by side in one job.

Run it with ``./dev bench`` or::

    .venv/bin/horarun -np 2 .venv/bin/python benchmarks/collectives.py [--json results.json]

or let it start the job itself (through ``horarun``, 2 workers unless ``--np`` says otherwise)::

    .venv/bin/python benchmarks/collectives.py [--np N] [--json results.json]

Every worker runs hora (``hvd.init()``) and, next to it, torch.distributed's default process
group on Gloo, rendezvousing through the job's store under its own key prefix. Both then run the
same collectives on the same tensors:

1. allreduce bus bandwidth, 1 to 256 MiB of float32 (goal: hora >= 0.95x raw; where hora's
   ranks share a host and exchange through shared memory, its default: >= 2x raw Gloo up to
   16 MiB, >= 1.3x from 64 MiB, and at least raw mpi4py's at every size under ``--with-mpi``);
2. 300 allreduces of 1 KiB: hora submits them all and lets fusion batch them, raw runs them one
   by one (goal: hora >= 5x faster);
3. latency of one synchronous allreduce, 4 B to 1 MiB, and of an unnamed 4 B one (negotiated
   anew every call) (goal: hora <= raw + 0.5 ms; over shared memory, 4 B: hora <= 2x raw);
4. 200 allreduces of 4 KiB three ways: one by one, each waited for (goal: hora <= 2x raw);
   as one grouped call against raw ``all_reduce_coalesced`` (goal: hora <= 2x raw); all started
   asynchronously, then waited for, against raw ``async_op=True`` (goal: hora <= raw).

Calls are timed one by one, back to back, in blocks that start with a barrier; hora and raw
blocks alternate (ABBA) so that changes in the machine's load hit both alike. A call's time is
that of the slowest rank, and the table shows medians. Rank 0 prints the table; ``--json PATH``
also writes every sample there.

``--with-mpi`` starts the job through ``horarun --mpi`` (so ``mpirun``) with hora on its
default path, and times raw mpi4py on the same buffers beside every row: ``Allreduce`` for the
bandwidth and latency rows and the one-by-one small allreduces, ``Iallreduce`` of each tensor
and then one wait for the grouped and asynchronous ones (shown in the goal column)::

    .venv/bin/python benchmarks/collectives.py --with-mpi [--np N] [--json results.json]

``--load`` runs one busy process per core of the host while measuring (started by each host's
local rank 0, stopped before the table is printed): the numbers of a machine that is busy, as a
training job's usually is. ``HORA_FAST_PATH=0`` in the environment measures hora without its
fast path (the title says which).

``--transport mpi`` measures hora's MPI data path instead: the script starts itself through
``horarun --mpi`` (so ``mpirun``), and compares hora's allreduce bus bandwidth, 1 to 64 MiB,
with mpi4py's own ``Allreduce`` on the same buffers (goal: hora >= 0.95x raw from 16 MiB up),
and with torch.distributed's Gloo beside them (MPI vs Gloo on this machine)::

    .venv/bin/python benchmarks/collectives.py --transport mpi [--np N] [--json results.json]

``--transport nccl`` measures hora's NCCL data path on CUDA tensors: every worker pins GPU
``local_rank % device_count``, runs hora with ``HORA_GPU_OPERATIONS=nccl`` and, beside it,
torch.distributed's default group with CUDA tensors on NCCL (CPU tensors, such as the gathered
timings, on Gloo), and compares their allreduce bus bandwidth on CUDA float32 buffers of 1 to
256 MiB (goal: hora >= 0.95x raw from 16 MiB up). Each timed call ends with
``torch.cuda.synchronize()``, and the block's lead-in call (after its barrier) does too, so a
time covers the whole collective. It starts one worker per visible GPU unless ``--np`` says
otherwise, and needs at least two, each with a GPU of its own; without CUDA, NCCL or hora's
NCCL data path it says why and exits with status 2::

    .venv/bin/python benchmarks/collectives.py --transport nccl [--np N] [--json results.json]

``--plot PATH`` also draws the allreduce bus bandwidth against message size as a PNG chart, a
line per library with the range of its calls as a band (any ``--transport``); ``--docs`` draws
docs/images/bandwidth_by_size.png (see charts.py).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as _dist

import hora
import hora.torch as hvd
from hora.common import basics
from hora.common.vocabulary.config import Settings

# The benchmarks' shared helpers live beside this file.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import charts
import harness

MIB = 1024 * 1024
KIB = 1024
# Allreduce sizes in bytes, and how many times each is timed (per library).
BANDWIDTH_REPS = {1 * MIB: 60, 4 * MIB: 40, 16 * MIB: 24, 64 * MIB: 12, 256 * MIB: 6}
BANDWIDTH_GOAL = 0.95
# Ranks of one host exchange through shared memory (hora's "shm" data path): what it must give
# against raw Gloo, which goes through TCP loopback: from these many bytes up, at least this
# ratio of bus bandwidths (and at least raw mpi4py's, when it runs beside them).
SHM_BANDWIDTH_GOALS = ((64 * MIB, 1.3), (0, 2.0))
# --transport nccl: CUDA float32 allreduce sizes and repetitions, and where the goal starts.
NCCL_BANDWIDTH_REPS = {1 * MIB: 100, 4 * MIB: 80, 16 * MIB: 60, 64 * MIB: 40, 256 * MIB: 20}
GOAL_FROM_BYTES = 16 * MIB


def bus_bytes(nbytes: int, ranks: int) -> float:
    """The bytes an allreduce of ``nbytes`` moves per rank on a ring: 2 (n-1)/n x bytes."""
    return 2 * (ranks - 1) / ranks * nbytes


def peer_goal(nbytes: int, ratio: float, peer: str) -> dict[str, Any]:
    """A row's goal against a raw peer (``ratio``: hora's bus bandwidth over the peer's),
    which applies from ``GOAL_FROM_BYTES`` up."""
    applies = nbytes >= GOAL_FROM_BYTES
    return {
        "ratio": ratio,
        "goal": f"hora/raw {peer} bus bandwidth >= {BANDWIDTH_GOAL}" if applies else "",
        "pass": ratio >= BANDWIDTH_GOAL or not applies,
    }


FUSION_TENSORS = 300
FUSION_ELEMENTS = 256  # 1 KiB of float32
FUSION_GOAL = 5.0
LATENCY_SIZES = (4, 1 * KIB, 64 * KIB, 1 * MIB)
LATENCY_EXTRA_GOAL_US = 500.0
# On the shared-memory path a synchronous 4 B allreduce costs at most this times raw Gloo's.
SHM_LATENCY_GOAL = 2.0
# Many small ops: how many, how large, and the goal for hora's time over raw's, per way.
SMALL_OPS = 200
SMALL_OP_ELEMENTS = 1024  # 4 KiB of float32
SMALL_OP_GOALS = {"one by one": 2.0, "grouped": 2.0, "async": 1.0}
RAW_PREFIX = "raw-bench/"
CHART = "bandwidth_by_size.png"  # under docs/images/ with --docs

# torch.distributed's stubs omit the stores (as in hora.common.transport.gloo).
dist: Any = _dist

Op = Callable[[], object]


# ---------------------------------------------------------------- launching


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--np",
        type=int,
        default=None,
        help="workers to start when not run under horarun (default 2; with --transport nccl, "
        "one per visible GPU)",
    )
    parser.add_argument("--json", metavar="PATH", default=None, help="also write results here")
    parser.add_argument(
        "--transport",
        choices=("gloo", "mpi", "nccl"),
        default="gloo",
        help="the data path to measure against its own library (default: gloo)",
    )
    parser.add_argument(
        "--with-mpi",
        action="store_true",
        help="start the job through mpirun (horarun --mpi) and time raw mpi4py's Allreduce "
        "beside hora and raw Gloo (hora keeps its default data path)",
    )
    parser.add_argument(
        "--load",
        action="store_true",
        help="run one busy process per core on the host while measuring (a loaded machine)",
    )
    parser.add_argument(
        "--repeats",
        type=float,
        default=1.0,
        metavar="FACTOR",
        help="scale every repetition count (e.g. 0.2 for a quick check)",
    )
    harness.add_chart_options(parser, CHART)
    args = parser.parse_args(argv)
    if args.np is None:
        args.np = default_workers(args.transport)
    return args


def default_workers(transport: str) -> int:
    """Workers to start: one per visible GPU for NCCL, else 2."""
    if transport == "nccl" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2


def relaunch(args: argparse.Namespace) -> int:
    """Start this script on ``args.np`` workers through horarun and return its exit status."""
    forwarded = ["--repeats", str(args.repeats), "--transport", args.transport]
    if args.load:
        forwarded.append("--load")
    if args.json:
        forwarded += ["--json", os.path.abspath(args.json)]
    chart = harness.chart_path(args, CHART)
    if chart:
        forwarded += ["--plot", chart]
    if args.transport == "mpi" or args.with_mpi:
        command = [sys.executable, "-m", "hora.runner.launch", "--mpi", "-np", str(args.np)]
        # --with-mpi: mpirun starts the job so that mpi4py can run beside hora, whose own
        # collectives keep their default path (HORA_CPU_OPERATIONS=gloo).
        env = {**os.environ, "HORA_CPU_OPERATIONS": "gloo"} if args.with_mpi else None
        return subprocess.call(
            [*command, sys.executable, os.path.abspath(__file__), *forwarded], env=env
        )
    return harness.relaunch(__file__, args.np, forwarded)


def init_raw_group(rank: int, size: int) -> None:
    harness.init_raw_group(rank, size, RAW_PREFIX, timeout_s=60)


# ---------------------------------------------------------------- timing


def run_block(op: Op, reps: int) -> list[float]:
    """Time ``reps`` back-to-back calls of ``op`` on this rank, after a barrier and a lead-in.

    The barrier lines the ranks up; one untimed call absorbs the skew with which ranks leave it
    (hundreds of microseconds here) and, for hora, wakes a parked engine. The timed calls then
    follow each other as they would in a training loop.
    """
    dist.barrier()
    op()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return times


@dataclass(frozen=True)
class Comparison:
    """Times hora and its peers' ops against each other in alternating blocks.

    Blocks run in the order hora, raw, raw, hora, ... (with a third op: A B C C B A ...) so that
    drift in the machine's load falls on every op alike. Before a peer's block hora's engine
    gets ``settle_s`` to park, so that its idle cycles do not compete with the peer for the CPU.
    """

    settle_s: float

    def run(
        self, hora_op: Op, raw_op: Op, reps: int, warmup: int, block: int
    ) -> tuple[list[float], list[float]]:
        """Time each op ``reps`` times, in blocks of ``block``, after ``warmup`` untimed calls.

        Returns:
            (hora times, raw times) in seconds; each is the slowest rank's time for that call.
        """
        hora_times, raw_times = self.run_all([hora_op, raw_op], reps, warmup, block)
        return hora_times, raw_times

    def run_all(self, ops: Sequence[Op], reps: int, warmup: int, block: int) -> list[list[float]]:
        """:meth:`run` for any number of ops, the first hora's; their times, in order."""
        for _ in range(warmup):
            for op in ops:
                dist.barrier()
                op()
        times: list[list[float]] = [[] for _ in ops]
        order = [*range(len(ops)), *reversed(range(len(ops)))]
        for index in itertools.cycle(order):
            count = min(block, reps - len(times[index]))
            if count > 0:
                if index:
                    time.sleep(self.settle_s)
                times[index].extend(run_block(ops[index], count))
            if all(len(t) == reps for t in times):
                break
        return [harness.slowest_rank(t) for t in times]


def scaled(count: int, factor: float) -> int:
    return max(3, round(count * factor))


def check_results(size: int) -> None:
    """Both libraries sum correctly (once, before timing)."""
    expected = float(size * (size + 1) // 2)
    mine = torch.full((FUSION_ELEMENTS,), float(dist.get_rank() + 1))
    raw = mine.clone()
    dist.all_reduce(raw)
    fused = [mine.clone() for _ in range(4)]
    handles = [hvd.allreduce_async_(t, name=f"check.{i}", op=hvd.Sum) for i, t in enumerate(fused)]
    for handle in handles:
        hvd.synchronize(handle)
    single = hvd.allreduce_(mine.clone(), op=hvd.Sum, name="check.single")
    for result in (raw, single, *fused):
        if not torch.equal(result, torch.full_like(result, expected)):
            raise RuntimeError(f"wrong allreduce result: {result[:4].tolist()} != {expected}")


# ---------------------------------------------------------------- benchmarks


def hora_allreduce(tensor: torch.Tensor, name: str | None) -> Op:
    return lambda: hvd.allreduce_(tensor, op=hvd.Sum, name=name)


def raw_allreduce(tensor: torch.Tensor) -> Op:
    return lambda: dist.all_reduce(tensor)


def shm_goal(nbytes: int) -> float:
    """The bus bandwidth ratio to raw Gloo the shared-memory path must reach at ``nbytes``."""
    return next(ratio for start, ratio in SHM_BANDWIDTH_GOALS if nbytes >= start)


def bench_bandwidth(
    timer: Comparison, factor: float, path: str, mpi: tuple[Any, Any] | None
) -> list[dict[str, Any]]:
    """One large in-place float32 allreduce at a time; bus bandwidth per size, against raw
    Gloo and, where ``mpi`` (``(communicator, MPI module)``) is given, raw mpi4py."""
    size = dist.get_world_size()
    rows = []
    for nbytes, base_reps in BANDWIDTH_REPS.items():
        # Zeros stay zeros however often they are summed: no overflow, no denormals.
        tensor = torch.zeros(nbytes // 4, dtype=torch.float32)
        name = f"bandwidth.{nbytes}"
        ops = [hora_allreduce(tensor, name), raw_allreduce(tensor)]
        if mpi is not None:
            ops.append(raw_mpi_allreduce(mpi[0], mpi[1], tensor))
        samples = timer.run_all(ops, scaled(base_reps, factor), warmup=3, block=5)
        hora_s, raw_s = statistics.median(samples[0]), statistics.median(samples[1])
        moved = bus_bytes(nbytes, size)
        ratio = raw_s / hora_s
        wanted = shm_goal(nbytes) if path == "shm" else BANDWIDTH_GOAL
        row: dict[str, Any] = {
            "bytes": nbytes,
            "hora_s": hora_s,
            "raw_s": raw_s,
            "hora_busbw_GBps": moved / hora_s / 1e9,
            "raw_busbw_GBps": moved / raw_s / 1e9,
            "ratio": ratio,
            "wanted": wanted,
            "goal": f"hora/raw bus bandwidth >= {wanted:g}",
            "pass": ratio >= wanted,
            "hora_samples_s": samples[0],
            "raw_samples_s": samples[1],
        }
        if mpi is not None:
            mpi_s = statistics.median(samples[2])
            row.update(
                mpi_s=mpi_s,
                mpi_busbw_GBps=moved / mpi_s / 1e9,
                mpi_ratio=mpi_s / hora_s,
                mpi_samples_s=samples[2],
            )
            if path == "shm":
                row["goal"] += " and >= raw mpi4py's"
                row["pass"] = row["pass"] and mpi_s / hora_s >= 1.0
        rows.append(row)
    return rows


def bench_fusion(timer: Comparison, factor: float) -> dict[str, Any]:
    """Many small allreduces: hora submits them all at once, raw runs them one by one."""
    tensors = [torch.zeros(FUSION_ELEMENTS, dtype=torch.float32) for _ in range(FUSION_TENSORS)]
    names = [f"t{i}" for i in range(FUSION_TENSORS)]
    submit_times: list[float] = []

    def hora_batch() -> None:
        start = time.perf_counter()
        handles = [hvd.allreduce_async_(t, name=n, op=hvd.Sum) for t, n in zip(tensors, names)]
        submit_times.append(time.perf_counter() - start)
        for handle in handles:
            hvd.synchronize(handle)

    def raw_batch() -> None:
        for t in tensors:
            dist.all_reduce(t)

    warmup = 3
    hora_times, raw_times = timer.run(
        hora_batch, raw_batch, scaled(30, factor), warmup=warmup, block=5
    )
    hora_s, raw_s = statistics.median(hora_times), statistics.median(raw_times)
    speedup = raw_s / hora_s
    return {
        "tensors": FUSION_TENSORS,
        "tensor_bytes": FUSION_ELEMENTS * 4,
        "hora_s": hora_s,
        "raw_s": raw_s,
        "hora_submit_s": statistics.median(submit_times[warmup:]),
        "speedup": speedup,
        "goal": f"raw/hora time >= {FUSION_GOAL}",
        "pass": speedup >= FUSION_GOAL,
        "hora_samples_s": hora_times,
        "raw_samples_s": raw_times,
    }


def bench_latency(
    timer: Comparison, factor: float, path: str, mpi: tuple[Any, Any] | None
) -> list[dict[str, Any]]:
    """One synchronous allreduce at a time: named (a repeated name is replayed by the steady
    state) and, for the smallest size, unnamed (every unnamed call is negotiated anew); raw
    mpi4py beside them where ``mpi`` is given."""
    rows = []
    for nbytes, named in [(n, True) for n in LATENCY_SIZES] + [(LATENCY_SIZES[0], False)]:
        tensor = torch.zeros(nbytes // 4, dtype=torch.float32)
        name = f"latency.{nbytes}" if named else None
        ops = [hora_allreduce(tensor, name), raw_allreduce(tensor)]
        if mpi is not None:
            ops.append(raw_mpi_allreduce(mpi[0], mpi[1], tensor))
        samples = timer.run_all(ops, scaled(200, factor), warmup=20, block=20)
        hora_times, raw_times = samples[0], samples[1]
        hora_s, raw_s = statistics.median(hora_times), statistics.median(raw_times)
        extra_us = (hora_s - raw_s) * 1e6
        if path == "shm" and nbytes == LATENCY_SIZES[0]:
            goal = f"hora/raw time <= {SHM_LATENCY_GOAL:g}"
            passed = hora_s / raw_s <= SHM_LATENCY_GOAL
        else:
            goal = f"hora - raw <= {LATENCY_EXTRA_GOAL_US:g} us"
            passed = extra_us <= LATENCY_EXTRA_GOAL_US
        rows.append(
            {
                "bytes": nbytes,
                "named": named,
                "hora_s": hora_s,
                "raw_s": raw_s,
                "extra_us": extra_us,
                "goal": goal,
                "pass": passed,
                "hora_samples_s": hora_times,
                "raw_samples_s": raw_times,
                **mpi_columns(samples),
            }
        )
    return rows


def mpi_columns(samples: list[list[float]]) -> dict[str, Any]:
    """Raw mpi4py's median and samples, when a third op was timed."""
    if len(samples) < 3:
        return {}
    return {"mpi_s": statistics.median(samples[2]), "mpi_samples_s": samples[2]}


def mpi_small_ops(tensors: list[torch.Tensor], comm: Any, mpi: Any) -> dict[str, Op]:
    """Raw mpi4py's ways of running many small allreduces: one by one, and non-blocking
    (``Iallreduce`` each, then wait for all) for both the grouped and asynchronous rows."""
    arrays = [t.numpy() for t in tensors]

    def one_by_one() -> None:
        for array in arrays:
            comm.Allreduce(mpi.IN_PLACE, array, mpi.SUM)

    def non_blocking() -> None:
        mpi.Request.Waitall([comm.Iallreduce(mpi.IN_PLACE, a, mpi.SUM) for a in arrays])

    return {"one by one": one_by_one, "grouped": non_blocking, "async": non_blocking}


def raw_coalesced(tensors: list[torch.Tensor]) -> None:
    """torch.distributed's one call for many tensors (it warns that it will be deprecated)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_reduce_coalesced(tensors)


def small_ops(tensors: list[torch.Tensor]) -> dict[str, tuple[Op, Op]]:
    """The three ways of running many small allreduces, as (hora, raw) pairs."""
    names = [f"small.{i}" for i in range(len(tensors))]

    def hora_one_by_one() -> None:
        for t, n in zip(tensors, names):
            hvd.allreduce_(t, op=hvd.Sum, name=n)

    def raw_one_by_one() -> None:
        for t in tensors:
            dist.all_reduce(t)

    def hora_async() -> None:
        handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=n) for t, n in zip(tensors, names)]
        for handle in handles:
            hvd.synchronize(handle)

    def raw_async() -> None:
        for work in [dist.all_reduce(t, async_op=True) for t in tensors]:
            work.wait()

    return {
        "one by one": (hora_one_by_one, raw_one_by_one),
        "grouped": (
            lambda: hvd.grouped_allreduce_(tensors, op=hvd.Sum, name="small.grouped"),
            lambda: raw_coalesced(tensors),
        ),
        "async": (hora_async, raw_async),
    }


def bench_small_ops(
    timer: Comparison, factor: float, mpi: tuple[Any, Any] | None
) -> list[dict[str, Any]]:
    """Many small allreduces, one by one, grouped and asynchronous, against raw's same way
    (and raw mpi4py's, where ``mpi`` is given)."""
    tensors = [torch.zeros(SMALL_OP_ELEMENTS, dtype=torch.float32) for _ in range(SMALL_OPS)]
    mpi_ops = mpi_small_ops(tensors, *mpi) if mpi is not None else {}
    rows = []
    for way, (hora_op, raw_op) in small_ops(tensors).items():
        ops = [hora_op, raw_op, *([mpi_ops[way]] if mpi_ops else [])]
        samples = timer.run_all(ops, scaled(20, factor), warmup=3, block=5)
        hora_times, raw_times = samples[0], samples[1]
        hora_s, raw_s = statistics.median(hora_times), statistics.median(raw_times)
        goal = SMALL_OP_GOALS[way]
        rows.append(
            {
                "way": way,
                "tensors": SMALL_OPS,
                "tensor_bytes": SMALL_OP_ELEMENTS * 4,
                "hora_s": hora_s,
                "raw_s": raw_s,
                "ratio": hora_s / raw_s,
                "goal": f"hora/raw time <= {goal:g}",
                "pass": hora_s / raw_s <= goal,
                "hora_samples_s": hora_times,
                "raw_samples_s": raw_times,
                **mpi_columns(samples),
            }
        )
    return rows


# ---------------------------------------------------------------- report


def size_label(nbytes: int) -> str:
    if nbytes >= MIB:
        return f"{nbytes // MIB} MiB"
    if nbytes >= KIB:
        return f"{nbytes // KIB} KiB"
    return f"{nbytes} B"


def duration(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"


def latency_label(row: dict[str, Any]) -> str:
    return f"latency {size_label(row['bytes'])}{'' if row['named'] else ', unnamed'}"


def mpi_note(row: dict[str, Any]) -> str:
    """Raw mpi4py's time beside a row's goal, when it was timed."""
    return f"; mpi4py {duration(row['mpi_s'])}" if "mpi_s" in row else ""


def format_table(results: dict[str, Any]) -> str:
    header = ("benchmark", "hora", "raw gloo", "hora vs raw", "goal", "result")
    rows: list[tuple[str, ...]] = []
    for row in results["allreduce_bandwidth"]:
        goal = f">= {row['wanted']:g}x"
        if "mpi_busbw_GBps" in row:
            goal += f"; mpi4py {row['mpi_busbw_GBps']:.2f} GB/s ({row['mpi_ratio']:.2f}x)"
        rows.append(
            (
                f"allreduce {size_label(row['bytes'])} busbw",
                f"{row['hora_busbw_GBps']:.2f} GB/s",
                f"{row['raw_busbw_GBps']:.2f} GB/s",
                f"{row['ratio']:.3f}x",
                goal,
                harness.verdict(row["pass"]),
            )
        )
    fusion = results["fusion"]
    rows.append(
        (
            f"{fusion['tensors']} x {size_label(fusion['tensor_bytes'])} allreduce",
            duration(fusion["hora_s"]),
            duration(fusion["raw_s"]),
            f"{fusion['speedup']:.1f}x faster",
            f">= {FUSION_GOAL:g}x faster",
            harness.verdict(fusion["pass"]),
        )
    )
    for row in results["latency"]:
        by_ratio = row["goal"].startswith("hora/raw")
        rows.append(
            (
                latency_label(row),
                duration(row["hora_s"]),
                duration(row["raw_s"]),
                f"{row['hora_s'] / row['raw_s']:.2f}x time"
                if by_ratio
                else f"{row['extra_us']:+.0f} us",
                (f"<= {SHM_LATENCY_GOAL:g}x" if by_ratio else f"<= +{LATENCY_EXTRA_GOAL_US:.0f} us")
                + mpi_note(row),
                harness.verdict(row["pass"]),
            )
        )
    for row in results["small_ops"]:
        rows.append(
            (
                f"{row['tensors']} x {size_label(row['tensor_bytes'])} {row['way']}",
                duration(row["hora_s"]),
                duration(row["raw_s"]),
                f"{row['ratio']:.2f}x time",
                f"<= {SMALL_OP_GOALS[row['way']]:g}x" + mpi_note(row),
                harness.verdict(row["pass"]),
            )
        )
    title = (
        f"hora {results['hora_version']} ({results['hora_revision']}, data path "
        f"{results['data_path']}, fast path {'on' if results['fast_path'] else 'off'}) vs "
        f"torch.distributed gloo (torch {results['torch_version']})"
        f"{results['mpi_peer']}, {results['world_size']} ranks, "
        f"cycle time {results['cycle_time_ms']:g} ms; medians, slowest rank"
    )
    notes = (
        f"hora submit time for the {fusion['tensors']} async calls: "
        f"{duration(fusion['hora_submit_s'])} (median)\n"
        f"run time {results['elapsed_s']:.1f} s on {results['cpus']} CPUs; load average "
        f"{results['load_before'][0]:.2f} before, {results['load_after'][0]:.2f} after"
    )
    passed = sum(r["pass"] for r in results["goals"])
    summary = f"goals met: {passed}/{len(results['goals'])}"
    return "\n".join([title, *harness.table(header, rows), notes, summary])


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    items = [
        {"name": f"allreduce {size_label(r['bytes'])} bus bandwidth", "pass": r["pass"]}
        for r in results["allreduce_bandwidth"]
    ]
    items.append({"name": "fusion of 300 small allreduces", "pass": results["fusion"]["pass"]})
    items += [{"name": latency_label(r), "pass": r["pass"]} for r in results["latency"]]
    items += [
        {"name": f"{r['tensors']} small allreduces, {r['way']}", "pass": r["pass"]}
        for r in results["small_ops"]
    ]
    return items


def chart_series(transport: str, results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The lines of the bandwidth chart, hora's first, then its raw peer's: ``(label,
    bandwidth key, samples key)`` of the ``allreduce_bandwidth`` rows."""
    if transport == "mpi":
        return [
            ("hora over MPI", "hora_mpi_busbw_GBps", "hora_samples_s"),
            ("raw mpi4py Allreduce", "raw_mpi_busbw_GBps", "mpi_samples_s"),
            ("raw torch.distributed Gloo", "raw_gloo_busbw_GBps", "gloo_samples_s"),
        ]
    if transport == "nccl":
        return [
            ("hora over NCCL", "hora_nccl_busbw_GBps", "hora_samples_s"),
            ("raw torch.distributed NCCL", "raw_nccl_busbw_GBps", "raw_samples_s"),
        ]
    path = results["data_path"]
    named = {"shm": "shared memory", "gloo": "Gloo", "hierarchical": "hierarchical"}
    series = [
        (f"hora ({named.get(path, path)})", "hora_busbw_GBps", "hora_samples_s"),
        ("raw torch.distributed Gloo", "raw_busbw_GBps", "raw_samples_s"),
    ]
    if "mpi_busbw_GBps" in results["allreduce_bandwidth"][0]:
        series.append(("raw mpi4py Allreduce", "mpi_busbw_GBps", "mpi_samples_s"))
    return series


def chart_drawer(args: argparse.Namespace) -> Callable[[dict[str, Any]], object] | None:
    """What draws the bandwidth chart on rank 0 (``None``: no ``--plot``, no ``--docs``)."""
    path = harness.chart_path(args, CHART)
    if path is None:
        return None
    return lambda results: charts.bandwidth_by_size(
        results, chart_series(args.transport, results), path
    )


def run_options(args: argparse.Namespace) -> str:
    """The options that shaped the measurements, as the chart's caption names them."""
    shown = "" if args.transport == "gloo" else f" --transport {args.transport}"
    shown += " --with-mpi" if mpi_launched() and args.transport == "gloo" else ""
    shown += " --load" if args.load else ""
    return shown + (f" --repeats {args.repeats:g}" if args.repeats != 1.0 else "")


# ---------------------------------------------------------------- MPI


def raw_mpi_allreduce(comm: Any, mpi: Any, tensor: torch.Tensor) -> Op:
    """mpi4py's in-place ``Allreduce`` on the tensor's memory (no copy)."""
    array = tensor.numpy()
    return lambda: comm.Allreduce(mpi.IN_PLACE, array, mpi.SUM)


def bench_mpi_bandwidth(timer: Comparison, factor: float, comm: Any, mpi: Any) -> list[Any]:
    """One large float32 allreduce at a time: hora over MPI, raw mpi4py, and raw Gloo."""
    size = comm.Get_size()
    rows = []
    for nbytes, base_reps in BANDWIDTH_REPS.items():
        tensor = torch.zeros(nbytes // 4, dtype=torch.float32)
        reps = scaled(base_reps, factor)
        mpi_op = raw_mpi_allreduce(comm, mpi, tensor)
        hora_times, mpi_times = timer.run(
            hora_allreduce(tensor, f"bandwidth.{nbytes}"), mpi_op, reps, warmup=3, block=5
        )
        _, gloo_times = timer.run(mpi_op, raw_allreduce(tensor), reps, warmup=2, block=5)
        moved = bus_bytes(nbytes, size)
        hora_s, mpi_s = statistics.median(hora_times), statistics.median(mpi_times)
        gloo_s = statistics.median(gloo_times)
        rows.append(
            {
                "bytes": nbytes,
                "hora_mpi_busbw_GBps": moved / hora_s / 1e9,
                "raw_mpi_busbw_GBps": moved / mpi_s / 1e9,
                "raw_gloo_busbw_GBps": moved / gloo_s / 1e9,
                **peer_goal(nbytes, mpi_s / hora_s, "MPI"),
                "mpi_vs_gloo": gloo_s / hora_s,
                "hora_samples_s": hora_times,
                "mpi_samples_s": mpi_times,
                "gloo_samples_s": gloo_times,
            }
        )
    return rows


def format_mpi_table(results: dict[str, Any]) -> str:
    header = ("allreduce busbw", "hora mpi", "raw mpi4py", "hora/raw", "goal", "raw gloo")
    header += ("hora mpi/raw gloo",)
    rows = []
    for row in results["allreduce_bandwidth"]:
        goal = f">= {BANDWIDTH_GOAL}x {harness.verdict(row['pass'])}" if row["goal"] else "-"
        rows.append(
            (
                size_label(row["bytes"]),
                f"{row['hora_mpi_busbw_GBps']:.2f} GB/s",
                f"{row['raw_mpi_busbw_GBps']:.2f} GB/s",
                f"{row['ratio']:.3f}x",
                goal,
                f"{row['raw_gloo_busbw_GBps']:.2f} GB/s",
                f"{row['mpi_vs_gloo']:.2f}x",
            )
        )
    title = (
        f"hora {results['hora_version']} over MPI ({results['mpi_library']}) vs mpi4py "
        f"{results['mpi4py_version']} and torch.distributed gloo (torch {results['torch_version']})"
        f", {results['world_size']} ranks; medians, slowest rank"
    )
    notes = (
        f"run time {results['elapsed_s']:.1f} s on {results['cpus']} CPUs; load average "
        f"{results['load_before'][0]:.2f} before, {results['load_after'][0]:.2f} after"
    )
    return "\n".join([title, *harness.table(header, rows), notes])


def mpi_worker(args: argparse.Namespace) -> None:
    """hora over MPI against mpi4py and Gloo, in a job started by ``horarun --mpi``."""
    import mpi4py
    from mpi4py import MPI

    started = time.perf_counter()
    load_before = os.getloadavg()
    hvd.init()
    if not hvd.mpi_enabled():
        raise SystemExit("--transport mpi: hora does not run over MPI here (HORA_CPU_OPERATIONS)")
    rank, size = hvd.rank(), hvd.size()
    comm = MPI.COMM_WORLD.Dup()
    init_raw_group(rank, size)
    check_results(size)
    cycle_time_ms = Settings.from_env().cycle_time_ms
    timer = Comparison(settle_s=max(0.05, 10 * cycle_time_ms / 1000))
    results: dict[str, Any] = {
        "hora_version": hora.__version__,
        "torch_version": torch.__version__,
        "mpi4py_version": mpi4py.__version__,
        "mpi_library": MPI.Get_library_version().splitlines()[0].split(",")[0].strip(),
        "world_size": size,
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "allreduce_bandwidth": bench_mpi_bandwidth(timer, args.repeats, comm, MPI),
        "options": run_options(args),
        **harness.run_facts(),
    }
    harness.report(results, started, rank, format_mpi_table, args.json, chart_drawer(args))
    comm.Free()
    dist.destroy_process_group()
    hvd.shutdown()


def nccl_unavailable() -> str | None:
    """Why ``--transport nccl`` cannot run here (``None``: it can)."""
    reason = harness.nccl_unavailable("--transport nccl")
    return None if reason is None else f"{reason} Measure --transport gloo or mpi instead."


def nccl_workers_unfit(np: int) -> str | None:
    """Why ``np`` workers on this host cannot share its GPUs over NCCL (``None``: they can)."""
    gpus = torch.cuda.device_count()
    if np < 2 or np > gpus:
        return (
            f"--transport nccl needs 2 or more workers with a GPU each: --np {np}, and this "
            f"host has {gpus} GPU(s) (NCCL does not put two ranks on one GPU)."
        )
    return None


def cuda_synced(op: Op) -> Op:
    """``op`` followed by ``torch.cuda.synchronize()``: its time covers the GPU's work too."""

    def run() -> None:
        op()
        torch.cuda.synchronize()

    return run


def check_cuda_results(size: int, device: torch.device) -> None:
    """hora and raw NCCL sum CUDA tensors correctly, leaving them on this GPU (once)."""
    expected = float(size * (size + 1) // 2)
    mine = torch.full((FUSION_ELEMENTS,), float(dist.get_rank() + 1), device=device)
    raw = mine.clone()
    dist.all_reduce(raw)
    single = hvd.allreduce_(mine.clone(), op=hvd.Sum, name="check.cuda")
    torch.cuda.synchronize()
    for result in (raw, single):
        if result.device != device:
            raise RuntimeError(f"allreduce moved a tensor from {device} to {result.device}")
        if not torch.equal(result, torch.full_like(result, expected)):
            raise RuntimeError(f"wrong allreduce result: {result[:4].tolist()} != {expected}")


def bench_nccl_bandwidth(
    timer: Comparison, factor: float, device: torch.device
) -> list[dict[str, Any]]:
    """One large in-place CUDA float32 allreduce at a time: hora over NCCL, raw NCCL."""
    size = dist.get_world_size()
    rows = []
    for nbytes, base_reps in NCCL_BANDWIDTH_REPS.items():
        # Zeros stay zeros however often they are summed: no overflow, no denormals.
        tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        hora_times, raw_times = timer.run(
            cuda_synced(hora_allreduce(tensor, f"bandwidth.{nbytes}")),
            cuda_synced(raw_allreduce(tensor)),
            scaled(base_reps, factor),
            warmup=3,
            block=5,
        )
        hora_s, raw_s = statistics.median(hora_times), statistics.median(raw_times)
        moved = bus_bytes(nbytes, size)
        rows.append(
            {
                "bytes": nbytes,
                "hora_s": hora_s,
                "raw_s": raw_s,
                "hora_nccl_busbw_GBps": moved / hora_s / 1e9,
                "raw_nccl_busbw_GBps": moved / raw_s / 1e9,
                **peer_goal(nbytes, raw_s / hora_s, "NCCL"),
                "hora_samples_s": hora_times,
                "raw_samples_s": raw_times,
            }
        )
        del tensor
        torch.cuda.empty_cache()
    return rows


def format_nccl_table(results: dict[str, Any]) -> str:
    header = ("allreduce busbw", "hora nccl", "raw nccl", "hora/raw", "goal")
    rows = []
    for row in results["allreduce_bandwidth"]:
        goal = f">= {BANDWIDTH_GOAL}x {harness.verdict(row['pass'])}" if row["goal"] else "-"
        rows.append(
            (
                size_label(row["bytes"]),
                f"{row['hora_nccl_busbw_GBps']:.2f} GB/s",
                f"{row['raw_nccl_busbw_GBps']:.2f} GB/s",
                f"{row['ratio']:.3f}x",
                goal,
            )
        )
    title = (
        f"hora {results['hora_version']} ({results['hora_revision']}) over NCCL "
        f"(HORA_GPU_OPERATIONS=nccl) vs torch.distributed nccl (torch {results['torch_version']}, "
        f"NCCL {results['nccl_version']}), {results['world_size']} ranks on {results['gpu']}; "
        "CUDA float32, medians, slowest rank"
    )
    notes = (
        "busbw = 2 (n-1)/n x bytes / time; each call timed up to torch.cuda.synchronize()\n"
        f"run time {results['elapsed_s']:.1f} s; load average "
        f"{results['load_before'][0]:.2f} before, {results['load_after'][0]:.2f} after"
    )
    goals = [r for r in results["allreduce_bandwidth"] if r["goal"]]
    summary = f"goals met: {sum(r['pass'] for r in goals)}/{len(goals)}"
    return "\n".join([title, *harness.table(header, rows), notes, summary])


def nccl_version() -> str:
    nccl: Any = torch.cuda.nccl
    version = nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def nccl_worker(args: argparse.Namespace) -> None:
    """hora's NCCL data path against raw torch.distributed NCCL, on this worker's GPU."""
    started = time.perf_counter()
    load_before = os.getloadavg()
    # The path measured: hora's collectives on CUDA tensors run on NCCL.
    os.environ["HORA_GPU_OPERATIONS"] = "nccl"
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if hvd.local_size() > torch.cuda.device_count():
        raise SystemExit(
            f"--transport nccl: {hvd.local_size()} workers on this host share "
            f"{torch.cuda.device_count()} GPU(s); NCCL needs one GPU per worker."
        )
    device = harness.local_gpu()
    harness.init_raw_group(
        rank, size, RAW_PREFIX, timeout_s=120, backend=harness.NCCL_BACKEND, device_id=device
    )
    check_cuda_results(size, device)
    cycle_time_ms = Settings.from_env().cycle_time_ms
    timer = Comparison(settle_s=max(0.05, 10 * cycle_time_ms / 1000))
    results: dict[str, Any] = {
        "hora_version": hora.__version__,
        "hora_revision": harness.source_revision() if rank == 0 else None,
        "torch_version": torch.__version__,
        "nccl_version": nccl_version(),
        "gpu": torch.cuda.get_device_name(device),
        "world_size": size,
        "load_before": load_before,
        "cycle_time_ms": cycle_time_ms,
        "allreduce_bandwidth": bench_nccl_bandwidth(timer, args.repeats, device),
        "options": run_options(args),
        **harness.run_facts(),
    }
    harness.report(results, started, rank, format_nccl_table, args.json, chart_drawer(args))
    dist.destroy_process_group()
    hvd.shutdown()


# ---------------------------------------------------------------- main


def worker(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    load_before = os.getloadavg()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    init_raw_group(rank, size)
    busy = start_load() if args.load and hvd.local_rank() == 0 else []
    cycle_time_ms = Settings.from_env().cycle_time_ms
    check_results(size)
    path = basics.data_path()
    mpi = mpi_peer()
    # Idle, hora's engine parks after a few cycles (about 5 ms at the default cycle time).
    timer = Comparison(settle_s=max(0.05, 10 * cycle_time_ms / 1000))
    results: dict[str, Any] = {
        **harness.versions(rank == 0),
        "world_size": size,
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "cycle_time_ms": cycle_time_ms,
        "fast_path": Settings.from_env().fast_path,
        "data_path": path,
        "mpi_peer": "" if mpi is None else f" and mpi4py ({mpi[1].Get_library_version()[:12]})",
        "allreduce_bandwidth": bench_bandwidth(timer, args.repeats, path, mpi),
        "fusion": bench_fusion(timer, args.repeats),
        "latency": bench_latency(timer, args.repeats, path, mpi),
        "small_ops": bench_small_ops(timer, args.repeats, mpi),
        "options": run_options(args),
        **harness.run_facts(),
    }
    stop_load(busy)
    dist.barrier()
    results["elapsed_s"] = time.perf_counter() - started
    results["load_after"] = os.getloadavg()
    results["goals"] = goals(results)
    if rank == 0:
        print(format_table(results), flush=True)
        if args.json:
            harness.write_json(args.json, results)
        draw = chart_drawer(args)
        if draw is not None:
            draw(results)
    dist.barrier()
    if mpi is not None:
        mpi[0].Free()
    dist.destroy_process_group()
    hvd.shutdown()


def start_load() -> list[subprocess.Popen[bytes]]:
    """One busy process per core of the host (``--load``), until :func:`stop_load`."""
    spin = "while True: pass"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]


def stop_load(busy: list[subprocess.Popen[bytes]]) -> None:
    for process in busy:
        process.kill()
        process.wait()


def mpi_peer() -> tuple[Any, Any] | None:
    """``(communicator, MPI module)`` for raw mpi4py beside hora and Gloo, when the job was
    started by ``mpirun`` (``--with-mpi``); else ``None``."""
    if not mpi_launched():
        return None
    from mpi4py import MPI

    return MPI.COMM_WORLD.Dup(), MPI


def mpi_launched() -> bool:
    """Whether ``mpirun`` or ``mpiexec`` started this process."""
    return "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ


def nccl_refusal(args: argparse.Namespace) -> str | None:
    """Why this ``--transport nccl`` run cannot go ahead (``None``: it can)."""
    reason = nccl_unavailable()
    if reason is None and "HORA_RANK" not in os.environ:
        reason = nccl_workers_unfit(args.np)
    return reason


def main() -> int:
    args = parse_args()
    reason = nccl_refusal(args) if args.transport == "nccl" else None
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    under_mpirun = mpi_launched()
    if args.transport == "mpi" and "HORA_RANK" in os.environ:
        print(
            "--transport mpi starts the job with mpirun itself: run "
            "`python benchmarks/collectives.py --transport mpi` (not under horarun).",
            file=sys.stderr,
        )
        return 2
    if "HORA_RANK" not in os.environ and not under_mpirun:
        return relaunch(args)
    if args.transport == "mpi":
        mpi_worker(args)
    elif args.transport == "nccl":
        nccl_worker(args)
    else:
        worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
