"""Scaling on an emulated CPU cluster: hora (hierarchical, flat, under ``horarun --mpi``) against
PyTorch DDP over Gloo, across hosts whose links are shaped with ``tc``.

One command runs the whole study (root: it makes network namespaces, see
:mod:`hora.tools.cluster`)::

    python benchmarks/cluster_scaling.py [--quick] [--rates 1gbit 10gbit] [--docs]

For each link rate it starts an emulated cluster (4 hosts, each link shaped to the rate in both
directions) and, for each layout (hosts x ranks: 1x2, 2x1, 2x2, 4x1), runs these jobs:

- ``hora``: hora on its default path (hierarchical where every host runs several ranks) and,
  beside it in the same job, DDP on a Gloo group of the same ranks: allreduce bus bandwidth
  (hora and raw ``torch.distributed.all_reduce``) and training throughput of the three models
  of benchmarks/training.py, each trained one rank alone (``single``), with DDP and with hora;
- ``fp16`` and ``bf16``: the same models trained with DDP and with hora's ``Compression.fp16``
  (or ``Compression.bf16``), in jobs of their own (see :data:`COMPRESSIONS`), chosen as a user
  of a cluster would without changing the script: ``horarun --gradient-compression fp16``;
- ``flat`` (layouts with several ranks on each of several hosts): the same for hora with
  ``HORA_HIERARCHICAL_ALLREDUCE=0``, one Gloo group of every rank;
- ``mpi`` (layouts across hosts, when ``mpirun`` and mpi4py are there): hora under
  ``horarun --mpi`` (Open MPI over TCP between hosts, shared memory within).

Within a job, calls and training steps are timed in blocks that alternate between the modes
(A B C C B A ...), each block after a barrier; a time is the slowest rank's, and figures are
medians with the range of the blocks' medians. Every process uses one thread. The 1x2 layout
does not cross a link and runs once. Rank 0 of each job writes its figures as JSON; the driver
prints the tables and writes ``cluster_scaling.json`` and ``cluster_scaling.png`` (``--docs``:
docs/images/cluster_scaling.png and docs/cluster_scaling.json).

Bus bandwidth is ``S / t * 2 (n - 1) / n`` for ``S`` bytes on ``n`` ranks. The link bound of an
allreduce across ``H`` hosts is the time each host's link needs for the bytes it must send:
``t_link = 2 (H - 1) / H * S / R`` with ``R`` the link's rate in bytes per second (125 MB/s at
1 Gbit/s): after the ranks of a host have reduced among themselves, every host still holds ``S``
bytes that the others need, and no allreduce gets by with less traffic per host. ``link %`` is
``t_link / t``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

KIB, MIB = 1 << 10, 1 << 20
FULL_SIZES = [KIB << (2 * i) for i in range(9)]  # 1 KiB ... 64 MiB, by 4x
QUICK_SIZES = [MIB, 16 * MIB, 64 * MIB]
LAYOUTS = {"1x2": (1, 2), "2x1": (2, 1), "2x2": (2, 2), "4x1": (4, 1)}
TRAIN_MODES = ("single", "ddp", "hora")
# Compressed training runs in jobs of its own, beside DDP: with several DistributedOptimizers
# taking turns in one process, hora's steps were up to 25% slower (ResNet, 1x2: 1035 samples/s
# alone, 784 beside the fp16 and bf16 ones), which would misstate each of them.
COMPRESSIONS = ("fp16", "bf16")
ROOT = Path(__file__).resolve().parents[1]
DOCS_PNG = ROOT / "docs" / "images" / "cluster_scaling.png"
DOCS_JSON = ROOT / "docs" / "cluster_scaling.json"


def reps_for(nbytes: int) -> int:
    """Timed calls per mode and size: fewer for the sizes that take long on a slow link."""
    return 20 if nbytes <= MIB else 6 if nbytes <= 4 * MIB else 4 if nbytes <= 16 * MIB else 3


# ---------------------------------------------------------------- worker


def slowest(times: list[float]) -> list[float]:
    import torch

    import hora.torch as hvd

    tensor = torch.tensor(times, dtype=torch.float64)
    return list(hvd.allreduce(tensor, op=hvd.Max, name=f"slowest.{len(times)}").tolist())


def allreduce_sweep(sizes: list[int], with_raw: bool) -> dict[str, Any]:
    """Median seconds (slowest rank) of hora's allreduce and, ``with_raw``, Gloo's, per size."""
    import torch
    import torch.distributed as dist

    import hora.torch as hvd

    out: dict[str, Any] = {}
    for nbytes in sizes:
        tensor = torch.ones(nbytes // 4)
        name = f"ar.{nbytes}"
        hvd.allreduce_(tensor, op=hvd.Sum, name=name)
        if with_raw:
            dist.all_reduce(tensor)
        times: dict[str, list[float]] = {"hora": [], "raw": []}
        order = ["hora", "raw"] if with_raw else ["hora"]
        for rep in range(reps_for(nbytes)):
            for mode in order if rep % 2 == 0 else order[::-1]:
                dist.barrier()
                start = time.perf_counter()
                if mode == "hora":
                    hvd.allreduce_(tensor, op=hvd.Sum, name=name)
                else:
                    dist.all_reduce(tensor)
                times[mode].append(time.perf_counter() - start)
        out[str(nbytes)] = {mode: slowest(times[mode]) for mode in order}
    return out


def training_modes(spec: Any, modes: list[str], rank: int, size: int) -> dict[str, Any]:
    """The training steps of ``spec``'s model in each of ``modes`` (None: this rank sits out)."""
    import torch
    import training
    from torch.nn.parallel import DistributedDataParallel

    import hora.torch as hvd

    batch = spec.batch_size
    generator = torch.Generator().manual_seed(training.SEED + 1 + rank)
    inputs = spec.make_inputs(batch, generator)
    labels = torch.randint(0, training.CLASSES, (batch,), generator=generator)
    steps: dict[str, Any] = {}
    for mode in modes:
        torch.manual_seed(training.SEED)
        model = spec.build()
        if mode == "single":
            opt = training.sgd(model)
            steps[mode] = training.make_step(model, opt, inputs, labels) if rank == 0 else None
            continue
        if mode == "ddp":
            wrapped = DistributedDataParallel(model, **training.NO_BUFFER_SYNC)
            steps[mode] = training.make_step(wrapped, training.sgd(wrapped), inputs, labels)
            continue
        # The compressed modes run in jobs of their own, started with horarun's
        # --gradient-compression: an optimizer built with the default compression there sends
        # fp16 or bf16.
        wanted = mode.removeprefix("hora-") if mode != "hora" else "none"
        setting = os.environ.get("HORA_GRADIENT_COMPRESSION", "none")
        assert setting == wanted, f"mode {mode} in a job with HORA_GRADIENT_COMPRESSION={setting}"
        opt = hvd.DistributedOptimizer(
            training.sgd(model),
            named_parameters=[(f"{mode}.{n}", p) for n, p in model.named_parameters()],
        )
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        steps[mode] = training.make_step(model, opt, inputs, labels)
    return steps


def train(models: list[str], modes: list[str], iters: int, block: int) -> dict[str, Any]:
    """Samples per second of each mode, per model: the batch (times the ranks) over the median
    step of the slowest rank, and the range over blocks."""
    import torch.distributed as dist
    import training

    import hora.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    for name in models:
        spec = training.MODELS[name]
        steps = training_modes(spec, modes, rank, size)
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for mode in modes:  # warmup
            dist.barrier()
            for _ in range(3):
                if steps[mode] is not None:
                    steps[mode]()
        blocks = (iters + block - 1) // block
        for index in range(blocks):
            for mode in modes if index % 2 == 0 else modes[::-1]:
                time.sleep(0.05)  # hora's engine parks before the next block
                dist.barrier()
                step = steps[mode]
                if step is None:
                    times[mode] += [0.0] * block
                    continue
                step()
                for _ in range(block):
                    start = time.perf_counter()
                    step()
                    times[mode].append(time.perf_counter() - start)
        row: dict[str, Any] = {"batch": spec.batch_size}
        for mode in modes:
            worst = slowest(times[mode])
            workers = 1 if mode == "single" else size
            rates = [
                workers * spec.batch_size / statistics.median(worst[i : i + block])
                for i in range(0, len(worst), block)
            ]
            row[mode] = {
                "samples_per_s": workers * spec.batch_size / statistics.median(worst),
                "low": min(rates),
                "high": max(rates),
                "blocks": rates,
            }
        out[name] = row
    return out


def worker(args: argparse.Namespace) -> None:
    import harness
    import torch

    import hora.torch as hvd
    from hora.common import basics

    torch.set_num_threads(1)
    hvd.init()
    harness.init_raw_group(hvd.rank(), hvd.size(), "cluster-raw/", timeout_s=300)
    result: dict[str, Any] = {"path": basics.data_path(), "size": hvd.size()}
    compressed = args.variant in COMPRESSIONS
    if not compressed:
        result["allreduce"] = allreduce_sweep(args.sizes, with_raw=args.variant == "hora")
    modes = ["hora"]
    if args.variant == "hora":
        modes = list(TRAIN_MODES)
    elif compressed:
        modes = ["ddp", f"hora-{args.variant}"]
    modes = args.modes or modes
    result["training"] = train(args.models, modes, args.iters, args.block)
    if hvd.rank() == 0:
        harness.write_json(args.json, result)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    hvd.shutdown()


# ---------------------------------------------------------------- driver


class JobFailed(RuntimeError):
    """A job of the study failed; the message names it and shows its last lines."""


@dataclass(frozen=True)
class JobSpec:
    rate: str
    layout: str
    variant: str  # hora, flat, mpi

    @property
    def name(self) -> str:
        return f"{self.rate}-{self.layout}-{self.variant}"


def mpi_available() -> str | None:
    """Why hora under ``horarun --mpi`` cannot run here, or None."""
    import importlib.util

    here = os.path.dirname(sys.executable)
    if shutil.which("mpirun", path=here + os.pathsep + os.environ.get("PATH", "")) is None:
        return "no mpirun"
    if importlib.util.find_spec("mpi4py") is None:
        return "no mpi4py"
    return None


def variants(layout: str, with_mpi: bool) -> list[str]:
    hosts, ranks = LAYOUTS[layout]
    chosen = ["hora", *COMPRESSIONS]
    if hosts > 1 and ranks > 1:
        chosen.append("flat")
    if hosts > 1 and with_mpi:
        chosen.append("mpi")
    return chosen


def run_job(cluster: Any, job: JobSpec, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    hosts, ranks = LAYOUTS[job.layout]
    result_path = out_dir / f"{job.name}.json"
    result_path.unlink(missing_ok=True)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env["OMP_NUM_THREADS"] = "1"
    if job.variant == "flat":
        env["HORA_HIERARCHICAL_ALLREDUCE"] = "0"
    if job.variant == "mpi":
        config = cluster.keys / "ssh_config"
        config.write_text(
            f"IdentityFile {cluster.keys / 'client_key'}\n"
            f"UserKnownHostsFile {cluster.keys / 'known_hosts'}\n"
            "StrictHostKeyChecking yes\nBatchMode yes\n"
        )
        env["PRTE_MCA_plm_ssh_agent"] = f"ssh -F {config}"
        env["OMPI_MCA_btl_tcp_if_include"] = "eth0"
        env["OMPI_MCA_oob_tcp_if_include"] = "eth0"
        launcher = [sys.executable, "-m", "hora.runner.launch", "--mpi", "-np", str(hosts * ranks)]
        launcher += ["-H", cluster.host_list(ranks, hosts)]
    else:
        launcher = cluster.horarun(slots=ranks, hosts=hosts)
        if job.variant in COMPRESSIONS:
            launcher += ["--gradient-compression", job.variant]
    command = [*launcher, sys.executable, os.path.abspath(__file__), "--worker"]
    command += ["--variant", job.variant, "--json", str(result_path), "--iters", str(args.iters)]
    command += ["--block", str(args.block), "--models", *args.models]
    command += ["--sizes", *map(str, args.sizes)]
    log = out_dir / f"{job.name}.log"
    started = time.monotonic()
    with open(log, "w") as output:
        done = subprocess.run(
            command, stdout=output, stderr=subprocess.STDOUT, env=env, timeout=900
        )
    if done.returncode != 0 or not result_path.exists():
        tail = log.read_text().splitlines()[-25:]
        raise JobFailed(
            f"job {job.name} failed ({done.returncode}); see {log}:\n" + "\n".join(tail)
        )
    result: dict[str, Any] = json.loads(result_path.read_text())
    result["seconds"] = time.monotonic() - started
    print(f"  {job.name}: {result['seconds']:.0f} s (path {result['path']})", file=sys.stderr)
    return result


def run_study(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    from hora.tools.cluster import Cluster, measure_rate

    why_no_mpi = mpi_available() if args.mpi else "not asked for (--no-mpi)"
    study: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_before": os.getloadavg(),
        "cpus": os.cpu_count(),
        "sizes": args.sizes,
        "models": args.models,
        "iters": args.iters,
        "block": args.block,
        "mpi": why_no_mpi or "yes",
        "links": {},
        "jobs": {},
        "failed": [],
    }
    for index, rate in enumerate(args.rates):
        hosts_needed = max(LAYOUTS[layout][0] for layout in args.layouts)
        print(f"{rate}: starting {hosts_needed} hosts", file=sys.stderr)
        with Cluster.start(max(hosts_needed, 2), None if rate == "unlimited" else rate) as cluster:
            study["links"][rate] = measure_rate(cluster, 0, 1, seconds=1.5)
            for _repeat in range(args.repeats):
                for layout in args.layouts:
                    if layout == "1x2" and index > 0:
                        continue  # within one host: no link crossed
                    for variant in variants(layout, why_no_mpi is None):
                        job = JobSpec(rate, layout, variant)
                        try:
                            result = run_job(cluster, job, args, out_dir)
                        except (JobFailed, subprocess.TimeoutExpired) as exc:
                            print(f"  {exc}", file=sys.stderr)  # the table shows it missing
                            study["failed"].append(job.name)
                            continue
                        study["jobs"].setdefault(job.name, []).append(result)
    study["load_after"] = os.getloadavg()
    study["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return study


# ---------------------------------------------------------------- report


def rate_bytes(rate: str) -> float | None:
    return {"1gbit": 125e6, "10gbit": 1250e6}.get(rate)


def merged(runs: list[dict[str, Any]], *path: str) -> list[float]:
    """Every sample under ``path`` across repeated runs of one job."""
    values: list[float] = []
    for run in runs:
        node: Any = run
        for key in path:
            node = node[key]
        values += node
    return values


def busbw(nbytes: int, seconds: float, size: int) -> float:
    return nbytes / seconds * 2 * (size - 1) / size / 1e6


def allreduce_rows(study: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for rate in study["links"]:
        for layout, (hosts, ranks) in LAYOUTS.items():
            size = hosts * ranks
            shown_rate = rate if layout != "1x2" else next(iter(study["links"]))
            if layout == "1x2" and rate != shown_rate:
                continue
            for nbytes in study["sizes"]:
                row: dict[str, Any] = {"rate": rate, "layout": layout, "bytes": nbytes}
                for variant, mode, label in (
                    ("hora", "hora", "hora"),
                    ("flat", "hora", "hora flat"),
                    ("hora", "raw", "gloo"),
                    ("mpi", "hora", "hora mpi"),
                ):
                    runs = study["jobs"].get(f"{shown_rate}-{layout}-{variant}")
                    if not runs:
                        continue
                    samples = merged(runs, "allreduce", str(nbytes), mode)
                    row[label] = statistics.median(samples)
                    row[label + " busbw"] = busbw(nbytes, row[label], size)
                if "hora" not in row:
                    continue  # a layout the study did not run
                limit = rate_bytes(rate)
                if limit and hosts > 1:
                    t_link = 2 * (hosts - 1) / hosts * nbytes / limit
                    row["link %"] = t_link / row["hora"]
                rows.append(row)
    return rows


def training_rows(study: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for rate in study["links"]:
        for layout in LAYOUTS:
            if study["jobs"].get(f"{rate}-{layout}-hora"):
                rows += [training_row(study, rate, layout, model) for model in study["models"]]
    return rows


def training_row(study: dict[str, Any], rate: str, layout: str, model: str) -> dict[str, Any]:
    """One model's figures at one rate and layout, from every job that trained it there."""
    hosts, ranks = LAYOUTS[layout]
    runs = study["jobs"][f"{rate}-{layout}-hora"]
    row: dict[str, Any] = {"rate": rate, "layout": layout, "model": model}
    for mode in TRAIN_MODES:
        values = [r["training"][model][mode] for r in runs]
        row[mode] = statistics.median(v["samples_per_s"] for v in values)
    row["hora/ddp"] = paired(runs, model, "hora", "ddp")
    for variant in ("flat", "mpi", *COMPRESSIONS):
        other = study["jobs"].get(f"{rate}-{layout}-{variant}")
        if not other:
            continue
        mode = f"hora-{variant}" if variant in COMPRESSIONS else "hora"
        values = [r["training"][model][mode] for r in other]
        median = statistics.median(v["samples_per_s"] for v in values)
        if variant in COMPRESSIONS:
            row[mode] = median
            row[f"{mode}/ddp"] = paired(other, model, mode, "ddp")
        else:
            row[f"hora {variant}"] = median
    for mode in ("ddp", "hora", "hora-fp16", "hora-bf16"):
        if mode in row:
            row[mode + " eff"] = row[mode] / (hosts * ranks * row["single"])
    return row


def paired(runs: list[dict[str, Any]], model: str, mode: str, other: str) -> tuple[float, ...]:
    """``mode``'s throughput over ``other``'s in one job: the median over every pair of blocks
    that ran next to each other, and the lowest and highest pair."""
    ratios = [
        a / b
        for run in runs
        for a, b in zip(
            run["training"][model][mode]["blocks"], run["training"][model][other]["blocks"]
        )
    ]
    return statistics.median(ratios), min(ratios), max(ratios)


def format_report(study: dict[str, Any]) -> str:
    import harness

    lines = [
        f"hora on an emulated cluster ({study['cpus']} CPUs, one thread per rank; started "
        f"{study['started']}, load average {study['load_before'][0]:.2f} before, "
        f"{study['load_after'][0]:.2f} after; hora under horarun --mpi: {study['mpi']})",
        "links (TCP payload, one stream, host a -> b): "
        + ", ".join(f"{rate} {bps * 8 / 1e9:.2f} Gbit/s" for rate, bps in study["links"].items()),
        "",
        "allreduce: median time of the slowest rank, bus bandwidth in MB/s; link % = t_link / t",
    ]
    labels = ["hora", "hora flat", "gloo", "hora mpi"]
    header = ("link", "hosts x ranks", "size", *[f"{label} MB/s" for label in labels], "link %")
    rows = []
    for r in allreduce_rows(study):
        size = r["bytes"]
        shown = f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"
        cells = [f"{r[label + ' busbw']:.0f}" if label in r else "-" for label in labels]
        link = f"{r['link %']:.0%}" if "link %" in r else "-"
        rows.append(
            (r["rate"] if r["layout"] != "1x2" else "(none)", r["layout"], shown, *cells, link)
        )
    lines += harness.table(header, rows)
    lines += [
        "",
        "training: samples/s (all ranks), median of blocks; eff = samples/s / (ranks x single);",
        "x/DDP: median (range) over pairs of adjacent blocks in one job (fp16 and bf16 run in",
        "jobs of their own, each beside DDP)",
    ]
    header = (
        "link", "hosts x ranks", "model", "single", "DDP", "hora", "hora flat", "hora mpi",
        "hora fp16", "hora bf16", "hora/DDP", "fp16/DDP", "bf16/DDP", "eff DDP", "eff hora",
    )  # fmt: skip
    rows = []
    for r in training_rows(study):
        rows.append(
            (
                r["rate"] if r["layout"] != "1x2" else "(none)",
                r["layout"],
                r["model"],
                f"{r['single']:.0f}",
                f"{r['ddp']:.0f}",
                f"{r['hora']:.0f}",
                f"{r['hora flat']:.0f}" if "hora flat" in r else "-",
                f"{r['hora mpi']:.0f}" if "hora mpi" in r else "-",
                f"{r['hora-fp16']:.0f}" if "hora-fp16" in r else "-",
                f"{r['hora-bf16']:.0f}" if "hora-bf16" in r else "-",
                ratio(r.get("hora/ddp")),
                ratio(r.get("hora-fp16/ddp")),
                ratio(r.get("hora-bf16/ddp")),
                f"{r['ddp eff']:.0%}",
                f"{r['hora eff']:.0%}",
            )
        )
    lines += harness.table(header, rows)
    if study["failed"]:
        lines.append("failed jobs (logs in the output folder): " + ", ".join(study["failed"]))
    return "\n".join(lines)


def ratio(value: tuple[float, ...] | None) -> str:
    """A paired ratio as ``median (low-high)``."""
    if value is None:
        return "-"
    return f"{value[0]:.2f}x ({value[1]:.2f}-{value[2]:.2f})"


def plot(study: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(study["links"])
    fig, axes = plt.subplots(2, len(rates), figsize=(6.5 * len(rates), 9), squeeze=False)
    arows = allreduce_rows(study)
    for column, rate in enumerate(rates):
        ax = axes[0][column]
        for label, style in (
            ("hora", "o-"),
            ("hora flat", "s--"),
            ("gloo", "^:"),
            ("hora mpi", "d-."),
        ):
            points = [r for r in arows if r["rate"] == rate and r["layout"] == "2x2" and label in r]
            if points:
                ax.plot(
                    [p["bytes"] for p in points], [p[label + " busbw"] for p in points], style,
                    label=label if label != "gloo" else "Gloo (DDP's)",
                )  # fmt: skip
        limit = rate_bytes(rate)
        if limit:
            ax.axhline(limit * 1.5 / 1e6, color="grey", lw=0.8, label="link bound (2 hosts)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("allreduce size (bytes)")
        ax.set_ylabel("bus bandwidth (MB/s)")
        ax.set_title(f"2 hosts x 2 ranks, links {rate}")
        ax.legend(fontsize=8)
        ax = axes[1][column]
        trows = [r for r in training_rows(study) if r["rate"] == rate and r["layout"] != "1x2"]
        models = study["models"]
        layouts = [
            layout
            for layout in LAYOUTS
            if layout != "1x2" and any(r["layout"] == layout for r in trows)
        ]
        width = 0.8 / 3
        for offset, (mode, label) in enumerate(
            (("ddp", "DDP"), ("hora", "hora"), ("hora-fp16", "hora fp16"))
        ):
            xs, ys = [], []
            for m_index, model in enumerate(models):
                for l_index, layout in enumerate(layouts):
                    found = [r for r in trows if r["model"] == model and r["layout"] == layout]
                    if found and mode + " eff" in found[0]:
                        xs.append(m_index * (len(layouts) + 1) + l_index + offset * width)
                        ys.append(found[0][mode + " eff"] * 100)
            ax.bar(xs, ys, width, label=label)
        ticks = [
            m * (len(layouts) + 1) + j + width
            for m in range(len(models))
            for j in range(len(layouts))
        ]
        ax.set_xticks(
            ticks, [f"{model}\n{layout}" for model in models for layout in layouts], fontsize=7
        )
        ax.set_ylabel("scaling efficiency vs one rank (%)")
        ax.set_title(f"training, links {rate}")
        ax.legend(fontsize=8)
    fig.suptitle(
        f"hora on an emulated cluster: {study['cpus']} CPUs, network namespaces with tc tbf links "
        f"({study['started']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="hora", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--modes", nargs="+", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="1gbit, 2x2, mlp, 3 sizes (minutes)")
    parser.add_argument("--rates", nargs="+", default=None, help="tc rates (default 1gbit 10gbit)")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=None)
    parser.add_argument("--models", nargs="+", default=None, help="default mlp resnet transformer")
    parser.add_argument("--sizes", nargs="+", type=int, default=None, help="allreduce bytes")
    parser.add_argument(
        "--iters", type=int, default=None, help="timed steps per mode (15; --quick 10)"
    )
    parser.add_argument("--block", type=int, default=5, help="steps per block (5)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every job (1)")
    parser.add_argument("--no-mpi", dest="mpi", action="store_false")
    parser.add_argument("--output-dir", type=Path, default=Path("cluster-scaling"))
    parser.add_argument("--docs", action="store_true", help=f"write {DOCS_PNG} and {DOCS_JSON}")
    args = parser.parse_args()
    quick = args.quick
    args.rates = args.rates or (["1gbit"] if quick else ["1gbit", "10gbit"])
    args.layouts = args.layouts or (["2x2"] if quick else list(LAYOUTS))
    args.models = args.models or (["mlp"] if quick else ["mlp", "resnet", "transformer"])
    args.sizes = args.sizes or (QUICK_SIZES if quick else FULL_SIZES)
    args.iters = args.iters or (10 if quick else 15)
    return args


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    from hora.tools.cluster import unavailable

    reason = unavailable()
    if reason:
        print(f"benchmarks/cluster_scaling.py: {reason}", file=sys.stderr)
        return 2
    out_dir = args.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    study = run_study(args, out_dir)
    study["elapsed_s"] = time.monotonic() - started
    report = format_report(study)
    print(report)
    print(f"study time {study['elapsed_s'] / 60:.1f} min")
    json_path = DOCS_JSON if args.docs else out_dir / "cluster_scaling.json"
    png_path = DOCS_PNG if args.docs else out_dir / "cluster_scaling.png"
    json_path.write_text(json.dumps(study, indent=1) + "\n")
    (out_dir / "report.txt").write_text(report + "\n")
    plot(study, png_path)
    print(f"wrote {json_path}, {png_path}, {out_dir / 'report.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
