"""The fast path (synchronous calls run on the caller's thread, on shared memory) on real
processes: the same bits as the engine's path (``HORA_FAST_PATH=0``), the same errors, no wait
when ranks make a call synchronously on one and asynchronously on another or in different
orders, and joins and new sessions that fall back and stay right.
"""

from __future__ import annotations

from typing import Any

import pytest

from hora.common.transport import shm_segment

from .jobs import error_of, run_job
from .test_failures import _stalled_worker

FULL_PATH = {"HORA_FAST_PATH": "0"}
FAST = {"HORA_FAST_PATH": "1"}  # the default, said explicitly
STALL_ENV = {
    **FAST,
    "HORA_STALL_CHECK_TIME_SECONDS": "1",
    "HORA_STALL_SHUTDOWN_TIME_SECONDS": "3",
}

pytestmark = pytest.mark.skipif(
    shm_segment.supported() is not None, reason=f"no shared-memory path: {shm_segment.supported()}"
)


def _inline_calls() -> int:
    from hora.common import basics

    lane = basics.engine().lane(0)
    return int(getattr(lane, "inline_calls", 0))


def _mixed_run(count: int, seed: int) -> dict[str, Any]:
    """``count`` calls of mixed kinds, sizes, dtypes, reductions and names, the same sequence
    on every rank (some asynchronous); a digest of every result."""
    import hashlib
    import random

    import torch

    import hora.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    plan = random.Random(seed)
    data = torch.Generator().manual_seed(seed * 100 + rank)
    digest = hashlib.sha256()
    pending: list[int] = []
    sizes = (1, 3, 257, 16384, 70_000, 300_001, 700_000)
    dtypes = (torch.float32, torch.float64, torch.int32, torch.int64)
    for index in range(count):
        kind = plan.random()
        numel = plan.choice(sizes) if plan.random() < 0.3 else plan.choice(sizes[:4])
        dtype = plan.choice(dtypes)
        name = plan.choice([None, "a", "b", f"n{index % 7}"])
        tensor = (torch.rand(numel, generator=data) * 100 - 50).to(dtype)
        if kind < 0.55:
            ops = [hvd.Sum, hvd.Min, hvd.Max] + ([hvd.Average] if dtype.is_floating_point else [])
            op = plan.choice(ops)
            scales = (plan.choice([1.0, 0.5, 3.0]), plan.choice([1.0, 0.25]))
            if not dtype.is_floating_point:
                scales = (1.0, 1.0)
            result = hvd.allreduce(tensor, name=name, op=op, prescale_factor=scales[0],
                                   postscale_factor=scales[1])  # fmt: skip
            digest.update(result.numpy().tobytes())
        elif kind < 0.7:
            tensors = [
                tensor[: max(1, numel // (j + 1))].clone() for j in range(plan.randint(2, 5))
            ]
            for result in hvd.grouped_allreduce(tensors, name=name, op=hvd.Sum):
                digest.update(result.numpy().tobytes())
        elif kind < 0.8:
            root = plan.randrange(size)
            digest.update(hvd.broadcast(tensor, root_rank=root, name=name).numpy().tobytes())
        elif kind < 0.85:
            hvd.barrier()
        elif kind < 0.95:
            # The engine's path: a number on the lane, the result later.
            pending.append(hvd.allreduce_async(tensor, name=f"async.{index}", op=hvd.Sum))
            if len(pending) > 3 or plan.random() < 0.3:
                digest.update(hvd.synchronize(pending.pop(0)).numpy().tobytes())
        else:
            digest.update(hvd.allgather(tensor[:5], name=name).numpy().tobytes())
    for handle in pending:
        digest.update(hvd.synchronize(handle).numpy().tobytes())
    inline = _inline_calls()
    hvd.shutdown()
    return {"digest": digest.hexdigest(), "inline": inline}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_mixed_calls_give_the_full_paths_bits(np: int) -> None:
    fast = run_job(_mixed_run, np, 600, np, env=FAST, timeout_s=200)
    full = run_job(_mixed_run, np, 600, np, env=FULL_PATH, timeout_s=200)
    assert [r["digest"] for r in fast] == [r["digest"] for r in full]
    assert len({r["digest"] for r in fast}) <= np  # broadcasts/allreduces agree per rank
    assert all(r["inline"] > 100 for r in fast), fast
    assert all(r["inline"] == 0 for r in full), full


@pytest.mark.timeout(600)
def test_a_long_mixed_run_gives_the_full_paths_bits() -> None:
    fast = run_job(_mixed_run, 2, 10_000, 7, env=FAST, timeout_s=500)
    full = run_job(_mixed_run, 2, 10_000, 7, env=FULL_PATH, timeout_s=500)
    assert [r["digest"] for r in fast] == [r["digest"] for r in full]
    assert all(r["inline"] > 3000 for r in fast), fast


def _counted() -> dict[str, Any]:
    """What live metrics count for a few synchronous calls: allreduces of two sizes, a
    grouped allreduce and a broadcast."""
    import torch

    import hora.torch as hvd
    from hora.common import basics

    hvd.init()
    counters = basics.engine().counters
    hvd.barrier()
    before, _ = counters.take()
    inline_before = _inline_calls()
    hvd.allreduce(torch.ones(10), name="small")
    hvd.allreduce(torch.ones(300_000, dtype=torch.float64), name="large", op=hvd.Sum)
    hvd.grouped_allreduce([torch.ones(3), torch.ones(5), torch.ones(7)], name="group")
    hvd.broadcast(torch.ones(4), root_rank=0, name="bcast")
    after, intervals = counters.take()
    inline = _inline_calls() - inline_before
    hvd.shutdown()
    return {
        "batches": after.batches - before.batches,
        "tensors": after.tensors - before.tensors,
        "bytes": after.reduced_bytes - before.reduced_bytes,
        "intervals": len(intervals),
        "inline": inline,
    }


@pytest.mark.parametrize("np", [2, 3])
def test_live_metrics_count_fast_path_calls_as_the_engine_counts_them(np: int) -> None:
    fast = run_job(_counted, np, env=FAST)
    full = run_job(_counted, np, env=FULL_PATH)
    expected_bytes = 10 * 4 + 300_000 * 8 + 15 * 4
    for counted in fast + full:
        assert counted["bytes"] == expected_bytes, counted
        assert counted["tensors"] == 1 + 1 + 3 + 1, counted
    # A call that waited too long for a peer (a loaded machine) goes to the engine, which
    # counts it as a batch of its own; so may the barrier before them, if the engine's thread
    # counts it after the barrier returned. Each call counts once at least.
    assert all(r["inline"] >= 1 for r in fast), fast
    assert all(r["batches"] >= 4 for r in fast), fast
    assert all(r["intervals"] >= r["inline"] for r in fast), fast
    assert all(r["inline"] == 0 for r in full), full


def _signed_alike() -> bool:
    """Whether every member signed its last signed call alike, once all made it and before any
    signs another (allgathers, which the lane leaves to the engine unsigned, line them up)."""
    import torch

    import hora.torch as hvd
    from hora.common import basics

    hvd.allgather(torch.ones(1))
    lane = basics.engine().lane(0)
    alike = len({lane.signed(m) for m in range(hvd.size())}) == 1  # type: ignore[union-attr]
    hvd.allgather(torch.ones(1))
    return alike


def _direct_beside_general() -> dict[str, Any]:
    """Small synchronous allreduces that one rank makes through the direct path and another
    through the general one (a tensor that requires a gradient, an inference tensor written
    outside inference mode), and calls the direct path leaves to the engine."""
    import torch

    import hora.torch as hvd

    hvd.init()
    rank = hvd.rank()
    values, alike = [], []
    # Rank 0's tensor requires a gradient: autograd's path; the others' take the direct one.
    grad = torch.full((3,), float(rank + 1), requires_grad=rank == 0)
    values.append(hvd.allreduce(grad, op=hvd.Sum, name="grad").detach().tolist())
    alike.append(_signed_alike())
    with torch.inference_mode():
        frozen = torch.full((2,), float(rank))
    if rank == 1:  # only inference mode may write it: the general path enters it
        values.append(hvd.allreduce_(frozen, op=hvd.Max).tolist())
    else:
        with torch.inference_mode():
            values.append(hvd.allreduce_(frozen, op=hvd.Max).tolist())
    alike.append(_signed_alike())
    scaled = torch.arange(4, dtype=torch.int32) + rank
    values.append(hvd.allreduce(scaled, prescale_factor=2, postscale_factor=3, op=hvd.Sum).tolist())
    values.append(hvd.allreduce(torch.tensor(float(rank)), name="scalar").tolist())
    # Asynchronous (signed ahead) on rank 0, synchronous elsewhere.
    late = torch.ones(5) * (rank + 1)
    if rank == 0:
        values.append(hvd.synchronize(hvd.allreduce_async(late, name="late", op=hvd.Sum)).tolist())
    else:
        values.append(hvd.allreduce(late, name="late", op=hvd.Sum).tolist())
    values.append(hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist())  # in step after it
    hvd.shutdown()
    return {"values": values, "alike": alike}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np", [2, 3])
def test_direct_and_general_calls_meet_on_the_lane(np: int) -> None:
    results = run_job(_direct_beside_general, np, env=FAST)
    total = sum(range(1, np + 1))
    expected = [
        [float(total)] * 3,
        [float(np - 1)] * 2,
        [3 * sum(2 * (i + r) for r in range(np)) for i in range(4)],
        sum(range(np)) / np,
        [float(total)] * 5,
        [float(np)],
    ]
    assert all(r["values"] == expected for r in results), results
    # The two paths sign a call alike, so the lane may run it whichever path each rank took.
    assert all(r["alike"] == [True, True] for r in results), results


def _signed_ahead() -> dict[str, Any]:
    """Asynchronous small allreduces, signed ahead on the lane and settled every way: waited for
    at once, several in flight, polled, interleaved with a call on another set, asynchronous on
    one rank only, and one never waited for."""
    import time

    import torch

    import hora.torch as hvd

    hvd.init(process_sets="dynamic")
    rank, size = hvd.rank(), hvd.size()
    other = hvd.add_process_set([0, 1]) if size > 2 else None
    values: list[Any] = []
    before = _inline_calls()
    # The first goes to the engine; once waited for at once, the next ones are signed ahead.
    for i in range(20):  # waited for at once: as a synchronous call
        tensor = torch.full((3,), float(rank + i))
        values.append(hvd.synchronize(hvd.allreduce_async_(tensor, op=hvd.Sum)).tolist())
    at_once = _inline_calls() - before
    handles = [
        hvd.allreduce_async(torch.full((2,), float(10 * rank + i)), name=f"flight.{i}", op=hvd.Sum)
        for i in range(5)
    ]
    values += [hvd.synchronize(h).tolist() for h in handles]
    polled = hvd.allreduce_async(torch.ones(4) * rank, op=hvd.Max, name="polled")
    while not hvd.poll(polled):
        time.sleep(0.001)
    values.append(hvd.synchronize(polled).tolist())
    crossing = hvd.allreduce_async_(torch.ones(2) * (rank + 1), name="crossing", op=hvd.Sum)
    if other is not None and rank in (0, 1):  # a call on another set before the wait
        values.append(hvd.allreduce(torch.ones(1), process_set=other, op=hvd.Sum).tolist())
    values.append(hvd.synchronize(crossing).tolist())
    scaled = torch.arange(3, dtype=torch.int64) + rank
    if rank == 0:
        one_side = hvd.allreduce_async(scaled, op=hvd.Sum, prescale_factor=2)
        values.append(hvd.synchronize(one_side).tolist())
    else:
        values.append(hvd.allreduce(scaled, op=hvd.Sum, prescale_factor=2).tolist())
    average = hvd.allreduce_async(torch.ones(2) * rank, name="average")
    values.append(hvd.synchronize(average).tolist())
    if rank == 0:  # never waited for: the next call settles it, and the others' completes
        hvd.allreduce_async_(torch.ones(1), name="left", op=hvd.Sum)
    else:
        values.append(hvd.allreduce(torch.ones(1), name="left", op=hvd.Sum).tolist())
    values.append(hvd.allreduce(torch.ones(1), name="final", op=hvd.Sum).tolist())
    hvd.shutdown()
    return {"values": values, "at once": at_once}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np", [2, 3])
def test_asynchronous_calls_signed_ahead_settle_every_way(np: int) -> None:
    results = run_job(_signed_ahead, np, env=FAST)
    ranks = range(np)
    total = sum(ranks)
    expected: list[Any] = [[float(total + np * i)] * 3 for i in range(20)]
    expected += [[float(10 * total + np * i)] * 2 for i in range(5)]
    expected += [[float(np - 1)] * 4]
    crossing = [[2.0]] if np > 2 else []  # the call on the set of ranks 0 and 1
    tail = [[float(total + np)] * 2, [2 * sum(i + r for r in ranks) for i in range(3)]]
    tail += [[total / np] * 2]
    for rank, result in enumerate(results):
        mine = expected + (crossing if rank < 2 else []) + tail
        mine += ([] if rank == 0 else [[float(np)]]) + [[float(np)]]
        assert result["values"] == mine, result
    # Waited for at once, calls meet on the lane (a busy machine may leave some to the
    # engine: a member that arrives more than the settle time late).
    assert all(r["at once"] >= 1 for r in results), results


def _late_member_behind_a_call_signed_ahead() -> dict[str, Any]:
    """Rank 0 signs a call ahead and computes for 3 s before waiting for it; the last rank
    arrives 0.3 s late, so the others leave the call to the engine: the engine's thread must
    hand rank 0's call to the engine long before rank 0 waits for it."""
    import time

    import torch

    import hora.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    # Lined up; and having waited for an asynchronous call at once, the next is signed ahead.
    hvd.synchronize(hvd.allreduce_async(torch.ones(1)))
    started = time.monotonic()
    tensor = torch.ones(3) * (rank + 1)
    if rank == 0:
        handle = hvd.allreduce_async(tensor, name="x", op=hvd.Sum)
        time.sleep(3.0)
        result = hvd.synchronize(handle)
    else:
        if rank == size - 1:
            time.sleep(0.3)
        result = hvd.allreduce(tensor, name="x", op=hvd.Sum)
    elapsed = time.monotonic() - started
    hvd.shutdown()
    return {"result": result.tolist(), "elapsed_s": elapsed}


@pytest.mark.timeout(120)
def test_a_call_left_to_the_engine_does_not_wait_for_its_signer() -> None:
    results = run_job(_late_member_behind_a_call_signed_ahead, 3, env=FAST)
    assert all(r["result"] == [6.0] * 3 for r in results), results
    # Ranks 1 and 2 finish once rank 2 arrived, not when rank 0 waits for its handle.
    assert results[0]["elapsed_s"] >= 3.0
    assert all(r["elapsed_s"] < 2.5 for r in results[1:]), results


def _async_mismatches() -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    hvd.init()
    rank = hvd.rank()
    # Having waited for an asynchronous call at once, the next is signed ahead.
    hvd.synchronize(hvd.allreduce_async(torch.ones(1)))
    out = {
        "shape": error_of(
            lambda: hvd.synchronize(hvd.allreduce_async(torch.ones(4 + rank), name="shape"))
        ),
        "op": error_of(
            lambda: hvd.synchronize(
                hvd.allreduce_async(torch.ones(4), name="op", op=hvd.Sum if rank else hvd.Max)
            )
        ),
    }
    first = hvd.allreduce_async(torch.ones(3), name="twice")
    out["name in flight"] = error_of(lambda: hvd.allreduce_async(torch.ones(3), name="twice"))
    hvd.synchronize(first)
    out["after"] = str(hvd.allreduce(torch.ones(2), name="after", op=hvd.Sum).tolist())
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np", [2, 3])
def test_asynchronous_mismatches_raise_the_full_paths_errors(np: int) -> None:
    fast = run_job(_async_mismatches, np, env=FAST)
    full = run_job(_async_mismatches, np, env=FULL_PATH)
    for rank in range(np):
        for what in ("shape", "op", "name in flight"):
            assert fast[rank][what], (rank, what)
            assert fast[rank][what] == full[rank][what], (rank, what)
        assert fast[rank]["after"] == str([float(np)] * 2)


def _mismatches() -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    hvd.init()
    rank = hvd.rank()
    out = {
        "shape": error_of(lambda: hvd.allreduce(torch.ones(4 + rank), name="shape")),
        "dtype": error_of(
            lambda: hvd.allreduce(
                torch.ones(4, dtype=torch.float32 if rank else torch.float64), name="dtype"
            )  # fmt: skip
        ),
        "op": error_of(
            lambda: hvd.allreduce(torch.ones(4), name="op", op=hvd.Sum if rank else hvd.Max)
        ),
        "broadcast root": error_of(
            lambda: hvd.broadcast(torch.ones(4), root_rank=rank % 2, name="root")
        ),
    }
    # Still in step afterwards.
    out["after"] = str(hvd.allreduce(torch.ones(2), name="after", op=hvd.Sum).tolist())
    out["inline"] = str(_inline_calls())
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_mismatches_raise_the_full_paths_errors(np: int) -> None:
    fast = run_job(_mismatches, np, env=FAST)
    full = run_job(_mismatches, np, env=FULL_PATH)
    for rank in range(np):
        for what in ("shape", "dtype", "op", "broadcast root"):
            assert fast[rank][what], (rank, what)
            assert fast[rank][what] == full[rank][what], (rank, what)
        assert "rank 1" in fast[rank]["shape"]["message"]
        assert fast[rank]["after"] == str([float(np)] * 2)
    assert all(int(r["inline"]) >= 1 for r in fast)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_a_mismatched_name_is_reported_by_the_stall_inspector(np: int) -> None:
    for observed in run_job(_stalled_worker, np, env=STALL_ENV, timeout_s=60):
        assert observed["message"] is not None
        assert "stalled for longer than 3 seconds" in observed["message"]
        assert "1!: [allreduce.x]" in observed["message"]
        assert observed["elapsed_s"] < 20


def _sync_here_async_there() -> dict[str, Any]:
    import time

    import torch

    import hora.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    start = time.monotonic()
    for step in range(20):
        x = torch.full((1000,), float(rank + step))
        if (rank + step) % 2:
            out[f"mixed.{step}"] = hvd.allreduce(x, name=f"mixed.{step}", op=hvd.Sum)
        else:
            handle = hvd.allreduce_async(x, name=f"mixed.{step}", op=hvd.Sum)
            out[f"mixed.{step}"] = hvd.synchronize(handle)
    # Different orders: rank 0 starts y first, the others wait for x first.
    x, y = torch.ones(3) * (rank + 1), torch.ones(5) * (rank + 2)
    if rank == 0:
        handle = hvd.allreduce_async(y, name="y", op=hvd.Sum)
        out["x"] = hvd.allreduce(x, name="x", op=hvd.Sum)
    else:
        out["x"] = hvd.allreduce(x, name="x", op=hvd.Sum)
        handle = hvd.allreduce_async(y, name="y", op=hvd.Sum)
    out["y"] = hvd.synchronize(handle)
    out["elapsed_s"] = time.monotonic() - start
    out["size"] = size
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_sync_on_one_rank_and_async_on_another_completes(np: int) -> None:
    import torch

    for out in run_job(_sync_here_async_there, np, env=FAST, timeout_s=60):
        for step in range(20):
            expected = sum(float(r + step) for r in range(np))
            assert torch.equal(out[f"mixed.{step}"], torch.full((1000,), expected))
        assert torch.equal(out["x"], torch.ones(3) * sum(r + 1 for r in range(np)))
        assert torch.equal(out["y"], torch.ones(5) * sum(r + 2 for r in range(np)))
        assert out["elapsed_s"] < 30


def _join_and_go_on() -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    hvd.init()
    rank = hvd.rank()
    out: dict[str, Any] = {}
    steps = 3 if rank == 0 else 8
    for step in range(steps):
        out[f"before.{step}"] = hvd.allreduce(torch.ones(4) * (rank + 1), name="g", op=hvd.Sum)
        if step < 3:
            hvd.barrier()
    out["last"] = hvd.join()
    inline_at_join = _inline_calls()
    for step in range(10):
        out[f"after.{step}"] = hvd.allreduce(
            torch.full((300_000,), float(rank + step)), name=f"after.{step % 3}", op=hvd.Sum
        )
    out["inline_after"] = _inline_calls() - inline_at_join
    # A second session: new lanes, numbers from the start.
    hvd.shutdown()
    hvd.init()
    out["session2"] = hvd.allreduce(torch.ones(2) * rank, name="s2", op=hvd.Sum)
    out["inline_session2"] = _inline_calls()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_join_falls_back_and_the_lane_comes_back_after_it(np: int) -> None:
    import torch

    for rank, out in enumerate(run_job(_join_and_go_on, np, env=FAST, timeout_s=120)):
        for step in range(3 if rank == 0 else 8):
            everyone = range(np) if step < 3 else range(1, np)
            expected = torch.ones(4) * sum(r + 1 for r in everyone)
            assert torch.equal(out[f"before.{step}"], expected), (rank, step)
        for step in range(10):
            expected = torch.full((300_000,), float(sum(r + step for r in range(np))))
            assert torch.equal(out[f"after.{step}"], expected), (rank, step)
        assert out["inline_after"] >= 5, out["inline_after"]
        assert torch.equal(out["session2"], torch.ones(2) * sum(range(np)))
        assert out["inline_session2"] == 1


def _stopped_member() -> dict[str, Any]:
    import logging
    import os
    import signal
    import threading
    import time

    import torch

    import hora.torch as hvd

    hvd.init()
    rank = hvd.rank()
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("hora").addHandler(Keep(logging.WARNING))
    pids = hvd.allgather_object(os.getpid())
    hvd.allreduce(torch.ones(2), name="warm")
    if rank == 0:
        # Rank 1 stops itself; rank 0 resumes it after 4 s, from another thread.
        threading.Timer(4.0, os.kill, (pids[1], signal.SIGCONT)).start()
    start = time.monotonic()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    result = hvd.allreduce(torch.ones(2) * (rank + 1), name="x", op=hvd.Sum)
    return {
        "result": result.tolist(),
        "elapsed_s": time.monotonic() - start,
        "warnings": warnings,
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np", [2, 3])
def test_a_stopped_member_is_waited_for_as_on_the_full_path(np: int) -> None:
    # A member stopped for 4 s (SIGSTOP): the others' call goes to the engine after the lane's
    # settling time and completes once the member is back, with the same warnings as on the
    # full path (whose engine cannot exchange with a stopped rank either).
    env = {**FAST, "HORA_STALL_CHECK_TIME_SECONDS": "1"}
    fast = run_job(_stopped_member, np, env=env, timeout_s=60)
    full = run_job(_stopped_member, np, env={**env, **FULL_PATH}, timeout_s=60)
    total = float(sum(range(1, np + 1)))
    for observed in fast + full:
        assert observed["result"] == [total, total]
    assert fast[0]["elapsed_s"] >= 3.5, fast[0]
    assert [r["warnings"] for r in fast] == [r["warnings"] for r in full]


def _traced(path: str) -> dict[str, Any]:
    """Calls the lane runs, with a timeline being written."""
    import torch

    import hora.torch as hvd

    hvd.init()
    hvd.start_timeline(path)
    for _ in range(3):
        hvd.allreduce(torch.ones(1000), name="a", op=hvd.Sum)
    hvd.grouped_allreduce([torch.ones(3), torch.ones(5)], name="g", op=hvd.Sum)
    hvd.broadcast(torch.ones(7), root_rank=0, name="b")
    inline = _inline_calls()
    hvd.stop_timeline()
    hvd.shutdown()
    return {"inline": inline}


@pytest.mark.timeout(120)
def test_a_timeline_shows_the_calls_the_lane_ran(tmp_path: Any) -> None:
    from hora.tools import timeline

    path = tmp_path / "timeline.json"
    results = run_job(_traced, 2, str(path), env=FAST)
    loaded = timeline.load(path)
    by_rank: dict[int, dict[str, list[Any]]] = {0: {}, 1: {}}
    for e in loaded.events:
        if e.ph == "X" and e.tid >= timeline.FIRST_TENSOR_ROW:
            row = loaded.row_name(e.rank, e.tid)
            by_rank[e.rank].setdefault(row, []).append(e)
    for rank, result in enumerate(results):
        rows = by_rank[rank]
        inline = [e for events in rows.values() for e in events if e.args.get("path") == "lane"]
        # Each inline call: NEGOTIATE_<OP> then the collective, on each of its tensors' rows.
        assert len(inline) == 2 * (result["inline"] + 1), (rank, rows.keys(), result)
        assert result["inline"] >= 3, result
        for events in rows.values():
            for negotiate, collective in zip(events[::2], events[1::2]):
                if negotiate.args.get("path") != "lane":
                    continue
                assert negotiate.name == timeline.NEGOTIATE
                assert negotiate.end <= collective.ts + 1
                assert collective.name in ("ALLREDUCE", "BROADCAST")
                assert collective.args["tensors"] >= 1
    # The n-th call has the same number on the lane on both ranks.
    numbers = [
        sorted(e.args["lane"] for events in by_rank[r].values() for e in events if "lane" in e.args)
        for r in (0, 1)
    ]
    assert numbers[0] == numbers[1] and numbers[0], numbers
    assert {"allreduce.a", "grouped_allreduce.g_1of2", "broadcast.b"} <= set(by_rank[0])
    # hora's summary counts them as negotiated calls, and compares them across ranks.
    summary = timeline.summarize(loaded)
    assert all(r.negotiated_calls == 6 for r in summary.per_rank), summary
    assert summary.compared_collectives >= 5, summary
