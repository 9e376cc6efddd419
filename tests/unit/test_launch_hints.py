"""horarun's answers to a new user's first mistakes: a misspelt flag gets the nearest real one,
a Python script given without ``python`` gets the command meant. Pure logic; the same mistakes
through real processes are in tests/multiproc/test_launch_mistakes.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from hora.runner import options
from hora.runner.command import CommandError, check_command
from hora.runner.flag_parser import SHORT_USAGE

PYTHON_SCRIPT = "import sys\nprint(sys.argv)\n"


def _file(path: Path, text: str, executable: bool = False) -> str:
    path.write_text(text)
    path.chmod(0o755 if executable else 0o644)
    return path.name


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("--np", ["-np"]),
        ("--fusion-treshold-mb", ["--fusion-threshold-mb"]),
        ("--fusion-treshold-mb=64", ["--fusion-threshold-mb"]),
        ("-hosts", ["--hosts"]),
        ("--ssh_port", ["--ssh-port"]),
        ("--verbos", ["--verbose"]),
        ("--no-such-thing-at-all", []),
    ],
)
def test_a_misspelt_flag_gets_the_nearest_real_one(given: str, expected: list[str]) -> None:
    assert options.nearest_flags(given) == expected


def test_an_unknown_flag_is_named_with_a_suggestion_in_two_lines() -> None:
    with pytest.raises(options.UnknownFlag) as err:
        options.parse(["--fusion-treshold-mb", "64", "python", "x.py"])
    assert str(err.value).splitlines() == [
        "unknown option --fusion-treshold-mb; did you mean --fusion-threshold-mb?",
        "`horarun --help` lists every flag.",
    ]
    # Before "-np is required" and "no command given": the misspelt flag is the cause.
    with pytest.raises(options.UnknownFlag, match=r"unknown option --np; did you mean -np\?"):
        options.parse(["--np", "2"])


def test_other_usage_errors_print_one_line_of_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        options.parse(["-np", "two", "python", "x.py"])
    assert exited.value.code == 2
    said = capsys.readouterr().err.splitlines()
    assert said == [
        "horarun: argument -np/--num-proc: invalid int value: 'two'",
        SHORT_USAGE,
    ]


def test_a_python_script_without_python_is_refused_with_the_command_meant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    name = _file(tmp_path / "train.py", PYTHON_SCRIPT)
    argv = ["-np", "2", "--verbose", name, "--epochs", "3"]
    with pytest.raises(CommandError) as err:
        check_command(argv[3:], argv)
    assert "'train.py' is a Python script, not a program (it is not executable)" in str(err.value)
    interpreter = "python" if "python3" not in str(err.value) else "python3"
    assert str(err.value).endswith(
        f"did you mean `horarun -np 2 --verbose {interpreter} train.py --epochs 3`?"
    )
    # Through the parser: an OptionError, as every refused command line.
    with pytest.raises(options.OptionError, match="did you mean `horarun -np 2"):
        options.parse(["-np", "2", name])


@pytest.mark.parametrize(
    ("text", "executable", "word", "said"),
    [
        # Executable but no #! line: exec would fail with "Exec format error".
        (PYTHON_SCRIPT, True, "./train.py", "it has no #! line naming its interpreter"),
        # A working script, but a name without a slash is looked up on the PATH only.
        (f"#!{sys.executable}\n{PYTHON_SCRIPT}", True, "train.py", "it is not on the PATH"),
        # No .py suffix, not executable, but Python all the same.
        (PYTHON_SCRIPT, False, "train", "it is not executable"),
    ],
)
def test_a_script_that_cannot_start_names_its_interpreter(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    text: str,
    executable: bool,
    word: str,
    said: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    _file(tmp_path / word.removeprefix("./"), text, executable)
    with pytest.raises(CommandError) as err:
        check_command([word], ["-np", "2", word])
    assert said in str(err.value)
    assert f"python {word}`?" in str(err.value) or f"python3 {word}`?" in str(err.value)


def test_commands_that_can_start_are_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _file(tmp_path / "train.py", f"#!{sys.executable}\n{PYTHON_SCRIPT}", executable=True)
    for command in (
        ["./train.py"],  # executable, with a #! line, named by its path
        [sys.executable, "train.py"],  # the usual way
        ["no-such-program-here"],  # not a file here: the workers say what is wrong
        [str(Path(sys.executable).resolve())],  # a binary
    ):
        check_command(command, ["-np", "2", *command])


def test_a_file_that_is_not_python_nor_executable_gets_chmod(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _file(tmp_path / "run.sh", "#!/usr/bin/env bash\necho hi\n")
    with pytest.raises(CommandError) as err:
        check_command(["./run.sh", "a"], ["-np", "2", "./run.sh", "a"])
    assert str(err.value) == (
        "'./run.sh' is not executable: run `chmod +x ./run.sh`, or put its interpreter first "
        "(`horarun -np 2 bash ./run.sh a`)."
    )
