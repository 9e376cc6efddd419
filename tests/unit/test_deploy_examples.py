"""The deployment examples in examples/deploy/ are well-formed.

What can be checked here without a cluster: the MPIJob manifest parses and is consistent, the
batch scripts pass ``bash -n``, the Dockerfile pins PyTorch and installs hora. The CPU batch
script also runs as a real SLURM job in tests/multiproc/test_launchers.py. No Docker engine or
Kubernetes cluster is available where these tests run, so the image is never built here.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "examples" / "deploy"
ROOT = DEPLOY.parents[1]


def test_mpijob_manifest_is_a_consistent_v2beta1_mpijob() -> None:
    yaml = pytest.importorskip("yaml")
    documents = list(yaml.safe_load_all((DEPLOY / "mpijob.yaml").read_text()))
    assert len(documents) == 1
    job = documents[0]
    assert job["apiVersion"] == "kubeflow.org/v2beta1"
    assert job["kind"] == "MPIJob"
    spec = job["spec"]
    assert spec["mpiImplementation"] == "OpenMPI"
    launcher = spec["mpiReplicaSpecs"]["Launcher"]
    worker = spec["mpiReplicaSpecs"]["Worker"]
    assert launcher["replicas"] == 1
    (launcher_container,) = launcher["template"]["spec"]["containers"]
    (worker_container,) = worker["template"]["spec"]["containers"]
    assert launcher_container["image"] == worker_container["image"]
    assert launcher_container["command"] == ["mpirun"]
    args = [str(a) for a in launcher_container["args"]]
    # mpirun starts slotsPerWorker ranks on each worker.
    np = int(args[args.index("-np") + 1])
    assert np == spec["slotsPerWorker"] * worker["replicas"]
    assert args[args.index("python") + 1] == "/opt/hora/train.py"
    assert worker_container["command"][0] == "/usr/sbin/sshd"


@pytest.mark.parametrize(
    "script", ["slurm-cpu.sbatch", "slurm-gpu.sbatch", "../../.ci/install-launchers"]
)
def test_shell_scripts_parse(script: str) -> None:
    done = subprocess.run(
        ["bash", "-n", str(DEPLOY / script)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("script", ["slurm-cpu.sbatch", "slurm-gpu.sbatch"])
def test_batch_scripts_start_workers_with_srun_and_a_secret(script: str) -> None:
    text = (DEPLOY / script).read_text()
    directives = re.findall(r"^#SBATCH (--[\w-]+)=(\S+)$", text, flags=re.MULTILINE)
    options = dict(directives)
    assert int(options["--nodes"]) >= 1 and int(options["--ntasks-per-node"]) >= 1
    # #SBATCH lines count only before the first command.
    first_command = min(
        i for i, line in enumerate(text.splitlines()) if line and not line.startswith("#")
    )
    last_directive = max(
        i for i, line in enumerate(text.splitlines()) if line.startswith("#SBATCH")
    )
    assert last_directive < first_command
    assert "export HORA_SECRET_KEY" in text
    assert re.search(r"^srun .*\"\$@\"$", text, flags=re.MULTILINE)
    if "gpu" in script:
        assert "--gpus-per-node" in options


def test_dockerfile_pins_torch_and_installs_hora() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.\d+-slim-\w+$", text, flags=re.MULTILINE)
    pinned = re.search(r"^ARG TORCH_VERSION=(\d+\.\d+\.\d+)$", text, flags=re.MULTILINE)
    assert pinned is not None
    assert '"torch==${TORCH_VERSION}"' in text
    assert "pip install /tmp/hora-src" in text
    # The example job the MPIJob manifest runs is copied into the image.
    assert "examples/deploy/train.py /opt/hora/train.py" in text
    ignored = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
