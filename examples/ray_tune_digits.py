"""A Ray Tune sweep in which every trial is a multi-worker ``HoraTrainer`` run on the digits.

Run it (it starts a local Ray, or joins ``--address``)::

    pip install 'hora[examples,ray]'
    python examples/ray_tune_digits.py                          # 2 trials x 2 workers, 4 epochs
    python examples/ray_tune_digits.py --lrs 0.05 0.02 1e-5 --max-concurrent-trials 2

This is Ray Train V2's way of putting a trainer under Tune: each Tune trial runs
:func:`launch_trial`, a small driver function that builds a ``HoraTrainer`` from the trial's
hyperparameters and calls ``fit()``. The workers run ray_digits.py's training function unchanged
(Horovod's recipe, a checkpoint from rank 0 every epoch, resuming from
``ray.train.get_checkpoint()``). ``TuneReportCallback`` forwards every ``ray.train.report`` to the
trial, with the path of the checkpoint it carried, so Tune's scheduler sees each epoch:
``ASHAScheduler`` stops a trial whose test accuracy trails the others at a rung.

The search space is a grid over the learning rate, the good value first and an obviously bad one
(1e-5) second: with one trial at a time, the bad trial reaches the first rung after the good one
has recorded its accuracy there, and ASHA stops it after one epoch.

Each trial's Train run is named after the trial, under the sweep's storage: when Tune retries a
failed trial (``--max-trial-failures``), the new ``HoraTrainer`` finds the run's checkpoints and
its workers resume from the latest one.

A stopped trial's workers are freed by Ray Train's placement-group cleaner, which needs Ray's
dashboard (``ray[default]``, part of ``hora[ray]``); without it their CPUs stay reserved until the
script ends, and the script warns.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

# From hora's extras: when one is missing, one line says what to install, not a traceback.
try:
    import ray
    import ray.cloudpickle
    import ray.train
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback
except ModuleNotFoundError as missing:
    sys.exit(
        f"{os.path.basename(__file__)} needs {missing.name}, which is not installed: "
        "pip install 'hora[examples,ray]'"
    )

from hora.ray import HoraConfig, HoraTrainer

# ray_digits.py (and the pytorch_digits.py it imports) sit next to this file.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ray_digits

# The trial actors and the workers do not have examples/ on their path: send the module's
# functions by value (ray_digits registers pytorch_digits the same way).
ray.cloudpickle.register_pickle_by_value(ray_digits)

METRIC = "test_accuracy"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="hora on Ray Tune: a sweep of HoraTrainer runs")
    parser.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=[0.05, 1e-5],
        help="learning rates of one worker to try, in this order (a grid)",
    )
    parser.add_argument("--num-workers", type=int, default=2, help="workers of every trial")
    parser.add_argument(
        "--epochs", type=int, default=4, help="epochs of a trial that is not stopped"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per worker")
    parser.add_argument("--seed", type=int, default=42, help="seed of the split, model and order")
    parser.add_argument(
        "--max-concurrent-trials", type=int, default=1, help="trials that run at the same time"
    )
    parser.add_argument(
        "--max-trial-failures", type=int, default=1, help="retries of a failed trial (Tune)"
    )
    parser.add_argument(
        "--storage-path",
        default=None,
        help="where Tune and Train keep results and checkpoints (default ~/ray_results)",
    )
    parser.add_argument("--name", default="hora_tune_digits", help="the sweep's name")
    parser.add_argument(
        "--address", default=None, help="an existing Ray cluster (default: start a local one)"
    )
    return parser.parse_args(argv)


def launch_trial(config: dict[str, Any], *, num_workers: int, storage_path: str) -> None:
    """One Tune trial: a ``HoraTrainer`` run of ``num_workers`` with this trial's ``config``.

    It runs in the trial's actor, which mostly waits: the workers ask for their CPUs through the
    ``ScalingConfig``, and the Train controller that ``fit()`` starts asks for none.
    """
    context = ray.tune.get_context()
    trainer = HoraTrainer(
        ray_digits.train_func,
        train_loop_config=config,
        hora_config=HoraConfig(timeout_s=120),
        scaling_config=ray.train.ScalingConfig(
            num_workers=num_workers, resources_per_worker={"CPU": 1}
        ),
        run_config=ray.train.RunConfig(
            # The same name when Tune retries this trial: the new run resumes from its
            # checkpoints instead of starting over.
            name=f"{context.get_experiment_name()}-{context.get_trial_id()}",
            storage_path=storage_path,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1),
            callbacks=[TuneReportCallback()],
        ),
    )
    trainer.fit()


def make_tuner(args: argparse.Namespace) -> ray.tune.Tuner:
    """The sweep: a grid over the learning rate, ASHA on the test accuracy of every epoch."""
    storage_path = args.storage_path or os.path.expanduser("~/ray_results")
    param_space = {
        "lr": ray.tune.grid_search(args.lrs),
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "seed": args.seed,
    }
    scheduler = ray.tune.schedulers.ASHAScheduler(
        time_attr="epoch",
        max_t=args.epochs,
        grace_period=1,
        reduction_factor=2,
        # A trial that reaches max_t ends on its own (its training function returns), rather
        # than being stopped at its last report.
        stop_last_trials=False,
    )
    return ray.tune.Tuner(
        ray.tune.with_resources(
            ray.tune.with_parameters(
                launch_trial, num_workers=args.num_workers, storage_path=storage_path
            ),
            # Tune places no trial that asks for nothing: the waiting driver holds one CPU.
            {"cpu": 1},
        ),
        param_space=param_space,
        tune_config=ray.tune.TuneConfig(
            metric=METRIC,
            mode="max",
            scheduler=scheduler,
            max_concurrent_trials=args.max_concurrent_trials,
        ),
        run_config=ray.tune.RunConfig(
            name=args.name,
            storage_path=storage_path,
            failure_config=ray.tune.FailureConfig(max_failures=args.max_trial_failures),
        ),
    )


def main(argv: list[str] | None = None) -> ray.tune.ResultGrid:
    args = parse_args(argv)
    context = None
    if args.address:
        context = ray.init(address=args.address)
    elif not ray.is_initialized():
        # Per running trial: its workers' CPUs and one for its driver. The dashboard (on by
        # default with ray[default]) serves the state API that Ray Train's placement-group
        # cleaner uses to free the workers of a trial that ASHA stops.
        cpus = (args.num_workers + 1) * args.max_concurrent_trials
        context = ray.init(num_cpus=cpus)
    if context is not None and not context.dashboard_url:
        print(
            "warning: this Ray cluster has no dashboard, so the CPUs of a trial that ASHA stops "
            "stay reserved until this script ends and later trials may wait for them forever; "
            'pip install "ray[default]" (see docs/ray.md)',
            file=sys.stderr,
            flush=True,
        )
    results = make_tuner(args).fit()

    for result in results:
        metrics = result.metrics or {}
        print(
            f"lr {result.config['lr']:g}: {metrics.get('epoch')} epoch(s), "
            f"test accuracy {metrics.get(METRIC, float('nan')):.4f}",
            flush=True,
        )
    best = results.get_best_result(metric=METRIC, mode="max", scope="all")
    best_metrics = best.metrics or {}
    print(
        f"best: lr {best.config['lr']:g}, test accuracy {best_metrics.get(METRIC, float('nan')):.4f}",
        flush=True,
    )
    # TuneReportCallback passes the path of the Train checkpoint with the metrics.
    print(f"best checkpoint: {best_metrics.get('checkpoint_path')}", flush=True)
    return results


if __name__ == "__main__":
    main()
