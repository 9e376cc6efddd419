"""Compatibility path for scripts that import ``horovod.tensorflow.gradient_aggregation_eager``:
:class:`LocalGradientAggregationHelperEager` is :mod:`hora.tensorflow.gradient_aggregation`'s,
where both of Horovod's aggregation helpers are written.

Example:
    >>> from hora.tensorflow.gradient_aggregation_eager import LocalGradientAggregationHelperEager
    >>> helper = LocalGradientAggregationHelperEager(2, None, False, True)
"""

from __future__ import annotations

from hora.tensorflow.gradient_aggregation import LocalGradientAggregationHelperEager

__all__ = ["LocalGradientAggregationHelperEager"]
