"""What this installation of hora can do: the ``*_built`` queries of Horovod's API, and the
``--check-build`` table of ``horarun`` and ``hora``.

A box is ticked when hora can use that framework or transport here: the library is present
*and* hora has a path through it. hora's transports are Gloo (through ``torch.distributed``), MPI
(through mpi4py, when it loads) and, for CUDA tensors, NCCL (through ``torch.distributed``, when
torch has it and a GPU is visible). Nothing here starts a job; torch is imported only by the
queries that need it, so ``horarun --check-build`` needs nothing beyond what it reports on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def gloo_built() -> bool:
    """hora's CPU transport is Gloo, through ``torch.distributed``."""
    from hora.common.transport.gloo import gloo_available

    return gloo_available()


def mpi_built() -> bool:
    """Whether hora can use MPI: mpi4py imports and its MPI library loads (MPI is not
    initialized by asking)."""
    from hora.common.transport.mpi import mpi_loadable

    return mpi_loadable()


def nccl_built() -> int:
    """NCCL's version code where this torch has NCCL, so that collectives on CUDA tensors run
    over NCCL (``HORA_GPU_OPERATIONS=nccl``, the default); 0 where CUDA tensors can only go
    through host memory.

    As Horovod's, the code is NCCL's ``NCCL_VERSION_CODE`` (21803 for NCCL 2.18.3), so
    ``if hvd.nccl_built():`` and version comparisons both work.

    Example:
        >>> if hvd.nccl_built() >= 21803:  # NCCL 2.18.3 or later
        ...     print("NCCL", hvd.nccl_built())
    """
    from hora.common.transport.nccl import nccl_compiled

    if not nccl_compiled():
        return 0
    import torch

    nccl: Any = torch.cuda.nccl
    return nccl_version_code(nccl.version())


def nccl_version_code(version: tuple[int, ...] | int) -> int:
    """NCCL's ``NCCL_VERSION_CODE`` for the version torch reports.

    ``torch.cuda.nccl.version()`` is a tuple such as ``(2, 18, 3)`` (older torch releases
    return the code itself, an int). NCCL numbers releases up to 2.8 as
    ``major * 1000 + minor * 100 + patch`` and later ones as
    ``major * 10000 + minor * 100 + patch`` (its ``NCCL_VERSION`` macro).

    Example:
        >>> nccl_version_code((2, 18, 3)), nccl_version_code((2, 7, 8))
        (21803, 2708)
    """
    if isinstance(version, int):
        return version
    major, minor, patch = (list(version) + [0, 0, 0])[:3]
    if major <= 2 and minor <= 8:
        return major * 1000 + minor * 100 + patch
    return major * 10000 + minor * 100 + patch


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """Whether this torch has CUDA, so that hora takes CUDA tensors (over NCCL where
    :func:`nccl_built`, else through host memory)."""
    import torch

    return bool(torch.backends.cuda.is_built())


def rocm_built() -> bool:
    import torch

    return getattr(torch.version, "hip", None) is not None


def torch_version() -> str | None:
    try:
        import torch
    except Exception:  # a broken install is reported, not raised
        return None
    return str(torch.__version__)


def _tensorflow_version() -> str | None:
    """TensorFlow's version, found without importing it (importing takes seconds)."""
    from importlib import metadata

    for distribution in ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


@dataclass(frozen=True)
class Capability:
    """One line of the report.

    Attributes:
        name: as Horovod's table names it.
        usable: hora can use it in this installation (the box is ticked).
        detail: what was found, for ``hora doctor``.
    """

    name: str
    usable: bool
    detail: str


def frameworks() -> list[Capability]:
    version = torch_version()
    tensorflow = _tensorflow_version()
    return [
        Capability(
            "TensorFlow",
            tensorflow is not None,
            f"tensorflow {tensorflow} (hora.tensorflow, hora.keras)"
            if tensorflow
            else 'not installed: pip install "hora[tensorflow]"',
        ),
        Capability(
            "PyTorch",
            version is not None,
            f"torch {version} (hora.torch)" if version else "torch cannot be imported",
        ),
        Capability("MXNet", False, "hora has no MXNet API"),
    ]


def _gloo() -> Capability:
    if torch_version() is None:
        return Capability("Gloo", False, "torch cannot be imported")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return Capability("Gloo", False, "this torch build has no Gloo in torch.distributed")
    return Capability("Gloo", True, "torch.distributed Gloo: hora's transport")


def _nccl() -> Capability:
    if torch_version() is None:
        return Capability("NCCL", False, "torch cannot be imported")
    import torch
    import torch.distributed as dist

    from hora.common.vocabulary.config import Settings

    if not dist.is_available() or not dist.is_nccl_available():
        return Capability("NCCL", False, "this torch build has no NCCL")
    nccl: Any = torch.cuda.nccl
    found = nccl.version()  # a tuple (2, 21, 5); an int such as 2708 in older torch releases
    version = ".".join(str(p) for p in found) if isinstance(found, tuple) else str(found)
    if not torch.cuda.is_available():
        return Capability("NCCL", False, f"torch has NCCL {version} but no CUDA device is visible")
    devices = torch.cuda.device_count()
    if Settings.from_env().gpu_operations != "nccl":
        return Capability(
            "NCCL",
            False,
            f"torch has NCCL {version} and {devices} CUDA device(s), but HORA_GPU_OPERATIONS="
            "host sends CUDA tensors through host memory",
        )
    return Capability("NCCL", True, f"NCCL {version}, {devices} CUDA device(s): CUDA tensors' path")


def _mpi() -> Capability:
    try:
        import mpi4py
        from mpi4py import MPI
    except Exception:  # ImportError, or a broken MPI library
        return Capability("MPI", False, "mpi4py cannot be imported")
    library = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
    found = f"mpi4py {mpi4py.__version__} ({library})"
    if torch_version() is None:  # hora's MPI transport stands on torch tensors
        return Capability("MPI", False, f"{found}, but torch cannot be imported")
    if not mpi_built():
        return Capability("MPI", False, f"{found}, but its MPI library does not answer")
    return Capability("MPI", True, found)


def transports() -> list[Capability]:
    """Gloo, NCCL and MPI, in that order."""
    return [_gloo(), _nccl(), _mpi()]


def check_build_text() -> str:
    """Horovod's ``--check-build`` report, for hora."""
    from hora import __version__

    gloo, nccl, mpi = transports()

    def box(usable: bool) -> str:
        return "[X]" if usable else "[ ]"

    lines = [f"hora v{__version__}:", "", "Available Frameworks:"]
    lines += [f"    {box(c.usable)} {c.name}" for c in frameworks()]
    lines += [
        "",
        "Available Controllers:",
        f"    {box(mpi.usable)} MPI",
        f"    {box(gloo.usable)} Gloo",
    ]
    lines += ["", "Available Tensor Operations:", f"    {box(nccl.usable)} NCCL", "    [ ] DDL"]
    lines += ["    [ ] CCL", f"    {box(mpi.usable)} MPI", f"    {box(gloo.usable)} Gloo"]
    return "\n".join(lines)
