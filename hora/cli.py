"""The ``hora`` command: subcommands around hora jobs (``hora doctor``, ``hora timeline``,
``hora bench scaling``, ...).

Each subcommand is a function taking its parsed arguments; add one with :func:`build_parser`.
``horarun`` stays its own command, as ``horovodrun`` is.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _doctor(args: argparse.Namespace) -> int:
    from hora.tools.doctor import doctor

    try:
        return doctor(np=args.np, run_check=not args.no_run, timeout_s=args.timeout)
    except Exception as exc:  # each check catches its own; this is the doctor's own bug
        said = str(exc).strip().splitlines()
        print(
            f"hora doctor: stopped by {type(exc).__name__}"
            + (f": {said[0]}" if said else "")
            + ". The report above is complete up to here; please report this line.",
            file=sys.stderr,
        )
        return 1


def _check_build(args: argparse.Namespace) -> int:
    del args
    from hora.common.build_info import check_build_text

    print(check_build_text())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hora", description="Tools for hora jobs.")
    commands = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")
    doctor = commands.add_parser(
        "doctor",
        help="check this installation: frameworks, transports, versions, and a 2-process job",
        description="Print what this installation can use and run a short allreduce on this "
        "machine through hora.run. Exits 1 when that check fails.",
    )
    doctor.add_argument("--np", type=int, default=2, help="processes in the check (default 2)")
    doctor.add_argument("--no-run", action="store_true", help="skip the allreduce check")
    doctor.add_argument(
        "--timeout", type=float, default=120.0, help="seconds the check may take (default 120)"
    )
    doctor.set_defaults(handler=_doctor)
    check = commands.add_parser("check-build", help="the same report as `horarun --check-build`")
    check.set_defaults(handler=_check_build)
    # hora timeline summarize|merge|plot: the parser and handlers live with the reader.
    from hora.tools.timeline_report import add_parser as add_timeline_parser

    add_timeline_parser(commands)
    # hora bench scaling: a group for benchmark studies; each study brings its flags and handler.
    bench = commands.add_parser("bench", help="benchmark studies of hora jobs: scaling")
    studies = bench.add_subparsers(dest="study", required=True, metavar="STUDY")
    from hora.tools.scaling import add_parser as add_scaling_parser

    add_scaling_parser(studies)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hora`` command."""
    args = build_parser().parse_args(argv)
    if getattr(args, "np", 2) < 1:
        print("hora doctor: --np must be >= 1.", file=sys.stderr)
        return 2
    status: int = args.handler(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
