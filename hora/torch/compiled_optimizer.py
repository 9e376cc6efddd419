"""``DistributedOptimizer`` (its usual, averaging form) under ``torch.compile``.

Three ways of compiling a training loop meet the optimizer:

1. a compiled model, eager backward: the model's backward is one compiled node, after which
   autograd accumulates each gradient and runs the optimizer's gradient hooks as in eager mode;
   nothing here is needed;
2. compiled autograd (``torch._dynamo.config.compiled_autograd = True``, ``loss.backward()``
   inside a compiled function): Dynamo traces the gradient hooks into the backward graph,
   where each records one operator, ``hora::gradient_ready``. When the graph runs, the
   operator runs the eager hook if the gradient the graph computed is already the parameter's
   ``.grad`` (accumulated in place); compiled autograd usually gives the parameters their
   ``.grad`` when the graph ends, and then ``step()`` submits the gradients, all at once;
3. a compiled training step that calls ``optimizer.step()``: Dynamo traces ``step()``, which
   records ``hora::synchronize_gradients`` (when the graph runs: the eager ``synchronize()``,
   which submits what no hook submitted, waits for every reduction and writes the averaged
   gradients) before the wrapped optimizer's update. torch.optim's ``step()`` breaks the graph
   on purpose, in a block where Dynamo cannot resume, so hora's breaks it first, in a place
   where Dynamo can; an optimizer whose ``step()`` Dynamo traces whole stays in the graph.

Whatever the way, ``step()`` reduces every gradient that no hook submitted: gradients are never
left unsynchronized, even where a compiler skipped the hooks. And when a compiled function runs
the hooks eagerly (eager autograd inside it), they run with Dynamo disabled: Dynamo would
otherwise compile hora's submission once per parameter shape.

The hooks of an optimizer are kept on each parameter (``_hora_gradient_hooks``), where the
operators, which take only tensors and numbers, find them when they run.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from hora.torch.compiled_ops import AVAILABLE, ORDERED, meet_dynamo, tracing
from hora.torch.gradient_reduction import count_step, guarded_zero_grad

# Where torch.optim's Optimizer lives (its step() wrapper breaks a graph).
TORCH_OPTIMIZER = "torch/optim/optimizer.py"

# The attribute of a parameter that lists hora's gradient hooks on it (an operator names one by
# its place in the list).
HOOKS = "_hora_gradient_hooks"

# The attribute of an optimizer that keeps its gradient hook with Dynamo disabled.
UNTRACED = "_untraced_on_gradient"

SCHEMAS = {
    "gradient_ready": "(Tensor param, Tensor grad, int hook) -> ()",
    "synchronize_gradients": "(Tensor anchor, Tensor(a!)[] grads, int hook) -> ()",
}


def register_hooks(owner: Any, params: list[torch.Tensor]) -> tuple[list[Any], int]:
    """Register ``owner``'s gradient hook on each parameter; returns the hooks' handles and the
    place of the first parameter's hook in its list (how a traced ``step()`` names ``owner``)."""
    hooks = [gradient_hook(owner, p) for p in params]
    handles = [p.register_post_accumulate_grad_hook(h) for p, h in zip(params, hooks)]
    owner._step_breaks_graph = step_breaks_graph(owner._hora_class.__mro__[1])
    return handles, (hooks[0].slot if hooks else -1)  # type: ignore[attr-defined]


def step_breaks_graph(optimizer_class: type) -> bool:
    """Whether ``optimizer_class.step`` is torch.optim's, which breaks the graph on purpose
    (torch keeps an optimizer's update in a graph of its own)."""
    function = getattr(optimizer_class, "step", None)
    while function is not None:
        code = getattr(function, "__code__", None)
        if code is not None and code.co_name == "_use_grad":
            return bool(code.co_filename.replace(os.sep, "/").endswith(TORCH_OPTIMIZER))
        function = getattr(function, "__wrapped__", None)
    return False


def gradient_hook(owner: Any, p: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """The gradient hook of ``owner`` (an optimizer) on parameter ``p``: it calls
    ``owner._on_gradient(p)`` and holds ``owner`` weakly (autograd keeps hooks in C++, where
    the garbage collector cannot see a cycle from a parameter to its optimizer). Traced into a
    compiled autograd graph, it records ``hora::gradient_ready`` instead, which calls it when
    the graph runs; run as a frame of its own inside a compiled function, it is not compiled."""
    reference = weakref.ref(owner)
    hooks = p.__dict__.setdefault(HOOKS, [])
    slot = len(hooks)

    def hook(p: torch.Tensor) -> None:
        if tracing():
            meet_dynamo()
            if torch._dynamo.compiled_autograd.in_compiled_autograd_region:
                torch.ops.hora.gradient_ready(p, p.grad, slot)
                return
            # Eager autograd runs the hook inside a compiled function: nothing to compile.
            torch._dynamo.skip_frame()
        alive = reference()
        if alive is None:
            return
        if "torch._dynamo" not in sys.modules:
            alive._on_gradient(p)
            return
        # A compiled function may be running this hook eagerly (eager autograd inside it):
        # Dynamo would compile hora's submission, once per parameter shape. Keep it out.
        on_gradient = alive.__dict__.get(UNTRACED)
        if on_gradient is None:
            on_gradient = torch._dynamo.disable(alive._on_gradient)
            setattr(alive, UNTRACED, on_gradient)
        on_gradient(p)

    hook.owner = reference  # type: ignore[attr-defined]
    hook.slot = slot  # type: ignore[attr-defined]
    hooks.append(hook)
    return hook


def _hook(p: torch.Tensor, slot: int) -> Any:
    return p.__dict__[HOOKS][slot]


def _gradient_ready(param: torch.Tensor, grad: torch.Tensor, slot: int) -> None:
    """Run the eager hook, once the gradient the graph computed is the parameter's. If it is
    not (a compiler that accumulates gradients elsewhere), the hook is left out and ``step()``
    submits the gradient."""
    if param.grad is not None and param.grad.data_ptr() == grad.data_ptr():
        _hook(param, slot)(param)


def _synchronize_gradients(anchor: torch.Tensor, grads: list[torch.Tensor], slot: int) -> None:
    """Eager ``synchronize()`` for a traced ``step()``; the results are written into ``grads``
    (the gradients as the graph has them)."""
    owner = _hook(anchor, slot).owner()
    if owner is None:
        return
    params = owner._requires_update
    for p, grad in zip(params, grads):
        if p.grad is None:  # a gradient the graph made and autograd has not given the parameter
            p.grad = grad
    owner._lend_results = False
    try:
        owner.synchronize()
    finally:
        owner._lend_results = True
    owner._synchronized = False
    for p, grad in zip(params, grads):
        if p.grad is not None and p.grad.data_ptr() != grad.data_ptr():
            grad.copy_(p.grad)
    count_step()


def _nothing(*args: Any) -> None:
    return None


def define_operators() -> None:
    """Register the optimizer's operators of the ``hora`` namespace with PyTorch (at import)."""
    ready = torch.library.custom_op(
        "hora::gradient_ready",
        _gradient_ready,
        mutates_args=(),
        schema=SCHEMAS["gradient_ready"],
    )
    ready.register_fake(_nothing)
    ready.register_effect(ORDERED)
    synchronize = torch.library.custom_op(
        "hora::synchronize_gradients",
        _synchronize_gradients,
        mutates_args=("grads",),
        schema=SCHEMAS["synchronize_gradients"],
    )
    synchronize.register_fake(_nothing)


def traced_synchronize(optimizer: Any) -> None:
    """``synchronize()`` as Dynamo traces ``step()``: one operator, which runs the eager
    ``synchronize()`` when the graph runs (see ``_synchronize_gradients``)."""
    meet_dynamo()
    params = optimizer._requires_update
    if optimizer._should_synchronize and params:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        torch.ops.hora.synchronize_gradients(params[0], grads, optimizer._anchor_slot)


def zero_grad(optimizer: Any, set_to_none: bool = True) -> None:
    """``zero_grad()``; refused while reductions are in flight (Horovod's guard), which a traced
    call cannot know of: the graph's gradients are all collected by then."""
    if tracing():
        super(optimizer._hora_class, optimizer).zero_grad(set_to_none)
    else:
        guarded_zero_grad(optimizer, set_to_none)


if AVAILABLE:
    define_operators()
