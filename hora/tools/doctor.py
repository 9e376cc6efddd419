"""What this installation can do: ``horarun --check-build`` and ``hora doctor``.

``check_build_text`` prints Horovod's ``--check-build`` table. A box is ticked when hora can use
that framework or transport here: the library is present *and* hora has a path through it. hora's
transports are Gloo (through ``torch.distributed``), MPI (through mpi4py, when it loads) and, for
CUDA tensors, NCCL (through ``torch.distributed``, when torch has it and a GPU is visible). ``doctor`` adds versions,
those details, and a two-process allreduce on this machine through ``hora.run``. Nothing here
starts a job of its own beyond that check.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Capability:
    """One line of the report.

    Attributes:
        name: as Horovod's table names it.
        usable: hora can use it in this installation (the box is ticked).
        detail: what was found, for ``hora doctor``.
    """

    name: str
    usable: bool
    detail: str


def _torch_version() -> str | None:
    try:
        import torch
    except Exception:  # noqa: BLE001 - a broken install is reported, not raised
        return None
    return str(torch.__version__)


def _tensorflow_version() -> str | None:
    """TensorFlow's version, found without importing it (importing takes seconds)."""
    from importlib import metadata

    for distribution in ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def frameworks() -> list[Capability]:
    version = _torch_version()
    tensorflow = _tensorflow_version()
    return [
        Capability(
            "TensorFlow",
            tensorflow is not None,
            f"tensorflow {tensorflow} (hora.tensorflow, hora.keras)"
            if tensorflow
            else 'not installed: pip install "hora[tensorflow]"',
        ),
        Capability(
            "PyTorch",
            version is not None,
            f"torch {version} (hora.torch)" if version else "torch cannot be imported",
        ),
        Capability("MXNet", False, "hora has no MXNet API"),
    ]


def _gloo() -> Capability:
    if _torch_version() is None:
        return Capability("Gloo", False, "torch cannot be imported")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return Capability("Gloo", False, "this torch build has no Gloo in torch.distributed")
    return Capability("Gloo", True, "torch.distributed Gloo: hora's transport")


def _nccl() -> Capability:
    if _torch_version() is None:
        return Capability("NCCL", False, "torch cannot be imported")
    import torch
    import torch.distributed as dist

    from hora.common.config import Settings

    if not dist.is_available() or not dist.is_nccl_available():
        return Capability("NCCL", False, "this torch build has no NCCL")
    nccl: Any = torch.cuda.nccl
    found = nccl.version()  # a tuple (2, 21, 5); an int such as 2708 in older torch releases
    version = ".".join(str(p) for p in found) if isinstance(found, tuple) else str(found)
    if not torch.cuda.is_available():
        return Capability("NCCL", False, f"torch has NCCL {version} but no CUDA device is visible")
    devices = torch.cuda.device_count()
    if Settings.from_env().gpu_operations != "nccl":
        return Capability(
            "NCCL",
            False,
            f"torch has NCCL {version} and {devices} CUDA device(s), but HORA_GPU_OPERATIONS="
            "host sends CUDA tensors through host memory",
        )
    return Capability("NCCL", True, f"NCCL {version}, {devices} CUDA device(s): CUDA tensors' path")


def _mpi() -> Capability:
    from hora.common.basics import mpi_built

    try:
        import mpi4py
        from mpi4py import MPI
    except Exception:  # noqa: BLE001 - ImportError, or a broken MPI library
        return Capability("MPI", False, "mpi4py cannot be imported")
    library = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
    found = f"mpi4py {mpi4py.__version__} ({library})"
    if not mpi_built():
        return Capability("MPI", False, f"{found}, but its MPI library does not answer")
    return Capability("MPI", True, found)


def transports() -> list[Capability]:
    """Gloo, NCCL and MPI, in that order."""
    return [_gloo(), _nccl(), _mpi()]


def check_build_text() -> str:
    """Horovod's ``--check-build`` report, for hora."""
    from hora import __version__

    gloo, nccl, mpi = transports()

    def box(usable: bool) -> str:
        return "[X]" if usable else "[ ]"

    lines = [f"hora v{__version__}:", "", "Available Frameworks:"]
    lines += [f"    {box(c.usable)} {c.name}" for c in frameworks()]
    lines += [
        "",
        "Available Controllers:",
        f"    {box(mpi.usable)} MPI",
        f"    {box(gloo.usable)} Gloo",
    ]
    lines += ["", "Available Tensor Operations:", f"    {box(nccl.usable)} NCCL", "    [ ] DDL"]
    lines += ["    [ ] CCL", f"    {box(mpi.usable)} MPI", f"    {box(gloo.usable)} Gloo"]
    return "\n".join(lines)


def _ssh() -> str:
    if shutil.which("ssh") is None:
        return "not found: horarun needs an OpenSSH client for hosts other than this one"
    try:
        result = subprocess.run(["ssh", "-V"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run ssh -V ({exc})"
    return (result.stderr or result.stdout).strip().splitlines()[0]


def _loopback_allreduce() -> float:
    """Runs on each of the check's workers: one summed allreduce."""
    import importlib

    import torch

    hvd: Any = importlib.import_module("hora.torch")
    hvd.init()
    try:
        total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="hora.doctor")
        return float(total.item())
    finally:
        hvd.shutdown()


@dataclass(frozen=True)
class CheckResult:
    passed: bool
    seconds: float
    detail: str


def loopback_check(np: int = 2, timeout_s: float = 120.0) -> CheckResult:
    """Run a summed allreduce on ``np`` processes of this machine through ``hora.run``."""
    import hora

    expected = float(np * (np + 1) // 2)
    start = time.monotonic()
    try:
        results = hora.run(_loopback_allreduce, np=np, timeout_s=timeout_s)
    except Exception as exc:  # noqa: BLE001 - reported to the user as a failed check
        return CheckResult(False, time.monotonic() - start, f"{type(exc).__name__}: {exc}")
    seconds = time.monotonic() - start
    if results != [expected] * np:
        return CheckResult(False, seconds, f"expected {[expected] * np}, got {results}")
    return CheckResult(True, seconds, f"every rank got {expected:g}")


def doctor(np: int = 2, run_check: bool = True, timeout_s: float = 120.0) -> int:
    """Print the report; returns the exit status (1 when the loopback check fails)."""
    from hora import __version__

    print(check_build_text())
    print("\nVersions:")
    print(f"    hora      {__version__}")
    print(f"    torch     {_torch_version() or 'cannot be imported'}")
    print(f"    python    {platform.python_version()} ({sys.executable})")
    print(f"    platform  {platform.platform()}")
    print("\nDetails:")
    for capability in [*frameworks()[1:2], *transports()]:
        print(f"    {capability.name + ':':<9} {capability.detail}")
    print(f"    {'ssh:':<9} {_ssh()}")
    if not run_check:
        return 0
    print(
        f"\nLoopback check: allreduce on {np} processes of this machine (hora.run) ...", flush=True
    )
    result = loopback_check(np, timeout_s)
    verdict = "PASS" if result.passed else "FAIL"
    print(f"    {verdict} in {result.seconds:.1f} s: {result.detail}")
    if not result.passed:
        print(
            "    hora cannot run a job on this machine. Run `horarun -np 2 --verbose python -c "
            '"import hora.torch as hvd; hvd.init()"` to see each worker\'s output.',
        )
    return 0 if result.passed else 1
