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


def _type_only(tree: ast.Module) -> set[int]:
    """The ids of the import nodes under ``if TYPE_CHECKING:``: names for annotations."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            found.update(id(child) for part in node.body for child in ast.walk(part))
    return found


def _imports(path: Path, types_too: bool = True) -> set[str]:
    """The modules ``path`` imports, by full name (``from a import b``: ``a`` and ``a.b``);
    without ``types_too``, not those imported only for annotations (``if TYPE_CHECKING:``)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    skip = set() if types_too else _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
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
        "hora.common.api",
        "hora.common.vocabulary.settings_table",
    ),
    "hora.lightning": (
        "hora.torch",
        "hora.lightning",
        "hora.common.api",
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


# hora/common's floors, from the bottom (hora/common/README.md draws them): a module imports
# its own floor and the floors below it, never one above. The state floor holds the services'
# objects, so it names their types for annotations (``if TYPE_CHECKING:``) and nothing more.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    (
        "vocabulary",
        ("hora.common.vocabulary", "hora.common.exceptions", "hora.common.process_sets"),
    ),
    ("state", ("hora.common.runtime",)),
    ("job", ("hora.common.job",)),
    ("transport", ("hora.common.transport",)),
    ("engine", ("hora.common.engine",)),
    ("metrics", ("hora.common.metrics",)),
    ("queries", ("hora.common.basics", "hora.common.build_info")),
    ("ops", ("hora.common.ops",)),
    ("startup", ("hora.common.startup",)),
    ("elastic", ("hora.common.elastic",)),
    ("api", ("hora.common.api",)),
]


def _floor(module: str) -> int | None:
    for number, (_, prefixes) in enumerate(FLOORS):
        if _within(module, prefixes):
            return number
    return None


def test_every_module_of_common_stands_on_a_floor() -> None:
    homeless = [m for m in MODULES if _within(m, ("hora.common",)) and m != "hora.common"]
    assert [m for m in homeless if _floor(m) is None] == []
    # At most eight modules directly in hora/common: the rest live in its folders.
    direct = [p.name for p in (HORA / "common").glob("*.py") if p.name != "__init__.py"]
    assert len(direct) <= 8, sorted(direct)


@pytest.mark.parametrize("floor", [name for name, _ in FLOORS])
def test_a_floor_of_common_imports_nothing_above_it(floor: str) -> None:
    number = next(i for i, (name, _) in enumerate(FLOORS) if name == floor)
    upward = []
    for module, path in MODULES.items():
        if _floor(module) != number:
            continue
        for name in _imports(path, types_too=floor != "state"):
            above = _floor(name)
            if above is not None and above > number:
                upward.append(f"{module} imports {name} ({FLOORS[above][0]})")
    assert sorted(upward) == []


# What an adapter may use of hora/common: the neutral API, the submission layer (hora/common/ops,
# engine_facts being all it learns of the engine), elastic state, the shared vocabulary and
# process sets, live metrics (``hvd.metrics``) and the training timeline's current file.
ADAPTER_REACH = (
    "hora.common.api",
    "hora.common.ops",
    "hora.common.elastic",
    "hora.common.vocabulary",
    "hora.common.process_sets",
    "hora.common.exceptions",
    "hora.common.metrics",
    "hora.common.startup.timeline",
)


def test_adapters_reach_the_engine_only_through_the_api_and_the_submission_layer() -> None:
    reached = sorted(
        f"{module} imports {name}"
        for module, path in MODULES.items()
        if _within(module, ADAPTERS)
        for name in _imports(path)
        if _within(name, ("hora.common",)) and not _within(name, ADAPTER_REACH)
    )
    assert reached == []


def _readme_rule(readme: Path) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """A folder README's "Must not import:" sentence: (forbidden, allowed) module names.

    ``Must not import: `a`, `b`.`` forbids ``a`` and ``b``; ``Must not import: anything of
    hora but `x`, `y`.`` forbids all of hora except ``x`` and ``y`` (and the folder itself).
    """
    text = " ".join(readme.read_text().split())
    found = re.search(r"Must not import:? (.*?)(?:\.(?: |$)|$)", text)
    if found is None:
        return None
    sentence = found.group(1)
    names = tuple(re.findall(r"`([a-z_][a-z0-9_.]*)`", sentence))
    if sentence.startswith("anything of hora"):
        return ("hora",), names
    return names, ()


# hora/README.md's table of the top-level folders is checked by the layer tests above.
READMES = sorted(p.parent / "README.md" for p in HORA.rglob("__init__.py") if p.parent != HORA)


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_every_folder_readme_states_what_it_must_not_import_and_holds_to_it(
    readme: Path,
) -> None:
    rule = _readme_rule(readme)
    assert rule is not None, f"{readme.relative_to(ROOT)} has no 'Must not import:' sentence"
    forbidden, allowed = rule
    folder = _module(readme.parent / "__init__.py")
    breaches = sorted(
        f"{module} imports {name}"
        for module, path in MODULES.items()
        if _within(module, (folder,))
        for name in _imports(path)
        if _within(name, forbidden) and not _within(name, (*allowed, folder))
    )
    assert breaches == []


# A store method called with a key spelled out in place (a string, an f-string, a
# concatenation) rather than one that hora/common/job/store_keys.py builds.
STORE_METHODS = {"set", "get", "set_signed", "get_signed", "wait", "add", "compare_set", "mark"}


def test_every_store_key_is_built_by_store_keys() -> None:
    spelled = []
    for path in sorted(HORA.rglob("*.py")):
        if path.name == "store_keys.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in STORE_METHODS
                and node.args
                and "store" in ast.unparse(node.func.value).lower()
            ):
                continue
            key = node.args[0]
            if isinstance(key, (ast.JoinedStr, ast.BinOp)) or (
                isinstance(key, ast.Constant) and isinstance(key.value, str)
            ):
                spelled.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(key)}")
    assert spelled == []
