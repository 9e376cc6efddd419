"""The choice of a data path for CUDA tensors, as far as it can be checked without a GPU.

The NCCL path itself runs in tests/multiproc/test_cuda.py where GPUs are visible.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hora.torch as hvd
from hora.common.build_info import nccl_version_code
from hora.common.transport import TransportError
from hora.common.transport.nccl import NCCLCommunicator, nccl_available, shared_gpus
from hora.common.vocabulary.config import SettingError, Settings


@pytest.mark.timeout(30)
def test_gpu_operations_default_to_nccl_and_read_horovods_variable() -> None:
    assert Settings.from_env({}).gpu_operations == "nccl"
    assert Settings.from_env({"HOROVOD_GPU_OPERATIONS": "NCCL"}).gpu_operations == "nccl"
    assert Settings.from_env({"HORA_GPU_OPERATIONS": "host"}).gpu_operations == "host"


@pytest.mark.timeout(30)
def test_an_unknown_gpu_path_is_refused_naming_the_choices() -> None:
    with pytest.raises(SettingError, match="HORA_GPU_OPERATIONS must be one of nccl, host"):
        Settings.from_env({"HORA_GPU_OPERATIONS": "mpi"})


@pytest.mark.timeout(30)
def test_nccl_built_is_nccls_version_code_or_zero() -> None:
    built = hvd.nccl_built()
    assert type(built) is int
    if not (dist.is_available() and dist.is_nccl_available()):
        assert built == 0
    else:  # Horovod's answer: NCCL_VERSION_CODE, e.g. 21803 for NCCL 2.18.3
        assert built == nccl_version_code(torch.cuda.nccl.version()) > 0  # type: ignore[no-untyped-call]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("version", "code"),
    # Codes as NCCL's own NCCL_VERSION macro numbers them: the scheme changed after 2.8.
    [((2, 7, 8), 2708), ((2, 8, 4), 2804), ((2, 9, 6), 20906), ((2, 18, 3), 21803), (2708, 2708)],
)
def test_nccl_version_code_follows_nccls_numbering(
    version: tuple[int, ...] | int, code: int
) -> None:
    assert nccl_version_code(version) == code


@pytest.mark.timeout(30)
def test_members_on_one_gpu_are_found_in_groups() -> None:
    assert shared_gpus(["GPU-a", "GPU-b", "GPU-c"]) == []
    assert shared_gpus(["GPU-a", "GPU-b", "GPU-a", "GPU-b", "GPU-c"]) == [[0, 2], [1, 3]]
    assert shared_gpus(["GPU-a"] * 3) == [[0, 1, 2]]


@pytest.mark.timeout(30)
@pytest.mark.skipif(nccl_available(), reason="NCCL is available here")
def test_a_nccl_group_without_nccl_says_what_to_set_instead() -> None:
    with pytest.raises(TransportError, match="HORA_GPU_OPERATIONS=host"):
        NCCLCommunicator(None, 0, 2, 30.0, torch.device("cuda", 0))


@pytest.mark.timeout(60)
def test_gpu_data_path_is_host_until_a_nccl_group_is_made() -> None:
    from hora.common import basics

    with pytest.raises(ValueError, match="hvd.init()"):
        basics.gpu_data_path()
    hvd.init()
    try:
        hvd.allreduce(torch.ones(3), name="cpu_only")
        assert basics.gpu_data_path() == "host"
    finally:
        hvd.shutdown()
