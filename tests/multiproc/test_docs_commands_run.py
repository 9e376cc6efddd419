"""The quick commands of the docs, run as a pip user types them, on two workers.

Each command below is looked up in the docs (tests/unit/test_docs_commands.py reads them), so it
runs as written: through ``bash``, with this Python's folder first on ``PATH`` (``horarun``,
``hora`` and ``python`` are then those of this installation, as in an activated environment).
A few get arguments appended that shorten them (``--epochs 1``), or that point a file they write
into the test's folder; argparse takes the last value. What the docs say the command prints is
checked where they show it. The scripts the docs ask the reader to write (the README's
``train.py``, launching.md's ``fail.py``) are taken from the docs too.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.unit.test_docs_commands import COMMANDS, ROOT, DocCommand, RecordProperty

BIN = Path(sys.executable).parent
COMMAND_TIMEOUT_S = 90


@dataclass(frozen=True)
class Run:
    """A command of ``doc`` to run (``text``, as the docs write it), from the repository's root
    or from the test's folder (``in_tmp``), with ``extra`` arguments appended; its output must
    match each of ``expect``."""

    doc: str
    text: str
    extra: tuple[str, ...] = ()
    expect: tuple[str, ...] = ()
    in_tmp: bool = False


def _documented(run: Run) -> DocCommand:
    for command in COMMANDS:
        if command.doc.name == run.doc and command.text == run.text:
            return command
    raise AssertionError(f"{run.doc} no longer has `{run.text}`: update this test's list")


def _snippet(doc: str, first_line: str) -> str:
    """The ```python block of ``doc`` that starts with ``first_line``."""
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / doc).read_text(), re.M | re.S)
    found = [block for block in blocks if block.startswith(first_line + "\n")]
    assert len(found) == 1, f"{doc} has no ```python block starting with {first_line!r}"
    return found[0]


def _user_env(**extra: str) -> dict[str, str]:
    """A shell of a pip user: this installation first on PATH, no launcher's variables."""
    prefixes = ("HORA_", "HOROVOD_", "OMPI_", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC_", "MV2_")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _execute(run: Run, tmp_path: Path) -> float:
    """Run ``run`` and check its output; returns the seconds it took."""
    command = _documented(run)
    line = command.text
    if run.extra:
        assert shlex.split(line) == list(command.words), f"{command}: extra for one command only"
        line += " " + shlex.join(run.extra)
    started = time.monotonic()
    result = subprocess.run(
        ["bash", "-c", line],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        cwd=tmp_path if run.in_tmp else ROOT,
        env=_user_env(),
    )
    seconds = time.monotonic() - started
    output = result.stdout + result.stderr
    shown = f"{command}\n$ {line}\nexit status {result.returncode}\n{output}"
    assert result.returncode == 0, shown
    for pattern in run.expect:
        assert re.search(pattern, output, re.M), f"no match for {pattern!r}:\n{shown}"
    return seconds


def _run_all(runs: list[Run], tmp_path: Path, record_property: RecordProperty) -> None:
    times = []
    for run in runs:
        seconds = _execute(run, tmp_path)
        times.append(f"{seconds:5.1f} s  {run.doc}: {run.text}")
    print("\n".join(["", f"docs commands run: {len(runs)}", *times]))
    record_property("docs_commands_run", len(runs))


@pytest.fixture(autouse=True)
def _installed() -> None:
    for program in ("horarun", "hora", "python"):
        if not (BIN / program).exists():
            pytest.skip(f"{program} is not installed beside {sys.executable}")


def _sample_headings() -> list[str]:
    """The section headings (``Details:``) of launching.md's sample of ``hora doctor``."""
    text = (ROOT / "docs" / "launching.md").read_text()
    sample = text.split("```bash\nhora doctor\n```\n\n```text\n", 1)[1].split("```", 1)[0]
    return [line.split(":")[0] + ":" for line in sample.splitlines() if re.match(r"^\w.*:", line)]


RUNS_IN_REPOSITORY = [
    Run(
        "training.md",
        "horarun -np 2 python examples/collectives_demo.py",
        expect=(r"^\[0\]<stdout>:", r"^\[1\]<stdout>:"),
    ),
    Run(
        "training.md",
        "horarun -np 2 python examples/pytorch_digits.py",
        extra=("--epochs", "1", "--no-progress"),
        expect=(r"^\[0\]<stdout>:final test accuracy: 0\.\d{4}$",),
    ),
    Run(
        "training.md",
        "horarun -np 2 python examples/pytorch_zero_digits.py",
        extra=("--epochs", "1"),
    ),
    Run(
        "training.md",
        "horarun -np 2 python examples/pytorch_synthetic_benchmark.py --model resnet",
        extra=("--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2"),
        expect=(r"^\[0\]<stdout>:Total img/sec on 2 worker\(s\): ",),
    ),
    Run(
        "security.md",
        'horarun -np 2 python -c "import os, hora.torch as hvd; hvd.init(); '
        "print(os.environ['HORA_RENDEZVOUS_ADDR'], len(os.environ['HORA_SECRET_KEY']))\"",
        expect=(r"^\[0\]<stdout>:127\.0\.0\.1 64$", r"^\[1\]<stdout>:127\.0\.0\.1 64$"),
    ),
    Run(
        "environment.md",
        "HOROVOD_TORUS_ALLREDUCE=1 HORA_FUSION_THRESHLD=0 horarun -np 2 python -c "
        '"import hora.torch as hvd; hvd.init()"',
        expect=(
            r"HOROVOD_TORUS_ALLREDUCE=1 has no effect: hora has no torus allreduce",
            r"HORA_FUSION_THRESHLD is not a variable hora reads; did you mean "
            r"HORA_FUSION_THRESHOLD\?",
        ),
    ),
    Run(
        "launching.md",
        "hora doctor",
        expect=(
            r"^    PASS in [\d.]+ s: every rank got 3",
            *(f"^{re.escape(heading)}" for heading in _sample_headings()),
        ),
    ),
]


@pytest.mark.timeout(300)
def test_documented_commands_run_in_the_repository(
    tmp_path: Path, record_property: RecordProperty
) -> None:
    # The benchmark's own --json default would write into the repository: none is given.
    _run_all(RUNS_IN_REPOSITORY, tmp_path, record_property)


@pytest.mark.timeout(300)
def test_documented_scripts_run_as_the_docs_tell(
    tmp_path: Path, record_property: RecordProperty
) -> None:
    # The reader's own files, as the docs give them: the README's train.py, launching.md's fail.py.
    (tmp_path / "train.py").write_text(_snippet("README.md", "# train.py"))
    (tmp_path / "fail.py").write_text(_snippet("docs/launching.md", "# fail.py"))
    (tmp_path / "sweep.py").write_text(_snippet("docs/launching.md", "# sweep.py"))
    runs = [
        Run(
            "launching.md",
            "python sweep.py",
            expect=(r"^lr 0\.1: \[0\.0934, 0\.0934\] in [\d.]+ s$", r"^lr 0\.01: \[-0\.0777, "),
            in_tmp=True,
        ),
        Run(
            "launching.md",
            "horarun -np 2 python train.py",
            expect=(r"^\[0\]<stdout>:rank 0 step 0 loss ", r"^\[1\]<stdout>:rank 1 step 40 loss "),
            in_tmp=True,
        ),
        Run(
            "profiling.md",
            "HORA_TIMELINE=timeline.json horarun -np 2 python train.py",
            in_tmp=True,
        ),
        Run("profiling.md", "hora timeline summarize timeline.json", in_tmp=True),
        Run("profiling.md", "hora timeline merge timeline.json -o job.json", in_tmp=True),
        Run(
            "launching.md",
            'horarun -np 2 python fail.py; echo "exit status $?"',
            expect=(
                r"^horarun: the job failed\.$",
                r"^rank 1 \(host localhost, pid \d+\) exited with code 1\.$",
                r"^    ValueError: corrupt batch at step 3$",
                r"^exit status 1$",
            ),
            in_tmp=True,
        ),
    ]
    _run_all(runs, tmp_path, record_property)
    assert (tmp_path / "job.json").stat().st_size > 0


@pytest.mark.timeout(120)
def test_durable_commits_resume_where_the_docs_say(
    tmp_path: Path, record_property: RecordProperty
) -> None:
    commits = ("--commit-dir", str(tmp_path / "digits-commits"))
    script = "horarun -np 2 python examples/pytorch_elastic_digits.py"
    first = f"{script} --epochs 1 --commit-dir /tmp/digits-commits"
    again = f"{script} --epochs 3 --commit-dir /tmp/digits-commits"
    runs = [
        Run("elastic.md", first, extra=commits),
        Run("elastic.md", again, extra=commits, expect=(r"resuming at epoch 2, batch 0",)),
    ]
    _run_all(runs, tmp_path, record_property)


# ---------------------------------------------------------------- an example without its extra


def _without(tmp_path: Path, package: str) -> dict[str, str]:
    """An environment in which ``import package`` fails as where it is not installed."""
    fake = tmp_path / "uninstalled" / package
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{package}'\", name={package!r})\n"
    )
    return _user_env(PYTHONPATH=str(fake.parent))


HINT = "pytorch_digits.py needs sklearn, which is not installed: pip install 'hora[examples]'"


@pytest.mark.timeout(60)
def test_an_example_without_its_extra_says_which_to_install(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "examples/pytorch_digits.py"],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=ROOT,
        env=_without(tmp_path, "sklearn"),
    )
    assert result.returncode == 1
    assert result.stderr == HINT + "\n"  # one line, no traceback


@pytest.mark.timeout(60)
def test_an_example_without_its_extra_under_horarun(tmp_path: Path) -> None:
    result = subprocess.run(
        ["horarun", "-np", "2", "python", "examples/pytorch_digits.py"],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=ROOT,
        env=_without(tmp_path, "sklearn"),
    )
    assert result.returncode == 1
    for rank in (0, 1):
        assert f"[{rank}]<stderr>:{HINT}\n" in result.stderr
    assert "Traceback" not in result.stderr
    # horarun's report quotes the failed rank's last stderr line: the hint.
    report = re.compile(r"^Last lines of rank [01]'s stderr:\n    " + re.escape(HINT) + "$", re.M)
    assert report.search(result.stderr), result.stderr
