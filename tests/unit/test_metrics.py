"""The pure parts of live metrics: interval arithmetic, the settings' parsing, what a step is,
and the sinks on their own (a TensorBoard file read back, a Prometheus endpoint scraped)."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from hora.common.engine.counters import Counters
from hora.common.metrics import Publisher, parse_ranks, parse_spec
from hora.common.metrics.records import StepRecord, covered, step_timing
from hora.common.metrics.sinks import METRICS, MetricsError, PrometheusSink, TensorBoardSink
from hora.common.vocabulary.config import SettingError
from hora.runner.flags import metrics_spec


@pytest.mark.parametrize(
    ("intervals", "low", "high", "expected"),
    [
        ([], 0.0, 10.0, 0.0),
        ([(1.0, 2.0), (3.0, 5.0)], 0.0, 10.0, 3.0),
        ([(1.0, 4.0), (2.0, 3.0), (3.5, 6.0)], 0.0, 10.0, 5.0),  # overlaps count once
        ([(3.0, 5.0), (1.0, 2.0)], 0.0, 10.0, 3.0),  # any order
        ([(-2.0, 1.0), (9.0, 12.0)], 0.0, 10.0, 2.0),  # clipped to the window
        ([(11.0, 12.0)], 0.0, 10.0, 0.0),
    ],
)
def test_covered_counts_the_union_within_the_window(
    intervals: list[tuple[float, float]], low: float, high: float, expected: float
) -> None:
    assert covered(intervals, low, high) == pytest.approx(expected)


def test_a_step_timing_takes_differences_and_the_backward_overlap() -> None:
    counters = Counters()
    before, _ = counters.take()
    counters.collective(1.0, 3.0, 400, 2)
    counters.collective(2.0, 4.0, 100, 1)
    counters.carried(8)
    counters.negotiated(0.25, 0.5)
    after, intervals = counters.take()
    timing = step_timing(0.0, 5.0, before, after, intervals, (0.5, 2.5))
    assert (timing.step_s, timing.comm_s, timing.overlap_s) == (5.0, 3.0, 1.5)
    assert (timing.reduced_bytes, timing.batches, timing.tensors) == (508, 3, 4)
    assert (timing.negotiation_s, timing.stall_s) == (0.25, 0.5)
    assert timing.comm_share == pytest.approx(0.6)
    assert counters.take()[1] == []  # intervals are handed out once


def test_specs_and_ranks_parse() -> None:
    sinks = parse_spec(" tensorboard:/tmp/m , prometheus:9400")
    assert [(s.kind, s.target) for s in sinks] == [
        ("tensorboard", "/tmp/m"),
        ("prometheus", "9400"),
    ]
    assert sinks[1].port == 9400
    assert parse_ranks("all") is None
    assert parse_ranks("0,4") == frozenset({0, 4})


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "is empty"),
        ("grafana:1", "unknown sink 'grafana:1'"),
        ("prometheus:0", "between 1 and 65535"),
        ("prometheus:x", "between 1 and 65535"),
        ("tensorboard", "needs a directory"),
        ("prometheus:1,prometheus:2", "names prometheus twice"),
    ],
)
def test_bad_specs_say_what_is_wrong(text: str, match: str) -> None:
    with pytest.raises(SettingError, match=match):
        parse_spec(text)


@pytest.mark.parametrize("text", ["", "rank0", "-1", "0,,1"])
def test_bad_rank_lists_are_refused(text: str) -> None:
    with pytest.raises(SettingError, match="HORA_METRICS_RANKS must be all or a list"):
        parse_ranks(text)


class _Recorded:
    """A sink that keeps what it is given."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.closed = False

    def write(self, record: StepRecord) -> None:
        self.records.append(record)

    def close(self) -> None:
        self.closed = True


def test_the_optimizer_ends_steps_and_log_step_adds_to_them() -> None:
    sink = _Recorded()
    publisher = Publisher(Counters(), 3, [sink])
    publisher.gradient_ready()
    publisher.optimizer_stepped()
    publisher.log_step(32, {"loss": 0.5})
    publisher.optimizer_stepped()  # no log_step for step 2
    publisher.optimizer_stepped()
    publisher.log_step(None, {"loss": 0.25})
    steps = [(r.step, r.timing is not None, r.samples, dict(r.scalars)) for r in sink.records]
    assert steps == [
        (1, True, None, {}),
        (1, False, 32, {"loss": 0.5}),
        (2, True, None, {}),
        (3, True, None, {}),
        (3, False, None, {"loss": 0.25}),
    ]
    first = sink.records[0].timing
    assert first is not None and sink.records[1].samples_per_s == pytest.approx(32 / first.step_s)
    assert all(r.rank == 3 for r in sink.records)
    publisher.close()
    assert sink.closed


def test_log_step_ends_steps_where_the_optimizer_does_not() -> None:
    sink = _Recorded()
    publisher = Publisher(Counters(), 0, [sink])
    publisher.log_step(8, {})  # before any optimizer step: the script's calls end steps
    publisher.optimizer_stepped()  # ignored from now on
    publisher.log_step(8, {"x": 1.0})
    assert [(r.step, r.timing is not None) for r in sink.records] == [(1, True), (2, True)]


def test_tensorboard_files_are_read_back_by_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(str(tmp_path), 2)
    counters = Counters()
    before, _ = counters.take()
    counters.collective(0.0, 0.5, 1024, 3)
    after, intervals = counters.take()
    timing = step_timing(0.0, 2.0, before, after, intervals, None)
    sink.write(StepRecord(2, 1, timing))
    sink.write(StepRecord(2, 1, None, 16, 8.0, {"train/loss": 0.75}))
    sink.close()
    accumulator = EventAccumulator(str(tmp_path / "rank2"))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert {m.tag for m in METRICS} | {"hora/samples_per_s", "train/loss"} == tags
    assert accumulator.Scalars("hora/step_time_ms")[0].value == pytest.approx(2000)
    assert accumulator.Scalars("hora/comm_share")[0].value == pytest.approx(0.25)
    assert accumulator.Scalars("hora/reduced_bytes")[0].value == 1024
    assert accumulator.Scalars("train/loss")[0].step == 1


@pytest.mark.timeout(60)
def test_writing_event_files_does_not_import_tensorflow(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    code = (
        "import sys\n"
        "from hora.common.metrics.sinks import TensorBoardSink\n"
        f"TensorBoardSink({str(tmp_path)!r}, 0).close()\n"
        "print('tensorflow' in sys.modules, 'torch.utils.tensorboard' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True
    )
    assert result.stdout.split() == ["False", "False"]


def test_a_directory_that_cannot_be_written_is_a_clear_error(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(MetricsError, match=r"rank 1: cannot write TensorBoard event files in"):
        TensorBoardSink(str(blocker / "metrics"), 1)


def test_prometheus_serves_text_its_parser_reads() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    sink = PrometheusSink(0, "127.0.0.1", 5)
    try:
        port = sink._server.server_port
        counters = Counters()
        before, _ = counters.take()
        counters.collective(0.0, 0.1, 4096, 2)
        after, intervals = counters.take()
        timing = step_timing(0.0, 0.4, before, after, intervals, (0.0, 0.05))
        sink.write(StepRecord(5, 1, timing))
        sink.write(StepRecord(5, 1, None, 10, 25.0, {"loss": 1.5}))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    finally:
        sink.close()
    samples = {
        (s.name, s.labels.get("name")): s
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("hora_reduced_bytes_total", None)].value == 4096
    assert samples[("hora_communication_seconds_total", None)].value == pytest.approx(0.1)
    assert samples[("hora_backward_overlap_seconds_total", None)].value == pytest.approx(0.05)
    assert samples[("hora_communication_share", None)].value == pytest.approx(0.25)
    assert samples[("hora_samples_total", None)].value == 10
    assert samples[("hora_scalar", "loss")].value == 1.5
    assert {s.labels["rank"] for s in samples.values()} == {"5"}


def test_a_port_in_use_is_a_clear_error() -> None:
    pytest.importorskip("prometheus_client")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            MetricsError, match=rf"rank 0: .* 127\.0\.0\.1:{port}: the port is in use"
        ):
            PrometheusSink(port, "127.0.0.1", 0)


@pytest.mark.parametrize(
    ("module", "make", "package"),
    [
        ("prometheus_client", lambda: PrometheusSink(9400, "127.0.0.1", 0), "prometheus_client"),
        ("tensorboard", lambda: TensorBoardSink("/nonexistent", 0), "tensorboard"),
        ("google_crc32c", lambda: TensorBoardSink("/nonexistent", 0), "google-crc32c"),
    ],
)
def test_a_missing_package_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, module: str, make: object, package: str
) -> None:
    if module == "google_crc32c":  # imported after tensorboard
        pytest.importorskip(
            "tensorboard", reason="tensorboard is not installed: pip install -e '.[dev]'"
        )
    # None in sys.modules makes `import` fail as for a package that is not installed.
    for name in list(sys.modules):
        if name == module or name.startswith(module + "."):
            monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(
        MetricsError,
        match=rf"rank 0: HORA_METRICS asks for .*, but the {package} package cannot be imported .*"
        rf"pip install 'hora\[metrics\]'.*pip install {package}",
    ) as err:
        make()  # type: ignore[operator]
    # One line, and no chained ModuleNotFoundError printed above it.
    assert "\n" not in str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_horarun_makes_tensorboard_directories_absolute(tmp_path: Path) -> None:
    encoded = metrics_spec("prometheus:9400,tensorboard:runs/m")
    assert encoded.startswith("prometheus:9400,tensorboard:/")
    assert encoded.endswith("/runs/m")
    assert metrics_spec("nonsense") == "nonsense"  # the workers refuse it, with the reason


def test_steps_are_numbered_on_across_stop_and_start(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from hora.common import metrics

    metrics.attach(Counters(), 1, 0)
    try:
        with pytest.raises(SettingError, match="hvd.metrics.start: unknown sink"):
            metrics.start("csv:x")
        metrics.start(f"tensorboard:{tmp_path}", ranks="0")
        assert metrics.current() is None  # rank 1 does not publish
        metrics.log_step(batch_size=1)  # and does nothing
        metrics.start(f"tensorboard:{tmp_path}")
        publisher = metrics.current()
        assert publisher is not None
        publisher.optimizer_stepped()
        metrics.stop()
        metrics.start(f"tensorboard:{tmp_path}")
        publisher = metrics.current()
        assert publisher is not None
        publisher.optimizer_stepped()
        assert publisher.step == 2
    finally:
        metrics.detach()
    assert metrics.current() is None
    with pytest.raises(ValueError, match=r"needs hvd.init\(\) first"):
        metrics.start(f"tensorboard:{tmp_path}")


def test_the_docs_name_every_metric() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs/profiling.md").read_text()
    for metric in METRICS:
        assert f"`{metric.tag}`" in text, metric.tag
        suffix = "_total" if metric.total is not None else ""
        assert f"`{metric.prometheus}{suffix}`" in text, metric.prometheus
