"""``DistributedOptimizer(op=hvd.Adasum)``: combines the ranks' updates with Adasum."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hora.common.vocabulary.message import ReduceOp
from hora.torch import ops
from hora.torch.gradient_reduction import (
    TOO_MANY_PASSES,
    UNSUBMITTED,
    DistributedOptions,
    Pending,
    Reduction,
    count_step,
    guarded_zero_grad,
    parameter_names,
    set_backward_passes_per_step,
    step_only,
    weak_gradient_hook,
)


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    """``DistributedOptimizer(op=hvd.Adasum)``: combines the ranks' *updates* with Adasum.

    Adasum combines what each rank's optimizer would do with its own gradient: as soon as a
    parameter's gradient is in, its hook runs the wrapped optimizer's step for that parameter
    alone, on this rank's gradient, and submits the change (``delta``) with
    ``op=hvd.Adasum``; the parameter keeps its value meanwhile. ``step()`` waits for the
    combined deltas and applies them. Each rank keeps its own optimizer state, updated from
    its own gradients, as in Horovod.
    """

    _hora_class: type[torch.optim.Optimizer]

    def __init__(self, params: Any, options: DistributedOptions) -> None:
        super(self._hora_class, self).__init__(params)  # type: ignore[call-arg]  # the wrapped class takes its defaults
        self._compression = options.compression
        self.backward_passes_per_step = options.backward_passes_per_step
        self._parameter_names = {
            p: f"delta.{name[len('grad.') :]}"
            for p, name in parameter_names(self.param_groups, options.named_parameters).items()
        }
        self._requires_update = [
            p for group in self.param_groups for p in group["params"] if p.requires_grad
        ]
        self._delay = {p: self.backward_passes_per_step for p in self._requires_update}
        self._handles: dict[torch.Tensor, Pending] = {}
        self._hooks = [
            p.register_post_accumulate_grad_hook(weak_gradient_hook(self))
            for p in self._requires_update
        ]

    def _on_gradient(self, p: torch.Tensor) -> None:
        pending = self._handles.get(p)
        if pending is not None and pending is not UNSUBMITTED and self._delay[p] <= 0:
            raise AssertionError(TOO_MANY_PASSES)
        self._delay[p] -= 1
        self._handles[p] = self._submit_delta(p) if self._delay[p] == 0 else UNSUBMITTED

    def _submit_delta(self, p: torch.Tensor) -> Reduction:
        """Step ``p`` alone on this rank's gradient; submit the change; put ``p`` back."""
        with torch.no_grad():
            start = p.detach().clone()
            self._step_only([p])
            delta = p.detach() - start
            p.copy_(start)
        compressed, ctx = self._compression.compress(delta)
        handle = ops.allreduce_async_(compressed, name=self._parameter_names[p], op=ReduceOp.ADASUM)
        return Reduction(handle, ctx, compressed, False)

    _step_only = step_only

    def synchronize(self) -> None:
        """Nothing to do: the combined deltas are applied by ``step()``."""

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError(
            "Skipping synchronization is not supported when using Adasum optimizer: "
            "op=hvd.Adasum combines optimizer updates, not gradients, so there are no reduced "
            "gradients to clip between synchronize() and step()."
        )
        yield  # pragma: no cover - a generator for contextmanager

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        # Parameters whose hook did not run this step (no gradient on this rank) still submit
        # a delta, so that every rank submits the same names.
        for p in self._requires_update:
            pending = self._handles.get(p)
            if pending is None or pending is UNSUBMITTED:
                self._handles[p] = self._submit_delta(p)
        with torch.no_grad():
            for p, pending in self._handles.items():
                assert isinstance(pending, Reduction)
                result = ops.synchronize(pending.handle)
                delta = self._compression.decompress(result, pending.compression_ctx)
                p.add_(delta.to(p.dtype))
                self._delay[p] = self.backward_passes_per_step
        self._handles.clear()
        count_step()
        return loss

    zero_grad = guarded_zero_grad
    set_backward_passes_per_step = set_backward_passes_per_step


_DistributedAdasumOptimizer.step.hooked = True  # type: ignore[attr-defined]
