"""hora.tensorflow.keras on real processes, under Keras 3 and under tf_keras (Keras 2).

One job per (Keras, number of ranks) runs every check (TensorFlow's import dominates a job's
cost) and returns what each rank observed; the tests assert on it here. The central check is
equivalence: ``model.fit`` on N ranks, each with a slice of every batch, reaches the weights that
one plain Keras process reaches on the whole batches. Every check also records a control (the
same run without hora's help) that must differ, so a check cannot pass by doing nothing.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hora

from .conftest import HAS_TENSORFLOW, HAS_TF_KERAS, NO_TENSORFLOW

BATCH = 6  # the global batch: every rank gets BATCH / size rows (size 2 or 3)
STEPS = 3  # global batches per epoch
JOB_TIMEOUT_S = 170.0
TEST_TIMEOUT_S = 240

FLAVORS = {"keras3": {}, "tf_keras": {"TF_USE_LEGACY_KERAS": "1"}}
# At three ranks, the checks whose results depend on the number of ranks.
SIZE_CHECKS = [
    "apply",
    "passes",
    "partial",
    "compute",
    "fit",
    "broadcast",
    "metrics",
    "learning_rate",
]
ALL_CHECKS = ["helpers", *SIZE_CHECKS, "checkpoint", "load_model", "errors", "horovod_calls"]
JOBS = [("keras3", 2), ("keras3", 3), ("tf_keras", 2), ("tf_keras", 3)]


# ---------------------------------------------------------------- worker side


def _error_of(call: Callable[[], Any]) -> dict[str, Any] | None:
    """What ``call()`` raised: ``{"types": [class names along the MRO], "message": ...}``."""
    try:
        call()
    except Exception as exc:  # the test inspects what was raised
        return {"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
    return None


def _data(steps: int = STEPS, seed: int = 7) -> tuple[Any, Any]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * BATCH, 4)).astype(np.float32)
    y = (x @ np.array([[0.5], [-1.0], [0.25], [2.0]]) + 0.1).astype(np.float32)
    return x, y


def _shard(array: Any, rank: int, size: int, batch: int = BATCH) -> Any:
    """This rank's rows of every global batch, in order."""
    per = batch // size
    batches = array.reshape(-1, batch, *array.shape[1:])
    return batches[:, rank * per : (rank + 1) * per].reshape(-1, *array.shape[1:])


def _mlp(k: Any, seed: int) -> Any:
    """A tiny 4-3-1 network whose weights come from ``seed`` (the same in every Keras)."""
    model = k.Sequential([k.Input((4,)), k.layers.Dense(3, activation="tanh"), k.layers.Dense(1)])
    rng = np.random.default_rng(seed)
    model.set_weights(
        [(0.5 * rng.normal(size=w.shape)).astype(np.float32) for w in model.get_weights()]
    )
    return model


def _max_diff(a: list[Any], b: list[Any]) -> float:
    return max(float(np.abs(np.asarray(u) - np.asarray(v)).max()) for u, v in zip(a, b))


def _dense(k: Any, inputs: int = 3) -> Any:
    layer = k.layers.Dense(1)
    layer.build((None, inputs))
    layer.set_weights([np.zeros((inputs, 1), np.float32), np.zeros((1,), np.float32)])
    return layer


def _optimizers(k: Any, flavor: str) -> dict[str, Callable[..., Any]]:
    """The optimizer families of this Keras: Keras 3's, or tf_keras's new and legacy ones."""
    found = {"new": k.optimizers.SGD}
    if flavor == "tf_keras":
        found["legacy"] = k.optimizers.legacy.SGD
    return found


def check_helpers(hvd: Any, tf: Any, flavor: str, tmp: str) -> dict[str, Any]:
    r, n = hvd.rank(), hvd.size()
    return {
        "allreduce": hvd.allreduce(float(r), op=hvd.Sum, name="k.sum"),
        "average": hvd.allreduce([float(r), 2.0 * r]),
        "allgather": hvd.allgather([r], name="k.gather"),
        "broadcast": hvd.broadcast(np.array([r + 5.0]), 0, name="k.bcast"),
        "reducescatter": hvd.reducescatter(
            np.arange(2.0 * n).reshape(n, 2) * (r + 1), op=hvd.Sum, name="k.rs"
        ),
        "types": type(hvd.allreduce(1.0)).__module__,
    }


def _applier(opt: Any, variables: list[Any], grads: Callable[[Any], list[Any]]) -> Any:
    """A step that applies ``grads(args)`` to ``variables`` with ``opt``."""

    def step(*args: Any) -> None:
        opt.apply_gradients(zip(grads(list(args)), variables))

    return step


def check_apply(hvd: Any, tf: Any, flavor: str, tmp: str) -> dict[str, Any]:
    """apply_gradients (and Keras 3's apply) in a custom loop, eagerly and in tf.function."""
    k, r = tf.keras, hvd.rank()
    out: dict[str, Any] = {}
    for family, make in _optimizers(k, flavor).items():
        for mode in ("eager", "function"):
            layer = _dense(k)
            opt = hvd.DistributedOptimizer(make(1.0))

            step = _applier(opt, layer.trainable_variables, lambda g: g)
            run = tf.function(step, autograph=False) if mode == "function" else step
            run(tf.fill((3, 1), float(r + 1)), tf.fill((1,), 10.0 * (r + 1)))
            out[f"{family}.{mode}"] = [np.asarray(w) for w in layer.get_weights()]
    if flavor == "keras3":
        layer = _dense(k)
        opt = hvd.DistributedOptimizer(k.optimizers.SGD(1.0))
        opt.apply([tf.fill((3, 1), float(r + 1)), tf.fill((1,), 10.0 * (r + 1))], layer.weights)
        out["new.apply"] = [np.asarray(w) for w in layer.get_weights()]
    return out


def check_passes(hvd: Any, tf: Any, flavor: str, tmp: str) -> dict[str, Any]:
    """backward_passes_per_step=2: (kernel[0, 0], iterations) after each of four calls."""
    k, r = tf.keras, hvd.rank()
    out: dict[str, Any] = {}
    for family, make in _optimizers(k, flavor).items():
        for mode in ("eager", "function"):
            for average in (False, True):
                layer = _dense(k)
                opt = hvd.DistributedOptimizer(
                    make(1.0), backward_passes_per_step=2, average_aggregated_gradients=average
                )

                fill = lambda g: [tf.fill((3, 1), g[0]), tf.fill((1,), g[0])]  # noqa: E731
                step = _applier(opt, layer.trainable_variables, fill)
                run = tf.function(step, autograph=False) if mode == "function" else step
                seen = []
                for call in range(4):
                    run(tf.constant((call + 1.0) * (r + 1)))
                    seen.append((float(layer.get_weights()[0][0, 0]), int(opt.iterations)))
                out[f"{family}.{mode}.{average}"] = seen
    return out


def check_partial(hvd: Any, tf: Any, flavor: str, tmp: str) -> dict[str, Any]:
    """PartialDistributedOptimizer: the local layer's gradients stay on their rank."""
    k, r = tf.keras, hvd.rank()
    out: dict[str, Any] = {}
    for scale in (True, False):
        shared, local = _dense(k), _dense(k)
        opt = hvd.PartialDistributedOptimizer(
            k.optimizers.SGD(1.0), local_layers=[local], scale_local_gradients=scale
        )
        variables = shared.trainable_variables + local.trainable_variables
        grads = [tf.fill(v.shape, float(r + 1)) for v in variables]
        opt.apply_gradients(zip(grads, variables))
        out[str(scale)] = {
            "shared": float(shared.get_weights()[0][0, 0]),
            "local": float(local.get_weights()[0][0, 0]),
        }
    return out


def check_compute(hvd: Any, tf: Any, flavor: str, tmp: str) -> dict[str, Any]:
    """Horovod-style custom loops: ``_compute_gradients`` then ``apply_gradients``."""
    k, r = tf.keras, hvd.rank()
    out: dict[str, Any] = {}
    for passes in (1, 2):
        layer = _dense(k)
        opt = hvd.DistributedOptimizer(k.optimizers.SGD(1.0), backward_passes_per_step=passes)
        x = tf.fill((1, 3), float(r + 1))  # d(sum(layer(x)))/d(kernel) = x
        loss = functools.partial(lambda f, v: tf.reduce_sum(f(v)), layer, x)
        pairs = opt._compute_gradients(loss, layer.trainable_variables)
        counters = []
        for _ in range(passes):
            opt.apply_gradients(pairs)
            counters.append(int(opt._agg_helper.counter) if passes > 1 else None)
        out[str(passes)] = {
            "grad": float(pairs[0][0][0, 0]),
            "kernel": float(layer.get_weights()[0][0, 0]),
            "counters": counters,
            "helper": opt._agg_helper is not None,
        }
    return out


def _fit_equivalence(
    hvd: Any, tf: Any, make: Callable[..., Any], passes: int, epochs: int = 2
) -> dict[str, Any]:
    k, r, n = tf.keras, hvd.rank(), hvd.size()
    x, y = _data(STEPS * 2)
    model = _mlp(k, 1)
    opt = hvd.DistributedOptimizer(
        make(0.1), backward_passes_per_step=passes, average_aggregated_gradients=True
    )
    model.compile(optimizer=opt, loss="mse")
    model.fit(
        _shard(x, r, n),
        _shard(y, r, n),
        batch_size=BATCH // n,
        epochs=epochs,
        shuffle=False,
        verbose=0,
    )
    reference = _mlp(k, 1)
    reference.compile(optimizer=make(0.1), loss="mse")
    reference.fit(x, y, batch_size=BATCH * passes, epochs=epochs, shuffle=False, verbose=0)
    alone = _mlp(k, 1)  # the control: this rank's data only, no averaging
    alone.compile(optimizer=make(0.1), loss="mse")
    alone.fit(
        _shard(x, r, n),
        _shard(y, r, n),
        batch_size=BATCH // n,
        epochs=epochs,
        shuffle=False,
        verbose=0,
    )
    return {
        "diff": _max_diff(model.get_weights(), reference.get_weights()),
        "control": _max_diff(alone.get_weights(), reference.get_weights()),
        "iterations": int(opt.iterations),
        "reference_iterations": int(reference.optimizer.iterations),
        "class": (type(opt).__name__, type(opt).__qualname__, type(opt).__module__),
        "base": (type(reference.optimizer).__qualname__, type(reference.optimizer).__module__),
    }


def check_fit(hvd: Any, tf: Any, flavor: str, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for family, make in _optimizers(tf.keras, flavor).items():
        out[family] = _fit_equivalence(hvd, tf, make, passes=1)
        out[f"{family}.passes2"] = _fit_equivalence(hvd, tf, make, passes=2)
    return out


def _recorder(k: Any, on: str, fn: Callable[..., Any]) -> Any:
    """A Keras callback that calls ``fn(model, *args)`` from hook ``on``."""

    class Recorder(k.callbacks.Callback):  # type: ignore[misc]
        pass

    def hook(self: Any, *args: Any, **kwargs: Any) -> None:
        fn(self.model, *args, **kwargs)

    setattr(Recorder, on, hook)
    return Recorder()


def check_broadcast(hvd: Any, tf: Any, flavor: str, tmp: str) -> dict[str, Any]:
    """Ranks start apart; BroadcastGlobalVariablesCallback gives them rank 0's weights (from
    the first batch) and optimizer state (after it)."""
    k, r, n = tf.keras, hvd.rank(), hvd.size()
    x, y = _data()
    out: dict[str, Any] = {}
    for label, with_callback in (("broadcast", True), ("control", False)):
        model = _mlp(k, 100 + r)
        # A rank-dependent learning rate: an optimizer variable that the callback must send.
        opt = hvd.DistributedOptimizer(k.optimizers.SGD(0.1 * (r + 1), 0.9))
        model.compile(optimizer=opt, loss="mse")
        first: list[Any] = []
        probe = _recorder(
            k,
            "on_train_batch_begin",
            lambda m, batch, logs=None, first=first: (
                first.append(m.get_weights()) if batch == 0 else None
            ),
        )
        callbacks = [probe]
        if with_callback:
            local = model.layers[-1].bias
            callbacks.insert(
                0, hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=local)
            )
        model.fit(
            _shard(x, r, n),
            _shard(y, r, n),
            batch_size=BATCH // n,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
        out[label] = {
            "start": first[0],
            "final": model.get_weights(),
            "iterations": int(model.optimizer.iterations),
            "learning_rate": float(np.asarray(model.optimizer.learning_rate)),
        }
    out["root_init"] = _mlp(k, 100).get_weights()
    out["own_init"] = _mlp(k, 100 + r).get_weights()
    return out


def check_metrics(hvd: Any, tf: Any, flavor: str, tmp: str) -> dict[str, Any]:
    """MetricAverageCallback: the callbacks after it see the ranks' average."""
    k, r, n = tf.keras, hvd.rank(), hvd.size()
    x, y = _data()
    vx, vy = _data(seed=8)
    before: list[dict[str, float]] = []
    after: list[dict[str, float]] = []
    model = _mlp(k, 1)
    model.compile(
        optimizer=hvd.DistributedOptimizer(k.optimizers.SGD(0.05)), loss="mse", metrics=["mae"]
    )
    model.fit(
        _shard(x, r, n),
        _shard(y, r, n),
        batch_size=BATCH // n,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=(_shard(vx, r, n), _shard(vy, r, n)),
        callbacks=[
            _recorder(
                k,
                "on_epoch_end",
                lambda m, e, logs: before.append({key: float(v) for key, v in logs.items()}),
            ),
            hvd.callbacks.MetricAverageCallback(),
            _recorder(
                k,
                "on_epoch_end",
                lambda m, e, logs: after.append({key: float(v) for key, v in logs.items()}),
            ),
        ],
    )
    return {"before": before, "after": after}


def _lr_probe(k: Any, seen: list[Any]) -> Any:
    def record(m: Any, batch: int, logs: Any = None) -> None:
        momentum = getattr(m.optimizer, "momentum", None)
        seen.append(
            (
                float(np.asarray(m.optimizer.learning_rate)),
                None if momentum is None else float(np.asarray(momentum)),
            )
        )

    return _recorder(k, "on_train_batch_begin", record)


def check_learning_rate(hvd: Any, tf: Any, flavor: str, tmp: str) -> dict[str, Any]:
    """Warmup per batch (with momentum correction) and a staircase schedule per epoch."""
    import warnings

    k, r, n = tf.keras, hvd.rank(), hvd.size()
    x, y = _data()
    xs, ys = _shard(x, r, n), _shard(y, r, n)
    out: dict[str, Any] = {}
    # Momentum correction needs a momentum it can change: a variable (tf_keras legacy) or a
    # model that runs eagerly (Keras 3).
    make = k.optimizers.legacy.SGD if flavor == "tf_keras" else k.optimizers.SGD
    for label, eager in (("warmup", flavor == "keras3"), ("compiled", False)):
        seen: list[Any] = []
        logged: list[float] = []
        model = _mlp(k, 1)
        model.compile(
            optimizer=hvd.DistributedOptimizer(
                (make if label == "warmup" else k.optimizers.SGD)(0.4, momentum=0.9)
            ),
            loss="mse",
            run_eagerly=eager,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(
                xs,
                ys,
                batch_size=BATCH // n,
                epochs=3,
                shuffle=False,
                verbose=0,
                callbacks=[
                    hvd.callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=2),
                    _lr_probe(k, seen),
                    _recorder(
                        k,
                        "on_epoch_end",
                        lambda m, e, logs, logged=logged: logged.append(logs["lr"]),
                    ),
                ],
            )
        out[label] = {
            "seen": seen,
            "logged": logged,
            "warnings": [str(w.message) for w in caught if "Momentum correction" in str(w.message)],
            "momentum_after": float(np.asarray(model.optimizer.momentum)),
        }
    seen = []
    model = _mlp(k, 1)
    model.compile(optimizer=hvd.DistributedOptimizer(k.optimizers.SGD(0.3)), loss="mse")
    model.fit(
        xs,
        ys,
        batch_size=BATCH // n,
        epochs=4,
        shuffle=False,
        verbose=0,
        callbacks=[
            hvd.callbacks.LearningRateScheduleCallback(0.2, 0.5, start_epoch=1, end_epoch=3),
            _lr_probe(k, seen),
        ],
    )
    out["schedule"] = [lr for lr, _ in seen]
    return out


def check_checkpoint(hvd: Any, tf: Any, flavor: str, tmp: str) -> dict[str, Any]:
    """BestModelCheckpoint: only rank 0 writes; an unset filepath is a clear error."""
    k, r, n = tf.keras, hvd.rank(), hvd.size()
    x, y = _data()
    vx, vy = _data(seed=8)
    model = _mlp(k, 1)
    model.compile(optimizer=hvd.DistributedOptimizer(k.optimizers.SGD(0.05)), loss="mse")
    best = hvd.callbacks.BestModelCheckpoint(monitor="val_loss")
    unset_before = best.filepath
    best.filepath = os.path.join(
        tmp, f"best-rank{r}.keras" if flavor == "keras3" else f"best-rank{r}.h5"
    )
    model.fit(
        _shard(x, r, n),
        _shard(y, r, n),
        batch_size=BATCH // n,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=(vx, vy),
        callbacks=[hvd.callbacks.MetricAverageCallback(), best],
    )
    unset = hvd.callbacks.BestModelCheckpoint()
    unset.set_model(model)
    unset.on_epoch_begin(0)
    return {
        "unset_before": unset_before,
        "unset_error": _error_of(lambda: unset.on_epoch_end(0, {"val_loss": 1.0})),
    }


def check_load_model(hvd: Any, tf: Any, flavor: str, tmp: str) -> dict[str, Any]:
    """Save a model trained with DistributedOptimizer; hvd.load_model gets it back wrapped,
    with its optimizer state; plain Keras loads it without hora."""
    import hora.tensorflow as hvd_tf

    k, r, n = tf.keras, hvd.rank(), hvd.size()
    x, y = _data()
    path = os.path.join(tmp, "model.keras" if flavor == "keras3" else "model.h5")
    model = _mlp(k, 1)
    model.compile(
        optimizer=hvd.DistributedOptimizer(k.optimizers.SGD(0.1, momentum=0.5)), loss="mse"
    )
    model.fit(
        _shard(x, r, n), _shard(y, r, n), batch_size=BATCH // n, epochs=1, shuffle=False, verbose=0
    )
    if r == 0:
        model.save(path)
    hvd_tf.barrier()
    out: dict[str, Any] = {}
    for label, load in (("hora", hvd.load_model), ("plain", k.models.load_model)):
        loaded = load(path)
        opt = loaded.optimizer
        out[label] = {
            "class": (type(opt).__qualname__, type(opt).__module__),
            "distributed": hasattr(opt, "_hora"),
            "iterations": int(opt.iterations),
            "momentum": float(np.asarray(opt.momentum)),
        }
        loaded.fit(x[r::n], y[r::n], batch_size=BATCH // n, epochs=1, shuffle=False, verbose=0)
        out[label]["weights"] = loaded.get_weights()
    return out


def check_errors(hvd: Any, tf: Any, flavor: str, tmp: str) -> dict[str, Any]:
    import hora.tensorflow as hvd_tf

    k, r, n = tf.keras, hvd.rank(), hvd.size()
    v1 = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    wrapped = hvd.DistributedOptimizer(k.optimizers.SGD(0.1))
    out = {
        "compat_v1": _error_of(lambda: hvd.DistributedOptimizer(v1)),
        "compat_v1_tf": isinstance(hvd_tf.DistributedOptimizer(v1), tf.compat.v1.train.Optimizer),
        "not_optimizer": _error_of(lambda: hvd.DistributedOptimizer(object())),
        "twice": _error_of(lambda: hvd.DistributedOptimizer(wrapped)),
        "op": _error_of(lambda: hvd.DistributedOptimizer(k.optimizers.SGD(0.1), op=hvd.Max)),
        "passes": _error_of(
            lambda: hvd.DistributedOptimizer(k.optimizers.SGD(0.1), backward_passes_per_step=0)
        ),
        "global_variables": _error_of(lambda: hvd.broadcast_global_variables(0)),
    }
    # Last: XLA refuses while tracing, on every rank, before any collective.
    x, y = _data()
    model = _mlp(k, 1)
    model.compile(
        optimizer=hvd.DistributedOptimizer(k.optimizers.SGD(0.1)), loss="mse", jit_compile=True
    )
    out["xla"] = _error_of(
        lambda: model.fit(_shard(x, r, n), _shard(y, r, n), batch_size=BATCH // n, verbose=0)
    )
    return out


def check_horovod_calls(hvd: Any, tf: Any, flavor: str, tmp: str) -> dict[str, Any]:
    """Calls written as Horovod's modules take them: positional in each module's order, and
    ``name=`` naming the optimizer."""
    import hora.keras as hvd_keras
    import hora.tensorflow as hvd_tf

    k, r = tf.keras, hvd.rank()
    out: dict[str, Any] = {}
    for family, make in _optimizers(k, flavor).items():
        plain = make(1.0)  # Keras 3 numbers its default names: sgd_1, sgd_2, ...
        named = hvd.DistributedOptimizer(make(1.0), name="dist_sgd")
        out[family] = {  # the config's name: tf_keras's legacy optimizers have no .name
            "named": named.get_config()["name"],
            "unnamed": hvd.DistributedOptimizer(plain).get_config()["name"],
            "plain": plain.get_config()["name"],
        }
        for label, opt in (("weights", named), ("control", plain)):
            layer = _dense(k)
            _applier(opt, layer.trainable_variables, lambda g: g)(
                tf.fill((3, 1), float(r + 1)), tf.fill((1,), 10.0 * (r + 1))
            )
            out[family][label] = [np.asarray(w) for w in layer.get_weights()]
    # horovod.tensorflow: (optimizer, name, use_locking, ..., backward_passes_per_step 8th).
    tf_opt = hvd_tf.DistributedOptimizer(
        k.optimizers.SGD(0.1), "tf_opt", True, "", "", hvd.Compression.none, False, 2
    )
    # horovod.keras: num_groups and groups follow op.
    keras_opt = hvd_keras.DistributedOptimizer(
        k.optimizers.SGD(0.1), "keras_opt", "", "", hvd.Compression.none, False, 1.0,
        hvd.Average, 2,
    )  # fmt: skip
    out["tf_opt"] = [tf_opt.get_config()["name"], tf_opt._hora.accumulator.passes]
    out["keras_opt"] = [keras_opt.get_config()["name"], keras_opt._hora.reducer.num_groups]
    out["named.attribute"] = named.name if flavor == "keras3" else None

    def checkpoint(cb: Any) -> list[Any]:
        mode = getattr(cb, "mode", None) or cb.monitor_op.__name__  # tf_keras keeps the op
        return [cb.monitor, mode, cb.save_weights_only, cb.save_freq]

    out["checkpoint.keras"] = checkpoint(
        hvd_keras.callbacks.BestModelCheckpoint("val_acc", 0, "max", 3)
    )
    out["checkpoint.tensorflow.keras"] = checkpoint(
        hvd.callbacks.BestModelCheckpoint("val_acc", 0, True, "max", 3)
    )
    return out


CHECKS: dict[str, Callable[..., dict[str, Any]]] = {
    "helpers": check_helpers,
    "apply": check_apply,
    "passes": check_passes,
    "partial": check_partial,
    "compute": check_compute,
    "fit": check_fit,
    "broadcast": check_broadcast,
    "metrics": check_metrics,
    "learning_rate": check_learning_rate,
    "checkpoint": check_checkpoint,
    "load_model": check_load_model,
    "errors": check_errors,
    "horovod_calls": check_horovod_calls,
}


def keras_worker(flavor: str, checks: list[str], tmp: str) -> dict[str, Any]:
    """Run the named checks on this rank; returns what each observed."""
    import tensorflow as tf

    import hora.tensorflow.keras as hvd

    hvd.init()
    out: dict[str, Any] = {"keras": tf.keras.__name__, "rank": hvd.rank(), "size": hvd.size()}
    for name in checks:
        out[name] = CHECKS[name](hvd, tf, flavor, tmp)
    return out


# ---------------------------------------------------------------- test side


@pytest.fixture(scope="module", params=JOBS, ids=[f"{f}-np{n}" for f, n in JOBS])
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    flavor, np_ = request.param
    if not HAS_TENSORFLOW:
        pytest.skip(NO_TENSORFLOW)
    if flavor == "tf_keras" and not HAS_TF_KERAS:
        pytest.skip("tf_keras is not installed: pip install -e '.[integrations]'")
    checks = ALL_CHECKS if np_ == 2 else SIZE_CHECKS
    tmp = tmp_path_factory.mktemp(f"{flavor}-np{np_}")
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_USE_LEGACY_KERAS": "0", **FLAVORS[flavor]}
    results = hora.run(
        keras_worker, args=(flavor, checks, str(tmp)), np=np_, env=env, timeout_s=JOB_TIMEOUT_S
    )
    return {"flavor": flavor, "size": np_, "ranks": results, "tmp": tmp, "checks": checks}


def _ranks(job: dict[str, Any], check: str) -> list[Any]:
    if check not in job["checks"]:
        pytest.skip(f"{check} runs at two ranks only")
    return [rank[check] for rank in job["ranks"]]


def _close(a: Any, b: Any, tol: float = 1e-5) -> bool:
    return bool(
        np.allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), atol=tol)
    )


def _same_everywhere(values: list[Any]) -> bool:
    return all(
        _close(
            np.concatenate([np.ravel(w) for w in v]),
            np.concatenate([np.ravel(w) for w in values[0]]),
        )
        for v in values
    )


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_workers_use_the_requested_keras(job: dict[str, Any]) -> None:
    expected = "tf_keras" if job["flavor"] == "tf_keras" else "keras"
    for rank in job["ranks"]:
        assert rank["keras"].split(".")[0] == expected, rank["keras"]
        assert rank["size"] == job["size"]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_keras_helpers_return_numpy_values(job: dict[str, Any]) -> None:
    n = job["size"]
    for r, seen in enumerate(_ranks(job, "helpers")):
        assert seen["types"] == "numpy"
        assert float(seen["allreduce"]) == n * (n - 1) / 2
        assert _close(seen["average"], [(n - 1) / 2, n - 1])
        assert list(seen["allgather"]) == list(range(n))
        assert _close(seen["broadcast"], [5.0])
        total = np.arange(2.0 * n).reshape(n, 2) * sum(range(1, n + 1))
        assert _close(seen["reducescatter"], total[r : r + 1])


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_apply_gradients_averages_in_custom_loops(job: dict[str, Any]) -> None:
    n = job["size"]
    mean = (n + 1) / 2  # ranks send r + 1
    for seen in _ranks(job, "apply"):
        assert len(seen) == (3 if job["flavor"] == "keras3" else 4)
        for label, (kernel, bias) in seen.items():
            assert _close(kernel, np.full((3, 1), -mean)), (label, kernel)
            assert _close(bias, [-10 * mean]), (label, bias)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_backward_passes_per_step_applies_every_second_call(job: dict[str, Any]) -> None:
    n = job["size"]
    mean = (n + 1) / 2  # call c sends (c + 1) * (rank + 1)
    for seen in _ranks(job, "passes"):
        assert len(seen) == (4 if job["flavor"] == "keras3" else 8)
        for label, calls in seen.items():
            divide = 2 if label.endswith("True") else 1
            first = -(1 + 2) * mean / divide
            second = first - (3 + 4) * mean / divide
            # Keras 3's iterations counts updates (like its gradient_accumulation_steps);
            # tf_keras's counts calls (like Horovod's wrapper).
            updates = job["flavor"] == "keras3"
            counts = [0, 1, 1, 2] if updates else [1, 2, 3, 4]
            expected = list(zip([0.0, first, first, second], counts))
            for (value, iterations), (want, want_iterations) in zip(calls, expected):
                assert _close(value, want), (label, calls, expected)
                assert iterations == want_iterations, (label, calls)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_partial_distributed_optimizer_keeps_local_gradients(job: dict[str, Any]) -> None:
    n = job["size"]
    for r, seen in enumerate(_ranks(job, "partial")):
        assert _close(seen["True"]["shared"], -(n + 1) / 2)
        assert _close(seen["False"]["shared"], -(n + 1) / 2)
        assert _close(seen["True"]["local"], -(r + 1) / n)
        assert _close(seen["False"]["local"], -(r + 1))


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_compute_gradients_averages_once(job: dict[str, Any]) -> None:
    mean = (job["size"] + 1) / 2  # rank r's gradient is r + 1
    for r, seen in enumerate(_ranks(job, "compute")):
        # Averaged in _compute_gradients; apply_gradients does not average them again.
        assert _close(seen["1"]["grad"], mean), seen
        assert _close(seen["1"]["kernel"], -mean), seen
        assert seen["1"]["helper"] is False
        # With accumulation the gradients stay this rank's own until the update averages the
        # sum of the two calls.
        assert _close(seen["2"]["grad"], r + 1), seen
        assert _close(seen["2"]["kernel"], -2 * mean), seen
        assert seen["2"]["counters"] == [1, 0] and seen["2"]["helper"] is True


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_fit_on_n_ranks_equals_one_process_on_whole_batches(job: dict[str, Any]) -> None:
    for seen in _ranks(job, "fit"):
        families = ["new", "legacy"] if job["flavor"] == "tf_keras" else ["new"]
        assert sorted(seen) == sorted(families + [f + ".passes2" for f in families])
        for label, result in seen.items():
            assert result["diff"] < 1e-5, (label, result)
            assert result["control"] > 1e-3, (label, result)  # the data differ between ranks
            # tf_keras counts every call (as Horovod), Keras 3 the updates.
            calls = 2 if label.endswith("passes2") and job["flavor"] == "tf_keras" else 1
            assert result["iterations"] == calls * result["reference_iterations"], (label, result)
            name, qualname, module = result["class"]
            assert (qualname, module) == tuple(result["base"]) and name == "SGD", result


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_broadcast_callback_starts_every_rank_from_rank_0(job: dict[str, Any]) -> None:
    seen = _ranks(job, "broadcast")
    root = seen[0]["root_init"]
    for rank in seen:
        start = rank["broadcast"]["start"]
        # Every weight but the last bias (registered local) is rank 0's from the first batch.
        assert _max_diff(start[:-1], root[:-1]) < 1e-7
        assert _max_diff(start[-1:], rank["own_init"][-1:]) < 1e-7
        assert rank["broadcast"]["iterations"] == seen[0]["broadcast"]["iterations"]
    assert _same_everywhere([rank["broadcast"]["final"][:-1] for rank in seen])
    assert not _same_everywhere([rank["broadcast"]["final"][-1:] for rank in seen])
    assert all(_close(rank["broadcast"]["learning_rate"], 0.1) for rank in seen)
    # The controls: without the callback, ranks keep their own weights and learning rates.
    assert not _same_everywhere([rank["control"]["final"] for rank in seen])
    assert _close([rank["control"]["learning_rate"] for rank in seen], [0.1, 0.2, 0.3][: len(seen)])


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_metric_average_callback_averages_logs(job: dict[str, Any]) -> None:
    seen = _ranks(job, "metrics")
    names = set(seen[0]["before"][0])
    assert {"loss", "mae", "val_loss", "val_mae"} <= names
    for epoch in range(2):
        for name in names:
            raw = [rank["before"][epoch][name] for rank in seen]
            assert len(set(raw)) > 1, (name, raw)  # ranks saw different data
            for rank in seen:
                assert _close(rank["after"][epoch][name], np.mean(raw), 1e-6), (name, raw)


def _warmup(initial: float, size: int, epochs: int, steps: int, warmup: int) -> list[float]:
    """Horovod's warmup: lr grows from initial / size to initial over ``warmup`` epochs."""
    rates, lr = [], initial  # before the first batch: the optimizer's own rate
    for epoch in range(epochs):
        for batch in range(steps):
            if epoch < warmup:
                reached = epoch + (batch + 1) / steps
                lr = initial / size * (reached * (size - 1) / warmup + 1)
            rates.append(lr)
    return rates


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_warmup_and_schedule_set_the_learning_rate(job: dict[str, Any]) -> None:
    n = job["size"]
    rates = _warmup(0.4, n, epochs=3, steps=STEPS, warmup=2)
    for seen in _ranks(job, "learning_rate"):
        warmup = seen["warmup"]
        assert _close([lr for lr, _ in warmup["seen"]], rates, 1e-6), warmup["seen"]
        assert _close(warmup["logged"], [rates[STEPS - 1], rates[2 * STEPS - 1], rates[-1]], 1e-6)
        previous = [0.4] + rates[:-1]
        corrected = [0.9 * new / old for new, old in zip(rates, previous)]
        assert _close([m for _, m in warmup["seen"]], corrected, 1e-5), warmup["seen"]
        assert _close(warmup["momentum_after"], 0.9)
        assert warmup["warnings"] == []
        # A compiled Keras 3 / tf_keras step bakes a Python momentum in: skipped, with a warning.
        compiled = seen["compiled"]
        assert _close([lr for lr, _ in compiled["seen"]], rates, 1e-6)
        assert _close([m for _, m in compiled["seen"]], [0.9] * len(rates))
        assert len(compiled["warnings"]) == 1, compiled["warnings"]
        schedule = seen["schedule"]
        assert _close(schedule, [0.3] * STEPS + [0.2] * STEPS + [0.1] * 2 * STEPS, 1e-6)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_best_model_checkpoint_writes_on_rank_0_only(job: dict[str, Any]) -> None:
    seen = _ranks(job, "checkpoint")
    written = sorted(p.name for p in Path(job["tmp"]).glob("best-rank*"))
    assert written == ["best-rank0.keras" if job["flavor"] == "keras3" else "best-rank0.h5"]
    for r, rank in enumerate(seen):
        assert rank["unset_before"] is None
        if r == 0:
            assert rank["unset_error"] is not None and "ValueError" in rank["unset_error"]["types"]
            assert "callback.filepath" in rank["unset_error"]["message"]
        else:
            assert rank["unset_error"] is None


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_load_model_wraps_the_optimizer_and_keeps_its_state(job: dict[str, Any]) -> None:
    seen = _ranks(job, "load_model")
    for rank in seen:
        assert rank["hora"]["distributed"] and not rank["plain"]["distributed"]
        assert rank["hora"]["class"] == rank["plain"]["class"]
        assert rank["hora"]["class"][0] == "SGD"
        assert rank["hora"]["iterations"] == rank["plain"]["iterations"] == STEPS
        assert _close(rank["hora"]["momentum"], 0.5)
    # After one more epoch on different data, hora's ranks agree and plain Keras's do not.
    assert _same_everywhere([rank["hora"]["weights"] for rank in seen])
    assert not _same_everywhere([rank["plain"]["weights"] for rank in seen])


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_clear_errors(job: dict[str, Any]) -> None:
    for rank in _ranks(job, "errors"):
        # Keras's wrapper refuses a TensorFlow 1 optimizer, naming hora.tensorflow's, which
        # wraps it as one (for graphs run by a session; see test_graph_mode.py).
        assert "NotImplementedError" in rank["compat_v1"]["types"], rank["compat_v1"]
        assert "hora.tensorflow's DistributedOptimizer" in rank["compat_v1"]["message"]
        assert rank["compat_v1_tf"] is True
        assert "TypeError" in rank["not_optimizer"]["types"]
        assert "already a hora DistributedOptimizer" in rank["twice"]["message"]
        assert "hvd.Average" in rank["op"]["message"]
        assert "backward_passes_per_step" in rank["passes"]["message"]
        assert "BroadcastGlobalVariablesCallback" in rank["global_variables"]["message"]
        assert rank["xla"] is not None, "jit_compile=True trained without an error"
        assert "jit_compile=False" in rank["xla"]["message"], rank["xla"]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_horovod_calls_keep_their_meaning(job: dict[str, Any]) -> None:
    seen = _ranks(job, "horovod_calls")
    for rank in seen:
        for family in ("new", "legacy") if job["flavor"] == "tf_keras" else ("new",):
            names = rank[family]
            assert names["named"] == "dist_sgd"  # name= names the optimizer, as Horovod's
            assert names["unnamed"] == names["plain"]  # no name: the optimizer's own
        if job["flavor"] == "keras3":
            assert rank["named.attribute"] == "dist_sgd"
        assert rank["tf_opt"] == ["tf_opt", 2]
        assert rank["keras_opt"] == ["keras_opt", 2]
        assert rank["checkpoint.keras"][0] == "val_acc"
        assert rank["checkpoint.keras"][1] in ("max", "greater")
        assert rank["checkpoint.keras"][2:] == [False, 3]
        assert rank["checkpoint.tensorflow.keras"][1] in ("max", "greater")
        assert rank["checkpoint.tensorflow.keras"][2:] == [True, 3]
    # A named optimizer still averages: every rank ends with the same weights.
    for family in seen[0]:
        if family in ("new", "legacy"):
            assert _same_everywhere([rank[family]["weights"] for rank in seen])
            assert not _same_everywhere([rank[family]["control"] for rank in seen])
