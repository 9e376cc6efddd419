"""CUDA tensors through hora on real processes: collectives, DistributedOptimizer (with
torch.amp), SyncBatchNorm, NVTX ranges and the examples, over NCCL (``HORA_GPU_OPERATIONS=nccl``)
and through host memory (``host``).

Skipped where no GPU is visible. A host with fewer GPUs than ranks shares them round-robin
(ranks ``i`` and ``i + count`` on GPU ``i``), so one GPU runs the np=2 and np=3 jobs too; NCCL
cannot put two ranks on one GPU, so there the NCCL jobs check that hora sends CUDA tensors
through host memory instead (and says so). The np=1 job runs NCCL end to end on any GPU (a group
of one: its creation, stream ordering and completion polling); NCCL among several ranks, and
the secret proof over NCCL's connections (which a group of one skips), need a GPU per rank.

Training and SyncBatchNorm are checked twice: against the same computation on the GPU in one
process, and against it on the CPU in float32.

``.ci/gpu-check`` runs this file, with the GPU benchmarks, on a machine with a GPU.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from .jobs import run_job

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")

ROOT = Path(__file__).resolve().parents[2]
BATCH = 12
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8")


def _collectives(device: Any) -> dict[str, Any]:
    """Each collective on CUDA tensors: (result on the GPU, values right)."""
    import torch

    import hora.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    for name in DTYPES:
        dtype = getattr(torch, name)
        mine = (torch.arange(10) % 4 + rank).to(dtype)
        expected = sum((torch.arange(10) % 4 + r).to(torch.float64) for r in range(size))
        result = hvd.allreduce(mine.to(device), op=hvd.Sum, name=f"sum.{name}")
        out[f"allreduce_{name}"] = (result.is_cuda, torch.equal(result.cpu().double(), expected))
    mine = torch.full((5, 3), float(rank), device=device)
    average = hvd.allreduce(mine, name="average")
    out["average"] = (
        average.is_cuda,
        torch.allclose(average.cpu(), torch.full((5, 3), (size - 1) / 2)),
    )
    hvd.allreduce_(mine, op=hvd.Sum, name="in_place")
    out["in_place"] = (
        mine.is_cuda,
        torch.equal(mine.cpu(), torch.full((5, 3), float(sum(range(size))))),
    )
    parts = [torch.full((n,), float(rank + n), device=device) for n in (1, 7, 300)]
    grouped = hvd.grouped_allreduce(parts, op=hvd.Sum, name="grouped")
    out["grouped"] = (
        all(t.is_cuda for t in grouped),
        all(
            torch.equal(t.cpu(), torch.full((n,), float(sum(r + n for r in range(size)))))
            for t, n in zip(grouped, (1, 7, 300))
        ),
    )
    rows = torch.full((rank + 1, 2), rank, dtype=torch.int64, device=device)
    gathered = hvd.allgather(rows, name="gather")
    expected_rows = torch.cat([torch.full((r + 1, 2), r, dtype=torch.int64) for r in range(size)])
    out["allgather"] = (gathered.is_cuda, torch.equal(gathered.cpu(), expected_rows))
    value = torch.full((4,), float(rank), dtype=torch.float16, device=device)
    broadcast = hvd.broadcast(value, root_rank=size - 1, name="bcast")
    out["broadcast"] = (
        broadcast.is_cuda,
        torch.equal(broadcast.cpu(), torch.full((4,), float(size - 1), dtype=torch.float16)),
    )
    send = torch.arange(size * 2, dtype=torch.float32, device=device) + 100 * rank
    received, splits = hvd.alltoall(send, splits=[2] * size, name="a2a")
    expected_a2a = torch.cat(
        [torch.arange(2 * rank, 2 * rank + 2) + 100 * r for r in range(size)]
    ).float()
    out["alltoall"] = (
        received.is_cuda,
        torch.equal(received.cpu(), expected_a2a) and splits.tolist() == [2] * size,
    )
    scattered = hvd.reducescatter(torch.ones(size * 3, 2, device=device), op=hvd.Sum, name="rs")
    out["reducescatter"] = (
        scattered.is_cuda,
        torch.equal(scattered.cpu(), torch.full((3, 2), float(size))),
    )
    if size & (size - 1) == 0:
        # Orthogonal vectors are added by Adasum; equal ones are averaged.
        one_hot = torch.zeros(2 * size, device=device)
        one_hot[2 * rank] = 1.0
        summed = hvd.allreduce(one_hot, op=hvd.Adasum, name="adasum.orthogonal")
        equal = hvd.allreduce(torch.full((9,), 2.0, device=device), op=hvd.Adasum, name="adasum")
        out["adasum"] = (
            summed.is_cuda and equal.is_cuda,
            torch.equal(summed.cpu(), torch.tensor([1.0, 0.0] * size))
            and torch.equal(equal.cpu(), torch.full((9,), 2.0)),
        )
    else:
        try:
            hvd.allreduce(torch.ones(2, device=device), op=hvd.Adasum)
            out["adasum"] = (True, False)
        except NotImplementedError:
            out["adasum"] = (True, True)
    return out


def _side_stream(device: Any) -> dict[str, Any]:
    """A tensor written on a side stream, still queued there when it is submitted, and its
    result used on that stream.

    The GPU sleeps on the side stream before filling the tensor, which leaves the work queued
    while hora reads it; the values must be those written after the sleep.
    """
    import torch

    import hora.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        big = torch.zeros(1 << 20, device=device)
        torch.cuda._sleep(100_000_000)
        big.fill_(float(rank + 1))
        result = hvd.allreduce(big, op=hvd.Sum, name="side_stream")
        doubled = result * 2
    torch.cuda.synchronize(device)
    expected = 2.0 * sum(r + 1 for r in range(size))
    return {"side_stream": (doubled.is_cuda, bool((doubled == expected).all().item()))}


def _model(seed: int, device: Any) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 1),
    ).to(device)


def _train(
    device: Any, optimizer_name: str, steps: int, amp: bool = False, shard: int = 0
) -> dict[str, float]:
    """hora on N ranks against one process on the whole batch, both on the GPU; ``shard``: the
    ZeRO stage of hora's optimizer (1: ``shard_optimizer_state``, 2: and ``shard_gradients``).

    Returns the largest difference from the reference, and the largest difference between
    the ranks (which must be none: every rank applies the same averaged gradients).
    """
    import torch

    import hora.torch as hvd

    rank, size = hvd.rank(), hvd.size()

    def make(parameters: Any) -> Any:
        if optimizer_name == "adam":
            return torch.optim.Adam(parameters, lr=0.01)
        return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)

    model = _model(100 + rank, device)  # ranks start apart; the broadcast fixes that
    sharding = dict(shard_optimizer_state=True, shard_gradients=shard == 2) if shard else {}
    optimizer = hvd.DistributedOptimizer(
        make(model.parameters()), named_parameters=model.named_parameters(), **sharding
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    reference = _model(100, device)
    reference_optimizer = make(reference.parameters())
    # The same one-process loop on the CPU, in float32 throughout (no autocast, no scaler).
    on_cpu = _model(100, "cpu")
    on_cpu_optimizer = make(on_cpu.parameters())
    # A loss scale that overflows neither side: each rank scales its own slice's loss, whose
    # gradients are size times those of the whole batch's mean loss, so with the default
    # scale (65536) a rank can skip a step (inf) that the one-process reference takes.
    scaler = torch.amp.GradScaler("cuda", init_scale=256.0, enabled=amp)
    reference_scaler = torch.amp.GradScaler("cuda", init_scale=256.0, enabled=amp)
    data = torch.Generator().manual_seed(7)
    mine = slice(rank * (BATCH // size), (rank + 1) * (BATCH // size))
    for _ in range(steps):
        x = torch.randn(BATCH, 6, generator=data).to(device)
        y = torch.randn(BATCH, 1, generator=data).to(device)
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        on_cpu_optimizer.zero_grad()
        torch.nn.functional.mse_loss(on_cpu(x.cpu()), y.cpu()).backward()
        if amp:
            torch.nn.utils.clip_grad_norm_(on_cpu.parameters(), 1.0)
        on_cpu_optimizer.step()
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
            reference_loss = torch.nn.functional.mse_loss(reference(x), y)
        if amp:
            # Horovod's recipe for GradScaler: reduce, unscale, clip, then step without a
            # second synchronize.
            scaler.scale(loss).backward()
            optimizer.synchronize()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scaler.update()
            reference_scaler.scale(reference_loss).backward()
            reference_scaler.unscale_(reference_optimizer)
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            reference_scaler.step(reference_optimizer)
            reference_scaler.update()
        else:
            loss.backward()
            optimizer.step()
            reference_loss.backward()
            reference_optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every_rank = hvd.allgather(flat.unsqueeze(0), name=f"params.{optimizer_name}.{amp}.{shard}")
    return {
        "reference": max(
            (a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters())
        ),
        "cpu_reference": max(
            (a.cpu() - b).abs().max().item()
            for a, b in zip(model.parameters(), on_cpu.parameters())
        ),
        "ranks": (every_rank - flat).abs().max().item(),
        "on_gpu": float(all(p.is_cuda for p in model.parameters())),
    }


def _sparse(device: Any) -> dict[str, Any]:
    """A sparse embedding gradient on the GPU, averaged across ranks."""
    import torch

    import hora.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(3)
    embedding = torch.nn.Embedding(20, 4, sparse=True).to(device)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(embedding.parameters(), lr=1.0),
        named_parameters=embedding.named_parameters(),
    )
    before = embedding.weight.detach().clone()
    embedding(torch.tensor([rank, 10 + rank], device=device)).sum().backward()
    optimizer.step()
    changed = sorted(
        int(i) for i in ((embedding.weight - before).abs().sum(dim=1) > 0).nonzero().flatten()
    )
    step = (before - embedding.weight).detach()
    expected = sorted([r for r in range(size)] + [10 + r for r in range(size)])
    return {
        "sparse": (
            changed == expected,
            torch.allclose(step[changed], torch.full((len(changed), 4), 1.0 / size, device=device)),
        )
    }


def _sync_batch_norm(device: Any) -> dict[str, float]:
    """SyncBatchNorm on the GPU against torch.nn.BatchNorm2d on the concatenated batch."""
    import torch

    import hora.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    generator = torch.Generator().manual_seed(5)
    batches = [torch.randn(2 + r, 3, 4, 4, generator=generator) for r in range(size)]
    whole = torch.cat(batches).to(device).requires_grad_()
    reference = torch.nn.BatchNorm2d(3).to(device)
    expected = reference(whole)  # once: each training-mode call updates the running statistics
    expected.pow(2).sum().backward()
    layer = hvd.SyncBatchNorm(3).to(device)
    mine = batches[rank].to(device).requires_grad_()
    output = layer(mine)
    output.pow(2).sum().backward()
    start = sum(b.shape[0] for b in batches[:rank])
    ours = slice(start, start + batches[rank].shape[0])
    weight_grad = hvd.allreduce(layer.weight.grad, op=hvd.Sum, name="bn.weight_grad")
    # The same batch through torch.nn.BatchNorm2d on the CPU.
    whole_cpu = torch.cat(batches).detach().requires_grad_()
    on_cpu = torch.nn.BatchNorm2d(3)
    expected_cpu = on_cpu(whole_cpu)
    expected_cpu.pow(2).sum().backward()
    differences = {}
    for suffix, ref, out, grad in (
        ("", reference, expected, whole.grad),
        ("_cpu", on_cpu, expected_cpu, whole_cpu.grad),
    ):
        differences.update(
            {
                "output" + suffix: (output.cpu() - out[ours].cpu()).abs().max().item(),
                "input_grad" + suffix: (mine.grad.cpu() - grad[ours].cpu()).abs().max().item(),
                "weight_grad" + suffix: (weight_grad.cpu() - ref.weight.grad.cpu())
                .abs()
                .max()
                .item(),
                "running_mean" + suffix: (layer.running_mean.cpu() - ref.running_mean.cpu())
                .abs()
                .max()
                .item(),
                "running_var" + suffix: (layer.running_var.cpu() - ref.running_var.cpu())
                .abs()
                .max()
                .item(),
            }
        )
    return differences


def _cuda_worker() -> dict[str, Any]:
    import torch

    import hora.torch as hvd
    from hora.common import basics
    from hora.tools.synthetic_benchmark import pick_device

    hvd.init()
    device = pick_device(no_cuda=False)  # GPU local_rank % count, as the examples pick it
    out = _collectives(device)
    out["path"] = basics.gpu_data_path()
    out.update(_side_stream(device))
    out.update(_sparse(device))
    out["sgd"] = _train(device, "sgd", steps=4)
    # Enough steps for the engine to settle into its steady state (pipelined fused batches).
    out["sgd_steady"] = _train(device, "sgd", steps=40)
    out["adam"] = _train(device, "adam", steps=6)
    out["amp"] = _train(device, "sgd", steps=12, amp=True)
    # ZeRO: each rank keeps its shard of Adam's state (stage 1) and of the gradients (stage 2).
    out["zero1_adam"] = _train(device, "adam", steps=6, shard=1)
    out["zero2_adam"] = _train(device, "adam", steps=6, shard=2)
    torch.backends.cudnn.deterministic = True
    out["sync_batch_norm"] = _sync_batch_norm(device)
    hvd.shutdown()
    return out


@pytest.fixture(
    scope="module",
    params=[(1, "nccl"), (2, "nccl"), (3, "nccl"), (2, "host"), (3, "host")],
    ids=lambda p: f"np{p[0]}-{p[1]}",
)
def cuda_job(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    np, path = request.param
    results = run_job(_cuda_worker, np, env={"HORA_GPU_OPERATIONS": path}, timeout_s=150)
    own_gpus = torch.cuda.device_count() >= np and torch.distributed.is_nccl_available()
    expected = "nccl" if path == "nccl" and own_gpus else "host"
    for rank, observed in enumerate(results):
        assert observed["path"] == expected, f"rank {rank}: CUDA tensors took {observed['path']}"
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "case",
    [f"allreduce_{d}" for d in DTYPES]
    + ["average", "in_place", "grouped", "allgather", "broadcast", "alltoall", "reducescatter"]
    + ["adasum"],
)
def test_collectives_on_cuda_tensors(cuda_job: list[dict[str, Any]], case: str) -> None:
    for rank, observed in enumerate(cuda_job):
        on_gpu, right = observed[case]
        assert on_gpu, f"rank {rank}: {case} returned a tensor off the GPU"
        assert right, f"rank {rank}: {case} returned wrong values"


@pytest.mark.timeout(180)
def test_a_tensor_written_on_a_side_stream_is_reduced_with_its_final_values(
    cuda_job: list[dict[str, Any]],
) -> None:
    for rank, observed in enumerate(cuda_job):
        assert observed["side_stream"] == (True, True), f"rank {rank}: {observed['side_stream']}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("case", "tolerance", "cpu_tolerance"),
    # AMP computes in float16 where the CPU reference computes in float32.
    [
        ("sgd", 1e-5, 1e-4),
        ("sgd_steady", 1e-4, 1e-3),
        ("adam", 1e-5, 1e-4),
        ("amp", 5e-3, 5e-2),
        ("zero1_adam", 1e-5, 1e-4),
        ("zero2_adam", 1e-5, 1e-4),
    ],
)
def test_training_on_the_gpu_matches_one_process(
    cuda_job: list[dict[str, Any]], case: str, tolerance: float, cpu_tolerance: float
) -> None:
    for rank, observed in enumerate(cuda_job):
        result = observed[case]
        assert result["on_gpu"] == 1.0
        assert result["ranks"] == 0.0, f"rank {rank}: ranks differ by {result['ranks']} ({case})"
        assert result["reference"] < tolerance, f"rank {rank}: {case} differs by {result}"
        assert result["cpu_reference"] < cpu_tolerance, (
            f"rank {rank}: {case} differs from the CPU by {result}"
        )


@pytest.mark.timeout(180)
def test_sparse_gradients_on_the_gpu(cuda_job: list[dict[str, Any]]) -> None:
    for rank, observed in enumerate(cuda_job):
        assert observed["sparse"] == (True, True), f"rank {rank}: {observed['sparse']}"


@pytest.mark.timeout(180)
def test_sync_batch_norm_on_the_gpu(cuda_job: list[dict[str, Any]]) -> None:
    for rank, observed in enumerate(cuda_job):
        for quantity, difference in observed["sync_batch_norm"].items():
            assert difference < 1e-4, f"rank {rank}: {quantity} differs by {difference}"


def _nvtx_worker() -> dict[str, Any]:
    """With ``HORA_ENABLE_NVTX=1``: the ranges hora opened through ``torch.cuda.nvtx``.

    ``torch.cuda.nvtx``'s functions are wrapped before ``hvd.init()`` so that each call is
    recorded and then made: hora's ranges reach NVTX, as ``nsys`` would see them.
    """
    import torch
    import torch.cuda.nvtx as nvtx

    import hora.torch as hvd
    from hora.common.engine.tracing import nvtx_ranges
    from hora.tools.synthetic_benchmark import pick_device

    names: list[str] = []
    real_push, real_start = nvtx.range_push, nvtx.range_start

    def push(name: str) -> Any:
        names.append(name)
        return real_push(name)

    def start(name: str) -> Any:
        names.append(name)
        return real_start(name)

    nvtx.range_push, nvtx.range_start = push, start  # type: ignore[assignment]
    hvd.init()
    device = pick_device(no_cuda=False)
    on_gpu = hvd.allreduce(torch.ones(1000, device=device), op=hvd.Sum, name="nvtx.gpu")
    hvd.allgather(torch.ones(3, device=device), name="nvtx.gather")
    hvd.allreduce(torch.ones(10), op=hvd.Sum, name="nvtx.cpu")
    torch.cuda.synchronize(device)
    right = bool((on_gpu == hvd.size()).all().item())
    hvd.shutdown()
    return {"available": nvtx_ranges() is not None, "names": sorted(set(names)), "right": right}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np", [1, 2])
def test_nvtx_ranges_reach_torch_cuda_nvtx(np: int) -> None:
    from hora.common.engine.tracing import RANGE_PREFIX

    results = run_job(_nvtx_worker, np, env={"HORA_ENABLE_NVTX": "1"}, timeout_s=120)
    for rank, observed in enumerate(results):
        assert observed["available"] and observed["right"], f"rank {rank}: {observed}"
        expected = {RANGE_PREFIX + phase for phase in ("NEGOTIATE", "ALLREDUCE", "ALLGATHER")}
        assert expected <= set(observed["names"]), f"rank {rank}: {observed['names']}"


def _horarun(*command: str) -> str:
    full = [sys.executable, "-m", "hora.runner.launch", "-np", "2", sys.executable, *command]
    result = subprocess.run(full, capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert result.returncode == 0, f"{full}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


@pytest.mark.timeout(180)
def test_digits_example_trains_on_the_gpu() -> None:
    output = _horarun("examples/pytorch_digits.py", "--no-progress", "--epochs", "6")
    assert "training on 2 worker(s) (cuda)" in output, output
    final = re.search(r"final test accuracy: (\d\.\d+)", output)
    assert final is not None and float(final.group(1)) >= 0.9, output


@pytest.mark.timeout(180)
def test_synthetic_benchmark_runs_on_the_gpu() -> None:
    output = _horarun(
        "examples/pytorch_synthetic_benchmark.py",
        "--model",
        "resnet",
        "--num-iters",
        "2",
        "--num-batches-per-iter",
        "4",
    )
    assert "Device of rank 0: cuda:0" in output, output
    assert re.search(r"Total img/sec on 2 worker\(s\): \d", output), output
