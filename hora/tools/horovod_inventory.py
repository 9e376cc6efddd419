"""Horovod's public Python API as data: each public module and the names a user reaches in it.

This is a compatibility record, not code of Horovod's: only names. It was read from Horovod
0.28.1's source (horovod/horovod at commit 2626dc87a3a8eb8fb7d2216198ce45bce0f9e65a) by these
rules:

* The modules are those Horovod's API reference documents (``horovod.torch``,
  ``horovod.tensorflow.keras.callbacks``, ``horovod.spark.common.store``, ...) and those a
  Horovod script imports by path (``horovod.torch.mpi_ops``, ``horovod.common.exceptions``,
  ``horovod.tensorflow.data.compute_service``, ...). Private modules (``horovod._keras``) and
  the launcher's internals (``horovod.runner.gloo_run`` and the like) are not among them.
* A module's names are its ``__all__`` where it has one. Otherwise they are the public names it
  defines (functions, classes, module-level values), and, in the namespaces users import from
  (a package's ``__init__`` and the ``mpi_ops`` modules), the names it imports from Horovod's
  other modules, except the helpers of ``horovod.common.util`` that it imports for its own use
  (they are listed once, under ``horovod.common.util``). Modules of other projects (``torch``,
  ``warnings``) and stand-ins for type annotations (``MPI``) are not names.

:mod:`hora.tools.horovod_gaps` says what hora lacks of it; tests/unit/test_horovod_inventory.py
checks that every other name is on hora's module of the same path (``hora.torch`` for
``horovod.torch``).
"""

from __future__ import annotations

HOROVOD_VERSION = "0.28.1"

HOROVOD: dict[str, tuple[str, ...]] = {
    "horovod": ("run",),
    "horovod.common.basics": ("HorovodBasics",),
    "horovod.common.elastic": ("ObjectState", "State", "notification_manager", "run_fn"),
    "horovod.common.exceptions": (
        "HorovodInternalError", "HorovodVersionMismatchError", "HostsUpdatedInterrupt",
        "get_version_mismatch_message",
    ),
    "horovod.common.process_sets": (
        "ProcessSet", "add_process_set", "global_process_set", "remove_process_set",
    ),
    "horovod.common.util": (
        "EXTENSIONS", "ccl_built", "check_extension", "check_installed_version", "ddl_built", "env",
        "extension_available", "get_average_backwards_compatibility_fun", "get_ext_suffix",
        "get_extension_full_path", "gloo_built", "gpu_available", "is_iterable",
        "is_version_greater_equal_than", "mpi_built", "nccl_built", "num_rank_is_power_2",
        "split_list",
    ),
    "horovod.data": ("AsyncDataLoaderMixin", "BaseDataLoader"),
    "horovod.data.data_loader_base": ("AsyncDataLoaderMixin", "BaseDataLoader"),
    "horovod.keras": (
        "Adasum", "Average", "Compression", "DistributedOptimizer", "PartialDistributedOptimizer",
        "Sum", "allgather", "allreduce", "broadcast", "broadcast_global_variables", "callbacks",
        "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic",
        "global_process_set", "gloo_built", "gloo_enabled", "init", "is_initialized", "load_model",
        "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
        "nccl_built", "rank", "reducescatter", "rocm_built", "shutdown", "size", "start_timeline",
        "stop_timeline",
    ),
    "horovod.keras.callbacks": (
        "BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
        "LearningRateWarmupCallback", "MetricAverageCallback",
    ),
    "horovod.keras.elastic": (
        "CommitStateCallback", "KerasState", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
        "run",
    ),
    "horovod.mxnet": (
        "Adasum", "Average", "Compression", "DistributedOptimizer", "DistributedTrainer", "Max",
        "Min", "ProcessSet", "Product", "Sum", "add_process_set", "allgather", "allgather_object",
        "allreduce", "allreduce_", "alltoall", "broadcast", "broadcast_", "broadcast_object",
        "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
        "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
        "grouped_allreduce", "grouped_allreduce_", "grouped_reducescatter", "init",
        "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
        "mpi_threads_supported", "nccl_built", "rank", "reducescatter", "remove_process_set",
        "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline",
    ),
    "horovod.ray": ("BaseHorovodWorker", "ElasticRayExecutor", "RayExecutor"),
    "horovod.runner": ("run",),
    "horovod.spark": ("run", "run_elastic"),
    "horovod.spark.common.backend": ("Backend", "SparkBackend", "default_num_proc"),
    "horovod.spark.common.estimator": ("HorovodEstimator", "HorovodModel"),
    "horovod.spark.common.store": (
        "AbstractFilesystemStore", "DBFSLocalStore", "FilesystemStore", "HDFSStore", "LocalStore",
        "Store",
    ),
    "horovod.spark.data_loaders": ("PytorchAsyncDataLoader", "PytorchDataLoader"),
    "horovod.spark.keras": ("KerasEstimator", "KerasModel"),
    "horovod.spark.lightning": ("TorchEstimator", "TorchModel"),
    "horovod.spark.torch": ("TorchEstimator", "TorchModel"),
    "horovod.tensorflow": (
        "Adasum", "Average", "BroadcastGlobalVariablesHook", "Compression",
        "DistributedGradientTape", "DistributedOptimizer", "LocalGradientAggregationHelper", "Max",
        "Min", "PartialDistributedGradientTape", "ProcessSet", "Product", "Sum",
        "SyncBatchNormalization", "add_process_set", "allgather", "allgather_object", "allreduce",
        "alltoall", "broadcast", "broadcast_", "broadcast_global_variables", "broadcast_object",
        "broadcast_object_fn", "broadcast_variables", "ccl_built", "check_num_rank_power_of_2",
        "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic", "global_process_set",
        "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allreduce",
        "grouped_reducescatter", "handle_average_backwards_compatibility", "init", "is_homogeneous",
        "is_initialized", "join", "local_rank", "local_rank_op", "local_size", "local_size_op",
        "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
        "process_set_included_op", "rank", "rank_op", "reducescatter", "refs_to_vars",
        "remove_process_set", "rocm_built", "shutdown", "size", "size_op", "start_timeline",
        "stop_timeline", "vars_to_refs",
    ),
    "horovod.tensorflow.compression": (
        "Compression", "Compressor", "FP16Compressor", "NoneCompressor",
    ),
    "horovod.tensorflow.data.compute_service": (
        "TfDataServiceConfig", "compute_worker_fn", "send_to_data_service", "tf_data_service",
    ),
    "horovod.tensorflow.elastic": (
        "ObjectState", "TensorFlowKerasState", "TensorFlowState", "broadcast_object",
        "broadcast_object_fn", "broadcast_variables", "init", "rank", "run", "run_fn", "shutdown",
    ),
    "horovod.tensorflow.functions": (
        "allgather_object", "broadcast_object", "broadcast_object_fn", "broadcast_variables",
    ),
    "horovod.tensorflow.gradient_aggregation": (
        "LocalGradientAggregationHelper", "apply_op_to_not_none_tensors", "get_not_none_from_list",
    ),
    "horovod.tensorflow.gradient_aggregation_eager": ("LocalGradientAggregationHelperEager",),
    "horovod.tensorflow.keras": (
        "Average", "Compression", "DistributedOptimizer", "ProcessSet", "Sum", "add_process_set",
        "allgather", "allreduce", "broadcast", "broadcast_global_variables", "callbacks",
        "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic",
        "global_process_set", "gloo_built", "gloo_enabled", "init", "is_initialized", "load_model",
        "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
        "nccl_built", "rank", "reducescatter", "remove_process_set", "rocm_built", "shutdown",
        "size", "start_timeline", "stop_timeline",
    ),
    "horovod.tensorflow.keras.callbacks": (
        "BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
        "LearningRateWarmupCallback", "MetricAverageCallback",
    ),
    "horovod.tensorflow.keras.elastic": (
        "CommitStateCallback", "KerasState", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
        "run",
    ),
    "horovod.tensorflow.mpi_ops": (
        "Adasum", "Average", "MPI_LIB", "Max", "Min", "ProcessSet", "Product", "Sum",
        "add_process_set", "allgather", "alltoall", "broadcast", "broadcast_", "ccl_built",
        "check_num_rank_power_of_2", "cross_rank", "cross_size", "cuda_built", "ddl_built",
        "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
        "handle_average_backwards_compatibility", "init", "is_homogeneous", "is_initialized",
        "join", "local_rank", "local_rank_op", "local_size", "local_size_op", "mpi_built",
        "mpi_enabled", "mpi_threads_supported", "nccl_built", "process_set_included_op", "rank",
        "rank_op", "remove_process_set", "rocm_built", "shutdown", "size", "size_op",
        "start_timeline", "stop_timeline",
    ),
    "horovod.tensorflow.sync_batch_norm": ("SyncBatchNormalization",),
    "horovod.tensorflow.util": ("refs_to_vars", "vars_to_refs"),
    "horovod.torch": (
        "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max",
        "Min", "ProcessSet", "Product", "Sum", "SyncBatchNorm", "add_process_set", "allgather",
        "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
        "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
        "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
        "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
        "elastic", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
        "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
        "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
        "grouped_reducescatter_async", "init", "is_initialized", "join", "local_rank", "local_size",
        "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank",
        "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "shutdown",
        "size", "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize",
    ),
    "horovod.torch.compression": ("Compression", "Compressor", "FP16Compressor", "NoneCompressor"),
    "horovod.torch.elastic": ("ElasticSampler", "TorchState", "init", "run", "run_fn", "shutdown"),
    "horovod.torch.elastic.sampler": ("ElasticSampler",),
    "horovod.torch.elastic.state": (
        "ModelStateHandler", "OptimizerStateHandler", "SamplerStateHandler", "StateHandler",
        "TorchState", "get_handler_registry", "set_handler_registry",
    ),
    "horovod.torch.functions": (
        "allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    ),
    "horovod.torch.mpi_ops": (
        "Adasum", "Average", "Compression", "HorovodAllgather", "HorovodAllreduce",
        "HorovodAlltoall", "HorovodBroadcast", "HorovodGroupedAllgather", "HorovodGroupedAllreduce",
        "HorovodGroupedReducescatter", "HorovodInternalError", "HorovodReducescatter", "Max", "Min",
        "ProcessSet", "Product", "Sum", "add_process_set", "allgather", "allgather_async",
        "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
        "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
        "broadcast_async_", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
        "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
        "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
        "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
        "grouped_reducescatter_async", "handle_average_backwards_compatibility", "init",
        "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "mpi_built",
        "mpi_enabled", "mpi_lib", "mpi_threads_supported", "nccl_built", "poll", "rank",
        "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "shutdown",
        "size", "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize",
    ),
    "horovod.torch.optimizer": ("DistributedOptimizer",),
    "horovod.torch.sync_batch_norm": ("SyncBatchNorm",),
}  # fmt: skip


def paths() -> list[str]:
    """Every name of :data:`HOROVOD` as a dotted path (``horovod.torch.allreduce``), in order."""
    return [f"{module}.{name}" for module, names in HOROVOD.items() for name in names]


def under(path: str) -> list[str]:
    """The dotted paths of the names that ``path`` stands for: a module's names and those of the
    modules below it (``horovod.spark``), or one name (``horovod.ray.ElasticRayExecutor``)."""
    return [name for name in paths() if name == path or name.startswith(path + ".")]


def package(path: str) -> str:
    """The part of Horovod a dotted path belongs to, for counts: ``horovod.torch`` for
    ``horovod.torch.elastic.run``, ``horovod.common`` for ``horovod.common.util.env``,
    ``horovod`` for ``horovod.run``."""
    parts = path.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else parts[0]
