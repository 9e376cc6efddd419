"""Gradient compression's one policy, for every framework: floating-point tensors travel as a
smaller floating-point type and are cast back afterwards; other tensors travel as they are.

Horovod's API has a ``Compression`` namespace of compressor classes per framework
(``hvd.Compression.none``, ``.fp16``, ``.bf16``), whose ``compress(tensor) -> (tensor, ctx)``
and ``decompress(tensor, ctx) -> tensor`` users also implement themselves. The policy is written
once here; an adapter supplies how its tensors are cast (:class:`Casts`) and names its
compressors.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol


class Casts(Protocol):
    """How one framework casts its tensors, for :class:`CastCompressor`."""

    def dtype(self, tensor: Any) -> Any:
        """The tensor's element type."""

    def is_floating(self, dtype: Any) -> bool:
        """Whether ``dtype`` is a floating-point type."""

    def wire_dtype(self, name: str) -> Any:
        """The framework's type named ``float16`` or ``bfloat16``."""

    def cast(self, tensor: Any, dtype: Any) -> Any:
        """``tensor`` as ``dtype``."""


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


class CastCompressor(Compressor):
    """Floating-point tensors travel as :attr:`wire` (``float16`` or ``bfloat16``); the context
    is the original type, or ``None`` for a tensor sent as it is."""

    wire: ClassVar[str] = "float16"
    casts: ClassVar[Casts]

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        casts = cls.casts
        dtype = casts.dtype(tensor)
        wire = casts.wire_dtype(cls.wire)
        if casts.is_floating(dtype) and dtype != wire:
            return casts.cast(tensor, wire), dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor: Any, ctx: Any) -> Any:
        return tensor if ctx is None else cls.casts.cast(tensor, ctx)
