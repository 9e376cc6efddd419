"""The state of a sharded ``DistributedOptimizer`` as a whole: consolidated state dicts (every
rank's shard gathered into ``torch.optim``'s format), per-rank files, and moving state between
ranks (``broadcast_optimizer_state``, the elastic ``TorchState``'s snapshots).

A rank's state is keyed by its *pieces* (see :mod:`hora.torch.zero_layout`): flat slices of
the parameters. An entry of a piece's state is *sharded* when it holds one value per element
(a tensor of the piece's shape, other than ``step``), such as Adam's ``exp_avg``; every other
entry (``step``, ASGD's ``eta``, ...) is the same for all pieces of a parameter. Consolidating
concatenates the sharded entries of a parameter's pieces, in element order, and reshapes them
to the parameter's shape; loading slices them again, for whatever ranks there are now.

This module knows state dicts, layouts and collectives; the optimizer's step is in
:mod:`hora.torch.zero_optimizer`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hora.common import basics
from hora.common.errors import HoraValueError
from hora.common.objects import allgather_object, broadcast_object
from hora.common.process_sets import ProcessSet
from hora.torch import ops

if TYPE_CHECKING:
    from hora.torch.zero_layout import Layout, Piece


class ShardedOptimizer(Protocol):
    """What this module uses of :class:`hora.torch.zero_optimizer.ShardedOptimizer` (which
    imports this module: a protocol keeps the dependency one way)."""

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

# Tensors of at most this many elements travel inside the pickled structure of a broadcast
# state dict, the others as tensors (see _broadcast_dict).
_INLINE_ELEMENTS = 64


def _is_sharded(key: Any, value: Any, piece: torch.Tensor) -> bool:
    """Whether ``value`` holds one value per element of ``piece`` (see the module docstring)."""
    return (
        isinstance(value, torch.Tensor)
        and key != "step"
        and tuple(value.shape) == tuple(piece.shape)
    )


def _param_lists(opt: ShardedOptimizer) -> list[list[torch.Tensor]]:
    """The parameters of each group (even while param_groups show the pieces)."""
    return opt.param_lists


def _options(opt: ShardedOptimizer, lists: list[list[torch.Tensor]]) -> list[dict[str, Any]]:
    """``torch.optim``'s ``param_groups`` entry of a state dict: options and positions."""
    groups = []
    position = 0
    for group, params in zip(opt.param_groups, lists):
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = list(range(position, position + len(params)))
        position += len(params)
        groups.append(packed)
    return groups


def _positions(opt: ShardedOptimizer) -> tuple[list[int], dict[int, int]]:
    """Each trainable parameter's position in the state dict, and the trainable index of
    each position."""
    lists = _param_lists(opt)
    where = {id(p): n for n, p in enumerate(p for params in lists for p in params)}
    positions = [where[id(p)] for p in opt.trainable]
    return positions, {pos: index for index, pos in enumerate(positions)}


def _name(opt: ShardedOptimizer, index: int) -> str:
    return opt.parameter_name(index)


# ---------------------------------------------------------------- consolidated


@dataclass(frozen=True)
class _Entry:
    """One entry of a piece's state as a rank describes it: sharded (its dtype), or a value
    (sent by the rank whose piece starts the parameter; ``None`` from the others)."""

    sharded: bool
    dtype: torch.dtype | None = None
    value: Any = None


def consolidated_state_dict(opt: ShardedOptimizer) -> dict[str, Any]:
    """The whole state in ``torch.optim``'s format, on every rank (a collective): describe
    each rank's entries, gather the sharded ones bucket by bucket, add the values."""
    layout = opt.layout
    lists = _param_lists(opt)
    positions, _ = _positions(opt)
    local = _describe(opt)
    if layout.size > 1:
        described = allgather_object(
            local, name=f"{opt.label}.state_dict.described", process_set=opt.process_set
        )
    else:
        described = [local]
    merged = _merge(opt, described)
    state: dict[int, dict[str, Any]] = {}
    for bucket, key, full in _gather_sharded(opt, merged):
        for slot in bucket.slots:
            entry = merged.get(slot.index, {}).get(key)
            if entry is not None and entry.sharded:
                shape = opt.trainable[slot.index].shape
                value = full[slot.offset : slot.offset + slot.numel].view(shape)
                state.setdefault(positions[slot.index], {})[key] = value
    for index, entries in merged.items():
        for key, entry in entries.items():
            if not entry.sharded:
                state.setdefault(positions[index], {})[key] = _copy(entry.value)
    state.update(_frozen_state(opt, lists))
    ordered = {position: state[position] for position in sorted(state)}
    return {"state": ordered, "param_groups": _options(opt, lists)}


def _describe(opt: ShardedOptimizer) -> dict[int, dict[str, _Entry]]:
    """This rank's pieces' state entries, by trainable index (see :class:`_Entry`)."""
    piece_of = opt.layout.piece_of()
    local: dict[int, dict[str, _Entry]] = {}
    for index, tensor in opt.pieces.items():
        state = opt.state.get(tensor)
        if not state:
            continue
        first = piece_of[index].start == 0
        local[index] = {
            key: _Entry(True, value.dtype)
            if _is_sharded(key, value, tensor)
            else _Entry(False, None, value if first else None)
            for key, value in state.items()
        }
    return local


def _gather_sharded(
    opt: ShardedOptimizer, merged: dict[int, dict[str, _Entry]]
) -> list[tuple[Any, str, torch.Tensor]]:
    """Allgather every sharded entry of every bucket: ``(bucket, key, the bucket's flat
    values)``, each rank's part packed in the bucket's order (zeros where a piece lacks it)."""
    layout = opt.layout
    started: list[tuple[Any, str, Any]] = []
    for bucket in layout.buckets:
        keys: dict[str, torch.dtype] = {}
        for slot in bucket.slots:
            for key, entry in merged.get(slot.index, {}).items():
                if entry.sharded and entry.dtype is not None:
                    keys.setdefault(key, entry.dtype)
        for key, dtype in sorted(keys.items()):
            parts = []
            for piece in layout.pieces[bucket.number]:
                value = opt.state.get(opt.pieces[piece.index], {}).get(key)
                if value is None:
                    value = torch.zeros(piece.numel, dtype=dtype)
                parts.append(value.detach().reshape(-1).to(dtype))
            flat = torch.cat(parts) if parts else torch.empty(0, dtype=dtype)
            if layout.size > 1:
                name = f"{opt.label}.state_dict.{bucket.number}.{key}"
                handle = ops.allgather_async(flat, name=name, process_set=opt.process_set)
                started.append((bucket, key, handle))
            else:
                started.append((bucket, key, flat))
    return [
        (bucket, key, got if isinstance(got, torch.Tensor) else ops.synchronize(got))
        for bucket, key, got in started
    ]


def _frozen_state(
    opt: ShardedOptimizer, lists: list[list[torch.Tensor]]
) -> dict[int, dict[str, Any]]:
    """The whole state of parameters that were not trainable when wrapped (kept as it is,
    the same on every rank), by position."""
    everything = [p for params in lists for p in params]
    return {
        position: {k: _copy(v) for k, v in opt.state[p].items()}
        for position, p in enumerate(everything)
        if not p.requires_grad and opt.state.get(p)
    }


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _merge(
    opt: ShardedOptimizer, described: Sequence[dict[int, dict[str, _Entry]]]
) -> dict[int, dict[str, _Entry]]:
    """Combine every rank's description of its pieces' state; check that every rank that owns
    part of a parameter with state has state for it."""
    layout = opt.layout
    merged: dict[int, dict[str, _Entry]] = {}
    for entries_of in described:
        for index, entries in entries_of.items():
            into = merged.setdefault(index, {})
            for key, entry in entries.items():
                if key not in into or (not entry.sharded and entry.value is not None):
                    into[key] = entry
    for bucket in layout.buckets:
        edges = bucket.bounds(layout.size)
        for slot in bucket.slots:
            if slot.index not in merged:
                continue
            owners = [
                rank
                for rank in range(layout.size)
                if max(edges[rank], slot.offset) < min(edges[rank + 1], slot.offset + slot.numel)
            ]
            missing = [rank for rank in owners if slot.index not in described[rank]]
            if missing:
                having = [rank for rank in owners if rank not in missing]
                raise HoraValueError(
                    f"sharded DistributedOptimizer: rank(s) {missing} have no optimizer state for "
                    f"their shard of {_name(opt, slot.index)!r}, while rank(s) {having} have. "
                    "Every rank must step (or load the same state) together."
                )
    return merged


# ---------------------------------------------------------------- per rank


def sharded_state_dict(opt: ShardedOptimizer) -> dict[str, Any]:
    """This rank's pieces' state, with what is needed to check or consolidate it later."""
    layout = opt.layout
    lists = _param_lists(opt)
    positions, _ = _positions(opt)
    state: dict[int, dict[str, Any]] = {}
    pieces: dict[int, list[int]] = {}
    for piece in layout.piece_of().values():
        position = positions[piece.index]
        pieces[position] = [piece.start, piece.stop]
        own = opt.state.get(opt.pieces[piece.index])
        if own:
            state[position] = dict(own)
    state.update(_frozen_state(opt, lists))
    meta = {
        "format": SHARDED_FORMAT,
        "rank": layout.rank,
        "size": layout.size,
        "pieces": pieces,
        "shapes": {positions[i]: list(p.shape) for i, p in enumerate(opt.trainable)},
    }
    return {
        SHARDED_KEY: meta,
        "state": {position: state[position] for position in sorted(state)},
        "param_groups": _options(opt, lists),
    }


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
        if _is_sharded(key, value, torch.empty(stop - start)):
            joined = torch.cat([part[2][key].reshape(-1) for part in with_state])
            merged[key] = joined.view(shape)
        else:
            merged[key] = _copy(value)
    return merged


# ---------------------------------------------------------------- loading


def load_state_dict(opt: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
    """Load a consolidated state (keeping this rank's slices) or this rank's sharded one."""
    lists = _param_lists(opt)
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
    _, index_at = _positions(opt)
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
    _set_options(opt, saved_groups)
    opt.loaded_state = state_dict if meta is None else None


def _clear_state(opt: ShardedOptimizer, everything: list[torch.Tensor]) -> None:
    """Drop this rank's state (the pieces get what the wrapped class makes at construction)."""
    for tensor in opt.pieces.values():
        opt.state.pop(tensor, None)
    for p in everything:
        if not p.requires_grad:
            opt.state.pop(p, None)
    opt.fresh_state()


def _set_options(opt: ShardedOptimizer, groups: list[dict[str, Any]]) -> None:
    """Take the options (``lr``, ``betas``, ...) of ``groups``, keeping our parameters."""
    for group, saved_group in zip(opt.param_groups, groups):
        for key, value in saved_group.items():
            if key != "params":
                group[key] = value


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


def _check_sharded(opt: ShardedOptimizer, meta: dict[str, Any]) -> None:
    layout = opt.layout
    positions, _ = _positions(opt)
    ours = {
        positions[piece.index]: [piece.start, piece.stop] for piece in layout.piece_of().values()
    }
    theirs = {int(k): list(v) for k, v in meta.get("pieces", {}).items()}
    if (meta.get("size"), meta.get("rank")) != (layout.size, layout.rank) or ours != theirs:
        raise ValueError(
            f"sharded DistributedOptimizer: this sharded state dict was saved by rank "
            f"{meta.get('rank')} of {meta.get('size')} for other shards; this is rank "
            f"{layout.rank} of {layout.size}. Load each rank's own file with the same number of "
            "ranks and the same model, or combine every rank's file with "
            "hora.torch.zero_state.consolidate_sharded_state_dicts and load the result."
        )


# ---------------------------------------------------------------- between ranks


def _set_rank_of(opt: ShardedOptimizer, global_rank: int) -> int:
    ranks = opt.process_set.ranks
    if opt.process_set.process_set_id == 0 or not ranks:
        return global_rank
    if global_rank not in ranks:
        raise HoraValueError(
            f"broadcast_optimizer_state: root rank {global_rank} is not in the optimizer's "
            f"process set {ranks}."
        )
    return ranks.index(global_rank)


def broadcast_state(opt: ShardedOptimizer, root_rank: int) -> None:
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
    lists = _param_lists(opt)
    if root_whole:
        mine = None
        if basics.rank() == root_rank and opt.loaded_state is not None:
            # The state as loaded, with the options as they are now.
            mine = {"state": opt.loaded_state["state"], "param_groups": _options(opt, lists)}
        whole = broadcast_dict(mine, root_rank, f"{name}.state", process_set)
        opt.load_state_dict(whole)
        return
    options = broadcast_object(
        _options(opt, lists), root_rank, name=f"{name}.options", process_set=process_set
    )
    _set_options(opt, options)
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
    skeleton = _strip(value, tensors) if basics.rank() == root_rank else None
    shapes = [(tuple(t.shape), t.dtype) for t in tensors]
    skeleton, shapes = broadcast_object(
        (skeleton, shapes), root_rank, name=f"{name}.structure", process_set=process_set
    )
    if basics.rank() == root_rank:
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


def initial_snapshot(opt: ShardedOptimizer) -> dict[str, Any]:
    """The elastic state's first snapshot, without communication where that is possible: a
    worker that joins a running job makes its ``TorchState`` while the others are in
    ``sync()``, where no collective of its own would find partners."""
    if opt.loaded_state is not None:
        return copy.deepcopy(opt.loaded_state)
    if not any(opt.state.get(t) for t in opt.pieces.values()):
        return {"state": {}, "param_groups": _options(opt, _param_lists(opt))}
    return consolidated_state_dict(opt)


def sync_from_root(opt: ShardedOptimizer, snapshot: dict[str, Any], root_rank: int = 0) -> None:
    """Give every rank the root's snapshot, sliced for the ranks there are now."""
    if opt.process_set.included() and opt.layout_size_now() > 1:
        mine = snapshot if basics.rank() == root_rank else None
        snapshot = broadcast_dict(mine, root_rank, f"{opt.label}.elastic", opt.process_set)
    opt.load_state_dict(snapshot)
