"""A sharded optimizer's whole state, gathered from every rank into ``torch.optim``'s format.

:func:`consolidated_state_dict` is a collective, on every rank: each rank describes its pieces'
state entries (see :mod:`hora.torch.zero_state_format`), the descriptions are allgathered and
checked (every rank that owns part of a parameter with state has state for it), the sharded
entries are allgathered bucket by bucket and cut into each parameter's shape, and the other
entries come from the rank whose piece starts the parameter.

This module knows state dicts, layouts and collectives; loading a state is
:mod:`hora.torch.zero_state_loading`'s, and the per-rank files are :mod:`hora.torch.zero_state`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hora.common.ops.objects import allgather_object
from hora.common.vocabulary.errors import HoraValueError
from hora.torch import ops
from hora.torch.zero_state_format import (
    ShardedOptimizerView,
    copy_value,
    is_sharded,
    positions,
    state_dict_of,
)


@dataclass(frozen=True)
class _Entry:
    """One entry of a piece's state as a rank describes it: sharded (its dtype), or a value
    (sent by the rank whose piece starts the parameter; ``None`` from the others)."""

    sharded: bool
    dtype: torch.dtype | None = None
    value: Any = None


def consolidated_state_dict(opt: ShardedOptimizerView) -> dict[str, Any]:
    """The whole state in ``torch.optim``'s format, on every rank (a collective): describe
    each rank's entries, gather the sharded ones bucket by bucket, add the values."""
    layout = opt.layout
    at, _ = positions(opt)
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
                state.setdefault(at[slot.index], {})[key] = value
    for index, entries in merged.items():
        for key, entry in entries.items():
            if not entry.sharded:
                state.setdefault(at[index], {})[key] = copy_value(entry.value)
    return state_dict_of(opt, state)


def _describe(opt: ShardedOptimizerView) -> dict[int, dict[str, _Entry]]:
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
            if is_sharded(key, value, tensor)
            else _Entry(False, None, value if first else None)
            for key, value in state.items()
        }
    return local


def _gather_sharded(
    opt: ShardedOptimizerView, merged: dict[int, dict[str, _Entry]]
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


def _merge(
    opt: ShardedOptimizerView, described: Sequence[dict[int, dict[str, _Entry]]]
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
                    f"their shard of {opt.parameter_name(slot.index)!r}, while rank(s) {having} "
                    "have. Every rank must step (or load the same state) together."
                )
    return merged
