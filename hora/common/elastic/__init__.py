"""Elastic training's framework-neutral half: the state protocol (``State``, ``ObjectState``,
the all-or-nothing commit), durable commits on disk, and ``run``, the loop that survives the
job's changes. ``hora.torch.elastic`` and ``hora.tensorflow.elastic`` add their frameworks'
objects (models, optimizers, samplers, variables) and are what users import as
``hvd.elastic``; docs/elastic.md describes the whole.
"""
