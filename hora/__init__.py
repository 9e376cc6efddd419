"""hora: Horovod-compatible distributed data-parallel training for PyTorch, in pure Python.

``import hora.torch as hvd`` gives Horovod's PyTorch API; ``horarun`` launches jobs;
``hora.run(func, num_proc=N)`` (Horovod's ``horovod.run``) runs a function on the workers of a
job, on this machine, on other hosts over SSH, or elastic, and returns their results.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hora.common.vocabulary.errors import HoraInternalError, HorovodInternalError

__version__ = "0.1.0"

if TYPE_CHECKING:
    from hora.runner.api import run
    from hora.runner.fork_server import ForkServer


def __getattr__(name: str) -> Any:
    # ``hora.run`` is :func:`hora.runner.api.run` (Horovod's ``horovod.run``), loaded on first
    # use: ``import hora.torch`` does not load the launcher.
    if name == "run":
        from hora.runner.api import run

        return run
    if name == "ForkServer":  # hora's own: workers of hora.run forked from one process
        from hora.runner.fork_server import ForkServer

        return ForkServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ForkServer", "HoraInternalError", "HorovodInternalError", "__version__", "run"]
