"""``hora.run`` with ``hosts=`` across hosts over real SSH: network namespaces stand in for
machines (see conftest). The function travels by value; the results come back in rank order.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import cloudpickle
import pytest

import hora
from hora.runner.api import HoraRunError
from tests.multihost.conftest import Cluster

# The workers on the other "hosts" do not import this test package: send its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _ssh_arguments(cluster: Cluster) -> dict[str, Any]:
    """hora.run's SSH arguments from the cluster's horarun flags."""
    flags = cluster.ssh_flags
    pairs = list(zip(flags[::2], flags[1::2]))
    return {
        "ssh_identity_file": next(v for f, v in pairs if f == "--ssh-identity-file"),
        "ssh_options": [v for f, v in pairs if f == "--ssh-option"],
    }


def _where() -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="total")
    place = {
        "rank": hvd.rank(),
        "host": os.environ["HORA_HOSTNAME"],
        "cross": (hvd.cross_rank(), hvd.cross_size()),
        "mark": os.environ.get("HORA_TEST_MARK"),
        "total": total.item(),
    }
    hvd.shutdown()
    return place


@pytest.mark.timeout(120)
def test_hosts_runs_the_function_on_two_hosts_over_ssh(cluster: Cluster) -> None:
    a, b = cluster.hosts
    places = hora.run(
        _where,
        num_proc=3,
        hosts=f"localhost:1,{a}:1,{b}:1",
        env={"HORA_TEST_MARK": "carried"},
        timeout_s=90,
        **_ssh_arguments(cluster),
    )
    assert places == [
        {"rank": r, "host": h, "cross": (r, 3), "mark": "carried", "total": 6.0}
        for r, h in enumerate(["localhost", a, b])
    ]


def _fail_on_the_second_host() -> int:
    import hora.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank 1 found a corrupt shard")
    return hvd.rank()


@pytest.mark.timeout(120)
def test_a_remote_ranks_error_comes_back(cluster: Cluster) -> None:
    a, b = cluster.hosts
    with pytest.raises(HoraRunError) as info:
        hora.run(
            _fail_on_the_second_host,
            num_proc=2,
            hosts=[f"{a}:1", f"{b}:1"],
            timeout_s=90,
            **_ssh_arguments(cluster),
        )
    assert "ValueError: rank 1 found a corrupt shard" in info.value.errors[1]
    assert info.value.results == {0: 0}


@pytest.mark.timeout(60)
def test_an_unreachable_host_is_refused_before_anything_starts(cluster: Cluster) -> None:
    with pytest.raises(ValueError, match=f"cannot reach host '{cluster.unreachable}' over SSH"):
        hora.run(
            _where,
            num_proc=2,
            hosts=f"{cluster.hosts[0]}:1,{cluster.unreachable}:1",
            start_timeout=3,
            **_ssh_arguments(cluster),
        )
