"""The elastic driver's loop: it watches the hosts, the workers and the store, and forms rounds.

Each :meth:`Driver.step` takes discovery's newest hosts, looks at the workers that ended (a failure
is recorded in its round's store space and blacklists its host; a status 0 starts the end of
training), grants a worker's request for a new round, and publishes the next round when the
workers it would have changed. Its bookkeeping lives in three small objects: :class:`Processes`
(the worker processes), :class:`Rounds` (the rounds published) and :class:`Ending` (the end of
training).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hora.common.job.rounds import (
    RoundPlan,
    arrived_key,
    host_of,
    publish_host_update,
    publish_round,
    reset_requested,
    round_prefix,
)
from hora.common.job.store import StoreClient, report_failure
from hora.common.job.store_keys import exit_key
from hora.runner.elastic.blacklist import HostManager, describe_hosts
from hora.runner.elastic.discovery import HostWatcher
from hora.runner.elastic.report import Ending, final_failures, job_report, shortage
from hora.runner.elastic.rounds import (
    ElasticError,
    Limits,
    Rounds,
    describe_change,
    order_workers,
    plural,
    update_flags,
)
from hora.runner.elastic.workers import Failure, Processes, Spawner
from hora.runner.hosts import Host
from hora.runner.supervisor import Worker

# How often the driver looks at its workers, the store and the hosts.
POLL_S = 0.05
# How long a worker's request for a new round waits for a process exit that would explain it.
RESET_GRACE_S = 1.0
# How long a store write about a failed worker may block.
STORE_TIMEOUT_S = 30.0
# While the job waits for slots, how often it says what it has and what it lacks.
WAIT_REPORT_S = 10.0

logger = logging.getLogger("hora.runner")


class Driver:
    """Runs an elastic job's rounds until training finishes or the job cannot go on.

    Args:
        limits: the elastic flags.
        manager: the hosts.
        watcher: where the newest hosts come from.
        spawner: starts worker processes.
        base: the job's store, without a round's prefix.
        usable: filters discovered hosts this job cannot use (reported once each).
        clock: the time (seconds, monotonic).

    It logs to the ``hora.runner`` logger: its progress at debug level (``--verbose``); a round
    after the first at info level when debug lines are not shown (the new workers' numbers
    prefix their output); too few slots as a warning.
    """

    def __init__(
        self,
        limits: Limits,
        manager: HostManager,
        watcher: HostWatcher,
        spawner: Spawner,
        base: StoreClient,
        usable: Callable[[list[Host]], list[Host]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.manager = manager
        self.watcher = watcher
        self.spawner = spawner
        self.supervisor = spawner.supervisor
        self.base = base
        self.usable = usable
        self.clock = clock
        self.procs = Processes()
        self.rounds = Rounds()
        self.ending = Ending()
        self.failures: list[Failure] = []
        self._round_stores: dict[int, StoreClient] = {}

    @property
    def plan(self) -> RoundPlan | None:
        """The newest round published."""
        return self.rounds.plan

    # -------------------------------------------------------- the loop

    def run(self, timeout_s: float | None = None) -> int:
        """Drive the job to its end; returns horarun's exit status.

        Args:
            timeout_s: give up after this long (``hora.run``'s ``timeout_s``; default never).

        Raises:
            ElasticError: the job cannot go on.
            TimeoutError: ``timeout_s`` passed first (the workers are still running).
        """
        deadline = None if timeout_s is None else self.clock() + timeout_s
        while True:
            result = self.step()
            if result is not None:
                return result
            if deadline is not None and self.clock() > deadline:
                raise TimeoutError(f"the job did not finish within {timeout_s:g} s")
            time.sleep(POLL_S)

    def step(self) -> int | None:
        """One look at the hosts, the workers and the store; the exit status once the job ended."""
        now = self.clock()
        self.manager.update(self.usable(self.watcher.hosts()))
        self._collect_exits(now)
        if self.ending.since is not None:
            return self._finish_step(now)
        self._check_blacklist()
        self._check_reset_request(now)
        self._plan_step(now)
        return None

    # -------------------------------------------------------- workers ending

    def _in_round(self, worker: Worker) -> bool:
        plan = self.plan
        return (
            plan is not None
            and self.procs.ids[worker.slot.rank] in plan.workers
            and self.procs.is_newest(worker)
        )

    def _collect_exits(self, now: float) -> None:
        for worker in list(self.supervisor.workers):
            number = worker.slot.rank
            if number in self.procs.handled or not worker.done.is_set():
                continue
            self.procs.handled.add(number)
            code = worker.exit_code or 0
            if not self._in_round(worker):
                self._say_left(worker, code)
                continue
            assert self.plan is not None
            worker_id = self.procs.ids[number]
            rank = self.plan.workers[worker_id].rank
            if code == 0:
                if self.ending.since is None:
                    self._start_finishing(worker_id, rank, now)
                continue
            text = (
                f"rank {rank} of round {self.plan.number} ({worker_id}, worker {number}, "
                f"pid {worker.pid if worker.pid is not None else '?'}) {worker.describe_exit(code)}"
            )
            failure = Failure(worker, worker_id, rank, self.plan.number, text)
            self.failures.append(failure)
            self._record(failure)
            if self.ending.since is None:
                self._blacklist_for(failure, worker.describe_exit(code))

    def _say_left(self, worker: Worker, code: int) -> None:
        """A process outside the newest round ended: stopped, left, or failed (no matter)."""
        number = worker.slot.rank
        worker_id = self.procs.ids[number]
        if number in self.procs.released:
            logger.debug("worker %d (%s) stopped", number, worker_id)
        elif code == 0:
            logger.debug("worker %d (%s) left the job (not in the newest round)", number, worker_id)
        else:
            logger.debug(
                "worker %d (%s), not in the newest round, %s",
                number,
                worker_id,
                worker.describe_exit(code),
            )

    def _round_store(self, number: int) -> StoreClient:
        if number not in self._round_stores:
            base = self.base
            self._round_stores[number] = StoreClient(
                base.addr, base.port, base.secret, STORE_TIMEOUT_S, prefix=round_prefix(number)
            )
        return self._round_stores[number]

    def _record(self, failure: Failure) -> None:
        """Tell the round's survivors how the worker ended (their collectives then fail)."""
        try:
            store = self._round_store(failure.round)
            store.set_signed(exit_key(failure.rank), failure.text.encode())
            report_failure(store, failure.text)
        except Exception as exc:  # survivors still notice through Gloo
            logger.debug("could not record the end of rank %d in the store: %s", failure.rank, exc)

    def _blacklist_for(self, failure: Failure, how: str) -> None:
        reason = f"rank {failure.rank} ({failure.worker_id}) {how}"
        taken = self.manager.take_out(failure.worker_id, self.limits.min_np)
        if taken is not None:
            reason += f"; {taken.summary}"
            logger.debug("%s: its worker %s %s", taken.detail, failure.worker_id, how)
            for worker_id, worker in self.procs.newest.items():
                number = worker.slot.rank
                if taken.stops(worker_id) and number not in self.procs.handled:
                    if number not in self.procs.released:
                        logger.debug(
                            "stopping worker %d (%s) on blacklisted %s",
                            number,
                            worker_id,
                            taken.name,
                        )
                    self.procs.release(worker)
        self.rounds.forced.append(reason)

    def _check_blacklist(self) -> None:
        if not self.rounds.forced:
            return
        discovered = self.manager.discovered()
        if discovered and all(self.manager.blacklist.blocked(h) for h, _ in discovered):
            names = ", ".join(h for h, _ in discovered)
            raise ElasticError(
                f"every host is blacklisted after its workers failed ({names}); stopping the job."
            )

    def _check_reset_request(self, now: float) -> None:
        rounds = self.rounds
        plan = rounds.plan
        if plan is None or plan.number in rounds.reset_seen:
            return
        if rounds.reset_asked is not None and rounds.reset_asked[0] == plan.number:
            asked_at = rounds.reset_asked[1]
        else:
            try:
                if not reset_requested(self.base, plan.number):
                    return
            except Exception:  # a store hiccup; look again next time
                return
            asked_at = now
            rounds.reset_asked = (plan.number, now)
        # A worker's collective often fails because a peer died, before horarun sees that
        # peer's exit: give the exit a moment to arrive, so that one failure makes one round.
        if now - asked_at >= RESET_GRACE_S:
            rounds.reset_seen.add(plan.number)
            rounds.forced.append(
                f"a worker of round {plan.number} asked for a new round (a collective failed "
                "while every worker process still ran)"
            )

    # -------------------------------------------------------- forming rounds

    def _plan_step(self, now: float) -> None:
        rounds = self.rounds
        plan = rounds.plan
        running = self.procs.running()
        stopping = self.procs.stopping()
        previous = plan.ranked() if plan is not None else []
        available = self.manager.available()
        order = order_workers(
            previous, running, stopping, available, self.limits.max_np, self.manager.out()
        )
        if plan is not None and not rounds.forced and set(order) == set(plan.workers):
            rounds.short_since = None
            return
        need = self.limits.np if plan is None else self.limits.min_np
        if len(order) < need:
            self._wait_for_slots(now, need, len(order))
            return
        rounds.short_since = None
        self._publish(order, running, stopping)

    def _wait_for_slots(self, now: float, need: int, have: int) -> None:
        """Too few slots for the next round: say so every :data:`WAIT_REPORT_S`, and stop the
        job once ``--elastic-timeout`` has passed.

        Raises:
            ElasticError: the time is up.
        """
        limits = self.limits
        rounds = self.rounds
        blacklisted = ", ".join(self.manager.blacklist.hosts()) or "none"
        available = self.manager.usable()
        if rounds.short_since is None:
            rounds.short_since = now
            rounds.short_told = None
        waited = now - rounds.short_since
        if waited < limits.timeout_s:
            if rounds.short_told is None or now - rounds.short_told >= WAIT_REPORT_S:
                rounds.short_told = now
                left_s = limits.timeout_s - waited
                logger.warning("%s", shortage(self.manager, need, have, limits.min_np, left_s))
            return
        if rounds.plan is None:
            raise ElasticError(
                f"timed out after {limits.timeout_s:g} s waiting for {need} slots to start the "
                f"job (-np {limits.np}): the hosts found offer {have} "
                f"({describe_hosts(self.manager.discovered())}; blacklisted hosts: "
                f"{blacklisted}). Check the hosts (or the host discovery script's output), "
                "lower -np, or raise --elastic-timeout."
            )
        out = self.manager.out()
        taken = f"; slots taken out after failures: {', '.join(out)}" if out else ""
        raise ElasticError(
            f"fewer than --min-np {need} slots were available for {limits.timeout_s:g} s "
            f"(--elastic-timeout): {have} usable ({describe_hosts(available)}); blacklisted "
            f"hosts: {blacklisted}{taken}. Stopping the job."
        )

    def _reason_for_next(self, order: list[str], running: set[str], stopping: set[str]) -> str:
        """Why the round after the newest one comes; counts it against ``--reset-limit`` and
        publishes a host-change notice when hosts changed.

        Raises:
            ElasticError: no survivor would pass the state on, or the reset limit is reached.
        """
        rounds = self.rounds
        plan = rounds.plan
        assert plan is not None
        number = rounds.next_number
        survivors = [w for w in order if w in plan.workers and w in running and w not in stopping]
        if not survivors:
            gone = ", ".join(dict.fromkeys(host_of(w) for w in plan.workers))
            why = "; ".join(rounds.forced) or describe_change(plan.workers, order)
            raise ElasticError(
                f"no worker of round {plan.number} is left to pass the training state on to "
                f"round {number} (its hosts {gone} are gone or blacklisted; {why}). "
                "Stopping the job."
            )
        reason = "; ".join(rounds.forced) or describe_change(plan.workers, order)
        limit = self.limits.reset_limit
        if limit is not None and rounds.resets >= limit:
            raise ElasticError(
                f"the job was reset {plural(rounds.resets + 1, 'time')}, more than --reset-limit "
                f"{limit} allows (this reset: {reason}). Stopping the job."
            )
        rounds.resets += 1
        if not rounds.forced:
            rounds.updates += 1
            publish_host_update(self.base, rounds.updates, update_flags(plan.workers, order))
        return reason

    def _publish(self, order: list[str], running: set[str], stopping: set[str]) -> None:
        rounds = self.rounds
        number = rounds.next_number
        reason = "the job starts"
        if rounds.plan is not None:
            reason = self._reason_for_next(order, running, stopping)
        new_plan = RoundPlan.from_order(number, rounds.updates, order)
        publish_round(self.base, new_plan)
        rounds.plan = new_plan
        rounds.forced = []
        hosts = len({host_of(w) for w in order})
        head = f"round {number}: {plural(len(order), 'worker')} on {plural(hosts, 'host')}"
        verbose = logger.isEnabledFor(logging.DEBUG)
        if verbose:
            ranks = ", ".join(f"rank {r} {w}" for r, w in enumerate(order))
            logger.debug("%s (%s), reason: %s", head, ranks, reason)
        started = []
        for worker_id in order:
            if worker_id not in running:
                worker = self.spawner.spawn(worker_id)
                self.procs.add(worker_id, worker, number)
                started.append(f"worker {worker.slot.rank} ({worker_id})")
        if not verbose and number > 0:
            # The new workers' numbers prefix their output: say whose they are.
            new = f"; started {', '.join(started)}" if started else ""
            logger.info("%s, reason: %s%s", head, reason, new)

    # -------------------------------------------------------- the end

    def _start_finishing(self, worker_id: str, rank: int, now: float) -> None:
        plan = self.plan
        assert plan is not None
        self.ending.since = now
        self.ending.finisher = f"rank {rank} ({worker_id})"
        others = [w for w in plan.workers if w != worker_id]
        waiting = (
            f"; waiting up to {self.limits.timeout_s:g} s for the other "
            f"{plural(len(others), 'worker')} of round {plan.number}"
            if others
            else ""
        )
        logger.debug(
            "%s finished with exit status 0: training is over%s", self.ending.finisher, waiting
        )
        running = self.procs.running()
        arrived = self._arrivals(plan)
        formed = len(arrived) == plan.size
        for other, worker in self.procs.newest.items():
            number = worker.slot.rank
            if other not in running or number in self.procs.released:
                continue
            if other not in plan.workers:
                # Left out of the round and still running: nothing is left for it to do.
                self.procs.release(worker)
                continue
            if formed:
                continue
            # The round never formed: a worker waiting at its barrier, or started to join it
            # (after round 0), never trained in it; one still in an earlier round may be
            # finishing too (saving a checkpoint, say), and round 0's workers may still be busy
            # before hvd.init(): those get their time.
            joiner = plan.number > 0 and self.procs.started_for.get(number) == plan.number
            if other in arrived or joiner:
                logger.debug(
                    "stopping worker %d (%s): it never trained in round %d",
                    number,
                    other,
                    plan.number,
                )
                self.ending.never_joined.add(other)
                self.procs.release(worker)

    def _arrivals(self, plan: RoundPlan) -> set[str]:
        """The workers that reached ``plan``'s barrier (all of them, if the store cannot say)."""
        try:
            store = self._round_store(plan.number)
            return {w for w, a in plan.workers.items() if store.marked(arrived_key(a.rank))}
        except Exception:  # then the round counts as formed
            return set(plan.workers)

    def _finish_step(self, now: float) -> int | None:
        plan, since = self.plan, self.ending.since
        assert plan is not None and since is not None
        running = self.procs.running()
        waiting = [w for w in plan.workers if w in running and w not in self.ending.never_joined]
        if waiting and now - since < self.limits.timeout_s:
            return None
        for worker_id in waiting:
            self.ending.stopped_late.add(worker_id)
            self.procs.release(self.procs.newest[worker_id])
        return 0 if not self.final_failures() else 1

    def final_failures(self) -> list[str]:
        """Why the last round did not end well, one line per worker (empty: it did)."""
        assert self.plan is not None
        return final_failures(self.plan, self.procs, self.ending, self.limits.timeout_s)

    def report(self) -> str:
        """The failure report for the end of the job (see :func:`job_report`)."""
        return job_report(self.plan, self.procs, self.ending, self.failures, self.limits.timeout_s)
