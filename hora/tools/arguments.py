"""Argument types shared by hora's command-line tools (argparse ``type=`` callables)."""

from __future__ import annotations

import argparse


def whole_number(text: str, least: int) -> int:
    """``text`` as an int of at least ``least``, or an argparse error that says why not."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least {least}")
    return value


def positive(text: str) -> int:
    """A whole number of at least 1."""
    return whole_number(text, 1)


def not_negative(text: str) -> int:
    """A whole number of at least 0."""
    return whole_number(text, 0)
