"""Compatibility re-export of Horovod's ``horovod.tensorflow.mpi_ops`` names: the collectives
are :mod:`hora.tensorflow.ops`'s; nothing here depends on MPI."""

from hora.common.basics import is_homogeneous  # noqa: F401
from hora.tensorflow import *  # noqa: F403
from hora.tensorflow import __all__  # noqa: F401
