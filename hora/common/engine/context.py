"""What the parts of one engine are built from: made once by :class:`~hora.common.engine.Engine`
and handed to each part, instead of the same dozen values passed again and again.

- :class:`EngineContext`: what every part of one engine shares: the job's facts (settings,
  rank, size), the store and its keys, and the live parts every thread meets (the intake, the
  tracer, the counters, the communicators, the finisher), and whether the watcher saw the job
  fail.
- :class:`NegotiationState`: what negotiated cycles and parked ranks read: the message table
  every rank holds alike, the process sets, and the stall inspector that watches the table.

Both are frozen: a part reads them, and copies what its loops use into attributes of its own
when it is built (a lookup on the context in a hot path costs as much as any other).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hora.common.engine.communicators import Communicators
from hora.common.engine.counters import Counters
from hora.common.engine.finisher import Finisher
from hora.common.engine.intake import Intake
from hora.common.engine.negotiation import MessageTable
from hora.common.engine.stall import StallInspector
from hora.common.engine.tracing import Tracer
from hora.common.job.store import StoreClient
from hora.common.job.store_keys import GenerationKeys
from hora.common.process_sets import ProcessSetTable
from hora.common.vocabulary.config import Settings


@dataclass(frozen=True, slots=True)
class EngineContext:
    """What every part of one engine shares.

    Attributes:
        settings: engine settings.
        rank, size: this rank and the job's size.
        store: the job's store (doorbells, stall and deadlock records), and ``keys`` its
            generation's keys.
        intake: what user threads hand in, and where the engine thread waits.
        tracer: the engine's timeline and NVTX ranges.
        counters: what the engine did, for live metrics.
        communicators: each process set's communicators, and the control communicator.
        finisher: the thread that completes the allreduces a cycle starts.
        failure_seen: whether the watcher saw the job fail.
    """

    settings: Settings
    rank: int
    size: int
    store: StoreClient
    keys: GenerationKeys
    intake: Intake
    tracer: Tracer
    counters: Counters
    communicators: Communicators
    finisher: Finisher
    failure_seen: Callable[[], bool]


@dataclass(frozen=True, slots=True)
class NegotiationState:
    """What negotiated cycles and parked ranks read.

    Attributes:
        table: the negotiation table (which requests every rank has submitted).
        process_sets: the engine's table of process sets.
        stall: the stall inspector (stalls and deadlocks are read from ``table``).
    """

    table: MessageTable
    process_sets: ProcessSetTable
    stall: StallInspector
