"""Where a sharded ``DistributedOptimizer`` (ZeRO stages 1 and 2) keeps what: which parameters
travel together in one bucket, and which elements of each bucket every rank owns.

A bucket is a run of whole parameters of one dtype and device, laid end to end in one flat
buffer (a parameter's elements in their flat, row-major order). The bucket's gradients are
reduce-scattered as that one flat tensor, and the engine gives rank ``i`` of ``n`` the
``i``-th contiguous part of it: ``numel // n`` elements, one more for the first ``numel % n``
ranks. What a rank owns of one parameter is therefore one interval of its elements (a
:class:`Piece`, possibly empty). The updated parts are allgathered in the same order.

This module is pure arithmetic on sizes: it knows no tensors, optimizers or collectives.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """A parameter's place in its bucket.

    Attributes:
        index: the parameter's position in the optimizer's trainable parameters.
        offset: its first element in the bucket's flat buffer.
        numel: its number of elements.
    """

    index: int
    offset: int
    numel: int


@dataclass(frozen=True)
class Piece:
    """The elements of one parameter that one rank owns (and updates).

    Attributes:
        index: the parameter's position in the optimizer's trainable parameters.
        bucket: the bucket's number.
        start: the first element owned, counted in the parameter's flat order.
        stop: one past the last element owned.
        shard_offset: where the piece begins in the rank's part of the bucket.
    """

    index: int
    bucket: int
    start: int
    stop: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Bucket:
    """Parameters reduce-scattered (and allgathered) as one flat tensor.

    Attributes:
        number: its position in the layout (the order buckets are built in).
        slots: its parameters, in the order they lie in the flat buffer.
        numel: the flat buffer's length.
    """

    number: int
    slots: tuple[Slot, ...]
    numel: int

    def bounds(self, size: int) -> list[int]:
        """Where each rank's part begins, and the end: rank ``r`` owns
        ``[bounds[r], bounds[r + 1])`` (the engine's reducescatter split)."""
        base, extra = divmod(self.numel, size)
        edges = [0]
        for rank in range(size):
            edges.append(edges[-1] + base + (1 if rank < extra else 0))
        return edges

    def pieces(self, rank: int, size: int) -> list[Piece]:
        """The non-empty pieces ``rank`` owns, in the bucket's order."""
        edges = self.bounds(size)
        low, high = edges[rank], edges[rank + 1]
        owned = []
        for slot in self.slots:
            first = max(low, slot.offset)
            last = min(high, slot.offset + slot.numel)
            if first < last:
                owned.append(
                    Piece(
                        slot.index,
                        self.number,
                        first - slot.offset,
                        last - slot.offset,
                        first - low,
                    )
                )
        return owned


def plan_buckets(
    numels: Sequence[int],
    keys: Sequence[Hashable],
    bucket_elements: Sequence[int],
    groups: Sequence[Sequence[int]] | None = None,
) -> list[Bucket]:
    """Pack parameters into buckets, the last parameter first (backward produces gradients
    roughly in reverse order, so the first bucket is complete first).

    Args:
        numels: each trainable parameter's number of elements.
        keys: each parameter's dtype and device (only equal keys share a bucket).
        bucket_elements: per parameter, the most elements a bucket of its dtype may hold
            (``bytes // element_size``); a parameter larger than that is a bucket alone.
        groups: explicit buckets (lists of parameter indices) instead of packing by size;
            each list is split further where the keys differ.

    Returns:
        The buckets, numbered in order.
    """
    runs: list[list[int]] = []
    if groups is not None:
        for group in groups:
            by_key: dict[Hashable, list[int]] = {}
            for index in group:
                by_key.setdefault(keys[index], []).append(index)
            runs.extend(by_key.values())
    else:
        open_runs: dict[Hashable, tuple[list[int], int]] = {}
        for index in reversed(range(len(numels))):
            key = keys[index]
            current = open_runs.get(key)
            if current is not None and current[1] + numels[index] <= bucket_elements[index]:
                current[0].append(index)
                open_runs[key] = (current[0], current[1] + numels[index])
                continue
            run = [index]
            runs.append(run)
            open_runs[key] = (run, numels[index])
    buckets = []
    for number, run in enumerate(runs):
        slots = []
        offset = 0
        for index in run:
            slots.append(Slot(index, offset, numels[index]))
            offset += numels[index]
        buckets.append(Bucket(number, tuple(slots), offset))
    return buckets


@dataclass(frozen=True)
class Layout:
    """The buckets and this rank's pieces of them, for ``size`` ranks.

    Attributes:
        buckets: every bucket.
        rank: this rank's place among the ranks that share the optimizer.
        size: how many ranks share it.
        pieces: per bucket, this rank's non-empty pieces.
        shard_numels: per bucket, the length of this rank's part.
    """

    buckets: tuple[Bucket, ...]
    rank: int
    size: int
    pieces: tuple[tuple[Piece, ...], ...]
    shard_numels: tuple[int, ...]

    @staticmethod
    def of(buckets: Sequence[Bucket], rank: int, size: int) -> Layout:
        pieces = tuple(tuple(bucket.pieces(rank, size)) for bucket in buckets)
        numels = []
        for bucket in buckets:
            edges = bucket.bounds(size)
            numels.append(edges[rank + 1] - edges[rank])
        return Layout(tuple(buckets), rank, size, pieces, tuple(numels))

    def piece_of(self) -> dict[int, Piece]:
        """This rank's piece of each parameter that it owns a part of, by parameter index."""
        return {piece.index: piece for pieces in self.pieces for piece in pieces}
