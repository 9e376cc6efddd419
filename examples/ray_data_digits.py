"""The digits CNN trained with ``HoraTrainer``, its workers fed by Ray Data instead of a sampler.

Run it (it starts a local Ray with one CPU per worker plus one for Ray Data, or joins
``--address``)::

    pip install 'hora[examples,ray]'
    python examples/ray_data_digits.py                       # 2 workers, 4 epochs
    python examples/ray_data_digits.py --num-workers 4 --address auto

The data path:

1. the driver puts the raw digits (pixel counts 0 to 16, as ``uint8``) in a Ray Dataset with an
   ``id`` column, one row per image;
2. :func:`preprocess` runs as a Ray Data ``map_batches`` step, in Ray Data's own tasks rather than
   in the training workers: it scales the pixels to [0, 1] and shapes them as 1x8x8 images;
3. ``HoraTrainer(datasets={"train": ..., "test": ...})`` hands the datasets to Ray Train, which
   splits "train" into one shard per worker (``DataConfig(datasets_to_split=["train"])``; "test"
   is read whole by every worker);
4. each worker reads its shard with ``ray.train.get_dataset_shard("train")`` and
   ``iter_torch_batches``, and trains the Horovod way (``hvd.DistributedOptimizer``).

Ray Train gives every worker the same number of rows, dropping at most ``num_workers - 1`` rows
per epoch when the rows do not divide evenly (hora's workers must take the same number of steps).
The split here keeps 1,440 training rows, which 2, 3, 4, 5, 6, 8, 9 and 10 workers divide. At the
end of every epoch the workers gather the ids they read (``hvd.allgather``) and report how many
rows were read, how many distinct ones and how many training rows were missed, so every run shows
whether each training row was read exactly once per epoch across the workers.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

# From hora's extras: when one is missing, one line says what to install, not a traceback.
try:
    import ray
    import ray.cloudpickle
    import ray.data
    import ray.train
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ModuleNotFoundError as missing:
    sys.exit(
        f"{os.path.basename(__file__)} needs {missing.name}, which is not installed: "
        "pip install 'hora[examples,ray]'"
    )

import numpy as np
import torch
import torch.nn.functional as F

import hora.torch as hvd
from hora.ray import HoraConfig, HoraTrainer

# pytorch_digits.py sits next to this file; Python finds it when this script is run directly.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pytorch_digits
from pytorch_digits import DigitsNet

# The Ray workers do not have examples/ on their path: send pytorch_digits by value.
ray.cloudpickle.register_pickle_by_value(pytorch_digits)

# 1,797 digits: 1,440 for training (divisible by many worker counts), 357 for testing.
TRAIN_ROWS = 1440
CHECKPOINT_FILE = "digits.pt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="hora on Ray Train, fed by Ray Data")
    parser.add_argument("--num-workers", type=int, default=2, help="training workers")
    parser.add_argument("--epochs", type=int, default=4, help="epochs to train")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per worker")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate of one worker")
    parser.add_argument("--seed", type=int, default=42, help="seed of the split, model and order")
    parser.add_argument(
        "--shuffle-buffer",
        type=int,
        default=256,
        help="rows each worker shuffles locally while it reads (0: read in order)",
    )
    parser.add_argument(
        "--storage-path", default=None, help="where Ray keeps checkpoints (default ~/ray_results)"
    )
    parser.add_argument("--name", default=None, help="the run's name (its folder in storage)")
    parser.add_argument(
        "--address", default=None, help="an existing Ray cluster (default: start a local one)"
    )
    return parser.parse_args(argv)


def split_ids(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The ids (row numbers in ``load_digits()``) of the training and the test rows."""
    labels = load_digits().target
    train_ids, test_ids = train_test_split(
        np.arange(len(labels)), train_size=TRAIN_ROWS, random_state=seed, stratify=labels
    )
    return np.sort(train_ids), np.sort(test_ids)


def raw_dataset(ids: np.ndarray, blocks: int) -> ray.data.Dataset:
    """The digits with these ids, unprocessed: ``id``, ``pixels`` (64 ``uint8``), ``label``.

    A real data set would come from ``ray.data.read_parquet`` (or another reader) on shared
    storage; the digits are small enough to go from the driver. ``blocks`` is the number of
    pieces Ray Data cuts them into: its unit of work, and of the split among the workers.
    """
    digits = load_digits()
    rows = [
        {"id": int(i), "pixels": digits.data[i].astype(np.uint8), "label": int(digits.target[i])}
        for i in ids
    ]
    return ray.data.from_items(rows, override_num_blocks=blocks)


def preprocess(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A Ray Data step: pixel counts 0..16 to floats in [0, 1], shaped as 1x8x8 images."""
    images = batch["pixels"].astype(np.float32).reshape(-1, 1, 8, 8) / 16.0
    return {"id": batch["id"], "image": images, "label": batch["label"]}


def make_datasets(seed: int) -> dict[str, ray.data.Dataset]:
    """``train`` and ``test``, each a raw dataset followed by :func:`preprocess`."""
    train_ids, test_ids = split_ids(seed)
    return {
        "train": raw_dataset(train_ids, blocks=16).map_batches(preprocess, batch_format="numpy"),
        "test": raw_dataset(test_ids, blocks=2).map_batches(preprocess, batch_format="numpy"),
    }


BATCH_DTYPES = {"id": torch.int64, "image": torch.float32, "label": torch.int64}


def train_epoch(
    config: dict[str, Any], model: torch.nn.Module, optimizer: Any, epoch: int
) -> tuple[float, torch.Tensor]:
    """One pass over this worker's shard; returns the mean loss over every worker and the ids read."""
    model.train()
    shard = ray.train.get_dataset_shard("train")
    total, batches, ids = torch.zeros(()), 0, []
    for batch in shard.iter_torch_batches(
        batch_size=config["batch_size"],
        dtypes=BATCH_DTYPES,
        local_shuffle_buffer_size=config["shuffle_buffer"] or None,
        local_shuffle_seed=config["seed"] + epoch,
    ):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch["image"]), batch["label"])
        loss.backward()
        optimizer.step()
        total += loss.detach()
        batches += 1
        ids.append(batch["id"])
    # Every worker took the same number of steps: Ray Train's split gives them equal rows.
    mean_loss = hvd.allreduce(total / max(batches, 1), name="train_loss").item()
    return mean_loss, torch.cat(ids)


def coverage(ids: torch.Tensor, train_ids: torch.Tensor) -> dict[str, Any]:
    """What the workers read this epoch, from every worker's ids (a collective: all ranks call it).

    Every training row was read exactly once when ``rows_read == rows_distinct == len(train_ids)``
    and ``rows_missing == 0``.
    """
    per_worker = hvd.allgather(torch.tensor([len(ids)]), name="rows_per_worker")
    every_id = hvd.allgather(ids, name="ids_read")
    return {
        "rows_read": len(every_id),
        "rows_distinct": len(torch.unique(every_id)),
        "rows_missing": int((~torch.isin(train_ids, every_id)).sum().item()),
        "id_sum": int(every_id.sum().item()),
        "rows_per_worker": per_worker.tolist(),
    }


def read_test_set() -> dict[str, torch.Tensor]:
    """The whole test set, read once: it is small, and every worker scores all of it."""
    batches = list(
        ray.train.get_dataset_shard("test").iter_torch_batches(batch_size=512, dtypes=BATCH_DTYPES)
    )
    return {key: torch.cat([batch[key] for batch in batches]) for key in BATCH_DTYPES}


@torch.no_grad()
def evaluate(model: torch.nn.Module, test_set: dict[str, torch.Tensor]) -> float:
    """Accuracy on the test set (the same on every worker: they hold the same weights)."""
    model.eval()
    predicted = model(test_set["image"]).argmax(dim=1)
    return (predicted == test_set["label"]).float().mean().item()


def train_func(config: dict[str, Any]) -> None:
    """Runs on every Ray worker: Horovod's recipe on this worker's Ray Data shard."""
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(config["seed"])
    model = DigitsNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"] * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    test_set = read_test_set()
    train_ids = torch.from_numpy(split_ids(config["seed"])[0])

    for epoch in range(config["epochs"]):
        loss, ids = train_epoch(config, model, optimizer, epoch)
        metrics = {
            "epoch": epoch + 1,
            "train_loss": loss,
            "test_accuracy": evaluate(model, test_set),
            **coverage(ids, train_ids),
        }
        # Every rank reports (ray.train.report is a barrier); only rank 0 attaches a checkpoint.
        with tempfile.TemporaryDirectory() as directory:
            checkpoint = None
            if hvd.rank() == 0:
                torch.save(model.state_dict(), os.path.join(directory, CHECKPOINT_FILE))
                checkpoint = ray.train.Checkpoint.from_directory(directory)
            ray.train.report(metrics, checkpoint=checkpoint)
    hvd.shutdown()


def make_trainer(args: argparse.Namespace) -> HoraTrainer:
    return HoraTrainer(
        train_func,
        train_loop_config={
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "seed": args.seed,
            "shuffle_buffer": args.shuffle_buffer,
        },
        hora_config=HoraConfig(timeout_s=120),
        scaling_config=ray.train.ScalingConfig(num_workers=args.num_workers),
        run_config=ray.train.RunConfig(name=args.name, storage_path=args.storage_path),
        datasets=make_datasets(args.seed),
        # Split "train" among the workers; every worker reads all of "test".
        dataset_config=ray.train.DataConfig(datasets_to_split=["train"]),
    )


def main(argv: list[str] | None = None) -> ray.train.Result:
    args = parse_args(argv)
    if args.address:
        ray.init(address=args.address)
    elif not ray.is_initialized():
        # One CPU per worker, and one left for Ray Data's reading and preprocessing tasks.
        ray.init(num_cpus=args.num_workers + 1, include_dashboard=False)
    # Ray Data's progress bars, one per dataset and worker and epoch, would drown the output.
    ray.data.DataContext.get_current().enable_progress_bars = False
    result = make_trainer(args).fit()

    rows = len(split_ids(args.seed)[0])
    for _, metrics in sorted(result.best_checkpoints, key=lambda item: item[1]["epoch"]):
        once = metrics["rows_read"] == metrics["rows_distinct"] == rows
        once = once and metrics["rows_missing"] == 0
        print(
            f"epoch {metrics['epoch']}: train loss {metrics['train_loss']:.4f}, "
            f"test accuracy {metrics['test_accuracy']:.4f}, rows per worker "
            f"{metrics['rows_per_worker']}, "
            + (
                f"every one of the {rows} training rows read once"
                if once
                else f"{metrics['rows_distinct']} distinct rows of {rows} read "
                f"({metrics['rows_read']} reads, {metrics['rows_missing']} rows missed)"
            ),
            flush=True,
        )
    print(f"checkpoint: {result.checkpoint.path if result.checkpoint else None}", flush=True)
    return result


if __name__ == "__main__":
    main()
