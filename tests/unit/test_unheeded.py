"""What is set but not acted on is named: Horovod's variables for what hora does not have, its
values that hora lacks, HOROVOD_CONTROLLER, unknown HORA_* names; and the variables whose reading
follows Horovod's (HOROVOD_CONTROLLER's choice, interface lists, HOROVOD_TIMELINE=DYNAMIC)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from hora.common.vocabulary import config
from hora.common.vocabulary import settings_table as table
from hora.common.vocabulary.config import Settings
from hora.runner import options

ROOT = Path(__file__).resolve().parents[2]
COMMAND = ["python", "train.py"]

# A value that asks each of Horovod's unheeded variables for what hora does not do, and one that
# asks only for what hora does anyway (``None``: every value asks).
ASKING: dict[str, tuple[str, str | None]] = {
    "HOROVOD_TORUS_ALLREDUCE": ("1", "0"),
    "HOROVOD_HIERARCHICAL_ALLGATHER": ("1", "0"),
    "HOROVOD_NUM_NCCL_STREAMS": ("2", "1"),
    "HOROVOD_THREAD_AFFINITY": ("0,1", None),
    "HOROVOD_MPI_THREADS_DISABLE": ("1", "0"),
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": ("20", None),
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": ("0.8", None),
    "HOROVOD_BATCH_D2D_MEMCOPIES": ("0", "1"),
    "HOROVOD_ENABLE_ASYNC_COMPLETION": ("1", "0"),
    "HOROVOD_ENABLE_XLA_OPS": ("1", "0"),
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE": ("1048576", None),
    "HOROVOD_CCL_CACHE": ("1", "0"),
    "HOROVOD_DISABLE_NVTX_RANGES": ("0", "1"),
    "HOROVOD_ELASTIC": ("1", "0"),
    "HOROVOD_SECRET_KEY": ("c2VjcmV0", None),
    "HOROVOD_CONTROLLER": ("ccl", "mpi"),
}


def test_every_unheeded_variable_is_exercised() -> None:
    assert {entry.name for entry in table.UNHEEDED} == set(ASKING)


@pytest.mark.parametrize("entry", table.UNHEEDED, ids=lambda entry: entry.name)
def test_a_value_hora_does_not_honour_is_named_with_the_reason(entry: table.Unheeded) -> None:
    asking, harmless = ASKING[entry.name]
    lines = config.unheeded({entry.name: asking})
    assert len(lines) == 1, lines
    assert lines[0].startswith(entry.name), lines
    assert lines[0].endswith(f"has no effect: {entry.why}"), lines
    if harmless is not None:
        assert config.unheeded({entry.name: harmless}) == []
    assert config.unheeded({entry.name: ""}) == []  # set to nothing is unset


def test_a_secret_is_named_without_its_value() -> None:
    (line,) = config.unheeded({"HOROVOD_SECRET_KEY": "c2VjcmV0"})
    assert "c2VjcmV0" not in line
    assert line.startswith("HOROVOD_SECRET_KEY has no effect: hora's job secret is")


def test_hora_names_win_over_horovod_twins_for_unheeded_settings() -> None:
    env = {"HORA_HIERARCHICAL_ALLGATHER": "0", "HOROVOD_HIERARCHICAL_ALLGATHER": "1"}
    assert config.unheeded(env) == []
    (line,) = config.unheeded({"HORA_HIERARCHICAL_ALLGATHER": "1"})
    assert line.startswith("HORA_HIERARCHICAL_ALLGATHER=1 has no effect: hora's allgather")


def test_a_clean_or_hora_only_environment_names_nothing() -> None:
    env = {v.env: "1" for v in table.VARIABLES}
    env.update({name: "x" for name in table.SCRIPT_VARIABLES})
    env.update(HOROVOD_FUSION_THRESHOLD="0", HOROVOD_CYCLE_TIME="2", PATH="/bin")
    env.update(HORA_CPU_OPERATIONS="gloo", HORA_GPU_OPERATIONS="host", HORA_LOG_LEVEL="INFO")
    env.update(HORA_HIERARCHICAL_ALLGATHER="0")
    assert config.unheeded(env) == []
    assert config.unheeded({}) == []


def test_horovods_build_variables_are_not_named() -> None:
    # Horovod ignores them at run time too; images often leave them set.
    env = {"HOROVOD_WITH_PYTORCH": "1", "HOROVOD_GPU_ALLREDUCE": "NCCL", "HOROVOD_WITHOUT_MPI": "1"}
    assert config.unheeded(env) == []


# ---------------------------------------------------------------- unknown HORA_* names


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [
        ("HORA_FUSION_THRESHLD", "HORA_FUSION_THRESHOLD"),
        ("HORA_STALL_CHECK_TIME_SECOND", "HORA_STALL_CHECK_TIME_SECONDS"),
        ("HORA_GLOO_IFAC", "HORA_GLOO_IFACE"),
    ],
)
def test_a_misspelt_hora_name_is_named_with_the_closest_one(name: str, suggestion: str) -> None:
    assert config.unheeded({name: "1"}) == [
        f"{name} is not a variable hora reads; did you mean {suggestion}?"
    ]


def test_an_unknown_hora_name_without_a_close_one_is_named_alone() -> None:
    assert config.unheeded({"HORA_WIBBLE": "1"}) == ["HORA_WIBBLE is not a variable hora reads"]


def test_a_horovod_only_setting_under_a_hora_name_gives_horovods_reason() -> None:
    (line,) = config.unheeded({"HORA_TORUS_ALLREDUCE": "1"})
    assert line == f"HORA_TORUS_ALLREDUCE=1 has no effect: {table.TORUS_ALLREDUCE.why}"


def test_the_examples_read_only_declared_hora_names() -> None:
    # The scripts' own variables are declared, so that hvd.init() does not call them typos.
    known = {v.env for v in table.VARIABLES} | set(table.SCRIPT_VARIABLES)
    for path in (ROOT / "examples").rglob("*"):
        if path.is_file() and path.suffix in {".sh", ".sbatch", ".py", ".yaml", ".md"}:
            for name in set(re.findall(r"\bHORA_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())):
                assert name in known, f"{path.relative_to(ROOT)} uses {name}"


# ---------------------------------------------------------------- Horovod's values hora lacks


def test_horovods_ccl_is_named_and_the_cpu_path_falls_back() -> None:
    assert config.unheeded({"HOROVOD_CPU_OPERATIONS": "CCL"}) == [
        f"HOROVOD_CPU_OPERATIONS=CCL has no effect: {table.CPU_OPERATIONS.lacking}"
    ]
    assert config.cpu_operations({"HOROVOD_CPU_OPERATIONS": "ccl"}) == ("gloo", None)
    # The controller's library takes its place, as the reason says.
    env = {"HOROVOD_CPU_OPERATIONS": "ccl", "HOROVOD_CONTROLLER": "MPI"}
    assert config.cpu_operations(env) == ("mpi", "HOROVOD_CONTROLLER")
    assert Settings.from_env(env).cpu_operations == "mpi"


def test_horovods_mpi_gpu_path_is_named_and_nccl_used() -> None:
    env = {"HOROVOD_GPU_OPERATIONS": "MPI"}
    assert config.unheeded(env) == [
        f"HOROVOD_GPU_OPERATIONS=MPI has no effect: {table.GPU_OPERATIONS.lacking}"
    ]
    assert Settings.from_env(env).gpu_operations == "nccl"
    assert config.unheeded({"HOROVOD_GPU_OPERATIONS": "NCCL"}) == []


def test_hora_names_still_refuse_values_hora_lacks() -> None:
    with pytest.raises(config.SettingError, match="HORA_GPU_OPERATIONS must be one of nccl, host"):
        Settings.from_env({"HORA_GPU_OPERATIONS": "mpi"})


# ---------------------------------------------------------------- HOROVOD_CONTROLLER


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, ("gloo", None)),
        ({"HOROVOD_CONTROLLER": "mpi"}, ("mpi", "HOROVOD_CONTROLLER")),
        ({"HOROVOD_CONTROLLER": "GLOO"}, ("gloo", "HOROVOD_CONTROLLER")),
        ({"HOROVOD_CONTROLLER": "ccl"}, ("gloo", None)),
        ({"HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": "gloo"},
         ("gloo", "HOROVOD_CPU_OPERATIONS")),
        ({"HOROVOD_CONTROLLER": "gloo", "HORA_CPU_OPERATIONS": "mpi"},
         ("mpi", "HORA_CPU_OPERATIONS")),
    ],
)  # fmt: skip
def test_horovod_controller_chooses_the_path_when_nothing_else_does(
    env: dict[str, str], expected: tuple[str, str | None]
) -> None:
    assert config.cpu_operations(env) == expected
    assert Settings.from_env(env).cpu_operations == expected[0]


def test_a_controller_that_another_variable_overrides_is_named() -> None:
    env = {"HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": "gloo"}
    assert config.unheeded(env) == [
        "HOROVOD_CONTROLLER=mpi has no effect: HOROVOD_CPU_OPERATIONS=gloo chooses the library, "
        "and hora negotiates over the library that moves CPU data."
    ]
    assert config.unheeded({"HOROVOD_CONTROLLER": "mpi", "HORA_CPU_OPERATIONS": "mpi"}) == []


# ---------------------------------------------------------------- read as Horovod reads them


def test_horovods_dynamic_timeline_opens_no_file_at_init() -> None:
    assert config.timeline_path({"HOROVOD_TIMELINE": "DYNAMIC"}) is None
    assert config.timeline_path({"HORA_TIMELINE": "t.json"}) == "t.json"
    assert config.timeline_path({}) is None


@pytest.mark.parametrize(
    ("env", "interface"),
    [
        ({"HORA_GLOO_IFACE": "eth1,eth2"}, "eth1"),
        ({"HOROVOD_GLOO_IFACE": " eth2 , eth1"}, "eth2"),
        ({"GLOO_SOCKET_IFNAME": "ib0,eth0"}, "ib0"),
        ({"HORA_GLOO_IFACE": "eth1", "GLOO_SOCKET_IFNAME": "ib0"}, "eth1"),
        ({}, ""),
    ],
)
def test_gloo_uses_the_first_interface_of_a_list(env: dict[str, str], interface: str) -> None:
    assert config.gloo_interface(env) == interface


@pytest.mark.parametrize(
    "argv",
    [
        ["--network-interface", "eth0,eth1"],
        ["--network-interface", "eth0", "--network-interface", "eth1"],
        ["--network-interfaces", "eth0, eth1"],
        ["--network-interface", "eth0", "--network-interfaces", "eth1,eth0"],
    ],
)
def test_network_interface_lists_are_split_on_commas_as_horovodrun_splits_them(
    argv: list[str],
) -> None:
    launch = options.parse(["-np", "1", *argv, *COMMAND])
    assert isinstance(launch, options.LaunchOptions)
    assert launch.hosts.interfaces == ("eth0", "eth1")


# ---------------------------------------------------------------- the warning at init


def test_one_warning_names_every_line(caplog: pytest.LogCaptureFixture) -> None:
    env = {"HOROVOD_TORUS_ALLREDUCE": "1", "HORA_CYCLE_TIM": "3"}
    with caplog.at_level(logging.WARNING, logger="hora"):
        lines = config.name_unheeded(env)
    assert len(lines) == 2
    (record,) = [r for r in caplog.records if r.name == "hora"]
    text = record.getMessage()
    assert text.startswith("hora does not act on these 2 variables set in this environment:")
    assert all(f"\n  {line}\n" in text for line in lines), text
    assert text.endswith(f"See {config.UNHEEDED_DOC}.")
    assert (ROOT / "docs/environment.md").read_text().count(
        "\n## Variables hora does not act on\n"
    ) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hora"):
        assert config.name_unheeded({"HORA_CYCLE_TIME": "3"}) == []
    assert not caplog.records
