"""What it costs to make and attach a shared-memory segment that no other user can swap or plant:
hora's ``Segment`` against Python's ``multiprocessing.shared_memory``.

Run it with::

    .venv/bin/python benchmarks/shm_setup.py [--repeats 9] [--rounds 50] [--slot-bytes 16777216]

One round of each side, timed in this process:

- **hora**: ``Segment.create`` (a nameless ``O_TMPFILE`` file, sized, its slots reserved, its
  header and nonce written, then linked under a random name; in a private ``0700`` directory
  where ``/dev/shm`` lacks the sticky bit), ``Segment.attach`` by a second member (opened without
  following links or blocking, ``fstat`` checks of type, owner, mode, device, inode and size, the
  header and nonce), then the name removed (only if it is still the creator's file) and both
  mappings closed.
- **peer**: ``SharedMemory(create=True, size=...)`` with the same bytes reserved
  (``posix_fallocate`` on its descriptor, as hora does so that a full ``/dev/shm`` is an error at
  set-up rather than a ``SIGBUS`` later), a second ``SharedMemory(name=...)`` attach, ``unlink``,
  and both closed. It makes no checks, so the ratio is what the guarantees cost at set-up.

Both map the same number of bytes (two members' slots and the control lines), at a small slot
(64 KiB, where fixed costs show) and at the default one (16 MiB, where reserving the memory
dominates). Repetitions alternate hora and peer (ABAB) so that changes in the machine's load hit
both; the table shows the median time per round, the range over repetitions, and the ratio
hora/peer against the goal of at most :data:`GOAL` (segments are made once per process set at
``hvd.init()``; no step of training pays for them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing import shared_memory

from hora.common.job.shm_names import SHM_DIR, unsafe_directory
from hora.common.transport.shm_segment import Segment, total_bytes

# hora's set-up / the peer's, at most.
GOAL = 1.25
SECRET = "shm-setup-benchmark-" + os.urandom(8).hex()


def hora_round(slot_bytes: int) -> None:
    made = Segment.create(SECRET, 2, slot_bytes)
    other = Segment.attach(made.file, 1, 2, slot_bytes)
    made.unlink()
    other.close()
    made.close()


def peer_round(slot_bytes: int) -> None:
    made = shared_memory.SharedMemory(create=True, size=total_bytes(2, slot_bytes))
    os.posix_fallocate(made._fd, 0, total_bytes(2, slot_bytes))  # type: ignore[attr-defined]
    other = shared_memory.SharedMemory(name=made.name)
    made.unlink()
    other.close()
    made.close()


def timed(round_: Callable[[int], None], rounds: int, slot_bytes: int) -> float:
    """Seconds per round, over ``rounds`` rounds."""
    started = time.perf_counter()
    for _ in range(rounds):
        round_(slot_bytes)
    return (time.perf_counter() - started) / rounds


def compare(slot_bytes: int, repeats: int, rounds: int) -> tuple[str, ...]:
    """One row of the table: hora's and the peer's median and range, and their ratio."""
    hora_times, peer_times = [], []
    for _ in range(repeats):
        hora_times.append(timed(hora_round, rounds, slot_bytes))
        peer_times.append(timed(peer_round, rounds, slot_bytes))
    ratios = [h / p for h, p in zip(hora_times, peer_times)]
    ratio = statistics.median(hora_times) / statistics.median(peer_times)

    def cell(times: list[float]) -> str:
        middle, low, high = statistics.median(times), min(times), max(times)
        return f"{middle * 1e6:.0f} ({low * 1e6:.0f}-{high * 1e6:.0f})"

    return (
        f"{slot_bytes >> 10} KiB",
        cell(hora_times),
        cell(peer_times),
        f"{ratio:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
        "met" if ratio <= GOAL else "NOT met",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--slot-bytes", type=int, nargs="+", default=[64 << 10, 16 << 20])
    args = parser.parse_args()
    where = "private directories" if unsafe_directory(SHM_DIR) else f"{SHM_DIR} (sticky)"
    print(f"segments of 2 members in {where}; µs per round, median (range over repetitions)")
    header = ("slot", "hora µs", "peer µs", "hora/peer", f"goal <= {GOAL}x")
    rows = [compare(slot, args.repeats, args.rounds) for slot in args.slot_bytes]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))
    return 0 if all(row[-1] == "met" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
