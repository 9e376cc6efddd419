"""Every ``horarun`` flag, declared once.

One :class:`Option` per flag holds all its facts: its names, its ``dest`` (what its value is
called while parsing, and what names it in a field of the typed options), its help, its key in
the YAML config file, its range, the ``HORA_*`` variable it sets for the workers (a
:class:`~hora.common.vocabulary.settings_table.Variable`, which brings that variable's name, ``HOROVOD_*``
twin, default and range), and whether it has no effect in hora, is refused, or only means
something in an elastic job. :mod:`hora.runner.options` builds the parser, reads the config
file, validates the values, computes the workers' environment and fills the typed options
(:class:`~hora.runner.options.LaunchOptions`) from this table; ``python -m
hora.tools.docs_tables`` writes the flag tables of docs/launching.md and docs/elastic.md from it.

Pure data: no argparse here, and no torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from hora.common.vocabulary import settings_table as var
from hora.common.vocabulary.settings_table import (
    AT_LEAST_ONE,
    NON_NEGATIVE,
    POSITIVE,
    Bounds,
    Variable,
)

# How a flag takes its value: ``switch`` (no value; stores ``Option.stores``), a number, text,
# a log level, ``append`` (repeatable text) or ``pair`` (two numbers).
Shape = Literal["switch", "int", "float", "text", "level", "append", "pair"]

# The docs table that lists a flag: docs/launching.md's ``general``, ``ssh``, ``engine``,
# ``inert`` and ``refused`` tables; ``None`` for the flags described in prose (the elastic ones,
# which docs/elastic.md's table lists through ``Option.elastic_doc``).
DocTable = Literal["general", "ssh", "engine", "inert", "refused", None]


def number_text(value: Any) -> str:
    """A number as a worker reads it (``3``, ``3.5``); text as it is."""
    if isinstance(value, str):
        return value
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def mib_to_bytes(value: Any) -> str:
    return str(int(value * 1024 * 1024))


def absolute_path(value: Any) -> str:
    return os.path.abspath(str(value))


def metrics_spec(value: Any) -> str:
    """``HORA_METRICS``'s text with each ``tensorboard:DIR`` made absolute (workers may start
    elsewhere); anything else as given (the workers check it)."""
    items = []
    for item in str(value).split(","):
        kind, _, target = item.partition(":")
        if kind.strip().lower() == "tensorboard" and target.strip():
            item = f"tensorboard:{os.path.abspath(target.strip())}"
        items.append(item)
    return ",".join(items)


def one_if_true(value: Any) -> str:
    return "1" if value else "0"


def one_if_false(value: Any) -> str:
    return "0" if value else "1"


@dataclass(frozen=True)
class Group:
    """A section of ``horarun --help``; ``exclusive``: at most one of its flags may be given
    (on the command line; a config-file value for it yields to one given there)."""

    name: str
    title: str
    exclusive: bool = False


GROUPS = (
    Group("general", "general"),
    Group("ssh", "SSH"),
    Group("tunables", "tunables"),
    Group("autotune", "autotune (see docs/profiling.md)"),
    Group("elastic", "elastic (on with --min-np, --max-np or --host-discovery-script)"),
    Group("timeline", "timeline"),
    Group("metrics", "live metrics (see docs/profiling.md)"),
    Group("stall", "stall check"),
    Group("library", "library options"),
    Group("logging", "logging"),
    Group("hosts", "hosts", exclusive=True),
    Group("controller", "controller", exclusive=True),
)


@dataclass(frozen=True)
class Option:
    """One ``horarun`` flag.

    Attributes:
        flags: its names; the first one names it in messages.
        dest: the name of its value while parsing (``None`` when not given), and what a field
            of the options that holds it names (:func:`hora.runner.options.flag`).
        group: the :class:`Group` it belongs to, by name.
        shape: how it takes its value.
        help: what it does, for ``--help`` (the variable it sets is appended).
        metavar: the value's name in ``--help`` and the docs (two names for a pair).
        stores: what a switch stores when given.
        opposite: hidden switches that store the opposite (``--no-autotune``).
        config_key: its key in the config file, ``section.key``, or ``section: value`` for a
            scalar section (``controller: gloo``).
        variable: the ``HORA_*`` variable it sets for the workers.
        encode: the value as that variable's text.
        sets: variables set to fixed values when a switch is on (``NCCL_IB_DISABLE=1``).
        bounds: the range of a number; by default the variable's.
        inert: why it has no effect in hora (it is accepted and noted under ``--verbose``).
        refused: why horarun refuses it (with status 2).
        elastic_only: it means something only in an elastic job.
        makes_elastic: giving it makes the job elastic.
        hora: a flag of hora's own, not horovodrun's.
        doc: its meaning in docs/launching.md (default: ``help``).
        env_doc: what docs/launching.md adds after the variable it sets.
        default_doc: its default as the help and the docs show it, when the variable's default
            does not say it (another unit) or it has no variable.
        elastic_doc: its meaning in docs/elastic.md's table (``""``: not listed there).
        elastic_default: its default in that table.
        doc_table: the docs/launching.md table that lists it.
    """

    flags: tuple[str, ...]
    dest: str
    group: str
    shape: Shape
    help: str = ""
    metavar: str | tuple[str, str] | None = None
    stores: bool = True
    opposite: tuple[str, ...] = ()
    config_key: str | None = None
    variable: Variable[Any] | None = None
    encode: Callable[[Any], str] = number_text
    sets: tuple[tuple[str, str], ...] = ()
    bounds: Bounds | None = None
    inert: str = ""
    refused: str = ""
    elastic_only: bool = False
    makes_elastic: bool = False
    hora: bool = False
    doc: str = ""
    env_doc: str = ""
    default_doc: str = ""
    elastic_doc: str = ""
    elastic_default: str = ""
    doc_table: DocTable = None

    @property
    def flag(self) -> str:
        """The name that stands for it in messages: the first one longer than a letter
        (``-np``, ``--ssh-port`` rather than ``-p``)."""
        return next((flag for flag in self.flags if len(flag) > 2), self.flags[0])

    @property
    def limits(self) -> Bounds | None:
        """The range its value must lie in: its own, else its variable's."""
        if self.bounds is not None:
            return self.bounds
        return self.variable.bounds if self.variable is not None else None

    @property
    def default_text(self) -> str:
        """Its default, as ``--help`` shows it (``""`` when there is none to show)."""
        if self.default_doc or self.variable is None or self.shape == "switch":
            return self.default_doc
        default = self.variable.default
        return "" if default is None else number_text(default)

    def env_text(self) -> str:
        """The variables it sets, as ``--help`` and the docs show them (``HORA_AUTOTUNE=1``)."""
        if self.sets:
            return ", ".join(f"{name}={value}" for name, value in self.sets)
        if self.variable is None:
            return ""
        if self.shape == "switch":
            return f"{self.variable.env}={self.encode(self.stores)}"
        return self.variable.env

    def help_text(self) -> str:
        """The line of ``horarun --help``."""
        text = self.help or (f"accepted, no effect: {self.inert}" if self.inert else "")
        if self.refused:
            text = text or "(not available)"
        extra = [part for part in (self.env_text(), self.default_text) if part]
        if self.default_text:
            extra[-1] = f"default {self.default_text}"
        prefix = "(hora) " if self.hora else ""
        return f"{prefix}{text}" + (f" ({'; '.join(extra)})" if extra else "")

    def bounds_error(self, value: float) -> str:
        """Why ``value`` is out of range, naming the flag (and config key) and the rule."""
        limits = self.limits
        assert limits is not None
        if limits == NON_NEGATIVE:
            # horovodrun's phrasing for its config file's rule.
            where = self.flag + (
                f" or {self.config_key} in the config file" if self.config_key else ""
            )
            return f"{self.dest}={value:g} must be >= 0 ({where})."
        unit = f" {self.variable.unit}" if self.variable is not None and self.variable.unit else ""
        return f"{self.flag} must be {limits.describe()}{unit}, got {value:g}."


def _switch(*flags: str, **facts: Any) -> Option:
    """A flag without a value; its ``dest`` defaults to its last name (``--tcp``: ``tcp``)."""
    dest = facts.pop("dest", flags[-1].lstrip("-").replace("-", "_"))
    return Option(flags, dest=dest, shape="switch", **facts)


OPTIONS: tuple[Option, ...] = (
    # ------------------------------------------------------------------ general
    Option(("-v", "--version"), "version", "general", "switch",
           help="print hora's version", doc="Print hora's version and exit.", doc_table="general"),
    Option(("-np", "--num-proc"), "np", "general", "int", metavar="N", bounds=AT_LEAST_ONE,
           help="number of worker processes",
           doc="Number of worker processes. Required (except with `--check-build` and "
           "`--version`, and in elastic jobs, where it defaults to `--min-np`).",
           elastic_doc="workers to start with; round 0 waits until N slots are available",
           elastic_default="`--min-np`", doc_table="general"),
    Option(("-cb", "--check-build"), "check_build", "general", "switch",
           help="show which frameworks and transports this installation can use, and exit",
           doc="Print what this installation can use (see [Checking an installation]"
           "(#checking-an-installation)) and exit.", doc_table="general"),
    Option(("--disable-cache",), "disable_cache", "general", "switch",
           inert="horarun keeps no cache; it checks SSH on every launch.",
           doc="Accepted. `horarun` keeps no cache; it checks SSH on every launch.",
           doc_table="general"),
    Option(("--start-timeout",), "start_timeout", "general", "float", metavar="S",
           variable=var.START_TIMEOUT, bounds=NON_NEGATIVE,
           help="seconds workers may take to reach the rendezvous",
           doc="Sets `HORA_START_TIMEOUT`: seconds a worker may take to reach the store "
           "(default 30). Also caps SSH's `ConnectTimeout` (default 10).", doc_table="general"),
    Option(("--network-interface",), "network_interface", "general", "append", metavar="IFACE",
           help="network interface for the rendezvous store and Gloo (repeatable, or a "
           "comma-separated list)",
           doc="The interface the job uses on this machine and for Gloo: the store listens on its "
           "address (in a multi-host job), and every worker gets `HORA_GLOO_IFACE=IFACE` and "
           "`NCCL_SOCKET_IFNAME`. Repeatable, and a value may list several separated by commas "
           "(`eth0,eth1`), as in `horovodrun`; the first one is used for Gloo and the store, "
           "and `NCCL_SOCKET_IFNAME` gets them all.",
           doc_table="general"),
    Option(("--network-interfaces",), "network_interfaces", "general", "text",
           metavar="IFACE,IFACE",
           help="comma-separated network interfaces, as --network-interface takes them",
           doc="The same as a comma-separated list (`horovodrun`'s preferred form; it deprecates "
           "commas in `--network-interface`, which hora accepts as well).",
           doc_table="general"),
    Option(("--output-filename",), "output_filename", "general", "text", metavar="DIR",
           help="also write each rank's output to DIR/rank.N/{stdout,stderr}",
           doc="Also write each rank's output to `DIR/rank.<rank>/stdout` and `.../stderr`.",
           doc_table="general"),
    Option(("--verbose",), "verbose", "general", "switch", help="say what horarun does",
           doc="Print what `horarun` does to stderr: the SSH check, the store's address, each "
           "rank's host and place, and a note for each flag that has no effect in hora.",
           doc_table="general"),
    Option(("--config-file",), "config_file", "general", "text", metavar="YAML",
           help="read settings from a YAML file",
           doc="Read settings from a YAML file; see [Config file](#config-file). Flags given on "
           "the command line win.", doc_table="general"),
    Option(("--disable-output-prefix",), "disable_output_prefix", "general", "switch", hora=True,
           help="forward output without the [rank]<stream>: prefix",
           doc="forward lines without the `[rank]<stream>:` prefix.", doc_table="general"),
    # ------------------------------------------------------------------ SSH
    Option(("-p", "--ssh-port"), "ssh_port", "ssh", "int", metavar="PORT",
           bounds=Bounds(low=1, high=65535), help="port of sshd on the hosts",
           doc="Port of `sshd` on the hosts. Default: your SSH configuration, else 22.",
           doc_table="ssh"),
    Option(("-i", "--ssh-identity-file"), "ssh_identity_file", "ssh", "text", metavar="FILE",
           help="SSH private key", doc="The private key to log in with.", doc_table="ssh"),
    Option(("--ssh-option",), "ssh_option", "ssh", "append", metavar="KEY=VALUE", hora=True,
           help="extra `ssh -o` option, e.g. UserKnownHostsFile=/path (repeatable)",
           doc="an extra `ssh -o` option, e.g. `UserKnownHostsFile=/path` or "
           "`StrictHostKeyChecking=yes`. Repeatable.", doc_table="ssh"),
    # ------------------------------------------------------------------ tunables
    Option(("--fusion-threshold-mb",), "fusion_threshold_mb", "tunables", "float", metavar="MB",
           config_key="params.fusion_threshold_mb", variable=var.FUSION_THRESHOLD,
           encode=mib_to_bytes, help="fusion buffer size in MiB", default_doc="128",
           env_doc="(MiB converted to bytes)", doc_table="engine"),
    Option(("--cycle-time-ms",), "cycle_time_ms", "tunables", "float", metavar="MS",
           config_key="params.cycle_time_ms", variable=var.CYCLE_TIME,
           help="negotiation cycle time in ms", doc_table="engine"),
    Option(("--cache-capacity",), "cache_capacity", "tunables", "int", metavar="N",
           config_key="params.cache_capacity", variable=var.CACHE_CAPACITY,
           help="response cache entries", doc_table="engine"),
    _switch("--hierarchical-allreduce", opposite=("--no-hierarchical-allreduce",),
            group="tunables", config_key="params.hierarchical_allreduce",
            variable=var.HIERARCHICAL_ALLREDUCE, encode=one_if_true,
            help="reduce within hosts through shared memory, across hosts over the network",
            doc_table="engine"),
    Option(("--gradient-compression",), "gradient_compression", "tunables", "text",
           metavar="{none,fp16,bf16}", variable=var.GRADIENT_COMPRESSION, encode=str, hora=True,
           help="how optimizers built without a compressor send gradients",
           doc="How a `DistributedOptimizer` or `DistributedGradientTape` built with "
           "`Compression.none` (the default) sends gradients: `none`, `fp16` or `bf16`; see "
           "[cluster.md](cluster.md#when-to-compress).", doc_table="engine"),
    _switch("--hierarchical-allgather", opposite=("--no-hierarchical-allgather",),
            group="tunables", config_key="params.hierarchical_allgather",
            variable=var.HIERARCHICAL_ALLGATHER, encode=one_if_true,
            help="accepted; hora gathers across hosts over one Gloo group",
            doc_table="engine"),
    _switch("--torus-allreduce", opposite=("--no-torus-allreduce",), group="tunables",
            config_key="params.torus_allreduce", inert=var.TORUS_ALLREDUCE.why,
            doc_table="inert"),
    # ------------------------------------------------------------------ autotune
    _switch("--autotune", opposite=("--no-autotune",), group="autotune",
            config_key="autotune.enabled", variable=var.AUTOTUNE, encode=one_if_true,
            help="try batch sizes for the steady state online and keep the fastest",
            env_doc="; see [profiling.md](profiling.md#autotune)", doc_table="engine"),
    Option(("--autotune-log-file",), "autotune_log_file", "autotune", "text", metavar="FILE",
           config_key="autotune.log_file", variable=var.AUTOTUNE_LOG, encode=absolute_path,
           help="rank 0 logs every trial to this CSV file", env_doc="(made absolute)",
           doc_table="engine"),
    Option(("--autotune-warmup-samples",), "autotune_warmup_samples", "autotune", "int",
           metavar="N", config_key="autotune.warmup_samples",
           variable=var.AUTOTUNE_WARMUP_SAMPLES,
           help="steps after each change that are not measured", doc_table="engine"),
    Option(("--autotune-steps-per-sample",), "autotune_steps_per_sample", "autotune", "int",
           metavar="N", config_key="autotune.steps_per_sample",
           variable=var.AUTOTUNE_STEPS_PER_SAMPLE, help="measured steps per tried setting",
           doc_table="engine"),
    Option(("--autotune-bayes-opt-max-samples",), "autotune_bayes_opt_max_samples", "autotune",
           "int", metavar="N", config_key="autotune.bayes_opt_max_samples", bounds=NON_NEGATIVE,
           inert=var.AUTOTUNE_BAYES_OPT_MAX_SAMPLES.why, doc_table="inert"),
    Option(("--autotune-gaussian-process-noise",), "autotune_gaussian_process_noise",
           "autotune", "float", metavar="X", config_key="autotune.gaussian_process_noise",
           bounds=Bounds(low=0, high=1),
           inert=var.AUTOTUNE_GAUSSIAN_PROCESS_NOISE.why, doc_table="inert"),
    # ------------------------------------------------------------------ elastic
    Option(("--min-np", "--min-num-proc"), "min_np", "elastic", "int", metavar="N",
           bounds=AT_LEAST_ONE, makes_elastic=True,
           help="fewest workers the job may train with", default_doc="-np",
           elastic_doc="fewest workers the job may train with", elastic_default="`-np`"),
    Option(("--max-np", "--max-num-proc"), "max_np", "elastic", "int", metavar="N",
           bounds=AT_LEAST_ONE, makes_elastic=True,
           help="most workers the job may train with", default_doc="every slot available",
           elastic_doc="most workers; extra slots stay unused", elastic_default="unbounded"),
    Option(("--slots-per-host", "--slots"), "slots", "elastic", "int", metavar="N",
           bounds=AT_LEAST_ONE, elastic_only=True, default_doc="1",
           help="slots of a host the discovery script names without :N",
           elastic_doc="slots of a discovered host printed without `:slots`",
           elastic_default="1"),
    Option(("--elastic-timeout",), "elastic_timeout", "elastic", "float", metavar="S",
           bounds=POSITIVE, elastic_only=True,
           default_doc=f"{var.ELASTIC_TIMEOUT.env}, else "
           f"{number_text(var.ELASTIC_TIMEOUT.default)}",
           help="seconds to wait for enough slots, and workers for a round",
           elastic_doc="how long the job may wait for `-np` slots at the start, or for "
           "`--min-np` slots after a change",
           elastic_default=number_text(var.ELASTIC_TIMEOUT.default)),
    Option(("--reset-limit",), "reset_limit", "elastic", "int", metavar="N",
           bounds=NON_NEGATIVE, elastic_only=True, default_doc="no limit",
           help="most times the job may re-form after its first round",
           elastic_doc="most re-formations (rounds after the first, host changes included) "
           "before the job stops", elastic_default="unlimited"),
    Option(("--blacklist-cooldown-range",), "blacklist_cooldown_range", "elastic", "pair",
           metavar=("LO", "HI"), bounds=Bounds(low=1, high=3600), elastic_only=True,
           default_doc="for good",
           help="seconds a failed host stays out, growing from LO to HI",
           elastic_doc="a failed host returns after `LO * 2^k + random(0, LO)` seconds, kept "
           "within [LO, HI], k = its earlier failures", elastic_default="blacklisted for good"),
    # ------------------------------------------------------------------ timeline
    Option(("--timeline-filename",), "timeline_filename", "timeline", "text", metavar="FILE",
           config_key="timeline.filename", variable=var.TIMELINE, encode=absolute_path,
           help="write a timeline: rank 0 to FILE, rank r to FILE.rank<r>, merged into FILE at "
           "the end; see docs/profiling.md",
           env_doc="(made absolute); see [profiling.md](profiling.md#recording-a-timeline)",
           doc_table="engine"),
    _switch("--timeline-mark-cycles", opposite=("--no-timeline-mark-cycles",), group="timeline",
            config_key="timeline.mark_cycles", variable=var.TIMELINE_MARK_CYCLES,
            encode=one_if_true, help="mark every negotiation cycle in the timeline",
            doc_table="engine"),
    # ------------------------------------------------------------------ live metrics
    Option(("--metrics",), "metrics", "metrics", "text", metavar="SPEC",
           config_key="metrics.spec", variable=var.METRICS, encode=metrics_spec, hora=True,
           help="publish live metrics per rank and step: tensorboard:DIR and/or "
           "prometheus:PORT, comma-separated; see docs/profiling.md",
           env_doc="(directories made absolute); see "
           "[profiling.md](profiling.md#live-metrics-tensorboard-and-prometheus)",
           doc_table="engine"),
    Option(("--metrics-ranks",), "metrics_ranks", "metrics", "text", metavar="RANKS",
           config_key="metrics.ranks", variable=var.METRICS_RANKS, hora=True,
           help="which ranks publish live metrics: all, or a list such as 0 or 0,4",
           doc_table="engine"),
    Option(("--metrics-addr",), "metrics_addr", "metrics", "text", metavar="ADDR",
           config_key="metrics.addr", variable=var.METRICS_ADDR, hora=True,
           help="the address Prometheus endpoints bind", doc_table="engine"),
    # ------------------------------------------------------------------ stall check
    _switch("--no-stall-check", dest="stall_check", stores=False, opposite=("--stall-check",),
            group="stall", config_key="stall_check.enabled", variable=var.STALL_CHECK_DISABLE,
            encode=one_if_false, help="turn the stall inspector off", doc_table="engine"),
    Option(("--stall-check-warning-time-seconds",), "stall_check_warning_time_seconds", "stall",
           "float", metavar="S", config_key="stall_check.warning_time_seconds",
           variable=var.STALL_CHECK_TIME_SECONDS, help="warn after a stall this long",
           doc_table="engine"),
    Option(("--stall-check-shutdown-time-seconds",), "stall_check_shutdown_time_seconds",
           "stall", "float", metavar="S", config_key="stall_check.shutdown_time_seconds",
           variable=var.STALL_SHUTDOWN_TIME_SECONDS, bounds=NON_NEGATIVE,
           help="end the job after a stall this long (0 waits forever)", doc_table="engine"),
    # ------------------------------------------------------------------ library options
    _switch("--mpi-threads-disable", opposite=("--no-mpi-threads-disable",), group="library",
            config_key="library_options.mpi_threads_disable",
            inert=var.MPI_THREADS_DISABLE.why, doc_table="inert"),
    Option(("--mpi-args",), "mpi_args", "library", "text", metavar="ARGS",
           help="extra arguments for mpirun (with --mpi)",
           doc="With `--mpi`: extra arguments for `mpirun`, as one string (`--mpi-args=\"--mca "
           "btl_tcp_if_include eth0\"`). Without `--mpi` it has no effect.",
           doc_table="general"),
    _switch("--tcp", group="library", sets=(("NCCL_IB_DISABLE", "1"),),
            help="turn InfiniBand off for NCCL (hora's CUDA path and your script's)",
            inert="Gloo's and the store's traffic is TCP already; NCCL_IB_DISABLE=1 is set for "
            "NCCL.",
            env_doc=", as `horovodrun` sets it; NCCL then uses sockets. Gloo's traffic is TCP "
            "already.",
            doc_table="engine"),
    Option(("--binding-args",), "binding_args", "library", "text", metavar="ARGS",
           help="mpirun's process binding arguments (with --mpi; default: --bind-to none)",
           doc="With `--mpi`: `mpirun`'s binding arguments in place of Open MPI's `--bind-to "
           "none`, which `horarun` passes so that PyTorch's threads may use every core. Without "
           "`--mpi` it has no effect.", doc_table="general"),
    Option(("--num-nccl-streams",), "num_nccl_streams", "library", "int", metavar="N",
           config_key="library_options.num_nccl_streams", bounds=NON_NEGATIVE,
           inert=var.NUM_NCCL_STREAMS.why, doc_table="inert"),
    Option(("--thread-affinity",), "thread_affinity", "library", "text", metavar="CORES",
           config_key="library_options.thread_affinity",
           inert=var.THREAD_AFFINITY.why, doc_table="inert"),
    Option(("--gloo-timeout-seconds",), "gloo_timeout_seconds", "library", "float",
           metavar="S", config_key="library_options.gloo_timeout_seconds",
           variable=var.GLOO_TIMEOUT_SECONDS, help="seconds ranks wait for each other",
           doc_table="engine"),
    # ------------------------------------------------------------------ logging
    Option(("--log-level",), "log_level", "logging", "level", metavar="LEVEL",
           config_key="logging.level", variable=var.LOG_LEVEL, help="hora's log level",
           env_doc=f"({', '.join(f'`{level}`' for level in var.LOG_LEVELS)})",
           doc_table="engine"),
    _switch("--log-without-timestamp", "--log-hide-timestamp", dest="log_with_timestamp",
            stores=False, opposite=("--log-with-timestamp", "--no-log-hide-timestamp"),
            group="logging", config_key="logging.with_timestamp", variable=var.LOG_HIDE_TIME,
            encode=one_if_false, help="leave the time out of hora's log lines",
            doc_table="engine"),
    _switch("-prefix-timestamp", "--prefix-output-with-timestamp", group="logging",
            help="start each forwarded output line with the time",
            doc="Start each forwarded line with the time.", doc_table="general"),
    # ------------------------------------------------------------------ hosts
    Option(("-H", "--hosts"), "hosts", "hosts", "text", metavar="HOSTS",
           help="hosts and slots, e.g. node1:4,node2:4 (default: localhost:NP)",
           doc="Hosts and slots, as `host:slots[,host:slots...]`. A bare name means one slot. "
           "Default: `localhost:N`.", doc_table="general"),
    Option(("-hostfile", "--hostfile"), "hostfile", "hosts", "text", metavar="FILE",
           help="file with one `host slots=N` per line",
           doc="Hosts from a file; see [Hostfile](#hostfile). Not together with `-H`.",
           doc_table="general"),
    Option(("--host-discovery-script",), "host_discovery_script", "hosts", "text",
           metavar="PATH", makes_elastic=True,
           help="(elastic) executable printing the available hosts, one `host` or `host:slots` "
           "a line; run every second",
           elastic_doc="executable printing the hosts available now, one `host` or `host:slots` "
           "per line; run every second", elastic_default="hosts from `-H`/`--hostfile`"),
    # ------------------------------------------------------------------ controller
    _switch("--gloo", group="controller", config_key="controller: gloo",
            variable=var.CPU_OPERATIONS, encode=lambda _on: "gloo",
            help="start the workers with horarun (default); CPU data goes through shared memory "
            "within a host, over Gloo across hosts",
            doc="`horarun` starts the workers itself (over SSH on other hosts), not through "
            "`mpirun`: the default. Ranks of one host move the data of CPU tensors and negotiate "
            "through shared memory (`HORA_SHARED_MEMORY`), ranks on different hosts over Gloo.",
            doc_table="general"),
    _switch("--mpi", group="controller", config_key="controller: mpi",
            variable=var.CPU_OPERATIONS, encode=lambda _on: "mpi",
            help="start the job with mpirun; the workers negotiate and move CPU data over MPI",
            doc="Start the job through `mpirun` (Open MPI's or MPICH's, the first on `PATH`): "
            "`horarun` runs one `mpirun` command built from its flags and waits for it. The "
            "workers negotiate and move the data of CPU tensors over MPI (mpi4py). Needs mpi4py "
            "built for that MPI; not for elastic jobs. See [MPI](#mpi).", doc_table="general"),
    _switch("--jsrun", group="controller",
            refused="--jsrun is not available: hora does not launch through LSF's jsrun.",
            doc_table="refused"),
)  # fmt: skip

BY_DEST: dict[str, Option] = {option.dest: option for option in OPTIONS}
