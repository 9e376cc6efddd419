"""Keras training throughput: hora against TensorFlow's MultiWorkerMirroredStrategy, in one run.

Run it with TensorFlow and tf_keras installed (the driver itself never imports TensorFlow)::

    python benchmarks/keras_training.py [--np 2] [--models mlp cnn] [--repeats 3] [--warmup 10]
        [--steps 60] [--batch-size B] [--threads 1] [--hora-keras3] [--json results.json]

The script is a driver. For each round it starts one job of each kind, ``--np`` workers each,
that run this same script in a worker mode:

- hora: ``horarun -np N python keras_training.py --worker hora``; the model is compiled with
  ``hvd.DistributedOptimizer(SGD(momentum))``, with ``BroadcastGlobalVariablesCallback(0)``;
  each worker reads its own data, one per-worker batch per step;
- MWMS: N processes started by the driver, each with a ``TF_CONFIG`` that names a cluster of N
  workers on 127.0.0.1 (free ports) and its own index, running ``--worker mwms``; the model is
  built and compiled under ``tf.distribute.MultiWorkerMirroredStrategy()`` (its defaults) and
  fed global batches (N x the per-worker batch) with auto-sharding off, which the strategy
  splits so that every worker computes on one per-worker batch per step;
- with ``--hora-keras3``, also hora under Keras 3 (reported beside the others).

Both hora and MWMS run under tf_keras (Keras 2, ``TF_USE_LEGACY_KERAS=1``, set by the driver):
Keras 3's ``model.fit`` fails under MultiWorkerMirroredStrategy with more than one worker
(keras-team/keras#20585), so tf_keras is where the two can run the same training loop.

The rounds alternate the jobs' order (hora, MWMS, MWMS, hora, ...) so that drift in the
machine's load falls on all alike. What is compared is the same for all: the models built from
the same seed (an MLP on 784-dim inputs, 1.9 M parameters; a small CNN on 32x32x3 images, 0.5 M
parameters), a fixed synthetic data set (random, generated; nothing is downloaded), the same
per-worker batch, SGD with momentum, ``jit_compile=False``, and ``--threads`` intra-op and
inter-op threads per worker (``tf.config.threading``; 1 by default: one core per worker on a
two-core machine). Each worker runs one ``model.fit`` of ``--warmup`` + ``--steps`` steps and
times the last ``--steps`` with a callback (from the start of the first timed batch to the end
of the last). A job's throughput is ``N x batch x steps / t`` with ``t`` the slowest worker's
time; the table shows each kind's median over the rounds and the ratio to MWMS (goal: hora
>= 1.0x MWMS). Workers report one JSON line per model on stdout, which the driver reads;
``--json PATH`` writes every sample. A job that fails or outlives ``--timeout`` is stopped
(every process it started) and the benchmark ends with its output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import hora

GOAL = 1.0  # hora samples/s / MWMS samples/s
SEED = 1234
LEARNING_RATE = 0.01
MOMENTUM = 0.9
CLASSES = 10
SAMPLES = 8  # the fixed synthetic data set holds this many per-worker batches
RESULT = "KERAS_BENCH_RESULT "  # the prefix of a worker's JSON line


@dataclass(frozen=True)
class JobKind:
    """What one job runs: its worker mode, and whether under tf_keras or Keras 3."""

    name: str
    label: str
    worker: str  # "hora" or "mwms"
    tf_keras: bool  # TF_USE_LEGACY_KERAS=1


JOB_KINDS = {
    "hora": JobKind("hora", "hora", "hora", tf_keras=True),
    "mwms": JobKind("mwms", "MWMS", "mwms", tf_keras=True),
    "hora-keras3": JobKind("hora-keras3", "hora Keras 3", "hora", tf_keras=False),
}


@dataclass(frozen=True)
class ModelSpec:
    """A reference model: its input shape and its batch per worker (unless ``--batch-size``)."""

    name: str
    input_shape: tuple[int, ...]
    batch_size: int


MODELS = {
    "mlp": ModelSpec("mlp", (784,), 64),
    "cnn": ModelSpec("cnn", (32, 32, 3), 32),
}


def _harness() -> Any:
    """The benchmarks' shared helpers, beside this file (only the driver needs them: they import
    PyTorch, which the TensorFlow workers do without)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness

    return harness


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=2, help="workers per job (default 2)")
    parser.add_argument(
        "--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="default: all"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds; each runs one job of each (default 3)"
    )
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    parser.add_argument("--steps", type=int, default=60, help="timed steps (default 60)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="samples per worker and step (default: each model's own, mlp 64, cnn 32)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op and inter-op threads per worker"
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds a job may run (default 600)"
    )
    parser.add_argument("--json", metavar="PATH", default=None, help="also write results here")
    parser.add_argument(
        "--hora-keras3",
        action="store_true",
        help="also time hora under Keras 3 (a third job per round; MWMS cannot run there)",
    )
    parser.add_argument("--worker", choices=("hora", "mwms"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("np", "repeats", "steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.warmup < 1 or (args.batch_size is not None and args.batch_size < 1):
        parser.error("--warmup and --batch-size must be at least 1 (warm-up traces the step)")
    return args


def batch_size(spec: ModelSpec, args: argparse.Namespace) -> int:
    return int(args.batch_size or spec.batch_size)


# ---------------------------------------------------------------- worker side


def configure_tensorflow(threads: int) -> Any:
    """Import TensorFlow with ``threads`` intra-op and inter-op threads; returns the module."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    return tf


def build_model(tf: Any, spec: ModelSpec) -> Any:
    """``spec``'s model, with the same initial weights in every process."""
    keras = tf.keras
    keras.utils.set_random_seed(SEED)
    layers = keras.layers
    if spec.name == "mlp":
        body = [
            layers.Dense(1024, activation="relu"),
            layers.Dense(1024, activation="relu"),
        ]
    else:
        body = [
            layers.Conv2D(32, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(),
            layers.Conv2D(64, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(),
            layers.Flatten(),
            layers.Dense(128, activation="relu"),
        ]
    return keras.Sequential([keras.Input(spec.input_shape), *body, layers.Dense(CLASSES)])


def synthetic_data(tf: Any, spec: ModelSpec, batch: int, seed: int) -> Any:
    """A fixed random data set of ``SAMPLES`` batches of ``batch``, repeated without end."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(SAMPLES * batch, *spec.input_shape)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=SAMPLES * batch).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch, drop_remainder=True)


def compile_model(tf: Any, model: Any, optimizer: Any) -> None:
    model.compile(
        optimizer=optimizer,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )


def make_timer(tf: Any, warmup: int, steps: int) -> Any:
    """A callback that times batches ``warmup`` to ``warmup + steps - 1`` of ``fit``."""

    class StepTimer(tf.keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.start = 0.0
            self.seconds = 0.0

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            if batch == warmup:
                self.start = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if batch == warmup + steps - 1:
                self.seconds = time.perf_counter() - self.start

    return StepTimer()


def timed_fit(
    tf: Any, model: Any, data: Any, args: argparse.Namespace, extra: list[Any]
) -> tuple[Any, float]:
    """One ``fit`` of warm-up plus timed steps; returns the timer and the last loss."""
    timer = make_timer(tf, args.warmup, args.steps)
    history = model.fit(
        data,
        epochs=1,
        steps_per_epoch=args.warmup + args.steps,
        callbacks=[*extra, timer],
        verbose=0,
    )
    return timer, float(history.history["loss"][-1])


def report(
    spec: ModelSpec,
    model: Any,
    rank: int,
    size: int,
    batch: int,
    steps: int,
    seconds: float,
    loss: float,
) -> None:
    """Print this worker's result for one model as one JSON line, for the driver."""
    import tensorflow as tf

    result = {
        "model": spec.name,
        "rank": rank,
        "size": size,
        "parameters": int(model.count_params()),
        "batch_size": batch,
        "steps": steps,
        "seconds": seconds,
        "loss": loss,
        "keras_version": keras_version(tf),
    }
    print(RESULT + json.dumps(result), flush=True)


def keras_version(tf: Any) -> str:
    """The version of the Keras that ``tf.keras`` resolves to (tf_keras: ``tf_keras.*``)."""
    package = sys.modules.get(tf.keras.__name__.partition(".")[0])
    return str(getattr(package, "__version__", "unknown"))


def hora_worker(args: argparse.Namespace) -> None:
    tf = configure_tensorflow(args.threads)
    import hora.tensorflow.keras as hvd

    hvd.init()
    for name in args.models:
        spec = MODELS[name]
        batch = batch_size(spec, args)
        model = build_model(tf, spec)
        optimizer = tf.keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)
        compile_model(tf, model, hvd.DistributedOptimizer(optimizer))
        # Each worker its own data, one per-worker batch per step.
        data = synthetic_data(tf, spec, batch, SEED + 1 + hvd.rank())
        broadcast = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
        timer, loss = timed_fit(tf, model, data, args, [broadcast])
        report(spec, model, hvd.rank(), hvd.size(), batch, args.steps, timer.seconds, loss)
    hvd.shutdown()


def mwms_worker(args: argparse.Namespace) -> None:
    tf = configure_tensorflow(args.threads)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
    size = strategy.num_replicas_in_sync
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    for name in args.models:
        spec = MODELS[name]
        batch = batch_size(spec, args)
        with strategy.scope():
            model = build_model(tf, spec)
            compile_model(tf, model, tf.keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM))
        # Global batches of size x batch; the strategy splits each into per-replica batches of
        # ``batch`` (one replica per worker), so every worker computes on one per-worker batch.
        data = synthetic_data(tf, spec, size * batch, SEED + 1).with_options(options)
        timer, loss = timed_fit(tf, model, data, args, [])
        report(spec, model, rank, size, batch, args.steps, timer.seconds, loss)


# ---------------------------------------------------------------- driver: jobs


def free_ports(count: int) -> list[int]:
    """``count`` TCP ports on 127.0.0.1 that were free a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def worker_command(args: argparse.Namespace, kind: JobKind) -> list[str]:
    command = [sys.executable, os.path.abspath(__file__), "--worker", kind.worker]
    command += ["--models", *args.models, "--warmup", str(args.warmup)]
    command += ["--steps", str(args.steps), "--threads", str(args.threads)]
    if args.batch_size is not None:
        command += ["--batch-size", str(args.batch_size)]
    return command


def job_environment(kind: JobKind) -> dict[str, str]:
    """The driver's environment, without hora's or TensorFlow's job settings, for ``kind``."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("HORA_")}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.pop("TF_USE_LEGACY_KERAS", None)
    if kind.tf_keras:
        env["TF_USE_LEGACY_KERAS"] = "1"
    return env


def job_commands(args: argparse.Namespace, kind: JobKind) -> list[tuple[list[str], dict[str, str]]]:
    """The processes the driver starts for one job: ``(command, environment)`` each."""
    env, worker = job_environment(kind), worker_command(args, kind)
    if kind.worker == "hora":
        return [([sys.executable, "-m", "hora.runner.launch", "-np", str(args.np), *worker], env)]
    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(args.np)]}
    commands = []
    for index in range(args.np):
        config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
        commands.append((worker, {**env, "TF_CONFIG": json.dumps(config)}))
    return commands


def stop(processes: list[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGTERM each process's group, then SIGKILL what is left after ``grace_s``.

    Each process leads its own session, so its group holds everything it started (horarun's
    workers also stop when horarun does).
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in processes if p.poll() is None]
        for process in live:
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        for process in live:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


class JobFailed(RuntimeError):
    """A job exited with an error or ran out of time; the message holds its output's tail."""


def wait_all(processes: list[subprocess.Popen[bytes]], timeout_s: float) -> str | None:
    """Wait for every process; returns why the job failed, or ``None``."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in processes]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return f"a process exited with {failed[0]}"
        if all(c == 0 for c in codes):
            return None
        if time.monotonic() > deadline:
            return f"timed out after {timeout_s:g} s"
        time.sleep(0.2)


def run_job(args: argparse.Namespace, kind: JobKind) -> list[dict[str, Any]]:
    """Start one job, wait for it, and return its workers' results.

    Whatever happens (a failure, a timeout, Ctrl-C), no process of the job outlives this call.
    """
    with tempfile.TemporaryDirectory(prefix="keras-bench-") as folder:
        processes: list[subprocess.Popen[bytes]] = []
        logs = [os.path.join(folder, f"{i}.log") for i in range(args.np)]
        try:
            for (command, env), log in zip(job_commands(args, kind), logs):
                with open(log, "wb") as out:
                    processes.append(
                        subprocess.Popen(
                            command,
                            env=env,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
            failure = wait_all(processes, args.timeout)
        finally:
            stop(processes)
        output = "".join(read_log(log) for log in logs[: len(processes)])
    if failure:
        raise JobFailed(f"{kind.label} job: {failure}; its output ends:\n{output[-6000:]}")
    return parse_results(output, kind)


def read_log(path: str) -> str:
    with open(path, "rb") as log:
        return log.read().decode(errors="replace")


def parse_results(output: str, kind: JobKind) -> list[dict[str, Any]]:
    results = []
    for line in output.splitlines():
        _, found, payload = line.partition(RESULT)
        if found:
            results.append(json.loads(payload))
    if not results:
        raise JobFailed(f"{kind.label} job reported nothing; its output:\n{output[-6000:]}")
    return results


# ---------------------------------------------------------------- driver: results


def job_kinds(args: argparse.Namespace) -> list[JobKind]:
    names = ["hora", "mwms", *(["hora-keras3"] if args.hora_keras3 else [])]
    return [JOB_KINDS[name] for name in names]


def schedule(kinds: list[JobKind], repeats: int) -> list[JobKind]:
    """A B, B A, A B, ... (A B C, C B A, ... with three): each goes first every other round."""
    order: list[JobKind] = []
    for round_ in range(repeats):
        order += kinds if round_ % 2 == 0 else list(reversed(kinds))
    return order


def job_throughput(results: list[dict[str, Any]], model: str, np: int) -> dict[str, Any]:
    """One job's figures for ``model``: the slowest worker's time, and samples/s over all."""
    mine = sorted((r for r in results if r["model"] == model), key=lambda r: r["rank"])
    if len(mine) != np:
        raise JobFailed(f"{model}: {len(mine)} of {np} workers reported")
    seconds = max(r["seconds"] for r in mine)
    return {
        "samples_per_s": np * mine[0]["batch_size"] * mine[0]["steps"] / seconds,
        "slowest_s": seconds,
        "seconds_per_worker": [r["seconds"] for r in mine],
        "loss_per_worker": [r["loss"] for r in mine],
        "parameters": mine[0]["parameters"],
        "batch_size": mine[0]["batch_size"],
        "keras_version": mine[0]["keras_version"],
    }


def summarize(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per model: each job kind's median samples/s, its samples, and the ratios to MWMS."""
    rows = []
    for model in args.models:
        row: dict[str, Any] = {"model": model, "samples_per_s": {}, "samples": {}}
        for kind in job_kinds(args):
            figures = [r["models"][model] for r in runs if r["kind"] == kind.name]
            row["samples"][kind.name] = [f["samples_per_s"] for f in figures]
            row["samples_per_s"][kind.name] = statistics.median(row["samples"][kind.name])
            row["parameters"], row["batch_size"] = (
                figures[0]["parameters"],
                figures[0]["batch_size"],
            )
        rates = row["samples_per_s"]
        row["ratio"] = {
            name: rate / rates["mwms"] for name, rate in rates.items() if name != "mwms"
        }
        row["pass"] = row["ratio"]["hora"] >= GOAL
        rows.append(row)
    return rows


def format_table(results: dict[str, Any]) -> str:
    harness = _harness()
    kinds = [JOB_KINDS[name] for name in results["job_kinds"]]
    ratios = [k for k in kinds if k.name != "mwms"]
    header = (
        "model",
        "params",
        "batch/worker",
        *(f"{k.label} samples/s" for k in kinds),
        *(f"{k.label}/MWMS" for k in ratios),
        "result",
    )
    rows = [
        (
            r["model"],
            f"{r['parameters']:,}",
            str(r["batch_size"]),
            *(f"{r['samples_per_s'][k.name]:.0f}" for k in kinds),
            *(f"{r['ratio'][k.name]:.2f}x" for k in ratios),
            harness.verdict(r["pass"]),
        )
        for r in results["rows"]
    ]
    title = (
        f"hora {results['hora_version']} ({results['hora_revision']}) vs "
        f"tf.distribute.MultiWorkerMirroredStrategy, TensorFlow {results['tensorflow_version']}; "
        f"hora and MWMS on tf_keras {results['tf_keras_version']}; {results['np']} workers, "
        f"{results['threads']} thread(s) each; medians of {results['repeats']} jobs each"
    )
    notes = (
        f"samples/s = {results['np']} x batch x {results['steps']} timed steps / slowest "
        f"worker's time; goal hora >= {GOAL:g}x MWMS\nrun time {results['elapsed_s']:.0f} s "
        f"on {results['cpus']} CPUs; load average {results['load_before'][0]:.2f} before, "
        f"{results['load_after'][0]:.2f} after"
    )
    spread = [
        f"{r['model']} samples/s by job: "
        + "; ".join(
            f"{k.label} " + " ".join(f"{v:.0f}" for v in r["samples"][k.name]) for k in kinds
        )
        for r in results["rows"]
    ]
    return "\n".join([title, *harness.table(header, rows), *spread, notes])


def package_version(*names: str) -> str:
    """An installed package's version, from its metadata (importing TensorFlow is slow)."""
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every job, in the alternating order; returns each job's figures per model."""
    runs = []
    for number, kind in enumerate(schedule(job_kinds(args), args.repeats), start=1):
        print(f"job {number}: {kind.label} on {args.np} workers ...", flush=True)
        results = run_job(args, kind)
        models = {m: job_throughput(results, m, args.np) for m in args.models}
        runs.append({"job": number, "kind": kind.name, "models": models})
        line = ", ".join(f"{m} {v['samples_per_s']:.0f} samples/s" for m, v in models.items())
        print(f"  {line}", flush=True)
    return runs


def drive(args: argparse.Namespace) -> int:
    harness = _harness()
    started, load_before = time.perf_counter(), os.getloadavg()
    runs = run_all(args)
    results = {
        "hora_version": hora.__version__,
        "hora_revision": harness.source_revision(),
        "tensorflow_version": package_version("tensorflow", "tensorflow-cpu"),
        "tf_keras_version": package_version("tf-keras", "tf_keras"),
        "keras_version": package_version("keras"),
        "python_version": platform.python_version(),
        "cpus": os.cpu_count(),
        "np": args.np,
        "threads": args.threads,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "steps": args.steps,
        "job_kinds": [k.name for k in job_kinds(args)],
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "elapsed_s": time.perf_counter() - started,
        "rows": summarize(runs, args),
        "jobs": runs,
    }
    print(format_table(results), flush=True)
    if args.json:
        harness.write_json(args.json, results)
    return 0


def main() -> int:
    args = parse_args()
    if args.worker == "hora":
        hora_worker(args)
        return 0
    if args.worker == "mwms":
        mwms_worker(args)
        return 0
    try:
        return drive(args)
    except JobFailed as error:
        print(f"keras_training: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
