import pytest

from hora.common.vocabulary.config import SettingError, Settings


def test_defaults_match_horovod() -> None:
    s = Settings.from_env({})
    assert s.fusion_threshold_bytes == 128 * 1024 * 1024
    assert s.cycle_time_ms == 1.0
    assert s.cache_capacity == 1024
    assert s.stall_check_time_s == 60


def test_a_stall_never_ends_the_job_unless_a_shutdown_time_is_set() -> None:
    # Horovod's default: a rank may work alone (an evaluation on rank 0) as long as it needs.
    assert Settings.from_env({}).stall_shutdown_time_s == 0
    # A shorter or longer check time leaves it at never: only the warning moves.
    for check in ("1", "900"):
        settings = Settings.from_env({"HORA_STALL_CHECK_TIME_SECONDS": check})
        assert (settings.stall_check_time_s, settings.stall_shutdown_time_s) == (float(check), 0)
    assert (
        Settings.from_env({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "300"}).stall_shutdown_time_s
        == 300
    )


def test_horovod_names_are_honoured_and_hora_names_win() -> None:
    s = Settings.from_env({"HOROVOD_FUSION_THRESHOLD": "1024", "HOROVOD_CYCLE_TIME": "5"})
    assert (s.fusion_threshold_bytes, s.cycle_time_ms) == (1024, 5.0)
    s = Settings.from_env({"HOROVOD_CYCLE_TIME": "5", "HORA_CYCLE_TIME": "2.5"})
    assert s.cycle_time_ms == 2.5


def test_booleans_parse_like_horovod() -> None:
    assert Settings.from_env({"HOROVOD_STALL_CHECK_DISABLE": "1"}).stall_check_enabled is False
    assert Settings.from_env({"HORA_DYNAMIC_PROCESS_SETS": "true"}).dynamic_process_sets


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"HORA_FUSION_THRESHOLD": "lots"}, "must be an integer"),
        ({"HORA_FUSION_THRESHOLD": "-1"}, ">= 0 bytes"),
        ({"HORA_CYCLE_TIME": "x"}, "must be a number"),
        ({"HORA_LOG_LEVEL": "LOUD"}, "HORA_LOG_LEVEL must be one of"),
        ({"HORA_STALL_CHECK_DISABLE": "maybe"}, "must be 0 or 1"),
    ],
)
def test_bad_values_are_named(env: dict[str, str], match: str) -> None:
    with pytest.raises(SettingError, match=match):
        Settings.from_env(env)


def test_topology_from_horarun_variables() -> None:
    from hora.common.job.topology import detect

    env = {
        "HORA_RANK": "1",
        "HORA_SIZE": "3",
        "HORA_LOCAL_RANK": "1",
        "HORA_LOCAL_SIZE": "3",
        "HORA_RENDEZVOUS_ADDR": "127.0.0.1",
        "HORA_RENDEZVOUS_PORT": "1234",
    }
    topology = detect(env)
    assert (topology.rank, topology.size, topology.local_size, topology.all_local) == (
        1,
        3,
        3,
        True,
    )


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"HORA_RANK": "3", "HORA_SIZE": "2", "HORA_RENDEZVOUS_ADDR": "x"}, "rank 3 is outside"),
        ({"HORA_RANK": "0", "HORA_SIZE": "2"}, "needs a rendezvous address"),
        ({"HORA_RANK": "zero", "HORA_SIZE": "2"}, "must be an integer"),
        ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR is not"),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, "Open MPI set some of its variables"),
    ],
)
def test_bad_or_foreign_topology_is_explained(env: dict[str, str], match: str) -> None:
    from hora.common.job.topology import TopologyError, detect

    with pytest.raises(TopologyError, match=match):
        detect(env)


def test_single_process_without_any_launcher() -> None:
    from hora.common.job.topology import detect

    assert detect({"SLURM_NTASKS": "4"}).size == 1  # an allocation, not an srun step


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, ("gloo", False)),
        ({"HORA_CPU_OPERATIONS": "mpi", "HORA_ENABLE_NVTX": "1"}, ("mpi", True)),
        ({"HOROVOD_CPU_OPERATIONS": "MPI", "HORA_ENABLE_NVTX": "1"}, ("mpi", True)),
        # Horovod has no HOROVOD_ENABLE_NVTX (it has HOROVOD_DISABLE_NVTX_RANGES).
        ({"HOROVOD_ENABLE_NVTX": "1"}, ("gloo", False)),
        ({"HORA_CPU_OPERATIONS": "gloo", "HOROVOD_CPU_OPERATIONS": "mpi"}, ("gloo", False)),
    ],
)
def test_the_data_path_and_nvtx_settings(env: dict[str, str], expected: tuple[str, bool]) -> None:
    settings = Settings.from_env(env)
    assert (settings.cpu_operations, settings.enable_nvtx) == expected


def test_an_unknown_data_path_is_refused_by_name() -> None:
    with pytest.raises(
        SettingError, match="HORA_CPU_OPERATIONS must be one of gloo, mpi; got 'ccl'"
    ):
        Settings.from_env({"HORA_CPU_OPERATIONS": "ccl"})


def test_horovods_ccl_is_not_refused_but_replaced() -> None:
    # A Horovod value hora lacks counts as unset (hvd.init() names it; see test_unheeded.py).
    assert Settings.from_env({"HOROVOD_CPU_OPERATIONS": "ccl"}).cpu_operations == "gloo"
    assert Settings.from_env({"HOROVOD_GPU_OPERATIONS": "MPI"}).gpu_operations == "nccl"
