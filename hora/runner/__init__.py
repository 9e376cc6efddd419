"""``horarun`` and ``hora.run``: host parsing, slot assignment, process spawning and supervision,
and the job's rendezvous store. Importing this package never imports PyTorch.

``hora.runner.run`` is ``hora.run`` (:func:`hora.runner.api.run`), where Horovod has
``horovod.runner.run``; it is loaded on first use, so that importing one module of the runner
does not load them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hora.runner.api import run


def __getattr__(name: str) -> Any:
    if name == "run":
        from hora.runner.api import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["run"]
