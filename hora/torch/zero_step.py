"""The course of one step of a sharded ``DistributedOptimizer`` on this rank's shard.

:class:`ShardedStep` runs a step as an outline over its collaborators: a backward pass begins
(the pieces taken back from ``param_groups``, the ranks checked against the layout), the
buckets' reduced shards are collected (``synchronize()``), and ``step()`` updates each bucket
as soon as its shard arrives, with the wrapped optimizer on this rank's pieces, and starts its
allgather at once, so the update of one bucket overlaps the communication of the others. It
also lays the shards out anew when the ranks change, giving the pieces the state the wrapped
class makes in its constructor.

It owns only what it knows of the wrapped optimizer (its class, whether it makes state
eagerly); the pass's bookkeeping is :mod:`hora.torch.zero_reduce_scatter`'s, the shown shards
:mod:`hora.torch.zero_reduced_gradients`' and the gathers
:mod:`hora.torch.zero_parameter_gather`'s. The optimizer's own ``state`` and ``param_groups``
(``torch.optim``'s) are reached through the optimizer each call is given.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Protocol

from hora.torch.gradient_reduction import global_step_hooks
from hora.torch.zero_parameter_gather import ParameterGather
from hora.torch.zero_parameters import ShardedParameters
from hora.torch.zero_reduce_scatter import GradientReduceScatter
from hora.torch.zero_reduced_gradients import ReducedGradients

AMP_NEEDS_SYNCHRONIZE = (
    "GradScaler.step() was called on a sharded DistributedOptimizer (shard_optimizer_state=True) "
    "before optimizer.synchronize(). Each rank holds only its shard of the reduced gradients, so "
    "the scaler must see those: call optimizer.synchronize() after backward, then "
    "scaler.unscale_(optimizer) if you clip, then scaler.step(optimizer) (see docs/zero.md)."
)

# Group keys that are not options of the update.
_NOT_OPTIONS = ("params", "param_names")


class SteppedOptimizer(Protocol):
    """What the step uses of the sharded optimizer itself (``GradScaler``'s ``grad_scale`` and
    ``found_inf`` are read where it sets them)."""

    state: Any
    param_groups: list[dict[str, Any]]
    backward_passes_per_step: int


@dataclass(frozen=True, eq=False)
class ShardedStep:
    """One step's course: the pass's start, ``synchronize()``, ``step()``, and laying out.

    Attributes:
        params: the parameters, their buckets and this rank's pieces.
        reduce_scatter: the gradients' reduce-scatter during backward.
        reduced: the reduced shards, as ``synchronize()`` shows them.
        gather: the parameters' allgather.
        wrapped: the wrapped optimizer's class, whose ``step()`` updates the pieces.
        eager_state: whether the wrapped class makes state in its constructor (Adagrad's
            accumulators).
    """

    params: ShardedParameters
    reduce_scatter: GradientReduceScatter
    reduced: ReducedGradients
    gather: ParameterGather
    wrapped: Any
    eager_state: bool

    # ------------------------------------------------------------------ a backward pass

    def begin_pass(self, opt: SteppedOptimizer) -> None:
        """At the first gradient of a step: take the pieces back from param_groups (a step
        GradScaler skipped leaves them shown) and check the ranks are those of the layout."""
        self.gather.finish()
        self.reduce_scatter.begin_pass()
        # A new backward pass after synchronize() without step(): a new step begins.
        self.reduced.restart(opt.param_groups)
        if self.params.needs_new_layout(opt.state):
            self.lay_out(opt)

    def submit_outstanding(self, opt: SteppedOptimizer) -> None:
        """Close the backward pass: reduce every bucket no hook completed."""
        if not self.reduce_scatter.in_pass:
            self.begin_pass(opt)
        self.reduce_scatter.submit_outstanding()

    def synchronize(self, opt: SteppedOptimizer) -> None:
        """Wait for this rank's shard of the reduced gradients and show the pieces."""
        if self.reduced.synchronized:
            return
        self.gather.finish()
        self.submit_outstanding(opt)
        collect = self.reduce_scatter.collect
        shards = [collect(number) for number in range(len(self.params.buckets))]
        self.reduce_scatter.end_pass(opt.backward_passes_per_step)
        self.reduced.settle(shards, opt.param_groups)

    def reset(self, opt: SteppedOptimizer) -> None:
        """Forget a step in progress (load_state_dict, an elastic reset)."""
        self.gather.finish_or_drop()
        self.reduce_scatter.drop()
        self.reduced.drop(opt.param_groups, sentinel=False)
        self.reduce_scatter.end_pass(opt.backward_passes_per_step)

    # ------------------------------------------------------------------ the step

    def step(self, opt: SteppedOptimizer) -> None:
        """Update this rank's shard of the parameters and gather every rank's.

        Under a ``GradScaler`` (which sets ``grad_scale`` and ``found_inf`` on the optimizer
        before calling its step), the shards are unscaled here unless ``scaler.unscale_`` did
        it, and nothing is updated when any rank found an inf.

        Raises:
            RuntimeError: a ``GradScaler`` calls it without ``synchronize()`` first.
        """
        found_inf = getattr(opt, "found_inf", None)
        grad_scale = getattr(opt, "grad_scale", None)
        scaled = hasattr(opt, "found_inf")
        reduced = self.reduced
        if scaled and not reduced.synchronized:
            # GradScaler removes these only after a step that returns.
            for attribute in ("found_inf", "grad_scale"):
                delattr(opt, attribute)
            raise RuntimeError(AMP_NEEDS_SYNCHRONIZE)
        try:
            if reduced.synchronized:
                reduced.hide(opt.param_groups)
                skip = found_inf is not None and float(found_inf) > 0
                if not skip:
                    if grad_scale is not None:
                        reduced.unscale(grad_scale)
                    self._step_and_gather(opt, collected=True)
            else:
                self._step_and_gather(opt, collected=False)
        finally:
            reduced.drop(opt.param_groups, sentinel=True)

    def _step_and_gather(self, opt: SteppedOptimizer, collected: bool) -> None:
        """Update the shards bucket by bucket as their gradients arrive (unless hooks or a
        foreign optimizer ask for one update), allgathering each as soon as it is updated and
        writing each gathered bucket into the parameters as soon as it is in."""
        params, gather = self.params, self.gather
        collect = self.reduce_scatter.collect
        params.refresh()
        if not collected:
            self.submit_outstanding(opt)
        numbers = range(len(params.buckets))
        gathers: list[tuple[int, Any]] = []
        if not collected and self._steps_in_parts(opt):
            for number in numbers:
                collect(number)
                self._update(opt, [number])
                for piece in params.layout.pieces[number]:
                    params.pieces[piece.index].grad = None  # its reduced shard is used up
                gathers.append((number, gather.start(number)))
                if not gather.overlapped:  # overlapped, each bucket goes in before its forward
                    gathers = gather.write_finished(gathers)
        else:
            if not collected:
                for number in numbers:
                    collect(number)
            self._update(opt, None)
            gathers = [(number, gather.start(number)) for number in numbers]
        if not collected:
            self.reduce_scatter.end_pass(opt.backward_passes_per_step)
        gather.place(gathers)

    def _steps_in_parts(self, opt: SteppedOptimizer) -> bool:
        """Whether the wrapped optimizer may run once per bucket: torch.optim's own classes
        (one parameter's update is independent of the others'), without step hooks (which
        would run once per bucket)."""
        if len(self.params.buckets) < 2:
            return False
        if not self.wrapped.__module__.startswith("torch.optim."):
            return False
        return not (
            getattr(opt, "_optimizer_step_pre_hooks", None)
            or getattr(opt, "_optimizer_step_post_hooks", None)
            or global_step_hooks()
        )

    def _update(self, opt: SteppedOptimizer, buckets: list[int] | None) -> None:
        """Run the wrapped optimizer on this rank's pieces (of ``buckets``, or all)."""
        groups = self.params.bucket_piece_groups(len(opt.param_groups), buckets)
        if not any(groups):
            return
        saved = [group["params"] for group in opt.param_groups]
        # A fused wrapped optimizer reads these itself: the shards are unscaled already.
        hidden = {k: getattr(opt, k) for k in ("grad_scale", "found_inf") if hasattr(opt, k)}
        try:
            for k in hidden:
                setattr(opt, k, None)
            for group, own in zip(opt.param_groups, groups):
                group["params"] = own
            self.wrapped.step(opt)
        finally:
            for group, params in zip(opt.param_groups, saved):
                group["params"] = params
            for k, v in hidden.items():
                setattr(opt, k, v)

    # ------------------------------------------------------------------ laying out

    def lay_out(self, opt: SteppedOptimizer) -> None:
        """Lay the shards out over the ranks there are now; each piece gets a view of its
        parameter's memory and fresh optimizer state."""
        for tensor in self.params.pieces.values():
            opt.state.pop(tensor, None)
        self.params.lay_out()
        self.fresh_state(opt)

    def relayout(self, opt: SteppedOptimizer) -> None:
        """Lay the shards out anew if the ranks changed, dropping this rank's state (the
        caller loads a consolidated state next)."""
        self.gather.finish_or_drop()
        if self.params.changed():
            self.lay_out(opt)

    def reshard(self, opt: SteppedOptimizer) -> None:
        """Lay the shards out for the ranks there are now, dropping this rank's state (the
        caller loads a consolidated state next)."""
        self.reset(opt)
        self.lay_out(opt)

    def fresh_state(self, opt: SteppedOptimizer) -> None:
        """Give the pieces the state the wrapped class makes in its constructor (Adagrad's
        accumulators), by making one on each group's pieces with the group's options as
        arguments; most classes make theirs at the first step instead."""
        if not self.eager_state:
            return
        wrapped = self.wrapped
        accepted = inspect.signature(wrapped.__init__).parameters
        for number, pieces in enumerate(self.params.piece_groups(len(opt.param_groups))):
            if not pieces:
                continue
            options = {k: v for k, v in opt.param_groups[number].items() if k not in _NOT_OPTIONS}
            arguments = {k: v for k, v in options.items() if k in accepted}
            fresh = wrapped([{**options, "params": pieces}], **arguments)
            for tensor, state in fresh.state.items():
                opt.state[tensor] = state
