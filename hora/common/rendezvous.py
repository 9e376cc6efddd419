"""The job's key-value store as workers see it: namespaced keys and authenticated values.

The launcher runs a ``torch.distributed.TCPStore``. That store has no access control, so hora
protects what it puts there in two ways:

* every key lives under a namespace derived from the per-job secret, so a process that does not
  know the secret cannot name (read, overwrite or wait on) any of the job's keys;
* every value hora itself parses is signed with HMAC-SHA256 under the secret, and verified before
  it is decoded. Nothing is ever unpickled before its signature checks out.

This module knows stores and bytes; it does not know the engine.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta
from typing import Any

TAG_BYTES = 32

# Set (first writer wins) when any worker or the launcher sees the job fail.
FAILURE_KEY = "failure"


# Set (first writer wins, signed "rank N: why") by a worker that ends the job on purpose.
CAUSE_KEY = "cause"

# Names the doorbell key parked ranks wait on (written by global rank 0 when it parks).
PARKED_KEY = "parked"


def exit_key(rank: int) -> str:
    """Store key where the launcher records how a rank's process ended."""
    return f"exit/{rank}"


class AuthenticationError(RuntimeError):
    """A value in the store was not signed with this job's secret."""


def new_secret() -> str:
    """A fresh random job secret, as hex."""
    return secrets.token_hex(32)


def namespace_for(secret: str) -> str:
    """The key prefix for a job: unguessable without the secret."""
    return "hora-" + hashlib.sha256(b"hora-namespace:" + secret.encode()).hexdigest()[:32]


def sign(secret: str, data: bytes) -> bytes:
    """``data`` preceded by its HMAC-SHA256 tag under ``secret``."""
    tag = hmac.new(secret.encode(), data, hashlib.sha256).digest()
    return tag + data


def verify(secret: str, blob: bytes, what: str = "value") -> bytes:
    """The data inside a signed blob.

    Raises:
        AuthenticationError: the tag does not match (wrong secret, or the blob was forged).
    """
    if len(blob) < TAG_BYTES:
        raise AuthenticationError(f"rejected an unsigned {what} (too short to carry a signature)")
    tag, data = blob[:TAG_BYTES], blob[TAG_BYTES:]
    expected = hmac.new(secret.encode(), data, hashlib.sha256).digest()
    if not hmac.compare_digest(tag, expected):
        raise AuthenticationError(
            f"rejected a {what} that was not signed with this job's secret; another process "
            "may be writing to the job's rendezvous port"
        )
    return data


class StoreClient:
    """A connection to the job's store, with namespaced keys and signed values.

    Args:
        addr: the store's address; empty for a job of one (an in-process store is used).
        port: the store's port.
        secret: the job secret (hex).
        timeout_s: how long a ``get``/``wait`` may block before failing.
    """

    def __init__(self, addr: str, port: int, secret: str, timeout_s: float) -> None:
        import torch.distributed

        dist: Any = torch.distributed

        self.addr = addr
        self.port = port
        self.secret = secret
        self.timeout_s = timeout_s
        if addr:
            try:
                self.store: Any = dist.TCPStore(
                    addr,
                    port,
                    None,
                    False,
                    timedelta(seconds=timeout_s),
                    wait_for_workers=False,
                )
            except (RuntimeError, ValueError) as exc:
                raise RuntimeError(
                    f"cannot reach the job's rendezvous store at {addr}:{port} within "
                    f"{timeout_s:g} s ({exc}). Was this process started by horarun, and is the "
                    "launcher still running? Raise HORA_START_TIMEOUT if start-up is slow."
                ) from exc
        else:
            self.store = dist.HashStore()
        self.namespace = namespace_for(secret)

    def reconnect(self) -> StoreClient:
        """A second, independent connection (a blocked ``wait`` holds its connection)."""
        if not self.addr:
            clone = object.__new__(StoreClient)
            clone.__dict__.update(self.__dict__)
            return clone
        return StoreClient(self.addr, self.port, self.secret, self.timeout_s)

    def key(self, name: str) -> str:
        return f"{self.namespace}/{name}"

    def scoped(self, scope: str) -> Any:
        """A ``torch.distributed.PrefixStore`` for a process group's own rendezvous."""
        import torch.distributed

        dist: Any = torch.distributed

        return dist.PrefixStore(f"{self.namespace}/{scope}/", self.store)

    def set_signed(self, name: str, data: bytes) -> None:
        self.store.set(self.key(name), sign(self.secret, data))

    def get_signed(self, name: str) -> bytes:
        """The verified value of a key (blocks until it exists, up to the store timeout)."""
        blob = bytes(self.store.get(self.key(name)))
        return verify(self.secret, blob, what=f"store value {name!r}")

    def check(self, name: str) -> bool:
        return bool(self.store.check([self.key(name)]))

    def wait(self, name: str, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a key to exist; ``False`` on timeout."""
        try:
            self.store.wait([self.key(name)], timedelta(seconds=timeout_s))
            return True
        except RuntimeError as exc:
            if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                return False
            raise

    def delete(self, name: str) -> None:
        try:
            self.store.delete_key(self.key(name))
        except RuntimeError:
            pass


def report_failure(store: StoreClient, text: str) -> None:
    """Mark the job failed (first report wins) and wake ranks parked on their doorbell."""
    try:
        store.store.compare_set(store.key(FAILURE_KEY), "", text.encode())
    except RuntimeError:
        pass
    if store.check(PARKED_KEY):
        wake_key = bytes(store.store.get(store.key(PARKED_KEY))).decode(errors="replace")
        store.set_signed(wake_key, b"")
