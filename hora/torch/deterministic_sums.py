"""Deterministic mode's sums of gradients: each micro-batch's gradient (a *leaf*) laid out in one
flat buffer per element type, the rank's nodes of the fixed tree summed as the leaves arrive,
every rank's nodes gathered, and the upper levels completed in the tree's order
(:mod:`hora.torch.deterministic_tree` says which sums those are).

Every sum is an element-wise addition of two whole flat buffers (or of a leaf's gradients into
the views of one), so an element's value depends only on the two values added, never on where
they were added, by which rank, or how the buffer is cut: that is why the root is the same bits
for every world size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hora.torch import deterministic_tree as tree
from hora.torch.deterministic_tree import Span


@dataclass
class _Node:
    """A node of the tree summed so far on this rank: its leaves and the buffer holding it."""

    span: Span
    buffer: torch.Tensor


@dataclass
class FlatGradients:
    """The parameters of one element type, laid out back to back in flat buffers.

    Attributes:
        params: the parameters, in the optimizer's order.
        grad_dtype: their element type (the gradients' too).
        wire_dtype: the type their sums are taken and sent in (a compressed type, or the same).
        prescale: each leaf is multiplied by it when it is taken (1: not at all).
        values: the leaves are the tensors' own values (buffers a forward pass updates, such
            as batch norm's running statistics), not their gradients.
        offsets: where each parameter starts in a flat buffer.
        numel: the flat buffers' length.
    """

    params: list[torch.Tensor]
    grad_dtype: torch.dtype
    wire_dtype: torch.dtype
    prescale: float = 1.0
    values: bool = False
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    _zeros: dict[int, torch.Tensor] = field(default_factory=dict)
    _rows: torch.Tensor | None = None
    _stack: list[_Node] = field(default_factory=list)
    _scratch: list[torch.Tensor] = field(default_factory=list)
    _cover: list[Span] = field(default_factory=list)
    _leaves: int = 0
    _reduced: torch.Tensor | None = None

    def __post_init__(self) -> None:
        position = 0
        self.offsets = []
        for p in self.params:
            self.offsets.append(position)
            position += p.numel()
        self.numel = position

    # ------------------------------------------------------------------ this rank's nodes

    def begin(self, cover: list[Span], leaves: int) -> None:
        """Start a step whose leaves on this rank form the nodes ``cover`` of a tree over
        ``leaves`` leaves."""
        self._cover = list(cover)
        self._leaves = leaves
        self._stack = []
        rows = self._rows
        if rows is None or rows.shape[0] != len(cover):
            device = self.params[0].device
            self._rows = torch.empty(len(cover), self.numel, dtype=self.wire_dtype, device=device)

    def _gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient of the micro-batch that just ended (zeros where it got
        none: a zero is added as every other value is, wherever the leaf goes), or the
        tensors' values."""
        if self.values:
            return list(self.params)
        grads = []
        for index, p in enumerate(self.params):
            grad = p.grad
            if grad is None:
                grad = self._zeros.get(index)
                if grad is None:
                    grad = self._zeros[index] = torch.zeros_like(p)
            elif grad.is_sparse:
                grad = grad.to_dense()
            grads.append(grad)
        return grads

    def _views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return [
            buffer[offset : offset + p.numel()].view(p.shape)
            for offset, p in zip(self.offsets, self.params)
        ]

    def _buffer_for(self, leaf: int) -> torch.Tensor:
        """Where a leaf starting a new node goes: the row of its cover node when it is that
        node's first leaf (the node's sum then builds up in the row that is sent), else a
        scratch buffer."""
        assert self._rows is not None
        for row, span in enumerate(self._cover):
            if span[0] == leaf:
                return self._rows[row]
        if self._scratch:
            return self._scratch.pop()
        return torch.empty_like(self._rows[0])

    def add_leaf(self, leaf: int) -> None:
        """Take the parameters' gradients as leaf ``leaf``'s and sum every node it completes."""
        grads = self._gradients()
        span = (leaf, leaf + 1)
        stack = self._stack
        direct = self.wire_dtype == self.grad_dtype and self.prescale == 1.0
        if direct and stack and tree.are_siblings(stack[-1].span, span, self._leaves):
            # Its left sibling is a leaf too: add the gradients straight into its views.
            left = stack[-1]
            torch._foreach_add_(self._views(left.buffer), grads)
            left.span = (left.span[0], span[1])
        else:
            buffer = self._buffer_for(leaf)
            torch._foreach_copy_(self._views(buffer), grads)
            if self.prescale != 1.0:
                buffer.mul_(self.prescale)
            stack.append(_Node(span, buffer))
        while len(stack) >= 2 and tree.are_siblings(stack[-2].span, stack[-1].span, self._leaves):
            right = stack.pop()
            left = stack[-1]
            left.buffer.add_(right.buffer)
            left.span = (left.span[0], right.span[1])
            self._scratch.append(right.buffer)

    def nodes(self) -> torch.Tensor:
        """This rank's cover nodes, one row each, once every leaf of its block is in."""
        spans = [node.span for node in self._stack]
        if spans != self._cover:
            raise AssertionError(f"deterministic sums: nodes {spans}, expected {self._cover}")
        assert self._rows is not None
        return self._rows

    # ------------------------------------------------------------------ every rank's nodes

    def complete(self, gathered: torch.Tensor, covers: Sequence[Sequence[Span]]) -> torch.Tensor:
        """The root: ``gathered`` holds every rank's cover nodes in rank order (``covers``),
        one row each; the missing levels are added in the tree's order (in place, in the
        rows)."""
        spans = [span for ranks_cover in covers for span in ranks_cover]
        if len(spans) != gathered.shape[0]:
            raise AssertionError(f"deterministic sums: {gathered.shape[0]} rows for {spans}")
        nodes = {span: gathered[row] for row, span in enumerate(spans)}
        return tree.complete(nodes, self._leaves, lambda left, right: left.add_(right))

    def reduced(self, root: torch.Tensor, postscale: float, divisor: int) -> list[torch.Tensor]:
        """The reduced gradients, views of one buffer of the gradients' type: ``root`` cast
        back, multiplied by ``postscale`` (unless 1), divided by ``divisor`` (unless 1; an
        integer type's quotient is rounded down)."""
        out = self._reduced
        if out is None or out.device != root.device:
            out = self._reduced = torch.empty(self.numel, dtype=self.grad_dtype, device=root.device)
        if not out.dtype.is_floating_point:
            torch.div(root, divisor, rounding_mode="floor", out=out)
        elif divisor != 1 and postscale == 1.0 and root.dtype == out.dtype:
            torch.div(root, divisor, out=out)
        else:
            out.copy_(root)
            if postscale != 1.0:
                out.mul_(postscale)
            if divisor != 1:
                out.div_(divisor)
        return self._views(out)


def flat_groups(
    params: Sequence[torch.Tensor],
    wire_of: dict[torch.dtype, torch.dtype],
    prescale: float,
    values: bool = False,
) -> list[FlatGradients]:
    """The parameters (or, with ``values``, buffers) grouped by element type and device, in
    order of first appearance; each group's sums are taken in ``wire_of[dtype]`` (its own type
    when absent)."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p)
    return [
        FlatGradients(members, dtype, wire_of.get(dtype, dtype), prescale, values)
        for (dtype, _), members in groups.items()
    ]
