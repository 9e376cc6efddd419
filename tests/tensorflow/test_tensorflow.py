"""hora.tensorflow on real processes: collectives eagerly and in ``tf.function``, their gradients,
``DistributedGradientTape``, ``SyncBatchNormalization``, elastic state, and the refusals.

One job per number of ranks runs every check (TensorFlow's import dominates a job's cost) and
returns plain observations; the tests assert on them here, against values computed from the
ranks' inputs.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import hora

from .conftest import HAS_TENSORFLOW, HAS_TF_KERAS, NO_TENSORFLOW

JOB_TIMEOUT_S = 170.0
TEST_TIMEOUT_S = 240
ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0"}


def _error(call: Any) -> dict[str, Any] | None:
    try:
        call()
    except Exception as exc:  # the test inspects what was raised
        return {"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
    return None


# ---------------------------------------------------------------- worker side


def _collectives(hvd: Any, tf: Any) -> dict[str, Any]:
    r, n = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    x = tf.constant([1.0, -2.0, 3.0]) * (r + 1)
    for op in ("Sum", "Average", "Min", "Max", "Product"):
        out[f"allreduce.{op}"] = hvd.allreduce(x, op=getattr(hvd, op)).numpy().tolist()
    for dtype in ("int32", "int64", "float16", "bfloat16", "float64", "uint16", "uint8"):
        t = tf.cast(tf.constant([1, 2, 3]) * (r + 1), dtype)
        out[f"sum.{dtype}"] = [hvd.allreduce(t, op=hvd.Sum).dtype.name] + tf.cast(
            hvd.allreduce(t, op=hvd.Sum), tf.float64
        ).numpy().tolist()
    out["scaled"] = (
        hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5).numpy().tolist()
    )
    out["fp16"] = hvd.allreduce(x, compression=hvd.Compression.fp16).numpy().tolist()
    out["grouped"] = [t.numpy().tolist() for t in hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum)]
    slices = tf.IndexedSlices(tf.fill([1, 2], float(r + 1)), tf.constant([r]), tf.constant([n, 2]))
    for op in ("Sum", "Average"):
        reduced = hvd.allreduce(slices, op=getattr(hvd, op))
        out[f"sparse.{op}"] = tf.convert_to_tensor(reduced).numpy().tolist()
    out["allgather"] = hvd.allgather(tf.fill([r + 1, 2], r)).numpy().tolist()
    out["allgather.uint16"] = hvd.allgather(tf.constant([60000 + r], tf.uint16)).numpy().tolist()
    gathered = hvd.grouped_allgather([tf.fill([r + 1], r), tf.fill([1, 2], 10 + r)])
    out["grouped_allgather"] = [t.numpy().tolist() for t in gathered]
    out["broadcast"] = hvd.broadcast(tf.constant([r * 10]), root_rank=n - 1).numpy().tolist()
    v = tf.Variable([float(r), float(r)])
    hvd.broadcast_([v], root_rank=1, name="vars")
    out["broadcast_"] = v.numpy().tolist()
    rows = tf.range(2 * n) + 100 * r
    received, splits = hvd.alltoall(rows, splits=[2] * n)
    out["alltoall"] = [received.numpy().tolist(), splits.numpy().tolist()]
    out["alltoall.even"] = hvd.alltoall(rows).numpy().tolist()
    out["reducescatter"] = (
        hvd.reducescatter(tf.ones([2 * n + 1, 2]) * (r + 1), op=hvd.Sum).numpy().tolist()
    )
    out["grouped_reducescatter"] = [
        t.numpy().tolist()
        for t in hvd.grouped_reducescatter([tf.ones([n, 1]), tf.ones([n, 2]) * r], op=hvd.Sum)
    ]
    out["ops"] = [int(o) for o in (hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(),
                                   hvd.local_size_op(), hvd.process_set_included_op(0),
                                   hvd.process_set_included_op(99))]  # fmt: skip
    out["objects"] = [
        hvd.broadcast_object({"from": r}, root_rank=0),
        hvd.allgather_object(r * 3),
        hvd.broadcast_object_fn(root_rank=n - 1)([r]),
    ]
    hvd.barrier()
    out["join"] = int(hvd.join())
    return out


def _in_function(hvd: Any, tf: Any) -> dict[str, Any]:
    r = hvd.rank()

    @tf.function
    def step(a: Any) -> Any:
        total = hvd.allreduce(a, op=hvd.Sum)
        rows = hvd.allgather(tf.reshape(a, [1, -1]))
        root = hvd.broadcast(a, root_rank=0)
        return total, rows, root, hvd.rank_op()

    runs = []
    for k in range(3):  # the traced names are reused at every call
        total, rows, root, rank = step(tf.constant([float(r + k), 1.0]))
        runs.append([total.numpy().tolist(), rows.numpy().tolist(), root.numpy().tolist(),
                     int(rank)])  # fmt: skip

    @tf.function
    def summed(a: Any) -> Any:
        return hvd.allreduce(tf.fill([2], tf.reduce_sum(a)), op=hvd.Sum)

    # Rank 0 alone traces the function again for its second input's shape; the collective's
    # name comes from its place in the function, so it still meets the others'.
    retraced = [summed(tf.ones([2])).numpy().tolist()]
    retraced.append(summed(tf.ones([3 if r == 0 else 2])).numpy().tolist())
    # TensorFlow names a function's gradient graph after a process-wide count, which the
    # functions rank 0 alone builds here move on.
    if r == 0:
        for k in range(3):
            tf.function(lambda x: x * 2)(tf.constant(float(k)))
    variable = tf.Variable([1.0 + r, 2.0])
    with tf.GradientTape() as tape:
        squares = tf.reduce_sum(summed(variable * variable))
    backward = tape.gradient(squares, variable).numpy().tolist()
    return {"runs": runs, "retraced": retraced, "backward": backward}


def _gradients(hvd: Any, tf: Any) -> dict[str, Any]:
    r, n = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    x = tf.constant([1.0, 2.0]) * (r + 1)
    weights = tf.constant([1.0, 3.0])
    ops = {
        "sum": lambda: hvd.allreduce(x, op=hvd.Sum),
        "average": lambda: hvd.allreduce(x, op=hvd.Average),
        "allgather": lambda: hvd.allgather(tf.reshape(x, [1, 2])),
        "broadcast": lambda: hvd.broadcast(x, root_rank=0),
        "reducescatter": lambda: hvd.reducescatter(tf.reshape(tf.tile(x, [n]), [n, 2]), op=hvd.Sum),
        "alltoall": lambda: hvd.alltoall(tf.reshape(tf.tile(x, [n]), [n, 2])),
    }
    for key, op in ops.items():
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(op() * weights)
        out[key] = tape.gradient(loss, x).numpy().tolist()
    return out


def _model(tf: Any, seed: int) -> Any:
    model = tf.keras.Sequential(
        [tf.keras.Input((3,)), tf.keras.layers.Dense(4), tf.keras.layers.Dense(1)]
    )
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(size=w.shape).astype("float32") for w in model.get_weights()])
    return model


def _tape(hvd: Any, tf: Any) -> dict[str, Any]:
    r, n = hvd.rank(), hvd.size()
    model = _model(tf, 3)
    inputs = [np.full((2, 3), float(k + 1), dtype="float32") for k in range(n)]
    out: dict[str, Any] = {}

    def grads(wrap: Any, data: Any) -> list[list[float]]:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(data) ** 2)
        tape = wrap(tape) if wrap else tape
        return [g.numpy().ravel().tolist() for g in tape.gradient(loss, model.trainable_variables)]

    local = [grads(None, inputs[k]) for k in range(n)]
    out["expected"] = [np.mean([local[k][i] for k in range(n)], axis=0).tolist()
                       for i in range(len(local[0]))]  # fmt: skip
    out["eager"] = grads(hvd.DistributedGradientTape, inputs[r])
    out["groups"] = grads(lambda t: hvd.DistributedGradientTape(t, num_groups=2), inputs[r])
    out["fp16"] = grads(
        lambda t: hvd.DistributedGradientTape(t, compression=hvd.Compression.fp16), inputs[r]
    )
    os.environ["HORA_GRADIENT_COMPRESSION"] = "fp16"  # read as each tape is built
    out["fp16.setting"] = grads(hvd.DistributedGradientTape, inputs[r])
    del os.environ["HORA_GRADIENT_COMPRESSION"]

    @tf.function
    def traced(data: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(data) ** 2)
        tape = hvd.DistributedGradientTape(tape)
        return tape.gradient(loss, model.trainable_variables)

    out["function"] = [g.numpy().ravel().tolist() for g in traced(tf.constant(inputs[r]))]
    last = model.layers[-1]
    partial = grads(lambda t: hvd.PartialDistributedGradientTape(t, local_layers=[last]), inputs[r])
    out["partial"] = partial
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(inputs[r]) ** 2)
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[last])
    local_pairs, global_pairs = tape.get_local_and_global_gradients(loss, model.trainable_variables)
    out["split"] = [
        [g.numpy().ravel().tolist() for _, g in local_pairs],
        [g.numpy().ravel().tolist() for _, g in global_pairs],
    ]
    out["partial.local"] = [(np.array(g) / n).tolist() for g in local[r]]
    embedding = tf.Variable(tf.zeros([n + 1, 2]))
    for as_dense in (False, True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(embedding, [r, n]) * float(r + 1))
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=as_dense)
        (grad,) = tape.gradient(loss, [embedding])
        out[f"embedding.{as_dense}"] = [type(grad).__name__,
                                        tf.convert_to_tensor(grad).numpy().tolist()]  # fmt: skip
    return out


def _sync_batch_norm(hvd: Any, tf: Any) -> dict[str, Any]:
    r, n = hvd.rank(), hvd.size()
    batches = [np.arange(8, dtype="float32").reshape(4, 2) * (k + 1) + k for k in range(n)]
    plain = tf.keras.layers.BatchNormalization(axis=-1)
    whole = plain(np.concatenate(batches), training=True).numpy()
    synced = hvd.SyncBatchNormalization(axis=-1)
    mine = synced(batches[r], training=True).numpy()
    x = tf.constant(batches[r])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = hvd.SyncBatchNormalization(axis=-1)(x, training=True)
        loss = tf.reduce_sum(y * tf.constant([[1.0, 2.0]]))
    return {
        "mine": mine.tolist(),
        "whole": whole[4 * r : 4 * r + 4].tolist(),
        "grad_finite": bool(np.isfinite(tape.gradient(loss, x).numpy()).all()),
    }


def _elastic(hvd: Any, tf: Any, folder: str) -> dict[str, Any]:
    r = hvd.rank()
    model = _model(tf, 10 + r)  # ranks start different: sync makes them rank 0's
    state = hvd.elastic.TensorFlowKerasState(model, epoch=r, commit_dir=folder)
    state.sync()
    after_sync = [w.tolist() for w in model.get_weights()]
    model.layers[0].kernel.assign_add(tf.ones_like(model.layers[0].kernel))
    state.epoch = 5
    state.commit()
    committed = [w.tolist() for w in model.get_weights()]
    model.layers[0].kernel.assign(tf.zeros_like(model.layers[0].kernel))
    state.epoch = 9
    state.restore()
    restored = [w.tolist() for w in model.get_weights()]
    reader = hvd.elastic.TensorFlowKerasState(_model(tf, 99), epoch=0, commit_dir=folder)
    reader.sync()  # rank 0 resumes from the durable commit; the sync gives it to everyone
    resumed = [w.tolist() for w in reader.model.get_weights()]
    return {
        "after_sync": after_sync,
        "committed": committed,
        "restored": restored,
        "epoch": state.epoch,
        "resumed": resumed,
        "resumed_epoch": reader.epoch,
    }


def _keras_elastic(tf: Any) -> dict[str, Any]:
    import hora.keras as khvd

    model = _model(tf, 5)
    model.compile(optimizer=khvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)), loss="mse")
    state = khvd.elastic.KerasState(model, batch=2, epoch=1)
    commits: list[int] = []
    steps: list[int] = []

    class Count(tf.keras.callbacks.Callback):  # type: ignore[misc]
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            steps.append(0)

        def on_batch_end(self, batch: int, logs: Any = None) -> None:
            steps[-1] += 1

    original = state.commit
    state.commit = lambda: (commits.append(state.batch), original())[1]

    @khvd.elastic.run
    def train(state: Any) -> None:
        # Resume in the middle of an epoch: its first fit skips the batches already done.
        x = np.ones((40, 3), dtype="float32")
        done = state.batch
        first = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(4).skip(done)
        model.fit(first, steps_per_epoch=5 - done, epochs=1, verbose=0, callbacks=[
                      khvd.elastic.CommitStateCallback(state, batches_per_commit=2),
                      khvd.elastic.UpdateBatchStateCallback(state),
                      khvd.elastic.UpdateEpochStateCallback(state),
                      Count()])  # fmt: skip
        model.fit(x, x[:, :1], batch_size=4, steps_per_epoch=5, epochs=3 - state.epoch,
                  verbose=0, callbacks=[
                      khvd.elastic.CommitStateCallback(state, batches_per_commit=2),
                      khvd.elastic.UpdateBatchStateCallback(state),
                      khvd.elastic.UpdateEpochStateCallback(state),
                      Count()])  # fmt: skip

    train(state)
    return {"epoch": state.epoch, "batch": state.batch, "steps": steps, "commits": commits}


def _refusals(hvd: Any, tf: Any) -> dict[str, Any]:
    r = hvd.rank()
    out: dict[str, Any] = {}
    out["mismatch"] = _error(lambda: hvd.allreduce(tf.ones([r + 1]), name="mismatch"))
    out["splits"] = _error(lambda: hvd.alltoall(tf.ones([hvd.size() + 1])))

    @tf.function(jit_compile=True)
    def compiled(a: Any) -> Any:
        return hvd.allreduce(a)

    out["xla"] = _error(lambda: compiled(tf.ones([2])))
    out["global_variables"] = _error(lambda: hvd.broadcast_global_variables(0))
    out["after"] = hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy().tolist()  # still works
    return out


def _horovod_calls(hvd: Any, tf: Any) -> dict[str, Any]:
    """Calls written as Horovod's API takes them: positional, in its order."""
    r, n = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    x = tf.constant([1.0, 2.0]) * (r + 1)
    none, everyone = hvd.Compression.none, hvd.global_process_set
    (total,) = hvd.grouped_allreduce([x], None, "", "", none, hvd.Sum, 1.0, 1.0, everyone,
                                     False, "horovod.grouped")  # fmt: skip
    out["grouped_allreduce"] = total.numpy().tolist()
    (mine,) = hvd.grouped_reducescatter([tf.ones([n, 1]) * (r + 1)], "", none, hvd.Sum, everyone,
                                        2.0, 1.0)  # fmt: skip
    out["grouped_reducescatter"] = mine.numpy().tolist()
    default, inplace = tf.Variable([float(r)] * 2), tf.Variable([float(r)] * 2)
    hvd.broadcast_variables([default], n - 1)  # Horovod's default: inplace=False
    hvd.broadcast_variables([inplace], n - 1, everyone, True)
    out["broadcast_variables"] = [default.numpy().tolist(), inplace.numpy().tolist()]
    session = object()  # Horovod's TensorFlow 1 session argument: not needed eagerly
    out["objects"] = [
        hvd.broadcast_object({"from": r}, n - 1, session, "horovod.object"),
        hvd.allgather_object(r * 3, session, "horovod.gather"),
        hvd.broadcast_object_fn(0, session, "horovod.fn")([r]),
    ]
    out["fused"] = [_error(lambda: hvd.SyncBatchNormalization(fused=True)),
                    _error(lambda: hvd.SyncBatchNormalization(None)),
                    _error(lambda: hvd.SyncBatchNormalization(everyone)),
                    _error(lambda: hvd.SyncBatchNormalization(False, process_set=everyone))]  # fmt: skip
    return out


def _process_set(hvd: Any, tf: Any, evens: Any) -> dict[str, Any]:
    """Last in the job: a collective only some ranks make moves the numbering of later unnamed
    collectives apart between ranks (as in Horovod), so nothing unnamed follows it."""
    r = hvd.rank()
    out: dict[str, Any] = {}
    value = tf.constant(float(r))
    if evens.included():
        out["allreduce"] = float(hvd.allreduce(value, op=hvd.Sum, name="evens", process_set=evens))
    with tf.GradientTape() as tape:
        tape.watch(value)
        square = value * value
    (grad,) = hvd.DistributedGradientTape(tape, process_set=evens).gradient(square, [value])
    out["tape"] = float(grad)  # members average 2r over the set; the others keep theirs
    hvd.barrier()  # no rank shuts hora down while the set's members still reduce
    return out


def _job(folder: str) -> dict[str, Any]:
    import tensorflow as tf

    import hora.tensorflow as hvd

    evens = hvd.ProcessSet(range(0, int(os.environ["HORA_SIZE"]), 2))
    hvd.init(process_sets=[evens])
    try:
        return {
            "collectives": _collectives(hvd, tf),
            "function": _in_function(hvd, tf),
            "gradients": _gradients(hvd, tf),
            "tape": _tape(hvd, tf),
            "sync_batch_norm": _sync_batch_norm(hvd, tf),
            "elastic": _elastic(hvd, tf, folder),
            "refusals": _refusals(hvd, tf),
            "horovod_calls": _horovod_calls(hvd, tf),
            "keras_elastic": _keras_elastic(tf),
            "process_set": _process_set(hvd, tf, evens),
            "keras": tf.keras.__name__,
        }
    finally:
        hvd.shutdown()


# ---------------------------------------------------------------- test side

_results: dict[tuple[int, bool], list[dict[str, Any]]] = {}


def _ranks(np_: int, legacy: bool, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    if not HAS_TENSORFLOW:
        pytest.skip(NO_TENSORFLOW)
    if legacy and not HAS_TF_KERAS:
        pytest.skip("tf_keras is not installed: pip install -e '.[integrations]'")
    key = (np_, legacy)
    if key not in _results:
        folder = tmp_path_factory.mktemp(f"tf-np{np_}")
        os.chmod(folder, 0o700)
        env = dict(ENV, **({"TF_USE_LEGACY_KERAS": "1"} if legacy else {}))
        _results[key] = hora.run(
            _job, args=(str(folder),), np=np_, env=env, timeout_s=JOB_TIMEOUT_S
        )
        # tf.keras is Keras 3 by default, tf_keras with TF_USE_LEGACY_KERAS=1.
        keras = _results[key][0]["keras"]
        assert keras.startswith("tf_keras") == legacy, keras
    return _results[key]


JOBS = [(2, False), (3, False), (2, True)]


@pytest.fixture(params=JOBS, ids=[f"np{n}{'-tf_keras' if legacy else ''}" for n, legacy in JOBS])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    np_, legacy = request.param
    return _ranks(np_, legacy, tmp_path_factory)


def _inputs(n: int) -> list[np.ndarray]:
    return [np.array([1.0, -2.0, 3.0]) * (r + 1) for r in range(n)]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_collectives_match_their_definitions(ranks: list[Any]) -> None:
    n = len(ranks)
    xs = _inputs(n)
    expected = {
        "allreduce.Sum": sum(xs),
        "allreduce.Average": sum(xs) / n,
        "allreduce.Min": np.min(xs, axis=0),
        "allreduce.Max": np.max(xs, axis=0),
        "allreduce.Product": np.prod(xs, axis=0),
        "scaled": sum(xs),
        "fp16": sum(xs) / n,
    }
    for r, seen in enumerate(ranks):
        c = seen["collectives"]
        for key, value in expected.items():
            np.testing.assert_allclose(c[key], value, rtol=1e-3, err_msg=key)
        for dtype in ("int32", "int64", "float16", "bfloat16", "float64", "uint16", "uint8"):
            assert c[f"sum.{dtype}"][0] == dtype
            assert c[f"sum.{dtype}"][1:] == [float(sum(range(1, n + 1)) * k) for k in (1, 2, 3)]
        assert c["grouped"] == [sum(xs).tolist(), (2 * sum(xs)).tolist()]
        dense = np.zeros((n, 2))
        for k in range(n):
            dense[k] = k + 1
        np.testing.assert_allclose(c["sparse.Sum"], dense)
        np.testing.assert_allclose(c["sparse.Average"], dense / n)
        assert c["allgather"] == [[k, k] for k in range(n) for _ in range(k + 1)]
        assert c["allgather.uint16"] == [60000 + k for k in range(n)]
        assert c["grouped_allgather"] == [
            [k for k in range(n) for _ in range(k + 1)],
            [[10 + k, 10 + k] for k in range(n)],
        ]
        assert c["broadcast"] == [(n - 1) * 10]
        assert c["broadcast_"] == [1.0, 1.0]
        assert c["alltoall"] == [[100 * k + 2 * r + j for k in range(n) for j in (0, 1)], [2] * n]
        assert c["alltoall.even"] == c["alltoall"][0]
        rows = 2 * n + 1
        mine = rows // n + (1 if r < rows % n else 0)
        assert c["reducescatter"] == [[float(sum(range(1, n + 1)))] * 2] * mine
        assert c["grouped_reducescatter"] == [[[float(n)]], [[float(sum(range(n)))] * 2]]
        assert c["ops"] == [r, n, r, n, 1, -3]
        assert c["objects"] == [{"from": 0}, [3 * k for k in range(n)], [n - 1]]
        assert c["join"] in range(n)
        p = seen["process_set"]
        evens = [k for k in range(n) if k % 2 == 0]
        if r in evens:
            assert p["allreduce"] == float(sum(evens))
            assert p["tape"] == 2.0 * sum(evens) / len(evens)
        else:
            assert "allreduce" not in p and p["tape"] == 2.0 * r


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_collectives_inside_tf_function_are_right_at_every_call(ranks: list[Any]) -> None:
    n = len(ranks)
    for r, seen in enumerate(ranks):
        for k, (total, rows, root, rank) in enumerate(seen["function"]["runs"]):
            assert total == [float(sum(q + k for q in range(n))), float(n)]
            assert rows == [[float(q + k), 1.0] for q in range(n)]
            assert root == [float(k), 1.0]
            assert rank == r
        assert seen["function"]["retraced"] == [[2.0 * n] * 2, [2.0 * n + 1] * 2]
        # d/dv of sum(allreduce(fill(sum(v * v)))): the sum of 2 x 2v over the ranks.
        assert seen["function"]["backward"] == [4.0 * n * (1.0 + r), 8.0 * n]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_gradients_of_collectives(ranks: list[Any]) -> None:
    n = len(ranks)
    w = np.array([1.0, 3.0])
    for r, seen in enumerate(ranks):
        g = seen["gradients"]
        np.testing.assert_allclose(g["sum"], n * w)  # the upstream gradients are summed
        np.testing.assert_allclose(g["average"], w)
        np.testing.assert_allclose(g["allgather"], w)  # averaged, then this rank's row
        np.testing.assert_allclose(g["broadcast"], w if r == 0 else 0 * w)
        np.testing.assert_allclose(g["reducescatter"], n * n * w)
        np.testing.assert_allclose(g["alltoall"], n * w)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_distributed_gradient_tape_averages(ranks: list[Any]) -> None:
    n = len(ranks)
    for seen in ranks:
        t = seen["tape"]
        for key in ("eager", "groups", "function"):
            for got, want in zip(t[key], t["expected"]):
                np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=key)
        for got, want in zip(t["fp16"], t["expected"]):
            np.testing.assert_allclose(got, want, rtol=2e-2)
        # HORA_GRADIENT_COMPRESSION=fp16 makes a tape built without a compressor send fp16.
        assert t["fp16"] != t["eager"]
        assert t["fp16.setting"] == t["fp16"]
        # The last layer is local: its gradients are this rank's own, divided by the size.
        for got, want in zip(t["partial"][:2], t["expected"][:2]):
            np.testing.assert_allclose(got, want, rtol=1e-5)
        for got, want in zip(t["partial"][2:], t["partial.local"][2:]):
            np.testing.assert_allclose(got, want, rtol=1e-5)
        local_part, global_part = t["split"]
        assert len(local_part) == 2 and len(global_part) == 2
        for got, want in zip(global_part + local_part, t["partial"]):
            np.testing.assert_allclose(got, want, rtol=1e-5)
        # Embedding rows r and n: every rank's row r once, and row n from all.
        rows = np.zeros((n + 1, 2))
        for k in range(n):
            rows[k] += (k + 1) / n
            rows[n] += (k + 1) / n
        assert t["embedding.False"][0] == "IndexedSlices"
        np.testing.assert_allclose(t["embedding.False"][1], rows)
        np.testing.assert_allclose(t["embedding.True"][1], rows)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_sync_batch_norm_uses_every_ranks_batch(ranks: list[Any]) -> None:
    for seen in ranks:
        s = seen["sync_batch_norm"]
        np.testing.assert_allclose(s["mine"], s["whole"], rtol=1e-4, atol=1e-4)
        assert s["grad_finite"]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_elastic_state_syncs_commits_restores_and_resumes(ranks: list[Any]) -> None:
    first = ranks[0]["elastic"]
    for seen in ranks:
        e = seen["elastic"]
        assert e["after_sync"] == first["after_sync"]  # rank 0's weights everywhere
        assert e["restored"] == e["committed"] and e["epoch"] == 5
        assert e["resumed"] == first["committed"] and e["resumed_epoch"] == 5


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_refusals_name_the_problem_and_hora_keeps_working(ranks: list[Any]) -> None:
    n = len(ranks)
    for seen in ranks:
        f = seen["refusals"]
        assert {"FailedPreconditionError", "HoraInternalError"} <= set(f["mismatch"]["types"])
        assert "Mismatched allreduce tensor shapes" in f["mismatch"]["message"]
        assert {"InvalidArgumentError", "ValueError"} <= set(f["splits"]["types"])
        assert "jit_compile=False" in f["xla"]["message"]
        assert "broadcast_variables" in f["global_variables"]["message"]
        assert f["after"] == [float(n), float(n)]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_horovod_positional_calls_and_defaults(ranks: list[Any]) -> None:
    n = len(ranks)
    total = sum(range(1, n + 1))
    for seen in ranks:
        h = seen["horovod_calls"]
        assert h["grouped_allreduce"] == [float(total), 2.0 * total]  # op=Sum, 6th
        assert h["grouped_reducescatter"] == [[2.0 * total]]  # prescale_factor=2.0, 6th
        assert h["broadcast_variables"] == [[float(n - 1)] * 2] * 2
        assert h["objects"] == [{"from": n - 1}, [3 * k for k in range(n)], [0]]
        for refused in h["fused"][:3]:
            assert refused is not None and "ValueError" in refused["types"], refused
            assert "does not support fused=" in refused["message"]
        assert "process_set=" in h["fused"][2]["message"]
        assert h["fused"][3] is None


def _tf1_session_job() -> dict[str, Any]:
    """TensorFlow 1 graph mode: Horovod's object helpers take the session that runs the graph."""
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    import hora.tensorflow as hvd

    hvd.init()
    try:
        r, n = hvd.rank(), hvd.size()
        with tf.compat.v1.Session() as session:
            total = session.run(hvd.allreduce(tf.constant([float(r + 1)]), op=hvd.Sum))
            return {
                "eager": tf.executing_eagerly(),
                "allreduce": total.tolist(),
                "broadcast_object": hvd.broadcast_object({"from": r}, n - 1, session),
                "allgather_object": hvd.allgather_object(r * 3, session),
                "broadcast_object_fn": hvd.broadcast_object_fn(0, session)([r]),
            }
    finally:
        hvd.shutdown()


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("np_", [2, 3])
def test_object_helpers_take_a_tensorflow_1_session(np_: int) -> None:
    if not HAS_TENSORFLOW:
        pytest.skip(NO_TENSORFLOW)
    results = hora.run(_tf1_session_job, np=np_, env=ENV, timeout_s=JOB_TIMEOUT_S)
    for seen in results:
        assert seen == {
            "eager": False,
            "allreduce": [float(sum(range(1, np_ + 1)))],
            "broadcast_object": {"from": np_ - 1},
            "allgather_object": [3 * k for k in range(np_)],
            "broadcast_object_fn": [0],
        }


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_keras_elastic_callbacks_track_epochs_and_batches(ranks: list[Any]) -> None:
    for seen in ranks:
        k = seen["keras_elastic"]
        # Started at epoch 1, batch 2: the first epoch runs the 3 batches not done, the next 5.
        assert k["steps"] == [3, 5]
        assert k["epoch"] == 3 and k["batch"] == 0
        # A commit every second batch (state.batch then counts from the resumed position) and
        # at each epoch's end.
        assert k["commits"] == [4, 0, 2, 4, 0]
