"""Tensor fusion: which agreed responses are run as one collective on one buffer.

The plan is computed from the response list alone, so every rank derives the same plan.
Allreduces that share a process set, dtype, device, reduction and scale factors are packed
together, in first-seen order, until the next one would overflow the fusion threshold; a response
that does not fit one batch does not block the others (Horovod's look-ahead). Other kinds run
one by one. This module knows responses and byte counts, never buffers.
"""

from __future__ import annotations

from collections.abc import Hashable

from hora.common.vocabulary.message import RequestType, Response


def fusion_key(response: Response, disable_group_fusion: bool = False) -> Hashable:
    """Responses with equal keys may share one fused buffer."""
    t = response.template()
    group = t.group if disable_group_fusion else None
    return (
        response.process_set_id,
        t.dtype,
        t.device,
        t.reduce_op,
        t.prescale,
        t.postscale,
        response.joined_ranks,
        group,
    )


def plan(
    responses: list[Response], threshold_bytes: int, disable_group_fusion: bool = False
) -> list[list[Response]]:
    """Split ``responses`` into batches; each batch runs as one collective.

    Args:
        responses: the agreed responses of one cycle, in agreed order.
        threshold_bytes: the largest fused buffer (0: every response alone).
        disable_group_fusion: fuse a grouped op's tensors only with each other.

    Returns:
        Batches in execution order. Non-allreduce responses and errors are batches of one.
    """
    batches: list[list[Response]] = []
    open_batches: dict[Hashable, tuple[list[Response], int]] = {}
    for response in responses:
        if response.kind != RequestType.ALLREDUCE or response.error is not None:
            batches.append([response])
            continue
        size = response.num_bytes
        key = fusion_key(response, disable_group_fusion)
        current = open_batches.get(key)
        if current is not None and current[1] + size <= threshold_bytes:
            current[0].append(response)
            open_batches[key] = (current[0], current[1] + size)
            continue
        batch = [response]
        batches.append(batch)
        open_batches[key] = (batch, size)
    return batches
