"""``hora.run``'s arguments as ``horarun``'s flags: converted, checked, and named back.

``hora.run`` takes ``horovod.run``'s arguments; each that is a flag of ``horarun``
(:data:`FLAG_OF_ARGUMENT`) becomes the value the parser would store for it, with a
``TypeError`` naming the argument when its type is wrong. :func:`launch_options` builds the job's
:class:`~hora.runner.options.LaunchOptions` from them (:func:`hora.runner.options.from_values`:
the same checks and notes as ``horarun``'s), and :func:`in_our_words` rewrites a message about
flags so that it names the arguments instead (``-np 3``: ``num_proc 3``).

This module knows the arguments and the flag table; it does not plan, start or watch a job
(:mod:`hora.runner.api` does).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora.runner import options
from hora.runner.flags import BY_DEST
from hora.runner.options import LaunchOptions, OptionError, Refused

# hora.run's arguments that are horarun flags: the flag's ``dest`` of each.
FLAG_OF_ARGUMENT: dict[str, str] = {
    "num_proc": "np",
    "min_num_proc": "min_np",
    "max_num_proc": "max_np",
    "slots": "slots",
    "reset_limit": "reset_limit",
    "cooldown_range": "blacklist_cooldown_range",
    "hosts": "hosts",
    "hostfile": "hostfile",
    "host_discovery_script": "host_discovery_script",
    "start_timeout": "start_timeout",
    "ssh_port": "ssh_port",
    "ssh_identity_file": "ssh_identity_file",
    "ssh_options": "ssh_option",
    "disable_cache": "disable_cache",
    "output_filename": "output_filename",
    "verbose": "verbose",
    "use_gloo": "gloo",
    "use_mpi": "mpi",
    "mpi_args": "mpi_args",
    "network_interfaces": "network_interface",
    "network_interface": "network_interfaces",
    "prefix_output": "disable_output_prefix",
}
_ARGUMENT_OF_FLAG = {dest: argument for argument, dest in FLAG_OF_ARGUMENT.items()}
_WHOLE = ("num_proc", "min_num_proc", "max_num_proc", "slots", "reset_limit", "ssh_port")


def launch_options(
    given: Mapping[str, Any],
    executable: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> LaunchOptions:
    """The job's options from :func:`run`'s arguments, checked as ``horarun``'s flags are.

    Args:
        given: :func:`run`'s flag arguments by name (``None``: not given).
        executable: the Python the workers run (default: this one).
        env: the job's environment: the launcher's settings (``HORA_ELASTIC_TIMEOUT``,
            ``HORA_LAUNCHER_TIMEOUT_SECONDS``, ...) are read there, as ``horarun`` reads them
            in the environment it shares with its workers (default: ours).

    Raises:
        ValueError: an argument is out of range or arguments exclude each other.
        TypeError: an argument has the wrong type.
    """
    values: dict[str, Any] = {}
    for argument, value in given.items():
        dest = FLAG_OF_ARGUMENT[argument]
        values[dest] = _flag_value(argument, value)
    if values["np"] is None and values["min_np"] is None:
        values["np"] = 1  # horovod.run's default
    python = sys.executable if executable is None else _text("executable", executable)
    command = [python, "-m", "hora.runner.task"]
    if values["mpi"]:
        command.append("--mpi")
    try:
        launch = options.from_values(values, command, env)
    except Refused as refused:
        raise Refused([f"hora.run: {in_our_words(r)}" for r in refused.reasons]) from None
    except OptionError as exc:
        raise OptionError(f"hora.run: {in_our_words(str(exc))}") from None
    if launch.mpi.enabled and launch.elastic is not None:
        raise OptionError(
            "hora.run: use_mpi cannot run an elastic job (MPI cannot add or remove processes of "
            "a running job); drop use_mpi, or min_num_proc/max_num_proc/host_discovery_script."
        )
    return launch


def in_our_words(text: str) -> str:
    """``text`` (a message about ``horarun``'s flags) with each flag named as :func:`run`'s
    argument: ``-np 3 is more than --max-np 2`` reads ``num_proc 3 is more than max_num_proc 2``.
    """
    for dest, argument in _ARGUMENT_OF_FLAG.items():
        name = "prefix_output=False" if argument == "prefix_output" else argument
        for flag in sorted(BY_DEST[dest].flags, key=len, reverse=True):
            text = re.sub(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", name, text)
    return text


def one_of(name: str, value: int | None, alias: str, alias_value: int | None) -> int | None:
    """Horovod's argument or its older name, whichever is given; both only when they agree."""
    if value is not None and alias_value is not None and value != alias_value:
        raise ValueError(
            f"hora.run: {alias}={alias_value!r} and {name}={value!r} disagree; give one of them "
            f"({alias} is the older name of {name})."
        )
    return value if value is not None else alias_value


def _flag_value(argument: str, value: Any) -> Any:
    """An argument as the parser would store its flag's value (``None``: not given).

    Raises:
        TypeError: the argument has the wrong type.
    """
    if argument == "prefix_output":
        return None if value else True
    if value is None:
        return None
    if argument in ("disable_cache", "verbose", "use_gloo", "use_mpi"):
        return True if value else None
    if argument in _WHOLE:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"hora.run: {argument} must be a whole number, got {value!r}.")
        return value
    convert = _CONVERSIONS.get(argument, _text)
    return convert(argument, value)


def _pair(argument: str, value: Any) -> list[float]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise TypeError(f"hora.run: {argument} must be (low, high) in seconds, got {value!r}.")
    return [_number(argument, v) for v in value]


def _host_list(argument: str, value: Any) -> str:
    return value if isinstance(value, str) else ",".join(_texts(argument, value))


def _mpi_arguments(argument: str, value: Any) -> str:
    return value if isinstance(value, str) else shlex.join(_texts(argument, value))


def _interface_list(argument: str, value: Any) -> list[str]:
    return _texts(argument, value.split(",") if isinstance(value, str) else value)


def _number(argument: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"hora.run: {argument} must be a number, got {value!r}.")
    return float(value)


def _text(argument: str, value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"hora.run: {argument} must be a string or a path, got {value!r}.")
    return os.fspath(value)


def _texts(argument: str, value: Any) -> list[str]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise TypeError(f"hora.run: {argument} must be a list of strings, got {value!r}.")
    items = [item.strip() for item in value if isinstance(item, str)]
    if len(items) != len(value):
        raise TypeError(f"hora.run: {argument} must be a list of strings, got {value!r}.")
    return [item for item in items if item]


# How an argument that is not a switch or a whole number becomes its flag's value (default:
# text, or a path as text).
_CONVERSIONS: dict[str, Callable[[str, Any], Any]] = {
    "start_timeout": _number,
    "cooldown_range": _pair,
    "hosts": _host_list,
    "mpi_args": _mpi_arguments,
    "network_interfaces": _interface_list,
    "ssh_options": _texts,
}


def environment_with(env: Mapping[str, str | None] | None) -> dict[str, str]:
    """This process's environment with ``env`` applied (``None`` removes a variable)."""
    base = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            base.pop(name, None)
        elif isinstance(name, str) and isinstance(value, str):
            base[name] = value
        else:
            raise TypeError(
                f"hora.run: env must map names to strings (or None), got {name!r}: {value!r}."
            )
    return base
