"""Another user against the shared-memory path: a segment belongs to its job provably, sweeps
cannot be blocked, a killed creator's leftovers go, and squatted names change nothing.

The attacker is uid ``nobody`` (so these tests need root, as CI has). The job-level attacks run
inside a private mount namespace whose ``/dev/shm`` is a tmpfs of its own, with the sticky bit
(an ordinary host) and without it (a Kubernetes ``emptyDir``); see ``shm_scenarios.py``. The
segment-level checks run in this host's ``/dev/shm``.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from hora.common.job import shm_names
from hora.common.transport import shm_segment
from hora.common.transport.shm_segment import Segment, SegmentError, SegmentFile
from tests.processes import NOBODY, needs_root

ROOT = Path(__file__).resolve().parents[2]
SECRET = "attack-test-secret-0123456789abcdef"

pytestmark = [
    needs_root,
    pytest.mark.skipif(
        shm_segment.supported() is not None, reason=f"no shared memory: {shm_segment.supported()}"
    ),
]


@functools.cache
def _namespaces_work() -> bool:
    """Whether this machine lets the tests make a private mount namespace (asked once)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         "mount -t tmpfs -o mode=0777 hora-probe /dev/shm"],
        capture_output=True, timeout=30,
    )  # fmt: skip
    return probe.returncode == 0


def in_namespace(scenario: str, sticky: bool) -> dict[str, Any]:
    """Run ``scenario`` of shm_scenarios.py with a private tmpfs ``/dev/shm`` (mode 1777 or
    0777); what it saw."""
    if not _namespaces_work():
        pytest.skip("no private mount namespace here (unshare -m, mount tmpfs)")
    mode = "1777" if sticky else "0777"
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "out.json"
        script = (
            f"mount -t tmpfs -o mode={mode},size=2g hora-test /dev/shm && "
            'exec "$0" -m tests.multiproc.shm_scenarios "$1" "$2"'
        )
        done = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script,
             sys.executable, scenario, str(out)],
            capture_output=True, text=True, timeout=280, cwd=ROOT,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        result: dict[str, Any] = json.loads(out.read_text())
        result["stderr"] = done.stderr
        return result


# ------------------------------------------------------------------ jobs under attack


@pytest.mark.timeout(300)
def test_renaming_segments_between_jobs_never_gives_a_wrong_value() -> None:
    """Without the sticky bit anyone may rename any file in /dev/shm: 20 jobs while nobody
    renames every hora name over every other; segments live in private directories, and an
    attacher proves it has its creator's file, so no value is ever wrong."""
    seen = in_namespace("swap", sticky=False)
    assert seen["failures"] == [], seen["failures"]
    assert seen["runs"] == 20 and seen["wrong"] == 0, seen
    assert seen["renames"] > 0, seen  # the attacker did reach the jobs' names
    assert "lacks the sticky bit" in seen["stderr"] and "private directories" in seen["stderr"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sticky", [True, False], ids=["sticky", "not-sticky"])
def test_fifos_and_links_named_hora_neither_block_nor_fail_a_job(sticky: bool) -> None:
    seen = in_namespace("fifo", sticky=sticky)
    assert [r["wrong"] for r in seen["job"]] == [0, 0] and seen["job"][0]["path"] == "shm", seen
    assert seen["job_s"] < 30, seen
    assert seen["horarun_rc"] == 0, seen["horarun_out"]
    assert seen["horarun_s"] < 45, seen  # horarun's sweep at the end does not wait on a FIFO
    # Nothing of another user's was removed; nothing of the jobs' is left.
    assert set(seen["left"]) >= {"hora-fifo", "hora-link", "hora-x-dir"}, seen["left"]
    assert all(
        n.startswith(("hora-fifo", "hora-link", "hora-x-dir", "hora-0000")) or "fifo" in n
        for n in seen["left"]
    ), seen["left"]


@pytest.mark.timeout(300)
def test_a_killed_creators_leftovers_are_removed_by_the_next_job() -> None:
    seen = in_namespace("leftovers", sticky=True)
    assert "hora-0123456789abcdef-headerless-old" in seen["before"], seen
    assert seen["after"] == ["hora-0123456789abcdef-headerless-fresh"], seen
    assert [r["wrong"] for r in seen["job"]] == [0, 0], seen


@pytest.mark.timeout(300)
def test_names_squatted_after_a_run_with_the_same_secret_change_nothing() -> None:
    """torchrun jobs share HORA_SECRET_KEY from run to run; every segment name is new anyway."""
    seen = in_namespace("squat", sticky=True)
    first, second = seen["runs"]
    assert all(r["path"] == "shm" and r["sum"] == 2.0 for r in first + second), seen
    old = {n for r in first for n in r["names"]}
    new = {n for r in second for n in r["names"]}
    assert old and new and not old & new, seen
    assert set(seen["squatted"]) >= old  # nobody's files are still there, untouched


# ------------------------------------------------------------------ a segment's own checks


@pytest.fixture
def made() -> Any:
    segments: list[Segment] = []

    def make() -> Segment:
        segments.append(Segment.create(SECRET, 2, 1 << 16))
        return segments[-1]

    yield make
    for segment in segments:
        segment.close()
    prefix = shm_names.job_prefix(SECRET)
    for name in os.listdir(shm_names.SHM_DIR):
        if name.startswith(prefix):
            os.unlink(os.path.join(shm_names.SHM_DIR, name))


def test_every_segment_gets_a_new_name_and_carries_its_nonce(made: Any) -> None:
    first, second = made(), made()
    assert first.file.name != second.file.name
    prefix = shm_names.job_prefix(SECRET)
    assert first.file.name.startswith(prefix) and second.file.name.startswith(prefix)
    with open(first.path, "rb") as handle:
        header = handle.read(shm_names.LINE)
    assert shm_names.nonce_of(first.file.name) in header
    assert os.stat(first.path).st_mode & 0o777 == 0o600


def test_a_segment_renamed_over_another_jobs_name_is_refused(made: Any) -> None:
    """The attack that gave wrong values: job X's live segment renamed over job Y's name."""
    x, y = made(), made()
    attached = Segment.attach(x.file, 1, 2, 1 << 16)
    attached.close()
    os.rename(x.path, y.path)
    with pytest.raises(SegmentError, match="is not the segment its creator made: it is another"):
        Segment.attach(y.file, 1, 2, 1 << 16)


def test_a_file_of_another_user_under_the_name_is_refused_naming_its_owner(made: Any) -> None:
    segment = made()
    os.unlink(segment.path)
    with open(segment.path, "wb") as handle:
        handle.write(bytes(shm_segment.total_bytes(2, 1 << 16)))
    os.chown(segment.path, NOBODY, NOBODY)
    with pytest.raises(SegmentError, match=r"a file of nobody \(uid 65534\)"):
        Segment.attach(segment.file, 1, 2, 1 << 16)


def test_a_fifo_under_the_name_is_refused_at_once(made: Any) -> None:
    segment = made()
    os.unlink(segment.path)
    os.mkfifo(segment.path)
    started = time.monotonic()
    with pytest.raises(SegmentError, match="a FIFO"):
        Segment.attach(segment.file, 1, 2, 1 << 16)
    assert time.monotonic() - started < 5


def test_a_forged_description_cannot_point_outside_dev_shm() -> None:
    forged = json.dumps(
        {"directory": "..", "name": "etc", "device": 1, "inode": 1, "directory_inode": 1}
    )
    with pytest.raises(SegmentError, match="not hora's"):
        SegmentFile.from_json(forged)


def test_a_sweep_skips_what_is_not_this_users_regular_file() -> None:
    """A FIFO is never opened (the sweep would wait for a writer), nor is a link followed."""
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o1777)
        fifo, link = Path(folder, "hora-a-fifo"), Path(folder, "hora-a-link")
        os.mkfifo(fifo)
        target = Path(folder, "target")
        target.write_bytes(bytes(256))
        os.utime(target, (0, 0))
        link.symlink_to(target)
        old = Path(folder, "hora-old")
        old.write_bytes(bytes(256))
        os.utime(old, (0, 0))
        theirs = Path(folder, "hora-theirs")
        theirs.write_bytes(bytes(256))
        os.utime(theirs, (0, 0))
        os.chown(theirs, NOBODY, NOBODY)
        started = time.monotonic()
        removed = shm_names.sweep(directory=folder)
        assert time.monotonic() - started < 5
        assert removed == [str(old)]
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and link.is_symlink() and theirs.exists()
