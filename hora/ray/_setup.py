"""Setting hora up on a group of Ray workers, shared by the Ray Train backend and RayExecutor.

For each start of a job (a Ray Train worker group, or :meth:`RayExecutor.start`):

1. every worker says where it runs (Ray node id and address, host name);
2. ranks follow the group's order; local ranks number the workers of one node in rank order, and
   cross ranks number the workers with the same local rank (Horovod's definitions);
3. rank 0's worker makes a fresh job secret and starts hora's store service with it, listening
   on ``127.0.0.1`` when every worker is on one node, else on rank 0's node address
   (``ray.util.get_node_ip_address()``), never on every interface; it seals one copy of the
   secret to each worker's public key, so the driver and Ray only ever carry sealed copies
   (:mod:`hora.ray._worker`);
4. every worker gets its ``HORA_*`` variables (and the ``HOROVOD_*`` twins of the topology
   ones), so the user's function only calls ``hvd.init()``.

A new start (Ray Train restarting after a failure, or a resize) gets new workers, a new store,
a new port and a new secret: nothing of an earlier attempt can be read or written by the new one.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hora.common.vocabulary import settings_table as table
from hora.ray import _worker
from hora.runner.hosts import Slot

logger = logging.getLogger("hora.ray")

LOOPBACK = "127.0.0.1"


# One rank's place in the job: the same record (and variables) as horarun's.
Placement = Slot


def place(nodes: Sequence[str], hostnames: Sequence[str] | None = None) -> list[Placement]:
    """Ranks, local ranks and cross ranks for workers on ``nodes`` (one node key per rank).

    Workers of one node need not be adjacent in rank order (Horovod's definitions hold either
    way): a node's local ranks count its workers in rank order, and a worker's cross rank counts
    the workers before it with the same local rank.

    Example:
        >>> [(p.local_rank, p.cross_rank) for p in place(["a", "b", "a"])]
        [(0, 0), (0, 1), (1, 0)]
    """
    size = len(nodes)
    names = list(hostnames) if hostnames is not None else list(nodes)
    per_node: dict[str, int] = {}
    local_ranks = []
    for node in nodes:
        local_ranks.append(per_node.get(node, 0))
        per_node[node] = local_ranks[-1] + 1
    cross_count: dict[int, int] = {}
    cross_ranks = []
    for local_rank in local_ranks:
        cross_ranks.append(cross_count.get(local_rank, 0))
        cross_count[local_rank] = cross_ranks[-1] + 1
    return [
        Placement(
            rank=rank,
            size=size,
            local_rank=local_ranks[rank],
            local_size=per_node[nodes[rank]],
            cross_rank=cross_ranks[rank],
            cross_size=cross_count[local_ranks[rank]],
            hostname=names[rank],
        )
        for rank in range(size)
    ]


@dataclass
class Options:
    """What every worker of the job gets besides its topology.

    Attributes:
        timeout_s: how long ``hvd.init()`` waits for the other workers and the store
            (``HORA_START_TIMEOUT``), and how long store operations may block.
        env: more variables for every worker (settings such as ``HORA_FUSION_THRESHOLD``).
    """

    timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)


class Group:
    """The few things hora needs from a group of Ray workers (a Train worker group, or actors).

    Subclasses implement :meth:`call_all` (the same call on every worker, results in rank
    order), :meth:`call_each` (one call per rank, each with its own arguments) and
    :meth:`call_one` (one rank).
    """

    def __len__(self) -> int:
        raise NotImplementedError

    def call_all(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None
    ) -> list[Any]:
        raise NotImplementedError

    def call_each(
        self, fn: Callable[..., Any], args_per_rank: Sequence[tuple[Any, ...]]
    ) -> list[Any]:
        raise NotImplementedError

    def call_one(
        self, rank: int, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None
    ) -> Any:
        raise NotImplementedError


@dataclass
class Rendezvous:
    """A started job: where its store is (hosted by rank 0's worker) and how to close it."""

    token: str
    address: str
    port: int
    placements: list[Placement]
    infos: list[dict[str, Any]]


def start(
    group: Group,
    options: Options,
    nodes: Sequence[str] | None = None,
    infos: list[dict[str, Any]] | None = None,
) -> Rendezvous:
    """Set hora up on every worker of ``group`` (see the module's description).

    Args:
        group: the workers, in rank order.
        options: timeout and extra variables.
        nodes: one node key per rank that defines "same host" (default: the Ray node ids).
        infos: what :func:`hora.ray._worker.describe` returned on each worker, if known.
    """
    size = len(group)
    if infos is None:
        infos = group.call_all(_worker.describe)
    if nodes is None:
        nodes = [info["node_id"] for info in infos]
    placements = place(list(nodes), [info["hostname"] for info in infos])
    one_node = len(set(nodes)) == 1
    address = LOOPBACK if one_node else infos[0]["node_ip"]
    token = uuid.uuid4().hex
    keys = [info["public_key"] for info in infos]
    port, sealed = group.call_one(
        0, _worker.host_rendezvous, token, address, keys, options.timeout_s
    )
    common = {k: v for k, v in options.env.items() if k != table.SECRET_KEY.env}
    common.update(
        {
            table.RENDEZVOUS_ADDR.env: address,
            table.RENDEZVOUS_PORT.env: str(port),
            table.START_TIMEOUT.env: f"{options.timeout_s:g}",
        }
    )
    group.call_each(
        _worker.set_env,
        [({**common, **p.env()}, _worker.STALE_VARS, box) for p, box in zip(placements, sealed)],
    )
    logger.debug(
        "hora set up on %d Ray workers; store on rank 0's worker at %s:%d", size, address, port
    )
    return Rendezvous(token, address, port, placements, infos)


def stop(group: Group, rendezvous: Rendezvous | None, timeout_s: float) -> None:
    """``hvd.shutdown()`` on every worker still alive, then close the store.

    Best effort: a dead worker, or one stuck past ``timeout_s``, is left to Ray, which ends the
    worker processes next.
    """
    try:
        group.call_all(_worker.shutdown_hora, timeout_s=timeout_s)
    except Exception as exc:  # a crashed worker is why the group is stopping
        logger.debug("hvd.shutdown() did not finish on every Ray worker: %s", exc)
    if rendezvous is not None:
        try:
            group.call_one(0, _worker.close_rendezvous, rendezvous.token, timeout_s=timeout_s)
        except Exception as exc:  # rank 0's worker may be gone with its store
            logger.debug("could not close the store on rank 0's worker: %s", exc)


def settings_env(
    *,
    fusion_threshold: int | None = None,
    cycle_time_ms: float | None = None,
    timeline_filename: str | None = None,
    stall_check_time_s: float | None = None,
    nics: str | Sequence[str] | None = None,
    log_level: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """``HORA_*`` variables for the engine settings that are set (``None`` keeps the default)."""
    env: dict[str, str] = {}
    if fusion_threshold is not None:
        env[table.FUSION_THRESHOLD.env] = str(int(fusion_threshold))
    if cycle_time_ms is not None:
        env[table.CYCLE_TIME.env] = f"{float(cycle_time_ms):g}"
    if timeline_filename:
        env[table.TIMELINE.env] = str(timeline_filename)
    if stall_check_time_s is not None:
        env[table.STALL_CHECK_TIME_SECONDS.env] = f"{float(stall_check_time_s):g}"
    if nics:
        names = [nics] if isinstance(nics, str) else sorted(nics)
        if len(names) != 1:
            raise ValueError(
                f"nics={nics!r}: hora's Gloo transport uses one network interface; name one "
                "(the one every node reaches the others through)."
            )
        env[table.GLOO_IFACE.env] = names[0]
    if log_level:
        env[table.LOG_LEVEL.env] = str(log_level).upper()
    for key, value in (extra or {}).items():
        env[str(key)] = str(value)
    return env
