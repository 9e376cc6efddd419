"""Gradient compression for TensorFlow tensors: a smaller type on the wire, the original after."""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class _CastCompressor(Compressor):
    wire_dtype: tf.DType = tf.float16

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        dtype = tensor.dtype
        if dtype.is_floating and dtype != cls.wire_dtype:
            return tf.cast(tensor, cls.wire_dtype), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor if ctx is None else tf.cast(tensor, ctx)


class FP16Compressor(_CastCompressor):
    """Floating-point tensors travel as float16."""

    wire_dtype = tf.float16


class BF16Compressor(_CastCompressor):
    """Floating-point tensors travel as bfloat16 (float32's range, less precision)."""

    wire_dtype = tf.bfloat16


class Compression:
    """The available compressors: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
