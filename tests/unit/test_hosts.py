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


def test_ipv6_addresses_go_in_brackets_and_are_kept_in_short_form() -> None:
    assert parse_hosts("[::1]:2,node1:1") == [Host("::1", 2), Host("node1", 1)]
    assert parse_hosts("[::1]") == [Host("::1", 1)]
    assert parse_hosts("[0:0:0:0:0:0:0:1]:3") == [Host("::1", 3)]
    assert parse_hosts("[fe80::1%eth0]:1") == [Host("fe80::1%eth0", 1)]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("a:x", r"host list entry 'a:x': slots must be an integer \(host:slots\), got 'x'\."),
        ("a:0", r"host list entry 'a:0': slots must be >= 1 \(the number of workers on the host"),
        ("a:-1", r"slots must be >= 1 .*, got -1\."),
        ("a:", r"'a:': no slot count after ':'"),
        ("a:1,,b:1", "empty entry"),
        (":3", r"host list: ':3' has no host name\."),
        ("::1:2", r"'::1:2': an IPv6 address goes in brackets, as in \[::1\]:2"),
        ("::1", r"'::1': an IPv6 address goes in brackets"),
        ("[::1", r"write an IPv6 address in brackets, then the slots"),
        ("[::1]2", r"write an IPv6 address in brackets, then the slots"),
        ("[node1]:2", r"'node1' is not an IPv6 address"),
        ("[::1]:0", r"host list entry '\[::1\]:0': slots must be >= 1"),
    ],
)
def test_bad_host_lists(text: str, match: str) -> None:
    with pytest.raises(HostError, match=match):
        parse_hosts(text)


@pytest.mark.parametrize(
    ("text", "merged"),
    [
        ("a:1,b:1,a:2", "(a:3)"),
        ("node1:2,NODE1:2", "(node1:4)"),  # host names are not case-sensitive
        ("[::1]:1,[0::1]:1", "([::1]:2)"),
    ],
)
def test_a_host_listed_twice_is_an_error_naming_the_merged_entry(text: str, merged: str) -> None:
    # Not merged silently: a host listed twice is more often a mistake (a copied line) than a
    # wish for more slots, and it would start twice the workers meant for it.
    with pytest.raises(HostError, match="appears twice") as info:
        parse_hosts(text)
    assert str(info.value).endswith(f"List each host once, with all its slots {merged}.")


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


def test_hostfile_ipv6_addresses(tmp_path: Path) -> None:
    text = "[::1]:2\n[fe80::2] slots=3\nfe80::3 slots=4  # no brackets needed before slots=\n"
    assert parse_hostfile(_hostfile(tmp_path, text)) == [
        Host("::1", 2),
        Host("fe80::2", 3),
        Host("fe80::3", 4),
    ]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("node1 slots=4\nnode2 cpus=2\n", r"line 2: cannot read 'node2 cpus=2'"),
        ("node1 slots=x\n", r"line 1: 'node1 slots=x': slots must be an integer"),
        ("node1\nnode2 slots=-2\n", r"line 2: 'node2 slots=-2': slots must be >= 1"),
        ("node1 slots=0 # none\n", r"line 1: 'node1 slots=0': slots must be >= 1"),
        ("node1:2 slots=4\n", r"line 1: 'node1:2 slots=4': it gives the slots twice"),
        ("# nothing\n\n", "lists no hosts"),
        ("::1\n", r"line 1: '::1': an IPv6 address goes in brackets"),
        ("nodeA:1 slots=2\n", r"gives the slots twice"),
        (
            "node1 slots=2\n# spare\nnode1 slots=2\n",
            r"line 3: host 'node1' appears twice \(first on line 1\)\. List each host once, "
            r"with all its slots \(`node1 slots=4`\)\.",
        ),
        (
            "[::1]:1\n::1 slots=1\n",
            r"line 2: host '::1' appears twice .*\(`\[::1\] slots=2`\)",
        ),
    ],
)
def test_bad_hostfiles_name_the_problem(tmp_path: Path, text: str, match: str) -> None:
    path = _hostfile(tmp_path, text)
    with pytest.raises(HostError, match=match) as info:
        parse_hostfile(path)
    assert str(info.value).startswith((f"{path}, line ", f"hostfile {path!r}"))


def test_a_hostfile_that_is_not_text_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_bytes(b"node1 slots=2\nnode2 slots=\xff2\n")
    with pytest.raises(HostError, match=r"line 2: byte 0xff is not UTF-8 text"):
        parse_hostfile(str(path))


def test_missing_hostfile(tmp_path: Path) -> None:
    with pytest.raises(HostError, match="cannot read hostfile"):
        parse_hostfile(str(tmp_path / "absent"))


@pytest.mark.parametrize("name", ["-oProxyCommand=x", "a b", "host;rm", "[-oProxyCommand=x]"])
def test_host_names_that_could_be_ssh_options_are_refused(name: str) -> None:
    with pytest.raises(HostError, match="is not a host name|is not an IPv6 address"):
        parse_hosts(f"{name}:1")


def test_ipv6_loopback_is_this_machine() -> None:
    (host,) = parse_hosts("[::1]:2")
    assert is_local(host.name)


def test_this_machine_by_name_loopback_or_own_address() -> None:
    assert is_local("localhost")
    assert is_local(socket.gethostname())
    assert is_local("127.0.0.2")
    own = sorted(a for a in local_addresses() if "." in a and not a.startswith("127."))
    if own:
        assert is_local(own[0])
    assert not is_local("192.0.2.1")  # TEST-NET-1: never assigned to a real machine
