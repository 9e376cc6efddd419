"""The engine: negotiation, fusion, execution and the steady state, one background thread per
process. See README.md in this folder for its parts and docs/architecture.md for the whole.

What the framework layer uses: :class:`Engine` (its documented methods), :class:`Entry` and
:class:`Handle`, :func:`dtype_name` and :func:`owns_its_memory` (the rule for adopting a lent
result).
"""

from hora.common.engine.buffers import dtype_name, owns_its_memory
from hora.common.engine.engine import Engine
from hora.common.engine.handles import Entry, Handle

__all__ = ["Engine", "Entry", "Handle", "dtype_name", "owns_its_memory"]
