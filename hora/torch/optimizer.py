"""``DistributedOptimizer``: wraps any ``torch.optim`` optimizer so that ``step()`` uses
gradients combined across ranks. The usual form averages (or sums) gradients
(:mod:`hora.torch.averaging_optimizer`); ``op=hvd.Adasum`` combines updates
(:mod:`hora.torch.adasum_optimizer`). This module checks the arguments and makes the class.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from hora.common import api
from hora.common.ops import compression as compression_policy
from hora.common.ops import submission
from hora.common.process_sets import ProcessSet
from hora.common.vocabulary.message import ReduceOp, RequestType
from hora.torch import deterministic_optimizer, ops
from hora.torch.adasum_optimizer import _DistributedAdasumOptimizer
from hora.torch.averaging_optimizer import _DistributedOptimizer
from hora.torch.compression import Compression
from hora.torch.gradient_reduction import DistributedOptions
from hora.torch.zero_optimizer import make_sharded


def DistributedOptimizer(  # Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = ReduceOp.AVERAGE,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = ops.global_process_set,
    shard_optimizer_state: bool = False,
    shard_gradients: bool = False,
    *,
    deterministic: bool | None = None,
    microbatches: int | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged across ranks.

    Args:
        optimizer: any ``torch.optim`` optimizer (its hyperparameters carry over; its state
            does not, so wrap before loading a checkpoint).
        named_parameters: ``model.named_parameters()``; names the allreduces (recommended).
        compression: ``Compression.none``, ``Compression.fp16`` or ``Compression.bf16``
            (with ``Compression.none``, ``HORA_GRADIENT_COMPRESSION`` may choose one).
        backward_passes_per_step: backward passes to accumulate locally before reducing.
        op: ``hvd.Average`` (default), ``hvd.Sum``, or ``hvd.Adasum`` (each rank steps on its
            own gradient and the updates are combined with Adasum; a power-of-two number of
            ranks, the global process set; see docs/training.md).
        gradient_predivide_factor: divide gradients by this before the sum and multiply after
            (Average only).
        num_groups: deprecated; use ``groups``.
        groups: an int (split parameters into that many groups) or a list of parameter lists;
            each group is reduced as one grouped allreduce.
        sparse_as_dense: reduce sparse gradients as dense tensors.
        process_set: the ranks that train together.
        shard_optimizer_state: ZeRO stage 1: gradients are reduce-scattered and each rank keeps
            and updates only its shard of the optimizer state; updated parameters are
            allgathered (see docs/zero.md). hora's extension, not in Horovod.
        shard_gradients: ZeRO stage 2 (with ``shard_optimizer_state=True``): each ``.grad`` is
            also released once it has been sent, so a rank keeps only its gradient shard.
        deterministic: combine gradients in one fixed order, the same bits at every world
            size that divides ``microbatches`` (default: ``HORA_DETERMINISTIC``); each step's
            backward passes then run in micro-batches, ``with optimizer.microbatch(mb):``
            (see docs/deterministic.md). hora's extension, not in Horovod.
        microbatches: ``K`` of deterministic mode, the micro-batches a step is cut into
            (default: ``HORA_DETERMINISTIC_MICROBATCHES``).

    Returns:
        An optimizer of the same class with the distributed behaviour.

    Example:
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
        >>> optimizer = hvd.DistributedOptimizer(
        ...     optimizer, named_parameters=model.named_parameters())
    """
    reduce_op = ReduceOp(int(op))
    if reduce_op not in (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM):
        raise ValueError(
            "DistributedOptimizer supports op=hvd.Average, op=hvd.Sum and op=hvd.Adasum."
        )
    if gradient_predivide_factor != 1.0 and reduce_op != ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if num_groups != 0:
        warnings.warn(
            "Parameter `num_groups` has been replaced by `groups` and will be removed.",
            DeprecationWarning,
            stacklevel=2,
        )
        if groups is None:
            groups = num_groups
    if hasattr(optimizer, "_requires_update"):
        raise ValueError("The optimizer is already a DistributedOptimizer.")
    options = DistributedOptions(
        named_parameters,
        compression_policy.for_gradients(compression, Compression.fp16, Compression.bf16),
        backward_passes_per_step,
        reduce_op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        process_set,
        shard_gradients,
    )
    leaves = deterministic_optimizer.chosen_microbatches(deterministic, microbatches)
    if leaves is not None:
        sharded = shard_optimizer_state or shard_gradients
        return deterministic_optimizer.make(optimizer, options, leaves, sharded)
    if shard_optimizer_state or shard_gradients:
        return make_sharded(shard_optimizer_state, optimizer, options)
    adasum = reduce_op == ReduceOp.ADASUM and api.size() > 1
    if adasum:
        # Checked here, not at the first step: a job of 3 ranks fails at once.
        submission.check_adasum(RequestType.ALLREDUCE, [], process_set)
    methods = _DistributedAdasumOptimizer if adasum else _DistributedOptimizer
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(methods.__dict__))
    # The methods call the wrapped optimizer's as super(cls, self): a subclass of the result
    # (as PyTorch Lightning makes) then still reaches the wrapped class, not itself again.
    cls._hora_class = cls  # type: ignore[attr-defined]
    return cls(optimizer.param_groups, options)  # type: ignore[no-any-return]
