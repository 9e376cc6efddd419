"""Sharded ``DistributedOptimizer`` (``shard_optimizer_state=True``, ZeRO stages 1 and 2) on
real processes.

The central check is equivalence: a model trained with sharding ends with the parameters the
unsharded ``DistributedOptimizer`` reaches on the same data (each worker trains both, from the
same weights). Then the options around it (gradient accumulation, compression, GradScaler,
clipping, Sum, predivision, groups, process sets), the state (consolidated and per-rank state
dicts, loading into and from unsharded optimizers, ``broadcast_optimizer_state``) and what is
refused.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from .jobs import assert_raised, error_of, run_job

BATCH = 12  # divisible by 2 and 3, so every rank's slice has the same size
STEPS = 4


def _model(seed: int = 0, unused: bool = False) -> Any:
    import torch

    torch.manual_seed(seed)
    layers = [
        torch.nn.Linear(6, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 7),
        torch.nn.Tanh(),
        torch.nn.Linear(7, 1),
    ]
    model = torch.nn.Sequential(*layers)
    if unused:  # a parameter the forward pass never uses: it gets no gradient
        model.register_parameter("unused", torch.nn.Parameter(torch.randn(3, 3)))
    return model


OPTIMIZERS: dict[str, Any] = {
    "sgd_momentum": lambda p, torch: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "sgd_nesterov": lambda p, torch: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda p, torch: torch.optim.Adam(p, lr=0.01),
    "adam_amsgrad": lambda p, torch: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    "adamw": lambda p, torch: torch.optim.AdamW(p, lr=0.01),
    "adamw_fused": lambda p, torch: torch.optim.AdamW(p, lr=0.01, fused=True),
    "rmsprop": lambda p, torch: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    "adagrad": lambda p, torch: torch.optim.Adagrad(p, lr=0.05),
    "adadelta": lambda p, torch: torch.optim.Adadelta(p),
    "adamax": lambda p, torch: torch.optim.Adamax(p, lr=0.01),
    "nadam": lambda p, torch: torch.optim.NAdam(p, lr=0.01),
    "radam": lambda p, torch: torch.optim.RAdam(p, lr=0.01),
    "rprop": lambda p, torch: torch.optim.Rprop(p, lr=0.01),
    "asgd": lambda p, torch: torch.optim.ASGD(p, lr=0.01, t0=1),
}


def _train(
    optimizer_name: str,
    shard: int,
    passes: int = 1,
    compression: str = "none",
    amp: str = "",
    clip: float | None = None,
    norm_type: float = 2.0,
    steps: int = STEPS,
    inf_at: int | None = None,
    unused: bool = False,
    scheduler: bool = False,
    process_set: Any = None,
    overlap: bool = False,
    **wrap: Any,
) -> dict[str, Any]:
    """Train one model; ``shard`` 0 is the unsharded optimizer, 1 and 2 the ZeRO stages.

    ``amp``: "" (none), "unscale" (synchronize, unscale_, step) or "direct" (synchronize,
    step). ``inf_at``: the step at which the last rank's gradient of one element of the first
    weight is inf (the scaler must skip that step on every rank). Returns the parameters and
    what was observed on the way (gradient norms, scales).
    """
    import torch

    import hora.torch as hvd

    rank = hvd.rank()
    members = process_set.ranks if process_set is not None else list(range(hvd.size()))
    size = len(members)
    place = members.index(rank) if rank in members else 0
    model = _model(unused=unused)
    options: dict[str, Any] = dict(wrap)
    if process_set is not None:
        options["process_set"] = process_set
    if shard:
        options.update(shard_optimizer_state=True, shard_gradients=shard == 2)
    optimizer = hvd.DistributedOptimizer(
        OPTIMIZERS[optimizer_name](model.parameters(), torch),
        named_parameters=model.named_parameters(),
        backward_passes_per_step=passes,
        compression=getattr(hvd.Compression, compression),
        **options,
    )
    if overlap and shard:
        optimizer.overlap_gather_with_forward(model)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5) if scheduler else None
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2) if amp else None
    if inf_at is not None:
        weight = model[0].weight

        def poison(grad: Any) -> Any:
            if poison.step == inf_at and rank == members[-1]:  # type: ignore[attr-defined]
                grad = grad.clone()
                grad[0, 0] = float("inf")
            return grad

        poison.step = -1  # type: ignore[attr-defined]
        weight.register_hook(poison)
    data = torch.Generator().manual_seed(7)
    per_rank = BATCH // size
    out: dict[str, Any] = {"norms": [], "scales": []}
    for step in range(steps):
        if inf_at is not None:
            poison.step = step  # type: ignore[attr-defined]
        optimizer.zero_grad()
        for _ in range(passes):
            x = torch.randn(BATCH, 6, generator=data)
            y = torch.randn(BATCH, 1, generator=data)
            mine = slice(place * per_rank, (place + 1) * per_rank)
            loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            optimizer.synchronize()
            if amp == "unscale":
                scaler.unscale_(optimizer)
                if clip is not None:
                    out["norms"].append(_clip(optimizer, model, shard, clip, norm_type))
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scaler.update()
            out["scales"].append(scaler.get_scale())
        elif clip is not None:
            if not shard:
                optimizer.synchronize()
            out["norms"].append(_clip(optimizer, model, shard, clip, norm_type))
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
        if schedule is not None:
            schedule.step()
    if overlap and shard:
        optimizer.finish_parameter_gather()  # the last step's gathers: no forward follows
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["optimizer"] = optimizer
    out["model"] = model
    return out


def _clip(optimizer: Any, model: Any, shard: int, clip: float, norm_type: float) -> float:
    import torch

    if shard:
        return float(optimizer.clip_grad_norm_(clip, norm_type))
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip, norm_type))


def _difference(a: list[Any], b: list[Any]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _compare(name: str, shard: int, **options: Any) -> dict[str, Any]:
    """The largest parameter difference between sharded and unsharded training, and their
    observations."""
    plain = _train(name, 0, **options)
    sharded = _train(name, shard, **options)
    return {
        "difference": _difference(plain["params"], sharded["params"]),
        "norms": (plain["norms"], sharded["norms"]),
        "scales": (plain["scales"], sharded["scales"]),
        "finite": all(bool(torch.isfinite(p).all()) for p in sharded["params"]),
    }


def _against_one_process(make: Any, shard: int) -> float:
    """Sharded training against one plain process on the whole batch (equal slices per rank,
    so the average of the ranks' mean losses is the whole batch's)."""
    import torch

    import hora.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    model, reference = _model(), _model()
    optimizer = hvd.DistributedOptimizer(
        make(model.parameters()),
        named_parameters=model.named_parameters(),
        shard_optimizer_state=True,
        shard_gradients=shard == 2,
    )
    plain = make(reference.parameters())
    data = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, 6, generator=data), torch.randn(BATCH, 1, generator=data)
        mine = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
        for net, opt, part in ((model, optimizer, mine), (reference, plain, slice(None))):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x[part]), y[part]).backward()
            opt.step()
    return _difference(
        [p.detach() for p in model.parameters()], [p.detach() for p in reference.parameters()]
    )


def _equivalence_worker() -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    hvd.init()
    out: dict[str, Any] = {}
    for shard in (1, 2):
        # Adagrad makes its state when constructed, from its initial_accumulator_value.
        out[f"adagrad_initial_stage{shard}"] = _against_one_process(
            lambda p: torch.optim.Adagrad(p, lr=0.05, initial_accumulator_value=0.5), shard
        )
    for name in OPTIMIZERS:
        for shard in (1, 2):
            out[f"{name}_stage{shard}"] = _compare(name, shard)["difference"]
    for shard in (1, 2):
        for name in ("sgd_momentum", "adam", "adamw"):
            out[f"{name}_passes2_stage{shard}"] = _compare(name, shard, passes=2)["difference"]
            out[f"{name}_fp16_stage{shard}"] = _compare(name, shard, compression="fp16")[
                "difference"
            ]
        out[f"adam_bf16_stage{shard}"] = _compare("adam", shard, compression="bf16")["difference"]
        out[f"adam_sum_stage{shard}"] = _compare("adam", shard, op=hvd.Sum)["difference"]
        out[f"adam_predivide_stage{shard}"] = _compare(
            "adam", shard, gradient_predivide_factor=2.0
        )["difference"]
        out[f"sgd_groups_stage{shard}"] = _compare("sgd_momentum", shard, groups=2)["difference"]
        out[f"adam_unused_stage{shard}"] = _compare("adam", shard, unused=True)["difference"]
        out[f"adam_scheduler_stage{shard}"] = _compare("adam", shard, scheduler=True)["difference"]
        out[f"adam_scaler_stage{shard}"] = _compare("adam", shard, amp="unscale", inf_at=1)
        out[f"adam_scaler_direct_stage{shard}"] = _compare("adam", shard, amp="direct", inf_at=2)
        out[f"adamw_scaler_fp16_passes2_stage{shard}"] = _compare(
            "adamw", shard, amp="unscale", compression="fp16", passes=2, inf_at=1
        )
        out[f"sgd_scaler_clip_stage{shard}"] = _compare(
            "sgd_momentum", shard, amp="unscale", clip=0.05
        )
        out[f"sgd_clip_stage{shard}"] = _compare("sgd_momentum", shard, clip=0.05)
        out[f"adam_clip_inf_stage{shard}"] = _compare("adam", shard, clip=0.01, norm_type=inf)
        # Parameters gathered during the next forward pass, bucket by bucket (3 buckets).
        for name in ("sgd_momentum", "adam"):
            out[f"{name}_overlap_stage{shard}"] = _compare(name, shard, overlap=True, groups=3)[
                "difference"
            ]
        out[f"adam_overlap_passes2_unused_stage{shard}"] = _compare(
            "adam", shard, overlap=True, groups=3, passes=2, unused=True
        )["difference"]
        out[f"adam_overlap_scaler_clip_stage{shard}"] = _compare(
            "adam", shard, overlap=True, groups=3, amp="unscale", clip=0.05, inf_at=1
        )
    hvd.shutdown()
    return out


inf = float("inf")


@pytest.fixture(scope="module", params=[2, 3], ids=lambda np: f"np{np}")
def equivalence(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return run_job(_equivalence_worker, request.param, timeout_s=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_training_matches_the_unsharded_optimizer(
    equivalence: list[dict[str, Any]], name: str, stage: int
) -> None:
    for rank, observed in enumerate(equivalence):
        difference = observed[f"{name}_stage{stage}"]
        assert difference < 1e-6, f"rank {rank}: {name} stage {stage} differs by {difference}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize(
    ("case", "tolerance"),
    [
        ("sgd_momentum_passes2", 1e-6),
        ("adam_passes2", 1e-6),
        ("adamw_passes2", 1e-6),
        ("sgd_momentum_fp16", 1e-3),
        ("adam_fp16", 1e-3),
        ("adamw_fp16", 1e-3),
        ("adam_bf16", 1e-2),
        ("adam_sum", 1e-6),
        ("adam_predivide", 1e-6),
        ("sgd_groups", 1e-6),
        ("adam_unused", 1e-6),
        ("adam_scheduler", 1e-6),
        ("adagrad_initial", 1e-6),
        ("sgd_momentum_overlap", 1e-6),
        ("adam_overlap", 1e-6),
        ("adam_overlap_passes2_unused", 1e-6),
    ],
)
def test_options_keep_sharded_training_equivalent(
    equivalence: list[dict[str, Any]], case: str, tolerance: float, stage: int
) -> None:
    for rank, observed in enumerate(equivalence):
        difference = observed[f"{case}_stage{stage}"]
        assert difference < tolerance, f"rank {rank}: {case} stage {stage} differs by {difference}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize(
    "case",
    [
        "adam_scaler",
        "adam_scaler_direct",
        "adamw_scaler_fp16_passes2",
        "sgd_scaler_clip",
        "adam_overlap_scaler_clip",
    ],
)
def test_grad_scaler_skips_and_scales_as_the_unsharded_optimizer(
    equivalence: list[dict[str, Any]], case: str, stage: int
) -> None:
    tolerance = 1e-3 if "fp16" in case else 1e-6
    scales = []
    for rank, observed in enumerate(equivalence):
        result = observed[f"{case}_stage{stage}"]
        assert result["difference"] < tolerance, f"rank {rank}: {case} differs: {result}"
        assert result["finite"], f"rank {rank}: {case} stepped on an inf"
        plain, sharded = result["scales"]
        assert plain == sharded, f"rank {rank}: scales {plain} (unsharded) != {sharded}"
        scales.append(sharded)
    # The inf on one element of one rank's gradient made every rank back off at once.
    assert all(s == scales[0] for s in scales), scales
    if case != "sgd_scaler_clip":  # the cases with an inf
        assert any(b < a for a, b in zip(scales[0], scales[0][1:])), scales[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("case", ["sgd_clip", "adam_clip_inf", "sgd_scaler_clip"])
def test_clip_grad_norm_uses_the_norm_over_all_shards(
    equivalence: list[dict[str, Any]], case: str, stage: int
) -> None:
    for rank, observed in enumerate(equivalence):
        result = observed[f"{case}_stage{stage}"]
        plain, sharded = result["norms"]
        assert len(sharded) == STEPS and sharded == pytest.approx(plain, rel=1e-5), (rank, result)
        assert result["difference"] < 1e-6, (rank, result)


# ---------------------------------------------------------------- state and behaviour


def _state_close(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest difference between two optimizer state dicts (inf when their keys differ)."""
    import torch

    if set(a["state"]) != set(b["state"]):
        return float("inf")
    worst = 0.0
    for position, entries in a["state"].items():
        other = b["state"][position]
        if set(entries) != set(other):
            return float("inf")
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                if value.shape != other[key].shape:
                    return float("inf")
                worst = max(worst, (value.double() - other[key].double()).abs().max().item())
            elif value != other[key]:
                return float("inf")
    options = [{k: v for k, v in g.items() if k != "params"} for g in a["param_groups"]]
    theirs = [{k: v for k, v in g.items() if k != "params"} for g in b["param_groups"]]
    return worst if options == theirs else float("inf")


def _continue(optimizer: Any, model: Any, steps: int = 2, seed: int = 11) -> list[Any]:
    import torch

    import hora.torch as hvd

    data = torch.Generator().manual_seed(seed)
    size, rank = hvd.size(), hvd.rank()
    for _ in range(steps):
        optimizer.zero_grad()
        x = torch.randn(BATCH, 6, generator=data)
        y = torch.randn(BATCH, 1, generator=data)
        mine = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _fresh(shard: int, name: str = "adam", state_from: Any = None) -> tuple[Any, Any]:
    """A model with the weights of ``state_from``'s model (or seed 0) and a fresh optimizer."""
    import torch

    import hora.torch as hvd

    model = _model()
    if state_from is not None:
        model.load_state_dict(state_from.state_dict())
    options = dict(shard_optimizer_state=True, shard_gradients=shard == 2) if shard else {}
    optimizer = hvd.DistributedOptimizer(
        OPTIMIZERS[name](model.parameters(), torch),
        named_parameters=model.named_parameters(),
        **options,
    )
    return model, optimizer


def _state_worker() -> dict[str, Any]:
    import copy

    import torch

    import hora.torch as hvd
    from hora.torch.zero_state import consolidate_sharded_state_dicts

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict[str, Any] = {"size": size}
    for name in ("adam", "sgd_momentum", "adagrad"):
        plain = _train(name, 0)
        sharded = _train(name, 2)
        plain_state = plain["optimizer"].state_dict()
        whole = sharded["optimizer"].state_dict()
        # The consolidated state is the unsharded optimizer's.
        out[f"{name}_consolidated"] = _state_close(plain_state, whole)
        # optimizer.state holds this rank's shard only.
        mine = sum(
            t.numel()
            for s in sharded["optimizer"].state.values()
            for k, t in s.items()
            if isinstance(t, torch.Tensor) and k != "step"
        )
        everything = sum(
            t.numel()
            for s in plain["optimizer"].state.values()
            for k, t in s.items()
            if isinstance(t, torch.Tensor) and k != "step"
        )
        out[f"{name}_state_elements"] = (mine, everything)
        # Consolidated -> a plain torch optimizer on one process -> the same state.
        local_model = _model()
        local = OPTIMIZERS[name](local_model.parameters(), torch)
        local.load_state_dict(copy.deepcopy(whole))
        out[f"{name}_into_plain_torch"] = _state_close(local.state_dict(), plain_state)
        # Unsharded state -> a sharded optimizer, and both trained on: the same parameters.
        model_a, opt_a = _fresh(0, name, state_from=plain["model"])
        opt_a.load_state_dict(copy.deepcopy(plain_state))
        model_b, opt_b = _fresh(1, name, state_from=plain["model"])
        opt_b.load_state_dict(copy.deepcopy(plain_state))
        out[f"{name}_unsharded_to_sharded"] = _difference(
            _continue(opt_a, model_a), _continue(opt_b, model_b)
        )
        # Sharded consolidated -> an unsharded DistributedOptimizer, both trained on.
        model_c, opt_c = _fresh(0, name, state_from=sharded["model"])
        opt_c.load_state_dict(copy.deepcopy(whole))
        out[f"{name}_sharded_to_unsharded"] = _difference(
            _continue(opt_c, model_c), _continue(sharded["optimizer"], sharded["model"])
        )
        out[f"{name}_after_both"] = _difference(
            [p.detach() for p in model_c.parameters()], [p.detach() for p in model_a.parameters()]
        )

    # Per-rank files: this rank's shard, loaded into a fresh sharded optimizer; consolidated
    # from every rank's file; refused by another rank.
    trained = _train("adam", 1)
    shard_dict = trained["optimizer"].sharded_state_dict()
    everyone = hvd.allgather_object(shard_dict, name="shards")
    out["files_consolidated"] = _state_close(
        consolidate_sharded_state_dicts(list(reversed(everyone))),
        trained["optimizer"].state_dict(),
    )
    model_d, opt_d = _fresh(1, "adam", state_from=trained["model"])
    opt_d.load_state_dict(copy.deepcopy(shard_dict))
    reference = copy.deepcopy(trained["optimizer"].state_dict())
    out["file_reload"] = _difference(
        _continue(opt_d, model_d), _continue(trained["optimizer"], trained["model"])
    )
    other = everyone[(rank + 1) % size]
    out["foreign_file"] = error_of(lambda: opt_d.load_state_dict(copy.deepcopy(other)))

    # broadcast_optimizer_state: a checkpoint loaded on rank 0 only reaches every rank's shard.
    model_e, opt_e = _fresh(2, "adam", state_from=trained["model"])
    if rank == 0:
        opt_e.load_state_dict(copy.deepcopy(reference))
        opt_e.param_groups[0]["lr"] = 0.02
    hvd.broadcast_optimizer_state(opt_e, root_rank=0)
    out["broadcast_lr"] = opt_e.param_groups[0]["lr"]
    opt_e.param_groups[0]["lr"] = 0.01
    model_f, opt_f = _fresh(0, "adam", state_from=trained["model"])
    opt_f.load_state_dict(copy.deepcopy(reference))
    out["broadcast_checkpoint"] = _difference(_continue(opt_e, model_e), _continue(opt_f, model_f))
    # ... a fresh root empties every rank's state; ranks that stepped together keep theirs.
    fresh_model, fresh_opt = _fresh(1, "adam")
    hvd.broadcast_optimizer_state(fresh_opt, root_rank=0)
    out["broadcast_fresh"] = len(fresh_opt.state)
    before = opt_e.state_dict()
    hvd.broadcast_optimizer_state(opt_e, root_rank=size - 1)
    out["broadcast_stepped"] = _state_close(before, opt_e.state_dict())
    # ... but a root with stepped state cannot fill a rank that has none.
    lost_model, lost = _fresh(1, "adam", state_from=trained["model"])
    _continue(lost, lost_model, steps=1)
    if rank == size - 1:  # this rank loses its shard's state (a fresh optimizer's state_dict)
        lost.load_state_dict(OPTIMIZERS["adam"](_model().parameters(), torch).state_dict())
    out["broadcast_missing"] = error_of(lambda: hvd.broadcast_optimizer_state(lost, root_rank=0))
    hvd.shutdown()
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda np: f"np{np}")
def state(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return run_job(_state_worker, request.param, timeout_s=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["adam", "sgd_momentum", "adagrad"])
def test_state_dict_is_consolidated_and_round_trips(state: list[dict[str, Any]], name: str) -> None:
    for rank, observed in enumerate(state):
        assert observed[f"{name}_consolidated"] < 1e-6, (rank, observed)
        assert observed[f"{name}_into_plain_torch"] < 1e-6, (rank, observed)
        assert observed[f"{name}_unsharded_to_sharded"] < 1e-6, (rank, observed)
        assert observed[f"{name}_sharded_to_unsharded"] < 1e-6, (rank, observed)
        assert observed[f"{name}_after_both"] < 1e-6, (rank, observed)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["adam", "sgd_momentum", "adagrad"])
def test_each_rank_keeps_one_shard_of_the_state(state: list[dict[str, Any]], name: str) -> None:
    shares = [observed[f"{name}_state_elements"] for observed in state]
    everything = shares[0][1]
    assert sum(mine for mine, _ in shares) == everything
    size = state[0]["size"]
    # The model is one bucket, split as evenly as whole elements allow: each of the (at most
    # two) sharded entries of a rank's state has at most one element more than 1/size.
    assert all(abs(mine - everything / size) <= 2 for mine, _ in shares), shares


@pytest.mark.timeout(300)
def test_per_rank_state_files(state: list[dict[str, Any]]) -> None:
    for observed in state:
        assert observed["files_consolidated"] < 1e-7, observed
        assert observed["file_reload"] < 1e-6, observed
        assert_raised(observed["foreign_file"], ValueError, "consolidate_sharded_state_dicts")


@pytest.mark.timeout(300)
def test_broadcast_optimizer_state_with_shards(state: list[dict[str, Any]]) -> None:
    for observed in state:
        assert observed["broadcast_lr"] == 0.02
        assert observed["broadcast_checkpoint"] < 1e-6, observed
        assert observed["broadcast_fresh"] == 0
        assert observed["broadcast_stepped"] < 1e-12
        assert_raised(observed["broadcast_missing"], ValueError, "have none for theirs")


def _behaviour_worker() -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict[str, Any] = {"size": size}
    model = _model()

    def wrap(optimizer: Any, **options: Any) -> Any:
        return hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            shard_optimizer_state=options.pop("shard_optimizer_state", True),
            **options,
        )

    out["lbfgs"] = error_of(lambda: wrap(torch.optim.LBFGS(model.parameters())))
    out["sparse_adam"] = error_of(lambda: wrap(torch.optim.SparseAdam(model.parameters())))

    class Normed(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            return super().step(closure)

    class Declared(Normed):
        hora_elementwise_update = True

    class Defaults(torch.optim.Adam):
        pass

    out["own_step"] = error_of(lambda: wrap(Normed(model.parameters(), lr=0.1)))
    out["declared"] = error_of(lambda: wrap(Declared(model.parameters(), lr=0.1)))
    out["subclass"] = error_of(lambda: wrap(Defaults(model.parameters())))
    out["adasum"] = error_of(lambda: wrap(torch.optim.SGD(model.parameters()), op=hvd.Adasum))
    out["stage2_alone"] = error_of(
        lambda: wrap(
            torch.optim.SGD(model.parameters()), shard_optimizer_state=False, shard_gradients=True
        )
    )
    twice = wrap(torch.optim.SGD(model.parameters(), lr=0.1))
    out["twice"] = error_of(lambda: wrap(twice))
    out["add_group"] = error_of(
        lambda: twice.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    )
    model(torch.ones(2, 6)).sum().backward()
    out["closure"] = error_of(lambda: twice.step(lambda: 0.0))
    out["zero_grad_race"] = error_of(twice.zero_grad)
    twice.step()

    # Stage 2 releases each gradient once its bucket is sent; stage 1 keeps it.
    for stage in (1, 2):
        m = _model()
        opt = hvd.DistributedOptimizer(
            torch.optim.Adam(m.parameters()),
            named_parameters=m.named_parameters(),
            shard_optimizer_state=True,
            shard_gradients=stage == 2,
        )
        m(torch.ones(2, 6)).sum().backward()
        out[f"grads_after_backward_stage{stage}"] = [p.grad is not None for p in m.parameters()]
        opt.synchronize()
        # Between synchronize() and step(), param_groups list this rank's pieces.
        shown = opt.param_groups[0]["params"]
        out[f"shown_stage{stage}"] = (
            sum(t.numel() for t in shown[:-1]),
            all(t.grad is not None for t in shown),
        )
        opt.step()
        out[f"params_after_step_stage{stage}"] = len(opt.param_groups[0]["params"])
        # Two backward passes with backward_passes_per_step=1 are refused, as unsharded.
        opt.zero_grad()
        m(torch.ones(2, 6)).sum().backward()
        out[f"too_many_passes_stage{stage}"] = error_of(
            lambda m=m: m(torch.ones(2, 6)).sum().backward()
        )
        opt.step()

    # With the gather overlapped, step() leaves the other ranks' shards to the next forward;
    # model.state_dict() (and each module's forward) writes them first.
    m = _model()
    opt = hvd.DistributedOptimizer(
        torch.optim.Adam(m.parameters(), lr=0.01),
        named_parameters=m.named_parameters(),
        shard_optimizer_state=True,
        groups=3,
    )
    out["overlap_other_model"] = error_of(lambda: opt.overlap_gather_with_forward(m[0]))
    opt.overlap_gather_with_forward(m)
    m(torch.ones(2, 6)).sum().backward()
    opt.step()
    after_step = [p.detach().clone() for p in m.parameters()]
    whole = [t.clone() for t in m.state_dict().values()]
    out["overlap_stale_after_step"] = any(not torch.equal(a, b) for a, b in zip(after_step, whole))
    out["overlap_state_dict_whole"] = all(
        torch.equal(a, b.detach()) for a, b in zip(whole, m.parameters())
    )
    opt.zero_grad()
    m(torch.ones(2, 6)).sum().backward()
    opt.step()
    first = m[0].weight.detach().clone()
    m[0](torch.ones(1, 6))  # the first layer's forward writes its bucket in
    out["overlap_forward_writes_its_bucket"] = not torch.equal(first, m[0].weight.detach())
    opt.finish_parameter_gather()
    everywhere = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    out["overlap_ranks_agree"] = bool(
        torch.equal(hvd.broadcast(everywhere, 0, name="overlap.check"), everywhere)
    )

    # A GradScaler without synchronize() first is refused (the same on every rank).
    m = _model()
    opt = hvd.DistributedOptimizer(
        torch.optim.Adam(m.parameters()),
        named_parameters=m.named_parameters(),
        shard_optimizer_state=True,
        shard_gradients=True,
    )
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(m(torch.ones(2, 6)).sum()).backward()
    out["scaler_unsynchronized"] = error_of(lambda: scaler.step(opt))

    # hvd.join() cannot stand in for a rank that owns a shard.
    m = _model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1),
        named_parameters=m.named_parameters(),
        shard_optimizer_state=True,
    )
    if rank == 0:
        hvd.join()
        out["join"] = None
    else:
        m(torch.ones(2, 6)).sum().backward()
        out["join"] = error_of(opt.step)
        hvd.join()
    hvd.shutdown()
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda np: f"np{np}")
def behaviour(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return run_job(_behaviour_worker, request.param, timeout_s=120)


@pytest.mark.timeout(150)
def test_what_cannot_be_sharded_is_refused_clearly(behaviour: list[dict[str, Any]]) -> None:
    for observed in behaviour:
        assert_raised(observed["lbfgs"], ValueError, "cannot shard LBFGS", "elementwise")
        assert_raised(observed["sparse_adam"], ValueError, "cannot shard SparseAdam")
        assert_raised(observed["own_step"], ValueError, "cannot shard Normed")
        assert observed["declared"] is None
        assert observed["subclass"] is None
        assert_raised(observed["adasum"], ValueError, "Adasum")
        assert_raised(observed["stage2_alone"], ValueError, "needs shard_optimizer_state=True")
        assert_raised(observed["twice"], ValueError, "already a DistributedOptimizer")
        assert_raised(observed["add_group"], ValueError, "add_param_group")
        assert_raised(observed["closure"], ValueError, "step(closure)")
        assert_raised(observed["zero_grad_race"], AssertionError, "zero_grad")
        assert_raised(observed["scaler_unsynchronized"], RuntimeError, "synchronize()")


@pytest.mark.timeout(150)
def test_stage_two_releases_gradients_and_synchronize_shows_the_shards(
    behaviour: list[dict[str, Any]],
) -> None:
    total = 6 * 16 + 16 + 16 * 7 + 7 + 7 + 1
    shown = []
    for observed in behaviour:
        assert all(observed["grads_after_backward_stage1"])
        released = observed["grads_after_backward_stage2"]
        assert not any(released) if observed["size"] > 1 else all(released)
        for stage in (1, 2):
            elements, with_grads = observed[f"shown_stage{stage}"]
            assert with_grads
            shown.append(elements)
            assert observed[f"params_after_step_stage{stage}"] == 6
            assert_raised(
                observed[f"too_many_passes_stage{stage}"],
                AssertionError,
                "backward_passes_per_step",
            )
    assert sum(shown) == 2 * total


@pytest.mark.timeout(150)
def test_overlapped_gather_writes_each_bucket_before_it_is_read(
    behaviour: list[dict[str, Any]],
) -> None:
    for observed in behaviour:
        assert observed["overlap_stale_after_step"], "step() waited for the gathers"
        assert observed["overlap_state_dict_whole"]
        assert observed["overlap_forward_writes_its_bucket"]
        assert observed["overlap_ranks_agree"]
        assert_raised(
            observed["overlap_other_model"], ValueError, "does not hold 4 of the parameters"
        )


@pytest.mark.timeout(150)
def test_join_is_refused_with_an_explanation(behaviour: list[dict[str, Any]]) -> None:
    for observed in behaviour[1:]:
        assert_raised(observed["join"], ValueError, "hvd.join() cannot stand in")


def _process_set_worker() -> dict[str, Any]:
    import hora.torch as hvd

    pair = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[pair])
    out: dict[str, Any] = {}
    for shard in (1, 2):
        out[f"stage{shard}"] = _compare("adam", shard, process_set=pair)["difference"]
    hvd.barrier()  # rank 1, alone, finishes first: its shutdown would end the job
    hvd.shutdown()
    return out


@pytest.mark.timeout(150)
def test_a_process_set_shards_among_its_members() -> None:
    # Rank 1 is not a member: it trains alone, as with the unsharded optimizer.
    for rank, observed in enumerate(run_job(_process_set_worker, 3, timeout_s=120)):
        for stage in (1, 2):
            assert observed[f"stage{stage}"] < 1e-6, (rank, observed)


# ---------------------------------------------------------------- the example

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "pytorch_zero_digits.py")
FINAL = re.compile(r"^\[0\]<stdout>:final test accuracy: (\d\.\d{4})$", re.MULTILINE)
SHARES = re.compile(r"optimizer state per rank \[([\d, ]+)\] bytes")


def _example(np: int, *args: str) -> str:
    command = [sys.executable, "-m", "hora.runner.launch", "-np", str(np), sys.executable]
    done = subprocess.run([*command, EXAMPLE, *args], capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.timeout(300)
def test_the_example_trains_checkpoints_and_resumes_on_more_workers(tmp_path: Path) -> None:
    import torch

    folder = str(tmp_path / "ckpt")
    output = _example(2, "--checkpoint-dir", folder)
    assert float(FINAL.findall(output)[0]) >= 0.9, output
    shares = [int(n) for n in SHARES.findall(output)[0].split(",")]
    # The whole state the script saved: each rank held half of it (and a step count for each
    # parameter it has a piece of).
    whole = torch.load(Path(folder) / "optimizer-consolidated.pt")
    entries = [t for s in whole["state"].values() for k, t in s.items() if k != "step"]
    everything = sum(t.numel() * t.element_size() for t in entries)
    assert abs(sum(shares) - everything) <= 8 * len(whole["state"]), (shares, everything)
    steps = 4 * len(whole["state"])
    assert max(shares) <= everything / 2 + steps + 8, (shares, everything)
    # Three workers resume from two workers' files (combined and re-sharded), in float16.
    resumed = _example(3, "--checkpoint-dir", folder, "--resume", "--epochs", "9", "--amp")
    assert "epoch 9/9" in resumed and "epoch 8/9" not in resumed, resumed
    assert float(FINAL.findall(resumed)[0]) >= 0.9, resumed
