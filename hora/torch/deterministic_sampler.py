"""Deterministic mode's data: micro-batches cut from each epoch by global sample position, the
same for every world size, and seeds that belong to a micro-batch rather than to a rank.

An epoch is a permutation of the data set (seeded with ``seed + epoch``, as
:class:`~hora.torch.elastic.ElasticSampler`'s), cut into global batches of
``microbatches * microbatch_size`` samples; global batch ``s`` (step ``s`` of the epoch) is
cut into ``microbatches`` micro-batches of ``microbatch_size`` samples, numbered ``0 .. K-1``.
Rank ``r`` of ``N`` runs micro-batches ``r * K/N .. (r + 1) * K/N - 1`` of every step: which
samples a micro-batch holds never depends on ``N``, only which rank runs it does.

The progress is one number, the steps done in the epoch (:meth:`DeterministicSampler.record_step`),
kept by ``hvd.elastic.TorchState`` like an ``ElasticSampler``'s: after a reset the job goes on
at the step after the last commit, with whatever ranks it has then.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from hora.common import api
from hora.torch import deterministic_tree as tree

_MASK = (1 << 64) - 1


def _mix(value: int) -> int:
    """SplitMix64's finalizer: 64 bits in, 64 well-mixed bits out."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def microbatch_seed(step: int, index: int, seed: int = 0) -> int:
    """The seed of micro-batch ``index`` of step ``step`` (counted over the whole run): the same
    on every rank that runs it, at any world size. A 63-bit number, mixed so that neighbouring
    steps and micro-batches get unrelated streams.

    Example:
        >>> torch.manual_seed(microbatch_seed(step=120, index=3, seed=42))
    """
    for part in (step, index):
        if part < 0:
            raise ValueError(f"micro-batch seeds take steps and indices >= 0, got {part}")
    mixed = _mix(seed & _MASK)
    mixed = _mix(mixed ^ (step & _MASK))
    mixed = _mix(mixed ^ (index & _MASK))
    return mixed >> 1


def microbatch_generator(
    step: int, index: int, seed: int = 0, device: str | torch.device = "cpu"
) -> torch.Generator:
    """A new ``torch.Generator`` seeded with :func:`microbatch_seed`: for a data loader's
    augmentation, or any randomness of one micro-batch that must not depend on the rank.

    Example:
        >>> noise = torch.randn(8, generator=microbatch_generator(step, index))
    """
    return torch.Generator(device=device).manual_seed(microbatch_seed(step, index, seed))


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with torch's default CPU generator seeded with ``seed`` (dropout and every
    other draw that takes no generator); the generator's state is put back afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a step.

    Attributes:
        index: its leaf in the step's tree, ``0 .. K-1``.
        step: the step's number in the run (epochs included), for seeds.
        indices: the data set's samples it holds.
        seed: :func:`microbatch_seed` of (``step``, ``index``, the sampler's seed).
    """

    index: int
    step: int
    indices: tuple[int, ...]
    seed: int

    def generator(self, device: str | torch.device = "cpu") -> torch.Generator:
        """A new generator seeded with :attr:`seed`."""
        return torch.Generator(device=device).manual_seed(self.seed)


@dataclass(frozen=True)
class Step:
    """One step of an epoch: this rank's micro-batches, in order (iterate over it).

    Attributes:
        epoch: the epoch.
        number: the step's number within the epoch.
        microbatches: the micro-batches this rank runs.
    """

    epoch: int
    number: int
    microbatches: tuple[MicroBatch, ...]

    def __iter__(self) -> Iterator[MicroBatch]:
        return iter(self.microbatches)

    def __len__(self) -> int:
        return len(self.microbatches)


class DeterministicSampler:
    """Hands out micro-batches by global position, the same for every world size, and
    remembers how far the epoch got.

    Args:
        dataset: anything with ``len()``; micro-batches hold indices ``0 .. len(dataset) - 1``.
        microbatches: ``K``, the micro-batches of a step; the job's world size must divide it.
        microbatch_size: samples per micro-batch (a step takes ``K * microbatch_size``).
        shuffle: a new permutation every epoch (seeded with ``seed + epoch``); ``False`` keeps
            the data set's order.
        seed: the base of the permutations and of the micro-batches' seeds; the same on every
            rank.
        drop_last: leave out the samples of an epoch that do not fill a whole step (default);
            ``False`` fills the last step with the epoch's first samples instead.
        num_replicas, rank: the world to share steps over (default: ``hvd.size()`` and
            ``hvd.rank()`` at each :meth:`reset`). For tests and tools.

    Attributes:
        epoch: the current epoch.
        step: the steps of this epoch done (recorded with :meth:`record_step`).
        steps_per_epoch: the steps of an epoch.
        num_replicas, rank: the sharing in force since the last :meth:`reset`.

    Example:
        >>> sampler = hvd.deterministic.DeterministicSampler(dataset, microbatches=12,
        ...                                                  microbatch_size=8, seed=0)
        >>> for step in sampler.steps():
        ...     optimizer.zero_grad()
        ...     for mb in step:
        ...         with optimizer.microbatch(mb):
        ...             loss_of(mb.indices).backward()
        ...     optimizer.step()
        ...     sampler.record_step()
    """

    def __init__(
        self,
        dataset: Sized,
        microbatches: int,
        microbatch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        if microbatches < 1 or microbatch_size < 1:
            raise ValueError(
                f"microbatches and microbatch_size must be at least 1, got {microbatches} and "
                f"{microbatch_size}."
            )
        self.dataset = dataset
        self.microbatches = microbatches
        self.microbatch_size = microbatch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.step = 0
        self._fixed = (num_replicas, rank)
        self.num_replicas = 1
        self.rank = 0
        self._order: tuple[int, list[int]] | None = None
        batch = microbatches * microbatch_size
        total = len(dataset)
        self.steps_per_epoch = total // batch if drop_last else -(-total // batch)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"a step takes {batch} samples ({microbatches} micro-batches of "
                f"{microbatch_size}), more than the data set's {total}: no step would run "
                "(drop_last=False runs one, repeating samples)."
            )
        self.reset()

    # ------------------------------------------------------------------ progress

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first step (call it at the end of an epoch, with the
        next one's number, as for ``ElasticSampler``)."""
        self.epoch = epoch
        self.step = 0

    def record_step(self) -> None:
        """The job finished one more step of the epoch (call it after ``optimizer.step()``)."""
        self.step = min(self.step + 1, self.steps_per_epoch)

    @property
    def global_step(self) -> int:
        """The steps of the run before the current one: ``epoch * steps_per_epoch + step``."""
        return self.epoch * self.steps_per_epoch + self.step

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": ..., "step": ...}``: all a rank needs to resume."""
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Take over another sampler's progress (from :meth:`state_dict`) and :meth:`reset`."""
        self.epoch = int(state_dict["epoch"])
        self.step = int(state_dict["step"])
        self.reset()

    def reset(self) -> None:
        """Re-read the world size and this rank (``TorchState`` calls it after every reset).

        Raises:
            ValueError: the world size does not divide ``microbatches``.
        """
        replicas, rank = self._fixed
        self.num_replicas = replicas if replicas is not None else api.size()
        self.rank = rank if rank is not None else api.rank()
        refusal = tree.refusal(self.microbatches, self.num_replicas)
        if refusal is not None:
            raise ValueError(refusal)
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is out of range for {self.num_replicas} ranks.")

    # ------------------------------------------------------------------ micro-batches

    def _permutation(self) -> list[int]:
        cached = self._order
        if cached is not None and cached[0] == self.epoch:
            return cached[1]
        total = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(total, generator=generator).tolist()
        else:
            order = list(range(total))
        self._order = (self.epoch, order)
        return order

    def local_indices(self) -> range:
        """The micro-batches (``0 .. K-1``) this rank runs in every step."""
        start, end = tree.block(self.microbatches, self.num_replicas, self.rank)
        return range(start, end)

    def microbatch(self, number: int, index: int) -> MicroBatch:
        """Micro-batch ``index`` of step ``number`` of the current epoch (any rank's)."""
        if not 0 <= index < self.microbatches or not 0 <= number < self.steps_per_epoch:
            raise ValueError(
                f"no micro-batch {index} of step {number}: an epoch has {self.steps_per_epoch} "
                f"steps of {self.microbatches} micro-batches."
            )
        order = self._permutation()
        size = self.microbatch_size
        first = (number * self.microbatches + index) * size
        indices = tuple(order[position % len(order)] for position in range(first, first + size))
        step = self.epoch * self.steps_per_epoch + number
        return MicroBatch(index, step, indices, microbatch_seed(step, index, self.seed))

    def steps(self) -> Iterator[Step]:
        """The steps left in the epoch, from :attr:`step` on, each with this rank's
        micro-batches. Record each one with :meth:`record_step` once it is done."""
        for number in range(self.step, self.steps_per_epoch):
            mine = tuple(self.microbatch(number, index) for index in self.local_indices())
            yield Step(self.epoch, number, mine)

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's micro-batches of the steps left, as lists of sample indices, in order:
        a ``batch_sampler`` for ``torch.utils.data.DataLoader`` (each batch one micro-batch)."""
        for step in self.steps():
            for microbatch in step:
                yield list(microbatch.indices)

    def __len__(self) -> int:
        """This rank's micro-batches in the steps left of the epoch."""
        return (self.steps_per_epoch - self.step) * len(self.local_indices())

    def __repr__(self) -> str:
        return (
            f"DeterministicSampler(epoch={self.epoch}, step={self.step}/{self.steps_per_epoch}, "
            f"microbatches={self.microbatches}, microbatch_size={self.microbatch_size}, "
            f"rank={self.rank}, num_replicas={self.num_replicas})"
        )
