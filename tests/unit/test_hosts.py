import pytest

from hora.runner.hosts import Host, HostError, assign_slots, parse_hosts


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
