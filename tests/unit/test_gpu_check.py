"""``.ci/gpu-check``, the GPU machine's check, as far as a machine without a GPU can run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "gpu-check"


@pytest.mark.timeout(30)
def test_the_script_parses() -> None:
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, done.stderr


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the check would run")
def test_without_a_gpu_it_stops_after_saying_so(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=50, env=env
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no CUDA device visible to this PyTorch" in (out / "gpu-check.log").read_text()
    summary = (out / "summary.txt").read_text().split("\n")
    assert summary[0].split()[:2] == ["machine", "FAILED"], summary
    assert not any(line.startswith("tests") for line in summary), summary
