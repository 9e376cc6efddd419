"""``horarun``'s command line and config file, read once into a typed :class:`LaunchOptions`.

The flags themselves are declared in :mod:`hora.runner.flags`, one :class:`~hora.runner.flags.Option`
each; this module turns that table into the parser (:func:`build_parser`), the config-file reader
(:func:`read_config_file`), the range checks, the ``HORA_*`` variables the honoured flags set for
workers (:func:`engine_env`), the notes on flags that have no effect in hora (:func:`notes`, one
line each, for ``--verbose``) and the refusals of flags asking for what hora cannot do
(:func:`refusals`). :func:`parse` checks the values and builds the frozen options the rest of the
runner reads: the job's command and size, its hosts (:class:`HostOptions`), its output
(:class:`OutputOptions`), the elastic flags (:class:`ElasticOptions`; ``--min-np``, ``--max-np`` or
``--host-discovery-script`` make the job elastic, and the driver is :mod:`hora.runner.elastic`),
``--mpi``'s (:class:`MpiOptions`) and the engine's variables to export. A field that holds one
flag's value names that flag (:func:`flag`) and is filled from the table; only what is worked out
from several flags or the environment is built by hand. :func:`from_values` builds the same options
from flag values given by name (``hora.run``'s arguments). It does not start anything.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import Field, dataclass, field, fields
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from hora.common import config, safe_files
from hora.common.settings_table import (
    ELASTIC_TIMEOUT,
    HOST_DISCOVERY_TIMEOUT,
    LAUNCHER_TIMEOUT_SECONDS,
    LOG_LEVELS,
    Variable,
)
from hora.runner.command import CommandError, check_command
from hora.runner.flags import BY_DEST, GROUPS, OPTIONS, Option
from hora.runner.remote import CONNECT_TIMEOUT_S, SshSettings

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "CONFIG_KEYS",
    "LOG_LEVELS",
    "ElasticOptions",
    "HostOptions",
    "LaunchOptions",
    "MpiOptions",
    "OptionError",
    "OutputOptions",
    "Query",
    "Refused",
    "UnknownFlag",
    "Values",
    "build_parser",
    "engine_env",
    "env_seconds",
    "flag",
    "flag_of",
    "from_values",
    "nearest_flags",
    "notes",
    "parse",
    "read",
    "read_config_file",
    "refusals",
    "worker_env",
]

# The flags' values as given on the command line or in the config file, by ``Option.dest``;
# ``None`` where neither gives one. Only this module reads it: it builds :class:`LaunchOptions`.
Values = Mapping[str, Any]

_FLAG = "flag"


def flag(dest: str, default: Any = None) -> Any:
    """A field of the options that holds the value of the flag ``dest`` (``default`` when neither
    the command line nor the config file gives one); :func:`parse` fills it from the table.

    Raises:
        ValueError: no flag of :data:`hora.runner.flags.OPTIONS` has that ``dest``.
    """
    if dest not in BY_DEST:
        raise ValueError(f"no flag of hora.runner.flags sets {dest!r}")
    return field(default=default, metadata={_FLAG: dest})


def flag_of(item: Field[Any]) -> str | None:
    """The ``dest`` of the flag a field of the options holds (``None``: it is worked out)."""
    dest = item.metadata.get(_FLAG)
    return None if dest is None else str(dest)


@dataclass(frozen=True)
class HostOptions:
    """Where the job runs and how horarun reaches its hosts.

    Attributes:
        host_list: ``-H``'s ``host:slots,...``.
        hostfile: ``--hostfile``.
        discovery_script: ``--host-discovery-script`` (an elastic job's hosts).
        slots_per_host: ``--slots-per-host``: the slots of a host the script prints without ``:N``.
        interfaces: ``--network-interface`` and ``--network-interfaces``, in order, each once.
        ssh: how other hosts are reached (``-p``, ``-i``, ``--ssh-option``; ssh's connect timeout
            capped by ``--start-timeout``).
        discovery_timeout_s: how long one run of the discovery script may take
            (``HORA_HOST_DISCOVERY_TIMEOUT``).
    """

    host_list: str | None = flag("hosts")
    hostfile: str | None = flag("hostfile")
    discovery_script: str | None = flag("host_discovery_script")
    slots_per_host: int = flag("slots", 1)
    interfaces: tuple[str, ...] = ()
    ssh: SshSettings = SshSettings()
    discovery_timeout_s: float = HOST_DISCOVERY_TIMEOUT.default


@dataclass(frozen=True)
class OutputOptions:
    """How the workers' output is forwarded, and what horarun says.

    Attributes:
        directory: ``--output-filename``: also write each rank's output under it.
        disable_prefix: ``--disable-output-prefix``: forward lines without ``[rank]<stream>:``.
        timestamp: ``--prefix-output-with-timestamp``: start each forwarded line with the time.
        verbose: ``--verbose``: horarun says what it does.
    """

    directory: str | None = flag("output_filename")
    disable_prefix: bool = flag("disable_output_prefix", False)
    timestamp: bool = flag("prefix_output_with_timestamp", False)
    verbose: bool = flag("verbose", False)


@dataclass(frozen=True)
class ElasticOptions:
    """An elastic job's flags, with their defaults applied.

    Attributes:
        min_np: ``--min-np`` (default ``-np``).
        timeout_s: ``--elastic-timeout``, else ``HORA_ELASTIC_TIMEOUT``.
        max_np: ``--max-np`` (``None``: every slot available).
        reset_limit: ``--reset-limit`` (``None``: no limit).
        cooldown_s: ``--blacklist-cooldown-range`` (``None``: a failed host is out for good).
    """

    min_np: int
    timeout_s: float
    max_np: int | None = flag("max_np")
    reset_limit: int | None = flag("reset_limit")
    cooldown_s: tuple[float, float] | None = flag("blacklist_cooldown_range")


@dataclass(frozen=True)
class MpiOptions:
    """``--mpi`` and what ``mpirun`` gets with it.

    Attributes:
        enabled: ``--mpi`` (or ``controller: mpi``): start the job with ``mpirun``.
        args: ``--mpi-args``: more arguments for ``mpirun``, as one string.
        binding_args: ``--binding-args``: ``mpirun``'s binding arguments.
    """

    enabled: bool = flag("mpi", False)
    args: str | None = flag("mpi_args")
    binding_args: str | None = flag("binding_args")


def _no_variables() -> Mapping[str, str]:
    return MappingProxyType({})


@dataclass(frozen=True)
class LaunchOptions:
    """Everything ``horarun``'s flags, config file and environment ask of a job, checked.

    Built once by :func:`parse`; nothing changes it afterwards.

    Attributes:
        command: what every worker runs.
        np: the number of workers (to start with, in an elastic job).
        hosts: where the job runs and how its hosts are reached.
        output: how output is forwarded, and ``--verbose``.
        elastic: the elastic flags; ``None`` when the job is not elastic.
        mpi: ``--mpi`` and its arguments.
        engine_env: the ``HORA_*`` variables (and ``NCCL_IB_DISABLE``) the flags set for every
            worker.
        launcher_timeout_s: ``HORA_LAUNCHER_TIMEOUT_SECONDS``: how long a worker's watchdog waits
            for horarun's heartbeat.
        notes: one line per accepted flag that has no effect here (said under ``--verbose``).
    """

    command: tuple[str, ...]
    np: int
    hosts: HostOptions = HostOptions()
    output: OutputOptions = OutputOptions()
    elastic: ElasticOptions | None = None
    mpi: MpiOptions = MpiOptions()
    engine_env: Mapping[str, str] = field(default_factory=_no_variables)
    launcher_timeout_s: float = LAUNCHER_TIMEOUT_SECONDS.default
    notes: tuple[str, ...] = ()


class Query(Enum):
    """What ``horarun`` is asked instead of a job; the value is the flag's ``dest``."""

    VERSION = "version"
    CHECK_BUILD = "check_build"


class OptionError(ValueError):
    """A flag or config-file value that horarun cannot use."""


class Refused(OptionError):
    """Flags asking for what hora cannot do (``--jsrun``).

    Attributes:
        reasons: why, one line per flag.
    """

    def __init__(self, reasons: Sequence[str]) -> None:
        super().__init__("\n".join(reasons))
        self.reasons = tuple(reasons)


class UnknownFlag(OptionError):
    """A flag horarun does not have (``--np``, ``--fusion-treshold-mb``), with the nearest ones
    it has.

    Attributes:
        given: the flags as given, in order.
    """

    def __init__(self, given: Sequence[str]) -> None:
        lines = [_unknown_flag_line(flag) for flag in given]
        super().__init__("\n".join([*lines, _SHORT_HELP]))
        self.given = tuple(given)


_SHORT_HELP = "`horarun --help` lists every flag."
_SHORT_USAGE = f"usage: horarun -np N [flags] command [args ...]; {_SHORT_HELP}"

# Every name of every flag, to match a misspelt one against (the hidden opposites too:
# ``--no-autotune`` is as valid as ``--autotune``), and the flag (``dest``) each stands for.
_FLAG_OF_NAME: dict[str, str] = {
    **{name: option.dest for option in OPTIONS for name in (*option.flags, *option.opposite)},
    "-h": "help",
    "--help": "help",
}
# How alike a misspelt flag and a real one must be (difflib's ratio), and how much less alike
# than the best a second suggestion may be.
_CLOSE = 0.75
_TIE = 0.02


def nearest_flags(given: str) -> list[str]:
    """The flags ``given`` most likely stands for: the same name with other dashes (``--np``:
    ``-np``), else the closest spellings (``--fusion-treshold-mb``: ``--fusion-threshold-mb``);
    empty when none is close.

    Example:
        >>> nearest_flags("--np"), nearest_flags("--fusion-treshold-mb")
        (['-np'], ['--fusion-threshold-mb'])
    """
    bare = given.split("=", 1)[0].lstrip("-")
    if not bare:
        return []
    by_bare = {name.lstrip("-"): name for name in _FLAG_OF_NAME}
    if bare in by_bare:
        return [by_bare[bare]]
    scored = sorted(
        ((difflib.SequenceMatcher(None, bare, other).ratio(), other) for other in by_bare),
        reverse=True,
    )
    best = scored[0][0]
    close: dict[str, str] = {}  # by dest: one name per flag
    # Names as close as the best are shown too (``--min-np`` and ``--max-np``), two at most.
    for score, other in scored:
        if score < max(best - _TIE, _CLOSE) or len(close) == 2:
            break
        close.setdefault(_FLAG_OF_NAME[by_bare[other]], by_bare[other])
    return list(close.values())


def _unknown_flag_line(given: str) -> str:
    name = given.split("=", 1)[0]
    close = nearest_flags(given)
    if not close:
        return f"unknown option {name}."
    return f"unknown option {name}; did you mean {' or '.join(close)}?"


class _Parser(argparse.ArgumentParser):
    """argparse's parser with a short usage on an error: the message, then one line of usage
    (``--help`` prints the whole list)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"horarun: {message}\n{_SHORT_USAGE}\n")


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
    parser = _Parser(
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


def _check_bounds(values: Values) -> None:
    """Every number within its declared range (a pair is checked by :func:`_check_elastic`)."""
    for option in OPTIONS:
        value = values[option.dest]
        limits = option.limits
        if value is None or limits is None or option.shape == "pair":
            continue
        if not limits.allows(value):
            raise OptionError(option.bounds_error(value))


def _check(values: Values) -> None:
    _check_bounds(values)
    if values["output_filename"]:
        _check_output_directory(values["output_filename"])
    for option in values["ssh_option"] or []:
        if "=" not in option or option.startswith("-"):
            raise OptionError(f"--ssh-option {option!r} must look like Key=Value.")
    if _is_elastic(values):
        _check_elastic(values)


_ELASTIC_TRIGGERS = tuple(option for option in OPTIONS if option.makes_elastic)
_TRIGGER_FLAGS = ", ".join(option.flag for option in _ELASTIC_TRIGGERS[:-1])
_TRIGGER_TEXT = f"{_TRIGGER_FLAGS} or {_ELASTIC_TRIGGERS[-1].flag}"


def _is_elastic(values: Values) -> bool:
    """Whether the flags ask for an elastic job (``--min-np``, ``--max-np`` or
    ``--host-discovery-script``)."""
    return any(values[option.dest] is not None for option in _ELASTIC_TRIGGERS)


def _check_elastic(values: Values) -> None:
    """Check the elastic flags together, ``-np`` defaulting to ``--min-np`` and the reverse."""
    np, min_np, max_np = values["np"], values["min_np"], values["max_np"]
    if np is None:
        np = min_np
    if min_np is None:
        min_np = np
    if np is not None:
        if np < min_np:
            raise OptionError(
                f"-np {np} is less than --min-np {min_np}: the job starts with -np workers, at "
                "least --min-np."
            )
        if max_np is not None and np > max_np:
            raise OptionError(f"-np {np} is more than --max-np {max_np}.")
    if min_np is not None and max_np is not None and min_np > max_np:
        raise OptionError(f"--min-np {min_np} is more than --max-np {max_np}.")
    if values["blacklist_cooldown_range"] is not None:
        _check_cooldown(*values["blacklist_cooldown_range"])
    if values["host_discovery_script"] is not None:
        _check_script(values["host_discovery_script"])


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


def _given_on_command_line(values: Values) -> set[str]:
    """The exclusive groups (by name) of which the command line gave a flag."""
    exclusive = {group.name for group in GROUPS if group.exclusive}
    return {
        option.group
        for option in OPTIONS
        if option.group in exclusive and values[option.dest] is not None
    }


def _apply_config_file(values: dict[str, Any]) -> None:
    """Fill what the command line left unset from ``--config-file``. A flag of an exclusive group
    (``--gloo``) given on the command line also keeps the file from setting its rivals."""
    taken = _given_on_command_line(values)
    for dest, value in read_config_file(values["config_file"]).items():
        if BY_DEST[dest].group in taken:
            continue
        if values[dest] is None:
            values[dest] = value


def read(
    argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> tuple[dict[str, Any], list[str]]:
    """What the command line gives, and the config file for what it left unset, unchecked.

    Returns:
        Every flag's value by ``dest`` (``None`` where neither gives one), and the command.

    Raises:
        SystemExit: argparse's usage error (status 2).
        UnknownFlag: a flag horarun does not have, before the command.
        OptionError: the config file is unusable.
    """
    parser = parser or build_parser()
    namespace, extra = parser.parse_known_args(argv)
    unknown = [word for word in extra if word.startswith("-")]
    if unknown:
        raise UnknownFlag(unknown)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    values = vars(namespace)
    command = list(values.pop("command"))
    if values["config_file"]:
        _apply_config_file(values)
    if command and command[0] == "--":
        command = command[1:]
    return values, command


_DataclassT = TypeVar("_DataclassT", bound="DataclassInstance")


def _build(kind: type[_DataclassT], values: Values, **worked_out: Any) -> _DataclassT:
    """A ``kind`` whose :func:`flag` fields hold the flags' values (a list as a tuple; a flag
    not given leaves the field's default), the others ``worked_out``."""
    given: dict[str, Any] = {}
    for item in fields(kind):
        dest = flag_of(item)
        if dest is not None and values[dest] is not None:
            value = values[dest]
            given[item.name] = tuple(value) if isinstance(value, list) else value
    return kind(**given, **worked_out)


def _interfaces(values: Values) -> tuple[str, ...]:
    """``--network-interface`` (repeatable) and ``--network-interfaces``, in order, each once.
    A value of either may name several, separated by commas (``eth0,eth1``), as horovodrun
    splits both."""
    given = values["network_interface"] or []
    texts = [given] if isinstance(given, str) else list(given)
    texts.append(values["network_interfaces"] or "")
    return tuple(dict.fromkeys(name for text in texts for name in config.interfaces(text)))


def _ssh(values: Values) -> SshSettings:
    """How the job's hosts are reached: the SSH flags, and a connect timeout capped by
    ``--start-timeout``."""
    start_timeout = values["start_timeout"]
    if start_timeout is None:
        start_timeout = CONNECT_TIMEOUT_S
    return SshSettings(
        port=values["ssh_port"],
        identity_file=values["ssh_identity_file"],
        options=tuple(values["ssh_option"] or ()),
        connect_timeout_s=max(1.0, min(CONNECT_TIMEOUT_S, start_timeout)),
    )


def _elastic_timeout_s(values: Values, env: Mapping[str, str] | None = None) -> float:
    """``--elastic-timeout``, else ``HORA_ELASTIC_TIMEOUT`` (or its Horovod twin) of ``env``
    (default: ours)."""
    if values["elastic_timeout"] is not None:
        return float(values["elastic_timeout"])
    try:
        return float(config.read(ELASTIC_TIMEOUT, env))
    except ValueError:
        # The workers refuse the value, naming it; the driver keeps the default.
        return float(ELASTIC_TIMEOUT.default)


def _elastic(
    values: Values, np: int, env: Mapping[str, str] | None = None
) -> ElasticOptions | None:
    """The elastic flags with their defaults; ``None`` when the job is not elastic."""
    if not _is_elastic(values):
        return None
    min_np = values["min_np"] if values["min_np"] is not None else np
    timeout_s = _elastic_timeout_s(values, env)
    return _build(ElasticOptions, values, min_np=min_np, timeout_s=timeout_s)


def _job_size(parser: argparse.ArgumentParser, values: Values, command: list[str]) -> int:
    """The number of workers to start, once nothing refused is asked for; a usage error
    (status 2) without it or without a command.

    Raises:
        Refused: a flag asks for what hora cannot do.
    """
    reasons = refusals(values)
    if reasons:
        raise Refused(reasons)
    if not command:
        parser.error("no command given; usage: horarun -np N python train.py")
    np: int | None = values["np"] if values["np"] is not None else values["min_np"]
    if np is None:
        parser.error(
            "-np (or --min-np) is required (the number of worker processes to start with)"
            if _is_elastic(values)
            else "-np is required (the number of worker processes)"
        )
    return np


def parse(argv: Sequence[str] | None = None) -> LaunchOptions | Query:
    """Read the command line, then the config file for what it left unset; check the values and
    build the job's options.

    Returns:
        The job's options, or the :class:`Query` (``--version``, ``--check-build``) to answer
        instead.

    Raises:
        SystemExit: argparse's usage error (status 2), also when the command or ``-np`` is
            missing.
        Refused: a flag asks for what hora cannot do.
        UnknownFlag: a flag horarun does not have (with the nearest ones it has).
        OptionError: a value is out of range, the config file is unusable, or the command's
            first word is a file here that cannot start (``train.py`` without ``python``).
    """
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    values, command = read(argv, parser)
    _check(values)
    launcher_timeout_s = env_seconds(LAUNCHER_TIMEOUT_SECONDS)
    hosts = _host_options(values)
    for query in Query:
        if values[query.value]:
            return query
    np = _job_size(parser, values, command)
    try:
        check_command(command, argv)
    except CommandError as exc:
        raise OptionError(str(exc)) from None
    return _launch_options(values, command, np, hosts, launcher_timeout_s)


def from_values(
    given: Mapping[str, Any], command: Sequence[str], env: Mapping[str, str] | None = None
) -> LaunchOptions:
    """The options of a job described by flag values rather than a command line (``hora.run``).

    Every check of :func:`parse` applies, and so does the rule of argparse's exclusive groups
    (``-H``, ``--hostfile`` and ``--host-discovery-script``; ``--gloo`` and ``--mpi``).

    Args:
        given: flag values by ``dest`` (``{"np": 2, "hosts": "localhost:2"}``), as the parser
            would store them; every flag not named (or ``None``) is not given.
        command: what every worker runs.
        env: the job's environment, where the launcher's ``HORA_*`` settings are read (default:
            ours).

    Raises:
        Refused: a flag asks for what hora cannot do.
        OptionError: a value is out of range, flags that exclude each other are given together,
            or neither ``np`` nor ``min_np`` is.
        ValueError: ``given`` names no flag of :data:`hora.runner.flags.OPTIONS`.
    """
    unknown = sorted(set(given) - set(BY_DEST))
    if unknown:
        raise ValueError(f"no flag of hora.runner.flags sets {', '.join(map(repr, unknown))}")
    values: dict[str, Any] = {option.dest: None for option in OPTIONS}
    values.update(given)
    for group in GROUPS:
        named = [o.flag for o in OPTIONS if o.group == group.name and values[o.dest]]
        if group.exclusive and len(named) > 1:
            raise OptionError(f"{' and '.join(named)} cannot be given together; give one.")
    reasons = refusals(values)
    if reasons:
        raise Refused(reasons)
    _check(values)
    launcher_timeout_s = env_seconds(LAUNCHER_TIMEOUT_SECONDS, env)
    hosts = _host_options(values, env)
    np: int | None = values["np"] if values["np"] is not None else values["min_np"]
    if np is None:
        raise OptionError("-np (or --min-np) is required (the number of worker processes).")
    return _launch_options(values, command, np, hosts, launcher_timeout_s, env)


def _host_options(values: Values, env: Mapping[str, str] | None = None) -> HostOptions:
    return _build(
        HostOptions,
        values,
        interfaces=_interfaces(values),
        ssh=_ssh(values),
        discovery_timeout_s=env_seconds(HOST_DISCOVERY_TIMEOUT, env),
    )


def _launch_options(
    values: Values,
    command: Sequence[str],
    np: int,
    hosts: HostOptions,
    launcher_timeout_s: float,
    env: Mapping[str, str] | None = None,
) -> LaunchOptions:
    return LaunchOptions(
        command=tuple(command),
        np=np,
        hosts=hosts,
        output=_build(OutputOptions, values),
        elastic=_elastic(values, np, env),
        mpi=_build(MpiOptions, values),
        engine_env=MappingProxyType(engine_env(values)),
        launcher_timeout_s=launcher_timeout_s,
        notes=tuple(notes(values)),
    )


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


def notes(values: Values) -> list[str]:
    """One line per accepted flag that has no effect in hora (printed under ``--verbose``)."""
    found = []
    for option in OPTIONS:
        value = values[option.dest]
        if option.inert and value is not None and value is not False:
            found.append(f"{option.flag} has no effect: {option.inert}")
    if not _is_elastic(values):
        for option in OPTIONS:
            if option.elastic_only and values[option.dest] is not None:
                found.append(
                    f"{option.flag} has no effect: the job is not elastic (give {_TRIGGER_TEXT})."
                )
    elif values["slots"] is not None and values["host_discovery_script"] is None:
        found.append(
            "--slots-per-host has no effect: it applies to hosts a --host-discovery-script names."
        )
    return found


def refusals(values: Values) -> list[str]:
    """Why the flags asking for what hora cannot do are refused (empty when none are given)."""
    return [option.refused for option in OPTIONS if option.refused and values[option.dest]]


def engine_env(values: Values) -> dict[str, str]:
    """The ``HORA_*`` variables set by the flags hora honours (and ``NCCL_IB_DISABLE``)."""
    env: dict[str, str] = {}
    for option in OPTIONS:
        value = values[option.dest]
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
