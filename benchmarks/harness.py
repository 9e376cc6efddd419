"""What the benchmarks share: starting themselves through horarun, the raw torch.distributed
peer group beside hora, the slowest rank's timings, the report's small helpers, and the options
and facts (date, machine) of the charts that some of them draw (see charts.py)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import torch
import torch.distributed as dist

import hora


def step_block_arguments(args: Any) -> list[str]:
    """The options of a benchmark that times training steps in blocks (``--models``,
    ``--steps``, ``--block``, ``--warmup``, ``--batch-size``), to pass on to its workers."""
    forwarded = ["--models", *args.models, "--steps", str(args.steps)]
    forwarded += ["--block", str(args.block), "--warmup", str(args.warmup)]
    if args.batch_size is not None:
        forwarded += ["--batch-size", str(args.batch_size)]
    return forwarded


def relaunch(script: str, np: int, forwarded: list[str]) -> int:
    """Start ``script`` on ``np`` workers through horarun and return its exit status."""
    command = [sys.executable, "-m", "hora.runner.launch", "-np", str(np)]
    command += [sys.executable, os.path.abspath(script), *forwarded]
    return subprocess.call(command)


# The raw group's store, hosted by rank 0; it must outlive the group.
_raw_store: list[Any] = []


def init_raw_group(
    rank: int,
    size: int,
    prefix: str,
    timeout_s: float,
    backend: str = "gloo",
    device_id: torch.device | None = None,
) -> None:
    """torch.distributed's default group beside hora (call it after ``hvd.init()``).

    The job's own store only speaks hora's authenticated protocol, so rank 0 hosts a plain
    ``TCPStore`` for the raw group on a free port and sends its address to the others with
    hora's ``broadcast_object``; the group's keys live under ``prefix``.

    ``backend`` is Gloo by default; ``"nccl"`` builds a NCCL group, and ``"cpu:gloo,cuda:nccl"``
    one that runs CUDA tensors over NCCL and CPU tensors (barriers, the timings that
    ``slowest_rank`` gathers) over Gloo. ``device_id`` binds a NCCL group to this worker's GPU,
    which also connects its communicator now rather than on the first collective.
    """
    import socket

    import hora.torch as hvd

    timeout = timedelta(seconds=timeout_s)
    store = None
    if rank == 0:
        addr = "127.0.0.1" if hvd.local_size() == size else socket.getfqdn()
        store = dist.TCPStore(addr, 0, size, True, timeout, wait_for_workers=False)
        where = (addr, store.port)
    where = hvd.broadcast_object(where if rank == 0 else None, root_rank=0, name="raw-store")
    if store is None:
        store = dist.TCPStore(where[0], where[1], size, False, timeout)
    _raw_store.append(store)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(prefix, store),
        rank=rank,
        world_size=size,
        timeout=timeout,
        device_id=device_id,
    )


# A default group with CUDA tensors on NCCL and CPU ones (barriers' fallbacks, the timings that
# ``slowest_rank`` gathers) on Gloo.
NCCL_BACKEND = "cpu:gloo,cuda:nccl"


def nccl_unavailable(option: str) -> str | None:
    """Why ``option`` (a benchmark's GPU mode) cannot run here: no CUDA GPU, or a PyTorch
    without NCCL (``None``: it can; hora's NCCL data path comes with PyTorch's NCCL)."""
    if not torch.cuda.is_available():
        return (
            f"{option} needs CUDA GPUs, and this machine's PyTorch sees none "
            f"(torch {torch.__version__}); run it on a GPU host, one worker per GPU."
        )
    if not dist.is_nccl_available():
        return f"{option}: this PyTorch (torch {torch.__version__}) is built without NCCL."
    return None


def local_gpu() -> torch.device:
    """This worker's GPU, local rank modulo the visible GPUs, made the current CUDA device
    (call it after ``hvd.init()``)."""
    import hora.torch as hvd

    index = hvd.local_rank() % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def slowest_rank(times: list[float]) -> list[float]:
    """Per repetition, the longest time any rank measured (ranks that sat out report 0)."""
    tensor = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def versions(revision: bool = True) -> dict[str, str | None]:
    """What was measured, for a benchmark's results: hora's version and commit (``None`` when
    not ``revision``: a rank other than 0 leaves git alone), torch's and Python's."""
    return {
        "hora_version": hora.__version__,
        "hora_revision": source_revision() if revision else None,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
    }


def source_revision() -> str | None:
    """The git commit of the hora checkout being measured (``None`` outside a git checkout)."""
    try:
        described = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=os.path.dirname(os.path.abspath(hora.__file__)),
            capture_output=True,
            text=True,
            timeout=10,
        )
    except OSError:
        return None
    return described.stdout.strip() or None


def verdict(passed: bool) -> str:
    return "PASS" if passed else "MISS"


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """An aligned text table: the first column left-aligned, the others right-aligned, ruled."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join([first, *rest])

    rule = "-" * len(line(header))
    return [rule, line(header), rule, *map(line, rows), rule]


def report(
    results: dict[str, Any],
    started: float,
    rank: int,
    table: Callable[[dict[str, Any]], str],
    json_path: str | None,
    chart: Callable[[dict[str, Any]], object] | None = None,
) -> None:
    """End a benchmark run on every rank: record its run time and load, and have rank 0 print
    ``table(results)`` (write every sample to ``json_path``, and draw ``chart(results)``, when
    given)."""
    import time

    dist.barrier()
    results["elapsed_s"] = time.perf_counter() - started
    results["load_after"] = os.getloadavg()
    if rank == 0:
        print(table(results), flush=True)
        if json_path:
            write_json(json_path, results)
        if chart is not None:
            chart(results)
    dist.barrier()


def write_json(path: str, results: Any) -> None:
    """Write a benchmark's results (every sample included) to ``path``, as indented JSON."""
    with open(path, "w", encoding="utf-8") as out:
        json.dump(results, out, indent=2)
        out.write("\n")


# ---------------------------------------------------------------- charts

DOCS_IMAGES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "images"
)


def add_chart_options(parser: argparse.ArgumentParser, docs_name: str) -> None:
    """``--plot PATH`` and ``--docs`` (the chart at ``docs/images/<docs_name>``)."""
    parser.add_argument(
        "--plot",
        metavar="PATH",
        default=None,
        help="also draw the results as a PNG chart here (needs matplotlib: "
        "pip install 'hora[plot]')",
    )
    parser.add_argument(
        "--docs",
        action="store_true",
        help=f"draw the chart the documentation shows: --plot docs/images/{docs_name}",
    )


def chart_path(args: argparse.Namespace, docs_name: str) -> str | None:
    """Where the chart goes: ``--plot``, else ``docs/images/<docs_name>`` under ``--docs``
    (absolute, so that workers started elsewhere write the same file), or ``None``."""
    if args.plot:
        return os.path.abspath(args.plot)
    return os.path.join(DOCS_IMAGES, docs_name) if args.docs else None


def run_facts() -> dict[str, str]:
    """When and where a benchmark ran, for its chart's caption: the date (UTC) and the
    machine (CPU model and count, operating system, Python)."""
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": (
            f"{os.cpu_count()} CPUs ({cpu_model()}), {platform.system()} "
            f"{platform.release()}, Python {platform.python_version()}"
        ),
    }


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it (or the platform's word for it)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
