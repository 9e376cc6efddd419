"""hora's PyTorch API: ``import hora.torch as hvd`` in place of ``import horovod.torch as hvd``.

Example:
    >>> import hora.torch as hvd
    >>> hvd.init()
    >>> x = hvd.allreduce(torch.ones(3) * hvd.rank(), op=hvd.Sum)
"""

from hora.common import metrics
from hora.common.basics import (
    cross_rank,
    cross_size,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_enabled,
    mpi_threads_supported,
    rank,
    size,
)
from hora.common.build_info import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    mpi_built,
    nccl_built,
    rocm_built,
)
from hora.common.process_sets import ProcessSet
from hora.common.startup.lifecycle import init, shutdown
from hora.common.startup.registration import register_process_set as add_process_set
from hora.common.startup.registration import unregister_process_set as remove_process_set
from hora.common.startup.timeline import start_timeline, stop_timeline
from hora.common.vocabulary.errors import (
    HoraInternalError,
    HoraValueError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
)
from hora.torch import elastic
from hora.torch.compression import Compression
from hora.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from hora.torch.ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    global_process_set,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from hora.torch.optimizer import DistributedOptimizer
from hora.torch.sync_batch_norm import SyncBatchNorm

__all__ = [
    "DistributedOptimizer",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "Adasum",
    "Average",
    "Compression",
    "HoraInternalError",
    "HoraValueError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "gloo_built",
    "gloo_enabled",
    "global_process_set",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "start_timeline",
    "stop_timeline",
    "metrics",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "synchronize",
]


def __getattr__(name: str) -> object:
    # ``hvd.mpi_ops`` without importing it, as in Horovod, where the package loads it. It
    # re-exports this package's names, so it loads once they are all defined.
    if name == "mpi_ops":
        import importlib

        return importlib.import_module("hora.torch.mpi_ops")
    raise AttributeError(f"module 'hora.torch' has no attribute {name!r}")
