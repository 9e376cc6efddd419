"""``HoraEnvironment``: Lightning's view of the job, read from hora's own topology.

Lightning asks a *cluster environment* for the world size and this process's ranks. This one
answers with what hora decided: the launcher's variables as :func:`hora.common.job.topology.detect`
reads them (``horarun`` and ``hora.run``, and also torchrun, ``mpirun``/``mpiexec`` and ``srun``)
until ``hvd.init()`` has run, and hora's running topology afterwards. Lightning and hora therefore
never disagree on who is rank 0, whichever launcher started the job.
"""

from __future__ import annotations

import logging
import os

from hora.common import api
from hora.common.job.topology import Topology, detect
from hora.common.vocabulary import settings_table as table
from hora.common.vocabulary.config import is_set
from hora.lightning._compat import ClusterEnvironment, find_free_network_port

log = logging.getLogger(__name__)


class HoraEnvironment(ClusterEnvironment):
    """The processes of a hora job, as Lightning's ``ClusterEnvironment``.

    Processes are always created outside Lightning (by ``horarun``, ``hora.run``, ``mpirun``,
    ``srun`` or torchrun): one process per device. :meth:`detect` recognises a job started by
    ``horarun`` or ``hora.run`` (``HORA_RANK`` or ``HOROVOD_RANK`` is set); it stays ``False``
    under other launchers so that Lightning's own environments keep theirs, but
    :class:`~hora.lightning.HoraStrategy` uses this environment under every launcher.

    ``node_rank`` is hora's cross rank: the index of this host among the hosts of the job.

    Example:
        >>> from hora.lightning import HoraEnvironment, HoraStrategy
        >>> trainer = Trainer(strategy=HoraStrategy(cluster_environment=HoraEnvironment()))
    """

    def __init__(self) -> None:
        super().__init__()
        self._launch: Topology | None = None
        self._main_port = -1

    def _topology(self) -> Topology:
        if api.is_initialized():
            return api.topology()
        if self._launch is None:
            self._launch = detect()
        return self._launch

    @property
    def creates_processes_externally(self) -> bool:
        """Always ``True``: the launcher starts every process, Lightning starts none."""
        return True

    @property
    def main_address(self) -> str:
        """``MASTER_ADDR`` if set, else the address of hora's rendezvous (hora itself uses
        neither: it does not initialise ``torch.distributed``)."""
        return os.environ.get("MASTER_ADDR") or self._topology().rendezvous_addr or "127.0.0.1"

    @property
    def main_port(self) -> int:
        """``MASTER_PORT`` if set, else a free local port (never hora's own rendezvous port)."""
        if self._main_port == -1:
            port = os.environ.get("MASTER_PORT")
            self._main_port = int(port) if port else find_free_network_port()
        return self._main_port

    @staticmethod
    def detect() -> bool:
        """Whether ``horarun`` or ``hora.run`` started this process."""
        return is_set(table.RANK)

    def world_size(self) -> int:
        return self._topology().size

    def set_world_size(self, size: int) -> None:
        if size != self.world_size():
            log.debug("HoraEnvironment: ignoring world size %d (the launcher's is used)", size)

    def global_rank(self) -> int:
        return self._topology().rank

    def set_global_rank(self, rank: int) -> None:
        if rank != self.global_rank():
            log.debug("HoraEnvironment: ignoring global rank %d (the launcher's is used)", rank)

    def local_rank(self) -> int:
        return self._topology().local_rank

    def node_rank(self) -> int:
        return self._topology().cross_rank

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
