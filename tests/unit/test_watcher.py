"""The watcher that wakes a parked engine: it follows the newest parking round even when load
kept it from running until an older round's doorbell was gone."""

from __future__ import annotations

import threading
import time

import pytest

from hora.common.engine.failures import Watcher
from hora.common.job.store import StoreClient
from hora.common.job.store_keys import GenerationKeys


@pytest.mark.timeout(30)
def test_a_late_watcher_still_hears_the_next_rounds_doorbell(served: tuple[str, int]) -> None:
    secret, port = served

    def client() -> StoreClient:
        return StoreClient("127.0.0.1", port, secret, timeout_s=5.0)

    keys = GenerationKeys(0)
    ringer = client()
    woken: list[int] = []
    heard = threading.Event()
    running = [True]

    def on_woken(round_: int) -> None:
        woken.append(round_)
        if round_ == 2:
            heard.set()

    watcher = Watcher(client(), client(), keys, lambda: running[0], on_woken, lambda: None)
    # Round 1's doorbell rang and was deleted (rank 0 does so when round 2 parks) before this
    # watcher, held up by load, got to wait for it.
    ringer.mark(keys.wake(1))
    ringer.delete(keys.wake(1))
    watcher.watch(1)
    watcher.start()
    time.sleep(0.3)
    watcher.watch(2)
    ringer.mark(keys.wake(2))
    try:
        assert heard.wait(10), f"the watcher never heard round 2's doorbell (woken: {woken})"
        assert 1 not in woken
    finally:
        running[0] = False
        watcher.stop()
        watcher.join(5)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("through", ["connection", "torch store"])
def test_a_key_deleted_after_it_was_seen_reads_as_gone_at_once(
    served: tuple[str, int], through: str
) -> None:
    secret, port = served
    store = StoreClient("127.0.0.1", port, secret, timeout_s=20.0)
    if through == "torch store":
        # A worker's process groups reach hora's store through a torch.distributed.Store.
        from hora.common.job.torch_store import TorchStore

        store.store = TorchStore(store.store)
    store.mark("g0/wake/1")
    assert store._read_seen("g0/wake/1") == b""
    store.delete("g0/wake/1")
    started = time.monotonic()
    # What a reader finds once the key went between its check and its read: no value, and no
    # wait for the store's 20 s timeout.
    assert store._read_seen("g0/wake/1") is None
    assert time.monotonic() - started < 2.0
