"""Gradient compression's one policy, for every framework: floating-point tensors travel as a
smaller floating-point type and are cast back afterwards; other tensors travel as they are.

Horovod's API has a ``Compression`` namespace of compressor classes per framework
(``hvd.Compression.none``, ``.fp16``, ``.bf16``), whose ``compress(tensor) -> (tensor, ctx)``
and ``decompress(tensor, ctx) -> tensor`` users also implement themselves. The policy is written
once here; an adapter supplies how its tensors are cast (:class:`Casts`) and names its
compressors.

The policy never looks inside a tensor or a type: a tensor is whatever the framework's is (the
type variable ``TensorT``: what goes in comes out), a type (``dtype``) and a compressor's
context are opaque objects it only compares and hands back.
"""

from __future__ import annotations

import logging
from typing import ClassVar, Protocol, TypeVar

from hora.common.vocabulary import settings_table as table
from hora.common.vocabulary.config import SettingError, read

TensorT = TypeVar("TensorT")
logger = logging.getLogger("hora")


class Casts(Protocol):
    """How one framework casts its tensors, for :class:`CastCompressor`."""

    def dtype(self, tensor: object) -> object:
        """The tensor's element type."""

    def is_floating(self, dtype: object) -> bool:
        """Whether ``dtype`` is a floating-point type."""

    def wire_dtype(self, name: str) -> object:
        """The framework's type named ``float16`` or ``bfloat16``."""

    def cast(self, tensor: TensorT, dtype: object) -> TensorT:
        """``tensor`` as ``dtype``."""


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx) -> tensor``.

    ``ctx`` is the compressor's own: whatever ``compress`` needs ``decompress`` to know.
    """

    @staticmethod
    def compress(tensor: TensorT) -> tuple[TensorT, object]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: TensorT, ctx: object) -> TensorT:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: TensorT) -> tuple[TensorT, object]:
        return tensor, None

    @staticmethod
    def decompress(tensor: TensorT, ctx: object) -> TensorT:
        return tensor


class CastCompressor(Compressor):
    """Floating-point tensors travel as :attr:`wire` (``float16`` or ``bfloat16``); the context
    is the original type, or ``None`` for a tensor sent as it is."""

    wire: ClassVar[str] = "float16"
    casts: ClassVar[Casts]

    @classmethod
    def compress(cls, tensor: TensorT) -> tuple[TensorT, object]:
        casts = cls.casts
        dtype = casts.dtype(tensor)
        wire = casts.wire_dtype(cls.wire)
        if casts.is_floating(dtype) and dtype != wire:
            return casts.cast(tensor, wire), dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor: TensorT, ctx: object) -> TensorT:
        return tensor if ctx is None else cls.casts.cast(tensor, ctx)


def for_gradients(compression: object, fp16: object, bf16: object) -> object:
    """The compressor an optimizer or gradient tape built with ``compression`` sends gradients
    with: ``compression`` itself, except where it is :class:`NoneCompressor` (the default) and
    ``HORA_GRADIENT_COMPRESSION`` names ``fp16`` or ``bf16``: then the adapter's compressor of
    that name (``fp16``, ``bf16``).

    Raises:
        SettingError: ``HORA_GRADIENT_COMPRESSION`` is not ``none``, ``fp16`` or ``bf16``.
    """
    if compression is not NoneCompressor:
        return compression
    name = read(table.GRADIENT_COMPRESSION)
    problem = table.GRADIENT_COMPRESSION.problem(name)
    if problem is not None:
        raise SettingError(problem)
    if name == "none":
        return compression
    logger.debug("gradients travel as %s (HORA_GRADIENT_COMPRESSION=%s)", name, name)
    return fp16 if name == "fp16" else bf16
