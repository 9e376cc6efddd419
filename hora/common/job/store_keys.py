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


# ---------------------------------------------------------------- elastic rounds
# (hora/common/job/rounds.py says what each holds and who writes it)

# The newest round's number.
ELASTIC_ROUND = "elastic/round"
# The driver's latest host-change notice.
ELASTIC_HOST_UPDATES = "elastic/hosts-updated"


def elastic_plan(number: int) -> str:
    """Round ``number``'s plan (workers, ranks, world size)."""
    return f"elastic/round/{number}/plan"


def elastic_reset(number: int) -> str:
    """Written by a worker that asks for round ``number`` to be replaced by a new one."""
    return f"elastic/round/{number}/reset"


def elastic_round_prefix(number: int) -> str:
    """The store prefix under which round ``number``'s engine keeps its keys."""
    return f"r{number}/"


def elastic_arrived(rank: int) -> str:
    """Written (under the round's prefix) by rank ``rank`` once it joined its round."""
    return f"elastic/arrived/{rank}"


# ---------------------------------------------------------------- torchrun's store
# Under torchrun, ranks agree on a round token in the agent's store (see joining.py); ``prefix``
# is the run's own prefix there.


def torchrun_hello(prefix: str, rank: int) -> str:
    """Rank ``rank``'s greeting: a fresh nonce."""
    return f"{prefix}round/hello/{rank}"


def torchrun_welcome(prefix: str, nonce: bytes) -> str:
    """Rank 0's answer to the greeting with ``nonce``: the round token, signed."""
    return f"{prefix}round/welcome/{nonce.hex()}"


def torchrun_ready(prefix: str, token: str, rank: int) -> str:
    """Written by rank ``rank`` once it has the round token."""
    return f"{prefix}{token}/ready/{rank}"


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

    def settings(self, rank: int) -> str:
        """A rank's values of the settings every rank must share, published at ``init``."""
        return f"{self._prefix}/settings/{rank}"

    def settings_verdict(self) -> str:
        """Rank 0's finding on those values at ``init``: alike, or which ranks differ."""
        return f"{self._prefix}/settings-verdict"

    def timeline_closed(self, rank: int) -> str:
        """Written by a rank that closed its timeline file (rank 0 then merges them)."""
        return f"{self._prefix}/timeline-closed/{rank}"

    def detached(self, rank: int) -> str:
        """Written by a rank at shutdown, for a rank that hosts the store and waits at exit."""
        return f"detached/{self.generation}/{rank}"


class ScopeKeys:
    """The keys of one communicator's rendezvous, under its scope (:meth:`GenerationKeys.scope`):
    how its members find out which of them share a host, make their shared memory, and agree
    on the GPUs and MPI ranks they bring."""

    def __init__(self, scope: str) -> None:
        self.scope = scope

    def host_of(self, member: int) -> str:
        """A member's host identity (boot id, ``/dev/shm`` device, network namespace)."""
        return f"{self.scope}/host-of/{member}"

    def shm_created(self, group: int) -> str:
        """The segment file a host group's first member made (or why it could not)."""
        return f"{self.scope}/shm-created/{group}"

    def shm_ok(self, member: int) -> str:
        """Whether shared memory works for a member (empty), else why not."""
        return f"{self.scope}/shm-ok/{member}"

    def gpu_of(self, member: int) -> str:
        """The GPU a member's NCCL communicator would use."""
        return f"{self.scope}/gpu-of/{member}"

    def mpi_member(self, member: int) -> str:
        """A member's rank in the job's MPI communicator."""
        return f"{self.scope}/mpi-member/{member}"

    def lane(self) -> str:
        """The scope of the set's lane, the segment of its fast path."""
        return f"{self.scope}/lane"

    def cross(self, local_rank: int) -> str:
        """The scope of the Gloo group across hosts of the members with this local rank."""
        return f"{self.scope}/cross{local_rank}"
