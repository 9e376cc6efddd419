"""The free pages of a member's shared-memory arena: blocks given back by finalizers, which run
on whatever thread drops a block's last view, whenever that thread allocates."""

from __future__ import annotations

import gc
import random
import threading

import pytest

from hora.common.transport.shm_layout import BLOCK, ArenaPages


def test_blocks_taken_and_given_back_merge_into_one_range_again() -> None:
    pages = ArenaPages(8 * BLOCK)
    blocks = [pages.take(BLOCK) for _ in range(8)]
    assert pages.take(1) is None  # full
    for block in random.Random(0).sample(blocks, len(blocks)):
        assert block is not None
        pages.give_back(*block)
    assert pages.take(8 * BLOCK) == (0, 8 * BLOCK)


@pytest.mark.timeout(20)
def test_a_block_given_back_while_its_thread_holds_the_lock_does_not_deadlock() -> None:
    # What the cyclic garbage collector does when it runs inside take(): a finalizer gives a
    # block back on the thread that holds the lock. It used to wait for that lock for ever
    # (the engine thread of a job in the steady state hung in ArenaPages.give_back).
    pages = ArenaPages(4 * BLOCK)
    first = pages.take(2 * BLOCK)
    assert first is not None
    done = threading.Event()

    def inside_take() -> None:
        with pages._lock:  # as take() holds it
            pages.give_back(*first)
        done.set()

    thread = threading.Thread(target=inside_take, daemon=True)
    thread.start()
    assert done.wait(5), "give_back waited for a lock its own thread holds"
    # The block was kept aside, and the next take finds it.
    assert pages.take(4 * BLOCK) == (0, 4 * BLOCK)


class _View:
    """Stands for an arena view: gives its block back when collected, inside a cycle so that
    only the cyclic collector frees it (at some allocation of some thread)."""

    def __init__(self, pages: ArenaPages, block: tuple[int, int]) -> None:
        self.pages, self.block, self.me = pages, block, self

    def __del__(self) -> None:
        self.pages.give_back(*self.block)


@pytest.mark.timeout(60)
def test_threads_taking_while_the_collector_gives_blocks_back_lose_no_page() -> None:
    pages = ArenaPages(256 * BLOCK)
    old = gc.get_threshold()
    gc.set_threshold(5)  # collect often, inside take() and give_back() too
    try:

        def work(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(2000):
                block = pages.take(rng.randint(1, 3) * BLOCK)
                if block is not None:
                    _View(pages, block)  # dropped at once; freed by the collector later

        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(50)
        assert not any(thread.is_alive() for thread in threads), "a thread hung"
    finally:
        gc.set_threshold(*old)
    gc.collect()
    assert pages.take(256 * BLOCK) == (0, 256 * BLOCK)
