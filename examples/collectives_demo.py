"""A 2-worker tour of hora's collectives. Run it with::

    horarun -np 2 python examples/collectives_demo.py

Every rank prints what it sent and what it got back.
"""

import torch

import hora.torch as hvd


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    say = lambda what, value: print(f"rank {rank}/{size}: {what:<28} {value}")  # noqa: E731

    mine = torch.arange(3, dtype=torch.float32) + 10 * rank
    say("my tensor", mine.tolist())
    say("allreduce (average)", hvd.allreduce(mine, name="avg").tolist())
    say("allreduce (sum)", hvd.allreduce(mine, op=hvd.Sum, name="sum").tolist())
    say("allreduce (max)", hvd.allreduce(mine, op=hvd.Max, name="max").tolist())

    rows = torch.full((rank + 1, 2), float(rank))
    say("allgather (rank+1 rows each)", hvd.allgather(rows, name="rows").tolist())
    say("broadcast from rank 0", hvd.broadcast(mine, root_rank=0, name="bcast").tolist())

    send = torch.arange(size * 2, dtype=torch.float32) + 100 * rank
    received = hvd.alltoall(send, name="a2a")
    say("alltoall", received.tolist())
    say("reducescatter (sum)", hvd.reducescatter(torch.ones(size * 2), op=hvd.Sum).tolist())

    handles = [
        hvd.allreduce_async(torch.tensor([float(i)]), name=f"g{i}", op=hvd.Sum) for i in range(5)
    ]
    say("5 async allreduces (fused)", [hvd.synchronize(h).item() for h in handles])
    say(
        "bfloat16 allreduce",
        hvd.allreduce(torch.ones(2, dtype=torch.bfloat16), op=hvd.Sum).tolist(),
    )
    say("bool allreduce (or)", hvd.allreduce(torch.tensor([rank == 0, False]), op=hvd.Sum).tolist())
    config = hvd.broadcast_object({"lr": 0.1, "from": rank}, root_rank=0)
    say("broadcast_object", config)
    say("allgather_object", hvd.allgather_object(f"hello from {rank}"))
    hvd.barrier()
    hvd.shutdown()


if __name__ == "__main__":
    main()
