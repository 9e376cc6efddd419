"""A sharded optimizer's ``state_dict()`` is a collective: called on one rank only, the error
says so and how to save a checkpoint, rather than only that another rank shut down."""

from __future__ import annotations

from typing import Any

import pytest

from .jobs import error_of, run_job


def _state_dict_on_rank_0_only() -> dict[str, Any] | None:
    import torch

    import hora.torch as hvd

    hvd.init()
    model = torch.nn.Linear(4, 2)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        shard_optimizer_state=True,
    )
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    if hvd.rank() != 0:
        return None  # leaves: hora.run's worker calls hvd.shutdown()
    return error_of(optimizer.state_dict)


@pytest.mark.timeout(120)
def test_state_dict_of_a_sharded_optimizer_on_one_rank_says_it_is_a_collective() -> None:
    error, absent = run_job(_state_dict_on_rank_0_only, 2)
    assert absent is None
    assert error is not None and "HoraInternalError" in error["types"]
    message = error["message"]
    assert message.startswith(
        "sharded DistributedOptimizer: state_dict() did not complete on rank 0: rank 1 called "
        "hvd.shutdown()."
    )
    assert "every rank must call it" in message
    assert "`state = optimizer.state_dict()` on every rank, then save on rank 0" in message
    assert "hvd.join()" not in message
