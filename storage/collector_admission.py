"""The collector's admission of connections: the tokens /control and /ingest present in their
handshake, and the connection limits with their reserves (a 503 past them)."""

from __future__ import annotations

from http import HTTPStatus

from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response

from storage.collector_config import bearer, presented_token
from storage.collector_core import CollectorCore, Slot
from wire.control import same_secret


def _peer(connection: ServerConnection) -> str:
    """The peer's address without its port ("" when unknown)."""
    addr = connection.remote_address
    return str(addr[0]) if isinstance(addr, tuple) and addr else ""


class Admission(CollectorCore):
    """Who may open a connection, and how many of each kind are open."""

    def _gate(self, connection: ServerConnection, request: Request, path: str) -> Response | None:
        """Check the token an /ingest or /control handshake presents and admit the connection
        (None), or the 401 or 503 that refuses it."""
        gate = self.config.control_gate()
        if path == "/control" and gate:
            token = presented_token(request)
            if not any(same_secret(token, t) for t in gate):
                self.metrics.refuse("auth")
                return connection.respond(
                    HTTPStatus.UNAUTHORIZED,
                    "missing or wrong token: /control needs the collector's --control-token as "
                    "'Authorization: Bearer <token>' or ?token=\n",
                )
        kind = "control" if path == "/control" else "unidentified"
        tokens = self.config.publish_tokens() if path == "/ingest" else ()
        presented = bearer(request) if tokens else None
        if presented is not None:
            if not any(same_secret(presented, t) for t in tokens):
                self.metrics.refuse("auth")
                return connection.respond(
                    HTTPStatus.UNAUTHORIZED, "wrong publish token in the Authorization header\n"
                )
            kind = "ingest"
        return self._admit(connection, kind)

    def _admit(self, connection: ServerConnection, kind: str) -> Response | None:
        """Count a new connection against the limits (None: admitted), or the 503 that refuses
        it. Two invariants keep the reserves: /control and connections without a credential yet
        together leave ``reserved`` slots to /ingest connections with one, and those together
        with the ones without a credential leave as many to /control; the ones without a
        credential also have their own small pool, and a share of it per peer address."""
        cfg = self.config
        n, reserved = cfg.max_connections, cfg.reserved
        total, control, unidentified = self._n_conns, self._n_control, self._n_unidentified
        engines = total - control - unidentified  # /ingest with a credential
        peer = _peer(connection)
        full = f"too many connections (at most {n})"
        if total >= n:
            why = full
        elif kind == "control":
            why = "" if control + unidentified < n - reserved else full
        elif kind == "ingest":
            why = "" if engines + unidentified < n - reserved else full
        elif unidentified >= cfg.max_unidentified:
            why = f"too many connections without a hello yet (at most {cfg.max_unidentified})"
        elif self._unidentified_by_peer.get(peer, 0) >= cfg.max_unidentified_per_peer:
            why = (
                "too many connections without a hello yet from this address (at most "
                f"{cfg.max_unidentified_per_peer})"
            )
        elif control + unidentified >= n - reserved or engines + unidentified >= n - reserved:
            why = full
        else:
            why = ""
        if why:
            self.metrics.refuse(
                "too_many_unidentified" if "hello" in why else "too_many_connections"
            )
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, why + "\n")
        slot = Slot(kind, peer)
        self._slots[connection] = slot
        self._n_conns += 1
        if kind == "control":
            self._n_control += 1
        elif kind == "unidentified":
            self._n_unidentified += 1
            self._unidentified_by_peer[peer] = self._unidentified_by_peer.get(peer, 0) + 1
        # the slot is freed when the handler ends, or when the connection closes should the
        # handshake fail before any handler runs
        self._spawn(self._release_when_closed(connection))
        return None

    def _identified(self, connection: ServerConnection) -> None:
        """An unidentified /ingest connection showed its credential: it leaves the small pool."""
        slot = self._slots.get(connection)
        if slot is None or slot.kind != "unidentified":
            return
        slot.kind = "ingest"
        self._forget_unidentified(slot.peer)

    def _forget_unidentified(self, peer: str) -> None:
        self._n_unidentified -= 1
        left = self._unidentified_by_peer.get(peer, 0) - 1
        if left > 0:
            self._unidentified_by_peer[peer] = left
        else:
            self._unidentified_by_peer.pop(peer, None)

    def _release(self, connection: ServerConnection) -> None:
        slot = self._slots.pop(connection, None)
        if slot is None:
            return
        self._n_conns -= 1
        if slot.kind == "control":
            self._n_control -= 1
        elif slot.kind == "unidentified":
            self._forget_unidentified(slot.peer)

    async def _release_when_closed(self, connection: ServerConnection) -> None:
        try:
            await connection.wait_closed()
        finally:
            self._release(connection)
