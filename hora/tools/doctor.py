"""``hora doctor``: the ``--check-build`` table (:mod:`hora.common.build_info`), the versions of
hora and its dependencies, the details behind each box, and a two-process allreduce on this
machine through ``hora.run``.

Each check catches its own failure and says it in one line: what is missing or broken, and the
command that installs it. A broken environment is what ``hora doctor`` is run in, so it never
ends in a traceback. Nothing here starts a job of its own beyond the allreduce check.
"""

from __future__ import annotations

import importlib
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hora.common.build_info import check_build_text, frameworks, transports

# hora's dependencies (pyproject.toml's ``dependencies``): the name pip installs, and the module
# imported to check it. torch comes after numpy, which it imports: the first broken one is the
# cause.
DEPENDENCIES: dict[str, str] = {
    "numpy": "numpy",
    "torch": "torch",
    "psutil": "psutil",
    "cloudpickle": "cloudpickle",
    "packaging": "packaging",
    "PyYAML": "yaml",
    "tqdm": "tqdm",
    "cryptography": "cryptography",
}

# What torch's line adds to its install command: the build must match the machine's CUDA.
_TORCH_NOTE = " (or the build for your CUDA version, from https://pytorch.org/get-started/)"


@dataclass(frozen=True)
class Dependency:
    """One dependency as found here.

    Attributes:
        name: the name pip installs (``PyYAML``).
        module: the module imported (``yaml``).
        version: its version when it imports; ``None`` when it does not.
        problem: why it does not import (``"not installed"``, or the error it raised).
        install: what to do: the command that installs it (into this interpreter).
    """

    name: str
    module: str
    version: str | None
    problem: str
    install: str

    def line(self) -> str:
        """Its line of the report."""
        if self.version is not None:
            return f"    {self.name:<13} {self.version}"
        return f"    {self.name:<13} {self.problem}; {self.install}"


def _requirements() -> dict[str, str]:
    """hora's requirement of each dependency (``numpy>=1.24,<3``), by lower-case name, from the
    installed metadata; empty when hora's metadata is not there (a source tree on sys.path)."""
    from importlib import metadata

    try:
        declared = metadata.requires("hora") or []
    except metadata.PackageNotFoundError:
        return {}
    found: dict[str, str] = {}
    for text in declared:
        requirement, _, marker = text.partition(";")
        if "extra" in marker:
            continue
        name = re.match(r"[A-Za-z0-9._-]+", requirement.strip())
        if name is not None:
            found[name.group(0).lower()] = requirement.strip().replace(" ", "")
    return found


def find_dependency(
    name: str, module: str, requirement: str | None = None, broken: Sequence[str] = ()
) -> Dependency:
    """Import ``module`` and say what was found; never raises (an error is the finding).

    Args:
        name: the name pip installs.
        module: the module to import.
        requirement: hora's requirement (``numpy>=1.24,<3``) for the install command.
        broken: modules already found broken: an error raised inside one of them is theirs
            (torch fails when numpy does), and the line says to fix that one first.
    """
    pip = f"{shlex.quote(sys.executable)} -m pip install"
    spec = shlex.quote(requirement or name)
    note = _TORCH_NOTE if name == "torch" else ""
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return Dependency(
                name, module, None, "not installed", f"install it: {pip} {spec}{note}"
            )
        reinstall = f"reinstall it: {pip} --force-reinstall {spec}{note}"
        return _broken(name, module, exc, reinstall, broken)
    except (Exception, SystemExit) as exc:  # a broken install raises anything
        reinstall = f"reinstall it: {pip} --force-reinstall {spec}{note}"
        return _broken(name, module, exc, reinstall, broken)
    return Dependency(name, module, str(getattr(imported, "__version__", "installed")), "", "")


def _broken(
    name: str, module: str, exc: BaseException, install: str, broken: Sequence[str]
) -> Dependency:
    cause = _raised_in(exc, broken)
    if cause is not None:
        return Dependency(
            name, module, None, f"cannot be imported: it imports {cause}", f"fix {cause} first"
        )
    said = str(exc).strip().splitlines()
    reason = f"{type(exc).__name__}: {said[0]}" if said else type(exc).__name__
    return Dependency(name, module, None, f"installed but cannot be imported ({reason})", install)


def _raised_in(exc: BaseException, modules: Sequence[str]) -> str | None:
    """Which of ``modules`` (or their submodules) ``exc`` was raised in, if any."""
    names = []
    trace = exc.__traceback__
    while trace is not None:
        names.append(str(trace.tb_frame.f_globals.get("__name__", "")))
        trace = trace.tb_next
    missing = getattr(exc, "name", None)  # ModuleNotFoundError's module
    if isinstance(missing, str):
        names.append(missing)
    for name in reversed(names):
        top = name.partition(".")[0]
        if top in modules:
            return top
    return None


def dependencies() -> list[Dependency]:
    """Every dependency of :data:`DEPENDENCIES`, in that order, as found here."""
    requirements = _requirements()
    found: list[Dependency] = []
    for name, module in DEPENDENCIES.items():
        broken = [d.module for d in found if d.version is None]
        found.append(find_dependency(name, module, requirements.get(name.lower()), broken))
    return found


def _ssh() -> str:
    if shutil.which("ssh") is None:
        return "not found: horarun needs an OpenSSH client for hosts other than this one"
    try:
        result = subprocess.run(["ssh", "-V"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run ssh -V ({exc})"
    said = (result.stderr or result.stdout).strip().splitlines()
    return said[0] if said else f"ssh -V said nothing (exit {result.returncode})"


def _shared_memory() -> str:
    """Whether ranks on this machine can exchange through shared memory, and the room for it."""
    import os

    from hora.common.job.shm_names import SHM_DIR
    from hora.common.transport.shm_segment import supported

    why_not = supported()
    if why_not is not None:
        return f"not usable ({why_not}): ranks on this machine exchange over Gloo"
    room = os.statvfs(SHM_DIR)
    free = room.f_bavail * room.f_frsize / 2**30
    return f"usable ({SHM_DIR}, {free:.1f} GiB free): ranks on one host exchange through it"


def _loopback_allreduce() -> tuple[float, str]:
    """Runs on each of the check's workers: one summed allreduce, and the data path it took."""
    import importlib

    import torch

    from hora.common import basics

    hvd: Any = importlib.import_module("hora.torch")
    hvd.init()
    try:
        total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="hora.doctor")
        return float(total.item()), basics.data_path()
    finally:
        hvd.shutdown()


@dataclass(frozen=True)
class CheckResult:
    passed: bool
    seconds: float
    detail: str


def loopback_check(np: int = 2, timeout_s: float = 120.0) -> CheckResult:
    """Run a summed allreduce on ``np`` processes of this machine through ``hora.run``."""
    expected = float(np * (np + 1) // 2)
    start = time.monotonic()
    try:
        import hora

        results = hora.run(_loopback_allreduce, np=np, timeout_s=timeout_s)
    except Exception as exc:  # reported to the user as a failed check
        return CheckResult(False, time.monotonic() - start, f"{type(exc).__name__}: {exc}")
    seconds = time.monotonic() - start
    totals = [total for total, _ in results]
    if totals != [expected] * np:
        return CheckResult(False, seconds, f"expected {[expected] * np}, got {totals}")
    paths = sorted({path for _, path in results})
    return CheckResult(True, seconds, f"every rank got {expected:g}, data path {'/'.join(paths)}")


def _said(what: str, produce: Callable[[], str]) -> str:
    """``produce()``, or one line saying that ``what`` failed and how."""
    try:
        return produce()
    except Exception as exc:  # a check's failure is a finding, not a crash
        said = str(exc).strip().splitlines()
        return f"{what} failed: {type(exc).__name__}" + (f": {said[0]}" if said else "")


def _details() -> list[str]:
    lines = [
        f"    {capability.name + ':':<9} {capability.detail}"
        for capability in [*frameworks()[1:2], *transports()]
    ]
    lines.append(f"    {'shm:':<9} {_said('the shared memory check', _shared_memory)}")
    return lines


def doctor(np: int = 2, run_check: bool = True, timeout_s: float = 120.0) -> int:
    """Print the report; returns the exit status: 1 when a dependency is missing or broken, or
    when the loopback check fails."""
    from hora import __version__

    # Imported first, in an order where the first broken one is the cause (torch needs numpy).
    found = dependencies()
    missing = [d.name for d in found if d.version is None]
    has_torch = "torch" not in missing
    print(_said("the build table", check_build_text) if has_torch else _NO_TABLE)
    print("\nVersions:")
    print(f"    {'hora':<13} {__version__}")
    for dependency in found:
        print(dependency.line())
    print(f"    {'python':<13} {platform.python_version()} ({sys.executable})")
    print(f"    {'platform':<13} {platform.platform()}")
    if has_torch:
        print("\nDetails:")
        print(_said("the details", lambda: "\n".join(_details())))
        print(f"    {'ssh:':<9} {_said('the ssh check', _ssh)}")
    if missing:
        lines = "its line" if len(missing) == 1 else "their lines"
        print(
            f"\nhora cannot run: {', '.join(missing)} cannot be imported. Follow {lines} "
            "above, then run hora doctor again."
        )
        return 1
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


_NO_TABLE = "The build table is left out: it needs torch, which cannot be imported (see below)."
