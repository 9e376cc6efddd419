"""HORA_GRADIENT_COMPRESSION: the compressor an optimizer built without one sends gradients with."""

from __future__ import annotations

import pytest
import torch

from hora.common.ops.compression import for_gradients
from hora.common.vocabulary.config import SettingError
from hora.torch.compression import Compression


class Plain(Compression.none):  # type: ignore[misc, valid-type]
    """A compressor of the user's own that happens to send tensors as they are."""


@pytest.mark.parametrize(
    ("setting", "given", "chosen"),
    [
        (None, Compression.none, Compression.none),
        ("none", Compression.none, Compression.none),
        ("fp16", Compression.none, Compression.fp16),
        ("BF16", Compression.none, Compression.bf16),
        ("bf16", Compression.fp16, Compression.fp16),
        ("fp16", Plain, Plain),
    ],
)
def test_only_the_default_compressor_gives_way_to_the_setting(
    monkeypatch: pytest.MonkeyPatch, setting: str | None, given: object, chosen: object
) -> None:
    if setting is None:
        monkeypatch.delenv("HORA_GRADIENT_COMPRESSION", raising=False)
    else:
        monkeypatch.setenv("HORA_GRADIENT_COMPRESSION", setting)
    assert for_gradients(given, Compression.fp16, Compression.bf16) is chosen


def test_an_unknown_compression_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HORA_GRADIENT_COMPRESSION", "int8")
    with pytest.raises(SettingError, match="HORA_GRADIENT_COMPRESSION.*int8"):
        for_gradients(Compression.none, Compression.fp16, Compression.bf16)


def test_the_chosen_compressor_sends_floating_point_gradients_as_its_type(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HORA_GRADIENT_COMPRESSION", "bf16")
    compressor = for_gradients(Compression.none, Compression.fp16, Compression.bf16)
    sent, ctx = compressor.compress(torch.ones(3))  # type: ignore[attr-defined]
    assert sent.dtype == torch.bfloat16 and ctx == torch.float32
