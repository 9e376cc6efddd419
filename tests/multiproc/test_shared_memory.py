"""The shared-memory path for ranks of one host: every collective and dtype gives what the Gloo
path gives (bitwise for integer sums), a lost rank is reported as on Gloo, segments are the job
user's alone and nothing is left in /dev/shm, and a /dev/shm without room falls back to Gloo.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hora.common.transport import shm_segment
from hora.common.transport.shm_segment import Segment
from tests.processes import needs_root, nobody_python, run_as_nobody

from .jobs import run_failing_job, run_job

GLOO = {"HORA_SHARED_MEMORY": "0"}
# Small slots make every collective run in many chunks.
SMALL_SLOTS = {"HORA_SHM_SLOT_BYTES": str(1 << 16)}

pytestmark = pytest.mark.skipif(
    shm_segment.supported() is not None, reason=f"no shared-memory path: {shm_segment.supported()}"
)

HALF_TOLERANCE = {
    torch.float16: {"rtol": 4e-3, "atol": 1e-3},
    torch.bfloat16: {"rtol": 3e-2, "atol": 1e-2},
}
DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8"]


def _every_collective() -> dict[str, Any]:
    import torch

    import hora.torch as hvd
    from hora.common import basics

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict[str, Any] = {"path": basics.data_path(), "negotiation": basics.negotiation_path()}
    for name in DTYPES:
        dtype = getattr(torch, name)
        big = (torch.arange(100_003) % 97 + rank).to(dtype)
        if dtype.is_floating_point:
            big = big / 7
        out[f"allreduce.{name}"] = hvd.allreduce(big, op=hvd.Sum, name=f"s.{name}")
        if dtype.is_floating_point:
            out[f"average.{name}"] = hvd.allreduce(big, name=f"a.{name}")
        out[f"min.{name}"] = hvd.allreduce(big, op=hvd.Min, name=f"mn.{name}")
        out[f"max.{name}"] = hvd.allreduce(big, op=hvd.Max, name=f"mx.{name}")
        rows = torch.full((rank + 2, 3), rank + 1).to(dtype)
        out[f"allgather.{name}"] = hvd.allgather(rows, name=f"g.{name}")
        out[f"broadcast.{name}"] = hvd.broadcast(big, root_rank=size - 1, name=f"b.{name}")
        split = (torch.arange(size * 5 * 2) + 10 * rank).to(dtype).reshape(size * 5, 2)
        out[f"alltoall.{name}"] = hvd.alltoall(split, name=f"t.{name}")
        out[f"reducescatter.{name}"] = hvd.reducescatter(
            (torch.arange(size * 4 + 1) + rank).to(dtype), op=hvd.Sum, name=f"r.{name}"
        )
    out["grouped"] = hvd.grouped_allreduce(
        [torch.full((n,), float(rank + 1)) for n in (1, 1000, 70_000)], op=hvd.Sum
    )
    out["objects"] = hvd.allgather_object({"rank": rank, "pad": "x" * (rank * 5000)})
    uneven = torch.arange(3 * size + rank, dtype=torch.float32)
    splits = [1 + (rank + j) % 3 for j in range(size)]
    out["alltoall.uneven"] = hvd.alltoall(uneven[: sum(splits)], splits=splits)
    hvd.barrier()
    hvd.shutdown()
    return out


def _compare(shm: list[dict[str, Any]], gloo: list[dict[str, Any]]) -> None:
    for rank, (mine, reference) in enumerate(zip(shm, gloo)):
        assert set(mine) == set(reference)
        for key, value in mine.items():
            if key in ("path", "negotiation"):
                continue
            expected = reference[key]
            pairs = (
                zip(value, expected) if isinstance(value, (list, tuple)) else [(value, expected)]
            )
            for got, want in pairs:
                if isinstance(got, torch.Tensor):
                    if got.is_floating_point():
                        # Summed in another order than Gloo's ring: a few units of the last
                        # place apart in half precision.
                        tolerance = HALF_TOLERANCE.get(got.dtype, {})
                        torch.testing.assert_close(got, want, msg=f"rank {rank} {key}", **tolerance)
                    else:
                        assert torch.equal(got, want), f"rank {rank} {key}"
                else:
                    assert got == want, f"rank {rank} {key}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_every_collective_and_dtype_matches_the_gloo_path(np: int) -> None:
    shm = run_job(_every_collective, np, env=SMALL_SLOTS, timeout_s=200)
    gloo = run_job(_every_collective, np, env=GLOO, timeout_s=200)
    assert {r["path"] for r in shm} == {"shm"} and {r["negotiation"] for r in shm} == {"shm"}
    assert {r["path"] for r in gloo} == {"gloo"}
    _compare(shm, gloo)


def _sums_twice() -> list[float]:
    import torch

    import hora.torch as hvd

    hvd.init()
    values = torch.randn(1_000_003, generator=torch.Generator().manual_seed(hvd.rank()))
    first = hvd.allreduce(values, op=hvd.Sum, name="one")
    second = hvd.allreduce(values, op=hvd.Sum, name="two")
    hvd.shutdown()
    return [float(first.double().sum()), float(second.double().sum()), float(first[7])]


@pytest.mark.timeout(120)
def test_float_sums_are_deterministic_and_equal_on_every_rank() -> None:
    first = run_job(_sums_twice, 3)
    again = run_job(_sums_twice, 3)
    assert first == again
    assert len({tuple(r) for r in first}) == 1
    assert first[0][0] == first[0][1]


def _dies_in_a_collective() -> str:
    import os
    import signal

    import torch

    import hora.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(10), name="warm")
    if hvd.rank() == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        hvd.allreduce(torch.ones(1 << 20), name="never")
    except hvd.HorovodInternalError as exc:
        return f"{time.monotonic() - started:.2f} {exc}"
    return "no error"


@pytest.mark.timeout(120)
def test_a_rank_killed_in_a_collective_is_reported_at_once() -> None:
    error = run_failing_job(_dies_in_a_collective, 2)
    text = error.results.get(0, "")
    assert text != "no error", error
    seconds = float(text.split()[0])
    assert seconds < 10.0, text
    assert "rank 1" in text, text


@pytest.mark.timeout(120)
def test_a_dev_shm_without_room_falls_back_to_gloo_and_says_why(
    capfd: pytest.CaptureFixture[str],
) -> None:
    free = os.statvfs("/dev/shm")
    too_big = free.f_bavail * free.f_frsize + (1 << 30)
    results = run_job(_every_path, 2, env={"HORA_SHM_SLOT_BYTES": str(too_big)})
    assert results == [("gloo", 6.0)] * 2
    err = capfd.readouterr().err
    assert "shared memory is not used" in err and "has no room for" in err, err[-2000:]
    assert "HORA_SHM_SLOT_BYTES" in err


def _every_path() -> tuple[str, float]:
    import torch

    import hora.torch as hvd
    from hora.common import basics

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]) * 2, op=hvd.Sum).item()
    path = basics.data_path()
    hvd.shutdown()
    return path, total


def _segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("hora-")}


@pytest.mark.timeout(120)
def test_no_segment_is_left_in_dev_shm_and_a_killed_makers_is_swept() -> None:
    before = _segments()
    assert run_job(_every_path, 3) == [("shm", 12.0)] * 3
    assert _segments() == before  # unlinked as soon as every member mapped it
    # A process killed between making a segment and the others' attaching leaves its name.
    maker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; sys.path.insert(0, sys.argv[1]); "
            "from hora.common.transport.shm_segment import Segment; "
            "s = Segment.create('stale-test', 2, 1 << 16); print(s.file.name, flush=True); "
            "time.sleep(60)",
            str(Path(__file__).resolve().parents[2]),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert maker.stdout is not None
    name = maker.stdout.readline().strip()
    os.kill(maker.pid, signal.SIGKILL)
    maker.wait()
    assert name in _segments()
    run_job(_every_path, 2)  # the next segment's maker sweeps what dead makers left
    assert name not in _segments()


@pytest.mark.timeout(60)
@needs_root
def test_another_user_cannot_open_a_segment() -> None:
    segment = Segment.create("other-user-test", 2, 1 << 16)
    try:
        assert os.stat(segment.path).st_mode & 0o777 == 0o600
        done = run_as_nobody(
            [nobody_python(), "-c", f"open({segment.path!r}, 'r+b')"],
            capture_output=True,
            timeout=30,
        )
        assert done.returncode != 0 and "PermissionError" in done.stderr, done.stderr
    finally:
        segment.unlink()
        segment.close()


def _timeline_paths(path: str) -> None:
    import torch

    import hora.torch as hvd

    hvd.init()
    hvd.start_timeline(path)
    for step in range(3):
        # Asynchronous: the engine runs it (a synchronous call may run on the fast path).
        hvd.synchronize(hvd.allreduce_async(torch.ones(100_000), name=f"x{step}"))
        hvd.allreduce(torch.ones(10), name=f"s{step}")
        hvd.allgather(torch.ones(3), name=f"g{step}")
    hvd.stop_timeline()
    hvd.shutdown()


@pytest.mark.timeout(120)
def test_the_timeline_says_which_path_each_collective_took(tmp_path: Path) -> None:
    import json

    target = tmp_path / "timeline.json"
    run_job(_timeline_paths, 2, str(target))
    events = json.loads(target.read_text())
    paths = {
        (e["name"], e["args"].get("path"))
        for e in events
        if e.get("ph") == "X" and e["name"] in ("ALLREDUCE", "ALLGATHER")
    }
    assert ("ALLREDUCE", "shm") in paths and ("ALLGATHER", "shm") in paths, paths
    # The small synchronous allreduces: the lane when the fast path runs them, else carried in
    # negotiation's exchange.
    small = {("ALLREDUCE", "lane"), ("ALLREDUCE", "exchange")}
    assert paths - {("ALLREDUCE", "shm"), ("ALLGATHER", "shm")} <= small, paths


def test_wrapping_counters_compare_in_order() -> None:
    reached = shm_segment.reached
    assert reached(5, 5) and reached(6, 5) and not reached(4, 5)
    top = (1 << 31) - 1
    assert reached(0, top) and not reached(top, 0)  # 0 follows 2**31 - 1


def test_the_launcher_reads_the_creator_where_segments_write_it() -> None:
    from hora.common.job import shm_names

    segment = Segment.create("layout-test", 2, 1 << 16)
    try:
        with open(segment.path, "rb") as handle:
            header = handle.read(shm_names.LINE * 2)
        creator = int.from_bytes(
            header[shm_names.CREATOR_OFFSET : shm_names.CREATOR_OFFSET + 4], "little"
        )
        assert creator == os.getpid()
        assert not shm_names.leftover(segment.path)
    finally:
        segment.unlink()
        segment.close()


LEAVES_A_SEGMENT = """
import os, signal
from hora.common.transport.shm_segment import Segment

segment = Segment.create(os.environ["HORA_SECRET_KEY"], 2, 1 << 16)
print("made " + segment.file.name, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(120)
def test_horarun_removes_what_a_killed_worker_left(tmp_path: Path) -> None:
    script = tmp_path / "maker.py"
    script.write_text(LEAVES_A_SEGMENT)
    done = subprocess.run(
        [sys.executable, "-m", "hora.runner.launch", "-np", "1", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode != 0, done.stdout
    made = [line.split("made ", 1)[1] for line in done.stdout.splitlines() if "made " in line]
    assert made, done.stdout + done.stderr
    assert made[0] not in _segments()


def _mixed_placements() -> dict[str, Any]:
    import gc

    import torch

    import hora.torch as hvd
    from hora.common import basics
    from hora.common.vocabulary.message import ReduceOp

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    comm: Any = basics.engine()._communicators.of_set(0)
    out: dict[str, Any] = {"path": comm.path}
    expected = sum(range(1, size + 1)) * torch.arange(300_000, dtype=torch.float64)
    # Where each member's data lies: all in their arenas, none, or only some (every member then
    # takes the slots' way); each case twice, so that a second call finds its staging block.
    for case in ("all", "none", "rank 0 only", "all", "rank 0 only"):
        in_arena = case == "all" or (case == "rank 0 only" and rank == 0)
        buffer = comm.arena_buffer(300_000, torch.float64) if in_arena else None
        if buffer is None:
            buffer = torch.empty(300_000, dtype=torch.float64)
        buffer.copy_((rank + 1) * torch.arange(300_000, dtype=torch.float64))
        comm.allreduce(buffer, ReduceOp.SUM)
        out[case] = bool(torch.equal(buffer, expected))
        del buffer
    # A buffer nothing refers to any more goes back to the arena: the next one takes its place,
    # while one a view still refers to keeps its own.
    first = comm.arena_buffer(1 << 20, torch.uint8)
    place = first.data_ptr()
    view = first[10:20]
    del first
    gc.collect()
    second = comm.arena_buffer(1 << 20, torch.uint8)
    out["kept while viewed"] = second.data_ptr() != place
    del view, second
    gc.collect()
    out["given back"] = comm.arena_buffer(1 << 20, torch.uint8).data_ptr() == place
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_members_whose_data_lies_in_different_places_reduce_alike(np: int) -> None:
    for result in run_job(_mixed_placements, np):
        assert result["path"] == "shm"
        assert all(result[case] for case in ("all", "none", "rank 0 only")), result
        assert result["kept while viewed"] and result["given back"], result
