"""Values a user may mistype: ``inf``, ``nan``, sizes beyond any machine, sizes off the page.

Every variable of the settings table refuses ``inf``, ``-inf`` and ``nan`` with a SettingError
that names it and the value (never a bare OverflowError); the shared-memory sizes have an upper
bound, and are rounded up to whole pages where the data path takes them.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest

from hora.common.transport import shm_segment
from hora.common.transport.paths import whole_pages
from hora.common.vocabulary import config
from hora.common.vocabulary import settings_table as table
from hora.common.vocabulary.config import SettingError, Settings
from hora.common.vocabulary.settings_table import Variable

NOT_FINITE = ["inf", "-inf", "nan", "Infinity", "1e400"]
# Kinds whose values are text: "inf" is a fine file or host name.
TEXT_KINDS = (table.TEXT, table.OPTIONAL_TEXT, table.CHOICE, table.LEVEL)


@pytest.mark.parametrize("text", NOT_FINITE)
@pytest.mark.parametrize("variable", table.VARIABLES, ids=lambda variable: variable.env)
def test_every_variable_refuses_what_is_not_a_finite_number_by_name(
    variable: Variable[Any], text: str
) -> None:
    env = {variable.env: text}
    if variable.kind in TEXT_KINDS:
        value = config.read(variable, env)  # text: read as it is; choices decide below
        assert value == variable.kind.parse(text)
        if variable.choices:
            assert f"{variable.env} must be one of" in (variable.problem(value) or "")
        return
    with pytest.raises(SettingError) as raised:
        config.read(variable, env)
    assert variable.env in str(raised.value) and repr(text) in str(raised.value)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"HORA_SHM_SLOT_BYTES": "inf"}, "HORA_SHM_SLOT_BYTES must be an integer, got 'inf'"),
        ({"HORA_SHM_ARENA_BYTES": "-inf"}, "HORA_SHM_ARENA_BYTES must be an integer, got '-inf'"),
        ({"HORA_SHARED_MEMORY": "inf"}, "HORA_SHARED_MEMORY must be 0 or 1, got 'inf'"),
        ({"HORA_SHARED_MEMORY": "nan"}, "HORA_SHARED_MEMORY must be 0 or 1, got 'nan'"),
        ({"HORA_CYCLE_TIME": "nan"}, r"HORA_CYCLE_TIME \(or HOROVOD_CYCLE_TIME\) must be a number"),
        (
            {"HOROVOD_GLOO_TIMEOUT_SECONDS": "inf"},
            r"HORA_GLOO_TIMEOUT_SECONDS \(or HOROVOD_GLOO_TIMEOUT_SECONDS\) must be a finite "
            r"number, got 'inf'",
        ),
        # No range: still finite (it becomes a timedelta).
        ({"HORA_STALL_SHUTDOWN_TIME_SECONDS": "inf"}, "must be a finite number, got 'inf'"),
    ],
)
def test_settings_name_the_variable_and_the_value(env: dict[str, str], match: str) -> None:
    with pytest.raises(SettingError, match=match):
        Settings.from_env(env)


def test_the_start_timeout_is_a_finite_number_too() -> None:
    with pytest.raises(SettingError, match="HORA_START_TIMEOUT .* must be a finite number"):
        config.start_timeout_s({"HORA_START_TIMEOUT": "inf"})


def test_a_horovod_variable_hora_only_names_may_hold_inf() -> None:
    # HOROVOD_TORUS_ALLREDUCE is read as a boolean to decide whether to name it.
    assert config.unheeded({"HOROVOD_TORUS_ALLREDUCE": "inf"}) == [
        "HOROVOD_TORUS_ALLREDUCE=inf has no effect: " + table.TORUS_ALLREDUCE.why
    ]


@pytest.mark.parametrize("name", ["HORA_SHM_SLOT_BYTES", "HORA_SHM_ARENA_BYTES"])
@pytest.mark.parametrize("text", ["1e16", "1e19", str(2**40 + 1)])
def test_shared_memory_sizes_beyond_a_tebibyte_are_refused(name: str, text: str) -> None:
    low = 65536 if name == "HORA_SHM_SLOT_BYTES" else 0
    expected = f"{name} must be between {low} and 1099511627776 bytes, got {int(float(text))}."
    with pytest.raises(SettingError) as raised:
        Settings.from_env({name: text})
    assert str(raised.value) == expected


def test_the_largest_and_smallest_sizes_are_taken() -> None:
    settings = Settings.from_env({"HORA_SHM_SLOT_BYTES": "65536", "HORA_SHM_ARENA_BYTES": "0"})
    assert (settings.shm_slot_bytes, settings.shm_arena_bytes) == (65536, 0)
    top = str(2**40)
    settings = Settings.from_env({"HORA_SHM_SLOT_BYTES": top, "HORA_SHM_ARENA_BYTES": top})
    assert (settings.shm_slot_bytes, settings.shm_arena_bytes) == (2**40, 2**40)
    with pytest.raises(SettingError, match="HORA_SHM_SLOT_BYTES must be between 65536 and"):
        Settings.from_env({"HORA_SHM_SLOT_BYTES": "65535"})


def test_integers_are_read_exactly() -> None:
    assert table.parse_int("1099511627777") == 2**40 + 1
    assert table.parse_int(" 16777216 ") == 16 * 1024 * 1024
    assert table.parse_int("1e6") == 1_000_000


def test_no_range_holds_what_is_not_finite() -> None:
    for bounds in (table.NON_NEGATIVE, table.POSITIVE, table.Bounds(), table.Bounds(high=1)):
        assert not bounds.allows(math.inf)
        assert not bounds.allows(-math.inf)
        assert not bounds.allows(math.nan)
    assert table.Bounds(0, 2**40).describe() == "between 0 and 1099511627776"
    assert table.Bounds(0.5, 2.5).describe() == "between 0.5 and 2.5"
    problem = table.GLOO_TIMEOUT_SECONDS.problem(math.inf)
    assert problem == "HORA_GLOO_TIMEOUT_SECONDS must be a finite number > 0 seconds, got inf."
    assert table.STALL_SHUTDOWN_TIME_SECONDS.problem(math.nan) == (
        "HORA_STALL_SHUTDOWN_TIME_SECONDS must be a finite number, got nan."
    )


@pytest.mark.parametrize(
    ("given", "taken"),
    [(0, 0), (1, 4096), (4096, 4096), (65536, 65536), (65538, 69632), (16 * 2**20 + 1, 16781312)],
)
def test_shared_memory_sizes_are_rounded_up_to_whole_pages(
    given: int, taken: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="hora"):
        assert whole_pages(given, table.SHM_SLOT_BYTES) == taken
    said = [record for record in caplog.records if "rounded up" in record.getMessage()]
    assert [record.levelno for record in said] == ([logging.DEBUG] if given != taken else [])
    if said:
        assert said[0].getMessage() == (
            f"HORA_SHM_SLOT_BYTES={given} is rounded up to {taken}, a multiple of 4096"
        )


def test_the_page_the_docs_name_is_the_segments() -> None:
    assert table.SHM_PAGE_BYTES == shm_segment.PAGE
    assert table.SHM_MAX_BYTES % shm_segment.PAGE == 0
    assert (table.SHM_SLOT_BYTES.bounds or table.Bounds()).low == 16 * shm_segment.PAGE
