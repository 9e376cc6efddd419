"""Files hora creates cannot be redirected by a link another user planted, and are private.

The attacker is uid ``nobody``: its links are made here and handed to it with ``lchown``, which
is what planting them itself would leave behind. The victim is this process (root in CI, which
may replace another user's file in a sticky directory) and, where the test needs an ordinary
user's view, a second process running as another uid.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import hora
from hora.common.job import port_file
from hora.common.vocabulary import safe_files
from hora.common.vocabulary.config import SettingError
from hora.common.vocabulary.timeline_writer import Timeline, merge

NOBODY = 65534
# The victim of the test run as an ordinary user: any uid other than nobody's and root's.
VICTIM = 4242
SECRET = "s" * 64
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as other users needs root")


@pytest.fixture
def reachable() -> Iterator[Path]:
    """A directory every user can reach (pytest's own are its user's alone)."""
    base = Path(tempfile.mkdtemp(prefix="hora-safe-files-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def shared(reachable: Path) -> Path:
    """A directory like /tmp: everyone may write, only owners may remove (mode 1777)."""
    directory = reachable / "shared"
    directory.mkdir()
    directory.chmod(0o1777)
    return directory


@pytest.fixture
def precious(reachable: Path) -> Path:
    """A file of the victim's that the attacker wants overwritten."""
    path = reachable / "precious"
    path.write_text("keep me\n")
    return path


def plant(link: Path, target: Path, uid: int = NOBODY) -> None:
    """A symbolic link at ``link`` to ``target``, owned by ``uid``."""
    link.symlink_to(target)
    os.lchown(link, uid, uid)


# ---------------------------------------------------------------- as this process


@as_root
@pytest.mark.parametrize(
    "write",
    [
        lambda path: safe_files.write(path, "data\n"),
        lambda path: safe_files.create(path).write("data\n"),
        lambda path: port_file.publish(path, "job", SECRET, 1234),
        lambda path: Timeline(path, 0).close(),
    ],
    ids=["write", "create", "port file", "timeline"],
)
def test_a_planted_link_is_replaced_never_written_through(
    shared: Path, precious: Path, write: Callable[[Path], None]
) -> None:
    name = shared / "out"
    plant(name, precious)
    write(name)
    assert precious.read_text() == "keep me\n"
    info = os.lstat(name)
    assert stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert [p.name for p in shared.iterdir()] == ["out"]  # no temporary left behind


def test_files_are_private_unless_hora_file_mode_says_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    os.umask(0o022)
    safe_files.write(tmp_path / "a", b"x")
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o600
    monkeypatch.setenv("HORA_FILE_MODE", "0640")
    with safe_files.create(tmp_path / "b") as out:
        out.write("x")
    assert stat.S_IMODE(os.stat(tmp_path / "b").st_mode) == 0o640
    monkeypatch.setenv("HORA_FILE_MODE", "rw-r--r--")
    with pytest.raises(SettingError, match="HORA_FILE_MODE must be octal permission bits"):
        safe_files.write(tmp_path / "c", b"x")
    monkeypatch.setenv("HORA_FILE_MODE", "1777")
    with pytest.raises(SettingError, match="HORA_FILE_MODE"):
        safe_files.file_mode()


def test_directories_hora_creates_are_private_and_a_failed_write_changes_nothing(
    tmp_path: Path,
) -> None:
    target = tmp_path / "new" / "deeper" / "file"
    safe_files.write(target, "old")
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "deeper").st_mode) == 0o700
    with pytest.raises(RuntimeError, match="half way"), safe_files.replacing(target) as out:
        out.write(b"new")
        raise RuntimeError("half way")
    assert target.read_text() == "old"
    assert sorted(p.name for p in target.parent.iterdir()) == ["file"]


@as_root
def test_a_directory_of_another_user_or_reached_through_their_link_is_refused(
    shared: Path, tmp_path: Path
) -> None:
    theirs = shared / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(safe_files.UnsafePathError, match=r"belongs to uid 65534, not to this user"):
        safe_files.write(theirs / "timeline.json", "x")
    mine = tmp_path / "mine"
    mine.mkdir()
    plant(shared / "logs", mine)
    with pytest.raises(safe_files.UnsafePathError, match="is a symbolic link that belongs to uid"):
        safe_files.make_directories(shared / "logs" / "rank.0")
    assert list(mine.iterdir()) == []


@as_root
def test_merging_a_timeline_ignores_files_another_user_put_beside_it(shared: Path) -> None:
    path = shared / "timeline.json"
    for rank in (0, 1):
        timeline = Timeline(path, rank)
        timeline.close()
    forged = shared / "timeline.rank2.json"
    forged.write_text('[\n{"name": "forged", "ph": "X", "pid": 2, "ts": 1, "dur": 1},\n')
    os.chown(forged, NOBODY, NOBODY)
    assert merge(path)
    merged = json.loads(path.read_text())
    assert {event.get("pid") for event in merged} == {0, 1}
    assert forged.exists()  # not this user's to remove


# ---------------------------------------------------------------- as an ordinary user

VICTIM_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from hora.common.vocabulary import safe_files
from hora.common.job import port_file

out = {}
for name, write in [
    ("write", lambda p: safe_files.write(p, "data")),
    ("create", lambda p: safe_files.create(p).close()),
    ("port file", lambda p: port_file.publish(__import__("pathlib").Path(p), "j", "s" * 64, 1)),
]:
    try:
        write(sys.argv[2])
        out[name] = "written"
    except safe_files.UnsafePathError as exc:
        out[name] = str(exc)
print(json.dumps(out))
"""


@as_root
def test_an_ordinary_user_is_told_why_a_planted_name_cannot_be_written(
    shared: Path, precious: Path, reachable: Path
) -> None:
    """Unlike root, an ordinary user cannot replace another user's link in a sticky
    directory: the write is refused with what to do, and nothing is written through it."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 for the victim user")
    code = reachable / "code"
    shutil.copytree(Path(hora.__file__).parent, code / "hora")
    for path in [code, *code.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    precious.chmod(0o666)  # the victim could write it, if it followed the link
    name = shared / "timeline.json"
    plant(name, precious)
    done = subprocess.run(
        [python, "-c", VICTIM_SCRIPT, str(code), str(name)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        user=VICTIM,
        group=VICTIM,
        extra_groups=[],
    )
    assert done.returncode == 0, done.stderr
    for message in json.loads(done.stdout).values():
        assert "a file of that name that belongs to uid 65534 is already there" in message
        assert "write to a directory only you can write" in message
    assert precious.read_text() == "keep me\n"
    assert os.readlink(name) == str(precious)
    assert [p.name for p in shared.iterdir()] == ["timeline.json"]


def test_a_tool_output_path_through_a_link_is_replaced(tmp_path: Path) -> None:
    """What `hora timeline merge -o` and the scaling study write goes through the same door."""
    from hora.tools.scaling_table import write_csv

    elsewhere = tmp_path / "elsewhere.csv"
    elsewhere.write_text("mine\n")
    link = tmp_path / "table.csv"
    link.symlink_to(elsewhere)
    write_csv([], link)
    assert elsewhere.read_text() == "mine\n"
    assert not link.is_symlink() and link.read_text().startswith("model,")
