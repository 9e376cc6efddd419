"""A missing optional package is one line that names the extra to install, with no chained
traceback: MPI, Ray, Lightning, TensorFlow and Keras, the plots of ``hora timeline plot`` and
``hora bench scaling``. (Live metrics' sinks: tests/unit/test_metrics.py.)

``None`` in ``sys.modules`` makes ``import`` fail as for a package that is not installed.
"""

from __future__ import annotations

import importlib
import io
import sys
from pathlib import Path
from typing import Any

import pytest

from hora.common.transport import TransportError
from hora.tools import scaling
from hora.tools.scaling import StudySettings
from hora.tools.scaling_table import Measurement

pytestmark = pytest.mark.timeout(60)


def _uninstalled(monkeypatch: pytest.MonkeyPatch, *packages: str) -> None:
    """Import of each package fails, as where it is not installed."""
    for package in packages:
        for name in [n for n in sys.modules if n.startswith(package + ".")]:
            monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.setitem(sys.modules, package, None)


def _forget(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """The next import of ``package`` runs its modules again (put back when the test ends)."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)


def _is_one_line(error: BaseException) -> bool:
    """One line, and nothing chained that Python would print above it."""
    context_shown = error.__context__ is not None and not error.__suppress_context__
    return "\n" not in str(error) and error.__cause__ is None and not context_shown


def test_mpi_without_mpi4py_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # HORA_CPU_OPERATIONS=mpi and hvd.init(comm=...) say this, after what asked for MPI.
    from hora.common.transport.mpi import import_mpi

    _uninstalled(monkeypatch, "mpi4py")
    with pytest.raises(
        TransportError, match=r"MPI is not available .*pip install 'hora\[mpi\]'"
    ) as err:
        import_mpi()
    assert _is_one_line(err.value), err.value


def test_hora_ray_without_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    _forget(monkeypatch, "hora.ray")
    _uninstalled(monkeypatch, "ray")
    with pytest.raises(ImportError, match=r"hora\.ray needs Ray.*pip install 'hora\[ray\]'") as err:
        importlib.import_module("hora.ray")
    assert _is_one_line(err.value), err.value


def test_hora_lightning_without_lightning_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    _forget(monkeypatch, "hora.lightning")
    _uninstalled(monkeypatch, "lightning", "pytorch_lightning")
    with pytest.raises(ImportError, match=r"pip install 'hora\[lightning\]'") as err:
        importlib.import_module("hora.lightning")
    assert _is_one_line(err.value), err.value


@pytest.mark.parametrize("module", ["hora.tensorflow", "hora.tensorflow.keras", "hora.keras"])
def test_tensorflow_apis_without_tensorflow_name_the_extra(
    monkeypatch: pytest.MonkeyPatch, module: str
) -> None:
    _forget(monkeypatch, "hora.tensorflow")
    _forget(monkeypatch, "hora.keras")
    _uninstalled(monkeypatch, "tensorflow")
    with pytest.raises(
        ImportError, match=r"needs? TensorFlow.*pip install 'hora\[tensorflow\]'"
    ) as err:
        importlib.import_module(module)
    assert _is_one_line(err.value), err.value


def test_a_scaling_study_without_matplotlib_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def measure(job: scaling.Job, settings: StudySettings, on_output: Any) -> Measurement:
        return Measurement(
            model=job.model,
            unit="img",
            workers=job.workers,
            batch_size=32,
            batches_per_iter=8,
            seconds_per_iter=1.0,
            throughput_total=256.0 * job.workers,
            throughput_total_ci95=1.0,
        )

    monkeypatch.setattr(scaling, "run_job", measure)  # no benchmark jobs: only the report
    _uninstalled(monkeypatch, "matplotlib")
    out = io.StringIO()
    settings = StudySettings(
        world_sizes=(1, 2), output_dir=tmp_path, timeline=False, progress=False
    )
    assert len(scaling.run_study(settings, out)) == 2
    notes = [line for line in out.getvalue().splitlines() if "matplotlib" in line]
    assert notes == [
        "No scaling.png: matplotlib is not installed. Install it (pip install 'hora[plot]') and "
        "run the study again for the plot."
    ]
    assert (tmp_path / "scaling.csv").exists() and not (tmp_path / "scaling.png").exists()
