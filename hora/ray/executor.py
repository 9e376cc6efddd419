"""``RayExecutor``: ``horovod.ray.RayExecutor``'s interface on plain Ray actors, for migrating code.

Horovod's executor starts one actor per worker in a placement group, gives each the topology
variables and the rendezvous address, and runs functions on all of them. This one does the
same with hora (see :mod:`hora.ray._setup`), so code written for ``horovod.ray`` runs after
changing its imports::

    from hora.ray import RayExecutor          # was: from horovod.ray import RayExecutor
    import hora.torch as hvd                  # was: import horovod.torch as hvd

It needs only Ray core (not ``ray[train]``). New code should prefer :class:`hora.ray.HoraTrainer`,
which adds Ray Train's checkpoints, failure handling and elastic worker counts.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import (
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hora.ray import _setup, _worker

logger = logging.getLogger("hora.ray")


@dataclass
class RaySettings:
    """What :meth:`RayExecutor.create_settings` returns (Horovod's ``MiniSettings``).

    Attributes:
        timeout_s: how long ``hvd.init()`` waits for the other workers (``HORA_START_TIMEOUT``).
        placement_group_timeout_s: how long :meth:`RayExecutor.start` waits for Ray to place the
            workers.
        nics: the one network interface Gloo uses between nodes (a name, or a one-element set).
        verbose: accepted for Horovod compatibility.
        env: more variables for every worker (``HORA_*`` settings, for instance).
        ssh_identity_file: accepted for Horovod compatibility and unused: hora needs no SSH
            inside Ray.
    """

    timeout_s: float = 30.0
    placement_group_timeout_s: float = 100.0
    nics: Any = None
    verbose: int = 1
    env: dict[str, str] = field(default_factory=dict)
    ssh_identity_file: str | None = None
    elastic: bool = False

    @property
    def start_timeout(self) -> float:
        return self.timeout_s


class HoraRayWorker:
    """The actor behind each worker (Horovod's ``BaseHorovodWorker``)."""

    executable: Any = None

    def hostname(self) -> str:
        import socket

        return socket.gethostname()

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def get_gpu_ids(self) -> list[Any]:
        return list(ray.get_gpu_ids())

    def update_env_vars(self, env_vars: dict[str, Any]) -> None:
        """Set variables in this worker process."""
        os.environ.update({str(k): str(v) for k, v in env_vars.items()})

    def env_vars(self) -> dict[str, str]:
        """This worker process's environment."""
        return dict(os.environ)

    def start_executable(
        self,
        executable_cls: type | None = None,
        executable_args: Sequence[Any] | None = None,
        executable_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Create the object that :meth:`execute` passes to its functions (``None`` without a class)."""
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or ()), **(executable_kwargs or {}))

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)``."""
        return fn(self.executable)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` (how :meth:`RayExecutor.run` and hora's set-up call in)."""
        return fn(*args, **kwargs)


class _ActorGroup(_setup.Group):
    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors

    def __len__(self) -> int:
        return len(self.actors)

    def call_all(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None
    ) -> list[Any]:
        return ray.get([actor.call.remote(fn, *args) for actor in self.actors], timeout=timeout_s)

    def call_each(
        self, fn: Callable[..., Any], args_per_rank: Sequence[tuple[Any, ...]]
    ) -> list[Any]:
        return ray.get(
            [actor.call.remote(fn, *args) for actor, args in zip(self.actors, args_per_rank)]
        )

    def call_one(
        self, rank: int, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None
    ) -> Any:
        return ray.get(self.actors[rank].call.remote(fn, *args), timeout=timeout_s)


def _run_with(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> Callable[[Any], Any]:
    def call(_executable: Any) -> Any:
        return fn(*args, **kwargs)

    return call


class RayExecutor:
    """Run hora workers as Ray actors (``horovod.ray.RayExecutor``'s interface).

    Args:
        settings: from :meth:`create_settings` (``None``: its defaults).
        num_workers: number of workers, placed with Ray's ``PACK`` strategy.
        num_hosts: instead of ``num_workers``: this many nodes (``STRICT_SPREAD``) ...
        num_workers_per_host: ... with this many workers on each.
        cpus_per_worker: CPUs Ray reserves for each worker.
        use_gpu: reserve GPUs; the workers of a node then all see the node's reserved GPUs
            (``CUDA_VISIBLE_DEVICES``), so ``torch.cuda.set_device(hvd.local_rank())`` works.
        gpus_per_worker: GPUs per worker with ``use_gpu`` (default 1).
        use_current_placement_group: run inside the caller's placement group when there is one
            (as Horovod does) instead of creating one.
        min_workers, max_workers, reset_limit, cooldown_range, elastic_timeout,
            override_discovery: Horovod's elastic mode, not provided here; use
            :class:`hora.ray.HoraTrainer` with ``ScalingConfig(num_workers=(min, max))``.

    Example:
        >>> settings = RayExecutor.create_settings(timeout_s=30)
        >>> executor = RayExecutor(settings, num_workers=2)
        >>> executor.start()
        >>> executor.run(train_fn)      # one result per worker, in rank order
        >>> executor.shutdown()
    """

    @classmethod
    def create_settings(
        cls,
        timeout_s: float = 30,
        ssh_identity_file: str | None = None,
        ssh_str: str | None = None,
        placement_group_timeout_s: float = 100,
        nics: Any = None,
    ) -> RaySettings:
        """Settings for :class:`RayExecutor` (Horovod's signature).

        Args:
            timeout_s: how long ``hvd.init()`` waits for the other workers.
            ssh_identity_file: unused (no SSH inside Ray).
            ssh_str: unused, and never written to a file (Horovod wrote the private key to
                ``ssh_identity_file``).
            placement_group_timeout_s: how long :meth:`start` waits for Ray to place the workers.
            nics: the one network interface Gloo uses between nodes.
        """
        if ssh_str:
            warnings.warn(
                "RayExecutor.create_settings(ssh_str=...) is ignored: hora needs no SSH inside "
                "Ray, and the key is not written anywhere.",
                stacklevel=2,
            )
        return RaySettings(
            timeout_s=float(timeout_s),
            placement_group_timeout_s=float(placement_group_timeout_s),
            nics=nics,
            ssh_identity_file=ssh_identity_file,
        )

    def __init__(
        self,
        settings: RaySettings | None = None,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        use_current_placement_group: bool = True,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: Any = None,
        elastic_timeout: int = 600,
        override_discovery: bool = True,
    ) -> None:
        if max_workers and (not min_workers or min_workers <= 0):
            raise ValueError(
                "`max_workers` provided without any positive `min_workers`. Elastic workloads "
                "require a positive `min_workers`."
            )
        if min_workers and num_workers:
            raise ValueError(
                "Both `min_workers` and `num_workers` provided. Only one of the above is "
                "allowed as workloads cannot be elastic and non-elastic."
            )
        if min_workers is not None:
            raise NotImplementedError(
                "hora.ray.RayExecutor has no elastic mode (min_workers/max_workers). Use "
                "hora.ray.HoraTrainer with ray.train.ScalingConfig(num_workers=(min, max)) and a "
                "FailureConfig: Ray Train restarts the workers from the latest checkpoint when "
                "workers are lost or added (docs/ray.md)."
            )
        if num_workers is not None and num_hosts is not None:
            raise ValueError("Give either num_workers or num_hosts (with num_workers_per_host).")
        if gpus_per_worker and not use_gpu:
            raise ValueError(
                "gpus_per_worker is set, but use_gpu is False. use_gpu must be True if "
                "gpus_per_worker is set."
            )
        if use_gpu and gpus_per_worker is not None and gpus_per_worker <= 0:
            raise ValueError(f"gpus_per_worker must be positive: got {gpus_per_worker}.")
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"num_workers must be positive: got {num_workers}.")
        if num_hosts is not None and (num_hosts < 1 or num_workers_per_host < 1):
            raise ValueError("num_hosts and num_workers_per_host must be positive.")
        self.settings = settings if settings is not None else self.create_settings()
        self.num_workers = num_workers
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.workers: list[Any] = []
        self._placement_group: Any = None
        self._created_placement_group = False
        self._rendezvous: _setup.Rendezvous | None = None

    # ------------------------------------------------------------------ start

    def _world_size(self, inherited: Any) -> int:
        if self.num_workers is not None:
            return int(self.num_workers)
        if self.num_hosts is not None:
            return int(self.num_hosts * self.num_workers_per_host)
        if inherited is not None:
            return len(inherited.bundle_specs)
        raise ValueError("RayExecutor needs num_workers, or num_hosts and num_workers_per_host.")

    def _place_workers(self) -> list[Any]:
        inherited = get_current_placement_group() if self.use_current_placement_group else None
        size = self._world_size(inherited)
        per_worker = {"CPU": self.cpus_per_worker}
        if self.use_gpu:
            per_worker["GPU"] = self.gpus_per_worker
        if inherited is not None:
            logger.info(
                "RayExecutor: found a placement group, starting the workers inside it. "
                "Pass use_current_placement_group=False to create a new one."
            )
            pg, bundle_of = inherited, (lambda _index: -1)
        else:
            if self.num_hosts is not None:
                bundles = [
                    {k: v * self.num_workers_per_host for k, v in per_worker.items()}
                    for _ in range(self.num_hosts)
                ]
                strategy = "STRICT_SPREAD"
                hosts = self.num_workers_per_host

                def bundle_of(index: int) -> int:
                    return index // hosts

            else:
                bundles = [dict(per_worker) for _ in range(size)]
                strategy = "PACK"

                def bundle_of(index: int) -> int:
                    return index

            pg = placement_group(bundles, strategy=strategy)
            self._placement_group, self._created_placement_group = pg, True
            ready, _ = ray.wait([pg.ready()], timeout=self.settings.placement_group_timeout_s)
            if not ready:
                raise TimeoutError(
                    f"Ray could not place {size} workers ({per_worker} each, {strategy}) within "
                    f"{self.settings.placement_group_timeout_s:g} s. Resources available now: "
                    f"{ray.available_resources()}; requested: {bundles}. Use a smaller job, "
                    "add nodes, or raise create_settings(placement_group_timeout_s=...)."
                )
        remote_cls = ray.remote(HoraRayWorker)
        workers = []
        for index in range(size):
            options: dict[str, Any] = {
                "num_cpus": self.cpus_per_worker,
                "num_gpus": self.gpus_per_worker,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=pg,
                    placement_group_bundle_index=bundle_of(index),
                    placement_group_capture_child_tasks=False,
                ),
            }
            workers.append(remote_cls.options(**options).remote())
        return workers

    def start(
        self,
        executable_cls: type | None = None,
        executable_args: Sequence[Any] | None = None,
        executable_kwargs: dict[str, Any] | None = None,
        extra_env_vars: dict[str, Any] | None = None,
    ) -> None:
        """Start the workers and set hora up on them.

        Workers are ranked node by node (in the order Ray placed them; by GPU id within a
        node), rank 0's worker hosts the job's rendezvous store, and every worker gets its
        ``HORA_*`` variables: functions run with :meth:`run` call ``hvd.init()`` themselves.

        Args:
            executable_cls: a class instantiated once in every worker; :meth:`execute` passes
                the instance to its function.
            executable_args: positional arguments for ``executable_cls``.
            executable_kwargs: keyword arguments for ``executable_cls``.
            extra_env_vars: environment variables set in every worker before anything runs.
        """
        if self.workers:
            raise RuntimeError("RayExecutor.start() was already called; call shutdown() first.")
        if not ray.is_initialized():
            ray.init()
        try:
            workers = self.workers = self._place_workers()
            infos = _ActorGroup(workers).call_all(_worker.describe)
            order = self._rank_order(infos)
            self.workers = [workers[i] for i in order]
            infos = [infos[i] for i in order]
            group = _ActorGroup(self.workers)
            if self.use_gpu:
                self._share_gpus(group, infos)
            env = _setup.settings_env(nics=self.settings.nics, extra=self.settings.env)
            env.update({str(k): str(v) for k, v in (extra_env_vars or {}).items()})
            options = _setup.Options(timeout_s=float(self.settings.timeout_s), env=env)
            self._rendezvous = _setup.start(group, options, infos=infos)
            ray.get(
                [
                    w.start_executable.remote(executable_cls, executable_args, executable_kwargs)
                    for w in self.workers
                ]
            )
        except BaseException:
            self._release(graceful=False)
            raise

    @staticmethod
    def _rank_order(infos: list[dict[str, Any]]) -> list[int]:
        """Worker indices in rank order: node by node (first placed first), by GPU id within."""
        nodes: dict[str, int] = {}
        for info in infos:
            nodes.setdefault(info["node_id"], len(nodes))

        def lowest_gpu(info: dict[str, Any]) -> Any:
            ids = info.get("gpu_ids") or []
            try:
                return (0, min(int(g) for g in ids)) if ids else (0, 0)
            except ValueError:
                return (1, min(str(g) for g in ids))

        return sorted(
            range(len(infos)), key=lambda i: (nodes[infos[i]["node_id"]], lowest_gpu(infos[i]), i)
        )

    @staticmethod
    def _share_gpus(group: _ActorGroup, infos: list[dict[str, Any]]) -> None:
        by_node: dict[str, list[str]] = {}
        for info in infos:
            by_node.setdefault(info["node_id"], []).extend(info.get("gpu_ids") or [])
        group.call_each(
            _worker.set_env,
            [({"CUDA_VISIBLE_DEVICES": ",".join(by_node[info["node_id"]])}, ()) for info in infos],
        )

    # ------------------------------------------------------------------ running

    def _check_started(self) -> None:
        if not self.workers:
            raise RuntimeError("RayExecutor.start() has not been called (or shutdown() was).")

    def execute(
        self, fn: Callable[[Any], Any], callbacks: list[Callable[..., Any]] | None = None
    ) -> list[Any]:
        """``fn(executable)`` on every worker; the results in rank order.

        ``callbacks`` is accepted for Horovod compatibility and unused (as in Horovod's
        non-elastic executor).
        """
        self._check_started()
        return ray.get([w.execute.remote(fn) for w in self.workers])

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        callbacks: list[Callable[..., Any]] | None = None,
    ) -> list[Any]:
        """``fn(*args, **kwargs)`` on every worker; the results in rank order.

        ``callbacks`` is accepted for Horovod compatibility and unused.

        Raises:
            ray.exceptions.RayTaskError: ``fn`` raised on a worker (the first failure, by rank).
            ray.exceptions.RayActorError: a worker process died.
        """
        return ray.get(self.run_remote(fn, args, kwargs))

    def run_remote(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Start ``fn(*args, **kwargs)`` on every worker; one ``ObjectRef`` per rank (``ray.get``)."""
        self._check_started()
        call = _run_with(fn, tuple(args or ()), dict(kwargs or {}))
        return [w.execute.remote(call) for w in self.workers]

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0's worker only; its result."""
        self._check_started()
        return ray.get(self.workers[0].execute.remote(fn))

    # ------------------------------------------------------------------ shutdown

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """``hvd.shutdown()`` on the workers, then end them and free their placement group.

        A worker still busy after ``timeout_s`` (running a function) is ended regardless.
        """
        self._release(graceful=True, timeout_s=timeout_s)

    def _release(self, graceful: bool, timeout_s: float = 30.0) -> None:
        workers, self.workers = self.workers, []
        rendezvous, self._rendezvous = self._rendezvous, None
        if graceful and workers:
            _setup.stop(_ActorGroup(workers), rendezvous, timeout_s)
        for worker in workers:
            try:
                ray.kill(worker)
            except Exception:  # already gone
                pass
        if self._created_placement_group and self._placement_group is not None:
            try:
                remove_placement_group(self._placement_group)
            except Exception:  # already removed
                pass
        self._placement_group, self._created_placement_group = None, False

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
