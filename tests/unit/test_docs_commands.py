"""The commands in README.md and docs/*.md are commands that hora and this repository accept.

Every fenced shell block (```bash, ```sh, ```console, or untyped) is read for commands that
start with ``horarun``, ``hora``, ``python`` or ``./dev``, after an optional ``$ `` prompt and
``NAME=value`` assignments; ``\\``-continued lines are joined and ``# comments`` dropped. Each one
must parse, without running anything:

- ``horarun``: its flags through horarun's own parser (:func:`hora.runner.options.build_parser`),
  then the command it starts, checked the same way;
- ``hora``: the subcommand and its flags through :func:`hora.cli.build_parser`;
- ``python SCRIPT``: the script is in this repository (or on :data:`PLACEHOLDERS`, the files a
  reader brings), and every ``--flag`` given to it is one that the script defines;
  ``python -m MODULE``: the module exists (``pytest``: the test paths do); ``python -c``: the code
  compiles;
- ``./dev``: the subcommand is one of the script's.

The whole text of the docs is also checked for ``HORA_*`` variables that hora does not declare,
extras (``hora[...]``) that pyproject.toml does not define, and relative links or anchors that do
not resolve. tests/multiproc/test_docs_commands_run.py runs the quick commands end to end.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hora import cli
from hora.common.vocabulary import settings_table
from hora.runner import options

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
EXAMPLES = tuple(sorted((ROOT / "examples").glob("*.py")))

SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}
PROGRAMS = {"horarun", "hora", "python", "python3", "./dev"}

# Files and hosts of the reader's own that the docs name in their commands: scripts such as the
# README's train.py, a hostfile, a discovery script. Any other file a command names must exist
# in this repository.
PLACEHOLDERS = {
    "train.py",
    "train_keras.py",
    "my_train.py",
    "fail.py",
    "sweep.py",
    "stall.py",
    "latency.py",
    "graph_mode.py",
    "run_example.py",
    "hosts.txt",
    "horovod.yaml",
    "./discover_hosts.sh",
    "./discover.sh",
}

# Scripts whose flags live in the module they hand over to.
FLAGS_DEFINED_IN = {
    "examples/pytorch_synthetic_benchmark.py": "hora/tools/synthetic_benchmark.py",
}

# Deliberate mistakes the docs show, with what hora says of them (docs/environment.md).
MISSPELT_ON_PURPOSE = {"HORA_FUSION_THRESHLD"}

# Paths in this repository that a command may name as a file it reads.
REPOSITORY_PATH = re.compile(r"^(examples|benchmarks|tests|docs|hora|\.ci)/")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SEPARATORS = {";", "&", "&&", "|", "||"}
# pytest's record_property fixture: a name and a value for the JUnit report.
RecordProperty = Callable[[str, object], None]


@dataclass(frozen=True)
class DocCommand:
    """One command of the docs: ``text`` is its shell line as written (continued lines joined,
    without prompt or comment), ``words`` this command's part of it (the line may chain
    several with ``;`` or ``&&``)."""

    doc: Path
    line: int
    text: str
    words: tuple[str, ...]

    @property
    def env(self) -> dict[str, str]:
        """The ``NAME=value`` assignments before the program."""
        pairs = (word.split("=", 1) for word in self.words[: self._program_index()])
        return {name: value for name, value in pairs}

    @property
    def argv(self) -> list[str]:
        """The program and its arguments."""
        return list(self.words[self._program_index() :])

    def _program_index(self) -> int:
        index = 0
        while index < len(self.words) and ASSIGNMENT.match(self.words[index]):
            index += 1
        return index

    def __str__(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}: {self.text}"


def shell_lines(doc: Path) -> Iterator[tuple[int, str, str]]:
    """``(line number, language, logical line)`` of every line inside a fenced shell block;
    ``\\``-continued lines are joined, numbered by their first line."""
    fence: str | None = None
    language = ""
    pending: list[str] = []
    start = 0
    for number, line in enumerate(doc.read_text().splitlines(), start=1):
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence, language = match.group(1), match.group(2).lower()
            continue
        if match and match.group(1).startswith(fence) and not match.group(2):
            fence = None
            continue
        if language not in SHELL_LANGUAGES:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending.append(line.rstrip()[:-1])
            continue
        pending.append(line)
        yield start, language, " ".join(part.strip() for part in pending)
        pending = []


def _without_comment(line: str) -> str:
    """``line`` without its ``# comment`` (a ``#`` after a space, outside quotes)."""
    for match in re.finditer(r"\s#", line):
        try:
            shlex.split(line[: match.start()])
        except ValueError:
            continue  # inside quotes
        return line[: match.start()].rstrip()
    return line


def _segments(line: str) -> Iterator[list[str]]:
    """The simple commands of a shell line (split at ``;``, ``&&``, ``|``, ``&``)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = ""
    words: list[str] = []
    for token in lexer:
        if token in SEPARATORS:
            if words:
                yield words
            words = []
        else:
            words.append(token)
    if words:
        yield words


def doc_commands() -> list[DocCommand]:
    """Every command of the docs that starts with one of :data:`PROGRAMS`."""
    found = []
    for doc in DOCS:
        for number, language, line in shell_lines(doc):
            text = line.strip()
            if text.startswith("$ "):
                text = text[2:]
            elif language == "console":
                continue  # output, not a command
            text = _without_comment(text)
            try:
                segments = list(_segments(text))
            except ValueError:  # an unclosed quote: kept as one word, which no check passes
                segments = [text.split(" ", 1)]
            for words in segments:
                command = DocCommand(doc, number, text, tuple(words))
                if command.argv and command.argv[0] in PROGRAMS:
                    found.append(command)
    return found


# ---------------------------------------------------------------- checking one command


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser``'s reading of ``argv``, or AssertionError with argparse's message."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return parser.parse_args(argv)
    except SystemExit:
        raise AssertionError(" ".join(errors.getvalue().split())) from None


def _file(name: str) -> None:
    """A file a command reads: one of this repository's, or the reader's own."""
    if name in PLACEHOLDERS or name.startswith("/"):
        return
    assert REPOSITORY_PATH.match(name), (
        f"{name!r} is neither a file of this repository nor a placeholder"
    )
    assert (ROOT / name).exists(), f"{name} does not exist"


def _script_flags(script: str, args: list[str]) -> None:
    source = (ROOT / FLAGS_DEFINED_IN.get(script, script)).read_text()
    for arg in args:
        if arg.startswith("--") and len(arg) > 2:
            flag = arg.split("=", 1)[0]
            assert f'"{flag}"' in source, f"{script} defines no {flag}"


def _python(argv: list[str]) -> None:
    args = argv[1:]
    assert args, "python without a script"
    if args[0] == "-c":
        compile(args[1], "<python -c>", "exec")
    elif args[0] == "-m":
        module, rest = args[1], args[2:]
        if module == "hora":
            _hora(["hora", *rest])
        elif module == "pytest":
            for arg in rest:
                if not arg.startswith("-") and "/" in arg:
                    _file(arg.split("::")[0])
        else:
            assert importlib.util.find_spec(module) is not None, f"no module {module}"
    else:
        _file(args[0])
        if REPOSITORY_PATH.match(args[0]):
            _script_flags(args[0], args[1:])


def _hora(argv: list[str]) -> None:
    _parse(cli.build_parser(), argv[1:])


def _horarun(argv: list[str]) -> None:
    values = vars(_parse(options.build_parser(), argv[1:]))
    assert not options.refusals(values), options.refusals(values)
    if values["host_discovery_script"]:
        _file(values["host_discovery_script"])
    if values["check_build"] or values["version"]:
        return
    assert values["np"] is not None or values["min_np"] is not None, "no -np"
    command = list(values["command"])
    if command and command[0] == "--":
        command = command[1:]
    assert command, "no command to run"
    if command[0] in PROGRAMS:
        check(command)


def _dev_commands() -> set[str]:
    return set(re.findall(r"^    ([a-z]+)\)$", (ROOT / "dev").read_text(), re.MULTILINE))


def _dev(argv: list[str]) -> None:
    assert len(argv) > 1 and argv[1] in _dev_commands(), f"./dev has {sorted(_dev_commands())}"


def check(argv: list[str]) -> None:
    """Raise AssertionError, saying why, when ``argv`` is not a command hora would take."""
    {"horarun": _horarun, "hora": _hora, "./dev": _dev}.get(argv[0], _python)(argv)


# ---------------------------------------------------------------- the tests

COMMANDS = doc_commands()


def test_the_docs_have_commands_to_check(record_property: RecordProperty) -> None:
    # A change to the extraction that finds (almost) nothing would pass every check below.
    by_program = {p: sum(c.argv[0] == p for c in COMMANDS) for p in sorted(PROGRAMS)}
    print(f"docs commands checked: {len(COMMANDS)} {by_program}")
    record_property("docs_commands_checked", len(COMMANDS))
    assert len(COMMANDS) >= 80
    assert by_program["horarun"] >= 40 and by_program["hora"] >= 5 and by_program["python"] >= 10


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_command_parses(command: DocCommand) -> None:
    try:
        check(command.argv)
    except (AssertionError, SyntaxError) as err:
        raise AssertionError(f"{command}\n  {err}") from None
    for name in command.env:
        if name.startswith("HORA_"):
            assert name in _declared() | MISSPELT_ON_PURPOSE, f"{command}\n  unknown {name}"


def test_the_docs_are_written_for_pip_users() -> None:
    # `./dev` users are told once, in the README, to prefix .venv/bin/ or activate the venv.
    for command in COMMANDS:
        assert ".venv/bin/" not in command.text, command


def _declared() -> set[str]:
    return {v.env for v in settings_table.VARIABLES} | set(settings_table.SCRIPT_VARIABLES)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_variables_named_in_the_docs_exist(doc: Path) -> None:
    named = set(re.findall(r"\bHORA_[A-Z0-9_]*[A-Z0-9]\b", doc.read_text()))
    assert named - _declared() - MISSPELT_ON_PURPOSE == set()


def _extras() -> set[str]:
    """The extras of pyproject.toml (read as text: tomllib is Python 3.11's)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([a-z0-9_-]+) = \[", section, re.MULTILINE))


@pytest.mark.parametrize("path", DOCS + EXAMPLES, ids=lambda p: p.name)
def test_extras_named_exist(path: Path) -> None:
    for extras in re.findall(r"hora\[([^\]]*)\]", path.read_text()):
        assert set(extras.split(",")) <= _extras(), f"{path.name}: hora[{extras}]"


def test_examples_hint_their_extras_alike() -> None:
    # Every example that needs an extra says so in the same words, with the same quoting.
    hint = re.compile(
        r'needs \{missing\.name\}, which is not installed: "\n\s+"pip install \'hora\[[a-z,]+\]\'"'
    )
    needing = [
        p
        for p in EXAMPLES
        if re.search(r"^\s*(import|from) (sklearn|tensorflow|lightning|ray)\b", p.read_text(), re.M)
    ]
    assert len(needing) >= 6
    for path in needing:
        text = path.read_text()
        assert hint.search(text), f"{path.name} imports an extra's package without the hint"
        assert 'install "hora[' not in text, path.name


# GitHub's anchors: headings lower-cased, punctuation dropped, spaces as hyphens, -1, -2, ...
# for repeats.
def _anchors(doc: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fence = False
    for line in doc.read_text().splitlines():
        if FENCE.match(line):
            fence = not fence
        heading = None if fence else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(doc: Path) -> Iterator[str]:
    text = re.sub(r"^\s*```.*?^\s*```", "", doc.read_text(), flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    yield from re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_and_anchors_resolve(doc: Path) -> None:
    broken = []
    for target in _links(doc):
        if re.match(r"^[a-z][a-z+.-]*:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{doc.name}: {broken}"
