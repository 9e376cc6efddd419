"""Gradient compression for PyTorch tensors: :mod:`hora.common.ops.compression`'s policy with
PyTorch's casts (``Compression.none``, ``.fp16``, ``.bf16``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hora.common.ops.compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class _TorchCasts:
    def dtype(self, tensor: Any) -> Any:
        return tensor.dtype

    def is_floating(self, dtype: Any) -> bool:
        return bool(dtype.is_floating_point)

    def wire_dtype(self, name: str) -> Any:
        return getattr(torch, name)

    def cast(self, tensor: Any, dtype: Any) -> Any:
        return tensor.to(dtype)


class FP16Compressor(CastCompressor):
    """Floating-point tensors travel as float16."""

    wire = "float16"
    casts = _TorchCasts()


class BF16Compressor(CastCompressor):
    """Floating-point tensors travel as bfloat16 (float32's range, less precision)."""

    wire = "bfloat16"
    casts = _TorchCasts()


class Compression:
    """The available compressors: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def compressed(
    compression: Any,
    tensors: Sequence[torch.Tensor],
    run: Callable[[list[torch.Tensor]], Sequence[torch.Tensor]],
) -> list[torch.Tensor]:
    """``run`` on the tensors as ``compression`` sends them (contiguous); each result as
    ``compression`` gives it back. (hora's collectives use it; not one of Horovod's names.)"""
    sent = [compression.compress(t) for t in tensors]
    results = run([t.contiguous() for t, _ in sent])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, sent)]
