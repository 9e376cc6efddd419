"""A worker that another launcher (mpirun, mpiexec, srun, torchrun) starts: it joins the job
through ``hvd.init()``, runs real collectives, and prints what it saw as one JSON line.

Used by tests/multiproc/test_launchers.py; run it by hand the same way, e.g.
``torchrun --standalone --nproc-per-node 2 tests/multiproc/launcher_worker.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import hora.common.basics as basics
import hora.torch as hvd

MARKER = "HORA-WORKER-RESULT "

# Each launcher's own names for this process's rank and local rank, and Open MPI's job id.
LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMI_RANK",
    "MPI_LOCALRANKID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "PMIX_NAMESPACE",
    "OMPI_MCA_ess_base_jobid",
)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--fail-first-round",
        action="store_true",
        help="under torchrun, rank 1 exits with an error in round 0 after a first allreduce",
    )
    parser.add_argument(
        "--init-twice",
        action="store_true",
        help="run one allreduce, shut hora down, and start it again before the real work",
    )
    args = parser.parse_args()

    if args.init_twice:
        hvd.init()
        first = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="first_generation")
        if first.item() != hvd.size():
            raise RuntimeError(f"first generation's allreduce gave {first.item()}")
        hvd.shutdown()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    total = hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum, name="sum")
    first_round = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    if args.fail_first_round and first_round and rank == 1:
        print("rank 1 fails round 0 on purpose", file=sys.stderr, flush=True)
        os._exit(3)
    gathered = hvd.allgather(torch.tensor([rank]), name="ranks")
    shared = torch.tensor([rank * 10.0 + 7.0])
    hvd.broadcast_(shared, root_rank=size - 1, name="from_last")
    topology = basics.topology()
    result = {
        "rank": rank,
        "size": size,
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(),
        "source": topology.source,
        "authenticated": topology.authenticated,
        "store_port": topology.rendezvous_port,
        "allreduce_sum": total.item(),
        "allgather": gathered.tolist(),
        "broadcast": shared.item(),
        "env": {name: os.environ[name] for name in LAUNCHER_VARIABLES if name in os.environ},
    }
    # One write per report: ranks that share a pipe (torchrun's workers under srun) must not
    # interleave within a line (print() writes the newline separately when unbuffered).
    sys.stdout.write(MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
