"""SLURM's ``srun``: its variables read into a :class:`~hora.common.job.launcher_reading.Reading`,
and the formats SLURM writes them in.

:func:`read_slurm` reads a task of a job step: rank and size, local rank, the node, the tasks on
each node (:func:`expand_tasks_per_node`: ``2(x3),1``), the cross rank and size worked out from
them (:func:`cross_from_counts`), and where the step's store is: the first node of the step's host
list (:func:`expand_hostlist`: ``node[01-03]``) unless the address is given. Choosing ``srun``
over another launcher is :mod:`hora.common.job.topology`'s job.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping

from hora.common.job.launcher_reading import (
    LauncherError,
    Reading,
    StorePlan,
    derived_port,
    explicit_address,
    explicit_port,
    integer_variable,
)

_HOSTLIST_TOKEN = re.compile(r"([^\[\],]*)(\[[^\]]*\])?")


def expand_hostlist(text: str) -> list[str]:
    """Expand a SLURM host list such as ``node[01-03,07],gpu[1-2]-ib`` into host names.

    Handles comma-separated items, bracketed ranges with zero padding, and several bracket groups
    in one name (``rack[1-2]-node[1-2]`` gives four names, in SLURM's order). The same as
    ``scontrol show hostnames``, without needing SLURM's tools on the path. (The ``python-hostlist``
    package does this too, but it is GPL-2.0+, and hora is Apache-2.0.)

    Raises:
        LauncherError: the list is empty or malformed.
    """
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        hosts.extend(_expand_item(item, text))
    if not hosts:
        raise LauncherError(f"empty SLURM host list {text!r}.")
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item]


def _expand_item(item: str, whole: str) -> list[str]:
    names = [""]
    pos = 0
    while pos < len(item):
        match = _HOSTLIST_TOKEN.match(item, pos)
        if match is None or match.end() == pos:
            raise LauncherError(f"cannot parse SLURM host list {whole!r} near {item[pos:]!r}.")
        prefix, bracket = match.group(1), match.group(2)
        names = [name + prefix for name in names]
        if bracket:
            values = _expand_ranges(bracket[1:-1], whole)
            names = [name + value for name in names for value in values]
        pos = match.end()
    return names


def _expand_ranges(body: str, whole: str) -> list[str]:
    values: list[str] = []
    for part in body.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise LauncherError(f"cannot parse range {part!r} in SLURM host list {whole!r}.")
        if not dash:
            values.append(low)
            continue
        width = len(low)
        if int(high) < int(low):
            raise LauncherError(f"range {part!r} runs backwards in SLURM host list {whole!r}.")
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def expand_tasks_per_node(text: str) -> list[int]:
    """Expand SLURM's ``2(x3),1`` (tasks on each node, in node order) into ``[2, 2, 2, 1]``.

    Raises:
        LauncherError: the text is malformed.
    """
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise LauncherError(f"cannot parse SLURM tasks per node {text!r} near {part!r}.")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def cross_from_counts(counts: list[int], node: int, local_rank: int) -> tuple[int, int]:
    """Horovod's cross rank and size from the number of processes on each node.

    The cross rank is this node's index among the nodes that run a process with this local rank.
    """
    cross_rank = sum(1 for count in counts[:node] if count > local_rank)
    cross_size = sum(1 for count in counts if count > local_rank)
    return cross_rank, cross_size


def read_slurm(env: Mapping[str, str]) -> Reading | None:
    """A task of a SLURM job step (``srun``): present when ``SLURM_STEP_ID`` and ``SLURM_PROCID``
    are set. The batch script itself (no step) is not a SLURM launch.

    The store runs on the step's first node (the task with ``SLURM_NODEID=0``, ``SLURM_LOCALID=0``)
    at that node's name from ``SLURM_STEP_NODELIST``, on a port derived from the job and step ids,
    unless ``HORA_RENDEZVOUS_ADDR``/``MASTER_ADDR`` and ``HORA_RENDEZVOUS_PORT``/``MASTER_PORT``
    say otherwise (then global rank 0 starts it, as torch.distributed's ``env://`` does).
    """
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", ""))
    if not step or "SLURM_PROCID" not in env:
        return None
    launcher = "SLURM's srun"
    rank = integer_variable(env, "SLURM_PROCID", launcher)
    size_var = next(
        (n for n in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") if env.get(n)),
        "SLURM_STEP_NUM_TASKS",
    )
    size = integer_variable(env, size_var, launcher)
    local_rank = integer_variable(env, "SLURM_LOCALID", launcher)
    node = integer_variable(env, "SLURM_NODEID", launcher)
    counts = _tasks_per_node(env, node, size, size_var)
    cross_rank, cross_size = cross_from_counts(counts, node, local_rank)
    job_id = f"slurm-{env.get('SLURM_JOB_ID', env.get('SLURM_JOBID', ''))}.{step}"
    plan = _store_plan(env, rank, node == 0 and local_rank == 0, len(counts), job_id)
    return Reading(
        launcher=launcher,
        rank=rank,
        size=size,
        rank_var="SLURM_PROCID",
        size_var=size_var,
        local_rank=local_rank,
        local_size=counts[node],
        cross_rank=cross_rank,
        cross_size=cross_size,
        hostname=env.get("SLURMD_NODENAME") or socket.gethostname(),
        plan=plan,
        one_per_node=all(count == 1 for count in counts),
    )


def _tasks_per_node(env: Mapping[str, str], node: int, size: int, size_var: str) -> list[int]:
    """The tasks on each node of the step, in node order, checked against the node and size.

    Raises:
        LauncherError: the counts are malformed, name too few nodes, or do not add up to the size.
    """
    counts_text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    counts = expand_tasks_per_node(counts_text) if counts_text else [size]
    if node >= len(counts):
        raise LauncherError(
            f"SLURM_NODEID={node} but SLURM_STEP_TASKS_PER_NODE={counts_text!r} lists only "
            f"{len(counts)} nodes."
        )
    if sum(counts) != size:
        raise LauncherError(
            f"SLURM_STEP_TASKS_PER_NODE={counts_text!r} adds up to {sum(counts)} tasks but "
            f"{size_var}={size}."
        )
    return counts


def _store_plan(
    env: Mapping[str, str], rank: int, first_task: bool, nodes: int, job_id: str
) -> StorePlan:
    """Where the step's store is: the address given (global rank 0 starts it), else loopback on
    a one-node step or the first host of the step's node list (the first node's first task
    starts it); the port given, else derived from the job and step ids.

    Raises:
        LauncherError: a port given is not one, or a step of several nodes has no node list.
    """
    nodelist_var = next(
        (n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(n)),
        "",
    )
    addr, addr_var = explicit_address(env)
    port, port_var = explicit_port(env)
    if addr:
        host, how = rank == 0, f"{addr_var}={addr}"
    else:
        host = first_task
        if nodes == 1:
            addr, how = "127.0.0.1", "loopback (a one-node step)"
        elif nodelist_var:
            addr = expand_hostlist(env[nodelist_var])[0]
            how = f"the first host of {nodelist_var}={env[nodelist_var]}"
        else:
            raise LauncherError(
                "this SLURM step spans several nodes but SLURM_STEP_NODELIST is not set: set "
                "MASTER_ADDR to the first node's name and MASTER_PORT to a free port."
            )
    derived = port is None
    if port is None:
        port, port_var = derived_port(job_id), f"derived from job {job_id}"
    return StorePlan(
        addr=addr,
        port=port,
        host=host,
        job_id=job_id,
        derived=derived,
        how=f"a store on {addr}:{port} ({how}; port {port_var})",
    )
