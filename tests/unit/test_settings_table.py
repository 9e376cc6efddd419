"""The declarations of every HORA_* variable and horarun flag, and what is built from them."""

from __future__ import annotations

import ast
import dataclasses
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from hora.common.vocabulary import config
from hora.common.vocabulary import settings_table as table
from hora.runner import flags, options
from hora.runner.flags import OPTIONS, Option
from hora.tools import docs_tables

ROOT = Path(__file__).resolve().parents[2]
COMMAND = ["python", "train.py"]

# A value of the right shape for each kind of flag, on the command line and in a config file.
SAMPLES: dict[str, tuple[list[str], Any]] = {
    "int": (["1"], 1),
    "float": (["0.5"], 0.5),
    "text": (["x.log"], "x.log"),
    "level": (["info"], "info"),
}
# Flags whose value must name a real file (their own tests cover them).
UNSAMPLED = {"host_discovery_script", "config_file"}


# ---------------------------------------------------------------- variables


def test_variable_names_are_unique_and_twins_are_horovods() -> None:
    names = [variable.name for variable in table.VARIABLES]
    assert len(names) == len(set(names))
    for variable in table.VARIABLES:
        assert re.fullmatch(r"[A-Z][A-Z0-9_]*", variable.name), variable
        assert variable.env == f"HORA_{variable.name}"
        assert variable.horovod_env in (None, f"HOROVOD_{variable.name}")
        assert variable.meaning.strip(), f"{variable.env} has no meaning for the docs"


# The variables Horovod reads at run time (horovod/common/common.h, its env parser and
# operations, horovodrun's workers' environment), and HOROVOD_GPU_OPERATIONS, which Horovod reads
# when it is built.
HOROVODS = {
    "HOROVOD_FUSION_THRESHOLD",
    "HOROVOD_CYCLE_TIME",
    "HOROVOD_CACHE_CAPACITY",
    "HOROVOD_STALL_CHECK_DISABLE",
    "HOROVOD_STALL_CHECK_TIME_SECONDS",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
    "HOROVOD_GLOO_TIMEOUT_SECONDS",
    "HOROVOD_DYNAMIC_PROCESS_SETS",
    "HOROVOD_TIMELINE",
    "HOROVOD_TIMELINE_MARK_CYCLES",
    "HOROVOD_AUTOTUNE",
    "HOROVOD_AUTOTUNE_LOG",
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES",
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
    "HOROVOD_DISABLE_GROUP_FUSION",
    "HOROVOD_LOG_LEVEL",
    "HOROVOD_LOG_HIDE_TIME",
    "HOROVOD_CPU_OPERATIONS",
    "HOROVOD_CONTROLLER",
    "HOROVOD_GPU_OPERATIONS",
    "HOROVOD_HIERARCHICAL_ALLREDUCE",
    "HOROVOD_HIERARCHICAL_ALLGATHER",
    "HOROVOD_TORUS_ALLREDUCE",
    "HOROVOD_GLOO_IFACE",
    "HOROVOD_START_TIMEOUT",
    "HOROVOD_RANK",
    "HOROVOD_SIZE",
    "HOROVOD_LOCAL_RANK",
    "HOROVOD_LOCAL_SIZE",
    "HOROVOD_CROSS_RANK",
    "HOROVOD_CROSS_SIZE",
    "HOROVOD_HOSTNAME",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR",
    "HOROVOD_GLOO_RENDEZVOUS_PORT",
    "HOROVOD_ELASTIC",
    "HOROVOD_ELASTIC_TIMEOUT",
    "HOROVOD_SECRET_KEY",
    "HOROVOD_MPI_THREADS_DISABLE",
    "HOROVOD_BATCH_D2D_MEMCOPIES",
    "HOROVOD_NUM_NCCL_STREAMS",
    "HOROVOD_CCL_CACHE",
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE",
    "HOROVOD_THREAD_AFFINITY",
    "HOROVOD_DISABLE_NVTX_RANGES",
    "HOROVOD_ENABLE_ASYNC_COMPLETION",
    "HOROVOD_ENABLE_XLA_OPS",
}


def test_every_horovod_name_hora_reads_is_horovods_and_none_is_dropped() -> None:
    twins = {v.horovod_env for v in table.VARIABLES if v.horovod_env}
    also = {n for v in table.VARIABLES for n in v.also_read if n.startswith("HOROVOD_")}
    unheeded = {n for entry in table.UNHEEDED for n in entry.names if n.startswith("HOROVOD_")}
    # docs/environment.md lists as twins only variables Horovod has ...
    assert twins <= HOROVODS, sorted(twins - HOROVODS)
    assert also | unheeded <= HOROVODS, sorted((also | unheeded) - HOROVODS)
    # ... and every variable Horovod has is acted on, or named at hvd.init() when set.
    assert twins | also | unheeded >= HOROVODS, sorted(HOROVODS - twins - also - unheeded)


def test_horarun_and_init_give_one_reason_for_what_has_no_effect() -> None:
    reasons = {entry.why for entry in table.UNHEEDED}
    for option in OPTIONS:
        if option.doc_table == "inert":
            assert option.inert in reasons, option.flag


def test_defaults_lie_within_their_bounds_and_choices() -> None:
    for variable in table.VARIABLES:
        if variable.default is not None:
            assert variable.problem(variable.default) is None, variable.env


@pytest.mark.parametrize(
    ("bounds", "inside", "outside", "text"),
    [
        (table.NON_NEGATIVE, [0, 5], [-1], ">= 0"),
        (table.POSITIVE, [0.5], [0, -1], "> 0"),
        (table.Bounds(low=1, high=3), [1, 3], [0, 4], "between 1 and 3"),
        (table.Bounds(high=3), [-5, 3], [4], "<= 3"),
    ],
)
def test_bounds(bounds: table.Bounds, inside: list[float], outside: list[float], text: str) -> None:
    assert all(bounds.allows(value) for value in inside)
    assert not any(bounds.allows(value) for value in outside)
    assert bounds.describe() == text


def test_settings_take_their_defaults_from_the_table() -> None:
    fields = {field.name: field.default for field in dataclasses.fields(config.Settings)}
    assert set(fields) == set(config.SETTINGS_VARIABLES)
    for name, variable in config.SETTINGS_VARIABLES.items():
        expected = not variable.default if name == "stall_check_enabled" else variable.default
        assert fields[name] == expected, name
    assert config.Settings.from_env({}) == config.Settings()


def test_a_variable_declared_without_a_twin_is_read_under_its_hora_name_only() -> None:
    assert config.raw(table.STEADY_STATE, {"HOROVOD_STEADY_STATE": "0"}) is None
    assert config.raw(table.STEADY_STATE, {"HORA_STEADY_STATE": "0"}) == "0"
    assert config.raw(table.CYCLE_TIME, {"HOROVOD_CYCLE_TIME": "4"}) == "4"
    assert config.Settings.from_env({"HOROVOD_STEADY_STATE": "0"}).steady_state is True


def test_range_errors_name_the_variable_the_rule_and_the_value() -> None:
    with pytest.raises(config.SettingError, match=r"HORA_GLOO_TIMEOUT_SECONDS must be > 0 seconds"):
        config.Settings.from_env({"HOROVOD_GLOO_TIMEOUT_SECONDS": "0"})
    with pytest.raises(config.SettingError, match=r"must be >= 1 steps, got 0"):
        config.Settings.from_env({"HORA_AUTOTUNE_STEPS_PER_SAMPLE": "0"})


def test_the_table_imports_nothing_of_hora() -> None:
    source = (ROOT / "hora/common/vocabulary/settings_table.py").read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            assert node.module is not None and not node.module.startswith("hora"), node.module
        if isinstance(node, ast.Import):
            assert not any(alias.name.startswith("hora") for alias in node.names)


def test_the_elastic_defaults_agree_with_the_table() -> None:
    from hora.common.job import rounds as worker_side

    assert table.ELASTIC_TIMEOUT.default == worker_side.DEFAULT_TIMEOUT_S
    assert table.ELASTIC.env == worker_side.ELASTIC_VAR


# ---------------------------------------------------------------- flags


def test_every_flag_is_declared_once_with_help() -> None:
    dests = [option.dest for option in OPTIONS]
    assert len(dests) == len(set(dests))
    names = [name for option in OPTIONS for name in (*option.flags, *option.opposite)]
    assert len(names) == len(set(names))
    groups = {group.name for group in flags.GROUPS}
    for option in OPTIONS:
        assert all(name.startswith("-") for name in option.flags), option.flags
        assert option.group in groups, option.dest
        assert option.help_text().strip(), f"{option.flag} has no help"
        assert option.doc_table is not None or option.elastic_doc, f"{option.flag} is not in docs"
        assert not (option.opposite and option.shape != "switch"), option.flag


def test_flags_set_declared_variables_within_their_ranges() -> None:
    for option in OPTIONS:
        if option.variable is not None:
            assert table.BY_NAME[option.variable.name] is option.variable, option.flag
        if option.limits is not None and option.variable is not None:
            default = option.variable.default
            assert default is None or option.limits.allows(default), option.flag
        if option.bounds is not None and option.variable is not None and option.variable.bounds:
            # A flag may only narrow its variable's range, never widen it.
            low, var_low = option.bounds.low, option.variable.bounds.low
            assert low is not None and (var_low is None or low >= var_low), option.flag


def test_the_parser_has_each_flag_with_a_default_of_none() -> None:
    parser = options.build_parser()
    defaults = vars(parser.parse_args([]))
    assert set(defaults) == {option.dest for option in OPTIONS} | {"command"}
    assert all(value is None for key, value in defaults.items() if key != "command")
    for option in OPTIONS:
        for name in (*option.flags, *option.opposite):
            assert name in parser._option_string_actions, name


def _given(option: Option) -> list[str]:
    if option.shape == "switch":
        return [option.flags[0]]
    if option.shape == "pair":
        return [option.flags[0], "2", "5"]
    if option.shape == "text" and option.variable is not None and option.variable.choices:
        return [option.flags[0], option.variable.choices[-1]]
    return [option.flags[0], *SAMPLES["int" if option.shape == "append" else option.shape][0]]


@pytest.mark.parametrize("option", OPTIONS, ids=lambda option: option.flag)
def test_each_flag_parses_and_sets_its_variable(option: Option) -> None:
    if option.refused or option.shape == "append" or option.dest in UNSAMPLED:
        pytest.skip("refused, or checked elsewhere")
    argv = ["-np", "1"] if option.dest != "np" else []
    if option.elastic_only or option.dest == "max_np":
        argv += ["--min-np", "1"]
    values, _ = options.read([*argv, *_given(option), *COMMAND])
    assert values[option.dest] is not None
    env = options.engine_env(values)
    if option.variable is not None:
        assert option.variable.env in env
    said = "\n".join(options.notes(values))
    if option.dest != "slots":  # noted without a discovery script (test_elastic_driver.py)
        assert (f"{option.flag} has no effect" in said) == bool(option.inert)


CONFIG_OPTIONS = [o for o in OPTIONS if o.config_key is not None and "." in o.config_key]


@pytest.mark.parametrize("option", CONFIG_OPTIONS, ids=lambda option: option.config_key or "")
def test_a_config_key_sets_what_its_flag_sets(tmp_path: Path, option: Option) -> None:
    assert option.config_key is not None
    section, key = option.config_key.split(".")
    assert options.CONFIG_KEYS[section][key] == option.dest
    if option.shape == "switch":
        value_text, argv = str(option.stores).lower(), [option.flags[0]]
    else:
        argv, value = _given(option), SAMPLES[option.shape][1]
        value_text = repr(value) if isinstance(value, str) else str(value)
    path = tmp_path / "horovod.yaml"
    path.write_text(textwrap.dedent(f"{section}:\n  {key}: {value_text}\n"))
    from_file, _ = options.read(["-np", "1", "--config-file", str(path), *COMMAND])
    from_flag, _ = options.read(["-np", "1", *argv, *COMMAND])
    assert from_file[option.dest] == from_flag[option.dest]
    assert options.engine_env(from_file) == options.engine_env(from_flag)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--gloo-timeout-seconds", "0"], r"--gloo-timeout-seconds must be > 0 seconds, got 0"),
        (["--autotune-steps-per-sample", "0"], r"--autotune-steps-per-sample must be >= 1"),
        (["--ssh-port", "70000"], r"--ssh-port must be between 1 and 65535, got 70000"),
        (["--autotune-gaussian-process-noise", "2"], r"between 0 and 1, got 2"),
        (["--cache-capacity", "-1"], r"cache_capacity=-1 must be >= 0 \(--cache-capacity or "),
    ],
)
def test_out_of_range_flags_are_refused_by_name(argv: list[str], match: str) -> None:
    with pytest.raises(options.OptionError, match=match):
        options.parse(["-np", "1", *argv, *COMMAND])


def test_help_names_each_variable_and_its_default() -> None:
    text = " ".join(options.build_parser().format_help().split())
    assert "(HORA_CYCLE_TIME; default 1)" in text
    assert "(HORA_STALL_CHECK_DISABLE=1)" in text
    assert "(HORA_FUSION_THRESHOLD; default 128)" in text


# ---------------------------------------------------------------- docs


@pytest.mark.parametrize("name", docs_tables.FILES)
def test_the_docs_tables_are_the_generated_ones(name: str) -> None:
    text = (ROOT / "docs" / name).read_text()
    assert docs_tables.blocks(text), f"docs/{name} marks no table"
    assert docs_tables.render(text) == text, (
        f"docs/{name} is out of date: run `python -m hora.tools.docs_tables`"
    )


def test_every_table_is_in_the_docs_once() -> None:
    marked = [name for file in docs_tables.FILES for name in docs_tables.blocks(
        (ROOT / "docs" / file).read_text()
    )]  # fmt: skip
    assert sorted(marked) == sorted(docs_tables.TABLES)


def test_the_docs_list_every_variable_and_flag() -> None:
    env_doc = (ROOT / "docs/environment.md").read_text()
    for variable in table.VARIABLES:
        assert f"`{variable.env}`" in env_doc, variable.env
    flag_docs = (ROOT / "docs/launching.md").read_text() + (ROOT / "docs/elastic.md").read_text()
    for option in OPTIONS:
        assert f"`{option.flags[0]}" in flag_docs, option.flag


def test_the_check_mode_reports_a_stale_file(tmp_path: Path) -> None:
    for name in docs_tables.FILES:
        (tmp_path / name).write_text((ROOT / "docs" / name).read_text())
    assert docs_tables.main(["--check", "--docs", str(tmp_path)]) == 0
    stale = (tmp_path / "environment.md").read_text().replace("`HORA_CYCLE_TIME`", "`X`", 1)
    (tmp_path / "environment.md").write_text(stale)
    assert docs_tables.main(["--check", "--docs", str(tmp_path)]) == 1
    assert docs_tables.main(["--docs", str(tmp_path)]) == 0
    assert docs_tables.main(["--check", "--docs", str(tmp_path)]) == 0
