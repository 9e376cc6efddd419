"""Adasum: adaptive summation of gradients (Maleki et al., "Scaling Distributed Training with
Adaptive Summation", MLSys 2021), as Horovod computes it.

Two gradients ``a`` and ``b`` are combined as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

Orthogonal gradients are added, parallel ones averaged. Ranks are combined pairwise in a binary
tree (rank 2k with 2k+1, then pairs of pairs, ...), each tensor of a fused buffer with its own
coefficients. The tree runs as a vector-halving, distance-doubling exchange: at each level a rank
keeps half of its current segment and swaps the other half with its partner, so every rank
computes the combination of one slice; the dot products and norms of each tensor are summed over
the ranks that hold its slices (products and sums in float64, as Horovod takes them; the
combination is computed in the buffer's own precision). The slices then travel back up the tree until every
rank holds the whole result. The number of ranks must be a power of two, as in Horovod.

This module knows flat CPU buffers and a communicator's point-to-point exchange, never requests.
"""

from __future__ import annotations

import math
import sys

import torch

from hora.common.transport import Communicator

# Below this squared norm a gradient counts as zero: its coefficient stays 1 (Horovod's bound).
_TINY_NORM_SQ = math.sqrt(sys.float_info.min)


def is_power_of_two(count: int) -> bool:
    return count > 0 and count & (count - 1) == 0


def coefficients(
    dot: torch.Tensor, left_sq: torch.Tensor, right_sq: torch.Tensor
) -> tuple[list[float], list[float]]:
    """Per tensor, the factors of the left and the right gradient."""
    left = torch.where(left_sq >= _TINY_NORM_SQ, 1.0 - dot / (2.0 * left_sq), 1.0)
    right = torch.where(right_sq >= _TINY_NORM_SQ, 1.0 - dot / (2.0 * right_sq), 1.0)
    return left.tolist(), right.tolist()


# Below this many elements per tensor on average, one vectorised reduction over all tensors
# beats a loop over them (measured: 200 tensors of 100 elements, 0.1 against 2.7 ms; 8 of 500k,
# 9 against 95 ms).
_LOOP_FROM = 1 << 14


def products(left: torch.Tensor, right: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Per tensor (pieces of ``lengths`` elements, one after another): ``left . right``,
    ``|left|^2`` and ``|right|^2``, as a float64 tensor of shape (3, len(lengths)).

    Products and sums are taken in float64, as Horovod takes them: a float32 product of two
    gradients near float32's smallest normal (1e-38) underflows to zero, which would make
    parallel gradients look orthogonal and sum them instead of averaging them.
    """
    if not lengths:
        return torch.zeros(3, 0, dtype=torch.float64)
    left, right = left.double(), right.double()
    if left.numel() >= _LOOP_FROM * len(lengths):
        sums = [
            torch.stack([torch.dot(a, b), torch.dot(a, a), torch.dot(b, b)])
            for a, b in zip(left.split(lengths), right.split(lengths))
        ]
        return torch.stack(sums, dim=1)
    stacked = torch.stack([left * right, left * left, right * right])
    counts = torch.tensor(lengths, dtype=torch.int64).expand(3, len(lengths))
    return torch.segment_reduce(stacked, "sum", lengths=counts, axis=1)


def combine_into(
    out: torch.Tensor,
    other: torch.Tensor,
    lengths: list[int],
    out_factors: list[float],
    other_factors: list[float],
) -> None:
    """``out = out_factor * out + other_factor * other``, tensor by tensor (``other`` is
    scaled in place too); in the buffer's precision."""
    outs, others = list(out.split(lengths)), list(other.split(lengths))
    torch._foreach_mul_(outs, out_factors)
    torch._foreach_mul_(others, other_factors)
    torch._foreach_add_(outs, others)


def allreduce(buffer: torch.Tensor, counts: list[int], comm: Communicator) -> None:
    """Adasum-reduce ``buffer`` in place across the communicator's members.

    Args:
        buffer: a flat, contiguous float32 or float64 CPU buffer: the tensors, one after another.
        counts: the number of elements of each tensor in ``buffer``.
        comm: the members; their number must be a power of two.

    Raises:
        ValueError: the number of members is not a power of two.
        TransportError: an exchange failed.
    """
    size, rank = comm.size, comm.rank
    if not is_power_of_two(size):
        raise ValueError(f"Adasum needs a power-of-two number of ranks, not {size}.")
    if size == 1 or buffer.numel() == 0:
        return
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    received = torch.empty_like(buffer)
    lo, hi = 0, buffer.numel()
    parents: list[tuple[int, int]] = []
    distance = 1
    while distance < size:
        # Halve the segment: the rank whose bit is clear keeps the first half (the smaller one
        # when the length is odd), its partner the second; each sends the half it gives up.
        mid = lo + (hi - lo) // 2
        lower = rank & distance == 0
        keep, give = ((lo, mid), (mid, hi)) if lower else ((mid, hi), (lo, mid))
        partner = rank ^ distance
        comm.sendrecv(buffer[give[0] : give[1]], received[keep[0] : keep[1]], partner)
        mine = buffer[keep[0] : keep[1]]
        theirs = received[keep[0] : keep[1]]
        left, right = (mine, theirs) if lower else (theirs, mine)
        # Every tensor's part of the kept segment (empty for tensors outside it).
        lengths = [max(0, min(e, keep[1]) - max(b, keep[0])) for b, e in zip(starts, starts[1:])]
        sums = products(left, right, lengths)
        # The whole of both gradients lies with the 2 * distance ranks of this subtree.
        _sum_within(sums, rank, 2 * distance, comm)
        left_factor, right_factor = coefficients(sums[0], sums[1], sums[2])
        if lower:
            combine_into(mine, theirs, lengths, left_factor, right_factor)
        else:
            combine_into(mine, theirs, lengths, right_factor, left_factor)
        parents.append((lo, hi))
        lo, hi = keep
        distance *= 2
    # Back up the tree: swap slices with the same partners, in reverse, until all is whole.
    while parents:
        distance //= 2
        parent_lo, parent_hi = parents.pop()
        sibling = (hi, parent_hi) if rank & distance == 0 else (parent_lo, lo)
        comm.sendrecv(buffer[lo:hi], buffer[sibling[0] : sibling[1]], rank ^ distance)
        lo, hi = parent_lo, parent_hi


def _sum_within(values: torch.Tensor, rank: int, group: int, comm: Communicator) -> None:
    """Sum ``values`` over the ``group`` consecutive ranks that include ``rank`` (a power of
    two, aligned), by recursive doubling; every member ends with bit-identical sums."""
    incoming = torch.empty_like(values)
    distance = 1
    while distance < group:
        comm.sendrecv(values, incoming, rank ^ distance)
        # a + b == b + a exactly, so both partners hold the same sum.
        values.add_(incoming)
        distance *= 2


def reference(vectors: list[torch.Tensor], counts: list[int]) -> torch.Tensor:
    """Adasum of per-rank flat buffers computed in one process, by the same tree (for tests
    and for checking a job's result)."""
    if not is_power_of_two(len(vectors)):
        raise ValueError(f"Adasum needs a power-of-two number of ranks, not {len(vectors)}.")
    level = [v.clone() for v in vectors]
    while len(level) > 1:
        for left, right in zip(level[0::2], level[1::2]):
            sums = products(left, right, counts)
            left_factor, right_factor = coefficients(sums[0], sums[1], sums[2])
            combine_into(left, right.clone(), counts, left_factor, right_factor)
        level = level[0::2]
    return level[0]
