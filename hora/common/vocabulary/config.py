"""Runtime settings, read once from ``HORA_*`` and ``HOROVOD_*`` environment variables.

The names, defaults, ranges and ``HOROVOD_*`` twins of the variables are declared in
:mod:`hora.common.vocabulary.settings_table`; this module reads them. It knows nothing of the engine that
uses them. For each setting the ``HORA_`` name wins over the ``HOROVOD_`` one, so a Horovod job
script keeps working and a hora user can override it.

It also finds what is set but not acted on (:func:`unheeded`): Horovod's variables for features
hora does not have, Horovod's values that hora lacks, and ``HORA_*`` names hora does not know
(typos); ``hvd.init()`` names them once (:func:`name_unheeded`).
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar, cast

from hora.common.vocabulary import settings_table as table
from hora.common.vocabulary.settings_table import Unheeded, Variable

T = TypeVar("T")

logger = logging.getLogger("hora")


class SettingError(ValueError):
    """An environment variable holds a value hora cannot use."""


def _first_set(names: tuple[str, ...], env: Mapping[str, str] | None) -> tuple[str, str] | None:
    """The first of ``names`` set to something, and its text (the empty string is unset)."""
    source = os.environ if env is None else env
    for name in names:
        value = source.get(name)
        if value is not None and value != "":
            return name, value
    return None


def raw(variable: Variable[object], env: Mapping[str, str] | None = None) -> str | None:
    """The text of ``HORA_<name>`` or, failing that, of its ``HOROVOD_<name>`` twin (``None``
    when neither is set, or set to the empty string).

    A variable declared without a Horovod twin (``STEADY_STATE``, ``SECRET_KEY``, ...) is read
    under its ``HORA_`` name only.
    """
    found = _first_set(variable.environ_names, env)
    return found[1] if found is not None else None


def _parse(variable: Variable[T], text: str) -> T:
    """``text`` as ``variable``'s kind, and a finite number if a number (no range holds
    ``inf``: see :class:`~hora.common.vocabulary.settings_table.Bounds`)."""
    try:
        value = variable.kind.parse(text)
    except (ValueError, OverflowError):
        raise SettingError(
            f"{variable.names} must be {variable.kind.expected}, got {text!r}."
        ) from None
    if isinstance(value, float) and not math.isfinite(value):
        raise SettingError(f"{variable.names} must be a finite number, got {text!r}.")
    return value


def _lacked(variable: Variable[object], name: str, value: object) -> bool:
    """Whether ``value``, read from ``name``, is one of Horovod's values that hora lacks (then
    the twin counts as unset; see ``Variable.lacking``)."""
    return bool(variable.lacking) and name != variable.env and value not in variable.choices


def chosen_by(variable: Variable[object], env: Mapping[str, str] | None = None) -> str | None:
    """The name of the variable whose value :func:`read` returns: ``HORA_<name>``, or its
    Horovod twin unless that holds a value hora lacks; ``None`` when the default applies."""
    found = _first_set(variable.environ_names, env)
    if found is None:
        return None
    name, text = found
    return None if _lacked(variable, name, _parse(variable, text)) else name


def read(
    variable: Variable[T], env: Mapping[str, str] | None = None, *, default: T | None = None
) -> T:
    """The value of ``variable`` (``HORA_`` then ``HOROVOD_``); when unset, ``default`` or, without
    one, the variable's declared default. A Horovod twin holding one of Horovod's values that
    hora lacks (``HOROVOD_CPU_OPERATIONS=ccl``) counts as unset; :func:`unheeded` names it.

    Raises:
        SettingError: the text cannot be parsed; the message names the variable and the value.
    """
    found = _first_set(variable.environ_names, env)
    if found is not None:
        value = _parse(variable, found[1])
        if not _lacked(variable, found[0], value):
            return value
    return variable.default if default is None else default


def is_set(variable: Variable[object], env: Mapping[str, str] | None = None) -> bool:
    """Whether ``variable`` (or its Horovod twin) is set to something."""
    return raw(variable, env) is not None


def _setting(variable: Variable[T], negated: bool = False) -> T:
    """A :class:`Settings` field read from ``variable`` (``negated``: its boolean opposite)."""
    default = cast(T, not variable.default) if negated else variable.default
    return field(default=default, metadata={"variable": variable, "negated": negated})


@dataclass(frozen=True)
class Settings:
    """Engine settings. Build with :meth:`from_env`; every field has Horovod's default.

    Attributes:
        fusion_threshold_bytes: largest fused buffer; 0 turns fusion off.
        cycle_time_ms: shortest interval between two negotiation cycles.
        cache_capacity: entries of the response cache; 0 turns it off.
        carry_threshold_bytes: largest CPU allreduce carried in the negotiation exchange
            (reduced on every rank without a second round trip); 0 turns it off.
        stall_check_enabled: whether the stall inspector runs.
        stall_check_time_s: warn when some ranks waited this long for others.
        stall_shutdown_time_s: shut the job down after a stall this long (0, the default as in
            Horovod: never; deadlocks end the job regardless, after ``gloo_timeout_s``).
        gloo_timeout_s: how long one collective may wait for a peer.
        dynamic_process_sets: allow ``add_process_set`` after ``init``.
        disable_group_fusion: fuse the tensors of a group only with each other.
        log_level: ``TRACE``, ``DEBUG``, ``INFO``, ``WARNING`` or ``ERROR``.
        steady_state: replay a repeating sequence of allreduces without negotiating each one
            (``HORA_STEADY_STATE``, on by default; see docs/engine.md).
        autotune: try batch sizes for the steady state online and keep the fastest.
        autotune_log: where rank 0 logs the autotune trials (CSV), or ``None``.
        autotune_warmup_samples: steps after each autotune change that are not measured.
        autotune_steps_per_sample: measured steps per autotune candidate.
        cpu_operations: the library of the data path and the negotiation, ``gloo`` or ``mpi``
            (see :func:`cpu_operations`: ``HOROVOD_CONTROLLER`` chooses when nothing else does).
        shared_memory: whether ranks of one host exchange through shared memory (Gloo path).
        shm_slot_bytes: shared memory per rank and process set.
        shm_arena_bytes: address space per rank and process set for repeated buffers.
        fast_path: whether synchronous calls of a set on one host may run on the caller's
            thread (hora.common.ops.fast_path).
        hierarchical_allreduce: ``True``/``False`` chooses for sets spanning hosts; ``None``:
            hora's choice.
        hierarchical_allgather: Horovod's setting, named when set (hora has no such allgather).
        gpu_operations: how CUDA tensors move, ``nccl`` or ``host`` (through host memory).
        enable_nvtx: mark the engine's phases as NVTX ranges (a no-op without CUDA).
        deterministic: whether optimizers built without ``deterministic=`` sum in deterministic
            mode's fixed order (see docs/deterministic.md).
        deterministic_microbatches: that mode's K, for optimizers built without
            ``microbatches=`` (``None``: unset).
        gradient_compression: how optimizers built with ``Compression.none`` send gradients
            (``none``, ``fp16``, ``bf16``; read again as each optimizer is built, see
            :func:`hora.common.ops.compression.for_gradients`).
    """

    fusion_threshold_bytes: int = _setting(table.FUSION_THRESHOLD)
    cycle_time_ms: float = _setting(table.CYCLE_TIME)
    cache_capacity: int = _setting(table.CACHE_CAPACITY)
    carry_threshold_bytes: int = _setting(table.CARRY_THRESHOLD)
    stall_check_enabled: bool = _setting(table.STALL_CHECK_DISABLE, negated=True)
    stall_check_time_s: float = _setting(table.STALL_CHECK_TIME_SECONDS)
    stall_shutdown_time_s: float = _setting(table.STALL_SHUTDOWN_TIME_SECONDS)
    gloo_timeout_s: float = _setting(table.GLOO_TIMEOUT_SECONDS)
    dynamic_process_sets: bool = _setting(table.DYNAMIC_PROCESS_SETS)
    disable_group_fusion: bool = _setting(table.DISABLE_GROUP_FUSION)
    log_level: str = _setting(table.LOG_LEVEL)
    steady_state: bool = _setting(table.STEADY_STATE)
    autotune: bool = _setting(table.AUTOTUNE)
    autotune_log: str | None = _setting(table.AUTOTUNE_LOG)
    autotune_warmup_samples: int = _setting(table.AUTOTUNE_WARMUP_SAMPLES)
    autotune_steps_per_sample: int = _setting(table.AUTOTUNE_STEPS_PER_SAMPLE)
    cpu_operations: str = _setting(table.CPU_OPERATIONS)
    shared_memory: bool = _setting(table.SHARED_MEMORY)
    shm_slot_bytes: int = _setting(table.SHM_SLOT_BYTES)
    shm_arena_bytes: int = _setting(table.SHM_ARENA_BYTES)
    fast_path: bool = _setting(table.FAST_PATH)
    hierarchical_allreduce: bool | None = _setting(table.HIERARCHICAL_ALLREDUCE)
    hierarchical_allgather: bool | None = _setting(table.HIERARCHICAL_ALLGATHER)
    gpu_operations: str = _setting(table.GPU_OPERATIONS)
    enable_nvtx: bool = _setting(table.ENABLE_NVTX)
    deterministic: bool = _setting(table.DETERMINISTIC)
    deterministic_microbatches: int | None = _setting(table.DETERMINISTIC_MICROBATCHES)
    gradient_compression: str = _setting(table.GRADIENT_COMPRESSION)

    @property
    def stall_limit_s(self) -> float:
        """How long a call may wait for its peers before the job ends as stalled:
        ``HORA_STALL_SHUTDOWN_TIME_SECONDS``, while the stall check is on and that time is not
        shorter than its check time; 0: no such limit."""
        limit = self.stall_shutdown_time_s
        if not self.stall_check_enabled or limit < self.stall_check_time_s:
            return 0.0
        return limit

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read every setting from the environment (``HORA_*`` first, then ``HOROVOD_*``).

        Raises:
            SettingError: a variable is set to something that cannot be parsed or is out of range.
        """
        values: dict[str, Any] = {}
        for declared in fields(cls):
            variable: Variable[object] = declared.metadata["variable"]
            value = read(variable, env)
            values[declared.name] = not value if declared.metadata["negated"] else value
        values["cpu_operations"] = cpu_operations(env)[0]
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        """Raise :class:`SettingError` for values out of range (the variables' declared bounds
        and choices)."""
        for name, variable in SETTINGS_VARIABLES.items():
            problem = variable.problem(getattr(self, name))
            if problem is not None:
                raise SettingError(problem)


# The variable each field of :class:`Settings` is read from (``stall_check_enabled`` is the
# negation of ``HORA_STALL_CHECK_DISABLE``).
SETTINGS_VARIABLES: dict[str, Variable[object]] = {
    declared.name: declared.metadata["variable"] for declared in fields(Settings)
}
# The fields every rank must hold alike (their variables are declared ``agreed``): ``hvd.init()``
# compares them across ranks (:func:`hora.common.startup.wiring.agree_on_settings`).
AGREED_SETTINGS: dict[str, Variable[object]] = {
    name: variable for name, variable in SETTINGS_VARIABLES.items() if variable.agreed
}


def start_timeout_s(env: Mapping[str, str] | None = None) -> float:
    """How long a worker may take to reach the job's store (``HORA_START_TIMEOUT``)."""
    return read(table.START_TIMEOUT, env)


def cpu_operations(env: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """The library that moves CPU data and carries the negotiation, and the variable that chose
    it (``None``: nothing did, and it is Gloo).

    ``HORA_CPU_OPERATIONS``, else ``HOROVOD_CPU_OPERATIONS`` (unless it names a library hora
    lacks), else ``HOROVOD_CONTROLLER`` when it names ``gloo`` or ``mpi``: Horovod may negotiate
    over one library and move data over another, hora uses one for both. The value is as read;
    :meth:`Settings.validate` refuses one hora does not know under the ``HORA_`` name.

    Raises:
        SettingError: the text cannot be parsed.
    """
    variable = table.CPU_OPERATIONS
    name = chosen_by(variable, env)
    if name is not None:
        return read(variable, env), name
    source = os.environ if env is None else env
    controller = source.get(table.CONTROLLER_NAME, "").strip().lower()
    if controller in variable.choices:
        return controller, table.CONTROLLER_NAME
    return read(variable, env), None


def timeline_path(env: Mapping[str, str] | None = None) -> str | None:
    """The file ``hvd.init()`` starts a timeline in (``HORA_TIMELINE``); ``None`` when unset or
    ``DYNAMIC`` (Horovod's word for "only when ``hvd.start_timeline()`` is called")."""
    path = read(table.TIMELINE, env)
    return None if path == table.TIMELINE_DYNAMIC else path


def interfaces(text: str) -> list[str]:
    """A comma-separated list of network interfaces (``eth0,eth1``), in order, each once."""
    names = [name.strip() for name in text.split(",")]
    return list(dict.fromkeys(name for name in names if name))


def gloo_interface(env: Mapping[str, str] | None = None) -> str:
    """The network interface Gloo binds: ``HORA_GLOO_IFACE`` (or ``HOROVOD_GLOO_IFACE``), else
    ``GLOO_SOCKET_IFNAME``; of a comma-separated list, the first. ``""`` when none is set."""
    source = os.environ if env is None else env
    text = raw(table.GLOO_IFACE, source) or source.get("GLOO_SOCKET_IFNAME", "")
    names = interfaces(text)
    return names[0] if names else ""


# ---------------------------------------------------------------- what is set but not acted on

# Where docs/environment.md explains the lines :func:`name_unheeded` logs.
UNHEEDED_DOC = "docs/environment.md#variables-hora-does-not-act-on"


def _said(entry: Unheeded, name: str, text: str) -> str:
    shown = name if entry.secret else f"{name}={text}"
    return f"{shown} has no effect: {entry.why}"


def _known_hora_names() -> list[str]:
    names = {variable.env for variable in table.VARIABLES}
    names.update(n for v in table.VARIABLES for n in v.also_read if n.startswith("HORA_"))
    names.update(table.SCRIPT_VARIABLES)
    return sorted(names)


def _unknown_hora_names(source: Mapping[str, str]) -> list[str]:
    """A line for each ``HORA_*`` variable hora does not read (a typo, most likely)."""
    known = _known_hora_names()
    horovods = {name: entry for entry in table.UNHEEDED for name in entry.names}
    lines = []
    for name in sorted(source):
        if not name.startswith("HORA_") or name in known or source[name] == "":
            continue
        entry = horovods.get("HOROVOD_" + name.removeprefix("HORA_"))
        if entry is not None:
            lines.append(_said(entry, name, source[name]))
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        hint = f"; did you mean {close[0]}?" if close else ""
        lines.append(f"{name} is not a variable hora reads{hint}")
    return lines


def unheeded(env: Mapping[str, str] | None = None) -> list[str]:
    """One line for each variable that is set but that hora does not act on.

    These are Horovod's variables for what hora does not have (``HOROVOD_TORUS_ALLREDUCE=1``,
    declared in ``settings_table.UNHEEDED``), Horovod's values that hora lacks
    (``HOROVOD_CPU_OPERATIONS=ccl``), a ``HOROVOD_CONTROLLER`` that another variable overrides,
    and ``HORA_*`` names hora does not know, with the closest known name. Unknown
    ``HOROVOD_*`` names are not listed: Horovod's build variables (``HOROVOD_WITH_PYTORCH``)
    are often left set, and Horovod ignores them at run time too.

    Example:
        >>> unheeded({"HOROVOD_TORUS_ALLREDUCE": "1", "HORA_FUSION_THRESHLD": "0"})[1]
        'HORA_FUSION_THRESHLD is not a variable hora reads; did you mean HORA_FUSION_THRESHOLD?'
    """
    source = os.environ if env is None else env
    lines = []
    for entry in table.UNHEEDED:
        found = _first_set(entry.names, source)
        if found is not None and not entry.harmless(found[1]):
            lines.append(_said(entry, *found))
    for variable in table.VARIABLES:
        found = _first_set(variable.environ_names, source)
        if found is None or not variable.lacking:
            continue
        try:
            lacked = _lacked(variable, found[0], variable.kind.parse(found[1]))
        except ValueError:
            continue  # Settings.from_env names it, as an error
        if lacked:
            lines.append(f"{found[0]}={found[1]} has no effect: {variable.lacking}")
    controller = source.get(table.CONTROLLER_NAME, "").strip()
    library, name = cpu_operations(source)
    if controller.lower() in table.CPU_OPERATIONS.choices and controller.lower() != library:
        lines.append(
            f"{table.CONTROLLER_NAME}={controller} has no effect: {name}={library} chooses the "
            "library, and hora negotiates over the library that moves CPU data."
        )
    return lines + _unknown_hora_names(source)


def name_unheeded(env: Mapping[str, str] | None = None) -> list[str]:
    """Log one warning that names every variable :func:`unheeded` finds (nothing when there
    is none); ``hvd.init()`` calls it once per process, on local rank 0 of each host.

    Returns:
        The lines named.
    """
    lines = unheeded(env)
    if lines:
        logger.warning(
            "hora does not act on %s set in this environment:\n  %s\nSee %s.",
            "this variable" if len(lines) == 1 else f"these {len(lines)} variables",
            "\n  ".join(lines),
            UNHEEDED_DOC,
        )
    return lines
