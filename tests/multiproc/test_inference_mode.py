"""Collectives on tensors made under ``torch.inference_mode()`` (as in PyTorch Lightning's
validation and test loops) return results instead of stopping the engine, on the engine's path
and on the fast path (``HORA_FAST_PATH``), which writes results on the caller's thread."""

from __future__ import annotations

from typing import Any

import pytest

from .jobs import run_job


def _inference_worker() -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    hvd.init()
    out: dict[str, Any] = {}
    with torch.inference_mode():
        x = torch.ones(4) * (hvd.rank() + 1)
        out["allreduce"] = hvd.allreduce(x, op=hvd.Sum, name="made.inside").tolist()
        # Average scales the result on the engine's side, in the result's own storage.
        out["average"] = hvd.allreduce(x, name="average.inside").tolist()
        out["allgather"] = hvd.allgather(x[:1].unsqueeze(0), name="gathered").flatten().tolist()
        out["object"] = hvd.broadcast_object({"root": x[:1]}, root_rank=0)["root"].tolist()
        y = torch.ones(3)
        hvd.allreduce_(y, op=hvd.Sum, name="in.place.inside")
        out["in_place"] = y.tolist()
        z = torch.ones(2)
    # An inference tensor reduced in place from outside inference mode.
    hvd.allreduce_(z, op=hvd.Sum, name="in.place.outside")
    out["outside"] = z.tolist()
    hvd.shutdown()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fast_path", ["0", "1"], ids=["engine", "fast-path"])
@pytest.mark.parametrize("np", [2, 3])
def test_inference_tensors_are_reduced(np: int, fast_path: str) -> None:
    total = sum(range(1, np + 1))
    for result in run_job(_inference_worker, np, env={"HORA_FAST_PATH": fast_path}):
        assert result == {
            "allreduce": [float(total)] * 4,
            "average": [total / np] * 4,
            "allgather": [float(r + 1) for r in range(np)],
            "object": [1.0],
            "in_place": [float(np)] * 3,
            "outside": [float(np)] * 2,
        }
