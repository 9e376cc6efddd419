"""The docs' tables of ``horarun`` flags and ``HORA_*`` variables, written from their declarations.

``python -m hora.tools.docs_tables`` rewrites, in docs/environment.md, docs/launching.md,
docs/elastic.md and docs/api.md, every block between ``<!-- table: NAME -->`` and
``<!-- end table -->`` with the table NAME built from :mod:`hora.common.vocabulary.settings_table` and
:mod:`hora.runner.flags` (docs/api.md's "What is not there yet": from
:mod:`hora.tools.horovod_gaps` and :mod:`hora.tools.horovod_inventory` too);
``--check`` changes nothing and exits with 1 when a file differs from what it would write
(tests/unit/test_settings_table.py runs the same check).
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hora.common.vocabulary import safe_files
from hora.common.vocabulary.settings_table import UNHEEDED, VARIABLES, Variable
from hora.runner.flags import OPTIONS, Option, number_text
from hora.tools import horovod_gaps, horovod_inventory

DOCS = Path(__file__).resolve().parents[2] / "docs"
FILES = ("environment.md", "launching.md", "elastic.md", "api.md")

_BLOCK = re.compile(r"(<!-- table: ([a-z-]+) -->\n)(.*?)(<!-- end table -->)", re.DOTALL)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- variables


def _twin(variable: Variable[Any]) -> str:
    twin = f"`{variable.horovod_env}`" if variable.horovod_env else "none"
    if variable.also_read:
        names = "/".join(f"`{name}`" for name in variable.also_read)
        verb = "is" if len(variable.also_read) == 1 else "are"
        twin += f"; {names} {verb} also read"
    return twin


def _default(variable: Variable[Any]) -> str:
    if variable.default_doc:
        return variable.default_doc
    value = variable.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`1`" if value else "`0`"
    return f"`{number_text(value)}`"


def _variables(table: str) -> str:
    rows = [(f"`{v.env}`", _twin(v), _default(v), v.meaning) for v in VARIABLES if v.table == table]
    return _table(("Variable", "Horovod twin", "Default", "Meaning"), rows)


def _unheeded() -> str:
    rows = [
        (" or ".join(f"`{name}`" for name in entry.names), entry.named_when, entry.why)
        for entry in UNHEEDED
    ]
    rows += [
        (
            f"`{v.horovod_env}`",
            "other than " + ", ".join(f"`{choice}`" for choice in v.choices),
            v.lacking,
        )
        for v in VARIABLES
        if v.lacking
    ]
    return _table(("Variable", "Named when", "What hora does instead"), rows)


# ---------------------------------------------------------------- flags


def _flags(option: Option) -> str:
    metavar = option.metavar
    value = " ".join(metavar) if isinstance(metavar, tuple) else metavar
    suffix = f" {value}" if value and option.shape != "switch" else ""
    text = ", ".join(f"`{flag}{suffix}`" for flag in option.flags)
    if option.opposite:
        text += " (and " + ", ".join(f"`{flag}`" for flag in option.opposite) + ")"
    return text


def _meaning(option: Option) -> str:
    text = option.doc or option.help[:1].upper() + option.help[1:] + "."
    return f"*hora*: {text}" if option.hora else text


def _config_key(option: Option) -> str:
    if option.config_key is None:
        return ""
    if option.shape == "switch" and not option.stores:
        return f"`{option.config_key}: false`"
    return f"`{option.config_key}`"


def _sets(option: Option) -> str:
    note = option.env_doc
    if note and not note.startswith((",", ";")):
        note = " " + note
    return f"`{option.env_text()}`{note}"


def _listed(table: str) -> list[Option]:
    return [option for option in OPTIONS if option.doc_table == table]


def _general(table: str) -> str:
    rows = [(_flags(o), _meaning(o)) for o in _listed(table)]
    return _table(("Flag", "Meaning"), rows)


def _engine() -> str:
    rows = [(_flags(o), _config_key(o), _sets(o)) for o in _listed("engine")]
    return _table(("Flag", "Config key", "Variable"), rows)


def _inert() -> str:
    rows = [(_flags(o), _config_key(o), o.inert) for o in _listed("inert")]
    return _table(("Flag", "Config key", "Why it has no effect"), rows)


def _refused() -> str:
    rows = [
        (", ".join(filter(None, (_flags(o), _config_key(o)))), f"`{o.refused}`")
        for o in _listed("refused")
    ]
    return _table(("Flag", "Message"), rows)


def _elastic() -> str:
    rows = [(_flags(o), o.elastic_doc, o.elastic_default) for o in OPTIONS if o.elastic_doc]
    return _table(("Flag", "Meaning", "Default"), rows)


# ---------------------------------------------------------------- Horovod's API


def _paragraph(text: str) -> str:
    # Lines break between words, never inside a code span or a link's text.
    kept = re.sub(r"`[^`]*`|\[[^\]]*\]", lambda m: m.group().replace(" ", "\0"), text)
    lines = textwrap.fill(kept, 100, break_long_words=False, break_on_hyphens=False)
    return lines.replace("\0", " ") + "\n\n"


def _names(path: str) -> str:
    names = horovod_inventory.under(path)
    return f"`{path}`" if names == [path] else f"`{path}` ({len(names)} names)"


def _horovod_gaps() -> str:
    inventory = horovod_inventory.paths()
    missing = [path for path in inventory if horovod_gaps.covered(path)]
    packages = list(dict.fromkeys(horovod_inventory.package(path) for path in inventory))
    text = _paragraph(
        f"Horovod {horovod_inventory.HOROVOD_VERSION}'s Python API has {len(inventory)} public "
        f"names in {len(horovod_inventory.HOROVOD)} modules (`hora/tools/horovod_inventory.py` "
        f"lists them). hora has {len(inventory) - len(missing)} of them at the same path "
        "(`hora.torch.allreduce` for `horovod.torch.allreduce`); the first table counts them by "
        "package, the second says what hora lacks, or has and refuses, and what to use "
        "instead."
    )
    counts = []
    for name in packages:
        of_package = [p for p in inventory if horovod_inventory.package(p) == name]
        lacking = [p for p in of_package if p in missing]
        counts.append((f"`{name}`", str(len(of_package)), str(len(of_package) - len(lacking))))
    text += _table(("Horovod", "Public names", "In hora"), counts) + "\n"
    rows = []
    for gap in horovod_gaps.GAPS:
        paths = ", ".join(_names(path) for path in gap.missing)
        rows.append((f"{paths}: {gap.title}" if paths else gap.title, gap.instead, gap.why))
    text += _table(("Horovod", "In hora", "Why"), rows) + "\n"
    variables = [f"`{entry.name}`" for entry in UNHEEDED]
    values = [
        f"`{v.horovod_env}` other than " + " or ".join(f"`{choice}`" for choice in v.choices)
        for v in VARIABLES
        if v.lacking
    ]
    inert = [_flags(o) for o in OPTIONS if o.inert]
    refused = [_flags(o) for o in OPTIONS if o.refused]
    text += _paragraph(
        "**Settings with no effect.** hora reads these variables of Horovod's only to say, at "
        f"`hvd.init()`, that it does not act on them: {', '.join(variables)}; and "
        f"{', '.join(values)}. `horarun` accepts these flags and changes nothing: "
        f"{', '.join(inert)}; it refuses {', '.join(refused)}. "
        "[environment.md](environment.md#variables-hora-does-not-act-on) and "
        "[launching.md](launching.md#flags) give each one's reason."
    )
    text += _paragraph(
        "What works, but not quite as in Horovod, is explained with each part: "
        + ", ".join(f"[{what}]({link})" for what, link in horovod_gaps.ELSEWHERE)
        + "."
    )
    return text.removesuffix("\n")


TABLES: dict[str, Callable[[], str]] = {
    "variables-settings": lambda: _variables("settings"),
    "variables-launcher": lambda: _variables("launcher"),
    "variables-elastic": lambda: _variables("elastic"),
    "variables-unheeded": _unheeded,
    "flags-general": lambda: _general("general"),
    "flags-ssh": lambda: _general("ssh"),
    "flags-engine": _engine,
    "flags-inert": _inert,
    "flags-refused": _refused,
    "flags-elastic": _elastic,
    "horovod-gaps": _horovod_gaps,
}


def render(text: str) -> str:
    """``text`` with every marked block replaced by its table.

    Raises:
        KeyError: a block names a table that does not exist.
    """

    def block(match: re.Match[str]) -> str:
        return match.group(1) + TABLES[match.group(2)]() + match.group(4)

    return _BLOCK.sub(block, text)


def blocks(text: str) -> list[str]:
    """The names of the tables ``text`` marks, in order."""
    return [match.group(2) for match in _BLOCK.finditer(text)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hora.tools.docs_tables", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 when a file is out of date"
    )
    parser.add_argument("--docs", type=Path, default=DOCS, help="the docs folder")
    args = parser.parse_args(argv)
    stale = []
    for name in FILES:
        path = args.docs / name
        text = path.read_text()
        new = render(text)
        if new == text:
            continue
        stale.append(name)
        if not args.check:
            safe_files.write(path, new, mode=path.stat().st_mode & 0o777)
    verb = "out of date" if args.check else "rewritten"
    for name in stale:
        print(f"{args.docs / name}: {verb}", file=sys.stderr)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
