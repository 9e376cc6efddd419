"""Horovod's TensorFlow and Keras import paths on hora, on real processes:
``hora.tensorflow.mpi_ops`` (every name of Horovod's module), ``hora.tensorflow.util``,
``hora.tensorflow.gradient_aggregation`` and ``gradient_aggregation_eager`` (the local
aggregation helpers, summing over steps and averaging across ranks), and ``hora.keras.elastic``
(``model.fit`` with its callbacks).

One job per number of ranks runs every check and returns what each rank observed; the tests
compare it with values rebuilt here from each rank's inputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hora

from .conftest import HAS_TENSORFLOW, NO_TENSORFLOW

JOB_TIMEOUT_S = 170.0
TEST_TIMEOUT_S = 240
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0"}
STEPS = 4
PASSES = 2

# Every name horovod/tensorflow/mpi_ops.py defines for its users, but the handles on its compiled
# library (MPI_LIB, check_installed_version, get_ext_suffix) and the modules and helpers it
# imports for itself.
HOROVOD_TF_MPI_OPS = [
    "Adasum", "Average", "Max", "Min", "ProcessSet", "Product", "Sum", "add_process_set",
    "allgather", "alltoall", "broadcast", "broadcast_", "ccl_built", "check_num_rank_power_of_2",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built",
    "gloo_enabled", "grouped_allgather", "handle_average_backwards_compatibility", "init",
    "is_homogeneous", "is_initialized", "join", "local_rank", "local_rank_op", "local_size",
    "local_size_op", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
    "num_rank_is_power_2", "process_set_included_op", "rank", "rank_op", "remove_process_set",
    "rocm_built", "shutdown", "size", "size_op", "start_timeline", "stop_timeline",
]  # fmt: skip

# Names horovod.tensorflow itself imports from mpi_ops, util and gradient_aggregation.
HOROVOD_TF_EXTRA = [
    "handle_average_backwards_compatibility",
    "check_num_rank_power_of_2",
    "_executing_eagerly",
    "_make_subgraph",
    "_cache",
    "vars_to_refs",
    "refs_to_vars",
    "LocalGradientAggregationHelper",
]


def _grad(rank: int, step: int) -> list[float]:
    """Rank ``rank``'s gradient of the first variable at ``step``."""
    return [float((step + 1) * (rank + 1)), float(2 * (step + 1) * (rank + 1))]


# ---------------------------------------------------------------- worker side


def _paths(hvd: Any, tf: Any) -> dict[str, Any]:
    import sys

    import hora.keras
    import hora.tensorflow.keras.elastic as tf_keras_elastic
    import hora.tensorflow.mpi_ops as mpi_ops
    from hora.keras import elastic as keras_elastic
    from hora.tensorflow import gradient_aggregation, gradient_aggregation_eager, util

    out: dict[str, Any] = {}
    out["mpi_ops.missing"] = [n for n in HOROVOD_TF_MPI_OPS if not hasattr(mpi_ops, n)]
    out["mpi_ops.not_same"] = [n for n in hvd.__all__ if getattr(mpi_ops, n) is not getattr(hvd, n)]
    out["mpi_ops.attribute"] = hvd.mpi_ops is sys.modules["hora.tensorflow.mpi_ops"]
    out["package.missing"] = [n for n in HOROVOD_TF_EXTRA if not hasattr(hvd, n)]
    out["handle"] = [
        int(mpi_ops.handle_average_backwards_compatibility(None, False)),
        int(mpi_ops.handle_average_backwards_compatibility(hvd.Max, None)),
        int(hvd.handle_average_backwards_compatibility(None, None)),
    ]
    out["power_of_2"] = [n for n in range(9) if hvd.check_num_rank_power_of_2(n)]
    out["aggregation.same"] = [
        hvd.LocalGradientAggregationHelper is gradient_aggregation.LocalGradientAggregationHelper,
        gradient_aggregation_eager.LocalGradientAggregationHelperEager
        is gradient_aggregation.LocalGradientAggregationHelperEager,
        hvd.util is util,
    ]
    variables = [tf.Variable([1.0]), [tf.Variable([2.0]), tf.Variable([3.0])]]
    refs = util.vars_to_refs(variables)
    back = util.refs_to_vars(refs)
    out["refs"] = [
        isinstance(refs, tuple) and hash(refs) is not None,
        back[0] is variables[0] and back[1][1] is variables[1][1],
    ]
    calls: list[int] = []
    cached = util._cache(lambda n: calls.append(n) or n * 2)
    out["cache"] = [cached(3), cached(3), cached(4), calls, util._executing_eagerly()]
    out["eager_in_function"] = bool(tf.function(lambda: tf.constant(util._executing_eagerly()))())
    out["subgraph"] = float(util._make_subgraph(lambda x: x * 3)(tf.constant(2.0)))
    out["keras.elastic"] = [
        hora.keras.elastic is keras_elastic,
        keras_elastic.KerasState is tf_keras_elastic.KerasState,
        keras_elastic.CommitStateCallback is tf_keras_elastic.CommitStateCallback,
        keras_elastic.UpdateBatchStateCallback is tf_keras_elastic.UpdateBatchStateCallback,
        keras_elastic.UpdateEpochStateCallback is tf_keras_elastic.UpdateEpochStateCallback,
        keras_elastic.run is tf_keras_elastic.run,
    ]
    return out


def _aggregation(hvd: Any, tf: Any, graph: bool, average: bool) -> dict[str, Any]:
    """Train two variables for STEPS steps with a helper of PASSES passes; the second variable
    is local to each rank (registered), the first is averaged."""
    from hora.tensorflow.gradient_aggregation import LocalGradientAggregationHelper
    from hora.tensorflow.gradient_aggregation_eager import LocalGradientAggregationHelperEager

    rank = hvd.rank()
    shared, local = tf.Variable([0.0, 0.0]), tf.Variable([0.0])
    if graph:
        helper = LocalGradientAggregationHelper(
            PASSES, None, False, average, rank, LocalGradientAggregationHelper._OPTIMIZER_TYPE_KERAS
        )
    else:
        helper = LocalGradientAggregationHelperEager(PASSES, None, False, average)
    helper.register_local_var(local)
    optimizer = tf.keras.optimizers.SGD(1.0)
    variables = [shared, local, tf.Variable([5.0])]  # the third has no gradient
    # Built before the step: an optimizer cannot make its variables inside the tf.cond.
    optimizer.build(variables[:2])

    def step(first: Any, second: Any) -> Any:
        grads = helper.compute_gradients([first, second, None], variables)
        applied = helper.apply_gradients(
            lambda: optimizer.apply_gradients(zip(grads[:2], variables[:2])), optimizer
        )
        return grads[0], grads[1], grads[2] is None, applied, helper.counter.read_value()

    run = tf.function(step) if graph else step
    seen = []
    for s in range(STEPS):
        first, second, none, applied, counter = run(
            tf.constant(_grad(rank, s)), tf.constant([float(s + 1)])
        )
        seen.append(
            {
                "first": first.numpy().tolist(),
                "second": second.numpy().tolist(),
                "none": bool(none),
                "applied": bool(applied),
                "counter": int(counter),
                "shared": shared.numpy().tolist(),
                "local": local.numpy().tolist(),
                "iterations": int(optimizer.iterations.numpy()),
            }
        )
    return {"steps": seen}


def _keras_elastic_fit(hvd: Any, tf: Any) -> dict[str, Any]:
    from hora.keras.elastic import (
        CommitStateCallback,
        KerasState,
        UpdateBatchStateCallback,
        UpdateEpochStateCallback,
        run,
    )

    tf.keras.utils.set_random_seed(3 + hvd.rank())  # different weights on every rank
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)), loss="mse")
    state = KerasState(model, batch=0, epoch=0)
    commits: list[int] = []
    original = state.commit
    state.commit = lambda: (commits.append(state.batch), original())[1]
    x = np.arange(24, dtype="float32").reshape(8, 3) / 24 + hvd.rank()

    @run
    def train(state: Any) -> None:
        model.fit(x, x[:, :1], batch_size=2, epochs=2 - state.epoch, verbose=0, callbacks=[
                      CommitStateCallback(state, batches_per_commit=2),
                      UpdateBatchStateCallback(state),
                      UpdateEpochStateCallback(state)])  # fmt: skip

    train(state)
    return {
        "epoch": state.epoch,
        "commits": commits,
        "weights": [w.tolist() for w in model.get_weights()],
    }


def _worker() -> dict[str, Any]:
    import tensorflow as tf

    import hora.tensorflow as hvd
    import hora.tensorflow.keras as khvd

    hvd.init()
    try:
        return {
            "size": hvd.size(),
            "paths": _paths(hvd, tf),
            "eager": _aggregation(hvd, tf, graph=False, average=False),
            "graph": _aggregation(hvd, tf, graph=True, average=True),
            "keras_elastic": _keras_elastic_fit(khvd, tf),
        }
    finally:
        hvd.shutdown()


# ---------------------------------------------------------------- test side


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    if not HAS_TENSORFLOW:
        pytest.skip(NO_TENSORFLOW)
    return hora.run(_worker, np=request.param, env=ENV, timeout_s=JOB_TIMEOUT_S)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_mpi_ops_and_the_package_hold_horovods_names(ranks: list[dict[str, Any]]) -> None:
    for observed in ranks:
        paths = observed["paths"]
        assert paths["mpi_ops.missing"] == []
        assert paths["mpi_ops.not_same"] == []
        assert paths["mpi_ops.attribute"] is True
        assert paths["package.missing"] == []
        assert paths["handle"] == [1, 4, 0]  # Sum, Max, Average
        assert paths["power_of_2"] == [1, 2, 4, 8]
        assert paths["aggregation.same"] == [True, True, True]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_util_helpers(ranks: list[dict[str, Any]]) -> None:
    for observed in ranks:
        paths = observed["paths"]
        assert paths["refs"] == [True, True]
        assert paths["cache"] == [6, 6, 8, [3, 4], True]
        assert paths["eager_in_function"] is False
        assert paths["subgraph"] == 6.0


def _mean_sum(size: int, steps: range) -> list[float]:
    """The first variable's gradients summed over ``steps`` on each rank, averaged over ranks."""
    totals = [sum(np.array(_grad(r, s)) for s in steps) for r in range(size)]
    return list(np.mean(totals, axis=0))


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_eager_helper_returns_sums_and_reduces_every_second_step(
    ranks: list[dict[str, Any]],
) -> None:
    size = len(ranks)
    for rank, observed in enumerate(ranks):
        steps = observed["eager"]["steps"]
        # Step 0: this rank's sum so far (its own gradient); nothing applied.
        assert steps[0]["first"] == _grad(rank, 0)
        assert (steps[0]["applied"], steps[0]["counter"]) == (False, 1)
        # Step 1: the sums of steps 0 and 1, averaged across ranks; the local variable's sum is
        # divided by the number of ranks instead; the update is applied.
        np.testing.assert_allclose(steps[1]["first"], _mean_sum(size, range(2)))
        np.testing.assert_allclose(steps[1]["second"], [(1 + 2) / size])
        assert (steps[1]["applied"], steps[1]["counter"]) == (True, 0)
        np.testing.assert_allclose(steps[1]["shared"], [-v for v in _mean_sum(size, range(2))])
        # Step 2: the sums start again.
        assert steps[2]["first"] == _grad(rank, 2)
        np.testing.assert_allclose(steps[3]["first"], _mean_sum(size, range(2, 4)))
        assert [s["none"] for s in steps] == [True] * STEPS
        assert [s["iterations"] for s in steps] == [1, 2, 3, 4]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_graph_helper_in_a_function_returns_inputs_and_averages_over_passes(
    ranks: list[dict[str, Any]],
) -> None:
    size = len(ranks)
    for rank, observed in enumerate(ranks):
        steps = observed["graph"]["steps"]
        assert steps[0]["first"] == _grad(rank, 0)  # the gradient it was given
        assert steps[2]["first"] == _grad(rank, 2)
        mean = [v / PASSES for v in _mean_sum(size, range(2))]
        np.testing.assert_allclose(steps[1]["first"], mean)
        np.testing.assert_allclose(steps[1]["second"], [(1 + 2) / size / PASSES])
        np.testing.assert_allclose(
            steps[3]["first"], [v / PASSES for v in _mean_sum(size, range(2, 4))]
        )
        assert [s["applied"] for s in steps] == [False, True, False, True]
        assert [s["counter"] for s in steps] == [1, 0, 1, 0]
        assert [s["iterations"] for s in steps] == [1, 2, 3, 4]
        # The weights move only when applied, by the averaged gradient: the same everywhere.
        assert steps[0]["shared"] == [0.0, 0.0]
        np.testing.assert_allclose(steps[1]["shared"], [-v for v in mean])
    assert len({str(observed["graph"]["steps"][3]["shared"]) for observed in ranks}) == 1


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_keras_elastic_module_trains_and_commits(ranks: list[dict[str, Any]]) -> None:
    for observed in ranks:
        fit = observed["keras_elastic"]
        assert fit["epoch"] == 2
        # 4 batches an epoch: a commit after batch 2, and one after batch 4, which is also the
        # epoch's end (state.batch back to 0).
        assert fit["commits"] == [2, 0, 2, 0]
    # The state's sync started every rank from rank 0's weights; averaged updates kept them equal.
    first = ranks[0]["keras_elastic"]["weights"]
    for observed in ranks[1:]:
        for mine, theirs in zip(observed["keras_elastic"]["weights"], first):
            np.testing.assert_allclose(mine, theirs, rtol=1e-6)
