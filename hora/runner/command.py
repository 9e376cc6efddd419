"""Whether the job's command can start as a program: a Python script given without its
interpreter (``horarun -np 2 train.py``) is refused before any worker starts, with the command
the user most likely meant.

horovodrun runs such a command through a shell, which answers ``train.py: not found``; running
it with an interpreter of horarun's choosing could pick another Python than the user's, so
horarun does not guess either: it says what to type. A script that can start (executable, with a
``#!`` line, reachable by its path or on the ``PATH``) runs as it is. This module looks only at
the first word of the command and the file it names here; it starts nothing.
"""

from __future__ import annotations

import ast
import os
import shlex
import shutil
from collections.abc import Sequence
from pathlib import Path

__all__ = ["CommandError", "check_command"]

# Bytes read for the ``#!`` line (and to tell a binary); the most read to parse a script
# without one as Python (a larger file is not taken for a script).
_FIRST_BYTES = 4096
_SNIFF_BYTES = 1 << 20
_PYTHON_SUFFIXES = (".py", ".pyw")


class CommandError(ValueError):
    """The command's first word names a file here that cannot start as a program."""


def check_command(command: Sequence[str], argv: Sequence[str]) -> None:
    """Refuse a command whose first word is a file here that cannot start as a program.

    Args:
        command: the job's command (``["train.py", "--epochs", "3"]``).
        argv: horarun's whole command line, which ends with ``command``, for the suggestion.

    Raises:
        CommandError: the file is a Python script given without its interpreter, is not
            executable, or is not reachable by the name given; the message says what to type.
    """
    if not command:
        return
    program = command[0]
    path = Path(program)
    if not path.is_file():
        return  # a program on the PATH, or a file on other hosts only: the workers say
    executable = os.access(path, os.X_OK)
    head = _head(path, _FIRST_BYTES)
    shebang = head.startswith(b"#!")
    # exec looks a name without a slash up on the PATH only, as a shell does.
    by_path = "/" in program
    found = None if by_path else shutil.which(program)
    if found is not None and not Path(found).samefile(path):
        return  # the program on the PATH is what runs, as in a shell
    reachable = by_path or found is not None
    python = _looks_like_python(path, head)
    if executable and reachable and (shebang or not python):
        return
    flags = list(argv[: len(argv) - len(command)])
    if python:
        why = _why_python_cannot_start(program, executable, shebang)
        meant = _horarun([*flags, _interpreter(), *command])
        raise CommandError(
            f"{program!r} is a Python script, not a program ({why}); did you mean `{meant}`?"
        )
    if not executable:
        interpreter = _named_interpreter(head) if shebang else None
        first = f"`{_horarun([*flags, interpreter or 'INTERPRETER', *command])}`"
        raise CommandError(
            f"{program!r} is not executable: run `chmod +x {shlex.quote(program)}`, or put "
            f"its interpreter first ({first})."
        )
    meant = _horarun([*flags, f"./{program}", *command[1:]])
    raise CommandError(f"{program!r} is not on the PATH; did you mean `{meant}`?")


def _why_python_cannot_start(program: str, executable: bool, shebang: bool) -> str:
    if not executable:
        return "it is not executable"
    if not shebang:
        return "it has no #! line naming its interpreter"
    return f"it is not on the PATH; ./{program} would name it"


def _named_interpreter(head: bytes) -> str | None:
    """The interpreter a ``#!`` line names: ``/bin/sh``, or ``bash`` for ``#!/usr/bin/env
    bash``; ``None`` when the line names none."""
    words = head.split(b"\n", 1)[0][2:].decode("utf-8", "replace").split()
    if words and words[0].endswith("/env") and len(words) > 1:
        words = words[1:]
    return words[0] if words else None


def _head(path: Path, size: int) -> bytes:
    """The first ``size`` bytes of the file; empty when it cannot be read."""
    try:
        with path.open("rb") as file:
            return file.read(size)
    except OSError:
        return b""


def _looks_like_python(path: Path, head: bytes) -> bool:
    """A ``.py`` name, a ``#!`` line naming Python, or a text without one that parses as Python
    and imports, defines or calls something (a shell script of one word parses too).

    Args:
        head: the file's first :data:`_FIRST_BYTES`.
    """
    if path.suffix in _PYTHON_SUFFIXES:
        return True
    if head.startswith(b"#!"):
        return b"python" in head.split(b"\n", 1)[0]
    if b"\0" in head:
        return False  # a binary
    text = _head(path, _SNIFF_BYTES + 1)
    if len(text) > _SNIFF_BYTES:
        return False
    try:
        tree = ast.parse(text.decode("utf-8"))
    except (SyntaxError, ValueError):  # ValueError: not UTF-8, or a NUL byte (a binary)
        return False
    statements = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef, ast.Call)
    return any(isinstance(node, statements) for node in ast.walk(tree))


def _interpreter() -> str:
    """The name to suggest: ``python``, or ``python3`` where only that is on the PATH."""
    if shutil.which("python") is None and shutil.which("python3") is not None:
        return "python3"
    return "python"


def _horarun(argv: Sequence[str]) -> str:
    return shlex.join(["horarun", *argv])
