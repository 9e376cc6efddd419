"""``horarun``'s elastic driver: a job that re-forms around lost workers and changing hosts.

An elastic job (``--min-np``, ``--max-np`` or ``--host-discovery-script``) trains in numbered
*rounds* (see :mod:`hora.common.job.rounds`, the protocol between this driver and the workers). The
driver:

* finds hosts: from ``--host-discovery-script`` (run every second by a thread; each output line is
  ``host`` or ``host:slots``) or from ``-H``/``--hostfile`` (then only failures change who trains).
  A host with ``n`` slots gives the worker ids ``host:0 .. host:(n-1)``; hosts keep the order in
  which they were first seen;
* starts round 0 once ``-np`` slots are available (waiting up to ``--elastic-timeout``), with every
  available slot up to ``--max-np``;
* orders each round's ranks so that rank 0 holds the freshest state: the workers that survive from
  the previous round first, in their previous rank order, host by host (a host's workers stay
  contiguous), then the new workers; a process is started only for a worker id that has none;
* on a worker of the current round ending with a non-zero status or a signal: records it in that
  round's store space (so the survivors' collectives fail at once and name it, even inside their
  ``hvd.init()``), blacklists its host (all of it; its other workers are stopped) for good, or for
  a growing cooldown with ``--blacklist-cooldown-range``, and publishes the next round; when
  blacklisting the host would leave fewer than ``--min-np`` slots (a job on one machine), only the
  worker's slot is taken out, on the same terms; a worker that asks for a new round (a collective
  failed while every process still ran) gets one with the same workers;
* on hosts added or removed (so that the round would change): publishes a host-change notice,
  then the next round; workers on removed hosts are left out and exit with status 0 themselves;
* waits up to ``--elastic-timeout`` when fewer than ``--min-np`` slots are available (``-np`` for
  round 0), saying at once and every 10 s what the hosts offer and what is missing, then stops
  the job; stops it too when every host is blacklisted, when no worker of the previous round is
  left to pass the training state on, or when the job would re-form more often than
  ``--reset-limit`` allows (every round after round 0 counts, as in Horovod);
* ends the job when a worker of the current round exits with status 0 (training finished): the
  round's other workers get ``--elastic-timeout`` seconds to finish too; horarun exits 0 when all
  of them exited 0, else 1 with a report naming the worker.

Output prefix: every worker *process* gets a number when horarun starts it (0, 1, 2, ... in
start order, so in round 0 a worker's number is its rank) and its lines are prefixed
``[<number>]<stdout>:`` / ``[<number>]<stderr>:`` for as long as it lives, whatever its rank in
later rounds; ``--output-filename DIR`` writes ``DIR/rank.<number>/``. With ``--verbose`` horarun
says which worker id (``host:slot``) each number is and logs every round; without it, it prints one

The parts, by role:

* :mod:`~hora.runner.elastic.discovery`: where hosts come from, and the thread that asks;
* :mod:`~hora.runner.elastic.blacklist`: the hosts in first-seen order, less the blacklisted ones;
* :mod:`~hora.runner.elastic.rounds`: the limits on rounds, the next round's rank order, and
  where the job is in its rounds;
* :mod:`~hora.runner.elastic.workers`: starting a worker id's process, and keeping track of them;
* :mod:`~hora.runner.elastic.driver`: the loop that forms rounds;
* :mod:`~hora.runner.elastic.report`: how the job ended, in words;
* :mod:`~hora.runner.elastic.start`: horarun's way in (first hosts, then the driver on the job
  that :mod:`hora.runner.job` built).
"""

from hora.runner.elastic.blacklist import Blacklist, HostManager, describe_hosts
from hora.runner.elastic.discovery import (
    DiscoveryError,
    HostWatcher,
    ScriptDiscovery,
    StaticDiscovery,
    parse_discovery_output,
)
from hora.runner.elastic.driver import POLL_S, RESET_GRACE_S, Driver
from hora.runner.elastic.report import job_report
from hora.runner.elastic.rounds import (
    ElasticError,
    Limits,
    describe_change,
    order_workers,
    update_flags,
)
from hora.runner.elastic.start import ElasticPlan, plan_elastic
from hora.runner.elastic.workers import Failure, Spawner

__all__ = [
    "POLL_S",
    "RESET_GRACE_S",
    "Blacklist",
    "DiscoveryError",
    "Driver",
    "ElasticError",
    "ElasticPlan",
    "Failure",
    "HostManager",
    "HostWatcher",
    "Limits",
    "ScriptDiscovery",
    "Spawner",
    "StaticDiscovery",
    "describe_change",
    "describe_hosts",
    "job_report",
    "order_workers",
    "parse_discovery_output",
    "plan_elastic",
    "update_flags",
]
