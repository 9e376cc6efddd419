"""Python objects between ranks, for every framework adapter: ``broadcast_object`` and
``allgather_object``.

Objects are serialized with cloudpickle and signed with the job's secret before they leave the
sender; receivers verify the signature before unpickling, so bytes that did not come from a
process of this job are never unpickled. The bytes travel as uint8 tensors through
:mod:`hora.common.ops.collectives`.
"""

from __future__ import annotations

from typing import TypeVar, cast

import cloudpickle
import torch

from hora.common import basics
from hora.common.job.store import sign, verify
from hora.common.ops import collectives
from hora.common.process_sets import ProcessSet, global_process_set
from hora.common.runtime import session

T = TypeVar("T")


def _broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str, process_set: ProcessSet
) -> torch.Tensor:
    handle = collectives.broadcast_async(tensor, root_rank, name, process_set, in_place=True)
    return cast(torch.Tensor, collectives.synchronize(handle))


def _allgather(tensor: torch.Tensor, name: str, process_set: ProcessSet) -> torch.Tensor:
    handle = collectives.allgather_async([tensor], name, process_set, False)
    return cast(torch.Tensor, collectives.synchronize(handle))


def _secret() -> str:
    return basics.topology().secret


def _default_name(kind: str) -> str:
    # Horovod names the tensors after type(obj), so a root passing a dict and other ranks
    # passing None never match and the job stalls. A per-session call counter matches as long
    # as every rank calls the helpers in the same order, which they must anyway.
    return f"{kind}.{next(session().object_calls)}"


def broadcast_object(
    obj: T,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> T:
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
    length = _broadcast_(length, root_rank, f"{name}.sz", process_set)
    if data is None:
        data = torch.zeros(int(length.item()), dtype=torch.uint8)
    data = _broadcast_(data, root_rank, f"{name}.t", process_set)
    if basics.rank() == root_rank:
        return obj
    blob = verify(_secret(), data.numpy().tobytes(), what="broadcast object")
    received: T = cloudpickle.loads(blob)
    return received


def allgather_object(
    obj: T, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[T]:
    """Gather a picklable object from every rank; returns the list in rank order.

    Example:
        >>> counts = hvd.allgather_object(len(my_shard))
    """
    name = name or _default_name("allgather_object")
    payload = sign(_secret(), cloudpickle.dumps(obj))
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    sizes = _allgather(torch.tensor([data.numel()], dtype=torch.int64), f"{name}.sz", process_set)
    gathered = _allgather(data, f"{name}.t", process_set)
    objects: list[T] = []
    offset = 0
    raw = gathered.numpy().tobytes()
    for size in sizes.tolist():
        blob = verify(_secret(), raw[offset : offset + size], what="gathered object")
        objects.append(cloudpickle.loads(blob))
        offset += size
    return objects
