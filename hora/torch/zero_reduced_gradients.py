"""This rank's reduced gradient shards as ``GradScaler`` and clipping see them.

After ``synchronize()`` each of this rank's pieces holds its reduced gradient shard as
``.grad`` until ``step()`` or ``zero_grad()``. :class:`ReducedGradients` owns that state: whether
the shards are in, the parameter lists taken out of ``param_groups`` while the groups list the
pieces instead (so ``GradScaler.unscale_`` unscales exactly the shards), and a one-element
sentinel whose gradient is ``inf`` on every rank when any rank's shard has an inf or NaN (so
every rank's scaler finds the same infs). It also unscales the shards and clips them by their
norm over every rank.

It knows the pieces and two small allreduces; it does not know how the shards were reduced,
the optimizer's state or its step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hora.torch import ops
from hora.torch.zero_parameters import ShardedParameters


class ReducedGradients:
    """Whether the reduced shards are in the pieces' ``.grad``, and ``param_groups`` showing the
    pieces meanwhile.

    Attributes:
        synchronized: the reduced shards are in (``synchronize()`` was called) and not used yet.
        sentinel: the one-element "parameter" ``GradScaler`` sees while the pieces are shown.
    """

    def __init__(self, params: ShardedParameters) -> None:
        self._params = params
        self.synchronized = False
        # While shown: the parameters of each group, which param_groups list again afterwards.
        self._shown: list[list[torch.Tensor]] | None = None
        trainable = params.trainable
        device = trainable[0].device if trainable else torch.device("cpu")
        self.sentinel = torch.zeros(1, device=device)

    def param_lists(self, param_groups: list[dict[str, Any]]) -> list[list[torch.Tensor]]:
        """The parameters of each group (even while ``param_groups`` show the pieces)."""
        if self._shown is not None:
            return self._shown
        return [group["params"] for group in param_groups]

    def settle(self, shards: list[torch.Tensor], param_groups: list[dict[str, Any]]) -> None:
        """Take the collected ``shards`` as this step's gradients: agree with every rank whether
        any has a non-finite value (the sentinel's gradient), and show the pieces."""
        bad = torch.zeros(1)
        for shard in shards:
            if shard.numel() and not bool(torch.isfinite(shard).all()):
                bad.fill_(1.0)
                break
        params = self._params
        if params.layout.size > 1:
            bad = ops.synchronize(
                ops.allreduce_async(
                    bad,
                    name=f"{params.label}.nonfinite",
                    op=ops.Max,
                    process_set=params.process_set,
                )
            )
        self.sentinel.grad = torch.full_like(self.sentinel, math.inf if bad.item() else 0.0)
        self.synchronized = True
        self.show(param_groups)

    def show(self, param_groups: list[dict[str, Any]]) -> None:
        """List the pieces (and the sentinel) in param_groups instead of the parameters."""
        if self._shown is not None:
            return
        self._shown = [group["params"] for group in param_groups]
        pieces = self._params.piece_groups(len(param_groups))
        for group, own in zip(param_groups, pieces):
            group["params"] = list(own)
        param_groups[0]["params"].append(self.sentinel)

    def hide(self, param_groups: list[dict[str, Any]]) -> None:
        """Put the parameters back into param_groups."""
        if self._shown is None:
            return
        for group, params in zip(param_groups, self._shown):
            group["params"] = params
        self._shown = None

    def restart(self, param_groups: list[dict[str, Any]]) -> None:
        """At a new backward pass: the parameters back in param_groups; shards collected by a
        ``synchronize()`` that no step used are forgotten (a new step begins)."""
        self.hide(param_groups)
        if self.synchronized:
            self.synchronized = False
            self._params.drop_gradients()

    def drop(self, param_groups: list[dict[str, Any]], sentinel: bool) -> None:
        """Forget the shards (used, or abandoned): the parameters back in param_groups, the
        pieces' gradients (and the sentinel's) released."""
        self.hide(param_groups)
        self.synchronized = False
        self._params.drop_gradients()
        if sentinel:
            self.sentinel.grad = None

    def unscale(self, grad_scale: Any) -> None:
        """Divide the shards by ``GradScaler``'s scale."""
        inverse = torch.as_tensor(grad_scale).double().reciprocal().float()
        grads = [t.grad for t in self._params.pieces.values() if t.grad is not None]
        if grads:
            torch._foreach_mul_(grads, inverse.to(grads[0].device).item())

    def clip_norm(
        self, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> torch.Tensor:
        """Scale the shards (collected) so that their norm over every rank is at most
        ``max_norm``; returns that norm before clipping (see
        ``ShardedOptimizer.clip_grad_norm_``)."""
        params = self._params
        grads = [t.grad for t in params.pieces.values() if t.grad is not None]
        norm_type = float(norm_type)
        device = self.sentinel.device
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for g in grads]).to(
                device
            )
            local = torch.linalg.vector_norm(norms, norm_type)
        else:
            local = torch.zeros((), device=device)
        infinite = norm_type == math.inf
        part = local.reshape(1) if infinite else local.reshape(1) ** norm_type
        if params.layout.size > 1:
            part = ops.synchronize(
                ops.allreduce_async(
                    part,
                    name=f"{params.label}.grad_norm",
                    op=ops.Max if infinite else ops.Sum,
                    process_set=params.process_set,
                )
            )
        total: torch.Tensor = part[0] if infinite else part[0] ** (1.0 / norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coefficient.to(grads[0].device).item())
        return total
