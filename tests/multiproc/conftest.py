"""Multi-process tests: worker functions defined here travel to the workers by value.

``hora.run`` pickles the worker function with cloudpickle. Functions of an importable module are
normally pickled by reference, which would make every worker import this test package; pytest
puts it on ``sys.path`` only in its own process. Registering the package pickles its functions
(and the helpers they call) by value instead.
"""

from __future__ import annotations

import sys

import cloudpickle

_package = sys.modules.get(__name__.rpartition(".")[0])
if _package is not None:
    cloudpickle.register_pickle_by_value(_package)
