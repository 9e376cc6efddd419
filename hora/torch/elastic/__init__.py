"""Elastic training: ``hvd.elastic``, Horovod's elastic worker API.

An elastic job (``horarun --min-np 2 --max-np 8 --host-discovery-script ./hosts.sh python
train.py``) keeps training when workers are lost or hosts come and go. The job runs in
*rounds*; each change ends the round, and the workers that remain, with any new ones, form the
next. The training function, decorated with :func:`run`, is restarted in every round from a
:class:`State` that all workers share: rank 0's, as of the last ``commit()`` when a collective
failed, or as it was when hosts changed.

Usage::

    import torch
    import hora.torch as hvd

    hvd.init()
    model = Net()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
        named_parameters=model.named_parameters(),
    )
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)

    # No collective here (not even broadcast_parameters): run() synchronizes the state.

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, 10):
            batches = iter(loader)      # only the epoch's samples not yet processed
            for _ in range(sampler.num_batches(32)):    # the same count on every rank
                batch = next(batches, None)  # None: this rank's share is used up
                optimizer.zero_grad()
                if batch is not None:
                    x, y = batch
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()        # without a backward pass: contributes zeros
                sampler.record_batch(state.batch, 32)
                state.batch += 1
                if state.batch % 10 == 0:
                    state.commit()              # save + check_host_updates()
                else:
                    state.check_host_updates()  # cheap: one tiny allreduce
            state.batch = 0
            sampler.set_epoch(state.epoch + 1)  # at the END of the epoch
            state.commit()

    def rescale_lr():
        for group in optimizer.param_groups:
            group["lr"] = 0.01 * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
    state.register_reset_callbacks([rescale_lr])
    train(state)

Outside an elastic job the same script runs as an ordinary one: ``run`` synchronizes the state
once and calls the function; ``commit()`` only saves and ``check_host_updates()`` does nothing.

Public API:

* :func:`run` - the decorator; :func:`reset_count` - resets so far in this process;
  :func:`round_number` - the job's current round (0 for the first).
* :class:`State`, :class:`ObjectState`, :class:`TorchState` - the state protocol and its
  implementations; :class:`StateHandler` and :func:`get_handler_registry` /
  :func:`set_handler_registry` - how ``TorchState`` keeps models, optimizers, samplers.
* :class:`ElasticSampler` - sharding that resumes mid-epoch with any number of ranks.
* Durable commits: ``TorchState(..., commit_dir=...)`` (or ``HORA_ELASTIC_COMMIT_DIR``) also
  writes every commit to disk, atomically, and a restarted job resumes from it;
  :func:`read_commit` reads one; :class:`DurableCommitError` - it could not be written or read.
* ``HoraInternalError`` (alias ``HorovodInternalError``), ``HostsUpdatedInterrupt`` - the
  exceptions ``run`` handles (the same classes as ``hvd.HoraInternalError`` etc.).

Semantics worth knowing (see each object's documentation):

* ``hvd.elastic.run`` always synchronizes after a reset; ``HostsUpdatedInterrupt.skip_sync``
  is kept for compatibility and ignored (Horovod issue #3494).
* :class:`ElasticSampler` pads as Horovod's does: every rank gets the same number of samples
  (at most ``size - 1`` are repeated), so a plain ``for batch in loader`` stays in step, and no
  sample is skipped across resets. With ``pad=False`` no sample is repeated either, but ranks
  may get one sample, so one batch, more than others: the loop above, which runs
  ``num_batches`` steps on every rank, suits both (the alternative, ``hvd.join(); state.commit();
  state.sync()`` after the epoch, is described in :mod:`hora.torch.elastic.sampler`).
* A commit is all-or-nothing: when ``commit()`` raises, the previous commit is kept whole.
* Everything ``run`` does is collective and named identically on every worker; a worker that
  joins a running job must reach the decorated function without other collectives first.
"""

from hora.common.api import init, shutdown  # horovod.torch.elastic has them too
from hora.common.elastic.durable import DurableCommitError, read_commit
from hora.common.elastic.loop import reset_count, round_number, run, run_fn
from hora.common.elastic.state import ObjectState, State
from hora.common.vocabulary.errors import (
    HoraInternalError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
)
from hora.torch.elastic.sampler import ElasticSampler
from hora.torch.elastic.torch_state import (
    ModelStateHandler,
    OptimizerStateHandler,
    SamplerStateHandler,
    StateHandler,
    TorchState,
    get_handler_registry,
    set_handler_registry,
)

__all__ = [
    "DurableCommitError",
    "ElasticSampler",
    "HoraInternalError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ModelStateHandler",
    "ObjectState",
    "OptimizerStateHandler",
    "SamplerStateHandler",
    "State",
    "StateHandler",
    "TorchState",
    "get_handler_registry",
    "init",
    "read_commit",
    "reset_count",
    "round_number",
    "run",
    "run_fn",
    "set_handler_registry",
    "shutdown",
]
