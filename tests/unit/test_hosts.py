import socket
from pathlib import Path

import pytest

from hora.runner.hosts import (
    Host,
    HostError,
    assign_slots,
    is_local,
    local_addresses,
    parse_hostfile,
    parse_hosts,
)


def test_parse_hosts() -> None:
    assert parse_hosts("a:4,b:2") == [Host("a", 4), Host("b", 2)]
    assert parse_hosts("a") == [Host("a", 1)]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("a:x", "slots must be an integer"),
        ("a:0", ">= 1"),
        ("a:1,,b:1", "empty entry"),
        ("a:1,a:2", "appears twice"),
        (":3", "no host name"),
    ],
)
def test_bad_host_lists(text: str, match: str) -> None:
    with pytest.raises(HostError, match=match):
        parse_hosts(text)


def test_slots_fill_hosts_in_order_with_local_and_cross_ranks() -> None:
    slots = assign_slots([Host("a", 2), Host("b", 2)], 4)
    assert [(s.hostname, s.rank, s.local_rank, s.local_size) for s in slots] == [
        ("a", 0, 0, 2),
        ("a", 1, 1, 2),
        ("b", 2, 0, 2),
        ("b", 3, 1, 2),
    ]
    assert [(s.cross_rank, s.cross_size) for s in slots] == [(0, 2), (0, 2), (1, 2), (1, 2)]


def test_heterogeneous_cross_size_per_local_rank() -> None:
    slots = assign_slots([Host("a", 2), Host("b", 1)], 3)
    assert [(s.local_rank, s.cross_rank, s.cross_size) for s in slots] == [
        (0, 0, 2),
        (1, 0, 1),
        (0, 1, 2),
    ]


def test_too_few_slots() -> None:
    with pytest.raises(HostError, match="-np 5 needs 5 slots but the hosts provide 3"):
        assign_slots([Host("a", 3)], 5)


def test_slot_env_sets_hora_and_horovod_names() -> None:
    env = assign_slots([Host("localhost", 2)], 2)[1].env()
    assert env["HORA_RANK"] == env["HOROVOD_RANK"] == "1"
    assert env["HORA_LOCAL_SIZE"] == "2"


def _hostfile(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hosts"
    path.write_text(text)
    return str(path)


def test_hostfile_reads_both_dialects_comments_and_blank_lines(tmp_path: Path) -> None:
    text = """
    # the training nodes
    node1 slots=4
    node2:2      # a second node, horovodrun -H style

    node3 slots=1 max_slots=8
    node4
    """
    assert parse_hostfile(_hostfile(tmp_path, text)) == [
        Host("node1", 4),
        Host("node2", 2),
        Host("node3", 1),
        Host("node4", 1),
    ]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("node1 slots=4\nnode2 cpus=2\n", r"line 2: cannot read 'node2 cpus=2'"),
        ("node1 slots=x\n", "slots must be an integer"),
        ("# nothing\n\n", "lists no hosts"),
        ("node1 slots=2\nnode1 slots=2\n", "appears twice"),
    ],
)
def test_bad_hostfiles_name_the_problem(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(HostError, match=match):
        parse_hostfile(_hostfile(tmp_path, text))


def test_a_hostfile_that_is_not_text_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_bytes(b"node1 slots=2\nnode2 slots=\xff2\n")
    with pytest.raises(HostError, match=r"line 2: byte 0xff is not UTF-8 text"):
        parse_hostfile(str(path))


def test_missing_hostfile(tmp_path: Path) -> None:
    with pytest.raises(HostError, match="cannot read hostfile"):
        parse_hostfile(str(tmp_path / "absent"))


@pytest.mark.parametrize("name", ["-oProxyCommand=x", "a b", "host;rm"])
def test_host_names_that_could_be_ssh_options_are_refused(name: str) -> None:
    with pytest.raises(HostError, match="is not a host name"):
        parse_hosts(f"{name}:1")


def test_this_machine_by_name_loopback_or_own_address() -> None:
    assert is_local("localhost")
    assert is_local(socket.gethostname())
    assert is_local("127.0.0.2")
    own = sorted(a for a in local_addresses() if "." in a and not a.startswith("127."))
    if own:
        assert is_local(own[0])
    assert not is_local("192.0.2.1")  # TEST-NET-1: never assigned to a real machine
