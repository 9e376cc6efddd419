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

This module holds the optimizer's face: which optimizers can be sharded, the class the factory
makes, and its public methods. Each does its work through one collaborator:

- :mod:`hora.torch.zero_parameters`: the parameters, their buckets and this rank's pieces;
- :mod:`hora.torch.zero_reduce_scatter`: the gradients' reduce-scatter during backward;
- :mod:`hora.torch.zero_reduced_gradients`: the reduced shards after ``synchronize()``, as
  ``GradScaler`` and clipping see them;
- :mod:`hora.torch.zero_parameter_gather`: the parameters' allgather, and its overlap with the
  forward pass;
- :mod:`hora.torch.zero_step`: the course of a step over those, and laying the shards out anew;
- :mod:`hora.torch.zero_state` and its neighbours: the state as a whole (state dicts, per-rank
  files, broadcasts, elastic snapshots).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from hora.common import api
from hora.common.ops import submission
from hora.common.process_sets import ProcessSet
from hora.common.startup.timeline import current_timeline
from hora.common.vocabulary.errors import HoraInternalError, HoraValueError
from hora.common.vocabulary.message import ReduceOp
from hora.torch import zero_consolidated_state, zero_state, zero_state_loading
from hora.torch.gradient_reduction import (
    ZERO_GRAD_RACE,
    DistributedOptions,
    count_step,
    elastic_job,
    skip_synchronize,
    weak_gradient_hook,
)
from hora.torch.zero_layout import Layout
from hora.torch.zero_parameter_gather import ParameterGather
from hora.torch.zero_parameters import ShardedParameters
from hora.torch.zero_reduce_scatter import GradientReduceScatter
from hora.torch.zero_reduced_gradients import ReducedGradients
from hora.torch.zero_step import ShardedStep

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

NO_CLOSURE = (
    "step(closure) is not supported with shard_optimizer_state=True: a closure would run "
    "backward again while the gradients of this step are being reduced. Call loss.backward() "
    "and then optimizer.step()."
)


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

    # Set once the shards are laid out (after torch.optim's constructor has added the groups).
    _sharded_params: ShardedParameters

    def __init__(self, params: Any, options: DistributedOptions) -> None:
        super().__init__(params)  # type: ignore[call-arg]  # the wrapped class takes its defaults
        # Adagrad makes full-size state in its constructor: each piece gets its own below.
        eager_state = bool(self.state)
        self.state.clear()
        self.backward_passes_per_step = options.backward_passes_per_step
        self._should_synchronize = True
        # The last consolidated state loaded, until the next step (broadcast_optimizer_state
        # sends it from the root: see zero_state.broadcast_state).
        self.loaded_state: dict[str, Any] | None = None
        name = f"zero{submission.sharded_optimizer_number()}"
        sharded = ShardedParameters(self.param_groups, options, name)
        self._requires_update = sharded.trainable  # marks a DistributedOptimizer
        self._reduce_scatter = GradientReduceScatter(sharded, options)
        self._reduced = ReducedGradients(sharded)
        self._gather = ParameterGather(sharded)
        self._sharded_step = ShardedStep(
            sharded,
            self._reduce_scatter,
            self._reduced,
            self._gather,
            self._wrapped_class(),
            eager_state,
        )
        self._sharded_step.lay_out(self)
        self._sharded_params = sharded
        self._hooks: list[Any] = []
        if options.process_set.included() and (sharded.size_now() > 1 or elastic_job()):
            hook = weak_gradient_hook(self)
            for p in sharded.trainable:
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def _wrapped_class(self) -> Any:
        mro = type(self).__mro__
        return mro[mro.index(ShardedOptimizer) + 1]

    # ------------------------------------------------------------------ gradients

    def _on_gradient(self, p: torch.Tensor) -> None:
        if not self._reduce_scatter.in_pass:
            self._sharded_step.begin_pass(self)
        self._reduce_scatter.gradient_in(p)

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
        self._sharded_step.synchronize(self)

    skip_synchronize = skip_synchronize

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Not a reason to wait for the parameters: the pieces' gradients are dropped, their
        # data is left alone (the usual loop calls zero_grad() before the forward pass).
        if self._reduce_scatter.in_flight():
            raise AssertionError(ZERO_GRAD_RACE)
        self._reduced.drop(self.param_groups, sentinel=True)
        super().zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes accumulate locally before a reduction."""
        if passes <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.backward_passes_per_step = passes
        self._reduce_scatter.set_backward_passes_per_step(passes)

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
        return self._reduced.clip_norm(max_norm, norm_type, error_if_nonfinite)

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
        self._gather.finish()
        timeline = current_timeline()
        started = timeline.now() if timeline is not None else 0
        self._sharded_step.step(self)
        self.loaded_state = None
        count_step(timeline, started)
        return None

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
        self._gather.overlap_with(model)

    def finish_parameter_gather(self, buckets: Any = None) -> None:
        """Write what the last ``step()``'s allgathers brought into the parameters now (of
        ``buckets``, or all); nothing to do without :meth:`overlap_gather_with_forward`."""
        self._gather.finish(buckets)

    # ------------------------------------------------------------------ state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # torch.optim's constructor adds the groups it is given before the shards are laid out.
        if hasattr(self, "_sharded_params"):
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
        self._sharded_step.reset(self)
        zero_state_loading.load_state_dict(self, state_dict)

    # ------------------------------------------------------------------ seams for zero_state

    @property
    def layout(self) -> Layout:
        return self._sharded_params.layout

    @property
    def trainable(self) -> list[torch.Tensor]:
        return self._sharded_params.trainable

    @property
    def all_params(self) -> list[torch.Tensor]:
        return self._sharded_params.all_params

    @property
    def pieces(self) -> dict[int, torch.Tensor]:
        """This rank's piece tensor of each parameter it owns a part of, by trainable index."""
        return self._sharded_params.pieces

    @property
    def label(self) -> str:
        return self._sharded_params.label

    @property
    def param_lists(self) -> list[list[torch.Tensor]]:
        """The parameters of each group (even while param_groups show the pieces)."""
        return self._reduced.param_lists(self.param_groups)

    def parameter_name(self, index: int) -> str:
        """The name of trainable parameter ``index`` (as its reductions are named)."""
        return self._sharded_params.name(index)

    def fresh_state(self) -> None:
        """Give the pieces the state the wrapped class makes in its constructor."""
        self._sharded_step.fresh_state(self)

    @property
    def process_set(self) -> ProcessSet:
        return self._sharded_params.process_set

    def relayout(self) -> None:
        """Lay the shards out anew if the ranks changed, dropping this rank's state (the
        caller loads a consolidated state next)."""
        self._sharded_step.relayout(self)

    def layout_size_now(self) -> int:
        """How many ranks share the optimizer now (the layout may be older)."""
        return self._sharded_params.size_now()

    def reshard(self) -> None:
        """Lay the shards out for the ranks there are now, dropping this rank's state (the
        caller loads a consolidated state next)."""
        self._sharded_step.reshard(self)


def _state_dict_advice(exc: HoraInternalError) -> str:
    """What a failed :meth:`ShardedOptimizer.state_dict` says: what happened, and that every
    rank must call it."""
    said = str(exc).strip().splitlines()
    what = said[0].rstrip(".") if said else type(exc).__name__
    try:
        where = f" on rank {api.rank()}"
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


# torch.optim wraps each class's step() in a function that runs the step hooks; the wrapped
# class's step() has that wrapper already (see averaging_optimizer).
ShardedOptimizer.step.hooked = True  # type: ignore[attr-defined]


def make_sharded(
    shard_optimizer_state: bool, optimizer: torch.optim.Optimizer, options: DistributedOptions
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
    if options.op == ReduceOp.ADASUM:
        raise ValueError(
            "shard_optimizer_state=True does not support op=hvd.Adasum: Adasum combines whole "
            "updates of every rank, and a sharded rank computes the update of its shard only. "
            "Use op=hvd.Average or op=hvd.Sum."
        )
    check_shardable(optimizer)
    if any(p.is_sparse for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("shard_optimizer_state=True needs dense parameters.")
    cls = type(optimizer.__class__.__name__, (ShardedOptimizer, optimizer.__class__), {})
    sharded = cls(optimizer.param_groups, options)
    if optimizer.state:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sharded.load_state_dict(optimizer.state_dict())
    return sharded  # type: ignore[no-any-return]
