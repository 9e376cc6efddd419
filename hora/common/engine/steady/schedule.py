"""The steady state's schedule: its pure parts, without threads, buffers or transports.

It finds the period (the agreed allreduces repeating, :class:`History`), cuts it into batches as
DDP cuts gradients into buckets (:func:`build_schedule`), tells whether a submitted request is
the one the :class:`Schedule` expects, and defines the codes a rank contributes with each batch
(following, deviated, or blocked before a tensor) and the cuts they imply. :mod:`.replay` runs
the schedule; this module does not know how, nor anything of tensors' contents.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from hora.common.engine import fusion
from hora.common.vocabulary.message import ReduceOp, Request, RequestType, Response

if TYPE_CHECKING:
    import torch

    from hora.common.transport import Communicator

# Responses in the longest period looked for (names in one training step).
MAX_PERIOD = 4096
# A schedule replayed for this many periods was stable: leaving it starts a new phase of the
# job rather than showing a pattern that keeps changing (see Replay._leave).
STABLE_PERIODS = 20
# Batches are cut at this size (or the fusion threshold, if smaller) so that communication
# of the first gradients overlaps the rest of backward.
BUCKET_BYTES = 25 * 1024 * 1024
# The first batch is cut smaller still, so that communication starts early in backward.
FIRST_BUCKET_BYTES = 1024 * 1024

_FLOATING = ("float16", "bfloat16", "float32", "float64")

# A rank's code for a batch, in its own slot after the data (exact in every floating dtype).
FOLLOWING = 0  # it submitted exactly the batch's tensors
DEVIATED = 1  # it submitted something else, or is shutting down
_BLOCKED = 2  # its user waits on a result; + the index of its first missing tensor
_MAX_INDEX = 200  # bfloat16 holds integers exactly up to 256


def blocked_code(first_missing: int) -> int:
    """The code of a rank whose user blocked before submitting ``batch[first_missing]``."""
    return _BLOCKED + min(first_missing, _MAX_INDEX + 1)


def cuts_from(batch: list[Request], codes: list[int]) -> set[str]:
    """Names before which future batches must be cut, from every rank's code for ``batch``."""
    cuts: set[str] = set()
    for code in codes:
        if code < _BLOCKED:
            continue
        index = code - _BLOCKED
        if 0 < index <= _MAX_INDEX and index < len(batch):
            cuts.add(batch[index].name)
        elif index > _MAX_INDEX:
            cuts.update(r.name for r in batch[1:])
    return cuts


def eligible(response: Response) -> bool:
    """Whether an executed response can be part of a schedule."""
    if response.kind != RequestType.ALLREDUCE or response.error is not None:
        return False
    if response.joined_ranks or response.process_set_id != 0:
        return False
    template = response.template()
    return template.dtype in _FLOATING and template.reduce_op in (ReduceOp.SUM, ReduceOp.AVERAGE)


@dataclass(frozen=True, eq=False)
class BatchLayout:
    """Which names a schedule reduces together: for each name, its batch's number; and how
    many batches a period has. A new schedule comes with a new layout (compare identities)."""

    batch_of: dict[str, int]
    batches: int


class BatchBuffer(NamedTuple):
    """A steady-state batch's buffer and the engine's views of it (made by
    :mod:`.staging`): the data, the ranks' codes, each tensor's piece; and the references to
    the buffer's memory when nothing outside the engine holds it."""

    buffer: torch.Tensor
    data: torch.Tensor
    codes: torch.Tensor
    pieces: dict[str, torch.Tensor]
    baseline: tuple[int, int]


@dataclass
class Schedule:
    """The batches of one period, in order, and where this rank is in it."""

    batches: list[list[Request]]
    position: int = 0
    index: dict[str, tuple[int, Request]] = field(default_factory=dict)
    # The responses the schedule was cut from (to cut them again another way).
    period: list[Response] = field(default_factory=list)
    # Per batch: its buffer and the engine's views of it (the data, the ranks' codes, each
    # tensor's piece), reused every period; see hora.common.engine.steady.staging.
    batch_buffers: list[BatchBuffer] = field(default_factory=list)
    # The communicator each batch runs on (its buffers live on that communicator's device).
    comms: list[Communicator] = field(default_factory=list)
    # Per name: its piece of its batch's current buffer (a view shaped as the tensor).
    pieces: dict[str, torch.Tensor] = field(default_factory=dict)
    # Per batch: the elements of each of its tensors, in order.
    sizes: list[list[int]] = field(default_factory=list)
    # Batches whose buffer the transport holds now (the engine's lock guards it).
    in_flight: set[int] = field(default_factory=set)
    # Per batch: the factor its tensors are multiplied by before the sum (the prescale factor,
    # divided by the number of ranks for an average, as DDP divides gradients into its
    # buckets), and whether each tensor is scaled as it is staged (large tensors: one pass)
    # rather than the whole buffer once before it is sent.
    factors: list[float] = field(default_factory=list)
    scale_each: list[bool] = field(default_factory=list)
    # Batches whose last results were lent out as views of their buffer (the engine's lock
    # guards it), and per batch a second buffer to turn to while a lent one is still used.
    lent: set[int] = field(default_factory=set)
    spares: dict[int, BatchBuffer] = field(default_factory=dict)
    # Which names each batch holds, for callers that want to submit a batch at once.
    layout: BatchLayout = field(init=False)

    def __post_init__(self) -> None:
        for number, batch in enumerate(self.batches):
            for request in batch:
                self.index[request.name] = (number, request)
            self.sizes.append([request.num_elements for request in batch])
        self.layout = BatchLayout(
            {name: number for name, (number, _) in self.index.items()}, len(self.batches)
        )

    @property
    def current(self) -> list[Request]:
        return self.batches[self.position]

    def advance(self) -> None:
        self.position = (self.position + 1) % len(self.batches)

    def started(self) -> None:
        """The current batch's buffer is the transport's now; go on to the next batch. (Under
        the engine's lock: submitting threads read ``in_flight``.)"""
        self.in_flight.add(self.position)
        self.advance()

    def landed(self, number: int, lent: bool = False) -> None:
        """Batch ``number``'s buffer is back from the transport, its results lent out where
        ``lent``. (Under the engine's lock, as :meth:`started`.)"""
        if lent:
            self.lent.add(number)
        self.in_flight.discard(number)

    def expects(self, request: Request) -> bool:
        """Whether ``request`` is one the schedule runs (same name and request).

        A name whose batch already ran in this period belongs to the next one: a schedule may
        start anywhere in a training step (wherever the agreed sequence was first seen to
        repeat), so a rank that submits a step's tensors in another order reaches into the
        next period. Its batch uses it when it comes round. A rank whose user then waits on
        it before submitting the rest of this period leaves as a blocked rank would.
        """
        found = self.index.get(request.name)
        if found is None:
            return False
        if found[1] is request:
            return True
        if found[1] != request:
            return False
        # Keep the caller's equal request: one that submits the same request object every step
        # (DistributedOptimizer does) is then recognised without comparing its fields again.
        self.index[request.name] = (found[0], request)
        return True


@dataclass
class History:
    """The agreed allreduces executed since the last thing a schedule cannot contain.

    Recording is O(1): each name's latest position is kept, so the engine learns after every
    cycle how far back the last response's name was agreed before without scanning the history
    (which holds thousands of responses when every call has a new name, as unnamed calls do).
    """

    responses: list[Response] = field(default_factory=list)
    repeats: int = 2
    # The position of responses[0] since the history began (trimming advances it), each name's
    # latest position, and the last response's distance to its name's previous one.
    _base: int = 0
    _last_seen: dict[str, int] = field(default_factory=dict)
    _gap: int | None = None

    def record(self, response: Response) -> None:
        if not eligible(response):
            self.clear()
            return
        name = response.names[0]
        position = self._base + len(self.responses)
        previous = self._last_seen.get(name)
        self._gap = position - previous if previous is not None else None
        self._last_seen[name] = position
        self.responses.append(response)
        keep = self.repeats * MAX_PERIOD
        if len(self.responses) > keep + MAX_PERIOD:
            # Trimmed a period's worth at a time: deleting from the front of a list moves
            # what remains.
            drop = len(self.responses) - keep
            del self.responses[:drop]
            self._base += drop
            self._last_seen = {n: p for n, p in self._last_seen.items() if p >= self._base}

    def clear(self) -> None:
        self.responses.clear()
        self._last_seen.clear()
        self._base = 0
        self._gap = None

    def _last_gap(self) -> int | None:
        """How many responses back the last one's name was agreed before (None: never, or
        longer ago than the longest period)."""
        gap = self._gap
        return gap if gap is not None and gap <= MAX_PERIOD else None

    def _repeated(self, tail: list[Response], names: list[str]) -> bool:
        """Whether ``tail`` (named ``names``) ends the history ``repeats`` times over."""
        responses = self.responses
        length = len(tail)
        templates = [r.template() for r in tail]
        for k in range(1, self.repeats):
            earlier = responses[len(responses) - (k + 1) * length : len(responses) - k * length]
            if [r.names[0] for r in earlier] != names:
                return False
            if [r.template() for r in earlier] != templates:
                return False
        return True

    def period(self) -> list[Response] | None:
        """The last period, if the history ends with it repeated ``repeats`` times."""
        responses = self.responses
        if not responses:
            return None
        length = self._last_gap()
        if length is None or length * self.repeats > len(responses):
            return None
        tail = responses[-length:]
        names = [r.names[0] for r in tail]
        if len(set(names)) != length or not self._repeated(tail, names):
            return None
        # The period before the repetitions (as much of it as the history holds) may hold only
        # the period's own names. Otherwise the repetition may be part of a step: where ranks
        # submit in varying orders, one step's last tensors can be agreed in the same order as
        # the next step's first ones, and a schedule of them alone would meet the rest of the
        # step as a deviation.
        end = len(responses) - self.repeats * length
        before = responses[max(0, end - length) : end]
        if not {r.names[0] for r in before} <= set(names):
            return None
        return tail


def build_schedule(
    period: list[Response],
    fusion_threshold_bytes: int,
    cuts: set[str] | frozenset[str] = frozenset(),
    first_bucket_bytes: int = FIRST_BUCKET_BYTES,
    bucket_bytes: int = BUCKET_BYTES,
) -> Schedule:
    """Cut a period into batches, in order, as PyTorch DDP cuts gradients into buckets.

    A batch closes once it holds ``first_bucket_bytes`` (the first) or ``bucket_bytes`` (the
    others), the tensor that crosses the mark included, so that the first allreduce starts
    early in backward. Batches never exceed the fusion threshold (0: every tensor alone) and
    only hold responses that could share a fused buffer. A batch also ends before any name in
    ``cuts``: a point where some rank's user waited for a result before submitting more.
    """
    batches: list[list[Request]] = []
    current: list[Response] = []
    size = 0
    mark = first_bucket_bytes
    for response in period:
        nbytes = response.num_bytes
        if current and (
            response.names[0] in cuts
            or fusion.fusion_key(response) != fusion.fusion_key(current[0])
            or size + nbytes > fusion_threshold_bytes
        ):
            batches.append([r.template() for r in current])
            current, size = [], 0
        current.append(response)
        size += nbytes
        if size >= mark:
            batches.append([r.template() for r in current])
            current, size, mark = [], 0, bucket_bytes
    if current:
        batches.append([r.template() for r in current])
    return Schedule(batches, period=list(period))
