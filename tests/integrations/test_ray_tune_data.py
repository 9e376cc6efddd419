"""HoraTrainer under Ray Tune, and fed by Ray Data: the two examples, end to end on local Ray.

examples/ray_tune_digits.py (a sweep of two 2-worker trials with ASHA) and
examples/ray_data_digits.py (2 workers reading Ray Data shards) run in this process, on one local
Ray cluster for the module: 3 logical CPUs (two workers, plus one for the Tune trial's driver or
for Ray Data's tasks) and Ray's dashboard, whose state API Ray Train's placement-group cleaner
needs to release the workers of a trial that Tune stops. A third test retries a failed trial,
whose new HoraTrainer resumes from the first attempt's checkpoint. On a 2-core machine the sweep
takes 60 to 80 s, the retry 35 to 60 s and the Ray Data run 32 to 42 s, so they are marked slow
(CI runs them: `./dev test` deselects nothing).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[integrations]'")
pytest.importorskip(
    "ray.tune", reason="ray.tune is not installed: pip install -e '.[integrations]'"
)
pytest.importorskip(
    "ray.data", reason="ray.data is not installed: pip install -e '.[integrations]'"
)
pytest.importorskip("sklearn", reason="scikit-learn is not installed: pip install -e '.[dev]'")

import ray
import ray.cloudpickle

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import ray_data_digits  # noqa: E402
import ray_tune_digits  # noqa: E402
from pytorch_digits import DigitsNet, load_data  # noqa: E402

# Imported here, not run as scripts: their functions must reach Ray's workers by value too, as
# must this module's.
ray.cloudpickle.register_pickle_by_value(ray_tune_digits)
ray.cloudpickle.register_pickle_by_value(ray_data_digits)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Ray Data warns about its own deprecated settings when Ray Train starts.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CPUS = 3
GOOD_LR, BAD_LR = 0.05, 1e-5


@pytest.fixture(scope="module")
def ray_cluster():
    """Local Ray with 3 CPUs and the dashboard, for this module only.

    A Ray this process already runs is shut down first: the sweep needs both the third CPU and
    the dashboard, which another module's cluster may lack.
    """
    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        num_cpus=CPUS,
        include_dashboard=True,
        logging_level="WARNING",
        configure_logging=True,
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def wait_for_free_cpus(expected: float, timeout_s: float) -> float:
    """Ray's free CPUs once they reach ``expected``, or what they are after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    free = ray.available_resources().get("CPU", 0.0)
    while free < expected and time.monotonic() < deadline:
        time.sleep(1)
        free = ray.available_resources().get("CPU", 0.0)
    return free


def checkpoint_accuracy(checkpoint_path: str, seed: int) -> tuple[int, float]:
    """The epoch and the test accuracy of the model in a ray_digits.py checkpoint."""
    state = torch.load(
        os.path.join(checkpoint_path, ray_tune_digits.ray_digits.CHECKPOINT_FILE),
        map_location="cpu",
    )
    model = DigitsNet()
    model.load_state_dict(state["model"])
    model.eval()
    _, test_set = load_data(seed)
    images, labels = test_set.tensors
    with torch.no_grad():
        accuracy = (model(images).argmax(dim=1) == labels).float().mean().item()
    return int(state["epoch"]), accuracy


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_tune_sweep_of_hora_trainer_runs_stops_the_bad_trial(ray_cluster, tmp_path):
    epochs = 3
    results = ray_tune_digits.main(
        [
            "--lrs",
            str(GOOD_LR),
            str(BAD_LR),
            "--epochs",
            str(epochs),
            "--storage-path",
            str(tmp_path),
            "--name",
            "sweep",
        ]
    )

    assert results.num_errors == 0, [r.error for r in results]
    assert len(results) == 2
    by_lr = {result.config["lr"]: result for result in results}
    good, bad = by_lr[GOOD_LR], by_lr[BAD_LR]
    # The good trial trained every epoch; every report reached Tune, one per epoch.
    assert good.metrics["epoch"] == epochs
    assert good.metrics["training_iteration"] == epochs
    assert good.metrics["test_accuracy"] > 0.8
    # ASHA stopped the bad trial at its first rung: its function would have reported 3 epochs.
    assert bad.metrics["epoch"] == 1
    assert bad.metrics["test_accuracy"] < good.metrics["test_accuracy"]

    best = results.get_best_result(metric="test_accuracy", mode="max", scope="all")
    assert best.config["lr"] == GOOD_LR
    # TuneReportCallback passed the path of the Train checkpoint rank 0 reported with the
    # metrics: its model scores the reported accuracy.
    epoch, accuracy = checkpoint_accuracy(best.metrics["checkpoint_path"], seed=42)
    assert epoch == epochs
    assert accuracy == pytest.approx(best.metrics["test_accuracy"], abs=1e-6)
    # Each trial's Train run is stored under the sweep's storage, named after the trial.
    assert Path(best.metrics["checkpoint_path"]).parent.name.startswith("sweep-")

    # The stopped trial's workers were released: every CPU is free again.
    assert wait_for_free_cpus(CPUS, timeout_s=60) == CPUS


def resumable_train(config: dict) -> None:
    """A HoraTrainer worker: one allreduce per epoch, resuming after the latest checkpoint."""
    import ray.train

    import hora.torch as hvd

    hvd.init()
    start_epoch = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None and hvd.rank() == 0:
        with checkpoint.as_directory() as directory:
            start_epoch = int(Path(directory, "epoch.txt").read_text())
    start_epoch = hvd.broadcast_object(start_epoch, root_rank=0, name="start_epoch")
    for epoch in range(start_epoch, config["epochs"]):
        ranks = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="ranks").item()
        with tempfile.TemporaryDirectory() as directory:
            reported = None
            if hvd.rank() == 0:
                Path(directory, "epoch.txt").write_text(str(epoch + 1))
                reported = ray.train.Checkpoint.from_directory(directory)
            metrics = {"epoch": epoch + 1, "start_epoch": start_epoch, "ranks": ranks}
            ray.train.report(metrics, checkpoint=reported)


def flaky_trial(config: dict, *, storage_path: str) -> None:
    """A Tune trial whose first attempt fails after one epoch, checkpoint reported."""
    import ray.train
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from hora.ray import HoraConfig, HoraTrainer

    trial_id = ray.tune.get_context().get_trial_id()
    marker = Path(storage_path, f"attempted-{trial_id}")
    first_attempt = not marker.exists()
    marker.touch()
    HoraTrainer(
        resumable_train,
        train_loop_config={"epochs": 1 if first_attempt else config["epochs"]},
        hora_config=HoraConfig(timeout_s=60),
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(
            name=f"flaky-{trial_id}", storage_path=storage_path, callbacks=[TuneReportCallback()]
        ),
    ).fit()
    if first_attempt:
        raise RuntimeError("the trial's first attempt fails after its first checkpoint")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_retried_tune_trial_resumes_its_hora_trainer_run(ray_cluster, tmp_path):
    import ray.tune

    tuner = ray.tune.Tuner(
        ray.tune.with_parameters(flaky_trial, storage_path=str(tmp_path)),
        param_space={"epochs": 2},
        run_config=ray.tune.RunConfig(
            name="flaky",
            storage_path=str(tmp_path),
            failure_config=ray.tune.FailureConfig(max_failures=1),
        ),
    )
    results = tuner.fit()

    assert results.num_errors == 0, [r.error for r in results]
    (result,) = list(results)
    # The second attempt found the first one's checkpoint (epoch 1) and trained epoch 2 only.
    assert result.metrics["epoch"] == 2
    assert result.metrics["start_epoch"] == 1
    assert result.metrics["ranks"] == 2.0
    assert len(list(tmp_path.glob("attempted-*"))) == 1
    assert wait_for_free_cpus(CPUS, timeout_s=60) == CPUS


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_data_shards_give_every_row_once_per_epoch(ray_cluster, tmp_path):
    epochs = 2
    result = ray_data_digits.main(
        ["--epochs", str(epochs), "--num-workers", "2", "--storage-path", str(tmp_path)]
    )

    assert result.error is None
    train_ids, _ = ray_data_digits.split_ids(seed=42)
    assert len(train_ids) == 1440
    reported = sorted((m for _, m in result.best_checkpoints), key=lambda m: m["epoch"])
    assert [m["epoch"] for m in reported] == list(range(1, epochs + 1))
    for metrics in reported:
        # Across the two workers, every training row exactly once: as many reads as rows, all
        # distinct, none missed, and the ids add up to the training ids' sum.
        assert metrics["rows_read"] == metrics["rows_distinct"] == len(train_ids), metrics
        assert metrics["rows_missing"] == 0, metrics
        assert metrics["id_sum"] == int(train_ids.sum()), metrics
        # Ray Train's split gives the two workers equal halves.
        assert metrics["rows_per_worker"] == [720, 720], metrics
    # The model learned from the preprocessed batches (chance is 0.1).
    assert reported[-1]["test_accuracy"] > 0.5
    assert wait_for_free_cpus(CPUS, timeout_s=60) == CPUS


def test_ray_data_preprocessing_scales_and_shapes_the_pixels():
    import numpy as np

    batch = {
        "id": np.array([3, 8]),
        "pixels": np.array([[0] * 63 + [16], [8] * 64], dtype=np.uint8),
        "label": np.array([1, 2]),
    }
    out = ray_data_digits.preprocess(batch)
    assert out["image"].shape == (2, 1, 8, 8) and out["image"].dtype == np.float32
    assert out["image"][0, 0, 7, 7] == 1.0 and out["image"][0].sum() == 1.0
    assert np.all(out["image"][1] == 0.5)
    assert out["id"].tolist() == [3, 8] and out["label"].tolist() == [1, 2]
