"""Small allreduces carried in the control exchange: one round trip instead of two.

A negotiated allreduce costs the exchange that agrees on it and then the data collective. For a
tensor of a few bytes (a loss, a metric, a counter) the second round trip is most of its
latency. So every rank puts the bytes of its small pending allreduces into its header of each
exchange, next to the requests, for as long as they are pending. In the cycle where a response
is agreed, every rank holds every member's bytes from that cycle's headers, and reduces them
itself in rank order: the same arithmetic on the same bytes, so the same result everywhere.

Whether a response is carried is decided from the exchanged headers alone (every member sent
its bytes, of the agreed size), so every rank decides alike; any other response runs as a
collective as before. The carried section has one size on every rank, sized like the request
slot from what the ranks wanted to send in the last cycle (:class:`InlineSlot`).

This module knows entries, requests and bytes; the engine does the exchange.
"""

from __future__ import annotations

import struct
from collections.abc import Container

import torch

from hora.common.engine.buffers import compute_dtype, postscale, scale, torch_dtype
from hora.common.engine.handles import Entry
from hora.common.engine.negotiation import InlineSlot
from hora.common.vocabulary.message import (
    Key,
    ReduceOp,
    Request,
    RequestType,
    Response,
    key_parts,
    make_key,
)

# Per item: process set id, name length, data length; then the name and the data.
_ITEM = struct.Struct("<IHI")


class Carrier:
    """This rank's small allreduces that ride in the exchanges until they are agreed.

    Args:
        threshold: the largest tensor carried, in bytes (0: none).
    """

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        # At most a few items: their bytes ride in one header slot.
        self.slot = InlineSlot(largest=max(InlineSlot.LARGEST, 4 * threshold))
        # Each pending item, encoded once for the slot: it rides in every exchange until agreed.
        self._riding: dict[Key, bytes] = {}
        # Responses reduced from carried bytes (counted by the engine; for tests and tools).
        self.reduced = 0

    def carries(self, request: Request, tensor: torch.Tensor | None) -> bool:
        """Whether this rank sends the bytes of ``tensor`` with ``request``."""
        return (
            request.kind == RequestType.ALLREDUCE
            and request.reduce_op != ReduceOp.ADASUM
            and tensor is not None
            and tensor.device.type == "cpu"
            and 0 < tensor.numel() * tensor.element_size() <= self.threshold
        )

    def add(self, entries: list[Entry]) -> None:
        """Take the bytes of the new entries that qualify (read now: the caller may not change
        a tensor before its call completes)."""
        if self.threshold <= 0:
            return
        for entry in entries:
            tensor = entry.tensor
            if self.carries(entry.request, tensor) and len(entry.request.name) < 16_384:
                assert tensor is not None
                data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                set_id, name = key_parts(entry.request.key)
                encoded = name.encode()
                item = _ITEM.pack(set_id, len(encoded), len(data)) + encoded + data
                self._riding[entry.request.key] = item

    def section(self) -> tuple[bytes, int]:
        """The bytes for this cycle's slot (whole items, in submission order, as many as fit),
        and how many bytes all riding items would need."""
        size = self.slot.size
        parts: list[bytes] = []
        used = wanted = 0
        for item in self._riding.values():
            wanted += len(item)
            if used + len(item) <= size:
                parts.append(item)
                used += len(item)
        section = b"".join(parts)
        return section + bytes(size - used), wanted

    def keep_only(self, pending: Container[Key]) -> None:
        """Forget items that are no longer pending (agreed, failed, or taken over by the
        steady state)."""
        if self._riding:
            self._riding = {k: v for k, v in self._riding.items() if k in pending}


def parse(section: bytes) -> dict[Key, bytes]:
    """The items of one rank's slot.

    Raises:
        ValueError: the section is malformed.
    """
    items: dict[Key, bytes] = {}
    offset = 0
    end = len(section)
    while offset + _ITEM.size <= end:
        set_id, name_length, data_length = _ITEM.unpack_from(section, offset)
        if name_length == 0:
            break  # padding
        offset += _ITEM.size
        stop = offset + name_length + data_length
        if stop > end:
            raise ValueError("a carried tensor runs past the end of its slot")
        name = section[offset : offset + name_length].decode()
        items[make_key(set_id, name)] = section[offset + name_length : stop]
        offset = stop
    return items


def carried_parts(
    response: Response, members: tuple[int, ...], sections: list[dict[Key, bytes]]
) -> list[bytes] | None:
    """Every member's bytes for ``response``, in member order, when this cycle carried them
    all; ``None`` when it runs as a collective. The same answer on every rank."""
    if (
        response.kind != RequestType.ALLREDUCE
        or response.error is not None
        or response.joined_ranks
        or len(response.keys) != 1
    ):
        return None
    template = response.template()
    if template.reduce_op == ReduceOp.ADASUM or template.device != "cpu":
        return None
    key = response.keys[0]
    expected = template.num_elements * torch_dtype(template.dtype).itemsize
    parts = []
    for rank in members:
        data = sections[rank].get(key)
        if data is None or len(data) != expected:
            return None
        parts.append(data)
    return parts


def reduce_parts(request: Request, parts: list[bytes]) -> torch.Tensor:
    """The allreduce of ``parts`` (one per member, in member order), as the collective computes
    it: each part prescaled, combined in order, then averaged and postscaled. Returned in the
    request's dtype and shape."""
    dtype = torch_dtype(request.dtype)
    op = ReduceOp.SUM if request.reduce_op == ReduceOp.AVERAGE else request.reduce_op
    work_dtype, work_op = compute_dtype(dtype, op)
    total: torch.Tensor | None = None
    for data in parts:
        value = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
        value = scale(value.to(work_dtype), request.prescale)
        if total is None:
            total = value
        elif work_op == ReduceOp.SUM:
            total.add_(value)
        elif work_op == ReduceOp.PRODUCT:
            total.mul_(value)
        elif work_op == ReduceOp.MIN:
            torch.minimum(total, value, out=total)
        else:
            torch.maximum(total, value, out=total)
    assert total is not None
    divisor = len(parts) if request.reduce_op == ReduceOp.AVERAGE else 1
    result = postscale(total, divisor, request.postscale)
    return result.to(dtype).reshape(request.shape)
