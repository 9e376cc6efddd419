"""Live metrics published by real jobs: TensorBoard event files read back with TensorBoard's own
reader, a Prometheus endpoint scraped over HTTP while the job runs, and clear errors for
configurations that cannot work."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.processes import as_nobody, nobody_python

from .jobs import run_failing_job, run_job

STEPS = 8
BATCH = 4

pytest.importorskip("tensorboard")
pytest.importorskip("prometheus_client")


def _train(steps: int, log: bool, sharded: bool = False) -> dict[str, Any]:
    """``steps`` steps of a small model; ``sharded``: with ZeRO stage 2 (the gradients are
    reduce-scattered and the parameters allgathered, no allreduce)."""
    import torch
    import torch.nn.functional as F

    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    # Gradients of 1 KiB and less ride in the negotiation exchange; the 2 KiB weight does not.
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    shards = {"shard_optimizer_state": True, "shard_gradients": True} if sharded else {}
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        **shards,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    generator = torch.Generator().manual_seed(hvd.rank())
    x, y = torch.randn(BATCH, 8, generator=generator), torch.randint(0, 3, (BATCH,))
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if log:
            hvd.metrics.log_step(batch_size=BATCH, loss=loss)
    hvd.shutdown()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"losses": losses, "grad_bytes": grad_bytes}


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory))
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


@pytest.mark.timeout(150)
def test_a_two_rank_job_writes_tensorboard_scalars_per_rank_and_step(tmp_path: Path) -> None:
    from hora.common.metrics import METRICS

    directory = tmp_path / "metrics"
    results = run_job(_train, 2, STEPS, True, env={"HORA_METRICS": f"tensorboard:{directory}"})
    assert sorted(p.name for p in directory.iterdir()) == ["rank0", "rank1"]
    for rank, result in enumerate(results):
        scalars = _scalars(directory / f"rank{rank}")
        expected = {m.tag for m in METRICS} | {"hora/samples_per_s", "loss"}
        assert expected <= set(scalars), sorted(scalars)
        steps = list(range(1, STEPS + 1))
        for tag in expected:
            assert [step for step, _ in scalars[tag]] == steps, (tag, scalars[tag])
        value = {tag: [v for _, v in values] for tag, values in scalars.items()}
        # Every step reduces each gradient once, whether negotiated, carried in the exchange or
        # replayed in the steady state.
        assert value["hora/reduced_bytes"] == [result["grad_bytes"]] * STEPS
        assert all(t > 0 for t in value["hora/step_time_ms"])
        assert all(0 < s <= 1 for s in value["hora/comm_share"])
        assert all(c > 0 for c in value["hora/comm_time_ms"])
        overlaps = zip(value["hora/backward_overlap_ms"], value["hora/comm_time_ms"])
        assert all(0 <= o <= c + 1e-3 for o, c in overlaps)
        assert all(b >= 1 for b in value["hora/fusion_batches"])
        # Four gradients per step (and the broadcast parameters in the first).
        assert all(t >= 4 for t in value["hora/fused_tensors"])
        assert all(
            n >= 0 and s >= 0 for n, s in zip(value["hora/negotiation_ms"], value["hora/stall_ms"])
        )
        assert value["hora/negotiation_ms"][0] > 0  # the first step is negotiated
        rates = zip(value["hora/samples_per_s"], value["hora/step_time_ms"])
        assert all(r == pytest.approx(BATCH / (t / 1000), rel=1e-3) for r, t in rates)
        assert value["loss"] == pytest.approx(result["losses"], rel=1e-6)


@pytest.mark.timeout(150)
def test_sharded_gradients_count_as_reduced_bytes(tmp_path: Path) -> None:
    directory = tmp_path / "metrics"
    env = {"HORA_METRICS": f"tensorboard:{directory}"}
    results = run_job(_train, 2, STEPS, True, True, env=env)
    for rank, result in enumerate(results):
        value = [v for _, v in _scalars(directory / f"rank{rank}")["hora/reduced_bytes"]]
        # The broadcast parameters' allgather of the first step is no reduction.
        assert value == [result["grad_bytes"]] * STEPS


def _free_port_pair() -> int:
    """A port p such that p and p + 1 were free a moment ago."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports found")


SCRAPED_SCRIPT = """
import os, sys, time
from pathlib import Path
import torch
import torch.nn.functional as F
import hora.torch as hvd

hvd.init()
model = torch.nn.Linear(16, 4)
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
)
x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
for _ in range(6):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    hvd.metrics.log_step(batch_size=8, scalars={"train/loss": loss.item()})
folder = Path(sys.argv[1])
(folder / f"ready{hvd.rank()}").write_text("")
deadline = time.monotonic() + 60
while not (folder / "scraped").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
hvd.shutdown()
"""


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


@pytest.mark.timeout(150)
def test_prometheus_endpoints_are_scraped_while_the_job_runs(tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    script = tmp_path / "train.py"
    script.write_text(SCRAPED_SCRIPT)
    port = _free_port_pair()
    command = [sys.executable, "-m", "hora.runner.launch", "-np", "2"]
    command += ["--metrics", f"prometheus:{port}", sys.executable, str(script), str(tmp_path)]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
            assert job.poll() is None, job.communicate()[0]
            assert time.monotonic() < deadline, "the job did not train in time"
            time.sleep(0.05)
        for rank in (0, 1):
            # Rank r listens on PORT + its local rank.
            families = {f.name: f for f in text_string_to_metric_families(_scrape(port + rank))}
            samples = {
                (s.name, s.labels.get("name")): s
                for family in families.values()
                for s in family.samples
            }
            assert all(s.labels["rank"] == str(rank) for s in samples.values())
            assert samples[("hora_steps_total", None)].value == 6
            assert samples[("hora_samples_total", None)].value == 48
            assert samples[("hora_reduced_bytes_total", None)].value == 6 * (16 * 4 + 4) * 4
            assert samples[("hora_step_seconds_total", None)].value > 0
            assert 0 < samples[("hora_communication_share", None)].value <= 1
            assert samples[("hora_samples_per_second", None)].value > 0
            assert ("hora_scalar", "train/loss") in samples
            for name in ("fusion_batches", "fused_tensors", "negotiation_seconds"):
                assert samples[(f"hora_{name}_total", None)].value > 0, name
            assert families["hora_stall_seconds"].type == "counter"
        (tmp_path / "scraped").write_text("")
        output = job.communicate(timeout=60)[0]
        assert job.returncode == 0, output
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()


def _init_only() -> int:
    import hora.torch as hvd

    hvd.init()
    hvd.shutdown()
    return 0


def _error_text(env: dict[str, str]) -> str:
    error = run_failing_job(_init_only, 2, env=env)
    return str(error) + " ".join(str(e) for e in error.errors.values())


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("statsd:8125", "unknown sink 'statsd:8125'"),
        ("prometheus:http", "prometheus needs a port between 1 and 65535"),
        ("prometheus:70000", "prometheus needs a port between 1 and 65535"),
        ("tensorboard:", "tensorboard needs a directory"),
    ],
)
def test_a_bad_metrics_setting_fails_init_with_its_reason(spec: str, fragment: str) -> None:
    text = _error_text({"HORA_METRICS": spec})
    assert "HORA_METRICS" in text and fragment in text, text


HOLD_PORT = r"""
import socket, sys, time
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen()
print(sock.getsockname()[1], flush=True)
time.sleep(float(sys.argv[1]))
"""


def _port_held_by_another_user(hold_s: float) -> tuple[int, subprocess.Popen[str]]:
    """A port that uid nobody listens on (any user could take a job's metrics port first)."""
    if os.geteuid() != 0:
        pytest.skip("holding a port as another user needs root")
    holder = as_nobody([nobody_python(), "-c", HOLD_PORT, str(hold_s)], stdout=subprocess.PIPE)
    assert holder.stdout is not None
    return int(holder.stdout.readline()), holder


@pytest.mark.timeout(150)
def test_a_port_another_user_holds_costs_that_ranks_endpoint_not_the_job(
    capfd: pytest.CaptureFixture[str],
) -> None:
    port, holder = _port_held_by_another_user(120)
    try:
        # Rank 0 asks for the held port; rank 1 (local rank 1) for the next one.
        results = run_job(_train, 2, STEPS, True, env={"HORA_METRICS": f"prometheus:{port}"})
    finally:
        holder.kill()
        holder.wait()
    assert [len(r["losses"]) for r in results] == [STEPS, STEPS]
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "cannot serve Prometheus metrics" in line]
    assert len(said) == 1, err[-3000:]
    assert f"rank 0: cannot serve Prometheus metrics on 127.0.0.1:{port}" in said[0]
    assert "the job goes on without this rank's prometheus metrics" in said[0]
    assert "HORA_METRICS_REQUIRED=1" in said[0]


@pytest.mark.timeout(150)
def test_a_port_in_use_stops_the_job_when_metrics_are_required() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # Rank 1 (local rank 1) asks for port + 1: the taken port is rank 0's.
        text = _error_text({"HORA_METRICS": f"prometheus:{port}", "HORA_METRICS_REQUIRED": "1"})
    assert f"rank 0: cannot serve Prometheus metrics on 127.0.0.1:{port}" in text, text
    assert "the port is in use" in text, text


@pytest.mark.timeout(150)
def test_only_the_chosen_ranks_publish(tmp_path: Path) -> None:
    directory = tmp_path / "only0"
    env = {"HORA_METRICS": f"tensorboard:{directory}", "HORA_METRICS_RANKS": "0"}
    run_job(_train, 2, 3, False, env=env)
    assert [p.name for p in directory.iterdir()] == ["rank0"]
    scalars = _scalars(directory / "rank0")
    assert [step for step, _ in scalars["hora/step_time_ms"]] == [1, 2, 3]
    assert "hora/samples_per_s" not in scalars  # no batch size was reported
    assert os.listdir(directory / "rank0")[0].startswith("events.out.tfevents.")
