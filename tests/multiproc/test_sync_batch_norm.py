"""SyncBatchNorm on real processes: N ranks, each with a slice of a batch, behave as one process
running torch.nn.BatchNorm*d on the whole batch.

Each worker rebuilds every rank's inputs from a seed, runs the reference locally on their
concatenation and reports, per case and per quantity, the largest difference it saw: outputs,
input gradients, parameter gradients summed over the ranks, running statistics, eval outputs.
"""

from __future__ import annotations

from typing import Any

import pytest

from .jobs import assert_raised, error_of, run_job

STEPS = 3
LR = 0.01

# name: (model layout, input shape after (N,), dtype name, per-rank batch sizes, tolerance)
# Layouts are built twice by _model: with SyncBatchNorm and with torch.nn.BatchNorm{1,2}d.
CASES: dict[str, tuple[str, tuple[int, ...], str, str, float]] = {
    "nchw_two_layers": ("two_bn2d", (3, 4, 5), "float64", "uneven", 1e-11),
    "nchw_float32": ("two_bn2d", (3, 4, 5), "float32", "uneven", 5e-5),
    "nc_cumulative_momentum": ("bn1d_cumulative", (6,), "float64", "uneven", 1e-11),
    "nc_one_rank_empty": ("bn1d", (6,), "float64", "first_empty", 1e-11),
    "ncl_no_affine": ("bn1d_no_affine", (4, 7), "float64", "uneven", 1e-11),
    "nchw_no_running_stats": ("bn2d_no_running_stats", (3, 2, 2), "float64", "even", 1e-11),
}


def _model(layout: str, sync: bool, process_set: Any) -> Any:
    import torch

    import hora.torch as hvd

    def bn(channels: int, dims: int, **kwargs: Any) -> Any:
        if sync:
            return hvd.SyncBatchNorm(channels, process_set=process_set, **kwargs)
        return (torch.nn.BatchNorm1d if dims == 1 else torch.nn.BatchNorm2d)(channels, **kwargs)

    torch.manual_seed(11)  # the same conv weights and affine parameters for both models
    if layout == "two_bn2d":
        # Two layers with the same C: they share collective names, call after call.
        model = torch.nn.Sequential(bn(3, 2), torch.nn.Conv2d(3, 3, 1), torch.nn.Tanh(), bn(3, 2))
    elif layout == "bn1d_cumulative":
        model = torch.nn.Sequential(bn(6, 1, momentum=None))
    elif layout == "bn1d":
        model = torch.nn.Sequential(bn(6, 1, momentum=0.3))
    elif layout == "bn1d_no_affine":
        model = torch.nn.Sequential(bn(4, 1, affine=False))
    elif layout == "bn2d_no_running_stats":
        model = torch.nn.Sequential(bn(3, 2, track_running_stats=False))
    else:
        raise ValueError(layout)
    with torch.no_grad():
        for module in model:
            if getattr(module, "affine", False):
                module.weight.uniform_(0.5, 2.0)
                module.bias.uniform_(-1.0, 1.0)
    return model


def _batch_sizes(kind: str, members: int) -> list[int]:
    if kind == "uneven":
        return [2 + i for i in range(members)]
    if kind == "first_empty" and members > 1:
        return [0] + [3] * (members - 1)
    return [3] * members


def _diff(a: Any, b: Any) -> float:
    """Largest difference, relative to the reference's magnitude when that is above 1."""
    if a.numel() == 0 and b.numel() == 0:
        return 0.0
    if a.isnan().any() or b.isnan().any():
        return float("inf")
    scale = max(1.0, b.abs().max().item())
    return (a.double() - b.double()).abs().max().item() / scale


def _run_case(name: str, process_set: Any, device: str) -> dict[str, float]:
    """Train SyncBatchNorm and the one-process reference side by side; return the differences."""
    import torch

    import hora.torch as hvd

    layout, tail, dtype_name, sizes_kind, _ = CASES[name]
    dtype = getattr(torch, dtype_name)
    members = process_set.ranks
    me = members.index(hvd.rank())
    sizes = _batch_sizes(sizes_kind, len(members))
    mine = slice(sum(sizes[:me]), sum(sizes[: me + 1]))
    model = _model(layout, True, process_set).to(device=device, dtype=dtype)
    reference = _model(layout, False, process_set).to(device=device, dtype=dtype)
    data = torch.Generator().manual_seed(5)
    diffs: dict[str, float] = {}

    def note(quantity: str, value: float) -> None:
        key = f"{name}/{quantity}"
        diffs[key] = max(diffs.get(key, 0.0), value)

    def batch() -> tuple[Any, Any]:
        x = torch.randn((sum(sizes), *tail), generator=data, dtype=torch.float64) * 3 + 50
        weights = torch.randn(x.shape, generator=data, dtype=torch.float64)
        return x.to(device=device, dtype=dtype), weights.to(device=device, dtype=dtype)

    for _ in range(STEPS):
        x, loss_weights = batch()
        x_mine = x[mine].clone().requires_grad_()
        x_all = x.clone().requires_grad_()
        out = model(x_mine)
        expected = reference(x_all)
        # A sum loss: every element's dy is the same on the ranks as in the reference.
        (out * loss_weights[mine]).sum().backward()
        (expected * loss_weights).sum().backward()
        note("output", _diff(out, expected[mine]))
        note("input_grad", _diff(x_mine.grad, x_all.grad[mine]))
        with torch.no_grad():
            for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
                summed = hvd.allreduce(
                    p.grad, op=hvd.Sum, name=f"sbn_test.{name}.{pname}", process_set=process_set
                )
                note(f"summed_grad.{pname}", _diff(summed, q.grad))
                p -= LR * summed
                q -= LR * q.grad
        model.zero_grad()
        reference.zero_grad()

    for (bname, b), c in zip(model.named_buffers(), reference.buffers()):
        note(f"buffer.{bname}", _diff(b, c))

    model.eval()
    reference.eval()
    x, _ = batch()
    with torch.no_grad():
        note("eval_output", _diff(model(x[mine]), reference(x)[mine]))
    return diffs


def _sync_batch_norm_checks(device: str) -> dict[str, Any]:
    import torch

    import hora.torch as hvd

    hvd.init(process_sets="dynamic")
    subset = hvd.add_process_set([0, 2]) if hvd.size() >= 3 else None
    diffs: dict[str, Any] = {}
    for name in CASES:
        diffs.update(_run_case(name, hvd.global_process_set, device))
    if subset is not None and subset.included():
        sub = _run_case("nchw_two_layers", subset, device)
        diffs.update({f"subset_{key}": value for key, value in sub.items()})

    # Eval mode with running statistics is local: only rank 0 calls it, and it must not wait.
    if hvd.rank() == 0:
        layer = hvd.SyncBatchNorm(4).to(device).eval()
        x = torch.randn(5, 4, device=device)
        plain = torch.nn.BatchNorm1d(4).to(device).eval()
        diffs["eval_local/output"] = _diff(layer(x), plain(x))
    hvd.barrier()

    errors = {
        "one_dim": error_of(lambda: hvd.SyncBatchNorm(3)(torch.randn(3, device=device))),
        # One value per channel over the whole job: every rank raises, as torch does for N=1.
        "one_value": error_of(
            lambda: hvd.SyncBatchNorm(3).to(device)(
                torch.randn(1 if hvd.rank() == 0 else 0, 3, device=device)
            )
        ),
    }
    return {"diffs": diffs, "errors": errors, "size": hvd.size()}


def _tolerance(key: str) -> float:
    case = key.removeprefix("subset_").split("/")[0]
    return CASES[case][4] if case in CASES else 1e-11


def _check(results: list[dict[str, Any]], exact: bool = False) -> None:
    for rank, result in enumerate(results):
        diffs = result["diffs"]
        missing = [case for case in CASES if f"{case}/input_grad" not in diffs]
        assert not missing, f"rank {rank} did not run {missing}"
        too_far = {
            key: value
            for key, value in diffs.items()
            if value > (0.0 if exact else _tolerance(key))
        }
        assert not too_far, f"rank {rank} differs from torch.nn.BatchNorm: {too_far}"
        assert_raised(result["errors"]["one_dim"], ValueError, "expected at least 2D input")
        assert_raised(
            result["errors"]["one_value"],
            ValueError,
            "Expected more than 1 value per channel when training",
        )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_sync_batch_norm_matches_batch_norm_on_the_whole_batch(np: int) -> None:
    results = run_job(_sync_batch_norm_checks, np, "cpu")
    _check(results)
    if np == 3:
        assert any(key.startswith("subset_") for key in results[0]["diffs"])
        assert not any(key.startswith("subset_") for key in results[1]["diffs"])


@pytest.mark.timeout(120)
def test_sync_batch_norm_in_a_job_of_one_is_batch_norm() -> None:
    # size() == 1 runs torch's own batch norm, so every result is bit-for-bit the reference's.
    results = run_job(_sync_batch_norm_checks, 1, "cpu")
    assert results[0]["size"] == 1
    _check(results, exact=True)


@pytest.mark.timeout(120)
def test_sync_batch_norm_on_cuda() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _check(run_job(_sync_batch_norm_checks, 2, "cuda"))


def test_sync_batch_norm_is_exported() -> None:
    from torch.nn.modules.batchnorm import _BatchNorm

    import hora.torch as hvd

    assert "SyncBatchNorm" in hvd.__all__
    assert issubclass(hvd.SyncBatchNorm, _BatchNorm)
    layer = hvd.SyncBatchNorm(5)
    assert (layer.eps, layer.momentum, layer.affine, layer.track_running_stats) == (
        1e-5,
        0.1,
        True,
        True,
    )
    assert layer.process_set is hvd.global_process_set
