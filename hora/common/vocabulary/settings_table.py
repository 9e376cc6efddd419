"""Every ``HORA_*`` environment variable hora reads, declared once.

Each :class:`Variable` holds one variable's facts: its name, whether a ``HOROVOD_*`` twin is
read too, how its value is parsed, its default, the range it must lie in, and the sentence that
describes it in docs/environment.md. The readers (:mod:`hora.common.vocabulary.config`), ``horarun``'s flags
(:mod:`hora.runner.flags`, which name the variable each flag sets) and the generated tables of
docs/environment.md (``python -m hora.tools.docs_tables``) all take these facts from here.

Pure data: this module imports nothing of hora, and no third-party package.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

# A variable's value type. Covariant: a ``Variable[int]`` is a ``Variable[object]`` (the table
# of every variable), as the declarations are frozen and only read.
T_co = TypeVar("T_co", covariant=True)

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


def parse_bool(raw: str) -> bool:
    """``1``/``0``, ``true``/``false``, ``yes``/``no``, ``on``/``off`` (any case); a number > 0 is
    true. Raises ValueError for anything else (``inf`` and ``nan`` too)."""
    lowered = raw.strip().lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    return parse_int(lowered) > 0


def parse_int(raw: str) -> int:
    """A whole number, also written as a float (``1e6``; a fraction is cut off). Raises
    ValueError for anything else, ``inf`` and ``nan`` included."""
    try:
        return int(raw)
    except ValueError:
        value = float(raw)
    if not math.isfinite(value):
        raise ValueError(raw)  # int() of it would raise OverflowError, which callers miss
    return int(value)


def parse_number(raw: str) -> float:
    """A number (``0.5``, ``1e3``; ``inf`` too, which the reader refuses as not finite, see
    :class:`Bounds`). Raises ValueError for anything else, ``nan`` included."""
    value = float(raw)
    if math.isnan(value):
        raise ValueError(raw)
    return value


@dataclass(frozen=True)
class Kind(Generic[T_co]):
    """How a variable's text becomes a value.

    Attributes:
        expected: what the text must be, for error messages (``an integer``).
        parse: text to value; raises ValueError for text it cannot use.
    """

    expected: str
    parse: Callable[[str], T_co]


INTEGER: Kind[int] = Kind("an integer", parse_int)
NUMBER: Kind[float] = Kind("a number", parse_number)
BOOLEAN: Kind[bool] = Kind("0 or 1", parse_bool)
TEXT: Kind[str] = Kind("text", str)
LEVEL: Kind[str] = Kind("a log level", str.upper)
# One of a variable's choices, in any case (``MPI``: ``mpi``).
CHOICE: Kind[str] = Kind("text", lambda text: text.strip().lower())
OPTIONAL_TEXT: Kind[str | None] = Kind("text", str)
OPTIONAL_INTEGER: Kind[int | None] = Kind("an integer", parse_int)
OPTIONAL_BOOLEAN: Kind[bool | None] = Kind("0 or 1", parse_bool)


def parse_file_mode(raw: str) -> int:
    """Permission bits in octal (``600``, ``0640``, ``0o644``). Raises ValueError for anything
    else, or for bits beyond ``777``."""
    text = raw.strip().lower().removeprefix("0o")
    value = int(text, 8)
    if not 0 <= value <= 0o777:
        raise ValueError(raw)
    return value


FILE_MODE_KIND: Kind[int] = Kind("octal permission bits such as 600 or 640", parse_file_mode)


def _shown(number: float) -> str:
    """A bound as messages show it: whole numbers in full (``1099511627776``, not ``1.1e+12``)."""
    return str(int(number)) if float(number).is_integer() else f"{number:g}"


@dataclass(frozen=True)
class Bounds:
    """The range a number must lie in: ``low <= value`` (``low < value`` when ``low_open``) and
    ``value <= high``; ``None`` leaves that side open. Only finite numbers lie in a range:
    hora's numbers are sizes, counts and times that it computes with, and an infinite one
    overflows there (``timedelta(seconds=inf)``) instead of meaning "never". ``nan`` lies in
    none."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False

    def allows(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def describe(self) -> str:
        """``>= 0``, ``> 0``, ``<= 9``, or ``between 0 and 1``."""
        if self.low is not None and self.high is not None and not self.low_open:
            return f"between {_shown(self.low)} and {_shown(self.high)}"
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {_shown(self.low)}")
        if self.high is not None:
            parts.append(f"<= {_shown(self.high)}")
        return " and ".join(parts)


NON_NEGATIVE = Bounds(low=0)
POSITIVE = Bounds(low=0, low_open=True)
AT_LEAST_ONE = Bounds(low=1)

# Which table of docs/environment.md lists a variable; ``None``: none does (another variable's
# row names it as also read).
Table = Literal["settings", "launcher", "elastic", None]


@dataclass(frozen=True)
class Variable(Generic[T_co]):
    """One environment variable: ``HORA_<name>``, and ``HOROVOD_<name>`` when ``horovod``.

    Attributes:
        name: the name without its prefix (``FUSION_THRESHOLD``).
        kind: how the text is parsed.
        default: the value when neither name is set (``None``: unset).
        meaning: what it does, one or more sentences (docs/environment.md's "Meaning").
        horovod: whether ``HOROVOD_<name>`` is read when ``HORA_<name>`` is not set.
        bounds: the range the value must lie in, if any.
        choices: the values allowed, if only some are.
        unit: the unit of a number, for messages (``bytes``).
        default_doc: the default as docs/environment.md shows it, when the value alone does not
            say it well (``unset: detected``).
        also_read: other variables read for the same setting, named in the docs.
        table: which table of docs/environment.md lists it (``None``: only named as also read).
        lacking: for a variable with ``choices``, what hora does when its Horovod twin holds a
            value of Horovod's that is not among them (``HOROVOD_CPU_OPERATIONS=ccl``): the twin
            then counts as unset, and ``hvd.init()`` names it with this sentence. Without it,
            such a value is an error, as it is under the ``HORA_`` name.
        agreed: every rank must hold the same value, or the ranks would choose different
            paths or plan different collectives, and wait for each other in vain;
            ``hvd.init()`` compares it across ranks
            (:func:`hora.common.startup.wiring.agree_on_settings`).
    """

    name: str
    kind: Kind[T_co]
    default: T_co
    meaning: str
    horovod: bool = True
    bounds: Bounds | None = None
    choices: tuple[str, ...] = ()
    unit: str = ""
    default_doc: str = ""
    also_read: tuple[str, ...] = ()
    table: Table = "settings"
    lacking: str = ""
    agreed: bool = False

    @property
    def env(self) -> str:
        """The ``HORA_`` name."""
        return "HORA_" + self.name

    @property
    def horovod_env(self) -> str | None:
        """The ``HOROVOD_`` twin, or ``None`` when there is none."""
        return "HOROVOD_" + self.name if self.horovod else None

    @property
    def environ_names(self) -> tuple[str, ...]:
        """The variables read, in order: ``HORA_<name>``, then its Horovod twin if it has one."""
        twin = self.horovod_env
        return (self.env, twin) if twin else (self.env,)

    @property
    def names(self) -> str:
        """``HORA_X (or HOROVOD_X)``, for messages."""
        twin = self.horovod_env
        return f"{self.env} (or {twin})" if twin else self.env

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is out of range or not allowed, or ``None`` when it is fine (an
        optional variable left unset, ``None``, is fine)."""
        if value is None:
            return None
        if self.choices and value not in self.choices:
            return f"{self.env} must be one of {', '.join(self.choices)}; got {value!r}."
        if isinstance(value, float) and not math.isfinite(value):
            rule = f" {self.bounds.describe()}" if self.bounds is not None else ""
            unit = f" {self.unit}" if self.unit and rule else ""
            return f"{self.env} must be a finite number{rule}{unit}, got {value!r}."
        if self.bounds is not None and not self.bounds.allows(value):
            unit = f" {self.unit}" if self.unit else ""
            return f"{self.env} must be {self.bounds.describe()}{unit}, got {value!r}."
        return None


_PROFILING = "[docs/profiling.md](profiling.md)"
# Said in the meaning of every variable declared ``agreed``.
_SAME_ON_EVERY_RANK = (
    "Set it alike on every rank: `hvd.init()` compares it across ranks and stops, naming the "
    "ranks, where it differs."
)
# Shared-memory slots and arenas lie on page boundaries (hora/common/transport/shm_segment.py):
# their sizes are rounded up to a multiple of this.
SHM_PAGE_BYTES = 4096
# The largest slot or arena, 1 TiB. Every rank of a host maps every member's slot and arena,
# so a host's ranks need their number times (slot + arena) of address space (a process has
# 128 TiB on x86-64), and an arena buffer's offset is kept as a 32-bit count of pages (8 TiB).
# A size under this limit that /dev/shm has no room for falls back to Gloo and says why; one
# over it (``1e16``, say) is a typo, refused at ``hvd.init()``.
SHM_MAX_BYTES = 1 << 40
# HORA_TIMELINE's value that asks for no file at init, only for hvd.start_timeline() later.
TIMELINE_DYNAMIC = "DYNAMIC"

# ---------------------------------------------------------------- engine and worker settings

FUSION_THRESHOLD = Variable(
    "FUSION_THRESHOLD", INTEGER, 128 * 1024 * 1024,
    f"Largest fused allreduce buffer, in bytes. `0` turns fusion off. {_SAME_ON_EVERY_RANK}",
    bounds=NON_NEGATIVE, unit="bytes", default_doc="`134217728` (128 MiB)", agreed=True,
)  # fmt: skip
CYCLE_TIME = Variable(
    "CYCLE_TIME", NUMBER, 1.0,
    "Negotiation cycle time, in ms. A rank with nothing new waits up to this long before it "
    "joins the next cycle. A rank with new work starts a cycle at once.",
    bounds=NON_NEGATIVE, unit="milliseconds",
)  # fmt: skip
CARRY_THRESHOLD = Variable(
    "CARRY_THRESHOLD", INTEGER, 1024,
    "Allreduces of CPU tensors up to this many bytes travel inside the negotiation exchange and "
    "are reduced on every rank, saving a second round trip. `0` turns it off. See "
    "[docs/engine.md](engine.md#small-allreduces-one-round-trip).",
    bounds=Bounds(0, 4096), unit="bytes", horovod=False,
)  # fmt: skip
CACHE_CAPACITY = Variable(
    "CACHE_CAPACITY", INTEGER, 1024,
    "Response cache entries: how many repeated ops travel as one bit each. `0` turns the cache "
    f"off. {_SAME_ON_EVERY_RANK}",
    bounds=NON_NEGATIVE, unit="entries", agreed=True,
)  # fmt: skip
STALL_CHECK_DISABLE = Variable(
    "STALL_CHECK_DISABLE", BOOLEAN, False, "`1` turns off the stall inspector."
)
STALL_CHECK_TIME_SECONDS = Variable(
    "STALL_CHECK_TIME_SECONDS", NUMBER, 60.0,
    "Warn when some ranks have waited this long for others to submit a tensor.",
    bounds=POSITIVE, unit="seconds",
)  # fmt: skip
# Never, as in Horovod: a rank busy on its own (an evaluation or a checkpoint on rank 0 alone)
# may keep the others waiting as long as it takes. A job that cannot move at all still ends: the
# deadlock check (every rank waits for a collective another rank has not submitted, and nothing
# changed for HORA_GLOO_TIMEOUT_SECONDS) does not depend on this limit.
STALL_SHUTDOWN_TIME_SECONDS = Variable(
    "STALL_SHUTDOWN_TIME_SECONDS", NUMBER, 0.0,
    "End the job after a stall this long, with an error that names the tensors and the missing "
    "ranks. `0` (the default, as in Horovod) never ends it for a stall, so one rank may work "
    "alone (say, evaluate on rank 0) for as long as it needs; a deadlock, where every rank "
    "waits for a collective that another rank has not submitted, still ends the job after "
    "`HORA_GLOO_TIMEOUT_SECONDS`. A value below the check time is ignored, with a warning. See "
    "[docs/engine.md](engine.md#the-stall-inspector).",
)  # fmt: skip
GLOO_TIMEOUT_SECONDS = Variable(
    "GLOO_TIMEOUT_SECONDS", NUMBER, 30.0,
    "How long ranks wait for each other to connect in `hvd.init()`, and how long one collective "
    "may wait for a peer that has started it too. Waiting for a rank busy elsewhere has no such "
    "limit.",
    bounds=POSITIVE, unit="seconds",
)  # fmt: skip
DYNAMIC_PROCESS_SETS = Variable(
    "DYNAMIC_PROCESS_SETS", BOOLEAN, False,
    "`1` allows `add_process_set`/`remove_process_set` after `init()`.",
)  # fmt: skip
TIMELINE = Variable(
    "TIMELINE", OPTIONAL_TEXT, None,
    "Write a timeline: rank 0 to this file, rank r to the same name with `.rank<r>` before its "
    "extension (`timeline.json` → `timeline.rank1.json`), merged into the file at a normal end."
    f" `{TIMELINE_DYNAMIC}` (Horovod's word) writes none until "
    f"`hvd.start_timeline()`. See {_PROFILING}.",
)  # fmt: skip
TIMELINE_MARK_CYCLES = Variable(
    "TIMELINE_MARK_CYCLES", BOOLEAN, False, "`1` marks every negotiation cycle in the timeline."
)
METRICS = Variable(
    "METRICS", OPTIONAL_TEXT, None,
    "Publish live metrics per rank and step: `tensorboard:DIR` (event files in `DIR/rank<r>`) "
    "and/or `prometheus:PORT` (rank r serves `PORT` + its local rank), separated by a comma. "
    "Needs `pip install 'hora[metrics]'`. See "
    "[docs/profiling.md](profiling.md#live-metrics-tensorboard-and-prometheus).",
    horovod=False,
)  # fmt: skip
METRICS_RANKS = Variable(
    "METRICS_RANKS", TEXT, "all",
    "Which ranks publish live metrics: `all`, or a list such as `0` or `0,4`.",
    horovod=False,
)  # fmt: skip
METRICS_ADDR = Variable(
    "METRICS_ADDR", TEXT, "127.0.0.1",
    "The address the Prometheus endpoints of `HORA_METRICS` bind (`0.0.0.0`: every interface).",
    horovod=False,
)  # fmt: skip
METRICS_REQUIRED = Variable(
    "METRICS_REQUIRED", BOOLEAN, False,
    "`1` makes a metrics sink that cannot open (its port taken, its directory not writable) "
    "stop the job at `hvd.init()`. By default the job runs on without that sink and the rank "
    "logs why, once.",
    horovod=False,
)  # fmt: skip
FILE_MODE = Variable(
    "FILE_MODE", FILE_MODE_KIND, 0o600,
    "Permission bits (octal) of the files hora writes: timelines, `--output-filename` logs, "
    "metrics event files, the autotune log, the outputs of `hora timeline` and `hora bench`. "
    "They hold the job's data, so only their owner may read them by default; `640` or `644` "
    "shares them. See [docs/security.md](security.md#files-hora-writes).",
    horovod=False, default_doc="`600`",
)  # fmt: skip
AUTOTUNE = Variable(
    "AUTOTUNE", BOOLEAN, False,
    "`1` tries batch sizes for the steady state online and keeps the fastest; see "
    f"[docs/profiling.md](profiling.md#autotune). {_SAME_ON_EVERY_RANK}",
    agreed=True,
)  # fmt: skip
AUTOTUNE_LOG = Variable(
    "AUTOTUNE_LOG", OPTIONAL_TEXT, None, "Rank 0 logs every autotune trial to this CSV file."
)
AUTOTUNE_WARMUP_SAMPLES = Variable(
    "AUTOTUNE_WARMUP_SAMPLES", INTEGER, 3,
    "Steps after each autotune change that are not measured.",
    bounds=NON_NEGATIVE, unit="steps",
)  # fmt: skip
AUTOTUNE_STEPS_PER_SAMPLE = Variable(
    "AUTOTUNE_STEPS_PER_SAMPLE", INTEGER, 10, "Measured steps per tried setting.",
    bounds=AT_LEAST_ONE, unit="steps",
)  # fmt: skip
STEADY_STATE = Variable(
    "STEADY_STATE", BOOLEAN, True,
    "Replay a repeating sequence of allreduces (a training step) without negotiating each one; "
    "a deviation falls back to negotiation. `0` negotiates every op. See "
    "[docs/engine.md](engine.md#the-steady-state-replaying-a-training-step). "
    f"{_SAME_ON_EVERY_RANK}",
    horovod=False, agreed=True,
)  # fmt: skip
DISABLE_GROUP_FUSION = Variable(
    "DISABLE_GROUP_FUSION", BOOLEAN, False,
    f"`1` fuses the tensors of a grouped op only with each other. {_SAME_ON_EVERY_RANK}",
    agreed=True,
)  # fmt: skip
DETERMINISTIC = Variable(
    "DETERMINISTIC", BOOLEAN, False,
    "`1` makes every `hvd.DistributedOptimizer` built without `deterministic=` combine gradients "
    "in one fixed order over `HORA_DETERMINISTIC_MICROBATCHES` micro-batches: the same bits at "
    "every world size that divides that number. The script runs its steps in micro-batches; "
    f"see [docs/deterministic.md](deterministic.md). {_SAME_ON_EVERY_RANK}",
    horovod=False, agreed=True,
)  # fmt: skip
DETERMINISTIC_MICROBATCHES = Variable(
    "DETERMINISTIC_MICROBATCHES", OPTIONAL_INTEGER, None,
    "K of deterministic mode, the micro-batches every step is cut into, for optimizers built "
    "without `microbatches=`; the job's world size must divide it. See "
    f"[docs/deterministic.md](deterministic.md). {_SAME_ON_EVERY_RANK}",
    bounds=AT_LEAST_ONE, default_doc="unset", horovod=False, agreed=True,
)  # fmt: skip
LOG_LEVEL = Variable(
    "LOG_LEVEL", LEVEL, "WARNING",
    "`TRACE`, `DEBUG`, `INFO`, `WARNING`, `ERROR` or `FATAL`. hora logs to stderr as "
    "`[time LEVEL hora rank N] message`.",
    choices=LOG_LEVELS,
)  # fmt: skip
LOG_HIDE_TIME = Variable(
    "LOG_HIDE_TIME", BOOLEAN, False, "`1` leaves the timestamp out of hora's log lines."
)
CPU_OPERATIONS = Variable(
    "CPU_OPERATIONS", CHOICE, "gloo",
    "Which library moves the data of collectives on CPU tensors, and the negotiation between "
    "ranks: `gloo` (ranks of one host then exchange through shared memory, see "
    "`HORA_SHARED_MEMORY`; Gloo across hosts), or `mpi` (mpi4py, for jobs started by `mpirun`/`mpiexec` or `horarun "
    "--mpi`). When neither name is set, Horovod's `HOROVOD_CONTROLLER` (`gloo` or `mpi`) "
    "chooses: hora negotiates over the library that moves the data. See "
    f"[docs/deployment.md](deployment.md#choosing-a-data-path). {_SAME_ON_EVERY_RANK}",
    choices=("gloo", "mpi"), also_read=("HOROVOD_CONTROLLER",), agreed=True,
    lacking="hora has no oneCCL path: CPU tensors go over the library `HOROVOD_CONTROLLER` "
    "names, else Gloo.",
)  # fmt: skip
SHARED_MEMORY = Variable(
    "SHARED_MEMORY", BOOLEAN, True,
    "`1` (the default): ranks of a process set that share a host move data and negotiate "
    "through shared memory (`/dev/shm`); only what crosses hosts goes over the network. `0`: "
    "every byte over Gloo. See [docs/deployment.md](deployment.md#choosing-a-data-path). "
    f"{_SAME_ON_EVERY_RANK}",
    horovod=False, agreed=True,
)  # fmt: skip
FAST_PATH = Variable(
    "FAST_PATH",
    BOOLEAN,
    True,
    "`1` (the default): a synchronous allreduce (grouped or not), broadcast or barrier of CPU "
    "tensors on a process set whose ranks all share one host runs on the calling thread, "
    "straight on shared memory, when every rank of the set makes the same call at the same "
    "place in its sequence of calls on the set (an asynchronous allreduce of one tensor of "
    "at most 1 MiB too, run when its handle is waited for); any other call, or a call some "
    "rank makes differently, goes through the engine. `0`: every call goes through the engine (to "
    "compare, or to rule the fast path out); see "
    "[docs/engine.md](engine.md#the-fast-path-synchronous-calls-on-the-callers-thread). "
    f"{_SAME_ON_EVERY_RANK}",
    horovod=False,
    agreed=True,
)
SHM_SLOT_BYTES = Variable(
    "SHM_SLOT_BYTES", INTEGER, 16 * 1024 * 1024,
    "Shared memory each rank maps per process set, in bytes (negotiation takes 1 MiB more); "
    "a host's ranks together map this times their number, per set. Collectives larger than a "
    f"slot run in slot-sized chunks. From `65536` (64 KiB) to `{SHM_MAX_BYTES}` (1 TiB), rounded "
    f"up to a multiple of {SHM_PAGE_BYTES} (a page). {_SAME_ON_EVERY_RANK}",
    bounds=Bounds(low=64 * 1024, high=SHM_MAX_BYTES), unit="bytes", horovod=False,
    default_doc="`16777216` (16 MiB)", agreed=True,
)  # fmt: skip
SHM_ARENA_BYTES = Variable(
    "SHM_ARENA_BYTES", INTEGER, 1024 * 1024 * 1024,
    "Shared memory each rank may keep, per process set of one host, for the buffers of "
    "collectives that repeat (the steady state's fused gradients), which are then reduced "
    "where they lie, without copies. Address space only: pages are reserved as buffers are "
    "made, and they are the memory those buffers would take anyway. A buffer that does not "
    "fit, or finds /dev/shm full, is made in the process's own memory. `0` turns it off. At "
    f"most `{SHM_MAX_BYTES}` (1 TiB), rounded up to a multiple of {SHM_PAGE_BYTES} (a page). "
    f"{_SAME_ON_EVERY_RANK}",
    bounds=Bounds(low=0, high=SHM_MAX_BYTES), unit="bytes", horovod=False,
    default_doc="`1073741824` (1 GiB)", agreed=True,
)  # fmt: skip
HIERARCHICAL_ALLREDUCE = Variable(
    "HIERARCHICAL_ALLREDUCE", OPTIONAL_BOOLEAN, None,
    "For a process set that spans hosts with the same number of its ranks on each: `1` "
    "reduces within each host through shared memory, across hosts over Gloo (one shard per "
    "local rank), and shares the result within each host; `0` reduces over one Gloo group of "
    f"every rank. Unset: hierarchical where it applies. {_SAME_ON_EVERY_RANK}",
    default_doc="unset: hierarchical", agreed=True,
)  # fmt: skip
GRADIENT_COMPRESSION = Variable(
    "GRADIENT_COMPRESSION", CHOICE, "none",
    "How a `DistributedOptimizer` (PyTorch, TensorFlow, Keras) or `DistributedGradientTape` "
    "built with `compression=hvd.Compression.none` (the default) sends gradients: `none`, "
    "`fp16` or `bf16` (floating-point gradients travel as that type and are cast back). One "
    "built with another compressor keeps it. Compress where the links between hosts limit the "
    "step; see [docs/cluster.md](cluster.md#when-to-compress). "
    f"{_SAME_ON_EVERY_RANK}",
    choices=("none", "fp16", "bf16"), horovod=False, agreed=True,
)  # fmt: skip
HIERARCHICAL_ALLGATHER = Variable(
    "HIERARCHICAL_ALLGATHER", OPTIONAL_BOOLEAN, None,
    "Read so that Horovod's setting is not silently dropped: hora's allgather across hosts "
    "runs over one Gloo group (within a host, through shared memory); `1` is named once at "
    "`hvd.init()`.",
)  # fmt: skip
GPU_OPERATIONS = Variable(
    "GPU_OPERATIONS", CHOICE, "nccl",
    "How collectives on CUDA tensors move their data: `nccl` (a NCCL group per process set, "
    "buffers stay on the GPU; where this torch has no NCCL, hora uses `host`), or `host` "
    "(copied to host memory and through the CPU data path). Negotiation stays on the CPU path "
    "either way. See [docs/deployment.md](deployment.md#choosing-a-data-path). "
    f"{_SAME_ON_EVERY_RANK}",
    choices=("nccl", "host"), agreed=True,
    lacking="hora has no CUDA-aware MPI path: CUDA tensors go over NCCL "
    "(`HORA_GPU_OPERATIONS=host` moves them through host memory and the CPU data path instead).",
)  # fmt: skip
ENABLE_NVTX = Variable(
    "ENABLE_NVTX", BOOLEAN, False,
    "`1` marks hora's phases (negotiation, fusion copies, each collective) as NVTX ranges, which "
    "`nsys profile` shows next to your own. Without CUDA it does nothing. Horovod marks its "
    "ranges unless `HOROVOD_DISABLE_NVTX_RANGES=1`; hora marks none unless this is `1`. See "
    "[docs/profiling.md](profiling.md#nsys).",
    horovod=False,
)  # fmt: skip
GLOO_IFACE = Variable(
    "GLOO_IFACE", OPTIONAL_TEXT, None,
    "Network interface for Gloo's connections, e.g. `eth1` (of a comma-separated list such as "
    "`eth1,eth2`, the first). When unset and every rank runs on "
    "this host, Gloo uses loopback (`127.0.0.1`); in a multi-host job `horarun` gives each worker "
    "the interface through which its host reaches the launcher (or the one named by "
    "`--network-interface`).",
    also_read=("GLOO_SOCKET_IFNAME",),
)  # fmt: skip
GC_FREEZE = Variable(
    "GC_FREEZE", BOOLEAN, True,
    "`1` (the default): `hvd.init()` pauses Python's cyclic garbage collector while it joins "
    "the job, then moves every object alive at that point out of its reach (`gc.freeze()`), so "
    "later full collections no longer walk torch's objects on one rank while the others wait. "
    "`0` leaves the collector alone. See [docs/training.md](training.md#pythons-garbage-collector).",
    horovod=False,
)  # fmt: skip
START_TIMEOUT = Variable(
    "START_TIMEOUT", NUMBER, 30.0,
    "Seconds a worker (`hvd.init()`, or a `hora.run` worker fetching its function) may take to "
    "reach the job's rendezvous store; `hvd.init()` also waits this long (or "
    "`HORA_GLOO_TIMEOUT_SECONDS`, if longer) for every rank to reach it.",
)  # fmt: skip
LAUNCHER_TIMEOUT_SECONDS = Variable(
    "LAUNCHER_TIMEOUT_SECONDS", NUMBER, 60.0,
    "Read by `horarun` and `hora.run`, not by `hvd.init()`. The launcher tells each worker's "
    "watchdog that it is alive once a second; a watchdog that hears nothing for this long (the "
    "launcher is stopped, say by `SIGSTOP` or Ctrl-Z, or hung, or its host is unreachable) stops "
    "its worker. See [docs/errors.md](errors.md#the-launcher-is-killed-or-stopped).",
    bounds=POSITIVE, unit="seconds", horovod=False,
)  # fmt: skip
LAUNCHER = Variable(
    "LAUNCHER", OPTIONAL_TEXT, None,
    "Which launcher's variables `hvd.init()` reads: `horarun`, `torchrun`, `mpi`, `slurm`, `env` "
    "or `none`. Set it only when one launcher starts another on purpose and hora's choice is "
    "wrong; see [docs/deployment.md](deployment.md#when-launchers-disagree).",
    horovod=False, default_doc="unset: detected",
)  # fmt: skip
MPI4PY = Variable(
    "MPI4PY", BOOLEAN, True,
    "Under `mpirun`/`mpiexec`, `0` stops rank 0 from sending the store's address and a fresh "
    "secret with mpi4py.",
    horovod=False,
)  # fmt: skip

# ---------------------------------------------------------------- set by the launcher


def _launcher(
    name: str,
    meaning: str,
    default_doc: str,
    also_read: tuple[str, ...] = (),
    kind: Kind[Any] = OPTIONAL_INTEGER,
    horovod: bool = True,
) -> Variable[Any]:
    return Variable(
        name,
        kind,
        None,
        meaning,
        horovod=horovod,
        default_doc=default_doc,
        also_read=also_read,
        table="launcher",
    )


RANK = _launcher(
    "RANK",
    "Global rank. When it is set, `HORA_SIZE` must be set too.",
    "unset: a job of one",
)
SIZE = _launcher("SIZE", "Number of processes.", "`1`")
LOCAL_RANK = _launcher("LOCAL_RANK", "Rank on this host.", "`0`")
LOCAL_SIZE = _launcher("LOCAL_SIZE", "Processes on this host.", "`HORA_SIZE`")
CROSS_RANK = _launcher(
    "CROSS_RANK", "Index of this host among the hosts that have this local rank.", "`0`"
)
CROSS_SIZE = _launcher("CROSS_SIZE", "Number of such hosts.", "`1`")
HOSTNAME = _launcher(
    "HOSTNAME", "This host's name, as used in error messages.", "`socket.gethostname()`", (),
    OPTIONAL_TEXT,
)  # fmt: skip
RENDEZVOUS_ADDR = _launcher(
    "RENDEZVOUS_ADDR",
    "Address of the job's key-value store. Required when the size is above 1.",
    "unset",
    ("HORA_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_ADDR"),
    OPTIONAL_TEXT,
    horovod=False,
)
RENDEZVOUS_PORT = _launcher(
    "RENDEZVOUS_PORT",
    "Its port.",
    "unset",
    ("HORA_GLOO_RENDEZVOUS_PORT", "HOROVOD_GLOO_RENDEZVOUS_PORT"),
    horovod=False,
)
# Read after the two above, as their rows in docs/environment.md say.
GLOO_RENDEZVOUS_ADDR = Variable(
    "GLOO_RENDEZVOUS_ADDR", OPTIONAL_TEXT, None, "Read when `HORA_RENDEZVOUS_ADDR` is not set.",
    table=None,
)  # fmt: skip
GLOO_RENDEZVOUS_PORT = Variable(
    "GLOO_RENDEZVOUS_PORT", OPTIONAL_TEXT, None, "Read when `HORA_RENDEZVOUS_PORT` is not set.",
    table=None,
)  # fmt: skip
SECRET_KEY = Variable(
    "SECRET_KEY", OPTIONAL_TEXT, None,
    "The job's secret (hex), which authenticates everything exchanged through the store. Under "
    "`srun`, `torchrun`, or MPI without mpi4py, export it yourself (the same value on every "
    "rank), or the store is not authenticated. See [docs/security.md](security.md).",
    horovod=False, table="launcher",
)  # fmt: skip
SECRET_FILE = Variable(
    "SECRET_FILE", OPTIONAL_TEXT, None,
    "A file holding the job's secret, readable by its owner only (mode `0600`), on a file system "
    "every rank sees: the way to give `srun`, `torchrun` or `mpirun` jobs a secret without "
    "putting it in the environment of the launching shell. `HORA_SECRET_KEY` wins when both are "
    "set. See [docs/security.md](security.md#giving-a-job-its-secret).",
    horovod=False, table="launcher",
)  # fmt: skip
ALLOW_UNAUTHENTICATED = Variable(
    "ALLOW_UNAUTHENTICATED", BOOLEAN, False,
    "`1` lets a job start without a secret (under `srun`, `torchrun`, or MPI without mpi4py, "
    "when neither `HORA_SECRET_KEY` nor `HORA_SECRET_FILE` is set): anyone who can reach the "
    "store and knows the job id can then use it. Without it, such a job stops at `hvd.init()` "
    "and says how to give it a secret.",
    horovod=False, table="launcher",
)  # fmt: skip

# ---------------------------------------------------------------- elastic jobs

ELASTIC = Variable(
    "ELASTIC", OPTIONAL_BOOLEAN, None,
    "`1`: `hvd.init()` joins the newest round of an elastic job.",
    horovod=False, table="elastic",
)  # fmt: skip
ELASTIC_ID = Variable(
    "ELASTIC_ID", OPTIONAL_TEXT, None, "The worker's stable name in the job, `host:slot`.",
    horovod=False, table="elastic",
)  # fmt: skip
ELASTIC_TIMEOUT = Variable(
    "ELASTIC_TIMEOUT", NUMBER, 600.0,
    "Seconds a worker waits for a round that includes it, and for the round's other workers. "
    "`horarun` sets it to `--elastic-timeout` plus 10.",
    bounds=POSITIVE, unit="seconds", table="elastic",
)  # fmt: skip
ELASTIC_COMMIT_DIR = Variable(
    "ELASTIC_COMMIT_DIR", OPTIONAL_TEXT, None,
    "Yours to set, not `horarun`'s: a directory where rank 0 also writes every "
    "`state.commit()` of an `hvd.elastic` state, atomically, and from which a job started "
    "again resumes (the `commit_dir` argument of `ObjectState`/`TorchState` wins). See "
    "[docs/elastic.md](elastic.md#durable-commits).",
    horovod=False, table="elastic",
)  # fmt: skip
HOST_DISCOVERY_TIMEOUT = Variable(
    "HOST_DISCOVERY_TIMEOUT", NUMBER, 60.0,
    "Read by `horarun`: seconds one run of `--host-discovery-script` may take, and never more "
    "than `--elastic-timeout`. A run that takes longer is stopped, with everything it started, "
    "and counts as a failed run (at the start, the job does not start).",
    bounds=POSITIVE, unit="seconds", horovod=False, table="elastic",
)  # fmt: skip

VARIABLES: tuple[Variable[object], ...] = (
    FUSION_THRESHOLD,
    CYCLE_TIME,
    CARRY_THRESHOLD,
    CACHE_CAPACITY,
    STALL_CHECK_DISABLE,
    STALL_CHECK_TIME_SECONDS,
    STALL_SHUTDOWN_TIME_SECONDS,
    GLOO_TIMEOUT_SECONDS,
    DYNAMIC_PROCESS_SETS,
    TIMELINE,
    TIMELINE_MARK_CYCLES,
    METRICS,
    METRICS_RANKS,
    METRICS_ADDR,
    METRICS_REQUIRED,
    FILE_MODE,
    AUTOTUNE,
    AUTOTUNE_LOG,
    AUTOTUNE_WARMUP_SAMPLES,
    AUTOTUNE_STEPS_PER_SAMPLE,
    STEADY_STATE,
    DISABLE_GROUP_FUSION,
    DETERMINISTIC,
    DETERMINISTIC_MICROBATCHES,
    LOG_LEVEL,
    LOG_HIDE_TIME,
    CPU_OPERATIONS,
    SHARED_MEMORY,
    FAST_PATH,
    SHM_SLOT_BYTES,
    SHM_ARENA_BYTES,
    HIERARCHICAL_ALLREDUCE,
    HIERARCHICAL_ALLGATHER,
    GRADIENT_COMPRESSION,
    GPU_OPERATIONS,
    ENABLE_NVTX,
    GLOO_IFACE,
    GC_FREEZE,
    START_TIMEOUT,
    LAUNCHER_TIMEOUT_SECONDS,
    LAUNCHER,
    MPI4PY,
    RANK,
    SIZE,
    LOCAL_RANK,
    LOCAL_SIZE,
    CROSS_RANK,
    CROSS_SIZE,
    HOSTNAME,
    RENDEZVOUS_ADDR,
    RENDEZVOUS_PORT,
    GLOO_RENDEZVOUS_ADDR,
    GLOO_RENDEZVOUS_PORT,
    SECRET_KEY,
    SECRET_FILE,
    ALLOW_UNAUTHENTICATED,
    ELASTIC,
    ELASTIC_ID,
    ELASTIC_TIMEOUT,
    ELASTIC_COMMIT_DIR,
    HOST_DISCOVERY_TIMEOUT,
)

BY_NAME: dict[str, Variable[object]] = {variable.name: variable for variable in VARIABLES}

# ---------------------------------------------------------------- Horovod's, not acted on


def _reads_false(text: str) -> bool:
    """Whether ``text`` is a false boolean (text that is no boolean is not)."""
    try:
        return not parse_bool(text)
    except ValueError:
        return False


def _reads_true(text: str) -> bool:
    """Whether ``text`` is a true boolean (text that is no boolean is not)."""
    try:
        return parse_bool(text)
    except ValueError:
        return False


def _never(_text: str) -> bool:
    return False


@dataclass(frozen=True)
class Unheeded:
    """A variable of Horovod's that hora reads only to say that it does not act on it.

    ``hvd.init()`` names each one that is set to a value hora does not honour
    (:func:`hora.common.vocabulary.config.unheeded`); ``horarun --verbose`` says the same sentence of the
    flag that would set it (:mod:`hora.runner.flags` takes ``why`` from here); docs/environment.md
    lists them all.

    Attributes:
        names: the variables, read in this order (the first one set counts).
        why: why it has no effect, and what hora does instead.
        harmless: whether a value asks only for what hora does anyway (Horovod's default, say);
            such a value is not named.
        named_when: which values are named, as docs/environment.md says it.
        secret: never show its value.
    """

    names: tuple[str, ...]
    why: str
    harmless: Callable[[str], bool] = _never
    named_when: str = "any value"
    secret: bool = False

    @property
    def name(self) -> str:
        """The name that stands for it in the docs (the last one: Horovod's)."""
        return self.names[-1]


def _horovods(name: str, why: str, **facts: Any) -> Unheeded:
    return Unheeded(("HOROVOD_" + name,), why, **facts)


_BAYES = "hora's autotune tries a small fixed set of batch sizes, not Bayesian optimisation."

TORUS_ALLREDUCE = _horovods(
    "TORUS_ALLREDUCE",
    "hora has no torus allreduce; across hosts it reduces hierarchically where every host runs "
    "as many of a set's ranks (`HORA_HIERARCHICAL_ALLREDUCE`).",
    harmless=_reads_false, named_when="`1`",
)  # fmt: skip
HIERARCHICAL_ALLGATHER_UNHEEDED = Unheeded(
    HIERARCHICAL_ALLGATHER.environ_names,
    "hora's allgather across hosts runs over one Gloo group (within a host, through shared "
    "memory).",
    harmless=_reads_false, named_when="`1`",
)  # fmt: skip
NUM_NCCL_STREAMS = _horovods(
    "NUM_NCCL_STREAMS",
    "hora runs each process set's NCCL collectives on one NCCL stream, in order.",
    harmless=lambda text: text.strip() == "1", named_when="other than `1`",
)  # fmt: skip
THREAD_AFFINITY = _horovods(
    "THREAD_AFFINITY",
    "hora does not pin its background thread to a core; pin the whole process instead "
    "(`taskset`, `numactl`, `mpirun --bind-to`).",
)  # fmt: skip
MPI_THREADS_DISABLE = _horovods(
    "MPI_THREADS_DISABLE",
    "hora's MPI transport needs MPI_THREAD_MULTIPLE (each communicator calls MPI from its own "
    "thread).",
    harmless=_reads_false, named_when="`1`",
)  # fmt: skip
AUTOTUNE_BAYES_OPT_MAX_SAMPLES = _horovods("AUTOTUNE_BAYES_OPT_MAX_SAMPLES", _BAYES)
AUTOTUNE_GAUSSIAN_PROCESS_NOISE = _horovods("AUTOTUNE_GAUSSIAN_PROCESS_NOISE", _BAYES)
BATCH_D2D_MEMCOPIES = _horovods(
    "BATCH_D2D_MEMCOPIES",
    "hora always copies the CUDA tensors of a fused buffer with torch's batched multi-tensor "
    "copies.",
    harmless=_reads_true, named_when="`0`",
)  # fmt: skip
ENABLE_ASYNC_COMPLETION = _horovods(
    "ENABLE_ASYNC_COMPLETION",
    "hora has no such mode: a CUDA collective's handle completes once the host sees NCCL finish "
    "it.",
    harmless=_reads_false, named_when="`1`",
)  # fmt: skip
ENABLE_XLA_OPS = _horovods(
    "ENABLE_XLA_OPS",
    "hora's TensorFlow collectives cannot run inside XLA-compiled code; compile the step "
    "without XLA (`jit_compile=False`).",
    harmless=_reads_false, named_when="`1`",
)  # fmt: skip
ADASUM_MPI_CHUNK_SIZE = _horovods(
    "ADASUM_MPI_CHUNK_SIZE",
    "hora's Adasum sends each level's half of a buffer as one message; it has no chunk size.",
)  # fmt: skip
CCL_CACHE = _horovods(
    "CCL_CACHE", "hora has no oneCCL path.", harmless=_reads_false, named_when="`1`"
)
DISABLE_NVTX_RANGES = _horovods(
    "DISABLE_NVTX_RANGES",
    "hora marks NVTX ranges only with `HORA_ENABLE_NVTX=1` (Horovod marks them by default).",
    harmless=_reads_true, named_when="`0`",
)  # fmt: skip
ELASTIC_HOROVOD = _horovods(
    "ELASTIC",
    "a worker joins an elastic job when `horarun` starts it as one (`--min-np`, `--max-np` or "
    "`--host-discovery-script`), which sets `HORA_ELASTIC`.",
    harmless=_reads_false, named_when="`1`",
)  # fmt: skip
SECRET_KEY_HOROVOD = _horovods(
    "SECRET_KEY",
    "hora's job secret is `HORA_SECRET_KEY` (hex) or `HORA_SECRET_FILE` (see "
    "docs/security.md).",
    secret=True,
)  # fmt: skip
# The libraries HOROVOD_CONTROLLER may name (hora's CPU_OPERATIONS choices).
CONTROLLER_NAME = "HOROVOD_CONTROLLER"
CONTROLLER = Unheeded(
    (CONTROLLER_NAME,),
    "hora negotiates over the library that moves CPU data: `HORA_CPU_OPERATIONS`, else "
    "`HOROVOD_CPU_OPERATIONS`, else `HOROVOD_CONTROLLER` when it is `gloo` or `mpi`, else Gloo.",
    harmless=lambda text: text.strip().lower() in CPU_OPERATIONS.choices,
    named_when="other than `gloo`, `mpi`, or than the library `HORA_CPU_OPERATIONS` (or "
    "`HOROVOD_CPU_OPERATIONS`) names",
)  # fmt: skip

UNHEEDED: tuple[Unheeded, ...] = (
    TORUS_ALLREDUCE,
    HIERARCHICAL_ALLGATHER_UNHEEDED,
    NUM_NCCL_STREAMS,
    THREAD_AFFINITY,
    MPI_THREADS_DISABLE,
    AUTOTUNE_BAYES_OPT_MAX_SAMPLES,
    AUTOTUNE_GAUSSIAN_PROCESS_NOISE,
    BATCH_D2D_MEMCOPIES,
    ENABLE_ASYNC_COMPLETION,
    ENABLE_XLA_OPS,
    ADASUM_MPI_CHUNK_SIZE,
    CCL_CACHE,
    DISABLE_NVTX_RANGES,
    ELASTIC_HOROVOD,
    SECRET_KEY_HOROVOD,
    CONTROLLER,
)

# ``HORA_*`` variables that the scripts in examples/, ./dev and the tests read, not
# ``hvd.init()``: not named as unknown when set.
SCRIPT_VARIABLES = (
    "HORA_VENV",
    "HORA_APPTAINER_IMAGE",
    "HORA_EXAMPLE_HOSTS",
    "HORA_TEST_WORKERS",
    "HORA_TEST_FORK_SERVER",
)
