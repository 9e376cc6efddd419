"""Adasum: adaptive summation of gradients (Maleki et al., "Scaling Distributed Training with
Adaptive Summation", MLSys 2021), as Horovod computes it.

Two gradients ``a`` and ``b`` are combined as::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

Orthogonal gradients are added, parallel ones averaged. Ranks are combined pairwise in a binary
tree (rank 2k with 2k+1, then pairs of pairs, ...), each tensor of a fused buffer with its own
coefficients. The tree runs as a vector-halving, distance-doubling exchange: at each level a rank
keeps half of its current segment and swaps the other half with its partner, so every rank
computes the combination of one slice; the dot products and norms of each tensor are summed over
the ranks that hold its slices. The slices then travel back up the tree until every rank holds
the whole result. The number of ranks must be a power of two, as in Horovod.

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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tensor, the factors of the left and the right gradient (float64)."""
    left = torch.where(left_sq >= _TINY_NORM_SQ, 1.0 - dot / (2.0 * left_sq), 1.0)
    right = torch.where(right_sq >= _TINY_NORM_SQ, 1.0 - dot / (2.0 * right_sq), 1.0)
    return left, right


def combine(left: torch.Tensor, right: torch.Tensor, owner: torch.Tensor, count: int) -> None:
    """Adasum of ``left`` and ``right`` over whole tensors, written into ``left``.

    Args:
        left, right: flat buffers of the same length.
        owner: for each element, the index of the tensor it belongs to.
        count: the number of tensors.
    """
    dot, left_sq, right_sq = partial_products(left, right, owner, count)
    _scaled_add(left, right, owner, *coefficients(dot, left_sq, right_sq))


def partial_products(
    left: torch.Tensor, right: torch.Tensor, owner: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per tensor, the parts of ``left . right``, ``|left|^2`` and ``|right|^2`` that these
    elements hold, accumulated in float64."""
    wide_left, wide_right = left.double(), right.double()
    sums = torch.zeros(3, count, dtype=torch.float64)
    sums[0].index_add_(0, owner, wide_left * wide_right)
    sums[1].index_add_(0, owner, wide_left * wide_left)
    sums[2].index_add_(0, owner, wide_right * wide_right)
    return sums[0], sums[1], sums[2]


def _scaled_add(
    left: torch.Tensor,
    right: torch.Tensor,
    owner: torch.Tensor,
    left_factor: torch.Tensor,
    right_factor: torch.Tensor,
) -> None:
    # Computed in float64 and rounded once, as Horovod combines each element.
    combined = left.double().mul_(left_factor[owner]).add_(right.double().mul_(right_factor[owner]))
    left.copy_(combined)


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
    owner = torch.repeat_interleave(
        torch.arange(len(counts)), torch.tensor(counts, dtype=torch.int64)
    )
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
        mine_owner = owner[keep[0] : keep[1]]
        sums = torch.stack(partial_products(left, right, mine_owner, len(counts)))
        # The whole of both gradients lies with the 2 * distance ranks of this subtree.
        _sum_within(sums, rank, 2 * distance, comm)
        left_factor, right_factor = coefficients(sums[0], sums[1], sums[2])
        if lower:
            _scaled_add(mine, theirs, mine_owner, left_factor, right_factor)
        else:
            _scaled_add(mine, theirs, mine_owner, right_factor, left_factor)
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
    owner = torch.repeat_interleave(
        torch.arange(len(counts)), torch.tensor(counts, dtype=torch.int64)
    )
    level = [v.clone() for v in vectors]
    while len(level) > 1:
        for left, right in zip(level[0::2], level[1::2]):
            combine(left, right, owner, len(counts))
        level = level[0::2]
    return level[0]
