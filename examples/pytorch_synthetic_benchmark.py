"""Training throughput on synthetic data: Horovod's ``pytorch_synthetic_benchmark.py`` for hora.

Run it on two workers::

    horarun -np 2 python examples/pytorch_synthetic_benchmark.py --model resnet
    horarun -np 2 python examples/pytorch_synthetic_benchmark.py --model transformer --fp16-allreduce

Each step is a full training step (forward, backward with gradients averaged across the workers
by ``hvd.DistributedOptimizer``, optimizer update) on one batch of random data made once, so the
figures measure compute and communication, not data loading. The models are small ones so that
the benchmark runs on CPUs in seconds. With GPUs visible it runs on them, one per worker, as
Horovod's benchmark does (``--no-cuda`` keeps it on the CPU):

- ``mlp``: three linear layers on 1,024 features;
- ``resnet``: a ResNet of six basic blocks for 3x32x32 images (CIFAR-sized);
- ``transformer``: a two-layer transformer encoder classifying sequences of 64 tokens.

Rank 0 prints the throughput of every iteration and, at the end, as Horovod does::

    Img/sec per worker: 123.4 +-5.6
    Total img/sec on 2 worker(s): 246.8 +-11.2

(``samples/sec`` for the models that do not take images). The interval is 1.96 standard
deviations of the per-iteration figures; the total assumes every worker runs at rank 0's pace,
which synchronous data-parallel training enforces. ``--json PATH`` also writes these figures to a
file. ``hora bench scaling`` runs this benchmark at several world sizes and tabulates speedup and
efficiency (docs/profiling.md).

The models and the training loop live in :mod:`hora.tools.synthetic_benchmark`, so that an
installed hora can run them without this checkout; this script is its command line.
"""

from __future__ import annotations

from hora.tools.synthetic_benchmark import main

if __name__ == "__main__":
    main()
