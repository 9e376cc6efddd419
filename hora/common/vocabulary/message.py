"""Requests and responses: what ranks tell each other about the collectives they want to run.

A :class:`Request` describes one tensor operation (name, kind, dtype, shape, ...) without the
tensor itself. Requests cross the network as JSON, never as pickles, so a malformed or hostile
message can at worst be rejected. The engine turns agreed requests into :class:`Response` objects.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, field


class RequestType(enum.IntEnum):
    """The kinds of operation a rank can ask for."""

    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    BARRIER = 5
    JOIN = 6
    ADD_PROCESS_SET = 7
    REMOVE_PROCESS_SET = 8

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", " ")


class ReduceOp(enum.IntEnum):
    """Reduction operations, numbered as Horovod numbers them."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5

    @property
    def label(self) -> str:
        return self.name.capitalize()


# A name within its process set: names are unique per set, as in Horovod, where every process
# set negotiates on its own. The same name may be in flight in two sets at once. A name of the
# global set is its own key (the common case costs nothing); another set's is (set id, name),
# which never equals a string.
Key = str | tuple[int, str]


def make_key(process_set_id: int, name: str) -> Key:
    return name if process_set_id == 0 else (process_set_id, name)


def key_parts(key: Key) -> tuple[int, str]:
    """``(process set id, name)`` of a key."""
    return (0, key) if isinstance(key, str) else key


# Kinds whose tensors may differ in the first dimension between ranks.
VARIABLE_FIRST_DIM = frozenset({RequestType.ALLGATHER, RequestType.ALLTOALL})
# Kinds whose tensors are combined element-wise, so the shape must match exactly.
ELEMENTWISE = frozenset({RequestType.ALLREDUCE, RequestType.REDUCESCATTER})


@dataclass(frozen=True)
class Request:
    """One rank's wish to run one named operation.

    Attributes:
        name: the full name shared by all ranks (``"allreduce.grad.fc1"``).
        kind: the operation.
        dtype: the tensor's dtype as text (``"float32"``).
        shape: the tensor's shape.
        process_set_id: the process set the operation runs in (0: everyone).
        reduce_op: for reductions.
        root_rank: for broadcast, the *global* rank that sends; -1 otherwise.
        prescale: factor applied before the reduction.
        postscale: factor applied after the reduction (excluding Average's 1/size).
        device: ``"cpu"`` or ``"cuda"``.
        splits: for alltoall, the rows this rank sends to each member of the set.
        group: ``(group name, number of members)`` when the request is part of a grouped op.
        ranks: for process-set registration, the member ranks.
        key: ``(process_set_id, name)``, what identifies the request on a rank and across ranks.
    """

    name: str
    kind: RequestType
    dtype: str = "float32"
    shape: tuple[int, ...] = ()
    process_set_id: int = 0
    reduce_op: ReduceOp = ReduceOp.SUM
    root_rank: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    device: str = "cpu"
    splits: tuple[int, ...] | None = None
    group: tuple[str, int] | None = None
    ranks: tuple[int, ...] | None = None
    key: Key = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Made once: the engine looks requests up by key on every submission.
        set_id = self.process_set_id
        object.__setattr__(self, "key", self.name if set_id == 0 else (set_id, self.name))

    @property
    def num_elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    def to_wire(self) -> list[object]:
        """A compact JSON-able list (field order is the wire format)."""
        return [
            self.name,
            int(self.kind),
            self.dtype,
            list(self.shape),
            self.process_set_id,
            int(self.reduce_op),
            self.root_rank,
            self.prescale,
            self.postscale,
            self.device,
            None if self.splits is None else list(self.splits),
            None if self.group is None else list(self.group),
            None if self.ranks is None else list(self.ranks),
        ]

    @classmethod
    def from_wire(cls, item: object) -> Request:
        """Rebuild a request from :meth:`to_wire` output.

        Raises:
            ValueError: the item does not have the shape of a request.
        """
        if not isinstance(item, list) or len(item) != 13:
            raise ValueError(f"malformed request on the wire: {item!r:.200}")
        (name, kind, dtype, shape, ps_id, op, root, pre, post, device, splits, group, ranks) = item
        return cls(
            name=str(name),
            kind=RequestType(int(kind)),
            dtype=str(dtype),
            shape=tuple(int(d) for d in shape),
            process_set_id=int(ps_id),
            reduce_op=ReduceOp(int(op)),
            root_rank=int(root),
            prescale=float(pre),
            postscale=float(post),
            device=str(device),
            splits=None if splits is None else tuple(int(s) for s in splits),
            group=None if group is None else (str(group[0]), int(group[1])),
            ranks=None if ranks is None else tuple(int(r) for r in ranks),
        )

    def describe(self) -> str:
        """How this request is shown in error messages: ``allreduce float32 [4, 2] op=Sum``."""
        parts = [self.kind.label, self.dtype, format_shape(self.shape)]
        if self.kind in ELEMENTWISE:
            parts.append(f"op={self.reduce_op.label}")
            if self.prescale != 1.0 or self.postscale != 1.0:
                parts.append(f"prescale={self.prescale:g} postscale={self.postscale:g}")
        if self.kind == RequestType.BROADCAST:
            parts.append(f"root={self.root_rank}")
        if self.splits is not None:
            parts.append(f"splits={list(self.splits)}")
        if self.device != "cpu":
            parts.append(f"on {self.device}")
        if self.ranks is not None:
            parts.append(f"ranks={list(self.ranks)}")
        return " ".join(parts)


def key_label(key: Key) -> str:
    """How a key is shown to users: the name, and the process set unless it is the global one."""
    if isinstance(key, str):
        return key
    set_id, name = key
    return f"{name} (process set {set_id})"


def format_shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


@dataclass(frozen=True)
class CycleMessage:
    """What one rank contributes to one negotiation cycle.

    Attributes:
        requests: requests that are new this cycle and not covered by a cache bit.
        cache_bits: cache positions of new requests that match a cached response.
        shutdown: set when this rank wants the job to stop; the text says why.
        orderly: the stop was asked for by ``hvd.shutdown()`` or the process's exit (not by a
            failure, a stall or a deadlock).
    """

    requests: tuple[Request, ...] = ()
    cache_bits: tuple[int, ...] = ()
    shutdown: str | None = None
    orderly: bool = False

    def encode_payload(self) -> bytes:
        """The variable part (requests and shutdown reason) as UTF-8 JSON; empty when idle."""
        if not self.requests and self.shutdown is None:
            return b""
        body: dict[str, object] = {"r": [r.to_wire() for r in self.requests]}
        if self.shutdown is not None:
            body["s"] = self.shutdown
            if self.orderly:
                body["o"] = 1
        return json.dumps(body, separators=(",", ":")).encode()

    @staticmethod
    def decode_payload(data: bytes) -> tuple[tuple[Request, ...], str | None, bool]:
        """Parse :meth:`encode_payload` output: the requests, the shutdown reason and whether
        the shutdown is orderly.

        Raises:
            ValueError: the bytes are not a valid payload.
        """
        if not data:
            return (), None, False
        try:
            body = json.loads(data.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"malformed negotiation message: {exc}") from None
        if not isinstance(body, dict):
            raise ValueError("malformed negotiation message: not an object")
        requests = tuple(Request.from_wire(item) for item in body.get("r", []))
        shutdown = body.get("s")
        if shutdown is None:
            return requests, None, False
        return requests, str(shutdown), body.get("o") == 1


@dataclass
class Response:
    """An operation every participating rank has agreed to run now, in this order.

    Attributes:
        kind: the operation.
        names: the tensor names fused into this response (one unless fused).
        requests: per name, the request of each participating rank (global rank -> request).
        process_set_id: the process set it runs in.
        error: when set, the operation does not run; every rank's handle fails with this text.
        joined_ranks: ranks that have called join and contribute zeros.
        last_joined_rank: for a completed JOIN, the rank that joined last.
    """

    kind: RequestType
    names: list[str]
    requests: list[dict[int, Request]]
    process_set_id: int = 0
    error: str | None = None
    joined_ranks: frozenset[int] = field(default_factory=frozenset)
    last_joined_rank: int = -1

    # The names with the process set: how the engine finds the entries of this response
    # (made once; the engine looks them up several times per response).
    keys: Sequence[Key] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_id = self.process_set_id
        self.keys = self.names if set_id == 0 else [(set_id, name) for name in self.names]

    def template(self, index: int = 0) -> Request:
        """A representative request of entry ``index`` (the lowest rank's)."""
        per_rank = self.requests[index]
        return per_rank[min(per_rank)]

    @property
    def num_bytes(self) -> int:
        from hora.common.vocabulary.dtypes import itemsize

        return sum(
            self.template(i).num_elements * itemsize(self.template(i).dtype)
            for i in range(len(self.names))
        )
