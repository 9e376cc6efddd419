"""Topology from every launcher's variables, and the errors when launchers disagree.

The variable sets below are what real launchers export (printed by real processes here: Open MPI
5's ``mpirun``, MPICH 4's ``mpiexec.hydra``, SLURM 22.05's ``srun``, torch 2's ``torchrun``);
tests/multiproc/test_launchers.py runs the launchers themselves.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from hora.common.job.launchers import (
    LauncherError,
    cross_from_counts,
    derived_port,
    expand_hostlist,
    expand_tasks_per_node,
    first_hostfile_host,
)
from hora.common.job.store import StoreClient
from hora.common.job.topology import Topology, TopologyError, detect

# Job secrets of the form hora accepts (as secrets.token_hex(32) makes them).
SECRET = "0f1e2d3c4b5a69788796a5b4c3d2e1f0" * 2
OTHER = "a1b2c3d4e5f60718293a4b5c6d7e8f90" * 2


def torchrun_env(rank: int, size: int = 4, nproc: int = 2, agent_store: bool = True) -> dict:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(size),
        "LOCAL_RANK": str(rank % nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(rank // nproc),
        "GROUP_WORLD_SIZE": str(size // nproc),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(size),
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_RUN_ID": "job7",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),
    }


def ompi_env(rank: int, size: int, local_rank: int, local_size: int) -> dict:
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
        "OMPI_COMM_WORLD_NODE_RANK": str(local_rank),
        "OMPI_UNIVERSE_SIZE": str(size),
        "PMIX_RANK": str(rank),
        "PMIX_NAMESPACE": "prterun-vm-5489@1",
        "PRTE_LAUNCHED": "1",
    }


def slurm_env(rank: int, counts: str, node: int, local_rank: int, size: int) -> dict:
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(local_rank),
        "SLURM_NODEID": str(node),
        "SLURM_NTASKS": str(size),
        "SLURM_NPROCS": str(size),
        "SLURM_STEP_NUM_TASKS": str(size),
        "SLURM_STEP_TASKS_PER_NODE": counts,
        "SLURM_TASKS_PER_NODE": counts,
        "SLURM_STEP_NODELIST": "gnode[10,20-21]",
        "SLURM_JOB_NODELIST": "gnode[10,20-21]",
        "SLURMD_NODENAME": f"gnode{node}",
    }


# ---------------------------------------------------------------- SLURM's formats


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("vm", ["vm"]),
        ("gnode[10,20,25,37]", ["gnode10", "gnode20", "gnode25", "gnode37"]),
        ("node[001-003],login1", ["node001", "node002", "node003", "login1"]),
        ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
        ("a[1,3-4]b,c", ["a1b", "a3b", "a4b", "c"]),
        ("gpu-[9-11]", ["gpu-9", "gpu-10", "gpu-11"]),
    ],
)
def test_hostlists_expand_like_scontrol(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["", "node[1-", "node[a-b]", "node[5-2]"])
def test_malformed_hostlists_are_named(text: str) -> None:
    with pytest.raises(LauncherError, match="SLURM host list"):
        expand_hostlist(text)


def test_tasks_per_node_and_cross_ranks() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(LauncherError, match="tasks per node"):
        expand_tasks_per_node("2(3)")
    counts = [2, 2, 1]
    assert cross_from_counts(counts, node=2, local_rank=0) == (2, 3)
    assert cross_from_counts(counts, node=1, local_rank=1) == (1, 2)


def test_derived_ports_are_stable_in_range_and_differ_between_steps() -> None:
    port = derived_port("slurm-4242.0")
    assert port == derived_port("slurm-4242.0")
    assert 20000 <= port < 32768  # below the local ports of outgoing connections
    assert port != derived_port("slurm-4242.1")


# ---------------------------------------------------------------- each launcher


def test_horarun_variables_are_read_as_before() -> None:
    env = {
        "HORA_RANK": "1",
        "HORA_SIZE": "2",
        "HORA_LOCAL_RANK": "1",
        "HORA_LOCAL_SIZE": "2",
        "HORA_RENDEZVOUS_ADDR": "127.0.0.1",
        "HORA_RENDEZVOUS_PORT": "1234",
        "HORA_SECRET_KEY": SECRET,
        # A one-task srun step around horarun: srun started horarun, not the workers.
        **slurm_env(0, "1", 0, 0, 1),
    }
    topology = detect(env)
    assert topology.source == "horarun"
    assert topology.launch is None and topology.plan is None
    assert (topology.rank, topology.size, topology.rendezvous_port) == (1, 2, 1234)
    assert topology.authenticated and topology.secret == SECRET


@pytest.mark.parametrize("rank", [0, 3])
def test_torchrun_reuses_the_agent_store(rank: int) -> None:
    topology = detect(torchrun_env(rank))
    plan = topology.plan
    assert topology.source == "torchrun"
    assert (topology.rank, topology.size) == (rank, 4)
    assert (topology.local_rank, topology.local_size) == (rank % 2, 2)
    assert (topology.cross_rank, topology.cross_size) == (rank // 2, 2)
    assert plan is not None
    assert (plan.addr, plan.port, plan.host, plan.shared) == ("node0", 29400, False, True)
    assert plan.prefix == "hora/job7/"


def test_torchrun_without_the_agent_store_has_rank_0_host_it() -> None:
    plans = [detect(torchrun_env(r, agent_store=False)).plan for r in range(4)]
    assert [p.host for p in plans if p] == [True, False, False, False]
    assert not any(p.shared for p in plans if p)


def test_torchrun_with_one_process_is_a_job_of_one() -> None:
    env = torchrun_env(0, size=1, nproc=1)
    topology = detect(env)
    assert topology.size == 1 and topology.launch is None
    assert topology.source == "torchrun (1 process)"


def test_open_mpi_on_one_host_uses_loopback_and_a_port_from_the_job() -> None:
    topology = detect(ompi_env(2, 3, 1, 3))
    plan = topology.plan
    assert topology.source == "Open MPI"
    assert (topology.rank, topology.size, topology.local_rank, topology.local_size) == (2, 3, 1, 3)
    assert plan is not None
    assert plan.addr == "127.0.0.1"
    assert plan.port == derived_port("prterun-vm-5489@1")
    assert not plan.host and not plan.mpi4py and plan.exchange
    assert detect(ompi_env(0, 3, 0, 3)).plan.host  # type: ignore[union-attr]


def test_open_mpi_with_mpi4py_lets_rank_0_choose() -> None:
    plan = detect(ompi_env(0, 4, 0, 2), use_mpi4py=lambda launcher: launcher == "Open MPI").plan
    assert plan is not None and plan.mpi4py and plan.host
    assert (plan.addr, plan.port) == ("", 0)


def test_open_mpi_across_hosts_needs_an_address() -> None:
    with pytest.raises(TopologyError, match="install mpi4py .* or set MASTER_ADDR"):
        detect(ompi_env(1, 4, 1, 2))
    plan = detect({**ompi_env(1, 4, 1, 2), "MASTER_ADDR": "n0", "MASTER_PORT": "2222"}).plan
    assert plan is not None and (plan.addr, plan.port, plan.host) == ("n0", 2222, False)
    plan = detect({**ompi_env(1, 4, 1, 2), "HORA_RENDEZVOUS_ADDR": "n1", "MASTER_ADDR": "n0"}).plan
    assert plan is not None and plan.addr == "n1"


def test_mpijob_hostfile_names_rank_0s_host(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(
        "# written by mpi-operator\n"
        "job-worker-0.job.default.svc slots=2\n"
        "job-worker-1.job.default.svc slots=2\n"
    )
    env = {
        **ompi_env(3, 4, 1, 2),
        "OMPI_MCA_orte_default_hostfile": str(hostfile),
        "K_MPI_JOB_ROLE": "worker",
    }
    plan = detect(env).plan
    assert plan is not None
    assert plan.addr == "job-worker-0.job.default.svc"
    assert "the first host of" in plan.how
    assert first_hostfile_host(str(hostfile)) == "job-worker-0.job.default.svc"
    hostfile.write_text("a:4\nb:4\n")
    assert first_hostfile_host(str(hostfile)) == "a"


def test_mpich_needs_a_port_without_mpi4py() -> None:
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    with pytest.raises(TopologyError, match="MPICH/Intel MPI exports no job id .* MASTER_PORT"):
        detect(env)
    topology = detect({**env, "MASTER_PORT": "29511"})
    assert topology.source == "MPICH/Intel MPI"
    assert (topology.rank, topology.local_rank, topology.local_size) == (1, 1, 2)
    assert topology.plan is not None and topology.plan.port == 29511


def test_mvapich() -> None:
    env = {
        "MV2_COMM_WORLD_RANK": "0",
        "MV2_COMM_WORLD_SIZE": "2",
        "MV2_COMM_WORLD_LOCAL_RANK": "0",
        "MV2_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_PORT": "30000",
    }
    topology = detect(env)
    assert (topology.source, topology.size) == ("MVAPICH", 2)


@pytest.mark.parametrize(
    ("rank", "node", "local", "cross"),
    [(0, 0, 0, (0, 3)), (1, 0, 1, (0, 2)), (2, 1, 0, (1, 3)), (3, 1, 1, (1, 2)), (4, 2, 0, (2, 3))],
)
def test_slurm_step_on_three_nodes(rank: int, node: int, local: int, cross: tuple) -> None:
    topology = detect(slurm_env(rank, "2(x2),1", node, local, 5))
    plan = topology.plan
    assert topology.source == "SLURM's srun"
    assert (topology.rank, topology.size, topology.local_rank) == (rank, 5, local)
    assert topology.local_size == (1 if node == 2 else 2)
    assert (topology.cross_rank, topology.cross_size) == cross
    assert topology.hostname == f"gnode{node}"
    assert plan is not None
    assert plan.addr == "gnode10"
    assert plan.port == derived_port("slurm-4242.0")
    assert plan.host == (rank == 0)


def test_slurm_one_node_step_uses_loopback_and_master_variables_win() -> None:
    topology = detect(slurm_env(1, "2", 0, 1, 2))
    assert topology.plan is not None and topology.plan.addr == "127.0.0.1"
    env = {**slurm_env(1, "2", 0, 1, 2), "MASTER_ADDR": "gnode10", "MASTER_PORT": "12345"}
    plan = detect(env).plan
    assert plan is not None and (plan.addr, plan.port, plan.host) == ("gnode10", 12345, False)


def test_slurm_counts_that_do_not_add_up_are_refused() -> None:
    with pytest.raises(TopologyError, match="adds up to 3 tasks but SLURM_STEP_NUM_TASKS=4"):
        detect(slurm_env(0, "2,1", 0, 0, 4))


def test_a_batch_script_is_not_a_step_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    with caplog.at_level(logging.WARNING, logger="hora"):
        topology = detect(env)
    assert topology.size == 1
    assert "not started by srun" in caplog.text


def test_env_method_variables() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}
    topology = detect(env)
    assert topology.source == "torch.distributed env:// variables"
    assert topology.plan is not None and topology.plan.exchange
    with pytest.raises(TopologyError, match="MASTER_ADDR is not"):
        detect({"RANK": "0", "WORLD_SIZE": "2"})


def test_missing_or_malformed_variables_are_named() -> None:
    with pytest.raises(
        TopologyError, match="Open MPI set some of its variables but not OMPI_COMM_WORLD_RANK"
    ):
        detect({"OMPI_COMM_WORLD_SIZE": "4"})
    with pytest.raises(TopologyError, match="SLURM_PROCID must be an integer, got 'x'"):
        detect({**slurm_env(0, "1", 0, 0, 1), "SLURM_PROCID": "x"})
    with pytest.raises(TopologyError, match="MASTER_PORT must be a port number"):
        detect({**torchrun_env(0), "MASTER_PORT": "99999"})


# ---------------------------------------------------------------- disagreements


def test_stale_hora_rank_under_mpirun_is_refused_with_both_values() -> None:
    env = {
        **ompi_env(1, 2, 1, 2),
        "HORA_RANK": "0",
        "HORA_SIZE": "2",
        "HORA_RENDEZVOUS_ADDR": "127.0.0.1",
        "HORA_RENDEZVOUS_PORT": "1",
    }
    with pytest.raises(TopologyError) as info:
        detect(env)
    message = str(info.value)
    assert "horarun: HORA_RANK=0, HORA_SIZE=2" in message
    assert "Open MPI: OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=2" in message
    assert "unset them (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE)" in message
    assert "HORA_LAUNCHER" in message
    # Saying which launcher started the workers settles it.
    assert detect({**env, "HORA_LAUNCHER": "mpi"}).rank == 1


@pytest.mark.parametrize("rank", [0, 1])
def test_separate_torchrun_jobs_inside_one_srun_step_are_refused(rank: int) -> None:
    # `srun -n 2 torchrun --standalone --nproc-per-node 2`: two jobs of 2, not one of 4.
    env = {**torchrun_env(rank, size=2, nproc=2), **slurm_env(1, "2", 0, 1, 2)}
    with pytest.raises(TopologyError) as info:
        detect(env)
    message = str(info.value)
    assert f"torchrun: RANK={rank}, WORLD_SIZE=2" in message
    assert "SLURM's srun: SLURM_PROCID=1, SLURM_STEP_NUM_TASKS=2" in message
    assert "srun --ntasks-per-node=1 torchrun" in message


def test_one_torchrun_per_srun_task_is_a_normal_nesting() -> None:
    # `srun -N2 --ntasks-per-node=1 torchrun --nnodes 2 --nproc-per-node 2`
    env = {**torchrun_env(3, size=4, nproc=2), **slurm_env(0, "1(x2)", 0, 0, 2)}
    topology = detect(env)
    assert (topology.source, topology.rank, topology.size) == ("torchrun", 3, 4)


def test_mpirun_inside_an_allocation_is_a_normal_nesting() -> None:
    # Open MPI starts its daemons with `srun --ntasks-per-node=1`; ranks inherit that step.
    env = {**ompi_env(5, 8, 1, 4), **slurm_env(1, "1(x2)", 1, 0, 2), "MASTER_ADDR": "gnode10"}
    assert detect(env).source == "Open MPI"
    # srun --mpi=pmi2 starts the ranks itself: both describe the same process.
    env = {**slurm_env(1, "2", 0, 1, 2), "PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_PORT": "1"}
    assert detect(env).rank == 1


def test_world_sizes_that_cannot_both_hold_are_refused() -> None:
    env = {**ompi_env(1, 2, 1, 2), "RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "x"}
    with pytest.raises(TopologyError, match="WORLD_SIZE=4"):
        detect(env)


def test_hora_launcher_values_are_checked() -> None:
    with pytest.raises(TopologyError, match="HORA_LAUNCHER must be one of"):
        detect({"HORA_LAUNCHER": "pbs"})
    with pytest.raises(TopologyError, match="HORA_LAUNCHER=slurm but that launcher's variables"):
        detect({"HORA_LAUNCHER": "slurm"})
    assert detect({**ompi_env(0, 2, 0, 2), "HORA_LAUNCHER": "none"}).size == 1


# ---------------------------------------------------------------- the exchange


def test_cross_ranks_from_an_exchange_of_host_names() -> None:
    """MPI exports local ranks but no node index: ranks exchange host names through the store
    (a real in-process store here; every rank's view is computed in turn)."""
    from dataclasses import replace

    from hora.common.job import joining

    hosts = ["a", "a", "b", "c", "c"]
    base = [detect({**ompi_env(r, 5, 0, 1), "MASTER_ADDR": "a"}) for r in range(5)]
    store = StoreClient("", 0, "s" * 64, timeout_s=5)
    local = {0: 0, 1: 1, 2: 0, 3: 0, 4: 1}
    views = []
    for rank, topology in enumerate(base):
        assert topology.launch is not None
        launch = replace(topology.launch, local_rank=None, local_size=None, hostname=hosts[rank])
        views.append(replace(topology, hostname=hosts[rank], launch=launch))
    # Every rank's entry is in the store before the first rank reads them all (in a job, each
    # rank writes its own and waits for the others).
    for rank in range(5):
        entry = {"host": hosts[rank], "local_rank": None}
        store.set_signed(f"g0/topology/{rank}", json.dumps(entry).encode())
    results = [joining._exchange(store, view, 0) for view in views]
    assert [(t.local_rank, t.local_size) for t in results] == [
        (local[r], hosts.count(hosts[r])) for r in range(5)
    ]
    # Horovod: cross rank = position among the ranks with the same local rank.
    assert [(t.cross_rank, t.cross_size) for t in results] == [
        (0, 3),
        (0, 2),
        (1, 3),
        (2, 3),
        (1, 2),
    ]
    assert all(isinstance(t, Topology) for t in results)


# ---------------------------------------------------------------- hosting the store


def test_a_taken_port_is_reported_with_what_to_set() -> None:
    import socket

    from hora.common.job import joining

    topology = detect(slurm_env(0, "2", 0, 0, 2))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(TopologyError) as info:
            joining._host_store(topology, "127.0.0.1", port, "s" * 64)
    message = str(info.value)
    assert f"rank 0 (SLURM's srun) cannot start the job's rendezvous store on 127.0.0.1:{port}" in (
        message
    )
    assert "set HORA_RENDEZVOUS_PORT (or MASTER_PORT) to a free port" in message


def test_an_address_of_another_host_is_reported() -> None:
    from hora.common.job import joining

    topology = detect(slurm_env(0, "2", 0, 0, 2))
    # 192.0.2.1 (TEST-NET-1) is never an address of this host.
    with pytest.raises(TopologyError, match=r"192\.0\.2\.1 \(192\.0\.2\.1\) is not an address of"):
        joining._host_store(topology, "192.0.2.1", 0, "s" * 64)


# ---------------------------------------------------------------- the job secret


def test_a_secret_file_gives_the_job_its_secret(tmp_path: Path) -> None:
    from hora.common.job.topology import job_secret

    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    assert job_secret({"HORA_SECRET_FILE": str(path)}) == SECRET
    # HORA_SECRET_KEY wins; neither set: no secret.
    assert job_secret({"HORA_SECRET_FILE": str(path), "HORA_SECRET_KEY": OTHER}) == OTHER
    assert job_secret({}) == ""
    topology = detect({**slurm_env(0, "2", 0, 0, 2), "HORA_SECRET_FILE": str(path)})
    assert topology.secret == SECRET


@pytest.mark.parametrize(
    ("mode", "content", "expected"),
    [
        (0o644, SECRET, "can be read or written by other users (mode 0644): make it private"),
        (0o620, SECRET, "(mode 0620)"),
        (0o600, "short", "holds 5 characters; a job secret needs at least 32"),
        (None, "", "cannot read it"),
    ],
)
def test_a_bad_secret_file_is_refused_with_what_to_do(
    tmp_path: Path, mode: int | None, content: str, expected: str
) -> None:
    from hora.common.job.topology import job_secret

    path = tmp_path / "secret"
    if mode is not None:
        path.write_text(content)
        path.chmod(mode)
    with pytest.raises(TopologyError, match=f"HORA_SECRET_FILE={path}") as info:
        job_secret({"HORA_SECRET_FILE": str(path)})
    assert expected in str(info.value)


def test_a_directory_is_not_a_secret_file(tmp_path: Path) -> None:
    from hora.common.job.topology import job_secret

    with pytest.raises(TopologyError, match="is a directory; it must name a file") as info:
        job_secret({"HORA_SECRET_FILE": str(tmp_path)})
    assert "owned by" not in str(info.value)


@pytest.mark.parametrize("directory_mode", [0o1777, 0o777, 0o770, 0o720])
def test_a_secret_file_in_a_directory_others_can_write_is_refused(
    tmp_path: Path, directory_mode: int
) -> None:
    from hora.common.job.topology import job_secret

    shared = tmp_path / "shared"
    shared.mkdir()
    path = shared / "secret"
    path.write_text(SECRET)
    path.chmod(0o600)
    shared.chmod(directory_mode)
    with pytest.raises(
        TopologyError, match=f"lies in {shared}, which can be written by other"
    ) as info:
        job_secret({"HORA_SECRET_FILE": str(path)})
    assert f"(mode {directory_mode:04o})" in str(info.value)
    assert "mkdir -m 700 ~/.hora" in str(info.value)
    shared.chmod(0o755)
    assert job_secret({"HORA_SECRET_FILE": str(path)}) == SECRET


@pytest.mark.parametrize("key", ["abc", "x" * 31])
def test_a_short_secret_key_is_refused_as_a_short_secret_file_is(key: str) -> None:
    from hora.common.job.topology import job_secret

    with pytest.raises(TopologyError, match=f"HORA_SECRET_KEY holds {len(key)} characters; a job"):
        job_secret({"HORA_SECRET_KEY": key})
    with pytest.raises(TopologyError, match="needs at least 32"):
        detect({**slurm_env(0, "2", 0, 0, 2), "HORA_SECRET_KEY": key})
    assert job_secret({"HORA_SECRET_KEY": SECRET[:32]}) == SECRET[:32]


# Long but guessable: one character repeated, whitespace, a short word or two letters repeated.
WEAK = ["a" * 32, " " * 32, " \t\n" * 16, "ab" * 32, "password" * 4, "0123456" * 6]


@pytest.mark.parametrize("key", WEAK)
def test_a_weak_secret_key_is_refused_as_a_short_one_is(key: str) -> None:
    from hora.common.job.topology import job_secret

    with pytest.raises(TopologyError, match=f"HORA_SECRET_KEY holds {len(key)} characters") as info:
        job_secret({"HORA_SECRET_KEY": key})
    message = str(info.value)
    assert "a job secret needs at least 32 characters, 8 or more of them different" in message
    assert "secrets.token_hex(32)" in message
    with pytest.raises(TopologyError, match="8 or more of them different"):
        detect({**slurm_env(0, "2", 0, 0, 2), "HORA_SECRET_KEY": key})
    # Eight different characters are enough.
    assert job_secret({"HORA_SECRET_KEY": "abcdefgh" * 4}) == "abcdefgh" * 4


@pytest.mark.parametrize("content", [*WEAK, " " * 40 + "\n"])
def test_a_weak_secret_file_is_refused_as_a_weak_key_is(tmp_path: Path, content: str) -> None:
    from hora.common.job.topology import job_secret

    path = tmp_path / "secret"
    path.write_text(content)
    path.chmod(0o600)
    with pytest.raises(TopologyError, match=f"HORA_SECRET_FILE={path} holds ") as info:
        job_secret({"HORA_SECRET_FILE": str(path)})
    assert "a job secret needs at least 32 characters, 8 or more of them" in str(info.value)
