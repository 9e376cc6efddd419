"""``hvd.init()`` and Python's garbage collector (docs/training.md, "Python's garbage
collector")."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

import hora


class _Node:
    itself: Any = None


def _collector_after_init() -> dict[str, Any]:
    import hora.torch as hvd

    enabled_before = gc.isenabled()
    hvd.init()
    seen = {
        "frozen": gc.get_freeze_count(),
        "enabled": gc.isenabled(),
        "enabled_before": enabled_before,
    }
    # Objects made after init are still collected: a reference cycle made now goes away.
    node = _Node()
    node.itself = node
    probe = weakref.ref(node)
    del node
    gc.collect()
    seen["cycle_collected"] = probe() is None
    hvd.init()  # already running: nothing changes
    hvd.shutdown()
    # A cycle left behind before a later init (after shutdown, or an elastic round) is not
    # frozen by it.
    node = _Node()
    node.itself = node
    left = weakref.ref(node)
    del node
    hvd.init()
    gc.collect()
    seen["left_collected"] = left() is None
    hvd.shutdown()
    return seen


@pytest.mark.timeout(90)
@pytest.mark.parametrize("freeze", ["1", "0"])
def test_init_freezes_what_exists_and_collects_what_comes_after(freeze: str) -> None:
    results = hora.run(_collector_after_init, np=2, env={"HORA_GC_FREEZE": freeze}, timeout_s=60)
    for seen in results:
        assert seen["enabled"] == seen["enabled_before"] is True
        assert seen["cycle_collected"] and seen["left_collected"], seen
        if freeze == "1":
            assert seen["frozen"] > 10_000, seen  # torch's objects, at the least
        else:
            assert seen["frozen"] == 0, seen


def _optimizers_are_freed() -> dict[str, bool]:
    """A model and its DistributedOptimizer, dropped after training steps, are collected
    (autograd's gradient hooks hold the optimizer weakly)."""
    import torch

    import hora.torch as hvd

    hvd.init()
    kinds = {
        "averaging": {},
        "adasum": {"op": hvd.Adasum},
        "sharded": {"shard_optimizer_state": True},
    }
    freed = {}
    for kind, options in kinds.items():
        model = torch.nn.Linear(8, 2)
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            **options,
        )
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.ones(4, 8)).sum().backward()
            optimizer.step()
        probes = (weakref.ref(model), weakref.ref(optimizer))
        del model, optimizer
        gc.collect()
        freed[kind] = all(probe() is None for probe in probes)
    hvd.shutdown()
    return freed


@pytest.mark.timeout(90)
def test_dropped_models_and_their_optimizers_are_collected() -> None:
    for freed in hora.run(_optimizers_are_freed, np=2, timeout_s=60):
        assert freed == {"averaging": True, "adasum": True, "sharded": True}, freed
