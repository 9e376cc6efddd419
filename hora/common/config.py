"""Runtime settings, read once from ``HORA_*`` and ``HOROVOD_*`` environment variables.

The names, defaults, ranges and ``HOROVOD_*`` twins of the variables are declared in
:mod:`hora.common.settings_table`; this module reads them. It knows nothing of the engine that
uses them. For each setting the ``HORA_`` name wins over the ``HOROVOD_`` one, so a Horovod job
script keeps working and a hora user can override it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from hora.common import settings_table as table
from hora.common.settings_table import Variable

T = TypeVar("T")


class SettingError(ValueError):
    """An environment variable holds a value hora cannot use."""


def raw(variable: Variable[Any], env: Mapping[str, str] | None = None) -> str | None:
    """The text of ``HORA_<name>`` or, failing that, of its ``HOROVOD_<name>`` twin (``None``
    when neither is set, or set to the empty string).

    A variable declared without a Horovod twin (``STEADY_STATE``, ``SECRET_KEY``, ...) is read
    under its ``HORA_`` name only.
    """
    source = os.environ if env is None else env
    for name in variable.environ_names:
        value = source.get(name)
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
    text = raw(variable, env)
    if text is None:
        return variable.default if default is None else default
    try:
        return variable.kind.parse(text)
    except ValueError:
        raise SettingError(
            f"{variable.names} must be {variable.kind.expected}, got {text!r}."
        ) from None


def is_set(variable: Variable[Any], env: Mapping[str, str] | None = None) -> bool:
    """Whether ``variable`` (or its Horovod twin) is set to something."""
    return raw(variable, env) is not None


def _setting(variable: Variable[Any], negated: bool = False) -> Any:
    """A :class:`Settings` field read from ``variable`` (``negated``: its boolean opposite)."""
    default = not variable.default if negated else variable.default
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
        shared_memory: whether ranks of one host exchange through shared memory (Gloo path).
        shm_slot_bytes: shared memory per rank and process set.
        shm_arena_bytes: address space per rank and process set for repeated buffers.
        hierarchical_allreduce: ``True``/``False`` chooses for sets spanning hosts; ``None``:
            hora's choice.
        hierarchical_allgather: Horovod's setting, named when set (hora has no such allgather).
        gpu_operations: how CUDA tensors move, ``nccl`` or ``host`` (through host memory).
        enable_nvtx: mark the engine's phases as NVTX ranges (a no-op without CUDA).
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
    hierarchical_allreduce: bool | None = _setting(table.HIERARCHICAL_ALLREDUCE)
    hierarchical_allgather: bool | None = _setting(table.HIERARCHICAL_ALLGATHER)
    gpu_operations: str = _setting(table.GPU_OPERATIONS)
    enable_nvtx: bool = _setting(table.ENABLE_NVTX)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read every setting from the environment (``HORA_*`` first, then ``HOROVOD_*``).

        Raises:
            SettingError: a variable is set to something that cannot be parsed or is out of range.
        """
        values: dict[str, Any] = {}
        for declared in fields(cls):
            variable: Variable[Any] = declared.metadata["variable"]
            value = read(variable, env)
            values[declared.name] = not value if declared.metadata["negated"] else value
        if not is_set(table.STALL_SHUTDOWN_TIME_SECONDS, env):
            # A longer check time moves the default shutdown time with it (never below it).
            values["stall_shutdown_time_s"] = max(
                values["stall_shutdown_time_s"], values["stall_check_time_s"]
            )
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
SETTINGS_VARIABLES: dict[str, Variable[Any]] = {
    declared.name: declared.metadata["variable"] for declared in fields(Settings)
}


def start_timeout_s(env: Mapping[str, str] | None = None) -> float:
    """How long a worker may take to reach the job's store (``HORA_START_TIMEOUT``)."""
    return read(table.START_TIMEOUT, env)
