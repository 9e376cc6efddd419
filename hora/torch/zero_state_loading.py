"""Loading a state dict into a sharded optimizer: this rank keeps its slices.

:func:`load_state_dict` takes a consolidated state (from a sharded optimizer at any number of
ranks, or from any unsharded optimizer of the same parameters) and slices each sharded entry
(see :mod:`hora.torch.zero_state_format`) for this rank's pieces, laying the shards out first
if the ranks changed; or it takes this rank's own per-rank state dict, checked to have been
saved for the same shards. Entries are copied as ``torch.optim`` would keep them.

This module needs no other rank; gathering the state is
:mod:`hora.torch.zero_consolidated_state`'s.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from hora.torch.zero_state_format import (
    SHARDED_KEY,
    ShardedOptimizerView,
    positions,
    set_options,
)

if TYPE_CHECKING:
    from hora.torch.zero_layout import Piece


def load_state_dict(opt: ShardedOptimizerView, state_dict: dict[str, Any]) -> None:
    """Load a consolidated state (keeping this rank's slices) or this rank's sharded one."""
    lists = opt.param_lists
    saved_groups = _checked_groups(state_dict, lists)
    meta = state_dict.get(SHARDED_KEY)
    opt.relayout()
    if meta is not None:
        _check_sharded(opt, meta)
    everything = [p for params in lists for p in params]
    # Saved positions, in the order of the saved groups, map onto ours in the same order.
    saved_position = dict(
        zip((p for g in saved_groups for p in g["params"]), range(len(everything)))
    )
    _, index_at = positions(opt)
    _clear_state(opt, everything)
    piece_of = opt.layout.piece_of()
    for saved, entries in state_dict["state"].items():
        position = saved_position.get(saved)
        if position is None or not entries:
            continue
        p = everything[position]
        index = index_at.get(position)
        if index is None:
            opt.state[p] = {k: _cast(p, k, v, saved_groups, saved) for k, v in entries.items()}
        elif index in piece_of:
            piece = piece_of[index]
            tensor = opt.pieces[index]
            opt.state[tensor] = {
                key: _cast(tensor, key, _slice(meta, key, value, p, piece), saved_groups, saved)
                for key, value in entries.items()
            }
    set_options(opt, saved_groups)
    opt.loaded_state = state_dict if meta is None else None


def _clear_state(opt: ShardedOptimizerView, everything: list[torch.Tensor]) -> None:
    """Drop this rank's state (the pieces get what the wrapped class makes at construction)."""
    for tensor in opt.pieces.values():
        opt.state.pop(tensor, None)
    for p in everything:
        if not p.requires_grad:
            opt.state.pop(p, None)
    opt.fresh_state()


def _checked_groups(
    state_dict: dict[str, Any], lists: list[list[torch.Tensor]]
) -> list[dict[str, Any]]:
    """The saved parameter groups, checked against ours (torch.optim's messages)."""
    saved_groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(saved_groups, list) or not isinstance(state_dict.get("state"), dict):
        raise ValueError("loaded state dict has no 'state' and 'param_groups'")
    if len(saved_groups) != len(lists):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(params) for g, params in zip(saved_groups, lists)):
        raise ValueError(
            "loaded state dict contains a parameter group that doesn't match the size of "
            "optimizer's group"
        )
    return saved_groups


def _slice(meta: Any, key: Any, value: Any, param: torch.Tensor, piece: Piece) -> Any:
    """From a consolidated state, a sharded entry's values of ``piece`` (others as they are)."""
    if (
        meta is None
        and isinstance(value, torch.Tensor)
        and key != "step"
        and tuple(value.shape) == tuple(param.shape)
    ):
        return value.detach().reshape(-1)[piece.start : piece.stop]
    return value


def _cast(
    param: torch.Tensor, key: Any, value: Any, groups: list[dict[str, Any]], saved: Any
) -> Any:
    """A copy of ``value`` as ``torch.optim`` would keep it for ``param`` (floating state in the
    parameter's dtype, ``step`` as it is unless the group is fused or capturable)."""
    if not isinstance(value, torch.Tensor):
        return copy.deepcopy(value)
    if key == "step":
        group = next((g for g in groups if saved in g["params"]), {})
        if group.get("fused") or group.get("capturable"):
            return value.to(dtype=torch.float32, device=param.device, copy=True)
        return value.clone()
    if value.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device, copy=True)
    return value.to(device=param.device, copy=True)


def _check_sharded(opt: ShardedOptimizerView, meta: dict[str, Any]) -> None:
    """Refuse a per-rank state dict saved for other shards than this rank's."""
    layout = opt.layout
    at, _ = positions(opt)
    ours = {at[piece.index]: [piece.start, piece.stop] for piece in layout.piece_of().values()}
    theirs = {int(k): list(v) for k, v in meta.get("pieces", {}).items()}
    if (meta.get("size"), meta.get("rank")) != (layout.size, layout.rank) or ours != theirs:
        raise ValueError(
            f"sharded DistributedOptimizer: this sharded state dict was saved by rank "
            f"{meta.get('rank')} of {meta.get('size')} for other shards; this is rank "
            f"{layout.rank} of {layout.size}. Load each rank's own file with the same number of "
            "ranks and the same model, or combine every rank's file with "
            "hora.torch.zero_state.consolidate_sharded_state_dicts and load the result."
        )
