"""What a Horovod user finds missing in hora, or refused, and what to use instead: one table.

Each :class:`Gap` is one thing of Horovod's: a module, some names, or a feature. Its ``missing``
paths are Horovod's dotted names that hora does not have at the same path (a module stands for
every name in it and below it, as :func:`hora.tools.horovod_inventory.under` counts them).
A gap with no missing path is a feature that hora refuses or does differently.

docs/api.md's "What is not there yet" is written from this table by
``python -m hora.tools.docs_tables``, with the counts of :mod:`hora.tools.horovod_inventory` and
the names of Horovod's settings that hora reads without acting on them
(:data:`hora.common.vocabulary.settings_table.UNHEEDED`, the inert flags of :mod:`hora.runner.flags`),
which docs/environment.md and docs/launching.md explain one by one.
tests/unit/test_horovod_inventory.py checks both ways: every name of the inventory that is not
covered here is on hora's module, every missing path is really missing, and each refused or
different feature still is.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gap:
    """One thing of Horovod's that hora lacks or refuses.

    Attributes:
        key: a short name for it, for tests.
        title: what the Horovod user looks for, as the docs show it after the missing paths
            (Markdown).
        missing: Horovod's dotted paths that hora lacks (``horovod.spark`` for the whole
            package); empty for a feature that hora refuses or does differently.
        instead: what hora does, and what to use (Markdown).
        why: why it is not there (Markdown).
    """

    key: str
    title: str
    missing: tuple[str, ...]
    instead: str
    why: str


GAPS: tuple[Gap, ...] = (
    Gap(
        "spark",
        "Spark: `run`, `run_elastic`, the Keras, Torch and Lightning estimators, stores and "
        "backends",
        ("horovod.spark",),
        "Start the job on the cluster's hosts with `horarun -H` or `hora.run(hosts=...)` "
        "([launching.md](launching.md#multi-host-jobs-over-ssh)), or on Ray with `hora.ray` "
        "([ray.md](ray.md)), and read the data with the framework's own loader.",
        "hora launches over SSH, MPI and Ray; it has no Spark driver or estimators.",
    ),
    Gap(
        "mxnet",
        "MXNet",
        ("horovod.mxnet",),
        "`hora.torch` or `hora.tensorflow`.",
        "Apache MXNet is retired (moved to the Apache Attic in 2023); hora supports PyTorch and "
        "TensorFlow/Keras.",
    ),
    Gap(
        "data-loaders",
        "Data loaders: `BaseDataLoader`, `AsyncDataLoaderMixin`",
        ("horovod.data",),
        "`torch.utils.data.DataLoader` with a `DistributedSampler` (or `hvd.elastic.ElasticSampler` "
        "in elastic jobs), `tf.data` with `dataset.shard(hvd.size(), hvd.rank())`, or Ray Data "
        "through `hora.ray` ([ray.md](ray.md#feeding-workers-from-ray-data)).",
        "They serve Horovod's Spark estimators' readers, which hora does not have.",
    ),
    Gap(
        "tf-data-service",
        "The tf.data service of Horovod's compute workers: `TfDataServiceConfig`, "
        "`tf_data_service`",
        ("horovod.tensorflow.data",),
        "Run TensorFlow's own `tf.data.experimental.service` dispatcher and workers, or shard "
        "the input on each rank.",
        "Horovod starts those compute workers from `horovodrun` and Spark; hora's launcher does "
        "not.",
    ),
    Gap(
        "ray-elastic",
        "Ray's elastic executor and worker class, and `RayExecutor`'s elastic arguments",
        ("horovod.ray.ElasticRayExecutor", "horovod.ray.BaseHorovodWorker"),
        "`hora.ray.HoraTrainer` with `ScalingConfig(num_workers=(min, max))`, which restarts from "
        "a checkpoint when workers come or go ([ray.md](ray.md#elastic-worker-counts-num_workersmin-max)); "
        "`RayExecutor(min_workers=...)` raises `NotImplementedError` saying so. Code of your own "
        "on the workers: `RayExecutor.start(executable_cls=...)`.",
        "Ray Train handles worker groups that change; hora's in-memory elastic mode is "
        "`horarun`'s.",
    ),
    Gap(
        "compiled-library",
        "Handles on Horovod's compiled library",
        (
            "horovod.torch.mpi_ops.mpi_lib",
            "horovod.tensorflow.mpi_ops.MPI_LIB",
            "horovod.common.basics.HorovodBasics",
        ),
        "The build facts are `hvd.mpi_built()`, `hvd.gloo_built()`, `hvd.nccl_built()`, "
        "`hvd.cuda_built()`, ... and `horarun --check-build`; `HorovodBasics`'s methods are "
        "functions of each framework's module (listed once in `hora.common.api`).",
        "hora is pure Python: there is no C++ library to load or to query.",
    ),
    Gap(
        "common-util",
        "Horovod's helpers for loading its extensions (`check_extension`, "
        "`check_installed_version`, `get_ext_suffix`) and for its own modules (`split_list`, "
        "`env`, ...)",
        ("horovod.common.util",),
        "The build checks are on each framework's module (`hvd.mpi_built()`, `hvd.nccl_built()`, "
        "...); `num_rank_is_power_2` and `handle_average_backwards_compatibility` are in "
        "`hora.torch.mpi_ops` and `hora.tensorflow.mpi_ops`.",
        "hora compiles no extension, and keeps no module of miscellaneous helpers.",
    ),
    Gap(
        "notification-manager",
        "The elastic workers' notification service",
        ("horovod.common.elastic.notification_manager",),
        "`state.check_host_updates()` (and `state.commit()`) read host changes from the job's "
        "store ([elastic.md](elastic.md)).",
        "Horovod's driver calls a service in each worker; hora's driver writes to the store "
        "that every worker already reads.",
    ),
    Gap(
        "torch-elastic-state",
        "The module path of `TorchState` and its handlers",
        ("horovod.torch.elastic.state",),
        "`hora.torch.elastic` (`TorchState`) or `hora.torch.elastic.torch_state` (every name of "
        "Horovod's module: `StateHandler`, `ModelStateHandler`, `get_handler_registry`, ...).",
        "`hora.common.elastic.state` is the framework-neutral `State`; hora gives two modules "
        "two names.",
    ),
    Gap(
        "aggregation-helpers",
        "Two helpers of Horovod's gradient aggregation",
        (
            "horovod.tensorflow.gradient_aggregation.apply_op_to_not_none_tensors",
            "horovod.tensorflow.gradient_aggregation.get_not_none_from_list",
        ),
        "`LocalGradientAggregationHelper` itself is there; for the helpers, a list "
        "comprehension that skips `None`.",
        "They are internal helpers of that class.",
    ),
    Gap(
        "xla",
        "Collectives in XLA-compiled code (`HOROVOD_ENABLE_XLA_OPS`)",
        (),
        "Compile the step without XLA (`jit_compile=False`); hora says so when it meets XLA.",
        "XLA cannot call out to hora's Python engine.",
    ),
    Gap(
        "saved-model",
        "Collectives inside an exported SavedModel",
        (),
        "Export the model for inference without its collectives.",
        "hora's TensorFlow collectives are `tf.py_function`s that need hora's engine in the "
        "running Python; Horovod's are compiled ops.",
    ),
    Gap(
        "adasum-gpu",
        "Adasum on GPUs over NCCL",
        (),
        "`op=hvd.Adasum` on CUDA tensors copies them to host memory and combines them over Gloo "
        "([training.md](training.md#adasum-adaptive-summation)).",
        "hora's Adasum runs over the host communicator only.",
    ),
    Gap(
        "ccl-ddl",
        "oneCCL and IBM DDL (`ccl_built()`, `ddl_built()`)",
        (),
        "Both answer `False`; CPU data goes over Gloo or MPI, GPU data over NCCL "
        "([deployment.md](deployment.md#choosing-a-data-path)).",
        "hora has no oneCCL or DDL transport.",
    ),
    Gap(
        "jsrun-lsf",
        "`horovodrun --jsrun`, and `-np` and hosts taken from an LSF allocation",
        (),
        "`--jsrun` is refused with a message; in an LSF job pass `-np` and `-H` (or "
        "`--hostfile`), or start the workers with `mpirun` "
        "([launching.md](launching.md#mpi)).",
        "hora does not launch through LSF's `jsrun` or read LSF's job variables.",
    ),
)

# Where the other differences are explained: what works, but not as in Horovod.
ELSEWHERE: tuple[tuple[str, str], ...] = (
    ("PyTorch", "training.md#migrating-from-horovod"),
    ("TensorFlow", "tensorflow.md#what-is-not-supported"),
    ("Keras", "tensorflow-keras.md#migrating-from-horovodtensorflowkeras"),
    ("elastic training", "elastic.md#guarantees-and-how-hora-differs-from-horovod"),
    ("Ray", "ray.md#limitations"),
)


def covered(path: str) -> Gap | None:
    """The gap whose missing paths include Horovod's name ``path``, if any."""
    for gap in GAPS:
        if any(path == missing or path.startswith(missing + ".") for missing in gap.missing):
            return gap
    return None
