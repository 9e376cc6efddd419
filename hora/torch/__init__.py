"""hora's PyTorch API: ``import hora.torch as hvd`` in place of ``import horovod.torch as hvd``.

Example:
    >>> import hora.torch as hvd
    >>> hvd.init()
    >>> x = hvd.allreduce(torch.ones(3) * hvd.rank(), op=hvd.Sum)
"""

from typing import Any

from hora.common import metrics
from hora.common.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    size,
    start_timeline,
    stop_timeline,
)
from hora.common.basics import init as _init
from hora.common.basics import register_process_set as add_process_set
from hora.common.basics import shutdown as _shutdown
from hora.common.basics import unregister_process_set as remove_process_set
from hora.common.engine import Handle as _Handle
from hora.common.errors import (
    HoraInternalError,
    HoraValueError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
)
from hora.common.process_sets import ProcessSet
from hora.torch import elastic
from hora.torch.compression import Compression
from hora.torch.functions import (
    _restart_default_names,
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
    _clear_handles,
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


def init(comm: Any = None, process_sets: list[ProcessSet] | str | None = None) -> None:
    """Start hora in this process. See :func:`hora.common.basics.init`."""
    _clear_handles()
    # Unnamed collectives are named by counting calls; every process of the (re)started job,
    # old workers and new ones after an elastic reset alike, counts from the start.
    _Handle.restart_numbering()
    _restart_default_names()
    _init(comm=comm, process_sets=process_sets)


def shutdown() -> None:
    """Stop hora in this process; pending operations fail. ``init`` may be called again."""
    _shutdown()
    _clear_handles()


init.__doc__ = _init.__doc__

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
