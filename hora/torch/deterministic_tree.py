"""The fixed summation tree of deterministic mode: which sums are taken, in which order, over the
``K`` micro-batches of a step, whatever the number of ranks. Arithmetic on leaf ranges only: no
tensors, no collectives.

The tree is the left-to-right pairwise tree over the leaves ``0 .. K-1``. Level 0 holds the
leaves; level ``l + 1`` adds neighbours two by two, ``(0, 1), (2, 3), ...``, and a last node
without a partner is carried up unchanged (no addition). So node ``(l, i)`` is the sum of the
leaves ``[i * 2**l, min((i + 1) * 2**l, K))``, and a node is known by that range alone: a
carried node and the node it was carried from are one and the same sum. For ``K = 12``::

    leaves      0   1   2   3   4   5   6   7   8   9  10  11
    level 1     [0,2)   [2,4)   [4,6)   [6,8)   [8,10)  [10,12)
    level 2     [0,4)           [4,8)           [8,12)
    level 3     [0,8)                           [8,12)  (carried)
    root        [0,12) = [0,8) + [8,12)

Rank ``r`` of ``N`` (``N`` divides ``K``) holds the block of leaves ``[r * K/N, (r + 1) * K/N)``
and sums, bottom-up, every node of the tree that lies within its block. What it hands on is the
block's *cover*: the largest nodes within the block, left to right. When ``K/N`` is a power of
two the block is one node (one subtree); otherwise the cover has a few nodes (``K = 12``,
``N = 4``: ``[0,2), [2,3)`` on rank 0, ``[3,4), [4,6)`` on rank 1, ...). Every rank then
receives every cover and completes the upper levels itself (:func:`complete`), in the tree's
order. Each node's value is computed the same way wherever it is computed, so the root is the
same bits for every ``N`` that divides ``K``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

# A node of the tree: the leaves it sums, ``(start, end)``, end excluded.
Span = tuple[int, int]

T = TypeVar("T")


def _size_level(size: int) -> int:
    """The lowest level whose nodes can hold ``size`` leaves: ``ceil(log2(size))``."""
    return (size - 1).bit_length()


def is_node(span: Span, leaves: int) -> bool:
    """Whether ``span`` is the range of a node of the tree over ``leaves`` leaves."""
    start, end = span
    if not 0 <= start < end <= leaves:
        return False
    width = 1 << _size_level(end - start)
    return start % width == 0 and end == min(start + width, leaves)


def children(span: Span, leaves: int) -> tuple[Span, Span] | None:
    """The two nodes whose sum is node ``span`` (``None`` for a leaf), left then right."""
    if not is_node(span, leaves):
        raise ValueError(f"{span} is not a node of the tree over {leaves} leaves")
    start, end = span
    if end - start == 1:
        return None
    middle = start + (1 << (_size_level(end - start) - 1))
    return (start, middle), (middle, end)


def are_siblings(left: Span, right: Span, leaves: int) -> bool:
    """Whether ``left`` and ``right`` are the two children of one node (then it is their
    sum)."""
    if left[1] != right[0]:
        return False
    merged = (left[0], right[1])
    return is_node(merged, leaves) and children(merged, leaves) == (left, right)


def cover(start: int, end: int, leaves: int) -> list[Span]:
    """The largest nodes within the leaves ``[start, end)``, left to right: what a rank that
    holds those leaves sums by itself and hands on."""
    if not 0 <= start < end <= leaves:
        raise ValueError(f"[{start}, {end}) is not a block of {leaves} leaves")
    spans = []
    position = start
    while position < end:
        # The widest aligned node that starts here and ends within the block.
        level = (position & -position).bit_length() - 1 if position else _size_level(leaves)
        while min(position + (1 << level), leaves) > end:
            level -= 1
        stop = min(position + (1 << level), leaves)
        spans.append((position, stop))
        position = stop
    return spans


def complete(nodes: dict[Span, T], leaves: int, add: Callable[[T, T], T]) -> T:
    """The root from ``nodes`` (sums of nodes that together cover every leaf once), the missing
    levels added in the tree's order: ``add(left, right)`` for each missing node.

    ``add`` may work in place on its left argument: each value is used once.
    """

    def value(span: Span) -> T:
        found = nodes.get(span)
        if found is not None:
            return found
        pair = children(span, leaves)
        if pair is None:
            raise ValueError(f"leaf {span[0]} is in no node given")
        left = value(pair[0])
        return add(left, value(pair[1]))

    return value((0, leaves))


def block(leaves: int, size: int, rank: int) -> tuple[int, int]:
    """The leaves ``[start, end)`` rank ``rank`` of ``size`` ranks holds (``size`` divides
    ``leaves``)."""
    per_rank = leaves // size
    return rank * per_rank, (rank + 1) * per_rank


def divisors(number: int) -> list[int]:
    """The world sizes that can share ``number`` micro-batches evenly."""
    return [d for d in range(1, number + 1) if number % d == 0]


def refusal(leaves: int, size: int) -> str | None:
    """Why ``size`` ranks cannot share ``leaves`` micro-batches (``None``: they can)."""
    if size <= leaves and leaves % size == 0:
        return None
    usable = ", ".join(str(d) for d in divisors(leaves))
    multiples = ", ".join(str(size * m) for m in range(1, 5))
    return (
        f"deterministic mode splits each step into K={leaves} micro-batches, shared evenly "
        f"among the ranks, but this job has {size} ranks, and {size} does not divide {leaves}. "
        f"Run it on a number of ranks that divides K ({usable}), or choose a K that {size} "
        f"ranks divide ({multiples}, ...; a K of its own gives other results)."
    )


def describe(leaves: int) -> list[str]:
    """The tree's sums, one line per node that adds, bottom-up: ``[0,4) = [0,2) + [2,4)``."""
    lines: list[str] = []

    def walk(span: Span) -> None:
        pair = children(span, leaves)
        if pair is None:
            return
        walk(pair[0])
        walk(pair[1])
        lines.append(
            f"[{span[0]},{span[1]}) = [{pair[0][0]},{pair[0][1]}) + [{pair[1][0]},{pair[1][1]})"
        )

    walk((0, leaves))
    return lines
