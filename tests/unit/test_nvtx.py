"""NVTX ranges around the engine's phases (``HORA_ENABLE_NVTX=1``), in a job of one rank.

On a PyTorch without CUDA the ranges are off and cost nothing; to see which ranges the engine
opens, and in what nesting, the test hands the tracer recording functions in place of
``torch.cuda.nvtx``'s.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

import hora.torch as hvd
from hora.common import basics
from hora.common.engine.tracing import RANGE_PREFIX, Ranges, Tracer, nvtx_ranges

pytestmark = pytest.mark.timeout(60)


class Recorder:
    """Records every range call as (thread, event, name or range id)."""

    def __init__(self) -> None:
        self.events: list[tuple[int, str, object]] = []
        self._lock = threading.Lock()
        self._next = 0

    def _add(self, event: str, what: object) -> None:
        with self._lock:
            self.events.append((threading.get_ident(), event, what))

    def push(self, name: str) -> None:
        self._add("push", name)

    def pop(self) -> None:
        self._add("pop", None)

    def start(self, name: str) -> int:
        with self._lock:
            self._next += 1
            number = self._next
        self._add("start", (number, name))
        return number

    def end(self, number: int) -> None:
        self._add("end", number)

    def ranges(self) -> Ranges:
        return Ranges(self.push, self.pop, self.start, self.end)

    def nested(self) -> list[tuple[str, ...]]:
        """Each pushed range with the ranges open around it on its thread (outermost first);
        fails on a pop without a push, or a range left open."""
        stacks: dict[int, list[str]] = {}
        seen = []
        for thread, event, what in self.events:
            stack = stacks.setdefault(thread, [])
            if event == "push":
                stack.append(str(what))
                seen.append(tuple(stack))
            elif event == "pop":
                assert stack, f"a pop without a push on thread {thread}"
                stack.pop()
        assert all(not stack for stack in stacks.values()), f"ranges left open: {stacks}"
        return seen

    def spans(self) -> list[str]:
        """Names of the start/end ranges, each checked to end exactly once after it started."""
        started = {}
        ended = []
        for _, event, what in self.events:
            if event == "start":
                number, name = what  # type: ignore[misc]
                started[number] = name
            elif event == "end":
                assert what in started and what not in ended, f"range {what} ended twice or early"
                ended.append(what)
        assert sorted(ended) == sorted(started), "a started range never ended"
        return [started[number] for number in sorted(started)]


@pytest.fixture
def nvtx_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    monkeypatch.setenv("HORA_ENABLE_NVTX", "1")
    hvd.init()
    recorder = Recorder()
    try:
        yield recorder
    finally:
        hvd.shutdown()


# A CUDA build has NVTX whether or not a GPU is visible (nsys records its ranges either way).
@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="checks a PyTorch built without CUDA")
def test_without_cuda_the_ranges_are_off_and_collectives_work(nvtx_job: Recorder) -> None:
    assert nvtx_ranges() is None
    assert basics.engine().settings.enable_nvtx
    assert basics.engine().tracer.ranges is None
    result = hvd.allreduce(torch.arange(6.0), op=hvd.Sum, name="plain")
    assert torch.equal(result, torch.arange(6.0))


def test_the_phases_are_ranges_in_the_right_nesting(nvtx_job: Recorder) -> None:
    basics.engine().tracer.ranges = nvtx_job.ranges()
    first, second = torch.ones(4), torch.full((3,), 2.0)
    summed = hvd.grouped_allreduce([first, second], op=hvd.Sum, name="pair")
    gathered = hvd.allgather(torch.arange(3), name="rows")
    sent = hvd.broadcast(torch.tensor([5.0]), root_rank=0, name="root")
    basics.engine().tracer.ranges = None

    assert [t.tolist() for t in summed] == [first.tolist(), second.tolist()]
    assert gathered.tolist() == [0, 1, 2] and sent.tolist() == [5.0]
    nested = nvtx_job.nested()
    names = {stack[-1] for stack in nested}
    prefix = RANGE_PREFIX
    assert {
        prefix + "NEGOTIATE",
        prefix + "MEMCPY_IN_FUSION_BUFFER",
        prefix + "MEMCPY_OUT_FUSION_BUFFER",
        prefix + "ALLGATHER",
        prefix + "BROADCAST",
    } <= names
    # Phases follow one another: none is opened inside another.
    assert all(len(stack) == 1 for stack in nested), nested
    assert nvtx_job.spans() == [prefix + "ALLREDUCE"]
    # The fused allreduce: copy in, then the collective, then copy out.
    order = [
        what if event == "push" else what[1]  # type: ignore[index]
        for _, event, what in nvtx_job.events
        if event == "push" or event == "start"
    ]
    copy_in = order.index(prefix + "MEMCPY_IN_FUSION_BUFFER")
    on_the_wire = order.index(prefix + "ALLREDUCE")
    copy_out = order.index(prefix + "MEMCPY_OUT_FUSION_BUFFER")
    assert copy_in < on_the_wire < copy_out
    assert order.index(prefix + "NEGOTIATE") < copy_in


def test_a_tracer_without_ranges_does_nothing() -> None:
    tracer = Tracer()
    tracer.open("NEGOTIATE")
    tracer.close()
    tracer.finish(tracer.begin("ALLREDUCE"))
    recorder = Recorder()
    tracer.ranges = recorder.ranges()
    tracer.open("NEGOTIATE")
    tracer.close()
    assert recorder.nested() == [(RANGE_PREFIX + "NEGOTIATE",)]
