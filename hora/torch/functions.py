"""Helpers that move Python objects and model state between ranks.

Objects are serialized with cloudpickle and signed with the job's secret before they leave the
sender; receivers verify the signature before unpickling, so bytes that did not come from a
process of this job are never unpickled.
"""

from __future__ import annotations

import itertools
from typing import Any

import cloudpickle
import torch

from hora.common import basics
from hora.common.process_sets import ProcessSet
from hora.common.rendezvous import sign, verify
from hora.torch import ops


def _secret() -> str:
    return basics.topology().secret


_calls = itertools.count()


def _default_name(kind: str) -> str:
    # Horovod names the tensors after type(obj), so a root passing a dict and other ranks
    # passing None never match and the job stalls. A per-process call counter matches as long
    # as every rank calls the helpers in the same order, which they must anyway.
    return f"{kind}.{next(_calls)}"


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = ops.global_process_set,
) -> Any:
    """Send a picklable object from ``root_rank`` to every rank and return it everywhere.

    Example:
        >>> config = hvd.broadcast_object(config if hvd.rank() == 0 else None, root_rank=0)
    """
    name = name or _default_name("broadcast_object")
    if basics.rank() == root_rank:
        payload = sign(_secret(), cloudpickle.dumps(obj))
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        data = None
        length = torch.zeros(1, dtype=torch.int64)
    length = ops.broadcast_(length, root_rank, name=f"{name}.sz", process_set=process_set)
    if data is None:
        data = torch.zeros(int(length.item()), dtype=torch.uint8)
    data = ops.broadcast_(data, root_rank, name=f"{name}.t", process_set=process_set)
    if basics.rank() == root_rank:
        return obj
    blob = verify(_secret(), data.numpy().tobytes(), what="broadcast object")
    return cloudpickle.loads(blob)


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet = ops.global_process_set
) -> list[Any]:
    """Gather a picklable object from every rank; returns the list in rank order.

    Example:
        >>> counts = hvd.allgather_object(len(my_shard))
    """
    name = name or _default_name("allgather_object")
    payload = sign(_secret(), cloudpickle.dumps(obj))
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    sizes = ops.allgather(
        torch.tensor([data.numel()], dtype=torch.int64), name=f"{name}.sz", process_set=process_set
    )
    gathered = ops.allgather(data, name=f"{name}.t", process_set=process_set)
    objects = []
    offset = 0
    raw = gathered.numpy().tobytes()
    for size in sizes.tolist():
        blob = verify(_secret(), raw[offset : offset + size], what="gathered object")
        objects.append(cloudpickle.loads(blob))
        offset += size
    return objects
