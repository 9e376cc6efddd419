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

Every worker appends ``time event key value ...`` lines to a shared file: ``joined`` when it
has joined a round (hora's rounds, torchrun's attempts: the group formed, the checkpoint
loaded), ``step`` after each step, ``killed`` before it kills itself, each with the worker
(hora: its process, which survives rounds; torchrun: its rank, whose process is replaced), its
rank, the job's size and the round. The recovery time is from the ``killed`` line to the first
step completed by the recovered job (hora's next round, torchrun's next attempt), by any
worker; the table shows medians and the ratio hora/torchrun (goal: at most 1.0x, in-process
recovery should beat a restart). ``--json PATH`` writes every job's events too, and
``--plot PATH`` (or ``--docs``, for docs/images/elastic_rounds.png) draws the hora job with
the median recovery time as a timeline of its rounds (see charts.py)::

    .venv/bin/python benchmarks/elastic_recovery.py --repeats 3 --docs
"""

from __future__ import annotations

import argparse
import os
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
import charts
import harness

GOAL = 1.0
NP = 3
STEPS = 40
KILL_AT = 20
COMMIT_EVERY = 5
BATCH = 32
HIDDEN = 256
HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
CHART = "elastic_rounds.png"  # under docs/images/ with --docs


def _log(path: str, event: str, **fields: object) -> None:
    """Append one event: its time, its name, then ``key value`` pairs."""
    text = " ".join([f"{time.time():.6f}", event, *(f"{k} {v}" for k, v in fields.items())])
    with open(path, "a") as f:
        f.write(text + "\n")


def parse_events(text: str) -> list[dict[str, Any]]:
    """The lines of an events file as ``{"t": seconds, "event": name, key: value, ...}``
    (values that are integers as ``int``)."""
    events = []
    for line in text.splitlines():
        stamp, event, *pairs = line.split()
        parsed: dict[str, Any] = {"t": float(stamp), "event": event}
        for key, value in zip(pairs[::2], pairs[1::2]):
            parsed[key] = int(value) if value.lstrip("-").isdigit() else value
        events.append(parsed)
    return events


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

    torch.set_num_threads(1)
    hvd.init()
    model = _model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)
    worker = os.getpid()

    def joined() -> None:
        where = {"rank": hvd.rank(), "size": hvd.size(), "round": hvd.elastic.round_number()}
        _log(events, "joined", worker=worker, **where)

    joined()
    state.register_reset_callbacks([joined])

    @hvd.elastic.run
    def train(state: Any) -> None:
        while state.step < STEPS:
            number = hvd.elastic.round_number()
            if state.step == KILL_AT and hvd.rank() == NP - 1 and number == 0:
                _log(events, "killed", worker=worker, rank=hvd.rank(), round=number)
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = _batch(state.step, hvd.rank())
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            state.step += 1
            where = {"rank": hvd.rank(), "size": hvd.size(), "round": number}
            _log(events, "step", step=state.step, worker=worker, **where)
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
    # A restarted worker is a new process: the rank names the worker across attempts.
    where = {"worker": rank, "rank": rank, "size": size, "round": restart}
    _log(events, "joined", **where)
    while step < STEPS:
        if step == KILL_AT and rank == NP - 1 and restart == 0:
            _log(events, "killed", worker=rank, rank=rank, round=restart)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = _batch(step, rank)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        step += 1
        _log(events, "step", step=step, **where)
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


def run_once(kind: str, workdir: str) -> dict[str, Any]:
    """Run one job; returns its recovery time, how long the whole job took, when it was
    launched and its events."""
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
        lines = parse_events(f.read())
    killed = [e["t"] for e in lines if e["event"] == "killed"]
    if len(killed) != 1:
        raise RuntimeError(f"{kind}: expected one kill, the events say {len(killed)}")
    # The first step of the recovered job (hora's next round, torchrun's next attempt).
    after = [e["t"] for e in lines if e["event"] == "step" and e["round"] != 0]
    return {
        "recovery_s": min(after) - killed[0],
        "job_s": finished - started,
        "launched": started,
        "events": lines,
        # horarun's line about each new round (hora), for the chart.
        "driver": [
            line
            for line in (done.stdout + done.stderr).splitlines()
            if line.startswith("horarun: round ")
        ],
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="jobs per launcher (default 3)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write results here")
    harness.add_chart_options(parser, CHART)
    parser.add_argument("--worker", choices=["hora", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--events", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def measure(repeats: int) -> dict[str, Any]:
    """Run ``repeats`` jobs of each launcher, alternating; the results, every event included."""
    load_before = os.getloadavg()
    samples: dict[str, list[dict[str, Any]]] = {"hora": [], "torchrun": []}
    with tempfile.TemporaryDirectory() as workdir:
        for _ in range(repeats):
            for kind in ("hora", "torchrun"):
                samples[kind].append(run_once(kind, workdir))
    medians = {
        kind: {key: statistics.median(s[key] for s in runs) for key in ("recovery_s", "job_s")}
        for kind, runs in samples.items()
    }
    return {
        **harness.versions(),
        **harness.run_facts(),
        "np": NP,
        "steps": STEPS,
        "kill_at": KILL_AT,
        "killed_rank": NP - 1,
        "commit_every": COMMIT_EVERY,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "samples": samples,
        "medians": medians,
        "ratio": medians["hora"]["recovery_s"] / medians["torchrun"]["recovery_s"],
    }


def print_report(results: dict[str, Any]) -> None:
    medians, ratio, samples = results["medians"], results["ratio"], results["samples"]
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
        f"hora {results['hora_version']} ({results['hora_revision']}) elastic recovery vs "
        f"torchrun (torch {results['torch_version']}), {len(samples['hora'])} jobs each; medians"
    )
    print("\n".join(harness.table(header, rows)))
    for kind in ("hora", "torchrun"):
        shown = ", ".join(f"{s['recovery_s'] * 1000:.0f} ms" for s in samples[kind])
        print(f"{kind} recovery samples: {shown}")
    print(
        f"load average {results['load_before'][0]:.2f} before, {results['load_after'][0]:.2f} after"
    )
    print(f"goal hora/torchrun <= {GOAL:.1f}x: {harness.verdict(ratio <= GOAL)}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "hora":
        hora_worker(args.events)
        return 0
    if args.worker == "torch":
        torch_worker(args.events, args.checkpoint)
        return 0
    results = measure(args.repeats)
    print_report(results)
    if args.json:
        harness.write_json(args.json, results)
    chart = harness.chart_path(args, CHART)
    if chart:
        charts.elastic_rounds(results, chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
