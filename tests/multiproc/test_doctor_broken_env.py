"""``hora doctor`` in a broken environment (numpy that cannot be imported): one line per
missing piece, naming it and the command that installs it, and never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(120)
def test_doctor_names_a_broken_numpy_without_a_traceback(tmp_path: Path) -> None:
    broken = tmp_path / "numpy"
    broken.mkdir()
    (broken / "__init__.py").write_text('raise ImportError("this numpy is broken")\n')
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "hora", "doctor"],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output
    numpy_line = next(line for line in output.splitlines() if line.split()[:1] == ["numpy"])
    assert "cannot be imported (ImportError: this numpy is broken)" in numpy_line
    assert f"{sys.executable} -m pip install --force-reinstall 'numpy" in numpy_line
    torch_line = next(line for line in output.splitlines() if line.split()[:1] == ["torch"])
    assert "it imports numpy; fix numpy first" in torch_line
