"""What the benchmarks share: starting themselves through horarun, the raw torch.distributed
peer group beside hora, the slowest rank's timings, and the report's small helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
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
) -> None:
    """End a benchmark run on every rank: record its run time and load, and have rank 0 print
    ``table(results)`` (and write every sample to ``json_path``, when given)."""
    import time

    dist.barrier()
    results["elapsed_s"] = time.perf_counter() - started
    results["load_after"] = os.getloadavg()
    if rank == 0:
        print(table(results), flush=True)
        if json_path:
            write_json(json_path, results)
    dist.barrier()


def write_json(path: str, results: Any) -> None:
    """Write a benchmark's results (every sample included) to ``path``, as indented JSON."""
    with open(path, "w", encoding="utf-8") as out:
        json.dump(results, out, indent=2)
        out.write("\n")
