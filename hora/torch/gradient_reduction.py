"""What both forms of ``DistributedOptimizer`` share: the arguments it was called with
(:class:`DistributedOptions`), what a parameter's gradient waits for in a step (:class:`Pending`
and its kinds), the wrapped optimizer's methods they call in parts, the names of the
parameters' reductions, and Horovod's error texts.

This module knows optimizers, parameters and handles; the engine does the rest.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from hora.common import metrics
from hora.common.ops import submission
from hora.common.process_sets import ProcessSet
from hora.common.vocabulary.errors import HoraInternalError
from hora.common.vocabulary.message import ReduceOp
from hora.common.vocabulary.timeline_writer import TRAINING_ROW, Timeline
from hora.torch import ops

STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code."
)
TOO_MANY_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)
ZERO_GRAD_RACE = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)


@dataclass(frozen=True)
class DistributedOptions:
    """What ``DistributedOptimizer`` was asked for (checked), as every optimizer class it makes
    takes it; each reads what applies to it (the Adasum one, no ``op`` or groups).

    Attributes:
        named_parameters: the user's ``named_parameters``, or ``None``.
        compression: the compressor class (``Compression.none``, ...).
        backward_passes_per_step: local passes before a reduction, at the start
            (``set_backward_passes_per_step`` changes the optimizer's).
        op: Average, Sum or Adasum.
        gradient_predivide_factor: with Average, the sum is divided by it before the
            reduction and multiplied after (see :attr:`scales`).
        groups: the user's ``groups`` (or the deprecated ``num_groups``).
        sparse_as_dense: reduce sparse gradients as dense ones.
        process_set: the ranks that share the optimizer.
        shard_gradients: ZeRO stage 2 (sharded form only).
    """

    named_parameters: Any
    compression: Any
    backward_passes_per_step: int
    op: ReduceOp
    gradient_predivide_factor: float
    groups: Any
    sparse_as_dense: bool
    process_set: ProcessSet
    shard_gradients: bool = False

    @property
    def scales(self) -> tuple[float, float]:
        """The prescale and postscale factors of a gradient's reduction."""
        factor = self.gradient_predivide_factor
        if self.op == ReduceOp.AVERAGE and factor != 1.0:
            return 1.0 / factor, factor
        return 1.0, 1.0


def guarded_zero_grad(self: Any, set_to_none: bool = True) -> None:
    """``zero_grad()``, refused while reductions are in flight (Horovod's guard)."""
    if any(pending is not UNSUBMITTED for pending in self._handles.values()):
        raise AssertionError(ZERO_GRAD_RACE)
    super(self._hora_class, self).zero_grad(set_to_none)


@contextmanager
def skip_synchronize(self: Any) -> Iterator[None]:
    """Within this block ``step()`` does not synchronize (call ``synchronize()`` first).

    Example:
        >>> loss.backward()
        >>> optimizer.synchronize()
        >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        >>> with optimizer.skip_synchronize():
        ...     optimizer.step()
    """
    self._should_synchronize = False
    try:
        yield
    finally:
        self._should_synchronize = True


def set_backward_passes_per_step(self: Any, passes: int) -> None:
    """Change how many backward passes accumulate locally before an allreduce."""
    if passes <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    self.backward_passes_per_step = passes
    for p in self._delay:
        self._delay[p] = passes


def count_step(timeline: Timeline | None = None, started: int = 0) -> None:
    """A step is done: on ``timeline`` it is an ``OPTIMIZER_STEP`` from ``started`` (written out
    at once, so that every finished step reaches the file even if the process is killed next),
    and live metrics count it."""
    if timeline is not None:
        timeline.complete(TRAINING_ROW, "OPTIMIZER_STEP", started, timeline.now())
        timeline.flush()
    publisher = metrics.current()
    if publisher is not None:
        publisher.optimizer_stepped()


def step_only(
    self: Any, params: list[torch.Tensor] | None, skip: set[torch.Tensor] | None = None
) -> Any:
    """Run the wrapped optimizer's step on ``params`` only (or on all but ``skip``)."""
    chosen = set(params) if params is not None else None
    saved = [group["params"] for group in self.param_groups]
    try:
        for group in self.param_groups:
            group["params"] = [
                p
                for p in group["params"]
                if (chosen is None or p in chosen) and (skip is None or p not in skip)
            ]
        return super(self._hora_class, self).step()
    finally:
        for group, params_of_group in zip(self.param_groups, saved):
            group["params"] = params_of_group


# A held gradient: its parameter and the gradient tensor its hook saw (see _batches_now).
Held = tuple[torch.Tensor, torch.Tensor | None]

# The reduced gradients of a group, by the group's handle, as collected so far in a step.
GroupResults = dict[int, list[torch.Tensor]]


class Pending:
    """What a parameter's gradient is waiting for in this step (``_handles``' values)."""

    __slots__ = ()

    def finished(self, group_results: GroupResults) -> bool:
        """Whether the result is in, without waiting (sparse ones count as not in)."""
        return False

    def collect(self, optimizer: Any, p: torch.Tensor, group_results: GroupResults) -> None:
        """Wait for the reduced gradient and write it into ``p.grad``."""
        raise HoraInternalError(
            f"hora: the gradient of {optimizer._parameter_names.get(p, 'a parameter')} was "
            f"collected while {self}; please report this."
        )


class Mark(Pending):
    """A gradient not submitted yet: still accumulating, waiting for its group, or held."""

    __slots__ = ("_why",)

    def __init__(self, why: str) -> None:
        self._why = why

    def __str__(self) -> str:
        return self._why


# Not submitted in this step yet (accumulating locally, or waiting for the rest of its group).
UNSUBMITTED = Mark("not submitted yet")
# Held until its steady-state batch is complete (see _batches_now).
HELD = Mark("held for its batch")


class Reduction(Pending):
    """A gradient reduced on its own: its handle, and what ``_write_grad`` needs."""

    __slots__ = ("compression_ctx", "handle", "submitted", "was_sparse")

    def __init__(
        self, handle: int, compression_ctx: Any, submitted: torch.Tensor, was_sparse: bool
    ) -> None:
        self.handle = handle
        self.compression_ctx = compression_ctx
        self.submitted = submitted
        self.was_sparse = was_sparse

    def finished(self, group_results: GroupResults) -> bool:
        return bool(submission.poll(self.handle))

    def collect(self, optimizer: Any, p: torch.Tensor, group_results: GroupResults) -> None:
        optimizer._write_grad(p, ops.synchronize(self.handle), self)


class GroupMember(Reduction):
    """A gradient reduced with its group: the group's handle and its place in the group."""

    __slots__ = ("index",)

    def __init__(
        self, handle: int, index: int, compression_ctx: Any, submitted: torch.Tensor
    ) -> None:
        super().__init__(handle, compression_ctx, submitted, False)
        self.index = index

    def finished(self, group_results: GroupResults) -> bool:
        return self.handle in group_results or super().finished(group_results)

    def collect(self, optimizer: Any, p: torch.Tensor, group_results: GroupResults) -> None:
        results = group_results.get(self.handle)
        if results is None:
            results = group_results[self.handle] = ops.synchronize(self.handle)
        optimizer._write_grad(p, results[self.index], self)


class SparseReduction(Pending):
    """A sparse gradient, gathered as indices and values (``sparse_allreduce_async``)."""

    __slots__ = ("_finish",)

    def __init__(self, finish: Any) -> None:
        self._finish = finish

    def collect(self, optimizer: Any, p: torch.Tensor, group_results: GroupResults) -> None:
        p.grad = self._finish().coalesce()


def weak_gradient_hook(owner: Any) -> Callable[[torch.Tensor], None]:
    """A gradient hook that calls ``owner._on_gradient(p)`` and holds ``owner`` weakly:
    autograd keeps hooks in C++, where the garbage collector cannot see a cycle from a
    parameter to its optimizer, so a strong reference would keep a dropped model and optimizer
    (and their gradients and state) alive for the life of the process."""
    reference = weakref.ref(owner)

    def hook(p: torch.Tensor) -> None:
        alive = reference()
        if alive is not None:
            alive._on_gradient(p)

    return hook


def global_step_hooks() -> bool:
    """Whether step hooks were registered for every optimizer (torch.optim's global hooks)."""
    from torch.optim import optimizer as torch_optimizer

    return bool(
        getattr(torch_optimizer, "_global_optimizer_pre_hooks", None)
        or getattr(torch_optimizer, "_global_optimizer_post_hooks", None)
    )


def elastic_job() -> bool:
    from hora.common.vocabulary import settings_table as table
    from hora.common.vocabulary.config import read

    return bool(read(table.ELASTIC))


def parameter_names(param_groups: list[dict[str, Any]], named_parameters: Any) -> dict[Any, str]:
    all_params = [p for group in param_groups for p in group["params"]]
    if named_parameters is None:
        return {p: f"grad.noname.{i}" for i, p in enumerate(all_params)}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually produced "
            "by model.named_parameters()."
        )
    names = [name for name, _ in named]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"Parameter names in named_parameters must be unique. Found duplicates: {duplicates}"
        )
    by_param = {p: f"grad.{name}" for name, p in named}
    unnamed = [id(p) for p in all_params if p not in by_param]
    if unnamed:
        raise ValueError(
            "named_parameters was specified, but one or more model parameters were not named. "
            f"Python object ids: {unnamed}"
        )
    return by_param


def split_groups(params: list[torch.Tensor], groups: Any) -> list[list[torch.Tensor]]:
    if groups is None or groups == 0:
        return [[p] for p in params]
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError("groups must be a non-negative integer or a list of lists of tensors")
        count = min(groups, len(params)) or 1
        size = -(-len(params) // count)
        return [params[i : i + size] for i in range(0, len(params), size)]
    explicit: list[list[torch.Tensor]] = []
    seen: set[torch.Tensor] = set()
    for group in groups:
        members = [p for p in group if p.requires_grad]
        if any(p in seen for p in members):
            raise ValueError("A parameter appears in more than one group.")
        seen.update(members)
        explicit.append(members)
    explicit += [[p] for p in params if p not in seen]
    return [g for g in explicit if g]
