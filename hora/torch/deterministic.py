"""Deterministic data-parallel training: the same bits at any world size (docs/deterministic.md).

``hvd.DistributedOptimizer(..., deterministic=True, microbatches=K)`` cuts every step into
``K`` micro-batches by global sample position and sums their gradients along one fixed binary
tree, so a run ends with the same parameters, bit for bit, at every world size that divides
``K``, and after elastic changes of the world size. This module holds what a training loop needs
besides the optimizer: the sampler that hands out micro-batches, and seeds that belong to a
micro-batch rather than to a rank.

Usage::

    import torch
    import hora.torch as hvd
    from hora.torch import deterministic

    hvd.init()
    torch.set_num_threads(1)  # the same on every rank: kernels split work by thread
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        deterministic=True, microbatches=12,
    )
    sampler = deterministic.DeterministicSampler(dataset, microbatches=12, microbatch_size=8)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        while state.epoch < 10:
            for step in sampler.steps():
                optimizer.zero_grad()
                for mb in step:                      # this rank's micro-batches
                    with optimizer.microbatch(mb):   # dropout seeded by (step, micro-batch)
                        x, y = dataset[list(mb.indices)]
                        loss_fn(model(x), y).backward()
                optimizer.step()
                sampler.record_step()
                state.commit()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()

Public names:

* :class:`DeterministicSampler`, with :class:`Step` and :class:`MicroBatch`: micro-batches by
  global position, resumable (``hvd.elastic.TorchState`` keeps its progress).
* :func:`microbatch_seed`, :func:`microbatch_generator`, :func:`seeded`: randomness of a
  micro-batch, the same on whichever rank runs it.
* :func:`tree_sums`: the fixed tree's additions for a ``K``, as text; :func:`world_sizes`: the
  world sizes a ``K`` allows.
"""

from __future__ import annotations

from hora.torch import deterministic_tree
from hora.torch.deterministic_sampler import (
    DeterministicSampler,
    MicroBatch,
    Step,
    microbatch_generator,
    microbatch_seed,
    seeded,
)


def tree_sums(microbatches: int) -> list[str]:
    """The additions of the fixed tree over ``microbatches`` leaves, bottom-up, one per line:
    ``[0,4) = [0,2) + [2,4)`` is the sum of leaves 0..3, the sum of 0..1 plus the sum of 2..3.

    Example:
        >>> deterministic.tree_sums(3)
        ['[0,2) = [0,1) + [1,2)', '[0,3) = [0,2) + [2,3)']
    """
    return deterministic_tree.describe(microbatches)


def world_sizes(microbatches: int) -> list[int]:
    """The world sizes that can train with ``microbatches`` micro-batches per step (its
    divisors)."""
    return deterministic_tree.divisors(microbatches)


__all__ = [
    "DeterministicSampler",
    "MicroBatch",
    "Step",
    "microbatch_generator",
    "microbatch_seed",
    "seeded",
    "tree_sums",
    "world_sizes",
]
