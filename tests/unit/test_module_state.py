"""A process's state lives in hora/common/runtime.py alone (docs/architecture.md): no other module
of hora keeps state of the process at module level. Checked on the source of every module.

What counts as module state:

* a ``global`` statement, anywhere: a function that rebinds a name of its module;
* a module-level name bound to a mutable container (a dict, list or set display or
  comprehension, or a call that returns one) that is not a read-only table (below);
* a module-level name bound to an object made by a call (a lock, a counter, an instance of a
  class), but for the calls below whose result holds nothing that changes;
* a module-level name, whatever it is bound to, that a function of hora writes into (assigns
  an attribute or an item of it, calls a mutating method such as ``append`` on it, or
  ``setattr``): ``progress.plan = plan`` makes ``progress`` state;
* a function cache (``functools.cache``, ``lru_cache``), but for the ones allowed below.

What is not, and why:

* constants: literals, tuples of them, f-strings and arithmetic on them;
* aliases (``plan_key = keys.elastic_plan``) and type aliases (``tuple[...]``, ``X | None``):
  they bind what is made elsewhere, and that place is checked too;
* functions (``lambda``), classes and imports;
* read-only tables: an UPPER_CASE name (or ``__all__``) bound to a dict, list or set that no
  function of hora writes into; a table nobody writes holds no state (one its module completes
  at import, as ``__all__ += api.__all__``, included), and turning each into a frozen mapping
  would slow every lookup of the engine's;
* calls whose result cannot change (:data:`IMMUTABLE_CALLS`: ``frozenset``, ``tuple``,
  ``re.compile``, ``struct.Struct``, ``math`` functions, a string's methods), and hora
  functions annotated to return an immutable type (``tuple``, ``frozenset``, ``int``, ...) or
  one of the immutable classes below;
* calls that make nothing of hora's (:data:`NOT_STATE_CALLS`): loggers (``logging`` keeps
  them, however they are configured; hora's configuring them once is the runtime's
  ``logging_configured``), ``TypeVar`` and its kin (types for annotations),
  ``importlib.import_module`` (a module), ``getattr`` (what exists already);
* instances of hora's immutable classes, unless code writes into them: frozen dataclasses,
  named tuples, enums, and plain classes whose methods but ``__init__`` neither assign nor
  write into an attribute of ``self`` (markers such as ``FINISHED``, the engine's executors);
* the few names of :data:`ALLOWED`, each with its reason.

Class attributes are not checked here: the classes of hora hold per-object state in dataclass
fields and instances, which is the objects' own. Names are matched by spelling, not resolved:
a table is taken as written when any function writes into something of the same name.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HORA = ROOT / "hora"
RUNTIME = HORA / "common" / "runtime.py"

CONSTANT_NAME = re.compile(r"_*[A-Z][A-Z0-9_]*")

# Calls whose result cannot change after it is made.
IMMUTABLE_CALLS = {
    "frozenset",
    "tuple",
    "range",
    "int",
    "float",
    "str",
    "bytes",
    "bool",
    "re.compile",
    "struct.Struct",
}
IMMUTABLE_PREFIXES = ("math.",)
# Calls that make nothing of hora's that could change (``getattr`` reads what exists).
NOT_STATE_CALLS = {
    "getattr",
    "logging.getLogger",
    "getLogger",
    "TypeVar",
    "typing.TypeVar",
    "ParamSpec",
    "NewType",
    "importlib.import_module",
}
# Return annotations that name an immutable type.
IMMUTABLE_RETURNS = re.compile(r"(tuple|frozenset|int|float|str|bytes|bool)\b")
CONTAINER_RETURNS = re.compile(r"(dict|list|set|defaultdict|OrderedDict)\b")
MUTATORS = {
    "append",
    "extend",
    "insert",
    "remove",
    "pop",
    "popitem",
    "clear",
    "update",
    "setdefault",
    "add",
    "discard",
    "sort",
    "reverse",
    "difference_update",
    "intersection_update",
    "symmetric_difference_update",
    "__setitem__",
    "__delitem__",
}
CACHES = {"functools.cache", "functools.lru_cache", "cache", "lru_cache"}

# Module-level names that are allowed although they look like state, and why.
ALLOWED = {
    (
        "hora/common/process_sets.py",
        "global_process_set",
    ): "Horovod's hvd.global_process_set: an object users hold, which every init binds to the "
    "running job (hora.common.startup.registration) as it binds the sets users make, and the "
    "session holds as its process set 0. It must exist at import, as the default of every "
    "process_set= argument, in a module below the runtime's floor",
    (
        "hora/common/transport/shm_segment.py",
        "_syscall",
    ): "libc's syscall function, loaded once per process: every call returns the same function, "
    "so the cache changes nothing but the cost",
    (
        "hora/common/transport/shm_lane.py",
        "_compare_exchange",
    ): "libatomic's compare-and-swap function, loaded once per process: every call returns the "
    "same function, so the cache changes nothing but the cost",
    (
        "hora/common/ops/fast_path.py",
        "_tensor_text",
    ): "the text of a tensor's dtype and shape in a fast-path signature: it depends on its "
    "arguments alone, so the cache changes nothing but the cost (a small call's formatting)",
    (
        "hora/common/ops/fast_path.py",
        "_items_text",
    ): "the text of a call's request fields in a fast-path signature, as _tensor_text",
    (
        "hora/common/ops/fast_path.py",
        "reduction_text",
    ): "the text of an allreduce's fields in a fast-path signature, as _tensor_text",
}

SOURCES = {str(p.relative_to(ROOT)): ast.parse(p.read_text()) for p in sorted(HORA.rglob("*.py"))}


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    return ""


def _module_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run at import: the module's, and those of its ``if``s and ``try``s."""
    for statement in body:
        if isinstance(statement, ast.If):
            yield from _module_statements(statement.body)
            yield from _module_statements(statement.orelse)
        elif isinstance(statement, ast.Try):
            yield from _module_statements(statement.body)
            for handler in statement.handlers:
                yield from _module_statements(handler.body)
            yield from _module_statements(statement.orelse)
            yield from _module_statements(statement.finalbody)
        else:
            yield statement


def _frozen(decorator: ast.expr) -> bool:
    return (
        isinstance(decorator, ast.Call)
        and _dotted(decorator.func).endswith("dataclass")
        and any(
            k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value is True
            for k in decorator.keywords
        )
    )


def _writes_self(method: ast.FunctionDef) -> bool:
    """Whether ``method`` assigns an attribute of ``self`` or writes into one."""
    for node in ast.walk(method):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
        ):
            targets = [node.func.value]
        for target in targets:
            while isinstance(target, ast.Subscript):
                target = target.value
            if isinstance(target, ast.Attribute) and _dotted(target).startswith("self."):
                return True
    return False


def _is_immutable_class(node: ast.ClassDef) -> bool:
    """A frozen dataclass, a named tuple, an enum, or a plain class whose methods but
    ``__init__`` neither assign nor write into an attribute of ``self``: its objects keep what
    they were made with (markers such as ``FINISHED``, the engine's stateless executors)."""
    if any(_frozen(decorator) for decorator in node.decorator_list):
        return True
    if any(_dotted(b).split(".")[-1] in {"NamedTuple", "Enum", "IntEnum"} for b in node.bases):
        return True
    if any(_dotted(d).split(".")[-1] == "dataclass" for d in node.decorator_list):
        return False  # a dataclass that is not frozen: its fields are there to change
    return not any(
        isinstance(method, ast.FunctionDef) and method.name != "__init__" and _writes_self(method)
        for method in node.body
    )


def _immutable_classes(sources: dict[str, ast.Module]) -> set[str]:
    return {
        node.name
        for tree in sources.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and _is_immutable_class(node)
    }


def _returns(tree: ast.Module, function: str) -> str:
    """The return annotation of the module-level function ``function`` ("" when there is none)."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == function and node.returns:
            return ast.unparse(node.returns).strip("'\"")
    return ""


def _value_kind(value: ast.expr, tree: ast.Module, classes: set[str]) -> str:
    """``"constant"``, ``"container"`` (a mutable container), ``"object"`` (made by a call
    whose result may hold state) or ``"not hora's"`` (made by a call of :data:`NOT_STATE_CALLS`:
    a logger is the ``logging`` module's to keep, whoever configures it)."""
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return "container"
    if isinstance(value, ast.Call):
        return _call_kind(value, tree, classes)
    if isinstance(value, ast.Lambda):
        return "constant"
    kinds = {_value_kind(child, tree, classes) for child in ast.iter_child_nodes(value)}
    if isinstance(value, (ast.Subscript, ast.Attribute)):
        return "constant"  # an alias, an item of a table, or a type alias
    for worst in ("object", "container"):
        if worst in kinds:
            return worst
    return "constant"


def _hora_class(callee: str, tree: ast.Module) -> str:
    """The name of the class of hora that ``callee`` (as the module spells it) is: a class of
    the module, a name imported from hora, or a class reached through a module of hora; ``""``
    for anything else (``threading.Lock`` is no class of hora's, whatever hora names its own)."""
    local = {n.name: n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hora"):
            for alias in node.names:
                local[alias.asname or alias.name] = alias.name
                modules.add(alias.asname or alias.name)  # it may be a module, too
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hora"):
                    modules.add(alias.asname or alias.name)
    head, _, name = callee.rpartition(".")
    if not head:
        return local.get(name, "")
    return name if head in modules or head.startswith("hora.") else ""


def _call_kind(call: ast.Call, tree: ast.Module, classes: set[str]) -> str:
    callee = _dotted(call.func)
    if callee in IMMUTABLE_CALLS or callee.startswith(IMMUTABLE_PREFIXES):
        return "constant"
    if callee in NOT_STATE_CALLS:
        return "not hora's"
    if isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Constant):
        return "constant"  # a method of a literal string: another string
    if callee in {"dict", "list", "set", "collections.defaultdict", "defaultdict"}:
        return "container"
    if _hora_class(callee, tree) in classes:
        return "constant"
    returns = _returns(tree, callee)
    if IMMUTABLE_RETURNS.match(returns) or returns.split("[")[0] in classes:
        return "constant"
    if CONTAINER_RETURNS.match(returns):
        return "container"
    return "object"


def _targets(statement: ast.stmt) -> list[str]:
    if isinstance(statement, ast.Assign):
        found = []
        for target in statement.targets:
            nodes = target.elts if isinstance(target, ast.Tuple) else [target]
            found += [n.id for n in nodes if isinstance(n, ast.Name)]
        return found
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
        return [statement.target.id]
    return []


def _mutated_names(sources: dict[str, ast.Module]) -> set[str]:
    """Every name (bare, or as an attribute of a module) that a function of ``sources`` writes
    into: item or attribute assignment or deletion, augmented assignment, a mutating method,
    ``setattr``. (A table that its module completes at import, as ``__all__ += api.__all__``,
    is a constant after it.)"""
    written: set[str] = set()

    def name_of(node: ast.expr) -> str:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute):
            return node.attr
        return ""

    functions = [
        node
        for tree in sources.values()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
    ]
    for function in functions:
        for node in ast.walk(function):
            targets: list[ast.expr] = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = node.targets
            elif isinstance(node, ast.AugAssign):
                targets = [node.target]
                written.add(name_of(node.target))
            if isinstance(node, ast.AnnAssign):
                targets = [node.target]
            for target in targets:
                if isinstance(target, (ast.Subscript, ast.Attribute)):
                    written.add(name_of(target.value))
            if isinstance(node, ast.Call):
                if isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                    written.add(name_of(node.func.value))
                elif _dotted(node.func) in {"setattr", "delattr"} and node.args:
                    written.add(name_of(node.args[0]))
    written -= {"", "self", "cls"}
    return written


def module_state(sources: dict[str, ast.Module]) -> list[str]:
    """What each module of ``sources`` (by path) keeps as state, as ``path:line: why``."""
    written = _mutated_names(sources)
    classes = _immutable_classes(sources)
    found = []
    for path, tree in sources.items():
        if path == str(RUNTIME.relative_to(ROOT)):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found.append(f"{path}:{node.lineno}: global {', '.join(node.names)}")
        for statement in _module_statements(tree.body):
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
                cached = [d for d in statement.decorator_list if _dotted(d) in CACHES]
                if cached and (path, statement.name) not in ALLOWED:
                    found.append(f"{path}:{statement.lineno}: {statement.name} is cached")
                continue
            value = getattr(statement, "value", None)
            names = _targets(statement)
            if value is None or not names:
                continue
            kind = _value_kind(value, tree, classes)
            for name in names:
                if (path, name) in ALLOWED or kind == "not hora's":
                    continue
                table = name == "__all__" or CONSTANT_NAME.fullmatch(name)
                if kind == "constant" or (kind == "container" and table):
                    if name not in written:
                        continue
                    why = "a table" if kind == "container" else "an object"
                    why += " that code writes to"
                else:
                    why = kind
                found.append(f"{path}:{statement.lineno}: {name} = {ast.unparse(value)} ({why})")
    return sorted(found)


def test_no_module_but_the_runtime_keeps_process_state() -> None:
    assert module_state(SOURCES) == []


def test_every_allowance_names_something_that_exists() -> None:
    for path, name in ALLOWED:
        tree = SOURCES[path]
        defined = {
            target
            for statement in _module_statements(tree.body)
            for target in (
                [statement.name]
                if isinstance(statement, (ast.FunctionDef, ast.ClassDef))
                else _targets(statement)
            )
        }
        assert name in defined, f"{path} no longer defines {name}: drop its allowance"


def test_the_check_finds_each_kind_of_state() -> None:
    """The check is not vacuous: each kind of state it looks for, in a module of its own."""
    planted = ast.parse(
        "import functools, itertools, logging, threading\n"
        "_numbers = itertools.count()\n"
        "_lock = threading.Lock()\n"
        "_servers: dict[str, object] = {}\n"
        "_keys: list[object] = []\n"
        "LIMITS = {'a': 1}\n"
        "_told = False\n"
        "def tell() -> None:\n"
        "    global _told\n"
        "    _told = True\n"
        "    LIMITS['b'] = 2\n"
        "@functools.cache\n"
        "def load() -> object:\n"
        "    return object()\n"
        "SOLE = (1, 2)\n"
        "logger = logging.getLogger('hora')\n"
        "class _Progress:\n"
        "    plan = None\n"
        "progress = _Progress()\n"
        "def join() -> None:\n"
        "    progress.plan = 1\n"
        "    logger.propagate = False\n"
    )
    found = module_state({"hora/planted.py": planted, **SOURCES})
    planted_found = sorted(
        line.split(": ", 1)[1] for line in found if line.startswith("hora/planted")
    )
    assert planted_found == [
        "LIMITS = {'a': 1} (a table that code writes to)",
        "_keys = [] (container)",
        "_lock = threading.Lock() (object)",
        "_numbers = itertools.count() (object)",
        "_servers = {} (container)",
        "global _told",
        "load is cached",
        "progress = _Progress() (an object that code writes to)",
    ]
