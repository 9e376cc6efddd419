"""What a framework adapter may ask of the running engine, and nothing more.

Adapters submit through :mod:`hora.common.ops.collectives` and :mod:`hora.common.ops.submission`;
the few facts of the engine they need besides (the steady state's batch layout, whether a
process set is registered and who its members are, whether the engine still runs, the rule for
adopting a lent tensor) are these functions. The engine itself stays behind them
(``tests/unit/test_layers.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hora.common import basics
from hora.common.engine import owns_its_memory
from hora.common.engine.adasum import is_power_of_two

if TYPE_CHECKING:
    from hora.common.engine.steady.schedule import BatchLayout

__all__ = [
    "batch_layout",
    "engine_stopped",
    "is_power_of_two",
    "owns_its_memory",
    "set_members",
    "set_registered",
]


def batch_layout() -> BatchLayout | None:
    """The steady state's batches (which names are allreduced together), while it runs: a hint
    for submitting a batch's gradients together; ``None`` outside the steady state.

    Raises:
        ValueError: ``init`` has not been called.
    """
    return basics.engine().batch_layout


def set_registered(process_set_id: int | None) -> bool:
    """Whether a process set of this id is registered in the running job (``False`` before
    ``init``)."""
    if process_set_id is None or not basics.is_initialized():
        return False
    return basics.engine().process_sets.contains(process_set_id)


def set_members(process_set_id: int) -> tuple[int, ...]:
    """The global ranks of a registered process set, in order.

    Raises:
        ValueError: ``init`` has not been called, or the set is not registered.
    """
    return basics.engine().process_sets.members(process_set_id)


def engine_stopped() -> bool:
    """Whether hora cannot take collectives now: not initialized, or its engine has failed
    (a lost peer, an elastic change) or stopped."""
    if not basics.is_initialized():
        return True
    engine = basics.engine()
    return engine.failure is not None or not engine.running
