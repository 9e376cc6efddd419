"""hora under ``torch.compile``, on real processes: every collective as an operator of the graph,
the forms with handles, errors, and ``DistributedOptimizer`` in each way of compiling a loop.

Compiling is slow on a small machine, so each world size runs two jobs: one calls every
collective from a few compiled functions and the same functions eagerly, the other trains a small
model in each way of compiling against an eager run. The tests compare what they report.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hora.common.vocabulary.errors import HoraInternalError, HoraValueError

from .jobs import assert_raised, error_of, run_job
from .references import all_inputs, assert_same, expected_allreduce, rank_input

pytestmark = pytest.mark.slow

# Compiling a function takes tens of seconds here: one job's budget.
JOB_TIMEOUT_S = 900.0


# ---------------------------------------------------------------- collectives


def _collectives(
    x: torch.Tensor, w: torch.Tensor, i: torch.Tensor, z: torch.Tensor, pair: Any
) -> Any:
    """Every collective once (the reducescatter input ``z`` does not divide evenly), and an
    allreduce in the process set ``pair`` (see :func:`_members`)."""
    import hora.torch as hvd

    y = x * w
    out = {
        "average": hvd.allreduce(y, name="c.average"),
        "sum": hvd.allreduce(y, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
        "max_int": hvd.allreduce(i, op=hvd.Max, name="c.max_int"),
        "grouped": hvd.grouped_allreduce(
            [y, y * 2], name="c.grouped", compression=hvd.Compression.fp16
        ),
        "allgather": hvd.allgather(y, name="c.allgather"),
        "grouped_allgather": hvd.grouped_allgather([y, i], name="c.grouped_allgather"),
        "broadcast": hvd.broadcast(y, root_rank=1, name="c.broadcast"),
        "alltoall": hvd.alltoall(y, name="c.alltoall"),
        "reducescatter": hvd.reducescatter(z * w[0, 0], op=hvd.Sum, name="c.reducescatter"),
        "grouped_reducescatter": hvd.grouped_reducescatter([z, z * 3], name="c.grs"),
    }
    hvd.allreduce(y * 3, name="c.unused")  # its result is unused: every rank still submits it
    if pair.included():
        out["pair"] = hvd.allreduce(y, op=hvd.Sum, name="c.pair", process_set=pair)
    floats = [v for v in out.values() for v in (v if isinstance(v, list) else [v])]
    loss = sum(v.sum() for v in floats if v.is_floating_point())
    return loss, out


def _members(size: int) -> list[int]:
    """A process set that leaves the last rank out."""
    return [0, 1] if size > 2 else [0]


def _in_place(x: torch.Tensor) -> Any:
    """The in-place forms."""
    import hora.torch as hvd

    y = x.clone()
    returned = hvd.allreduce_(y, op=hvd.Sum, name="h.inplace")
    pair = hvd.grouped_allreduce_([x.clone(), x * 2], name="h.grouped")
    b = x + 1
    hvd.broadcast_(b, root_rank=0, name="h.broadcast")
    return y, returned, pair[0], pair[1], b


def _with_handle(x: torch.Tensor) -> torch.Tensor:
    import hora.torch as hvd

    return hvd.synchronize(hvd.allreduce_async(x * 2, name="h.async")) + 1  # type: ignore[no-any-return]


def _uneven(x: torch.Tensor, splits: list[int]) -> Any:
    """Shapes known only when the call runs (Dynamo told to capture them)."""
    import hora.torch as hvd

    gathered = hvd.allgather(x, name="u.allgather")
    received, received_splits = hvd.alltoall(x, splits=splits, name="u.alltoall")
    return gathered * 2, received + 1, received_splits


def _ops_worker() -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    hvd.init(process_sets="dynamic")
    rank, size = hvd.rank(), hvd.size()
    pair = hvd.add_process_set(_members(size))
    out: dict[str, Any] = {}

    def inputs() -> tuple[torch.Tensor, ...]:
        x = rank_input(rank, "x", (2 * size, 3))
        w = torch.full((2 * size, 3), 1.5, requires_grad=True)
        i = rank_input(rank, "i", (2 * size, 3), torch.int64)
        return x, w, i, rank_input(rank, "z", (3 * size - 1, 2))

    # Eagerly, then compiled whole (fullgraph: no graph break), forward and backward.
    for how, run in (
        ("eager", _collectives),
        ("compiled", torch.compile(_collectives, fullgraph=True)),
    ):
        x, w, i, z = inputs()
        loss, values = run(x, w, i, z, pair)
        loss.backward()
        out[how] = {"values": values, "grad": w.grad}
    autotuned = torch.compile(
        lambda t: hvd.allreduce(t * 2, name="autotune") + 1,
        fullgraph=True,
        mode="max-autotune-no-cudagraphs",
    )
    x = rank_input(rank, "autotune", (4, 4))
    out["autotune"] = (autotuned(x), hvd.allreduce(x * 2, name="autotune") + 1)

    x = rank_input(rank, "handles", (5,))
    out["in_place"] = (_in_place(x), torch.compile(_in_place, fullgraph=True)(x))
    # A form with a handle breaks the graph (an error with fullgraph=True) and runs eagerly.
    out["with_handle"] = (_with_handle(x), torch.compile(_with_handle, backend="aot_eager")(x))

    # Unnamed calls are numbered when they run, as eager ones: rank 0's compiled calls meet
    # the other ranks' eager ones.
    def unnamed(t: torch.Tensor) -> torch.Tensor:
        return hvd.allreduce(t) + hvd.allreduce(t * 2, op=hvd.Sum)

    mixed = torch.compile(unnamed, fullgraph=True) if rank == 0 else unnamed
    out["mixed"] = mixed(rank_input(rank, "mixed", (3,)))

    # Dynamo keeps allgather and alltoall, whose first dimension depends on the other ranks, in
    # a graph with fullgraph=True, or when told to capture such operators; otherwise it breaks
    # the graph there and runs them eagerly.
    x = rank_input(rank, "uneven", (rank + 2, 2))
    splits = [1] * (size - 1) + [rank + 2 - (size - 1)]
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        out["uneven"] = (_uneven(x, splits), torch.compile(_uneven)(x, splits))
    out["uneven.breaks"] = dict(counters["graph_break"])
    out["uneven.default"] = torch.compile(_uneven, backend="aot_eager")(x, splits)

    def compiled(fn: Any, *args: Any) -> Any:
        return error_of(lambda: torch.compile(fn, backend="aot_eager", fullgraph=True)(*args))

    shape = torch.ones(2 + rank)
    out["err.shape"] = compiled(lambda t: hvd.allreduce(t, name="err.shape"), shape)
    out["err.shape.eager"] = error_of(lambda: hvd.allreduce(shape, name="err.shape.eager"))
    flags = torch.ones(3) > 0
    out["err.bool"] = compiled(lambda t: hvd.allreduce(t, name="err.bool"), flags)
    out["err.bool.eager"] = error_of(lambda: hvd.allreduce(flags, name="err.bool.eager"))
    out["err.op"] = compiled(lambda t: hvd.reducescatter(t, op=hvd.Max), torch.ones(4))
    out["err.handle"] = compiled(_with_handle, x)
    if not pair.included():
        out["err.member"] = compiled(lambda t: hvd.allreduce(t, process_set=pair), torch.ones(3))
    out["after_errors"] = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after")
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"np{n}")
def ops_job(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    np = request.param
    return np, run_job(_ops_worker, np, timeout_s=JOB_TIMEOUT_S)


@pytest.mark.timeout(1000)
def test_every_collective_compiles_whole_and_gives_the_eager_results(ops_job: Any) -> None:
    np, ranks = ops_job
    for rank, observed in enumerate(ranks):
        eager, compiled = observed["eager"]["values"], observed["compiled"]["values"]
        assert sorted(eager) == sorted(compiled)
        for key in eager:
            pairs = (
                zip(eager[key], compiled[key])
                if isinstance(eager[key], list)
                else [(eager[key], compiled[key])]
            )
            for e, c in pairs:
                assert c.dtype == e.dtype and c.shape == e.shape, (rank, key)
                assert torch.equal(c, e), (rank, key, c, e)
        torch.testing.assert_close(
            observed["compiled"]["grad"], observed["eager"]["grad"], rtol=1e-6, atol=1e-6
        )
        xs = all_inputs(np, "x", (2 * np, 3))
        ys = [x * 1.5 for x in xs]
        assert_same(compiled["average"], expected_allreduce(ys, "Average"))
        assert_same(compiled["sum"], expected_allreduce(ys, "Sum", 2.0, 0.5))
        ints = all_inputs(np, "i", (2 * np, 3), torch.int64)
        assert_same(compiled["max_int"], expected_allreduce(ints, "Max"))
        assert_same(compiled["allgather"], torch.cat(ys))
        assert_same(compiled["broadcast"], ys[1])
        assert compiled["grouped"][0].dtype == torch.float32
        assert compiled["reducescatter"].shape[0] == (3 * np - 1 + np - 1 - rank) // np
        members = _members(np)
        if rank in members:
            assert_same(compiled["pair"], expected_allreduce(ys[: len(members)], "Sum"))


@pytest.mark.timeout(1000)
def test_max_autotune_mode_compiles_an_allreduce(ops_job: Any) -> None:
    _, ranks = ops_job
    for observed in ranks:
        compiled, eager = observed["autotune"]
        assert torch.equal(compiled, eager)


@pytest.mark.timeout(1000)
def test_in_place_forms_trace_as_functional_calls(ops_job: Any) -> None:
    _, ranks = ops_job
    for observed in ranks:
        eager, compiled = observed["in_place"]
        for e, c in zip(eager, compiled):
            assert torch.equal(e, c)
        assert torch.equal(compiled[0], compiled[1])  # allreduce_ returns its tensor


@pytest.mark.timeout(1000)
def test_forms_with_handles_break_the_graph_naming_the_functional_form(ops_job: Any) -> None:
    _, ranks = ops_job
    for observed in ranks:
        eager, compiled = observed["with_handle"]
        assert torch.equal(eager, compiled)
        error = observed["err.handle"]
        assert error is not None and "Unsupported" in error["types"], error
        assert "hvd.allreduce_async returns a handle" in error["message"]
        assert "call hvd.allreduce(...)" in error["message"]


@pytest.mark.timeout(1000)
def test_unnamed_compiled_calls_meet_eager_ones_by_their_number(ops_job: Any) -> None:
    np, ranks = ops_job
    inputs = all_inputs(np, "mixed", (3,))
    expected = expected_allreduce(inputs, "Average") + expected_allreduce(
        [2 * x for x in inputs], "Sum"
    )
    for observed in ranks:
        assert_same(observed["mixed"], expected)


@pytest.mark.timeout(1000)
def test_data_dependent_shapes_compile_when_dynamo_captures_them(ops_job: Any) -> None:
    _, ranks = ops_job
    for observed in ranks:
        eager, compiled = observed["uneven"]
        for e, c, d in zip(eager, compiled, observed["uneven.default"]):
            assert torch.equal(e, c) and torch.equal(e, d)
        assert observed["uneven.breaks"] == {}


@pytest.mark.timeout(1000)
def test_errors_are_the_eager_errors(ops_job: Any) -> None:
    np, ranks = ops_job
    for rank, observed in enumerate(ranks):
        assert_raised(
            observed["err.shape"], HoraInternalError, "Mismatched allreduce tensor shapes"
        )
        assert observed["err.shape"]["types"] == observed["err.shape.eager"]["types"]
        assert_raised(observed["err.bool"], HoraValueError, "Average is not defined for bool")
        assert observed["err.bool"]["message"] == observed["err.bool.eager"]["message"]
        assert_raised(observed["err.op"], HoraValueError, "only supports AVERAGE and SUM")

        if rank == np - 1:
            assert_raised(observed["err.member"], HoraValueError, "not a member")
        assert observed["after_errors"].tolist() == [np, np]


# ---------------------------------------------------------------- DistributedOptimizer


class _PlainSGD(torch.optim.Optimizer):
    """An optimizer whose step Dynamo traces whole (torch.optim's break the graph on purpose)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure: Any = None) -> None:
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])


# What each way of compiling compiles, and what is still eager.
WAYS = ("model", "autograd", "step", "whole")
RUNS = [("sgd", 1), ("adam", 2)]


def _train(way: str, optimizer_name: str, passes: int, steps: int = 3) -> dict[str, Any]:
    """Train a small model ``steps`` steps of ``passes`` backward passes, compiled ``way`` (or
    eagerly); report the parameters, the reduced gradients and each rank's local ones."""
    import copy

    import torch
    import torch.nn.functional as F

    import hora.torch as hvd

    rank = hvd.rank()
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    if optimizer_name == "sgd":
        base: Any = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    elif optimizer_name == "adam":
        base = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        base = _PlainSGD(model.parameters())
    optimizer = hvd.DistributedOptimizer(
        base, named_parameters=model.named_parameters(), backward_passes_per_step=passes
    )
    data = torch.Generator().manual_seed(10 + rank)  # every rank its own batches
    batches = [
        (torch.randn(4, 6, generator=data), torch.randint(0, 3, (4,), generator=data))
        for _ in range(steps * passes)
    ]
    # This rank's own gradient of the first step, before any reduction.
    for x, y in batches[:passes]:
        F.cross_entropy(reference(x), y).backward()
    local = [p.grad for p in reference.parameters()]
    forward = torch.compile(model) if way in ("model", "autograd") else model

    def backward(x: torch.Tensor, y: torch.Tensor) -> None:
        F.cross_entropy(forward(x), y).backward()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        backward(x, y)
        optimizer.step()

    counters = torch._dynamo.utils.counters
    counters.clear()
    # Compiled autograd applies to the backward passes of functions compiled while it is on.
    with torch._dynamo.config.patch(
        compiled_autograd=way == "autograd", trace_autograd_ops=way == "whole"
    ):
        if way == "autograd":
            backward = torch.compile(backward)
        run_step = (
            torch.compile(step, fullgraph=way == "whole") if way in ("step", "whole") else None
        )
        for index in range(steps):
            optimizer.zero_grad()
            mine = batches[index * passes : (index + 1) * passes]
            if run_step is None:
                for x, y in mine:
                    backward(x, y)
                optimizer.step()
            else:
                for x, y in mine[:-1]:
                    backward(x, y)
                run_step(*mine[-1])
    breaks = {str(reason).split("\n")[0]: n for reason, n in counters["graph_break"].items()}
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [p.grad.clone() for p in model.parameters()],
        "local": local,
        "breaks": breaks,
    }


def _reduce_gradients(compiled: bool, steps: int = 3) -> dict[str, Any]:
    """A step that reduces its own gradients: backward, ``hvd.grouped_allreduce`` of the
    gradients, an SGD update and ``hvd.allreduce`` of the loss; compiled whole (fullgraph=True,
    the backward traced with ``trace_autograd_ops``) or eagerly."""
    import torch
    import torch.nn.functional as F

    import hora.torch as hvd

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    weights = list(model.parameters())
    data = torch.Generator().manual_seed(20 + hvd.rank())
    x, y = torch.randn(4, 6, generator=data), torch.randint(0, 3, (4,), generator=data)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for p in weights:
            p.grad = None
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads = hvd.grouped_allreduce([p.grad for p in weights], name="reduce.grads")
        with torch.no_grad():
            for p, grad in zip(weights, grads):
                p.sub_(0.1 * grad)
        return hvd.allreduce(loss.detach(), name="reduce.loss")  # type: ignore[no-any-return]

    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        run = torch.compile(step, fullgraph=True) if compiled else step
        losses = [run(x, y) for _ in range(steps)]
    return {
        "params": [p.detach().clone() for p in weights],
        "losses": losses,
        "breaks": dict(counters["graph_break"]),
    }


def _optimizer_worker() -> dict[str, Any]:
    import hora.torch as hvd

    hvd.init()
    out: dict[str, Any] = {}
    for name, passes in RUNS:
        out[("eager", name, passes)] = _train("eager", name, passes)
        for way in ("model", "autograd", "step"):
            out[(way, name, passes)] = _train(way, name, passes)
    out[("eager", "plain", 1)] = _train("eager", "plain", 1)
    out[("whole", "plain", 1)] = _train("whole", "plain", 1)
    # Last: torch 2.13's Dynamo, tracing torch.optim's step() after a compiled function that
    # closed over a list of parameters, fails inside ("'weights' not in cell_and_freevars"),
    # with or without hora.
    out["reduce.eager"] = _reduce_gradients(compiled=False)
    out["reduce.compiled"] = _reduce_gradients(compiled=True)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"np{n}")
def optimizer_job(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    np = request.param
    return np, run_job(_optimizer_worker, np, timeout_s=JOB_TIMEOUT_S)


def _relative_difference(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """The parameters' difference relative to their size: ||actual - expected|| / ||expected||
    (Inductor's kernels round differently from eager ones, so parameters near zero differ by more
    than 1e-6 of themselves after a few steps of Adam, whose update divides by the gradient)."""
    difference = sum(float((a - e).double().pow(2).sum()) for a, e in zip(actual, expected))
    size = sum(float(e.double().pow(2).sum()) for e in expected)
    return (difference / size) ** 0.5


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("way", ["model", "autograd", "step"])
@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r[0]}-passes{r[1]}")
def test_compiled_training_reaches_the_eager_parameters(
    optimizer_job: Any, way: str, run: tuple[str, int]
) -> None:
    _, ranks = optimizer_job
    for observed in ranks:
        eager, compiled = observed[("eager", *run)], observed[(way, *run)]
        difference = _relative_difference(compiled["params"], eager["params"])
        print(f"{way} {run}: relative difference {difference:.2e}")
        assert difference <= 1e-6


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("way", ["eager", "model", "autograd", "step"])
def test_gradients_differ_before_the_reduction_and_agree_after(
    optimizer_job: Any, way: str
) -> None:
    _, ranks = optimizer_job
    key = (way, *RUNS[0])
    local = [observed[key]["local"][0] for observed in ranks]
    assert not any(torch.equal(local[0], other) for other in local[1:])
    first = ranks[0][key]
    for observed in ranks[1:]:
        for a, b in zip(first["grads"], observed[key]["grads"]):
            assert torch.equal(a, b)
        for a, b in zip(first["params"], observed[key]["params"]):
            assert torch.equal(a, b)


@pytest.mark.timeout(1000)
def test_compiled_autograd_traces_the_gradient_hooks_without_a_break(optimizer_job: Any) -> None:
    _, ranks = optimizer_job
    for observed in ranks:
        # The only break is Dynamo's own, at loss.backward() (compiled autograd takes it over).
        for reason in observed[("autograd", *RUNS[0])]["breaks"]:
            assert "backward" in reason, reason


@pytest.mark.timeout(1000)
def test_a_whole_training_step_compiles_as_one_graph(optimizer_job: Any) -> None:
    _, ranks = optimizer_job
    for observed in ranks:
        whole, eager = observed[("whole", "plain", 1)], observed[("eager", "plain", 1)]
        assert whole["breaks"] == {}
        assert _relative_difference(whole["params"], eager["params"]) <= 1e-6
    for a, b in zip(
        ranks[0][("whole", "plain", 1)]["params"], ranks[-1][("whole", "plain", 1)]["params"]
    ):
        assert torch.equal(a, b)


@pytest.mark.timeout(1000)
def test_a_step_that_allreduces_its_gradients_compiles_whole(optimizer_job: Any) -> None:
    _, ranks = optimizer_job
    for observed in ranks:
        compiled, eager = observed["reduce.compiled"], observed["reduce.eager"]
        assert compiled["breaks"] == {}
        assert _relative_difference(compiled["params"], eager["params"]) <= 1e-6
        torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-6, atol=0)
    for observed in ranks[1:]:  # the reduced gradients made every rank's update the same
        for a, b in zip(
            ranks[0]["reduce.compiled"]["params"], observed["reduce.compiled"]["params"]
        ):
            assert torch.equal(a, b)
