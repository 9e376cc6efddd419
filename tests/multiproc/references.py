"""Per-rank inputs and the results collectives must produce, computed in plain PyTorch.

Every rank's input is a function of (rank, name, shape, dtype) alone, so a worker builds its own
and the test rebuilds all ranks' inputs to compute the expected result independently of hora.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.bool,
)

# Loose enough for a ring reduction of 2-3 values done in the dtype itself.
_TOLERANCE = {
    torch.float16: {"rtol": 1e-2, "atol": 1e-2},
    torch.bfloat16: {"rtol": 3e-2, "atol": 3e-2},
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
}


def rank_input(
    rank: int, name: str, shape: Sequence[int] = (3, 4), dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The tensor ``rank`` contributes under ``name``: small values, so integer ops never overflow.

    Integers lie in [-4, 4] ([0, 5] for uint8), so even an int8 product over 3 ranks fits.
    """
    seed = zlib.crc32(f"{rank}/{name}".encode())
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(tuple(shape), generator=generator) > 0.5
    if dtype.is_floating_point:
        return torch.randn(tuple(shape), generator=generator, dtype=torch.float64).to(dtype)
    low, high = (0, 6) if dtype == torch.uint8 else (-4, 5)
    return torch.randint(low, high, tuple(shape), generator=generator, dtype=torch.int64).to(dtype)


def all_inputs(
    size: int, name: str, shape: Sequence[int] = (3, 4), dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    return [rank_input(rank, name, shape, dtype) for rank in range(size)]


def scale(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Horovod's scaling: integers through float64, truncated toward zero."""
    if factor == 1.0:
        return tensor
    if tensor.dtype.is_floating_point:
        return tensor * factor
    return (tensor.double() * factor).trunc().to(tensor.dtype)


def expected_allreduce(
    inputs: Sequence[torch.Tensor],
    op: str,
    prescale: float = 1.0,
    postscale: float = 1.0,
    size: int | None = None,
) -> torch.Tensor:
    """``postscale * op(prescale * x_r)``; Average divides the sum by ``size`` (default: all).

    Floats are reduced in float64 and cast back; bool Sum/Max is "or", Min/Product is "and".
    """
    dtype = inputs[0].dtype
    size = len(inputs) if size is None else size
    if dtype == torch.bool:
        stacked = torch.stack(list(inputs))
        return stacked.any(0) if op in ("Sum", "Max") else stacked.all(0)
    if op == "Average":
        postscale = postscale / size
    if dtype.is_floating_point:
        work = [x.double() * prescale for x in inputs]
    else:
        work = [scale(x, prescale).long() for x in inputs]
    stacked = torch.stack(work)
    reduced = {
        "Sum": stacked.sum(0),
        "Average": stacked.sum(0),
        "Min": stacked.min(0).values,
        "Max": stacked.max(0).values,
        "Product": stacked.prod(0),
    }[op]
    if dtype.is_floating_point:
        return (reduced * postscale).to(dtype)
    return scale(reduced.to(dtype), postscale)


def reducescatter_rows(dim0: int, size: int) -> list[int]:
    """Rows each rank receives: the first ``dim0 % size`` ranks get one extra."""
    return [dim0 // size + (1 if rank < dim0 % size else 0) for rank in range(size)]


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Exact for integers and bool; a dtype-appropriate tolerance for floating point."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if expected.dtype.is_floating_point:
        torch.testing.assert_close(
            actual, expected, msg=lambda m: f"{what}: {m}", **_TOLERANCE[expected.dtype]
        )
    else:
        assert torch.equal(actual, expected), f"{what}:\n{actual}\n!=\n{expected}"
