"""``HoraRunError`` shows where the user's function failed: its file and line, as the worker's
traceback had them, even though the function travels by value."""

from __future__ import annotations

import inspect

import pytest

from .jobs import run_failing_job


def _raises_here() -> None:
    raise ValueError("raised in the test module")


@pytest.mark.timeout(120)
def test_hora_run_error_names_the_functions_file_and_line() -> None:
    lines, first = inspect.getsourcelines(_raises_here)
    line = first + next(i for i, text in enumerate(lines) if "raise ValueError" in text)
    error = run_failing_job(_raises_here, 2)
    message = str(error)
    assert "<dynamic-code>" not in message
    for rank in range(2):
        assert f'File "{__file__}", line {line}, in _raises_here' in error.errors[rank]
    assert 'raise ValueError("raised in the test module")' in message  # the line's text
