"""``horarun``: start a training script on N worker processes, on this machine or over SSH.

Usage::

    horarun -np 2 python train.py
    horarun -np 4 -H localhost:4 --output-filename logs/ python train.py
    horarun -np 8 -H node1:4,node2:4 python train.py
    horarun -np 8 --hostfile hosts.txt --config-file horovod.yaml python train.py
    horarun -np 2 --min-np 2 --max-np 8 --host-discovery-script ./hosts.sh python train.py

Flags follow ``horovodrun`` (see :mod:`hora.runner.options`). The launch reads as an outline:
parse the flags; pick the driver and let it plan where the job runs (nothing starts until the
hosts are known and reachable): :mod:`hora.runner.static`, or :mod:`hora.runner.elastic` for an
elastic job (``--min-np``, ``--max-np`` or ``--host-discovery-script``); build the job once
(:mod:`hora.runner.job`: the store, the secret, the supervisor, the workers' environment); run it
with the driver; report. Importing this module never imports PyTorch.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from hora.runner import options
from hora.runner.elastic import DiscoveryError, plan_elastic
from hora.runner.hosts import HostError
from hora.runner.job import Plan, open_job
from hora.runner.options import LaunchOptions, Query
from hora.runner.static import plan_job

# Every module of the runner logs to this logger; only horarun's main gives it a handler.
logger = logging.getLogger("hora.runner")

_HANDLER_NAME = "horarun"


def configure_logging(verbose: bool) -> None:
    """Print the ``hora.runner`` logger's lines to stderr as ``horarun: <message>``: warnings and
    notices always, what horarun does (debug lines) under ``--verbose``.

    Configures that logger alone, and again on a second call rather than twice.
    """
    for handler in [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]:
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("horarun: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    # Not also through "hora" (a worker's hvd.init() gives that one a handler) or the root.
    logger.propagate = False


def _parse(argv: Sequence[str] | None) -> LaunchOptions | int:
    """The options of a job to run, or the exit status when there is none (bad flags, --version,
    --check-build)."""
    try:
        parsed = options.parse(argv)
    except options.Refused as refused:
        for reason in refused.reasons:
            print(f"horarun: {reason}", file=sys.stderr)
        return 2
    except options.OptionError as exc:
        print(f"horarun: {exc}", file=sys.stderr)
        return 2
    if parsed is Query.VERSION:
        from hora import __version__

        print(f"hora {__version__}")
        return 0
    if parsed is Query.CHECK_BUILD:
        from hora.common.build_info import check_build_text

        print(check_build_text())
        return 0
    return parsed


def _plan(launch: LaunchOptions) -> Plan | int:
    """Where the job runs, planned by its driver; or the exit status when it cannot start."""
    try:
        if launch.elastic is not None:
            return plan_elastic(launch.np, launch.hosts, launch.elastic)
        return plan_job(launch.np, launch.hosts)
    except HostError as exc:
        print(f"horarun: {exc}", file=sys.stderr, flush=True)
        return 2
    except DiscoveryError as exc:
        print(
            f"horarun: {str(exc).rstrip('.')}. The job cannot start.", file=sys.stderr, flush=True
        )
        return 1
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``horarun`` command."""
    launch = _parse(argv)
    if isinstance(launch, int):
        return launch
    configure_logging(launch.output.verbose)
    for note in launch.notes:
        logger.debug(note)
    if launch.mpi.enabled:
        from hora.runner import mpi_launch

        return mpi_launch.run(launch)
    plan = _plan(launch)
    if isinstance(plan, int):
        return plan
    with open_job(launch, plan) as job:
        outcome = plan.run(job)
        if outcome.message:
            print(f"horarun: {outcome.message}", file=sys.stderr, flush=True)
    return outcome.status


if __name__ == "__main__":
    sys.exit(main())
