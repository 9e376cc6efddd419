"""``SyncBatchNorm``: batch normalisation with statistics taken over every rank's batch.

This module owns the maths of a batch norm whose batch is split across the ranks of a process
set: one allreduce of per-channel statistics in forward, one of per-channel gradient sums in
backward. It knows nothing of how the collectives travel; it calls :mod:`hora.torch.ops`.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from hora.common.process_sets import ProcessSet
from hora.torch import ops


class SyncBatchNorm(_BatchNorm):
    """Batch norm whose training statistics cover the union of all ranks' batches.

    In training mode (and in eval mode without running statistics) the mean and variance of each
    channel are computed over the inputs of every rank in ``process_set``; ranks may hold batches
    of different sizes. The output and the input gradient equal those of
    :class:`torch.nn.BatchNorm2d` (or 1d/3d) applied to the concatenation of all ranks' batches,
    and the running statistics are updated with that batch's mean and unbiased variance. In eval
    mode with running statistics, or in a job of one process, it is a plain batch norm.

    Unlike Horovod's, it accepts CPU tensors as well as CUDA tensors, honours ``momentum=None``
    (a cumulative average, as in PyTorch) and takes a ``process_set``.

    The gradients of ``weight`` and ``bias`` stay local, as in Horovod: each rank's holds only its
    own batch's share, and their sum over the ranks is the gradient of the whole batch.
    :class:`hora.torch.DistributedOptimizer` averages them together with the other parameters'
    gradients, which is the usual data-parallel gradient when each rank's loss is a mean over its
    own batch.

    Every rank of the set must call the layer the same number of times and in the same order (it
    runs a collective per call, and another per backward). Statistics are exchanged in float64.

    Args:
        num_features: ``C`` of an input of shape ``(N, C, *)``.
        eps: added to the variance for numerical stability.
        momentum: weight of the new batch in the running statistics; ``None`` for a cumulative
            moving average.
        affine: learn a per-channel ``weight`` and ``bias``.
        track_running_stats: keep running statistics and use them in eval mode.
        process_set: the ranks whose batches are normalised together (default: all).

    Raises:
        ValueError: the input has fewer than 2 dimensions, or the ranks hold one value per
            channel in all (raised on every rank, as torch does for a batch of one).

    Example:
        >>> hvd.init()
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), hvd.SyncBatchNorm(8))
        >>> out = model(torch.randn(4 + hvd.rank(), 3, 16, 16))  # batch sizes may differ
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_set: ProcessSet = ops.global_process_set,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        using_batch_stats = self.training or (
            self.running_mean is None and self.running_var is None
        )
        if not using_batch_stats or self.process_set.size() == 1:
            return super().forward(input)

        # Same bookkeeping as _BatchNorm.forward:
        # https://github.com/pytorch/pytorch/blob/main/torch/nn/modules/batchnorm.py
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        output, mean, var_unbiased = _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.eps, self.process_set
        )
        if self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
                self.running_var.lerp_(var_unbiased.to(self.running_var.dtype), momentum)
        return cast(torch.Tensor, output)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Reduced-precision inputs are normalised in float32, as PyTorch's own kernels do."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _channel_view(t: torch.Tensor, dims: int) -> torch.Tensor:
    """A per-channel ``[C]`` tensor shaped to broadcast against an ``(N, C, *)`` input."""
    return t.reshape((1, -1) + (1,) * (dims - 2))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Forward: one allreduce of ``[count, sum x, sum x^2]`` (built from local moments); backward:
    one allreduce of ``[sum dy, sum dy * (x - mean)]``. Both travel in float64 under names that depend only on
    ``C``, so repeated calls hit the response cache; each call waits for its result, so no two
    ops with one name are ever in flight together.
    """

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        process_set: ProcessSet,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        x = input.to(_compute_dtype(input.dtype))
        count = input.numel() // channels if channels else 0

        # Local moments around the local mean (stable), then a float64 sum across ranks: the
        # cancellation in E[x^2] - mean^2 then costs ~1e-16 * mean^2, not float32's ~1e-7.
        stats = torch.zeros(1 + 2 * channels, dtype=torch.float64, device=input.device)
        stats[0] = count
        if count > 0:
            var, mean = torch.var_mean(x, dim=dims, correction=0)
            mean64 = mean.to(torch.float64)
            stats[1 : 1 + channels] = mean64 * count
            stats[1 + channels :] = (var.to(torch.float64) + mean64 * mean64) * count
        total = ops.allreduce_(
            stats, name=f"sync_batch_norm.stats.{channels}", op=ops.Sum, process_set=process_set
        )
        total_count = int(total[0].item())
        if total_count <= 1:
            raise ValueError(
                "Expected more than 1 value per channel when training, got "
                f"{total_count} across the ranks of {process_set} (input size {list(input.shape)} "
                "on this rank)."
            )
        global_mean = total[1 : 1 + channels] / total_count
        global_var = (total[1 + channels :] / total_count - global_mean * global_mean).clamp_(min=0)
        invstd = torch.rsqrt(global_var + eps)

        # y = x * scale + shift with per-channel scale = weight * invstd, shift = bias - mean * scale.
        scale = invstd if weight is None else invstd * weight.to(torch.float64)
        shift = -global_mean * scale
        if bias is not None:
            shift = shift + bias.to(torch.float64)
        output = torch.addcmul(
            _channel_view(shift.to(x.dtype), input.dim()),
            x,
            _channel_view(scale.to(x.dtype), input.dim()),
        ).to(input.dtype)

        mean = global_mean.to(x.dtype)
        invstd_c = invstd.to(x.dtype)
        ctx.save_for_backward(input, weight, mean, invstd_c)
        ctx.total_count = total_count
        ctx.process_set = process_set
        var_unbiased = global_var * (total_count / (total_count - 1))
        ctx.mark_non_differentiable(global_mean, var_unbiased)
        return output, global_mean, var_unbiased

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_output: torch.Tensor, _grad_mean: Any, _grad_var: Any
    ) -> tuple[Any, ...]:
        input, weight, mean, invstd = ctx.saved_tensors
        channels = input.shape[1]
        nd = input.dim()
        dims = [0, *range(2, nd)]
        work = mean.dtype
        dy = grad_output.to(work)
        # Sums of dy * (x - mean), not dy * x - mean * dy, which would cancel for large means.
        xmu = input.to(work) - _channel_view(mean, nd)
        sum_dy = dy.sum(dim=dims)
        sum_dy_xmu = (dy * xmu).sum(dim=dims)

        grad_weight = sum_dy_xmu * invstd if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy if ctx.needs_input_grad[2] else None
        grad_input = None
        if ctx.needs_input_grad[0]:
            # Every rank builds the same graph, so every rank agrees on whether this runs.
            total = ops.allreduce_(
                torch.cat([sum_dy, sum_dy_xmu]).to(torch.float64),
                name=f"sync_batch_norm.grad.{channels}",
                op=ops.Sum,
                process_set=ctx.process_set,
            )
            mean_dy = (total[:channels] / ctx.total_count).to(work)
            mean_dy_xmu = (total[channels:] / ctx.total_count).to(work)
            # dx = w * invstd * (dy - mean(dy) - xhat * mean(dy * xhat)), xhat = (x - mean) * invstd,
            # evaluated per channel as dy * a + (x - mean) * b + c in place of the temporary.
            a = invstd if weight is None else invstd * weight.to(work)
            b = -a * mean_dy_xmu * invstd * invstd
            c = -a * mean_dy
            grad_input = (
                xmu.mul_(_channel_view(b, nd))
                .add_(_channel_view(c, nd))
                .addcmul_(dy, _channel_view(a, nd))
                .to(input.dtype)
            )
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(weight.dtype)
        return grad_input, grad_weight, grad_bias, None, None
