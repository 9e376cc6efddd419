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

import argparse
import sys
from collections.abc import Callable, Sequence

from hora.runner import options
from hora.runner.elastic import DiscoveryError, plan_elastic
from hora.runner.hosts import HostError
from hora.runner.job import Plan, open_job
from hora.runner.static import plan_job


def _parse(argv: Sequence[str] | None) -> argparse.Namespace | int:
    """The flags of a job to run, or the exit status when there is none (bad flags, --version,
    --check-build)."""
    try:
        args = options.parse(argv)
    except options.OptionError as exc:
        print(f"horarun: {exc}", file=sys.stderr)
        return 2
    if args.version:
        from hora import __version__

        print(f"hora {__version__}")
        return 0
    if args.check_build:
        from hora.tools.doctor import check_build_text

        print(check_build_text())
        return 0
    refused = options.refusals(args)
    if refused:
        for reason in refused:
            print(f"horarun: {reason}", file=sys.stderr)
        return 2
    if not args.command:
        options.build_parser().error("no command given; usage: horarun -np N python train.py")
    if args.np is None:
        options.build_parser().error(
            "-np (or --min-np) is required (the number of worker processes to start with)"
            if options.is_elastic(args)
            else "-np is required (the number of worker processes)"
        )
    return args


def _plan(args: argparse.Namespace, say: Callable[[str], None]) -> Plan | int:
    """Where the job runs, planned by its driver; or the exit status when it cannot start."""
    try:
        if options.is_elastic(args):
            return plan_elastic(args, say)
        return plan_job(args, say)
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
    args = _parse(argv)
    if isinstance(args, int):
        return args

    verbose = bool(args.verbose)

    def say(message: str) -> None:
        if verbose:
            print(f"horarun: {message}", file=sys.stderr, flush=True)

    for note in options.notes(args):
        say(note)
    if args.mpi:
        from hora.runner import mpi_launch

        return mpi_launch.run(args, say)
    plan = _plan(args, say)
    if isinstance(plan, int):
        return plan
    with open_job(args, plan, say) as job:
        outcome = plan.run(job, say)
        if outcome.message:
            print(f"horarun: {outcome.message}", file=sys.stderr, flush=True)
    return outcome.status


if __name__ == "__main__":
    sys.exit(main())
