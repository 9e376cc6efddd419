"""Which communicators a job's process sets get, made in one place.

The engine asks for a communicator per process set (and one for its control plane) through the
factories made here: Gloo groups built on the job's store, or MPI communicators made from the
job's MPI communicator (``HORA_CPU_OPERATIONS=mpi``), and for CUDA tensors NCCL groups
(``HORA_GPU_OPERATIONS=nccl``). Gloo and NCCL groups prove the job secret over their own
connections before they are used. This module also finds the job's MPI communicator, and the
place of a process in a job made of part of an MPI job (``hvd.init(comm=...)``).

Before any of them is made, every rank checks through the store that the ranks hold the same
values of the settings that choose these paths, and of those the engine of every rank must
apply alike (:func:`agree_on_settings`): ranks that went different ways would wait for each
other in vain.

It knows settings, the store and the transports; not the engine's cycle or tensors' contents.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING

from hora.common.job.launchers import mpi_identity
from hora.common.job.store import AuthenticationError, StoreClient, tampering
from hora.common.job.store_keys import GenerationKeys, ScopeKeys
from hora.common.job.store_protocol import StoreWaitEnded
from hora.common.job.topology import Topology
from hora.common.process_sets import is_mpi_communicator
from hora.common.transport import (
    Communicator,
    CommunicatorFactory,
    DeviceCommunicatorFactory,
    TransportError,
    prove_peers,
)
from hora.common.vocabulary import settings_table as table
from hora.common.vocabulary.config import (
    AGREED_SETTINGS,
    SettingError,
    Settings,
    cpu_operations,
    gloo_interface,
)
from hora.common.vocabulary.errors import HoraInternalError

if TYPE_CHECKING:
    from typing import TypeAlias

    import torch
    from mpi4py import MPI

    from hora.common.transport.mpi import MPILibrary

    # What ``hvd.init(comm=...)`` takes: an mpi4py communicator, or ``MPI_COMM_WORLD`` ranks.
    JobComm: TypeAlias = "MPI.Intracomm | Sequence[int]"

logger = logging.getLogger("hora")


def cpu_communicators(
    topology: Topology,
    settings: Settings,
    store: StoreClient,
    mpi_comm: MPI.Intracomm | None = None,
) -> CommunicatorFactory:
    """Builds the communicators of the job's process sets and of its control plane.

    With ``HORA_CPU_OPERATIONS=mpi`` every one of them is an MPI communicator of its own, made
    from ``mpi_comm`` (the job's); otherwise a Gloo group built on the store. The negotiation
    moves to MPI with the data: every rank is in the job's communicator anyway, its small
    messages then take the MPI library's fastest path (shared memory, the fabric), and the job
    opens no Gloo connections at all. Its own communicator keeps it apart from the data.
    """
    if settings.cpu_operations == "mpi":
        # mpi_library and mpi_job_comm made the job's communicator: MPI carries the data.
        assert mpi_comm is not None
        return _mpi_factory(topology, settings, store, mpi_comm)
    from hora.common.transport.gloo import GlooCommunicator, make_device, raise_open_file_limit

    old, new = raise_open_file_limit()
    if new != old:
        logger.debug("rank %d raised its open-file limit from %d to %d", topology.rank, old, new)
    interface = gloo_interface()
    bind = "127.0.0.1" if topology.all_local and not interface else ""
    device = make_device(bind, interface)

    def gloo(scope: str, rank: int, size: int) -> Communicator:
        comm = GlooCommunicator(
            store.scoped(scope),
            rank,
            size,
            settings.gloo_timeout_s,
            device,
            give_up=store.wait_ender(),
        )
        return _proved(comm, store, scope)

    if not settings.shared_memory:
        return gloo
    from hora.common.transport.paths import PathChooser

    return PathChooser(topology, settings, store, gloo).communicator


def _proved(comm: Communicator, store: StoreClient, scope: str) -> Communicator:
    """``comm`` once its members proved to each other that they hold the job secret (see
    :func:`hora.common.transport.prove_peers`); aborted, and the error raised, if not."""
    try:
        prove_peers(comm, store.secret, scope)
    except TransportError:
        comm.abort()
        raise
    return comm


def gpu_communicators(settings: Settings, store: StoreClient) -> DeviceCommunicatorFactory | None:
    """Builds the NCCL communicators that move CUDA tensors (``HORA_GPU_OPERATIONS=nccl``), or
    ``None`` where CUDA tensors go through host memory (``host``, or a torch without NCCL).

    The factory returns ``None`` for a set whose members share a GPU (NCCL needs one per
    member): that set's CUDA tensors go through host memory, as every member learns from the
    same exchange. Each group proves the job secret over its own connections once it is made,
    as Gloo's do.
    """
    from hora.common.transport.nccl import (
        NCCLCommunicator,
        gpu_identity,
        nccl_compiled,
        shared_gpus,
    )

    if settings.gpu_operations != "nccl" or not nccl_compiled():
        return None
    from hora.common.engine.steady import steady_batch_timeout_s

    longest_s = steady_batch_timeout_s(settings)

    def factory(scope: str, rank: int, size: int, device: torch.device) -> Communicator | None:
        keys = ScopeKeys(scope)
        store.set_signed(keys.gpu_of(rank), gpu_identity(device).encode())
        try:
            identities = [store.get_signed(keys.gpu_of(r)).decode() for r in range(size)]
        except RuntimeError as exc:
            raise TransportError(f"the members of {scope} did not all arrive: {exc}") from exc
        shared = shared_gpus(identities)
        if shared:
            if rank == 0:
                logger.warning(
                    "members %s of a process set share a GPU; NCCL needs one GPU per process, "
                    "so that set's CUDA tensors go through host memory. Pin each process to its "
                    "own GPU (torch.cuda.set_device(hvd.local_rank())) to use NCCL.",
                    "; ".join(str(group) for group in shared),
                )
            return None
        comm = NCCLCommunicator(
            store.scoped(scope), rank, size, settings.gloo_timeout_s, device, longest_s
        )
        return _proved(comm, store, scope)

    return factory


def _mpi_factory(
    topology: Topology, settings: Settings, store: StoreClient, job_comm: MPI.Intracomm
) -> CommunicatorFactory:
    """MPI communicators: a duplicate of the job's for a set of every rank (the control plane
    and the global set), else a group of it made by the members alone.

    The members of a smaller set learn each other's ranks through the store (the factory is
    given only this process's place in the set), then call ``MPI_Comm_create_group``. Nothing is
    proved with the job secret here, unlike over Gloo: MPI's connections are made by the MPI
    library among the processes its launcher started, and no port of hora's is open to them.
    """
    from hora.common.transport.mpi import MPICommunicator, import_mpi

    mpi = import_mpi()

    def factory(scope: str, rank: int, size: int) -> Communicator:
        members = None
        if size != topology.size:
            keys = ScopeKeys(scope)
            store.set_signed(keys.mpi_member(rank), str(topology.rank).encode())
            try:
                members = [int(store.get_signed(keys.mpi_member(r))) for r in range(size)]
            except RuntimeError as exc:
                raise TransportError(f"the members of {scope} did not all arrive: {exc}") from exc
        return MPICommunicator.of(job_comm, members, settings.gloo_timeout_s, mpi)

    return factory


def mpi_library(comm: JobComm | None, topology: Topology, settings: Settings) -> MPILibrary | None:
    """mpi4py's ``MPI`` module when MPI plays a part (``comm`` given, or MPI carries the data),
    once it is clear that this job can use it; ``None`` when MPI plays no part. It makes no
    communicator, so a rank may call it before it joins the job (and refuse early).

    Raises:
        ValueError: MPI is asked for but is not available, or ``comm`` does not fit the job.
    """
    if comm is None and settings.cpu_operations != "mpi":
        return None
    why = "hvd.init(comm=...)"
    if comm is None:
        why = f"{cpu_operations()[1] or table.CPU_OPERATIONS.env}=mpi"
    launched_by_mpi = mpi_identity(os.environ) is not None
    if not launched_by_mpi and (topology.size > 1 or comm is not None):
        raise ValueError(
            f"{why} needs a job started by MPI's launcher, but {topology.source} started this "
            f"one. Start it with `mpirun -np N python train.py` or `horarun --mpi -np N python "
            "train.py`, or use Gloo (HORA_CPU_OPERATIONS=gloo, horarun --gloo)."
        )
    from hora.common.transport.mpi import import_mpi

    try:
        mpi = import_mpi()
    except TransportError as exc:
        raise ValueError(f"{why}: {exc}") from None
    world = mpi.COMM_WORLD
    if launched_by_mpi and world.Get_size() != topology.size:
        raise ValueError(
            f"{why}: {topology.source} started {topology.size} processes, but mpi4py's "
            f"MPI_COMM_WORLD has {world.Get_size()}: mpi4py is built for another MPI than the "
            "one that launched the job. Install mpi4py for this MPI (pip install mpi4py builds "
            "it against the mpicc on PATH), or set HORA_CPU_OPERATIONS=gloo."
        )
    if comm is not None and not is_mpi_communicator(comm):
        ranks = [int(r) for r in comm]
        if world.Get_rank() not in ranks:
            raise ValueError(
                f"hvd.init(comm={ranks}): this process (MPI_COMM_WORLD rank "
                f"{world.Get_rank()}) is not one of the listed ranks; only they call hvd.init "
                "with this list."
            )
    return mpi


def mpi_job_comm(comm: JobComm | None, mpi: MPILibrary | None) -> MPI.Intracomm | None:
    """The job's MPI communicator: ``comm`` (an mpi4py communicator, or world ranks), or
    ``MPI_COMM_WORLD`` when MPI carries the data; ``None`` when MPI plays no part (``mpi`` is
    :func:`mpi_library`'s answer). Collective: every rank of ``comm`` (or of the world) calls
    it at the same point, so a rank that took another path would leave the others waiting."""
    if mpi is None:
        return None
    world = mpi.COMM_WORLD
    if comm is None:
        return world.Dup()
    if is_mpi_communicator(comm):
        return comm.Dup()
    group = world.Get_group().Incl([int(r) for r in comm])
    made = world.Create_group(group)
    group.Free()
    return made


def sub_job(topology: Topology, job_comm: MPI.Intracomm) -> Topology:
    """The topology of a job that is ``job_comm``'s processes, a part of the MPI job: ranks
    are the communicator's; local ranks come from the exchange of host names; the store is
    hosted by its rank 0 and handed out over it (joining with mpi4py)."""
    launch = topology.launch
    if launch is None or not launch.plan.mpi4py:
        raise ValueError(
            "hvd.init(comm=...) hands out the job's store over that communicator with mpi4py: "
            "unset HORA_MPI4PY=0 and start the job with mpirun/mpiexec."
        )
    rank, size = job_comm.Get_rank(), job_comm.Get_size()
    if size == topology.size:
        return topology
    plan = replace(launch.plan, host=rank == 0, port=0, job_id=f"{launch.plan.job_id}/comm")
    # Every process of the MPI job on this host: so is every process of this part of it.
    all_local = launch.local_size is not None and launch.local_size == launch.size
    reading = replace(
        launch,
        rank=rank,
        size=size,
        local_rank=None,
        local_size=size if all_local else None,
        cross_rank=None,
        cross_size=None,
        plan=plan,
    )
    return replace(topology, rank=rank, size=size, launch=reading)


# ---------------------------------------------------------------- settings every rank shares

# A message lists this many ranks that hold one value, then says how many more.
_LISTED_RANKS = 8
# How much longer than rank 0 the others wait for its verdict once it arrived: rank 0 may itself
# wait, up to the same limit, for a rank that never comes, and then names that rank.
_VERDICT_GRACE_S = 5.0


def agree_on_settings(
    topology: Topology,
    settings: Settings,
    store: StoreClient,
    keys: GenerationKeys,
    timeout_s: float,
) -> None:
    """Stop ``init`` on every rank at once when the ranks hold different values of a setting
    they must share (a variable declared ``agreed``: shared memory and its sizes, the data
    paths, fusion, the response cache, the steady state). Left alone, such ranks would choose
    different paths for one process set, or plan different collectives, and wait for each
    other in vain until an unrelated timeout (or, with different fusion thresholds, reduce
    buffers that do not match).

    Every rank publishes its values. Rank 0 waits for all of them (one wait, one read of every
    key), compares them and publishes its verdict, which the other ranks read: O(size) store
    operations in all, and the same error on every rank as soon as the last one arrives.

    Args:
        keys: the generation's keys (an elastic round's store has a prefix of its own).
        timeout_s: how long rank 0 waits for the others, and they for rank 0.

    Raises:
        SettingError: the values differ; the message names each variable, rank 0's value and
            the ranks that hold another.
        HoraInternalError: a rank did not arrive within ``timeout_s`` (the message names it), or
            the store holds a value this job did not write.
    """
    if topology.size == 1:
        return
    mine = {name: getattr(settings, name) for name in AGREED_SETTINGS}
    store.set_signed(keys.settings(topology.rank), json.dumps(mine).encode())
    try:
        if topology.rank == 0:
            verdict = _judge(store, keys, topology.size, timeout_s)
            store.set_signed(keys.settings_verdict(), json.dumps(verdict).encode())
        else:
            verdict = _verdict_of_rank_0(store, keys, topology.rank, timeout_s)
    except AuthenticationError as exc:
        raise HoraInternalError(tampering(exc, topology.rank)) from None
    if verdict["differ"]:
        raise SettingError(verdict["differ"])
    if verdict["missing"]:
        raise HoraInternalError(verdict["missing"])


def _judge(store: StoreClient, keys: GenerationKeys, size: int, timeout_s: float) -> dict[str, str]:
    """Rank 0: every rank's values compared (``differ``), or the ranks that did not publish
    theirs in time (``missing``)."""
    names = [keys.settings(r) for r in range(size)]
    try:
        store.store.wait([store.key(name) for name in names], timedelta(seconds=timeout_s))
    except StoreWaitEnded:
        raise  # the elastic round was lost: nobody is late, and nothing is to be judged
    except RuntimeError:
        missing = [r for r, name in enumerate(names) if not store.check(name)]
        if not missing:
            raise
        whose = "its" if len(missing) == 1 else "their"
        return {
            "differ": "",
            "missing": f"rank 0 waited {timeout_s:g} s for {_ranks(missing)} to reach "
            "hvd.init(), to compare the settings every rank must share. Check "
            f"{whose} output; raise {table.START_TIMEOUT.env} if start-up is slow.",
        }
    blobs = store.store.multi_get([store.key(name) for name in names])
    values = [json.loads(store.verified(name, bytes(blob))) for name, blob in zip(names, blobs)]
    return {"differ": differences(values), "missing": ""}


def _verdict_of_rank_0(
    store: StoreClient, keys: GenerationKeys, rank: int, timeout_s: float
) -> dict[str, str]:
    name = keys.settings_verdict()
    if store.wait(name, timeout_s):
        return dict(json.loads(store.get_signed(name)))
    if not store.check(keys.settings(0)):
        why = f"rank {rank} waited {timeout_s:g} s for rank 0 to reach hvd.init()"
    elif store.wait(name, timeout_s + _VERDICT_GRACE_S):
        # Rank 0 arrived late and waited for the others: its verdict says who did not come.
        return dict(json.loads(store.get_signed(name)))
    else:
        why = f"rank {rank} waited {2 * timeout_s + _VERDICT_GRACE_S:g} s for rank 0's verdict"
    return {
        "differ": "",
        "missing": f"{why}, to compare the settings every rank must share. Check its output; "
        f"raise {table.START_TIMEOUT.env} if start-up is slow.",
    }


def differences(values: list[dict[str, object]]) -> str:
    """What the ranks' values of the settings they must share (``values[r]``: rank ``r``'s)
    disagree on, one line per variable, and what to do; ``""`` when they agree.

    Example:
        >>> differences([{"shared_memory": True}, {"shared_memory": False}])[:74]
        'HORA_SHARED_MEMORY differs across ranks: rank 0 has 1, rank 1 has 0. Set it'
    """
    lines = []
    for name, variable in AGREED_SETTINGS.items():
        reference = values[0].get(name)
        others: dict[str, list[int]] = {}
        for rank, seen in enumerate(values):
            if seen.get(name) != reference:
                others.setdefault(_shown(seen.get(name)), []).append(rank)
        if others:
            held = [f"{_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} {value}"
                    for value, ranks in others.items()]  # fmt: skip
            lines.append(
                f"{variable.names} differs across ranks: rank 0 has {_shown(reference)}, "
                f"{', '.join(held)}."
            )
    if not lines:
        return ""
    them = "it" if len(lines) == 1 else "them"
    advice = (
        f"Set {them} the same on every rank: horarun passes the launcher's environment to every "
        f"rank, so look for a wrapper script or a launcher option that sets {them} for some "
        "ranks only."
    )
    return (" " if len(lines) == 1 else "\n").join([*lines, advice])


def _shown(value: object) -> str:
    """A setting's value as its variable is written (``1`` for true)."""
    if value is None:
        return "it unset"
    if isinstance(value, bool):
        return str(int(value))
    return str(value)


def _ranks(ranks: list[int]) -> str:
    """``rank 2``, ``ranks 1, 3``, ``ranks 1, 2, ..., 8 and 92 more``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    listed = ", ".join(map(str, ranks[:_LISTED_RANKS]))
    more = len(ranks) - _LISTED_RANKS
    return f"ranks {listed}" + (f" and {more} more" if more > 0 else "")
