"""The elastic driver of horarun, piece by piece: discovery, blacklist, rank order, rounds."""

from __future__ import annotations

import logging
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hora.common.job import rounds as protocol
from hora.common.job.store import StoreClient, new_secret
from hora.runner import elastic, options
from hora.runner.elastic import (
    Blacklist,
    DiscoveryError,
    Driver,
    ElasticError,
    HostManager,
    HostWatcher,
    Limits,
    ScriptDiscovery,
    StaticDiscovery,
    describe_change,
    order_workers,
    parse_discovery_output,
    update_flags,
)
from hora.runner.elastic import driver as driver_module
from hora.runner.hosts import Host, Slot
from hora.runner.job import Job
from hora.runner.options import LaunchOptions, OptionError
from hora.runner.remote import SshSettings
from hora.runner.supervisor import Worker

COMMAND = ["python", "train.py"]


def parse(argv: Sequence[str]) -> LaunchOptions:
    """The options of a job (not a query)."""
    parsed = options.parse(argv)
    assert isinstance(parsed, LaunchOptions)
    return parsed


def _limits(launch: LaunchOptions) -> Limits:
    assert launch.elastic is not None
    return Limits.from_options(launch.np, launch.elastic)


class _Log(logging.Handler):
    """Keeps what the ``hora.runner`` logger says."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self, low: int = logging.DEBUG, high: int = logging.CRITICAL) -> list[str]:
        """The lines logged at a level from ``low`` to ``high``."""
        return [r.getMessage() for r in self.records if low <= r.levelno <= high]


@pytest.fixture(autouse=True)
def runner_log() -> Iterator[_Log]:
    """What the runner logs during a test, with its debug lines shown (as under --verbose)."""
    log = _Log()
    logger = logging.getLogger("hora.runner")
    level = logger.level
    logger.addHandler(log)
    logger.setLevel(logging.DEBUG)
    try:
        yield log
    finally:
        logger.removeHandler(log)
        logger.setLevel(level)


def _script(tmp_path: Path, body: str, name: str = "discover.sh") -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


# ---------------------------------------------------------------- discovery


@pytest.mark.timeout(10)
def test_discovery_output_lines_are_hosts_with_slots() -> None:
    text = "a\n# a comment\n\n  b:4  \nc:2 # trailing comment\n"
    assert parse_discovery_output(text, default_slots=3) == [
        Host("a", 3),
        Host("b", 4),
        Host("c", 2),
    ]
    assert parse_discovery_output("") == []
    assert parse_discovery_output("\n# nothing\n") == []


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("a:x\n", r"line 1: 'a:x': slots must be an integer"),
        ("a\nb:0\n", r"line 2: 'b:0': slots must be >= 1"),
        ("a\na:2\n", r"line 2: host 'a' is listed twice"),
        ("a slots=2\n", r"line 1: 'a slots=2' is not a host name .*must be `host` or `host:s"),
        (":3\n", r"line 1: ':3' has no host name; each line must be `host` or `host:slots`"),
        ("-oProxy:1\n", r"'-oProxy' is not a host name"),
        ("a\nA:2\n", r"line 2: host 'A' is listed twice"),
        ("::1:2\n", r"line 1: '::1:2': an IPv6 address goes in brackets, as in \[::1\]:2"),
        ("[::1]:0\n", r"line 1: '\[::1\]:0': slots must be >= 1"),
    ],
)
def test_bad_discovery_lines_are_named(text: str, match: str) -> None:
    with pytest.raises(DiscoveryError, match=match):
        parse_discovery_output(text)


@pytest.mark.timeout(20)
def test_discovery_script_is_run_and_read(tmp_path: Path) -> None:
    script = _script(tmp_path, 'echo "node1:2"\necho node2\n')
    assert ScriptDiscovery(script, default_slots=4).find() == [Host("node1", 2), Host("node2", 4)]
    empty = _script(tmp_path, "exit 0\n", "empty.sh")
    assert ScriptDiscovery(empty).find() == []


@pytest.mark.timeout(20)
def test_discovery_script_failures_carry_its_stderr(tmp_path: Path) -> None:
    failing = _script(tmp_path, 'echo "no cloud credentials" >&2\nexit 3\n', "fail.sh")
    with pytest.raises(DiscoveryError, match=r"failed with exit status 3: no cloud credentials"):
        ScriptDiscovery(failing).find()
    silent = _script(tmp_path, "exit 1\n", "silent.sh")
    with pytest.raises(DiscoveryError, match=r"exit status 1 \(it wrote nothing to stderr\)"):
        ScriptDiscovery(silent).find()
    garbled = _script(tmp_path, 'echo "node1:many"\n', "garbled.sh")
    with pytest.raises(DiscoveryError, match=r"printed something unreadable, line 1"):
        ScriptDiscovery(garbled).find()
    slow = _script(tmp_path, "sleep 5\n", "slow.sh")
    with pytest.raises(DiscoveryError, match=r"did not finish within 0.2 s"):
        ScriptDiscovery(slow, timeout_s=0.2).find()
    binary = _script(tmp_path, "printf 'node1:2\\nn\\377de2\\n'\n", "binary.sh")
    with pytest.raises(DiscoveryError, match=r"line 2: byte 0xff is not UTF-8 text"):
        ScriptDiscovery(binary).find()


def test_discovery_output_may_name_ipv6_hosts_in_brackets() -> None:
    assert parse_discovery_output("[::1]:2\n[fe80::1]\n", default_slots=3) == [
        Host("::1", 2),
        Host("fe80::1", 3),
    ]


def _alive(token: str) -> list[int]:
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if token in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


@pytest.mark.timeout(30)
def test_a_timed_out_run_is_reported_on_time_when_a_detached_helper_holds_its_output(
    tmp_path: Path,
) -> None:
    """A helper that left the script's session (setsid) keeps its stdout open: the report comes
    when the run's time is up, not when the helper ends."""
    hang = _script(tmp_path, "setsid sleep 20 &\nsleep 60\n", "hang.sh")
    started = time.monotonic()
    with pytest.raises(DiscoveryError, match=r"did not finish within 0.5 s"):
        ScriptDiscovery(hang, timeout_s=0.5).find()
    assert time.monotonic() - started < 0.5 + 3.0


def test_one_discovery_run_never_outlasts_the_elastic_timeout(tmp_path: Path) -> None:
    from hora.runner.elastic.start import discovery_for

    script = _script(tmp_path, "echo localhost:2\n", "hosts.sh")
    args = parse(["--host-discovery-script", script, "--elastic-timeout", "7", "-np", "1", "true"])
    discovery = discovery_for(args.hosts, _limits(args))
    assert isinstance(discovery, ScriptDiscovery) and discovery.timeout_s == 7.0
    args = parse(["--host-discovery-script", script, "-np", "1", "true"])
    discovery = discovery_for(args.hosts, _limits(args))
    assert isinstance(discovery, ScriptDiscovery) and discovery.timeout_s == 60.0


@pytest.mark.timeout(20)
def test_a_discovery_run_that_times_out_is_killed_with_what_it_started(tmp_path: Path) -> None:
    token = str(tmp_path / "helper")
    slow = _script(
        tmp_path,
        f"""
        echo "asking the scheduler" >&2
        {sys.executable} -c "import time; time.sleep(60)" {token} &
        {sys.executable} -c "import time; time.sleep(60)" {token}
        """,
        "slow.sh",
    )
    with pytest.raises(DiscoveryError, match=r"within 0.5 s .* was stopped; its stderr: asking"):
        ScriptDiscovery(slow, timeout_s=0.5).find()
    assert _alive(token) == []


@pytest.mark.timeout(20)
def test_stopping_the_watcher_kills_a_discovery_run_in_progress(
    tmp_path: Path, runner_log: _Log
) -> None:
    token = str(tmp_path / "helper")
    hang = _script(
        tmp_path, f'{sys.executable} -c "import time; time.sleep(60)" {token}\n', "hang.sh"
    )
    watcher = HostWatcher(ScriptDiscovery(hang), interval_s=0.01)
    watcher.start()
    deadline = time.monotonic() + 10
    while not _alive(token):
        assert time.monotonic() < deadline, "the discovery script did not start"
        time.sleep(0.05)
    watcher.stop()
    deadline = time.monotonic() + 5
    while _alive(token):
        assert time.monotonic() < deadline, "the discovery run outlived the watcher"
        time.sleep(0.05)
    assert runner_log.lines() == []  # a run cancelled at the end is no failure to report


class _Answers:
    """A discovery that returns (or raises) the queued answers, then repeats the last."""

    def __init__(self, *answers: list[Host] | DiscoveryError) -> None:
        self.answers = list(answers)

    def find(self) -> list[Host]:
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, DiscoveryError):
            raise answer
        return answer


@pytest.mark.timeout(10)
def test_first_discovery_failure_is_fatal_later_ones_keep_the_last_hosts(
    runner_log: _Log,
) -> None:
    with pytest.raises(DiscoveryError, match="boom"):
        HostWatcher(_Answers(DiscoveryError("boom"))).first()

    logging.getLogger("hora.runner").setLevel(logging.INFO)  # without --verbose
    good = [Host("a", 1), Host("b", 2)]
    watcher = HostWatcher(
        _Answers(good, DiscoveryError("script failed"), DiscoveryError("again"), [Host("c", 1)])
    )
    assert watcher.first() == good
    watcher.poll()
    watcher.poll()
    assert watcher.hosts() == good
    said = runner_log.lines(logging.WARNING)
    assert len(said) == 1  # without --verbose: the first failure only
    assert "script failed; keeping the hosts it found last" in said[0]
    assert "--verbose" in said[0]
    watcher.poll()
    assert watcher.hosts() == [Host("c", 1)]

    runner_log.records.clear()
    logging.getLogger("hora.runner").setLevel(logging.DEBUG)  # --verbose
    verbose = HostWatcher(_Answers(good, DiscoveryError("x"), DiscoveryError("y")))
    verbose.first()
    verbose.poll()
    verbose.poll()
    assert runner_log.lines(logging.WARNING) == [
        "x; keeping the hosts it found last.",
        "y; keeping the hosts it found last.",
    ]


@pytest.mark.timeout(10)
def test_watcher_thread_polls_a_script_and_stops() -> None:
    calls = threading.Semaphore(0)

    class Counting:
        def find(self) -> list[Host]:
            calls.release()
            return [Host("a", 1)]

    watcher = HostWatcher(Counting(), interval_s=0.01)
    watcher.first()
    watcher.start()
    for _ in range(3):
        assert calls.acquire(timeout=5)
    watcher.stop()
    assert watcher._thread is not None and not watcher._thread.is_alive()
    # Static hosts never change: no thread.
    static = HostWatcher(StaticDiscovery([Host("a", 2)]))
    assert static.first() == [Host("a", 2)]
    static.start()
    assert static._thread is None


# ---------------------------------------------------------------- blacklist and hosts


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.timeout(10)
def test_blacklist_without_cooldown_is_for_good() -> None:
    clock = _Clock()
    blacklist = Blacklist(clock=clock)
    assert blacklist.add("a") is None
    clock.now += 1e9
    assert blacklist.blocked("a")
    assert not blacklist.blocked("b")
    assert blacklist.hosts() == ["a"]


@pytest.mark.timeout(10)
def test_blacklist_cooldown_grows_and_is_clamped() -> None:
    clock = _Clock()
    draws = iter([0.5, 0.0, 0.25, 0.9])
    blacklist = Blacklist(cooldown=(10.0, 50.0), clock=clock, rand=lambda: next(draws))
    # k-th listing: lo * 2**k + uniform * lo, clamped to [lo, hi].
    assert blacklist.add("a") == pytest.approx(15.0)  # 10 * 1 + 0.5 * 10
    assert blacklist.blocked("a")
    clock.now += 14.9
    assert blacklist.blocked("a")
    clock.now += 0.2
    assert not blacklist.blocked("a")  # cooldown over: available again
    assert blacklist.hosts() == []
    assert blacklist.add("a") == pytest.approx(20.0)  # 10 * 2 + 0
    clock.now += 20.0
    assert not blacklist.blocked("a")
    assert blacklist.add("a") == pytest.approx(42.5)  # 10 * 4 + 2.5
    clock.now += 42.5
    assert blacklist.add("a") == pytest.approx(50.0)  # 80 + 9 clamped to hi
    # A huge count does not overflow.
    for _ in range(200):
        blacklist.rand = lambda: 0.0
        blacklist.add("b")
    assert blacklist.add("b") == pytest.approx(50.0)


@pytest.mark.timeout(10)
def test_hosts_keep_first_seen_order_and_leave_out_blacklisted_ones() -> None:
    clock = _Clock()
    manager = HostManager(Blacklist(cooldown=(5.0, 5.0), clock=clock, rand=lambda: 0.0))
    manager.update([Host("b", 1), Host("a", 2)])
    manager.update([Host("c", 1), Host("a", 3), Host("b", 1)])
    assert manager.discovered() == [("b", 1), ("a", 3), ("c", 1)]
    manager.blacklist.add("a")
    assert manager.available() == [("b", 1), ("c", 1)]
    manager.update([Host("c", 1), Host("a", 3)])  # b removed
    assert manager.available() == [("c", 1)]
    clock.now += 5.0
    assert manager.available() == [("a", 3), ("c", 1)]  # a's cooldown is over


# ---------------------------------------------------------------- rank order


@pytest.mark.timeout(10)
def test_round_zero_fills_hosts_in_first_seen_order() -> None:
    order = order_workers([], set(), set(), [("a", 2), ("b", 1), ("c", 2)])
    assert order == ["a:0", "a:1", "b:0", "c:0", "c:1"]
    assert order_workers([], set(), set(), [("a", 2), ("b", 1)], max_np=2) == ["a:0", "a:1"]


@pytest.mark.timeout(10)
def test_survivors_come_first_in_their_rank_order_host_by_host() -> None:
    previous = ["c:0", "c:1", "a:0", "b:0"]  # a previous round's rank order
    running = {"c:0", "a:0"}  # c:1 and b:0 ended (b's host is blacklisted below)
    available = [("a", 2), ("c", 2), ("d", 1)]
    order = order_workers(previous, running, set(), available)
    # c has the first survivor: rank 0. Each host's new slots follow its survivors.
    assert order == ["c:0", "c:1", "a:0", "a:1", "d:0"]
    plan = protocol.RoundPlan.from_order(1, 0, order)
    assert [plan.workers[w].local_rank for w in order] == [0, 1, 0, 1, 0]
    assert plan.workers["a:0"].cross_rank == 1
    assert order_workers(previous, running, set(), available, max_np=3) == ["c:0", "c:1", "a:0"]


@pytest.mark.timeout(10)
def test_stopping_and_left_out_processes_are_not_survivors_and_hold_their_slots() -> None:
    previous = ["a:0", "b:0"]
    # b:0 is being stopped (its host was blacklisted, and its cooldown already ended);
    # x:0 was left out of an earlier round and still runs.
    order = order_workers(previous, {"a:0", "b:0", "x:0"}, {"b:0"}, [("a", 1), ("b", 1), ("x", 2)])
    assert order == ["a:0", "x:1"]
    # Slots that shrank drop their workers.
    assert order_workers(["a:0", "a:1"], {"a:0", "a:1"}, set(), [("a", 1)]) == ["a:0"]


@pytest.mark.timeout(10)
def test_slots_taken_out_are_left_out_of_the_order() -> None:
    order = order_workers(["a:0", "a:1", "a:2"], {"a:0", "a:2"}, set(), [("a", 3)], out=["a:1"])
    assert order == ["a:0", "a:2"]
    assert order_workers([], set(), set(), [("a", 2), ("b", 1)], out=["a:0"]) == ["a:1", "b:0"]


@pytest.mark.timeout(10)
def test_usable_slots_leave_out_blacklisted_hosts_and_slots_taken_out() -> None:
    clock = _Clock()
    manager = HostManager(Blacklist(cooldown=(5.0, 5.0), clock=clock, rand=lambda: 0.0))
    manager.update([Host("a", 2), Host("b", 1), Host("c", 1)])
    manager.slots_out.add("a:1")
    manager.slots_out.add("c:0")
    manager.blacklist.add("c")
    assert manager.out() == ["a:1"]  # c:0's host is out anyway
    assert manager.usable() == [("a", 1), ("b", 1)]
    assert manager.usable_slots(without="a") == 1
    manager.update([Host("a", 1), Host("b", 1)])  # a shrank: a:1 no longer exists
    assert manager.out() == []
    clock.now += 5.0
    manager.update([Host("a", 2), Host("b", 1)])
    assert manager.out() == [] and manager.usable_slots() == 3  # a:1's cooldown is over


@pytest.mark.timeout(10)
def test_update_flags_and_description() -> None:
    assert update_flags(["a:0"], ["a:0", "b:0"]) == protocol.HOSTS_ADDED
    assert update_flags(["a:0", "b:0"], ["a:0"]) == protocol.HOSTS_REMOVED
    both = protocol.HOSTS_ADDED | protocol.HOSTS_REMOVED
    assert update_flags(["a:0", "b:0"], ["a:0", "c:0"]) == both
    assert update_flags(["a:0"], ["a:0"]) == 0
    assert describe_change(["a:0", "b:0"], ["a:0", "c:0"]) == (
        "hosts changed: added c:0; removed b:0"
    )


# ---------------------------------------------------------------- options


@pytest.mark.timeout(10)
def test_elastic_flags_fill_each_others_defaults(tmp_path: Path) -> None:
    args = parse(["--min-np", "2", "--max-np", "4", *COMMAND])
    assert args.elastic is not None and args.np == 2 and args.elastic.min_np == 2
    args = parse(["-np", "3", "--max-np", "4", *COMMAND])
    assert args.elastic is not None and args.elastic.min_np == 3
    script = _script(tmp_path, "echo a\n")
    args = parse(["-np", "2", "--host-discovery-script", script, *COMMAND])
    assert args.elastic is not None and args.elastic.min_np == 2 and args.elastic.max_np is None
    assert parse(["-np", "2", *COMMAND]).elastic is None
    limits = _limits(parse(["--min-np", "2", "--elastic-timeout", "7", *COMMAND]))
    assert (limits.np, limits.min_np, limits.max_np, limits.timeout_s) == (2, 2, None, 7.0)


@pytest.mark.timeout(10)
def test_elastic_timeout_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", "42")
    assert _limits(parse(["--min-np", "1", *COMMAND])).timeout_s == 42.0
    monkeypatch.delenv("HOROVOD_ELASTIC_TIMEOUT")
    assert _limits(parse(["--min-np", "1", *COMMAND])).timeout_s == 600.0


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--min-np", "0"], r"--min-np must be >= 1, got 0"),
        (["--min-np", "3", "--max-np", "2"], r"-np 3 is more than --max-np 2"),
        (["-np", "1", "--min-np", "2"], r"-np 1 is less than --min-np 2"),
        (["-np", "5", "--max-np", "4"], r"-np 5 is more than --max-np 4"),
        (["--min-np", "1", "--slots-per-host", "0"], r"--slots-per-host must be >= 1"),
        (["--min-np", "1", "--elastic-timeout", "0"], r"--elastic-timeout must be > 0"),
        (["--min-np", "1", "--reset-limit", "-1"], r"reset_limit=-1 must be >= 0"),
        (
            ["--min-np", "1", "--blacklist-cooldown-range", "0.5", "10"],
            r"--blacklist-cooldown-range 0.5 10: need 1 <= MIN <= MAX <= 3600",
        ),
        (
            ["--min-np", "1", "--blacklist-cooldown-range", "20", "10"],
            r"need 1 <= MIN <= MAX",
        ),
        (
            ["--min-np", "1", "--blacklist-cooldown-range", "1", "4000"],
            r"need 1 <= MIN <= MAX <= 3600",
        ),
        (["-np", "1", "--host-discovery-script", "/nonexistent/d.sh"], r"no such file"),
    ],
)
def test_bad_elastic_flags_are_refused(flags: list[str], match: str) -> None:
    with pytest.raises(OptionError, match=match):
        parse([*flags, *COMMAND])


@pytest.mark.timeout(10)
def test_discovery_script_must_be_executable(tmp_path: Path) -> None:
    path = tmp_path / "d.sh"
    path.write_text("#!/bin/sh\necho a\n")
    path.chmod(0o644)
    with pytest.raises(OptionError, match=r"is not executable; run `chmod \+x"):
        parse(["-np", "1", "--host-discovery-script", str(path), *COMMAND])


@pytest.mark.timeout(10)
def test_elastic_only_flags_without_elastic_mode_are_noted() -> None:
    said = "\n".join(parse(["-np", "2", "--reset-limit", "3", *COMMAND]).notes)
    assert "--reset-limit has no effect: the job is not elastic" in said
    said = "\n".join(parse(["--min-np", "2", "--slots-per-host", "3", *COMMAND]).notes)
    assert "--slots-per-host has no effect: it applies to hosts a --host-discovery-script" in said


@pytest.mark.timeout(30)
def test_launch_refuses_bad_elastic_flags_with_status_2(tmp_path: Path) -> None:
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "hora.runner.launch", "--min-np", "3", "--max-np", "2", "true"],
        capture_output=True,
        text=True,
        timeout=25,
    )
    assert result.returncode == 2
    assert "horarun: -np 3 is more than --max-np 2." in result.stderr


# ---------------------------------------------------------------- the driver's decisions


class _Process:
    """Stands in for a watchdog's Popen."""

    def __init__(self) -> None:
        self.returncode: int | None = None
        self.stdin = None


class _FakeSpawner:
    """Records the workers the driver starts; the test ends them."""

    def __init__(self) -> None:
        self.supervisor = SimpleNamespace(workers=[])
        self.started: list[str] = []
        self.released: list[str] = []

    def spawn(self, worker_id: str) -> Worker:
        number = len(self.started)
        self.started.append(worker_id)
        host = worker_id.rpartition(":")[0]
        worker = Worker(Slot(host, number, 0, 1, 0, 1, 1), _Process())  # type: ignore[arg-type]
        worker.pid = 1000 + number
        spawner = self

        def release() -> None:
            spawner.released.append(worker_id)

        worker.release_stdin = release  # type: ignore[method-assign]
        self.supervisor.workers.append(worker)
        return worker

    def end(self, number: int, code: int, stderr: str = "") -> None:
        worker = self.supervisor.workers[number]
        worker.status = code
        if stderr:
            worker.stderr_tail.append(stderr)
        worker.done.set()


class _Harness:
    def __init__(
        self,
        hosts: list[Host],
        np: int,
        min_np: int | None = None,
        max_np: int | None = None,
        timeout_s: float = 30.0,
        reset_limit: int | None = None,
        cooldown: tuple[float, float] | None = None,
    ) -> None:
        self.clock = _Clock()
        self.hosts = hosts
        self.spawner = _FakeSpawner()
        self.log = next(h for h in logging.getLogger("hora.runner").handlers if isinstance(h, _Log))
        self.store = StoreClient("", 0, new_secret(), 5.0)
        limits = Limits(np, min_np or np, max_np, timeout_s, reset_limit, cooldown)
        watcher = SimpleNamespace(hosts=lambda: list(self.hosts))
        self.driver = Driver(
            limits,
            HostManager(Blacklist(cooldown, clock=self.clock, rand=lambda: 0.0)),
            watcher,  # type: ignore[arg-type]
            self.spawner,  # type: ignore[arg-type]
            self.store,
            lambda hosts: hosts,
            clock=self.clock,
        )
        # A round's own store space lives in the same in-process store here.
        self.driver._round_store = self._round_store  # type: ignore[method-assign]

    @property
    def said(self) -> list[str]:
        """The driver's progress lines (shown under --verbose)."""
        return self.log.lines(high=logging.DEBUG)

    @property
    def told(self) -> list[str]:
        """The driver's lines shown without --verbose."""
        return self.log.lines(logging.INFO)

    def _round_store(self, number: int) -> StoreClient:
        clone = self.store.reconnect()
        clone.prefix = protocol.round_prefix(number)
        clone.namespace = clone.prefix + clone.namespace
        return clone

    def step(self, seconds: float = 0.0) -> int | None:
        self.clock.now += seconds
        return self.driver.step()

    def join(self, *worker_ids: str) -> None:
        """The workers reached the newest round's barrier (all of the round's by default)."""
        plan = self.plan()
        space = self._round_store(plan.number)
        for worker_id in worker_ids or plan.ranked():
            space.set_signed(protocol.arrived_key(plan.workers[worker_id].rank), b"")

    def plan(self) -> protocol.RoundPlan:
        number = int(self.store.get_signed(protocol.ROUND_KEY))
        return protocol.RoundPlan.from_json(self.store.get_signed(protocol.plan_key(number)))


@pytest.mark.timeout(20)
def test_round_zero_waits_for_np_slots_then_uses_all_up_to_max_np() -> None:
    h = _Harness([Host("a", 1)], np=2, max_np=3, timeout_s=30.0)
    assert h.step() is None
    assert h.spawner.started == []
    assert not h.store.check(protocol.ROUND_KEY)
    h.hosts = [Host("a", 1), Host("b", 2), Host("c", 1)]
    h.step(1.0)
    plan = h.plan()
    assert plan.number == 0 and plan.ranked() == ["a:0", "b:0", "b:1"]
    assert h.spawner.started == ["a:0", "b:0", "b:1"]
    assert any("round 0: 3 workers on 2 hosts (rank 0 a:0, rank 1 b:0" in s for s in h.said)


@pytest.mark.timeout(20)
def test_round_zero_says_what_it_waits_for() -> None:
    logging.getLogger("hora.runner").setLevel(logging.INFO)
    h = _Harness([Host("a", 1)], np=3, min_np=2, timeout_s=600.0)
    h.step()
    h.step(driver_module.WAIT_REPORT_S)
    assert h.told == [
        "waiting for 2 more slots: the hosts found offer 1 (a:1), -np 3 needs 3; "
        "giving up in 600 s",
        "waiting for 2 more slots: the hosts found offer 1 (a:1), -np 3 needs 3; "
        "giving up in 590 s",
    ]
    h.hosts = [Host("a", 1), Host("b", 2)]
    h.step(1.0)
    assert h.plan().number == 0 and len(h.told) == 2


@pytest.mark.timeout(20)
def test_round_zero_times_out_naming_the_hosts_found() -> None:
    h = _Harness([Host("a", 1)], np=3, timeout_s=5.0)
    h.step()
    with pytest.raises(
        ElasticError, match=r"timed out after 5 s waiting for 3 slots.*offer 1 \(a:1"
    ):
        h.step(5.0)


@pytest.mark.timeout(20)
def test_without_verbose_a_new_round_is_one_line_naming_the_new_workers() -> None:
    logging.getLogger("hora.runner").setLevel(logging.INFO)
    h = _Harness([Host("a", 1), Host("b", 1)], np=1, min_np=1)
    h.step()
    assert h.plan().ranked() == ["a:0", "b:0"]
    h.hosts = [Host("a", 1), Host("b", 1), Host("c", 1)]
    h.step()
    assert h.plan().number == 1
    assert h.told == [
        "round 1: 3 workers on 3 hosts, reason: hosts changed: added c:0; started worker 2 (c:0)"
    ]
    assert h.said == []  # round 0 and the worker starts are --verbose lines


@pytest.mark.timeout(20)
def test_a_failed_worker_is_recorded_its_host_blacklisted_and_a_round_formed() -> None:
    h = _Harness([Host("a", 1), Host("b", 2), Host("c", 1)], np=2, min_np=2)
    h.step()
    assert h.plan().ranked() == ["a:0", "b:0", "b:1", "c:0"]
    h.spawner.end(1, -9)  # b:0, rank 1, killed
    h.step()
    # The survivors' round space names the lost rank, and the job is marked failed there.
    space = h._round_store(0)
    assert space.get_signed("exit/1").decode() == (
        "rank 1 of round 0 (b:0, worker 1, pid 1001) was killed by SIGKILL"
    )
    assert space.check("failure")
    # Horovod blacklists the whole host: b:1 is stopped too and left out.
    assert h.spawner.released == ["b:1"]
    plan = h.plan()
    assert plan.number == 1 and plan.ranked() == ["a:0", "c:0"]
    assert h.spawner.started == ["a:0", "b:0", "b:1", "c:0"]  # nobody new
    assert any(
        "round 1: 2 workers on 2 hosts (rank 0 a:0, rank 1 c:0), reason: rank 1 (b:0) was "
        "killed by SIGKILL; host b blacklisted" in s
        for s in h.said
    )
    assert any("blacklisted host b for good" in s for s in h.said)
    # b:1 ends from being stopped: not a failure.
    h.spawner.end(2, -15)
    h.step()
    assert h.plan().number == 1


@pytest.mark.timeout(20)
def test_a_failure_after_cooldown_brings_the_host_back_as_added() -> None:
    h = _Harness([Host("a", 1), Host("b", 1)], np=2, min_np=1, cooldown=(10.0, 10.0))
    h.step()
    h.spawner.end(1, 1)
    h.step()
    assert h.plan().ranked() == ["a:0"]
    h.step(10.0)
    # b's cooldown is over and its old process has ended: it comes back as an added host.
    plan = h.plan()
    assert plan.number == 2 and plan.ranked() == ["a:0", "b:0"] and plan.updates == 1
    number, flags = protocol.read_host_update(h.store)
    assert (number, flags) == (1, protocol.HOSTS_ADDED)
    assert h.spawner.started == ["a:0", "b:0", "b:0"]


@pytest.mark.timeout(20)
def test_host_changes_publish_a_notice_then_the_next_round() -> None:
    h = _Harness([Host("a", 1), Host("b", 1)], np=2, min_np=1, max_np=3)
    h.step()
    h.hosts = [Host("a", 1), Host("b", 1), Host("c", 2)]
    h.step(1.0)
    plan = h.plan()
    assert plan.ranked() == ["a:0", "b:0", "c:0"]  # max-np 3
    assert protocol.read_host_update(h.store) == (1, protocol.HOSTS_ADDED)
    assert plan.updates == 1
    h.step(1.0)
    assert h.plan().number == 1  # nothing changed since
    h.hosts = [Host("b", 1), Host("c", 2)]  # a removed: b's worker becomes rank 0
    h.step(1.0)
    plan = h.plan()
    assert plan.number == 2 and plan.ranked() == ["b:0", "c:0", "c:1"]
    both = protocol.HOSTS_ADDED | protocol.HOSTS_REMOVED
    assert protocol.read_host_update(h.store) == (2, both)
    # a:0 leaves by itself with status 0: neither a failure nor the end of training.
    h.spawner.end(0, 0)
    assert h.step() is None
    assert h.plan().number == 2


@pytest.mark.timeout(20)
def test_a_reset_request_forms_a_new_round_with_the_same_workers() -> None:
    h = _Harness([Host("a", 1), Host("b", 1)], np=2)
    h.step()
    h.store.set_signed(protocol.reset_key(0), b"")
    h.step()
    assert h.plan().number == 0  # a process exit that explains it may still come
    h.step(elastic.RESET_GRACE_S)
    plan = h.plan()
    assert plan.number == 1 and plan.ranked() == ["a:0", "b:0"]
    assert len(h.spawner.started) == 2
    h.step()
    assert h.plan().number == 1


@pytest.mark.timeout(20)
def test_a_reset_request_explained_by_a_failure_makes_one_round() -> None:
    h = _Harness([Host("a", 1), Host("b", 1), Host("c", 1)], np=3, min_np=1)
    h.step()
    h.store.set_signed(protocol.reset_key(0), b"")  # a survivor's collective failed first
    h.step(0.1)
    h.spawner.end(1, -9)  # then horarun sees b:0's death
    h.step(0.1)
    assert h.plan().number == 1 and h.plan().ranked() == ["a:0", "c:0"]
    h.step(elastic.RESET_GRACE_S)
    assert h.plan().number == 1
    assert h.driver.rounds.resets == 1


@pytest.mark.timeout(20)
def test_reset_limit_stops_the_job() -> None:
    h = _Harness([Host("a", 1), Host("b", 1), Host("c", 1)], np=3, min_np=1, reset_limit=1)
    h.step()
    h.spawner.end(2, 1, "bad batch")
    h.step()
    assert h.plan().number == 1
    h.spawner.end(1, 1)
    with pytest.raises(
        ElasticError, match=r"the job was reset 2 times, more than --reset-limit 1 allows"
    ):
        h.step()
    assert "last worker failure: rank 1 of round 1 (b:0" in h.driver.report()


@pytest.mark.timeout(20)
def test_too_few_slots_wait_for_elastic_timeout_then_stop() -> None:
    h = _Harness([Host("a", 1), Host("b", 1)], np=2, min_np=2, timeout_s=20.0)
    h.step()
    h.spawner.end(1, 3)
    h.step()
    assert h.plan().number == 0
    # Said at once, without --verbose, then every WAIT_REPORT_S (not at every step).
    assert h.told == [
        "waiting for 1 more slot: the hosts found offer 1 (a:1), --min-np 2 needs 2; "
        "blacklisted hosts: b; giving up in 20 s"
    ]
    h.step(5.0)
    assert len(h.told) == 1
    h.step(driver_module.WAIT_REPORT_S - 5.0)
    assert h.told[1:] == [
        "waiting for 1 more slot: the hosts found offer 1 (a:1), --min-np 2 needs 2; "
        "blacklisted hosts: b; giving up in 10 s"
    ]
    h.step(9.0)
    h.hosts = [Host("a", 1), Host("b", 1), Host("c", 1)]  # help arrives in time
    h.step(0.5)
    assert h.plan().number == 1 and h.plan().ranked() == ["a:0", "c:0"]

    h = _Harness([Host("a", 1), Host("b", 1)], np=2, min_np=2, timeout_s=20.0)
    h.step()
    h.spawner.end(1, 3)
    h.step()
    with pytest.raises(
        ElasticError,
        match=r"fewer than --min-np 2 slots were available for 20 s .*1 usable \(a:1\); "
        r"blacklisted hosts: b",
    ):
        h.step(20.0)


@pytest.mark.timeout(20)
def test_a_failure_on_the_only_host_takes_out_its_slot_not_the_host() -> None:
    logging.getLogger("hora.runner").setLevel(logging.INFO)
    h = _Harness([Host("a", 3)], np=3, min_np=2)
    h.step()
    h.spawner.end(1, -9)  # a:1, rank 1, killed
    h.step()
    # Blacklisting a would leave no slot: only a:1 is out, a:0 and a:2 go on.
    plan = h.plan()
    assert plan.number == 1 and plan.ranked() == ["a:0", "a:2"]
    assert h.spawner.released == [] and h.spawner.started == ["a:0", "a:1", "a:2"]
    assert h.told == [
        "round 1: 2 workers on 1 host, reason: rank 1 (a:1) was killed by SIGKILL; slot a:1 "
        "taken out (blacklisting host a would leave 0 slots, fewer than --min-np 2)"
    ]
    assert h.driver.manager.blacklist.hosts() == [] and h.driver.manager.out() == ["a:1"]
    # Another failure leaves one slot, below --min-np: the job waits, saying why.
    h.spawner.end(2, 1)
    h.step()
    assert h.plan().number == 1
    assert h.told[-1] == (
        "waiting for 1 more slot: the hosts found offer 1 (a:1), --min-np 2 needs 2; slots "
        "taken out after failures: a:1, a:2; giving up in 30 s"
    )


@pytest.mark.timeout(20)
def test_a_slot_taken_out_comes_back_after_its_cooldown() -> None:
    h = _Harness([Host("a", 2)], np=2, min_np=1, cooldown=(10.0, 10.0))
    h.step()
    h.spawner.end(1, 1)
    h.step()
    assert h.plan().ranked() == ["a:0"]
    h.step(10.0)
    plan = h.plan()
    assert plan.number == 2 and plan.ranked() == ["a:0", "a:1"]
    assert protocol.read_host_update(h.store) == (1, protocol.HOSTS_ADDED)


@pytest.mark.timeout(20)
def test_a_host_is_blacklisted_when_the_others_keep_min_np_slots() -> None:
    # Horovod's rule whenever the job can spare the host: all of it goes, b:1 is stopped.
    h = _Harness([Host("a", 2), Host("b", 2)], np=4, min_np=2)
    h.step()
    h.spawner.end(2, 1)  # b:0
    h.step()
    assert h.plan().ranked() == ["a:0", "a:1"] and h.spawner.released == ["b:1"]
    # Without a, fewer than --min-np 3 slots would be left: only the slot goes.
    h = _Harness([Host("a", 2), Host("b", 2)], np=4, min_np=3)
    h.step()
    h.spawner.end(2, 1)
    h.step()
    assert h.plan().ranked() == ["a:0", "a:1", "b:1"] and h.spawner.released == []


@pytest.mark.timeout(20)
def test_every_host_blacklisted_stops_the_job() -> None:
    h = _Harness([Host("a", 1), Host("b", 1)], np=2, min_np=1)
    h.step()
    h.spawner.end(0, 1)
    h.spawner.end(1, 1)
    with pytest.raises(ElasticError, match=r"every host is blacklisted .*\(a, b\)"):
        h.step()


@pytest.mark.timeout(20)
def test_first_worker_to_finish_ends_the_job() -> None:
    h = _Harness([Host("a", 1), Host("b", 1)], np=2, timeout_s=10.0)
    h.step()
    h.join()
    h.spawner.end(1, 0)
    assert h.step() is None  # a:0 still has time to finish
    h.spawner.end(0, 0)
    assert h.step() == 0

    h = _Harness([Host("a", 1), Host("b", 1)], np=2, timeout_s=10.0)
    h.step()
    h.join()
    h.spawner.end(0, 0)
    h.step()
    h.join()
    h.spawner.end(1, 2, "disk full")
    assert h.step() == 1
    assert h.driver.report().startswith(
        "rank 1 of round 0 (b:0, worker 1, pid 1001) exited with code 2"
    )
    assert "    disk full" in h.driver.report()

    h = _Harness([Host("a", 1), Host("b", 1)], np=2, timeout_s=10.0)
    h.step()
    h.join()
    h.spawner.end(0, 0)
    h.step()
    assert h.step(10.0) == 1  # b:0 never finished: stopped
    assert h.spawner.released == ["b:0"]
    assert "was still running 10 s after rank 0 (a:0) finished" in h.driver.report()


@pytest.mark.timeout(20)
def test_workers_that_never_trained_in_the_last_round_do_not_count() -> None:
    h = _Harness([Host("a", 1), Host("b", 1)], np=2, max_np=3)
    h.step()
    h.join()
    h.hosts = [Host("a", 1), Host("b", 1), Host("c", 1)]
    h.step(1.0)
    assert h.plan().ranked() == ["a:0", "b:0", "c:0"]
    # Training ended in round 0 before round 1 formed: c:0 waits at round 1's barrier in vain,
    # b:0 is still busy in round 0 (writing a checkpoint, say) and gets its time.
    h.join("c:0")
    h.spawner.end(0, 0)
    assert h.step() is None
    assert h.spawner.released == ["c:0"]
    h.spawner.end(1, 0)
    assert h.step() == 0


@pytest.mark.timeout(20)
def test_round_zero_workers_get_their_time_even_before_it_formed() -> None:
    h = _Harness([Host("a", 1), Host("b", 1)], np=2, timeout_s=10.0)
    h.step()
    h.spawner.end(0, 0)  # a:0 finished (without ever calling hvd.init(), say)
    assert h.step() is None
    assert h.spawner.released == []  # b:0 may still be busy before its hvd.init()
    h.spawner.end(1, 0)
    assert h.step() == 0


@pytest.mark.timeout(20)
def test_worker_environment_is_elastic_without_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HORA_RANK", "3")
    monkeypatch.setenv("HOROVOD_SIZE", "8")
    captured: dict[str, Any] = {}

    class Recorder:
        workers: list[Worker] = []

        def spawn(self, slot: Slot, command: list[str], env: dict[str, str], **kw: Any) -> str:
            captured.update(slot=slot, command=command, env=env, **kw)
            return "worker"

    class Store:
        def env(self) -> dict[str, str]:
            return {"HORA_RENDEZVOUS_PORT": "1"}

    job = Job(
        ["python", "t.py"],
        Store(),  # type: ignore[arg-type]
        Recorder(),  # type: ignore[arg-type]
        {"HORA_ELASTIC_TIMEOUT": "70"},
        SshSettings(),
    )
    spawner = elastic.Spawner(job, lambda host: host == "far")
    spawner.spawn("near:1")
    env = captured["env"]
    assert env["HORA_ELASTIC"] == "1" and env["HORA_ELASTIC_ID"] == "near:1"
    assert env["HORA_HOSTNAME"] == "near" and env["HORA_ELASTIC_TIMEOUT"] == "70"
    assert "HORA_RANK" not in env and "HOROVOD_SIZE" not in env
    assert captured["slot"].rank == 0 and captured["ssh"] is None
    spawner.spawn("far:0")
    assert captured["slot"].rank == 1 and captured["ssh"] is not None


@pytest.mark.timeout(10)
def test_importing_the_launcher_does_not_import_torch() -> None:
    import sys

    code = "import sys, hora.runner.launch, hora.runner.elastic; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr
