"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hora.common.job.store import new_secret, start_store_server


@pytest.fixture
def served() -> Iterator[tuple[str, int]]:
    """hora's own store service on loopback: ``(secret, port)``."""
    secret = new_secret()
    server, port = start_store_server("127.0.0.1", 0, secret)
    try:
        yield secret, port
    finally:
        server.close()
