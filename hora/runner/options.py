"""``horarun``'s command line and config file: horovodrun's flags, read into one namespace.

This module owns the flag names (horovodrun's, plus a few of hora's own), the YAML config file's
keys, which flags hora honours, and the ``HORA_*`` variables the honoured ones set for workers.
Flags that only mean something for a compiled Horovod build (MPI, NCCL, thread pinning,
autotuning) are accepted and have no effect: :func:`notes` says so, one line each, for
``--verbose``. Flags asking for something hora cannot do (an MPI or jsrun launch) are refused by
:func:`refusals`. ``--min-np``, ``--max-np`` or ``--host-discovery-script`` make the job elastic
(:func:`is_elastic`; the driver is :mod:`hora.runner.elastic`). It does not start anything.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


class OptionError(ValueError):
    """A flag or config-file value that horarun cannot use."""


def build_parser() -> argparse.ArgumentParser:
    """horovodrun's flags under their own names (``-np``, ``-H``, ``--fusion-threshold-mb``, ...).

    Every value defaults to ``None`` so that a config file can fill what the command line left
    out; :func:`parse` applies the defaults after that.
    """
    parser = argparse.ArgumentParser(
        prog="horarun",
        description="Launch a hora (Horovod-compatible) training job. Flags follow horovodrun.",
        epilog="Example: horarun -np 4 -H node1:2,node2:2 python train.py",
        allow_abbrev=False,
    )
    general = parser.add_argument_group("general")
    general.add_argument(
        "-v", "--version", action="store_true", default=None, help="print hora's version"
    )
    general.add_argument(
        "-np", "--num-proc", dest="np", type=int, default=None, help="number of worker processes"
    )
    general.add_argument(
        "-cb",
        "--check-build",
        action="store_true",
        default=None,
        help="show which frameworks and transports this installation can use, and exit",
    )
    general.add_argument(
        "--disable-cache",
        action="store_true",
        default=None,
        help="accepted; horarun keeps no cache (it checks SSH on every launch)",
    )
    general.add_argument(
        "--start-timeout",
        type=float,
        default=None,
        help="seconds workers may take to reach the rendezvous (HORA_START_TIMEOUT, default 30)",
    )
    general.add_argument(
        "--network-interface",
        dest="network_interface",
        action="append",
        default=None,
        metavar="IFACE",
        help="network interface for the rendezvous store and Gloo (repeatable)",
    )
    general.add_argument(
        "--network-interfaces",
        dest="network_interfaces",
        default=None,
        metavar="IFACE,IFACE",
        help="comma-separated form of --network-interface (deprecated in horovodrun)",
    )
    general.add_argument(
        "--output-filename",
        default=None,
        metavar="DIR",
        help="also write each rank's output to DIR/rank.N/{stdout,stderr}",
    )
    general.add_argument(
        "--verbose", action="store_true", default=None, help="say what horarun does"
    )
    general.add_argument(
        "--config-file", default=None, metavar="YAML", help="read settings from a YAML file"
    )
    general.add_argument(
        "--disable-output-prefix",
        action="store_true",
        default=None,
        help="(hora) forward output without the [rank]<stream>: prefix",
    )

    ssh = parser.add_argument_group("SSH")
    ssh.add_argument("-p", "--ssh-port", type=int, default=None, help="port of sshd on the hosts")
    ssh.add_argument(
        "-i", "--ssh-identity-file", default=None, metavar="FILE", help="SSH private key"
    )
    ssh.add_argument(
        "--ssh-option",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="(hora) extra `ssh -o` option, e.g. UserKnownHostsFile=/path (repeatable)",
    )

    tune = parser.add_argument_group("tunables")
    tune.add_argument(
        "--fusion-threshold-mb",
        type=float,
        default=None,
        help="fusion buffer size in MiB (HORA_FUSION_THRESHOLD)",
    )
    tune.add_argument(
        "--cycle-time-ms",
        type=float,
        default=None,
        help="negotiation cycle time in ms (HORA_CYCLE_TIME)",
    )
    tune.add_argument("--cache-capacity", type=int, default=None, help="response cache entries")
    for name, what in (
        ("hierarchical-allreduce", "hierarchical allreduce"),
        ("hierarchical-allgather", "hierarchical allgather"),
        ("torus-allreduce", "torus allreduce"),
    ):
        dest = name.replace("-", "_")
        tune.add_argument(
            f"--{name}",
            dest=dest,
            action="store_true",
            default=None,
            help=f"accepted; hora has no {what}",
        )
        tune.add_argument(f"--no-{name}", dest=dest, action="store_false", help=argparse.SUPPRESS)

    auto = parser.add_argument_group("autotune (see docs/profiling.md)")
    auto.add_argument(
        "--autotune",
        dest="autotune",
        action="store_true",
        default=None,
        help="try batch sizes for the steady state online and keep the fastest (HORA_AUTOTUNE)",
    )
    auto.add_argument(
        "--no-autotune", dest="autotune", action="store_false", help=argparse.SUPPRESS
    )
    auto.add_argument(
        "--autotune-log-file", default=None, help="rank 0 logs every trial here (CSV)"
    )
    auto.add_argument(
        "--autotune-warmup-samples",
        type=int,
        default=None,
        help="steps after each change that are not measured (default 3)",
    )
    auto.add_argument(
        "--autotune-steps-per-sample",
        type=int,
        default=None,
        help="measured steps per tried setting (default 10)",
    )
    auto.add_argument("--autotune-bayes-opt-max-samples", type=int, default=None)
    auto.add_argument("--autotune-gaussian-process-noise", type=float, default=None)

    elastic = parser.add_argument_group(
        "elastic (on with --min-np, --max-np or --host-discovery-script)"
    )
    elastic.add_argument(
        "--min-np",
        "--min-num-proc",
        dest="min_np",
        type=int,
        default=None,
        help="fewest workers the job may train with (default: -np)",
    )
    elastic.add_argument(
        "--max-np",
        "--max-num-proc",
        dest="max_np",
        type=int,
        default=None,
        help="most workers the job may train with (default: every slot available)",
    )
    elastic.add_argument(
        "--slots-per-host",
        "--slots",
        dest="slots",
        type=int,
        default=None,
        help="slots of a host the discovery script names without :N (default 1)",
    )
    elastic.add_argument(
        "--elastic-timeout",
        type=float,
        default=None,
        help="seconds to wait for enough slots, and workers for a round (HORA_ELASTIC_TIMEOUT, "
        "default 600)",
    )
    elastic.add_argument(
        "--reset-limit",
        type=int,
        default=None,
        help="most times the job may re-form after its first round (default: no limit)",
    )
    elastic.add_argument(
        "--blacklist-cooldown-range",
        type=float,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help="seconds a failed host stays out, growing from MIN to MAX (default: for good)",
    )

    timeline = parser.add_argument_group("timeline")
    timeline.add_argument(
        "--timeline-filename",
        default=None,
        help="write a timeline (HORA_TIMELINE): rank 0 to FILE, rank r to FILE.rank<r>, "
        "merged into FILE at the end; see docs/profiling.md",
    )
    timeline.add_argument(
        "--timeline-mark-cycles",
        dest="timeline_mark_cycles",
        action="store_true",
        default=None,
        help="mark every negotiation cycle in the timeline (HORA_TIMELINE_MARK_CYCLES)",
    )
    timeline.add_argument(
        "--no-timeline-mark-cycles",
        dest="timeline_mark_cycles",
        action="store_false",
        help=argparse.SUPPRESS,
    )

    stall = parser.add_argument_group("stall check")
    stall.add_argument(
        "--no-stall-check",
        dest="stall_check",
        action="store_false",
        default=None,
        help="turn the stall inspector off (HORA_STALL_CHECK_DISABLE=1)",
    )
    stall.add_argument(
        "--stall-check", dest="stall_check", action="store_true", help=argparse.SUPPRESS
    )
    stall.add_argument(
        "--stall-check-warning-time-seconds",
        type=float,
        default=None,
        help="warn after a stall this long (HORA_STALL_CHECK_TIME_SECONDS; default 60)",
    )
    stall.add_argument(
        "--stall-check-shutdown-time-seconds",
        type=float,
        default=None,
        help="end the job after a stall this long (HORA_STALL_SHUTDOWN_TIME_SECONDS; default "
        "600, 0 waits forever)",
    )

    library = parser.add_argument_group("library options")
    library.add_argument(
        "--mpi-threads-disable", dest="mpi_threads_disable", action="store_true", default=None
    )
    library.add_argument(
        "--no-mpi-threads-disable",
        dest="mpi_threads_disable",
        action="store_false",
        help=argparse.SUPPRESS,
    )
    library.add_argument("--mpi-args", default=None, help="accepted; hora does not run mpirun")
    library.add_argument(
        "--tcp",
        action="store_true",
        default=None,
        help="sets NCCL_IB_DISABLE=1 (hora's own traffic is TCP already)",
    )
    library.add_argument("--binding-args", default=None, help="accepted; hora does not run mpirun")
    library.add_argument("--num-nccl-streams", type=int, default=None)
    library.add_argument("--thread-affinity", default=None)
    library.add_argument(
        "--gloo-timeout-seconds",
        type=float,
        default=None,
        help="seconds ranks wait for each other (HORA_GLOO_TIMEOUT_SECONDS)",
    )

    logging = parser.add_argument_group("logging")
    logging.add_argument("--log-level", default=None, choices=LOG_LEVELS, type=str.upper)
    logging.add_argument(
        "--log-with-timestamp",
        dest="log_with_timestamp",
        action="store_true",
        default=None,
        help=argparse.SUPPRESS,
    )
    logging.add_argument(
        "--log-without-timestamp",
        "--log-hide-timestamp",
        dest="log_with_timestamp",
        action="store_false",
        help="leave the time out of hora's log lines (HORA_LOG_HIDE_TIME=1)",
    )
    logging.add_argument(
        "--no-log-hide-timestamp",
        dest="log_with_timestamp",
        action="store_true",
        help=argparse.SUPPRESS,
    )
    logging.add_argument(
        "-prefix-timestamp",
        "--prefix-output-with-timestamp",
        dest="prefix_output_with_timestamp",
        action="store_true",
        default=None,
        help="start each forwarded output line with the time",
    )

    hosts = parser.add_argument_group("hosts").add_mutually_exclusive_group()
    hosts.add_argument(
        "-H",
        "--hosts",
        default=None,
        help="hosts and slots, e.g. node1:4,node2:4 (default: localhost:NP)",
    )
    hosts.add_argument(
        "-hostfile", "--hostfile", default=None, help="file with one `host slots=N` per line"
    )
    hosts.add_argument(
        "--host-discovery-script",
        default=None,
        metavar="PATH",
        help="(elastic) executable printing the available hosts, one `host` or `host:slots` a "
        "line; run every second",
    )

    controller = parser.add_argument_group("controller").add_mutually_exclusive_group()
    controller.add_argument("--gloo", action="store_true", default=None, help="use Gloo (default)")
    controller.add_argument("--mpi", action="store_true", default=None, help="(not available)")
    controller.add_argument("--jsrun", action="store_true", default=None, help="(not available)")

    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    return parser


# Config-file keys (horovodrun's) and the flag each one stands for.
CONFIG_KEYS: dict[str, dict[str, str]] = {
    "params": {
        "fusion_threshold_mb": "fusion_threshold_mb",
        "cycle_time_ms": "cycle_time_ms",
        "cache_capacity": "cache_capacity",
        "hierarchical_allreduce": "hierarchical_allreduce",
        "hierarchical_allgather": "hierarchical_allgather",
        "torus_allreduce": "torus_allreduce",
    },
    "autotune": {
        "enabled": "autotune",
        "log_file": "autotune_log_file",
        "warmup_samples": "autotune_warmup_samples",
        "steps_per_sample": "autotune_steps_per_sample",
        "bayes_opt_max_samples": "autotune_bayes_opt_max_samples",
        "gaussian_process_noise": "autotune_gaussian_process_noise",
    },
    "timeline": {"filename": "timeline_filename", "mark_cycles": "timeline_mark_cycles"},
    "stall_check": {
        "enabled": "stall_check",
        "warning_time_seconds": "stall_check_warning_time_seconds",
        "shutdown_time_seconds": "stall_check_shutdown_time_seconds",
    },
    "library_options": {
        "mpi_threads_disable": "mpi_threads_disable",
        "num_nccl_streams": "num_nccl_streams",
        "thread_affinity": "thread_affinity",
        "gloo_timeout_seconds": "gloo_timeout_seconds",
    },
    "logging": {"level": "log_level", "with_timestamp": "log_with_timestamp"},
}

_BOOLEAN = {
    "hierarchical_allreduce",
    "hierarchical_allgather",
    "torus_allreduce",
    "autotune",
    "timeline_mark_cycles",
    "stall_check",
    "mpi_threads_disable",
    "log_with_timestamp",
}
_TEXT = {"autotune_log_file", "timeline_filename", "thread_affinity", "log_level"}
_INTEGER = {
    "cache_capacity",
    "autotune_warmup_samples",
    "autotune_steps_per_sample",
    "autotune_bayes_opt_max_samples",
    "num_nccl_streams",
}


def _config_value(path: str, key: str, dest: str, value: Any) -> Any:
    where = f"{path}: {key}={value!r}"
    if dest in _BOOLEAN:
        if not isinstance(value, bool):
            raise OptionError(f"{where} must be true or false.")
        return value
    if dest in _TEXT:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise OptionError(f"{where} must be a string.")
        text = str(value)
        if dest == "log_level":
            text = text.upper()
            if text not in LOG_LEVELS:
                raise OptionError(f"{where} must be one of {', '.join(LOG_LEVELS)}.")
        return text
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptionError(f"{where} must be a number.")
    if dest in _INTEGER and not float(value).is_integer():
        raise OptionError(f"{where} must be a whole number.")
    return int(value) if dest in _INTEGER else float(value)


def read_config_file(path: str) -> dict[str, Any]:
    """The flag values a horovodrun YAML config file sets, by flag (``dest``) name.

    Raises:
        OptionError: the file cannot be read, is not YAML, or holds an unknown key or a value of
            the wrong type.
    """
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise OptionError(f"cannot read config file {path!r}: {exc.strerror}.") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise OptionError(f"config file {path!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise OptionError(f"config file {path!r} must hold a mapping of sections.")
    values: dict[str, Any] = {}
    for section, body in data.items():
        if section == "controller":
            if body not in ("gloo", "mpi"):
                raise OptionError(f"{path}: controller={body!r} must be gloo or mpi.")
            values["gloo" if body == "gloo" else "mpi"] = True
            continue
        if section not in CONFIG_KEYS:
            known = ", ".join(["controller", *CONFIG_KEYS])
            raise OptionError(f"{path}: unknown section {section!r}; the sections are {known}.")
        if body is None:
            continue
        if not isinstance(body, dict):
            raise OptionError(f"{path}: section {section!r} must be a mapping of keys to values.")
        for key, value in body.items():
            dest = CONFIG_KEYS[section].get(str(key))
            if dest is None:
                known = ", ".join(CONFIG_KEYS[section])
                raise OptionError(
                    f"{path}: unknown key {section}.{key}; the keys of {section!r} are {known}."
                )
            values[dest] = _config_value(path, f"{section}.{key}", dest, value)
    return values


# Numeric flags that must not be negative (horovodrun's rule for its config file).
_NON_NEGATIVE = (
    "fusion_threshold_mb",
    "cycle_time_ms",
    "cache_capacity",
    "start_timeout",
    "autotune_warmup_samples",
    "autotune_steps_per_sample",
    "autotune_bayes_opt_max_samples",
    "autotune_gaussian_process_noise",
    "stall_check_warning_time_seconds",
    "stall_check_shutdown_time_seconds",
    "num_nccl_streams",
    "gloo_timeout_seconds",
    "elastic_timeout",
    "reset_limit",
)

# The largest --blacklist-cooldown-range bound (horovodrun's).
MAX_COOLDOWN_S = 3600.0


def _validate(args: argparse.Namespace) -> None:
    for dest in _NON_NEGATIVE:
        value = getattr(args, dest)
        if value is not None and value < 0:
            raise OptionError(f"{dest}={value:g} must be >= 0.")
    noise = args.autotune_gaussian_process_noise
    if noise is not None and noise > 1:
        raise OptionError(f"autotune_gaussian_process_noise={noise:g} must be between 0 and 1.")
    if args.np is not None and args.np < 1:
        raise OptionError(f"-np must be >= 1, got {args.np}.")
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        raise OptionError(f"--ssh-port {args.ssh_port} is not a port number.")
    for option in args.ssh_option or []:
        if "=" not in option or option.startswith("-"):
            raise OptionError(f"--ssh-option {option!r} must look like Key=Value.")
    if is_elastic(args):
        _validate_elastic(args)


def is_elastic(args: argparse.Namespace) -> bool:
    """Whether the flags ask for an elastic job (``--min-np``, ``--max-np`` or
    ``--host-discovery-script``)."""
    return (
        args.min_np is not None or args.max_np is not None or args.host_discovery_script is not None
    )


def _validate_elastic(args: argparse.Namespace) -> None:
    """Check the elastic flags and fill the defaults: ``-np`` from ``--min-np`` and the reverse."""
    for dest, flag in (
        ("min_np", "--min-np"),
        ("max_np", "--max-np"),
        ("slots", "--slots-per-host"),
    ):
        value = getattr(args, dest)
        if value is not None and value < 1:
            raise OptionError(f"{flag} must be >= 1, got {value}.")
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
    if args.elastic_timeout is not None and args.elastic_timeout <= 0:
        raise OptionError(f"--elastic-timeout must be > 0 seconds, got {args.elastic_timeout:g}.")
    if args.blacklist_cooldown_range is not None:
        low, high = args.blacklist_cooldown_range
        if not 1 <= low <= high <= MAX_COOLDOWN_S:
            raise OptionError(
                f"--blacklist-cooldown-range {low:g} {high:g}: need 1 <= MIN <= MAX <= "
                f"{MAX_COOLDOWN_S:g} (seconds)."
            )
    script = args.host_discovery_script
    if script is not None:
        path = Path(script)
        if not path.is_file():
            raise OptionError(f"--host-discovery-script {script!r}: no such file.")
        if not os.access(path, os.X_OK):
            raise OptionError(
                f"--host-discovery-script {script!r} is not executable; run `chmod +x {script}`."
            )


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Read the command line, then the config file for what it left unset.

    Raises:
        SystemExit: argparse's usage error (status 2).
        OptionError: a value is out of range or the config file is unusable.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config_file:
        for dest, value in read_config_file(args.config_file).items():
            if dest in ("gloo", "mpi") and (args.gloo or args.mpi or args.jsrun):
                continue  # a controller flag on the command line wins
            if getattr(args, dest) is None:
                setattr(args, dest, value)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    args.command = command
    interfaces = list(args.network_interface or [])
    if args.network_interfaces:
        interfaces += [i.strip() for i in args.network_interfaces.split(",") if i.strip()]
    args.interfaces = list(dict.fromkeys(interfaces))
    _validate(args)
    return args


@dataclass(frozen=True)
class _Inert:
    """A flag that is accepted for compatibility but changes nothing in hora."""

    dest: str
    flag: str
    why: str


_INERT = (
    _Inert("hierarchical_allreduce", "--hierarchical-allreduce", "hora reduces over one Gloo group; it has no hierarchical allreduce."),
    _Inert("hierarchical_allgather", "--hierarchical-allgather", "hora gathers over one Gloo group; it has no hierarchical allgather."),
    _Inert("torus_allreduce", "--torus-allreduce", "hora has no torus allreduce."),
    _Inert("autotune_bayes_opt_max_samples", "--autotune-bayes-opt-max-samples", "hora's autotune tries a small fixed set of batch sizes, not Bayesian optimisation."),
    _Inert("autotune_gaussian_process_noise", "--autotune-gaussian-process-noise", "hora's autotune tries a small fixed set of batch sizes, not Bayesian optimisation."),
    _Inert("mpi_threads_disable", "--mpi-threads-disable", "hora does not use MPI."),
    _Inert("mpi_args", "--mpi-args", "hora does not run mpirun."),
    _Inert("binding_args", "--binding-args", "hora does not run mpirun."),
    _Inert("num_nccl_streams", "--num-nccl-streams", "hora does not use NCCL."),
    _Inert("thread_affinity", "--thread-affinity", "hora does not pin its background thread to a core."),
    _Inert("tcp", "--tcp", "hora's own traffic is TCP already; NCCL_IB_DISABLE=1 is set for any NCCL your script uses."),
    _Inert("disable_cache", "--disable-cache", "horarun keeps no cache; it checks SSH on every launch."),
    _Inert("gloo", "--gloo", "Gloo is hora's only controller."),
)  # fmt: skip


# Flags that only mean something in an elastic job.
_ELASTIC_ONLY = (
    ("slots", "--slots-per-host"),
    ("elastic_timeout", "--elastic-timeout"),
    ("reset_limit", "--reset-limit"),
    ("blacklist_cooldown_range", "--blacklist-cooldown-range"),
)


def notes(args: argparse.Namespace) -> list[str]:
    """One line per accepted flag that has no effect in hora (printed under ``--verbose``)."""
    found = []
    for inert in _INERT:
        value = getattr(args, inert.dest)
        if value is not None and value is not False:
            found.append(f"{inert.flag} has no effect: {inert.why}")
    if not is_elastic(args):
        for dest, flag in _ELASTIC_ONLY:
            if getattr(args, dest) is not None:
                found.append(
                    f"{flag} has no effect: the job is not elastic (give --min-np, --max-np or "
                    "--host-discovery-script)."
                )
    elif args.slots is not None and args.host_discovery_script is None:
        found.append(
            "--slots-per-host has no effect: it applies to hosts a --host-discovery-script names."
        )
    return found


def refusals(args: argparse.Namespace) -> list[str]:
    """Why the flags asking for what hora cannot do are refused (empty when none are given)."""
    found = []
    if args.mpi:
        found.append(
            "--mpi (or controller: mpi) is not available: hora's workers talk over Gloo and "
            "horarun starts them itself (over SSH for other hosts). Drop --mpi."
        )
    if args.jsrun:
        found.append("--jsrun is not available: hora does not launch through LSF's jsrun.")
    return found


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    """The ``HORA_*`` variables set by the flags hora honours (and ``NCCL_IB_DISABLE``)."""
    env: dict[str, str] = {}

    def put(name: str, value: Any) -> None:
        if isinstance(value, str):
            env[name] = value
        elif value is not None:
            env[name] = str(int(value)) if float(value).is_integer() else repr(float(value))

    if args.fusion_threshold_mb is not None:
        env["HORA_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * 1024 * 1024))
    put("HORA_CYCLE_TIME", args.cycle_time_ms)
    put("HORA_CACHE_CAPACITY", args.cache_capacity)
    put("HORA_START_TIMEOUT", args.start_timeout)
    put("HORA_GLOO_TIMEOUT_SECONDS", args.gloo_timeout_seconds)
    put("HORA_STALL_CHECK_TIME_SECONDS", args.stall_check_warning_time_seconds)
    put("HORA_STALL_SHUTDOWN_TIME_SECONDS", args.stall_check_shutdown_time_seconds)
    put("HORA_LOG_LEVEL", args.log_level)
    if args.stall_check is not None:
        env["HORA_STALL_CHECK_DISABLE"] = "0" if args.stall_check else "1"
    if args.log_with_timestamp is not None:
        env["HORA_LOG_HIDE_TIME"] = "0" if args.log_with_timestamp else "1"
    if args.tcp:
        env["NCCL_IB_DISABLE"] = "1"
    if args.autotune is not None:
        env["HORA_AUTOTUNE"] = "1" if args.autotune else "0"
    if args.autotune_log_file is not None:
        env["HORA_AUTOTUNE_LOG"] = os.path.abspath(args.autotune_log_file)
    put("HORA_AUTOTUNE_WARMUP_SAMPLES", args.autotune_warmup_samples)
    put("HORA_AUTOTUNE_STEPS_PER_SAMPLE", args.autotune_steps_per_sample)
    if args.timeline_filename is not None:
        env["HORA_TIMELINE"] = os.path.abspath(args.timeline_filename)
    if args.timeline_mark_cycles is not None:
        env["HORA_TIMELINE_MARK_CYCLES"] = "1" if args.timeline_mark_cycles else "0"
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
