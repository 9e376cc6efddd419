"""Elastic training's framework-neutral half: the state protocol (``State``, ``ObjectState``,
the all-or-nothing commit), durable commits on disk, and ``run``, the loop that survives the
job's changes. ``hora.torch.elastic`` and ``hora.tensorflow.elastic`` add their frameworks'
objects (models, optimizers, samplers, variables) and are what users import as
``hvd.elastic``; docs/elastic.md describes the whole.

The package gives Horovod's ``horovod.common.elastic`` names: ``State``, ``ObjectState`` and
``run_fn`` (the loop with a reset of one's own), and ``run`` with hora's reset.
"""

from hora.common.elastic.loop import run, run_fn
from hora.common.elastic.state import ObjectState, State
from hora.common.vocabulary.errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = [
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "run",
    "run_fn",
]
