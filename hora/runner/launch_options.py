"""The frozen options a ``horarun`` job is described by, and the errors of reading them.

:class:`LaunchOptions` holds everything the flags, the config file and the environment ask of a
job, checked: the command and size, its hosts (:class:`HostOptions`), its output
(:class:`OutputOptions`), the elastic flags (:class:`ElasticOptions`), ``--mpi``'s
(:class:`MpiOptions`) and the engine's variables to export; :class:`Query` is what is asked
instead of a job (``--version``, ``--check-build``). A field that holds one flag's value names
that flag (:func:`flag`), and :func:`fill` fills such fields from the flags' values by name.

This module knows the flag table's names (``dest``) and nothing of argparse, the config file or
the checks: :mod:`hora.runner.options` reads the values and builds these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import Field, dataclass, field, fields
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

from hora.common.vocabulary.settings_table import HOST_DISCOVERY_TIMEOUT, LAUNCHER_TIMEOUT_SECONDS
from hora.runner.flags import BY_DEST
from hora.runner.remote import SshSettings

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# The flags' values as given on the command line or in the config file, by ``Option.dest``;
# ``None`` where neither gives one. Only the modules that build :class:`LaunchOptions` read it
# (:mod:`hora.runner.options` and the checks, config file and notes it calls on).
Values = Mapping[str, Any]

_FLAG = "flag"


def flag(dest: str, default: Any = None) -> Any:
    """A field of the options that holds the value of the flag ``dest`` (``default`` when neither
    the command line nor the config file gives one); :func:`fill` fills it from the table.

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

    Built once by :func:`hora.runner.options.parse` (or ``from_values``); nothing changes it
    afterwards.

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


_DataclassT = TypeVar("_DataclassT", bound="DataclassInstance")


def fill(kind: type[_DataclassT], values: Values, **worked_out: Any) -> _DataclassT:
    """A ``kind`` whose :func:`flag` fields hold the flags' values (a list as a tuple; a flag
    not given leaves the field's default), the others ``worked_out``."""
    given: dict[str, Any] = {}
    for item in fields(kind):
        dest = flag_of(item)
        if dest is not None and values[dest] is not None:
            value = values[dest]
            given[item.name] = tuple(value) if isinstance(value, list) else value
    return kind(**given, **worked_out)
