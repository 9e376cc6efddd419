"""Horovod's import paths on hora (PyTorch and the framework-neutral ones): each path imports,
each name is there, and each is the object hora uses, not a copy; the ``horovod.torch.mpi_ops``
autograd ``Function`` classes compute, through ``apply``, what hora's collectives compute, in a
job of one rank. TensorFlow's paths are checked in tests/tensorflow/test_horovod_imports.py
(this process does not import TensorFlow); the collectives' results and gradients across ranks
in tests/multiproc/test_horovod_imports.py.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import hora.torch as hvd
from hora.common.elastic import loop, state
from hora.common.vocabulary import errors

pytestmark = pytest.mark.timeout(60)

# Every name horovod/torch/mpi_ops.py defines or imports for its users, but the handles on its
# compiled library and the helpers it imports for itself (check_installed_version,
# get_average_backwards_compatibility_fun, gpu_available, torch, warnings).
HOROVOD_TORCH_MPI_OPS = [
    "Adasum", "Average", "Compression", "HorovodAllgather", "HorovodAllreduce", "HorovodAlltoall",
    "HorovodBroadcast", "HorovodGroupedAllgather", "HorovodGroupedAllreduce",
    "HorovodGroupedReducescatter", "HorovodInternalError", "HorovodReducescatter", "Max", "Min",
    "ProcessSet", "Product", "Sum", "add_process_set", "allgather", "allgather_async",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
    "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "global_process_set",
    "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
    "handle_average_backwards_compatibility", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "num_rank_is_power_2", "poll", "rank", "reducescatter", "reducescatter_async",
    "remove_process_set", "rocm_built", "shutdown", "size", "sparse_allreduce_async",
    "start_timeline", "stop_timeline", "synchronize",
]  # fmt: skip

FUNCTIONS = [
    "HorovodAllreduce",
    "HorovodGroupedAllreduce",
    "HorovodAllgather",
    "HorovodGroupedAllgather",
    "HorovodBroadcast",
    "HorovodAlltoall",
    "HorovodReducescatter",
    "HorovodGroupedReducescatter",
]


# ---------------------------------------------------------------- hora.common


def test_common_exceptions_are_the_classes_hora_raises() -> None:
    from hora.common import exceptions

    assert exceptions.HorovodInternalError is errors.HoraInternalError
    assert exceptions.HostsUpdatedInterrupt is errors.HostsUpdatedInterrupt
    assert exceptions.HorovodInternalError is hvd.HorovodInternalError
    assert issubclass(exceptions.HorovodInternalError, RuntimeError)
    assert exceptions.HostsUpdatedInterrupt(True).skip_sync is True


def test_version_mismatch_error_names_both_versions() -> None:
    from hora.common.exceptions import HorovodVersionMismatchError, get_version_mismatch_message

    error = HorovodVersionMismatchError("torch", "2.13.0", "2.12.1")
    assert isinstance(error, ImportError)
    assert (error.name, error.version, error.installed_version) == ("torch", "2.13.0", "2.12.1")
    assert str(error) == get_version_mismatch_message("torch", "2.13.0", "2.12.1")
    assert "torch 2.13.0 is running" in str(error)
    assert "built against torch 2.12.1" in str(error)


def test_common_elastic_gives_the_state_classes_and_run_fn() -> None:
    import hora.common.elastic as common_elastic

    assert common_elastic.State is state.State
    assert common_elastic.ObjectState is state.ObjectState
    assert common_elastic.run_fn is loop.run_fn
    assert common_elastic.run is loop.run
    assert hvd.elastic.State is common_elastic.State
    assert hvd.elastic.ObjectState is common_elastic.ObjectState


class _RecordingState:
    """A state that records what the loop asks of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def sync(self) -> None:
        self.calls.append("sync")


def test_run_fn_outside_an_elastic_job_syncs_once_and_never_resets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("HORA_ELASTIC", raising=False)
    resets: list[str] = []

    def train(state: _RecordingState, lr: float, *, epochs: int) -> tuple[float, int]:
        state.calls.append("train")
        return lr, epochs

    from hora.common.elastic import run_fn

    wrapped = run_fn(train, lambda: resets.append("reset"))
    recording = _RecordingState()
    assert wrapped(recording, 0.5, epochs=3) == (0.5, 3)
    assert recording.calls == ["sync", "train"]
    assert resets == []
    assert wrapped.__name__ == "train"


def test_run_fn_errors_propagate_outside_an_elastic_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HORA_ELASTIC", raising=False)
    from hora.common.elastic import run_fn

    def train(state: _RecordingState) -> None:
        raise hvd.HorovodInternalError("a peer was lost")

    with pytest.raises(hvd.HorovodInternalError, match="a peer was lost"):
        run_fn(train, lambda: None)(_RecordingState())


class _ElasticRecordingState(_RecordingState):
    def save(self) -> None:
        self.calls.append("save")

    def restore(self) -> None:
        self.calls.append("restore")

    def on_reset(self) -> None:
        self.calls.append("on_reset")


def test_run_fn_in_an_elastic_round_rejoins_with_the_callers_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hora.common.elastic import run_fn
    from hora.common.elastic.job import DriverJob
    from hora.common.runtime import runtime

    class Simulated(DriverJob):
        """An elastic job without a driver, whose own way to the next round is not taken."""

        def active(self) -> bool:
            return True

        def rejoin(self) -> None:
            raise AssertionError("run_fn rejoins with the caller's reset")

    # A simulated elastic worker, first in its job: no driver, no collectives before.
    monkeypatch.setattr(runtime(), "elastic_job", Simulated())
    monkeypatch.setattr(runtime(), "elastic_entered", True)
    monkeypatch.setattr(runtime(), "elastic_resets", 0)
    recording = _ElasticRecordingState()

    def train(state: _ElasticRecordingState) -> str:
        state.calls.append("train")
        if state.calls.count("train") == 1:
            raise hvd.HostsUpdatedInterrupt(False)
        return "done"

    def reset() -> None:
        recording.calls.append("reset")

    assert run_fn(train, reset)(recording) == "done"
    assert recording.calls == [
        "sync", "train", "save", "reset", "on_reset", "sync", "train",
    ]  # fmt: skip
    assert runtime().elastic_resets == 1


def test_common_process_sets_holds_horovods_names() -> None:
    from hora.common import process_sets
    from hora.common.process_sets import (
        ProcessSet,
        add_process_set,
        global_process_set,
        remove_process_set,
    )

    assert ProcessSet is hvd.ProcessSet
    assert global_process_set is hvd.global_process_set
    assert add_process_set is hvd.add_process_set
    assert remove_process_set is hvd.remove_process_set
    with pytest.raises(AttributeError, match="no attribute 'add_process_sets'"):
        process_sets.add_process_sets  # noqa: B018 - the lookup is the test


def test_common_process_sets_imports_first_and_asks_for_init() -> None:
    """A script may import Horovod's process-set functions before any framework module: the
    import works, and a call before ``hvd.init()`` says what to do."""
    code = (
        "from hora.common.process_sets import add_process_set, remove_process_set\n"
        "import sys\n"
        "assert 'hora.common.startup.registration' not in sys.modules\n"
        "for call in (lambda: add_process_set([0]), lambda: remove_process_set(None)):\n"
        "    try:\n"
        "        call()\n"
        "    except ValueError as exc:\n"
        "        print(exc)\n"
    )
    assert _in_a_fresh_interpreter(code).splitlines() == [errors.NOT_INITIALIZED] * 2


def _in_a_fresh_interpreter(code: str) -> str:
    """What ``code`` prints, run by a new Python (which has imported nothing of hora)."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


# ---------------------------------------------------------------- hora.torch.mpi_ops


def test_torch_mpi_ops_has_every_horovod_name() -> None:
    import hora.torch.mpi_ops as mpi_ops

    missing = [name for name in HOROVOD_TORCH_MPI_OPS if not hasattr(mpi_ops, name)]
    assert missing == []
    assert sorted(set(HOROVOD_TORCH_MPI_OPS) - set(mpi_ops.__all__)) == []


def test_torch_mpi_ops_names_are_hora_torchs_objects() -> None:
    import hora.torch.mpi_ops as mpi_ops

    for name in hvd.__all__:
        assert getattr(mpi_ops, name) is getattr(hvd, name), name
    for name in FUNCTIONS:
        assert issubclass(getattr(mpi_ops, name), torch.autograd.Function), name


def test_mpi_ops_is_an_attribute_of_hora_torch_without_importing_it() -> None:
    code = (
        "import sys, hora.torch as hvd;"
        "assert 'hora.torch.mpi_ops' not in sys.modules;"
        "print(hvd.mpi_ops.__name__, hvd.mpi_ops.HorovodAllreduce.__name__,"
        " hvd.mpi_ops is sys.modules['hora.torch.mpi_ops'])"
    )
    assert _in_a_fresh_interpreter(code).split() == [
        "hora.torch.mpi_ops",
        "HorovodAllreduce",
        "True",
    ]


def test_hora_torch_still_refuses_unknown_names() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'mpi_opz'"):
        hvd.mpi_opz  # noqa: B018 - the lookup is the test


def test_handle_average_backwards_compatibility() -> None:
    from hora.torch.mpi_ops import handle_average_backwards_compatibility as handle

    assert handle(hvd.Max, None) is hvd.Max
    assert handle(None, None) == hvd.Average
    with pytest.warns(DeprecationWarning, match="`average` has been replaced with `op`"):
        assert handle(None, True) == hvd.Average
    with pytest.warns(DeprecationWarning):
        assert handle(None, False) == hvd.Sum
    with pytest.raises(ValueError, match="op parameter supersedes average"):
        handle(hvd.Sum, True)


def test_num_rank_is_power_2() -> None:
    from hora.torch.mpi_ops import num_rank_is_power_2

    assert [n for n in range(17) if num_rank_is_power_2(n)] == [1, 2, 4, 8, 16]


# ---------------------------------------------------------------- Function.apply, one rank


@pytest.fixture
def one_rank() -> Iterator[Any]:
    import hora.torch.mpi_ops as mpi_ops

    hvd.init()
    try:
        yield mpi_ops
    finally:
        hvd.shutdown()


def _leaf(*shape: int, start: float = 1.0) -> torch.Tensor:
    count = 1
    for n in shape:
        count *= n
    return (torch.arange(count, dtype=torch.float64) + start).reshape(shape).requires_grad_()


def test_allreduce_function_scales_forward_and_backward(one_rank: Any) -> None:
    ps = hvd.global_process_set
    x = _leaf(3)
    y = one_rank.HorovodAllreduce.apply(x, None, "f.allreduce", hvd.Sum, 2.0, 0.5, ps)
    assert y.grad_fn is not None and type(y.grad_fn).__name__ == "HorovodAllreduceBackward"
    torch.testing.assert_close(y, x.detach() * 2.0 * 0.5)
    weights = torch.tensor([1.0, 10.0, 100.0], dtype=torch.float64)
    (y * weights).sum().backward()
    torch.testing.assert_close(x.grad, weights * 2.0 * 0.5)


def test_allreduce_function_takes_the_deprecated_average(one_rank: Any) -> None:
    x = _leaf(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        y = one_rank.HorovodAllreduce.apply(x, True, None, None, 1.0, 3.0, hvd.global_process_set)
        y.sum().backward()
    torch.testing.assert_close(y, x.detach() * 3.0)
    torch.testing.assert_close(x.grad, torch.full((2,), 3.0, dtype=torch.float64))


def test_grouped_allreduce_function_returns_one_result_per_input(one_rank: Any) -> None:
    a, b = _leaf(2), _leaf(2, 3)
    outs = one_rank.HorovodGroupedAllreduce.apply(
        None, "f.grouped", hvd.Sum, 1.0, 4.0, hvd.global_process_set, a, b
    )
    assert isinstance(outs, tuple) and len(outs) == 2
    torch.testing.assert_close(outs[0], a.detach() * 4.0)
    torch.testing.assert_close(outs[1], b.detach() * 4.0)
    (outs[0].sum() + 2 * outs[1].sum()).backward()
    torch.testing.assert_close(a.grad, torch.full((2,), 4.0, dtype=torch.float64))
    torch.testing.assert_close(b.grad, torch.full((2, 3), 8.0, dtype=torch.float64))


def test_allgather_and_broadcast_functions(one_rank: Any) -> None:
    ps = hvd.global_process_set
    x = _leaf(2, 2)
    gathered = one_rank.HorovodAllgather.apply(x, "f.allgather", ps)
    torch.testing.assert_close(gathered, x.detach())
    (gathered * 3).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2, 2), 3.0, dtype=torch.float64))

    a, b = _leaf(1), _leaf(3, 2)
    outs = one_rank.HorovodGroupedAllgather.apply("f.grouped_allgather", ps, a, b)
    torch.testing.assert_close(outs[1], b.detach())
    (outs[0].sum() * 5 + outs[1].sum()).backward()
    torch.testing.assert_close(a.grad, torch.full((1,), 5.0, dtype=torch.float64))

    z = _leaf(4)
    sent = one_rank.HorovodBroadcast.apply(z, 0, "f.broadcast", ps)
    torch.testing.assert_close(sent, z.detach())
    (sent * 7).sum().backward()
    torch.testing.assert_close(z.grad, torch.full((4,), 7.0, dtype=torch.float64))


def test_alltoall_function_with_and_without_splits(one_rank: Any) -> None:
    ps = hvd.global_process_set
    x = _leaf(4)
    received = one_rank.HorovodAlltoall.apply(x, None, "f.alltoall", ps)
    assert isinstance(received, torch.Tensor)
    torch.testing.assert_close(received, x.detach())
    (received * 2).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4,), 2.0, dtype=torch.float64))

    y = _leaf(3)
    output, splits = one_rank.HorovodAlltoall.apply(y, torch.tensor([3]), "f.alltoall.split", ps)
    assert splits.tolist() == [3] and not splits.requires_grad
    output.sum().backward()
    torch.testing.assert_close(y.grad, torch.ones(3, dtype=torch.float64))


def test_reducescatter_functions_scale_the_gradient(one_rank: Any) -> None:
    ps = hvd.global_process_set
    x = _leaf(4)
    out = one_rank.HorovodReducescatter.apply(x, "f.reducescatter", hvd.Sum, ps, 2.0, 3.0)
    torch.testing.assert_close(out, x.detach() * 6.0)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4,), 6.0, dtype=torch.float64))

    a, b = _leaf(2), _leaf(2, 2)
    outs = one_rank.HorovodGroupedReducescatter.apply(
        "f.grouped_reducescatter", hvd.Average, ps, 0.5, 1.0, a, b
    )
    torch.testing.assert_close(outs[0], a.detach() * 0.5)
    (outs[0].sum() + outs[1].sum()).backward()
    torch.testing.assert_close(b.grad, torch.full((2, 2), 0.5, dtype=torch.float64))


def test_functions_match_the_public_collectives(one_rank: Any) -> None:
    ps = hvd.global_process_set
    x = torch.linspace(-1.0, 1.0, 6).reshape(3, 2)
    pairs = [
        (
            one_rank.HorovodAllreduce.apply(x, None, "m.a", hvd.Average, 1.0, 1.0, ps),
            hvd.allreduce(x, name="m.b"),
        ),
        (one_rank.HorovodAllgather.apply(x, "m.c", ps), hvd.allgather(x, name="m.d")),
        (one_rank.HorovodBroadcast.apply(x, 0, "m.e", ps), hvd.broadcast(x, 0, name="m.f")),
        (
            one_rank.HorovodReducescatter.apply(x, "m.g", hvd.Average, ps, 1.0, 1.0),
            hvd.reducescatter(x, name="m.h"),
        ),
    ]
    for ours, public in pairs:
        torch.testing.assert_close(ours, public)
