"""hora.ray on a real local Ray cluster: HoraTrainer (Ray Train V2) and RayExecutor.

One Ray cluster (2 CPUs) serves the whole module: starting Ray costs 10+ s. A 2-worker
``HoraTrainer.fit()`` costs about 30 s here (Ray starts a controller and two worker processes),
so every test is marked slow.

Worker functions are defined in this module; Ray pickles them (and what they use from here) by
value, so the workers need not import the test package.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
from torch import nn

pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[integrations]'")

import ray
import ray.cloudpickle

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Ray Data warns about its own deprecated settings when Ray Train starts.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")

FEATURES = 4
ROWS = 16  # per worker
STEPS = 4  # epochs of one full-batch step each
LR = 0.1
MOMENTUM = 0.9


# ------------------------------------------------------------------ the training problem


def make_problem(world: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The same data on every process: ``world * ROWS`` rows of a noisy linear target."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(world * ROWS, FEATURES, generator=gen)
    w = torch.randn(FEATURES, 1, generator=gen)
    y = x @ w + 0.1 * torch.randn(world * ROWS, 1, generator=gen)
    return x, y


def make_model() -> nn.Module:
    torch.manual_seed(7)
    return nn.Linear(FEATURES, 1)


def reference_state(steps: int) -> dict[str, torch.Tensor]:
    """One process, the whole batch: what data-parallel training must reproduce."""
    x, y = make_problem()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def secret_digest() -> str:
    """A short, one-way digest of this start's job secret (never the secret itself)."""
    return hashlib.sha256(os.environ["HORA_SECRET_KEY"].encode()).hexdigest()[:12]


def train_loop(config: dict) -> None:
    """Runs on every HoraTrainer worker: Horovod-style training on this rank's rows.

    Resumes from ``ray.train.get_checkpoint()`` (rank 0 reads it, then broadcasts). With
    ``config["fail"]``, rank 1 kills its process after the second epoch's checkpoint is on
    record, in the first attempt only (the attempt without a checkpoint).
    """
    import ray.train

    import hora.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    context = ray.train.get_context()
    rank, size = hvd.rank(), hvd.size()
    x, y = make_problem(size)
    x, y = x[rank * ROWS : (rank + 1) * ROWS], y[rank * ROWS : (rank + 1) * ROWS]

    model = make_model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
        named_parameters=model.named_parameters(),
    )
    start_epoch = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None and rank == 0:
        with checkpoint.as_directory() as directory:
            state = torch.load(os.path.join(directory, "state.pt"), map_location="cpu")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"]
    start_epoch = hvd.broadcast_object(start_epoch, root_rank=0, name="start_epoch")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    # hora's topology is Ray's: the same ranks, local ranks and world size.
    mine = torch.tensor(
        [
            int(rank == context.get_world_rank()),
            int(size == context.get_world_size()),
            int(hvd.local_rank() == context.get_local_rank()),
        ]
    )
    topology_ok = bool(hvd.allreduce(mine, op=hvd.Min, name="topology_ok").min().item())
    torch_ok = None
    if config.get("torch_distributed"):
        # HoraConfig(init_torch_distributed=True): torch.distributed works next to hora.
        import torch.distributed as dist

        ranks = torch.tensor([float(rank)])
        dist.all_reduce(ranks)
        torch_ok = dist.get_rank() == rank and ranks.item() == size * (size - 1) / 2

    for epoch in range(start_epoch, config["epochs"]):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        mean_loss = hvd.allreduce(loss.detach(), name="loss").item()
        # Every rank must hold the same weights: rank 0 sees all of them.
        gathered = hvd.allgather(flat_params(model).unsqueeze(0), name="params")
        spread = (gathered - gathered[0]).abs().max().item()
        metrics = {
            "epoch": epoch + 1,
            "loss": mean_loss,
            "param_spread": spread,
            "start_epoch": start_epoch,
            "size": size,
            "topology_ok": topology_ok,
            "torch_ok": torch_ok,
            "store": os.environ["HORA_RENDEZVOUS_ADDR"],
            "secret": secret_digest(),
        }
        with tempfile.TemporaryDirectory() as directory:
            reported = None
            if rank == 0:
                state = {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "epoch": epoch + 1,
                }
                torch.save(state, os.path.join(directory, "state.pt"))
                reported = ray.train.Checkpoint.from_directory(directory)
            ray.train.report(metrics, checkpoint=reported)
        if config.get("fail") and start_epoch == 0 and epoch == 1 and rank == 1:
            # Wait until the controller has registered epoch 2's checkpoint, then crash.
            ray.train.get_all_reported_checkpoints(timeout_s=60)
            os._exit(1)
    hvd.shutdown()


def load_state(result) -> dict:
    with result.checkpoint.as_directory() as directory:
        return torch.load(os.path.join(directory, "state.pt"), map_location="cpu")


def assert_matches_reference(state: dict, steps: int) -> None:
    expected = reference_state(steps)
    for key, value in expected.items():
        torch.testing.assert_close(state["model"][key], value, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the cluster


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster with 2 CPUs for the module (reused if the session has one)."""
    if ray.is_initialized():
        yield ray
        return
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        logging_level="WARNING",
        configure_logging=True,
    )
    try:
        yield ray
    finally:
        ray.shutdown()


# ------------------------------------------------------------------ HoraTrainer


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hora_trainer_trains_like_one_process(ray_cluster, tmp_path):
    """Two workers match one process on the whole batch (torch.distributed set up as well)."""
    import ray.train

    from hora.ray import HoraConfig, HoraTrainer

    trainer = HoraTrainer(
        train_loop,
        train_loop_config={"epochs": STEPS, "torch_distributed": True},
        hora_config=HoraConfig(timeout_s=60, init_torch_distributed=True),
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(name="hora_trains", storage_path=str(tmp_path)),
    )
    result = trainer.fit()

    assert result.error is None
    metrics = result.metrics
    assert metrics["epoch"] == STEPS and metrics["size"] == 2
    assert metrics["topology_ok"] is True
    assert metrics["torch_ok"] is True
    assert metrics["param_spread"] == 0.0, "the workers' weights differ"
    # Both workers are on this node: the store listens on loopback only.
    assert metrics["store"] == "127.0.0.1"
    state = load_state(result)
    assert state["epoch"] == STEPS
    assert_matches_reference(state, STEPS)
    # Every report's checkpoint reached the Result, with its metrics.
    epochs = sorted(m["epoch"] for _, m in result.best_checkpoints)
    assert epochs == list(range(1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hora_trainer_recovers_from_a_worker_crash(ray_cluster, tmp_path):
    import ray.train

    from hora.ray import HoraConfig, HoraTrainer

    trainer = HoraTrainer(
        train_loop,
        train_loop_config={"epochs": STEPS, "fail": True},
        hora_config=HoraConfig(timeout_s=60, shutdown_timeout_s=10),
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(
            name="hora_recovers",
            storage_path=str(tmp_path),
            failure_config=ray.train.FailureConfig(max_failures=1),
        ),
    )
    result = trainer.fit()

    assert result.error is None
    # The second attempt resumed from the checkpoint of epoch 2, reported before the crash.
    assert result.metrics["start_epoch"] == 2
    assert result.metrics["epoch"] == STEPS
    assert result.metrics["param_spread"] == 0.0
    state = load_state(result)
    assert state["epoch"] == STEPS
    # Resuming (weights and momentum through the checkpoint) changes nothing in the result.
    assert_matches_reference(state, STEPS)
    reported = sorted(
        (m["epoch"], m["start_epoch"], m["secret"]) for _, m in result.best_checkpoints
    )
    assert [(e, s) for e, s, _ in reported] == [(1, 0), (2, 0), (3, 2), (4, 2)]
    # Each attempt had its own job secret (and so its own store namespace).
    first, second = {d for _, s, d in reported if s == 0}, {d for _, s, d in reported if s == 2}
    assert len(first) == len(second) == 1 and first != second


# ------------------------------------------------------------------ RayExecutor


class Counter:
    """An executable for RayExecutor.start(executable_cls=...)."""

    def __init__(self, base: int, step: int = 1) -> None:
        self.value = base
        self.step = step

    def bump(self) -> int:
        self.value += self.step
        return self.value


def allreduce_rank(scale: float, name: str = "x") -> tuple:
    import hora.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([scale * hvd.rank()]), op=hvd.Sum, name=name)
    return (
        hvd.rank(),
        hvd.size(),
        hvd.local_rank(),
        hvd.local_size(),
        hvd.cross_rank(),
        hvd.cross_size(),
        total.item(),
        os.environ.get("HORA_TEST_MARK"),
    )


def reinit_and_average() -> float:
    """A fresh hvd.init() after hvd.shutdown() in the same worker process."""
    import hora.torch as hvd

    hvd.shutdown()
    hvd.init()
    value = hvd.allreduce(torch.tensor([float(hvd.rank())]), name="again").item()
    hvd.shutdown()
    return value


def worker_env(name: str) -> str | None:
    return os.environ.get(name)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ray_executor_runs_hora_collectives(ray_cluster):
    from hora.ray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, num_workers=2, cpus_per_worker=1)
    executor.start(
        executable_cls=Counter,
        executable_args=[10],
        executable_kwargs={"step": 5},
        extra_env_vars={"HORA_TEST_MARK": "marked"},
    )
    try:
        # run: one value per worker, in rank order; the collective spans both workers.
        results = executor.run(allreduce_rank, args=[2.0], kwargs={"name": "first"})
        assert results == [
            (0, 2, 0, 2, 0, 1, 2.0, "marked"),
            (1, 2, 1, 2, 0, 1, 2.0, "marked"),
        ]
        # run_remote: object refs, one per rank.
        refs = executor.run_remote(allreduce_rank, kwargs={"scale": 3.0, "name": "second"})
        assert len(refs) == 2
        assert [r[6] for r in ray.get(refs)] == [3.0, 3.0]
        # execute: fn(executable) on every worker; execute_single: rank 0 only.
        assert executor.execute(lambda counter: counter.bump()) == [15, 15]
        assert executor.execute_single(lambda counter: counter.bump()) == 20
        assert executor.execute(lambda counter: counter.value) == [20, 15]
        # hvd.shutdown() then hvd.init() again inside the same workers and store.
        assert executor.run(reinit_and_average) == [0.5, 0.5]
        first_secret = executor.run(worker_env, args=["HORA_SECRET_KEY"])
        assert first_secret[0] and first_secret[0] == first_secret[1]
        # The secret was made in rank 0's worker and reached the others sealed: the driver
        # never held it.
        assert first_secret[0] not in repr(vars(executor._rendezvous))
        assert first_secret[0] not in os.environ.values()
        assert executor.run(worker_env, args=["HORA_RENDEZVOUS_ADDR"]) == ["127.0.0.1"] * 2
        workers = list(executor.workers)
    finally:
        executor.shutdown()

    with pytest.raises(RuntimeError, match="start"):
        executor.run(allreduce_rank, args=[1.0])
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(workers[0].env_vars.remote(), timeout=30)

    # A second start: new workers, a new store and a new secret.
    executor.start()
    try:
        assert [r[6] for r in executor.run(allreduce_rank, args=[1.0])] == [1.0, 1.0]
        second_secret = executor.run(worker_env, args=["HORA_SECRET_KEY"])
        assert second_secret[0] != first_secret[0]
        assert executor.execute(lambda executable: executable) == [None, None]
    finally:
        executor.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_ray_executor_arguments():
    from hora.ray import RayExecutor
    from hora.ray._setup import place, settings_env

    with pytest.raises(NotImplementedError, match="HoraTrainer"):
        RayExecutor(None, min_workers=1, max_workers=2)
    with pytest.raises(ValueError, match="min_workers"):
        RayExecutor(None, max_workers=2)
    with pytest.raises(ValueError, match="use_gpu"):
        RayExecutor(None, num_workers=2, gpus_per_worker=1)
    with pytest.raises(RuntimeError, match="start"):
        RayExecutor(None, num_workers=2).run(print)
    with pytest.raises(ValueError, match="one network interface"):
        settings_env(nics={"eth0", "eth1"})
    assert settings_env(nics={"eth0"}, fusion_threshold=1024) == {
        "HORA_GLOO_IFACE": "eth0",
        "HORA_FUSION_THRESHOLD": "1024",
    }
    # Horovod's local and cross ranks, nodes interleaved or not.
    placed = place(["a", "b", "a", "b", "a"])
    assert [(p.local_rank, p.local_size, p.cross_rank, p.cross_size) for p in placed] == [
        (0, 3, 0, 2),
        (0, 2, 1, 2),
        (1, 3, 0, 2),
        (1, 2, 1, 2),
        (2, 3, 0, 1),
    ]
    assert placed[4].env()["HOROVOD_CROSS_SIZE"] == "1"


# ------------------------------------------------------------------ the optional extra


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_importing_hora_does_not_import_ray():
    code = textwrap.dedent(
        """
        import sys
        import hora, hora.torch
        assert "ray" not in sys.modules, "import hora imported ray"
        sys.modules["ray"] = None  # as if Ray were not installed
        try:
            import hora.ray
        except ImportError as exc:
            assert "pip install 'hora[ray]'" in str(exc), exc
        else:
            raise AssertionError("import hora.ray without Ray did not fail")
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
