"""``horarun``'s command line and config file: horovodrun's flags, read into one namespace.

The flags themselves are declared in :mod:`hora.runner.flags`, one :class:`~hora.runner.flags.Option`
each; this module turns that table into the parser (:func:`build_parser`), the config-file reader
(:func:`read_config_file`), the range checks, the ``HORA_*`` variables the honoured flags set for
workers (:func:`engine_env`), the notes on flags that have no effect in hora (:func:`notes`, one
line each, for ``--verbose``) and the refusals of flags asking for what hora cannot do
(:func:`refusals`). ``--min-np``, ``--max-np`` or ``--host-discovery-script`` make the job
elastic (:func:`is_elastic`; the driver is :mod:`hora.runner.elastic`). It does not start
anything.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hora.common import config, safe_files
from hora.common.settings_table import (
    HOST_DISCOVERY_TIMEOUT,
    LAUNCHER_TIMEOUT_SECONDS,
    LOG_LEVELS,
    Variable,
)
from hora.runner.flags import BY_DEST, GROUPS, OPTIONS, Option

__all__ = [
    "CONFIG_KEYS",
    "LOG_LEVELS",
    "OptionError",
    "build_parser",
    "engine_env",
    "env_seconds",
    "is_elastic",
    "notes",
    "parse",
    "read_config_file",
    "refusals",
    "worker_env",
]


class OptionError(ValueError):
    """A flag or config-file value that horarun cannot use."""


_TYPES: dict[str, Any] = {"int": int, "float": float, "text": None, "append": None, "pair": float}


def _add(container: Any, option: Option) -> None:
    """Add ``option`` (and its hidden opposites) to a parser group."""
    facts: dict[str, Any] = {"dest": option.dest, "default": None, "help": option.help_text()}
    if option.shape == "switch":
        container.add_argument(
            *option.flags, action="store_true" if option.stores else "store_false", **facts
        )
        opposite = "store_false" if option.stores else "store_true"
        for flag in option.opposite:
            container.add_argument(
                flag, dest=option.dest, action=opposite, default=None, help=argparse.SUPPRESS
            )
        return
    if option.metavar is not None:
        facts["metavar"] = option.metavar
    if option.shape == "level":
        facts.update(type=str.upper, choices=LOG_LEVELS)
        facts.pop("metavar", None)  # argparse lists the choices
    elif _TYPES[option.shape] is not None:
        facts["type"] = _TYPES[option.shape]
    if option.shape == "append":
        facts["action"] = "append"
    if option.shape == "pair":
        facts["nargs"] = 2
    container.add_argument(*option.flags, **facts)


def build_parser() -> argparse.ArgumentParser:
    """horovodrun's flags under their own names (``-np``, ``-H``, ``--fusion-threshold-mb``, ...),
    built from :data:`hora.runner.flags.OPTIONS`.

    Every value defaults to ``None`` so that a config file can fill what the command line left
    out; :func:`parse` applies the defaults after that.
    """
    parser = argparse.ArgumentParser(
        prog="horarun",
        description="Launch a hora (Horovod-compatible) training job. Flags follow horovodrun.",
        epilog="Example: horarun -np 4 -H node1:2,node2:2 python train.py",
        allow_abbrev=False,
    )
    for group in GROUPS:
        container: Any = parser.add_argument_group(group.title)
        if group.exclusive:
            container = container.add_mutually_exclusive_group()
        for option in OPTIONS:
            if option.group == group.name:
                _add(container, option)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    return parser


def _config_sections(separator: str) -> dict[str, dict[str, str]]:
    """``{section: {key: dest}}`` for the config keys written ``section<separator>key``."""
    sections: dict[str, dict[str, str]] = {}
    for option in OPTIONS:
        if option.config_key is not None and separator in option.config_key:
            section, key = option.config_key.split(separator)
            sections.setdefault(section, {})[key] = option.dest
    return sections


# Config-file sections of keys (horovodrun's) and the flag (``dest``) each key stands for.
CONFIG_KEYS: dict[str, dict[str, str]] = _config_sections(".")
# Config-file sections holding one value (``controller: gloo``): value -> the switch it sets.
_CONFIG_CHOICES: dict[str, dict[str, str]] = _config_sections(": ")


def _config_text(where: str, option: Option, value: Any) -> str:
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise OptionError(f"{where} must be a string.")
    text = str(value)
    if option.shape == "level":
        text = text.upper()
        if text not in LOG_LEVELS:
            raise OptionError(f"{where} must be one of {', '.join(LOG_LEVELS)}.")
    return text


def _config_value(where: str, option: Option, value: Any) -> Any:
    """``value`` of a config key, checked against the shape of the flag it stands for."""
    if option.shape == "switch":
        if not isinstance(value, bool):
            raise OptionError(f"{where} must be true or false.")
        return value
    if option.shape in ("text", "level"):
        return _config_text(where, option, value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptionError(f"{where} must be a number.")
    if option.shape == "int" and not float(value).is_integer():
        raise OptionError(f"{where} must be a whole number.")
    return int(value) if option.shape == "int" else float(value)


def _load_yaml(path: str) -> Any:
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise OptionError(f"cannot read config file {path!r}: {exc.strerror}.") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise OptionError(f"config file {path!r} is not valid YAML: {exc}") from None


def _read_section(path: str, section: str, body: Any) -> dict[str, Any]:
    """The flag values one section of a config file sets, by ``dest``."""
    if section in _CONFIG_CHOICES:
        choices = _CONFIG_CHOICES[section]
        if body not in choices:
            allowed = " or ".join(choices)
            raise OptionError(f"{path}: {section}={body!r} must be {allowed}.")
        return {choices[body]: True}
    if section not in CONFIG_KEYS:
        known = ", ".join([*_CONFIG_CHOICES, *CONFIG_KEYS])
        raise OptionError(f"{path}: unknown section {section!r}; the sections are {known}.")
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise OptionError(f"{path}: section {section!r} must be a mapping of keys to values.")
    values: dict[str, Any] = {}
    for key, value in body.items():
        dest = CONFIG_KEYS[section].get(str(key))
        if dest is None:
            known = ", ".join(CONFIG_KEYS[section])
            raise OptionError(
                f"{path}: unknown key {section}.{key}; the keys of {section!r} are {known}."
            )
        values[dest] = _config_value(f"{path}: {section}.{key}={value!r}", BY_DEST[dest], value)
    return values


def read_config_file(path: str) -> dict[str, Any]:
    """The flag values a horovodrun YAML config file sets, by flag (``dest``) name.

    Raises:
        OptionError: the file cannot be read, is not YAML, or holds an unknown key or a value of
            the wrong type.
    """
    data = _load_yaml(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise OptionError(f"config file {path!r} must hold a mapping of sections.")
    values: dict[str, Any] = {}
    for section, body in data.items():
        values.update(_read_section(path, str(section), body))
    return values


def _check_bounds(args: argparse.Namespace) -> None:
    """Every number within its declared range (a pair is checked by :func:`_validate_elastic`)."""
    for option in OPTIONS:
        value = getattr(args, option.dest)
        limits = option.limits
        if value is None or limits is None or option.shape == "pair":
            continue
        if not limits.allows(value):
            raise OptionError(option.bounds_error(value))


def _validate(args: argparse.Namespace) -> None:
    _check_bounds(args)
    if args.output_filename:
        _check_output_directory(args.output_filename)
    for option in args.ssh_option or []:
        if "=" not in option or option.startswith("-"):
            raise OptionError(f"--ssh-option {option!r} must look like Key=Value.")
    if is_elastic(args):
        _validate_elastic(args)


_ELASTIC_TRIGGERS = tuple(option for option in OPTIONS if option.makes_elastic)
_TRIGGER_FLAGS = ", ".join(option.flag for option in _ELASTIC_TRIGGERS[:-1])
_TRIGGER_TEXT = f"{_TRIGGER_FLAGS} or {_ELASTIC_TRIGGERS[-1].flag}"


def is_elastic(args: argparse.Namespace) -> bool:
    """Whether the flags ask for an elastic job (``--min-np``, ``--max-np`` or
    ``--host-discovery-script``)."""
    return any(getattr(args, option.dest) is not None for option in _ELASTIC_TRIGGERS)


def _validate_elastic(args: argparse.Namespace) -> None:
    """Check the elastic flags together and fill the defaults: ``-np`` from ``--min-np`` and the
    reverse."""
    if args.np is None:
        args.np = args.min_np
    if args.min_np is None:
        args.min_np = args.np
    if args.np is not None:
        if args.np < args.min_np:
            raise OptionError(
                f"-np {args.np} is less than --min-np {args.min_np}: the job starts with -np "
                "workers, at least --min-np."
            )
        if args.max_np is not None and args.np > args.max_np:
            raise OptionError(f"-np {args.np} is more than --max-np {args.max_np}.")
    if args.min_np is not None and args.max_np is not None and args.min_np > args.max_np:
        raise OptionError(f"--min-np {args.min_np} is more than --max-np {args.max_np}.")
    if args.blacklist_cooldown_range is not None:
        _check_cooldown(*args.blacklist_cooldown_range)
    if args.host_discovery_script is not None:
        _check_script(args.host_discovery_script)


def _check_output_directory(directory: str) -> None:
    """Create ``--output-filename``'s directory now, so that a problem stops the job before any
    worker starts (files in it are created by :mod:`hora.common.safe_files`)."""
    try:
        safe_files.make_directories(directory)
    except OSError as exc:
        raise OptionError(f"--output-filename {directory}: {exc}") from None


def _check_script(script: str) -> None:
    path = Path(script)
    if not path.is_file():
        raise OptionError(f"--host-discovery-script {script!r}: no such file.")
    if not os.access(path, os.X_OK):
        raise OptionError(
            f"--host-discovery-script {script!r} is not executable; run `chmod +x {script}`."
        )


def _check_cooldown(low: float, high: float) -> None:
    option = BY_DEST["blacklist_cooldown_range"]
    limits = option.limits
    assert limits is not None and limits.low is not None and limits.high is not None
    if not limits.low <= low <= high <= limits.high:
        raise OptionError(
            f"{option.flag} {low:g} {high:g}: need {limits.low:g} <= MIN <= MAX <= "
            f"{limits.high:g} (seconds)."
        )


def _given_on_command_line(args: argparse.Namespace) -> set[str]:
    """The exclusive groups (by name) of which the command line gave a flag."""
    exclusive = {group.name for group in GROUPS if group.exclusive}
    return {
        option.group
        for option in OPTIONS
        if option.group in exclusive and getattr(args, option.dest) is not None
    }


def _apply_config_file(args: argparse.Namespace) -> None:
    """Fill what the command line left unset from ``--config-file``. A flag of an exclusive group
    (``--gloo``) given on the command line also keeps the file from setting its rivals."""
    taken = _given_on_command_line(args)
    for dest, value in read_config_file(args.config_file).items():
        if BY_DEST[dest].group in taken:
            continue
        if getattr(args, dest) is None:
            setattr(args, dest, value)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Read the command line, then the config file for what it left unset.

    Raises:
        SystemExit: argparse's usage error (status 2).
        OptionError: a value is out of range or the config file is unusable.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config_file:
        _apply_config_file(args)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    args.command = command
    interfaces = list(args.network_interface or [])
    if args.network_interfaces:
        interfaces += [i.strip() for i in args.network_interfaces.split(",") if i.strip()]
    args.interfaces = list(dict.fromkeys(interfaces))
    _validate(args)
    args.launcher_timeout_s = env_seconds(LAUNCHER_TIMEOUT_SECONDS)
    args.host_discovery_timeout_s = env_seconds(HOST_DISCOVERY_TIMEOUT)
    return args


def env_seconds(variable: Variable[float], env: Mapping[str, str] | None = None) -> float:
    """A launcher setting in seconds, from its ``HORA_*`` variable (``env``: default ours).

    Raises:
        OptionError: the value is not a number or out of range; the message names the variable.
    """
    try:
        value = config.read(variable, env)
    except config.SettingError as exc:
        raise OptionError(str(exc)) from None
    problem = variable.problem(value)
    if problem is not None:
        raise OptionError(problem)
    return float(value)


def notes(args: argparse.Namespace) -> list[str]:
    """One line per accepted flag that has no effect in hora (printed under ``--verbose``)."""
    found = []
    for option in OPTIONS:
        value = getattr(args, option.dest)
        if option.inert and value is not None and value is not False:
            found.append(f"{option.flag} has no effect: {option.inert}")
    if not is_elastic(args):
        for option in OPTIONS:
            if option.elastic_only and getattr(args, option.dest) is not None:
                found.append(
                    f"{option.flag} has no effect: the job is not elastic (give {_TRIGGER_TEXT})."
                )
    elif args.slots is not None and args.host_discovery_script is None:
        found.append(
            "--slots-per-host has no effect: it applies to hosts a --host-discovery-script names."
        )
    return found


def refusals(args: argparse.Namespace) -> list[str]:
    """Why the flags asking for what hora cannot do are refused (empty when none are given)."""
    return [option.refused for option in OPTIONS if option.refused and getattr(args, option.dest)]


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    """The ``HORA_*`` variables set by the flags hora honours (and ``NCCL_IB_DISABLE``)."""
    env: dict[str, str] = {}
    for option in OPTIONS:
        value = getattr(args, option.dest)
        if value is None:
            continue
        if option.variable is not None:
            env[option.variable.env] = option.encode(value)
        if option.sets and value:
            env.update(option.sets)
    return env


# Variables not passed to workers (as horovodrun).
_DROPPED_ENV = ("OLDPWD",)


def worker_env(base: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    """A worker's environment: ``base`` less what must not be passed on, plus ``extra``."""
    env = {
        k: v for k, v in base.items() if k not in _DROPPED_ENV and not k.startswith("BASH_FUNC_")
    }
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env
