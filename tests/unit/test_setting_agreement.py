"""The settings every rank must share, compared at ``hvd.init()`` through the job's store.

Ranks run here as threads over one in-process store: what they exchange, how many store
operations that takes, and what each raises. tests/multiproc/test_setting_agreement.py runs
real jobs.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

import pytest

from hora.common.job.store import StoreClient, new_secret
from hora.common.job.store_keys import GenerationKeys
from hora.common.job.topology import Topology
from hora.common.startup.wiring import agree_on_settings, differences
from hora.common.vocabulary import settings_table as table
from hora.common.vocabulary.config import (
    AGREED_SETTINGS,
    SETTINGS_VARIABLES,
    SettingError,
    Settings,
)
from hora.common.vocabulary.errors import HoraInternalError

ADVICE = (
    "Set it the same on every rank: horarun passes the launcher's environment to every rank, "
    "so look for a wrapper script or a launcher option that sets it for some ranks only."
)


class CountingStore:
    """A store that counts the operations made on it (the keys of one call count once)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._inner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.calls += 1
            return method(*args, **kwargs)

        return counted


def _run_ranks(
    settings: list[Settings],
    generation: int = 0,
    timeout_s: float = 10.0,
    absent: tuple[int, ...] = (),
    store: StoreClient | None = None,
) -> tuple[dict[int, BaseException | None], StoreClient]:
    """Every rank of ``settings`` but ``absent`` agrees at once, each in a thread; what each
    raised (``None``: nothing)."""
    store = store or StoreClient("", 0, new_secret(), timeout_s)
    size = len(settings)
    outcomes: dict[int, BaseException | None] = {}

    def rank(r: int) -> None:
        try:
            agree_on_settings(
                Topology(rank=r, size=size),
                settings[r],
                store.reconnect(),
                GenerationKeys(generation),
                timeout_s,
            )
            outcomes[r] = None
        except BaseException as exc:  # the test inspects it
            outcomes[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size) if r not in absent]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return outcomes, store


@pytest.mark.timeout(30)
def test_alike_settings_pass_in_few_store_operations_per_rank() -> None:
    size = 16
    store = StoreClient("", 0, new_secret(), 10.0)
    counting = CountingStore(store.store)
    store.store = counting
    outcomes, _ = _run_ranks([Settings()] * size, store=store)
    assert outcomes == dict.fromkeys(range(size))
    # O(size) in all: a write and a wait and a read or two per rank, and rank 0's verdict.
    assert counting.calls <= 4 * size + 4, counting.calls


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [2, 3])
def test_a_difference_is_named_on_every_rank_at_once(size: int) -> None:
    settings = [Settings()] * (size - 1) + [replace(Settings(), shared_memory=False)]
    started = time.monotonic()
    outcomes, _ = _run_ranks(settings, timeout_s=20.0)
    assert time.monotonic() - started < 5.0
    expected = (
        f"HORA_SHARED_MEMORY differs across ranks: rank 0 has 1, rank {size - 1} has 0. {ADVICE}"
    )
    for r in range(size):
        assert isinstance(outcomes[r], SettingError), outcomes
        assert str(outcomes[r]) == expected


@pytest.mark.timeout(30)
def test_every_variable_that_differs_is_named() -> None:
    settings = [
        Settings(),
        replace(Settings(), shm_slot_bytes=65538, hierarchical_allreduce=False),
        replace(Settings(), shm_slot_bytes=65538, cpu_operations="mpi"),
        Settings(),
        replace(Settings(), shm_slot_bytes=1 << 20),
    ]
    outcomes, _ = _run_ranks(settings)
    message = str(outcomes[3])
    assert message.splitlines() == [
        "HORA_CPU_OPERATIONS (or HOROVOD_CPU_OPERATIONS) differs across ranks: rank 0 has gloo, "
        "rank 2 has mpi.",
        "HORA_SHM_SLOT_BYTES differs across ranks: rank 0 has 16777216, ranks 1, 2 have 65538, "
        "rank 4 has 1048576.",
        "HORA_HIERARCHICAL_ALLREDUCE (or HOROVOD_HIERARCHICAL_ALLREDUCE) differs across ranks: "
        "rank 0 has it unset, rank 1 has 0.",
        "Set them the same on every rank: horarun passes the launcher's environment to every "
        "rank, so look for a wrapper script or a launcher option that sets them for some ranks "
        "only.",
    ]
    assert all(str(outcome) == message for outcome in outcomes.values()), outcomes


def test_many_ranks_are_counted_not_listed() -> None:
    values = [{"shared_memory": True}] + [{"shared_memory": False}] * 99
    assert differences(values).startswith(
        "HORA_SHARED_MEMORY differs across ranks: rank 0 has 1, ranks 1, 2, 3, 4, 5, 6, 7, 8 "
        "and 91 more have 0."
    )
    assert differences([{"shared_memory": True}] * 3) == ""


@pytest.mark.timeout(30)
def test_each_generation_compares_its_own_values() -> None:
    # A first start agrees; the second start (hvd.shutdown(), then hvd.init()) does not.
    store = StoreClient("", 0, new_secret(), 10.0)
    outcomes, _ = _run_ranks([Settings()] * 2, generation=0, store=store)
    assert outcomes == {0: None, 1: None}
    differ = [Settings(), replace(Settings(), fusion_threshold_bytes=0)]
    outcomes, _ = _run_ranks(differ, generation=1, store=store)
    assert all(isinstance(outcome, SettingError) for outcome in outcomes.values()), outcomes
    assert "HORA_FUSION_THRESHOLD (or HOROVOD_FUSION_THRESHOLD) differs" in str(outcomes[1])


@pytest.mark.timeout(30)
def test_a_rank_that_does_not_come_is_named_within_the_timeout() -> None:
    started = time.monotonic()
    outcomes, _ = _run_ranks([Settings()] * 3, timeout_s=0.5, absent=(2,))
    assert time.monotonic() - started < 5.0
    for r in (0, 1):
        assert isinstance(outcomes[r], HoraInternalError), outcomes
        assert str(outcomes[r]).startswith(
            "rank 0 waited 0.5 s for rank 2 to reach hvd.init(), to compare the settings every "
            "rank must share. Check its output; raise HORA_START_TIMEOUT"
        )


@pytest.mark.timeout(30)
def test_a_missing_rank_0_is_named_by_the_others() -> None:
    outcomes, _ = _run_ranks([Settings()] * 3, timeout_s=0.5, absent=(0,))
    for r in (1, 2):
        assert isinstance(outcomes[r], HoraInternalError), outcomes
        assert str(outcomes[r]).startswith(f"rank {r} waited 0.5 s for rank 0 to reach hvd.init()")


@pytest.mark.timeout(30)
def test_a_forged_value_stops_the_comparison() -> None:
    store = StoreClient("", 0, new_secret(), 10.0)
    keys = GenerationKeys(0)
    store.store.set(store.key(keys.settings(1)), b'{"shared_memory": true}')  # unsigned
    topology = Topology(rank=0, size=2)
    with pytest.raises(HoraInternalError, match="rank 0 found tampering in the job's store"):
        agree_on_settings(topology, Settings(), store, keys, 5.0)


def test_a_job_of_one_compares_nothing() -> None:
    store = CountingStore(None)
    client = StoreClient("", 0, new_secret(), 1.0)
    client.store = store
    agree_on_settings(Topology(), Settings(), client, GenerationKeys(0), 1.0)
    assert store.calls == 0


def test_the_settings_that_choose_paths_are_compared() -> None:
    compared = {variable.env for variable in AGREED_SETTINGS.values()}
    assert {
        "HORA_SHARED_MEMORY",
        "HORA_SHM_SLOT_BYTES",
        "HORA_SHM_ARENA_BYTES",
        "HORA_HIERARCHICAL_ALLREDUCE",
        "HORA_CPU_OPERATIONS",
        "HORA_GPU_OPERATIONS",
        "HORA_FUSION_THRESHOLD",
        "HORA_CACHE_CAPACITY",
        "HORA_STEADY_STATE",
        "HORA_AUTOTUNE",
        "HORA_DETERMINISTIC",
        "HORA_DETERMINISTIC_MICROBATCHES",
    } <= compared
    # Only settings hvd.init() reads can be compared, and the docs say which they are.
    settings_variables = set(SETTINGS_VARIABLES.values())
    for variable in table.VARIABLES:
        assert not variable.agreed or variable in settings_variables, variable.env
        said = "compares it across ranks" in variable.meaning
        assert said == variable.agreed, variable.env
