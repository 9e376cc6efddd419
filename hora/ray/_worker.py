"""What runs inside the Ray worker processes while hora is set up and torn down.

Ray sends these functions to the workers by reference (``hora.ray._worker.<name>``), so every
node needs hora installed, as it needs Ray. Nothing here talks to Ray's control plane; the
driver side (:mod:`hora.ray._setup`) calls these through a worker group or on actors.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

# Variables an outer launcher may have left in the Ray worker's environment (Ray workers inherit
# the environment of the process that started Ray) that would make hvd.init() take the wrong
# path. The topology variables themselves are always overwritten.
STALE_VARS = (
    "HORA_ELASTIC",
    "HORA_ELASTIC_ID",
    "HORA_LAUNCHER",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR",
    "HOROVOD_GLOO_RENDEZVOUS_PORT",
    "HOROVOD_SECRET_KEY",
)

_lock = threading.Lock()
# Rendezvous stores this process hosts, by the token of the start that created them.
_servers: dict[str, Any] = {}


def describe() -> dict[str, Any]:
    """Where this worker runs: Ray node id and address, host name, process id, GPU ids."""
    import ray

    context = ray.get_runtime_context()
    try:
        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
    except Exception:  # noqa: BLE001 - no GPU support compiled in, or not in a worker
        gpu_ids = []
    return {
        "node_id": context.get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "gpu_ids": gpu_ids,
    }


def host_rendezvous(token: str, bind_address: str, secret: str, timeout_s: float) -> int:
    """Start the job's rendezvous store in this process; returns its port.

    Args:
        token: names this start of the job; :func:`close_rendezvous` closes by it.
        bind_address: the only address the store listens on (never ``0.0.0.0``).
        secret: the job's fresh secret.
        timeout_s: how long store operations may block.
    """
    from hora.runner.store_server import RendezvousServer

    server = RendezvousServer(bind_address, secret=secret, timeout_s=timeout_s)
    with _lock:
        _servers[token] = server
    return int(server.port)


def close_rendezvous(token: str) -> bool:
    """Stop serving the store that the start ``token`` created here (if it is still here)."""
    with _lock:
        server = _servers.pop(token, None)
    if server is None:
        return False
    server.close()
    return True


def set_env(env: dict[str, str], unset: tuple[str, ...] = STALE_VARS) -> None:
    """Export ``env`` in this process (removing ``unset`` first) for ``hvd.init()`` to read."""
    for name in unset:
        os.environ.pop(name, None)
    os.environ.update({k: str(v) for k, v in env.items()})


def shutdown_hora() -> bool:
    """``hvd.shutdown()`` here, if hora runs; whether it did."""
    import sys

    if "hora.common.basics" not in sys.modules:
        return False  # the train function never imported hora
    from hora.common import basics

    if not basics.is_initialized():
        return False
    if "hora.torch" in sys.modules:
        sys.modules["hora.torch"].shutdown()
    else:
        basics.shutdown()
    return True
