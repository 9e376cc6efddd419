"""Where this process sits in the job: rank, size, local and cross ranks, and the rendezvous.

This module decides which launcher started this process and turns its variables into a
:class:`Topology`. It knows nothing of transports or tensors. ``horarun`` and ``hora.run`` export
the ``HORA_*`` variables (and their ``HOROVOD_*`` twins), read here; the variables of torchrun,
Open MPI, MPICH, MVAPICH, SLURM's ``srun`` and torch.distributed's ``env://`` are read in
:mod:`hora.common.job.launchers`. When two launchers' variables contradict each other, :func:`detect`
refuses with both. A process started without any launcher is a job of one.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from hora.common.job.launchers import READERS, LauncherError, Reading, StorePlan, mpi4py_usable
from hora.common.vocabulary import settings_table as table
from hora.common.vocabulary.config import SettingError, raw, read
from hora.common.vocabulary.settings_table import Variable

logger = logging.getLogger("hora")


class TopologyError(ValueError):
    """The launcher's variables are missing, malformed or contradict each other."""


@dataclass(frozen=True)
class Topology:
    """This process's place in the job.

    Attributes:
        rank: global rank, 0..size-1.
        size: number of processes.
        local_rank: rank among the processes on this host.
        local_size: processes on this host.
        cross_rank: index of this host among the hosts that have a process with this local rank.
        cross_size: number of hosts that have a process with this local rank.
        hostname: how the launcher names this host.
        rendezvous_addr: address of the job's key-value store ("" for a job of one).
        rendezvous_port: its port.
        secret: the job's secret key (hex), used to authenticate everything sent through the store.
        source: which launcher's variables were used.
        authenticated: whether ``secret`` is secret: ``False`` when no launcher handed one out
            and ``HORA_SECRET_KEY`` is not set (see docs/security.md).
        store_prefix: prefix of every key hora writes (inside a launcher's own store).
        launch: what another launcher's variables said, while :mod:`hora.common.job.joining` has
            not yet reached the store (``None`` under ``horarun`` and for a job of one).
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    hostname: str = "localhost"
    rendezvous_addr: str = ""
    rendezvous_port: int = 0
    secret: str = field(default="", repr=False)
    source: str = "single process"
    authenticated: bool = True
    store_prefix: str = ""
    launch: Reading | None = field(default=None, compare=False, repr=False)

    @property
    def all_local(self) -> bool:
        """Every process of the job runs on this host."""
        return self.local_size == self.size

    @property
    def plan(self) -> StorePlan | None:
        return None if self.launch is None else self.launch.plan

    def validate(self) -> None:
        if self.size < 1:
            raise TopologyError(f"{self.source}: world size must be >= 1, got {self.size}.")
        if not 0 <= self.rank < self.size:
            raise TopologyError(
                f"{self.source}: rank {self.rank} is outside 0..{self.size - 1} (size {self.size})."
            )
        if self.plan is not None and self.plan.exchange:
            return  # local and cross ranks come from the exchange in hora.common.job.joining
        if not 0 <= self.local_rank < self.local_size:
            raise TopologyError(
                f"{self.source}: local rank {self.local_rank} is outside 0..{self.local_size - 1}."
            )
        if not 0 <= self.cross_rank < self.cross_size:
            raise TopologyError(
                f"{self.source}: cross rank {self.cross_rank} is outside 0..{self.cross_size - 1}."
            )
        if self.size > 1 and not self.rendezvous_addr and self.launch is None:
            raise TopologyError(
                f"{self.source}: a job of {self.size} processes needs a rendezvous address "
                "(HORA_RENDEZVOUS_ADDR); start it with horarun or hora.run."
            )


# The shortest secret hora accepts, in every form: 32 characters (``secrets.token_hex(16)``).
MIN_SECRET_CHARS = 32
# The fewest different characters it accepts: 'a' * 32, 32 spaces or "password" * 4 are long
# but guessable. A random hex secret has fewer by chance once in 3e7 draws of 32 characters
# (``token_hex(16)``), once in 1e19 of 64 (``token_hex(32)``, what hora makes).
MIN_SECRET_DISTINCT = 8
_MAKE_ONE = "python3 -c 'import secrets; print(secrets.token_hex(32))' makes one"
_RULE = (
    f"a job secret needs at least {MIN_SECRET_CHARS} characters, {MIN_SECRET_DISTINCT} or more "
    "of them different and not all whitespace"
)


def job_secret(env: Mapping[str, str]) -> str:
    """The job secret from ``HORA_SECRET_KEY``, else from the file ``HORA_SECRET_FILE`` names;
    ``""`` when neither is set.

    Raises:
        TopologyError: the secret is shorter than :data:`MIN_SECRET_CHARS` or weak (fewer than
            :data:`MIN_SECRET_DISTINCT` different characters, or only whitespace); or the file
            is missing, not a regular file of this user, readable or writable by others, or
            lies in a directory that others can write.
    """
    secret = raw(table.SECRET_KEY, env) or ""
    path = raw(table.SECRET_FILE, env) or ""
    if secret:
        _check_strength(secret, table.SECRET_KEY.env)
        return secret
    if not path:
        return ""
    path = os.path.expanduser(path)
    secret = _read_secret_file(path).decode(errors="replace").strip()
    _check_strength(secret, f"HORA_SECRET_FILE={path}")
    return secret


def _check_strength(secret: str, source: str) -> None:
    """Refuse a secret that is short, or long but guessable (one character repeated, only
    whitespace, a short word repeated), with one message that says how to make a good one."""
    distinct = len(set(secret))
    if len(secret) < MIN_SECRET_CHARS:
        what = f"{len(secret)} characters"
    elif not secret.strip():
        what = f"{len(secret)} characters, all whitespace"
    elif distinct < MIN_SECRET_DISTINCT:
        what = f"{len(secret)} characters but only {distinct} different"
    else:
        return
    raise TopologyError(f"{source} holds {what}; {_RULE} ({_MAKE_ONE}).")


def _read_secret_file(path: str) -> bytes:
    """The first 4 KiB of the secret file, once it passed :func:`_check_secret_file`."""
    try:
        info = os.stat(path)
        _check_secret_file(path, info)
        with open(path, "rb") as handle:
            return handle.read(4096)
    except OSError as exc:
        raise TopologyError(
            f"HORA_SECRET_FILE={path}: cannot read it ({exc.strerror or exc}). Create it once, "
            "on a file system every rank sees, in a directory only you can write: (umask 077; "
            f"python3 -c 'import secrets; print(secrets.token_hex(32))' > {path})"
        ) from None


def _check_secret_file(path: str, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        what = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise TopologyError(
            f"HORA_SECRET_FILE={path} is {what}; it must name a file that holds the secret "
            f"({_MAKE_ONE})."
        )
    if info.st_uid != os.geteuid():
        raise TopologyError(
            f"HORA_SECRET_FILE={path} must be a file owned by this user (uid {os.geteuid()}); "
            f"it is owned by uid {info.st_uid}."
        )
    if info.st_mode & 0o077:
        raise TopologyError(
            f"HORA_SECRET_FILE={path} can be read or written by other users (mode "
            f"{stat.S_IMODE(info.st_mode):04o}): make it private with `chmod 600 {path}`, and "
            "make a new secret if others may have read it."
        )
    _check_secret_directory(path)


def _check_secret_directory(path: str) -> None:
    """The secret file's directory must be writable by its owner only: anyone else who can
    write there can plant files beside the secret (the port file hora publishes there), or in a
    directory without the sticky bit, replace the secret file itself."""
    directory = os.path.dirname(os.path.realpath(path))
    info = os.stat(directory)
    owner_ok = info.st_uid in (os.geteuid(), 0)
    if owner_ok and not info.st_mode & 0o022:
        return
    who = (
        f"belongs to uid {info.st_uid}"
        if not owner_ok
        else f"can be written by other users (mode {stat.S_IMODE(info.st_mode):04o})"
    )
    raise TopologyError(
        f"HORA_SECRET_FILE={path} lies in {directory}, which {who}: others could plant files "
        "beside the secret, such as the store's port file hora publishes there. Keep the secret "
        "in a directory only you can write, on a file system every rank sees: `mkdir -m 700 "
        f"~/.hora && mv {path} ~/.hora/secret`, then HORA_SECRET_FILE=~/.hora/secret."
    )


def _int_var(
    variable: Variable[int | None], env: Mapping[str, str], default: int | None = None
) -> int:
    try:
        value = read(variable, env)
    except SettingError as exc:
        raise TopologyError(str(exc)) from None
    if value is None:
        if default is None:
            raise TopologyError(
                f"{variable.env} is not set but other HORA_* topology variables are."
            )
        return default
    return value


def _from_hora(env: Mapping[str, str]) -> Topology | None:
    """``horarun``'s (and Horovod's) variables, or ``None`` when ``HORA_RANK`` is not set."""
    if raw(table.RANK, env) is None:
        return None
    size = _int_var(table.SIZE, env)
    local_size = _int_var(table.LOCAL_SIZE, env, default=size)
    addr = raw(table.RENDEZVOUS_ADDR, env) or raw(table.GLOO_RENDEZVOUS_ADDR, env) or ""
    port_raw = raw(table.RENDEZVOUS_PORT, env) or raw(table.GLOO_RENDEZVOUS_PORT, env) or "0"
    try:
        port = int(port_raw)
    except ValueError:
        raise TopologyError(
            f"{table.RENDEZVOUS_PORT.env} must be an integer, got {port_raw!r}."
        ) from None
    return Topology(
        rank=_int_var(table.RANK, env),
        size=size,
        local_rank=_int_var(table.LOCAL_RANK, env, default=0),
        local_size=local_size,
        cross_rank=_int_var(table.CROSS_RANK, env, default=0),
        cross_size=_int_var(table.CROSS_SIZE, env, default=1),
        hostname=raw(table.HOSTNAME, env) or socket.gethostname(),
        rendezvous_addr=addr,
        rendezvous_port=port,
        secret=job_secret(env),
        source="horarun",
    )


# ``HORA_LAUNCHER`` names the launcher whose variables to read, when hora's choice is not the one
# wanted (one launcher starting another on purpose).
LAUNCHER_NAMES = ("horarun", "torchrun", "mpi", "slurm", "env", "none")


def _hora_reading(topology: Topology, env: Mapping[str, str]) -> Reading:
    prefix = "HORA" if env.get(table.RANK.env) else "HOROVOD"
    return Reading(
        launcher="horarun",
        rank=topology.rank,
        size=topology.size,
        rank_var=f"{prefix}_RANK",
        size_var=f"{prefix}_SIZE",
        local_rank=topology.local_rank,
        local_size=topology.local_size,
        cross_rank=topology.cross_rank,
        cross_size=topology.cross_size,
        hostname=topology.hostname,
        plan=StorePlan(),
    )


def _compatible(inner: Reading, outer: Reading) -> bool:
    """Whether ``outer``'s variables can describe the launcher that started ``inner``'s process,
    or this same process.

    Launchers nest: ``srun`` starts one ``torchrun`` per node, ``mpirun`` inside an allocation
    starts its daemons with ``srun``, ``horarun`` runs inside a one-task step. The outer launcher's
    variables then count launchers, not workers, and stay in the workers' environment.
    """
    if outer.size == 1:
        return True
    if inner.launcher == "torchrun":
        # One torchrun agent per outer task; the agents rank themselves in their rendezvous.
        return outer.size == inner.group_size
    if outer.size == inner.size:
        return outer.rank == inner.rank  # both describe this very process
    # One launcher (or MPI daemon) per node, each starting this node's workers.
    return outer.one_per_node


def _disagreement(inner: Reading, outer: Reading) -> TopologyError:
    lines = [
        f"the launchers' variables in this process's environment disagree about its place in "
        f"the job (process {os.getpid()} on {socket.gethostname()}):",
        f"  {inner.launcher}: {inner.rank_var}={inner.rank}, {inner.size_var}={inner.size}",
        f"  {outer.launcher}: {outer.rank_var}={outer.rank}, {outer.size_var}={outer.size}",
        f"hora reads {inner.launcher}'s variables (the launcher that started this process) and "
        f"cannot also be rank {outer.rank} of {outer.size}.",
    ]
    if inner.launcher == "torchrun" and outer.launcher == "SLURM's srun":
        lines.append(
            f"Each of srun's {outer.size} tasks started torchrun, but torchrun's rendezvous has "
            f"{inner.group_size} node(s) (GROUP_WORLD_SIZE): several separate torchrun jobs. "
            "Start one torchrun per node with a shared rendezvous (`srun --ntasks-per-node=1 "
            "torchrun --nnodes=$SLURM_NNODES --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:29400 "
            "...`), or let srun start the workers (`srun --ntasks-per-node=N python train.py`)."
        )
    else:
        lines.append(
            f"If {outer.launcher}'s variables are left over (exported in a job script or copied "
            f"from another job), unset them ({outer.rank_var}, {outer.size_var}). If one launcher "
            "starts the other on purpose, set HORA_LAUNCHER to the one that starts the workers "
            f"({', '.join(LAUNCHER_NAMES)})."
        )
    return TopologyError("\n".join(lines))


def _from_reading(reading: Reading, env: Mapping[str, str]) -> Topology:
    if reading.size == 1:
        return Topology(hostname=reading.hostname, source=f"{reading.launcher} (1 process)")
    plan = reading.plan
    return Topology(
        rank=reading.rank,
        size=reading.size,
        local_rank=reading.local_rank if reading.local_rank is not None else 0,
        local_size=reading.local_size if reading.local_size is not None else 1,
        cross_rank=reading.cross_rank if reading.cross_rank is not None else 0,
        cross_size=reading.cross_size if reading.cross_size is not None else 1,
        hostname=reading.hostname,
        rendezvous_addr=plan.addr,
        rendezvous_port=plan.port,
        secret=job_secret(env),
        source=reading.launcher,
        store_prefix=plan.prefix,
        launch=reading,
    )


def _warn_unlaunched_slurm(env: Mapping[str, str]) -> None:
    ntasks = env.get("SLURM_NTASKS", "")
    if ntasks.isdigit() and int(ntasks) > 1 and "SLURM_JOB_ID" in env:
        logger.warning(
            "SLURM allocated %s tasks (SLURM_NTASKS=%s) but this process was not started by "
            "srun, so it runs as a job of one. Start the workers with `srun python ...`.",
            ntasks,
            ntasks,
        )


def detect(
    env: Mapping[str, str] | None = None,
    use_mpi4py: Callable[[str], bool] | None = None,
) -> Topology:
    """Work out this process's topology from the environment.

    The launcher that started the process wins: ``horarun`` (``HORA_RANK``), then torchrun
    (``TORCHELASTIC_RUN_ID``), Open MPI, MPICH/Intel MPI, MVAPICH, a SLURM step, and last
    torch.distributed's ``env://`` variables. ``HORA_LAUNCHER`` forces one. Every other
    launcher's variables that are present must fit (see :func:`_compatible`).

    Args:
        env: the variables to read (default: ``os.environ``).
        use_mpi4py: called with an MPI launcher's name; whether rank 0 may send the store's
            address with mpi4py. Default: :func:`hora.common.job.launchers.mpi4py_usable` when reading
            ``os.environ``, never for an explicit ``env``.

    Raises:
        TopologyError: the variables are malformed, incomplete or inconsistent.
    """
    source = os.environ if env is None else env
    if use_mpi4py is None:
        use_mpi4py = mpi4py_usable if env is None else _never
    forced = (raw(table.LAUNCHER, source) or "").lower()
    if forced and forced not in LAUNCHER_NAMES:
        raise TopologyError(
            f"HORA_LAUNCHER must be one of {', '.join(LAUNCHER_NAMES)}; got {forced!r}."
        )
    if forced == "none":
        return Topology(hostname=socket.gethostname(), source="single process (HORA_LAUNCHER)")
    try:
        topology, winner = _choose(source, forced, use_mpi4py)
    except LauncherError as exc:
        raise TopologyError(str(exc)) from None
    if winner is not None and not forced:
        _check_other_launchers(source, winner)
    if topology is None:
        _warn_unlaunched_slurm(source)
        topology = Topology(hostname=socket.gethostname())
    topology.validate()
    return topology


def _check_other_launchers(source: Mapping[str, str], winner: Reading) -> None:
    """Raise if another launcher's variables are present and disagree with ``winner``'s."""
    for key, reader in READERS.items():
        if key == "env" and winner.launcher == "torchrun":
            continue  # the same variables
        try:
            other = reader(source, _never)
        except LauncherError:
            continue  # malformed leftovers of another launcher cannot be compared
        if (
            other is not None
            and other.launcher != winner.launcher
            and not _compatible(winner, other)
        ):
            raise _disagreement(winner, other)


def _never(_launcher: str) -> bool:
    return False


def _same_process_step(env: Mapping[str, str]) -> Reading | None:
    """The SLURM step's reading when srun itself started this MPI rank, else ``None``."""
    from hora.common.job.launchers import mpi_identity, read_slurm

    identity = mpi_identity(env)
    if identity is None:
        return None
    launcher, (rank_var, size_var), _, _ = identity
    try:
        slurm = read_slurm(env)
    except LauncherError:
        return None
    if slurm is not None and (env.get(rank_var), env.get(size_var)) == (
        str(slurm.rank),
        str(slurm.size),
    ):
        return slurm
    return None


def _choose(
    env: Mapping[str, str], forced: str, use_mpi4py: Callable[[str], bool]
) -> tuple[Topology | None, Reading | None]:
    if forced in ("", "horarun"):
        hora = _from_hora(env)
        if hora is not None:
            return hora, _hora_reading(hora, env)
        if forced:
            raise TopologyError("HORA_LAUNCHER=horarun but HORA_RANK is not set.")
    for key, reader in READERS.items():
        if forced and key != forced:
            continue
        if key == "mpi" and not forced:
            # srun --mpi=pmi2/pmix starts MPI ranks itself: its own variables say more (node
            # index, tasks per node, the node list) than the PMI ones.
            slurm = _same_process_step(env)
            if slurm is not None:
                return _from_reading(slurm, env), slurm
        reading = reader(env, use_mpi4py)
        if reading is not None:
            logger.debug("topology from %s: %s", reading.launcher, reading.plan.how)
            return _from_reading(reading, env), reading
        if forced:
            raise TopologyError(
                f"HORA_LAUNCHER={forced} but that launcher's variables are not set."
            )
    return None, None
