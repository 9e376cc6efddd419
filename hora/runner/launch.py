"""``horarun``: start a training script on N worker processes, on this machine or over SSH.

Usage::

    horarun -np 2 python train.py
    horarun -np 4 -H localhost:4 --output-filename logs/ python train.py
    horarun -np 8 -H node1:4,node2:4 python train.py
    horarun -np 8 --hostfile hosts.txt --config-file horovod.yaml python train.py
    horarun -np 2 --min-np 2 --max-np 8 --host-discovery-script ./hosts.sh python train.py

Flags follow ``horovodrun`` (see :mod:`hora.runner.options`). The launch reads as an outline:
parse the flags, plan the job (hosts, slots, the SSH check, the store's address), start the store
and the workers, supervise them, report. An elastic job (``--min-np``, ``--max-np`` or
``--host-discovery-script``) goes to :func:`hora.runner.elastic.run_elastic` instead. Importing
this module never imports PyTorch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hora.runner import options
from hora.runner.hosts import (
    HostError,
    Slot,
    assign_slots,
    is_local,
    parse_hostfile,
    parse_hosts,
)
from hora.runner.options import worker_env
from hora.runner.remote import (
    SshSettings,
    check_hosts,
    rendezvous_address,
    ssh_settings,
)
from hora.runner.supervisor import OutputForwarder, Supervisor, install_signal_handlers


@dataclass(frozen=True)
class Plan:
    """Where every rank runs and how the workers find each other.

    Attributes:
        slots: one per rank.
        remote_hosts: the hosts reached over SSH (every other host is this machine).
        bind_address: where the job's store listens.
        interface_env: the network-interface variables every worker gets (from the flags);
            without them each worker's watchdog picks the interface that reaches the store.
        ssh: how hosts are reached.
    """

    slots: list[Slot]
    remote_hosts: list[str]
    bind_address: str
    interface_env: dict[str, str]
    ssh: SshSettings


def plan_job(args: argparse.Namespace, say: Callable[[str], None]) -> Plan:
    """Resolve hosts and slots, check SSH to every remote host, and pick the store's address.

    Raises:
        HostError: the hosts cannot be used or reached; nothing has been started.
    """
    if args.hostfile:
        hosts = parse_hostfile(args.hostfile)
    else:
        hosts = parse_hosts(args.hosts or f"localhost:{args.np}")
    slots = assign_slots(hosts, args.np)
    used = list(dict.fromkeys(slot.hostname for slot in slots))
    remote_hosts = [name for name in used if not is_local(name)]
    ssh = ssh_settings(args)
    if remote_hosts:
        say(f"checking SSH to {', '.join(remote_hosts)}")
        check_hosts(remote_hosts, ssh)
    bind_address = rendezvous_address(remote_hosts, ssh, args.interfaces)
    interface_env: dict[str, str] = {}
    if args.interfaces:
        interface_env = {
            "HORA_GLOO_IFACE": args.interfaces[0],
            "NCCL_SOCKET_IFNAME": ",".join(args.interfaces),
        }
    return Plan(slots, remote_hosts, bind_address, interface_env, ssh)


def _describe(plan: Plan, slot: Slot) -> str:
    where = "over ssh" if slot.hostname in plan.remote_hosts else "on this machine"
    return (
        f"rank {slot.rank} on {slot.hostname} {where} (local rank {slot.local_rank} of "
        f"{slot.local_size}, cross rank {slot.cross_rank} of {slot.cross_size})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``horarun`` command."""
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
    elastic = options.is_elastic(args)
    if args.np is None:
        options.build_parser().error(
            "-np (or --min-np) is required (the number of worker processes to start with)"
            if elastic
            else "-np is required (the number of worker processes)"
        )

    def say(message: str) -> None:
        if args.verbose:
            print(f"horarun: {message}", file=sys.stderr, flush=True)

    for note in options.notes(args):
        say(note)
    if elastic:
        from hora.runner.elastic import run_elastic

        return run_elastic(args, say)
    try:
        plan = plan_job(args, say)
    except HostError as exc:
        print(f"horarun: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return run_job(args, plan, say)


def run_job(args: argparse.Namespace, plan: Plan, say: Callable[[str], None]) -> int:
    """Start the store and one worker per slot, supervise them, and report how the job ended."""
    from hora.runner.rendezvous import RendezvousServer

    server = RendezvousServer(plan.bind_address)
    say(f"rendezvous store listening on {server.address}:{server.port}")
    supervisor = Supervisor(
        on_exit=server.record_exit,
        forwarder=OutputForwarder(
            prefix=not args.disable_output_prefix,
            timestamp=bool(args.prefix_output_with_timestamp),
            log_dir=args.output_filename,
        ),
    )
    install_signal_handlers(supervisor)
    base = dict(os.environ)
    extra = {**server.env(), **options.engine_env(args), **plan.interface_env}
    cwd = os.getcwd()
    for slot in plan.slots:
        remote = slot.hostname in plan.remote_hosts
        env = worker_env(base, {**extra, **slot.env()})
        say(f"starting {_describe(plan, slot)}: {' '.join(args.command)}")
        supervisor.spawn(slot, args.command, env, cwd=cwd, ssh=plan.ssh if remote else None)
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
