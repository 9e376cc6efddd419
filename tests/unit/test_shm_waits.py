"""What a shared-memory wait that timed out says: whom it waited for, and which limit ended it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hora.common.transport import TransportError
from hora.common.transport.shm_barriers import Barriers
from hora.common.transport.shm_segment import WaitTimeout


def _timed_out() -> None:
    raise WaitTimeout("member 1")


def test_a_wait_ended_by_the_stall_limit_names_the_setting() -> None:
    member = SimpleNamespace(rank=0, size=2)  # all Barriers reads of its segment here
    barriers = Barriers(member, 2.0, lambda m: f"rank {m + 4}", "HORA_STALL_SHUTDOWN_TIME_SECONDS")  # type: ignore[arg-type]
    with pytest.raises(TransportError) as info:
        barriers.wait(_timed_out)
    assert str(info.value) == (
        "timed out waiting for rank 5 in a shared-memory collective after "
        "HORA_STALL_SHUTDOWN_TIME_SECONDS (2 s)"
    )


def test_a_wait_without_a_named_limit_gives_its_time() -> None:
    member = SimpleNamespace(rank=1, size=3)
    barriers = Barriers(member, 30.0, lambda m: f"rank {m}")  # type: ignore[arg-type]
    with pytest.raises(TransportError) as info:
        barriers.wait(_timed_out)
    assert str(info.value) == "timed out waiting for rank 1 in a shared-memory collective (30 s)"
