"""Gradient compression for TensorFlow tensors: :mod:`hora.common.ops.compression`'s policy with
TensorFlow's casts (``Compression.none``, ``.fp16``, ``.bf16``)."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hora.common.ops.compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class _TensorFlowCasts:
    def dtype(self, tensor: Any) -> Any:
        return tensor.dtype

    def is_floating(self, dtype: Any) -> bool:
        return bool(dtype.is_floating)

    def wire_dtype(self, name: str) -> Any:
        return getattr(tf, name)

    def cast(self, tensor: Any, dtype: Any) -> Any:
        return tf.cast(tensor, dtype)


class FP16Compressor(CastCompressor):
    """Floating-point tensors travel as float16."""

    wire = "float16"
    casts = _TensorFlowCasts()


class BF16Compressor(CastCompressor):
    """Floating-point tensors travel as bfloat16 (float32's range, less precision)."""

    wire = "bfloat16"
    casts = _TensorFlowCasts()


class Compression:
    """The available compressors: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
