"""The stall inspector: notices when some ranks wait for others that never submit a tensor.

It reads the negotiation table (which every rank holds in full) and, on global rank 0, logs which
ranks are missing which tensors. Past the shutdown limit, when one is set (by default none is, as
in Horovod: a rank may work alone as long as it needs), it returns a reason to stop the job. It
also recognises a deadlock, where every rank waits for a tensor another rank never submits, from
what each rank says it waits for; that ends the job whatever the shutdown limit. It knows the
table's contents, never tensors or stores.
"""

from __future__ import annotations

import logging
import time

from hora.common.engine.negotiation import MessageTable
from hora.common.vocabulary.message import Key, key_label

logger = logging.getLogger("hora")

MAX_NAMES_PER_RANK = 6


class StallInspector:
    """Checks the table at most once per warning period.

    Args:
        warning_time_s: how long a tensor may wait before a warning.
        shutdown_time_s: how long before the job is stopped (0, the default: never).
        enabled: whether to check at all.
    """

    def __init__(self, warning_time_s: float, shutdown_time_s: float, enabled: bool) -> None:
        self.warning_time_s = warning_time_s
        self.shutdown_time_s = shutdown_time_s
        self.enabled = enabled
        self._last_check = time.monotonic()
        if enabled and 0 < shutdown_time_s < warning_time_s:
            logger.warning(
                "HORA_STALL_SHUTDOWN_TIME_SECONDS (%g) is shorter than "
                "HORA_STALL_CHECK_TIME_SECONDS (%g); stalled jobs will not be shut down.",
                shutdown_time_s,
                warning_time_s,
            )
            self.shutdown_time_s = 0.0

    def due(self) -> bool:
        return self.enabled and time.monotonic() - self._last_check >= min(self.warning_time_s, 5.0)

    def check_if_due(self, table: MessageTable) -> str | None:
        """:meth:`check`, when a check is due and the table holds anything."""
        return self.check(table) if self.due() and table else None

    def check(self, table: MessageTable) -> str | None:
        """Log a warning for stalled tensors; return a shutdown reason when past the limit."""
        now = time.monotonic()
        self._last_check = now
        missing: dict[int, list[str]] = {}
        stalled_too_long: set[int] = set()
        longest = 0.0
        for key, entry in table.pending.items():
            waited = now - entry.first_seen
            if waited < self.warning_time_s:
                continue
            for rank in table.missing_ranks(key):
                missing.setdefault(rank, []).append(key_label(key))
                if self.shutdown_time_s > 0 and waited >= self.shutdown_time_s:
                    stalled_too_long.add(rank)
            longest = max(longest, waited)
        if not missing:
            return None
        text = self.report(missing, stalled_too_long, longest)
        if stalled_too_long:
            logger.error(text)
            return text
        logger.warning(text)
        return None

    def report(self, missing: dict[int, list[str]], marked: set[int], longest: float) -> str:
        lines = [
            "One or more tensors were submitted to be reduced, gathered or broadcasted by "
            f"subset of ranks and are waiting for remainder of ranks for more than "
            f"{int(self.warning_time_s)} seconds. This may indicate that different ranks are "
            "trying to submit different tensors or that only subset of ranks is submitting "
            "tensors, which will cause deadlock.",
            "Missing ranks:",
        ]
        for rank in sorted(missing):
            names = missing[rank]
            shown = ", ".join(names[:MAX_NAMES_PER_RANK])
            more = " ..." if len(names) > MAX_NAMES_PER_RANK else ""
            mark = "!" if rank in marked else ""
            lines.append(f"{rank}{mark}: [{shown}{more}]")
        if marked:
            lines.append(
                'One or more rank (marked by "!") is stalled for longer than '
                f"{int(self.shutdown_time_s)} seconds. Will shutdown."
            )
        else:
            lines.append(
                f"(longest wait {longest:.0f} s) Check that every rank submits the same tensor "
                "names: a rank that skips a step, or names tensors differently, stalls the job."
            )
        return "\n".join(lines)

    def deadlock(
        self, table: MessageTable, waits: dict[int, list[Key]], idle_s: float
    ) -> str | None:
        """The shutdown reason when every rank waits for a tensor that is still negotiated.

        Args:
            table: the negotiation table.
            waits: for every rank of the job, the keys its blocked threads wait for.
            idle_s: how long nothing has arrived in, or left, the table.

        Returns:
            ``None`` unless every rank waits on a key that some other rank has not submitted:
            then nobody can move, and the text says who waits for what from whom.
        """
        lines = []
        for rank in sorted(waits):
            pending = [key for key in waits[rank] if key in table.pending]
            blocking = [(key, table.missing_ranks(key)) for key in pending]
            blocking = [(key, missing) for key, missing in blocking if missing]
            if not blocking:
                return None
            key, missing = blocking[0]
            who = ranks_text(missing)
            verb = "has" if len(missing) == 1 else "have"
            lines.append(
                f"  rank {rank} waits for {key_label(key)}, which {who} {verb} not submitted"
            )
        return "\n".join(
            [
                f"Deadlock: every rank waits for a collective that another rank has not submitted, "
                f"and nothing has changed for {idle_s:.0f} s:",
                *lines,
                "Every rank must make the same collective calls, in the same order or under the "
                "same names: a rank that skipped a call, took another branch, or stopped half-way "
                "through a sequence of calls (an exception caught and ignored) leaves the others "
                "waiting. hora ends the job now instead of waiting forever.",
            ]
        )


def ranks_text(ranks: list[int]) -> str:
    """``"rank 1"``, ``"ranks 1, 2"``: ranks as messages name them."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)
