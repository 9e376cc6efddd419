"""Live metrics: per rank and per step, what the engine did and how long steps took, published
to TensorBoard and Prometheus while the job runs (``HORA_METRICS``; docs/profiling.md).

The engine only counts (:mod:`hora.common.engine.counters`); this module turns the counts into
one record per step on the thread that ends the step, and hands it to the sinks
(:mod:`hora.common.metrics.sinks`). A step ends at each ``DistributedOptimizer.step()``, or at
each :func:`log_step` in a script whose steps the optimizer does not end (see :class:`Publisher`).
It knows counters, clocks and sinks; never tensors, modules or optimizers.

Example:
    >>> import hora.torch as hvd
    >>> hvd.init()                      # HORA_METRICS=tensorboard:runs/metrics
    >>> for x, y in loader:
    ...     loss = F.cross_entropy(model(x), y)
    ...     loss.backward()
    ...     optimizer.step()
    ...     hvd.metrics.log_step(batch_size=len(x), loss=loss.item())
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from hora.common.engine.counters import Counters
from hora.common.metrics.records import StepRecord, StepTiming, step_timing
from hora.common.metrics.sinks import (
    METRICS,
    MetricsError,
    PrometheusSink,
    Sink,
    SinkUnavailable,
    TensorBoardSink,
)
from hora.common.runtime import EngineFacts, StepPublisher, runtime
from hora.common.vocabulary import settings_table as table
from hora.common.vocabulary.config import SettingError, read

__all__ = [
    "METRICS",
    "MetricsError",
    "Publisher",
    "SinkSpec",
    "log_step",
    "parse_ranks",
    "parse_spec",
    "start",
    "stop",
]

logger = logging.getLogger("hora")

SINK_KINDS = ("tensorboard", "prometheus")


@dataclass(frozen=True)
class SinkSpec:
    """One sink asked for: ``tensorboard`` with a directory, or ``prometheus`` with a port."""

    kind: str
    target: str

    @property
    def port(self) -> int:
        return int(self.target)


def parse_spec(text: str, source: str = table.METRICS.env) -> list[SinkSpec]:
    """``tensorboard:DIR``, ``prometheus:PORT`` or both, separated by a comma.

    Raises:
        SettingError: an unknown sink, a missing directory, a port that is no port; the
            message names ``source`` and the item.
    """
    sinks: list[SinkSpec] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        kind, _, target = item.partition(":")
        kind = kind.strip().lower()
        if kind not in SINK_KINDS:
            raise SettingError(
                f"{source}: unknown sink {item!r}; use tensorboard:DIR and/or prometheus:PORT, "
                "separated by a comma (e.g. tensorboard:runs/metrics,prometheus:9400)."
            )
        target = target.strip()
        if kind == "tensorboard" and not target:
            raise SettingError(f"{source}: tensorboard needs a directory (tensorboard:DIR).")
        if kind == "prometheus" and not (target.isdigit() and 1 <= int(target) <= 65535):
            raise SettingError(
                f"{source}: prometheus needs a port between 1 and 65535 (prometheus:PORT), "
                f"got {target!r}."
            )
        if any(sink.kind == kind for sink in sinks):
            raise SettingError(f"{source} names {kind} twice; give each sink once.")
        sinks.append(SinkSpec(kind, target))
    if not sinks:
        raise SettingError(f"{source} is empty; use tensorboard:DIR and/or prometheus:PORT.")
    return sinks


def parse_ranks(text: str, source: str = table.METRICS_RANKS.env) -> frozenset[int] | None:
    """``all`` (``None``: every rank) or a comma-separated list of ranks (``0``, ``0,4``).

    Raises:
        SettingError: anything else.
    """
    if text.strip().lower() == "all":
        return None
    try:
        ranks = frozenset(int(part) for part in text.split(","))
    except ValueError:
        ranks = frozenset({-1})
    if not ranks or min(ranks) < 0:
        raise SettingError(
            f"{source} must be all or a list of ranks such as 0 or 0,4; got {text!r}."
        )
    return ranks


class Publisher:
    """One rank's step records, from the engine's counters to the sinks.

    What a step is: by default each ``DistributedOptimizer.step()`` ends one (and publishes
    it at once); :meth:`log_step` called after it adds the batch size and the script's values
    to that step. A script whose ``log_step`` finds no step ended by the optimizer since the
    last one (no ``DistributedOptimizer``, or ``log_step`` before ``step()``) ends steps with
    ``log_step`` itself, and from then on the optimizer no longer does. The first step counts
    from the moment metrics started (``hvd.init()`` or :func:`start`).

    Args:
        counters: the engine's counters.
        rank: this process's rank.
        sinks: where records go.
        steps_before: steps this process published before (the first step is the next one).
    """

    def __init__(
        self, counters: Counters, rank: int, sinks: list[Sink], steps_before: int = 0
    ) -> None:
        self.counters = counters
        self.rank = rank
        self.sinks = sinks
        self.step = steps_before
        self._totals, _ = counters.take()
        self._step_end = counters.now()
        # First and last gradient of the current backward pass (0: none yet).
        self._backward = (0.0, 0.0)
        # The last step's time, while log_step may still add to it (0: it may not).
        self._claimable_s = 0.0
        self._script_steps = False
        self._lock = threading.Lock()

    def gradient_ready(self) -> None:
        """A gradient of the current backward pass is ready (``DistributedOptimizer``'s hook)."""
        now = time.perf_counter()
        first = self._backward[0]
        self._backward = (first or now, now)

    def optimizer_stepped(self) -> None:
        """``DistributedOptimizer.step()`` finished: end the step, unless the script's
        ``log_step`` calls end steps."""
        if not self._script_steps:
            timing = self._end_step()
            self._claimable_s = timing.step_s
            self._publish(StepRecord(self.rank, self.step, timing))

    def log_step(self, batch_size: int | None, scalars: Mapping[str, float]) -> None:
        """The script's report (:func:`log_step`): added to the step the optimizer just ended,
        or ending a step of its own."""
        values = {name: float(value) for name, value in scalars.items()}
        if self._claimable_s and not self._script_steps:
            step_s, timing = self._claimable_s, None
        else:
            self._script_steps = True
            timing = self._end_step()
            step_s = timing.step_s
        self._claimable_s = 0.0
        rate = batch_size / step_s if batch_size is not None and step_s > 0 else None
        self._publish(StepRecord(self.rank, self.step, timing, batch_size, rate, values))

    def _end_step(self) -> StepTiming:
        now = self.counters.now()
        totals, intervals = self.counters.take()
        first, last = self._backward
        timing = step_timing(
            self._step_end, now, self._totals, totals, intervals, (first, last) if first else None
        )
        self._totals, self._step_end, self._backward = totals, now, (0.0, 0.0)
        self.step += 1
        return timing

    def _publish(self, record: StepRecord) -> None:
        with self._lock:
            for sink in self.sinks:
                sink.write(record)

    def close(self) -> None:
        with self._lock:
            for sink in self.sinks:
                sink.close()
            self.sinks = []


@dataclass
class _Context:
    """What :func:`start` needs from the running engine (set by ``hvd.init()``)."""

    counters: Counters
    rank: int
    local_rank: int


# Live metrics' state is the process runtime's (hora.common.runtime.LiveMetrics): the running
# publisher, what start() needs from the running engine, and the steps published so far (their
# numbers go on across stop/start and elastic rounds).


def current() -> StepPublisher | None:
    """The running publisher, or ``None``: DistributedOptimizer's hooks ask for every gradient."""
    return runtime().metrics.publisher


def start(
    spec: str, ranks: str = "all", address: str = "127.0.0.1", required: bool | None = None
) -> None:
    """Start publishing live metrics from this rank (closing any publisher before).

    Every rank calls it; ranks not in ``ranks`` publish nothing. ``HORA_METRICS`` does the same
    at ``hvd.init()``.

    Args:
        spec: ``tensorboard:DIR`` (event files in ``DIR/rank<r>``) and/or ``prometheus:PORT``
            (rank r listens on ``PORT`` + its local rank), separated by a comma.
        ranks: ``all``, or the ranks that publish (``0``, ``0,4``).
        address: the address Prometheus endpoints bind.
        required: whether a sink that cannot open here (its port taken, its directory not
            writable) is an error; otherwise the rank logs why and publishes to the other sinks.
            ``None``: ``HORA_METRICS_REQUIRED``.

    Raises:
        ValueError: ``init`` has not been called.
        SettingError: ``spec`` or ``ranks`` cannot be used.
        MetricsError: a sink's package is missing, or (``required``) a sink cannot open.

    Example:
        >>> hvd.metrics.start("tensorboard:runs/metrics,prometheus:9400", ranks="0")
    """
    state = runtime().metrics
    with state.lock:
        context = state.context
        if context is None:
            raise ValueError("hvd.metrics.start() needs hvd.init() first.")
        specs = parse_spec(spec, "hvd.metrics.start")
        if required is None:
            required = read(table.METRICS_REQUIRED)
        _open(context, specs, parse_ranks(ranks), address, required)


def stop() -> None:
    """Stop publishing and close this rank's sinks (files flushed, the port released)."""
    state = runtime().metrics
    with state.lock:
        publisher, state.publisher = state.publisher, None
        if publisher is not None:
            state.steps_done = publisher.step
            publisher.close()


def log_step(
    batch_size: int | None = None, scalars: Mapping[str, float] | None = None, **named: float
) -> None:
    """Report this step's batch size (for samples per second) and any values of your own.

    Called after ``optimizer.step()``, it adds to the step that ``DistributedOptimizer.step()``
    ended; in a script without ``DistributedOptimizer`` each call ends a step. Does nothing
    where metrics are off or this rank does not publish.

    Args:
        batch_size: samples this rank trained on in the step.
        scalars: values by name (names may hold ``/``, as ``train/loss``).
        **named: more values by name (``loss=0.3``); 0-d tensors are read with ``float()``.

    Example:
        >>> hvd.metrics.log_step(batch_size=64, loss=loss.item())
    """
    publisher = current()
    if publisher is not None:
        values = dict(scalars or {})
        values.update(named)
        publisher.log_step(batch_size, values)


def _open(
    context: EngineFacts,
    specs: list[SinkSpec],
    ranks: frozenset[int] | None,
    address: str,
    required: bool,
) -> None:
    stop()
    if ranks is not None and context.rank not in ranks:
        return
    sinks: list[Sink] = []
    try:
        for spec in specs:
            sink = _open_sink(spec, context, address, required)
            if sink is not None:
                sinks.append(sink)
    except Exception:
        for opened in sinks:
            opened.close()
        raise
    state = runtime().metrics
    state.publisher = Publisher(context.counters, context.rank, sinks, state.steps_done)


def _open_sink(spec: SinkSpec, context: EngineFacts, address: str, required: bool) -> Sink | None:
    """One sink; ``None`` when it cannot open here and is not required (the rank says why)."""
    try:
        if spec.kind == "tensorboard":
            return TensorBoardSink(spec.target, context.rank)
        return PrometheusSink(spec.port + context.local_rank, address, context.rank)
    except SinkUnavailable as exc:
        if required:
            raise
        logger.warning(
            "%s; the job goes on without this rank's %s metrics (set HORA_METRICS_REQUIRED=1 "
            "to stop instead).",
            exc,
            spec.kind,
        )
        return None


def attach(counters: Counters, rank: int, local_rank: int) -> None:
    """``hvd.init()``: remember the engine, and start publishing if ``HORA_METRICS`` says so.

    Raises:
        SettingError: a metrics variable cannot be used.
        MetricsError: a sink cannot be opened.
    """
    state = runtime().metrics
    with state.lock:
        context = state.context = _Context(counters, rank, local_rank)
        spec = read(table.METRICS)
        if spec:
            specs = parse_spec(spec)
            ranks = parse_ranks(read(table.METRICS_RANKS))
            required = read(table.METRICS_REQUIRED)
            _open(context, specs, ranks, read(table.METRICS_ADDR), required)


def detach() -> None:
    """``hvd.shutdown()``: close the sinks and forget the engine."""
    state = runtime().metrics
    with state.lock:
        stop()
        state.context = None
