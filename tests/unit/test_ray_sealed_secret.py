"""The job secret travels to Ray workers sealed to each worker's own key."""

from __future__ import annotations

import os

import pytest

from hora.common.job.store import new_secret
from hora.common.startup.lifecycle import receiving_key

# hora.ray, and so its _worker, imports Ray.
pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[integrations]'")

from hora.ray import _worker


def _public_key() -> str:
    return _worker._raw_public(receiving_key()).hex()


def test_a_sealed_secret_opens_only_with_the_workers_key() -> None:
    secret = new_secret()
    sealed = _worker.seal(secret, _public_key())
    assert secret not in sealed and secret.encode().hex() not in sealed
    assert _worker.unseal(sealed) == secret
    # Each copy has its own ephemeral key: two seals of one secret differ.
    assert _worker.seal(secret, _public_key()) != sealed


def test_a_copy_for_another_worker_or_a_changed_copy_is_refused() -> None:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    other = _worker._raw_public(X25519PrivateKey.generate()).hex()
    with pytest.raises(ValueError, match="made for another worker or changed on the way"):
        _worker.unseal(_worker.seal(new_secret(), other))
    sealed = bytearray.fromhex(_worker.seal(new_secret(), _public_key()))
    sealed[-1] ^= 1
    with pytest.raises(ValueError, match="does not open"):
        _worker.unseal(sealed.hex())


def test_set_env_unseals_into_the_secret_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    # Set through monkeypatch first, so that both are put back as they were when the test ends.
    monkeypatch.setenv("HORA_SECRET_KEY", "")
    monkeypatch.setenv("HORA_RANK", "")
    secret = new_secret()
    _worker.set_env({"HORA_RANK": "0"}, (), _worker.seal(secret, _public_key()))
    assert os.environ["HORA_SECRET_KEY"] == secret
