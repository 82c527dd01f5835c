"""The nats-server side: what every server's configuration includes (the operator, the accounts'
JWTs: mesh/auth/trust.py), pushing a new account JWT to the running servers (a revocation: they
close the revoked users' connections at once), and reloading a server's configuration."""

import os
import signal
from pathlib import Path

from nats.aio.client import Client

from mesh.auth.trust import Revoked, Trust

PUSH_WITHIN = 5.0  # seconds for the servers to take a new account JWT


class ServerNotRunning(Exception):
    pass


def write(path: Path, trust: Trust, revoked: list[Revoked]) -> None:
    text = trust.server_block(sorted(revoked, key=lambda r: r.public))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


async def publish_account(nc: Client, trust: Trust, revoked: list[Revoked]) -> None:
    """Give the running servers the account's JWT (a connection as the folder's claims user):
    one server takes it and its resolver passes it to the cluster's others. Raises nats-py's
    errors (a timeout: no server answered) and ValueError (a server refused it, saying why)."""
    answer = await nc.request("$SYS.REQ.CLAIMS.UPDATE", trust.account_jwt(revoked).encode(),
                              timeout=PUSH_WITHIN)  # fmt: skip
    if b'"error"' in answer.data:
        raise ValueError(answer.data.decode(errors="replace")[:300])


def running_pid(pid_file: Path) -> int | None:
    """The pid in `pid_file` if that process is alive, else None."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, someone else's: the reload will say so
    return pid


def reload(pid_file: Path) -> int:
    """Ask the server whose pid is in `pid_file` to reload its configuration (SIGHUP)."""
    pid = running_pid(pid_file)
    if pid is None:
        raise ServerNotRunning(f"no nats-server is running for {pid_file}")
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        raise ServerNotRunning(f"nats-server (pid {pid}) has stopped") from None
    return pid
