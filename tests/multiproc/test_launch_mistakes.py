"""horarun's answers to a new user's first mistakes, through real processes at np 2: a Python
script given without ``python`` is refused with the command meant (and one that can start still
runs); a misspelt flag gets the nearest real one in two lines, not the whole usage."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HORARUN = [sys.executable, "-m", "hora.runner.launch"]

TRAIN = """
import torch
import hora.torch as hvd
hvd.init()
total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="x")
print(f"rank {hvd.rank()} of {hvd.size()}: {total.item():g}")
hvd.shutdown()
"""


def _run(args: list[str], cwd: Path, timeout: float = 90) -> Any:
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=dict(os.environ)
    )


@pytest.mark.timeout(120)
def test_a_script_without_python_is_refused_with_the_command_meant(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    result = _run([*HORARUN, "-np", "2", "train.py"], tmp_path)
    assert result.returncode == 2, result.stderr
    said = result.stderr.strip().splitlines()
    assert len(said) == 1, result.stderr
    assert "'train.py' is a Python script, not a program (it is not executable)" in said[0]
    assert said[0].endswith("python train.py`?") or said[0].endswith("python3 train.py`?")
    assert "No such file" not in result.stderr and "[0]" not in result.stderr


@pytest.mark.timeout(120)
def test_an_executable_script_with_a_shebang_still_runs(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(f"#!{sys.executable}" + TRAIN)
    script.chmod(0o755)
    result = _run([*HORARUN, "-np", "2", "./train.py"], tmp_path)
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        assert f"[{rank}]<stdout>:rank {rank} of 2: 2" in result.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--np", "2", "python", "train.py"], "unknown option --np; did you mean -np?"),
        (
            ["--fusion-treshold-mb", "64", "python", "train.py"],
            "unknown option --fusion-treshold-mb; did you mean --fusion-threshold-mb?",
        ),
    ],
)
def test_a_misspelt_flag_gets_a_suggestion_not_the_usage(
    tmp_path: Path, argv: list[str], line: str
) -> None:
    result = _run([*HORARUN, *argv], tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"horarun: {line}", "`horarun --help` lists every flag."]
    assert result.stdout == ""
