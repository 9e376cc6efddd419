"""``hora.run``: run a Python function on a job's workers and collect what each returned.

``hora.run`` takes ``horovod.run``'s arguments. They become the same typed
:class:`~hora.runner.options.LaunchOptions` as ``horarun``'s flags
(:func:`hora.runner.options.from_values`: the same checks, the same notes on arguments that have
no effect in hora), and the job runs on ``horarun``'s machinery: the static driver
(:func:`hora.runner.static.plan_job`), the elastic one (:func:`hora.runner.elastic.plan_elastic`),
a :class:`~hora.runner.job.Job` for the store, the secret, the supervisor and the workers'
environment, and :mod:`hora.runner.mpi_launch` for ``use_mpi``. Only the command differs: every
worker runs :mod:`hora.runner.task`, which fetches the function from the job's store (signed with
the job secret), runs it and posts the outcome there.

What comes back: a static job's results in rank order; an elastic job's, as Horovod returns them,
those of ranks ``0 .. min_num_proc - 1``, here of the final round (the ranks that finished the
training). Importing this module never imports PyTorch.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import types
from collections import ChainMap
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import cloudpickle

from hora.common.job.rounds import ROUND_KEY, RoundPlan, plan_key
from hora.common.job.store import StoreClient
from hora.runner import mpi_launch, options
from hora.runner.elastic import DiscoveryError, ElasticPlan, plan_elastic
from hora.runner.flags import BY_DEST
from hora.runner.hosts import HostError
from hora.runner.job import Job, Plan, forwarder_for
from hora.runner.options import LaunchOptions, OptionError, Refused
from hora.runner.static import StaticPlan, plan_job
from hora.runner.supervisor import describe_exit

FUNCTION_KEY = "run/function"

logger = logging.getLogger("hora.runner")

# hora.run's arguments that are horarun flags: the flag's ``dest`` of each.
FLAG_OF_ARGUMENT: dict[str, str] = {
    "num_proc": "np",
    "min_num_proc": "min_np",
    "max_num_proc": "max_np",
    "slots": "slots",
    "reset_limit": "reset_limit",
    "cooldown_range": "blacklist_cooldown_range",
    "hosts": "hosts",
    "hostfile": "hostfile",
    "host_discovery_script": "host_discovery_script",
    "start_timeout": "start_timeout",
    "ssh_port": "ssh_port",
    "ssh_identity_file": "ssh_identity_file",
    "ssh_options": "ssh_option",
    "disable_cache": "disable_cache",
    "output_filename": "output_filename",
    "verbose": "verbose",
    "use_gloo": "gloo",
    "use_mpi": "mpi",
    "mpi_args": "mpi_args",
    "network_interfaces": "network_interface",
    "network_interface": "network_interfaces",
    "prefix_output": "disable_output_prefix",
}
_ARGUMENT_OF_FLAG = {dest: argument for argument, dest in FLAG_OF_ARGUMENT.items()}
_WHOLE = ("num_proc", "min_num_proc", "max_num_proc", "slots", "reset_limit", "ssh_port")


def result_key(rank: int) -> str:
    """Where a static job's (or an MPI job's) rank posts its outcome."""
    return f"run/result/{rank}"


def worker_result_key(worker_id: str) -> str:
    """Where an elastic job's worker (``host:slot``) posts its outcome, with its round and
    rank."""
    return f"run/result/worker/{worker_id}"


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
    given = {
        "num_proc": _one_of("num_proc", num_proc, "np", np),
        "min_num_proc": _one_of("min_num_proc", min_num_proc, "min_np", min_np),
        "max_num_proc": _one_of("max_num_proc", max_num_proc, "max_np", max_np),
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
    base_env = _base_env(env)
    launch = launch_options(given, executable, base_env)
    payload = pickled_call(func, tuple(args), dict(kwargs or {}))
    with _verbose_logging(launch.output.verbose):
        for note in launch.notes:
            logger.debug("%s", in_our_words(note))
        if launch.mpi.enabled:
            return _run_mpi(launch, payload, base_env, timeout_s)
        plan = _plan(launch)
        if isinstance(plan, ElasticPlan):
            return _run_elastic(plan, launch, payload, base_env, timeout_s)
        return _run_static(plan, launch, payload, base_env, timeout_s)


def pickled_call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """The function and its arguments as the workers load them: cloudpickle's pickle, with the
    file name of every code object it sends by value kept.

    cloudpickle names such code ``<dynamic-code>`` (a function of ``__main__``, of a notebook,
    or of a module registered with ``register_pickle_by_value``), so a worker's traceback would
    not say where the failing line is; with the name kept it shows the user's file and line
    (and the line's text, where the file is there too).
    """
    with io.BytesIO() as file:
        _CallPickler(file).dump((func, args, kwargs))
        return file.getvalue()


# How cloudpickle pickles a code object: a constructor and its arguments (without the file name).
_reduce_code = cloudpickle.Pickler.dispatch_table[types.CodeType]


def _code_keeping_file(code: types.CodeType) -> tuple[Any, ...]:
    build, arguments = _reduce_code(code)
    return _code_with_file, (build, arguments, code.co_filename)


def _code_with_file(build: Any, arguments: tuple[Any, ...], filename: str) -> types.CodeType:
    """A code object as cloudpickle builds it, with its file name back (runs on the worker)."""
    code: types.CodeType = build(*arguments)
    return code.replace(co_filename=filename)


class _CallPickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle is untyped
    dispatch_table = ChainMap(
        {types.CodeType: _code_keeping_file}, cloudpickle.Pickler.dispatch_table
    )


def launch_options(
    given: Mapping[str, Any],
    executable: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> LaunchOptions:
    """The job's options from :func:`run`'s arguments, checked as ``horarun``'s flags are.

    Args:
        given: :func:`run`'s flag arguments by name (``None``: not given).
        executable: the Python the workers run (default: this one).
        env: the job's environment: the launcher's settings (``HORA_ELASTIC_TIMEOUT``,
            ``HORA_LAUNCHER_TIMEOUT_SECONDS``, ...) are read there, as ``horarun`` reads them
            in the environment it shares with its workers (default: ours).

    Raises:
        ValueError: an argument is out of range or arguments exclude each other.
        TypeError: an argument has the wrong type.
    """
    values: dict[str, Any] = {}
    for argument, value in given.items():
        dest = FLAG_OF_ARGUMENT[argument]
        values[dest] = _flag_value(argument, value)
    if values["np"] is None and values["min_np"] is None:
        values["np"] = 1  # horovod.run's default
    python = sys.executable if executable is None else _text("executable", executable)
    command = [python, "-m", "hora.runner.task"]
    if values["mpi"]:
        command.append("--mpi")
    try:
        launch = options.from_values(values, command, env)
    except Refused as refused:
        raise Refused([f"hora.run: {in_our_words(r)}" for r in refused.reasons]) from None
    except OptionError as exc:
        raise OptionError(f"hora.run: {in_our_words(str(exc))}") from None
    if launch.mpi.enabled and launch.elastic is not None:
        raise OptionError(
            "hora.run: use_mpi cannot run an elastic job (MPI cannot add or remove processes of "
            "a running job); drop use_mpi, or min_num_proc/max_num_proc/host_discovery_script."
        )
    return launch


def in_our_words(text: str) -> str:
    """``text`` (a message about ``horarun``'s flags) with each flag named as :func:`run`'s
    argument: ``-np 3 is more than --max-np 2`` reads ``num_proc 3 is more than max_num_proc 2``.
    """
    for dest, argument in _ARGUMENT_OF_FLAG.items():
        name = "prefix_output=False" if argument == "prefix_output" else argument
        for flag in sorted(BY_DEST[dest].flags, key=len, reverse=True):
            text = re.sub(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", name, text)
    return text


def _one_of(name: str, value: int | None, alias: str, alias_value: int | None) -> int | None:
    """Horovod's argument or its older name, whichever is given; both only when they agree."""
    if value is not None and alias_value is not None and value != alias_value:
        raise ValueError(
            f"hora.run: {alias}={alias_value!r} and {name}={value!r} disagree; give one of them "
            f"({alias} is the older name of {name})."
        )
    return value if value is not None else alias_value


def _flag_value(argument: str, value: Any) -> Any:
    """An argument as the parser would store its flag's value (``None``: not given).

    Raises:
        TypeError: the argument has the wrong type.
    """
    if argument == "prefix_output":
        return None if value else True
    if value is None:
        return None
    if argument in ("disable_cache", "verbose", "use_gloo", "use_mpi"):
        return True if value else None
    if argument in _WHOLE:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"hora.run: {argument} must be a whole number, got {value!r}.")
        return value
    convert = _CONVERSIONS.get(argument, _text)
    return convert(argument, value)


def _pair(argument: str, value: Any) -> list[float]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise TypeError(f"hora.run: {argument} must be (low, high) in seconds, got {value!r}.")
    return [_number(argument, v) for v in value]


def _host_list(argument: str, value: Any) -> str:
    return value if isinstance(value, str) else ",".join(_texts(argument, value))


def _mpi_arguments(argument: str, value: Any) -> str:
    return value if isinstance(value, str) else shlex.join(_texts(argument, value))


def _interface_list(argument: str, value: Any) -> list[str]:
    return _texts(argument, value.split(",") if isinstance(value, str) else value)


def _number(argument: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"hora.run: {argument} must be a number, got {value!r}.")
    return float(value)


def _text(argument: str, value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"hora.run: {argument} must be a string or a path, got {value!r}.")
    return os.fspath(value)


def _texts(argument: str, value: Any) -> list[str]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise TypeError(f"hora.run: {argument} must be a list of strings, got {value!r}.")
    items = [item.strip() for item in value if isinstance(item, str)]
    if len(items) != len(value):
        raise TypeError(f"hora.run: {argument} must be a list of strings, got {value!r}.")
    return [item for item in items if item]


# How an argument that is not a switch or a whole number becomes its flag's value (default:
# text, or a path as text).
_CONVERSIONS: dict[str, Callable[[str, Any], Any]] = {
    "start_timeout": _number,
    "cooldown_range": _pair,
    "hosts": _host_list,
    "mpi_args": _mpi_arguments,
    "network_interfaces": _interface_list,
    "ssh_options": _texts,
}


def _base_env(env: Mapping[str, str | None] | None) -> dict[str, str]:
    """This process's environment with ``env`` applied (``None`` removes a variable)."""
    base = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            base.pop(name, None)
        elif isinstance(name, str) and isinstance(value, str):
            base[name] = value
        else:
            raise TypeError(
                f"hora.run: env must map names to strings (or None), got {name!r}: {value!r}."
            )
    return base


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


def _open_job(launch: LaunchOptions, plan: Plan, base_env: Mapping[str, str]) -> Job:
    """The job for ``plan``'s driver, as ``horarun``'s, without its signal handlers (this is a
    library call)."""
    return Job.open(
        launch.command,
        plan.network,
        env={**launch.engine_env, **plan.job_env()},
        base_env=base_env,
        forwarder=forwarder_for(launch.output),
        record_exits=plan.record_exits,
        launcher_timeout_s=launch.launcher_timeout_s,
    )


def _run_static(
    plan: StaticPlan,
    launch: LaunchOptions,
    payload: bytes,
    base_env: Mapping[str, str],
    timeout_s: float | None,
) -> list[Any]:
    """One worker per slot, all started at once; every rank's result."""
    with _open_job(launch, plan, base_env) as job:
        job.server.client.set_signed(FUNCTION_KEY, payload)
        for slot in plan.slots:
            logger.debug("starting %s: %s", plan.describe(slot), " ".join(job.command))
            job.spawn(slot, slot.env(), remote=slot.hostname in plan.remote_hosts)
        codes = job.supervisor.wait(timeout_s)
        results, errors = _collect(
            job.server.client, range(launch.np), lambda rank: _exit_text(job, rank, codes)
        )
    _raise_for(errors, results, launch.np)
    return [results[rank] for rank in range(launch.np)]


def _run_elastic(
    plan: ElasticPlan,
    launch: LaunchOptions,
    payload: bytes,
    base_env: Mapping[str, str],
    timeout_s: float | None,
) -> list[Any]:
    """Rounds of workers driven by the elastic driver; the results of the final round's ranks
    ``0 .. min_num_proc - 1``."""
    assert launch.elastic is not None
    wanted = range(launch.elastic.min_np)
    with _open_job(launch, plan, base_env) as job:
        client = job.server.client
        client.set_signed(FUNCTION_KEY, payload)
        outcome = plan.run(job, timeout_s)
        final = _final_round(client)
        results, errors = _collect_round(client, final)
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


def _final_round(client: StoreClient) -> RoundPlan | None:
    """The newest round the driver published (``None``: none formed)."""
    if not client.check(ROUND_KEY):
        return None
    number = int(client.get_signed(ROUND_KEY))
    return RoundPlan.from_json(client.get_signed(plan_key(number)))


def _collect_round(
    client: StoreClient, final: RoundPlan | None
) -> tuple[dict[int, Any], dict[int, str]]:
    """The outcomes the final round's workers posted, by their rank in it."""
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    if final is None:
        return results, errors
    for worker_id in final.ranked():
        rank = final.workers[worker_id].rank
        key = worker_result_key(worker_id)
        posted = cloudpickle.loads(client.get_signed(key)) if client.check(key) else None
        # A worker that never called hvd.init() posts round -1: it is matched by its id.
        if posted is None or posted[0] not in (final.number, -1):
            errors[rank] = f"worker {worker_id} ended without a result in round {final.number}"
            continue
        status, value = cloudpickle.loads(posted[2])
        if status == "ok":
            results[rank] = value
        else:
            errors[rank] = value
    return results, errors


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
    with _open_job(launch, plan, base_env) as job:
        server = job.server
        server.client.set_signed(FUNCTION_KEY, payload)
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
        results, errors = _collect(
            server.client,
            range(launch.np),
            lambda rank: f"rank {rank} ended without a result (mpirun exited with {status})",
        )
    _raise_for(errors, results, launch.np)
    return [results[rank] for rank in range(launch.np)]


def _collect(
    client: StoreClient, ranks: range, missing: Callable[[int], str]
) -> tuple[dict[int, Any], dict[int, str]]:
    """The results of the ranks that posted one, and the error text of the others."""
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    for rank in ranks:
        key = result_key(rank)
        if client.check(key):
            status, value = cloudpickle.loads(client.get_signed(key))
            if status == "ok":
                results[rank] = value
            else:
                errors[rank] = value
        else:
            errors[rank] = missing(rank)
    return results, errors


def _raise_for(errors: dict[int, str], results: dict[int, Any], np: int) -> None:
    if errors:
        summary = "\n".join(f"rank {r}: {text}" for r, text in sorted(errors.items()))
        raise HoraRunError(
            f"hora.run: {len(errors)} of {np} ranks failed.\n{summary}", results, errors
        )


def _exit_text(job: Job, rank: int, codes: dict[int, int]) -> str:
    code = codes.get(rank, 0)
    if code == 0:
        return f"rank {rank} exited without returning a result"
    worker = job.supervisor.workers[rank]
    tail = "\n".join(f"    {line}" for line in worker.stderr_tail)
    return f"the process {describe_exit(code)}" + (f"; last stderr lines:\n{tail}" if tail else "")
