"""The architecture's rules between packages, checked on the source (docs/architecture.md).

Every import counts, a lazy one inside a function included: a rule that holds only at import
time does not hold.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HORA = ROOT / "hora"


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


MODULES = {_module(p): p for p in HORA.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """The modules ``path`` imports, by full name (``from a import b``: ``a`` and ``a.b``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _breaches(layer: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{module} imports {name}"
        for module, path in MODULES.items()
        if _within(module, layer)
        for name in _imports(path)
        if _within(name, forbidden)
    )


ADAPTERS = ("hora.torch", "hora.tensorflow", "hora.keras")
EDGES = ("hora.lightning", "hora.ray")
LAUNCHER = ("hora.runner",)


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        # The runtime knows no framework adapter, no launcher, no tool, and no torch.nn or
        # optimizer: tensors are the engine's data plane, nothing more.
        (("hora.common",), (*ADAPTERS, *EDGES, *LAUNCHER, "hora.tools", "torch.nn", "torch.optim")),
        # Adapters stand on hora.common alone: not on each other, not on the launcher.
        (("hora.tensorflow", "hora.keras"), ("hora.torch", *LAUNCHER, "hora.tools")),
        (("hora.torch",), ("hora.tensorflow", "hora.keras", *LAUNCHER, "hora.tools")),
        # The launcher never imports a framework (its own imports; the process as a whole is
        # checked in tests/multiproc/test_launcher_imports.py).
        (LAUNCHER, ("torch", *ADAPTERS, *EDGES, "tensorflow")),
    ],
    ids=["common", "tensorflow", "torch", "runner"],
)
def test_a_layer_imports_nothing_above_or_beside_it(
    layer: tuple[str, ...], forbidden: tuple[str, ...]
) -> None:
    assert _breaches(layer, forbidden) == []


# What the integrations at the edge may use besides the public API (docs/architecture.md
# lists the same): Ray's rank 0 hosts the job's store and gives each worker its place, as
# horarun does; Lightning reads the topology before hvd.init() to answer its cluster
# environment's questions.
EDGE_ALLOWED = {
    "hora.ray": (
        "hora.torch",
        "hora.ray",
        "hora.runner.store_server",
        "hora.runner.hosts",
        "hora.common.job.store",
        "hora.common.startup.lifecycle",
        "hora.common.basics",
        "hora.common.vocabulary.settings_table",
    ),
    "hora.lightning": (
        "hora.torch",
        "hora.lightning",
        "hora.common.basics",
        "hora.common.vocabulary.config",
        "hora.common.vocabulary.settings_table",
        "hora.common.job.topology",
    ),
}


@pytest.mark.parametrize("edge", sorted(EDGE_ALLOWED))
def test_integrations_use_the_public_api_and_what_the_architecture_page_names(edge: str) -> None:
    allowed = EDGE_ALLOWED[edge]
    used = [
        f"{module} imports {name}"
        for module, path in MODULES.items()
        if _within(module, (edge,))
        for name in _imports(path)
        if name.startswith("hora") and name != "hora" and not _within(name, allowed)
    ]
    assert sorted(used) == []
    page = (ROOT / "docs" / "architecture.md").read_text()
    for name in allowed:
        if not _within(name, (edge, "hora.torch")):
            assert f"`{name}`" in page, f"docs/architecture.md does not name {name} for {edge}"


def test_settings_are_named_only_in_the_settings_table() -> None:
    """A ``HORA_`` variable is read and written through its declaration
    (``hora.common.vocabulary.settings_table``), never by a string of its own: a string that is a
    variable's whole name, anywhere but in the table, is one. (A message that names a variable
    to the user is text, not a name.)"""
    name = re.compile(r"(HORA|HOROVOD)_[A-Z0-9_]+")
    found = []
    for path in sorted(HORA.rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        if relative == "hora/common/vocabulary/settings_table.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and name.fullmatch(str(node.value)):
                found.append(f"{relative}:{node.lineno}: {node.value}")
    assert found == []


def test_every_package_folder_has_its_readme() -> None:
    missing = sorted(
        str(folder.relative_to(ROOT))
        for folder in [HORA, *(p.parent for p in HORA.rglob("__init__.py"))]
        if not (folder / "README.md").exists()
    )
    assert missing == []
