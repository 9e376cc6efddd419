"""``DistributedOptimizer``'s usual form: averages gradients across ranks while backward is still
running.

A hook on every parameter submits its gradient to the engine as soon as autograd has
accumulated it, so communication overlaps the rest of the backward pass; ``step()`` waits for
the results, writes them into ``.grad`` and runs the wrapped optimizer. The semantics (and the
error texts) are Horovod's. This module knows optimizers and parameters; the engine does the rest.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any

import torch

from hora.common import api, metrics
from hora.common.ops import engine_facts, submission
from hora.common.ops.repeated import RepeatedAllreduce
from hora.common.startup.timeline import current_timeline
from hora.common.vocabulary.timeline_writer import TRAINING_ROW
from hora.torch import compiled_optimizer, ops
from hora.torch.compiled_ops import tracing
from hora.torch.gradient_reduction import (
    HELD,
    STEP_AFTER_SYNCHRONIZE,
    TOO_MANY_PASSES,
    UNSUBMITTED,
    DistributedOptions,
    GroupMember,
    GroupResults,
    Held,
    Pending,
    Reduction,
    SparseReduction,
    count_step,
    elastic_job,
    global_step_hooks,
    parameter_names,
    set_backward_passes_per_step,
    skip_synchronize,
    split_groups,
    step_only,
)


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into a subclass of the wrapped optimizer's class (see the factory below)."""

    # The subclass the factory makes; super(_hora_class, self) is the wrapped optimizer class.
    _hora_class: type[torch.optim.Optimizer]
    # Whether a result the engine lends may become a gradient's memory (a traced step copies).
    _lend_results = True
    # Whether the wrapped optimizer's step() is torch.optim's, which breaks a compiled graph.
    _step_breaks_graph = False

    def __init__(self, params: Any, options: DistributedOptions) -> None:
        super(self._hora_class, self).__init__(params)  # type: ignore[call-arg]  # the wrapped class takes its defaults
        self._options = options
        self.backward_passes_per_step = options.backward_passes_per_step
        self._parameter_names = parameter_names(self.param_groups, options.named_parameters)
        self._delay: dict[torch.Tensor, int] = {}
        self._handles: dict[torch.Tensor, Pending] = {}
        self._hooks: list[Any] = []
        self._synchronized = False
        self._should_synchronize = True
        # First and last gradient of the current backward (timeline microseconds; 0: none yet).
        self._backward_span = (0, 0)
        self._requires_update: list[torch.Tensor] = []
        self._group_of: dict[torch.Tensor, int] = {}
        self._groups: list[list[torch.Tensor]] = []
        self._group_ready: dict[int, set[torch.Tensor]] = {}
        # Per parameter reduced on its own: its allreduce, with the request made once.
        self._reducers: dict[torch.Tensor, RepeatedAllreduce] = {}
        # In the steady state, the small gradients the engine reduces in one batch are submitted
        # together once the last of them is in (see _batches_now). Per batch: the gradients held
        # so far in this backward pass (None: not looked up yet in this pass) and how many are
        # still to come; the thread that holds them. Per schedule (the last one read): the
        # batch of each parameter that is held and how many of them each batch has.
        self._held: list[list[Held]] | None = None
        self._left: list[int] = []
        self._holder = 0
        self._batch_of: dict[torch.Tensor, int] = {}
        self._batch_sizes: list[int] = []
        self._layout_of: Any = None
        if options.process_set.included() and (api.size() > 1 or elastic_job()):
            self._register_hooks(options.groups)

    # ------------------------------------------------------------------ setup

    def _register_hooks(self, groups: Any) -> None:
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._requires_update = params
        self._delay = {p: self.backward_passes_per_step for p in params}
        self._groups = split_groups(params, groups)
        for index, members in enumerate(self._groups):
            if len(members) > 1:
                for p in members:
                    self._group_of[p] = index
        options = self._options
        for p in params:
            if p not in self._group_of:
                self._reducers[p] = RepeatedAllreduce(
                    self._parameter_names[p],
                    options.op,
                    *options.scales,
                    options.process_set,
                    lend=True,
                )
        self._hooks, self._anchor_slot = compiled_optimizer.register_hooks(self, params)

    # ------------------------------------------------------------------ gradient flow

    def _on_gradient(self, p: torch.Tensor) -> None:
        timeline = current_timeline()
        if timeline is not None:
            now = timeline.now()
            self._backward_span = (self._backward_span[0] or now, now)
        publisher = metrics.current()
        if publisher is not None:
            publisher.gradient_ready()
        # Runs for every gradient of every step, on backward's critical path: few lookups.
        handles = self._handles
        pending = handles.get(p)
        delay = self._delay[p]
        if pending is not None and pending is not UNSUBMITTED and delay <= 0:
            raise AssertionError(TOO_MANY_PASSES)
        delay -= 1
        self._delay[p] = delay
        if delay > 0:
            handles[p] = UNSUBMITTED
            return
        group = self._group_of.get(p) if self._group_of else None
        if group is None:
            held = self._held
            if held is None:
                held = self._held = self._batches_now()
            number = self._batch_of.get(p) if held else None
            if number is None:
                handles[p] = self._submit(p)
                return
            handles[p] = HELD
            # The tensor this hook saw is the one reduced later, even if the caller replaces
            # ``.grad`` (or sets it to None) meanwhile, as for a gradient submitted at once.
            held[number].append((p, p.grad))
            left = self._left
            left[number] -= 1
            if not left[number]:
                self._submit_held(held[number])
            return
        ready = self._group_ready.setdefault(group, set())
        ready.add(p)
        self._handles[p] = UNSUBMITTED
        if len(ready) == len(self._groups[group]):
            self._submit_group(group)

    def _batches_now(self) -> list[list[Held]]:
        """At a backward pass's first gradient: empty lists to hold gradients in, one per batch
        of the engine's steady-state schedule (none outside the steady state).

        Why hold them: on the CPU, the Python that submits a gradient runs between backward's
        kernels, which have evicted it from the caches, and costs several times what it costs
        run back to back (measured: about 40 against 8 microseconds a gradient, the ResNet of
        benchmarks/training.py). The engine starts a batch only once all its tensors are in,
        so submitting a batch's gradients together when the last of them arrives starts every
        batch as early as before, with less work in total. Not held: gradients of
        ``_HOLD_BELOW`` elements or more, whose copy into the batch's buffer is cheaper right
        after backward wrote them, while they are still in the caches (measured: the MLP of
        the benchmark, 6% slower with its two large gradients held), and the gradients of an
        optimizer with parameters on a GPU, where backward only queues kernels and hooks run
        on other threads and streams. Gradients of ``groups`` and of other process sets than
        the global one are never in a schedule's batches.
        """
        layout = engine_facts.batch_layout()
        if layout is None or self._options.process_set is not ops.global_process_set:
            return []
        if self._layout_of is None or self._layout_of() is not layout:
            # A new schedule (the first, or rebuilt by autotune, or after a deviation): a weak
            # reference, so that an old schedule's layout is not kept alive from here.
            self._layout_of = weakref.ref(layout)
            batch_of: dict[torch.Tensor, int] = {}
            sizes = [0] * layout.batches
            # Only where every parameter is on the CPU: autograd then runs every hook on the
            # thread that called backward() (a GPU's hooks run on a thread of their own).
            if all(p.device.type == "cpu" for p in self._reducers):
                for p, reducer in self._reducers.items():
                    number = layout.batch_of.get(reducer.name)
                    if number is not None and p.numel() < _HOLD_BELOW:
                        batch_of[p] = number
                        sizes[number] += 1
            self._batch_of, self._batch_sizes = batch_of, sizes
        if not self._batch_of:
            return []
        self._left = list(self._batch_sizes)
        self._holder = threading.get_ident()
        submission.hold(self)
        return [[] for _ in self._batch_sizes]

    def release_held(self) -> None:
        """Submit every gradient held so far in this pass: this thread is about to wait for a
        result, which might be in a batch that also needs them (another thread's wait does not
        stop this thread's backward pass from completing its batches)."""
        if threading.get_ident() == self._holder:
            self._submit_all_held()

    def _submit_all_held(self) -> None:
        """Submit what is held, batch by batch in the order the batches run."""
        for batch in self._held or ():
            self._submit_held(batch)

    def _submit_held(self, batch: list[Held]) -> None:
        handles = self._handles
        submit = self._submit
        for p, grad in batch:
            handles[p] = submit(p, grad)
        batch.clear()

    def _dense_grad(self, p: torch.Tensor, grad: torch.Tensor | None = None) -> torch.Tensor:
        """``grad`` (default ``p.grad``) made dense; where it is ``p.grad``, ``p.grad`` becomes
        the dense one too, so that the result is written into it (then made sparse again)."""
        if grad is None:
            grad = p.grad
        assert grad is not None
        if grad.is_sparse:
            dense = grad.to_dense()
            if p.grad is grad:
                p.grad = dense
            grad = dense
        return grad

    def _submit(self, p: torch.Tensor, grad: torch.Tensor | None = None) -> Pending:
        """Submit ``p``'s gradient: ``grad``, the one its hook held, or else ``p.grad``."""
        if grad is None:
            grad = p.grad
        assert grad is not None
        sparse = grad.is_sparse
        options = self._options
        if sparse and not options.sparse_as_dense:
            finish = ops.sparse_allreduce_async(
                grad, name=self._parameter_names[p], op=options.op, process_set=options.process_set
            )
            return SparseReduction(finish)
        if sparse:
            grad = self._dense_grad(p, grad)
        compressed, ctx = options.compression.compress(grad)
        return Reduction(self._reducers[p].submit(compressed), ctx, compressed, sparse)

    def _submit_group(self, group: int) -> None:
        members = self._groups[group]
        options = self._options
        compressed = []
        contexts = []
        for p in members:
            grad = self._dense_grad(p)
            tensor, ctx = options.compression.compress(grad)
            compressed.append(tensor)
            contexts.append(ctx)
        prescale, postscale = options.scales
        handle = ops.grouped_allreduce_async_(
            compressed,
            name=f"{self._parameter_names[members[0]]}.group{group}",
            op=options.op,
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=options.process_set,
        )
        for index, p in enumerate(members):
            self._handles[p] = GroupMember(handle, index, contexts[index], compressed[index])
        self._group_ready.pop(group, None)

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce and write the results into ``.grad``.

        Parameters that got no gradient this step (unused in the forward pass) are reduced as
        zeros, so every rank submits the same names.
        """
        if self._submit_outstanding():
            group_results: GroupResults = {}
            for p, pending in self._handles.items():
                self._collect(p, pending, group_results)
            self._handles.clear()
        self._synchronized = True

    def _submit_outstanding(self) -> bool:
        """Close the backward pass: submit what no hook submitted (zeros for parameters that
        got no gradient). Returns whether there are results to collect."""
        if self._held is not None:
            # A batch still held had a parameter with no gradient in this pass (it gets zeros
            # below, after the batch's others).
            self._submit_all_held()
            self._held = None
            submission.stop_holding(self)
        first, last = self._backward_span
        if first:
            timeline = current_timeline()
            if timeline is not None:
                timeline.complete(TRAINING_ROW, "BACKWARD", first, last)
            self._backward_span = (0, 0)
        if not self._options.process_set.included() or not self._requires_update:
            return False
        for p in self._requires_update:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            pending = self._handles.get(p)
            if pending is None or pending is UNSUBMITTED:
                group = self._group_of.get(p)
                if group is None:
                    self._handles[p] = self._submit(p)
                else:
                    self._group_ready.setdefault(group, set()).add(p)
        for group in list(self._group_ready):
            self._submit_group(group)
        return True

    def _collect(self, p: torch.Tensor, pending: Pending, group_results: GroupResults) -> None:
        """Wait for ``p``'s reduced gradient and write it into ``p.grad``."""
        pending.collect(self, p, group_results)
        self._delay[p] = self.backward_passes_per_step

    def _steps_in_parts(self) -> bool:
        """Whether ``step()`` may update parameters as their gradients arrive, in parts.

        Only for ``torch.optim``'s own optimizers, which update each parameter from its own
        gradient and state alone (not ``LBFGS``, whose step looks at every parameter at once),
        and only without step hooks, which would run once per part.
        """
        wrapped = self._hora_class.__bases__[0]
        if not _PER_PARAMETER_STEP or not wrapped.__module__.startswith("torch.optim."):
            return False
        if issubclass(wrapped, torch.optim.LBFGS):
            return False
        return not (
            getattr(self, "_optimizer_step_pre_hooks", None)
            or getattr(self, "_optimizer_step_post_hooks", None)
            or global_step_hooks()
        )

    def _synchronize_and_step_in_parts(self) -> Any:
        """Collect the reduced gradients in the order they were submitted; whenever the next
        one is still on the wire, update the parameters collected so far first.

        Only parts of at least ``_PART_MIN_ELEMENTS`` elements are updated early. The
        optimizer update of the first gradients then overlaps the communication of the
        last ones, which PyTorch DDP cannot do (its backward returns only once every bucket is
        reduced). Each parameter gets exactly the update of one whole step.
        """
        if not self._submit_outstanding():
            return super(self._hora_class, self).step()  # type: ignore[misc]
        group_results: GroupResults = {}
        ready: list[torch.Tensor] = []
        elements = 0
        stepped: set[torch.Tensor] = set()
        for p, pending in self._handles.items():
            if ready and elements >= _PART_MIN_ELEMENTS and not pending.finished(group_results):
                self._step_only(ready)
                stepped.update(ready)
                ready, elements = [], 0
            self._collect(p, pending, group_results)
            ready.append(p)
            elements += p.numel()
        self._handles.clear()
        if not stepped:
            return super(self._hora_class, self).step()  # type: ignore[misc]
        return self._step_only(None, skip=stepped)

    _step_only = step_only

    def _write_grad(self, p: torch.Tensor, output: torch.Tensor, reduction: Reduction) -> None:
        submitted = reduction.submitted
        result = self._options.compression.decompress(output, reduction.compression_ctx)
        grad = p.grad
        assert grad is not None
        if (
            result is output
            and output is not submitted
            and output.dtype == grad.dtype
            and output.shape == grad.shape
            and output.device == grad.device
            and engine_facts.owns_its_memory(grad)
            and self._lend_results
        ):
            # The engine lent its buffer's view instead of writing into the submitted tensor
            # (see RepeatedAllreduce): the gradient adopts that memory, as Horovod's optimizer
            # adopts its results (``set_``), instead of copying it. Not where the gradient is
            # a view of memory the caller arranged (a flat buffer of all gradients, or the
            # engine's buffer it adopted before, kept by zero_grad(set_to_none=False)): the
            # result is written into it, where such a caller looks for it.
            grad.set_(result)  # type: ignore[call-overload]  # set_(Tensor) is missing from the stubs
        elif result.data_ptr() != grad.data_ptr() or result.dtype != grad.dtype:
            grad.copy_(result)
        if reduction.was_sparse:
            p.grad = grad.to_sparse()

    skip_synchronize = skip_synchronize

    def step(self, closure: Any = None) -> Any:
        if tracing():  # torch.compile: the gradients' synchronization is one operator
            compiled_optimizer.traced_synchronize(self)
            if self._step_breaks_graph:
                # torch.optim's step() breaks the graph inside a try block, where Dynamo
                # cannot resume: break here, where it can.
                torch._dynamo.graph_break()
            return super(self._hora_class, self).step(closure)  # type: ignore[misc]
        timeline = current_timeline()
        started = timeline.now() if timeline is not None else 0
        in_parts = False
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(STEP_AFTER_SYNCHRONIZE, stacklevel=2)
            in_parts = closure is None and self._steps_in_parts()
            if not in_parts:
                self.synchronize()
        self._synchronized = False
        if in_parts:
            result = self._synchronize_and_step_in_parts()
        else:
            result = super(self._hora_class, self).step(closure)  # type: ignore[misc]
        count_step(timeline, started)
        return result

    zero_grad = compiled_optimizer.zero_grad
    set_backward_passes_per_step = set_backward_passes_per_step

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._handles.clear()
        self._held = None
        submission.stop_holding(self)
        self._group_ready.clear()
        self._synchronized = False
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        super(self._hora_class, self).load_state_dict(state_dict)  # type: ignore[misc]


# torch.optim wraps each optimizer class's step() in a function that runs the step hooks (and a
# profiler range). The wrapped optimizer's own step() has that wrapper already: marking this
# step() as wrapped keeps the hooks from running twice, once around it and once inside it. They
# run once, around the update, where the gradients are the averaged ones.
_DistributedOptimizer.step.hooked = True  # type: ignore[attr-defined]
# Gradients of this many elements or more are submitted at once, even in the steady state.
_HOLD_BELOW = 1 << 17

# DistributedOptimizer.step() updates parameters in parts as their gradients arrive (see
# _synchronize_and_step_in_parts); False always steps once, after every gradient is in.
_PER_PARAMETER_STEP = True
# The fewest parameter elements worth updating early. A smaller update is over before the
# result it would overlap lands, and its many short operations hold the GIL between them,
# delaying the engine threads that deliver that result (measured: the transformer of
# benchmarks/training.py, 28 tensors, slowed down when stepped in small parts).
_PART_MIN_ELEMENTS = 1 << 20
