"""Nothing in the job's store is trusted for its mere existence.

Marks (keys whose presence means something: alive, arrived, reset, detached, doorbells) hold a
signed value bound to the key's full name, which carries the elastic round's prefix and the engine
generation; a value written without the secret, or replayed from another key, round or
generation, is rejected with an error that names tampering.
"""

from __future__ import annotations

import logging

import pytest

from hora.common.engine.failures import diagnose
from hora.common.job import rounds
from hora.common.job.store import (
    AuthenticationError,
    StoreClient,
    has_mark,
    new_secret,
    put_mark,
    read_failure,
    report_failure,
    sign,
)
from hora.common.job.store_keys import FAILURE, GenerationKeys


def _client(secret: str, port: int, prefix: str = "") -> StoreClient:
    return StoreClient("127.0.0.1", port, secret, timeout_s=5.0, prefix=prefix)


def test_a_mark_is_seen_and_an_absent_one_is_not(served: tuple[str, int]) -> None:
    store = _client(*served)
    assert not store.marked("g0/alive/1")
    store.mark("g0/alive/1")
    assert store.marked("g0/alive/1")
    assert store.wait("g0/alive/1", 1.0)
    assert not store.wait("g0/alive/2", 0.2)
    assert not store.all_marked(["g0/alive/1", "g0/alive/2"])
    store.mark("g0/alive/2")
    assert store.all_marked(["g0/alive/1", "g0/alive/2"])


@pytest.mark.parametrize("value", [b"", b"1", b"x" * 40])
def test_an_unsigned_mark_is_tampering(served: tuple[str, int], value: bytes) -> None:
    store = _client(*served)
    store.store.set(store.key("g0/alive/1"), value)
    with pytest.raises(AuthenticationError):
        store.marked("g0/alive/1")
    with pytest.raises(AuthenticationError):
        store.wait("g0/alive/1", 1.0)
    with pytest.raises(AuthenticationError):
        store.all_marked(["g0/alive/1"])


def test_a_mark_signed_with_another_secret_is_rejected(served: tuple[str, int]) -> None:
    store = _client(*served)
    key = store.key(rounds.reset_key(0))
    store.store.set(key, sign(new_secret(), b"", key=key))
    with pytest.raises(AuthenticationError, match="not signed with this job's secret"):
        store.marked(rounds.reset_key(0))


def test_a_mark_replayed_under_another_key_is_rejected(served: tuple[str, int]) -> None:
    store = _client(*served)
    store.mark("g0/alive/1")
    store.store.set(store.key("g0/alive/2"), store.store.get(store.key("g0/alive/1")))
    with pytest.raises(AuthenticationError, match="for key 'g0/alive/2'"):
        store.marked("g0/alive/2")


def test_a_mark_replayed_from_an_earlier_round_or_generation_is_rejected(
    served: tuple[str, int],
) -> None:
    secret, port = served
    round1 = _client(secret, port, prefix=rounds.round_prefix(1))
    round2 = _client(secret, port, prefix=rounds.round_prefix(2))
    arrived = rounds.arrived_key(0)
    round1.mark(arrived)
    # Same name, the next round's prefix: the signature covers the prefix too.
    round2.store.set(round2.key(arrived), round1.store.get(round1.key(arrived)))
    with pytest.raises(AuthenticationError):
        round2.marked(arrived)

    old, new = GenerationKeys(0), GenerationKeys(1)
    round1.mark(old.wake(3))
    round1.store.set(round1.key(new.wake(3)), round1.store.get(round1.key(old.wake(3))))
    with pytest.raises(AuthenticationError):
        round1.wait(new.wake(3), 1.0)


def test_a_forged_reset_request_is_ignored_and_logged(
    served: tuple[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    """A forged reset must not burn the job's --reset-limit."""
    store = _client(*served)
    store.store.set(store.key(rounds.reset_key(4)), b"")
    with caplog.at_level(logging.ERROR, logger="hora"):
        assert not rounds.reset_requested(store, 4)
    assert "found tampering in the job's store" in caplog.text
    store.mark(rounds.reset_key(5))
    assert rounds.reset_requested(store, 5)


def test_failure_reports_are_signed_and_a_forged_one_names_tampering(
    served: tuple[str, int],
) -> None:
    store = _client(*served)
    report_failure(store, "rank 1: boom")
    assert read_failure(store) == "rank 1: boom"
    store.delete(FAILURE)
    store.store.set(store.key(FAILURE), b"rank 1: FORGED failure")
    with pytest.raises(AuthenticationError):
        read_failure(store)


def test_a_forged_alive_mark_is_reported_as_tampering_not_as_a_live_rank(
    served: tuple[str, int],
) -> None:
    """A forged alive mark must not hide a dead rank: the diagnosis names the tampering."""
    store = _client(*served)
    keys = GenerationKeys(0)
    store.store.set(store.key(keys.alive(1)), b"")
    text = diagnose(store, keys, rank=0, size=2, error="connection reset", reported=False)
    assert text.startswith("rank 0 found tampering in the job's store")
    assert "'g0/alive/1'" in text


def test_raw_store_marks(served: tuple[str, int]) -> None:
    """The helpers for launcher stores that hora reaches without a client (torchrun's)."""
    secret, port = served
    raw = _client(secret, port).store
    put_mark(raw, "run/ready/1", secret)
    assert has_mark(raw, "run/ready/1", secret)
    assert not has_mark(raw, "run/ready/2", secret)
    raw.set("run/ready/2", b"1")
    with pytest.raises(AuthenticationError):
        has_mark(raw, "run/ready/2", secret)
