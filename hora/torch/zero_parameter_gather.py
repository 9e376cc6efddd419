"""The allgather of a sharded ``DistributedOptimizer``'s updated shards into every rank's
parameters, and its overlap with the next forward pass.

:class:`ParameterGather` starts each bucket's allgather once the bucket's shard is updated and
writes the gathered bucket into the parameters as soon as it is in. After
:meth:`ParameterGather.overlap_with` (``model``) it owns the gathers the last ``step()`` started
instead, by bucket, until they are written: by a forward pre-hook on every module of ``model``
that owns one of their parameters, just before the module runs, or by anything that needs the
parameters whole first (the optimizer's own methods, ``model.state_dict()`` and
``model.load_state_dict()``).

It knows parameters, pieces, handles and modules' hooks; it does not know gradients, the
optimizer's state or its step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from hora.common.vocabulary.errors import HoraInternalError, HoraValueError
from hora.torch import ops
from hora.torch.zero_parameters import ShardedParameters


class ParameterGather:
    """The parameters' allgathers, and those the next forward pass waits for."""

    def __init__(self, params: ShardedParameters) -> None:
        self._params = params
        # After overlap_with(): the allgathers the last step() started, by bucket, whose results
        # are not yet in the parameters.
        self._overlap = False
        self._gathering: dict[int, Any] = {}
        self._hooks: list[Any] = []

    @property
    def overlapped(self) -> bool:
        """Whether the gathers wait for the forward pass (see :meth:`overlap_with`)."""
        return self._overlap

    @property
    def waiting(self) -> bool:
        """Whether some gathered buckets are not yet in the parameters."""
        return bool(self._gathering)

    def start(self, number: int) -> Any:
        """Start allgathering the bucket's updated shard (None: nobody to gather from)."""
        params = self._params
        layout = params.layout
        if layout.size == 1:
            return None
        pieces = layout.pieces[number]
        bucket = params.buckets[number]
        dtype = params.trainable[bucket.slots[0].index].dtype
        device = params.trainable[bucket.slots[0].index].device
        if pieces:
            shard = torch.cat([params.pieces[piece.index].detach() for piece in pieces])
        else:
            shard = torch.empty(0, dtype=dtype, device=device)
        return ops.allgather_async(
            shard,
            name=f"{params.label}.params.{number}.{params.first_name(number)}",
            process_set=params.process_set,
        )

    def write(self, number: int, gathered: Any) -> None:
        """Copy the gathered bucket into the parameters (or, alone, the non-contiguous
        parameters' pieces back into them)."""
        params = self._params
        bucket = params.buckets[number]
        with torch.no_grad():
            if gathered is None:
                for slot in bucket.slots:
                    p = params.trainable[slot.index]
                    if not p.is_contiguous() and slot.index in params.pieces:
                        p.copy_(params.pieces[slot.index].view_as(p))
                return
            flat = ops.synchronize(gathered)
            targets = [params.trainable[slot.index] for slot in bucket.slots]
            sources = [
                flat[slot.offset : slot.offset + slot.numel].view(p.shape)
                for slot, p in zip(bucket.slots, targets)
            ]
            torch._foreach_copy_([p.detach() for p in targets], sources)

    def write_finished(self, gathers: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        """Write the gathers that are in into the parameters (freeing their buffers); returns
        the others."""
        waiting = []
        for number, gathered in gathers:
            if gathered is None or ops.poll(gathered):
                self.write(number, gathered)
            else:
                waiting.append((number, gathered))
        return waiting

    def place(self, gathers: list[tuple[int, Any]]) -> None:
        """Write the gathered buckets into the parameters, or, with the gather overlapped,
        keep them for the next forward pass."""
        for number, gathered in gathers:
            if self._overlap and gathered is not None:
                self._gathering[number] = gathered  # written before the next forward needs it
            else:
                self.write(number, gathered)

    def finish(self, buckets: Any = None) -> None:
        """Write what the last ``step()``'s allgathers brought into the parameters now (of
        ``buckets``, or all)."""
        if not self._gathering:
            return
        chosen = sorted(self._gathering) if buckets is None else buckets
        for number in chosen:
            gathered = self._gathering.pop(number, None)
            if gathered is not None:
                self.write(number, gathered)

    def finish_or_drop(self) -> None:
        """:meth:`finish`, or, when the job failed meanwhile, forget the gathers (an elastic
        reset restores the parameters from a commit)."""
        try:
            self.finish()
        except HoraInternalError:
            self._gathering.clear()

    def overlap_with(self, model: torch.nn.Module) -> None:
        """Keep the gathers for the forward pass of ``model``: hook every module that owns a
        parameter, and ``model``'s state dict methods (see
        ``ShardedOptimizer.overlap_gather_with_forward``).

        Raises:
            HoraValueError: ``model`` lacks some of the parameters the optimizer updates.
        """
        params = self._params
        held = set(model.parameters())
        missing = [params.name_of(p) for p in params.trainable if p not in held]
        if missing:
            raise HoraValueError(
                f"overlap_gather_with_forward: the model does not hold {len(missing)} of the "
                f"parameters this optimizer updates ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}). Pass the module that contains every "
                "parameter the optimizer updates."
            )
        reference = weakref.ref(self)
        for module in model.modules():
            numbers = sorted(
                {
                    params.bucket_of[params.index[p]]
                    for p in module.parameters(recurse=False)
                    if p in params.index
                }
            )
            if numbers:
                hook = _gather_before_forward(reference, tuple(numbers))
                self._hooks.append(module.register_forward_pre_hook(hook))
        settle = _settle_before(reference)
        self._hooks.append(model.register_state_dict_pre_hook(settle))
        self._hooks.append(model.register_load_state_dict_pre_hook(settle))
        self._overlap = True


def _gather_before_forward(gather: weakref.ref[ParameterGather], buckets: tuple[int, ...]) -> Any:
    """A module's forward pre-hook: write the gathered buckets of its parameters first (holds
    the gather, and so the optimizer's shards, weakly, as the gradient hooks hold the
    optimizer)."""

    def hook(module: torch.nn.Module, args: Any) -> None:
        owner = gather()
        if owner is not None and owner.waiting:
            owner.finish(buckets)

    return hook


def _settle_before(gather: weakref.ref[ParameterGather]) -> Any:
    """A model's state_dict / load_state_dict pre-hook: every gathered bucket goes in first."""

    def hook(*args: Any, **kwargs: Any) -> None:
        owner = gather()
        if owner is not None:
            owner.finish()

    return hook
