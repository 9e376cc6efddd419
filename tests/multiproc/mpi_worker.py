"""A rank of a test job started by ``mpirun`` (see ``jobs.run_mpi``): load the function that the
test pickled, run it, and write the outcome to ``<folder>/rank<r>.pkl`` (``("ok", value)`` or
``("error", text)``).

A rank whose function raised still exits with status 0 after writing its error, so that mpirun
lets the other ranks finish and write theirs (it ends the whole job when a rank fails).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import cloudpickle


def _rank() -> int:
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    raise RuntimeError("mpi_worker.py runs under mpirun only")


def main() -> int:
    payload, folder = Path(sys.argv[1]), Path(sys.argv[2])
    fn, args = cloudpickle.loads(payload.read_bytes())
    try:
        outcome = ("ok", fn(*args))
    except BaseException as exc:  # reported to the test with the traceback
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        print(text, file=sys.stderr, end="", flush=True)
        outcome = ("error", f"{type(exc).__name__}: {exc}\n{text}")
    try:
        blob = cloudpickle.dumps(outcome)
    except Exception as exc:
        blob = cloudpickle.dumps(("error", f"the result could not be pickled: {exc}"))
    partial = folder / f"rank{_rank()}.tmp"
    partial.write_bytes(blob)
    partial.rename(folder / f"rank{_rank()}.pkl")
    from hora.common.startup.lifecycle import shutdown

    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
