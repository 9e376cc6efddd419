"""Runtime settings, read once from ``HORA_*`` and ``HOROVOD_*`` environment variables.

This module owns the names, defaults and parsing of every runtime variable. It knows nothing of
the engine that uses them. For each setting the ``HORA_`` name wins over the ``HOROVOD_`` one, so a
Horovod job script keeps working and a hora user can override it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_FUSION_THRESHOLD_BYTES = 128 * 1024 * 1024
DEFAULT_CYCLE_TIME_MS = 1.0
DEFAULT_CACHE_CAPACITY = 1024
DEFAULT_STALL_CHECK_TIME_S = 60.0
# A stall this long ends the job: a rank that never submits a tensor the others wait for becomes
# an error naming the tensor and the ranks, instead of a job that waits forever. Ten minutes, as
# PyTorch's NCCL timeout: far beyond a slow step, shorter than a lost night on a cluster.
DEFAULT_STALL_SHUTDOWN_TIME_S = 600.0
DEFAULT_GLOO_TIMEOUT_S = 30.0
DEFAULT_START_TIMEOUT_S = 30.0


class SettingError(ValueError):
    """An environment variable holds a value hora cannot use."""


def lookup(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """Return ``HORA_<name>`` or, failing that, ``HOROVOD_<name>`` (``None`` when neither is set)."""
    source = os.environ if env is None else env
    for prefix in ("HORA_", "HOROVOD_"):
        value = source.get(prefix + name)
        if value is not None and value != "":
            return value
    return None


def _float(name: str, default: float, env: Mapping[str, str] | None) -> float:
    raw = lookup(name, env)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise SettingError(
            f"HORA_{name} (or HOROVOD_{name}) must be a number, got {raw!r}."
        ) from None


def _int(name: str, default: int, env: Mapping[str, str] | None) -> int:
    raw = lookup(name, env)
    if raw is None:
        return default
    try:
        return int(float(raw))
    except ValueError:
        raise SettingError(
            f"HORA_{name} (or HOROVOD_{name}) must be an integer, got {raw!r}."
        ) from None


def flag(name: str, default: bool = False, env: Mapping[str, str] | None = None) -> bool:
    """An on/off variable: 1/0, true/false, yes/no, on/off (``HORA_`` then ``HOROVOD_``)."""
    return _bool(name, default, env)


def _bool(name: str, default: bool, env: Mapping[str, str] | None) -> bool:
    raw = lookup(name, env)
    if raw is None:
        return default
    lowered = raw.strip().lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    try:
        return int(float(lowered)) > 0
    except ValueError:
        raise SettingError(
            f"HORA_{name} (or HOROVOD_{name}) must be 0 or 1, got {raw!r}."
        ) from None


@dataclass(frozen=True)
class Settings:
    """Engine settings. Build with :meth:`from_env`; every field has Horovod's default.

    Attributes:
        fusion_threshold_bytes: largest fused buffer; 0 turns fusion off.
        cycle_time_ms: shortest interval between two negotiation cycles.
        cache_capacity: entries of the response cache; 0 turns it off.
        stall_check_enabled: whether the stall inspector runs.
        stall_check_time_s: warn when some ranks waited this long for others.
        stall_shutdown_time_s: shut the job down after a stall this long (0: never); by default
            ``DEFAULT_STALL_SHUTDOWN_TIME_S``, or the check time if that is longer.
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
    """

    fusion_threshold_bytes: int = DEFAULT_FUSION_THRESHOLD_BYTES
    cycle_time_ms: float = DEFAULT_CYCLE_TIME_MS
    cache_capacity: int = DEFAULT_CACHE_CAPACITY
    stall_check_enabled: bool = True
    stall_check_time_s: float = DEFAULT_STALL_CHECK_TIME_S
    stall_shutdown_time_s: float = DEFAULT_STALL_SHUTDOWN_TIME_S
    gloo_timeout_s: float = DEFAULT_GLOO_TIMEOUT_S
    dynamic_process_sets: bool = False
    disable_group_fusion: bool = False
    log_level: str = "WARNING"
    steady_state: bool = True
    autotune: bool = False
    autotune_log: str | None = None
    autotune_warmup_samples: int = 3
    autotune_steps_per_sample: int = 10

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read every setting from the environment (``HORA_*`` first, then ``HOROVOD_*``).

        Raises:
            SettingError: a variable is set to something that cannot be parsed or is out of range.
        """
        check_time_s = _float("STALL_CHECK_TIME_SECONDS", DEFAULT_STALL_CHECK_TIME_S, env)
        settings = cls(
            fusion_threshold_bytes=_int("FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD_BYTES, env),
            cycle_time_ms=_float("CYCLE_TIME", DEFAULT_CYCLE_TIME_MS, env),
            cache_capacity=_int("CACHE_CAPACITY", DEFAULT_CACHE_CAPACITY, env),
            stall_check_enabled=not _bool("STALL_CHECK_DISABLE", False, env),
            stall_check_time_s=check_time_s,
            stall_shutdown_time_s=_float(
                "STALL_SHUTDOWN_TIME_SECONDS", max(DEFAULT_STALL_SHUTDOWN_TIME_S, check_time_s), env
            ),
            gloo_timeout_s=_float("GLOO_TIMEOUT_SECONDS", DEFAULT_GLOO_TIMEOUT_S, env),
            dynamic_process_sets=_bool("DYNAMIC_PROCESS_SETS", False, env),
            disable_group_fusion=_bool("DISABLE_GROUP_FUSION", False, env),
            log_level=(lookup("LOG_LEVEL", env) or "WARNING").upper(),
            steady_state=_bool("STEADY_STATE", True, env),
            autotune=_bool("AUTOTUNE", False, env),
            autotune_log=lookup("AUTOTUNE_LOG", env) or None,
            autotune_warmup_samples=_int("AUTOTUNE_WARMUP_SAMPLES", 3, env),
            autotune_steps_per_sample=_int("AUTOTUNE_STEPS_PER_SAMPLE", 10, env),
        )
        settings.validate()
        return settings

    def validate(self) -> None:
        """Raise :class:`SettingError` for values out of range."""
        if self.autotune_warmup_samples < 0:
            raise SettingError("HORA_AUTOTUNE_WARMUP_SAMPLES must be >= 0 steps.")
        if self.autotune_steps_per_sample < 1:
            raise SettingError("HORA_AUTOTUNE_STEPS_PER_SAMPLE must be >= 1 step.")
        if self.fusion_threshold_bytes < 0:
            raise SettingError("HORA_FUSION_THRESHOLD must be >= 0 bytes (0 turns fusion off).")
        if self.cycle_time_ms < 0:
            raise SettingError("HORA_CYCLE_TIME must be >= 0 milliseconds.")
        if self.cache_capacity < 0:
            raise SettingError("HORA_CACHE_CAPACITY must be >= 0 (0 turns the cache off).")
        if self.stall_check_time_s <= 0:
            raise SettingError("HORA_STALL_CHECK_TIME_SECONDS must be > 0.")
        if self.gloo_timeout_s <= 0:
            raise SettingError("HORA_GLOO_TIMEOUT_SECONDS must be > 0.")
        if self.log_level not in ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"):
            raise SettingError(
                f"HORA_LOG_LEVEL must be one of TRACE, DEBUG, INFO, WARNING, ERROR, FATAL; "
                f"got {self.log_level!r}."
            )


def start_timeout_s(env: Mapping[str, str] | None = None) -> float:
    """How long a worker may take to reach the job's store (``HORA_START_TIMEOUT``)."""
    return _float("START_TIMEOUT", DEFAULT_START_TIMEOUT_S, env)
