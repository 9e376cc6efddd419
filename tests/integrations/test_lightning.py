"""hora.lightning: a real Lightning ``Trainer`` with ``strategy="hora"``, launched by horarun.

Starting a process that imports Lightning costs several seconds here, so one horarun job per
world size trains every scenario (``python tests/integrations/test_lightning.py OUT`` is the
worker; see :func:`_worker`) and the tests check what its ranks saved. Each scenario must end
with the parameters that single-process training reaches when every step takes the union of the
ranks' batches: Lightning's ``DistributedSampler`` gives rank ``r`` the entries ``r::world`` of
one seeded permutation, and the reference takes the same permutation whole.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

L = pytest.importorskip(
    "lightning", reason="Lightning is not installed: pip install -e '.[integrations]'"
)

import hora.lightning  # noqa: E402 - registers strategy="hora"
from hora.lightning import HoraEnvironment, HoraStrategy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HORARUN = [sys.executable, "-m", "hora.runner.launch"]
EXAMPLE = ROOT / "examples" / "lightning_digits.py"

ROWS = 24  # divisible by 2 and 3: every rank gets as many rows, and no sampler padding
BATCH = 4  # per rank
SCENARIOS = ("plain", "accumulate", "manual", "two_optimizers", "syncbn")
# Lightning's DistributedSampler is seeded with PL_GLOBAL_SEED (default 0); so is the reference.
SEED = int(os.environ.get("PL_GLOBAL_SEED", "0"))
ATOL = 1e-5


# ------------------------------------------------------------------ the training problem


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(ROWS, 4, generator=gen)
    y = x @ torch.randn(4, 1, generator=gen) + 0.1 * torch.randn(ROWS, 1, generator=gen)
    return TensorDataset(x, y)


class Regressor(L.LightningModule):
    """A small MLP with mean squared error; SGD with momentum and a step schedule (or, with
    ``two_optimizers``, one SGD for each linear layer, stepped by hand)."""

    def __init__(
        self, batch_norm: bool = False, manual: bool = False, two_optimizers: bool = False
    ) -> None:
        super().__init__()
        self.two_optimizers = two_optimizers
        layers: list[nn.Module] = [nn.Linear(4, 8)]
        if batch_norm:
            layers.append(nn.BatchNorm1d(8))
        layers += [nn.Tanh(), nn.Linear(8, 1)]
        self.net = nn.Sequential(*layers)
        self.automatic_optimization = not (manual or two_optimizers)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        if self.automatic_optimization:
            return loss
        if self.two_optimizers:
            first, second = self.optimizers()
            first.zero_grad()
            second.zero_grad()
            self.manual_backward(loss)
            first.step()
            second.step()
            return None
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        # Manual clipping sees averaged gradients: they are reduced right after backward.
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        optimizer.step()
        return None

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        if self.two_optimizers:
            first, second = self.net[0], self.net[-1]
            return (
                torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9),
                torch.optim.Adam(second.parameters(), lr=0.01),
            )
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return [optimizer], [scheduler]


def make_trainer(scenario: str, world: int, distributed: bool, seed: int) -> tuple[Any, Any]:
    """The module (initialised from ``seed``) and trainer of one scenario."""
    torch.manual_seed(seed)
    module = Regressor(
        batch_norm=scenario == "syncbn",
        manual=scenario == "manual",
        two_optimizers=scenario == "two_optimizers",
    )
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 3,
        "enable_checkpointing": False,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    if scenario == "accumulate":
        # 3 batches per epoch at np=2: a window of 2, then a short one of 1.
        options.update(accumulate_grad_batches=2, gradient_clip_val=0.05)
    if scenario == "syncbn" and distributed:
        options["sync_batchnorm"] = True  # batch statistics over the union of the ranks' batches
    strategy: Any = "auto"
    if distributed:
        strategy = "hora" if scenario == "plain" else HoraStrategy()
    return module, L.Trainer(strategy=strategy, **options)


def train_loader(world: int, distributed: bool) -> DataLoader:
    data = dataset()
    if distributed:
        return DataLoader(data, batch_size=BATCH)  # Lightning adds a DistributedSampler
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    return DataLoader(data, batch_size=BATCH * world, sampler=sampler)


def state_of(module: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ------------------------------------------------------------------ the worker (under horarun)


def _collectives(strategy: Any, rank: int, world: int) -> dict[str, Any]:
    x = torch.tensor([float(rank + 1)], requires_grad=True)
    stacked = strategy.all_gather(x, sync_grads=True)
    (stacked.squeeze(1) * torch.arange(1.0, world + 1)).sum().backward()
    assert x.grad is not None
    strategy.barrier("collectives")
    return {
        "mean": strategy.reduce(torch.tensor(float(rank + 1))),
        "sum": strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="sum"),
        "max": strategy.reduce(torch.tensor([rank, -rank]), reduce_op="max"),
        "int_mean": strategy.reduce(torch.tensor(rank)),
        "not_a_tensor": strategy.reduce(3.5),
        "gather": strategy.all_gather(torch.tensor([rank, 10 * rank])),
        "gather_scalar": strategy.all_gather(torch.tensor(float(rank))),
        "gather_grad": x.grad.clone(),
        "broadcast": strategy.broadcast({"from": rank, "text": f"rank {rank}"}, src=world - 1),
        "any": strategy.reduce_boolean_decision(rank == 0, all=False),
        "all": strategy.reduce_boolean_decision(rank == 0, all=True),
    }


def _worker(out_dir: str) -> None:
    from lightning_utilities.core.rank_zero import rank_zero_only

    import hora.torch as hvd

    torch.set_num_threads(1)
    rank, world = int(os.environ["HORA_RANK"]), int(os.environ["HORA_SIZE"])
    saved: dict[str, Any] = {}
    for scenario in SCENARIOS:
        # Every rank starts from different weights: setup must broadcast rank 0's.
        module, trainer = make_trainer(scenario, world, distributed=True, seed=rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, train_dataloaders=train_loader(world, distributed=True))
        saved[scenario] = {
            "state": state_of(module),
            "warnings": [str(w.message) for w in caught if "step()" in str(w.message)],
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        }
        if scenario != "plain":
            continue
        strategy = trainer.strategy
        sampler = trainer.train_dataloader.sampler
        saved["topology"] = {
            "strategy": type(strategy).__name__,
            "environment": type(strategy.cluster_environment).__name__,
            "detect": HoraEnvironment.detect(),
            "ranks": (
                trainer.world_size,
                trainer.global_rank,
                trainer.local_rank,
                trainer.node_rank,
            ),
            "hvd": (hvd.size(), hvd.rank(), hvd.local_rank()),
            "is_global_zero": trainer.is_global_zero,
            "rank_zero_only": rank_zero_only.rank,
            "sampler": (type(sampler).__name__, sampler.num_replicas, sampler.rank),
            "sampler_kwargs": strategy.distributed_sampler_kwargs,
            "device": str(strategy.root_device),
        }
        # A second stage in the same process: hora is still running after fit's teardown.
        tested = trainer.test(module, dataloaders=DataLoader(dataset(), batch_size=BATCH))
        saved["test"] = tested[0]["test_loss"]
        saved["collectives"] = _collectives(strategy, rank, world)
    torch.save(saved, Path(out_dir) / f"rank{rank}.pt")


# ------------------------------------------------------------------ running the jobs


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    result.elapsed = time.monotonic() - started  # type: ignore[attr-defined]
    assert result.returncode == 0, (
        f"{' '.join(command)} exited with {result.returncode}\n"
        f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return result


_jobs: dict[int, list[dict[str, Any]]] = {}
_references: dict[tuple[str, int], Any] = {}


def job(world: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results of the horarun job at this world size (run once per module)."""
    if world not in _jobs:
        out = tmp_path_factory.mktemp(f"lightning-np{world}")
        _run([*HORARUN, "-np", str(world), sys.executable, __file__, str(out)], timeout=110)
        _jobs[world] = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    return _jobs[world]


def reference(scenario: str, world: int) -> Any:
    """Single-process training on the union of the ranks' batches (in this process)."""
    if (scenario, world) not in _references:
        module, trainer = make_trainer(scenario, world, distributed=False, seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, train_dataloaders=train_loader(world, distributed=False))
            tested = None
            if scenario == "plain":
                loader = DataLoader(dataset(), batch_size=BATCH * world)
                tested = trainer.test(module, dataloaders=loader, verbose=False)[0]["test_loss"]
        _references[(scenario, world)] = (state_of(module), tested)
    return _references[(scenario, world)]


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=ATOL, rtol=1e-4, msg=name)


# ------------------------------------------------------------------ the tests


@pytest.mark.timeout(60)
def test_importing_hora_does_not_import_lightning() -> None:
    code = (
        "import sys, hora, hora.torch; "
        "assert not {'lightning', 'pytorch_lightning'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50)


@pytest.mark.timeout(30)
def test_strategy_name_selects_hora_strategy_and_environment() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    assert "hora" in StrategyRegistry
    HoraStrategy.register_strategies(StrategyRegistry)  # registering again is harmless
    trainer = L.Trainer(strategy="hora", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, HoraStrategy)
    assert isinstance(trainer.strategy.cluster_environment, HoraEnvironment)
    # No launcher: a job of one.
    assert (trainer.world_size, trainer.global_rank, trainer.is_global_zero) == (1, 0, True)
    assert trainer.strategy.root_device == torch.device("cpu")
    assert hora.lightning.PACKAGE == "lightning.pytorch"


_LAUNCHER_VARS = re.compile(
    r"^(HORA_|HOROVOD_|SLURM_|TORCHELASTIC_|OMPI_|PMI_|PMIX_|MV2_|LSB_|KUBEFLOW)|"
    r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|"
    r"MASTER_ADDR|MASTER_PORT|NODE_RANK)$"
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No launcher's variables; Lightning's rank_zero_only.rank restored afterwards."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    for name in list(os.environ):
        if _LAUNCHER_VARS.match(name):
            monkeypatch.delenv(name)
    monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)
    return monkeypatch


HORARUN_RANK_1 = {
    "HORA_RANK": "1",
    "HORA_SIZE": "4",
    "HORA_LOCAL_RANK": "1",
    "HORA_LOCAL_SIZE": "2",
    "HORA_CROSS_RANK": "0",
    "HORA_CROSS_SIZE": "2",
    "HORA_RENDEZVOUS_ADDR": "10.0.0.5",
    "HORA_RENDEZVOUS_PORT": "29999",
}


@pytest.mark.timeout(30)
def test_environment_reads_horarun_and_leaves_other_launchers_to_lightning(
    clean_env: pytest.MonkeyPatch,
) -> None:
    from lightning.fabric.plugins.environments import (
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    assert not HoraEnvironment.detect()
    assert (HoraEnvironment().world_size(), HoraEnvironment().global_rank()) == (1, 0)

    for name, value in HORARUN_RANK_1.items():
        clean_env.setenv(name, value)
    assert HoraEnvironment.detect()
    env = HoraEnvironment()
    assert env.creates_processes_externally
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (4, 1, 1, 0)
    assert env.main_address == "10.0.0.5"
    env.set_global_rank(3)  # Lightning may try; the launcher's ranks stay
    assert env.global_rank() == 1

    # Horovod's own variable names are read too.
    for name in HORARUN_RANK_1:
        clean_env.delenv(name)
    clean_env.setenv("HOROVOD_RANK", "0")
    clean_env.setenv("HOROVOD_SIZE", "1")
    assert HoraEnvironment.detect()
    clean_env.delenv("HOROVOD_RANK")
    clean_env.delenv("HOROVOD_SIZE")

    # srun and torchrun: Lightning's environments claim them, hora's does not, and both agree.
    slurm = {
        "SLURM_JOB_ID": "42",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_JOB_NAME": "train",
    }
    torchrun = {
        "TORCHELASTIC_RUN_ID": "r1",
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "29500",
    }
    for variables, theirs in ((slurm, SLURMEnvironment), (torchrun, TorchElasticEnvironment)):
        for name, value in variables.items():
            clean_env.setenv(name, value)
        assert theirs.detect() and not HoraEnvironment.detect()
        mine, other = HoraEnvironment(), theirs()
        for query in ("world_size", "global_rank", "local_rank", "node_rank"):
            assert getattr(mine, query)() == getattr(other, query)(), (theirs, query)
        for name in variables:
            clean_env.delenv(name)


@pytest.mark.timeout(30)
def test_horarun_inside_a_slurm_allocation_keeps_horas_ranks(
    clean_env: pytest.MonkeyPatch,
) -> None:
    """In an sbatch script, Lightning alone would pick SLURMEnvironment (rank 0 everywhere)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    for name, value in {
        **HORARUN_RANK_1,
        "SLURM_JOB_ID": "42",
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_JOB_NAME": "train",
    }.items():
        clean_env.setenv(name, value)
    assert SLURMEnvironment.detect()
    for strategy in ("hora", HoraStrategy()):
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False)
        assert isinstance(trainer.strategy.cluster_environment, HoraEnvironment)
        assert (trainer.world_size, trainer.global_rank, trainer.local_rank) == (4, 1, 1)
        assert not trainer.is_global_zero
        assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 4, "rank": 1}

    # With --ntasks=4 (no --ntasks-per-node) Lightning's SLURMEnvironment refuses to be built,
    # which it tries only for a strategy given by name; an instance skips that detection.
    clean_env.setenv("SLURM_NTASKS", "4")
    with pytest.raises(RuntimeError, match="ntasks"):
        L.Trainer(strategy="hora", accelerator="cpu", devices=1, logger=False)
    trainer = L.Trainer(strategy=HoraStrategy(), accelerator="cpu", devices=1, logger=False)
    assert (trainer.world_size, trainer.global_rank) == (4, 1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fit_at_np2_matches_single_process_training(
    scenario: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """plain: strategy="hora"; accumulate: accumulate_grad_batches=2 with a short last window
    and gradient clipping; manual: manual optimization with clipping; two_optimizers: manual
    optimization with an SGD and an Adam; syncbn: BatchNorm with Trainer(sync_batchnorm=True)."""
    ranks = job(2, tmp_path_factory)
    want, _ = reference(scenario, 2)
    for saved in ranks:
        assert_same_state(saved[scenario]["state"], want)
        # The schedulers were pointed at the distributed optimizers without a warning.
        assert saved[scenario]["warnings"] == []
    assert ranks[0][scenario]["metrics"] == ranks[1][scenario]["metrics"]  # sync_dist=True


@pytest.mark.timeout(60)
def test_np2_ranks_topology_and_a_second_stage(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    ranks = job(2, tmp_path_factory)
    _, want_test_loss = reference("plain", 2)
    for rank, saved in enumerate(ranks):
        top = saved["topology"]
        assert top["strategy"] == "HoraStrategy"
        assert top["environment"] == "HoraEnvironment"
        assert top["detect"] is True
        assert top["ranks"] == (2, rank, rank, 0)
        assert top["hvd"] == (2, rank, rank)
        assert top["is_global_zero"] is (rank == 0)
        assert top["rank_zero_only"] == rank
        assert top["sampler"] == ("DistributedSampler", 2, rank)
        assert top["sampler_kwargs"] == {"num_replicas": 2, "rank": rank}
        assert top["device"] == "cpu"
        # trainer.test after trainer.fit, the metric averaged over both ranks' shards.
        assert saved["test"] == pytest.approx(want_test_loss, rel=1e-4)


@pytest.mark.timeout(60)
def test_np2_reduce_all_gather_broadcast(tmp_path_factory: pytest.TempPathFactory) -> None:
    ranks = job(2, tmp_path_factory)
    for rank, saved in enumerate(ranks):
        c = saved["collectives"]
        assert c["mean"].item() == pytest.approx(1.5)
        assert c["sum"].item() == pytest.approx(3.0)
        assert c["max"].tolist() == [1, 0]
        assert c["int_mean"].dtype == torch.float32 and c["int_mean"].item() == 0.5
        assert c["not_a_tensor"] == 3.5
        assert c["gather"].tolist() == [[0, 0], [1, 10]]
        assert c["gather_scalar"].tolist() == [0.0, 1.0]
        # d/dx_r of sum_i (i + 1) * x_i, computed on both ranks and summed (as DDP does).
        assert c["gather_grad"].tolist() == [2.0 * (rank + 1)]
        assert c["broadcast"] == {"from": 1, "text": "rank 1"}
        assert c["any"] is True and c["all"] is False


@pytest.mark.timeout(120)
def test_fit_at_np3_matches_single_process_training(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """An odd world size: three ranks, batches of 4 each, against batches of 12."""
    ranks = job(3, tmp_path_factory)
    for scenario in SCENARIOS:
        want, _ = reference(scenario, 3)
        for saved in ranks:
            assert_same_state(saved[scenario]["state"], want)
    assert [saved["topology"]["ranks"] for saved in ranks] == [(3, r, r, 0) for r in range(3)]


FINAL = re.compile(r"^\[0\]<stdout>:final test accuracy: (\d\.\d{4})$", re.MULTILINE)


@pytest.mark.timeout(90)
def test_example_lightning_digits_trains_at_np2() -> None:
    result = _run([*HORARUN, "-np", "2", sys.executable, str(EXAMPLE)], timeout=80)
    finals = FINAL.findall(result.stdout)
    assert len(finals) == 1, result.stdout  # printed by rank 0 only
    assert float(finals[0]) >= 0.9, result.stdout
    assert result.elapsed < 60, f"the example took {result.elapsed:.0f} s"  # type: ignore[attr-defined]


if __name__ == "__main__":
    _worker(sys.argv[1])
