"""A cycle's exchange: what every rank says in it, and what it heard from the others.

Every rank contributes one header of the same size to an allgather on the control communicator:
its payload's length, the bytes its carried allreduces wanted, the response-cache bitmap, the
request slot (JSON-encoded requests not in the cache) and the carried slot (the bytes of small
allreduces, see carry.py). What does not fit in the request slot goes in a second allgather.
Every rank sizes the slots alike from what the ranks sent before, so the headers agree.

This module knows requests, the response cache and bytes; not what negotiation does with what it
heard, nor entries beyond their requests.
"""

from __future__ import annotations

import struct

from hora.common.engine import carry
from hora.common.engine.context import EngineContext
from hora.common.engine.handles import Entry
from hora.common.engine.negotiation import InlineSlot, ResponseCache
from hora.common.transport import allgather_bytes
from hora.common.vocabulary.errors import HoraInternalError
from hora.common.vocabulary.message import CycleMessage, Key, Request

# One rank's part of a cycle: its requests (cache bits expanded, then full requests), the
# reason it gave to end the job, if any, and whether that end is orderly (hvd.shutdown() or the
# process's exit, not a failure, stall or deadlock).
Contribution = tuple[tuple[Request, ...], str | None, bool]


class Exchange:
    """Runs each cycle's exchange for one rank.

    Args:
        context: the engine's shared parts (this rank, the job's size, the control
            communicator the exchange runs on).
        cache: the response cache (bits for requests every rank has seen before).
        carrier: this rank's small allreduces that ride in the exchange.
    """

    def __init__(
        self, context: EngineContext, cache: ResponseCache, carrier: carry.Carrier
    ) -> None:
        self._rank = context.rank
        self._size = context.size
        self._control = context.communicators.control
        self._cache = cache
        self._carrier = carrier
        self._inline = InlineSlot()

    def run(
        self, new: list[Entry], shutdown_reason: str | None, orderly: bool = False
    ) -> tuple[list[Contribution], list[dict[Key, bytes]]]:
        """Every rank's new requests this cycle, and the small allreduces' bytes it carried
        (see carry.py), in rank order.

        The header every rank contributes: its payload's length, the bytes its carried
        allreduces wanted, the response-cache bitmap, the request slot, the carried slot.
        """
        self._carrier.add(new)
        bits: list[int] = []
        full: list[Request] = []
        for entry in new:
            bit = self._cache.bit_for(entry.request, self._rank)
            if bit is None:
                full.append(entry.request)
            else:
                bits.append(bit)
        message = CycleMessage(tuple(full), tuple(bits), shutdown_reason, orderly)
        if self._size == 1:
            return [(tuple(entry.request for entry in new), message.shutdown, orderly)], [{}]
        payload = message.encode_payload()
        bitmap = 0
        for bit in bits:
            bitmap |= 1 << bit
        nbytes = (max(self._cache.capacity, 1) + 7) // 8
        slot = self._inline.size
        inline = payload[:slot]
        carried, wanted = self._carrier.section()
        header = (
            struct.pack("<qq", len(payload), wanted)
            + bitmap.to_bytes(nbytes, "little")
            + inline
            + bytes(slot - len(inline))
            + carried
        )
        headers = allgather_bytes(self._control, header)
        lengths = [struct.unpack_from("<q", h)[0] for h in headers]
        start = 16 + nbytes
        sections: list[dict[Key, bytes]] = [{}] * self._size
        if carried:
            sections = [_carried(rank, h[start + slot :]) for rank, h in enumerate(headers)]
        self._carrier.slot.after(max(struct.unpack_from("<q", h, 8)[0] for h in headers))
        payloads = [h[start : start + min(n, slot)] for h, n in zip(headers, lengths)]
        longest = max(lengths)
        if longest > slot:
            # What did not fit in the slot, from every rank (padded to the longest remainder).
            rest = payload[slot:]
            padded = allgather_bytes(self._control, rest + bytes(longest - slot - len(rest)))
            payloads = [p + r[: max(0, n - slot)] for p, r, n in zip(payloads, padded, lengths)]
        self._inline.after(longest)
        contributions = [
            self._contribution(rank, headers[rank][16:start], payloads[rank])
            for rank in range(self._size)
        ]
        return contributions, sections

    def _contribution(self, rank: int, bitmap: bytes, payload: bytes) -> Contribution:
        """One rank's requests (its cache bits expanded, then its full requests), shutdown
        reason and whether that shutdown is orderly."""
        received = int.from_bytes(bitmap, "little")
        expanded: list[Request] = []
        while received:
            low = received & -received
            expanded.append(self._cache.expand(low.bit_length() - 1, rank))
            received ^= low
        try:
            requests, shutdown, orderly = CycleMessage.decode_payload(payload)
        except ValueError as exc:
            raise HoraInternalError(f"rank {rank} sent a malformed message: {exc}") from exc
        return tuple(expanded) + requests, shutdown, orderly


def _carried(rank: int, section: bytes) -> dict[Key, bytes]:
    try:
        return carry.parse(section)
    except ValueError as exc:
        raise HoraInternalError(f"rank {rank} sent malformed carried tensors: {exc}") from exc
