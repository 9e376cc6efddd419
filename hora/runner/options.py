"""``horarun``'s command line and config file, read once into a typed :class:`LaunchOptions`.

The flags themselves are declared in :mod:`hora.runner.flags`, one :class:`~hora.runner.flags.Option`
each. :func:`parse` reads the command line with the parser of :mod:`hora.runner.flag_parser`, then
the config file (:mod:`hora.runner.config_file`) for what it left unset; checks the values
(:mod:`hora.runner.option_checks`) and builds the frozen options of
:mod:`hora.runner.launch_options` the rest of the runner reads: the job's command and size, its
hosts, its output, the elastic flags (``--min-np``, ``--max-np`` or ``--host-discovery-script``
make the job elastic, and the driver is :mod:`hora.runner.elastic`), ``--mpi``'s, the ``HORA_*``
variables the honoured flags set for workers (:func:`engine_env`) and the notes on flags that
have no effect in hora. A field that holds one flag's value is filled from the table; what is
worked out from several flags or the environment (the interfaces, SSH, the elastic timeout, the
launcher's settings in seconds) is built here. :func:`from_values` builds the same options from
flag values given by name (``hora.run``'s arguments). It does not start anything.

Every name of the modules above that the runner, ``hora.run`` and the tests reach through this
one is re-exported here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from hora.common.vocabulary import config
from hora.common.vocabulary.settings_table import (
    ELASTIC_TIMEOUT,
    HOST_DISCOVERY_TIMEOUT,
    LAUNCHER_TIMEOUT_SECONDS,
    LOG_LEVELS,
    Variable,
)
from hora.runner.command import CommandError, check_command
from hora.runner.config_file import CONFIG_KEYS, apply_config_file, read_config_file
from hora.runner.flag_parser import UnknownFlag, build_parser, nearest_flags
from hora.runner.flags import BY_DEST, GROUPS, OPTIONS
from hora.runner.launch_options import (
    ElasticOptions,
    HostOptions,
    LaunchOptions,
    MpiOptions,
    OptionError,
    OutputOptions,
    Query,
    Refused,
    Values,
    fill,
    flag,
    flag_of,
)
from hora.runner.option_checks import check_values, is_elastic, notes, refusals
from hora.runner.remote import CONNECT_TIMEOUT_S, SshSettings

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
        apply_config_file(values)
    if command and command[0] == "--":
        command = command[1:]
    return values, command


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
    if not is_elastic(values):
        return None
    min_np = values["min_np"] if values["min_np"] is not None else np
    timeout_s = _elastic_timeout_s(values, env)
    return fill(ElasticOptions, values, min_np=min_np, timeout_s=timeout_s)


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
            if is_elastic(values)
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
    check_values(values)
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
    check_values(values)
    launcher_timeout_s = env_seconds(LAUNCHER_TIMEOUT_SECONDS, env)
    hosts = _host_options(values, env)
    np: int | None = values["np"] if values["np"] is not None else values["min_np"]
    if np is None:
        raise OptionError("-np (or --min-np) is required (the number of worker processes).")
    return _launch_options(values, command, np, hosts, launcher_timeout_s, env)


def _host_options(values: Values, env: Mapping[str, str] | None = None) -> HostOptions:
    return fill(
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
        output=fill(OutputOptions, values),
        elastic=_elastic(values, np, env),
        mpi=fill(MpiOptions, values),
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
