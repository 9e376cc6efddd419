"""Horovod's public API (hora/tools/horovod_inventory.py) against hora's modules, both ways.

Every name of the inventory is on hora's module of the same path (``hora.torch.allreduce`` for
``horovod.torch.allreduce``) unless a gap of hora/tools/horovod_gaps.py covers it; every path a
gap calls missing really is missing, and every feature a gap calls refused or different still
is (a probe per gap, below). So the table, and docs/api.md's "What is not there yet" written
from it, cannot go stale: a name that hora gains fails the test until its gap goes, and a name
that hora loses fails it until a gap says why.

The TensorFlow and Keras modules are looked at in a child process (this process never imports
TensorFlow, as tests/tensorflow's conftest explains); without TensorFlow, or without Ray, their
checks skip.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hora.tools import docs_tables, horovod_gaps, horovod_inventory
from hora.tools.horovod_gaps import GAPS

ROOT = Path(__file__).resolve().parents[2]
HAS_TENSORFLOW = importlib.util.find_spec("tensorflow") is not None
HAS_RAY = importlib.util.find_spec("ray") is not None
CHILD_TIMEOUT_S = 240

# ---------------------------------------------------------------- looking a path up on hora


def hora_path(path: str) -> str:
    """hora's dotted path for Horovod's: ``hora.torch.elastic.run`` for ``horovod.torch...``."""
    assert path == "horovod" or path.startswith("horovod."), path
    return "hora" + path.removeprefix("horovod")


def resolves(path: str) -> bool:
    """Whether hora has Horovod's ``path``, a module or a name in one, at the same path.

    Raises:
        ModuleNotFoundError: a module of hora's exists but needs a package that is missing.
    """
    parts = hora_path(path).split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            found: object = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            gone = error.name
            if gone is not None and (gone == module_name or module_name.startswith(gone + ".")):
                continue  # hora has no such module (or package above it): look in its parent
            raise
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def side(path: str) -> str:
    """Where ``path`` is looked up: "tensorflow" (a child process), "ray" or "here"."""
    top = hora_path(path).split(".")[:2]
    if top[1:] and top[1] in ("tensorflow", "keras"):
        return "tensorflow"
    if top[1:] == ["ray"]:
        return "ray"
    return "here"


def checked_paths(where: str) -> tuple[list[str], list[str]]:
    """The inventory's names that hora must have, and the gaps' paths it must not, of one side."""
    present = [p for p in horovod_inventory.paths() if not horovod_gaps.covered(p)]
    missing = [p for gap in GAPS for p in gap.missing]
    return [p for p in present if side(p) == where], [p for p in missing if side(p) == where]


def problems(where: str, found: dict[str, bool]) -> list[str]:
    """What is wrong with one side's lookups (``found``: path -> whether hora has it)."""
    present, missing = checked_paths(where)
    said = [
        f"{hora_path(p)} is missing: add it, or a gap in hora/tools/horovod_gaps.py saying why"
        for p in present
        if not found[p]
    ]
    for path in missing:
        gap = horovod_gaps.covered(path)
        if found[path] and gap is not None:
            said.append(
                f"{hora_path(path)} exists now: take {path} out of gap {gap.key!r} in "
                "hora/tools/horovod_gaps.py"
            )
    return said


# ---------------------------------------------------------------- probes of refused features
# Each returns what is wrong, or None while the gap still holds. A probe that reads hora's source
# fails when that code changes: then check whether the gap has closed.


def _adasum_gpu() -> str | None:
    from hora.common.engine import executors

    source = inspect.getsource(executors.AdasumAllreduce.execute)
    if 'device="cpu"' in source and "run.host_comm" in source:
        return None
    return "hora's Adasum executor no longer copies to host memory: is Adasum over NCCL there?"


def _ccl_ddl() -> str | None:
    import hora.torch as hvd

    if hvd.ccl_built() is False and hvd.ddl_built() is False:
        return None
    return f"ccl_built() is {hvd.ccl_built()!r}, ddl_built() is {hvd.ddl_built()!r}"


def _jsrun_lsf() -> str | None:
    from hora.runner.flags import OPTIONS

    jsrun = [option for option in OPTIONS if "--jsrun" in option.flags]
    if len(jsrun) != 1 or not jsrun[0].refused:
        return "horarun no longer refuses --jsrun"
    readers = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "hora").rglob("*.py")
        if "LSB_JOBID" in path.read_text()
    ]
    return f"{readers} read LSF's LSB_JOBID: does horarun use LSF allocations?" if readers else None


def _saved_model() -> str | None:
    bridge = (ROOT / "hora/tensorflow/_bridge.py").read_text()
    if "tf.py_function(" in bridge:
        return None
    return "hora's TensorFlow collectives are no longer tf.py_functions"


def _xla() -> str | None:  # in the TensorFlow child
    import tensorflow as tf

    import hora.tensorflow as hvd

    step = tf.function(hvd.allreduce, jit_compile=True)
    hvd.init()
    try:
        step(tf.ones(2))
    except Exception as error:
        if "cannot run inside XLA-compiled code" in str(error):
            return None
        return f"an allreduce under jit_compile=True failed otherwise: {error}"
    finally:
        hvd.shutdown()
    return "an allreduce under jit_compile=True ran: hora's collectives work in XLA now"


def _ray_elastic() -> str | None:
    from hora.ray import RayExecutor

    try:
        RayExecutor(None, min_workers=1, max_workers=2)
    except NotImplementedError:
        return None
    return "RayExecutor(min_workers=1, max_workers=2) is no longer refused"


# gap key -> (side, probe). Every gap without missing paths has one.
PROBES: dict[str, tuple[str, Callable[[], str | None]]] = {
    "adasum-gpu": ("here", _adasum_gpu),
    "ccl-ddl": ("here", _ccl_ddl),
    "jsrun-lsf": ("here", _jsrun_lsf),
    "saved-model": ("here", _saved_model),
    "xla": ("tensorflow", _xla),
    "ray-elastic": ("ray", _ray_elastic),
}


def report(where: str) -> dict[str, Any]:
    """One side's lookups and probes (the TensorFlow side runs it in a child process)."""
    present, missing = checked_paths(where)
    return {
        "found": {path: resolves(path) for path in present + missing},
        "probes": {key: probe() for key, (at, probe) in PROBES.items() if at == where},
    }


@pytest.fixture(scope="module")
def tensorflow_report() -> dict[str, Any]:
    """The TensorFlow side, checked in a child process (TensorFlow's import stays there)."""
    if not HAS_TENSORFLOW:
        pytest.skip(
            "TensorFlow is not installed in this Python: hora.tensorflow's and hora.keras's "
            "names are checked where it is (pip install -e '.[integrations]')."
        )
    code = (
        "import json\n"
        "from tests.unit.test_horovod_inventory import report\n"
        "print('INVENTORY ' + json.dumps(report('tensorflow')))\n"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=CHILD_TIMEOUT_S,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("INVENTORY ")]
    assert done.returncode == 0 and lines, f"the child failed:\n{done.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("INVENTORY "))
    return result


def _side_report(where: str, request: pytest.FixtureRequest) -> dict[str, Any]:
    if where == "tensorflow":
        tensorflow: dict[str, Any] = request.getfixturevalue("tensorflow_report")
        return tensorflow
    if where == "ray" and not HAS_RAY:
        pytest.skip("Ray is not installed: hora.ray's names are checked where it is.")
    return report(where)


# ---------------------------------------------------------------- the tests


@pytest.mark.timeout(CHILD_TIMEOUT_S + 30)
@pytest.mark.parametrize("where", ["here", "ray", "tensorflow"])
def test_hora_has_every_horovod_name_but_the_gaps(
    where: str, request: pytest.FixtureRequest
) -> None:
    said = problems(where, _side_report(where, request)["found"])
    assert not said, "\n".join(said)


@pytest.mark.timeout(CHILD_TIMEOUT_S + 30)
@pytest.mark.parametrize("where", ["here", "ray", "tensorflow"])
def test_each_refused_feature_is_still_refused(where: str, request: pytest.FixtureRequest) -> None:
    probes = _side_report(where, request)["probes"]
    said = [f"gap {key!r}: {problem}" for key, problem in probes.items() if problem]
    assert not said, "\n".join(said)


def test_every_gap_without_missing_paths_has_a_probe() -> None:
    keys = [gap.key for gap in GAPS]
    assert len(keys) == len(set(keys))
    assert set(PROBES) <= set(keys), sorted(set(PROBES) - set(keys))
    unprobed = [gap.key for gap in GAPS if not gap.missing and gap.key not in PROBES]
    assert not unprobed, f"gaps with nothing to check: {unprobed}"


def test_the_inventory_holds_public_names_only() -> None:
    modules = list(horovod_inventory.HOROVOD)
    assert modules == sorted(modules)
    for module, names in horovod_inventory.HOROVOD.items():
        assert re.fullmatch(r"horovod(\.[a-z_]+)*", module), module
        assert names, f"{module} lists no names"
        assert len(names) == len(set(names)), module
        for name in names:
            assert name.isidentifier() and not name.startswith("_"), f"{module}.{name}"


def test_each_missing_path_stands_for_names_of_the_inventory_once() -> None:
    seen: dict[str, str] = {}
    for gap in GAPS:
        assert gap.title and gap.instead and gap.why, gap.key
        for path in gap.missing:
            names = horovod_inventory.under(path)
            assert names, f"gap {gap.key!r}: {path} is no name or module of Horovod's inventory"
            for name in names:
                assert name not in seen, f"{name} is in gaps {seen[name]!r} and {gap.key!r}"
                seen[name] = gap.key


def test_the_lookup_tells_modules_names_and_absences_apart() -> None:
    assert resolves("horovod.torch")
    assert resolves("horovod.torch.allreduce")
    assert resolves("horovod.torch.elastic.TorchState")
    assert resolves("horovod.common.exceptions.HorovodInternalError")
    assert not resolves("horovod.torch.no_such_name")
    assert not resolves("horovod.no_such_package.thing")
    assert not resolves("horovod.torch.elastic.no_such_module.thing")
    assert side("horovod.keras.callbacks.MetricAverageCallback") == "tensorflow"
    assert side("horovod.ray.RayExecutor") == "ray"
    assert side("horovod.spark.run") == "here"


def test_a_gained_or_a_lost_name_is_reported() -> None:
    present, missing = checked_paths("here")
    found = {path: True for path in present + missing}
    found["horovod.torch.allreduce"] = False
    said = problems("here", found)
    assert "hora.torch.allreduce is missing: add it, or a gap" in said[0]
    assert any("hora.spark exists now: take horovod.spark out of gap 'spark'" in s for s in said)


# ---------------------------------------------------------------- the docs


def _anchors(markdown: str) -> set[str]:
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_docs_api_says_what_the_table_says() -> None:
    text = (ROOT / "docs/api.md").read_text()
    assert "api.md" in docs_tables.FILES
    section = text.split("## What is not there yet", 1)[1].split("\n## ", 1)[0]
    assert docs_tables.blocks(section) == ["horovod-gaps"]
    assert docs_tables.render(text) == text, (
        "docs/api.md is out of date: run `python -m hora.tools.docs_tables`"
    )
    total = len(horovod_inventory.paths())
    assert f"Python API has {total} public names" in section
    for gap in GAPS:
        assert gap.instead in section, gap.key


def test_the_docs_links_of_the_table_lead_somewhere() -> None:
    links = [link for _, link in horovod_gaps.ELSEWHERE]
    links += [
        link
        for gap in GAPS
        for link in re.findall(r"\]\(([^)]+\.md(?:#[^)]+)?)\)", gap.instead + gap.why)
    ]
    for link in links:
        name, _, anchor = link.partition("#")
        target = ROOT / "docs" / name
        assert target.is_file(), link
        if anchor:
            assert anchor in _anchors(target.read_text()), link
