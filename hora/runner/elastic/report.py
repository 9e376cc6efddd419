"""How an elastic job ended, in words: the last round's failed workers, or the last failure seen;
and, while it waits for slots, what it waits for (:func:`shortage`).

Training is over when a worker of the newest round exits with status 0; the round's other workers
then get ``--elastic-timeout`` seconds to finish too (:class:`Ending` records what happened in
that time). horarun exits 0 when all of them exited 0, else 1 with :func:`job_report`. A job
stopped before training was over (an :class:`~hora.runner.elastic.rounds.ElasticError`) reports
its last worker failures instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from hora.common.job.rounds import RoundPlan
from hora.runner.elastic.blacklist import HostManager, describe_hosts
from hora.runner.elastic.rounds import plural
from hora.runner.elastic.workers import Failure, Processes
from hora.runner.supervisor import Worker

# How many worker failures before the last one a report names.
EARLIER_FAILURES = 5


@dataclass
class Ending:
    """The end of training, once a worker of the newest round exited with status 0.

    Attributes:
        since: when that worker's exit was seen (``None``: training goes on).
        finisher: that worker, as ``rank 0 (a:0)``.
        never_joined: worker ids stopped because they never trained in the last round; they
            count neither way.
        stopped_late: worker ids still running ``--elastic-timeout`` seconds after the
            finisher; horarun stopped them.
    """

    since: float | None = None
    finisher: str = ""
    never_joined: set[str] = field(default_factory=set)
    stopped_late: set[str] = field(default_factory=set)


def final_failures(
    plan: RoundPlan, processes: Processes, ending: Ending, timeout_s: float
) -> list[str]:
    """Why the last round did not end well, one line per worker (empty: it did)."""
    lines = []
    for worker_id in plan.ranked():
        if worker_id in ending.never_joined:
            continue
        rank = plan.workers[worker_id].rank
        worker = processes.newest[worker_id]
        if worker_id in ending.stopped_late:
            lines.append(
                f"rank {rank} of round {plan.number} ({worker_id}, worker "
                f"{worker.slot.rank}) was still running {timeout_s:g} s after "
                f"{ending.finisher} finished; horarun stopped it"
            )
            continue
        code = worker.exit_code
        if code is not None and code != 0:
            lines.append(
                f"rank {rank} of round {plan.number} ({worker_id}, worker "
                f"{worker.slot.rank}, pid {worker.pid}) {worker.describe_exit(code)}"
            )
    return lines


def _failed_in_last_round(plan: RoundPlan, processes: Processes, ending: Ending) -> list[Worker]:
    """The last round's workers that failed or were stopped late, the first to end first."""
    failed = [
        processes.newest[w]
        for w in plan.ranked()
        if w not in ending.never_joined
        and (w in ending.stopped_late or (processes.newest[w].exit_code or 0) != 0)
    ]
    failed.sort(key=lambda w: w.exit_time)
    return failed


def _failure_history(failures: Sequence[Failure]) -> list[str]:
    last = failures[-1]
    lines = [f"last worker failure: {last.text}"]
    earlier = [f.text for f in failures[-EARLIER_FAILURES - 1 : -1]]
    if earlier:
        lines.append("earlier failures: " + "; ".join(earlier))
    return lines


def job_report(
    plan: RoundPlan | None,
    processes: Processes,
    ending: Ending,
    failures: Sequence[Failure],
    timeout_s: float,
) -> str:
    """The failure report for the end of the job: the last round's failed workers and the
    stderr of the first of them, or the last worker failure seen (empty: nothing failed)."""
    lines: list[str] = []
    failed: list[Worker] = []
    if plan is not None and ending.since is not None:
        lines = final_failures(plan, processes, ending, timeout_s)
        failed = _failed_in_last_round(plan, processes, ending)
    elif failures:
        lines = _failure_history(failures)
        failed = [failures[-1].worker]
    if failed and failed[0].stderr_tail:
        worker = failed[0]
        lines.append(f"Last lines of worker {worker.slot.rank}'s stderr:")
        lines += [f"    {line}" for line in worker.stderr_tail]
    return "\n".join(lines)


def shortage(manager: HostManager, need: int, have: int, min_np: int, left_s: float) -> str:
    """What a job short of slots waits for, what the hosts offer, and how long it will wait:
    ``waiting for 1 more slot: the hosts found offer 1 (a:1), --min-np 2 needs 2; giving up in
    590 s``.

    Args:
        manager: the hosts.
        need: the slots the next round needs (``-np`` for round 0, else ``--min-np``).
        have: the slots it could have now (fewer than offered while stopped workers end).
        min_np: ``--min-np``.
        left_s: how long the job will still wait.
    """
    usable = manager.usable()
    offered = sum(count for _, count in usable)
    flag = f"--min-np {need}" if need == min_np else f"-np {need}"
    text = (
        f"waiting for {plural(need - have, 'more slot')}: the hosts found offer {offered} "
        f"({describe_hosts(usable)}), {flag} needs {need}"
    )
    if have < offered:
        text += f"; {offered - have} of them held by workers still ending"
    blacklisted = manager.blacklist.hosts()
    if blacklisted:
        text += f"; blacklisted hosts: {', '.join(blacklisted)}"
    out = manager.out()
    if out:
        text += f"; slots taken out after failures: {', '.join(out)}"
    return f"{text}; giving up in {math.ceil(left_s)} s"
