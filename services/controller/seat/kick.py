"""Closing a cut-off holder's NATS connection at a takeover (docs/architecture.md, the seat).

A holder whose link went silent keeps its place in the verb queue group until nats-server's
pings drop it (20-30 s); meanwhile about half of every request's attempts go to it and vanish.
So each holder records on the bus where its connection is (the server's id and its client id,
services/controller/seat/epochs.py), and the next holder, when the seat did not come to it by a
handover, asks that server to close that connection (`$SYS.REQ.SERVER.<id>.KICK`, routed to it
across a cluster) as soon as its own verbs are subscribed. The request needs the system
account's kicker (mesh.auth.system), on a connection of its own for that one request; a
controller without its credentials does not kick, and the server's pings end the window as
before.
"""

import json
import logging

import anyio
import msgspec
from nats.aio.client import Client

from mesh import bus
from mesh.errors import reason

log = logging.getLogger("mesh.controller")

CONNECT_WITHIN = 2.0  # the kicker's own connection (TLS, its nkey)
KICK_WITHIN = 1.0  # one try: the answer comes from the server, wherever it is in the cluster


class Where(msgspec.Struct, frozen=True):
    """A connection: the nats-server it is on and its client id there."""

    server: str
    client: int


def where(nc: Client) -> Where | None:
    """Where `nc` is connected now (None while it is not)."""
    info = nc._server_info or {}
    server, client = info.get("server_id"), nc._client_id
    return Where(server=server, client=client) if server and client else None


class Kicker:
    """The system account's kicker, if this controller has its credentials: a connection of
    its own for each kick, closed at once, so the system account is on the bus only for the
    moment it is needed."""

    def __init__(self, url: str, creds: str | None) -> None:
        self.url = url
        self.creds = creds
        if not creds:
            log.info("no system credentials (--system-creds): a cut-off holder's connection "
                     "stays until nats-server drops it")  # fmt: skip

    async def kick(self, whom: Where, *, holder: str) -> bool:
        """Ask `whom`'s server to close it; whether the server said it did."""
        if not self.creds:
            return False
        subject = f"$SYS.REQ.SERVER.{whom.server}.KICK"
        nc = None
        try:
            with anyio.fail_after(CONNECT_WITHIN):
                nc = await bus.connect(self.url, name="mesh-controller kicker", creds=self.creds,
                                       reconnect=False)  # fmt: skip
            msg = await nc.request(subject, json.dumps({"cid": whom.client}).encode(),
                                   timeout=KICK_WITHIN)  # fmt: skip
            error = json.loads(msg.data).get("error")
        except Exception as e:
            log.warning("could not close %s's NATS connection: %s", holder, reason(e))
            return False
        finally:
            if nc is not None:
                await bus.close(nc, drain=False, within=1.0)
        if error:  # gone already (its server dropped it, or it exited): nothing to do
            log.info("%s's NATS connection (client %d) is gone already: %s", holder,
                     whom.client, error.get("description", error))  # fmt: skip
            return False
        log.info("closed %s's NATS connection (client %d on %s)", holder, whom.client,
                 whom.server[:8])  # fmt: skip
        return True
