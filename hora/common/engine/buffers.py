"""The data plane's arithmetic on flat torch buffers: dtypes, scale factors, averages, and
where results go.

The engine moves bytes as torch CPU tensors, whatever framework submitted them (a framework
adapter hands its tensors in as torch views). This module also states the one rule the engine
and the framework layer share about memory: a lent result may be adopted only by a tensor that
owns its memory (:func:`owns_its_memory`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from contextlib import AbstractContextManager

import torch

from hora.common.engine.handles import Entry, finish
from hora.common.vocabulary.dtypes import FLOATING, INTEGER
from hora.common.vocabulary.message import ReduceOp

_DTYPES = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "bool": torch.bool,
}
assert set(_DTYPES) == FLOATING | INTEGER | {"bool"}
_DTYPE_NAMES = {value: name for name, value in _DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of hora's dtype name (``"float32"``)."""
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str | None:
    """hora's name for a torch dtype, or ``None`` when hora does not support it."""
    return _DTYPE_NAMES.get(dtype)


def compute_dtype(dtype: torch.dtype, op: ReduceOp) -> tuple[torch.dtype, ReduceOp]:
    """The dtype and op the transport reduces in, where Gloo lacks a kernel for ``dtype``."""
    if dtype == torch.bool:
        # Logical or for Sum/Max, logical and for Min/Product.
        return torch.uint8, (ReduceOp.MAX if op in (ReduceOp.SUM, ReduceOp.MAX) else ReduceOp.MIN)
    if dtype == torch.int16:
        return torch.int32, op
    return dtype, op


def scale(buffer: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply by ``factor`` as Horovod does: integers via float64, truncating; halves via fp32."""
    if factor == 1.0:
        return buffer
    if buffer.dtype in (torch.float16, torch.bfloat16):
        return buffer.float().mul_(factor).to(buffer.dtype)
    if not buffer.is_floating_point():
        return buffer.double().mul_(factor).trunc_().to(buffer.dtype)
    return buffer.mul_(factor)


def postscale(buffer: torch.Tensor, divisor: int, factor: float) -> torch.Tensor:
    """A reduced buffer divided by ``divisor`` (an average's number of ranks), then scaled.

    The average is a division, so it is correctly rounded (an integer average truncates
    exactly); multiplying by a rounded ``1 / divisor`` can be one unit off in the last place.
    """
    if divisor == 1:
        return scale(buffer, factor)
    if buffer.is_floating_point():
        return scale(buffer.div_(divisor), factor)
    if factor == 1.0:
        return buffer.div_(divisor, rounding_mode="trunc")
    return scale(buffer, factor / divisor)


def local_gpu(local_rank: int) -> torch.device:
    """The GPU of a rank whose tensors named none yet: its local rank's, round-robin over the
    visible GPUs (as a training script pins it with ``torch.cuda.set_device(local_rank)``)."""
    count = torch.cuda.device_count()
    return torch.device("cuda", local_rank % count if count else 0)


def on_default_stream(tensor: torch.Tensor) -> AbstractContextManager[object]:
    """A context that queues CUDA work on ``tensor``'s device's default stream (the engine's,
    which the submitting call made wait for the caller's stream); nothing for CPU tensors."""
    if not tensor.is_cuda:
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.default_stream(tensor.device))


def read_landed(tensor: torch.Tensor, streams: dict[torch.device, torch.cuda.Stream]) -> list[int]:
    """The values of a small tensor that a finished collective wrote, as integers.

    A CUDA tensor is read on a stream of its own (the caller's ``streams``, by device, made
    here at first use): the collective is known to be done, and the default stream may hold a
    backlog of the caller's kernels (the rest of backward) that a read there would wait for.
    """
    if not tensor.is_cuda:
        return [int(v) for v in tensor.tolist()]
    side = streams.get(tensor.device)
    if side is None:
        side = streams[tensor.device] = torch.cuda.Stream(tensor.device)
    with torch.cuda.stream(side):
        values = tensor.tolist()
    return [int(v) for v in values]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def destination(entry: Entry | None) -> torch.Tensor | None:
    """Where an allreduce result goes: the output tensor, or the input for in-place calls."""
    if entry is None:
        return None
    return entry.output if entry.output is not None else entry.tensor


def writing_to_inference(entries: Sequence[Entry | None]) -> AbstractContextManager[object]:
    """``torch.inference_mode()`` when a destination was made in inference mode (a caller in
    ``torch.inference_mode()``, as PyTorch Lightning's validation), where only it may write."""
    for entry in entries:
        dest = destination(entry)
        if dest is not None and dest.is_inference():
            return torch.inference_mode()
    return contextlib.nullcontext()


def copy_out_pieces(entries: Sequence[Entry | None], flat: torch.Tensor, sizes: list[int]) -> None:
    """Copy pieces of a reduced buffer to the entries' destinations and finish them."""
    pairs = [
        (dest.reshape(-1), piece)
        for dest, piece in zip(map(destination, entries), flat.split(sizes))
        if dest is not None and dest.data_ptr() != piece.data_ptr()
    ]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [p for _, p in pairs])
    for entry in entries:
        if entry is not None:
            finish(entry, destination(entry))


def storage_references(tensor: torch.Tensor) -> tuple[int, int]:
    """How many tensors refer to ``tensor``'s memory, and the references to its storage
    object from Python (a caller that kept ``grad.untyped_storage()`` holds no tensor)."""
    storage = tensor.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata), sys.getrefcount(storage)


def referenced_beyond(tensor: torch.Tensor, baseline: tuple[int, int]) -> bool:
    """Whether ``tensor``'s memory has more references than ``baseline`` (see
    ``storage_references``)."""
    tensors, objects = storage_references(tensor)
    return tensors > baseline[0] or objects > baseline[1]


# The references to the memory of a tensor that nothing else shares.
_SOLE = storage_references(torch.empty(1))


def owns_its_memory(tensor: torch.Tensor) -> bool:
    """Whether no other tensor (a view, or a buffer it is a view of) shares ``tensor``'s
    memory and no storage object of it is held.

    The lending rule: an entry submitted with ``lend=True`` may get a view of the engine's
    steady-state buffer as its result instead of a copy in its tensor. The caller may adopt
    that view (``tensor.set_(result)``) only where this returns ``True``; elsewhere it copies
    the result into its tensor. The engine writes a lent buffer again only once nothing
    outside it refers to it.
    """
    return not referenced_beyond(tensor, _SOLE)
