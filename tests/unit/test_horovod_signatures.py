"""Horovod's public signatures, written down as data: a Horovod call means the same in hora.

Each entry of the table is one function, class or method of Horovod's Python API that hora
provides, with the parameters Horovod defines for it: their names in order, and the default of
each (a bare name has none). The entries were read from Horovod's source (horovod/horovod:
``horovod/torch``, ``horovod/tensorflow``, ``horovod/keras``, ``horovod/common``); Horovod is
not imported. hora's function must begin with the same parameters, in the same order, each one
accepted by position and by keyword, with an equal default. After them hora may add its own,
each with a default (best keyword-only), so a Horovod call needs none of them. Where Horovod
requires an argument, hora may give it a default: a Horovod call passes it anyway.

Horovod names that hora does not provide are not here; tests/unit/test_guards.py lists the
exported names. TensorFlow's modules are inspected in a child process (this process never imports
TensorFlow, as tests/tensorflow's conftest explains); without TensorFlow their entries skip.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# ---------------------------------------------------------------- how the table is written


@dataclass(frozen=True)
class Ref:
    """A default that is an object of the module under test, by its dotted name there:
    ``Ref("Compression.none")``, ``Ref("global_process_set")``, ``Ref("Average")``."""

    path: str


KWARGS = "**"  # Horovod's signature ends in ``**kwargs``: hora's must take them too.

Param = str | tuple[str, Any]  # "name": no default; ("name", default)


@dataclass(frozen=True)
class Entry:
    """One Horovod callable: ``module`` is hora's module standing for Horovod's (``hora.torch``
    for ``horovod.torch``), ``name`` its dotted path there (``ProcessSet.size``)."""

    module: str
    name: str
    params: tuple[Param, ...]

    @property
    def id(self) -> str:
        return f"{self.module}.{self.name}"


def _entries(module: str, table: dict[str, tuple[Param, ...]]) -> list[Entry]:
    return [Entry(module, name, params) for name, params in table.items()]


PS = ("process_set", Ref("global_process_set"))
NONE_COMPRESSION = ("compression", Ref("Compression.none"))
SCALES = (("prescale_factor", 1.0), ("postscale_factor", 1.0))

# hora.common's runtime, as each framework module re-exports Horovod's basics.
_QUERIES = (
    "is_initialized",
    "size",
    "local_size",
    "cross_size",
    "rank",
    "local_rank",
    "cross_rank",
    "mpi_threads_supported",
    "mpi_enabled",
    "mpi_built",
    "gloo_enabled",
    "gloo_built",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "stop_timeline",
    "shutdown",
)
BASICS: dict[str, tuple[Param, ...]] = {
    "init": (("comm", None), ("process_sets", None)),
    "start_timeline": ("file_path", ("mark_cycles", False)),
    **{name: () for name in _QUERIES},
}
PROCESS_SETS: dict[str, tuple[Param, ...]] = {
    "ProcessSet": ("ranks_or_comm",),
    "ProcessSet.size": (),
    "ProcessSet.rank": (),
    "ProcessSet.included": (),
    "add_process_set": ("process_set",),
    "remove_process_set": ("process_set",),
}
COMPRESSORS: dict[str, tuple[Param, ...]] = {
    f"Compression.{kind}.{method}": params
    for kind in ("none", "fp16")
    for method, params in (("compress", ("tensor",)), ("decompress", ("tensor", "ctx")))
}
STATE_METHODS: dict[str, tuple[Param, ...]] = {
    "register_reset_callbacks": ("callbacks",),
    "on_reset": (),
    "commit": (),
    "check_host_updates": (),
    "save": (),
    "restore": (),
    "sync": (),
    "reset": (),
}

# ---------------------------------------------------------------- horovod.torch

_ALLREDUCE_ASYNC = ("tensor", ("average", None), ("name", None), ("op", None), *SCALES, PS)
_GROUPED_ASYNC = ("tensors", *_ALLREDUCE_ASYNC[1:])
_SCATTER_ASYNC = ("tensor", ("name", None), ("op", Ref("Average")), PS, *SCALES)
_BROADCAST = ("tensor", "root_rank", ("name", None), PS)

TORCH: dict[str, tuple[Param, ...]] = {
    **BASICS,
    "is_homogeneous": (),
    **PROCESS_SETS,
    **COMPRESSORS,
    "allreduce": ("tensor", ("average", None), ("name", None), NONE_COMPRESSION, ("op", None),
                  *SCALES, PS),
    "allreduce_async": _ALLREDUCE_ASYNC,
    "allreduce_async_": _ALLREDUCE_ASYNC,
    "allreduce_": _ALLREDUCE_ASYNC,
    "grouped_allreduce": ("tensors", ("average", None), ("name", None), NONE_COMPRESSION,
                          ("op", None), *SCALES, PS),
    "grouped_allreduce_async": _GROUPED_ASYNC,
    "grouped_allreduce_async_": _GROUPED_ASYNC,
    "grouped_allreduce_": _GROUPED_ASYNC,
    "sparse_allreduce_async": ("tensor", "name", "op", PS),
    "allgather": ("tensor", ("name", None), PS),
    "allgather_async": ("tensor", ("name", None), PS),
    "grouped_allgather": ("tensors", ("name", None), PS),
    "grouped_allgather_async": ("tensors", ("name", None), PS),
    "broadcast": _BROADCAST,
    "broadcast_async": _BROADCAST,
    "broadcast_": _BROADCAST,
    "broadcast_async_": _BROADCAST,
    "alltoall": ("tensor", ("splits", None), ("name", None), PS),
    "alltoall_async": ("tensor", ("splits", None), ("name", None), PS),
    "reducescatter": ("tensor", ("name", None), NONE_COMPRESSION, ("op", Ref("Average")), PS,
                      *SCALES),
    "reducescatter_async": _SCATTER_ASYNC,
    "grouped_reducescatter": ("tensors", ("name", None), NONE_COMPRESSION,
                              ("op", Ref("Average")), PS, *SCALES),
    "grouped_reducescatter_async": ("tensors", *_SCATTER_ASYNC[1:]),
    "join": (("device", -1),),
    "barrier": (PS,),
    "poll": ("handle",),
    "synchronize": ("handle",),
    "broadcast_parameters": ("params", "root_rank"),
    "broadcast_optimizer_state": ("optimizer", "root_rank", ("model", None)),
    "broadcast_object": ("obj", ("root_rank", 0), ("name", None), PS),
    "allgather_object": ("obj", ("name", None)),
    "DistributedOptimizer": ("optimizer", ("named_parameters", None), NONE_COMPRESSION,
                             ("backward_passes_per_step", 1), ("op", Ref("Average")),
                             ("gradient_predivide_factor", 1.0), ("num_groups", 0),
                             ("groups", None), ("sparse_as_dense", False), PS),
    "SyncBatchNorm": ("num_features", ("eps", 1e-05), ("momentum", 0.1), ("affine", True),
                      ("track_running_stats", True)),
    "SyncBatchNorm.forward": ("input",),
}  # fmt: skip

TORCH_ELASTIC: dict[str, tuple[Param, ...]] = {
    "run": ("func",),
    "TorchState": (("model", None), ("optimizer", None), KWARGS),
    **{f"TorchState.{name}": params for name, params in STATE_METHODS.items()},
    "ElasticSampler": ("dataset", ("shuffle", True), ("seed", 0)),
    "ElasticSampler.set_epoch": ("epoch",),
    "ElasticSampler.record_batch": ("batch_idx", "batch_size"),
    "ElasticSampler.load_state_dict": ("state_dict",),
    "ElasticSampler.state_dict": (),
    "ElasticSampler.reset": (),
}

# ---------------------------------------------------------------- horovod.tensorflow

_TF_GRADIENT_OPTIONS = (("device_dense", ""), ("device_sparse", ""), NONE_COMPRESSION,
                        ("sparse_as_dense", False), ("op", Ref("Average")),
                        ("gradient_predivide_factor", 1.0), ("num_groups", 0), ("groups", None),
                        PS)  # fmt: skip

TENSORFLOW: dict[str, tuple[Param, ...]] = {
    **BASICS,
    "is_homogeneous": (),
    **PROCESS_SETS,
    **COMPRESSORS,
    "allreduce": ("tensor", ("average", None), ("device_dense", ""), ("device_sparse", ""),
                  NONE_COMPRESSION, ("op", None), *SCALES, ("name", None), PS,
                  ("ignore_name_scope", False)),
    "grouped_allreduce": ("tensors", ("average", None), ("device_dense", ""),
                          ("device_sparse", ""), NONE_COMPRESSION, ("op", None), *SCALES, PS,
                          ("ignore_name_scope", False), ("name", None)),
    "allgather": ("tensor", ("name", None), ("ignore_name_scope", False), PS),
    "grouped_allgather": ("tensors", ("name", None), ("ignore_name_scope", False), PS),
    "broadcast": ("tensor", "root_rank", ("name", None), ("ignore_name_scope", False), PS),
    "broadcast_": ("variables", "root_rank", ("name", None), PS),
    "alltoall": ("tensor", ("splits", None), ("name", None), ("ignore_name_scope", False), PS),
    "reducescatter": ("tensor", ("device_dense", ""), NONE_COMPRESSION, ("op", Ref("Average")),
                      ("name", None), PS, ("ignore_name_scope", False), *SCALES),
    "grouped_reducescatter": ("tensors", ("device_dense", ""), NONE_COMPRESSION,
                              ("op", Ref("Average")), PS, *SCALES),
    "join": (),
    "size_op": (("process_set_id", 0), ("name", None)),
    "local_size_op": (("name", None),),
    "rank_op": (("name", None),),
    "local_rank_op": (("name", None),),
    "process_set_included_op": (("process_set_id", 0), ("name", None)),
    "broadcast_variables": ("variables", "root_rank", PS, ("inplace", False)),
    "broadcast_object": ("obj", ("root_rank", 0), ("session", None), ("name", None), PS),
    "broadcast_object_fn": (("root_rank", 0), ("session", None), ("name", None), PS),
    "allgather_object": ("obj", ("session", None), ("name", None), PS),
    "broadcast_global_variables": ("root_rank",),
    "BroadcastGlobalVariablesHook": ("root_rank", ("device", "")),
    "DistributedOptimizer": ("optimizer", ("name", None), ("use_locking", False),
                             ("device_dense", ""), ("device_sparse", ""), NONE_COMPRESSION,
                             ("sparse_as_dense", False), ("backward_passes_per_step", 1),
                             ("op", Ref("Average")), ("gradient_predivide_factor", 1.0),
                             ("average_aggregated_gradients", False), ("num_groups", 0),
                             ("groups", None), PS, ("scale_local_gradients", True)),
    "DistributedGradientTape": ("gradtape", *_TF_GRADIENT_OPTIONS,
                                ("scale_local_gradients", True)),
    "PartialDistributedGradientTape": ("gradtape", *_TF_GRADIENT_OPTIONS, ("local_layers", None),
                                       ("scale_local_gradients", True)),
    "SyncBatchNormalization": (("fused", False), KWARGS),
}  # fmt: skip

TENSORFLOW_ELASTIC: dict[str, tuple[Param, ...]] = {
    "run": ("func",),
    "ObjectState": ("bcast_object", "get_rank", KWARGS),
    "TensorFlowKerasState": ("model", ("optimizer", None), ("backend", None), KWARGS),
    "TensorFlowState": (("variables", None), ("session", None), KWARGS),
    **{f"TensorFlowKerasState.{name}": params for name, params in STATE_METHODS.items()},
}

# ---------------------------------------------------------------- Keras: horovod.tensorflow.keras and horovod.keras

_KERAS_HELPERS: dict[str, tuple[Param, ...]] = {
    "allgather": ("value", ("name", None)),
    "broadcast": ("value", "root_rank", ("name", None)),
    "reducescatter": ("value", ("name", None), ("op", Ref("Average"))),
    "broadcast_global_variables": ("root_rank",),
    "load_model": ("filepath", ("custom_optimizers", None), ("custom_objects", None),
                   NONE_COMPRESSION, ("legacy_opts", False)),
}  # fmt: skip
_KERAS_OPTIMIZER_HEAD = ("optimizer", ("name", None), ("device_dense", ""), ("device_sparse", ""),
                         NONE_COMPRESSION, ("sparse_as_dense", False),
                         ("gradient_predivide_factor", 1.0), ("op", Ref("Average")))  # fmt: skip

TF_KERAS: dict[str, tuple[Param, ...]] = {
    **BASICS,
    **PROCESS_SETS,
    **_KERAS_HELPERS,
    "allreduce": ("value", ("name", None), ("average", None), *SCALES, ("op", None),
                  NONE_COMPRESSION),
    "DistributedOptimizer": (*_KERAS_OPTIMIZER_HEAD, ("backward_passes_per_step", 1),
                             ("average_aggregated_gradients", False), ("num_groups", 0),
                             ("groups", None), PS, ("scale_local_gradients", True)),
}  # fmt: skip

KERAS: dict[str, tuple[Param, ...]] = {
    **BASICS,
    **_KERAS_HELPERS,
    "allreduce": ("value", ("name", None), ("average", True), *SCALES, ("op", None),
                  NONE_COMPRESSION),
    "DistributedOptimizer": (*_KERAS_OPTIMIZER_HEAD, ("num_groups", 0), ("groups", None)),
    "PartialDistributedOptimizer": (*_KERAS_OPTIMIZER_HEAD, ("backward_passes_per_step", 1),
                                    ("average_aggregated_gradients", False), ("groups", None),
                                    PS, ("local_layers", None), ("scale_local_gradients", True)),
}  # fmt: skip

_CALLBACKS: dict[str, tuple[Param, ...]] = {
    "BroadcastGlobalVariablesCallback": ("root_rank", ("device", ""), ("local_variables", None)),
    "MetricAverageCallback": (("device", ""),),
    "LearningRateScheduleCallback": ("initial_lr", "multiplier", ("start_epoch", 0),
                                     ("end_epoch", None), ("staircase", True),
                                     ("momentum_correction", True), ("steps_per_epoch", None)),
    "LearningRateWarmupCallback": ("initial_lr", ("warmup_epochs", 5),
                                   ("momentum_correction", True), ("steps_per_epoch", None),
                                   ("verbose", 0)),
}  # fmt: skip
TF_KERAS_CALLBACKS = {
    **_CALLBACKS,
    "BestModelCheckpoint": (("monitor", "val_loss"), ("verbose", 0), ("save_weights_only", False),
                            ("mode", "auto"), ("save_freq", "epoch")),
}  # fmt: skip
KERAS_CALLBACKS = {
    **_CALLBACKS,
    "BestModelCheckpoint": (("monitor", "val_loss"), ("verbose", 0), ("mode", "auto"),
                            ("save_freq", "epoch")),
}  # fmt: skip

TF_KERAS_ELASTIC: dict[str, tuple[Param, ...]] = {
    "run": ("func",),
    "KerasState": ("model", ("optimizer", None), KWARGS),
    "CommitStateCallback": ("state", ("batches_per_commit", 1)),
    "UpdateBatchStateCallback": ("state",),
    "UpdateEpochStateCallback": ("state",),
}

TORCH_ENTRIES = _entries("hora.torch", TORCH) + _entries("hora.torch.elastic", TORCH_ELASTIC)
TENSORFLOW_ENTRIES = (
    _entries("hora.tensorflow", TENSORFLOW)
    + _entries("hora.tensorflow.elastic", TENSORFLOW_ELASTIC)
    + _entries("hora.tensorflow.keras", TF_KERAS)
    + _entries("hora.tensorflow.keras.callbacks", TF_KERAS_CALLBACKS)
    + _entries("hora.tensorflow.keras.elastic", TF_KERAS_ELASTIC)
    + _entries("hora.keras", KERAS)
    + _entries("hora.keras.callbacks", KERAS_CALLBACKS)
    + _entries("hora.keras.elastic", TF_KERAS_ELASTIC)  # horovod.keras.elastic: the same
)

# Where hora keeps a different default on purpose: (module, name, parameter) -> hora's default.
# horovod.keras.allreduce's average=True makes every call that passes op= raise ("The op
# parameter supersedes average"); hora's None resolves to Average as well and lets op= work.
DELIBERATE: dict[tuple[str, str, str], Any] = {("hora.keras", "allreduce", "average"): None}

# ---------------------------------------------------------------- the check


def _resolve(module: Any, path: str) -> Any:
    value = module
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _same_default(expected: Any, actual: Any) -> bool:
    if isinstance(expected, (bool, int, float, str)):
        return type(actual) is type(expected) and actual == expected  # True is not 1
    return actual is expected  # None, or the very object (hvd.Average, Compression.none)


def signature_problems(module: Any, entry: Entry) -> list[str]:
    """What keeps a Horovod call of ``entry`` from meaning the same for hora's
    ``module.<entry.name>`` (nothing: an empty list)."""
    try:
        target = _resolve(module, entry.name)
    except AttributeError:
        return [f"hora has no {entry.id}"]
    params = list(inspect.signature(target).parameters.values())
    if params and params[0].name in ("self", "cls") and "." in entry.name:
        params = params[1:]  # a method looked up on its class
    shown = f"{entry.id}{inspect.signature(target)}"
    named = [p for p in entry.params if p != KWARGS]
    found: list[str] = []
    for position, param in enumerate(named):
        name, default = (param, inspect.Parameter.empty) if isinstance(param, str) else param
        if (entry.module, entry.name, name) in DELIBERATE:
            default = DELIBERATE[(entry.module, entry.name, name)]
        if position >= len(params):
            return found + [f"{shown}: Horovod's parameter {name!r} is missing"]
        have = params[position]
        if have.name != name:
            return found + [
                f"{shown}: parameter {position + 1} is {have.name!r}; Horovod's is {name!r}"
            ]
        if have.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            found.append(f"{shown}: {name!r} is {have.kind.description}; Horovod passes it "
                         "by position or keyword")  # fmt: skip
        if default is inspect.Parameter.empty:
            continue  # hora may give a default where Horovod requires the argument
        if have.default is inspect.Parameter.empty:
            found.append(f"{shown}: {name!r} has no default; Horovod's is {default!r}")
        else:
            expected = _resolve(module, default.path) if isinstance(default, Ref) else default
            if not _same_default(expected, have.default):
                found.append(
                    f"{shown}: {name!r} defaults to {have.default!r}; Horovod's is {default!r}"
                )
    for extra in params[len(named) :]:
        if extra.kind is inspect.Parameter.VAR_POSITIONAL:
            found.append(f"{shown}: *{extra.name} after Horovod's parameters takes stray "
                         "positional arguments")  # fmt: skip
        elif (
            extra.default is inspect.Parameter.empty
            and extra.kind is not inspect.Parameter.VAR_KEYWORD
        ):
            found.append(f"{shown}: hora's {extra.name!r} after Horovod's parameters needs a "
                         "default: a Horovod call does not pass it")  # fmt: skip
    if KWARGS in entry.params and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        found.append(f"{shown}: Horovod's takes **kwargs; hora's does not")
    return found


def report(modules: list[str]) -> dict[str, list[str]]:
    """Every TensorFlow entry of ``modules`` and its problems (run in a child process)."""
    loaded = {name: importlib.import_module(name) for name in modules}
    return {
        entry.id: signature_problems(loaded[entry.module], entry)
        for entry in TENSORFLOW_ENTRIES
        if entry.module in loaded
    }


# ---------------------------------------------------------------- the tests

ROOT = Path(__file__).resolve().parents[2]
HAS_TENSORFLOW = importlib.util.find_spec("tensorflow") is not None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("entry", TORCH_ENTRIES, ids=lambda e: e.id)
def test_torch_takes_horovods_calls(entry: Entry) -> None:
    problems = signature_problems(importlib.import_module(entry.module), entry)
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def tensorflow_report() -> dict[str, list[str]]:
    """The TensorFlow entries checked in a child process (TensorFlow's import stays there)."""
    if not HAS_TENSORFLOW:
        pytest.skip(
            "TensorFlow is not installed in this Python: hora.tensorflow's signatures are "
            "checked where it is (pip install -e '.[integrations]')."
        )
    modules = sorted({entry.module for entry in TENSORFLOW_ENTRIES})
    code = (
        "import json, sys\n"
        "from tests.unit.test_horovod_signatures import report\n"
        f"print('SIGNATURES ' + json.dumps(report({modules!r})))\n"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("SIGNATURES ")]
    assert done.returncode == 0 and lines, f"the child failed:\n{done.stderr[-4000:]}"
    result: dict[str, list[str]] = json.loads(lines[-1].removeprefix("SIGNATURES "))
    return result


@pytest.mark.timeout(300)
@pytest.mark.parametrize("entry", TENSORFLOW_ENTRIES, ids=lambda e: e.id)
def test_tensorflow_and_keras_take_horovods_calls(
    entry: Entry, tensorflow_report: dict[str, list[str]]
) -> None:
    assert entry.id in tensorflow_report, f"{entry.id} was not checked"
    problems = tensorflow_report[entry.id]
    assert not problems, "\n".join(problems)


def test_deliberate_differences_name_table_entries() -> None:
    entries = {(e.module, e.name): e for e in TENSORFLOW_ENTRIES}
    for module, name, param in DELIBERATE:
        assert param in {p[0] for p in entries[(module, name)].params if isinstance(p, tuple)}


# The check itself: each way a hora signature can drift from Horovod's is caught.

_HOROVOD = Entry(
    "fake", "f", ("tensor", ("name", None), ("process_set", Ref("global_process_set")))
)


class _Module:
    """A stand-in module: the function ``f`` under check, and the object a default refers to."""

    global_process_set = object()

    def __init__(self, f: Callable[..., Any]) -> None:
        self.f = f


_EVERYONE = _Module.global_process_set
_SOMEONE = object()


def _swapped(tensor: Any, process_set: Any = _EVERYONE, name: Any = None) -> None: ...
def _other_default(tensor: Any, name: Any = "x", process_set: Any = _EVERYONE) -> None: ...
def _other_object(tensor: Any, name: Any = None, process_set: Any = _SOMEONE) -> None: ...
def _missing(tensor: Any, name: Any = None) -> None: ...
def _keyword_only(tensor: Any, *, name: Any = None, process_set: Any = _EVERYONE) -> None: ...
def _positional_only(tensor: Any, /, name: Any = None, process_set: Any = _EVERYONE) -> None: ...
def _required(tensor: Any, name: Any, process_set: Any = _EVERYONE) -> None: ...
def _needs_extra(
    tensor: Any, name: Any = None, process_set: Any = _EVERYONE, *, extra: Any
) -> None: ...
def _stray(tensor: Any, name: Any = None, process_set: Any = _EVERYONE, *args: Any) -> None: ...
def _fits(tensor: Any, name: Any = None, process_set: Any = _EVERYONE, extra: int = 0, *,
          more: int = 0, **kwargs: Any) -> None: ...  # fmt: skip


DRIFTS: dict[str, tuple[Callable[..., Any], str]] = {
    "order": (_swapped, "parameter 2 is 'process_set'; Horovod's is 'name'"),
    "default": (_other_default, "'name' defaults to 'x'; Horovod's is None"),
    "another object": (_other_object, "'process_set' defaults to <object"),
    "missing": (_missing, "Horovod's parameter 'process_set' is missing"),
    "keyword-only": (_keyword_only, "'name' is keyword-only"),
    "positional-only": (_positional_only, "'tensor' is positional-only"),
    "no default": (_required, "'name' has no default; Horovod's is None"),
    "required extra": (_needs_extra, "'extra' after Horovod's parameters needs a default"),
    "stray positionals": (_stray, "*args after Horovod's parameters"),
}


@pytest.mark.parametrize("drift", DRIFTS, ids=str)
def test_the_check_catches_a_drift(drift: str) -> None:
    f, expected = DRIFTS[drift]
    problems = signature_problems(_Module(f), _HOROVOD)
    assert any(expected in p for p in problems), problems


def test_the_check_accepts_hora_extras_after_horovods_parameters() -> None:
    assert signature_problems(_Module(_fits), _HOROVOD) == []
    assert signature_problems(_Module(_fits), Entry("fake", "f", (*_HOROVOD.params, KWARGS))) == []
    assert signature_problems(_Module(_missing), Entry("fake", "f", ("tensor", KWARGS))) == [
        f"fake.f{inspect.signature(_missing)}: Horovod's takes **kwargs; hora's does not"
    ]
    assert signature_problems(_Module(_fits), Entry("fake", "g", ())) == ["hora has no fake.g"]
