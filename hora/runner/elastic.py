"""``horarun``'s elastic driver: a job that re-forms around lost workers and changing hosts.

An elastic job (``--min-np``, ``--max-np`` or ``--host-discovery-script``) trains in numbered
*rounds* (see :mod:`hora.common.elastic`, the protocol between this driver and the workers). The
driver:

* finds hosts: from ``--host-discovery-script`` (run every second by a thread; each output line is
  ``host`` or ``host:slots``) or from ``-H``/``--hostfile`` (then only failures change who trains).
  A host with ``n`` slots gives the worker ids ``host:0 .. host:(n-1)``; hosts keep the order in
  which they were first seen;
* starts round 0 once ``-np`` slots are available (waiting up to ``--elastic-timeout``), with every
  available slot up to ``--max-np``;
* orders each round's ranks so that rank 0 holds the freshest state: the workers that survive from
  the previous round first, in their previous rank order, host by host (a host's workers stay
  contiguous), then the new workers; a process is started only for a worker id that has none;
* on a worker of the current round ending with a non-zero status or a signal: records it in that
  round's store space (so the survivors' collectives fail at once and name it), blacklists its
  host (all of it; its other workers are stopped) for good, or for a growing cooldown with
  ``--blacklist-cooldown-range``, and publishes the next round; a worker that asks for a new round
  (a collective failed while every process still ran) gets one with the same workers;
* on hosts added or removed (so that the round would change): publishes a host-change notice,
  then the next round; workers on removed hosts are left out and exit with status 0 themselves;
* waits up to ``--elastic-timeout`` when fewer than ``--min-np`` slots are available, then stops
  the job; stops it too when every host is blacklisted, when no worker of the previous round is
  left to pass the training state on, or when the job would re-form more often than
  ``--reset-limit`` allows (every round after round 0 counts, as in Horovod);
* ends the job when a worker of the current round exits with status 0 (training finished): the
  round's other workers get ``--elastic-timeout`` seconds to finish too; horarun exits 0 when all
  of them exited 0, else 1 with a report naming the worker.

Output prefix: every worker *process* gets a number when horarun starts it (0, 1, 2, ... in
start order, so in round 0 a worker's number is its rank) and its lines are prefixed
``[<number>]<stdout>:`` / ``[<number>]<stderr>:`` for as long as it lives, whatever its rank in
later rounds; ``--output-filename DIR`` writes ``DIR/rank.<number>/``. With ``--verbose`` horarun
says which worker id (``host:slot``) each number is and logs every round; without it, it prints one
line per round after round 0, and errors.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hora.common.elastic import (
    ELASTIC_VAR,
    HOSTS_ADDED,
    HOSTS_REMOVED,
    WORKER_ID_VAR,
    RoundPlan,
    arrived_key,
    host_of,
    publish_host_update,
    publish_round,
    reset_requested,
    round_prefix,
)
from hora.common.rendezvous import StoreClient, report_failure
from hora.common.store_keys import exit_key
from hora.runner import options
from hora.runner.hosts import Host, HostError, Slot, is_local, parse_hostfile, parse_hosts
from hora.runner.options import worker_env
from hora.runner.remote import (
    SshSettings,
    interface_address,
    rendezvous_address,
    require_ssh,
    ssh_settings,
)
from hora.runner.supervisor import (
    OutputForwarder,
    Supervisor,
    Worker,
    install_signal_handlers,
)

# How often the driver looks at its workers, the store and the hosts.
POLL_S = 0.05
# How often the discovery script runs, and how long one run may take.
DISCOVERY_INTERVAL_S = 1.0
DISCOVERY_TIMEOUT_S = 60.0
DEFAULT_ELASTIC_TIMEOUT_S = 600.0
# Workers wait this much longer than the driver (HORA_ELASTIC_TIMEOUT), so that when a round
# cannot form, the driver, which sees the whole job, gives up first and says why.
WORKER_TIMEOUT_SLACK_S = 10.0
# How long a worker's request for a new round waits for a process exit that would explain it.
RESET_GRACE_S = 1.0
# How long a store write about a failed worker may block.
STORE_TIMEOUT_S = 30.0

# Topology variables an elastic worker must not inherit: the driver assigns ranks per round.
_TOPOLOGY_VARS = frozenset(
    f"{prefix}{name}"
    for prefix in ("HORA_", "HOROVOD_")
    for name in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")
)

_HOST_NAME = re.compile(r"^[\w.@-]+$")


class ElasticError(RuntimeError):
    """The elastic job cannot go on; the message tells the user why."""


class DiscoveryError(RuntimeError):
    """The host discovery script failed, or printed a line that is not ``host[:slots]``."""


# ---------------------------------------------------------------- hosts


def parse_discovery_output(text: str, default_slots: int = 1) -> list[Host]:
    """The hosts a discovery script printed: one ``host`` or ``host:slots`` per line.

    Blank lines and ``#`` comments are skipped; no line at all means no host is available.

    Raises:
        DiscoveryError: a line is not ``host[:slots]``, its slots are not a positive integer, or
            a host is listed twice.
    """
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, count = line.rpartition(":")
        if not sep:
            name, count = line, ""
        if not name or name.startswith("-") or not _HOST_NAME.match(name):
            raise DiscoveryError(
                f"line {number}: {raw.strip()!r} is not `host` or `host:slots` (host names hold "
                "letters, digits, '.', '-', '_' and '@')."
            )
        slots = default_slots
        if count:
            try:
                slots = int(count)
            except ValueError:
                raise DiscoveryError(
                    f"line {number}: {raw.strip()!r}: slots must be an integer (host:slots)."
                ) from None
            if slots < 1:
                raise DiscoveryError(f"line {number}: {raw.strip()!r}: slots must be >= 1.")
        if name in hosts:
            raise DiscoveryError(f"line {number}: host {name!r} is listed twice.")
        hosts[name] = slots
    return [Host(name, slots) for name, slots in hosts.items()]


class Discovery(Protocol):
    def find(self) -> list[Host]:
        """The hosts available now.

        Raises:
            DiscoveryError: they cannot be found this time.
        """
        ...


class StaticDiscovery:
    """The hosts of ``-H``/``--hostfile``: always the same."""

    def __init__(self, hosts: Sequence[Host]) -> None:
        self._hosts = list(hosts)

    def find(self) -> list[Host]:
        return list(self._hosts)


class ScriptDiscovery:
    """Runs ``--host-discovery-script`` and reads its standard output.

    Args:
        path: the executable.
        default_slots: slots of a host printed without ``:slots`` (``--slots-per-host``).
        timeout_s: how long one run may take.
    """

    def __init__(
        self, path: str, default_slots: int = 1, timeout_s: float = DISCOVERY_TIMEOUT_S
    ) -> None:
        self.path = os.path.abspath(path)
        self.shown = path
        self.default_slots = default_slots
        self.timeout_s = timeout_s

    def find(self) -> list[Host]:
        try:
            result = subprocess.run(
                [self.path],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=self.timeout_s,
            )
        except subprocess.TimeoutExpired:
            raise DiscoveryError(
                f"the host discovery script {self.shown} did not finish within {self.timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise DiscoveryError(
                f"cannot run the host discovery script {self.shown}: {exc.strerror}"
            ) from None
        stdout = result.stdout.decode(errors="replace")
        stderr = result.stderr.decode(errors="replace").strip()
        if result.returncode != 0:
            how = (
                f"was killed by signal {-result.returncode}"
                if result.returncode < 0
                else f"failed with exit status {result.returncode}"
            )
            detail = f": {stderr}" if stderr else " (it wrote nothing to stderr)"
            raise DiscoveryError(f"the host discovery script {self.shown} {how}{detail}")
        try:
            return parse_discovery_output(stdout, self.default_slots)
        except DiscoveryError as exc:
            raise DiscoveryError(
                f"the host discovery script {self.shown} printed something unreadable, {exc}"
            ) from None


class HostWatcher:
    """Asks a :class:`Discovery` for the hosts every ``interval_s`` in a thread, and keeps the
    last good answer.

    Args:
        discovery: where hosts come from.
        interval_s: time between two runs.
        report: prints a line for the user.
        verbose: report every failed run; otherwise only the first.
    """

    def __init__(
        self,
        discovery: Discovery,
        interval_s: float = DISCOVERY_INTERVAL_S,
        report: Callable[[str], None] | None = None,
        verbose: bool = False,
    ) -> None:
        self.discovery = discovery
        self.interval_s = interval_s
        self.report = report or (lambda message: None)
        self.verbose = verbose
        self.failures = 0
        self._hosts: list[Host] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def first(self) -> list[Host]:
        """Run discovery once, now.

        Raises:
            DiscoveryError: it failed; the job cannot start.
        """
        hosts = self.discovery.find()
        with self._lock:
            self._hosts = hosts
        return hosts

    def poll(self) -> None:
        """Run discovery once more; on failure, report it and keep the last good answer."""
        try:
            hosts = self.discovery.find()
        except DiscoveryError as exc:
            self.failures += 1
            if self.verbose:
                self.report(f"{exc}; keeping the hosts it found last.")
            elif self.failures == 1:
                self.report(
                    f"{exc}; keeping the hosts it found last (further failures are shown with "
                    "--verbose)."
                )
            return
        with self._lock:
            self._hosts = hosts

    def hosts(self) -> list[Host]:
        with self._lock:
            return list(self._hosts)

    def start(self) -> None:
        if isinstance(self.discovery, StaticDiscovery):
            return  # nothing will change
        self._thread = threading.Thread(target=self._run, name="hora-discovery", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)


@dataclass
class _Listing:
    count: int = 0  # how many times the host was blacklisted
    until: float | None = None  # when it may come back; None: never
    active: bool = False


class Blacklist:
    """Hosts taken out of the job after a failure: for good, or for a cooldown.

    With ``cooldown=(lo, hi)`` a host's ``k``-th blacklisting (``k`` from 0) lasts
    ``lo * 2**k + uniform(0, 1) * lo`` seconds, clamped to ``[lo, hi]`` (Horovod's rule); once it
    has passed the host counts as available again.

    Args:
        cooldown: ``(lo, hi)`` seconds, or ``None`` to blacklist for good.
        clock: the time (seconds, monotonic).
        rand: a uniform random number in ``[0, 1)``.
    """

    def __init__(
        self,
        cooldown: tuple[float, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.cooldown = cooldown
        self.clock = clock
        self.rand = rand
        self._hosts: dict[str, _Listing] = {}

    def add(self, host: str) -> float | None:
        """Blacklist ``host``; returns for how many seconds (``None``: for good)."""
        listing = self._hosts.setdefault(host, _Listing())
        listing.active = True
        if self.cooldown is None:
            listing.count += 1
            listing.until = None
            return None
        low, high = self.cooldown
        delay = low * 2.0 ** min(listing.count, 60) + self.rand() * low
        delay = max(low, min(high, delay))
        listing.count += 1
        listing.until = self.clock() + delay
        return delay

    def blocked(self, host: str) -> bool:
        """Whether ``host`` is blacklisted now."""
        listing = self._hosts.get(host)
        if listing is None or not listing.active:
            return False
        if listing.until is not None and self.clock() >= listing.until:
            listing.active = False
            return False
        return True

    def hosts(self) -> list[str]:
        """The hosts blacklisted now."""
        return [host for host in self._hosts if self.blocked(host)]


class HostManager:
    """The hosts discovery reports, in first-seen order, less the blacklisted ones."""

    def __init__(self, blacklist: Blacklist | None = None) -> None:
        self.blacklist = blacklist or Blacklist()
        self._order: dict[str, None] = {}
        self._slots: dict[str, int] = {}

    def update(self, hosts: Sequence[Host]) -> None:
        """Take discovery's newest answer."""
        for host in hosts:
            self._order.setdefault(host.name, None)
        self._slots = {host.name: host.slots for host in hosts}

    def discovered(self) -> list[tuple[str, int]]:
        """Every host discovery reports now, with its slots, in first-seen order."""
        return [(name, self._slots[name]) for name in self._order if name in self._slots]

    def available(self) -> list[tuple[str, int]]:
        """The discovered hosts that are not blacklisted."""
        return [(name, n) for name, n in self.discovered() if not self.blacklist.blocked(name)]


def describe_hosts(hosts: Sequence[tuple[str, int]]) -> str:
    """``a:2, b:1`` (``none`` when empty)."""
    return ", ".join(f"{name}:{slots}" for name, slots in hosts) or "none"


# ---------------------------------------------------------------- rounds


def order_workers(
    previous: Sequence[str],
    running: Collection[str],
    stopping: Collection[str],
    available: Sequence[tuple[str, int]],
    max_np: int | None = None,
) -> list[str]:
    """The next round's worker ids, in rank order.

    Workers of the previous round whose process still runs come first, in their previous rank
    order, host by host; each host's remaining slots follow its survivors (a host's workers stay
    contiguous); hosts without survivors follow in first-seen order. At most ``max_np``.

    Args:
        previous: the previous round's worker ids in rank order (empty for round 0).
        running: ids with a worker process that has not ended.
        stopping: ids among ``running`` whose process horarun is stopping (never survivors).
        available: ``(host, slots)`` usable now, in first-seen order.
        max_np: the most workers a round may have (``None``: no limit).

    A running process that is not a survivor (one left out of an earlier round and not yet
    ended) keeps its slot out of use until it ends.
    """
    slots = {host: [f"{host}:{i}" for i in range(count)] for host, count in available}
    usable = {worker for ids in slots.values() for worker in ids}
    survivors = [w for w in previous if w in usable and w in running and w not in stopping]
    kept = set(survivors)
    hosts = list(dict.fromkeys([host_of(w) for w in survivors] + list(slots)))
    order: list[str] = []
    for host in hosts:
        order += [w for w in survivors if host_of(w) == host]
        order += [w for w in slots[host] if w not in kept and w not in running]
    return order if max_np is None else order[:max_np]


def update_flags(current: Collection[str], desired: Collection[str]) -> int:
    """The host-change flags (``HOSTS_ADDED | HOSTS_REMOVED``) going from one set of worker ids
    to another."""
    flags = 0
    if set(desired) - set(current):
        flags |= HOSTS_ADDED
    if set(current) - set(desired):
        flags |= HOSTS_REMOVED
    return flags


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def describe_change(current: Collection[str], desired: Collection[str]) -> str:
    """``hosts changed: added b:0, b:1; removed c:0``."""
    added = [w for w in desired if w not in current]
    removed = [w for w in current if w not in desired]
    parts = []
    if added:
        parts.append(f"added {', '.join(added)}")
    if removed:
        parts.append(f"removed {', '.join(removed)}")
    return "hosts changed: " + "; ".join(parts)


# ---------------------------------------------------------------- the driver


@dataclass(frozen=True)
class Limits:
    """The elastic flags, with their defaults applied."""

    np: int
    min_np: int
    max_np: int | None
    timeout_s: float
    reset_limit: int | None
    cooldown: tuple[float, float] | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Limits:
        timeout = args.elastic_timeout
        if timeout is None:
            from hora.common.config import lookup

            raw = lookup("ELASTIC_TIMEOUT")
            try:
                timeout = float(raw) if raw else DEFAULT_ELASTIC_TIMEOUT_S
            except ValueError:
                timeout = DEFAULT_ELASTIC_TIMEOUT_S
        cooldown = args.blacklist_cooldown_range
        return cls(
            np=int(args.np),
            min_np=int(args.min_np if args.min_np is not None else args.np),
            max_np=args.max_np,
            timeout_s=float(timeout),
            reset_limit=args.reset_limit,
            cooldown=(float(cooldown[0]), float(cooldown[1])) if cooldown else None,
        )


@dataclass
class Failure:
    """A worker of a round that ended with a non-zero status (or was stopped)."""

    worker: Worker
    worker_id: str
    rank: int
    round: int
    text: str  # "rank 1 of round 0 (b:0, worker 1, pid 42) exited with code 1"


@dataclass
class _Spawner:
    """Starts worker processes the way the static path does (same environment handling)."""

    supervisor: Supervisor
    command: list[str]
    extra_env: dict[str, str]
    ssh: SshSettings
    is_remote: Callable[[str], bool]
    say: Callable[[str], None]
    cwd: str = field(default_factory=os.getcwd)
    base_env: dict[str, str] = field(
        default_factory=lambda: {k: v for k, v in os.environ.items() if k not in _TOPOLOGY_VARS}
    )
    next_number: int = 0

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
        env = worker_env(
            self.base_env,
            {
                **self.extra_env,
                ELASTIC_VAR: "1",
                WORKER_ID_VAR: worker_id,
                "HORA_HOSTNAME": host,
                "HOROVOD_HOSTNAME": host,
            },
        )
        remote = self.is_remote(host)
        where = "over ssh" if remote else "on this machine"
        self.say(f"starting worker {number} ({worker_id}) {where}: {' '.join(self.command)}")
        return self.supervisor.spawn(
            slot, self.command, env, cwd=self.cwd, ssh=self.ssh if remote else None
        )


class Driver:
    """Runs an elastic job's rounds until training finishes or the job cannot go on.

    Args:
        limits: the elastic flags.
        manager: the hosts.
        watcher: where the newest hosts come from.
        spawner: starts worker processes.
        base: the job's store, without a round's prefix.
        usable: filters discovered hosts this job cannot use (reported once each).
        say: logs a line under ``--verbose``.
        tell: prints a line always.
        clock: the time (seconds, monotonic).
    """

    def __init__(
        self,
        limits: Limits,
        manager: HostManager,
        watcher: HostWatcher,
        spawner: _Spawner,
        base: StoreClient,
        usable: Callable[[list[Host]], list[Host]],
        say: Callable[[str], None],
        tell: Callable[[str], None],
        verbose: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.manager = manager
        self.watcher = watcher
        self.spawner = spawner
        self.supervisor = spawner.supervisor
        self.base = base
        self.usable = usable
        self.say = say
        self.tell = tell
        self.verbose = verbose
        self.clock = clock
        self.plan: RoundPlan | None = None
        self.procs: dict[str, Worker] = {}  # newest process of each worker id
        self.ids: dict[int, str] = {}  # worker id by worker number
        self.handled: set[int] = set()  # worker numbers whose end was looked at
        self.released: set[int] = set()  # worker numbers horarun is stopping on purpose
        self.forced: list[str] = []  # why the next round must come even with the same workers
        self.failures: list[Failure] = []
        self.resets = 0
        self.updates = 0
        self.short_since: float | None = None
        self.finishing_since: float | None = None
        self.finisher = ""
        self.never_joined: set[str] = set()
        self.started_for: dict[int, int] = {}  # worker number -> the round it was started for
        self.stopped_late: set[str] = set()
        self._round_stores: dict[int, StoreClient] = {}
        self._reset_seen: set[int] = set()
        self._reset_asked: tuple[int, float] | None = None  # (round, when the driver saw it)

    # -------------------------------------------------------- the loop

    def run(self) -> int:
        """Drive the job to its end; returns horarun's exit status.

        Raises:
            ElasticError: the job cannot go on.
        """
        while True:
            result = self.step()
            if result is not None:
                return result
            time.sleep(POLL_S)

    def step(self) -> int | None:
        """One look at the hosts, the workers and the store; the exit status once the job ended."""
        now = self.clock()
        self.manager.update(self.usable(self.watcher.hosts()))
        self._collect_exits(now)
        if self.finishing_since is not None:
            return self._finish_step(now)
        self._check_blacklist()
        self._check_reset_request(now)
        self._plan_step(now)
        return None

    # -------------------------------------------------------- workers ending

    def _running(self) -> set[str]:
        return {
            worker_id
            for worker_id, worker in self.procs.items()
            if worker.slot.rank not in self.handled
        }

    def _in_round(self, worker: Worker) -> bool:
        worker_id = self.ids[worker.slot.rank]
        return (
            self.plan is not None
            and worker_id in self.plan.workers
            and self.procs.get(worker_id) is worker
            and worker.slot.rank not in self.released
        )

    def _collect_exits(self, now: float) -> None:
        for worker in list(self.supervisor.workers):
            number = worker.slot.rank
            if number in self.handled or not worker.done.is_set():
                continue
            self.handled.add(number)
            code = worker.exit_code or 0
            worker_id = self.ids[number]
            if not self._in_round(worker):
                if number in self.released:
                    self.say(f"worker {number} ({worker_id}) stopped")
                elif code == 0:
                    self.say(
                        f"worker {number} ({worker_id}) left the job (not in the newest round)"
                    )
                else:
                    self.say(
                        f"worker {number} ({worker_id}), not in the newest round, "
                        f"{worker.describe_exit(code)}"
                    )
                continue
            assert self.plan is not None
            rank = self.plan.workers[worker_id].rank
            if code == 0:
                if self.finishing_since is None:
                    self._start_finishing(worker_id, rank, now)
                continue
            text = (
                f"rank {rank} of round {self.plan.number} ({worker_id}, worker {number}, "
                f"pid {worker.pid if worker.pid is not None else '?'}) {worker.describe_exit(code)}"
            )
            failure = Failure(worker, worker_id, rank, self.plan.number, text)
            self.failures.append(failure)
            self._record(failure)
            if self.finishing_since is None:
                self._blacklist_for(failure, worker.describe_exit(code))

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
        except Exception as exc:  # noqa: BLE001 - survivors still notice through Gloo
            self.say(f"could not record the end of rank {failure.rank} in the store: {exc}")

    def _blacklist_for(self, failure: Failure, how: str) -> None:
        host = host_of(failure.worker_id)
        reason = f"rank {failure.rank} ({failure.worker_id}) {how}"
        if not self.manager.blacklist.blocked(host):
            delay = self.manager.blacklist.add(host)
            span = "for good" if delay is None else f"for {delay:.1f} s"
            reason += f"; host {host} blacklisted"
            self.say(f"blacklisted host {host} {span}: its worker {failure.worker_id} {how}")
            for worker_id, worker in self.procs.items():
                number = worker.slot.rank
                if host_of(worker_id) == host and number not in self.handled:
                    if number not in self.released:
                        self.say(f"stopping worker {number} ({worker_id}) on blacklisted {host}")
                    self.released.add(number)
                    worker.release_stdin()
        self.forced.append(reason)

    def _check_blacklist(self) -> None:
        if not self.forced:
            return
        discovered = self.manager.discovered()
        if discovered and all(self.manager.blacklist.blocked(h) for h, _ in discovered):
            names = ", ".join(h for h, _ in discovered)
            raise ElasticError(
                f"every host is blacklisted after its workers failed ({names}); stopping the job."
            )

    def _check_reset_request(self, now: float) -> None:
        plan = self.plan
        if plan is None or plan.number in self._reset_seen:
            return
        if self._reset_asked is not None and self._reset_asked[0] == plan.number:
            asked_at = self._reset_asked[1]
        else:
            try:
                if not reset_requested(self.base, plan.number):
                    return
            except Exception:  # noqa: BLE001 - a store hiccup; look again next time
                return
            asked_at = now
            self._reset_asked = (plan.number, now)
        # A worker's collective often fails because a peer died, before horarun sees that
        # peer's exit: give the exit a moment to arrive, so that one failure makes one round.
        if now - asked_at >= RESET_GRACE_S:
            self._reset_seen.add(plan.number)
            self.forced.append(
                f"a worker of round {plan.number} asked for a new round (a collective failed "
                "while every worker process still ran)"
            )

    # -------------------------------------------------------- forming rounds

    def _plan_step(self, now: float) -> None:
        plan = self.plan
        running = self._running()
        stopping = {self.ids[n] for n in self.released if n not in self.handled}
        previous = plan.ranked() if plan is not None else []
        available = self.manager.available()
        order = order_workers(previous, running, stopping, available, self.limits.max_np)
        if plan is not None and not self.forced and set(order) == set(plan.workers):
            self.short_since = None
            return
        need = self.limits.np if plan is None else self.limits.min_np
        if len(order) < need:
            self._wait_for_slots(now, need, len(order), available)
            return
        self.short_since = None
        self._publish(order, running, stopping)

    def _wait_for_slots(
        self, now: float, need: int, have: int, available: list[tuple[str, int]]
    ) -> None:
        limits = self.limits
        blacklisted = ", ".join(self.manager.blacklist.hosts()) or "none"
        if self.short_since is None:
            self.short_since = now
            if self.plan is None:
                self.say(
                    f"waiting up to {limits.timeout_s:g} s for {need} slots to start the job "
                    f"(-np {limits.np}); available: {describe_hosts(available)}"
                )
            else:
                self.tell(
                    f"round {self.plan.number + 1} needs --min-np {need} workers but has "
                    f"{_plural(have, 'usable slot')} ({describe_hosts(available)}; blacklisted hosts: "
                    f"{blacklisted}); waiting up to {limits.timeout_s:g} s for more"
                )
        if now - self.short_since < limits.timeout_s:
            return
        if self.plan is None:
            raise ElasticError(
                f"timed out after {limits.timeout_s:g} s waiting for {need} slots to start the "
                f"job (-np {limits.np}): the hosts found offer {have} "
                f"({describe_hosts(self.manager.discovered())}; blacklisted hosts: "
                f"{blacklisted}). Check the hosts (or the host discovery script's output), "
                "lower -np, or raise --elastic-timeout."
            )
        raise ElasticError(
            f"fewer than --min-np {need} slots were available for {limits.timeout_s:g} s "
            f"(--elastic-timeout): {have} usable ({describe_hosts(available)}); blacklisted "
            f"hosts: {blacklisted}. Stopping the job."
        )

    def _publish(self, order: list[str], running: set[str], stopping: set[str]) -> None:
        plan = self.plan
        number = 0 if plan is None else plan.number + 1
        reason = "the job starts"
        if plan is not None:
            survivors = [
                w for w in order if w in plan.workers and w in running and w not in stopping
            ]
            if not survivors:
                gone = ", ".join(dict.fromkeys(host_of(w) for w in plan.workers))
                why = "; ".join(self.forced) or describe_change(plan.workers, order)
                raise ElasticError(
                    f"no worker of round {plan.number} is left to pass the training state on to "
                    f"round {number} (its hosts {gone} are gone or blacklisted; {why}). "
                    "Stopping the job."
                )
            reason = "; ".join(self.forced) or describe_change(plan.workers, order)
            limit = self.limits.reset_limit
            if limit is not None and self.resets >= limit:
                raise ElasticError(
                    f"the job was reset {_plural(self.resets + 1, 'time')}, more than --reset-limit "
                    f"{limit} allows (this reset: {reason}). Stopping the job."
                )
            self.resets += 1
            if not self.forced:
                self.updates += 1
                publish_host_update(self.base, self.updates, update_flags(plan.workers, order))
        new_plan = RoundPlan.from_order(number, self.updates, order)
        publish_round(self.base, new_plan)
        self.plan = new_plan
        self.forced = []
        hosts = len({host_of(w) for w in order})
        head = f"round {number}: {_plural(len(order), 'worker')} on {_plural(hosts, 'host')}"
        if self.verbose:
            ranks = ", ".join(f"rank {r} {w}" for r, w in enumerate(order))
            self.say(f"{head} ({ranks}), reason: {reason}")
        started = []
        for worker_id in order:
            if worker_id not in running:
                worker = self.spawner.spawn(worker_id)
                self.procs[worker_id] = worker
                self.ids[worker.slot.rank] = worker_id
                self.started_for[worker.slot.rank] = number
                started.append(f"worker {worker.slot.rank} ({worker_id})")
        if not self.verbose and number > 0:
            # The new workers' numbers prefix their output: say whose they are.
            new = f"; started {', '.join(started)}" if started else ""
            self.tell(f"{head}, reason: {reason}{new}")

    # -------------------------------------------------------- the end

    def _start_finishing(self, worker_id: str, rank: int, now: float) -> None:
        assert self.plan is not None
        self.finishing_since = now
        self.finisher = f"rank {rank} ({worker_id})"
        others = [w for w in self.plan.workers if w != worker_id]
        waiting = (
            f"; waiting up to {self.limits.timeout_s:g} s for the other "
            f"{_plural(len(others), 'worker')} of round {self.plan.number}"
            if others
            else ""
        )
        self.say(f"{self.finisher} finished with exit status 0: training is over{waiting}")
        running = self._running()
        plan = self.plan
        arrived = self._arrivals(plan)
        formed = len(arrived) == plan.size
        for other, worker in self.procs.items():
            number = worker.slot.rank
            if other not in running or number in self.released:
                continue
            if other not in plan.workers:
                # Left out of the round and still running: nothing is left for it to do.
                self.released.add(number)
                worker.release_stdin()
                continue
            if formed:
                continue
            # The round never formed: a worker waiting at its barrier, or started to join it
            # (after round 0), never trained in it; one still in an earlier round may be
            # finishing too (saving a checkpoint, say), and round 0's workers may still be busy
            # before hvd.init(): those get their time.
            joiner = plan.number > 0 and self.started_for.get(number) == plan.number
            if other in arrived or joiner:
                self.say(
                    f"stopping worker {number} ({other}): it never trained in round {plan.number}"
                )
                self.never_joined.add(other)
                self.released.add(number)
                worker.release_stdin()

    def _arrivals(self, plan: RoundPlan) -> set[str]:
        """The workers that reached ``plan``'s barrier (all of them, if the store cannot say)."""
        try:
            store = self._round_store(plan.number)
            return {w for w, a in plan.workers.items() if store.check(arrived_key(a.rank))}
        except Exception:  # noqa: BLE001 - then the round counts as formed
            return set(plan.workers)

    def _finish_step(self, now: float) -> int | None:
        assert self.plan is not None and self.finishing_since is not None
        running = self._running()
        waiting = [w for w in self.plan.workers if w in running and w not in self.never_joined]
        if waiting and now - self.finishing_since < self.limits.timeout_s:
            return None
        for worker_id in waiting:
            worker = self.procs[worker_id]
            self.stopped_late.add(worker_id)
            self.released.add(worker.slot.rank)
            worker.release_stdin()
        return 0 if not self.final_failures() else 1

    def final_failures(self) -> list[str]:
        """Why the last round did not end well, one line per worker (empty: it did)."""
        assert self.plan is not None
        lines = []
        for worker_id in self.plan.ranked():
            if worker_id in self.never_joined:
                continue
            rank = self.plan.workers[worker_id].rank
            worker = self.procs[worker_id]
            if worker_id in self.stopped_late:
                lines.append(
                    f"rank {rank} of round {self.plan.number} ({worker_id}, worker "
                    f"{worker.slot.rank}) was still running {self.limits.timeout_s:g} s after "
                    f"{self.finisher} finished; horarun stopped it"
                )
                continue
            code = worker.exit_code
            if code is not None and code != 0:
                lines.append(
                    f"rank {rank} of round {self.plan.number} ({worker_id}, worker "
                    f"{worker.slot.rank}, pid {worker.pid}) {worker.describe_exit(code)}"
                )
        return lines

    def report(self) -> str:
        """The failure report for the end of the job: the last round's failed workers and the
        stderr of the first of them, or the last worker failure seen."""
        lines: list[str] = []
        failed: list[Worker] = []
        if self.plan is not None and self.finishing_since is not None:
            lines = self.final_failures()
            failed = [
                self.procs[w]
                for w in self.plan.ranked()
                if w not in self.never_joined
                and (w in self.stopped_late or (self.procs[w].exit_code or 0) != 0)
            ]
            failed.sort(key=lambda w: w.exit_time)
        elif self.failures:
            last = self.failures[-1]
            lines = [f"last worker failure: {last.text}"]
            failed = [last.worker]
            earlier = [f.text for f in self.failures[-6:-1]]
            if earlier:
                lines.append("earlier failures: " + "; ".join(earlier))
        if failed and failed[0].stderr_tail:
            worker = failed[0]
            lines.append(f"Last lines of worker {worker.slot.rank}'s stderr:")
            lines += [f"    {line}" for line in worker.stderr_tail]
        return "\n".join(lines)


# ---------------------------------------------------------------- horarun's entry


def _hosts_from_flags(args: argparse.Namespace, limits: Limits) -> list[Host]:
    if args.hostfile:
        return parse_hostfile(args.hostfile)
    return parse_hosts(args.hosts or f"localhost:{limits.max_np or limits.np}")


def run_elastic(  # noqa: C901 - to be split with the runner (issue 21, item 5)
    args: argparse.Namespace, say: Callable[[str], None]
) -> int:
    """Run an elastic job for ``horarun``; returns its exit status.

    ``0``: the last round's workers all exited 0. ``1``: the job failed or could not go on (the
    message says why). ``2``: the hosts named on the command line cannot be used.
    """

    def tell(message: str) -> None:
        print(f"horarun: {message}", file=sys.stderr, flush=True)

    limits = Limits.from_args(args)
    verbose = bool(args.verbose)
    discovery: Discovery
    if args.host_discovery_script:
        discovery = ScriptDiscovery(args.host_discovery_script, args.slots or 1)
    else:
        try:
            discovery = StaticDiscovery(_hosts_from_flags(args, limits))
        except HostError as exc:
            tell(str(exc))
            return 2
    watcher = HostWatcher(discovery, report=tell, verbose=verbose)
    try:
        first = watcher.first()
    except DiscoveryError as exc:
        tell(f"{str(exc).rstrip('.')}. The job cannot start.")
        return 1
    except KeyboardInterrupt:
        return 130
    say(f"hosts found: {describe_hosts([(h.name, h.slots) for h in first])}")
    if isinstance(discovery, StaticDiscovery) and len(first) == 1:
        say(
            f"every worker runs on one host ({first[0].name}): a failed worker blacklists it, "
            "which ends the job. Name more hosts (-H, --hostfile, --host-discovery-script) to "
            "survive failures."
        )

    local: dict[str, bool] = {}

    def is_remote(host: str) -> bool:
        if host not in local:
            local[host] = is_local(host)
        return not local[host]

    ssh = ssh_settings(args)
    remote = [h.name for h in first if is_remote(h.name)]
    try:
        if remote:
            require_ssh()
        if args.interfaces:
            bind_address = interface_address(args.interfaces[0])
        else:
            bind_address = rendezvous_address(remote, ssh, [])
    except HostError as exc:
        tell(str(exc))
        return 2
    except KeyboardInterrupt:
        return 130
    interface_env: dict[str, str] = {}
    if args.interfaces:
        interface_env = {
            "HORA_GLOO_IFACE": args.interfaces[0],
            "NCCL_SOCKET_IFNAME": ",".join(args.interfaces),
        }
    refused: set[str] = set()

    def usable(hosts: list[Host]) -> list[Host]:
        kept = []
        for host in hosts:
            why = ""
            if is_remote(host.name):
                if bind_address.startswith("127."):
                    why = (
                        f"host {host.name} is another machine, but the job's store listens on "
                        f"{bind_address} (every host was this machine when the job started); "
                        "pass --network-interface IFACE to let other machines join"
                    )
                elif shutil.which("ssh") is None:
                    why = f"host {host.name} is another machine and there is no `ssh` client here"
            if why:
                if host.name not in refused:
                    refused.add(host.name)
                    tell(f"{why}; it is not used.")
                continue
            kept.append(host)
        return kept

    from hora.runner.rendezvous import RendezvousServer

    server = RendezvousServer(bind_address)
    say(f"rendezvous store listening on {server.address}:{server.port}")
    supervisor = Supervisor(
        forwarder=OutputForwarder(
            prefix=not args.disable_output_prefix,
            timestamp=bool(args.prefix_output_with_timestamp),
            log_dir=args.output_filename,
        ),
    )
    install_signal_handlers(supervisor)
    worker_timeout = limits.timeout_s + WORKER_TIMEOUT_SLACK_S
    extra: dict[str, Any] = {
        **server.env(),
        **options.engine_env(args),
        **interface_env,
        "HORA_ELASTIC_TIMEOUT": f"{worker_timeout:g}",
    }
    spawner = _Spawner(supervisor, list(args.command), extra, ssh, is_remote, say)
    driver = Driver(
        limits,
        HostManager(Blacklist(limits.cooldown)),
        watcher,
        spawner,
        server.client,
        usable,
        say,
        tell,
        verbose=verbose,
    )
    watcher.start()
    try:
        status = driver.run()
        if status != 0:
            tell(f"the job failed.\n{driver.report()}")
        return status
    except ElasticError as exc:
        details = driver.report()
        tell(f"{exc}" + (f"\n{details}" if details else ""))
        return 1
    finally:
        watcher.stop()
        supervisor.stop()
        server.close()
