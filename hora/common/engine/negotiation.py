"""Negotiation: deciding, identically on every rank, which requests run now and in what order.

Every cycle each rank contributes the requests it submitted since the last cycle (as full
requests or as response-cache bits). All ranks receive every contribution and feed them, in rank
order, into an identical :class:`MessageTable`. Because every rank runs the same deterministic
procedure on the same input, all ranks derive the same ordered list of responses without a
coordinator round trip; this is Horovod's coordinator protocol with the coordinator replicated.

This module knows requests and responses, never tensors or transports.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from hora.common.process_sets import ProcessSetTable
from hora.common.vocabulary.message import (
    ELEMENTWISE,
    VARIABLE_FIRST_DIM,
    Key,
    Request,
    RequestType,
    Response,
    key_parts,
)

JOIN_NAME = "join.noname"
JOIN_KEY: Key = JOIN_NAME  # join is global

# Kinds whose agreed requests go into the response cache.
CACHEABLE = frozenset(
    {
        RequestType.ALLREDUCE,
        RequestType.ALLGATHER,
        RequestType.BROADCAST,
        RequestType.ALLTOALL,
        RequestType.REDUCESCATTER,
    }
)


class ResponseCache:
    """Requests that already ran, so a repeat can travel as one bit instead of a full request.

    Each entry holds, for one name of one process set, the request every rank made last time
    and a bit position. All ranks update the cache from the same responses in the same order, so
    positions agree everywhere. Eviction is least-recently-used.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[Key, tuple[int, dict[int, Request]]] = OrderedDict()
        self._by_bit: dict[int, Key] = {}

    def bit_for(self, request: Request, rank: int) -> int | None:
        """The bit to send for ``request`` from ``rank``, if the cache holds an identical one."""
        entry = self._entries.get(request.key)
        if entry is None:
            return None
        bit, per_rank = entry
        return bit if per_rank.get(rank) == request else None

    def expand(self, bit: int, rank: int) -> Request:
        """The request ``rank`` means by ``bit``.

        Raises:
            ValueError: the bit is not in use (ranks' caches disagree: an internal error).
        """
        key = self._by_bit.get(bit)
        if key is None:
            raise ValueError(f"rank {rank} sent response-cache bit {bit}, which is not in use")
        return self._entries[key][1][rank]

    def cached(self, key: Key, requests: dict[int, Request]) -> dict[int, Request] | None:
        """The cached per-rank requests when ``requests`` are exactly those (all cache hits).

        Such a response was validated when it entered the cache, so it need not be again.
        """
        entry = self._entries.get(key)
        if entry is None:
            return None
        per_rank = entry[1]
        if len(per_rank) != len(requests):
            return None
        for rank, request in per_rank.items():
            if requests.get(rank) is not request:
                return None
        return per_rank

    def put(self, key: Key, per_rank: dict[int, Request]) -> None:
        if self.capacity <= 0:
            return
        entry = self._entries.get(key)
        if entry is not None:
            if entry[1] is not per_rank:
                self._entries[key] = (entry[0], dict(per_rank))
            self._entries.move_to_end(key)
            return
        if len(self._entries) < self.capacity:
            bit = len(self._entries)
        else:
            _, (bit, _) = self._entries.popitem(last=False)
            del self._by_bit[bit]
        self._entries[key] = (bit, dict(per_rank))
        self._by_bit[bit] = key

    def __len__(self) -> int:
        return len(self._entries)


class InlineSlot:
    """How many bytes of new requests ride in the header of the next control exchange.

    A cycle's exchange is one allgather of headers of one size on every rank: lengths,
    response-cache bits, and a slot for requests not in the cache, sized from what the last
    cycle with such requests needed. A run of new requests (unnamed calls are always new) then
    costs one allgather a cycle; only what does not fit goes in a second one. Every rank sees the
    same lengths, so every rank sizes the next slot alike; the slot empties after
    ``KEEP_CYCLES`` cycles without new requests, so idle exchanges stay small.
    """

    STEP = 256
    LARGEST = 4096
    KEEP_CYCLES = 16

    def __init__(self, largest: int = LARGEST) -> None:
        self.largest = largest
        self.size = 0
        self._quiet = 0

    def after(self, longest: int) -> None:
        """Size the next slot, given the longest request payload of the cycle just exchanged."""
        if longest > 0:
            self._quiet = 0
            self.size = min(self.largest, -(-longest // self.STEP) * self.STEP)
            return
        self._quiet += 1
        if self._quiet >= self.KEEP_CYCLES:
            self.size = 0


@dataclass
class PendingName:
    """What the table knows about one name: who asked, with what, and since when."""

    requests: dict[int, Request] = field(default_factory=dict)
    first_seen: float = field(default_factory=time.monotonic)


class MessageTable:
    """Requests that some but not yet all ranks have made, in arrival order.

    Keyed by ``(process set, name)``: each process set has its own names, so ranks of two sets
    may use the same name at once (unnamed ops of disjoint sets are numbered alike). All sets
    share one table and one agreed order, so an op of the global set is ordered against the
    others, and ops of disjoint sets become ready independently of each other.
    """

    def __init__(self, process_sets: ProcessSetTable) -> None:
        self.process_sets = process_sets
        self.pending: dict[Key, PendingName] = {}
        self.joined: dict[int, None] = {}  # ordered set of global ranks that called join
        self.last_joined_rank = -1
        # When a request last arrived or a response was decided (time.monotonic()).
        self.changed = time.monotonic()

    def add(self, rank: int, request: Request) -> None:
        self.changed = time.monotonic()
        if request.kind == RequestType.JOIN:
            self.joined[rank] = None
            self.last_joined_rank = rank
        entry = self.pending.get(request.key)
        if entry is None:
            entry = self.pending[request.key] = PendingName()
        entry.requests[rank] = request

    def __bool__(self) -> bool:
        return bool(self.pending)

    def missing_ranks(self, key: Key) -> list[int]:
        """Members of the key's process set that have neither submitted it nor joined."""
        entry = self.pending[key]
        template = next(iter(entry.requests.values()))
        members = self._members_or_empty(template.process_set_id)
        return [r for r in members if r not in entry.requests and r not in self.joined]

    def _members_or_empty(self, process_set_id: int) -> tuple[int, ...]:
        if not self.process_sets.contains(process_set_id):
            return ()
        return self.process_sets.members(process_set_id)

    def _decidable(self, key: Key) -> bool:
        entry = self.pending[key]
        template = next(iter(entry.requests.values()))
        if template.kind == RequestType.JOIN:
            return False
        if not self.process_sets.contains(template.process_set_id):
            # Some rank used a set this rank does not know: fail it as soon as anyone asks.
            return True
        members = self.process_sets.members(template.process_set_id)
        if any(r not in members for r in entry.requests):
            return True
        absent = [r for r in members if r not in entry.requests]
        if not absent:
            return True
        if template.kind != RequestType.ALLREDUCE:
            # A member that joined never submits it: only allreduce runs while a member is
            # joined, so fail it now rather than wait (ranks that numbered their unnamed ops
            # differently would otherwise wait for each other forever).
            return any(r in self.joined for r in absent)
        # Ranks that joined stand in for an allreduce with zeros.
        return all(r in self.joined for r in absent)

    def ready(self, cache: ResponseCache) -> list[Response]:
        """Remove and return the responses every rank can run now, in a deterministic order."""
        responses: list[Response] = []
        decided: set[Key] = set()
        for key in list(self.pending):
            if key in decided or not self._decidable(key):
                continue
            entry = self.pending[key]
            template = next(iter(entry.requests.values()))
            if template.group is not None:
                members = self._group_members(template)
                if members is None:
                    continue
                for member in members:
                    responses.append(self._respond(member, self.pending[member].requests, cache))
                    decided.add(member)
            else:
                responses.append(self._respond(key, entry.requests, cache))
                decided.add(key)
        for key in decided:
            del self.pending[key]
        if decided:
            self.changed = time.monotonic()
        for response in responses:
            if response.error is None and response.kind in CACHEABLE and not response.joined_ranks:
                cache.put(response.keys[0], response.requests[0])
        self._complete_join(responses)
        return responses

    def _group_members(self, template: Request) -> list[Key] | None:
        group, set_id = template.group, template.process_set_id
        assert group is not None
        keys = [
            key
            for key, entry in self.pending.items()
            if key_parts(key)[0] == set_id and next(iter(entry.requests.values())).group == group
        ]
        if len(keys) < group[1] or not all(self._decidable(k) for k in keys):
            return None
        return keys

    def _complete_join(self, responses: list[Response]) -> None:
        if JOIN_KEY not in self.pending:
            return
        everyone = self.process_sets.members(0)
        if all(r in self.joined for r in everyone):
            requests = self.pending.pop(JOIN_KEY).requests
            responses.append(
                Response(
                    kind=RequestType.JOIN,
                    names=[JOIN_NAME],
                    requests=[requests],
                    last_joined_rank=self.last_joined_rank,
                )
            )
            self.joined.clear()

    def _respond(self, key: Key, requests: dict[int, Request], cache: ResponseCache) -> Response:
        name = key_parts(key)[1]
        cached = None if self.joined else cache.cached(key, requests)
        if cached is not None:
            template = next(iter(cached.values()))
            return Response(
                kind=template.kind,
                names=[name],
                requests=[cached],
                process_set_id=template.process_set_id,
            )
        template = requests[min(requests)]
        ps_id = template.process_set_id
        error = validate(name, requests, self.process_sets, self.joined)
        joined: frozenset[int] = frozenset()
        if error is None and self.process_sets.contains(ps_id):
            members = self.process_sets.members(ps_id)
            joined = frozenset(r for r in members if r not in requests)
        return Response(
            kind=template.kind,
            names=[name],
            requests=[dict(sorted(requests.items()))],
            process_set_id=ps_id,
            error=error,
            joined_ranks=joined,
        )


def _rank_list(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2, 5"``."""
    spans: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} {', '.join(spans)}"


def _mismatch(name: str, what: str, requests: dict[int, Request], hint: str) -> str:
    template = requests[min(requests)]
    by_text: dict[str, list[int]] = {}
    for rank in sorted(requests):
        by_text.setdefault(requests[rank].describe(), []).append(rank)
    lines = [
        f"Mismatched {what} for {name!r} (process set {template.process_set_id}): "
        "ranks submitted different requests under one name."
    ]
    lines += [f"  {_rank_list(ranks)}: {text}" for text, ranks in by_text.items()]
    lines.append(hint)
    return "\n".join(lines)


def validate(
    name: str,
    requests: dict[int, Request],
    process_sets: ProcessSetTable,
    joined: dict[int, None],
) -> str | None:
    """The error text when ranks disagree about ``name``; ``None`` when they agree.

    The checks follow Horovod's order: operation, data type, device, shape, reduction, scale
    factors, root rank; then what is invalid even when all ranks agree.
    """
    template = requests[min(requests)]
    ps_id = template.process_set_id
    if not process_sets.contains(ps_id):
        return (
            f"{template.kind.label} {name!r} uses process set {ps_id}, which is not registered on "
            "every rank. Register process sets with hvd.init(process_sets=...) or "
            "hvd.add_process_set(...) on all ranks, in the same order."
        )
    members = process_sets.members(ps_id)
    outsiders = sorted(r for r in requests if r not in members)
    if outsiders:
        return (
            f"{template.kind.label} {name!r}: {_rank_list(outsiders)} submitted it to process "
            f"set {ps_id} (ranks {list(members)}) without being a member."
        )
    return (
        _disagreement(name, requests)
        or _invalid_for_kind(name, requests, members)
        or _invalid_with_join(name, requests, members, joined)
    )


_SAME = "Every rank must submit the same operation, dtype and shape under one name"


def _disagreement(name: str, requests: dict[int, Request]) -> str | None:
    """Ranks that submitted different operations, dtypes, devices, shapes, reductions or scale
    factors under one name."""
    reqs = list(requests.values())
    kind = reqs[0].kind
    if len({r.kind for r in reqs}) > 1:
        return _mismatch(name, "operations", requests, _SAME + ".")
    if len({r.dtype for r in reqs}) > 1:
        return _mismatch(name, "data types", requests, _SAME + ".")
    if len({r.device for r in reqs}) > 1:
        return _mismatch(
            name, "CPU/GPU device selection", requests, "Every rank must use the same device type."
        )
    shapes = _shape_disagreement(name, requests)
    if shapes is not None:
        return shapes
    if kind in ELEMENTWISE:
        if len({r.reduce_op for r in reqs}) > 1:
            return _mismatch(
                name, "reduction operations", requests, "Every rank must use the same op."
            )
        if len({(r.prescale, r.postscale) for r in reqs}) > 1:
            return _mismatch(
                name,
                "prescale and/or postscale factors",
                requests,
                "Every rank must pass the same prescale_factor and postscale_factor.",
            )
    return None


def _shape_disagreement(name: str, requests: dict[int, Request]) -> str | None:
    """Ranks that submitted different shapes (allgather and alltoall: different trailing
    dimensions) under one name."""
    reqs = list(requests.values())
    kind = reqs[0].kind
    if kind in VARIABLE_FIRST_DIM:
        if any(len(r.shape) == 0 for r in reqs):
            return (
                f"{kind.label} {name!r}: a rank submitted a rank-zero (scalar) tensor; "
                f"{kind.label} needs at least one dimension."
            )
        if len({len(r.shape) for r in reqs}) > 1 or len({r.shape[1:] for r in reqs}) > 1:
            return _mismatch(
                name,
                f"{kind.label} tensor shapes",
                requests,
                _SAME + f" ({kind.label} allows the first dimension to differ).",
            )
        return None
    if len({r.shape for r in reqs}) > 1:
        return _mismatch(name, f"{kind.label} tensor shapes", requests, _SAME + ".")
    return None


def _invalid_for_kind(
    name: str, requests: dict[int, Request], members: tuple[int, ...]
) -> str | None:
    """Broadcast roots, alltoall splits and grouping: wrong even where ranks agree."""
    template = requests[min(requests)]
    reqs = list(requests.values())
    kind = template.kind
    ps_id = template.process_set_id
    if kind == RequestType.BROADCAST:
        if len({r.root_rank for r in reqs}) > 1:
            return _mismatch(
                name, "broadcast root ranks", requests, "Every rank must name the same root_rank."
            )
        if template.root_rank not in members:
            return (
                f"broadcast {name!r}: root rank {template.root_rank} is not a member of process "
                f"set {ps_id} (ranks {list(members)}). root_rank is a global rank."
            )
    if kind == RequestType.ALLTOALL:
        for rank, req in requests.items():
            if req.splits is not None and len(req.splits) != len(members):
                return (
                    f"alltoall {name!r}: rank {rank} passed {len(req.splits)} splits but the "
                    f"process set has {len(members)} members; pass one entry per member."
                )
    if len({r.group for r in reqs}) > 1:
        return _mismatch(
            name,
            "grouping",
            requests,
            "Every rank must submit this tensor in the same grouped call.",
        )
    return None


def _invalid_with_join(
    name: str, requests: dict[int, Request], members: tuple[int, ...], joined: dict[int, None]
) -> str | None:
    """Only allreduce runs while a member has joined."""
    kind = requests[min(requests)].kind
    absent_joined = [r for r in members if r not in requests and r in joined]
    if absent_joined and kind != RequestType.ALLREDUCE:
        return (
            f"{kind.label} {name!r} cannot run while {_rank_list(absent_joined)} "
            "joined: only allreduce is supported with join. Specify sparse_as_dense=True if "
            "using DistributedOptimizer."
        )
    return None
