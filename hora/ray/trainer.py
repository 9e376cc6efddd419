"""``HoraTrainer``: hora as a Ray Train backend, built the way Ray builds ``TorchTrainer``.

``HoraTrainer`` is a thin subclass of Ray Train's ``DataParallelTrainer`` (Train V2, Ray's default
today; Train V1 when ``RAY_TRAIN_V2_ENABLED=0``) whose backend, :class:`HoraBackend`,
gives every worker of every worker group the ``HORA_*`` variables before the training function
runs. Everything else is Ray's: ``ScalingConfig``, ``RunConfig``, ``FailureConfig``,
``CheckpointConfig``, ``ray.train.report`` and ``ray.train.get_checkpoint``, datasets, and the
restarts after a failure or a resize (see docs/ray.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.train.backend import Backend, BackendConfig

from hora.ray import _setup

logger = logging.getLogger("hora.ray")

try:
    from ray.train.v2._internal.constants import is_v2_enabled
except ImportError:  # pragma: no cover - a Ray without Train V2

    def is_v2_enabled() -> bool:
        return False


if is_v2_enabled():
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer as _DataParallelTrainer
else:  # pragma: no cover - Train V1 (RAY_TRAIN_V2_ENABLED=0), not tested here
    from ray.train.data_parallel_trainer import (  # type: ignore[assignment]
        DataParallelTrainer as _DataParallelTrainer,
    )


@dataclass
class HoraConfig(BackendConfig):
    """How hora is set up on the workers of a :class:`HoraTrainer` (a Ray Train ``BackendConfig``).

    Every field left at ``None`` keeps hora's default (or the ``HORA_*`` variable the workers
    already have). A fresh rendezvous store and job secret are made for every worker group, so a
    restarted group never sees what an earlier attempt wrote.

    Args:
        timeout_s: how long ``hvd.init()`` waits for the other workers (``HORA_START_TIMEOUT``).
        fusion_threshold: tensor fusion buffer size in bytes (``HORA_FUSION_THRESHOLD``).
        cycle_time_ms: the engine's cycle time (``HORA_CYCLE_TIME``).
        timeline_filename: write a timeline here (``HORA_TIMELINE``; rank r > 0 writes
            ``FILE.rank<r>`` on its own node).
        stall_check_time_s: warn about ranks that stall for this long
            (``HORA_STALL_CHECK_TIME_SECONDS``).
        nics: the one network interface Gloo uses between nodes (``HORA_GLOO_IFACE``); a
            one-element set is accepted for Horovod's ``nics={"eth0"}``.
        log_level: hora's log level on the workers (``HORA_LOG_LEVEL``).
        env_vars: more environment variables for every worker, set before ``hvd.init()``.
        shutdown_timeout_s: how long the backend waits for ``hvd.shutdown()`` on the workers when
            a worker group ends (a dead or stuck worker is then left to Ray, which ends it).
        init_torch_distributed: also set up ``torch.distributed``'s default process group
            through Ray's ``TorchConfig`` backend (for ``ray.train.torch.prepare_data_loader``,
            ``prepare_model`` or other code that needs it). hora itself does not need it.
        torch_backend: the ``torch.distributed`` backend when ``init_torch_distributed`` is set
            (default: ``nccl`` with GPUs, else ``gloo``).
    """

    timeout_s: float = 300.0
    fusion_threshold: int | None = None
    cycle_time_ms: float | None = None
    timeline_filename: str | None = None
    stall_check_time_s: float | None = None
    nics: Any = None
    log_level: str | None = None
    env_vars: dict[str, str] | None = None
    shutdown_timeout_s: float = 30.0
    init_torch_distributed: bool = False
    torch_backend: str | None = None

    @property
    def backend_cls(self) -> type[HoraBackend]:
        return HoraBackend

    @property
    def train_func_context(self) -> Any:
        # Ray's torch context: with GPUs, the worker's default CUDA device is its own.
        from ray.train.torch.config import TorchConfigContextManager

        return TorchConfigContextManager

    @property
    def framework(self) -> Any:
        try:
            from ray.train.v2._internal.util import TrainingFramework
        except ImportError:  # pragma: no cover - older Ray
            return None
        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        # Shown in Ray's state export and dashboard: never the values of env_vars.
        return {
            "timeout_s": self.timeout_s,
            "fusion_threshold": self.fusion_threshold,
            "cycle_time_ms": self.cycle_time_ms,
            "timeline_filename": self.timeline_filename,
            "stall_check_time_s": self.stall_check_time_s,
            "nics": None if self.nics is None else str(self.nics),
            "log_level": self.log_level,
            "env_vars": sorted(self.env_vars or {}),
            "init_torch_distributed": self.init_torch_distributed,
        }

    def options(self) -> _setup.Options:
        """The variables every worker gets besides its topology."""
        env = _setup.settings_env(
            fusion_threshold=self.fusion_threshold,
            cycle_time_ms=self.cycle_time_ms,
            timeline_filename=self.timeline_filename,
            stall_check_time_s=self.stall_check_time_s,
            nics=self.nics,
            log_level=self.log_level,
            extra=self.env_vars,
        )
        return _setup.Options(timeout_s=float(self.timeout_s), env=env)

    def _torch_config(self) -> Any:
        from ray.train.torch.config import TorchConfig

        return TorchConfig(backend=self.torch_backend, timeout_s=int(self.timeout_s))


class _TrainWorkerGroup(_setup.Group):
    """A Ray Train worker group (V1 or V2) seen through :class:`hora.ray._setup.Group`."""

    def __init__(self, worker_group: Any) -> None:
        self.worker_group = worker_group

    def __len__(self) -> int:
        return len(self.worker_group)

    def call_all(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None
    ) -> list[Any]:
        results: list[Any] = ray.get(self.worker_group.execute_async(fn, *args), timeout=timeout_s)
        return results

    def call_each(self, fn: Callable[..., Any], args_per_rank: Any) -> list[Any]:
        refs = [
            self.worker_group.execute_single_async(rank, fn, *args)
            for rank, args in enumerate(args_per_rank)
        ]
        return ray.get(refs)

    def call_one(
        self, rank: int, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None
    ) -> Any:
        return ray.get(self.worker_group.execute_single_async(rank, fn, *args), timeout=timeout_s)

    def node_keys(self) -> list[Any] | None:
        """Ray's own node ranks (V2), so ``hvd.local_rank()`` equals Ray's local rank."""
        get_workers = getattr(self.worker_group, "get_workers", None)
        if get_workers is None:
            return None
        try:
            contexts = [worker.distributed_context for worker in get_workers()]
        except Exception:  # a worker group without V2's contexts
            return None
        if any(context is None for context in contexts):
            return None
        return [context.node_rank for context in contexts]


def _hora_config(config: BackendConfig) -> HoraConfig:
    if not isinstance(config, HoraConfig):
        raise TypeError(f"HoraBackend needs a hora.ray.HoraConfig, got {type(config).__name__}.")
    return config


class HoraBackend(Backend):
    """Ray Train backend that sets hora up on each worker group (see :mod:`hora.ray._setup`).

    ``share_cuda_visible_devices`` is on, as for Ray's torch backend and Horovod's: every worker
    sees the GPUs of all the group's workers on its node, so ``torch.cuda.set_device(
    hvd.local_rank())`` picks the worker's own GPU.
    """

    share_cuda_visible_devices: bool = True

    def __init__(self) -> None:
        # Backend is a singleton per process (Ray's metaclass): one entry per live worker group.
        self._rendezvous: dict[int, _setup.Rendezvous] = {}

    def on_start(self, worker_group: Any, backend_config: BackendConfig) -> None:
        backend_config = _hora_config(backend_config)
        if backend_config.init_torch_distributed:
            torch_config = backend_config._torch_config()
            torch_config.backend_cls().on_start(worker_group, torch_config)
        group = _TrainWorkerGroup(worker_group)
        rendezvous = _setup.start(group, backend_config.options(), nodes=group.node_keys())
        self._rendezvous[id(worker_group)] = rendezvous

    def on_training_start(self, worker_group: Any, backend_config: BackendConfig) -> None:
        backend_config = _hora_config(backend_config)
        if backend_config.init_torch_distributed:
            torch_config = backend_config._torch_config()
            torch_config.backend_cls().on_training_start(worker_group, torch_config)

    def on_shutdown(self, worker_group: Any, backend_config: BackendConfig) -> None:
        backend_config = _hora_config(backend_config)
        rendezvous = self._rendezvous.pop(id(worker_group), None)
        _setup.stop(
            _TrainWorkerGroup(worker_group), rendezvous, float(backend_config.shutdown_timeout_s)
        )
        if backend_config.init_torch_distributed:
            torch_config = backend_config._torch_config()
            torch_config.backend_cls().on_shutdown(worker_group, torch_config)


class HoraTrainer(_DataParallelTrainer):
    """Data-parallel training with hora on Ray: ``TorchTrainer``'s interface, hora's collectives.

    The training function runs on every worker; it calls ``hvd.init()`` and trains the Horovod
    way (``hvd.DistributedOptimizer``, ``hvd.broadcast_parameters``, ...), and reports metrics
    and checkpoints with ``ray.train.report`` like any Ray Train function.

    Args:
        train_loop_per_worker: the training function, ``fn()`` or ``fn(config)``.
        train_loop_config: the ``config`` passed to it.
        hora_config: a :class:`HoraConfig` (defaults for every field when omitted).
        scaling_config: ``ray.train.ScalingConfig``: ``num_workers`` (an int, or
            ``(min, max)`` for Ray's elastic training), ``use_gpu``, ``resources_per_worker``...
        run_config: ``ray.train.RunConfig``: ``name``, ``storage_path``, ``failure_config``,
            ``checkpoint_config``, ``callbacks``...
        datasets: Ray Data datasets, read in the function with ``ray.train.get_dataset_shard``.
        dataset_config: ``ray.train.DataConfig``.
        **kwargs: anything else Ray's ``DataParallelTrainer`` takes (``validation_config``).

    Example:
        >>> def train(config):
        ...     import hora.torch as hvd
        ...     hvd.init()
        ...     ...
        ...     ray.train.report({"loss": loss})
        >>> result = HoraTrainer(train, scaling_config=ScalingConfig(num_workers=2)).fit()
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict[str, Any] | None = None,
        hora_config: HoraConfig | None = None,
        scaling_config: Any = None,
        run_config: Any = None,
        datasets: dict[str, Any] | None = None,
        dataset_config: Any = None,
        **kwargs: Any,
    ) -> None:
        if hora_config is not None and not isinstance(hora_config, HoraConfig):
            raise TypeError(
                f"hora_config must be a hora.ray.HoraConfig, got {type(hora_config).__name__}."
            )
        super().__init__(
            train_loop_per_worker,
            train_loop_config=train_loop_config,
            backend_config=hora_config or HoraConfig(),
            scaling_config=scaling_config,
            run_config=run_config,
            datasets=datasets,
            dataset_config=dataset_config,
            **kwargs,
        )
