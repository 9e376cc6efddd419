"""``horarun``'s argparse parser, built from the flag table, and what it says of a flag it lacks.

:func:`build_parser` turns :data:`hora.runner.flags.OPTIONS` into horovodrun's flags under their
own names, every value defaulting to ``None`` so that a config file can fill what the command line
left out. A usage error prints one line of usage (:data:`SHORT_USAGE`), not the whole list; a flag
horarun does not have is an :class:`UnknownFlag` naming the nearest real ones
(:func:`nearest_flags`: ``--np`` is ``-np``).

This module knows argparse and the flag table; it does not read the config file, check values or
build the options (:mod:`hora.runner.options` does).
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any, NoReturn

from hora.common.vocabulary.settings_table import LOG_LEVELS
from hora.runner.flags import GROUPS, OPTIONS, Option
from hora.runner.launch_options import OptionError


class UnknownFlag(OptionError):
    """A flag horarun does not have (``--np``, ``--fusion-treshold-mb``), with the nearest ones
    it has.

    Attributes:
        given: the flags as given, in order.
    """

    def __init__(self, given: Sequence[str]) -> None:
        lines = [_unknown_flag_line(flag) for flag in given]
        super().__init__("\n".join([*lines, SHORT_HELP]))
        self.given = tuple(given)


SHORT_HELP = "`horarun --help` lists every flag."
SHORT_USAGE = f"usage: horarun -np N [flags] command [args ...]; {SHORT_HELP}"

# Every name of every flag, to match a misspelt one against (the hidden opposites too:
# ``--no-autotune`` is as valid as ``--autotune``), and the flag (``dest``) each stands for.
_FLAG_OF_NAME: dict[str, str] = {
    **{name: option.dest for option in OPTIONS for name in (*option.flags, *option.opposite)},
    "-h": "help",
    "--help": "help",
}
# How alike a misspelt flag and a real one must be (difflib's ratio), and how much less alike
# than the best a second suggestion may be.
_CLOSE = 0.75
_TIE = 0.02


def nearest_flags(given: str) -> list[str]:
    """The flags ``given`` most likely stands for: the same name with other dashes (``--np``:
    ``-np``), else the closest spellings (``--fusion-treshold-mb``: ``--fusion-threshold-mb``);
    empty when none is close.

    Example:
        >>> nearest_flags("--np"), nearest_flags("--fusion-treshold-mb")
        (['-np'], ['--fusion-threshold-mb'])
    """
    bare = given.split("=", 1)[0].lstrip("-")
    if not bare:
        return []
    by_bare = {name.lstrip("-"): name for name in _FLAG_OF_NAME}
    if bare in by_bare:
        return [by_bare[bare]]
    scored = sorted(
        ((difflib.SequenceMatcher(None, bare, other).ratio(), other) for other in by_bare),
        reverse=True,
    )
    best = scored[0][0]
    close: dict[str, str] = {}  # by dest: one name per flag
    # Names as close as the best are shown too (``--min-np`` and ``--max-np``), two at most.
    for score, other in scored:
        if score < max(best - _TIE, _CLOSE) or len(close) == 2:
            break
        close.setdefault(_FLAG_OF_NAME[by_bare[other]], by_bare[other])
    return list(close.values())


def _unknown_flag_line(given: str) -> str:
    name = given.split("=", 1)[0]
    close = nearest_flags(given)
    if not close:
        return f"unknown option {name}."
    return f"unknown option {name}; did you mean {' or '.join(close)}?"


class _Parser(argparse.ArgumentParser):
    """argparse's parser with a short usage on an error: the message, then one line of usage
    (``--help`` prints the whole list)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"horarun: {message}\n{SHORT_USAGE}\n")


_TYPES: dict[str, Any] = {"int": int, "float": float, "text": None, "append": None, "pair": float}


def _add(container: Any, option: Option) -> None:
    """Add ``option`` (and its hidden opposites) to a parser group."""
    facts: dict[str, Any] = {"dest": option.dest, "default": None, "help": option.help_text()}
    if option.shape == "switch":
        container.add_argument(
            *option.flags, action="store_true" if option.stores else "store_false", **facts
        )
        opposite = "store_false" if option.stores else "store_true"
        for flag in option.opposite:
            container.add_argument(
                flag, dest=option.dest, action=opposite, default=None, help=argparse.SUPPRESS
            )
        return
    if option.metavar is not None:
        facts["metavar"] = option.metavar
    if option.shape == "level":
        facts.update(type=str.upper, choices=LOG_LEVELS)
        facts.pop("metavar", None)  # argparse lists the choices
    elif option.shape == "text" and option.variable is not None and option.variable.choices:
        facts.update(type=str.lower, choices=option.variable.choices)
    elif _TYPES[option.shape] is not None:
        facts["type"] = _TYPES[option.shape]
    if option.shape == "append":
        facts["action"] = "append"
    if option.shape == "pair":
        facts["nargs"] = 2
    container.add_argument(*option.flags, **facts)


def build_parser() -> argparse.ArgumentParser:
    """horovodrun's flags under their own names (``-np``, ``-H``, ``--fusion-threshold-mb``, ...),
    built from :data:`hora.runner.flags.OPTIONS`.

    Every value defaults to ``None`` so that a config file can fill what the command line left
    out; :func:`hora.runner.options.parse` applies the defaults after that.
    """
    parser = _Parser(
        prog="horarun",
        description="Launch a hora (Horovod-compatible) training job. Flags follow horovodrun.",
        epilog="Example: horarun -np 4 -H node1:2,node2:2 python train.py",
        allow_abbrev=False,
    )
    for group in GROUPS:
        container: Any = parser.add_argument_group(group.title)
        if group.exclusive:
            container = container.add_mutually_exclusive_group()
        for option in OPTIONS:
            if option.group == group.name:
                _add(container, option)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    return parser
