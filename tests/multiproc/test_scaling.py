"""``hora bench scaling`` end to end: real jobs through horarun, the table, the CSV and the plot."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hora.tools import timeline
from hora.tools.scaling_table import CSV_COLUMNS
from tests.processes import job_processes, kill_all, survivors

HORA = [sys.executable, "-m", "hora"]
TINY = ["--batch-size", "8", "--num-iters", "2", "--num-batches-per-iter", "2", "--warmup", "1"]


def _study(out: Path, *flags: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    command = [*HORA, "bench", "scaling", *flags, "--output-dir", str(out)]
    # From another folder than the checkout: the study must find its benchmark by itself.
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=out.parent)


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One study of the mlp at np 1 and 2: (its output folder, its stdout)."""
    out = tmp_path_factory.mktemp("study") / "results"
    result = _study(out, "--np", "1,2", "--model", "mlp", *TINY)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return out, result.stdout


def _csv(out: Path) -> list[dict[str, str]]:
    with (out / "scaling.csv").open(newline="") as file:
        reader = csv.DictReader(file)
        assert tuple(reader.fieldnames or ()) == CSV_COLUMNS
        return list(reader)


@pytest.mark.timeout(150)
def test_the_csv_has_a_row_per_world_size_with_the_jobs_figures(
    study: tuple[Path, str],
) -> None:
    out, _ = study
    rows = _csv(out)
    assert [(r["model"], r["unit"], int(r["workers"])) for r in rows] == [
        ("mlp", "samples", 1),
        ("mlp", "samples", 2),
    ]
    for row in rows:
        for column in ("seconds_per_iter", "batch_time_ms", "throughput_total", "speedup"):
            assert float(row[column]) > 0, row
        assert (int(row["batch_size"]), int(row["batches_per_iter"])) == (8, 2)
        # The figures are those the job's rank 0 wrote.
        result = json.loads((out / f"mlp-np{row['workers']}.result.json").read_text())
        assert result["workers"] == int(row["workers"])
        assert int(row["threads_per_worker"]) == result["threads_per_worker"] >= 1
        assert float(row["throughput_total"]) == pytest.approx(result["rate_total_mean"], abs=1e-3)
        per_worker = float(row["throughput_total"]) / int(row["workers"])
        assert float(row["throughput_per_worker"]) == pytest.approx(per_worker, abs=1e-3)
    one, two = rows
    assert float(one["speedup"]) == 1.0
    assert float(one["efficiency_percent"]) == 100.0
    # From the unrounded figures the jobs wrote: the CSV rounds its columns independently.
    totals = [
        json.loads((out / f"mlp-np{n}.result.json").read_text())["rate_total_mean"] for n in (1, 2)
    ]
    speedup = totals[1] / totals[0]
    assert float(two["speedup"]) == pytest.approx(speedup, abs=1e-4)
    assert float(two["efficiency_percent"]) == pytest.approx(100 * speedup / 2, abs=0.01)


@pytest.mark.timeout(150)
def test_the_communication_share_comes_from_each_jobs_timeline(study: tuple[Path, str]) -> None:
    out, _ = study
    for row in _csv(out):
        path = out / f"mlp-np{row['workers']}.timeline.json"
        summary = timeline.summarize(timeline.load(path))
        assert summary.comm_share is not None, summary.warnings
        assert summary.ranks == list(range(int(row["workers"])))
        share = float(row["communication_share_percent"])
        assert share == pytest.approx(100 * summary.comm_share, abs=0.01)
        assert 0 <= share <= 100
    # Two workers average their gradients over Gloo: that takes time.
    assert float(_csv(out)[1]["communication_share_percent"]) > 0


@pytest.mark.timeout(150)
def test_the_table_on_stdout_shows_the_jobs_figures(study: tuple[Path, str]) -> None:
    out, stdout = study
    lines = {line.split()[1]: line.split() for line in stdout.splitlines() if line[:4] == "mlp "}
    assert sorted(lines) == ["1", "2"], stdout
    results = {str(n): json.loads((out / f"mlp-np{n}.result.json").read_text()) for n in (1, 2)}
    for workers, cells in lines.items():
        result = results[workers]
        assert cells[2] == str(result["threads_per_worker"]), stdout
        assert cells[5] == f"{result['rate_total_mean']:.1f}", stdout
        assert cells[6] == f"±{result['rate_total_interval']:.1f}", stdout
    speedup = results["2"]["rate_total_mean"] / results["1"]["rate_total_mean"]
    assert lines["2"][-3:-1] == [f"{speedup:.2f}x", f"{100.0 * (speedup / 2.0):.1f}%"], stdout
    assert lines["1"][-3:-1] == ["1.00x", "100.0%"]
    assert f"Wrote {out / 'scaling.csv'}" in stdout
    assert f"Wrote {out / 'scaling.png'}" in stdout


@pytest.mark.timeout(150)
def test_the_plot_is_a_png_image_with_content(study: tuple[Path, str]) -> None:
    import matplotlib.image

    out, _ = study
    path = out / "scaling.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(path)
    height, width = pixels.shape[:2]
    assert width > 800 and height > 300
    assert pixels[..., :3].std() > 0.05  # lines and text, not a blank canvas


@pytest.mark.timeout(60)
def test_a_failed_job_stops_the_study_naming_model_np_and_output(tmp_path: Path) -> None:
    out = tmp_path / "results"
    # horarun refuses the job: two workers cannot run on one slot.
    result = _study(out, "--np", "2,4", "--model", "mlp", "-H", "localhost:1", *TINY, timeout=50)
    assert result.returncode == 1
    assert "the mlp job at np=2 failed (horarun exited with 2)" in result.stderr
    assert "np=4" not in result.stderr  # the study stopped at the first failure
    assert "horarun: -np 2 needs 2 slots but the hosts provide 1" in result.stderr
    assert f"Its whole output is in {out / 'mlp-np2.log'}" in result.stderr
    assert not (out / "scaling.csv").exists()
    assert "--hostfile" not in (out / "mlp-np2.log").read_text().splitlines()[0]
    assert "-H localhost:1" in (out / "mlp-np2.log").read_text().splitlines()[0]


@pytest.mark.timeout(90)
def test_a_job_past_its_timeout_is_stopped_with_its_workers(tmp_path: Path) -> None:
    out = tmp_path / "results"
    try:
        result = _study(out, "--np", "2", "--model", "mlp", *TINY, "--job-timeout", "2", timeout=60)
        assert result.returncode == 1, result.stdout
        assert "the mlp job at np=2 ran past --job-timeout 2 s" in result.stderr
        assert "Raise --job-timeout" in result.stderr
        # Every process of the job carries the output folder in its command line.
        assert survivors(job_processes(str(tmp_path)), timeout_s=20) == []
    finally:
        kill_all(str(tmp_path))
