"""An elastic job's worker processes: starting one for a worker id, and keeping track of them.

Every process gets a number when horarun starts it (0, 1, 2, ... in start order, so in round 0 a
worker's number is its rank); its output is prefixed with that number for as long as it lives,
whatever its rank in later rounds. A worker id (``host:slot``) may have several processes over the
job's life, one at a time: :class:`Processes` knows the newest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from hora.common.job.rounds import ELASTIC_VAR, WORKER_ID_VAR
from hora.common.vocabulary import settings_table as table
from hora.runner.hosts import Slot
from hora.runner.job import Job
from hora.runner.supervisor import Supervisor, Worker

logger = logging.getLogger("hora.runner")


@dataclass
class Spawner:
    """Starts the process of a worker id through the job, numbered in start order.

    Attributes:
        job: the job's store, supervisor and worker environment.
        is_remote: whether a host is another machine.
        next_number: the number the next process gets.
    """

    job: Job
    is_remote: Callable[[str], bool]
    next_number: int = 0

    @property
    def supervisor(self) -> Supervisor:
        return self.job.supervisor

    def spawn(self, worker_id: str) -> Worker:
        host, _, index = worker_id.rpartition(":")
        number = self.next_number
        self.next_number += 1
        # The slot only names the process for output and logs: its "rank" is the worker's
        # number (ranks change from round to round; the driver publishes them in the store).
        slot = Slot(
            hostname=host,
            rank=number,
            local_rank=int(index),
            local_size=1,
            cross_rank=0,
            cross_size=1,
            size=1,
        )
        env = {
            ELASTIC_VAR: "1",
            WORKER_ID_VAR: worker_id,
            **dict.fromkeys(table.HOSTNAME.environ_names, host),
        }
        remote = self.is_remote(host)
        where = "over ssh" if remote else "on this machine"
        logger.debug(
            "starting worker %d (%s) %s: %s", number, worker_id, where, " ".join(self.job.command)
        )
        return self.job.spawn(slot, env, remote=remote)


@dataclass
class Failure:
    """A worker of a round that ended with a non-zero status (or was stopped)."""

    worker: Worker
    worker_id: str
    rank: int
    round: int
    text: str  # "rank 1 of round 0 (b:0, worker 1, pid 42) exited with code 1"


@dataclass
class Processes:
    """The worker processes horarun started, by number and by worker id.

    Attributes:
        newest: the newest process of each worker id.
        ids: the worker id of each number.
        started_for: the round each number was started for.
        handled: the numbers whose end the driver has looked at.
        released: the numbers horarun is stopping on purpose.
    """

    newest: dict[str, Worker] = field(default_factory=dict)
    ids: dict[int, str] = field(default_factory=dict)
    started_for: dict[int, int] = field(default_factory=dict)
    handled: set[int] = field(default_factory=set)
    released: set[int] = field(default_factory=set)

    def add(self, worker_id: str, worker: Worker, round_number: int) -> None:
        """A process was started for ``worker_id`` to join round ``round_number``."""
        self.newest[worker_id] = worker
        self.ids[worker.slot.rank] = worker_id
        self.started_for[worker.slot.rank] = round_number

    def running(self) -> set[str]:
        """The worker ids whose newest process has not ended (as far as the driver looked)."""
        return {
            worker_id
            for worker_id, worker in self.newest.items()
            if worker.slot.rank not in self.handled
        }

    def stopping(self) -> set[str]:
        """The worker ids with a process horarun is stopping and that has not ended yet."""
        return {self.ids[n] for n in self.released if n not in self.handled}

    def release(self, worker: Worker) -> None:
        """Stop ``worker`` on purpose: its end is then no failure."""
        self.released.add(worker.slot.rank)
        worker.release_stdin()

    def is_newest(self, worker: Worker) -> bool:
        """Whether ``worker`` is the newest process of its worker id, not being stopped."""
        worker_id = self.ids[worker.slot.rank]
        return self.newest.get(worker_id) is worker and worker.slot.rank not in self.released
