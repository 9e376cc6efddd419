"""Starting hora jobs from a test, and recording errors inside workers as plain data.

Workers return observations (tensors, strings, numbers); the test asserts in the parent. Errors
raised inside a worker are recorded with :func:`error_of` so one job can check many behaviours.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import hora
from hora.runner.api import HoraRunError

# hora.run's own limit; every test's pytest timeout is longer, so a hang shows as a TimeoutError
# with the workers' output rather than as a pytest-timeout traceback.
JOB_TIMEOUT_S = 80.0


def run_job(
    fn: Callable[..., Any],
    np: int,
    *args: Any,
    env: dict[str, str] | None = None,
    timeout_s: float = JOB_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(*args)`` on ``np`` local processes; returns each rank's result in rank order."""
    return hora.run(fn, args=args, np=np, env=env, timeout_s=timeout_s)


def run_failing_job(
    fn: Callable[..., Any],
    np: int,
    *args: Any,
    env: dict[str, str] | None = None,
    timeout_s: float = JOB_TIMEOUT_S,
) -> HoraRunError:
    """Run a job that must fail; returns the error, with ``.results`` and ``.errors`` by rank."""
    with pytest.raises(HoraRunError) as info:
        hora.run(fn, args=args, np=np, env=env, timeout_s=timeout_s)
    return info.value


def error_of(call: Callable[[], Any]) -> dict[str, Any] | None:
    """Call ``call()``; describe the exception it raised, or return ``None`` if it returned.

    Returns:
        ``{"types": [class names along the MRO], "message": str(exc)}``.
    """
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        return {"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
    return None


def assert_raised(error: dict[str, Any] | None, kind: type[BaseException], *fragments: str) -> None:
    """Assert that :func:`error_of` saw ``kind`` and that its message holds every fragment."""
    assert error is not None, f"expected {kind.__name__}, but the call succeeded"
    assert kind.__name__ in error["types"], f"expected {kind.__name__}, got {error}"
    for fragment in fragments:
        assert fragment in error["message"], f"{fragment!r} not in {error['message']!r}"
