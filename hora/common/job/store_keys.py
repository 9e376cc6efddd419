"""Every key hora keeps in the job's store, named in one place.

Keys live under the job's namespace (see :class:`hora.common.job.store.StoreClient`). Keys of
the whole job are constants here; keys of one engine generation (``hvd.init`` after
``hvd.shutdown``, or an elastic round, starts a new one) come from :class:`GenerationKeys`, so
that a generation never reads another's values.
"""

from __future__ import annotations

# Set (first writer wins) when any worker or the launcher sees the job fail.
FAILURE = "failure"
# Set (first writer wins, signed "rank N: why") by a worker that ends the job on purpose.
CAUSE = "cause"
# Names the doorbell key parked ranks wait on (written by global rank 0 when it parks).
PARKED = "parked"


def exit_key(rank: int) -> str:
    """Where the launcher records how a rank's process ended."""
    return f"exit/{rank}"


class GenerationKeys:
    """The keys of one engine generation."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self._prefix = f"g{generation}"

    def scope(self, name: str) -> str:
        """The prefix of a communicator's own rendezvous (``control``, ``ps0``, ...)."""
        return f"{self._prefix}/{name}"

    def wake(self, round_: int) -> str:
        """The doorbell of parking round ``round_``: written to wake parked ranks."""
        return f"{self._prefix}/wake/{round_}"

    def alive(self, rank: int) -> str:
        """Written by a rank that saw a collective fail and is still alive."""
        return f"{self._prefix}/alive/{rank}"

    def waits(self, rank: int) -> str:
        """What a rank's blocked threads wait for (the deadlock check reads it)."""
        return f"{self._prefix}/waits/{rank}"

    def steady_wait(self, batch: int) -> str:
        """Written by a rank that has waited long inside steady-state batch ``batch``."""
        return f"{self._prefix}/steady_wait/{batch}"

    def topology(self, rank: int) -> str:
        """A rank's host facts, exchanged at ``init``."""
        return f"{self._prefix}/topology/{rank}"

    def timeline_closed(self) -> str:
        """Counts the ranks that closed their timeline files (rank 0 then merges them)."""
        return f"{self._prefix}/timeline-closed/"

    def detached(self, rank: int) -> str:
        """Written by a rank at shutdown, for a rank that hosts the store and waits at exit."""
        return f"detached/{self.generation}/{rank}"
