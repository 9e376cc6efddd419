"""Where live metrics go: TensorBoard event files and a Prometheus endpoint.

Each sink takes :class:`~hora.common.metrics.records.StepRecord` objects on the thread that ends
a step (the user's), never on the engine's. The packages they use are optional extras
(``pip install 'hora[metrics]'``), imported only when a sink is opened; a missing one is a
:class:`MetricsError` that says what to install.

TensorBoard's event files are written with ``tensorboard``'s protocol buffers, framed as TFRecords
here, without its ``EventFileWriter``, which would import all of TensorFlow where it is installed,
and without its ``RecordWriter``, whose CRC-32C in pure Python took 60 of the 70 microseconds that
a step's records cost (``google-crc32c`` computes it in C).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Protocol

from hora.common.metrics.records import StepRecord, StepTiming
from hora.common.vocabulary import safe_files

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge

# Event files reach the disk at least this often while steps are written (and at every close).
FLUSH_INTERVAL_S = 2.0


class MetricsError(ValueError):
    """Live metrics were asked for but cannot be published as asked."""


class SinkUnavailable(MetricsError):
    """A sink cannot open here and now (its port is taken, its directory is not writable), as
    opposed to a setting or an installation that is wrong."""


class Sink(Protocol):
    def write(self, record: StepRecord) -> None:
        """Publish one step's record."""

    def close(self) -> None:
        """Flush and release what the sink holds (files, the listening socket)."""


@dataclass(frozen=True)
class Metric:
    """One published metric, by its names in both sinks.

    Attributes:
        tag: its TensorBoard tag (per step).
        prometheus: its Prometheus name (without ``_total`` for counters).
        meaning: what it is, for the docs.
        read: its value for one step, in Prometheus's unit (seconds, bytes, a count).
        per_step: TensorBoard's unit per Prometheus's (1000: milliseconds for seconds).
        counter: whether Prometheus counts it up (a total over steps) rather than shows the
            last step's value.
    """

    tag: str
    prometheus: str
    meaning: str
    read: Callable[[StepTiming], float]
    per_step: float = 1.0
    counter: bool = True

    def value(self, timing: StepTiming) -> float:
        """Its value in TensorBoard's unit, from a step's timing."""
        return self.read(timing) * self.per_step

    @property
    def total(self) -> Callable[[StepTiming], float] | None:
        """Its increment in Prometheus's unit, for counters; ``None`` for the others."""
        return self.read if self.counter else None


# Seconds, shown in milliseconds per step.
_MS = 1000.0

METRICS: tuple[Metric, ...] = (
    Metric("hora/step_time_ms", "hora_step_seconds",
           "time from the end of the previous step to the end of this one",
           lambda t: t.step_s, _MS),
    Metric("hora/comm_time_ms", "hora_communication_seconds",
           "time in which at least one collective ran (collectives that overlap count once)",
           lambda t: t.comm_s, _MS),
    Metric("hora/comm_share", "hora_communication_share",
           "communication time over step time (0 to 1)", lambda t: t.comm_share, counter=False),
    Metric("hora/backward_overlap_ms", "hora_backward_overlap_seconds",
           "the part of communication time inside backward (first to last gradient)",
           lambda t: t.overlap_s, _MS),
    Metric("hora/reduced_bytes", "hora_reduced_bytes",
           "bytes reduced by allreduce and reducescatter (gradients: their size in their dtype)",
           lambda t: float(t.reduced_bytes)),
    Metric("hora/fusion_batches", "hora_fusion_batches",
           "collectives run; a fused batch of many tensors counts once",
           lambda t: float(t.batches)),
    Metric("hora/fused_tensors", "hora_fused_tensors", "tensors in those collectives",
           lambda t: float(t.tensors)),
    Metric("hora/negotiation_ms", "hora_negotiation_seconds",
           "time the engine spent in negotiation exchanges (0 in the steady state)",
           lambda t: t.negotiation_s, _MS),
    Metric("hora/stall_ms", "hora_stall_seconds",
           "time in which negotiated calls waited for some ranks to submit them",
           lambda t: t.stall_s, _MS),
)  # fmt: skip
SAMPLES_TAG = "hora/samples_per_s"


def missing_package(package: str, sink: str, rank: int, error: ImportError) -> MetricsError:
    return MetricsError(
        f"rank {rank}: HORA_METRICS asks for {sink}, but the {package} package cannot be "
        f"imported by {sys.executable} ({error}). Install it with `pip install 'hora[metrics]'` "
        f"(or `pip install {package}`), or leave {sink.split(':')[0]} out of HORA_METRICS."
    )


class TensorBoardSink:
    """Event files for TensorBoard in ``DIRECTORY/rank<r>``: one run per rank.

    Args:
        directory: the job's metrics directory (``tensorboard --logdir DIRECTORY``).
        rank: this process's rank.
    """

    def __init__(self, directory: str, rank: int) -> None:
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
        except ImportError as exc:
            raise missing_package("tensorboard", "tensorboard:DIR", rank, exc) from None
        try:
            import google_crc32c
        except ImportError as exc:
            raise missing_package("google-crc32c", "tensorboard:DIR", rank, exc) from None
        self._event = event_pb2.Event
        self._summary = summary_pb2.Summary
        self.path = os.path.join(directory, f"rank{rank}")
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        self.file_path = os.path.join(self.path, name + ".hora")
        try:
            file = safe_files.create(self.file_path, binary=True)
        except OSError as exc:
            raise SinkUnavailable(
                f"rank {rank}: cannot write TensorBoard event files in {self.path} "
                f"({exc.strerror or exc}). Point HORA_METRICS's tensorboard:DIR (or horarun "
                "--metrics) at a directory this rank can write to."
            ) from exc
        self._records = RecordFile(file, google_crc32c.value)
        self._flushed = time.monotonic()
        header = self._event(wall_time=time.time(), file_version="brain.Event:2")
        self._records.write(header.SerializeToString())
        self._records.flush()

    def write(self, record: StepRecord) -> None:
        value = self._summary.Value
        values = []
        if record.timing is not None:
            timing = record.timing
            values = [value(tag=m.tag, simple_value=m.value(timing)) for m in METRICS]
        if record.samples_per_s is not None:
            values.append(value(tag=SAMPLES_TAG, simple_value=record.samples_per_s))
        values += [value(tag=k, simple_value=float(v)) for k, v in record.scalars.items()]
        event = self._event(
            wall_time=time.time(), step=record.step, summary=self._summary(value=values)
        )
        self._records.write(event.SerializeToString())
        now = time.monotonic()
        if now - self._flushed >= FLUSH_INTERVAL_S:
            self._records.flush()
            self._flushed = now

    def close(self) -> None:
        if not self._records.closed:
            self._records.flush()
            self._records.close()


_CRC_MASK_DELTA = 0xA282EAD8


class RecordFile:
    """A TFRecord file: each record is its length (8 bytes, little-endian), the masked CRC-32C
    of those 8 bytes, the data, and the data's masked CRC-32C (TensorBoard checks both).

    Args:
        file: a binary file open for writing (closed by :meth:`close`).
        crc32c: the CRC-32C of a byte string.
    """

    def __init__(self, file: IO[bytes], crc32c: Callable[[bytes], int]) -> None:
        self._file = file
        self._crc32c = crc32c

    def _masked(self, data: bytes) -> bytes:
        crc = self._crc32c(data)
        rotated = ((crc >> 15) | (crc << 17)) & 0xFFFFFFFF
        return struct.pack("<I", (rotated + _CRC_MASK_DELTA) & 0xFFFFFFFF)

    def write(self, data: bytes) -> None:
        length = struct.pack("<Q", len(data))
        self._file.write(length + self._masked(length) + data + self._masked(data))

    def flush(self) -> None:
        self._file.flush()

    @property
    def closed(self) -> bool:
        return bool(self._file.closed)

    def close(self) -> None:
        self._file.close()


class PrometheusSink:
    """An HTTP endpoint for Prometheus to scrape, with every metric labelled by rank.

    Args:
        port: the port to listen on.
        address: the address to bind (loopback unless asked otherwise).
        rank: this process's rank (the ``rank`` label).
    """

    def __init__(self, port: int, address: str, rank: int) -> None:
        try:
            import prometheus_client as prometheus
        except ImportError as exc:
            raise missing_package("prometheus_client", "prometheus:PORT", rank, exc) from None
        self.registry = prometheus.CollectorRegistry(auto_describe=True)
        self.rank = str(rank)
        self._counters: dict[str, Counter] = {}
        self._gauges: dict[str, Gauge] = {}
        for metric in METRICS:
            if metric.counter:
                self._counters[metric.prometheus] = prometheus.Counter(
                    metric.prometheus, metric.meaning, ["rank"], registry=self.registry
                ).labels(self.rank)
            else:
                self._gauges[metric.prometheus] = prometheus.Gauge(
                    metric.prometheus, metric.meaning, ["rank"], registry=self.registry
                ).labels(self.rank)
        self._make_common(prometheus.Counter, prometheus.Gauge)
        self.address, self.port = address, port
        try:
            self._server, self._thread = prometheus.start_http_server(
                port, addr=address, registry=self.registry
            )
        except OSError as exc:
            raise SinkUnavailable(_bind_problem(rank, address, port, exc)) from exc

    def _make_common(self, counter: type[Counter], gauge: type[Gauge]) -> None:
        """The metrics that do not come from the engine's timing."""
        labels = ["rank"]
        registry = self.registry
        self._steps = counter(
            "hora_steps", "steps ended on this rank", labels, registry=registry
        ).labels(self.rank)
        self._last_step = gauge(
            "hora_last_step_seconds", "the last step's time", labels, registry=registry
        ).labels(self.rank)
        self._samples = counter(
            "hora_samples", "samples the script reported (hvd.metrics.log_step)", labels,
            registry=registry,
        ).labels(self.rank)  # fmt: skip
        self._rate = gauge(
            "hora_samples_per_second", "the last reported step's samples per second", labels,
            registry=registry,
        ).labels(self.rank)  # fmt: skip
        self._scalars = gauge(
            "hora_scalar", "the script's own values (hvd.metrics.log_step)", ["rank", "name"],
            registry=registry,
        )  # fmt: skip

    def write(self, record: StepRecord) -> None:
        timing = record.timing
        if timing is not None:
            self._steps.inc()
            self._last_step.set(timing.step_s)
            for metric in METRICS:
                if metric.total is not None:
                    self._counters[metric.prometheus].inc(metric.total(timing))
                else:
                    self._gauges[metric.prometheus].set(metric.value(timing))
        if record.samples is not None:
            self._samples.inc(record.samples)
        if record.samples_per_s is not None:
            self._rate.set(record.samples_per_s)
        for name, value in record.scalars.items():
            self._scalars.labels(self.rank, name).set(float(value))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


def _bind_problem(rank: int, address: str, port: int, exc: OSError) -> str:
    where = f"rank {rank}: cannot serve Prometheus metrics on {address}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return (
            f"{where}: the port is in use. Each rank listens on PORT + its local rank: give "
            "HORA_METRICS (or horarun --metrics) a prometheus:PORT whose next local-size ports "
            "are free on every host."
        )
    if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(exc, socket.gaierror):
        return (
            f"{where} ({exc.strerror or exc}): HORA_METRICS_ADDR must be an address of this "
            "host (default 127.0.0.1)."
        )
    return f"{where} ({exc.strerror or exc})."
