"""Training throughput: one process, PyTorch DDP and hora, side by side in one job.

Run it with::

    .venv/bin/horarun -np 2 .venv/bin/python benchmarks/training.py [--json results.json]

or let it start the job itself (through ``horarun``, 2 workers unless ``--np`` says otherwise)::

    .venv/bin/python benchmarks/training.py [--models mlp resnet transformer] [--iters N]
        [--batch-size B] [--np N] [--device cpu|cuda] [--json results.json]

Three reference models train on synthetic data (a fixed random batch per rank, the same on every
run): an MLP on 784-dim inputs, a small ResNet on 3x32x32 images and a small transformer encoder
classifier on token sequences. For each model, every worker builds three copies from the same
seed, each with plain SGD with momentum, and trains them in three modes:

1. single: rank 0 trains alone, the other ranks wait at a barrier;
2. DDP: ``torch.nn.parallel.DistributedDataParallel`` over torch.distributed's default group on
   Gloo (rendezvousing in the job's store under its own key prefix), default buckets,
   ``forward_sync_buffers=False`` (hora does not synchronise buffers in forward either);
3. hora: ``hvd.DistributedOptimizer`` with ``named_parameters`` (one allreduce per parameter,
   fused by the engine, as in Horovod; ``--hora-groups N`` passes ``groups=N`` instead).

Every process uses one intra-op thread (``torch.set_num_threads(1)``), the single-process mode
included, so that the scaling efficiency ``total / (np * single)`` compares like with like on a
machine with one core per worker. The per-worker batch is the same in every mode.

A training step (``zero_grad``, forward, loss, backward, ``step``) is timed on every rank; a
step's time is that of the slowest rank, and throughputs come from the median step time:
``batch / median`` for one process, ``np * batch / median`` for DDP and hora. Steps are timed in
blocks that start with a barrier and one untimed step; the modes' blocks alternate (single, hora,
DDP, DDP, hora, single, ...) so that drift in the machine's load hits all alike. Goal: hora's
throughput >= 1.05x DDP's; with ``--np 1``, on the CPU or a GPU, it is what hora's
``DistributedOptimizer`` costs the loop: hora's throughput >= 0.98x the single mode's (an
overhead of at most 2%). Rank 0 prints the table, with a breakdown of rank 0's median step into
forward, backward and ``step()``; ``--json PATH`` also writes every sample there. The spread of
the ratio within the run is that of its pairs of adjacent hora and DDP blocks (each block's
median step, slowest rank). ``--plot PATH`` draws the ratios as a bar chart, with that spread
as error bars; ``--docs`` draws docs/images/training_vs_ddp.png (see charts.py).

``--device cuda`` trains on GPUs instead (the default is ``--device cpu``, as above): each worker
uses GPU ``local_rank % device_count`` for its models and batches, the single-process mode
included. Forward, backward and ``step()`` each end with ``torch.cuda.synchronize()``, so a
step's time covers the GPU's work. It starts one worker per visible GPU unless ``--np`` says
otherwise, and compares what the workers' GPUs allow:

- one GPU per worker (``--np 1`` included): DDP over a default group on NCCL
  (``device_ids=[gpu]``; the CPU tensors of the timing gather go over Gloo) and hora over its
  NCCL data path (``HORA_GPU_OPERATIONS=nccl`` unless the environment sets it). Goal: hora's
  throughput >= 1.0x DDP's;
- more workers than GPUs (say ``--np 2`` on one GPU): NCCL cannot put two ranks on one GPU, so
  DDP runs over Gloo, which stages CUDA tensors through host memory, and hora sends them through
  host memory too (it finds the shared GPU itself). Goal: hora's throughput >= 1.0x DDP's.

The report names the data path that hora's CUDA tensors took. Without a CUDA GPU it says why and
exits with status 2::

    .venv/bin/python benchmarks/training.py --device cuda [--models ...] [--np N]

``--compile`` compiles each mode's model with ``torch.compile`` (``--compile-mode`` picks the mode,
``default`` unless it says ``max-autotune-no-cudagraphs``, ...): the single model and hora's
model as they are (``DistributedOptimizer`` reduces the gradients that the compiled backward
gives), DDP as ``torch.compile(DistributedDataParallel(model))`` (DDP's own recipe, whose graph is
split at its buckets so that their allreduces overlap the backward pass). Goal: hora's
throughput >= 1.1x DDP's, each compiled. Each mode's model is an instance of a subclass of its
own (Dynamo would otherwise run one graph for all three, see ``own_class``), and each worker
compiles a small layer first (imports and Inductor's start, once a process). The report adds
each mode's compile time (its first step less its median step, slowest rank; each mode's first
step starts from empty compile caches, so that it compiles from scratch) and the graph breaks
``torch._dynamo.explain`` counts in DDP's and hora's training step (zero_grad, forward, loss,
backward, step)::

    .venv/bin/python benchmarks/training.py --compile [--compile-mode MODE] [--models ...]
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as _dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import hora.torch as hvd
from hora.common import basics
from hora.common.vocabulary.config import Settings

# The benchmarks' shared helpers live beside this file.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import charts
import harness

GOAL = 1.05  # hora throughput / DDP throughput
COMPILED_GOAL = 1.1  # the same, each compiled (--compile)
GOALS = {"cpu": GOAL, "cuda": 1.0}  # the same, by --device
# With one worker: hora samples/s / single-process samples/s (hora's overhead at most 2%).
ALONE_GOAL = 0.98
RAW_PREFIX = "raw-train-bench/"
CHART = "training_vs_ddp.png"  # under docs/images/ with --docs
SEED = 1234
LEARNING_RATE = 0.01
MOMENTUM = 0.9
CLASSES = 10
MODES = ("single", "ddp", "hora")
# Blocks run in this order, then in reverse, and so on (see Alternation).
BLOCK_ORDER = ("single", "hora", "ddp")

# torch.distributed's stubs omit the stores (as in hora.common.transport.gloo).
dist: Any = _dist
# DDP's switch for its buffer broadcast before each forward: ``forward_sync_buffers`` in newer
# PyTorch releases, ``broadcast_buffers`` before them.
NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)

# One training step; returns (forward, backward, optimizer step) seconds on this rank.
Step = Callable[[], tuple[float, float, float]]


# ---------------------------------------------------------------- models


class MLP(nn.Module):
    """784 -> 1024 -> 1024 -> 10: few, large gradients (1.9 M parameters in 6 tensors)."""

    def __init__(self, inputs: int = 784, hidden: int = 1024) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(inputs, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A ResNet-8 for 3x32x32 images: compute-bound, many small gradients (78 K in 29 tensors)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.blocks = nn.Sequential(
            BasicBlock(width, width, 1),
            BasicBlock(width, 2 * width, 2),
            BasicBlock(2 * width, 4 * width, 2),
        )
        self.head = nn.Linear(4 * width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(features, 1).flatten(1))


class ResNet18(nn.Module):
    """ResNet-18's layout (64 to 512 channels, two blocks a stage) for 3x32x32 images: 11.2 M
    parameters in 62 tensors."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        stages: list[nn.Module] = []
        cin = width
        for stage in range(4):
            cout = width << stage
            stages += [BasicBlock(cin, cout, 1 if stage == 0 else 2), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*stages)
        self.head = nn.Linear(cin, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(features, 1).flatten(1))


class TinyTransformer(nn.Module):
    """Two encoder layers (d=128, 4 heads) over 32 tokens, mean-pooled: 530 K in 28 tensors."""

    def __init__(
        self, vocab: int = 1000, length: int = 32, width: int = 128, heads: int = 4, layers: int = 2
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(length, width))
        layer = nn.TransformerEncoderLayer(
            width, nhead=heads, dim_feedforward=4 * width, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embedding(tokens) + self.position)
        return self.head(hidden.mean(dim=1))


class DeepMLP(nn.Module):
    """784 -> 576 x 29 -> 10: a 10 M-parameter model in 60 tensors (9.8 M parameters)."""

    def __init__(self, inputs: int = 784, hidden: int = 576, layers: int = 30) -> None:
        super().__init__()
        widths = [inputs] + [hidden] * (layers - 1)
        modules: list[nn.Module] = []
        for cin, cout in zip(widths, widths[1:]):
            modules += [nn.Linear(cin, cout), nn.ReLU()]
        modules.append(nn.Linear(hidden, CLASSES))
        self.net = nn.Sequential(*modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass(frozen=True)
class ModelSpec:
    """A reference model, how to make a synthetic batch for it, and its batch per worker
    (unless ``--batch-size`` says otherwise)."""

    name: str
    build: Callable[[], nn.Module]
    make_inputs: Callable[[int, torch.Generator], torch.Tensor]
    batch_size: int = 32


def batch_label(batch_size: int | None) -> str:
    """How a report names the batch: ``--batch-size``'s, or each model's own."""
    return f"batch {batch_size} per worker" if batch_size else "each model's batch per worker"


def _tokens(length: int) -> Callable[[int, torch.Generator], torch.Tensor]:
    return lambda n, g: torch.randint(0, 1000, (n, length), generator=g)


MODELS = {
    "mlp": ModelSpec("mlp", MLP, lambda n, g: torch.randn(n, 784, generator=g)),
    "resnet": ModelSpec("resnet", SmallResNet, lambda n, g: torch.randn(n, 3, 32, 32, generator=g)),
    "transformer": ModelSpec("transformer", TinyTransformer, _tokens(32)),
    "mlp-10m": ModelSpec("mlp-10m", DeepMLP, lambda n, g: torch.randn(n, 784, generator=g)),
    # Five encoder layers (d=384, 6 heads) over 16 tokens: 9.3 M parameters in 64 tensors; a
    # batch of 8 keeps a step near 0.1 s on one core.
    "transformer-10m": ModelSpec(
        "transformer-10m",
        lambda: TinyTransformer(length=16, width=384, heads=6, layers=5),
        _tokens(16),
        batch_size=8,
    ),
    # A batch of 4 keeps a step near 0.1 s on one core.
    "resnet-18": ModelSpec(
        "resnet-18", ResNet18, lambda n, g: torch.randn(n, 3, 32, 32, generator=g), batch_size=4
    ),
}


# ---------------------------------------------------------------- launching


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--np",
        type=int,
        default=None,
        help="workers to start when not run under horarun (default 2; with --device cuda, "
        "one per visible GPU)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="train on CPUs (DDP over Gloo) or on GPUs (DDP and hora over NCCL) (default cpu)",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=list(MODELS),
        default=list(MODELS),
        help="models to train (default: all)",
    )
    parser.add_argument(
        "--iters", type=int, default=200, help="timed steps per model and mode (default 200)"
    )
    parser.add_argument(
        "--warmup", type=int, default=5, help="untimed steps per model and mode (default 5)"
    )
    parser.add_argument(
        "--block", type=int, default=10, help="timed steps per alternation block (default 10)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="samples per worker and step (default: each model's own, 32; 8 for transformer-10m)",
    )
    parser.add_argument(
        "--hora-groups",
        type=int,
        default=0,
        metavar="N",
        help="DistributedOptimizer(groups=N): reduce the gradients as N grouped allreduces "
        "(default 0: one allreduce per parameter, Horovod's default)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile every mode's model with torch.compile (DDP: the DDP module)",
    )
    parser.add_argument(
        "--compile-mode",
        default="default",
        help="torch.compile's mode with --compile (default, max-autotune-no-cudagraphs, ...)",
    )
    parser.add_argument("--json", metavar="PATH", default=None, help="also write results here")
    harness.add_chart_options(parser, CHART)
    args = parser.parse_args(argv)
    for name in ("iters", "block", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.hora_groups < 0:
        parser.error("--warmup and --hora-groups must not be negative")
    if args.np is None:
        cuda = args.device == "cuda" and torch.cuda.is_available()
        args.np = torch.cuda.device_count() if cuda else 2
    return args


def relaunch(args: argparse.Namespace) -> int:
    """Start this script on ``args.np`` workers through horarun and return its exit status."""
    forwarded = ["--models", *args.models, "--iters", str(args.iters)]
    forwarded += ["--warmup", str(args.warmup), "--block", str(args.block)]
    forwarded += ["--hora-groups", str(args.hora_groups), "--device", args.device]
    if args.batch_size is not None:
        forwarded += ["--batch-size", str(args.batch_size)]
    if args.compile:
        forwarded += ["--compile", "--compile-mode", args.compile_mode]
    if args.json:
        forwarded += ["--json", os.path.abspath(args.json)]
    chart = harness.chart_path(args, CHART)
    if chart:
        forwarded += ["--plot", chart]
    return harness.relaunch(__file__, args.np, forwarded)


def init_raw_group(rank: int, size: int, device: torch.device, shared: bool = False) -> None:
    """The default group DDP runs on: Gloo, or, on a GPU of its own, NCCL (bound to
    ``device``). Workers that share a GPU (``shared``) use Gloo, which stages CUDA tensors
    through host memory."""
    if device.type == "cuda" and not shared:
        harness.init_raw_group(
            rank, size, RAW_PREFIX, 300, backend=harness.NCCL_BACKEND, device_id=device
        )
    else:
        harness.init_raw_group(rank, size, RAW_PREFIX, timeout_s=300)


def no_sync() -> None:
    """A CPU step's parts end when their calls return."""


def device_sync(device: torch.device) -> Callable[[], None]:
    """What ends a timed part of a step on ``device``: waiting for the GPU, or nothing."""
    return torch.cuda.synchronize if device.type == "cuda" else no_sync


# ---------------------------------------------------------------- training


def make_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    sync: Callable[[], None] = no_sync,
) -> Step:
    """One training step on a fixed batch, timed in its three parts (each ends with ``sync``)."""

    def step() -> tuple[float, float, float]:
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), labels)
        sync()
        forward_end = time.perf_counter()
        loss.backward()
        sync()
        backward_end = time.perf_counter()
        optimizer.step()
        sync()
        end = time.perf_counter()
        return forward_end - start, backward_end - forward_end, end - backward_end

    return step


def make_plain_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, labels: torch.Tensor
) -> Callable[[], None]:
    """The same training step without its timers (what ``torch._dynamo.explain`` looks at)."""

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()

    return step


def hora_step(spec: ModelSpec, batch_size: int | None = None) -> Callable[[], float]:
    """A hora-trained copy of ``spec``'s model (as in the hora mode) and its timed step.

    For other benchmarks of hora's training path: returns a function that runs one step (of
    ``batch_size`` samples, the model's own batch by default) and returns its duration in
    seconds.
    """
    batch_size = batch_size or spec.batch_size
    torch.manual_seed(SEED)
    model = spec.build()
    optimizer = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    generator = torch.Generator().manual_seed(SEED + 1 + hvd.rank())
    inputs = spec.make_inputs(batch_size, generator)
    labels = torch.randint(0, CLASSES, (batch_size,), generator=generator)

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        return time.perf_counter() - start

    return step


@dataclass
class Mode:
    """A way of training one model: the step this rank runs (``None``: it sits this mode out)."""

    name: str
    step: Step | None
    workers: int
    module: nn.Module
    totals: list[float] = field(default_factory=list)
    phases: list[tuple[float, float, float]] = field(default_factory=list)
    # The step without timers (None: this rank sits the mode out), and its first step's time.
    plain: Callable[[], None] | None = None
    first_s: float = 0.0


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)


def no_compile(module: nn.Module) -> nn.Module:
    return module


def build_modes(
    spec: ModelSpec,
    batch_size: int,
    rank: int,
    size: int,
    hora_groups: int = 0,
    device: torch.device | None = None,
    compiler: Callable[[nn.Module], nn.Module] = no_compile,
) -> tuple[dict[str, Mode], nn.Module]:
    """The three modes of one model, each on its own copy of the same seeded initialisation, on
    ``device`` (the CPU by default); ``compiler`` makes what each mode runs of its model (the
    model itself, or ``torch.compile``'s module for ``--compile``; DDP's wraps the DDP module).

    Returns:
        (modes by name, the bare module that DDP wraps).
    """
    device = device or torch.device("cpu")
    copies = []
    for _ in MODES:
        torch.manual_seed(SEED)
        copies.append(spec.build().to(device))
    if compiler is not no_compile:
        copies = [own_class(copy, name) for copy, name in zip(copies, MODES)]
    single_model, ddp_module, hora_model = copies
    # The batch is drawn on the CPU, so that every device trains on the same data.
    generator = torch.Generator().manual_seed(SEED + 1 + rank)
    inputs = spec.make_inputs(batch_size, generator).to(device)
    labels = torch.randint(0, CLASSES, (batch_size,), generator=generator).to(device)
    sync = device_sync(device)

    # Buffers (BatchNorm statistics) stay rank-local after the initial sync, as with hora.
    device_ids = [device.index] if device.type == "cuda" else None
    ddp_model = DistributedDataParallel(ddp_module, device_ids=device_ids, **NO_BUFFER_SYNC)
    optimizer = hvd.DistributedOptimizer(
        sgd(hora_model),
        named_parameters=hora_model.named_parameters(),
        groups=hora_groups or None,
    )
    hvd.broadcast_parameters(hora_model.state_dict(), root_rank=0)
    trained = {
        "single": (compiler(single_model), sgd(single_model), 1, single_model),
        "ddp": (compiler(ddp_model), sgd(ddp_model), size, ddp_module),
        "hora": (compiler(hora_model), optimizer, size, hora_model),
    }
    modes = {}
    for name, (runs, optim, workers, module) in trained.items():
        if name == "single" and rank != 0:
            modes[name] = Mode(name, None, workers, module)
            continue
        step = make_step(runs, optim, inputs, labels, sync)
        plain = make_plain_step(runs, optim, inputs, labels)
        modes[name] = Mode(name, step, workers, module, plain=plain)
    return modes, ddp_module


# ---------------------------------------------------------------- timing


def run_block(mode: Mode, count: int) -> None:
    """Time ``count`` back-to-back steps of ``mode`` on this rank, after a barrier and a lead-in.

    The barrier lines the ranks up; one untimed step absorbs the skew with which ranks leave it
    and, for hora, wakes a parked engine. A rank that sits the mode out records zeros.
    """
    dist.barrier()
    if mode.step is None:
        mode.totals.extend([0.0] * count)
        mode.phases.extend([(0.0, 0.0, 0.0)] * count)
        return
    mode.step()
    for _ in range(count):
        start = time.perf_counter()
        phases = mode.step()
        mode.totals.append(time.perf_counter() - start)
        mode.phases.append(phases)


@dataclass(frozen=True)
class Alternation:
    """Times several modes against each other in alternating blocks.

    Blocks run in the order A, B, C, C, B, A, ... so that drift in the machine's load falls on all
    alike. Before any block that is not hora's, hora's engine gets ``settle_s`` to park, so that
    its idle cycles do not compete with the other mode for the CPU. With ``fresh_caches``, each
    mode's first step (where a compiled model compiles) starts from empty compile caches.
    """

    settle_s: float
    fresh_caches: bool = False

    def run(self, modes: dict[str, Mode], reps: int, warmup: int, block: int) -> None:
        """Time each mode ``reps`` steps, in blocks of ``block``, after ``warmup`` untimed steps.

        Fills each mode's ``totals`` (this rank's) and ``phases``.
        """
        order = [modes[name] for name in BLOCK_ORDER]
        for mode in order:
            time.sleep(self.settle_s)
            dist.barrier()
            if mode.step is not None:
                for index in range(warmup):
                    caches = fresh_caches() if index == 0 and self.fresh_caches else nullcontext()
                    start = time.perf_counter()
                    with caches:
                        mode.step()
                    if index == 0:  # a compiled model compiles in its first step
                        mode.first_s = time.perf_counter() - start
        for mode in itertools.cycle([*order, *reversed(order)]):
            count = min(block, reps - len(mode.totals))
            if count > 0:
                if mode.name != "hora":
                    time.sleep(self.settle_s)
                run_block(mode, count)
            if all(len(m.totals) == reps for m in order):
                break


# ---------------------------------------------------------------- checks


def flat_parameters(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def ranks_agree(module: nn.Module) -> bool:
    """Whether every rank holds bitwise the same parameters."""
    mine = flat_parameters(module).double()
    high, low = mine.clone(), mine.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return bool(torch.equal(high, low))


# ---------------------------------------------------------------- benchmark


def bench_model(
    spec: ModelSpec,
    args: argparse.Namespace,
    timer: Alternation,
    rank: int,
    size: int,
    device: torch.device | None = None,
) -> dict[str, Any]:
    batch_size = args.batch_size or spec.batch_size
    device = device or torch.device("cpu")
    compiler = compiler_for(args.compile_mode) if args.compile else no_compile
    if args.compile:
        torch._dynamo.reset()  # the previous model's graphs, which count towards Dynamo's limit
    modes, ddp_module = build_modes(
        spec, batch_size, rank, size, args.hora_groups, device, compiler
    )
    timer.run(modes, args.iters, args.warmup, args.block)
    parameters = list(modes["hora"].module.parameters())
    row: dict[str, Any] = {
        "model": spec.name,
        "parameters": sum(p.numel() for p in parameters),
        "parameter_tensors": len(parameters),
        "gradient_bytes": sum(p.numel() * p.element_size() for p in parameters),
        "batch_size": batch_size,
    }
    for name in MODES:
        mode = modes[name]
        slowest = harness.slowest_rank(mode.totals)
        step_s = statistics.median(slowest)
        # Rank 0's median forward, backward and step() (rank 0 trains in every mode).
        breakdown = [statistics.median(column) for column in zip(*mode.phases)]
        row[name] = {
            "workers": mode.workers,
            "step_s": step_s,
            "samples_per_s": mode.workers * batch_size / step_s,
            "forward_s": breakdown[0],
            "backward_s": breakdown[1],
            "optimizer_step_s": breakdown[2],
            "step_samples_s": slowest,
            # The first step less a timed one: compiling, under --compile.
            "compile_s": max(harness.slowest_rank([mode.first_s])[0] - step_s, 0.0),
        }
    single = row["single"]["samples_per_s"]
    hora_rate, ddp_rate = row["hora"]["samples_per_s"], row["ddp"]["samples_per_s"]
    row["ratio"] = hora_rate / ddp_rate
    row["ratio_blocks"] = block_ratios(
        row["hora"]["step_samples_s"], row["ddp"]["step_samples_s"], args.block
    )
    row["hora_efficiency"] = hora_rate / (size * single)
    row["ddp_efficiency"] = ddp_rate / (size * single)
    if size == 1:
        row["goal"] = f"hora >= {ALONE_GOAL:g}x single"
        row["pass"] = row["hora_efficiency"] >= ALONE_GOAL
    else:
        goal = COMPILED_GOAL if args.compile else GOALS[device.type]
        row["goal"] = f"hora >= {goal:g}x DDP"
        row["pass"] = row["ratio"] >= goal
    # Both trained the same number of steps on the same data from the same start.
    hora_params = flat_parameters(modes["hora"].module)
    row["hora_vs_ddp_max_abs_diff"] = float((hora_params - flat_parameters(ddp_module)).abs().max())
    row["hora_ranks_agree"] = ranks_agree(modes["hora"].module)
    row["ddp_ranks_agree"] = ranks_agree(ddp_module)
    if args.compile:
        explained = {name: graph_breaks(modes[name]) for name in ("ddp", "hora")}
        row["graph_breaks"] = {name: len(reasons) for name, reasons in explained.items()}
        row["graph_break_reasons"] = explained
    return row


def own_class(module: nn.Module, mode: str) -> nn.Module:
    """``module``, made an instance of a subclass of its class of its own (for ``--compile``).

    Dynamo keeps the code it compiles for a module on the code of ``nn.Module.__call__``, and
    its guards check the module's class, not which module it is: without this, the second
    mode's model would run the graph compiled for the first (DDP's without the split at its
    buckets, and with no compile time of its own)."""
    base = type(module)
    attributes = {"__module__": base.__module__, "__qualname__": f"{base.__qualname__}.{mode}"}
    module.__class__ = type(base.__name__, (base,), attributes)
    return module


def warm_compiler(mode: str) -> None:
    """Compile and run a small layer once, before any mode's model compiles: importing Inductor
    and starting its compiler happen once a process, and would otherwise count towards the
    compile time of whichever mode compiles first on each rank."""
    layer = torch.compile(nn.Linear(4, 2), mode=mode)
    with fresh_caches():
        layer(torch.randn(3, 4)).sum().backward()


def fresh_caches() -> ContextManager[None]:
    """Inductor's caches, emptied (and a directory of their own), for one mode's compiling: the
    three modes compile the same model, and each one's compile time is its own."""
    from torch._inductor.utils import fresh_cache

    return fresh_cache()


def compiler_for(mode: str) -> Callable[[nn.Module], nn.Module]:
    """``torch.compile`` in ``mode``."""

    def compile_module(module: nn.Module) -> nn.Module:
        return torch.compile(module, mode=mode)  # type: ignore[return-value]

    return compile_module


def graph_breaks(mode: Mode) -> list[str]:
    """The graph breaks ``torch._dynamo.explain`` finds in one training step of ``mode`` (after
    the timed ones; every rank takes this step): the first line of each one's reason."""
    assert mode.plain is not None
    explanation = torch._dynamo.explain(mode.plain)()
    return [str(reason.reason).split("\n")[0] for reason in explanation.break_reasons]


def block_ratios(hora_steps: list[float], ddp_steps: list[float], block: int) -> list[float]:
    """hora's throughput over DDP's in each pair of blocks that ran one after the other:
    DDP's median step over hora's, block by block (the blocks alternate, see Alternation)."""
    starts = range(0, min(len(hora_steps), len(ddp_steps)), block)
    return [
        statistics.median(ddp_steps[i : i + block]) / statistics.median(hora_steps[i : i + block])
        for i in starts
    ]


# ---------------------------------------------------------------- report


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def format_table(results: dict[str, Any]) -> str:
    size = results["world_size"]
    header = (
        "model",
        "single samples/s",
        "DDP samples/s",
        "hora samples/s",
        "hora/DDP",
        "hora eff",
        "DDP eff",
        "goal",
        "result",
    )
    rows = [
        (
            r["model"],
            f"{r['single']['samples_per_s']:.0f}",
            f"{r['ddp']['samples_per_s']:.0f}",
            f"{r['hora']['samples_per_s']:.0f}",
            f"{r['ratio']:.3f}x",
            f"{r['hora_efficiency']:.0%}",
            f"{r['ddp_efficiency']:.0%}",
            r["goal"],
            harness.verdict(r["pass"]),
        )
        for r in results["models"]
    ]
    compiled = results.get("compile_mode")
    title = (
        f"{'compiled (' + compiled + ') ' if compiled else ''}"
        f"hora {results['hora_version']} ({results['hora_revision']}) vs PyTorch DDP "
        f"(torch {results['torch_version']}, {results['ddp_backend']}), {size} ranks, "
        f"{results['device_label']}"
        f"{batch_label(results['batch_size'])}, 1 thread per process; hora: cycle time {results['cycle_time_ms']:g} ms, "
        f"fusion threshold {results['fusion_threshold_bytes']} B, groups "
        f"{results['hora_groups'] or 'none'}; medians of {results['iters']} steps, slowest rank"
    )
    detail_header = (
        "model",
        "params",
        "tensors",
        "mode",
        "step ms",
        "fwd ms",
        "bwd ms",
        "opt.step ms",
    )
    detail: list[tuple[str, ...]] = []
    for r in results["models"]:
        for name in MODES:
            m = r[name]
            detail.append(
                (
                    r["model"] if name == MODES[0] else "",
                    f"{r['parameters']:,}" if name == MODES[0] else "",
                    str(r["parameter_tensors"]) if name == MODES[0] else "",
                    name,
                    ms(m["step_s"]),
                    ms(m["forward_s"]),
                    ms(m["backward_s"]),
                    ms(m["optimizer_step_s"]),
                )
            )
    checks = [
        f"{r['model']}: hora vs DDP parameters max |diff| {r['hora_vs_ddp_max_abs_diff']:.2e}, "
        f"ranks agree: hora {r['hora_ranks_agree']}, DDP {r['ddp_ranks_agree']}"
        for r in results["models"]
    ]
    notes = (
        f"samples/s: single = batch / median step, DDP and hora = {size} x batch / median step "
        f"(total); eff = total / ({size} x single)\n"
        f"run time {results['elapsed_s']:.1f} s on {results['cpus']} CPUs; load average "
        f"{results['load_before'][0]:.2f} before, {results['load_after'][0]:.2f} after"
    )
    spread = ", ".join(
        f"{r['model']} {min(r['ratio_blocks']):.2f}-{max(r['ratio_blocks']):.2f}x"
        for r in results["models"]
    )
    notes += f"\nhora/DDP of each pair of adjacent blocks, lowest-highest: {spread}"
    if compiled:
        notes += "\ncompile s (first step less median, slowest rank), graph breaks in a step: " + (
            "; ".join(
                f"{r['model']} single {r['single']['compile_s']:.1f}, "
                f"DDP {r['ddp']['compile_s']:.1f}, hora {r['hora']['compile_s']:.1f} s, "
                f"breaks DDP {r['graph_breaks']['ddp']}, hora {r['graph_breaks']['hora']}"
                for r in results["models"]
            )
        )
    passed = sum(r["pass"] for r in results["models"])
    summary = f"goals met: {passed}/{len(results['models'])}"
    lines = [title, *harness.table(header, rows)]
    lines += ["step time breakdown (step: slowest rank; fwd/bwd/opt.step: rank 0's medians)"]
    lines += harness.table(detail_header, detail)
    lines += [*checks, notes, summary]
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def worker_device(device_type: str) -> tuple[torch.device, bool]:
    """The device this worker trains on (the CPU, or its GPU), and whether other workers of
    this host train on that GPU too (call it after ``hvd.init()``)."""
    if device_type != "cuda":
        return torch.device("cpu"), False
    return harness.local_gpu(), hvd.local_size() > torch.cuda.device_count()


def device_label(device: torch.device, shared: bool, path: str | None) -> str:
    """How the report names the device (nothing on the CPU, as before ``--device``)."""
    if device.type != "cuda":
        return ""
    setting = os.environ.get("HORA_GPU_OPERATIONS", "default")
    workers = f"{hvd.local_size()} workers per GPU" if shared else "one worker per GPU"
    return (
        f"on {torch.cuda.get_device_name(device)} GPUs, {workers} (HORA_GPU_OPERATIONS={setting}"
        f", hora's CUDA tensors went through {path}), "
    )


def worker(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    load_before = os.getloadavg()
    torch.set_num_threads(1)
    if args.device == "cuda":
        # hora's NCCL data path for CUDA tensors, unless the environment picks another.
        os.environ.setdefault("HORA_GPU_OPERATIONS", "nccl")
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    device, shared = worker_device(args.device)
    init_raw_group(rank, size, device, shared)
    gpu_operations = os.environ.get("HORA_GPU_OPERATIONS") if device.type == "cuda" else None
    settings = Settings.from_env()
    if args.compile:
        warm_compiler(args.compile_mode)
    # Idle, hora's engine parks after a few cycles (about 5 ms at the default cycle time).
    timer = Alternation(
        settle_s=max(0.05, 10 * settings.cycle_time_ms / 1000), fresh_caches=args.compile
    )
    results: dict[str, Any] = {
        **harness.versions(rank == 0),
        **harness.run_facts(),
        "world_size": size,
        "cpus": os.cpu_count(),
        "threads_per_process": torch.get_num_threads(),
        "load_before": load_before,
        "cycle_time_ms": settings.cycle_time_ms,
        "fusion_threshold_bytes": settings.fusion_threshold_bytes,
        "batch_size": args.batch_size,
        "hora_groups": args.hora_groups,
        "compile_mode": args.compile_mode if args.compile else None,
        "iters": args.iters,
        "warmup": args.warmup,
        "block": args.block,
        "device": str(device),
        "shared_gpu": shared,
        "ddp_backend": "nccl" if device.type == "cuda" and not shared else "gloo",
        "hora_gpu_operations": gpu_operations,
        "goal": ALONE_GOAL if size == 1 else GOALS[device.type],
        "models": [
            bench_model(MODELS[name], args, timer, rank, size, device) for name in args.models
        ],
    }
    path = basics.gpu_data_path() if device.type == "cuda" else None
    results["hora_gpu_path"] = path
    results["device_label"] = device_label(device, shared, path)
    chart = harness.chart_path(args, CHART)
    draw = (lambda r: charts.training_vs_ddp(r, chart)) if chart else None
    harness.report(results, started, rank, format_table, args.json, draw)
    dist.destroy_process_group()
    hvd.shutdown()


def cuda_refusal(args: argparse.Namespace) -> str | None:
    """Why this ``--device cuda`` run cannot go ahead (``None``: it can)."""
    return harness.nccl_unavailable("--device cuda")


def main() -> int:
    args = parse_args()
    reason = cuda_refusal(args) if args.device == "cuda" else None
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    if "HORA_RANK" not in os.environ:
        return relaunch(args)
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
