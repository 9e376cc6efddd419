"""Autotune against the default setting on the training benchmark's models.

Usage::

    .venv/bin/python benchmarks/autotune.py                  # np=2, the three models
    .venv/bin/python benchmarks/autotune.py --models mlp --measured 80

For each model this runs jobs of ``--np`` workers through horarun, in the order
tuned, default, default, tuned (so that drift in the machine's load falls on both alike). A tuned
job (``HORA_AUTOTUNE=1``) first trains until autotune has tried every setting and kept one; a
default job trains the same number of steps. Then both time ``--measured`` steps. A step's time
is the slowest rank's; the table compares the medians and shows what autotune chose. Goal: the
tuned setting is at least as fast as the default (ratio default / tuned >= 1.0, within the
benchmark's noise, which the two default runs show).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness
import training

RAW_PREFIX = "autotune-bench-raw"
WARMUP, STEPS_PER_SAMPLE = 2, 6


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=2, help="workers (default 2)")
    parser.add_argument(
        "--models", nargs="+", choices=sorted(training.MODELS), default=sorted(training.MODELS)
    )
    parser.add_argument("--measured", type=int, default=60, help="timed steps per job")
    parser.add_argument(
        "--batch-size", type=int, default=None, help="samples per worker (default: the model's)"
    )
    parser.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def worker(
    model_name: str, warm_steps: int, measured: int, batch_size: int | None, out: str
) -> None:
    """One job's training; rank 0 writes the slowest rank's step times and autotune's choice."""
    import torch

    import hora.torch as hvd
    from hora.common import basics

    torch.set_num_threads(1)
    hvd.init()
    harness.init_raw_group(hvd.rank(), hvd.size(), RAW_PREFIX, timeout_s=300)
    step = training.hora_step(training.MODELS[model_name], batch_size)
    for _ in range(warm_steps):
        step()
    times = harness.slowest_rank([step() for _ in range(measured)])
    tuner = basics.engine().autotuner
    if hvd.rank() == 0:
        chosen = None
        if tuner is not None:
            chosen = {
                "done": tuner.done,
                "first_batch_bytes": tuner.current.first_bucket_bytes,
                "batch_bytes": tuner.current.bucket_bytes,
            }
        with open(out, "w", encoding="utf-8") as file:
            json.dump({"times": times, "chosen": chosen}, file)
    hvd.shutdown()


def run_job(args: argparse.Namespace, model: str, tuned: bool, warm: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "result.json")
        spec = json.dumps([model, warm, args.measured, args.batch_size, out])
        command = [sys.executable, "-m", "hora.runner.launch", "-np", str(args.np)]
        command += [sys.executable, os.path.abspath(__file__), "--worker", spec]
        env = dict(os.environ)
        env.pop("HORA_AUTOTUNE", None)
        if tuned:
            env["HORA_AUTOTUNE"] = "1"
            env["HORA_AUTOTUNE_WARMUP_SAMPLES"] = str(WARMUP)
            env["HORA_AUTOTUNE_STEPS_PER_SAMPLE"] = str(STEPS_PER_SAMPLE)
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(out, encoding="utf-8") as file:
            result: dict[str, Any] = json.load(file)
            return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(*json.loads(args.worker))
        return 0
    from hora.common.engine.autotune import candidates

    # Entering the steady state takes a few steps; then every candidate runs its steps.
    warm = 4 + len(candidates(128 * 1024 * 1024)) * (WARMUP + STEPS_PER_SAMPLE) + 2
    header = ("model", "default ms", "tuned ms", "default/tuned", "default spread", "chosen")
    rows = []
    passed = 0
    for model in args.models:
        runs: dict[bool, list[float]] = {True: [], False: []}
        chosen: dict[str, Any] | None = None
        for tuned in (True, False, False, True):
            result = run_job(args, model, tuned, warm)
            runs[tuned].append(statistics.median(result["times"]))
            if tuned:
                chosen = result["chosen"]
                assert chosen is not None and chosen["done"], "autotune did not finish"
        default, tuned_ms = statistics.mean(runs[False]), statistics.mean(runs[True])
        spread = abs(runs[False][0] - runs[False][1]) / default
        ratio = default / tuned_ms
        ok = ratio >= 1.0 - spread
        passed += ok
        assert chosen is not None
        label = f"first {chosen['first_batch_bytes'] // 1024} KiB, then {chosen['batch_bytes'] // 1024} KiB"
        rows.append(
            (
                model,
                f"{default * 1000:.1f}",
                f"{tuned_ms * 1000:.1f}",
                f"{ratio:.3f}x {harness.verdict(ok)}",
                f"{spread:.1%}",
                label,
            )
        )
    print(
        f"autotune vs default, {args.np} ranks, {training.batch_label(args.batch_size)}; "
        f"medians of {args.measured} steps per job, slowest rank, mean of two jobs each"
    )
    print("\n".join(harness.table(header, rows)))
    print("PASS: tuned at least as fast as the default, within the spread of the two default runs")
    print(f"goals met: {passed}/{len(args.models)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
