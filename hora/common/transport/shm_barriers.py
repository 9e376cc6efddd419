"""How the members of a shared-memory communicator wait for each other.

:class:`Barriers` holds this member's counters in the segment (:mod:`.shm_segment`): its arrival
count (a barrier: store the next count, then wait until every other member's has reached it),
one count per peer for the pairs of ``sendrecv``, and the fence that an operation through
alternating half-slots (:mod:`.shm_halves`) leaves behind. A wait spins for a few microseconds,
then sleeps on a futex with a pidfd watch on the peers; a lost peer, a timeout or an abort comes
out as a :class:`~hora.common.transport.TransportError` that names the member.

It knows counters and deadlines; not buffers, nor the collectives that wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hora.common.transport import TransportError
from hora.common.transport.shm_segment import Aborted, PeerLost, Segment, WaitTimeout


class Barriers:
    """This member's barriers and pair waits on ``segment``.

    Args:
        segment: the mapped segment (this member's view).
        timeout_s: how long any one operation may wait for its peers.
        describe: how errors name a member.
        limit: the setting ``timeout_s`` comes from, for messages (``""``: none named).
    """

    def __init__(
        self,
        segment: Segment,
        timeout_s: float,
        describe: Callable[[int], str],
        limit: str = "",
    ) -> None:
        self.timeout_s = timeout_s
        self._limit = f"after {limit} ({timeout_s:g} s)" if limit else f"({timeout_s:g} s)"
        self._segment = segment
        self._describe = describe
        self._others = [m for m in range(segment.size) if m != segment.rank]
        self._arrivals = 0
        self._pairs = [0] * segment.size
        # Set after an operation through alternating half-slots; the next operation that writes
        # a whole slot first waits until the peers have read the half used last (``fence``).
        self._unfenced = False

    def deadline(self, timeout_s: float | None = None) -> float:
        """When an operation started now must give up waiting (``timeout_s``, else the
        communicator's)."""
        return time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

    def barrier(self, deadline: float) -> None:
        """Arrive, and return once every other member has arrived as often."""
        self._arrivals += 1
        self._segment.arrive(self._arrivals)
        self.wait(lambda: self._segment.wait_arrivals(self._others, self._arrivals, deadline))

    def fence(self, deadline: float) -> None:
        """Before an operation writes the whole slot: wait until every member has read what
        the last operation through alternating half-slots left in it."""
        if self._unfenced:
            self._unfenced = False
            self.barrier(deadline)

    def leave_unfenced(self) -> None:
        """An operation through alternating half-slots ended: its peers may still read it."""
        self._unfenced = True

    def next_mark(self, peer: int) -> int:
        """The count of this member's next step of a pair with ``peer``."""
        self._pairs[peer] += 1
        return self._pairs[peer]

    def meet(self, peer: int, mark: int, which: int, deadline: float) -> None:
        """Post ``mark`` on counter ``which`` for ``peer``, then wait until ``peer`` has posted
        as much on its own."""
        self._segment.post(peer, mark, which)
        self.wait(lambda: self._segment.wait_pair(peer, mark, which, deadline))

    def wait(self, waiting: Callable[[], None]) -> None:
        """Run the segment's wait ``waiting``; its failure as a :class:`TransportError`."""
        try:
            waiting()
        except PeerLost as exc:
            raise TransportError(
                f"{self._shown(exc)} of this host's shared-memory group exited during a "
                "collective (connection closed)"
            ) from None
        except WaitTimeout as exc:
            raise TransportError(
                f"timed out waiting for {self._shown(exc)} in a shared-memory collective "
                f"{self._limit}"
            ) from None
        except Aborted:
            raise TransportError("the communicator was aborted") from None

    def _shown(self, exc: BaseException) -> str:
        text = str(exc)
        if text.startswith("member "):
            number = text.split()[1]
            if number.isdigit():
                return self._describe(int(number)) + text[len(f"member {number}") :]
        return text
