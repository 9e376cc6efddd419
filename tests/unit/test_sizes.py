"""Size is a design signal: no module of hora over 600 lines, no class over 400, no function over
80 (docstrings not counted). A room past its size wants splitting now, not later.

The only exception is a declared table, named here with the reason: pure data, one entry per
thing it declares, which would only scatter if cut.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

HORA = Path(__file__).resolve().parents[2] / "hora"
MODULE_LINES = 600
CLASS_LINES = 400
FUNCTION_LINES = 80
# module (relative to hora/) -> why it may be longer
TABLES = {
    "common/vocabulary/settings_table.py": "one declaration per HORA_* variable, read by config, the "
    "launcher's flags and the generated docs tables",
}


def _docstring_lines(node: ast.AST) -> int:
    body = getattr(node, "body", [])
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        first = body[0]
        return (first.end_lineno or first.lineno) - first.lineno + 1
    return 0


def _span(node: ast.AST) -> int:
    start, end = getattr(node, "lineno", 0), getattr(node, "end_lineno", 0) or 0
    return end - start + 1 - _docstring_lines(node)


def _sizes() -> tuple[list[str], list[str], list[str]]:
    modules, classes, functions = [], [], []
    for path in sorted(HORA.rglob("*.py")):
        name = path.relative_to(HORA).as_posix()
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        lines = text.count("\n") - _docstring_lines(tree)
        if lines > MODULE_LINES and name not in TABLES:
            modules.append(f"{name}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and _span(node) > CLASS_LINES:
                classes.append(f"{name}: class {node.name}: {_span(node)} lines")
            functional = (ast.FunctionDef, ast.AsyncFunctionDef)
            if isinstance(node, functional) and _span(node) > FUNCTION_LINES:
                functions.append(f"{name}: {node.name}(): {_span(node)} lines")
    return modules, classes, functions


def test_no_module_class_or_function_is_past_its_size() -> None:
    modules, classes, functions = _sizes()
    problems = modules + classes + functions
    assert not problems, (
        f"past the size limits (modules {MODULE_LINES}, classes {CLASS_LINES}, functions "
        f"{FUNCTION_LINES} lines, docstrings not counted); split them along their seams:\n  "
        + "\n  ".join(problems)
    )


def test_the_declared_tables_exist() -> None:
    for name in TABLES:
        assert (HORA / name).is_file(), f"{name} is named as a table but does not exist"


def test_the_limits_catch_a_long_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: an 81-line function, a 401-line class, a module past 600 lines."""
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))
    members = "\n".join(f"    y{i} = {i}" for i in range(CLASS_LINES))
    filler = "\n" * MODULE_LINES
    (tmp_path / "big.py").write_text(
        f'"""Doc."""\ndef long():\n    """Doc."""\n{body}\n\nclass Big:\n{members}\n{filler}'
    )
    monkeypatch.setattr(__import__(__name__, fromlist=["HORA"]), "HORA", tmp_path)
    modules, classes, functions = _sizes()
    assert modules == [f"big.py: {(tmp_path / 'big.py').read_text().count(chr(10)) - 1} lines"]
    assert classes == ["big.py: class Big: 401 lines"]
    assert functions == ["big.py: long(): 81 lines"]
