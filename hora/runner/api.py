"""``hora.run``: run a Python function on a job's workers and collect what each returned.

``hora.run`` takes ``horovod.run``'s arguments. They become the same typed
:class:`~hora.runner.options.LaunchOptions` as ``horarun``'s flags
(:mod:`hora.runner.run_arguments`, through :func:`hora.runner.options.from_values`: the same
checks, the same notes on arguments that have no effect in hora), and the job runs on
``horarun``'s machinery: the static driver (:func:`hora.runner.static.plan_job`), the elastic one
(:func:`hora.runner.elastic.plan_elastic`), a :class:`~hora.runner.job.Job` for the store, the
secret, the supervisor and the workers' environment, and :mod:`hora.runner.mpi_launch` for
``use_mpi``. Only the command differs: every worker runs :mod:`hora.runner.task`, which fetches
the function from the job's store (signed with the job secret), runs it and posts the outcome
there (:mod:`hora.runner.run_payloads`).

What comes back: a static job's results in rank order; an elastic job's, as Horovod returns them,
those of ranks ``0 .. min_num_proc - 1``, here of the final round (the ranks that finished the
training). Importing this module never imports PyTorch.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from hora.runner import mpi_launch, options
from hora.runner.elastic import DiscoveryError, ElasticPlan, plan_elastic
from hora.runner.fork_server import ForkServer
from hora.runner.hosts import HostError
from hora.runner.job import Job, Plan, forwarder_for
from hora.runner.options import LaunchOptions
from hora.runner.run_arguments import (
    FLAG_OF_ARGUMENT,
    environment_with,
    in_our_words,
    launch_options,
    one_of,
)
from hora.runner.run_payloads import (
    FUNCTION_KEY,
    collect,
    collect_round,
    final_round,
    pickled_call,
    result_key,
    worker_result_key,
)
from hora.runner.static import StaticPlan, plan_job
from hora.runner.supervisor import describe_exit

__all__ = [
    "FLAG_OF_ARGUMENT",
    "FUNCTION_KEY",
    "HoraRunError",
    "in_our_words",
    "launch_options",
    "pickled_call",
    "result_key",
    "run",
    "worker_result_key",
]

logger = logging.getLogger("hora.runner")


class HoraRunError(RuntimeError):
    """One or more workers of :func:`run` failed.

    Attributes:
        results: the results of the ranks that returned, by rank.
        errors: the error text of the ranks that raised or died, by rank.
    """

    def __init__(self, message: str, results: dict[int, Any], errors: dict[int, str]) -> None:
        super().__init__(message)
        self.results = results
        self.errors = errors


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    cooldown_range: tuple[float, float] | None = None,
    hosts: str | Sequence[str] | None = None,
    hostfile: str | os.PathLike[str] | None = None,
    host_discovery_script: str | os.PathLike[str] | None = None,
    start_timeout: float | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | os.PathLike[str] | None = None,
    disable_cache: bool | None = None,
    output_filename: str | os.PathLike[str] | None = None,
    verbose: bool | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | Sequence[str] | None = None,
    network_interface: str | None = None,
    network_interfaces: str | Sequence[str] | None = None,
    executable: str | os.PathLike[str] | None = None,
    np: int | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
    *,
    env: Mapping[str, str | None] | None = None,
    timeout_s: float | None = None,
    prefix_output: bool = True,
    ssh_options: Sequence[str] | None = None,
    fork_server: ForkServer | None = None,
) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on every worker of a job and return what each returned.

    The arguments are ``horovod.run``'s, in its order, and mean what ``horarun``'s flags of the
    same name mean (see docs/launching.md). Each worker is a fresh Python process with the
    topology variables set, so ``func`` calls ``hvd.init()`` itself, as a training script would.

    Args:
        func: the function (closures and lambdas work: it is sent with cloudpickle).
        args: positional arguments for ``func``.
        kwargs: keyword arguments for ``func``.
        num_proc: number of workers (default 1; in an elastic job, ``min_num_proc``).
        min_num_proc: fewest workers an elastic job trains with (makes the job elastic).
        max_num_proc: most workers an elastic job trains with (makes the job elastic).
        slots: slots of a host the discovery script prints without ``:N`` (``--slots``).
        reset_limit: most times an elastic job may re-form after its first round.
        cooldown_range: ``(low, high)`` seconds a failed host stays out of an elastic job.
        hosts: ``"host:slots,host:slots"`` (or a list of ``"host:slots"``); other machines
            are reached over SSH. Default ``localhost:num_proc``.
        hostfile: a file of ``host slots=N`` lines, in place of ``hosts``.
        host_discovery_script: an executable printing the available hosts, one ``host`` or
            ``host:slots`` a line (makes the job elastic).
        start_timeout: seconds a worker may take to reach the job's store.
        ssh_port: port of ``sshd`` on the hosts.
        ssh_identity_file: the private key SSH logs in with.
        disable_cache: accepted; hora keeps no cache and checks SSH at every launch.
        output_filename: also write each rank's output to ``DIR/rank.<rank>/stdout|stderr``.
        verbose: say what the launch does, on stderr, with a note for each argument that has
            no effect in hora.
        use_gloo: the workers talk over Gloo (the default).
        use_mpi: start the workers with ``mpirun``; they talk over MPI (needs mpi4py).
        mpi_args: more arguments for ``mpirun``, as one string or a list.
        network_interface: Horovod's deprecated comma-separated form of
            ``network_interfaces``.
        network_interfaces: the interfaces the job uses (the first for Gloo and the store).
        executable: the Python the workers run (default: this one, ``sys.executable``).
        np: the old name of ``num_proc`` (hora's first keyword).
        min_np: the old name of ``min_num_proc``.
        max_np: the old name of ``max_num_proc``.
        env: the job's environment is this process's, with these variables set (a value of
            ``None`` removes the variable): the workers get it, and the launcher's settings
            (``HORA_ELASTIC_TIMEOUT``, ...) are read there.
        timeout_s: stop the workers and raise ``TimeoutError`` after this long.
        prefix_output: prefix forwarded output lines with ``[rank]<stream>:``.
        ssh_options: hora's own: extra ``ssh -o`` options (``"Key=Value"``), as
            ``--ssh-option``.
        fork_server: hora's own: a :class:`~hora.runner.fork_server.ForkServer` this machine's
            workers are forked from, instead of each starting a new interpreter (see
            docs/launching.md). Ignored under ``use_mpi``.

    Returns:
        The value ``func`` returned on each rank, in rank order. An elastic job returns, as
        Horovod does, those of ranks ``0 .. min_num_proc - 1``, here of its final round.

    Raises:
        ValueError: an argument is out of range, arguments that exclude each other are given
            together (``hosts`` and ``hostfile``, ``use_gloo`` and ``use_mpi``, ``np`` and
            ``num_proc`` that disagree), a host cannot be used or reached, or MPI is asked for
            and missing; nothing has been started. The message names the argument.
        TypeError: an argument has the wrong type.
        HoraRunError: a worker raised or exited abnormally; the message names the rank.
        TimeoutError: ``timeout_s`` passed first.

    Example:
        >>> def work():
        ...     import hora.torch as hvd
        ...     hvd.init()
        ...     return hvd.rank()
        >>> hora.run(work, num_proc=2)
        [0, 1]
        >>> hora.run(work, hosts="localhost:2", num_proc=2)
        [0, 1]
    """
    if not callable(func):
        raise TypeError(f"hora.run: func must be callable, got {type(func).__name__}.")
    if fork_server is not None and not isinstance(fork_server, ForkServer):
        raise TypeError(
            f"hora.run: fork_server must be a hora.ForkServer, got {type(fork_server).__name__}."
        )
    given = {
        "num_proc": one_of("num_proc", num_proc, "np", np),
        "min_num_proc": one_of("min_num_proc", min_num_proc, "min_np", min_np),
        "max_num_proc": one_of("max_num_proc", max_num_proc, "max_np", max_np),
        "slots": slots,
        "reset_limit": reset_limit,
        "cooldown_range": cooldown_range,
        "hosts": hosts,
        "hostfile": hostfile,
        "host_discovery_script": host_discovery_script,
        "start_timeout": start_timeout,
        "ssh_port": ssh_port,
        "ssh_identity_file": ssh_identity_file,
        "ssh_options": ssh_options,
        "disable_cache": disable_cache,
        "output_filename": output_filename,
        "verbose": verbose,
        "use_gloo": use_gloo,
        "use_mpi": use_mpi,
        "mpi_args": mpi_args,
        "network_interface": network_interface,
        "network_interfaces": network_interfaces,
        "prefix_output": prefix_output,
    }
    base_env = environment_with(env)
    launch = launch_options(given, executable, base_env)
    payload = pickled_call(func, tuple(args), dict(kwargs or {}))
    return _run_job(launch, payload, base_env, timeout_s, fork_server)


def _run_job(
    launch: LaunchOptions,
    payload: bytes,
    base_env: Mapping[str, str],
    timeout_s: float | None,
    fork_server: ForkServer | None = None,
) -> list[Any]:
    """The job run by its driver (or ``mpirun``), saying what it does under ``verbose``."""
    with _verbose_logging(launch.output.verbose):
        for note in launch.notes:
            logger.debug("%s", in_our_words(note))
        if launch.mpi.enabled:
            return _run_mpi(launch, payload, base_env, timeout_s)
        plan = _plan(launch)
        with _open_job(launch, plan, base_env, payload, fork_server) as job:
            if isinstance(plan, ElasticPlan):
                return _run_elastic(job, plan, launch, timeout_s)
            return _run_static(job, plan, launch.np, timeout_s)


@contextmanager
def _verbose_logging(verbose: bool) -> Iterator[None]:
    """Under ``verbose``, what the launch does (the ``hora.runner`` logger's debug lines, the
    notes included) goes to stderr as ``hora.run: <message>`` while the job runs."""
    if not verbose:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("hora.run: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _plan(launch: LaunchOptions) -> StaticPlan | ElasticPlan:
    """Where the job runs, planned by its driver; nothing is started.

    Raises:
        ValueError: the hosts cannot be used or reached, or the executable is missing here.
        RuntimeError: the host discovery script failed.
    """
    try:
        plan: StaticPlan | ElasticPlan
        if launch.elastic is not None:
            plan = plan_elastic(launch.np, launch.hosts, launch.elastic)
            local = any(not plan.locality.is_remote(h.name) for h in plan.watcher.hosts())
        else:
            plan = plan_job(launch.np, launch.hosts)
            local = any(slot.hostname not in plan.remote_hosts for slot in plan.slots)
    except HostError as exc:
        raise HostError(f"hora.run: {in_our_words(str(exc))}") from None
    except DiscoveryError as exc:
        raise DiscoveryError(f"hora.run: {str(exc).rstrip('.')}. The job cannot start.") from None
    if local:
        _check_executable(launch.command[0])
    return plan


def _check_executable(python: str) -> None:
    """The workers of this machine can start ``python``."""
    if shutil.which(python) is None:
        raise ValueError(
            f"hora.run: executable {python!r} is not an executable file here (the workers on "
            "this machine run it); give the path of a Python that has hora installed."
        )


@contextmanager
def _open_job(
    launch: LaunchOptions,
    plan: Plan,
    base_env: Mapping[str, str],
    payload: bytes,
    fork_server: ForkServer | None,
) -> Iterator[Job]:
    """The job for ``plan``'s driver, as ``horarun``'s, without its signal handlers (this is a
    library call), with the function its workers run (``payload``) in its store; closed on
    leaving."""
    with Job.open(
        launch.command,
        plan.network,
        env={**launch.engine_env, **plan.job_env()},
        base_env=base_env,
        forwarder=forwarder_for(launch.output),
        record_exits=plan.record_exits,
        launcher_timeout_s=launch.launcher_timeout_s,
        fork_server=fork_server,
    ) as job:
        job.server.client.set_signed(FUNCTION_KEY, payload)
        yield job


def _run_static(job: Job, plan: StaticPlan, np: int, timeout_s: float | None) -> list[Any]:
    """One worker per slot, all started at once; every rank's result."""
    for slot in plan.slots:
        logger.debug("starting %s: %s", plan.describe(slot), " ".join(job.command))
        job.spawn(slot, slot.env(), remote=slot.hostname in plan.remote_hosts)
    codes = job.supervisor.wait(timeout_s)
    results, errors = collect(
        job.server.client, range(np), lambda rank: _exit_text(job, rank, codes)
    )
    return _in_rank_order(results, errors, np)


def _run_elastic(
    job: Job, plan: ElasticPlan, launch: LaunchOptions, timeout_s: float | None
) -> list[Any]:
    """Rounds of workers driven by the elastic driver; the results of the final round's ranks
    ``0 .. min_num_proc - 1``."""
    assert launch.elastic is not None
    wanted = range(launch.elastic.min_np)
    client = job.server.client
    outcome = plan.run(job, timeout_s)
    final = final_round(client)
    results, errors = collect_round(client, final)
    if outcome.status == 0 and all(rank in results for rank in wanted):
        return [results[rank] for rank in wanted]
    summary = "\n".join(f"rank {r}: {text}" for r, text in sorted(errors.items()))
    where = "" if final is None else f" (round {final.number}, {final.size} workers)"
    raise HoraRunError(
        f"hora.run: the elastic job failed{where}.\n{outcome.message}"
        + (f"\n{summary}" if summary else ""),
        results,
        errors,
    )


def _mpi_launcher() -> mpi_launch.Mpirun:
    """``mpirun``, once mpi4py is known to be there.

    Raises:
        ValueError: mpi4py or ``mpirun`` is missing.
    """
    if importlib.util.find_spec("mpi4py") is None:
        raise ValueError(
            "hora.run: use_mpi needs mpi4py (pip install 'hora[mpi]', or pip install mpi4py "
            "built for the MPI whose mpirun starts the job); or drop use_mpi (the workers then "
            "talk over Gloo)."
        )
    try:
        return mpi_launch.find_mpirun()
    except mpi_launch.MPILaunchError as exc:
        raise ValueError(f"hora.run: {in_our_words(str(exc))}") from None


def _run_mpi(
    launch: LaunchOptions,
    payload: bytes,
    base_env: Mapping[str, str],
    timeout_s: float | None,
) -> list[Any]:
    """The job started by ``mpirun``; rank 0 gets the store's address and secret on its
    standard input (see :mod:`hora.runner.task`)."""
    mpirun = _mpi_launcher()
    plan = _plan(launch)
    assert isinstance(plan, StaticPlan)
    command = mpi_launch.mpirun_command(launch, mpirun, mpi_launch.worker_variables(launch))
    logger.debug("starting the job with %s's launcher: %s", mpirun.flavour, " ".join(command))
    with _open_job(launch, plan, base_env, payload, None) as job:
        server = job.server
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            env=options.worker_env(dict(base_env), {}),
            start_new_session=True,
            text=True,
        )
        assert process.stdin is not None
        try:
            process.stdin.write(f"{server.address} {server.port} {server.secret}\n")
            process.stdin.close()
        except BrokenPipeError:
            pass  # mpirun ended at once; its status and output say why
        try:
            status = process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise TimeoutError(f"the job did not finish within {timeout_s:g} s") from None
        results, errors = collect(
            server.client,
            range(launch.np),
            lambda rank: f"rank {rank} ended without a result (mpirun exited with {status})",
        )
    return _in_rank_order(results, errors, launch.np)


def _in_rank_order(results: dict[int, Any], errors: dict[int, str], np: int) -> list[Any]:
    """The results of ranks ``0 .. np - 1``, in rank order.

    Raises:
        HoraRunError: some ranks failed; the message lists them.
    """
    if errors:
        summary = "\n".join(f"rank {r}: {text}" for r, text in sorted(errors.items()))
        raise HoraRunError(
            f"hora.run: {len(errors)} of {np} ranks failed.\n{summary}", results, errors
        )
    return [results[rank] for rank in range(np)]


def _exit_text(job: Job, rank: int, codes: dict[int, int]) -> str:
    code = codes.get(rank, 0)
    if code == 0:
        return f"rank {rank} exited without returning a result"
    worker = job.supervisor.workers[rank]
    tail = "\n".join(f"    {line}" for line in worker.stderr_tail)
    return f"the process {describe_exit(code)}" + (f"; last stderr lines:\n{tail}" if tail else "")
