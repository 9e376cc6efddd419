"""Launch overhead: ``horarun`` against ``torchrun``, from the command to the last exit.

Run it with::

    .venv/bin/python benchmarks/launch.py [--np 2] [--repeats 7] [--json results.json]

Four commands, each timed from start to the exit of the launcher (wall clock):

1. ``horarun -np N python -c "import hora.torch as hvd; hvd.init(); hvd.shutdown()"``;
2. ``torchrun --standalone --nproc-per-node N --no-python python -c "<init_process_group('gloo')
   + destroy_process_group()>"``, the same work through torch.distributed;
3. ``horarun -np N python -c pass``, the launcher alone;
4. ``torchrun --standalone --nproc-per-node N --no-python python -c pass``.

Both launchers run as ``python -m`` with this interpreter, and both workers get
``OMP_NUM_THREADS=1`` (both set it when unset, horarun to the cores per worker), so they start the same
Python with the same environment. Repetitions alternate between hora and torchrun so that
changes in the machine's load hit both alike; the table shows medians and the ratio
hora/torchrun against the goal of at most 1.0x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# The benchmarks' shared helpers live beside this file.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness

GOAL = 1.0  # hora's time / torchrun's time
HORA_INIT = "import hora.torch as hvd; hvd.init(); hvd.shutdown()"
TORCH_INIT = (
    "import torch.distributed as dist; dist.init_process_group('gloo'); "
    "dist.destroy_process_group()"
)
# Launchers' variables that must not leak into the measured jobs from the caller's environment.
_LAUNCHER_PREFIXES = ("HORA_", "HOROVOD_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_")
_LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Case:
    """One row of the table: the same work started by horarun and by torchrun."""

    name: str
    hora_code: str
    torch_code: str

    def hora_command(self, np: int) -> list[str]:
        return [sys.executable, "-m", "hora.runner.launch", "-np", str(np)] + [
            sys.executable,
            "-c",
            self.hora_code,
        ]

    def torch_command(self, np: int) -> list[str]:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        return [*launcher, "--nproc-per-node", str(np), "--no-python"] + [
            sys.executable,
            "-c",
            self.torch_code,
        ]


CASES = (
    Case("init + shutdown", HORA_INIT, TORCH_INIT),
    Case("bare (python -c pass)", "pass", "pass"),
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=2, help="workers per job (default 2)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per command (default 7)")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed runs per command first (default 1)"
    )
    parser.add_argument("--json", metavar="PATH", default=None, help="also write results here")
    return parser.parse_args(argv)


def clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_NAMES
    }
    env["OMP_NUM_THREADS"] = "1"
    return env


def time_command(command: list[str], env: dict[str, str]) -> float:
    """Seconds from starting ``command`` to its exit.

    Raises:
        RuntimeError: the command failed (its output is in the message).
    """
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} exited with status {done.returncode}:\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
    return elapsed


def measure(case: Case, np: int, repeats: int, warmup: int) -> dict[str, Any]:
    """Time ``case`` under both launchers, alternating hora, torchrun, torchrun, hora, ..."""
    env = clean_env()
    commands = {"hora": case.hora_command(np), "torchrun": case.torch_command(np)}
    for _ in range(warmup):
        for command in commands.values():
            time_command(command, env)
    samples: dict[str, list[float]] = {"hora": [], "torchrun": []}
    order = ("hora", "torchrun", "torchrun", "hora")
    while min(len(s) for s in samples.values()) < repeats:
        for launcher in order:
            if len(samples[launcher]) < repeats:
                samples[launcher].append(time_command(commands[launcher], env))
    hora_s = statistics.median(samples["hora"])
    torch_s = statistics.median(samples["torchrun"])
    ratio = hora_s / torch_s
    return {
        "name": case.name,
        "hora_command": commands["hora"],
        "torchrun_command": commands["torchrun"],
        "hora_s": hora_s,
        "torchrun_s": torch_s,
        "ratio": ratio,
        "goal": f"hora/torchrun <= {GOAL}",
        "pass": ratio <= GOAL,
        "hora_samples_s": samples["hora"],
        "torchrun_samples_s": samples["torchrun"],
    }


def format_table(results: dict[str, Any]) -> str:
    header = ("start-up to exit", "horarun", "torchrun", "hora/torchrun", "goal", "result")
    rows = [
        (
            row["name"],
            f"{row['hora_s']:.2f} s",
            f"{row['torchrun_s']:.2f} s",
            f"{row['ratio']:.2f}x",
            f"<= {GOAL:.1f}x",
            harness.verdict(row["pass"]),
        )
        for row in results["cases"]
    ]
    title = (
        f"hora {results['hora_version']} ({results['hora_revision']}) launch overhead vs "
        f"torchrun (torch {results['torch_version']}), {results['np']} workers, "
        f"{results['repeats']} runs each; medians"
    )
    notes = (
        f"run time {results['elapsed_s']:.1f} s on {results['cpus']} CPUs; load average "
        f"{results['load_before'][0]:.2f} before, {results['load_after'][0]:.2f} after"
    )
    passed = sum(row["pass"] for row in results["cases"])
    summary = f"goals met: {passed}/{len(results['cases'])}"
    return "\n".join([title, *harness.table(header, rows), notes, summary])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    load_before = os.getloadavg()
    cases = [measure(case, args.np, args.repeats, args.warmup) for case in CASES]
    results: dict[str, Any] = {
        **harness.versions(),
        "np": args.np,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "elapsed_s": time.perf_counter() - started,
        "cases": cases,
    }
    print(format_table(results))
    if args.json:
        harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
