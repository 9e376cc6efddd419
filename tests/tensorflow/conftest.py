"""TensorFlow and Keras tests: real jobs (``hora.run``), each worker importing TensorFlow.

The test process itself never imports TensorFlow (the workers do, with their own environment:
``TF_USE_LEGACY_KERAS`` must be set before TensorFlow is imported). Without TensorFlow in this
Python, every test here is skipped. Worker functions travel to the workers by value, as in
tests/multiproc.
"""

from __future__ import annotations

import importlib.util
import sys

import cloudpickle
import pytest

_package = sys.modules.get(__name__.rpartition(".")[0])
if _package is not None:
    cloudpickle.register_pickle_by_value(_package)

HAS_TENSORFLOW = importlib.util.find_spec("tensorflow") is not None
HAS_TF_KERAS = importlib.util.find_spec("tf_keras") is not None


NO_TENSORFLOW = (
    "TensorFlow is not installed in this Python: hora.tensorflow's tests need it "
    "(pip install -e '.[integrations]', which brings tf-keras too; ./dev test installs it)."
)


# Session scope: it runs before any module-scoped fixture that would start a job.
@pytest.fixture(scope="session", autouse=True)
def _needs_tensorflow() -> None:
    if not HAS_TENSORFLOW:
        pytest.skip(NO_TENSORFLOW)
