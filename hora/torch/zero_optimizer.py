"""``DistributedOptimizer(..., shard_optimizer_state=True)``: ZeRO stages 1 and 2.

Each rank keeps the optimizer state of only its shard of the parameters. A hook on every
parameter counts its gradient in; once every gradient of a bucket (see
:mod:`hora.torch.zero_layout`) is in, the bucket's gradients are packed into one flat tensor and
reduce-scattered while backward goes on, so each rank receives the averaged gradient of its own
shard. ``step()`` runs the wrapped optimizer on the rank's shard only, as flat pieces of the
parameters (views of their memory), and allgathers the updated shards into every rank's
parameters: the same bytes on the wire as an allreduce. With ``shard_gradients=True`` (stage 2)
each ``.grad`` is also released once its bucket is packed, so gradients take full-size memory
only until their bucket leaves.

Each bucket is updated as soon as its reduced shard arrives and its allgather starts at once,
so the update of one bucket overlaps the communication of the others; ``step()`` returns once
the parameters are whole again. The optimizer sees no module: after
:meth:`ShardedOptimizer.overlap_gather_with_forward` (``model``) ``step()`` returns as soon as
the allgathers are started, and each bucket is written into the parameters just before the
first module that owns one of its parameters runs forward (or when anything else of the
optimizer's, or ``model.state_dict()``/``load_state_dict()``, needs them whole).

This module knows optimizers, parameters and handles; the state as a whole (consolidated and
per-rank state dicts, loading them) is in :mod:`hora.torch.zero_state` and its neighbours.
"""

from __future__ import annotations

import inspect
import itertools
import math
import warnings
import weakref
from typing import Any

import torch

from hora.common import basics, metrics, submission
from hora.common.errors import HoraInternalError, HoraValueError
from hora.common.message import ReduceOp
from hora.common.process_sets import ProcessSet
from hora.common.timeline_control import current_timeline
from hora.common.timeline_writer import TRAINING_ROW
from hora.torch import ops, zero_consolidated_state, zero_state, zero_state_loading
from hora.torch.gradient_reduction import (
    TOO_MANY_PASSES,
    ZERO_GRAD_RACE,
    elastic_job,
    global_step_hooks,
    parameter_names,
    skip_synchronize,
    split_groups,
    weak_gradient_hook,
)
from hora.torch.zero_layout import Layout, Piece, plan_buckets

# torch.optim's optimizers whose update of an element reads only that element's gradient and
# state (and per-parameter scalars such as a step count): they update a shard as they would the
# whole parameter.
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
)

# The class attribute with which an optimizer of another library declares an elementwise update.
ELEMENTWISE_FLAG = "hora_elementwise_update"

# The largest bucket of gradients reduce-scattered (and of parameters allgathered) as one tensor.
BUCKET_BYTES = 16 * 1024 * 1024

AMP_NEEDS_SYNCHRONIZE = (
    "GradScaler.step() was called on a sharded DistributedOptimizer (shard_optimizer_state=True) "
    "before optimizer.synchronize(). Each rank holds only its shard of the reduced gradients, so "
    "the scaler must see those: call optimizer.synchronize() after backward, then "
    "scaler.unscale_(optimizer) if you clip, then scaler.step(optimizer) (see docs/zero.md)."
)
NO_CLOSURE = (
    "step(closure) is not supported with shard_optimizer_state=True: a closure would run "
    "backward again while the gradients of this step are being reduced. Call loss.backward() "
    "and then optimizer.step()."
)

# Numbers the sharded optimizers of a process, in the order they are made (the same on every
# rank): the names of their collectives.
_numbers = itertools.count()


def check_shardable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose update of one element reads other elements.

    Raises:
        ValueError: the optimizer is not one of :data:`ELEMENTWISE` (or a subclass that leaves
            its ``step`` as it is), and its class does not set ``hora_elementwise_update``.
    """
    kind = type(optimizer)
    if getattr(kind, ELEMENTWISE_FLAG, False):
        return
    for position, base in enumerate(kind.__mro__):
        if base in ELEMENTWISE:
            # torch.optim puts a wrapper of the inherited step() into a subclass it instantiates
            # (to run the step hooks): only a step() of the subclass's own counts.
            inherited = inspect.unwrap(base.step)
            own = [
                inspect.unwrap(vars(c)["step"])
                for c in kind.__mro__[:position]
                if "step" in vars(c)
            ]
            if all(step is inherited for step in own):
                return
            break
    supported = ", ".join(c.__name__ for c in ELEMENTWISE)
    raise ValueError(
        f"shard_optimizer_state=True cannot shard {kind.__name__}: each rank updates only its "
        "slice of every parameter, so the update of an element may read only that element's "
        "gradient and state. LBFGS (a line search over all parameters), SparseAdam (sparse "
        "gradients) and optimizers that use a norm or a factorization of whole tensors (LAMB, "
        f"LARS, Adafactor, Muon, ...) do not. Supported: {supported}, and any optimizer class "
        f"that sets `{ELEMENTWISE_FLAG} = True`. Use DistributedOptimizer without "
        "shard_optimizer_state for this one."
    )


class ShardedOptimizer(torch.optim.Optimizer):
    """The methods of a sharded ``DistributedOptimizer``; the factory makes a class with this
    one first and the wrapped optimizer's class second, so ``super(ShardedOptimizer, self)``
    is the wrapped class.

    What it adds to the wrapped optimizer: ``synchronize()``, ``skip_synchronize()``,
    ``clip_grad_norm_()``, ``sharded_state_dict()``, and ``state_dict()`` /
    ``load_state_dict()`` that consolidate and re-shard.
    """

    # GradScaler then calls step() on every rank (with grad_scale and found_inf set) instead
    # of skipping it on the ranks that found an inf: see step().
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Any,
        named_parameters: Any,
        compression: Any,
        backward_passes_per_step: int,
        op: ReduceOp,
        gradient_predivide_factor: float,
        groups: Any,
        sparse_as_dense: bool,
        process_set: ProcessSet,
        shard_gradients: bool,
    ) -> None:
        self._layout: Layout | None = None
        super().__init__(params)  # type: ignore[call-arg]  # the wrapped class takes its defaults
        # Adagrad makes full-size state in its constructor: each piece gets its own below.
        self._eager_state = bool(self.state)
        self.state.clear()
        self._compression = compression
        self._op = op
        self._predivide = gradient_predivide_factor
        self._sparse_as_dense = sparse_as_dense
        self._process_set = process_set
        self._shard_gradients = shard_gradients
        self.backward_passes_per_step = backward_passes_per_step
        self._label = f"zero{next(_numbers)}"
        self._parameter_names = parameter_names(self.param_groups, named_parameters)
        self._all_params = [p for group in self.param_groups for p in group["params"]]
        self._trainable = [p for p in self._all_params if p.requires_grad]
        self._requires_update = self._trainable  # marks a DistributedOptimizer
        self._index = {p: i for i, p in enumerate(self._trainable)}
        self._group_of = [0] * len(self._trainable)
        for number, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p in self._index:
                    self._group_of[self._index[p]] = number
        self._buckets = self._plan(groups)
        self._bucket_of = [0] * len(self._trainable)
        for bucket in self._buckets:
            for slot in bucket.slots:
                self._bucket_of[slot.index] = bucket.number
        # Per trainable parameter: backward passes still to come before its gradient counts.
        self._delay = [backward_passes_per_step] * len(self._trainable)
        # Per bucket: gradients in; what its reduction is (a handle and compression context,
        # or the packed gradients themselves when no other rank shares the optimizer).
        self._ready = [0] * len(self._buckets)
        self._pending: list[Any] = [None] * len(self._buckets)
        self._in_pass = False
        # After synchronize(): every piece holds its reduced gradient shard, and param_groups
        # list the pieces (and the sentinel) until step() or zero_grad().
        self._synchronized = False
        self._shown: list[list[torch.Tensor]] | None = None
        self._should_synchronize = True
        # The last consolidated state loaded, until the next step (broadcast_optimizer_state
        # sends it from the root: see zero_state.broadcast_state).
        self.loaded_state: dict[str, Any] | None = None
        # A one-element "parameter" GradScaler sees while the gradients are shown: its gradient
        # is inf on every rank when any rank's shard has a non-finite value, so all agree.
        device = self._trainable[0].device if self._trainable else torch.device("cpu")
        self._sentinel = torch.zeros(1, device=device)
        self._pieces: dict[int, torch.Tensor] = {}
        # After overlap_gather_with_forward(): the allgathers the last step() started, by
        # bucket, whose results are not yet in the parameters.
        self._overlap = False
        self._gathering: dict[int, Any] = {}
        self._overlap_hooks: list[Any] = []
        self._build_layout()
        self._hooks: list[Any] = []
        if process_set.included() and (self._layout_size() > 1 or elastic_job()):
            hook = weak_gradient_hook(self)
            for p in self._trainable:
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    # ------------------------------------------------------------------ layout

    def _plan(self, groups: Any) -> list[Any]:
        keys = [(p.dtype, p.device) for p in self._trainable]
        numels = [p.numel() for p in self._trainable]
        limits = [max(1, BUCKET_BYTES // p.element_size()) for p in self._trainable]
        explicit = None
        if groups is not None and groups != 0:
            explicit = [
                [self._index[p] for p in members]
                for members in split_groups(self._trainable, groups)
            ]
        return plan_buckets(numels, keys, limits, explicit)

    def _layout_size(self) -> int:
        if not self._process_set.included():
            return 1
        return submission.set_size(self._process_set)

    def _layout_rank(self) -> int:
        if not self._process_set.included():
            return 0
        return submission.set_rank(self._process_set)

    def _build_layout(self) -> None:
        """Lay the buckets out over the ranks there are now; each piece gets a tensor that is a
        view of its parameter's memory and fresh optimizer state."""
        layout = Layout.of(self._buckets, self._layout_rank(), self._layout_size())
        self._layout = layout
        for tensor in self._pieces.values():
            self.state.pop(tensor, None)
        self._pieces = {}
        for pieces in layout.pieces:
            for piece in pieces:
                self._pieces[piece.index] = self._piece_tensor(piece)
        self._fresh_state()

    def _piece_tensor(self, piece: Piece) -> torch.Tensor:
        p = self._trainable[piece.index]
        with torch.no_grad():
            if p.is_contiguous():
                tensor = torch.empty(0, dtype=p.dtype, device=p.device)
                tensor.set_(p.untyped_storage(), p.storage_offset() + piece.start, (piece.numel,))  # type: ignore[call-overload]  # set_(storage, ...) is missing from the stubs
            else:
                tensor = p.detach().reshape(-1)[piece.start : piece.stop].clone()
        return tensor

    def _refresh_pieces(self) -> None:
        """Point every piece at its parameter's memory again: a parameter whose ``.data`` was
        replaced (``model.to``, ``load_state_dict(assign=True)``) keeps its piece and state."""
        assert self._layout is not None
        with torch.no_grad():
            for piece in self._layout.piece_of().values():
                p = self._trainable[piece.index]
                tensor = self._pieces[piece.index]
                if p.dtype != tensor.dtype or p.device != tensor.device:
                    raise HoraValueError(
                        f"sharded DistributedOptimizer: parameter "
                        f"{self._parameter_names[p]!r} changed from {tensor.dtype} on "
                        f"{tensor.device} to {p.dtype} on {p.device} after it was wrapped. "
                        "Move or cast the model before wrapping its optimizer."
                    )
                if not p.is_contiguous():
                    tensor.copy_(p.detach().reshape(-1)[piece.start : piece.stop])
                    continue
                offset = p.storage_offset() + piece.start
                if (
                    tensor.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
                    or tensor.storage_offset() != offset
                ):
                    tensor.set_(p.untyped_storage(), offset, (piece.numel,))  # type: ignore[call-overload]

    def _fresh_state(self) -> None:
        """Give the pieces the state the wrapped class makes in its constructor (Adagrad's
        accumulators), by making one on each group's pieces with the group's options as
        arguments; most classes make theirs at the first step instead."""
        if not self._eager_state:
            return
        wrapped = self._wrapped_class()
        accepted = inspect.signature(wrapped.__init__).parameters
        for number, pieces in enumerate(self._piece_groups()):
            if not pieces:
                continue
            options = {k: v for k, v in self.param_groups[number].items() if k not in _NOT_OPTIONS}
            arguments = {k: v for k, v in options.items() if k in accepted}
            fresh = wrapped([{**options, "params": pieces}], **arguments)
            for tensor, state in fresh.state.items():
                self.state[tensor] = state

    def _wrapped_class(self) -> Any:
        mro = type(self).__mro__
        return mro[mro.index(ShardedOptimizer) + 1]

    def _piece_groups(self) -> list[list[torch.Tensor]]:
        """Per parameter group, the pieces of its parameters that this rank owns, in order."""
        groups: list[list[torch.Tensor]] = [[] for _ in self.param_groups]
        for index, tensor in sorted(self._pieces.items()):
            groups[self._group_of[index]].append(tensor)
        return groups

    def _check_layout(self) -> None:
        """Lay the shards out again when the number of ranks changed (an elastic reset);
        refused while there is state that would be lost."""
        assert self._layout is not None
        size, rank = self._layout_size(), self._layout_rank()
        if (size, rank) == (self._layout.size, self._layout.rank):
            return
        if any(self.state.get(t) for t in self._pieces.values()):
            raise HoraValueError(
                f"sharded DistributedOptimizer: the ranks sharing it changed from "
                f"{self._layout.size} to {size} (this rank: {self._layout.rank} -> {rank}), "
                "and each rank holds only its own shard of the optimizer state. Redistribute it "
                "through hvd.elastic.TorchState (its commit keeps a consolidated copy), or load "
                "a consolidated optimizer.state_dict() on every rank."
            )
        self._build_layout()

    def relayout(self) -> None:
        """Lay the shards out anew if the ranks changed, dropping this rank's state (the
        caller loads a consolidated state next)."""
        assert self._layout is not None
        self._finish_or_drop_gather()
        if (self._layout_size(), self._layout_rank()) != (self._layout.size, self._layout.rank):
            self._build_layout()

    def layout_size_now(self) -> int:
        """How many ranks share the optimizer now (the layout may be older)."""
        return self._layout_size()

    def reshard(self) -> None:
        """Lay the shards out for the ranks there are now, dropping this rank's state (the
        caller loads a consolidated state next)."""
        self._reset_pass()
        self._build_layout()

    # ------------------------------------------------------------------ gradient flow

    def _on_gradient(self, p: torch.Tensor) -> None:
        if not self._in_pass:
            self._begin_pass()
        index = self._index[p]
        delay = self._delay[index] - 1
        if delay < 0:
            raise AssertionError(TOO_MANY_PASSES)
        self._delay[index] = delay
        if delay:
            return
        bucket = self._bucket_of[index]
        self._ready[bucket] += 1
        if self._ready[bucket] == len(self._buckets[bucket].slots):
            self._submit(bucket)

    def _begin_pass(self) -> None:
        """At the first gradient of a step: take the pieces back from param_groups (a step
        GradScaler skipped leaves them shown) and check the ranks are those of the layout."""
        self.finish_parameter_gather()
        self._in_pass = True
        self._hide()
        if self._synchronized:
            # A new backward pass after synchronize() without step(): a new step begins.
            self._synchronized = False
            for tensor in self._pieces.values():
                tensor.grad = None
        self._check_layout()

    def _submit(self, number: int) -> None:
        """Pack the bucket's gradients into one flat tensor and reduce-scatter it."""
        bucket = self._buckets[number]
        flats = []
        for slot in bucket.slots:
            p = self._trainable[slot.index]
            grad = p.grad
            if grad is None:
                grad = p.grad = torch.zeros_like(p)
            if grad.is_sparse:
                if not self._sparse_as_dense:
                    raise HoraValueError(
                        f"sharded DistributedOptimizer: {self._parameter_names[p]!r} has a "
                        "sparse gradient, which cannot be reduce-scattered. Pass "
                        "sparse_as_dense=True, or use dense gradients (sparse=False)."
                    )
                grad = grad.to_dense()
            flats.append(grad.reshape(-1))
        flat = torch.cat(flats) if len(flats) > 1 else flats[0]
        assert self._layout is not None
        if self._layout.size == 1:
            # Nobody to share with: the "reduced" gradient is the local one (a copy, since the
            # caller may zero .grad in place before step()).
            self._pending[number] = flat.clone() if len(flats) == 1 else flat
        else:
            compressed, ctx = self._compression.compress(flat)
            prescale, postscale = 1.0, 1.0
            if self._op == ReduceOp.AVERAGE and self._predivide != 1.0:
                prescale, postscale = 1.0 / self._predivide, self._predivide
            first = self._parameter_names[self._trainable[bucket.slots[0].index]]
            handle = ops.reducescatter_async(
                compressed.contiguous(),
                name=f"{self._label}.{number}.{first}",
                op=self._op,
                process_set=self._process_set,
                prescale_factor=prescale,
                postscale_factor=postscale,
            )
            self._pending[number] = (handle, ctx)
        if self._shard_gradients:
            for slot in bucket.slots:
                self._trainable[slot.index].grad = None

    def _submit_outstanding(self) -> None:
        """Close the backward pass: reduce every bucket no hook completed (zeros for
        parameters without a gradient, as the unsharded optimizer does)."""
        if not self._in_pass:
            self._begin_pass()
        for number in range(len(self._buckets)):
            if self._pending[number] is None:
                self._submit(number)

    def _collect(self, number: int) -> torch.Tensor:
        """Wait for the bucket's reduced shard; give each piece its slice as ``.grad``."""
        pending = self._pending[number]
        if isinstance(pending, torch.Tensor):
            assert self._layout is not None
            shard = pending
        else:
            handle, ctx = pending
            try:
                output = ops.synchronize(handle)
            except (HoraInternalError, HoraValueError) as exc:
                # The engine fails a reducescatter that a joined rank does not take part in.
                if "joined" in str(exc):
                    raise HoraValueError(
                        "sharded DistributedOptimizer: hvd.join() cannot stand in for a rank "
                        "that owns a shard of the parameters (each rank must update its own "
                        "shard in every step). Give every rank the same number of steps, or "
                        f"use DistributedOptimizer without shard_optimizer_state.\n{exc}"
                    ) from exc
                raise
            shard = self._compression.decompress(output, ctx)
        assert self._layout is not None
        for piece in self._layout.pieces[number]:
            tensor = self._pieces[piece.index]
            start = piece.shard_offset
            grad = shard[start : start + piece.numel]
            tensor.grad = grad if grad.dtype == tensor.dtype else grad.to(tensor.dtype)
        self._pending[number] = None
        return shard

    def _end_pass(self) -> None:
        self._delay = [self.backward_passes_per_step] * len(self._trainable)
        self._ready = [0] * len(self._buckets)
        self._in_pass = False

    def _reset_pass(self) -> None:
        """Forget a step in progress (load_state_dict, an elastic reset)."""
        self._finish_or_drop_gather()
        self._pending = [None] * len(self._buckets)
        self._hide()
        self._synchronized = False
        self._end_pass()
        for tensor in self._pieces.values():
            tensor.grad = None

    def synchronize(self) -> None:
        """Wait for this rank's shard of the reduced gradients.

        Afterwards, and until ``step()`` (or ``zero_grad()``), ``optimizer.param_groups`` list
        this rank's pieces of the parameters, whose ``.grad`` are the reduced gradient shards,
        and a one-element sentinel whose gradient is ``inf`` on every rank when any rank's
        shard has an inf or NaN. So ``GradScaler.unscale_(optimizer)`` unscales exactly the
        shards, and every rank's scaler finds the same infs.

        Example:
            >>> scaler.scale(loss).backward()
            >>> optimizer.synchronize()
            >>> scaler.unscale_(optimizer)
            >>> optimizer.clip_grad_norm_(1.0)
            >>> scaler.step(optimizer)
            >>> scaler.update()
        """
        if self._synchronized:
            return
        self.finish_parameter_gather()
        self._submit_outstanding()
        shards = [self._collect(number) for number in range(len(self._buckets))]
        self._end_pass()
        bad = torch.zeros(1)
        for shard in shards:
            if shard.numel() and not bool(torch.isfinite(shard).all()):
                bad.fill_(1.0)
                break
        if self._layout is not None and self._layout.size > 1:
            bad = ops.synchronize(
                ops.allreduce_async(
                    bad, name=f"{self._label}.nonfinite", op=ops.Max, process_set=self._process_set
                )
            )
        self._sentinel.grad = torch.full_like(self._sentinel, math.inf if bad.item() else 0.0)
        self._synchronized = True
        self._show()

    def _show(self) -> None:
        """List the pieces (and the sentinel) in param_groups instead of the parameters."""
        if self._shown is not None:
            return
        self._shown = [group["params"] for group in self.param_groups]
        for group, pieces in zip(self.param_groups, self._piece_groups()):
            group["params"] = list(pieces)
        self.param_groups[0]["params"].append(self._sentinel)

    def _hide(self) -> None:
        """Put the parameters back into param_groups."""
        if self._shown is None:
            return
        for group, params in zip(self.param_groups, self._shown):
            group["params"] = params
        self._shown = None

    skip_synchronize = skip_synchronize

    # ------------------------------------------------------------------ step

    def step(self, closure: Any = None) -> Any:
        """Update this rank's shard of the parameters and gather every rank's.

        Under a ``GradScaler`` (which sets ``grad_scale`` and ``found_inf`` before calling it),
        the shards are unscaled here unless ``scaler.unscale_`` did it, and nothing is updated
        when any rank found an inf. ``optimizer.synchronize()`` must come first then.
        """
        if closure is not None:
            raise ValueError(NO_CLOSURE)
        # The pieces are views of the parameters: the last step's gathers go in before this
        # step updates them.
        self.finish_parameter_gather()
        timeline = current_timeline()
        started = timeline.now() if timeline is not None else 0
        found_inf = getattr(self, "found_inf", None)
        grad_scale = getattr(self, "grad_scale", None)
        scaled = hasattr(self, "found_inf")
        if scaled and not self._synchronized:
            # GradScaler removes these only after a step that returns.
            for attribute in ("found_inf", "grad_scale"):
                delattr(self, attribute)
            raise RuntimeError(AMP_NEEDS_SYNCHRONIZE)
        try:
            if self._synchronized:
                self._hide()
                skip = found_inf is not None and float(found_inf) > 0
                if not skip:
                    if grad_scale is not None:
                        self._unscale(grad_scale)
                    self._step_and_gather(collected=True)
            else:
                self._step_and_gather(collected=False)
        finally:
            self._hide()
            self._synchronized = False
            for tensor in self._pieces.values():
                tensor.grad = None
            self._sentinel.grad = None
        self.loaded_state = None
        if timeline is not None:
            timeline.complete(TRAINING_ROW, "OPTIMIZER_STEP", started, timeline.now())
            timeline.flush()
        publisher = metrics.current()
        if publisher is not None:
            publisher.optimizer_stepped()
        return None

    def _unscale(self, grad_scale: Any) -> None:
        inverse = torch.as_tensor(grad_scale).double().reciprocal().float()
        grads = [t.grad for t in self._pieces.values() if t.grad is not None]
        if grads:
            torch._foreach_mul_(grads, inverse.to(grads[0].device).item())

    def _step_and_gather(self, collected: bool) -> None:
        """Update the shards bucket by bucket as their gradients arrive (unless hooks or a
        foreign optimizer ask for one update), allgathering each as soon as it is updated and
        writing each gathered bucket into the parameters as soon as it is in."""
        assert self._layout is not None
        self._refresh_pieces()
        if not collected:
            self._submit_outstanding()
        gathers: list[tuple[int, Any]] = []
        if not collected and self._steps_in_parts():
            for number in range(len(self._buckets)):
                self._collect(number)
                self._inner_step([number])
                for piece in self._layout.pieces[number]:
                    self._pieces[piece.index].grad = None  # its reduced shard is used up
                gathers.append((number, self._gather(number)))
                if not self._overlap:  # overlapped, each bucket goes in before its forward
                    gathers = self._scatter_finished(gathers)
        else:
            if not collected:
                for number in range(len(self._buckets)):
                    self._collect(number)
            self._inner_step(None)
            gathers = [(number, self._gather(number)) for number in range(len(self._buckets))]
        if not collected:
            self._end_pass()
        self._place(gathers)

    def _place(self, gathers: list[tuple[int, Any]]) -> None:
        """Write the gathered buckets into the parameters, or, with the gather overlapped,
        keep them for the next forward pass."""
        for number, gathered in gathers:
            if self._overlap and gathered is not None:
                self._gathering[number] = gathered  # written before the next forward needs it
            else:
                self._scatter_back(number, gathered)

    def _scatter_finished(self, gathers: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        """Write the gathers that are in into the parameters (freeing their buffers); returns
        the others."""
        waiting = []
        for number, gathered in gathers:
            if gathered is None or ops.poll(gathered):
                self._scatter_back(number, gathered)
            else:
                waiting.append((number, gathered))
        return waiting

    def _steps_in_parts(self) -> bool:
        """Whether the wrapped optimizer may run once per bucket: torch.optim's own classes
        (one parameter's update is independent of the others'), without step hooks (which
        would run once per bucket)."""
        if len(self._buckets) < 2:
            return False
        wrapped = self._wrapped_class()
        if not wrapped.__module__.startswith("torch.optim."):
            return False
        return not (
            getattr(self, "_optimizer_step_pre_hooks", None)
            or getattr(self, "_optimizer_step_post_hooks", None)
            or global_step_hooks()
        )

    def _inner_step(self, buckets: list[int] | None) -> Any:
        """Run the wrapped optimizer on this rank's pieces (of ``buckets``, or all)."""
        assert self._layout is not None
        chosen = None if buckets is None else set(buckets)
        groups: list[list[torch.Tensor]] = [[] for _ in self.param_groups]
        for number, pieces in enumerate(self._layout.pieces):
            if chosen is not None and number not in chosen:
                continue
            for piece in pieces:
                groups[self._group_of[piece.index]].append(self._pieces[piece.index])
        if not any(groups):
            return None
        saved = [group["params"] for group in self.param_groups]
        # A fused wrapped optimizer reads these itself: the shards are unscaled already.
        hidden = {k: getattr(self, k) for k in ("grad_scale", "found_inf") if hasattr(self, k)}
        try:
            for k in hidden:
                setattr(self, k, None)
            for group, own in zip(self.param_groups, groups):
                group["params"] = own
            return super().step()
        finally:
            for group, params in zip(self.param_groups, saved):
                group["params"] = params
            for k, v in hidden.items():
                setattr(self, k, v)

    def _gather(self, number: int) -> Any:
        """Start allgathering the bucket's updated shard (None: nobody to gather from)."""
        assert self._layout is not None
        if self._layout.size == 1:
            return None
        pieces = self._layout.pieces[number]
        bucket = self._buckets[number]
        dtype = self._trainable[bucket.slots[0].index].dtype
        device = self._trainable[bucket.slots[0].index].device
        if pieces:
            shard = torch.cat([self._pieces[piece.index].detach() for piece in pieces])
        else:
            shard = torch.empty(0, dtype=dtype, device=device)
        first = self._parameter_names[self._trainable[bucket.slots[0].index]]
        return ops.allgather_async(
            shard, name=f"{self._label}.params.{number}.{first}", process_set=self._process_set
        )

    def _scatter_back(self, number: int, gathered: Any) -> None:
        """Copy the gathered bucket into the parameters (or, alone, the non-contiguous
        parameters' pieces back into them)."""
        bucket = self._buckets[number]
        with torch.no_grad():
            if gathered is None:
                for slot in bucket.slots:
                    p = self._trainable[slot.index]
                    if not p.is_contiguous() and slot.index in self._pieces:
                        p.copy_(self._pieces[slot.index].view_as(p))
                return
            flat = ops.synchronize(gathered)
            targets = [self._trainable[slot.index] for slot in bucket.slots]
            sources = [
                flat[slot.offset : slot.offset + slot.numel].view(p.shape)
                for slot, p in zip(bucket.slots, targets)
            ]
            torch._foreach_copy_([p.detach() for p in targets], sources)

    # ------------------------------------------------------------------ gradients

    # ------------------------------------------------------------------ overlap

    def overlap_gather_with_forward(self, model: torch.nn.Module) -> None:
        """Let ``step()`` return once the updated shards' allgathers are started, and write
        each gathered bucket into the parameters just before the first module of ``model``
        that owns one of its parameters runs forward: the next forward pass computes while
        the parameters it reaches later are still on the wire.

        Everything else that reads the parameters through the optimizer or the model waits
        for them first: ``step()``, ``synchronize()``, the next backward pass,
        the optimizer's state methods, ``model.state_dict()`` and ``model.load_state_dict()``.
        Code that reads a parameter another way between ``step()`` and the forward pass that
        uses it (a parent module using a child's weight before the child runs, an EMA of the
        weights, ``hvd.broadcast_parameters(model.named_parameters())``) calls
        :meth:`finish_parameter_gather` first.

        Args:
            model: the module whose parameters this optimizer updates (or one containing them).

        Raises:
            ValueError: ``model`` lacks some of the parameters this optimizer updates (their
                modules would run before their gathered values are in).

        Example:
            >>> optimizer = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
            ...                                      shard_optimizer_state=True)
            >>> optimizer.overlap_gather_with_forward(model)
        """
        held = set(model.parameters())
        missing = [self._parameter_names[p] for p in self._trainable if p not in held]
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
                    self._bucket_of[self._index[p]]
                    for p in module.parameters(recurse=False)
                    if p in self._index
                }
            )
            if numbers:
                hook = _gather_before_forward(reference, tuple(numbers))
                self._overlap_hooks.append(module.register_forward_pre_hook(hook))
        settle = _settle_before(reference)
        self._overlap_hooks.append(model.register_state_dict_pre_hook(settle))
        self._overlap_hooks.append(model.register_load_state_dict_pre_hook(settle))
        self._overlap = True

    def finish_parameter_gather(self, buckets: Any = None) -> None:
        """Write what the last ``step()``'s allgathers brought into the parameters now (of
        ``buckets``, or all); nothing to do without :meth:`overlap_gather_with_forward`."""
        if not self._gathering:
            return
        chosen = sorted(self._gathering) if buckets is None else buckets
        for number in chosen:
            gathered = self._gathering.pop(number, None)
            if gathered is not None:
                self._scatter_back(number, gathered)

    def _finish_or_drop_gather(self) -> None:
        """:meth:`finish_parameter_gather`, or, when the job failed meanwhile, forget the
        gathers (an elastic reset restores the parameters from a commit)."""
        try:
            self.finish_parameter_gather()
        except HoraInternalError:
            self._gathering.clear()

    # ------------------------------------------------------------------ gradients

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Not a reason to wait for the parameters: the pieces' gradients are dropped, their
        # data is left alone (the usual loop calls zero_grad() before the forward pass).
        if any(pending is not None for pending in self._pending):
            raise AssertionError(ZERO_GRAD_RACE)
        self._hide()
        self._synchronized = False
        for tensor in self._pieces.values():
            tensor.grad = None
        self._sentinel.grad = None
        super().zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes accumulate locally before a reduction."""
        if passes <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.backward_passes_per_step = passes
        self._delay = [passes] * len(self._trainable)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the reduced gradients by their norm over all shards, as
        ``torch.nn.utils.clip_grad_norm_`` clips whole gradients.

        Each rank computes the norm of its shards; one allreduce combines them (a sum of
        ``norm ** p``, or a max for the infinity norm), so every rank scales its shards by the
        same factor. Waits for the gradients first (``synchronize()``) if ``step()`` has not.
        Under a ``GradScaler``, call ``scaler.unscale_(optimizer)`` before.

        Args:
            max_norm: the largest norm the gradients may have.
            norm_type: the p of the p-norm (``float("inf")`` for the largest absolute value).
            error_if_nonfinite: raise when the norm is inf or NaN (on every rank).

        Returns:
            The norm of all gradients before clipping (the same on every rank).

        Raises:
            RuntimeError: ``error_if_nonfinite`` and the norm is not finite.

        Example:
            >>> loss.backward()
            >>> norm = optimizer.clip_grad_norm_(1.0)
            >>> optimizer.step()
        """
        self.synchronize()
        grads = [t.grad for t in self._pieces.values() if t.grad is not None]
        norm_type = float(norm_type)
        device = self._sentinel.device
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for g in grads]).to(
                device
            )
            local = torch.linalg.vector_norm(norms, norm_type)
        else:
            local = torch.zeros((), device=device)
        infinite = norm_type == math.inf
        part = local.reshape(1) if infinite else local.reshape(1) ** norm_type
        assert self._layout is not None
        if self._layout.size > 1:
            part = ops.synchronize(
                ops.allreduce_async(
                    part,
                    name=f"{self._label}.grad_norm",
                    op=ops.Max if infinite else ops.Sum,
                    process_set=self._process_set,
                )
            )
        total: torch.Tensor = part[0] if infinite else part[0] ** (1.0 / norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coefficient.to(grads[0].device).item())
        return total

    # ------------------------------------------------------------------ state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._layout is not None:
            raise HoraValueError(
                "sharded DistributedOptimizer: add_param_group() after wrapping is not "
                "supported (the shards are laid out when the optimizer is wrapped). Add every "
                "parameter group to the optimizer before wrapping it."
            )
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state, gathered from every rank, in ``torch.optim``'s format:
        it loads into this optimizer at any number of ranks, and into an unsharded one.

        A collective: call it on every rank (each gets the whole state). For a large model
        :meth:`sharded_state_dict` saves each rank's shard instead.

        Example:
            >>> state = optimizer.state_dict()  # on every rank
            >>> if hvd.rank() == 0:
            ...     torch.save(state, "optimizer.pt")
        """
        self.finish_parameter_gather()
        try:
            return zero_consolidated_state.consolidated_state_dict(self)
        except HoraInternalError as exc:
            # A rank that does not call it goes on, typically to hvd.shutdown(); the engine
            # then names only that shutdown, which says nothing of state_dict().
            raise HoraInternalError(_state_dict_advice(exc)) from exc

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shard of the state (no communication), for a checkpoint file per rank.

        It loads back into a sharded optimizer with the same ranks; files of every rank
        combine into a consolidated state with
        :func:`hora.torch.zero_state.consolidate_sharded_state_dicts`.

        Example:
            >>> torch.save(optimizer.sharded_state_dict(), f"optimizer.{hvd.rank()}.pt")
        """
        self.finish_parameter_gather()
        return zero_state.sharded_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state (from :meth:`state_dict` or any unsharded optimizer of
        the same parameters): this rank keeps its slices. Or load this rank's
        :meth:`sharded_state_dict`. Needs no other rank."""
        self._reset_pass()
        zero_state_loading.load_state_dict(self, state_dict)

    # ------------------------------------------------------------------ seams for zero_state

    @property
    def layout(self) -> Layout:
        assert self._layout is not None
        return self._layout

    @property
    def trainable(self) -> list[torch.Tensor]:
        return self._trainable

    @property
    def all_params(self) -> list[torch.Tensor]:
        return self._all_params

    @property
    def pieces(self) -> dict[int, torch.Tensor]:
        """This rank's piece tensor of each parameter it owns a part of, by trainable index."""
        return self._pieces

    @property
    def label(self) -> str:
        return self._label

    @property
    def param_lists(self) -> list[list[torch.Tensor]]:
        """The parameters of each group (even while param_groups show the pieces)."""
        if self._shown is not None:
            return self._shown
        return [group["params"] for group in self.param_groups]

    def parameter_name(self, index: int) -> str:
        """The name of trainable parameter ``index`` (as its reductions are named)."""
        return self._parameter_names[self._trainable[index]]

    def fresh_state(self) -> None:
        """Give the pieces the state the wrapped class makes in its constructor."""
        self._fresh_state()

    @property
    def process_set(self) -> ProcessSet:
        return self._process_set


def _state_dict_advice(exc: HoraInternalError) -> str:
    """What a failed :meth:`ShardedOptimizer.state_dict` says: what happened, and that every
    rank must call it."""
    said = str(exc).strip().splitlines()
    what = said[0].rstrip(".") if said else type(exc).__name__
    try:
        where = f" on rank {basics.rank()}"
    except Exception:  # the session is gone: the message names no rank
        where = ""
    return (
        f"sharded DistributedOptimizer: state_dict() did not complete{where}: {what}.\n"
        "state_dict() of a sharded optimizer is a collective: it gathers every rank's shard of "
        "the optimizer state, so every rank must call it. Call `state = optimizer.state_dict()` "
        "on every rank, then save on rank 0 alone (`if hvd.rank() == 0: torch.save(state, "
        "path)`); or save each rank's own shard with optimizer.sharded_state_dict(), which "
        "needs no other rank."
    )


def _gather_before_forward(
    optimizer: weakref.ref[ShardedOptimizer], buckets: tuple[int, ...]
) -> Any:
    """A module's forward pre-hook: write the gathered buckets of its parameters first (holds
    the optimizer weakly, as the gradient hooks do)."""

    def hook(module: torch.nn.Module, args: Any) -> None:
        owner = optimizer()
        if owner is not None and owner._gathering:
            owner.finish_parameter_gather(buckets)

    return hook


def _settle_before(optimizer: weakref.ref[ShardedOptimizer]) -> Any:
    """A model's state_dict / load_state_dict pre-hook: every gathered bucket goes in first."""

    def hook(*args: Any, **kwargs: Any) -> None:
        owner = optimizer()
        if owner is not None:
            owner.finish_parameter_gather()

    return hook


# Group keys that are not options of the update.
_NOT_OPTIONS = ("params", "param_names")

# torch.optim wraps each class's step() in a function that runs the step hooks; the wrapped
# class's step() has that wrapper already (see averaging_optimizer).
ShardedOptimizer.step.hooked = True  # type: ignore[attr-defined]


def make_sharded(
    shard_optimizer_state: bool,
    optimizer: torch.optim.Optimizer,
    named_parameters: Any,
    compression: Any,
    backward_passes_per_step: int,
    op: ReduceOp,
    gradient_predivide_factor: float,
    groups: Any,
    sparse_as_dense: bool,
    process_set: ProcessSet,
    shard_gradients: bool,
) -> torch.optim.Optimizer:
    """The sharded ``DistributedOptimizer`` (checks the arguments the factory does not).

    Raises:
        ValueError: the optimizer's update is not elementwise, ``op`` is Adasum, or
            ``shard_gradients`` comes without ``shard_optimizer_state``.
    """
    if not shard_optimizer_state:
        raise ValueError(
            "shard_gradients=True (ZeRO stage 2) needs shard_optimizer_state=True as well."
        )
    if op == ReduceOp.ADASUM:
        raise ValueError(
            "shard_optimizer_state=True does not support op=hvd.Adasum: Adasum combines whole "
            "updates of every rank, and a sharded rank computes the update of its shard only. "
            "Use op=hvd.Average or op=hvd.Sum."
        )
    check_shardable(optimizer)
    if any(p.is_sparse for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("shard_optimizer_state=True needs dense parameters.")
    cls = type(optimizer.__class__.__name__, (ShardedOptimizer, optimizer.__class__), {})
    sharded = cls(
        optimizer.param_groups,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        process_set,
        shard_gradients,
    )
    if optimizer.state:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sharded.load_state_dict(optimizer.state_dict())
    return sharded  # type: ignore[no-any-return]
