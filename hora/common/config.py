"""Runtime settings, read once from ``HORA_*`` and ``HOROVOD_*`` environment variables.

The names, defaults, ranges and ``HOROVOD_*`` twins of the variables are declared in
:mod:`hora.common.settings_table`; this module reads them. It knows nothing of the engine that
uses them. For each setting the ``HORA_`` name wins over the ``HOROVOD_`` one, so a Horovod job
script keeps working and a hora user can override it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from hora.common import settings_table as table
from hora.common.settings_table import Variable

T = TypeVar("T")


class SettingError(ValueError):
    """An environment variable holds a value hora cannot use."""


def lookup(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """Return ``HORA_<name>`` or, failing that, ``HOROVOD_<name>`` (``None`` when neither is set).

    A variable declared without a Horovod twin (``STEADY_STATE``, ``SECRET_KEY``, ...) is read
    under its ``HORA_`` name only.
    """
    source = os.environ if env is None else env
    declared = table.BY_NAME.get(name)
    prefixes = (
        ("HORA_",) if declared is not None and not declared.horovod else ("HORA_", "HOROVOD_")
    )
    for prefix in prefixes:
        value = source.get(prefix + name)
        if value is not None and value != "":
            return value
    return None


def read(
    variable: Variable[T], env: Mapping[str, str] | None = None, *, default: T | None = None
) -> T:
    """The value of ``variable`` (``HORA_`` then ``HOROVOD_``); when unset, ``default`` or, without
    one, the variable's declared default.

    Raises:
        SettingError: the text cannot be parsed; the message names the variable and the value.
    """
    raw = lookup(variable.name, env)
    if raw is None:
        return variable.default if default is None else default
    try:
        return variable.kind.parse(raw)
    except ValueError:
        raise SettingError(
            f"{variable.names} must be {variable.kind.expected}, got {raw!r}."
        ) from None


def flag(name: str, default: bool = False, env: Mapping[str, str] | None = None) -> bool:
    """An on/off variable: 1/0, true/false, yes/no, on/off (``HORA_`` then ``HOROVOD_``)."""
    raw = lookup(name, env)
    if raw is None:
        return default
    try:
        return table.parse_bool(raw)
    except ValueError:
        names = table.BY_NAME[name].names if name in table.BY_NAME else f"HORA_{name}"
        raise SettingError(f"{names} must be 0 or 1, got {raw!r}.") from None


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
        stall_shutdown_time_s: shut the job down after a stall this long (0: never); by default
            the declared default (``HORA_STALL_SHUTDOWN_TIME_SECONDS``), or the check time if
            that is longer.
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
        cpu_operations: the library of the data path and the negotiation, ``gloo`` or ``mpi``.
        gpu_operations: how CUDA tensors move, ``nccl`` or ``host`` (through host memory).
        enable_nvtx: mark the engine's phases as NVTX ranges (a no-op without CUDA).
    """

    fusion_threshold_bytes: int = table.FUSION_THRESHOLD.default
    cycle_time_ms: float = table.CYCLE_TIME.default
    cache_capacity: int = table.CACHE_CAPACITY.default
    carry_threshold_bytes: int = table.CARRY_THRESHOLD.default
    stall_check_enabled: bool = not table.STALL_CHECK_DISABLE.default
    stall_check_time_s: float = table.STALL_CHECK_TIME_SECONDS.default
    stall_shutdown_time_s: float = table.STALL_SHUTDOWN_TIME_SECONDS.default
    gloo_timeout_s: float = table.GLOO_TIMEOUT_SECONDS.default
    dynamic_process_sets: bool = table.DYNAMIC_PROCESS_SETS.default
    disable_group_fusion: bool = table.DISABLE_GROUP_FUSION.default
    log_level: str = table.LOG_LEVEL.default
    steady_state: bool = table.STEADY_STATE.default
    autotune: bool = table.AUTOTUNE.default
    autotune_log: str | None = table.AUTOTUNE_LOG.default
    autotune_warmup_samples: int = table.AUTOTUNE_WARMUP_SAMPLES.default
    autotune_steps_per_sample: int = table.AUTOTUNE_STEPS_PER_SAMPLE.default
    cpu_operations: str = table.CPU_OPERATIONS.default
    gpu_operations: str = table.GPU_OPERATIONS.default
    enable_nvtx: bool = table.ENABLE_NVTX.default

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read every setting from the environment (``HORA_*`` first, then ``HOROVOD_*``).

        Raises:
            SettingError: a variable is set to something that cannot be parsed or is out of range.
        """
        check_time_s = read(table.STALL_CHECK_TIME_SECONDS, env)
        # A longer check time moves the default shutdown time with it (never below it).
        shutdown_default = max(table.STALL_SHUTDOWN_TIME_SECONDS.default, check_time_s)
        settings = cls(
            fusion_threshold_bytes=read(table.FUSION_THRESHOLD, env),
            cycle_time_ms=read(table.CYCLE_TIME, env),
            cache_capacity=read(table.CACHE_CAPACITY, env),
            carry_threshold_bytes=read(table.CARRY_THRESHOLD, env),
            stall_check_enabled=not read(table.STALL_CHECK_DISABLE, env),
            stall_check_time_s=check_time_s,
            stall_shutdown_time_s=read(
                table.STALL_SHUTDOWN_TIME_SECONDS, env, default=shutdown_default
            ),
            gloo_timeout_s=read(table.GLOO_TIMEOUT_SECONDS, env),
            dynamic_process_sets=read(table.DYNAMIC_PROCESS_SETS, env),
            disable_group_fusion=read(table.DISABLE_GROUP_FUSION, env),
            log_level=read(table.LOG_LEVEL, env),
            steady_state=read(table.STEADY_STATE, env),
            autotune=read(table.AUTOTUNE, env),
            autotune_log=read(table.AUTOTUNE_LOG, env),
            autotune_warmup_samples=read(table.AUTOTUNE_WARMUP_SAMPLES, env),
            autotune_steps_per_sample=read(table.AUTOTUNE_STEPS_PER_SAMPLE, env),
            cpu_operations=read(table.CPU_OPERATIONS, env).lower(),
            gpu_operations=read(table.GPU_OPERATIONS, env).lower(),
            enable_nvtx=read(table.ENABLE_NVTX, env),
        )
        settings.validate()
        return settings

    def validate(self) -> None:
        """Raise :class:`SettingError` for values out of range (the variables' declared bounds
        and choices)."""
        for field, variable in SETTINGS_VARIABLES.items():
            problem = variable.problem(getattr(self, field))
            if problem is not None:
                raise SettingError(problem)


# The variable each field of :class:`Settings` is read from (``stall_check_enabled`` is the
# negation of ``HORA_STALL_CHECK_DISABLE``).
SETTINGS_VARIABLES: dict[str, Variable[Any]] = {
    "fusion_threshold_bytes": table.FUSION_THRESHOLD,
    "cycle_time_ms": table.CYCLE_TIME,
    "cache_capacity": table.CACHE_CAPACITY,
    "carry_threshold_bytes": table.CARRY_THRESHOLD,
    "stall_check_enabled": table.STALL_CHECK_DISABLE,
    "stall_check_time_s": table.STALL_CHECK_TIME_SECONDS,
    "stall_shutdown_time_s": table.STALL_SHUTDOWN_TIME_SECONDS,
    "gloo_timeout_s": table.GLOO_TIMEOUT_SECONDS,
    "dynamic_process_sets": table.DYNAMIC_PROCESS_SETS,
    "disable_group_fusion": table.DISABLE_GROUP_FUSION,
    "log_level": table.LOG_LEVEL,
    "steady_state": table.STEADY_STATE,
    "autotune": table.AUTOTUNE,
    "autotune_log": table.AUTOTUNE_LOG,
    "autotune_warmup_samples": table.AUTOTUNE_WARMUP_SAMPLES,
    "autotune_steps_per_sample": table.AUTOTUNE_STEPS_PER_SAMPLE,
    "cpu_operations": table.CPU_OPERATIONS,
    "gpu_operations": table.GPU_OPERATIONS,
    "enable_nvtx": table.ENABLE_NVTX,
}


def start_timeout_s(env: Mapping[str, str] | None = None) -> float:
    """How long a worker may take to reach the job's store (``HORA_START_TIMEOUT``)."""
    return read(table.START_TIMEOUT, env)
