"""hora.tensorflow in TensorFlow 1 graph mode: collectives built into a ``tf.compat.v1`` graph
and run by a session, on real processes.

A session runs a step's independent ops in any order and on a small pool of threads, so each
rank here asks for the same collectives in a different order, on a session with one thread:
they must still meet by name and give what their definitions say. Every rank's inputs are
known, so the tests compute the expected values from them (numpy is the reference).
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
STEPS = 3
LEARNING_RATE = 0.1


def _order(keys: list[str], rank: int) -> list[str]:
    """The keys in an order of this rank's own: rotated by the rank, reversed on odd ranks."""
    turned = keys[rank % len(keys) :] + keys[: rank % len(keys)]
    return turned[::-1] if rank % 2 else turned


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return np.asarray(value).tolist()


# ---------------------------------------------------------------- worker side


def _independent_collectives(hvd: Any, tf: Any) -> dict[str, Any]:
    """One graph of independent collectives, fetched in a rank's own order, step after step."""
    r, n = hvd.rank(), hvd.size()
    x = tf.constant([1.0, -2.0, 3.0]) * (r + 1)
    built = {
        "sum": hvd.allreduce(x, op=hvd.Sum),
        "average": hvd.allreduce(x),
        "max": hvd.allreduce(x, op=hvd.Max),
        "allgather": hvd.allgather(tf.fill([r + 1, 2], float(r))),
        "broadcast": hvd.broadcast(x, root_rank=n - 1),
        "alltoall": hvd.alltoall(tf.range(2 * n) + 100 * r, splits=[2] * n)[0],
        "reducescatter": hvd.reducescatter(tf.ones([2 * n, 2]) * (r + 1), op=hvd.Sum),
        "grouped_allreduce": hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum),
        "grouped_allgather": hvd.grouped_allgather([tf.fill([r + 1], r), tf.fill([1, 2], r)]),
        "grouped_reducescatter": hvd.grouped_reducescatter([tf.ones([n, 1]) * r], op=hvd.Sum),
    }
    order = _order(sorted(built), r)
    # One thread: a collective that held it while waiting for its peers would hang the job.
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1)
    steps = []
    with tf.compat.v1.Session(config=config) as session:
        for _ in range(STEPS):
            fetched = session.run([built[key] for key in order])
            steps.append({key: _plain(value) for key, value in zip(order, fetched)})
    return {"order": order, "steps": steps}


def _one_fetch_at_a_time(hvd: Any, tf: Any) -> dict[str, Any]:
    """Collectives fetched one ``session.run`` each, in build order on every rank."""
    r = hvd.rank()
    values = [tf.constant([float(r + k)]) for k in range(4)]
    sums = [hvd.allreduce(v, op=hvd.Sum) for v in values]
    with tf.compat.v1.Session() as session:
        return {"sums": [session.run(s).tolist() for s in sums]}


def _variables(hvd: Any, tf: Any) -> dict[str, Any]:
    """``broadcast_variables``, ``broadcast_`` and ``broadcast_global_variables`` assign when
    the session runs what they return."""
    from tensorflow.python.ops.ref_variable import RefVariable

    r, n = hvd.rank(), hvd.size()
    resource = tf.compat.v1.Variable([float(r)] * 3, use_resource=True)
    reference = RefVariable([r, r])
    other = tf.compat.v1.Variable([float(r)] * 2, use_resource=True)
    broadcast = hvd.broadcast_variables([resource, reference], root_rank=n - 1)
    in_place = hvd.broadcast_([other], root_rank=0)
    everything = hvd.broadcast_global_variables(n - 1)
    initialize = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session() as session:
        session.run(initialize)
        before = _plain(session.run([resource, reference, other]))
        returned = _plain(session.run(broadcast))
        after = _plain(session.run([resource, reference]))
        returned_in_place = _plain(session.run(in_place))
        after_in_place = _plain(session.run(other))
        session.run(initialize)
        global_returned = session.run(everything)
        global_after = _plain(session.run([resource, reference, other]))
    return {
        "global_is_op": isinstance(everything, tf.Operation),
        "global_returned": global_returned,
        "global_after": global_after,
        "before": before,
        "returned": returned,
        "after": after,
        "returned_in_place": returned_in_place,
        "after_in_place": after_in_place,
    }


def _averaging_descent(hvd: Any, tf: Any, learning_rate: float) -> Any:
    """Gradient descent whose gradients are averaged across the ranks, in one collective,
    before they are applied (the recipe of Horovod's ``DistributedOptimizer``)."""

    class AveragingDescent(tf.compat.v1.train.GradientDescentOptimizer):  # type: ignore[misc]
        def compute_gradients(self, *args: Any, **kwargs: Any) -> Any:
            pairs = super().compute_gradients(*args, **kwargs)
            averaged = hvd.grouped_allreduce([g for g, _ in pairs])
            return list(zip(averaged, [v for _, v in pairs]))

    return AveragingDescent(learning_rate)


def _minimize(hvd: Any, tf: Any) -> dict[str, Any]:
    """Training steps of a linear model with ``minimize()``, each rank on its own data."""
    r = hvd.rank()
    rng = np.random.default_rng(r)
    features = rng.normal(size=(8, 3)).astype("float32")
    targets = rng.normal(size=(8, 1)).astype("float32")
    start = np.array([[0.5], [-1.0], [2.0]], dtype="float32")
    weights = tf.compat.v1.get_variable("weights", initializer=tf.constant(start))
    bias = tf.compat.v1.get_variable("bias", initializer=tf.constant([0.25]))
    data = tf.compat.v1.placeholder(tf.float32, [None, 3])
    labels = tf.compat.v1.placeholder(tf.float32, [None, 1])
    loss = tf.reduce_mean(tf.square(tf.matmul(data, weights) + bias - labels))
    step = _averaging_descent(hvd, tf, LEARNING_RATE).minimize(loss)
    with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        for _ in range(STEPS):
            session.run(step, {data: features, labels: targets})
        final = _plain(session.run([weights, bias]))
    return {
        "features": features.tolist(),
        "targets": targets.tolist(),
        "start": [start.tolist(), [0.25]],
        "final": final,
    }


def _legacy_training(hvd: Any, tf: Any) -> dict[str, Any]:
    """Horovod's TensorFlow 1 recipe unchanged: ``hvd.DistributedOptimizer`` around a
    ``tf.compat.v1.train`` optimizer, ``BroadcastGlobalVariablesHook(0)`` in a
    ``MonitoredTrainingSession``, each rank starting from its own weights and data."""
    r = hvd.rank()
    rng = np.random.default_rng(10 + r)
    features = rng.normal(size=(8, 3)).astype("float32")
    targets = rng.normal(size=(8, 1)).astype("float32")
    own_start = np.array([[0.5], [-1.0], [2.0]], dtype="float32") + r
    weights = tf.compat.v1.get_variable("weights", initializer=tf.constant(own_start))
    loss = tf.reduce_mean(tf.square(tf.matmul(tf.constant(features), weights) - targets))
    optimizer = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE))
    step = optimizer.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    hooks = [hvd.BroadcastGlobalVariablesHook(0)]
    with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as session:
        for _ in range(STEPS):
            session.run(step)
        final = session.run(weights).tolist()
    return {
        "is_v1_optimizer": isinstance(optimizer, tf.compat.v1.train.Optimizer),
        "features": features.tolist(),
        "targets": targets.tolist(),
        "final": final,
    }


def _legacy_aggregation(hvd: Any, tf: Any) -> dict[str, Any]:
    """``backward_passes_per_step=3`` on a ``tf.compat.v1.train`` optimizer: each rank's
    gradient is its rank + 1; the variable moves on every third step only, by the average over
    ranks of the three steps' sums divided by 3, and ``global_step`` counts every step."""
    r = hvd.rank()

    class RankGradient(tf.compat.v1.train.Optimizer):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(use_locking=False, name="rank_gradient")
            self.variable = tf.compat.v1.get_variable("moved", initializer=[0.0])

        def compute_gradients(self, *args: Any, **kwargs: Any) -> Any:
            return [(tf.constant([float(r + 1)]), self.variable)]

        def _resource_apply_dense(self, grad: Any, var: Any) -> Any:
            return var.assign_add(grad)

    optimizer = hvd.DistributedOptimizer(
        RankGradient(), backward_passes_per_step=3, average_aggregated_gradients=True
    )
    global_step = tf.compat.v1.train.get_or_create_global_step()
    update = optimizer.apply_gradients(optimizer.compute_gradients(), global_step=global_step)
    seen = []
    with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        for _ in range(7):
            session.run(update)
            value, count = session.run([optimizer._optimizer.variable, global_step])
            seen.append([float(value[0]), int(count)])
    return {"seen": seen}


def _gradients(hvd: Any, tf: Any) -> dict[str, Any]:
    """``tf.gradients`` through collectives: their gradients are collectives of the graph too."""
    r, n = hvd.rank(), hvd.size()
    x = tf.constant([1.0, 2.0]) * (r + 1)
    weights = tf.constant([1.0, 3.0])
    built = {
        "sum": hvd.allreduce(x, op=hvd.Sum),
        "allgather": hvd.allgather(tf.reshape(x, [1, 2])),
        "broadcast": hvd.broadcast(x, root_rank=0),
        "reducescatter": hvd.reducescatter(tf.reshape(tf.tile(x, [n]), [n, 2]), op=hvd.Sum),
    }
    grads = {key: tf.gradients(tf.reduce_sum(y * weights), x)[0] for key, y in built.items()}
    order = _order(sorted(grads), r)
    with tf.compat.v1.Session() as session:
        fetched = session.run([grads[key] for key in order])
    return {key: _plain(value) for key, value in zip(order, fetched)}


def _control_flow(hvd: Any, tf: Any) -> dict[str, Any]:
    """Collectives in ``tf.cond`` branches, and a loop whose iterations run one at a time."""
    r = hvd.rank()
    x = tf.constant([1.0]) * (r + 1)
    taken = tf.cond(
        tf.constant(True),
        lambda: hvd.allreduce(x, op=hvd.Sum),
        lambda: hvd.allreduce(-x, op=hvd.Sum),
    )
    other = tf.cond(
        tf.constant(False),
        lambda: hvd.allreduce(10 * x, op=hvd.Sum),
        lambda: hvd.allreduce(100 * x, op=hvd.Sum),
    )
    tf.compat.v1.disable_control_flow_v2()
    try:
        _, loop_total = tf.while_loop(
            lambda i, total: i < 3,
            lambda i, total: [i + 1, total + hvd.allreduce(tf.cast(i, tf.float32) + r, op=hvd.Sum)],
            [0, 0.0],
            parallel_iterations=1,
        )
    finally:
        tf.compat.v1.enable_control_flow_v2()
    fetches = [taken, other, loop_total]
    with tf.compat.v1.Session() as session:
        fetched = session.run(fetches if r % 2 == 0 else fetches[::-1])
    if r % 2:
        fetched = fetched[::-1]
    return {"taken": _plain(fetched[0]), "other": _plain(fetched[1]), "loop": float(fetched[2])}


def _join_and_barrier(hvd: Any, tf: Any) -> dict[str, Any]:
    barrier = hvd.barrier()
    with tf.compat.v1.Session() as session:
        return {"barrier_is_op": isinstance(barrier, tf.Operation),
                "barrier": session.run(barrier),
                "join": int(session.run(hvd.join()))}  # fmt: skip


def _error(call: Any) -> dict[str, Any] | None:
    try:
        call()
    except Exception as exc:  # the test inspects what was raised
        return {"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
    return None


def _refusals_and_errors(hvd: Any, tf: Any) -> dict[str, Any]:
    """What cannot work fails when the graph is built; a collective that fails when it runs
    fails that step only."""
    r = hvd.rank()
    out: dict[str, Any] = {}

    def loop(**options: Any) -> Any:
        return tf.while_loop(
            lambda i: i < 3, lambda i: i + hvd.allreduce(tf.constant(1.0)), [0.0], **options
        )

    out["loop_v2"] = _error(loop)
    tf.compat.v1.disable_control_flow_v2()
    try:
        out["loop_v1"] = _error(lambda: loop(parallel_iterations=10))
    finally:
        tf.compat.v1.enable_control_flow_v2()
    with tf.name_scope("tower"):
        mismatched = hvd.allreduce(tf.ones([r + 1]))
    fine = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
    with tf.compat.v1.Session() as session:
        out["mismatch"] = _error(lambda: session.run(mismatched))
        out["after"] = session.run(fine).tolist()
    return out


def _graph_job() -> dict[str, Any]:
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    import hora.tensorflow as hvd

    hvd.init()
    try:
        out: dict[str, Any] = {"eager": tf.executing_eagerly()}
        parts = {
            "independent": _independent_collectives,
            "one_at_a_time": _one_fetch_at_a_time,
            "variables": _variables,
            "minimize": _minimize,
            "legacy_training": _legacy_training,
            "legacy_aggregation": _legacy_aggregation,
            "gradients": _gradients,
            "control_flow": _control_flow,
            "join_and_barrier": _join_and_barrier,
            "refusals": _refusals_and_errors,
        }
        for key, part in parts.items():
            with tf.Graph().as_default():
                out[key] = part(hvd, tf)
        return out
    finally:
        hvd.shutdown()


# ---------------------------------------------------------------- test side

_results: dict[int, list[dict[str, Any]]] = {}


@pytest.fixture(params=[2, 3], ids=["np2", "np3"])
def ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    if not HAS_TENSORFLOW:
        pytest.skip(NO_TENSORFLOW)
    np_: int = request.param
    if np_ not in _results:
        _results[np_] = hora.run(_graph_job, np=np_, env=ENV, timeout_s=JOB_TIMEOUT_S)
    return _results[np_]


def _inputs(n: int) -> list[np.ndarray]:
    return [np.array([1.0, -2.0, 3.0]) * (r + 1) for r in range(n)]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_independent_collectives_meet_whatever_order_each_rank_runs_them(
    ranks: list[dict[str, Any]],
) -> None:
    n = len(ranks)
    xs = np.stack(_inputs(n))
    total = xs.sum(axis=0)
    expected = {
        "sum": total.tolist(),
        "average": (total / n).tolist(),
        "max": xs.max(axis=0).tolist(),
        "allgather": [[float(k)] * 2 for k in range(n) for _ in range(k + 1)],
        "broadcast": xs[n - 1].tolist(),
        "grouped_allreduce": [total.tolist(), (2 * total).tolist()],
        "grouped_allgather": [
            [k for k in range(n) for _ in range(k + 1)],
            [[k, k] for k in range(n)],
        ],
    }
    orders = {tuple(seen["independent"]["order"]) for seen in ranks}
    assert len(orders) == n  # every rank asked in an order of its own
    for r, seen in enumerate(ranks):
        assert seen["eager"] is False
        steps = seen["independent"]["steps"]
        assert len(steps) == STEPS
        for step in steps:
            for key, value in expected.items():  # small integers and halves: exact
                assert step[key] == value, key
            assert step["alltoall"] == [100 * k + 2 * r + j for k in range(n) for j in (0, 1)]
            assert step["reducescatter"] == [[float(sum(range(1, n + 1)))] * 2] * 2
            assert step["grouped_reducescatter"] == [[[float(sum(range(n)))]]]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_collectives_fetched_one_run_at_a_time(ranks: list[dict[str, Any]]) -> None:
    n = len(ranks)
    for seen in ranks:
        assert seen["one_at_a_time"]["sums"] == [
            [float(sum(q + k for q in range(n)))] for k in range(4)
        ]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_broadcasts_assign_the_variables_when_run(ranks: list[dict[str, Any]]) -> None:
    n = len(ranks)
    for r, seen in enumerate(ranks):
        v = seen["variables"]
        assert v["before"] == [[float(r)] * 3, [r, r], [float(r)] * 2]  # building assigns nothing
        root = [[float(n - 1)] * 3, [n - 1, n - 1]]
        assert v["returned"] == root and v["after"] == root
        assert v["returned_in_place"] == [[0.0, 0.0]] and v["after_in_place"] == [0.0, 0.0]
        assert v["global_is_op"] and v["global_returned"] is None
        assert v["global_after"] == root + [[float(n - 1)] * 2]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_minimize_applies_the_gradients_averaged_over_the_ranks(
    ranks: list[dict[str, Any]],
) -> None:
    weights = np.array(ranks[0]["minimize"]["start"][0])
    bias = np.array(ranks[0]["minimize"]["start"][1])
    data = [
        (np.array(s["minimize"]["features"]), np.array(s["minimize"]["targets"])) for s in ranks
    ]
    for _ in range(STEPS):
        grads_w, grads_b = [], []
        for features, targets in data:
            error = features @ weights + bias - targets
            grads_w.append(2 * features.T @ error / len(features))
            grads_b.append(2 * error.mean(axis=0))
        weights = weights - LEARNING_RATE * np.mean(grads_w, axis=0)
        bias = bias - LEARNING_RATE * np.mean(grads_b, axis=0)
    for seen in ranks:
        final_w, final_b = seen["minimize"]["final"]
        np.testing.assert_allclose(final_w, weights, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(final_b, bias, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_tensorflow_1_optimizer_and_hook_train_as_one_model(ranks: list[dict[str, Any]]) -> None:
    # The hook gave every rank rank 0's start; each step applies the average of the ranks'
    # gradients.
    weights = np.array([[0.5], [-1.0], [2.0]])
    data = [
        (np.array(s["legacy_training"]["features"]), np.array(s["legacy_training"]["targets"]))
        for s in ranks
    ]
    for _ in range(STEPS):
        grads = [2 * f.T @ (f @ weights - t) / len(f) for f, t in data]
        weights = weights - LEARNING_RATE * np.mean(grads, axis=0)
    for seen in ranks:
        assert seen["legacy_training"]["is_v1_optimizer"]
        np.testing.assert_allclose(seen["legacy_training"]["final"], weights, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_tensorflow_1_optimizer_aggregates_backward_passes(ranks: list[dict[str, Any]]) -> None:
    n = len(ranks)
    mean = sum(range(1, n + 1)) / n  # the average over ranks of one step's gradient
    expected = [[mean * 3 / 3 * ((step + 1) // 3), step + 1] for step in range(7)]
    for seen in ranks:
        np.testing.assert_allclose(seen["legacy_aggregation"]["seen"], expected, rtol=1e-6)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_gradients_through_collectives(ranks: list[dict[str, Any]]) -> None:
    n = len(ranks)
    w = np.array([1.0, 3.0])
    for r, seen in enumerate(ranks):
        g = seen["gradients"]
        np.testing.assert_allclose(g["sum"], n * w)  # the upstream gradients are summed
        np.testing.assert_allclose(g["allgather"], w)  # averaged, then this rank's row
        np.testing.assert_allclose(g["broadcast"], w if r == 0 else 0 * w)
        np.testing.assert_allclose(g["reducescatter"], n * n * w)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_collectives_in_conditionals_and_a_sequential_loop(ranks: list[dict[str, Any]]) -> None:
    n = len(ranks)
    total = float(sum(range(1, n + 1)))
    for seen in ranks:
        c = seen["control_flow"]
        assert c["taken"] == [total] and c["other"] == [100 * total]
        assert c["loop"] == float(sum(i + q for i in range(3) for q in range(n)))
        j = seen["join_and_barrier"]
        assert j["barrier_is_op"] and j["barrier"] is None
        assert j["join"] in range(n)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_what_cannot_work_is_refused_when_built_and_errors_end_one_step(
    ranks: list[dict[str, Any]],
) -> None:
    n = len(ranks)
    for seen in ranks:
        f = seen["refusals"]
        for key in ("loop_v2", "loop_v1"):
            refused = f[key]
            assert refused is not None, key
            assert {"InvalidArgumentError", "ValueError"} <= set(refused["types"])
            assert "tf.while_loop" in refused["message"]
            assert "parallel_iterations=1" in refused["message"]
        assert "parallel_iterations=10" in f["loop_v1"]["message"]
        # The collective is named after its place in the graph, name scope included.
        assert "allreduce.tower/HoraAllreduce" in f["mismatch"]["message"]
        assert "Mismatched allreduce tensor shapes" in f["mismatch"]["message"]
        assert f["after"] == [float(n)]
