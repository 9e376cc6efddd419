"""Topology and build queries on real processes started by ``hora.run`` on one host."""

from __future__ import annotations

from typing import Any

import pytest

from hora.common.transport.mpi import mpi_loadable

from .jobs import run_job


def _topology_worker() -> dict[str, Any]:
    import hora.torch as hvd

    before = hvd.is_initialized()
    hvd.init()
    out = {
        "initialized_before": before,
        "is_initialized": hvd.is_initialized(),
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(),
        "is_homogeneous": hvd.is_homogeneous(),
        "global_ranks": list(hvd.global_process_set.ranks),
        "global_set": (
            hvd.global_process_set.process_set_id,
            hvd.global_process_set.size(),
            hvd.global_process_set.rank(),
        ),
        "gloo_built": hvd.gloo_built(),
        "gloo_enabled": hvd.gloo_enabled(),
        "mpi_built": hvd.mpi_built(),
        "mpi_enabled": hvd.mpi_enabled(),
    }
    hvd.shutdown()
    out["initialized_after_shutdown"] = hvd.is_initialized()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("np", [2, 3])
def test_topology_of_a_single_host_job(np: int) -> None:
    ranks = run_job(_topology_worker, np, timeout_s=45)

    for rank, observed in enumerate(ranks):
        assert observed == {
            "initialized_before": False,
            "is_initialized": True,
            "rank": rank,
            "size": np,
            "local_rank": rank,
            "local_size": np,
            "cross_rank": 0,
            "cross_size": 1,
            "is_homogeneous": True,
            "global_ranks": list(range(np)),
            "global_set": (0, np, rank),
            "gloo_built": True,
            "gloo_enabled": True,
            # Whether mpi4py and its MPI library load here; the job itself runs over Gloo.
            "mpi_built": mpi_loadable(),
            "mpi_enabled": False,
            "initialized_after_shutdown": False,
        }
