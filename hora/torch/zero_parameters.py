"""The parameters a sharded ``DistributedOptimizer`` updates, and this rank's pieces of them.

:class:`ShardedParameters` owns the trainable parameters in the optimizer's order, their names,
the buckets they travel in (planned once, when the optimizer is wrapped), the layout of those
buckets over the ranks that share the optimizer now (see :mod:`hora.torch.zero_layout`), and the
piece tensors: flat views of the elements of each parameter that this rank owns, which the
wrapped optimizer updates and keys its state by. It also holds what names the optimizer's
collectives (its label and process set).

It knows tensors and the process set's size and rank; it does not know gradients, collectives
or the optimizer's step, and reads the optimizer's state only to tell whether its pieces have any.
"""

from __future__ import annotations

from typing import Any

import torch

from hora.common.ops import submission
from hora.common.vocabulary.errors import HoraValueError
from hora.torch.gradient_reduction import DistributedOptions, parameter_names, split_groups
from hora.torch.zero_layout import Bucket, Layout, Piece, plan_buckets

# The largest bucket of gradients reduce-scattered (and of parameters allgathered) as one tensor.
BUCKET_BYTES = 16 * 1024 * 1024


class ShardedParameters:
    """The trainable parameters of a sharded optimizer, their buckets, and this rank's pieces.

    Attributes:
        label: the prefix of the names of the optimizer's collectives.
        process_set: the ranks that share the optimizer.
        all_params: every parameter of every group, trainable or not.
        trainable: the parameters that require a gradient, in the groups' order; their
            positions are the indices of slots and pieces.
        index: each trainable parameter's position in ``trainable``.
        group_of: the parameter group of each trainable parameter.
        buckets: the buckets, each a run of trainable parameters.
        bucket_of: the bucket of each trainable parameter.
    """

    def __init__(
        self, param_groups: list[dict[str, Any]], options: DistributedOptions, label: str
    ) -> None:
        self.label = label
        self.process_set = options.process_set
        self._names = parameter_names(param_groups, options.named_parameters)
        self.all_params = [p for group in param_groups for p in group["params"]]
        self.trainable = [p for p in self.all_params if p.requires_grad]
        self.index = {p: i for i, p in enumerate(self.trainable)}
        self.group_of = [0] * len(self.trainable)
        for number, group in enumerate(param_groups):
            for p in group["params"]:
                if p in self.index:
                    self.group_of[self.index[p]] = number
        self.buckets = self._plan(options.groups)
        self.bucket_of = [0] * len(self.trainable)
        for bucket in self.buckets:
            for slot in bucket.slots:
                self.bucket_of[slot.index] = bucket.number
        self._layout: Layout | None = None
        self._pieces: dict[int, torch.Tensor] = {}

    def _plan(self, groups: Any) -> list[Bucket]:
        keys = [(p.dtype, p.device) for p in self.trainable]
        numels = [p.numel() for p in self.trainable]
        limits = [max(1, BUCKET_BYTES // p.element_size()) for p in self.trainable]
        explicit = None
        if groups is not None and groups != 0:
            explicit = [
                [self.index[p] for p in members] for members in split_groups(self.trainable, groups)
            ]
        return plan_buckets(numels, keys, limits, explicit)

    # ------------------------------------------------------------------ names

    def name_of(self, p: torch.Tensor) -> str:
        """The name of parameter ``p`` (as its reductions are named)."""
        return self._names[p]

    def name(self, index: int) -> str:
        """The name of trainable parameter ``index``."""
        return self._names[self.trainable[index]]

    def first_name(self, number: int) -> str:
        """The name of bucket ``number``'s first parameter (part of its collectives' names)."""
        return self.name(self.buckets[number].slots[0].index)

    # ------------------------------------------------------------------ layout

    @property
    def layout(self) -> Layout:
        """The buckets laid out over the ranks that shared the optimizer when it was last laid
        out (see :meth:`changed`)."""
        assert self._layout is not None
        return self._layout

    @property
    def pieces(self) -> dict[int, torch.Tensor]:
        """This rank's piece tensor of each parameter it owns a part of, by trainable index."""
        return self._pieces

    def size_now(self) -> int:
        """How many ranks share the optimizer now (the layout may be older)."""
        if not self.process_set.included():
            return 1
        return submission.set_size(self.process_set)

    def rank_now(self) -> int:
        """This rank's position among the ranks that share the optimizer now."""
        if not self.process_set.included():
            return 0
        return submission.set_rank(self.process_set)

    def changed(self) -> bool:
        """Whether the ranks sharing the optimizer are no longer those of the layout."""
        layout = self.layout
        return (self.size_now(), self.rank_now()) != (layout.size, layout.rank)

    def needs_new_layout(self, state: Any) -> bool:
        """Whether the ranks sharing the optimizer changed (an elastic reset); refused while
        this rank's pieces have state in ``state`` (the optimizer's), which a new layout would
        lose.

        Raises:
            HoraValueError: the ranks changed and this rank's pieces have state.
        """
        layout = self.layout
        size, rank = self.size_now(), self.rank_now()
        if (size, rank) == (layout.size, layout.rank):
            return False
        if self.has_state(state):
            raise HoraValueError(
                f"sharded DistributedOptimizer: the ranks sharing it changed from "
                f"{layout.size} to {size} (this rank: {layout.rank} -> {rank}), "
                "and each rank holds only its own shard of the optimizer state. Redistribute it "
                "through hvd.elastic.TorchState (its commit keeps a consolidated copy), or load "
                "a consolidated optimizer.state_dict() on every rank."
            )
        return True

    def lay_out(self) -> None:
        """Lay the buckets out over the ranks there are now; each piece gets a new tensor, a view
        of its parameter's memory (the caller drops the old pieces' state first)."""
        layout = Layout.of(self.buckets, self.rank_now(), self.size_now())
        self._layout = layout
        self._pieces = {}
        for pieces in layout.pieces:
            for piece in pieces:
                self._pieces[piece.index] = self._piece_tensor(piece)

    def _piece_tensor(self, piece: Piece) -> torch.Tensor:
        p = self.trainable[piece.index]
        with torch.no_grad():
            if p.is_contiguous():
                tensor = torch.empty(0, dtype=p.dtype, device=p.device)
                tensor.set_(p.untyped_storage(), p.storage_offset() + piece.start, (piece.numel,))  # type: ignore[call-overload]  # set_(storage, ...) is missing from the stubs
            else:
                tensor = p.detach().reshape(-1)[piece.start : piece.stop].clone()
        return tensor

    def refresh(self) -> None:
        """Point every piece at its parameter's memory again: a parameter whose ``.data`` was
        replaced (``model.to``, ``load_state_dict(assign=True)``) keeps its piece and state.

        Raises:
            HoraValueError: a parameter's dtype or device changed since the optimizer was wrapped.
        """
        with torch.no_grad():
            for piece in self.layout.piece_of().values():
                p = self.trainable[piece.index]
                tensor = self._pieces[piece.index]
                if p.dtype != tensor.dtype or p.device != tensor.device:
                    raise HoraValueError(
                        f"sharded DistributedOptimizer: parameter "
                        f"{self.name_of(p)!r} changed from {tensor.dtype} on "
                        f"{tensor.device} to {p.dtype} on {p.device} after it was wrapped. "
                        "Move or cast the model before wrapping its optimizer."
                    )
                if not p.is_contiguous():
                    tensor.copy_(p.detach().reshape(-1)[piece.start : piece.stop])
                    continue
                offset = p.storage_offset() + piece.start
                if (
                    tensor.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
                    or tensor.storage_offset() != offset
                ):
                    tensor.set_(p.untyped_storage(), offset, (piece.numel,))  # type: ignore[call-overload]

    def piece_groups(self, count: int) -> list[list[torch.Tensor]]:
        """Per parameter group (of ``count``), the pieces of its parameters that this rank owns,
        in order."""
        groups: list[list[torch.Tensor]] = [[] for _ in range(count)]
        for index, tensor in sorted(self._pieces.items()):
            groups[self.group_of[index]].append(tensor)
        return groups

    def bucket_piece_groups(
        self, count: int, buckets: list[int] | None
    ) -> list[list[torch.Tensor]]:
        """Per parameter group (of ``count``), this rank's pieces in ``buckets`` (or all), in the
        buckets' order."""
        chosen = None if buckets is None else set(buckets)
        groups: list[list[torch.Tensor]] = [[] for _ in range(count)]
        for number, pieces in enumerate(self.layout.pieces):
            if chosen is not None and number not in chosen:
                continue
            for piece in pieces:
                groups[self.group_of[piece.index]].append(self._pieces[piece.index])
        return groups

    def has_state(self, state: Any) -> bool:
        """Whether any of this rank's pieces has state in ``state`` (the optimizer's)."""
        return any(state.get(t) for t in self._pieces.values())

    def drop_gradients(self) -> None:
        """Forget the pieces' gradients (this rank's reduced shards)."""
        for tensor in self._pieces.values():
            tensor.grad = None
