"""Compatibility path for scripts that import ``horovod.tensorflow.mpi_ops``: the collectives are
:mod:`hora.tensorflow.ops`'s; nothing here depends on MPI.

Besides ``hora.tensorflow``'s names it gives the helpers Horovod's module defines:
``handle_average_backwards_compatibility`` (the op a call with the deprecated ``average``
argument uses) and ``check_num_rank_power_of_2`` (whether a number of ranks suits Adasum).
Horovod's handles on its compiled library (``MPI_LIB``, ``check_installed_version``,
``get_ext_suffix``) have no counterpart: hora compiles nothing.

Example:
    >>> from hora.tensorflow.mpi_ops import allgather, handle_average_backwards_compatibility
    >>> op = handle_average_backwards_compatibility(None, average=False)   # hvd.Sum
"""

from hora.common.ops.engine_facts import is_power_of_two as num_rank_is_power_2
from hora.common.ops.submission import handle_average_backwards_compatibility
from hora.tensorflow import *  # noqa: F403 - Horovod's mpi_ops holds the package's collectives
from hora.tensorflow import __all__ as _package_names

# Horovod's name for the check that Adasum's number of ranks is a power of two.
check_num_rank_power_of_2 = num_rank_is_power_2

__all__ = [
    *_package_names,
    "check_num_rank_power_of_2",
    "handle_average_backwards_compatibility",
    "num_rank_is_power_2",
]
