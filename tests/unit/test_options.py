"""horarun's flags and config file: what they set for the workers, and what they refuse."""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

from hora.common.vocabulary.settings_table import BY_NAME
from hora.runner import options
from hora.runner.flags import BY_DEST
from hora.runner.options import LaunchOptions, OptionError, Query, Refused

COMMAND = ["python", "train.py"]


def parse(argv: Sequence[str]) -> LaunchOptions:
    """The options of a job (not a query)."""
    parsed = options.parse(argv)
    assert isinstance(parsed, LaunchOptions)
    return parsed


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "horovod.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_horovodrun_flags_map_to_hora_variables() -> None:
    args = parse(
        [
            "-np", "4", "--fusion-threshold-mb", "2", "--cycle-time-ms", "3.5",
            "--cache-capacity", "512", "--no-stall-check",
            "--stall-check-warning-time-seconds", "90", "--stall-check-shutdown-time-seconds", "300",
            "--gloo-timeout-seconds", "45", "--log-level", "debug", "--log-without-timestamp",
            "--start-timeout", "60", "--tcp", *COMMAND,
        ]
    )  # fmt: skip
    assert args.engine_env == {
        "HORA_FUSION_THRESHOLD": str(2 * 1024 * 1024),
        "HORA_CYCLE_TIME": "3.5",
        "HORA_CACHE_CAPACITY": "512",
        "HORA_STALL_CHECK_DISABLE": "1",
        "HORA_STALL_CHECK_TIME_SECONDS": "90",
        "HORA_STALL_SHUTDOWN_TIME_SECONDS": "300",
        "HORA_GLOO_TIMEOUT_SECONDS": "45",
        "HORA_LOG_LEVEL": "DEBUG",
        "HORA_LOG_HIDE_TIME": "1",
        "HORA_START_TIMEOUT": "60",
        "NCCL_IB_DISABLE": "1",
    }
    assert args.command == tuple(COMMAND) and args.np == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.np = 2  # type: ignore[misc]


def test_single_dash_long_flags_and_repeatable_interfaces() -> None:
    args = parse(
        ["-np", "2", "-hostfile", "hosts", "-prefix-timestamp", "-p", "2222", "-i", "key",
         "--network-interface", "eth1", "--network-interfaces", "eth2,eth1", "--", *COMMAND]
    )  # fmt: skip
    assert args.hosts.hostfile == "hosts" and args.output.timestamp
    assert (args.hosts.ssh.port, args.hosts.ssh.identity_file) == (2222, "key")
    assert args.hosts.interfaces == ("eth1", "eth2")
    assert args.command == tuple(COMMAND)


def test_config_file_fills_what_the_command_line_left_out(tmp_path: Path) -> None:
    path = _config(
        tmp_path,
        """
        controller: gloo
        params:
          fusion_threshold_mb: 32
          cycle_time_ms: 2
          cache_capacity: 0
          hierarchical_allreduce: true
        autotune:
          enabled: false
        stall_check:
          enabled: true
          warning_time_seconds: 30
        library_options:
          gloo_timeout_seconds: 90
          num_nccl_streams: 2
        logging:
          level: info
          with_timestamp: true
        """,
    )
    args = parse(["-np", "2", "--config-file", path, "--cycle-time-ms", "5", *COMMAND])
    env = args.engine_env
    assert env["HORA_FUSION_THRESHOLD"] == str(32 * 1024 * 1024)
    assert env["HORA_CYCLE_TIME"] == "5"  # the command line wins
    assert env["HORA_CACHE_CAPACITY"] == "0"
    assert env["HORA_STALL_CHECK_DISABLE"] == "0"
    assert env["HORA_STALL_CHECK_TIME_SECONDS"] == "30"
    assert env["HORA_GLOO_TIMEOUT_SECONDS"] == "90"
    assert env["HORA_LOG_LEVEL"] == "INFO"
    assert env["HORA_LOG_HIDE_TIME"] == "0"
    assert env["HORA_HIERARCHICAL_ALLREDUCE"] == "1"
    said = "\n".join(args.notes)
    assert "--hierarchical-allreduce" not in said
    assert "--num-nccl-streams has no effect" in said
    assert "--autotune" not in said  # enabled: false asks for nothing


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("params:\n  fusion_threshold_mb: -1\n", r"fusion_threshold_mb=-1 must be >= 0"),
        ("params:\n  fusion_treshold_mb: 1\n", r"unknown key params.fusion_treshold_mb"),
        ("tuning:\n  x: 1\n", "unknown section 'tuning'"),
        ("params:\n  cache_capacity: 1.5\n", "must be a whole number"),
        ("stall_check:\n  enabled: 1\n", "must be true or false"),
        ("logging:\n  level: loud\n", "must be one of TRACE"),
        ("controller: nccl\n", "must be gloo or mpi"),
        ("params: [1, 2\n", "is not valid YAML"),
        ("- a\n- b\n", "must hold a mapping"),
    ],
)
def test_bad_config_files_are_refused_with_the_key(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(OptionError, match=match):
        parse(["-np", "1", "--config-file", _config(tmp_path, text), *COMMAND])


def test_negative_numbers_on_the_command_line_are_refused() -> None:
    with pytest.raises(OptionError, match=r"cycle_time_ms=-1 must be >= 0"):
        parse(["-np", "1", "--cycle-time-ms", "-1", *COMMAND])
    with pytest.raises(OptionError, match="must look like Key=Value"):
        parse(["-np", "1", "--ssh-option=-F/tmp/x", *COMMAND])


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["-np", "0"], r"-np must be >= 1, got 0\."),
        (["-np", "-1"], r"-np must be >= 1, got -1\."),
        (["--min-np", "0"], r"--min-np must be >= 1, got 0\."),
        (["-np", "2", "--max-np", "-2"], r"--max-np must be >= 1, got -2\."),
        (["-np", "3", "--max-np", "2"], r"-np 3 is more than --max-np 2\."),
        (["-np", "2", "--min-np", "3"], r"-np 2 is less than --min-np 3"),
    ],
)
def test_process_counts_are_checked_before_anything_starts(argv: list[str], match: str) -> None:
    with pytest.raises(OptionError, match=match):
        parse([*argv, *COMMAND])


def test_launcher_timeouts_come_from_their_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HORA_LAUNCHER_TIMEOUT_SECONDS", raising=False)
    monkeypatch.delenv("HORA_HOST_DISCOVERY_TIMEOUT", raising=False)
    args = parse(["-np", "1", *COMMAND])
    assert (args.launcher_timeout_s, args.hosts.discovery_timeout_s) == (60.0, 60.0)
    monkeypatch.setenv("HORA_LAUNCHER_TIMEOUT_SECONDS", "2.5")
    monkeypatch.setenv("HORA_HOST_DISCOVERY_TIMEOUT", "7")
    args = parse(["-np", "1", *COMMAND])
    assert (args.launcher_timeout_s, args.hosts.discovery_timeout_s) == (2.5, 7.0)


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("HORA_LAUNCHER_TIMEOUT_SECONDS", "0", r"must be > 0 seconds, got 0\.0\."),
        ("HORA_LAUNCHER_TIMEOUT_SECONDS", "-5", r"must be > 0 seconds, got -5\.0\."),
        ("HORA_HOST_DISCOVERY_TIMEOUT", "soon", r"must be a number, got 'soon'\."),
    ],
)
def test_bad_launcher_timeouts_are_refused_by_name(
    name: str, value: str, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(OptionError, match=f"^{name} {match}"):
        options.env_seconds(BY_NAME[name.removeprefix("HORA_")], {name: value})
    monkeypatch.setenv(name, value)
    with pytest.raises(OptionError, match=f"^{name} {match}"):
        parse(["-np", "1", *COMMAND])


def test_flags_hora_cannot_honour_are_refused() -> None:
    with pytest.raises(Refused) as refused:
        parse(["-np", "2", "--jsrun", "--min-np", "1", *COMMAND])
    said = "\n".join(refused.value.reasons)
    assert "--jsrun is not available" in said
    assert "--min-np" not in said  # elastic jobs are available (hora.runner.elastic)
    # --version and --check-build are answered before anything is refused or required.
    assert options.parse(["--version", "--jsrun"]) is Query.VERSION
    assert options.parse(["--check-build"]) is Query.CHECK_BUILD


def test_a_missing_command_or_np_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, said in [
        (["-np", "2"], "no command given"),
        ([*COMMAND], "-np is required"),
        (["--max-np", "2", *COMMAND], "-np (or --min-np) is required"),
    ]:
        with pytest.raises(SystemExit) as exited:
            parse(argv)
        assert exited.value.code == 2
        assert said in capsys.readouterr().err


def test_timeline_flags_become_variables(tmp_path: Path) -> None:
    args = parse(["-np", "2", "--timeline-filename", "t.json", "--timeline-mark-cycles", *COMMAND])
    env = args.engine_env
    assert env["HORA_TIMELINE"] == str(Path("t.json").resolve())
    assert env["HORA_TIMELINE_MARK_CYCLES"] == "1"
    from_file = parse(
        [
            "-np",
            "1",
            "--config-file",
            _config(tmp_path, "timeline:\n  filename: x.json\n"),
            *COMMAND,
        ]
    )
    assert from_file.engine_env["HORA_TIMELINE"] == str(Path("x.json").resolve())


def test_controller_from_config_yields_to_the_command_line(tmp_path: Path) -> None:
    args = parse(
        ["-np", "1", "--config-file", _config(tmp_path, "controller: mpi\n"), "--gloo", *COMMAND]
    )
    assert not args.mpi.enabled and args.engine_env["HORA_CPU_OPERATIONS"] == "gloo"
    from_file = parse(["-np", "1", "--config-file", _config(tmp_path, "controller: mpi\n"), "x"])
    assert from_file.mpi.enabled


def test_every_horovodrun_flag_is_accepted() -> None:
    flags = [
        "--disable-cache", "--hierarchical-allgather", "--torus-allreduce", "--autotune",
        "--autotune-log-file", "a.csv", "--autotune-warmup-samples", "3",
        "--autotune-steps-per-sample", "10", "--autotune-bayes-opt-max-samples", "20",
        "--autotune-gaussian-process-noise", "0.8", "--timeline-mark-cycles",
        "--mpi-threads-disable", "--mpi-args=--bind-to none", "--binding-args", "x",
        "--num-nccl-streams", "2", "--thread-affinity", "0,1", "--log-with-timestamp",
        "--no-hierarchical-allreduce", "--no-autotune", "--stall-check", "--gloo",
    ]  # fmt: skip
    args = parse(["-np", "1", *flags, *COMMAND])
    # --gloo, --mpi-args, --binding-args and the hierarchical switches act: not noted as inert.
    assert len(args.notes) >= 7
    assert args.engine_env["HORA_HIERARCHICAL_ALLREDUCE"] == "0"
    assert args.engine_env["HORA_HIERARCHICAL_ALLGATHER"] == "1"
    assert (args.mpi.args, args.mpi.binding_args) == ("--bind-to none", "x")
    env = args.engine_env
    assert env["HORA_AUTOTUNE"] == "0"  # --no-autotune came last
    assert env["HORA_AUTOTUNE_LOG"] == str(Path("a.csv").resolve())
    assert env["HORA_AUTOTUNE_WARMUP_SAMPLES"] == "3"
    assert env["HORA_AUTOTUNE_STEPS_PER_SAMPLE"] == "10"
    assert env["HORA_TIMELINE_MARK_CYCLES"] == "1"
    assert options.build_parser().prog == "horarun"


# The typed options and their parts.
PARTS = (
    options.LaunchOptions,
    options.HostOptions,
    options.OutputOptions,
    options.ElasticOptions,
    options.MpiOptions,
)


def test_each_flag_lands_in_one_field_or_says_why_not() -> None:
    """The flag table is the one declaration: a field names the flag it holds, and a flag the
    runner does not read as such sets a variable, has no effect, is refused, or is read while
    parsing."""
    held = [
        dest
        for kind in PARTS
        for item in dataclasses.fields(kind)
        if (dest := options.flag_of(item)) is not None
    ]
    assert len(held) == len(set(held))
    worked_out = {
        "version", "check_build", "config_file", "np", "min_np", "elastic_timeout",
        "network_interface", "network_interfaces", "ssh_port", "ssh_identity_file", "ssh_option",
        "start_timeout",
    }  # fmt: skip
    for dest, option in BY_DEST.items():
        why = [
            dest in held,
            dest in worked_out,
            option.variable is not None or bool(option.sets),
            bool(option.inert),
            bool(option.refused),
        ]
        assert any(why), f"{option.flag} is read nowhere"
    assert all(dest in BY_DEST for dest in worked_out)
    with pytest.raises(ValueError, match="no flag of hora.runner.flags sets 'ssh_prot'"):
        options.flag("ssh_prot")


def test_flags_reach_the_typed_options(tmp_path: Path) -> None:
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    args = parse(
        ["--min-np", "2", "--max-np", "4", "--host-discovery-script", str(script), "--slots", "3",
         "--reset-limit", "5", "--blacklist-cooldown-range", "2", "9", "--elastic-timeout", "30",
         "--ssh-option", "A=b", "--start-timeout", "4", "--output-filename", str(tmp_path / "o"),
         "--disable-output-prefix", "--verbose", *COMMAND]
    )  # fmt: skip
    assert args.np == 2 and args.elastic == options.ElasticOptions(
        min_np=2, timeout_s=30.0, max_np=4, reset_limit=5, cooldown_s=(2.0, 9.0)
    )
    assert (args.hosts.discovery_script, args.hosts.slots_per_host) == (str(script), 3)
    assert args.hosts.ssh.options == ("A=b",) and args.hosts.ssh.connect_timeout_s == 4.0
    assert args.output == options.OutputOptions(
        directory=str(tmp_path / "o"), disable_prefix=True, timestamp=False, verbose=True
    )
    plain = parse(["-np", "3", *COMMAND])
    assert plain.elastic is None and plain.hosts == options.HostOptions()
    assert plain.output == options.OutputOptions() and plain.mpi == options.MpiOptions()


def test_gradient_compression_is_a_choice_set_for_the_workers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse(["-np", "2", "--gradient-compression", "BF16", *COMMAND]).engine_env == {
        "HORA_GRADIENT_COMPRESSION": "bf16"
    }
    with pytest.raises(SystemExit) as exited:
        options.parse(["-np", "2", "--gradient-compression", "int8", *COMMAND])
    assert exited.value.code == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err
