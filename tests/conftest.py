"""Which tests are slow, which must run alone, and how the others share workers.

``./dev test`` runs the suite in two pytest runs (see docs/contributing.md):

1. the tests marked ``serial``, one at a time, on an otherwise quiet machine;
2. everything else in parallel with pytest-xdist (``-n``, ``--dist loadfile``), where each
   test file (or each group of files in GROUPS) is one unit of work: its module-scoped jobs
   start once, on one worker.

The tables below say which files are ``slow`` (``./dev test --fast`` leaves them out) and which
tests are ``serial``, each with the reason. A test marked in its own file (``@pytest.mark.slow``,
``@pytest.mark.serial``) counts as well.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import pytest

# Tests that take 10 s or more here (2 cores; one serial run with --durations=0), by function
# (all its parameters) or by file where such tests are most of the file's time.
SLOW: tuple[str, ...] = (
    "tests/integrations/test_lightning.py",
    "tests/integrations/test_ray.py",
    "tests/integrations/test_ray_tune_data.py",
    "tests/multihost/test_elastic_hosts.py",
    "tests/multiproc/test_docs_commands_run.py",
    "tests/multiproc/test_elastic_durable.py",
    "tests/multiproc/test_examples.py",
    "tests/multiproc/test_optimizer.py",
    "tests/multiproc/test_planted_links.py",
    "tests/multiproc/test_process_sets.py",
    "tests/multiproc/test_run_tracebacks.py",
    "tests/multiproc/test_scaling.py",
    "tests/multiproc/test_shared_memory.py",
    "tests/multiproc/test_shm_attacks.py",
    "tests/multiproc/test_zero_elastic.py",
    "tests/tensorflow/test_elastic.py",
    "tests/tensorflow/test_examples.py",
    "tests/tensorflow/test_graph_mode.py",
    "tests/tensorflow/test_horovod_tf_imports.py",
    "tests/tensorflow/test_keras.py",
    "tests/tensorflow/test_tensorflow.py",
    "tests/multihost/test_data_paths.py::test_two_hosts_of_two_ranks_reduce_hierarchically_or_flat",
    "tests/multihost/test_ssh_launch.py::test_training_across_two_hosts",
    "tests/multiproc/test_adasum.py::test_distributed_optimizer_combines_each_ranks_update",
    "tests/multiproc/test_autotune.py::test_autotune_agrees_across_ranks_and_changes_no_result",
    "tests/multiproc/test_elastic.py::test_a_host_added_mid_run_grows_the_world",
    "tests/multiproc/test_elastic_api.py::test_simulated_elastic_run_survives_a_failure_and_a_host_change",
    "tests/multiproc/test_elastic_driver.py::test_hosts_added_and_removed_by_discovery_change_the_rounds",
    "tests/multiproc/test_elastic_driver.py::test_too_few_slots_stop_the_job_after_the_elastic_timeout",
    "tests/multiproc/test_elastic_driver.py::test_waiting_for_slots_says_every_few_seconds_what_is_offered_and_missing",
    "tests/multiproc/test_failures.py::test_by_default_a_busy_rank_is_waited_for_and_a_deadlock_still_ends_the_job",
    "tests/multiproc/test_failures.py::test_init_after_a_peers_shutdown_does_nothing",
    "tests/multiproc/test_fault_injection.py::test_a_rank_killed_while_the_others_wait_in_allreduce_is_named_by_all",
    "tests/multiproc/test_fault_injection.py::test_a_stopped_rank_is_caught_by_the_stall_limit_and_named",
    "tests/multiproc/test_gc.py::test_dropped_models_and_their_optimizers_are_collected",
    "tests/multiproc/test_launcher.py::test_hora_doctor_runs_a_two_process_allreduce",
    "tests/multiproc/test_launchers.py::test_torchrun_restart_uses_a_fresh_round_in_the_agent_store",
    "tests/multiproc/test_launchers.py::test_slurm_srun",
    "tests/multiproc/test_launchers.py::test_torchrun_inside_a_one_task_srun_step",
    "tests/multiproc/test_launchers.py::test_separate_torchrun_jobs_in_one_srun_step_are_refused",
    "tests/multiproc/test_launchers.py::test_env_method_variables",
    "tests/multiproc/test_launchers.py::test_the_cpu_sbatch_example_runs_on_slurm",
    "tests/multiproc/test_metrics.py::test_a_two_rank_job_writes_tensorboard_scalars_per_rank_and_step",
    "tests/multiproc/test_metrics.py::test_prometheus_endpoints_are_scraped_while_the_job_runs",
    "tests/multiproc/test_metrics.py::test_a_port_another_user_holds_costs_that_ranks_endpoint_not_the_job",
    "tests/multiproc/test_metrics.py::test_only_the_chosen_ranks_publish",
    "tests/multiproc/test_mpi.py::test_a_dead_peer_ends_the_job_without_a_hang",
    "tests/multiproc/test_run_api.py::test_verbose_says_what_the_launch_does_and_notes_inert_arguments",
    "tests/multiproc/test_run_api.py::test_elastic_job_survives_a_lost_host_and_returns_the_final_rounds_results",
    "tests/multiproc/test_run_api.py::test_elastic_job_on_fixed_hosts",
    "tests/multiproc/test_run_api.py::test_elastic_job_that_cannot_reform_raises_with_the_drivers_report",
    "tests/multiproc/test_run_api.py::test_use_mpi_starts_the_job_with_mpirun",
    "tests/multiproc/test_setting_agreement.py::test_slot_sizes_set_differently_are_named_with_each_value",
    "tests/multiproc/test_setting_agreement.py::test_a_slot_size_off_the_page_reduces_through_shared_memory",
    "tests/multiproc/test_setting_agreement.py::test_mpi_on_some_ranks_and_gloo_on_others_is_named_under_mpirun",
    "tests/multiproc/test_steady_state.py::test_a_result_polled_for_in_the_middle_of_a_step_comes",
    "tests/multiproc/test_steady_state.py::test_a_rank_busy_elsewhere_longer_than_the_gloo_timeout_is_waited_for",
    "tests/multiproc/test_steady_state.py::test_every_rank_busy_elsewhere_at_once_is_no_stall",
    "tests/multiproc/test_steady_state.py::test_a_deviation_seen_while_some_ranks_run_the_next_batch",
    "tests/multiproc/test_store_attacks.py::test_another_user_flooding_the_store_as_workers_connect_never_fails_the_job",
    "tests/multiproc/test_zero.py::test_sharded_training_matches_the_unsharded_optimizer",
    "tests/multiproc/test_zero.py::test_the_example_trains_checkpoints_and_resumes_on_more_workers",
)

# What must not share the machine with other tests, and why.
SERIAL: dict[str, str] = {
    "tests/integrations/test_ray.py": "a local Ray cluster, which ray.init() in another test "
    "would join (/tmp/ray/ray_current_cluster); beside 4 busy workers its node timed out "
    "during startup and a test ran past its 180 s",
    "tests/integrations/test_ray_tune_data.py": "as test_ray.py",
    "tests/multiproc/test_elastic_driver.py::test_too_few_slots_stop_the_job_after_the_elastic_"
    "timeout": "which report names the failed worker (lost round, or last failure) depends on "
    "timing: it changed beside 4 busy workers",
    "tests/multiproc/test_elastic_driver.py::test_reset_limit_stops_the_job": "as above",
    "tests/multiproc/test_launchers.py": "a SLURM cluster (munged, slurmctld, slurmd) for the "
    "session; jobs on ports derived from launcher job ids, which other jobs' ports may take",
    "tests/multiproc/test_shm_attacks.py": "mount namespaces; 20 jobs under a renaming attacker "
    "(2 min alone) and timing bounds on the jobs (30 s, 45 s, 5 s)",
    "tests/multiproc/test_shared_memory.py::test_no_segment_is_left_in_dev_shm_and_a_killed_"
    "makers_is_swept": "compares the whole of /dev/shm before and after: other jobs' segments "
    "come and go there",
    "tests/multiproc/test_shared_memory.py::test_a_rank_killed_in_a_collective_is_reported_at_"
    "once": "the survivor's report must come within 10 s of the kill",
    "tests/multiproc/test_optimizer.py::test_steady_state_gradients_are_submitted_a_batch_at_a_"
    "time": "the order of hooks and submissions it checks changed once on a loaded machine "
    "(load average 9, serial run)",
    "tests/multiproc/test_metrics.py::test_prometheus_endpoints_are_scraped_while_the_job_runs": (
        "ports p and p + 1, free a moment before the job, must still be free when its ranks "
        "bind them; other jobs' connections take ephemeral ports all the time"
    ),
    "tests/multiproc/test_metrics.py::test_a_port_another_user_holds_costs_that_ranks_endpoint_"
    "not_the_job": "rank 1 binds the held port + 1, which must be free (as above)",
    "tests/multihost/test_cluster.py": "measures a shaped link's rate and the cluster's start "
    "and teardown time (10 s at most), which busy neighbours would slow",
    "tests/multiproc/test_setting_agreement.py::test_shared_memory_set_differently_is_named_on_"
    "every_rank_at_once": "the whole job, three processes starting, must end within 15 s",
}

# Files that must never run at the same time: a group is one unit of work, on one worker.
GROUPS: dict[str, str] = {
    # Each module builds a bridge, two network namespaces and their sshd; the subnet is picked
    # from the addresses in use, so two modules building at once could pick the same one.
    # Nothing else uses the namespaces or 10.77.x, so the group runs beside the other tests.
    "tests/multihost/test_data_paths.py": "multihost",
    "tests/multihost/test_elastic_hosts.py": "multihost",
    "tests/multihost/test_run_api.py": "multihost",
    "tests/multihost/test_ssh_launch.py": "multihost",
}

# Seconds of the files that take 40 s or more, and of every file in a group (their tests'
# durations summed, in the parallel run of ./dev test on a 2-core machine busy with other work):
# the parallel run starts the longest groups first, so that no worker is left with a long one at
# the end while the others idle.
SECONDS: dict[str, float] = {
    "tests/multiproc/test_fast_path.py": 383,
    "tests/multiproc/test_examples.py": 311,
    "tests/multiproc/test_steady_state.py": 270,
    "tests/multiproc/test_deterministic.py": 270,
    "tests/multiproc/test_compile.py": 260,
    "tests/multiproc/test_run_api.py": 246,
    "tests/tensorflow/test_keras.py": 230,
    "tests/multiproc/test_optimizer.py": 202,
    "tests/multiproc/test_zero.py": 185,
    "tests/multiproc/test_docs_commands_run.py": 179,
    "tests/multiproc/test_shared_memory.py": 171,
    "tests/tensorflow/test_tensorflow.py": 154,
    "tests/multiproc/test_fault_injection.py": 141,
    "tests/multiproc/test_metrics.py": 126,
    "tests/multiproc/test_adasum.py": 123,
    "tests/multiproc/test_mpi.py": 120,
    "tests/multiproc/test_failures.py": 110,
    "tests/multiproc/test_allreduce.py": 99,
    "tests/multihost/test_elastic_hosts.py": 99,
    "tests/multiproc/test_environment.py": 97,
    "tests/multiproc/test_elastic_driver.py": 97,
    "tests/integrations/test_lightning.py": 96,
    "tests/multiproc/test_launcher.py": 94,
    "tests/multiproc/test_elastic.py": 93,
    "tests/tensorflow/test_examples.py": 85,
    "tests/multiproc/test_store_attacks.py": 84,
    "tests/multiproc/test_elastic_durable.py": 79,
    "tests/multiproc/test_setting_agreement.py": 74,
    "tests/tensorflow/test_graph_mode.py": 72,
    "tests/multiproc/test_ordering.py": 72,
    "tests/multiproc/test_elastic_api.py": 72,
    "tests/multiproc/test_bad_input.py": 68,
    "tests/multiproc/test_join.py": 66,
    "tests/multiproc/test_planted_links.py": 65,
    "tests/multihost/test_ssh_launch.py": 65,
    "tests/multiproc/test_timeline.py": 64,
    "tests/tensorflow/test_horovod_tf_imports.py": 61,
    "tests/multiproc/test_launcher_imports.py": 55,
    "tests/multihost/test_data_paths.py": 53,
    "tests/multiproc/test_process_sets.py": 52,
    "tests/multiproc/test_timeline_analysis.py": 51,
    "tests/multiproc/test_collectives.py": 50,
    "tests/tensorflow/test_elastic.py": 45,
    "tests/multiproc/test_autotune.py": 43,
    "tests/multiproc/test_process_set_names.py": 42,
    "tests/multiproc/test_gc.py": 42,
    "tests/multiproc/test_scaling.py": 40,
    "tests/multihost/test_run_api.py": 31,
}

SERIAL_LEFT_OUT = "_hora_serial_left_out"


def _listed(nodeid: str, keys: Iterable[str]) -> bool:
    """Whether a key names ``nodeid``: its folder (``.../``), file, or function (``file::name``,
    every parameter of it)."""
    for key in keys:
        if key.endswith("/"):
            if nodeid.startswith(key):
                return True
        elif nodeid == key or nodeid.startswith((key + "::", key + "[")):
            return True
    return False


def _group(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return GROUPS.get(path, path)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``slow`` and ``serial`` from the tables (before ``-m`` selects); in a parallel run,
    leave out the serial tests and put the longest groups first."""
    for item in items:
        if _listed(item.nodeid, SLOW):
            item.add_marker(pytest.mark.slow)
        if _listed(item.nodeid, SERIAL):
            item.add_marker(pytest.mark.serial)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _leave_out_serial(config, items)
        # Every worker sorts alike; the scheduler hands out groups in this order.
        files: dict[str, set[str]] = {}
        for item in items:
            files.setdefault(_group(item.nodeid), set()).add(item.nodeid.split("::", 1)[0])
        seconds = {group: sum(SECONDS.get(p, 0.0) for p in paths) for group, paths in files.items()}
        first_seen = {group: n for n, group in enumerate(files)}
        items.sort(
            key=lambda item: (-seconds[_group(item.nodeid)], first_seen[_group(item.nodeid)])
        )


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, with the files of a GROUPS entry as one unit of work.

    (``--dist loadgroup`` with ``xdist_group`` marks would say the same, but pytest-xdist 3.8
    groups nothing under pytest 9.2: pytest-dev/pytest-xdist#1386.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileGroupScheduling(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return FileGroupScheduling(config, log)


def _leave_out_serial(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a parallel run the tests that must run alone are left out: ./dev test runs them in a
    serial run of their own, and a plain ``pytest -n N`` says so at its end."""
    serial = [item for item in items if item.get_closest_marker("serial") is not None]
    if serial:
        config.hook.pytest_deselected(items=serial)
        items[:] = [item for item in items if item.get_closest_marker("serial") is None]


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        setattr(config, SERIAL_LEFT_OUT, "not serial" not in (config.option.markexpr or ""))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if getattr(terminalreporter.config, SERIAL_LEFT_OUT, False):
        terminalreporter.write_line(
            "note: tests marked `serial` are left out of a parallel run (-n): they must run "
            "alone. Run them with `pytest -m serial`, or use ./dev test, which runs both.",
            yellow=True,
        )
