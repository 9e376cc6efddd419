"""Attacks on the shared-memory path by another user, each run inside a private mount namespace
with a ``/dev/shm`` of its own (``tests/multiproc/test_shm_attacks.py`` starts them).

``python -m tests.multiproc.shm_scenarios NAME OUT`` runs scenario ``NAME`` and writes what it
saw to ``OUT`` as JSON. The attacker is uid ``nobody`` running the system's ``python3`` with the
standard library only; the jobs are root's (CI runs as root), started as users start them
(``hora.run``, ``horarun``, ``torchrun``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hora
from hora.common.job.shm_names import GRACE_S, SHM_DIR, job_prefix
from tests import processes

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3"
JOB_TIMEOUT_S = 60.0


def as_nobody(code: str, *args: str) -> subprocess.Popen[str]:
    """Start ``code`` as uid nobody (the system Python, the standard library only)."""
    return processes.as_nobody(
        [SYSTEM_PYTHON, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def nobody_runs(code: str, *args: str) -> str:
    """Run ``code`` as uid nobody to its end; its standard output."""
    process = as_nobody(code, *args)
    out, err = process.communicate(timeout=30)
    if process.returncode != 0:
        raise RuntimeError(f"the attacker failed: {err}")
    return out


# ------------------------------------------------------------------ the jobs


def checked_allreduces(seed: int) -> dict[str, Any]:
    """Three 300,000-element sums of values only this job has; whether each is right."""
    import torch

    import hora.torch as hvd
    from hora.common import basics

    hvd.init()
    size = hvd.size()
    wrong = 0
    for step in range(3):
        base = torch.arange(300_000, dtype=torch.float64) + seed * 1_000_003 + step
        got = hvd.allreduce(base * (hvd.rank() + 1), op=hvd.Sum, name=f"x{step}")
        wrong += int(not torch.equal(got, base * (size * (size + 1) // 2)))
    path = basics.data_path()
    hvd.shutdown()
    return {"path": path, "wrong": wrong}


def segment_names() -> dict[str, Any]:
    """The job's data path and the names its segments had."""
    import torch

    import hora.torch as hvd
    from hora.common import basics

    hvd.init()
    total = hvd.allreduce(torch.ones(1000), op=hvd.Sum, name="one")
    engine: Any = basics.engine()
    comms = [engine._communicators.control, engine._communicators.of_set(0)]
    names = [c._segment.file.name for c in comms if getattr(c, "path", "") == "shm"]
    path = basics.data_path()
    hvd.shutdown()
    return {"path": path, "sum": float(total[0]), "names": names}


def run_job(fn: Callable[..., Any], np: int = 2, *args: Any) -> list[Any]:
    return hora.run(fn, args=args, np=np, timeout_s=JOB_TIMEOUT_S)


def entries() -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith("hora-"))


# ------------------------------------------------------------------ the scenarios

SWAPPER = """
import os, sys, time
stop = sys.argv[1]
renames = 0
while not os.path.exists(stop):
    names = [n for n in os.listdir("/dev/shm") if n.startswith("hora-")]
    for a in names:
        for b in names + [a + "x"]:
            if a != b:
                try:
                    os.rename("/dev/shm/" + a, "/dev/shm/" + b)
                    renames += 1
                except OSError:
                    pass
print(renames)
"""


def swap(rounds: int = 10) -> dict[str, Any]:
    """Two jobs at a time, while nobody renames every hora name over every other, as fast as it
    can: no job may compute a wrong value."""
    stop = f"/tmp/hora-swap-stop-{os.getpid()}"
    attacker = as_nobody(SWAPPER, stop)
    results: list[dict[str, Any]] = []
    failures: list[str] = []

    def one(seed: int) -> None:
        try:
            results.extend(run_job(checked_allreduces, 2, seed))
        except Exception as exc:  # a failed job is reported, not hidden
            failures.append(f"{type(exc).__name__}: {exc}"[-2000:])

    try:
        for round_ in range(rounds):
            jobs = [threading.Thread(target=one, args=(2 * round_ + k,)) for k in (0, 1)]
            for job in jobs:
                job.start()
            for job in jobs:
                job.join()
    finally:
        Path(stop).touch()
        out, _ = attacker.communicate(timeout=30)
        os.unlink(stop)
    return {
        "runs": len(results) // 2,
        "wrong": sum(r["wrong"] for r in results),
        "paths": sorted({r["path"] for r in results}),
        "renames": int(out.strip() or 0),
        "failures": failures,
    }


PLANT = """
import os, sys
for name in sys.argv[1:]:
    path = "/dev/shm/" + name
    if name.endswith("-link"):
        os.symlink("/etc/passwd", path)
    elif name.endswith("-dir"):
        os.mkdir(path)
        os.mkfifo(path + "/inner")
    else:
        os.mkfifo(path)
"""

FIFO_WORKER = """
import os, subprocess, sys
import torch
import hora.torch as hvd
from hora.common.job.shm_names import job_prefix

hvd.init()
if hvd.rank() == 0:
    # Another user who learned the job's prefix (inotify sees a segment's name) plants a FIFO.
    prefix = job_prefix(os.environ["HORA_SECRET_KEY"])
    subprocess.run(
        [sys.argv[1], "-c", sys.argv[2], prefix + "fifo", prefix + "dfifo-dir"],
        check=True, cwd="/", env={"PATH": "/usr/bin:/bin"}, user=65534, group=65534,
        extra_groups=[],
    )
hvd.barrier()
total = hvd.allreduce(torch.ones(100_000), op=hvd.Sum, name="after")
assert total[0].item() == hvd.size()
print("sum", total[0].item(), flush=True)
"""


def fifo() -> dict[str, Any]:
    """FIFOs, a link and a directory named ``hora-*`` planted by nobody neither block nor fail a
    job, nor ``horarun`` at the end of one whose prefix they carry."""
    nobody_runs(PLANT, "hora-fifo", "hora-0000000000000000-fifo", "hora-link", "hora-x-dir")
    started = time.monotonic()
    first = run_job(checked_allreduces, 2, 1)
    job_s = time.monotonic() - started
    script = Path(f"/tmp/hora-fifo-worker-{os.getpid()}.py")
    script.write_text(FIFO_WORKER)
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "hora.runner.launch", "-np", "2", sys.executable, str(script),
             SYSTEM_PYTHON, PLANT],
            capture_output=True, text=True, timeout=90, cwd=ROOT,
        )  # fmt: skip
    finally:
        script.unlink()
    return {
        "job": first,
        "job_s": job_s,
        "horarun_rc": done.returncode,
        "horarun_s": time.monotonic() - started,
        "horarun_out": (done.stdout + done.stderr)[-3000:],
        "left": entries(),
    }


MAKER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from hora.common.transport.shm_segment import Segment
print("ready", flush=True)
while True:
    segment = Segment.create(sys.argv[2], 2, 64 << 20)
    segment.unlink()
    segment.close()
"""


def leftovers(kills: int = 8) -> dict[str, Any]:
    """Creators killed at random points of making a segment, and a headerless file of this user
    past the grace period: the next job removes them all, and keeps a fresh headerless file."""
    secret = "leftover-test-secret-" + os.urandom(8).hex()
    made = 0
    for _ in range(kills):
        maker = subprocess.Popen(
            [sys.executable, "-c", MAKER, str(ROOT), secret], stdout=subprocess.PIPE, text=True
        )
        assert maker.stdout is not None and maker.stdout.readline().strip() == "ready"
        time.sleep(random.uniform(0.02, 0.3))
        os.kill(maker.pid, signal.SIGKILL)
        maker.wait()
        made += len([n for n in entries() if n.startswith(job_prefix(secret))])
    old = Path(SHM_DIR, "hora-0123456789abcdef-headerless-old")
    old.write_bytes(bytes(1 << 16))
    os.utime(old, (time.time() - 2 * GRACE_S,) * 2)
    fresh = Path(SHM_DIR, "hora-0123456789abcdef-headerless-fresh")
    fresh.write_bytes(bytes(1 << 16))
    before = entries()
    job = run_job(checked_allreduces, 2, 3)
    after = entries()
    fresh.unlink()
    return {"killed_with_a_name": made, "before": before, "job": job, "after": after}


TORCHRUN_WORKER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from tests.multiproc.shm_scenarios import segment_names
result = segment_names()
with open(sys.argv[2] + "." + __import__("os").environ["RANK"], "w") as handle:
    json.dump(result, handle)
"""


def squat() -> dict[str, Any]:
    """Two torchrun jobs with one secret: nobody creates files under every name the first job's
    segments had; the second job still exchanges through shared memory."""
    env = dict(os.environ, HORA_SECRET_KEY="squat-test-" + os.urandom(16).hex())
    script = Path(f"/tmp/hora-squat-worker-{os.getpid()}.py")
    script.write_text(TORCHRUN_WORKER)
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--standalone"]
    runs = []
    try:
        for attempt in range(2):
            out = f"/tmp/hora-squat-{os.getpid()}-{attempt}"
            done = subprocess.run(
                [*torchrun, "--nproc-per-node", "2", str(script), str(ROOT), out],
                capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
            )  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(done.stdout[-2000:] + done.stderr[-3000:])
            runs.append([json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)])
            if attempt == 0:
                names = sorted({n for r in runs[0] for n in r["names"]})
                squatter = "import sys\nfor n in sys.argv[1:]: open('/dev/shm/' + n, 'w')"
                nobody_runs(squatter, *names)
    finally:
        script.unlink()
    return {"runs": runs, "squatted": entries()}


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "swap": swap,
    "fifo": fifo,
    "leftovers": leftovers,
    "squat": squat,
}

if __name__ == "__main__":
    name, out_path = sys.argv[1], sys.argv[2]
    Path(out_path).write_text(json.dumps(SCENARIOS[name]()))
