"""``DistributedOptimizer(..., deterministic=True)``: gradients combined in one fixed order, so
that the same run gives the same bits at every world size that divides ``K`` and across elastic
changes (docs/deterministic.md).

Each step is cut into ``K`` micro-batches; a rank runs its block of them, each inside
``optimizer.microbatch(...)``, which takes that micro-batch's gradient as a leaf of the fixed
tree of :mod:`hora.torch.deterministic_tree` and sums the rank's nodes as the leaves come
(:mod:`hora.torch.deterministic_sums`). ``step()`` gathers every rank's nodes with one
allgather, completes the tree on every rank, divides once at the root (by ``K`` for an
average), writes the result into ``.grad`` and runs the wrapped optimizer. No sum is left to a
transport, whose order depends on the number of ranks.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from hora.common.elastic.loop import round_number
from hora.common.ops import collectives, submission
from hora.common.ops.compression import CastCompressor, NoneCompressor
from hora.common.ops.objects import allgather_object
from hora.common.startup.timeline import current_timeline
from hora.common.vocabulary import config
from hora.common.vocabulary.message import ReduceOp
from hora.common.vocabulary.settings_table import DETERMINISTIC, DETERMINISTIC_MICROBATCHES
from hora.torch import deterministic_tree as tree
from hora.torch.deterministic import MicroBatch, seeded
from hora.torch.deterministic_sums import FlatGradients, flat_groups
from hora.torch.gradient_reduction import (
    STEP_AFTER_SYNCHRONIZE,
    DistributedOptions,
    count_step,
    parameter_names,
    skip_synchronize,
)
from hora.torch.sync_batch_norm import SyncBatchNorm

_DOCS = "see docs/deterministic.md"


def chosen_microbatches(deterministic: bool | None, microbatches: int | None) -> int | None:
    """``K`` when deterministic mode is on (the argument, else ``HORA_DETERMINISTIC``), with
    ``microbatches`` (else ``HORA_DETERMINISTIC_MICROBATCHES``); ``None`` when it is off.

    Raises:
        ValueError: the mode is on without a ``K``, or ``microbatches`` was given without it.
    """
    on = config.read(DETERMINISTIC) if deterministic is None else deterministic
    if not on:
        if microbatches is not None:
            raise ValueError(
                f"DistributedOptimizer(microbatches={microbatches}) sets deterministic mode's "
                "K, but the mode is off: pass deterministic=True as well (or set "
                f"{DETERMINISTIC.env}=1), or leave microbatches out."
            )
        return None
    leaves = microbatches if microbatches is not None else config.read(DETERMINISTIC_MICROBATCHES)
    if leaves is None:
        raise ValueError(
            "deterministic mode needs K, the micro-batches every step is cut into: pass "
            f"microbatches=K to DistributedOptimizer or set {DETERMINISTIC_MICROBATCHES.env}; "
            f"choose a K that every world size you will run at divides ({_DOCS})."
        )
    if leaves < 1:
        raise ValueError(f"deterministic mode needs K >= 1 micro-batches, got {leaves}.")
    return leaves


def _refusals(options: DistributedOptions, sharded: bool) -> list[str]:
    """What deterministic mode cannot take among the optimizer's other arguments, and why."""
    found = []
    if options.op == ReduceOp.ADASUM:
        found.append(
            "op=hvd.Adasum: Adasum combines the ranks' updates pairwise, so its result depends "
            "on the number of ranks; use hvd.Average or hvd.Sum"
        )
    if sharded:
        found.append(
            "shard_optimizer_state/shard_gradients: ZeRO reduce-scatters gradients, summing "
            "them in the transport's order; train unsharded"
        )
    if options.groups not in (None, 0):
        found.append(
            "groups: every gradient of one element type already travels in one buffer; leave "
            "groups out"
        )
    compression = options.compression
    if not (
        isinstance(compression, type) and issubclass(compression, NoneCompressor | CastCompressor)
    ):
        found.append(
            f"compression={compression!r}: only hvd.Compression.none, .fp16 and .bf16 are "
            "known to commute with the tree (a cast of each micro-batch's gradient)"
        )
    if not options.process_set.included():
        found.append("process_set: this rank is not in it")
    return found


def make(
    optimizer: torch.optim.Optimizer, options: DistributedOptions, leaves: int, sharded: bool
) -> torch.optim.Optimizer:
    """The deterministic form of ``optimizer`` (see ``DistributedOptimizer``).

    Raises:
        ValueError: an argument deterministic mode cannot honour, with the reason.
    """
    refused = _refusals(options, sharded)
    if refused:
        raise ValueError(
            "DistributedOptimizer(deterministic=True) cannot take " + "; ".join(refused) + "."
        )
    methods = dict(_DeterministicOptimizer.__dict__)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    cls._hora_class = cls  # type: ignore[attr-defined]
    return cls(optimizer.param_groups, options, leaves)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class _Plan:
    """How the ``leaves`` of a step are shared among ``size`` ranks now."""

    leaves: int
    size: int
    rank: int
    round: int

    @property
    def block(self) -> tuple[int, int]:
        return tree.block(self.leaves, self.size, self.rank)

    @property
    def covers(self) -> list[list[tree.Span]]:
        return [
            tree.cover(*tree.block(self.leaves, self.size, r), self.leaves)
            for r in range(self.size)
        ]


class _Course:
    """The course of a step on this rank: its micro-batches, their sums, the combination."""

    def __init__(self, params: list[torch.Tensor], options: DistributedOptions, leaves: int):
        self.params = params
        self.options = options
        self.leaves = leaves
        prescale, postscale = options.scales
        self.postscale = postscale
        self.divisor = leaves if options.op == ReduceOp.AVERAGE else 1
        self.groups: list[FlatGradients] = flat_groups(
            params, _wire_types(options, params), prescale
        )
        # Batch norm's running statistics (track_running_stats): their sums, and their values
        # at the start of the step, where every micro-batch's forward pass starts from.
        self.buffers: list[torch.Tensor] = []
        self.buffer_groups: list[FlatGradients] = []
        self.start: list[torch.Tensor] = []
        self.taken: list[int] = []
        self.plan: _Plan | None = None
        self.agreed: _Plan | None = None
        self.probed = False
        # With backward_passes_per_step > 1: the passes each parameter saw in the micro-batch.
        self.passes: dict[torch.Tensor, int] = {}
        if options.backward_passes_per_step > 1:
            for p in params:
                p.register_post_accumulate_grad_hook(self._count_pass)

    # ------------------------------------------------------------------ micro-batches

    def _plan_now(self) -> _Plan:
        process_set = self.options.process_set
        size, rank = submission.set_size(process_set), submission.set_rank(process_set)
        refusal = tree.refusal(self.leaves, size)
        if refusal is not None:
            raise ValueError(refusal)
        plan = self.plan
        if plan is None or (plan.size, plan.rank, plan.round) != (size, rank, round_number()):
            plan = self.plan = _Plan(self.leaves, size, rank, round_number())
        return plan

    def _check_order(self, index: int, plan: _Plan) -> None:
        start, end = plan.block
        if not start <= index < end:
            raise ValueError(
                f"micro-batch {index} is not this rank's: rank {plan.rank} of {plan.size} runs "
                f"micro-batches {start}..{end - 1} of the K={self.leaves} of a step "
                "(DeterministicSampler.steps() hands out the right ones)."
            )
        if self.taken and index <= self.taken[-1]:
            raise ValueError(
                f"micro-batch {index} after {self.taken[-1]}: run each of a step's micro-batches "
                "once, in increasing order, then call optimizer.step() (or zero_grad() to start "
                "the step again)."
            )

    @contextmanager
    def microbatch(self, index: int, seed: int | None) -> Iterator[None]:
        plan = self._plan_now()
        self._check_order(index, plan)
        if not self.taken:
            for group in self.groups + self.buffer_groups:
                group.begin(tree.cover(*plan.block, self.leaves), self.leaves)
            self.start = [b.detach().clone() for b in self.buffers]
        elif self.buffers:
            torch._foreach_copy_(self.buffers, self.start)
        for p in self.params:
            p.grad = None
        self.passes.clear()
        probe = None
        if not self.probed:
            probe = torch.nn.modules.module.register_module_forward_pre_hook(_refuse_sync_bn)
        try:
            with seeded(seed) if seed is not None else nullcontext():
                yield
        finally:
            if probe is not None:
                probe.remove()
        self.probed = True
        self._take(index)

    def _count_pass(self, p: torch.Tensor) -> None:
        self.passes[p] = self.passes.get(p, 0) + 1

    def _take(self, index: int) -> None:
        wanted = self.options.backward_passes_per_step
        if wanted > 1:
            passes = max(self.passes.values(), default=0)
            if passes != wanted:
                raise ValueError(
                    f"micro-batch {index} had {passes} backward passes, but "
                    f"backward_passes_per_step={wanted}: each micro-batch accumulates that many."
                )
        for group in self.groups + self.buffer_groups:
            group.add_leaf(index)
        for p in self.params:
            p.grad = None
        self.taken.append(index)

    def track(self, buffers: list[torch.Tensor]) -> None:
        """Combine these buffers' values after each micro-batch as leaves too: a step leaves
        them at the tree's average over its micro-batches (see ``track_running_stats``)."""
        if self.taken:
            raise ValueError("track_running_stats() in the middle of a step: call it before one")
        self.buffers = buffers
        self.buffer_groups = flat_groups(buffers, {}, 1.0, values=True)
        self.agreed = None

    # ------------------------------------------------------------------ the step

    def combine(self, names: dict[torch.Tensor, str]) -> None:
        """Gather every rank's nodes, complete the tree and write the result into ``.grad``."""
        plan = self.plan
        try:
            self._check_step(plan, names)
            assert plan is not None
            if self.agreed != plan:
                self._agree(plan)
            groups = self.groups + self.buffer_groups
            rows = [group.nodes() for group in groups]
            if plan.size > 1:
                handle = collectives.allgather_async(
                    rows, "hora.deterministic", self.options.process_set, True
                )
                rows = collectives.results(handle, True)
            covers = plan.covers
            for group, gathered in zip(groups, rows):
                root = group.complete(gathered, covers)
                if group.values:
                    with torch.no_grad():
                        torch._foreach_copy_(group.params, group.reduced(root, 1.0, self.leaves))
                    continue
                for p, grad in zip(group.params, group.reduced(root, self.postscale, self.divisor)):
                    p.grad = grad
        finally:
            self.taken.clear()

    def _check_step(self, plan: _Plan | None, names: dict[torch.Tensor, str]) -> None:
        stray = [names[p] for p in self.params if p.grad is not None]
        if stray:
            raise ValueError(
                "deterministic mode: gradients were computed outside optimizer.microbatch() "
                f"(of {', '.join(stray[:5])}{', ...' if len(stray) > 5 else ''}); run every "
                f"backward pass of a step inside one ({_DOCS})."
            )
        if plan is None or not self.taken:
            raise ValueError(
                "deterministic mode: optimizer.step() without micro-batches; run this rank's "
                f"micro-batches inside optimizer.microbatch() first ({_DOCS})."
            )
        start, end = plan.block
        missing = sorted(set(range(start, end)) - set(self.taken))
        if missing:
            raise ValueError(
                f"deterministic mode: rank {plan.rank} of {plan.size} runs micro-batches "
                f"{start}..{end - 1} of each step, but {missing} did not run in this one."
            )

    def _agree(self, plan: _Plan) -> None:
        """Check, once per world, that every rank means the same step and computes its leaves
        alike (a leaf's bits depend on the torch version and on the intra-op threads that
        split its kernels)."""
        mine = (
            torch.__version__,
            torch.get_num_threads(),
            self.leaves,
            int(self.options.op),
            self.options.backward_passes_per_step,
            self.options.scales,
            [(str(g.grad_dtype), str(g.wire_dtype), g.numel) for g in self.groups],
            [(str(g.grad_dtype), g.numel) for g in self.buffer_groups],
        )
        everyone = allgather_object(
            mine, name="hora.deterministic.agree", process_set=self.options.process_set
        )
        differing = [rank for rank, theirs in enumerate(everyone) if theirs != everyone[0]]
        if differing:
            raise ValueError(
                "deterministic mode: the ranks differ in what makes their sums alike (torch "
                "version, intra-op threads, K, op, backward_passes_per_step, scaling, the "
                f"gradients' and tracked buffers' types and sizes): rank 0 has {everyone[0]}, "
                f"rank {differing[0]} {everyone[differing[0]]}. Run the same script with "
                "torch.set_num_threads(n), the same n, on every rank."
            )
        self.agreed = plan

    def clear(self) -> None:
        """Forget the step's micro-batches (``zero_grad``, ``load_state_dict``); tracked buffers
        go back to their values at the start of the step."""
        if self.taken and self.buffers:
            with torch.no_grad():
                torch._foreach_copy_(self.buffers, self.start)
        self.taken.clear()


def _wire_types(
    options: DistributedOptions, params: list[torch.Tensor]
) -> dict[torch.dtype, torch.dtype]:
    """The type each element type's sums are taken in: the compressed one for floating-point
    gradients under ``Compression.fp16``/``.bf16``."""
    compression = options.compression
    if not (isinstance(compression, type) and issubclass(compression, CastCompressor)):
        return {}
    wire = getattr(torch, compression.wire)
    return {p.dtype: wire for p in params if p.dtype.is_floating_point and p.dtype != wire}


def _refuse_sync_bn(module: torch.nn.Module, args: Any) -> None:
    del args
    if isinstance(module, SyncBatchNorm | torch.nn.SyncBatchNorm):
        raise ValueError(
            f"deterministic mode cannot use {type(module).__name__}: it takes its statistics "
            "over the batches of every rank, so its result depends on the number of ranks. "
            "Use torch.nn.BatchNorm (each micro-batch is normalised over its own samples, the "
            f"same at every world size) ({_DOCS})."
        )


class _DeterministicOptimizer(torch.optim.Optimizer):
    """Methods mixed into a subclass of the wrapped optimizer's class (see :func:`make`)."""

    _hora_class: type[torch.optim.Optimizer]

    def __init__(self, params: Any, options: DistributedOptions, leaves: int) -> None:
        super(self._hora_class, self).__init__(params)  # type: ignore[call-arg]  # the wrapped class takes its defaults
        self._options = options
        self.backward_passes_per_step = options.backward_passes_per_step
        self._parameter_names = parameter_names(self.param_groups, options.named_parameters)
        trained = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._course = _Course(trained, options, leaves)
        # What marks a DistributedOptimizer (broadcast_optimizer_state steps the wrapped class).
        self._requires_update = trained
        self._synchronized = False
        self._should_synchronize = True

    @property
    def microbatches(self) -> int:
        """``K``: the micro-batches every step is cut into."""
        return self._course.leaves

    def local_microbatches(self) -> range:
        """The micro-batches (``0 .. K-1``) this rank runs in a step, at the current world
        size."""
        start, end = self._course._plan_now().block
        return range(start, end)

    def microbatch(self, microbatch: MicroBatch | int, seed: int | None = None) -> Any:
        """A context for one micro-batch: run its forward and backward passes inside.

        On entry ``.grad`` is cleared, and with a seed (a :class:`MicroBatch`'s, or ``seed``)
        torch's default CPU generator is seeded for the block; on a normal exit the gradient is
        taken as the micro-batch's leaf. A rank runs its micro-batches
        (:meth:`local_microbatches`) in increasing order, then calls ``step()``.

        Example:
            >>> for mb in step:  # a DeterministicSampler's Step
            ...     with optimizer.microbatch(mb):
            ...         loss_fn(model(x[list(mb.indices)]), y[list(mb.indices)]).backward()
            >>> optimizer.step()
        """
        if isinstance(microbatch, MicroBatch):
            index, seed = microbatch.index, microbatch.seed if seed is None else seed
        else:
            index = int(microbatch)
        return self._course.microbatch(index, seed)

    def track_running_stats(self, model: torch.nn.Module) -> None:
        """Make the running statistics of ``model``'s batch norm layers the same bits on every
        rank and at every world size.

        Every micro-batch's forward pass then starts from the statistics as they were at the
        start of the step, and ``step()`` sets them to the average, over the fixed tree, of the
        values the ``K`` micro-batches left (``num_batches_tracked`` goes up by one a step): one
        update a step, with the micro-batches' mean statistics. Without it, each rank's
        statistics follow the micro-batches it ran. Call it on every rank, before the first
        step.
        """
        buffers = []
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                for name in ("running_mean", "running_var", "num_batches_tracked"):
                    buffer = getattr(module, name, None)
                    if isinstance(buffer, torch.Tensor):
                        buffers.append(buffer)
        self._course.track(buffers)

    def synchronize(self) -> None:
        """Combine this step's micro-batches across ranks and write the result into ``.grad``
        (then clip, if you like: the gradient is the same bits on every rank)."""
        self._course.combine(self._parameter_names)
        self._synchronized = True

    skip_synchronize = skip_synchronize

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise ValueError(
                "deterministic mode cannot take a closure: it would run forward and backward "
                f"again outside the micro-batches ({_DOCS})."
            )
        timeline = current_timeline()
        started = timeline.now() if timeline is not None else 0
        if self._should_synchronize:
            if self._synchronized:
                # The micro-batches are combined already: step on what synchronize() wrote.
                warnings.warn(STEP_AFTER_SYNCHRONIZE, stacklevel=2)
            else:
                self.synchronize()
        self._synchronized = False
        result = super(self._hora_class, self).step()  # type: ignore[misc]
        count_step(timeline, started)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``.grad`` and forget the micro-batches of an unfinished step."""
        self._course.clear()
        super(self._hora_class, self).zero_grad(set_to_none)  # type: ignore[misc]

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Refused: the passes per micro-batch are fixed when the optimizer is made."""
        raise ValueError(
            "deterministic mode fixes backward_passes_per_step (the backward passes of each "
            "micro-batch) when the optimizer is made; make a new DistributedOptimizer."
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._course.clear()
        self._synchronized = False
        super(self._hora_class, self).load_state_dict(state_dict)  # type: ignore[misc]


# As in averaging_optimizer: the wrapped class's step() runs the step hooks already.
_DeterministicOptimizer.step.hooked = True  # type: ignore[attr-defined]
