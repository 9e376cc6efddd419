"""``hora doctor``'s dependency check: each of hora's dependencies, and what to run when one is
missing. A whole broken environment is tests/multiproc/test_doctor_broken_env.py."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from hora.tools import doctor


def test_doctor_names_a_missing_module_and_its_install_command() -> None:
    found = doctor.find_dependency("hora-no-such-dist", "hora_no_such_module", "x>=1")
    assert found.version is None
    assert found.line() == (
        f"    hora-no-such-dist not installed; install it: {shlex.quote(sys.executable)} -m pip "
        "install 'x>=1'"
    )


def test_doctor_checks_every_declared_dependency() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = Path(__file__).parents[2] / "pyproject.toml"
    declared = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    names = {text.split(">")[0].split("<")[0].split("=")[0].strip() for text in declared}
    assert names == set(doctor.DEPENDENCIES)
