"""``ElasticSampler``: a distributed sampler that remembers how far the epoch has got.

Every rank draws the same permutation of the data set (seeded with ``seed + epoch``). The
sampler counts the samples the whole job has processed this epoch (``processed_num``) as a prefix
of that permutation; after a reset (a rank lost or added) each rank takes its share of what is
left, so the epoch carries on with the new number of ranks and no sample is skipped.

How the remaining samples are shared: rank ``r`` of ``n`` takes ``remaining[r::n]`` (strided).
When every rank has consumed ``k`` batches of ``B`` samples, the job has consumed exactly
``remaining[:k * B * n]``: a prefix again, which is what ``record_batch`` adds up.

As Horovod's sampler does, it pads by default: the remaining samples are extended with their own
first ones (at most ``n - 1`` of them) until they divide by the number of ranks, so every rank
gets the same number of samples (``num_samples``) and a loop ``for batch in loader`` runs the
same number of steps, hence the same collectives, on every rank. Those few samples are seen
twice in the epoch.

``pad=False`` shares exactly, with no sample repeated: some ranks then get one sample more
than others, so the last batch of an epoch may be smaller on some ranks, or missing on some
ranks (when a rank's share is one sample short of a full extra batch, or when fewer samples
remain than ranks). Rank 0's share is always a largest one. Two ways to keep the ranks
together then:

* Lockstep (recommended): every rank runs :meth:`ElasticSampler.num_batches` steps (the same
  number everywhere); a rank whose share has run out calls ``optimizer.step()`` without a
  backward pass. ``hvd.DistributedOptimizer`` reduces zeros for the gradients it did not get,
  so every rank applies the same averaged update and the weights stay identical. Every
  collective of the loop (``check_host_updates`` included) is called the same number of times
  on every rank.
* ``hvd.join()`` after the epoch's batches: a rank that has run out takes part in the others'
  allreduces with zeros until every rank has joined (``DistributedOptimizer`` works with it).
  The joined ranks skipped the last optimizer step, so the loop must then call
  ``state.commit(); state.sync()`` (every rank takes rank 0's weights and optimizer state).
  Collectives other than allreduce (broadcast, allgather, ...) fail while a rank has joined.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from hora.common import api


class ElasticSampler(Sampler[int]):
    """Shards a data set over the ranks and tracks the epoch's progress across resets.

    Args:
        dataset: anything with ``len()``; the sampler yields indices ``0 .. len(dataset) - 1``.
        shuffle: draw a fresh permutation every epoch (seeded with ``seed + epoch``, the same on
            every rank); ``False`` keeps the data set's order.
        seed: the base of the shuffling seed; every rank must pass the same.
        pad: give every rank the same number of samples, repeating at most ``n - 1`` of the
            epoch's first remaining ones (Horovod's behaviour, the default); ``False`` shares
            exactly, with no sample repeated and shares that differ by one (see the module's
            documentation for the loops that suit it).
        num_replicas: the number of ranks to shard over (default: ``hvd.size()`` at each
            :meth:`reset`). For tests and tools; a training script leaves it out.
        rank: this process's shard (default: ``hvd.rank()`` at each :meth:`reset`).

    Attributes:
        epoch: the current epoch (see :meth:`set_epoch`).
        processed_num: how many samples of this epoch's permutation the job has processed
            (a prefix of it); updated by :meth:`record_batch`.
        num_replicas, rank: the sharding in force since the last :meth:`reset`.
        remaining_indices: the permutation without its processed prefix.
        num_samples: the samples of this rank's share (the same on every rank when padding).
        total_size: the samples shared out: ``num_samples * num_replicas`` when padding, else
            ``len(remaining_indices)``.
        indices: this rank's share, ``remaining_indices[rank::num_replicas]`` (padded first).

    Usage: call :meth:`record_batch` after each batch, :meth:`set_epoch` at the **end** of each
    epoch (it starts the next one: calling it at the start of an epoch would forget the progress
    restored after a reset), and put the sampler in a :class:`~hora.torch.elastic.TorchState` so
    it is saved with every commit and synchronized after a reset.

    Example:
        >>> sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=42)
        >>> loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
        >>> state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
    """

    def __init__(
        self,
        dataset: Sized,
        shuffle: bool = True,
        seed: int = 0,
        *,
        pad: bool = True,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__()
        if num_replicas is not None and num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}.")
        if rank is not None and not 0 <= rank < (num_replicas or api.size()):
            raise ValueError(f"rank {rank} is out of range for {num_replicas} replicas.")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.pad = pad
        self.epoch = 0
        self.processed_num = 0
        self._fixed_replicas = num_replicas
        self._fixed_rank = rank
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: list[int] = []
        self._order: list[int] = []
        self.reset()

    # ------------------------------------------------------------------ progress

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing processed yet, a new permutation (seed ``seed + epoch``).

        Call it at the **end** of an epoch with the next epoch's number (Horovod's rule).
        """
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record that every rank has processed one more batch of ``batch_size`` samples.

        Adds ``batch_size * num_replicas`` to :attr:`processed_num` (capped at the data set's
        size, which the last, possibly partial, batch of the epoch reaches). ``batch_idx`` is
        accepted for Horovod compatibility and not used: the count does not depend on it.
        """
        del batch_idx
        self._advance(batch_size)

    def record_indices(self, indices: Iterable[Any]) -> None:
        """Record that this rank has processed ``indices``, the next ones of its share, and
        that every other rank has processed as many of its own.

        The same as ``record_batch(_, len(indices))``, for loops that consume the sampler
        directly rather than in fixed-size batches.
        """
        self._advance(len(list(indices)))

    def num_batches(self, batch_size: int) -> int:
        """How many batches of ``batch_size`` the largest share (rank 0's; every rank's when
        padding) has left.

        The same on every rank: a loop that runs this many steps everywhere keeps the ranks
        in lockstep (a rank out of data steps without a backward pass). Like ``len()``, it
        changes only at a :meth:`reset` (``set_epoch``, ``load_state_dict``).

        Example:
            >>> batches = iter(loader)
            >>> for _ in range(sampler.num_batches(32)):
            ...     batch = next(batches, None)  # None once this rank's share is used up
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
        largest = -(-len(self.remaining_indices) // self.num_replicas)
        return -(-largest // batch_size)

    def _advance(self, per_rank: int) -> None:
        if per_rank < 0:
            raise ValueError(f"a batch cannot have {per_rank} samples.")
        self.processed_num = min(self.processed_num + per_rank * self.num_replicas, self._total())

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": ..., "processed_num": ...}``: all a rank needs to resume the epoch."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Take over another sampler's progress (from :meth:`state_dict`) and :meth:`reset`."""
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Re-read the job's size and this rank, and share out what is left of the epoch.

        ``TorchState`` calls it after every reset of an elastic job; ``set_epoch`` and
        ``load_state_dict`` call it too.
        """
        self.num_replicas = self._fixed_replicas if self._fixed_replicas is not None else api.size()
        self.rank = self._fixed_rank if self._fixed_rank is not None else api.rank()
        total = self._total()
        self.processed_num = max(0, min(self.processed_num, total))
        self._order = self._permutation(total)
        remaining = self._order[self.processed_num :]
        self.remaining_indices = remaining
        shared = remaining
        if self.pad and remaining:
            self.num_samples = -(-len(remaining) // self.num_replicas)
            self.total_size = self.num_samples * self.num_replicas
            repeats = -(-self.total_size // len(remaining))
            shared = (remaining * repeats)[: self.total_size]
        self.indices = shared[self.rank :: self.num_replicas]
        if not self.pad or not remaining:
            self.num_samples = len(self.indices)
            self.total_size = len(remaining)

    @property
    def processed_indices(self) -> set[int]:
        """The indices the job has processed this epoch (the processed prefix of the
        permutation), as Horovod's sampler names them."""
        return set(self._order[: self.processed_num])

    def _total(self) -> int:
        return len(self.dataset)

    def _permutation(self, total: int) -> list[int]:
        if not self.shuffle:
            return list(range(total))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(total, generator=generator).tolist()

    # ------------------------------------------------------------------ Sampler

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        """The number of samples this rank yields for the rest of the epoch (the same on every
        rank when padding; else ranks may differ by one)."""
        return len(self.indices)

    def __repr__(self) -> str:
        return (
            f"ElasticSampler(epoch={self.epoch}, processed_num={self.processed_num}, "
            f"rank={self.rank}, num_replicas={self.num_replicas}, len={len(self)}, "
            f"pad={self.pad})"
        )
