"""The reduce-scatter of a sharded ``DistributedOptimizer``'s gradients, bucket by bucket.

:class:`GradientReduceScatter` owns one backward pass's bookkeeping: how many passes each
parameter's gradient still accumulates locally (``backward_passes_per_step``), how many
gradients of each bucket are in, and each bucket's reduction in flight. When a bucket's last
gradient is in, its gradients are packed into one flat tensor (compressed if asked) and
reduce-scattered while backward goes on; in stage 2 the parameters' ``.grad`` are released then.
Collecting a bucket waits for its reduced shard and gives each of this rank's pieces its slice
as ``.grad``.

It knows gradients, buckets and handles; it does not know the optimizer's state, its step or
what happens to the parameters afterwards, nor when a pass begins (the step's course decides:
see :mod:`hora.torch.zero_step`).
"""

from __future__ import annotations

from typing import Any

import torch

from hora.common.vocabulary.errors import HoraInternalError, HoraValueError
from hora.torch import ops
from hora.torch.gradient_reduction import TOO_MANY_PASSES, DistributedOptions
from hora.torch.zero_parameters import ShardedParameters


class GradientReduceScatter:
    """Counts gradients in and reduce-scatters each bucket once all of its gradients are in."""

    def __init__(self, params: ShardedParameters, options: DistributedOptions) -> None:
        self._params = params
        # Compression, op, scales, sparse_as_dense and shard_gradients (stage 2) are read here.
        self._options = options
        buckets = len(params.buckets)
        # Per trainable parameter: backward passes still to come before its gradient counts.
        self._delay = [options.backward_passes_per_step] * len(params.trainable)
        # Per bucket: gradients in; what its reduction is (a handle and compression context,
        # or the packed gradients themselves when no other rank shares the optimizer).
        self._ready = [0] * buckets
        self._pending: list[Any] = [None] * buckets
        self._in_pass = False

    @property
    def in_pass(self) -> bool:
        """Whether a backward pass has begun (its first gradient came in) and not ended."""
        return self._in_pass

    def begin_pass(self) -> None:
        self._in_pass = True

    def end_pass(self, backward_passes_per_step: int) -> None:
        """Start counting the next step's passes."""
        self._delay = [backward_passes_per_step] * len(self._params.trainable)
        self._ready = [0] * len(self._params.buckets)
        self._in_pass = False

    def set_backward_passes_per_step(self, passes: int) -> None:
        self._delay = [passes] * len(self._params.trainable)

    def in_flight(self) -> bool:
        """Whether a bucket was submitted and not collected."""
        return any(pending is not None for pending in self._pending)

    def drop(self) -> None:
        """Forget the reductions in flight (a step abandoned)."""
        self._pending = [None] * len(self._params.buckets)

    def gradient_in(self, p: torch.Tensor) -> None:
        """Count ``p``'s gradient in (a pass has begun); submit its bucket if it was the last.

        Raises:
            AssertionError: more backward passes than ``backward_passes_per_step`` before a step.
        """
        params = self._params
        index = params.index[p]
        delay = self._delay[index] - 1
        if delay < 0:
            raise AssertionError(TOO_MANY_PASSES)
        self._delay[index] = delay
        if delay:
            return
        bucket = params.bucket_of[index]
        self._ready[bucket] += 1
        if self._ready[bucket] == len(params.buckets[bucket].slots):
            self.submit(bucket)

    def submit_outstanding(self) -> None:
        """Reduce every bucket no gradient completed (zeros for parameters without a gradient,
        as the unsharded optimizer does)."""
        for number in range(len(self._params.buckets)):
            if self._pending[number] is None:
                self.submit(number)

    def submit(self, number: int) -> None:
        """Pack the bucket's gradients into one flat tensor and reduce-scatter it."""
        params = self._params
        options = self._options
        bucket = params.buckets[number]
        flats = []
        for slot in bucket.slots:
            p = params.trainable[slot.index]
            grad = p.grad
            if grad is None:
                grad = p.grad = torch.zeros_like(p)
            if grad.is_sparse:
                if not options.sparse_as_dense:
                    raise HoraValueError(
                        f"sharded DistributedOptimizer: {params.name_of(p)!r} has a "
                        "sparse gradient, which cannot be reduce-scattered. Pass "
                        "sparse_as_dense=True, or use dense gradients (sparse=False)."
                    )
                grad = grad.to_dense()
            flats.append(grad.reshape(-1))
        flat = torch.cat(flats) if len(flats) > 1 else flats[0]
        if params.layout.size == 1:
            # Nobody to share with: the "reduced" gradient is the local one (a copy, since the
            # caller may zero .grad in place before step()).
            self._pending[number] = flat.clone() if len(flats) == 1 else flat
        else:
            compressed, ctx = options.compression.compress(flat)
            prescale, postscale = options.scales
            handle = ops.reducescatter_async(
                compressed.contiguous(),
                name=f"{params.label}.{number}.{params.first_name(number)}",
                op=options.op,
                process_set=params.process_set,
                prescale_factor=prescale,
                postscale_factor=postscale,
            )
            self._pending[number] = (handle, ctx)
        if options.shard_gradients:
            for slot in bucket.slots:
                params.trainable[slot.index].grad = None

    def collect(self, number: int) -> torch.Tensor:
        """Wait for the bucket's reduced shard; give each piece its slice as ``.grad``.

        Raises:
            HoraValueError: a rank joined (``hvd.join()``) instead of reducing its shard.
        """
        pending = self._pending[number]
        if isinstance(pending, torch.Tensor):
            shard = pending
        else:
            handle, ctx = pending
            try:
                output = ops.synchronize(handle)
            except (HoraInternalError, HoraValueError) as exc:
                # The engine fails a reducescatter that a joined rank does not take part in.
                if "joined" in str(exc):
                    raise HoraValueError(
                        "sharded DistributedOptimizer: hvd.join() cannot stand in for a rank "
                        "that owns a shard of the parameters (each rank must update its own "
                        "shard in every step). Give every rank the same number of steps, or "
                        f"use DistributedOptimizer without shard_optimizer_state.\n{exc}"
                    ) from exc
                raise
            shard = self._options.compression.decompress(output, ctx)
        params = self._params
        for piece in params.layout.pieces[number]:
            tensor = params.pieces[piece.index]
            start = piece.shard_offset
            grad = shard[start : start + piece.numel]
            tensor.grad = grad if grad.dtype == tensor.dtype else grad.to(tensor.dtype)
        self._pending[number] = None
        return shard
