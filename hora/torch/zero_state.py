"""A sharded optimizer's state beyond this rank's memory: a file per rank, and other ranks.

- Per-rank files: :func:`sharded_state_dict` is this rank's pieces' state and where they lie (no
  communication); :func:`consolidate_sharded_state_dicts` combines every rank's file into a
  consolidated state offline, with no process group.
- Other ranks: :func:`broadcast_state` is ``broadcast_optimizer_state`` for a sharded optimizer,
  and the elastic ``TorchState``'s snapshots (:func:`initial_snapshot`,
  :func:`sync_from_root`) carry the consolidated state to the ranks there are after a change.

A rank's state is keyed by its pieces; which entries are sharded, and the state dicts' format,
are :mod:`hora.torch.zero_state_format`'s. Gathering the whole state is
:mod:`hora.torch.zero_consolidated_state`'s, loading one :mod:`hora.torch.zero_state_loading`'s;
the optimizer's step is in :mod:`hora.torch.zero_optimizer`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hora.common import api
from hora.common.ops.objects import allgather_object, broadcast_object
from hora.common.process_sets import ProcessSet
from hora.common.vocabulary.errors import HoraValueError
from hora.torch import ops
from hora.torch.zero_consolidated_state import consolidated_state_dict
from hora.torch.zero_state_format import (
    SHARDED_FORMAT,
    SHARDED_KEY,
    ShardedOptimizerView,
    copy_value,
    is_sharded,
    options,
    positions,
    set_options,
    state_dict_of,
)

# Tensors of at most this many elements travel inside the pickled structure of a broadcast
# state dict, the others as tensors (see broadcast_dict).
_INLINE_ELEMENTS = 64


# ---------------------------------------------------------------- per rank


def sharded_state_dict(opt: ShardedOptimizerView) -> dict[str, Any]:
    """This rank's pieces' state, with what is needed to check or consolidate it later."""
    layout = opt.layout
    at, _ = positions(opt)
    state: dict[int, dict[str, Any]] = {}
    pieces: dict[int, list[int]] = {}
    for piece in layout.piece_of().values():
        position = at[piece.index]
        pieces[position] = [piece.start, piece.stop]
        own = opt.state.get(opt.pieces[piece.index])
        if own:
            state[position] = dict(own)
    meta = {
        "format": SHARDED_FORMAT,
        "rank": layout.rank,
        "size": layout.size,
        "pieces": pieces,
        "shapes": {at[i]: list(p.shape) for i, p in enumerate(opt.trainable)},
    }
    return {SHARDED_KEY: meta, **state_dict_of(opt, state)}


def consolidate_sharded_state_dicts(shards: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Combine the :meth:`sharded_state_dict` of every rank into one consolidated state dict
    (no process group needed: for example offline, from the files of a checkpoint), which loads
    into a sharded optimizer at any number of ranks or into an unsharded optimizer.

    Args:
        shards: every rank's sharded state dict, in any order.

    Returns:
        The state in ``torch.optim``'s format.

    Raises:
        ValueError: ranks are missing or repeated, or the pieces do not cover the parameters.

    Example:
        >>> shards = [torch.load(f"optimizer.{r}.pt") for r in range(4)]
        >>> torch.save(consolidate_sharded_state_dicts(shards), "optimizer.pt")
    """
    order = _rank_order(shards)
    metas = [shards[n][SHARDED_KEY] for n in order]
    state: dict[int, dict[str, Any]] = {}
    for position, shape in metas[0]["shapes"].items():
        parts = []
        for n, meta in zip(order, metas):
            span = meta["pieces"].get(position)
            if span is not None:
                parts.append((span[0], span[1], shards[n]["state"].get(position)))
        merged = _join_pieces(position, shape, sorted(parts, key=lambda part: part[0]))
        if merged:
            state[int(position)] = merged
    first = shards[order[0]]
    for position, value in first["state"].items():
        if position not in metas[0]["shapes"]:
            state[position] = dict(value)
    return {
        "state": {position: state[position] for position in sorted(state)},
        "param_groups": copy.deepcopy(first["param_groups"]),
    }


def _rank_order(shards: Sequence[dict[str, Any]]) -> list[int]:
    """The positions of the shards in rank order, checked to be every rank's once."""
    metas = []
    for shard in shards:
        meta = shard.get(SHARDED_KEY) if isinstance(shard, dict) else None
        if not isinstance(meta, dict):
            raise ValueError("consolidate_sharded_state_dicts: not a sharded_state_dict() result")
        metas.append(meta)
    size = metas[0]["size"] if metas else 0
    ranks = sorted(meta["rank"] for meta in metas)
    if not metas or ranks != list(range(size)) or any(m["size"] != size for m in metas):
        raise ValueError(
            f"consolidate_sharded_state_dicts: needs the files of all {size} ranks once each, "
            f"got ranks {ranks}."
        )
    return sorted(range(len(shards)), key=lambda n: metas[n]["rank"])


def _join_pieces(
    position: Any, shape: list[int], parts: list[tuple[int, int, Any]]
) -> dict[str, Any]:
    """One parameter's state from its pieces' (in element order): sharded entries joined."""
    numel = math.prod(shape)
    covered = 0
    for start, stop, _ in parts:
        if start != covered:
            break
        covered = stop
    if covered != numel:
        raise ValueError(
            f"consolidate_sharded_state_dicts: the pieces of parameter {position} cover "
            f"{covered} of its {numel} elements."
        )
    with_state = [part for part in parts if part[2]]
    if not with_state:
        return {}
    if len(with_state) != len(parts):
        raise ValueError(
            f"consolidate_sharded_state_dicts: parameter {position} has state on some ranks only."
        )
    start, stop, first = with_state[0]
    merged: dict[str, Any] = {}
    for key, value in first.items():
        if is_sharded(key, value, torch.empty(stop - start)):
            joined = torch.cat([part[2][key].reshape(-1) for part in with_state])
            merged[key] = joined.view(shape)
        else:
            merged[key] = copy_value(value)
    return merged


# ---------------------------------------------------------------- between ranks


def _set_rank_of(opt: ShardedOptimizerView, global_rank: int) -> int:
    ranks = opt.process_set.ranks
    if opt.process_set.process_set_id == 0 or not ranks:
        return global_rank
    if global_rank not in ranks:
        raise HoraValueError(
            f"broadcast_optimizer_state: root rank {global_rank} is not in the optimizer's "
            f"process set {ranks}."
        )
    return ranks.index(global_rank)


def broadcast_state(opt: ShardedOptimizerView, root_rank: int) -> None:
    """``broadcast_optimizer_state`` for a sharded optimizer.

    The root's options always reach every rank. Its state does where the root holds it whole:
    a consolidated state loaded since the last step (a checkpoint loaded on the root) is sent
    and every rank keeps its slices. A fresh root empties every rank's state. When every rank
    already has state (they stepped together), each keeps its shard.

    Raises:
        HoraValueError: the root has stepped state but some rank has none for its shard (that
            shard's state lives nowhere): load the same state on every rank instead.
    """
    if not opt.process_set.included():
        return
    name = f"{opt.label}.broadcast"
    process_set = opt.process_set
    has_state = any(opt.state.get(t) for t in opt.pieces.values())
    flags = allgather_object(
        (has_state, opt.loaded_state is not None), name=f"{name}.flags", process_set=process_set
    )
    root_has, root_whole = flags[_set_rank_of(opt, root_rank)]
    lists = opt.param_lists
    if root_whole:
        mine = None
        if api.rank() == root_rank and opt.loaded_state is not None:
            # The state as loaded, with the options as they are now.
            mine = {"state": opt.loaded_state["state"], "param_groups": options(opt, lists)}
        whole = broadcast_dict(mine, root_rank, f"{name}.state", process_set)
        opt.load_state_dict(whole)
        return
    root_options = broadcast_object(
        options(opt, lists), root_rank, name=f"{name}.options", process_set=process_set
    )
    set_options(opt, root_options)
    if not root_has:
        opt.reshard()
        return
    lacking = [rank for rank, (has, _) in enumerate(flags) if not has]
    if lacking:
        raise HoraValueError(
            f"broadcast_optimizer_state: rank {root_rank} has optimizer state for its shard, but "
            f"rank(s) {lacking} (of the optimizer's process set) have none for theirs, and with "
            "shard_optimizer_state=True a shard's state lives only on its rank. Load the same "
            "consolidated state_dict on the root right before this call (or on every rank)."
        )


def broadcast_dict(
    value: dict[str, Any] | None, root_rank: int, name: str, process_set: ProcessSet
) -> dict[str, Any]:
    """Send a state dict from ``root_rank``: its structure pickled, its tensors as tensors."""
    tensors: list[torch.Tensor] = []
    skeleton = _strip(value, tensors) if api.rank() == root_rank else None
    shapes = [(tuple(t.shape), t.dtype) for t in tensors]
    skeleton, shapes = broadcast_object(
        (skeleton, shapes), root_rank, name=f"{name}.structure", process_set=process_set
    )
    if api.rank() == root_rank:
        buffers = [t.detach().contiguous() for t in tensors]
    else:
        buffers = [torch.empty(shape, dtype=dtype) for shape, dtype in shapes]
    handles = [
        ops.broadcast_async_(buffer, root_rank, name=f"{name}.{n}", process_set=process_set)
        for n, buffer in enumerate(buffers)
    ]
    for handle in handles:
        ops.synchronize(handle)
    result = _fill(skeleton, buffers)
    assert isinstance(result, dict)
    return result


@dataclass(frozen=True)
class _TensorAt:
    """A tensor's place in the list sent after a stripped structure."""

    number: int


def _strip(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() > _INLINE_ELEMENTS:
        tensors.append(value)
        return _TensorAt(len(tensors) - 1)
    if isinstance(value, dict):
        return {k: _strip(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip(v, tensors) for v in value]
    return value


def _fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, _TensorAt):
        return tensors[value.number]
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, tensors) for v in value]
    return value


# ---------------------------------------------------------------- elastic


def initial_snapshot(opt: ShardedOptimizerView) -> dict[str, Any]:
    """The elastic state's first snapshot, without communication where that is possible: a
    worker that joins a running job makes its ``TorchState`` while the others are in
    ``sync()``, where no collective of its own would find partners."""
    if opt.loaded_state is not None:
        return copy.deepcopy(opt.loaded_state)
    if not any(opt.state.get(t) for t in opt.pieces.values()):
        return {"state": {}, "param_groups": options(opt, opt.param_lists)}
    return consolidated_state_dict(opt)


def sync_from_root(opt: ShardedOptimizerView, snapshot: dict[str, Any], root_rank: int = 0) -> None:
    """Give every rank the root's snapshot, sliced for the ranks there are now."""
    if opt.process_set.included() and opt.layout_size_now() > 1:
        mine = snapshot if api.rank() == root_rank else None
        snapshot = broadcast_dict(mine, root_rank, f"{opt.label}.elastic", opt.process_set)
    opt.load_state_dict(snapshot)
