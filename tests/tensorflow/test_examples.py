"""The TensorFlow example scripts, run end to end through horarun on two workers.

examples/tensorflow_digits.py (a custom ``tf.GradientTape`` loop) and examples/keras_digits.py
(``model.fit``), the Keras one under Keras 3 and under tf_keras (``TF_USE_LEGACY_KERAS=1``).
Each must finish, learn the digits and report from rank 0 only.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import HAS_TF_KERAS

ROOT = Path(__file__).resolve().parents[2]
TENSORFLOW_DIGITS = str(ROOT / "examples" / "tensorflow_digits.py")
KERAS_DIGITS = str(ROOT / "examples" / "keras_digits.py")
HORARUN = [sys.executable, "-m", "hora.runner.launch"]
JOB_TIMEOUT_S = 150

FINAL = re.compile(r"^\[0\]<stdout>:final test accuracy (\d\.\d{4})$", re.MULTILINE)
# Keras's epoch summary (verbose=2) ends with the learning rate that the warmup set.
KERAS_EPOCH = re.compile(r"^\[0\]<stdout>:\d+/\d+ - .*\blr: (\d\.\d{4})\b", re.MULTILINE)


def _run(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Run ``script`` on two workers; returns its stdout, or fails showing all of its output."""
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})}
    if "TF_USE_LEGACY_KERAS" not in (env or {}):
        environment.pop("TF_USE_LEGACY_KERAS", None)  # Keras 3 unless the test asks otherwise
    command = [*HORARUN, "-np", "2", sys.executable, script, *args]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=ROOT, env=environment
    )
    assert result.returncode == 0, (
        f"{' '.join(command)} exited with {result.returncode}\n"
        f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return result.stdout


def _final_accuracy(output: str) -> float:
    finals = FINAL.findall(output)
    assert len(finals) == 1, output
    assert "[1]<stdout>:" not in output, output  # only rank 0 reports
    return float(finals[0])


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_tensorflow_digits_learns() -> None:
    output = _run(TENSORFLOW_DIGITS, "--epochs", "10")
    assert len(re.findall(r"^\[0\]<stdout>:epoch \d+: loss ", output, re.MULTILINE)) == 10
    assert _final_accuracy(output) >= 0.9, output


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
@pytest.mark.parametrize("flavor", ["keras3", "tf_keras"])
def test_keras_digits_learns(flavor: str) -> None:
    env = {}
    if flavor == "tf_keras":
        if not HAS_TF_KERAS:
            pytest.skip("tf_keras is not installed: pip install -e '.[integrations]'")
        env["TF_USE_LEGACY_KERAS"] = "1"
    output = _run(KERAS_DIGITS, "--epochs", "10", "--lr", "0.05", "--warmup-epochs", "2", env=env)
    rates = [float(lr) for lr in KERAS_EPOCH.findall(output)]
    # One summary per epoch; the warmup rises from 0.05 to 0.05 x 2 workers, then stays.
    assert len(rates) == 10, output
    assert rates[0] < 0.1 and rates[1:] == [0.1] * 9, rates
    assert _final_accuracy(output) >= 0.9, output
