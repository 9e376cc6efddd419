"""Compatibility path for scripts that import ``horovod.tensorflow.util``: its small TensorFlow
helpers (is TensorFlow eager, a ``tf.function`` of a callable, a cache per execution mode,
variables to hashable references and back).

The name breaks hora's rule against ``util`` modules only because Horovod scripts import this
path. ``hora.tensorflow`` re-exports these names, as ``horovod.tensorflow`` does; hora's own code
does not use them (its TensorFlow plumbing is :mod:`hora.tensorflow._bridge`).

Example:
    >>> from hora.tensorflow.util import vars_to_refs, refs_to_vars
    >>> refs = vars_to_refs(model.trainable_variables)   # a tuple: usable as a dict key
    >>> refs_to_vars(refs) == model.trainable_variables
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import tensorflow as tf

__all__ = ["refs_to_vars", "vars_to_refs"]


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs ops eagerly here (``False`` while a ``tf.function`` is traced)."""
    return bool(tf.executing_eagerly())


def _make_subgraph(f: Callable[..., Any]) -> Any:
    """``f`` as a ``tf.function``."""
    return tf.function(f)


def _cache(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` with its results kept, one per (arguments, eager or not): a second call with equal
    (hashable) arguments in the same mode returns the first call's result."""
    results: dict[tuple[Any, ...], Any] = {}

    @functools.wraps(f)
    def cached(*args: Any) -> Any:
        key = (args, _executing_eagerly())
        if key not in results:
            results[key] = f(*args)
        return results[key]

    return cached


def vars_to_refs(vars: Any) -> Any:
    """A variable's hashable reference (``var.ref()``); for a list, a tuple of the references
    of its items, nested lists included."""
    if isinstance(vars, list):
        return tuple(vars_to_refs(v) for v in vars)
    return vars.ref()


def refs_to_vars(refs: Any) -> Any:
    """The inverse of :func:`vars_to_refs`: tuples become lists of the variables referenced."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()
