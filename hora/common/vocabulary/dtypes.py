"""Element types as text: sizes and what each collective accepts.

Requests carry dtypes as strings (``"float32"``) so the negotiation layer needs no framework.
The framework layer maps its own dtypes onto these names.
"""

from __future__ import annotations

ITEMSIZE: dict[str, int] = {
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "bool": 1,
}

FLOATING = frozenset({"float16", "bfloat16", "float32", "float64"})
INTEGER = frozenset({"uint8", "int8", "int16", "int32", "int64"})
SUPPORTED = frozenset(ITEMSIZE)


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype``."""
    return ITEMSIZE[dtype]
