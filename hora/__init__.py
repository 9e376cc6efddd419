"""hora: Horovod-compatible distributed data-parallel training for PyTorch, in pure Python.

``import hora.torch as hvd`` gives Horovod's PyTorch API; ``horarun`` launches jobs;
``hora.run(fn, np=N)`` runs a function on N local workers and returns their results.
"""

from __future__ import annotations

from typing import Any

from hora.common.errors import HoraInternalError, HorovodInternalError

__version__ = "0.1.0"


def run(
    fn: Any,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    np: int = 1,
    **options: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``np`` worker processes and return each rank's result.

    See :func:`hora.runner.api.run` for the options.
    """
    from hora.runner.api import run as _run

    return _run(fn, args=args, kwargs=kwargs, np=np, **options)


__all__ = ["HoraInternalError", "HorovodInternalError", "__version__", "run"]
