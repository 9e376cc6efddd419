"""hora's PyTorch API: ``import hora.torch as hvd`` in place of ``import horovod.torch as hvd``.

Example:
    >>> import hora.torch as hvd
    >>> hvd.init()
    >>> x = hvd.allreduce(torch.ones(3) * hvd.rank(), op=hvd.Sum)
"""

from hora.common import api
from hora.common.api import *  # noqa: F403  (the framework-neutral names, listed once)
from hora.torch import elastic
from hora.torch.compression import Compression
from hora.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from hora.torch.ops import (
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
    "Compression",
    "SyncBatchNorm",
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
    "elastic",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "sparse_allreduce_async",
    "synchronize",
]
__all__ += api.__all__


def __getattr__(name: str) -> object:
    # ``hvd.mpi_ops`` without importing it, as in Horovod, where the package loads it. It
    # re-exports this package's names, so it loads once they are all defined.
    if name == "mpi_ops":
        import importlib

        return importlib.import_module("hora.torch.mpi_ops")
    raise AttributeError(f"module 'hora.torch' has no attribute {name!r}")
