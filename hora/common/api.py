"""hora's framework-neutral public API, listed once.

Both framework adapters (``hora.torch``, ``hora.tensorflow``) re-export every name of
:data:`__all__` and add only their tensor-typed collectives, optimizers and helpers; the
integrations (``hora.lightning``, ``hora.ray``) and tools use the same names. A new neutral
function (a question about the job, a build fact, a process-set call) is added here, once, and
both adapters have it.

Example:
    >>> from hora.common import api
    >>> api.init()
    >>> api.rank(), api.size(), api.data_path()
    (0, 2, 'shm')
"""

from hora.common import metrics
from hora.common.basics import (
    cross_rank,
    cross_size,
    data_path,
    gloo_enabled,
    gpu_data_path,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_enabled,
    mpi_threads_supported,
    rank,
    size,
)
from hora.common.basics import topology as topology
from hora.common.build_info import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    mpi_built,
    nccl_built,
    rocm_built,
)
from hora.common.ops.collectives import Adasum, Average, Max, Min, Product, Sum
from hora.common.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)

# lifecycle loads hora.common.startup.registration, which gives process_sets' add_process_set
# and remove_process_set the session they register in.
from hora.common.startup.lifecycle import init, shutdown
from hora.common.startup.timeline import start_timeline, stop_timeline
from hora.common.vocabulary.errors import (
    HoraInternalError,
    HoraValueError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
)

# What every adapter re-exports (``topology``, the running job's placement, is for the
# integrations and is not part of an adapter's namespace).
__all__ = [
    "Adasum",
    "Average",
    "HoraInternalError",
    "HoraValueError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "add_process_set",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "data_path",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "global_process_set",
    "gpu_data_path",
    "init",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_size",
    "metrics",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
