import re
import subprocess
import sys
from pathlib import Path

import pytest

HOROVOD_TORCH_NAMES = [
    "init",
    "shutdown",
    "is_initialized",
    "size",
    "local_size",
    "cross_size",
    "rank",
    "local_rank",
    "cross_rank",
    "mpi_threads_supported",
    "mpi_enabled",
    "mpi_built",
    "gloo_enabled",
    "gloo_built",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "allreduce",
    "allreduce_async",
    "allreduce_",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_async",
    "grouped_allreduce_",
    "grouped_allreduce_async_",
    "sparse_allreduce_async",
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "broadcast",
    "broadcast_async",
    "broadcast_",
    "broadcast_async_",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "barrier",
    "poll",
    "synchronize",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "HorovodInternalError",
    "Compression",
    "broadcast_object",
    "allgather_object",
    "DistributedOptimizer",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "SyncBatchNorm",
]


def test_hora_torch_exports_horovod_names() -> None:
    import hora.torch as hvd

    missing = [name for name in HOROVOD_TORCH_NAMES if not hasattr(hvd, name)]
    assert missing == []
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert hvd.HorovodInternalError is hvd.HoraInternalError


def test_importing_the_runner_does_not_import_torch() -> None:
    code = (
        "import sys, hora, hora.runner.launch, hora.runner.api, hora.runner.supervisor;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# Runs in a process where any import of torch fails and is remembered: the launcher's side of
# the store (the service, and StoreClient over a StoreConnection) must work without torch.
STORE_WITHOUT_TORCH = r"""
import sys
from datetime import timedelta

attempts = []


class RefuseTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            attempts.append(name)
            raise ImportError(f"imported {name!r}")
        return None


sys.meta_path.insert(0, RefuseTorch())
from hora.common.job.store import StoreClient, new_secret, read_failure, report_failure
from hora.common.job.store import start_store_server

secret = new_secret()
server, port = start_store_server("127.0.0.1", 0, secret)
client = StoreClient("127.0.0.1", port, secret, timeout_s=5.0)
other = client.reconnect()
client.set_signed("a", b"1")
assert other.get_signed("a") == b"1"
client.mark("here")
assert other.marked("here") and other.all_marked(["a", "here"]) and not other.marked("gone")
assert other.wait("here", 1.0) and not other.wait("never", 0.1)
client.store.set(client.key("gone"), client.signed("gone", b""))
client.delete("gone")
assert not other.marked("gone")
report_failure(client, "rank 1: failed")
assert read_failure(other) == "rank 1: failed"
server.close()
print(attempts, sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
"""


@pytest.mark.timeout(60)
def test_the_store_serves_and_is_used_without_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", STORE_WITHOUT_TORCH], capture_output=True, text=True, timeout=50
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] []", out.stderr


def test_topology_queries_before_init_raise() -> None:
    import pytest

    import hora.torch as hvd

    with pytest.raises(ValueError, match="has not been initialized"):
        hvd.rank()


def _import_graph() -> dict[str, set[str]]:
    """Module -> the hora modules it imports (anywhere in it), from the source files."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    paths = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (root / "hora").rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hora"):
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    imported.add(name if name in paths else node.module)
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names if a.name in paths)
        graph[module] = imported
    return graph


def test_no_import_cycles_between_modules() -> None:
    # A package importing its own submodules (and they the package's names) is no cycle.
    graph = _import_graph()

    def related(a: str, b: str) -> bool:
        return a.startswith(b + ".") or b.startswith(a + ".")

    cycles = []

    def visit(start: str, module: str, path: list[str]) -> None:
        for nxt in graph.get(module, ()):
            if nxt == start and len(path) > 1:
                if not all(related(a, b) for a, b in zip(path, path[1:] + path[:1])):
                    cycles.append(path)
            elif nxt not in path and len(path) < 6:
                visit(start, nxt, [*path, nxt])

    for module in graph:
        visit(module, module, [module])
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_the_readme_names_the_dependencies_pyproject_declares() -> None:
    """README.md's "Installing into your own environment" names each of pyproject.toml's
    dependencies and no other; .ci/bare-install checks that they are all a job needs."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~; \[]", spec, maxsplit=1)[0] for spec in project["dependencies"]}
    section = (root / "README.md").read_text().split("### Installing into your own environment")[1]
    sentence = section.split("hora needs", 1)[1].split("(", 1)[0]
    named = {re.split(r"[<>=]", name, maxsplit=1)[0] for name in re.findall(r"`([^`]+)`", sentence)}
    assert named == declared
