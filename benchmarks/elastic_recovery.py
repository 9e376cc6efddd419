"""Recovery time after a worker's death: elastic hora against torchrun's restart, at np=3.

Run it with::

    .venv/bin/python benchmarks/elastic_recovery.py [--repeats 3] [--json results.json]

Both jobs train the same MLP on synthetic data on 3 workers, keep their state every
``COMMIT_EVERY`` steps, and lose the worker of rank 2 to a ``SIGKILL`` it sends itself at step
``KILL_AT`` of the first attempt:

1. hora: ``horarun --host-discovery-script`` with three loopback "hosts" (127.0.0.1-3, one slot
   each) and ``--min-np 2``; the script uses ``hvd.elastic.run`` with a ``TorchState`` committed
   in memory. The two survivors roll back to the last commit and go on as a job of two.
2. torchrun: ``torchrun --standalone --nproc-per-node 3 --max-restarts 1`` with PyTorch DDP;
   rank 0 saves a checkpoint file every ``COMMIT_EVERY`` steps (the recovery model torchrun and
   Ray Train offer: every worker is restarted and loads the checkpoint). It goes on with 3.

Every worker appends ``time event`` lines to a shared file. The recovery time is from the
``killed`` line to the first step completed by the recovered job (hora's next round,
torchrun's next attempt), by any worker; the table shows medians
and the ratio hora/torchrun (goal: at most 1.0x, in-process recovery should beat a restart).
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

import hora

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness

GOAL = 1.0
NP = 3
STEPS = 40
KILL_AT = 20
COMMIT_EVERY = 5
BATCH = 32
HIDDEN = 256
HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]


def _log(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(f"{time.time():.6f} {text}\n")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 10)
    )


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(BATCH, 64, generator=generator)
    return x, torch.randint(0, 10, (BATCH,), generator=generator)


def hora_worker(events: str) -> None:
    import hora.torch as hvd
    from hora.common.job import rounds as protocol

    torch.set_num_threads(1)
    hvd.init()
    model = _model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)

    @hvd.elastic.run
    def train(state: Any) -> None:
        while state.step < STEPS:
            first_round = protocol.progress.plan is not None and protocol.progress.plan.number == 0
            if state.step == KILL_AT and hvd.rank() == NP - 1 and first_round:
                _log(events, "killed")
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = _batch(state.step, hvd.rank())
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            state.step += 1
            attempt = protocol.progress.plan.number if protocol.progress.plan else 0
            _log(events, f"step {state.step} size {hvd.size()} attempt {attempt}")
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    train(state)
    hvd.shutdown()


def torch_worker(events: str, checkpoint: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # Each attempt rendezvouses under its own prefix of torchrun's store: with the default
    # env:// rendezvous a restarted group finds the dead attempt's addresses and hangs.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"attempt{restart}/", store), rank=rank, world_size=size
    )
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    if os.path.exists(checkpoint):
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
    ddp = DistributedDataParallel(model)
    while step < STEPS:
        if step == KILL_AT and rank == NP - 1 and restart == 0:
            _log(events, "killed")
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = _batch(step, rank)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        step += 1
        _log(events, f"step {step} size {dist.get_world_size()} attempt {restart}")
        if step % COMMIT_EVERY == 0 and rank == 0:
            tmp = checkpoint + ".tmp"
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                tmp,
            )
            os.replace(tmp, checkpoint)
    dist.barrier()
    dist.destroy_process_group()
    del store


def _env() -> dict[str, str]:
    prefixes = ("HORA_", "HOROVOD_", "TORCHELASTIC_", "OMPI_", "PMI_", "SLURM_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(hora.__file__)))
    return env


def run_once(kind: str, workdir: str) -> dict[str, float]:
    """Run one job; returns its recovery time and how long the whole job took."""
    events = os.path.join(workdir, f"{kind}-events.txt")
    for path in (events, os.path.join(workdir, "checkpoint.pt")):
        if os.path.exists(path):
            os.remove(path)
    me = os.path.abspath(__file__)
    if kind == "hora":
        discover = os.path.join(workdir, "discover.sh")
        with open(discover, "w") as f:
            f.write("#!/bin/sh\n" + "".join(f"echo {h}\n" for h in HOSTS))
        os.chmod(discover, 0o755)
        command = [sys.executable, "-m", "hora.runner.launch", "-np", str(NP), "--min-np", "2"]
        command += ["--host-discovery-script", discover]
        command += [sys.executable, me, "--worker", "hora", "--events", events]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", str(NP), "--max-restarts", "1", "--monitor-interval", "0.1"]
        command += [me, "--worker", "torch", "--events", events]
        command += ["--checkpoint", os.path.join(workdir, "checkpoint.pt")]
    started = time.time()
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
    finished = time.time()
    if done.returncode != 0:
        raise RuntimeError(
            f"{kind} job failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
    with open(events) as f:
        lines = [line.split(" ", 1) for line in f.read().splitlines()]
    killed = [float(t) for t, what in lines if what == "killed"]
    if len(killed) != 1:
        raise RuntimeError(f"{kind}: expected one kill, the events say {len(killed)}")
    # The first step of the recovered job (hora's next round, torchrun's next attempt).
    after = [float(t) for t, what in lines if what.startswith("step") and not what.endswith(" 0")]
    return {"recovery_s": min(after) - killed[0], "job_s": finished - started}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="jobs per launcher (default 3)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write results here")
    parser.add_argument("--worker", choices=["hora", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--events", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "hora":
        hora_worker(args.events)
        return 0
    if args.worker == "torch":
        torch_worker(args.events, args.checkpoint)
        return 0
    load_before = os.getloadavg()
    samples: dict[str, list[dict[str, float]]] = {"hora": [], "torchrun": []}
    with tempfile.TemporaryDirectory() as workdir:
        for _ in range(args.repeats):
            for kind in ("hora", "torchrun"):
                samples[kind].append(run_once(kind, workdir))
    medians = {
        kind: {key: statistics.median(s[key] for s in runs) for key in ("recovery_s", "job_s")}
        for kind, runs in samples.items()
    }
    ratio = medians["hora"]["recovery_s"] / medians["torchrun"]["recovery_s"]
    header = ("np=3, rank 2 killed at step 20", "hora (elastic)", "torchrun (restart)", "ratio")
    rows = [
        (
            "recovery: kill -> next step",
            f"{medians['hora']['recovery_s'] * 1000:.0f} ms",
            f"{medians['torchrun']['recovery_s'] * 1000:.0f} ms",
            f"{ratio:.2f}x",
        ),
        (
            "whole job (40 steps)",
            f"{medians['hora']['job_s']:.2f} s",
            f"{medians['torchrun']['job_s']:.2f} s",
            f"{medians['hora']['job_s'] / medians['torchrun']['job_s']:.2f}x",
        ),
    ]
    print(
        f"hora {hora.__version__} ({harness.source_revision()}) elastic recovery vs torchrun "
        f"(torch {torch.__version__}), {args.repeats} jobs each; medians"
    )
    print("\n".join(harness.table(header, rows)))
    print(
        "hora recovery samples: "
        + ", ".join(f"{s['recovery_s'] * 1000:.0f} ms" for s in samples["hora"])
    )
    print(
        "torchrun recovery samples: "
        + ", ".join(f"{s['recovery_s'] * 1000:.0f} ms" for s in samples["torchrun"])
    )
    print(f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(f"goal hora/torchrun <= {GOAL:.1f}x: {harness.verdict(ratio <= GOAL)}")
    if args.json:
        results = {
            "hora_version": hora.__version__,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "samples": samples,
            "medians": medians,
            "ratio": ratio,
        }
        harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
