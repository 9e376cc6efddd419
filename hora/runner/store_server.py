"""The job's rendezvous store, run by the launcher.

hora's store service (:mod:`hora.common.job.store_service`) serves the job, listening only on
the address the workers use (loopback for a job on this machine). Only processes that prove the
job secret can use it. Workers find it through ``HORA_RENDEZVOUS_ADDR``/``PORT`` and get the
secret in ``HORA_SECRET_KEY`` (see :mod:`hora.common.job.store`).
"""

from __future__ import annotations

from typing import Any

from hora.common.job.store import (
    StoreClient,
    new_secret,
    report_failure,
    start_store_server,
)
from hora.common.job.store_keys import CAUSE, exit_key
from hora.common.vocabulary import settings_table as table


class RendezvousServer:
    """Start the store on ``bind_address`` (port chosen by the OS unless given).

    Args:
        bind_address: the interface address workers connect to.
        port: 0 for any free port.
        secret: the job secret; a fresh one when omitted.
        timeout_s: how long store operations may block.
    """

    def __init__(
        self,
        bind_address: str = "127.0.0.1",
        port: int = 0,
        secret: str | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        self.secret = secret or new_secret()
        self.address = bind_address
        self._store: Any
        self._store, self.port = start_store_server(bind_address, port, self.secret)
        self.client = StoreClient(bind_address, self.port, self.secret, timeout_s)

    def env(self) -> dict[str, str]:
        """Variables that tell workers where the store is and what the secret is."""
        return {
            table.RENDEZVOUS_ADDR.env: self.address,
            table.RENDEZVOUS_PORT.env: str(self.port),
            table.SECRET_KEY.env: self.secret,
        }

    def record_exit(self, rank: int, text: str) -> None:
        """Tell the surviving workers how a rank's process ended.

        The first rank recorded is also the job's cause, unless a rank already claimed it (one
        that exits on an uncaught exception does so itself). Otherwise a rank that ended without
        a word (killed by a signal, its host or ssh connection lost) would leave the cause to
        the first survivor that exits on the error its loss raised.
        """
        try:
            self.client.store.compare_set(
                self.client.key(CAUSE), "", self.client.signed(CAUSE, text.encode())
            )
        except RuntimeError:
            pass
        self.client.set_signed(exit_key(rank), text.encode())
        report_failure(self.client, text)

    def cause_rank(self) -> int | None:
        """The rank that reported ending the job on purpose (e.g. an uncaught exception)."""
        if self.client is None or not self.client.check(CAUSE):
            return None
        # The engine writes this key with compare_set (first writer wins), signed with the
        # key's name like set_signed values.
        try:
            text = self.client.get_signed(CAUSE).decode()
        except Exception:  # an unsigned value is ignored
            return None
        words = text.split()
        if len(words) >= 2 and words[0] == "rank" and words[1].isdigit():
            return int(words[1])
        return None

    def close(self) -> None:
        """Stop serving and close every connection."""
        self.client = None  # type: ignore[assignment]
        if self._store is not None:
            self._store.close()
        self._store = None
