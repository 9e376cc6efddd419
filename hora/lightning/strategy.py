"""``HoraStrategy``: data-parallel training in Lightning's ``Trainer`` with hora's collectives.

One process per device, started by ``horarun`` (or ``hora.run``, ``mpirun``, ``srun``,
torchrun); Lightning starts no process and ``torch.distributed`` is never initialised. The
strategy wraps each optimizer in :func:`hora.torch.DistributedOptimizer`, so gradients are
averaged while backward is still running, and gives Lightning hora's ``allreduce``,
``allgather``, ``broadcast_object`` and ``barrier`` for logging with ``sync_dist=True``,
checkpoint callbacks, early stopping and ``LightningModule.all_gather``.

When gradients are averaged
    The allreduces start in the backward pass of the batch that ends an accumulation window
    (``backward_passes_per_step`` is ``Trainer(accumulate_grad_batches=...)``), and the strategy
    waits for them right after that backward pass, before ``on_after_backward``. Every hook after
    it, gradient clipping and AMP's unscaling included, sees the averaged gradients, as with DDP;
    the optimizer then steps inside ``optimizer.skip_synchronize()``. In manual optimization the
    wait follows every ``manual_backward``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any

import torch
from torch import Tensor

import hora.torch as hvd
from hora.common import api
from hora.lightning._compat import (
    ClusterEnvironment,
    LightningModule,
    LightningOptimizer,
    ParallelStrategy,
    Trainer,
    TrainerFn,
    rank_zero_only,
)
from hora.lightning.environment import HoraEnvironment
from hora.lightning.layer_sync import HoraSyncBatchNorm

log = logging.getLogger(__name__)

_GROUP_UNSUPPORTED = (
    "HoraStrategy.{what} runs over the whole job; process groups are not supported. "
    "Leave `group` unset."
)


def _is_hora_optimizer(optimizer: Any) -> bool:
    # hora.torch.DistributedOptimizer builds a subclass of the wrapped optimizer's class that
    # carries these attributes (the same test DistributedOptimizer itself uses).
    return hasattr(optimizer, "_requires_update") and hasattr(optimizer, "synchronize")


def _unwrap(optimizer: Any) -> Any:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _outside_inference_mode() -> Any:
    """Lightning evaluates under ``torch.inference_mode()``, whose tensors hora's engine thread
    may not write into; collectives run with it off (their results are ordinary tensors)."""
    return torch.inference_mode(False)


def _normal(tensor: Tensor) -> Tensor:
    """``tensor``, or a copy of it that is not an inference tensor."""
    return tensor.clone() if tensor.is_inference() else tensor


def _hora_op(reduce_op: Any) -> Any:
    """Lightning's ``reduce_op`` (a string or a ``torch.distributed.ReduceOp`` member, which has
    a ``name``) as hora's op."""
    name = reduce_op if isinstance(reduce_op, str) else getattr(reduce_op, "name", None)
    if reduce_op is None:
        name = "mean"
    ops = {
        "mean": hvd.Average,
        "avg": hvd.Average,
        "average": hvd.Average,
        "sum": hvd.Sum,
        "max": hvd.Max,
        "min": hvd.Min,
        "product": hvd.Product,
        "prod": hvd.Product,
    }
    op = ops.get(str(name).lower())
    if op is None:
        raise ValueError(
            f"HoraStrategy.reduce: unsupported reduce_op {reduce_op!r}; use 'mean', 'sum', "
            "'max', 'min' or 'product'."
        )
    return op


class _AllGatherWithGrad(torch.autograd.Function):
    """Stack every rank's tensor along a new first dimension; the gradient of each rank's input
    is the sum over the ranks of the gradient of its slice (as ``torch.distributed.nn``)."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        return hvd.allgather(tensor.unsqueeze(0))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return hvd.allreduce(grad.contiguous(), op=hvd.Sum)[hvd.rank()]


def _track_step_calls(optimizer: Any) -> None:
    """Mark ``optimizer.step`` the way ``torch.optim.lr_scheduler`` does for the optimizer it was
    built with, after the scheduler has been pointed at the distributed optimizer (otherwise its
    first ``step()`` warns that ``optimizer.step()`` was overridden)."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = type(optimizer).step
    ref = weakref.ref(optimizer)

    @wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return step(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper


# The methods of hora's distributed optimizer that a LightningOptimizer must hand to it. A
# LightningOptimizer makes itself an instance of a subclass of the optimizer's class and copies
# its __dict__, so these would otherwise run on the copy: flags set on the wrong object, and
# ``super(self.__class__, self)`` in hora's methods recursing forever.
_DELEGATED = (
    "zero_grad",
    "synchronize",
    "skip_synchronize",
    "set_backward_passes_per_step",
    "load_state_dict",
    "state_dict",
)


def _delegating(cls: type) -> type:
    def make(name: str) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(self._optimizer, name)(*args, **kwargs)

        method.__name__ = method.__qualname__ = name
        return method

    namespace: dict[str, Any] = {name: make(name) for name in _DELEGATED}
    namespace["_hora_delegating"] = True
    return type(cls.__name__, (cls,), namespace)


class HoraStrategy(ParallelStrategy):
    """Data-parallel training with hora: one process per device, started by a launcher.

    Select it with ``Trainer(strategy="hora")`` after ``import hora.lightning``, or pass an
    instance to set the options below. Start the script with ``horarun -np N python train.py``
    (or ``hora.run``, ``mpirun``, ``srun``, torchrun): each process trains on its
    ``1/N`` share of every epoch (Lightning adds a ``DistributedSampler``), and the gradients are
    averaged across the processes, so one step with a batch of ``B`` per process equals one
    step of single-process training with a batch of ``N * B``.

    Args:
        accelerator: as for every Lightning strategy (usually left to the ``Trainer``).
        parallel_devices: the devices, indexed by local rank; by default each process uses the
            CPU, or GPU ``local_rank`` with ``accelerator="gpu"``.
        cluster_environment: default :class:`~hora.lightning.HoraEnvironment`. Another
            environment must report the same ranks as hora; ``setup`` checks it.
        checkpoint_io: as for every Lightning strategy.
        precision_plugin: as for every Lightning strategy.
        compression: ``hvd.Compression.none`` (default), ``.fp16`` or ``.bf16``: how gradients
            travel.
        op: ``hvd.Average`` (default) or ``hvd.Sum``: how gradients are combined.
        gradient_predivide_factor: divide gradients by this before summing and multiply after
            (with ``op=hvd.Average``).
        groups: an int (split the parameters into that many groups) or a list of parameter lists;
            each group is reduced as one grouped allreduce.
        sparse_as_dense: reduce sparse gradients as dense tensors.
        scale_lr: multiply each optimizer's learning rates (and the schedulers' ``base_lrs``) by
            the number of processes at the start of ``fit``, as Horovod's Lightning strategy did.
            Off by default: like DDP, hora leaves the learning rate to you.

    Example:
        >>> import hora.lightning
        >>> trainer = Trainer(strategy="hora", max_epochs=10)
        >>> trainer = Trainer(strategy=hora.lightning.HoraStrategy(compression=hvd.Compression.fp16))
    """

    strategy_name = "hora"

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        *,
        compression: Any = hvd.Compression.none,
        op: Any = hvd.Average,
        gradient_predivide_factor: float = 1.0,
        groups: Any = None,
        sparse_as_dense: bool = False,
        scale_lr: bool = False,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment or HoraEnvironment(),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._explicit_devices = parallel_devices is not None
        self._optimizer_options: dict[str, Any] = {
            "compression": compression,
            "op": op,
            "gradient_predivide_factor": gradient_predivide_factor,
            "groups": groups,
            "sparse_as_dense": sparse_as_dense,
        }
        self.scale_lr = scale_lr
        self._hora_optimizers: list[Any] = []
        self._stepping = False
        self._interrupted = False
        self._synced_layers: HoraSyncBatchNorm | None = None

    # ------------------------------------------------------------------ topology

    @property
    def root_device(self) -> torch.device:
        """This process's device: the CPU, or GPU ``local_rank`` (``cuda:0`` when each process
        sees one GPU)."""
        devices = self.parallel_devices or [torch.device("cpu")]
        if self._explicit_devices:
            if self.local_rank >= len(devices):
                raise ValueError(
                    f"HoraStrategy(parallel_devices={devices}) has no device for local rank "
                    f"{self.local_rank}; give one device per process on the host."
                )
            return devices[self.local_rank]
        if devices[0].type != "cuda":
            return devices[0]
        local_size = self._local_size()
        if local_size == 1:
            return devices[0]
        count = torch.cuda.device_count()
        if count >= local_size:
            return torch.device("cuda", self.local_rank)
        if count == 1:
            return torch.device("cuda", 0)
        raise ValueError(
            f"{local_size} processes run on this host but {count} GPUs are visible: give each "
            "process its own GPU (one process per GPU), or exactly one visible GPU per process "
            "with CUDA_VISIBLE_DEVICES."
        )

    def _local_size(self) -> int:
        if hvd.is_initialized():
            return hvd.local_size()
        env = self.cluster_environment
        if isinstance(env, HoraEnvironment):
            return env._topology().local_size
        return max(len(self.parallel_devices or ()), 1)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning: add a ``DistributedSampler``, honour ``self.log(sync_dist=True)``."""
        return True

    def set_world_ranks(self) -> None:
        """Called by the ``Trainer`` when it is built: only rank 0 prints Lightning's messages."""
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def setup_environment(self) -> None:
        """Start hora (``hvd.init()``; nothing happens if it is running) and pick the device."""
        hvd.init()
        self._check_environment()
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        super().setup_environment()

    def _check_environment(self) -> None:
        env = self.cluster_environment
        if env is None or isinstance(env, HoraEnvironment):
            return
        theirs = (env.world_size(), env.global_rank())
        ours = (hvd.size(), hvd.rank())
        if theirs != ours:
            raise RuntimeError(
                f"{type(env).__name__} says this process is rank {theirs[1]} of {theirs[0]}, "
                f"but hora (launcher: {api.topology().source}) says rank {ours[1]} of "
                f"{ours[0]}. "
                "Use HoraStrategy's default HoraEnvironment, which reads hora's topology."
            )

    # ------------------------------------------------------------------ model and optimizers

    def model_to_device(self) -> None:
        device = self.root_device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        assert self.model is not None
        self.model.to(device)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        trainer = self._trainer()
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            self._synced_layers = HoraSyncBatchNorm()
            model = self._synced_layers.apply(model)
        return model

    def _trainer(self) -> Trainer | None:
        module = self.lightning_module
        return getattr(module, "_trainer", None) if module is not None else None

    def setup(self, trainer: Trainer) -> None:
        """Move the model, create the optimizers, make every rank start from rank 0's weights
        and optimizer state, and wrap each optimizer in ``hvd.DistributedOptimizer``."""
        super().setup(trainer)
        module = self.lightning_module
        assert module is not None
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self._wrap_optimizers(trainer, module)
        for optimizer in self._hora_optimizers:
            if isinstance(optimizer, torch.optim.LBFGS):
                continue  # hvd.broadcast_optimizer_state cannot; a fresh LBFGS has no state
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        if self.scale_lr:
            self._scale_learning_rates()

    def _wrap_optimizers(self, trainer: Trainer, module: LightningModule) -> None:
        originals = [_unwrap(opt) for opt in self.optimizers]
        owner: dict[Tensor, int] = {}
        for index, optimizer in enumerate(originals):
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if owner.setdefault(p, index) != index:
                        raise ValueError(
                            f"A parameter is optimized by optimizers {owner[p]} and {index}: with "
                            "HoraStrategy each parameter must belong to one optimizer."
                        )
        names = {p: name for name, p in module.named_parameters()}
        passes = trainer.accumulate_grad_batches if module.automatic_optimization else 1
        wrapped = []
        for index, optimizer in enumerate(originals):
            if _is_hora_optimizer(optimizer):
                wrapped.append(optimizer)
                continue
            prefix = f"opt{index}." if len(originals) > 1 else ""
            named = [
                (prefix + names.get(p, f"unnamed{i}"), p)
                for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
            ]
            distributed = hvd.DistributedOptimizer(
                optimizer,
                named_parameters=named,
                backward_passes_per_step=passes,
                **self._optimizer_options,
            )
            if optimizer.state:
                distributed.load_state_dict(optimizer.state_dict())
            for config in self.lr_scheduler_configs:
                if getattr(config.scheduler, "optimizer", None) is optimizer:
                    config.scheduler.optimizer = distributed
                    _track_step_calls(distributed)
            wrapped.append(distributed)
        self.optimizers = wrapped
        self._hora_optimizers = [opt for opt in wrapped if _is_hora_optimizer(opt)]

    def _scale_learning_rates(self) -> None:
        size = self.world_size
        for optimizer in self._hora_optimizers:
            for group in optimizer.param_groups:
                group["lr"] *= size
                if "initial_lr" in group:
                    group["initial_lr"] *= size
        for config in self.lr_scheduler_configs:
            scheduler: Any = config.scheduler
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr * size for lr in scheduler.base_lrs]
        if self.is_global_zero:
            log.info("HoraStrategy(scale_lr=True): learning rates multiplied by %d", size)

    @property
    def optimizers(self) -> list[Any]:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[Any]) -> None:
        ParallelStrategy.optimizers.fset(self, optimizers)  # type: ignore[attr-defined]
        for lightning_optimizer in self._lightning_optimizers:
            cls = type(lightning_optimizer)
            if _is_hora_optimizer(lightning_optimizer._optimizer) and not getattr(
                cls, "_hora_delegating", False
            ):
                lightning_optimizer.__class__ = _delegating(cls)

    # ------------------------------------------------------------------ the training step

    @property
    def handles_gradient_accumulation(self) -> bool:
        # Lightning's loop decides when to step; the optimizers' backward_passes_per_step keeps
        # the allreduces for the last backward pass of each accumulation window.
        return False

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # GradientAccumulationScheduler may change accumulate_grad_batches between epochs.
        module = self.lightning_module
        trainer = self._trainer()
        if module is None or trainer is None or not module.automatic_optimization:
            return
        passes = trainer.accumulate_grad_batches
        for optimizer in self._hora_optimizers:
            if optimizer.backward_passes_per_step != passes and not optimizer._handles:
                optimizer.set_backward_passes_per_step(passes)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward, with the gradients averaged before ``on_after_backward``."""
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        self._average_gradients(module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _average_gradients(self, module: LightningModule) -> None:
        if module.automatic_optimization:
            # Only the backward pass that ends an accumulation window runs inside
            # optimizer_step (the loop calls the closure directly for the others).
            if self._stepping:
                for optimizer in self._hora_optimizers:
                    optimizer.synchronize()
            return
        for optimizer in self._hora_optimizers:
            if optimizer._handles:  # this backward pass produced gradients for it
                optimizer.synchronize()

    def optimizer_step(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        optimizer = _unwrap(optimizer)
        if not _is_hora_optimizer(optimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_and_average() -> Any:
            result = closure()
            if not optimizer._synchronized:  # e.g. no backward went through the strategy
                optimizer.synchronize()
            return result

        self._stepping = True
        try:
            with optimizer.skip_synchronize():
                return super().optimizer_step(optimizer, closure_and_average, model, **kwargs)
        finally:
            self._stepping = False

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Nothing to block: gradients of accumulation passes are not sent until the last one."""
        yield None

    # ------------------------------------------------------------------ collectives

    def reduce(
        self,
        tensor: Any,
        group: Any | None = None,
        reduce_op: Any = "mean",
    ) -> Any:
        """Reduce ``tensor`` over every process (``'mean'``, ``'sum'``, ``'max'``, ``'min'``,
        ``'product'``); anything but a tensor is returned unchanged."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is not None:
            raise ValueError(_GROUP_UNSUPPORTED.format(what="reduce"))
        op = _hora_op(reduce_op)
        if op == hvd.Average and not (tensor.is_floating_point() or tensor.is_complex()):
            tensor = tensor.float()
        with _outside_inference_mode():
            return hvd.allreduce(_normal(tensor), op=op)

    def all_gather(
        self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> Tensor:
        """Every process's ``tensor`` (same shape everywhere), stacked along a new first
        dimension of size ``world_size``."""
        if group is not None:
            raise ValueError(_GROUP_UNSUPPORTED.format(what="all_gather"))
        with _outside_inference_mode():
            if sync_grads:
                return _AllGatherWithGrad.apply(_normal(tensor))  # type: ignore[no-any-return]
            with torch.no_grad():
                return hvd.allgather(_normal(tensor.detach()).unsqueeze(0))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (any picklable object) on every process."""
        if not hvd.is_initialized():
            return obj
        with _outside_inference_mode():
            return hvd.broadcast_object(obj, root_rank=src)

    def barrier(self, name: str | None = None) -> None:
        if hvd.is_initialized() and hvd.size() > 1:
            hvd.barrier()

    # ------------------------------------------------------------------ the end of a stage

    def on_exception(self, exception: BaseException) -> None:
        # Another rank may be waiting in a collective: no barrier at teardown.
        self._interrupted = True

    def teardown(self) -> None:
        """Detach the gradient hooks, wait for every process to finish the stage, and leave hora
        running: ``fit``, ``validate`` and ``test`` may follow each other, and your own ``hvd``
        calls keep working. hora stops at process exit (or call ``hvd.shutdown()``)."""
        for optimizer in self._hora_optimizers:
            for hook in optimizer._hooks:
                hook.remove()
            optimizer._hooks.clear()
        self._hora_optimizers = []
        module = self.lightning_module
        if self._synced_layers is not None and module is not None:
            self._synced_layers.revert(module)
        self._synced_layers = None
        if not self._interrupted and hvd.is_initialized() and hvd.size() > 1:
            hvd.barrier()
        self._interrupted = False
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name,
                cls,
                description="Data-parallel training with hora (Horovod's API, pure Python)",
            )
