"""allreduce on real processes: every op and dtype, scale factors, the async, in-place and grouped
forms, and autograd.

One job per world size runs every call (spawning workers is the slow part); each test then
checks one behaviour against references rebuilt in this process from every rank's input. Every
world size runs twice: as configured by default, where these small tensors are mostly reduced
from bytes carried in the negotiation exchange, and with ``HORA_CARRY_THRESHOLD=0``, where every
one runs as a Gloo collective.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch

from .jobs import assert_raised, error_of, run_job
from .references import DTYPES, all_inputs, assert_same, expected_allreduce, rank_input

OPS = ("Sum", "Average", "Min", "Max", "Product")


class Case(NamedTuple):
    """One allreduce call: the same on every rank, with each rank's own input."""

    name: str
    dtype: torch.dtype
    op: str
    prescale: float = 1.0
    postscale: float = 1.0


def _dtype_label(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


MATRIX = [
    Case(f"{_dtype_label(dtype)}.{op}", dtype, op)
    for dtype in DTYPES
    for op in OPS
    if not (dtype == torch.bool and op == "Average")
]

SCALED = [
    Case(f"scaled.{_dtype_label(dtype)}.{op}.{pre:g}.{post:g}", dtype, op, pre, post)
    for dtype, op, pre, post in [
        (torch.float32, "Sum", 0.5, 3.0),
        (torch.float64, "Average", 2.0, 0.25),
        (torch.float16, "Sum", 0.5, 2.0),
        (torch.bfloat16, "Average", 2.0, 0.5),
        # Integers: each rank's x * 0.5 truncates toward zero, then so does sum * 1.5.
        (torch.int32, "Sum", 0.5, 1.5),
        (torch.int64, "Average", 1.0, 1.0),
        (torch.int8, "Sum", 1.5, 0.5),
        (torch.int16, "Max", 2.5, -0.5),
        (torch.int64, "Min", 1.0, 0.75),
    ]
]

# A grouped call may mix shapes and dtypes.
GROUP = [
    ((3, 4), torch.float32),
    ((5,), torch.float64),
    ((2, 2), torch.int32),
    ((6,), torch.float32),
]


def _allreduce_worker(cases: list[Case]) -> dict[str, Any]:
    import time

    import torch

    import hora.torch as hvd
    from hora.common.basics import engine as hvd_engine

    hvd.init()
    rank = hvd.rank()

    def mine(
        name: str, shape: tuple[int, ...] = (3, 4), dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        return rank_input(rank, name, shape, dtype)

    def group(prefix: str) -> list[torch.Tensor]:
        return [mine(f"{prefix}.{i}", shape, dtype) for i, (shape, dtype) in enumerate(GROUP)]

    out: dict[str, Any] = {"results": {}, "inputs_unchanged": []}
    for case in cases:
        x = mine(case.name, dtype=case.dtype)
        out["results"][case.name] = hvd.allreduce(
            x,
            name=case.name,
            op=getattr(hvd, case.op),
            prescale_factor=case.prescale,
            postscale_factor=case.postscale,
        )
        out["inputs_unchanged"].append(torch.equal(x, mine(case.name, dtype=case.dtype)))

    out["bool_average"] = error_of(
        lambda: hvd.allreduce(mine("bool", dtype=torch.bool), name="bool.avg", op=hvd.Average)
    )
    out["default_op"] = hvd.allreduce(mine("default"), name="default")
    out["unnamed"] = hvd.allreduce(mine("unnamed"), op=hvd.Sum)

    # Async: poll never blocks and eventually says done; synchronize gives the result once.
    x = mine("async")
    handle = hvd.allreduce_async(x, name="async", op=hvd.Sum)
    deadline = time.monotonic() + 30
    while not hvd.poll(handle) and time.monotonic() < deadline:
        time.sleep(0.005)
    out["async_polled_done"] = hvd.poll(handle)
    out["async"] = hvd.synchronize(handle)
    out["async_input_unchanged"] = torch.equal(x, mine("async"))
    out["synchronize_again"] = hvd.synchronize(handle)

    # In place: the input is the output.
    y = mine("inplace")
    out["inplace_returns_input"] = hvd.allreduce_(y, name="inplace", op=hvd.Sum) is y
    out["inplace"] = y
    z = mine("inplace_async")
    out["inplace_async_returns_input"] = (
        hvd.synchronize(hvd.allreduce_async_(z, name="inplace_async", op=hvd.Max)) is z
    )
    out["inplace_async"] = z

    # Grouped: a list in, a list out, in the same order.
    inputs = group("grouped")
    out["grouped"] = hvd.grouped_allreduce(inputs, name="grouped", op=hvd.Sum)
    out["grouped_inputs_unchanged"] = all(
        torch.equal(a, b) for a, b in zip(inputs, group("grouped"))
    )
    out["grouped_async"] = hvd.synchronize(
        hvd.grouped_allreduce_async(group("grouped_async"), name="grouped_async", op=hvd.Min)
    )
    in_place = group("grouped_inplace")
    returned = hvd.grouped_allreduce_(in_place, name="grouped_inplace", op=hvd.Sum)
    out["grouped_inplace_returns_inputs"] = [r is t for r, t in zip(returned, in_place)]
    out["grouped_inplace"] = in_place
    in_place_async = group("grouped_inplace_async")
    returned = hvd.synchronize(
        hvd.grouped_allreduce_async_(in_place_async, name="grouped_inplace_async", op=hvd.Max)
    )
    out["grouped_inplace_async_returns_inputs"] = [r is t for r, t in zip(returned, in_place_async)]
    out["grouped_inplace_async"] = in_place_async
    # Before the autograd calls below, which ask for the gradient's allreduce from autograd's
    # thread: counted here, the number is the same on every rank.
    out["carried"] = hvd_engine().carried

    # Autograd: d/dx_r of sum_s(w_s * allreduce(x)) is allreduce(w).
    for op in ("Sum", "Average"):
        x = mine(f"grad.{op}.x", (5,), torch.float64).requires_grad_()
        weight = mine(f"grad.{op}.w", (5,), torch.float64)
        value = hvd.allreduce(x, op=getattr(hvd, op), name=f"grad.{op}")
        (value * weight).sum().backward()
        out[f"grad.{op}.value"] = value.detach()
        out[f"grad.{op}"] = x.grad
    hvd.shutdown()
    return out


@pytest.fixture(
    scope="module",
    params=[(2, True, False), (3, True, False), (2, False, False), (3, False, False)]
    + [(2, False, True), (3, False, True)],
    ids=lambda p: f"np{p[0]}" + ("" if p[1] else "-collective") + ("-mpi" if p[2] else ""),
)
def job(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    # The MPI variants reduce every case with MPI's (and hora's half-float) reductions.
    np, carry, mpi = request.param
    # Carrying is the engine's: the carried variants keep synchronous calls off the fast path
    # (which the collective variants take).
    env = {"HORA_FAST_PATH": "0"} if carry else {"HORA_CARRY_THRESHOLD": "0"}
    ranks = run_job(_allreduce_worker, np, MATRIX + SCALED, env=env, mpi=mpi)
    carried = {observed["carried"] for observed in ranks}
    assert len(carried) == 1, f"ranks counted different carried allreduces: {carried}"
    if carry:
        # Each run of named calls starts as a collective, then rides in the exchange.
        assert carried.pop() > len(MATRIX), "small allreduces were not carried"
    else:
        assert carried == {0}
    return np, ranks


def _expected(np: int, case: Case) -> torch.Tensor:
    return expected_allreduce(
        all_inputs(np, case.name, dtype=case.dtype), case.op, case.prescale, case.postscale
    )


def _expected_group(np: int, prefix: str, op: str) -> list[torch.Tensor]:
    return [
        expected_allreduce(all_inputs(np, f"{prefix}.{i}", shape, dtype), op)
        for i, (shape, dtype) in enumerate(GROUP)
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", MATRIX, ids=lambda c: c.name)
def test_every_op_and_dtype_matches_reference(job: Any, case: Case) -> None:
    np, ranks = job
    expected = _expected(np, case)
    for rank, observed in enumerate(ranks):
        assert_same(observed["results"][case.name], expected, f"rank {rank} {case.name}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", SCALED, ids=lambda c: c.name)
def test_scale_factors_match_reference(job: Any, case: Case) -> None:
    np, ranks = job
    expected = _expected(np, case)
    for rank, observed in enumerate(ranks):
        assert_same(observed["results"][case.name], expected, f"rank {rank} {case.name}")


@pytest.mark.timeout(120)
def test_allreduce_leaves_its_input_alone(job: Any) -> None:
    _, ranks = job
    assert all(all(observed["inputs_unchanged"]) for observed in ranks)


@pytest.mark.timeout(120)
def test_average_of_bool_raises_value_error(job: Any) -> None:
    _, ranks = job
    for observed in ranks:
        assert_raised(observed["bool_average"], ValueError, "bool")


@pytest.mark.timeout(120)
def test_default_op_is_average_and_unnamed_calls_match(job: Any) -> None:
    np, ranks = job
    for observed in ranks:
        assert_same(
            observed["default_op"], expected_allreduce(all_inputs(np, "default"), "Average")
        )
        assert_same(observed["unnamed"], expected_allreduce(all_inputs(np, "unnamed"), "Sum"))


@pytest.mark.timeout(120)
def test_async_poll_then_synchronize(job: Any) -> None:
    np, ranks = job
    expected = expected_allreduce(all_inputs(np, "async"), "Sum")
    for observed in ranks:
        assert observed["async_polled_done"] is True
        assert_same(observed["async"], expected)
        assert observed["async_input_unchanged"]
        assert observed["synchronize_again"] is None


@pytest.mark.timeout(120)
def test_in_place_forms_write_into_the_input(job: Any) -> None:
    np, ranks = job
    for observed in ranks:
        assert observed["inplace_returns_input"]
        assert_same(observed["inplace"], expected_allreduce(all_inputs(np, "inplace"), "Sum"))
        assert observed["inplace_async_returns_input"]
        assert_same(
            observed["inplace_async"], expected_allreduce(all_inputs(np, "inplace_async"), "Max")
        )


@pytest.mark.timeout(120)
def test_grouped_forms_return_lists(job: Any) -> None:
    np, ranks = job
    for observed in ranks:
        assert observed["grouped_inputs_unchanged"]
        for key, op in [
            ("grouped", "Sum"),
            ("grouped_async", "Min"),
            ("grouped_inplace", "Sum"),
            ("grouped_inplace_async", "Max"),
        ]:
            assert isinstance(observed[key], list), key
            expected = _expected_group(np, key, op)
            assert len(observed[key]) == len(expected)
            for index, (actual, wanted) in enumerate(zip(observed[key], expected)):
                assert_same(actual, wanted, f"{key}[{index}]")
        assert all(observed["grouped_inplace_returns_inputs"])
        assert all(observed["grouped_inplace_async_returns_inputs"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_gradient_of_allreduce_is_the_allreduced_gradient(job: Any, op: str) -> None:
    np, ranks = job
    inputs = all_inputs(np, f"grad.{op}.x", (5,), torch.float64)
    weights = all_inputs(np, f"grad.{op}.w", (5,), torch.float64)
    for observed in ranks:
        assert_same(observed[f"grad.{op}.value"], expected_allreduce(inputs, op))
        assert_same(observed[f"grad.{op}"], expected_allreduce(weights, op))
