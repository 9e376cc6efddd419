"""``horarun``: start a training script on N worker processes.

Usage::

    horarun -np 2 python train.py
    horarun -np 4 -H localhost:4 --output-filename logs/ python train.py

Flags follow ``horovodrun``. This release launches on this machine; hosts other than this one
are rejected with a clear message. Importing this module never imports PyTorch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from hora.runner.hosts import HostError, assign_slots, is_local, parse_hosts
from hora.runner.supervisor import OutputForwarder, Supervisor, install_signal_handlers

# Variables not passed to workers (as horovodrun).
_DROPPED_ENV = ("OLDPWD",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="horarun",
        description="Launch a hora (Horovod-compatible) training job.",
    )
    parser.add_argument("-v", "--version", action="store_true", help="print hora's version")
    parser.add_argument(
        "-np", "--num-proc", dest="np", type=int, default=None, help="number of worker processes"
    )
    parser.add_argument(
        "-H",
        "--hosts",
        default=None,
        help="hosts and slots, e.g. localhost:4 (default: localhost:NP)",
    )
    parser.add_argument("--verbose", action="store_true", help="print what horarun does")
    parser.add_argument(
        "--output-filename",
        default=None,
        help="also write each rank's output to DIR/rank.N/{stdout,stderr}",
    )
    parser.add_argument(
        "--prefix-output-with-timestamp",
        action="store_true",
        help="add the time to each forwarded output line",
    )
    parser.add_argument(
        "--disable-output-prefix",
        action="store_true",
        help="forward output without the [rank]<stream>: prefix",
    )
    parser.add_argument(
        "--fusion-threshold-mb",
        type=float,
        default=None,
        help="fusion buffer size in MiB (HORA_FUSION_THRESHOLD)",
    )
    parser.add_argument(
        "--cycle-time-ms",
        type=float,
        default=None,
        help="negotiation cycle time in ms (HORA_CYCLE_TIME)",
    )
    parser.add_argument(
        "--cache-capacity",
        type=int,
        default=None,
        help="response cache entries (HORA_CACHE_CAPACITY)",
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=None,
        help="seconds workers may take to reach the rendezvous",
    )
    parser.add_argument(
        "--gloo-timeout-seconds",
        type=float,
        default=None,
        help="seconds one collective may wait for a peer",
    )
    parser.add_argument(
        "--log-level", default=None, choices=["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"]
    )
    parser.add_argument("--gloo", action="store_true", help="use Gloo (the default; accepted)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    return parser


def _settings_env(args: argparse.Namespace) -> dict[str, str]:
    env: dict[str, str] = {}
    if args.fusion_threshold_mb is not None:
        env["HORA_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * 1024 * 1024))
    if args.cycle_time_ms is not None:
        env["HORA_CYCLE_TIME"] = str(args.cycle_time_ms)
    if args.cache_capacity is not None:
        env["HORA_CACHE_CAPACITY"] = str(args.cache_capacity)
    if args.start_timeout is not None:
        env["HORA_START_TIMEOUT"] = str(args.start_timeout)
    if args.gloo_timeout_seconds is not None:
        env["HORA_GLOO_TIMEOUT_SECONDS"] = str(args.gloo_timeout_seconds)
    if args.log_level is not None:
        env["HORA_LOG_LEVEL"] = args.log_level
    return env


def worker_env(base: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    env = {
        k: v for k, v in base.items() if k not in _DROPPED_ENV and not k.startswith("BASH_FUNC_")
    }
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``horarun`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from hora import __version__

        print(f"hora {__version__}")
        return 0
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("no command given; usage: horarun -np N python train.py")
    if args.np is None:
        parser.error("-np is required (the number of worker processes)")
    try:
        hosts = parse_hosts(args.hosts or f"localhost:{args.np}")
        remote = [h.name for h in hosts if not is_local(h.name)]
        if remote:
            raise HostError(
                f"host {remote[0]!r} is not this machine; this version of horarun starts "
                "workers on this machine only. Use -H localhost:N."
            )
        slots = assign_slots(hosts, args.np)
    except HostError as exc:
        print(f"horarun: {exc}", file=sys.stderr)
        return 2

    from hora.runner.rendezvous import RendezvousServer

    server = RendezvousServer("127.0.0.1")
    supervisor = Supervisor(
        on_exit=server.record_exit,
        forwarder=OutputForwarder(
            prefix=not args.disable_output_prefix,
            timestamp=args.prefix_output_with_timestamp,
            log_dir=args.output_filename,
        ),
    )
    install_signal_handlers(supervisor)
    extra = {**server.env(), **_settings_env(args)}
    for slot in slots:
        env = worker_env(dict(os.environ), {**extra, **slot.env()})
        if args.verbose:
            print(
                f"horarun: starting rank {slot.rank} on {slot.hostname}: {' '.join(command)}",
                file=sys.stderr,
            )
        supervisor.spawn(slot, command, env)
    codes = supervisor.wait()
    cause = server.cause_rank()
    server.close()
    if any(code != 0 for code in codes.values()):
        report = supervisor.failure_report(codes, cause)
        print(f"horarun: the job failed.\n{report}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
