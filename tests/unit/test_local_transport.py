"""The in-process transport (threads as ranks), and the engine parts tested on it: Adasum's
exchange tree against the tree computed in one process, in milliseconds."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from hora.common.engine import adasum
from hora.common.transport import TransportError
from hora.common.transport.local import LocalCommunicator, local_group
from hora.common.vocabulary.message import ReduceOp


def _on_threads(size: int, work: Callable[[LocalCommunicator], Any]) -> list[Any]:
    """Run ``work`` for every member of a new group, each on its own thread."""
    group = local_group(size, timeout_s=10)
    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(work, group))


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_collectives_meet_in_call_order(size: int) -> None:
    def work(comm: LocalCommunicator) -> dict[str, Any]:
        r = comm.rank
        total = torch.full((3,), float(r + 1))
        first = comm.allreduce_async(total, ReduceOp.SUM)
        largest = torch.tensor([float(r)])
        second = comm.allreduce_async(largest, ReduceOp.MAX)
        second.wait()  # waited for in the other order: still matched in call order
        first.wait()
        gathered = [torch.empty(2) for _ in range(size)]
        comm.allgather(gathered, torch.tensor([r, -r], dtype=torch.float32))
        root = torch.tensor([float(r)])
        comm.broadcast(root, size - 1)
        chunks = [torch.full((2,), float(r)) for _ in range(size)]
        mine = torch.empty(2)
        comm.reducescatter(mine, chunks, ReduceOp.SUM)
        comm.barrier()
        return {"sum": total, "max": largest, "gathered": gathered, "root": root, "rs": mine}

    expected_sum = float(sum(range(1, size + 1)))
    for observed in _on_threads(size, work):
        assert torch.equal(observed["sum"], torch.full((3,), expected_sum))
        assert observed["max"].item() == size - 1
        assert [g.tolist() for g in observed["gathered"]] == [[r, -r] for r in range(size)]
        assert observed["root"].item() == size - 1
        assert torch.equal(observed["rs"], torch.full((2,), float(sum(range(size)))))


def test_sendrecv_pairs_partners_and_abort_unblocks() -> None:
    def work(comm: LocalCommunicator) -> float:
        received = torch.empty(1)
        comm.sendrecv(torch.tensor([float(comm.rank)]), received, comm.rank ^ 1)
        return received.item()

    assert _on_threads(4, work) == [1.0, 0.0, 3.0, 2.0]
    lonely, _ = local_group(2, timeout_s=10)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(lonely.barrier)
        lonely.abort()
        with pytest.raises(TransportError, match="aborted"):
            waiting.result(timeout=5)


@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize(
    "counts",
    [[1], [3, 1, 7], [5] * 40, [20000, 3, 17000]],
    ids=["one", "odd", "many_small", "large"],
)
def test_adasum_exchange_tree_matches_the_tree_in_one_process(size: int, counts: list[int]) -> None:
    generator = torch.Generator().manual_seed(size * 7 + len(counts))
    vectors = [
        torch.randn(sum(counts), generator=generator, dtype=torch.float64) for _ in range(size)
    ]
    vectors[0][: counts[0]] = 0.0  # a zero gradient keeps its factor at 1

    def work(comm: LocalCommunicator) -> torch.Tensor:
        mine = vectors[comm.rank].clone()
        adasum.allreduce(mine, counts, comm)
        return mine

    results = _on_threads(size, work)
    expected = adasum.reference(vectors, counts)
    for result in results:
        torch.testing.assert_close(result, expected, rtol=1e-12, atol=1e-12)
        assert torch.equal(result, results[0])  # every rank gets the same bits


@pytest.mark.parametrize("count", [1024, 40000], ids=["vectorised", "per_tensor"])
def test_adasum_averages_parallel_float32_gradients_near_the_smallest_normal(count: int) -> None:
    """Gradients parallel to each other are averaged, even when their float32 products would
    underflow (values near 1e-38): products are taken in float64."""
    size = 4
    generator = torch.Generator().manual_seed(2)
    direction = torch.randn(count, generator=generator, dtype=torch.float64)
    tiny = torch.finfo(torch.float32).tiny
    scales = [1.0, 3.0, 0.5, 2.0]
    vectors = [(direction * tiny * s).float() for s in scales]

    def work(comm: LocalCommunicator) -> torch.Tensor:
        mine = vectors[comm.rank].clone()
        adasum.allreduce(mine, [count], comm)
        return mine

    expected = torch.stack([v.double() for v in vectors]).sum(0) / size
    for result in _on_threads(size, work):
        relative = (result.double() - expected).norm() / expected.norm()
        assert relative < 1e-3, relative


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8])
def test_allgather_bytes_gives_every_member_every_header(size: int) -> None:
    """Recursive doubling for 1, 2, 4, 8 members, the library's allgather otherwise: the same
    answer, twice in a row on one group (the exchanges of one call must not leak into the
    next)."""
    from hora.common.transport import allgather_bytes

    def work(comm: LocalCommunicator) -> list[list[bytes]]:
        first = allgather_bytes(comm, bytes([comm.rank]) * 5)
        second = allgather_bytes(comm, bytes([100 + comm.rank, 7, 7]))
        return [first, second]

    for first, second in _on_threads(size, work):
        assert first == [bytes([r]) * 5 for r in range(size)]
        assert second == [bytes([100 + r, 7, 7]) for r in range(size)]


@pytest.mark.parametrize("size", [2, 3])
def test_members_prove_the_secret_to_each_other(size: int) -> None:
    from hora.common.transport import prove_peers

    _on_threads(size, lambda comm: prove_peers(comm, "s" * 64, "ps0"))


def test_a_member_without_the_secret_is_named_by_the_others() -> None:
    from hora.common.transport import PeerProofError, prove_peers

    def work(comm: LocalCommunicator) -> str:
        secret = "intruder" if comm.rank == 2 else "s" * 64
        try:
            prove_peers(comm, secret, "ps0")
        except PeerProofError as exc:
            return str(exc)
        return "passed"

    first, second, third = _on_threads(3, work)
    assert "member(s) [2] did not prove the job secret" in first
    assert "member(s) [2]" in second
    assert "member(s) [0, 1]" in third


def test_a_proof_is_bound_to_its_communicator() -> None:
    """Answers made for one scope do not pass in another (a connection handed to a pair made
    later cannot reuse them)."""
    from hora.common.transport import PeerProofError, prove_peers

    def work(comm: LocalCommunicator) -> bool:
        try:
            prove_peers(comm, "s" * 64, "ps0" if comm.rank == 0 else "ps1")
        except PeerProofError:
            return False
        return True

    assert _on_threads(2, work) == [False, False]
