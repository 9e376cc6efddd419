"""Helpers that move model state between ranks: parameters and optimizer state. Python
objects travel with :mod:`hora.common.ops.objects` (re-exported here, as Horovod has them)."""

from __future__ import annotations

from typing import Any

import torch

from hora.common.ops.objects import allgather_object as allgather_object
from hora.common.ops.objects import broadcast_object as broadcast_object
from hora.torch import ops
from hora.torch.zero_optimizer import ShardedOptimizer
from hora.torch.zero_state import broadcast_state


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Copy parameters (or any tensors) from ``root_rank`` to every rank, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()``, or a list of tensors.
        root_rank: the rank whose values everyone takes.

    Example:
        >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, (list, tuple)) or hasattr(params, "__iter__"):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"invalid params of type: {type(tensor)} (entry {name!r})")
        label = None if name is None else f"broadcast_parameters.{name}"
        handles.append(ops.broadcast_async_(tensor.data, root_rank, name=label))
    for handle in handles:
        ops.synchronize(handle)


def _initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state by one step on zero gradients, leaving weights as they
    were (Horovod's trick, without its side effect on weights under weight decay)."""
    saved = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            saved.append((p, p.detach().clone(), p.grad))
            if isinstance(optimizer, torch.optim.SparseAdam):
                p.grad = torch.zeros_like(p).to_sparse()
            else:
                p.grad = torch.zeros_like(p)
    # A DistributedOptimizer's own step would reduce: take the wrapped class's.
    base_class: Any = (
        optimizer.__class__.__mro__[1]
        if hasattr(optimizer, "_requires_update")
        else optimizer.__class__
    )
    base_step = base_class.step
    base_step(optimizer)
    with torch.no_grad():
        for p, value, grad in saved:
            p.copy_(value)
            p.grad = grad


def _zero_missing_grads(optimizer: torch.optim.Optimizer) -> None:
    """Give every trainable parameter without a gradient a zero one (sparse for SparseAdam)."""
    sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                zero = torch.zeros_like(p)
                p.grad = zero.to_sparse() if sparse else zero


def _match_roots_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Give this rank state where the root has some, and none where the root has none."""
    root_has_state = broadcast_object(
        bool(optimizer.state_dict()["state"]), root_rank, name="broadcast_optimizer_state.has"
    )
    if not root_has_state:
        # A fresh optimizer on the root: every rank starts from empty state, as the root does.
        optimizer.state.clear()
    elif not optimizer.state_dict()["state"]:
        # The root has state (e.g. from a checkpoint): create ours so its tensors can be
        # overwritten in place.
        _initialize_state(optimizer)


def _broadcast_state_tensors(state: dict[Any, dict[str, Any]], root_rank: int) -> dict[str, Any]:
    """Broadcast every tensor of the optimizer's per-parameter ``state`` in place; returns the
    other values by broadcast name, to be sent as one object."""
    scalars: dict[str, Any] = {}
    handles = []
    for param_id in sorted(state):
        for key in sorted(state[param_id]):
            value = state[param_id][key]
            name = f"broadcast_optimizer_state.{param_id}.{key}"
            if isinstance(value, torch.Tensor):
                handles.append(ops.broadcast_async_(value, root_rank, name=name))
            else:
                scalars[name] = value
    for handle in handles:
        ops.synchronize(handle)
    return scalars


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None
) -> None:
    """Copy optimizer state and hyperparameters (``lr``, ``momentum``, ...) from ``root_rank``.

    When the root has state (e.g. loaded from a checkpoint) and this rank does not, this rank
    creates its state first (one step on zero gradients, weights restored) so every entry can be
    overwritten. When the root's optimizer is fresh, every rank's state is emptied to match,
    so a step counter (Adam's bias correction) starts from zero everywhere.

    Example:
        >>> hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    """
    del model
    if isinstance(optimizer, ShardedOptimizer):
        # Each rank holds only its shard of the state: see zero_state.broadcast_state.
        broadcast_state(optimizer, root_rank)
        return
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state_dict()["state"]:
        # A fresh optimizer leaves with a zero gradient on every trainable parameter, as in
        # Horovod (which steps on zero gradients to create the state): scripts read or
        # broadcast p.grad right after this call.
        _zero_missing_grads(optimizer)
    _match_roots_state(optimizer, root_rank)
    state_dict = optimizer.state_dict()
    scalars = _broadcast_state_tensors(state_dict["state"], root_rank)
    options = [
        {k: v for k, v in group.items() if k != "params"} for group in state_dict["param_groups"]
    ]
    scalars, options = broadcast_object(
        (scalars, options), root_rank, name="broadcast_optimizer_state.options"
    )
    for param_id in state_dict["state"]:
        for key in state_dict["state"][param_id]:
            name = f"broadcast_optimizer_state.{param_id}.{key}"
            if name in scalars:
                state_dict["state"][param_id][key] = scalars[name]
    for group, group_options in zip(state_dict["param_groups"], options):
        group.update(group_options)
    optimizer.load_state_dict(state_dict)
