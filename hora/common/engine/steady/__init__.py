"""Steady state: replaying an agreed, repeating sequence of allreduces without negotiation.

A training loop submits the same gradients, in the same order, every step. Once every rank has
seen the agreed sequence of allreduces repeat (the same names and requests, twice in a row,
with nothing else in between and nothing pending), every rank derives the same *schedule* from
it: the period's responses, packed into fused batches. From then on each rank runs batch after
batch as soon as its own tensors for the batch are there, with no negotiation round: the data
allreduce is the only point where ranks meet, as in PyTorch DDP.

Every batch carries one extra element per rank, its *code*, reduced with the data. A rank that
submits anything the schedule does not predict (another name, another shape, another kind of
operation, a join, a shutdown), or whose user thread blocks on a result while the batch it
needs cannot fill, contributes a code instead of data. Every rank then sees the code, puts
the batch's tensors back in its queue untouched, and returns to negotiation at the same batch,
so a deviation costs one wasted round and never a hang or a mismatched collective.

The package's modules, from the plan to running it:

- :mod:`.schedule`: the pure parts: finding the period, cutting it into batches, the codes;
- :mod:`.replay`: ``Replay``, which enters, runs batch after batch, and leaves;
- :mod:`.collect`: when this rank's part of the current batch is decided;
- :mod:`.staging`: the batch buffers: staging tensors in, delivering results out;
- :mod:`.waits`: how long batches wait for peers, and who hears of a late one.

The engine knows ``Replay`` and the schedule it exposes; the steady state knows nothing of
negotiation. The package itself exports what code outside the engine uses, and imports nothing
of the replay: autotune.py imports the schedule's sizes, and the replay imports autotune.
"""

from hora.common.engine.steady.schedule import BatchLayout, Schedule
from hora.common.engine.steady.waits import steady_batch_timeout_s

__all__ = ["BatchLayout", "Schedule", "steady_batch_timeout_s"]
