"""DistributedOptimizer, broadcast_parameters and broadcast_optimizer_state on real processes.

The central check is equivalence: training with hora on N ranks, each with a slice of every batch,
gives the parameters that one plain PyTorch process reaches on the whole batch. Each worker trains
both (the reference locally, from rank 0's initial weights) and reports the largest difference.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from hora.common.vocabulary.errors import HoraInternalError
from hora.torch.averaging_optimizer import _HOLD_BELOW

from .jobs import assert_raised, error_of, run_job

BATCH = 12  # divisible by 2 and 3, so every rank's slice has the same size
STEPS = 4


def _model(seed: int, hidden: int = 8) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, 1),
    )


OPTIMIZERS: dict[str, Any] = {
    "sgd": lambda p, torch: torch.optim.SGD(p, lr=0.05),
    "sgd_momentum": lambda p, torch: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda p, torch: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p, torch: torch.optim.AdamW(p, lr=0.01),
    "rmsprop": lambda p, torch: torch.optim.RMSprop(p, lr=0.01),
    "adagrad": lambda p, torch: torch.optim.Adagrad(p, lr=0.05),
    "adadelta": lambda p, torch: torch.optim.Adadelta(p),
    "adamax": lambda p, torch: torch.optim.Adamax(p, lr=0.01),
    "nadam": lambda p, torch: torch.optim.NAdam(p, lr=0.01),
    "radam": lambda p, torch: torch.optim.RAdam(p, lr=0.01),
}


def _train(
    optimizer_name: str,
    passes: int = 1,
    compression: str = "none",
    float64_from: int | None = None,
    steps: int = STEPS,
    hidden: int = 8,
    set_to_none: bool = True,
    observe: Any = None,
    prepare: Any = None,
    **wrap: Any,
) -> float:
    """Train hora and a one-process reference side by side; return the largest difference.

    ``float64_from``: the step from which both models are in float64 (``model.double()``);
    the steps before it reduce float32 gradients but update nothing, so that the models are
    still equal when float64 starts. ``prepare(model)`` runs before the first step,
    ``observe(model)`` after each step.
    """
    import torch

    import hora.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    make = OPTIMIZERS[optimizer_name]
    model = _model(100 + rank, hidden)  # ranks start apart; broadcast_parameters must fix it
    optimizer = hvd.DistributedOptimizer(
        make(model.parameters(), torch),
        named_parameters=model.named_parameters(),
        backward_passes_per_step=passes,
        compression=getattr(hvd.Compression, compression),
        **wrap,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if prepare is not None:
        prepare(model)
    reference = _model(100, hidden)
    reference_optimizer = make(reference.parameters(), torch)
    data = torch.Generator().manual_seed(7)
    per_rank = BATCH // size
    dtype = torch.float32
    rate = optimizer.param_groups[0]["lr"]
    for step in range(steps):
        if float64_from is not None:
            for group in optimizer.param_groups + reference_optimizer.param_groups:
                group["lr"] = rate if step >= float64_from else 0.0
        if step == float64_from:
            dtype = torch.float64
            model.double()
            reference.double()
        optimizer.zero_grad(set_to_none=set_to_none)
        reference_optimizer.zero_grad(set_to_none=set_to_none)
        for _ in range(passes):
            x = torch.randn(BATCH, 6, generator=data).to(dtype)
            y = torch.randn(BATCH, 1, generator=data).to(dtype)
            mine = slice(rank * per_rank, (rank + 1) * per_rank)
            torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            torch.nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
        reference_optimizer.step()
        if observe is not None:
            observe(model)
    return _largest_difference(model, reference)


def _largest_difference(model: Any, reference: Any) -> float:
    return max(
        (a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters())
    )


def _equivalence_worker() -> dict[str, Any]:
    import hora.torch as hvd

    hvd.init()
    out: dict[str, Any] = {name: _train(name) for name in OPTIMIZERS}
    out["sgd_passes_2"] = _train("sgd_momentum", passes=2)
    out["adam_passes_2"] = _train("adam", passes=2)
    out["sgd_fp16"] = _train("sgd_momentum", compression="fp16")
    out["sgd_bf16"] = _train("sgd_momentum", compression="bf16")
    # HORA_GRADIENT_COMPRESSION is read as each optimizer is built: it picks bf16 for one built
    # with the default Compression.none, and leaves one built with fp16 as it is.
    os.environ["HORA_GRADIENT_COMPRESSION"] = "bf16"
    out["sgd_setting_bf16"] = _train("sgd_momentum")
    out["sgd_setting_keeps_fp16"] = _train("sgd_momentum", compression="fp16")
    del os.environ["HORA_GRADIENT_COMPRESSION"]
    out["sgd_groups_2"] = _train("sgd_momentum", groups=2)
    out["adam_predivide"] = _train("adam", gradient_predivide_factor=2.0)
    # The gradients' dtype changes midway on every rank: float64 training stays exact.
    out["sgd_float64_midway"] = _train("sgd", float64_from=STEPS // 2)
    hvd.shutdown()
    return out


@pytest.fixture(
    scope="module",
    params=[(2, False), (3, False), (2, True), (3, True)],
    ids=lambda p: f"np{p[0]}" + ("-mpi" if p[1] else ""),
)
def equivalence(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    np, mpi = request.param
    return run_job(_equivalence_worker, np, timeout_s=150, mpi=mpi)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_training_matches_one_process_on_the_whole_batch(
    equivalence: list[dict[str, Any]], name: str
) -> None:
    for rank, observed in enumerate(equivalence):
        assert observed[name] < 1e-5, f"rank {rank}: {name} differs by {observed[name]}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("case", "tolerance"),
    [
        ("sgd_passes_2", 1e-5),
        ("adam_passes_2", 1e-5),
        ("sgd_groups_2", 1e-5),
        ("adam_predivide", 1e-5),
        ("sgd_float64_midway", 1e-13),
        ("sgd_fp16", 2e-3),
        ("sgd_bf16", 2e-2),
    ],
)
def test_options_keep_training_equivalent(
    equivalence: list[dict[str, Any]], case: str, tolerance: float
) -> None:
    for rank, observed in enumerate(equivalence):
        assert observed[case] < tolerance, f"rank {rank}: {case} differs by {observed[case]}"


@pytest.mark.timeout(180)
def test_the_compression_setting_picks_a_compressor_for_the_default_only(
    equivalence: list[dict[str, Any]],
) -> None:
    for rank, observed in enumerate(equivalence):
        assert observed["sgd_bf16"] != observed["sgd_momentum"], f"rank {rank}"
        assert observed["sgd_setting_bf16"] == observed["sgd_bf16"], f"rank {rank}"
        assert observed["sgd_setting_keeps_fp16"] == observed["sgd_fp16"], f"rank {rank}"


def _lending_worker() -> dict[str, Any]:
    """Steady-state training whose gradients adopt views of the engine's buffers (see
    hora.common.ops.repeated.RepeatedAllreduce): with zero_grad()'s default, with gradients kept and
    zeroed in place, and with a caller that keeps every step's gradients."""
    import hora.torch as hvd
    from hora.common import basics

    hvd.init()
    engine = basics.engine()
    assert engine is not None
    out: dict[str, Any] = {}
    # 600 wide: one batch of large tensors (scaled one by one as they are staged) and one of
    # small ones (scaled in the buffer).
    steps, hidden = 10, 600
    kept: list[tuple[Any, Any]] = []
    storage: list[Any] = []

    def train(case: str, set_to_none: bool, keep: str = "", prepare: Any = None) -> None:
        # Per step: how many gradients' memory is distinct, and the buffers allocated so far.
        storages, buffers = out.setdefault(case + "_storages", []), []

        def observe(model: Any) -> None:
            grads = [p.grad for p in model.parameters()]
            storages.append(len({g.untyped_storage().data_ptr() for g in grads}))
            buffers.append(engine.steady_stats["buffers"])
            if keep == "tensors":
                kept.extend((g, g.clone()) for g in grads)
            elif keep == "storage" and len(storages) == steps - 4:
                # Only the storage object of one gradient, no tensor: it stays unchanged too.
                storage.extend([grads[0].untyped_storage(), bytes(grads[0].untyped_storage())])

        out[case] = _train(
            "sgd_momentum",
            steps=steps,
            hidden=hidden,
            set_to_none=set_to_none,
            observe=observe,
            prepare=prepare,
        )
        # Buffers allocated in each of the last 4 steps, when the steady state has settled.
        out[case + "_buffers"] = [b - a for a, b in zip(buffers[-5:], buffers[-4:])]
        out[case + "_batches"] = len(engine.schedule.batches) if engine.schedule else 0

    train("set_to_none", True)
    train("zeroed_in_place", False)
    train("kept", True, keep="tensors")
    train("storage_kept", True, keep="storage")
    flat: list[Any] = []

    def flat_gradients(model: Any) -> None:
        # The caller's own layout: every gradient a view of one flat buffer, kept across steps.
        import torch

        params = list(model.parameters())
        flat.append(torch.zeros(sum(p.numel() for p in params)))
        offset = 0
        for p in params:
            p.grad = flat[0][offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    train("flat_buffer", False, prepare=flat_gradients)
    out["kept_changed"] = sum(not held.equal(copy) for held, copy in kept)
    out["storage_changed"] = bytes(storage[0]) != storage[1]
    hvd.shutdown()
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 3])
def test_steady_state_gradients_adopt_the_engines_buffers_safely(np: int) -> None:
    for rank, observed in enumerate(run_job(_lending_worker, np, timeout_s=120)):
        for case in ("set_to_none", "zeroed_in_place", "kept", "storage_kept", "flat_buffer"):
            assert observed[case] < 1e-5, f"rank {rank}: {case} differs by {observed[case]}"
            assert observed[case + "_batches"] == 2, (rank, case, observed)
        # Gradients that are views of the caller's own flat buffer stay there: results are
        # written into them.
        assert set(observed["flat_buffer_storages"]) == {1}, observed
        for case in ("set_to_none", "zeroed_in_place", "kept", "storage_kept"):
            # The steady-state steps' gradients share their batches' buffers (6 parameters in
            # 2 batches); the first, negotiated steps' gradients are autograd's own tensors.
            assert observed[case + "_storages"][0] == 6, (rank, case, observed)
            assert observed[case + "_storages"][-1] == 2, (rank, case, observed)
        # Gradients reset to None each step free the lent views: one buffer per batch serves.
        # Gradients kept and zeroed in place hold the buffer they adopted first and get the
        # results copied into it: each batch stages into a second one, allocated once.
        assert observed["set_to_none_buffers"] == [0, 0, 0, 0], observed
        assert observed["zeroed_in_place_buffers"] == [0, 0, 0, 0], observed
        # Gradients a caller keeps are never written again: every batch takes a new buffer.
        assert observed["kept_buffers"] == [2, 2, 2, 2], observed
        assert observed["kept_changed"] == 0, observed
        # A storage object kept alone holds its batch's buffer, which is replaced once.
        assert observed["storage_kept_buffers"] == [1, 0, 0, 0], observed
        assert not observed["storage_changed"], observed


def _holding_worker() -> dict[str, Any]:
    """Steady-state training, recording when each gradient arrives and when it is submitted.

    In the steady state the optimizer holds a gradient until the rest of its batch (the
    engine's schedule) is in, then submits the batch's gradients together (see
    DistributedOptimizer._batches_now). Per case: the difference from the one-process
    reference, the last step's events and the schedule's batches.
    """
    import copy

    import torch

    import hora.torch as hvd
    from hora.common import basics

    hvd.init()
    engine = basics.engine()
    events: list[str] = []
    enqueue = engine.enqueue

    def recording_enqueue(entries: Any, posted: bool = False) -> None:
        # Records each submission, then queues it as usual.
        events.extend("submit " + e.request.name.removeprefix("allreduce.grad.") for e in entries)
        enqueue(entries, posted=posted)

    engine.enqueue = recording_enqueue  # type: ignore[method-assign]

    def prepare(model: Any) -> None:
        # Registered after the optimizer's hooks, so each runs after the optimizer's.
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda _, name=name: events.append("grad " + name))

    out: dict[str, Any] = {}
    steps: list[list[str]] = []
    steady_after: list[bool] = []

    def run(case: str, deviate_at: int | None = None, **options: Any) -> None:
        entered = engine.steady_stats["entered"]

        def observe(model: Any) -> None:
            steps.append(list(events))
            events.clear()
            # What the next step's first gradient will see: a loaded machine may enter the
            # steady state a step or two later than a quiet one.
            steady_after.append(engine.batch_layout is not None)
            if len(steps) == deviate_at:
                # Something the schedule does not predict: negotiation, then a new schedule.
                # (Asynchronous, so that the engine runs it: a synchronous call runs on the
                # caller's thread, on the fast path, and the engine never sees it.)
                hvd.synchronize(hvd.allreduce_async(torch.ones(1), name=f"deviation.{case}"))

        steps.clear()
        steady_after.clear()
        # Plain SGD: with momentum, 12 steps of this wide model (two passes summed) blow up.
        out[case] = _train("sgd", hidden=600, prepare=prepare, observe=observe, **options)
        # The last step that began in the steady state (not the one its deviation left).
        held = [i for i in range(1, len(steps)) if steady_after[i - 1] and i != deviate_at]
        out[case + "_events"] = steps[held[-1]] if held else []
        out[case + "_steady_after"] = list(steady_after)
        schedule = engine.schedule
        out[case + "_batches"] = [
            [r.name.removeprefix("allreduce.grad.") for r in batch]
            for batch in (schedule.batches if schedule is not None else [])
        ]
        out[case + "_entered"] = engine.steady_stats["entered"] - entered
        out["sizes"] = {name: p.numel() for name, p in _model(0, 600).named_parameters()}

    run("plain", steps=8)
    run("passes_2", steps=8, passes=2)
    run("deviation", steps=16, deviate_at=5)

    # A parameter that gets no gradient: its batch is complete only in step(), which submits
    # the held gradients and zeros for it. Every other step the caller also sets every .grad to
    # None before step(): what is reduced is still the gradient each hook saw, whether its hook
    # submitted it or held it.
    torch.manual_seed(0)  # the same initial weights on every rank
    layers = {"used": (6, 600), "head": (600, 1), "unused": (6, 1)}
    model = torch.nn.ModuleDict({k: torch.nn.Linear(*shape) for k, shape in layers.items()})
    plain = copy.deepcopy(model)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters()
    )
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(3)
    rank, size = hvd.rank(), hvd.size()
    per_rank = BATCH // size
    for step in range(8):
        x = torch.randn(BATCH, 6, generator=data)
        for net, opt, rows in (
            (model, optimizer, slice(rank * per_rank, (rank + 1) * per_rank)),
            (plain, plain_optimizer, slice(None)),
        ):
            opt.zero_grad()
            net["head"](torch.tanh(net["used"](x[rows]))).pow(2).mean().backward()
            if net is model and step % 2:
                for p in net.parameters():
                    p.grad = None
            opt.step()
    out["unused"] = _largest_difference(model, plain)
    out["unused_steady"] = engine.schedule is not None

    # Two backward passes a step with a wait for an engine result in between (a metric), all in
    # one batch: the thread submits the gradients it holds before it waits, so the engine sees
    # the wait after the first pass's gradients, cuts the batch there and stays in the steady
    # state. (A synchronous allreduce runs on the fast path, where the engine does not see it.)
    torch.manual_seed(1)
    two = torch.nn.ModuleDict({k: torch.nn.Linear(6, 4) for k in ("a", "b")})
    plain = copy.deepcopy(two)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(two.parameters(), lr=0.05), named_parameters=two.named_parameters()
    )
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.05)
    entered, blocked = engine.steady_stats["entered"], engine.steady_stats["blocked"]
    for _ in range(24):
        x = torch.randn(4, 6, generator=data)  # the same on every rank
        for net, opt in ((two, optimizer), (plain, plain_optimizer)):
            opt.zero_grad()
            first = net["a"](x).pow(2).mean()
            first.backward()
            if net is two:
                hvd.synchronize(hvd.allreduce_async(first.detach(), name="metric"))
            net["b"](x).pow(2).mean().backward()
            opt.step()
    out["metric"] = _largest_difference(two, plain)
    out["metric_entered"] = engine.steady_stats["entered"] - entered
    out["metric_blocked"] = engine.steady_stats["blocked"] - blocked
    schedule = engine.schedule
    out["metric_batches"] = [len(b) for b in schedule.batches] if schedule is not None else []
    hvd.shutdown()
    return out


def _assert_held_until_batch_complete(
    events: list[str], batches: list[list[str]], large: set[str]
) -> None:
    """The small gradients of each batch are submitted together, by the hook of the last of
    them to arrive; large ones by their own hook; the first batch before backward ends.

    With several backward passes per step only the last one submits: it alone is checked.
    """
    grads = [i for i, e in enumerate(events) if e.startswith("grad ")]
    passes = len(grads) // len({events[i] for i in grads})
    if passes > 1:
        events = events[grads[-len(grads) // passes - 1] + 1 :]
    for batch in batches:
        small = [name for name in batch if name not in large]
        assert len(small) > 1, batch  # the model is chosen so that holding shows
        positions = [events.index("submit " + name) for name in small]
        first = min(positions)
        assert sorted(positions) == list(range(first, first + len(small))), (batch, events)
        # The hook of the batch's last small gradient submitted them (user hooks run after).
        last = events[first + len(small)]
        assert last.startswith("grad ") and last[5:] in small, (batch, events)
        arrived = {e[5:] for e in events[:first] if e.startswith("grad ")}
        assert set(small) - arrived == {last[5:]}, (batch, events)
        for name in batch:
            if name in large:
                position = events.index("submit " + name)
                assert events[position + 1] == "grad " + name, (name, events)
    last_gradient = max(i for i, e in enumerate(events) if e.startswith("grad "))
    assert min(events.index("submit " + name) for name in batches[0]) < last_gradient, events


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 3])
def test_steady_state_gradients_are_submitted_a_batch_at_a_time(np: int) -> None:
    for rank, observed in enumerate(run_job(_holding_worker, np, timeout_s=120)):
        for case in ("plain", "passes_2", "deviation"):
            assert observed[case] < 1e-5, f"rank {rank}: {case} differs by {observed[case]}"
            batches = observed[case + "_batches"]
            assert len(batches) == 2, (rank, case, batches)
            large = {n for n, size in observed["sizes"].items() if size >= _HOLD_BELOW}
            assert large == {"2.weight"}, observed["sizes"]
            said = (
                f"rank {rank}, {case}, steady after each step: {observed[case + '_steady_after']}"
            )
            assert observed[case + "_events"], said  # a step began in the steady state
            try:
                _assert_held_until_batch_complete(observed[case + "_events"], batches, large)
            except AssertionError as exc:
                raise AssertionError(f"{said}: {exc}") from None
        # The deviation left the steady state; the schedule entered anew holds gradients too.
        assert observed["deviation_entered"] == 2, observed
        assert observed["unused_steady"], observed
        assert observed["unused"] < 1e-5, f"rank {rank}: differs by {observed['unused']}"
        # A wait between two backward passes: one blocked batch teaches the cut, once.
        assert observed["metric"] < 1e-5, observed
        assert observed["metric_blocked"] == 1, observed
        assert observed["metric_entered"] == 2, observed
        assert observed["metric_batches"] == [3, 2], observed


def _behaviour_worker() -> dict[str, Any]:
    import warnings

    import torch

    import hora.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    model = _model(seed=1)

    def wrap(**kwargs: Any) -> Any:
        return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)

    out["not_tuples"] = error_of(lambda: wrap(named_parameters=list(model.parameters())))
    named = list(model.named_parameters())
    out["duplicates"] = error_of(lambda: wrap(named_parameters=[named[0], named[0], *named[1:]]))
    out["unnamed"] = error_of(lambda: wrap(named_parameters=named[:-1]))
    out["bad_passes"] = error_of(lambda: wrap(backward_passes_per_step=0))
    out["predivide_sum"] = error_of(lambda: wrap(op=hvd.Sum, gradient_predivide_factor=2.0))
    out["adasum"] = error_of(
        lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(_model(seed=9).parameters(), lr=0.1), op=hvd.Adasum
        )
    )
    out["lbfgs"] = error_of(
        lambda: hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), 0)
    )
    out["bad_params"] = error_of(lambda: hvd.broadcast_parameters(42, root_rank=0))

    # The guards: zero_grad with reductions in flight; too many backward passes.
    optimizer = wrap(named_parameters=model.named_parameters())
    x = torch.randn(4, 6)
    model(x).sum().backward()
    out["zero_grad_race"] = error_of(optimizer.zero_grad)
    out["too_many_passes"] = error_of(lambda: model(x).sum().backward())
    optimizer.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    out["step_warning"] = [str(w.message) for w in caught]

    # Gradient clipping between synchronize() and step(), as Horovod documents it.
    optimizer.zero_grad()
    (model(torch.full((4, 6), float(rank + 1))).sum() * 100).backward()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with optimizer.skip_synchronize():
            optimizer.step()
    out["skip_warning"] = [str(w.message) for w in caught]
    out["clipped_weights"] = [p.detach().clone() for p in model.parameters()]

    # A parameter that only some ranks use still gets a (zero) gradient reduced everywhere.
    branches = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 1), "b": torch.nn.Linear(3, 1)})
    hvd.broadcast_parameters(branches.state_dict(), root_rank=0)
    branch_opt = hvd.DistributedOptimizer(
        torch.optim.SGD(branches.parameters(), lr=1.0), named_parameters=branches.named_parameters()
    )
    used = "a" if rank == 0 else "b"
    branches[used](torch.ones(2, 3)).sum().backward()
    branch_opt.step()
    out["unused_grad_b"] = branches["b"].weight.grad.clone()
    out["unused_grad_a"] = branches["a"].weight.grad.clone()

    # Sparse gradients: an embedding with sparse=True, reduced sparse and as dense.
    for sparse_as_dense in (False, True):
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(10, 3, sparse=True)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(embedding.parameters(), lr=1.0),
            named_parameters=[(f"emb{int(sparse_as_dense)}", embedding.weight)],
            sparse_as_dense=sparse_as_dense,
        )
        embedding(torch.tensor([rank, rank + 1])).sum().backward()
        opt.synchronize()
        out[f"sparse_grad_{sparse_as_dense}"] = embedding.weight.grad.to_dense().clone()

    # A fresh optimizer: its state stays empty (Adam's step count starts at zero, as in one
    # process), and every trainable parameter without a gradient gets a zero one, which a
    # Horovod script may broadcast right away.
    fresh_model = _model(seed=6)
    fresh_model[0].bias.requires_grad_(False)
    fresh = hvd.DistributedOptimizer(
        torch.optim.Adam(fresh_model.parameters(), lr=0.1),
        named_parameters=fresh_model.named_parameters(),
    )
    hvd.broadcast_optimizer_state(fresh, root_rank=0)
    out["fresh_state"] = len(fresh.state)
    out["fresh_grads"] = {
        name: None if p.grad is None else p.grad.clone()
        for name, p in fresh_model.named_parameters()
    }
    out["fresh_grad_broadcast"] = hvd.broadcast(fresh_model[0].weight.grad, root_rank=0)

    # Sum instead of Average; and hyperparameters travel with broadcast_optimizer_state.
    summed = hvd.DistributedOptimizer(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1 * (rank + 1)),
        op=hvd.Sum,
    )
    hvd.broadcast_optimizer_state(summed, root_rank=0)
    out["lr_after_broadcast"] = summed.param_groups[0]["lr"]
    weight = summed.param_groups[0]["params"][0]
    (weight * (rank + 1)).sum().backward()
    summed.synchronize()
    out["sum_grad"] = weight.grad.clone()
    out["size"] = size

    # Mixed precision on the CPU with a GradScaler, the Horovod way.
    amp_model = _model(seed=3)
    amp_opt = hvd.DistributedOptimizer(
        torch.optim.SGD(amp_model.parameters(), lr=0.1),
        named_parameters=amp_model.named_parameters(),
    )
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = amp_model(torch.randn(4, 6)).float().pow(2).mean()
    scaler.scale(loss).backward()
    amp_opt.synchronize()
    scaler.unscale_(amp_opt)
    with amp_opt.skip_synchronize():
        scaler.step(amp_opt)
    scaler.update()
    out["amp_finite"] = all(torch.isfinite(p).all().item() for p in amp_model.parameters())

    # Step hooks run once per step, around the update, and see the averaged gradients.
    hooked = _model(seed=4)
    hooked_opt = hvd.DistributedOptimizer(
        torch.optim.SGD(hooked.parameters(), lr=0.1), named_parameters=hooked.named_parameters()
    )
    seen: list[Any] = []
    hooked_opt.register_step_pre_hook(lambda *_: seen.append(("pre", hooked[0].bias.grad.clone())))
    hooked_opt.register_step_post_hook(lambda *_: seen.append(("post", None)))
    hooked(torch.full((2, 6), float(rank))).sum().backward()
    hooked_opt.step()
    out["step_hooks"] = [kind for kind, _ in seen]
    out["pre_hook_grad"] = seen[0][1] if seen else None

    # Gradients that change dtype on one rank only are a mismatch, reported as for any allreduce
    # (each parameter's allreduce is described anew when its gradient's dtype changes).
    mixed = _model(seed=5)
    mixed_opt = hvd.DistributedOptimizer(
        torch.optim.SGD(mixed.parameters(), lr=0.1), named_parameters=mixed.named_parameters()
    )
    dtype = torch.float32
    for step in range(3):
        if step == 2 and rank == 0:
            dtype = torch.float64
            mixed.double()
        mixed_opt.zero_grad()
        mixed(torch.ones(2, 6, dtype=dtype)).sum().backward()
        out["dtype_changed_alone"] = error_of(mixed_opt.step)
    hvd.shutdown()
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda np: f"np{np}")
def behaviour(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return run_job(_behaviour_worker, request.param, timeout_s=120)


@pytest.mark.timeout(150)
def test_bad_arguments_are_explained(behaviour: list[dict[str, Any]]) -> None:
    for observed in behaviour:
        assert_raised(observed["not_tuples"], ValueError, "sequence of tuples (name, parameter)")
        assert_raised(observed["duplicates"], ValueError, "must be unique. Found duplicates")
        assert_raised(observed["unnamed"], ValueError, "were not named")
        assert_raised(observed["bad_passes"], ValueError, "backward_passes_per_step must be > 0")
        assert_raised(observed["predivide_sum"], ValueError, "gradient_predivide_factor")
        if observed["size"] == 3:  # Adasum needs a power-of-two number of ranks
            assert_raised(observed["adasum"], NotImplementedError, "Adasum", "3 ranks")
        else:
            assert observed["adasum"] is None
        assert_raised(observed["lbfgs"], ValueError, "cannot broadcast torch.optim.LBFGS state")
        assert_raised(observed["bad_params"], ValueError, "invalid params of type")


@pytest.mark.timeout(150)
def test_guards_and_warnings_match_horovod(behaviour: list[dict[str, Any]]) -> None:
    for observed in behaviour:
        assert_raised(observed["zero_grad_race"], AssertionError, "before optimizer.step()")
        assert_raised(observed["too_many_passes"], AssertionError, "backward_passes_per_step")
        assert any("skip_synchronize()" in w for w in observed["step_warning"])
        assert observed["skip_warning"] == []


@pytest.mark.timeout(150)
def test_clipping_between_synchronize_and_step_keeps_ranks_identical(
    behaviour: list[dict[str, Any]],
) -> None:
    first = behaviour[0]["clipped_weights"]
    for observed in behaviour[1:]:
        for mine, theirs in zip(observed["clipped_weights"], first):
            assert (mine - theirs).abs().max().item() == 0.0


@pytest.mark.timeout(150)
def test_parameters_unused_on_some_ranks_are_reduced_as_zero(
    behaviour: list[dict[str, Any]],
) -> None:
    size = behaviour[0]["size"]
    users_of_b = size - 1  # every rank but rank 0 used branch b
    for observed in behaviour:
        # d(sum(W x))/dW with x = ones(2, 3) is 2 per element; averaged over all ranks.
        b_grad, a_grad = observed["unused_grad_b"], observed["unused_grad_a"]
        assert b_grad.allclose(b_grad * 0 + 2 * users_of_b / size)
        assert a_grad.allclose(a_grad * 0 + 2 / size)


@pytest.mark.timeout(150)
def test_sparse_gradients_are_averaged_sparse_or_dense(behaviour: list[dict[str, Any]]) -> None:
    import torch

    size = behaviour[0]["size"]
    expected = torch.zeros(10, 3)
    for rank in range(size):
        expected[rank] += 1.0 / size
        expected[rank + 1] += 1.0 / size
    for observed in behaviour:
        for sparse_as_dense in (False, True):
            assert observed[f"sparse_grad_{sparse_as_dense}"].allclose(expected)


@pytest.mark.timeout(150)
def test_broadcast_state_of_a_fresh_optimizer_leaves_zero_gradients(
    behaviour: list[dict[str, Any]],
) -> None:
    for observed in behaviour:
        assert observed["fresh_state"] == 0
        grads = observed["fresh_grads"]
        assert grads.pop("0.bias") is None  # frozen: no gradient
        assert grads and all(torch.equal(g, torch.zeros_like(g)) for g in grads.values())
        assert torch.equal(observed["fresh_grad_broadcast"], grads["0.weight"])


@pytest.mark.timeout(150)
def test_sum_op_and_broadcast_hyperparameters(behaviour: list[dict[str, Any]]) -> None:
    size = behaviour[0]["size"]
    total = sum(range(1, size + 1))
    for observed in behaviour:
        assert observed["lr_after_broadcast"] == pytest.approx(0.1)
        assert observed["sum_grad"].tolist() == [float(total)] * 2
        assert observed["amp_finite"]


# case: (optimizer, backward_passes_per_step, last and first layers as groups)
PART_CASES: dict[str, tuple[str, int, bool]] = {
    "sgd_momentum": ("sgd_momentum", 1, False),
    "adam": ("adam", 1, False),
    "sgd_groups": ("sgd_momentum", 1, True),
    "adam_passes_2": ("adam", 2, False),
}


def _parts_worker() -> dict[str, Any]:
    """The last rank pauses in the middle of backward, after its last layer's gradients, so
    the other ranks reach step() with those reduced and the rest still on the wire."""
    import time

    import torch

    import hora.torch as hvd
    import hora.torch.averaging_optimizer

    # This model's parts are far below the size worth splitting for speed; split them anyway.
    hora.torch.averaging_optimizer._PART_MIN_ELEMENTS = 0
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    class Pause(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            if rank == size - 1:
                time.sleep(0.15)
            return grad

    def build(seed: int) -> Any:
        torch.manual_seed(seed)
        return torch.nn.ModuleList(
            [torch.nn.Linear(6, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)]
        )

    def forward(layers: Any, x: Any, pause: bool) -> Any:
        x = torch.tanh(layers[0](x))
        x = torch.tanh(layers[1](x))
        return layers[2](Pause.apply(x) if pause else x)

    out: dict[str, Any] = {}
    for case, (name, passes, grouped) in PART_CASES.items():
        model, reference = build(100 + rank), build(100)
        groups = None
        if grouped:  # the last layer (reduced before the pause) and the first, as groups
            groups = [list(model[2].parameters()), list(model[0].parameters())]
        optimizer = hvd.DistributedOptimizer(
            OPTIMIZERS[name](model.parameters(), torch),
            named_parameters=model.named_parameters(),
            backward_passes_per_step=passes,
            groups=groups,
        )
        reference_optimizer = OPTIMIZERS[name](reference.parameters(), torch)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        parts = []
        step_only = optimizer._step_only

        def counting(
            params: Any, skip: Any = None, step_only: Any = step_only, parts: Any = parts
        ) -> Any:
            parts.append(len(params) if params is not None else -1)
            return step_only(params, skip)

        optimizer._step_only = counting
        data = torch.Generator().manual_seed(7)
        per_rank = BATCH // size
        for _ in range(3):
            optimizer.zero_grad()
            reference_optimizer.zero_grad()
            for _ in range(passes):
                x = torch.randn(BATCH, 6, generator=data)
                y = torch.randn(BATCH, 1, generator=data)
                mine = slice(rank * per_rank, (rank + 1) * per_rank)
                loss = torch.nn.functional.mse_loss(forward(model, x[mine], True), y[mine])
                loss.backward()
                torch.nn.functional.mse_loss(forward(reference, x, False), y).backward()
            optimizer.step()
            reference_optimizer.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out[case] = {
            "parts": parts,
            "reference": _largest_difference(model, reference),
            "ranks": (hvd.allgather(flat.unsqueeze(0), name=f"flat.{case}") - flat)
            .abs()
            .max()
            .item(),
        }
    hvd.shutdown()
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 3])
def test_step_updates_parameters_in_parts_as_gradients_arrive(np: int) -> None:
    results = run_job(_parts_worker, np)
    for case in PART_CASES:
        for rank, observed in enumerate(results):
            result = observed[case]
            assert result["ranks"] == 0.0, f"rank {rank}: ranks differ ({case}): {result}"
            assert result["reference"] < 1e-5, f"rank {rank}: {case}: {result}"
        # Rank 0 got the last layer's gradients while the last rank paused: it updated those
        # parameters first (a part of n parameters), then the rest (-1).
        parts = results[0][case]["parts"]
        assert -1 in parts and parts[0] > 0, (case, parts)


@pytest.mark.timeout(150)
def test_step_hooks_run_once_and_see_averaged_gradients(behaviour: list[dict[str, Any]]) -> None:
    for rank, observed in enumerate(behaviour):
        assert observed["step_hooks"] == ["pre", "post"], f"rank {rank}: {observed['step_hooks']}"
        # Each rank's own gradient differs (its input is its rank); the average does not.
        assert observed["pre_hook_grad"].equal(behaviour[0]["pre_hook_grad"]), rank


@pytest.mark.timeout(150)
def test_a_gradient_dtype_changed_on_one_rank_is_a_mismatch(
    behaviour: list[dict[str, Any]],
) -> None:
    for observed in behaviour:
        assert_raised(
            observed["dtype_changed_alone"],
            HoraInternalError,
            "Mismatched data types for 'allreduce.grad.",
            "float64",
            "float32",
        )
