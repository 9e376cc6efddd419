"""Compatibility path for scripts that import ``horovod.common.exceptions``.

hora's exception types live in :mod:`hora.common.vocabulary.errors`; this module gives them (and the
version-mismatch error Horovod's compiled extensions raise) at the path Horovod scripts import
them from. ``from hora.common.exceptions import HorovodInternalError`` gives the very class hora's
collectives raise, so ``except`` clauses written for Horovod catch hora's errors.

Example:
    >>> from hora.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
    >>> try:
    ...     hvd.allreduce(x)
    ... except HorovodInternalError:
    ...     state.restore()
"""

from __future__ import annotations

from hora.common.vocabulary.errors import (
    HoraInternalError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
)

__all__ = [
    "HoraInternalError",
    "HorovodInternalError",
    "HorovodVersionMismatchError",
    "HostsUpdatedInterrupt",
    "get_version_mismatch_message",
]


def get_version_mismatch_message(name: str, version: str, installed_version: str) -> str:
    """The text of a :class:`HorovodVersionMismatchError` for framework ``name``.

    Args:
        name: the framework (``"torch"``, ``"tensorflow"``).
        version: the version running now.
        installed_version: the version the extension was built against.

    Returns:
        The message, naming both versions and how to rebuild.
    """
    return (
        f"{name} {version} is running, but the extension was built against {name} "
        f"{installed_version}; calls into it may fail or misbehave. Rebuild it against the "
        "running version (pip install --no-cache-dir)."
    )


class HorovodVersionMismatchError(ImportError):
    """A framework's version differs from the one a compiled extension was built against.

    Horovod raises it on import when, say, PyTorch was upgraded after Horovod was built. hora is
    pure Python and builds nothing against a framework, so hora never raises it; the class is
    here so that ``except HorovodVersionMismatchError`` clauses in Horovod scripts still import.

    Args:
        name: the framework.
        version: the version running now.
        installed_version: the version the extension was built against.
    """

    def __init__(self, name: str, version: str, installed_version: str) -> None:
        super().__init__(get_version_mismatch_message(name, version, installed_version))
        self.name = name
        self.version = version
        self.installed_version = installed_version
