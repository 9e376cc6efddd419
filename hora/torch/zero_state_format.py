"""What the modules of a sharded optimizer's state share: the optimizer as they see it, and the
shape of its state dicts.

A rank's state is keyed by its *pieces* (see :mod:`hora.torch.zero_layout`): flat slices of
the parameters. An entry of a piece's state is *sharded* when it holds one value per element
(a tensor of the piece's shape, other than ``step``), such as Adam's ``exp_avg``; every other
entry (``step``, ASGD's ``eta``, ...) is the same for all pieces of a parameter. A consolidated
state dict is ``torch.optim``'s: each parameter's entries in its shape, by its position in the
groups; a per-rank one (``sharded_state_dict()``) keeps this rank's pieces' state and says, under
:data:`SHARDED_KEY`, where they lie.

This module knows state dicts and the optimizer's seams; it communicates with no rank. The
whole state is gathered in :mod:`hora.torch.zero_consolidated_state`, loaded in
:mod:`hora.torch.zero_state_loading`, and moved between ranks and files in
:mod:`hora.torch.zero_state`.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hora.common.process_sets import ProcessSet

if TYPE_CHECKING:
    from hora.torch.zero_layout import Layout


class ShardedOptimizerView(Protocol):
    """What the state modules use of :class:`hora.torch.zero_optimizer.ShardedOptimizer`
    (which imports them: a protocol keeps the dependency one way)."""

    state: Any
    param_groups: list[dict[str, Any]]
    loaded_state: dict[str, Any] | None

    @property
    def layout(self) -> Layout: ...
    @property
    def trainable(self) -> list[torch.Tensor]: ...
    @property
    def pieces(self) -> dict[int, torch.Tensor]: ...
    @property
    def label(self) -> str: ...
    @property
    def process_set(self) -> ProcessSet: ...
    @property
    def param_lists(self) -> list[list[torch.Tensor]]: ...
    def parameter_name(self, index: int) -> str: ...
    def fresh_state(self) -> None: ...
    def relayout(self) -> None: ...
    def reshard(self) -> None: ...
    def layout_size_now(self) -> int: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


# The key that marks a per-rank state dict (sharded_state_dict), and its format's version.
SHARDED_KEY = "hora_sharded"
SHARDED_FORMAT = 1


def is_sharded(key: Any, value: Any, piece: torch.Tensor) -> bool:
    """Whether ``value`` holds one value per element of ``piece`` (see the module docstring)."""
    return (
        isinstance(value, torch.Tensor)
        and key != "step"
        and tuple(value.shape) == tuple(piece.shape)
    )


def options(opt: ShardedOptimizerView, lists: list[list[torch.Tensor]]) -> list[dict[str, Any]]:
    """``torch.optim``'s ``param_groups`` entry of a state dict: options and positions."""
    groups = []
    position = 0
    for group, params in zip(opt.param_groups, lists):
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = list(range(position, position + len(params)))
        position += len(params)
        groups.append(packed)
    return groups


def set_options(opt: ShardedOptimizerView, groups: list[dict[str, Any]]) -> None:
    """Take the options (``lr``, ``betas``, ...) of ``groups``, keeping our parameters."""
    for group, saved_group in zip(opt.param_groups, groups):
        for key, value in saved_group.items():
            if key != "params":
                group[key] = value


def positions(opt: ShardedOptimizerView) -> tuple[list[int], dict[int, int]]:
    """Each trainable parameter's position in the state dict, and the trainable index of
    each position."""
    lists = opt.param_lists
    where = {id(p): n for n, p in enumerate(p for params in lists for p in params)}
    found = [where[id(p)] for p in opt.trainable]
    return found, {pos: index for index, pos in enumerate(found)}


def frozen_state(
    opt: ShardedOptimizerView, lists: list[list[torch.Tensor]]
) -> dict[int, dict[str, Any]]:
    """The whole state of parameters that were not trainable when wrapped (kept as it is,
    the same on every rank), by position."""
    everything = [p for params in lists for p in params]
    return {
        position: {k: copy_value(v) for k, v in opt.state[p].items()}
        for position, p in enumerate(everything)
        if not p.requires_grad and opt.state.get(p)
    }


def state_dict_of(opt: ShardedOptimizerView, state: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """A state dict in ``torch.optim``'s format: ``state`` (entries by position, to which the
    frozen parameters' state is added) in position order, and the groups' options."""
    lists = opt.param_lists
    state.update(frozen_state(opt, lists))
    return {
        "state": {position: state[position] for position in sorted(state)},
        "param_groups": options(opt, lists),
    }


def copy_value(value: Any) -> Any:
    """A copy of a state entry (tensors cloned)."""
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
