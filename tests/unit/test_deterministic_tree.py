"""Deterministic mode's fixed tree and its sums, on one process.

The tree (hora/torch/deterministic_tree.py) must give one and the same sum, addition for
addition, whichever world size shares out its leaves; the sums over real tensors
(hora/torch/deterministic_sums.py) must follow it bit for bit, whatever the element type.
"""

from __future__ import annotations

import pytest
import torch

from hora.torch import deterministic_sampler, deterministic_tree
from hora.torch.deterministic_sums import FlatGradients


def _expression(span: tuple[int, int], leaves: int) -> str:
    """The sum of a node as the tree writes it: ``((0+1)+2)``."""
    pair = deterministic_tree.children(span, leaves)
    if pair is None:
        return str(span[0])
    return f"({_expression(pair[0], leaves)}+{_expression(pair[1], leaves)})"


@pytest.mark.parametrize("leaves", range(1, 49))
def test_every_world_size_that_divides_k_completes_the_same_additions(leaves: int) -> None:
    whole = _expression((0, leaves), leaves)
    for size in deterministic_tree.divisors(leaves):
        nodes = {}
        for rank in range(size):
            start, end = deterministic_tree.block(leaves, size, rank)
            cover = deterministic_tree.cover(start, end, leaves)
            assert cover[0][0] == start and cover[-1][1] == end
            assert all(a[1] == b[0] for a, b in zip(cover, cover[1:]))
            nodes.update({span: _expression(span, leaves) for span in cover})
        root = deterministic_tree.complete(nodes, leaves, lambda a, b: f"({a}+{b})")
        assert root == whole, (leaves, size)


def test_a_power_of_two_block_is_one_subtree_and_k12_is_cut_as_documented() -> None:
    assert [
        deterministic_tree.cover(*deterministic_tree.block(16, 4, r), 16) for r in range(4)
    ] == [
        [(0, 4)],
        [(4, 8)],
        [(8, 12)],
        [(12, 16)],
    ]
    covers = [deterministic_tree.cover(*deterministic_tree.block(12, 4, r), 12) for r in range(4)]
    assert covers == [[(0, 2), (2, 3)], [(3, 4), (4, 6)], [(6, 8), (8, 9)], [(9, 10), (10, 12)]]
    assert deterministic_tree.describe(12)[-1] == "[0,12) = [0,8) + [8,12)"
    assert deterministic_tree.refusal(12, 5) is not None
    assert deterministic_tree.refusal(12, 3) is None


def _leaf_gradients(params: list[torch.Tensor], leaf: int) -> None:
    generator = torch.Generator().manual_seed(leaf)
    for p in params:
        p.grad = (
            None
            if leaf % 5 == 3
            else torch.randn(p.shape, generator=generator) * 10.0 ** (leaf % 4)
        )


@pytest.mark.parametrize("wire", [torch.float32, torch.float16])
@pytest.mark.parametrize("leaves", [4, 6, 12])
def test_flat_sums_are_the_same_bits_at_every_world_size(wire: torch.dtype, leaves: int) -> None:
    params = [torch.zeros(3, 5), torch.zeros(7), torch.zeros(2, 2, 2)]
    roots = []
    for size in deterministic_tree.divisors(leaves):
        rows, covers = [], []
        for rank in range(size):
            sums = FlatGradients(params, torch.float32, wire)
            start, end = deterministic_tree.block(leaves, size, rank)
            cover = deterministic_tree.cover(start, end, leaves)
            sums.begin(cover, leaves)
            for leaf in range(start, end):
                _leaf_gradients(params, leaf)
                sums.add_leaf(leaf)
            rows.append(sums.nodes().clone())
            covers.append(cover)
        root = sums.complete(torch.cat(rows), covers)
        roots.append(torch.cat([g.reshape(-1) for g in sums.reduced(root, 1.0, leaves)]))
    assert all(torch.equal(roots[0], other) for other in roots[1:])


def test_micro_batch_seeds_differ_by_step_and_index_and_a_sampler_cuts_by_position() -> None:
    seeds = {deterministic_sampler.microbatch_seed(s, i) for s in range(50) for i in range(12)}
    assert len(seeds) == 600
    whole = deterministic_sampler.DeterministicSampler(range(100), 4, 5, num_replicas=1, rank=0)
    halves = [
        deterministic_sampler.DeterministicSampler(range(100), 4, 5, num_replicas=2, rank=r)
        for r in range(2)
    ]
    one = next(whole.steps()).microbatches
    two = next(halves[0].steps()).microbatches + next(halves[1].steps()).microbatches
    assert one == two
    assert whole.steps_per_epoch == 5 and len(whole) == 20 and len(halves[1]) == 10
    with pytest.raises(ValueError, match="K=4"):
        deterministic_sampler.DeterministicSampler(range(100), 4, 5, num_replicas=3, rank=0)
