"""What runs inside the Ray worker processes while hora is set up and torn down.

Ray sends these functions to the workers by reference (``hora.ray._worker.<name>``), so every
node needs hora installed, as it needs Ray. Nothing here talks to Ray's control plane; the
driver side (:mod:`hora.ray._setup`) calls these through a worker group or on actors.

The job secret never travels in clear: each worker process has an X25519 key pair and reports
its public key (:func:`describe`); rank 0's worker makes the secret and seals one copy to each
worker's public key (:func:`seal`), and each worker opens its own copy (:func:`set_env`). Ray
carries only the sealed copies, so the secret is not in Ray's task arguments, object store or
logs. An attacker who can run tasks on the Ray cluster can still read any worker's memory: Ray's
own token authentication and TLS are what keep such people off a shared cluster
(docs/ray.md).
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

from hora.common.startup.lifecycle import keep_hosted, receiving_key, release_hosted
from hora.common.vocabulary import settings_table as table

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

# Variables an outer launcher may have left in the Ray worker's environment (Ray workers inherit
# the environment of the process that started Ray) that would make hvd.init() take the wrong
# path. The topology variables themselves are always overwritten.
STALE_VARS = (
    table.ELASTIC.env,
    table.ELASTIC_ID.env,
    table.LAUNCHER.env,
    *table.GLOO_RENDEZVOUS_ADDR.environ_names,
    *table.GLOO_RENDEZVOUS_PORT.environ_names,
    # Horovod's name for the secret, which hora does not read: gone all the same.
    "HOROVOD_" + table.SECRET_KEY.name,
)

# The rendezvous stores this process hosts are kept by the token of the start that created
# them, and its X25519 private key (made on first use, for the sealed job secret) by the
# process's runtime (lifecycle's keep_hosted and receiving_key).
_SEAL_INFO = b"hora-ray-sealed-secret"


def _raw_public(key: X25519PrivateKey) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    public: X25519PublicKey = key.public_key()
    return bytes(public.public_bytes(Encoding.Raw, PublicFormat.Raw))


def _box_key(shared: bytes, sender: bytes, recipient: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    hkdf = HKDF(hashes.SHA256(), 32, salt=None, info=_SEAL_INFO + sender + recipient)
    return bytes(hkdf.derive(shared))


def seal(secret: str, public_key_hex: str) -> str:
    """``secret`` encrypted to the worker whose public key is ``public_key_hex``, as hex.

    A fresh ephemeral key pair per copy (ECDH with X25519, HKDF-SHA256, ChaCha20-Poly1305):
    only the holder of the matching private key can open it, and any change is detected.
    """
    from cryptography.hazmat.primitives.asymmetric.x25519 import (
        X25519PrivateKey,
        X25519PublicKey,
    )
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    recipient = bytes.fromhex(public_key_hex)
    ephemeral = X25519PrivateKey.generate()
    sender = _raw_public(ephemeral)
    shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(recipient))
    box = ChaCha20Poly1305(_box_key(shared, sender, recipient))
    return (sender + box.encrypt(bytes(12), secret.encode(), sender)).hex()


def unseal(sealed_hex: str) -> str:
    """Open a copy that :func:`seal` made for this process's public key.

    Raises:
        ValueError: the copy was made for another process, or was changed on the way.
    """
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    sealed = bytes.fromhex(sealed_hex)
    sender, ciphertext = sealed[:32], sealed[32:]
    key = receiving_key()
    shared = key.exchange(X25519PublicKey.from_public_bytes(sender))
    box = ChaCha20Poly1305(_box_key(shared, sender, _raw_public(key)))
    try:
        return box.decrypt(bytes(12), ciphertext, sender).decode()
    except InvalidTag:
        raise ValueError(
            f"the sealed job secret sent to this Ray worker (pid {os.getpid()}) does not open "
            "with its key: it was made for another worker or changed on the way."
        ) from None


def describe() -> dict[str, Any]:
    """Where this worker runs: Ray node id and address, host name, process id, GPU ids."""
    import ray

    context = ray.get_runtime_context()
    try:
        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
    except Exception:  # no GPU support compiled in, or not in a worker
        gpu_ids = []
    return {
        "node_id": context.get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "gpu_ids": gpu_ids,
        "public_key": _raw_public(receiving_key()).hex(),
    }


def host_rendezvous(
    token: str, bind_address: str, public_keys: list[str], timeout_s: float
) -> tuple[int, list[str]]:
    """Make a fresh job secret and start the job's store in this process.

    Args:
        token: names this start of the job; :func:`close_rendezvous` closes by it.
        bind_address: the only address the store listens on (never ``0.0.0.0``).
        public_keys: every worker's public key (from :func:`describe`), in rank order.
        timeout_s: how long store operations may block.

    Returns:
        The store's port, and the secret sealed to each worker's key, in rank order.
    """
    from hora.common.job.store import new_secret
    from hora.runner.store_server import RendezvousServer

    secret = new_secret()
    server = RendezvousServer(bind_address, secret=secret, timeout_s=timeout_s)
    keep_hosted(token, server)
    return int(server.port), [seal(secret, key) for key in public_keys]


def close_rendezvous(token: str) -> bool:
    """Stop serving the store that the start ``token`` created here (if it is still here)."""
    server = release_hosted(token)
    if server is None:
        return False
    server.close()
    return True


def set_env(env: dict[str, str], unset: tuple[str, ...] = STALE_VARS, sealed: str = "") -> None:
    """Export ``env`` in this process (removing ``unset`` first) for ``hvd.init()`` to read;
    ``sealed``, the job secret sealed to this process (:func:`seal`), becomes
    ``HORA_SECRET_KEY``."""
    for name in unset:
        os.environ.pop(name, None)
    if sealed:
        os.environ[table.SECRET_KEY.env] = unseal(sealed)
    os.environ.update({k: str(v) for k, v in env.items()})


def shutdown_hora() -> bool:
    """``hvd.shutdown()`` here, if hora runs; whether it did."""
    import sys

    if "hora.common.startup.lifecycle" not in sys.modules:
        return False  # the train function never imported hora
    from hora.common.api import is_initialized
    from hora.common.startup import lifecycle

    if not is_initialized():
        return False
    lifecycle.shutdown()
    return True
