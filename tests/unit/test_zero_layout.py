"""The shard layout of a sharded ``DistributedOptimizer`` (hora/torch/zero_layout.py): buckets
of whole parameters, and each rank's contiguous part of every bucket."""

from __future__ import annotations

import pytest

from hora.torch.zero_layout import Layout, plan_buckets


def _owned(layout: Layout, index: int) -> list[tuple[int, int]]:
    return [(p.start, p.stop) for pieces in layout.pieces for p in pieces if p.index == index]


def test_buckets_take_parameters_last_first_up_to_the_limit() -> None:
    buckets = plan_buckets([4, 6, 3, 5], ["f32"] * 4, [10] * 4)
    assert [[s.index for s in b.slots] for b in buckets] == [[3, 2], [1, 0]]
    assert [b.numel for b in buckets] == [8, 10]
    assert [s.offset for s in buckets[0].slots] == [0, 5]


def test_a_parameter_larger_than_a_bucket_is_alone_and_keys_never_mix() -> None:
    buckets = plan_buckets([3, 50, 2, 4], ["a", "a", "b", "a"], [10] * 4)
    assert [[s.index for s in b.slots] for b in buckets] == [[3], [2], [1], [0]]


def test_explicit_groups_are_buckets_split_by_key() -> None:
    buckets = plan_buckets([2, 2, 2], ["a", "b", "a"], [1] * 3, groups=[[0, 1, 2]])
    assert [[s.index for s in b.slots] for b in buckets] == [[0, 2], [1]]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_every_element_has_exactly_one_owner_and_parts_are_even(size: int) -> None:
    numels = [5, 1, 12, 3, 9]
    buckets = plan_buckets(numels, ["f32"] * 5, [16] * 5)
    seen: dict[int, list[int]] = {i: [] for i in range(len(numels))}
    for rank in range(size):
        layout = Layout.of(buckets, rank, size)
        for bucket, pieces, numel in zip(buckets, layout.pieces, layout.shard_numels):
            # The engine's reducescatter split: the first numel % size ranks get one more.
            assert numel == bucket.numel // size + (1 if rank < bucket.numel % size else 0)
            assert sum(p.numel for p in pieces) == numel
            offsets = [p.shard_offset for p in pieces]
            assert offsets == sorted(offsets) and (not pieces or offsets[0] == 0)
        for index in seen:
            for start, stop in _owned(layout, index):
                seen[index].extend(range(start, stop))
    for index, elements in seen.items():
        assert sorted(elements) == list(range(numels[index])), index


def test_a_rank_owns_one_interval_of_a_parameter() -> None:
    buckets = plan_buckets([10], ["f32"], [100])
    assert [_owned(Layout.of(buckets, r, 3), 0) for r in range(3)] == [
        [(0, 4)],
        [(4, 7)],
        [(7, 10)],
    ]
    # More ranks than elements: some own nothing.
    assert _owned(Layout.of(plan_buckets([2], ["f32"], [100]), 2, 3), 0) == []
