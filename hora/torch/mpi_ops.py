"""Compatibility re-export of Horovod's ``horovod.torch.mpi_ops`` names."""

from hora.common.basics import is_homogeneous  # noqa: F401
from hora.torch import *  # noqa: F403
from hora.torch import __all__  # noqa: F401
