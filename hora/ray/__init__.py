"""hora on Ray: ``HoraTrainer`` (a Ray Train backend) and ``RayExecutor`` (``horovod.ray``'s API).

* :class:`HoraTrainer` is Ray Train's ``DataParallelTrainer`` with hora as its backend
  (:class:`HoraConfig`): ``ScalingConfig``, ``RunConfig``, ``FailureConfig``, checkpoints and
  ``ray.train.report`` work as with ``TorchTrainer``; the training function calls
  ``hvd.init()`` and uses hora's collectives.
* :class:`RayExecutor` keeps ``horovod.ray.RayExecutor``'s interface (``start``, ``run``,
  ``run_remote``, ``execute``, ``execute_single``, ``shutdown``) for code migrating from Horovod.

Install with ``pip install 'hora[ray]'``. ``import hora`` never imports Ray; this package does.
The trainer's names import ``ray.train`` on first use, so ``RayExecutor`` needs only Ray core.
See docs/ray.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

try:
    import ray  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installation
    if exc.name != "ray":
        raise  # Ray is there but does not import: its own traceback says why
    raise ModuleNotFoundError(
        "hora.ray needs Ray, which is not installed: pip install 'hora[ray]' "
        "(or pip install 'ray[train]').",
        name="ray",
    ) from None

if TYPE_CHECKING:
    from hora.ray.executor import RayExecutor, RaySettings
    from hora.ray.trainer import HoraBackend, HoraConfig, HoraTrainer

_TRAINER_NAMES = ("HoraTrainer", "HoraConfig", "HoraBackend")
_EXECUTOR_NAMES = ("RayExecutor", "RaySettings")


def __getattr__(name: str) -> Any:
    if name in _TRAINER_NAMES:
        try:
            from hora.ray import trainer
        except ImportError as exc:
            if "hora" in str(getattr(exc, "name", "") or ""):
                raise
            raise ImportError(
                f"hora.ray.{name} needs Ray Train, which cannot be imported ({exc}): "
                "pip install 'hora[ray]' (or pip install 'ray[train]')."
            ) from None
        return getattr(trainer, name)
    if name in _EXECUTOR_NAMES:
        from hora.ray import executor

        return getattr(executor, name)
    raise AttributeError(f"module 'hora.ray' has no attribute {name!r}")


__all__ = ["HoraBackend", "HoraConfig", "HoraTrainer", "RayExecutor", "RaySettings"]
