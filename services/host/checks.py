"""Health checks: tcp, http, exec, nats. One check passes or fails; `passes` consecutive passes
make a process healthy (counted by the supervisor)."""

import functools
import ssl
import subprocess
from collections.abc import Sequence
from pathlib import Path

import anyio
import httpx
from nats.aio.client import Client

from mesh.errors import reason
from mesh.modules.compose import DProcess
from mesh.modules.gate import duration
from services.host import sockets
from services.host.processes import credentials, kill_group


async def once(
    p: DProcess,
    *,
    nc: Client,
    cwd: Path,
    uid: int | None,
    gid: int | None,
    env: dict[str, str],
    groups: Sequence[int] = (),
    session: int | None = None,
    kin: Sequence[int] = (),
) -> tuple[bool, str]:
    """Run the process's check once: (passed, why not). An exec check runs as the process
    does: its account, with the account's supplementary `groups`. With `session` (the
    instance's pid, as it leads its own session), a tcp check passes only if that session
    holds the port, and an http check on this machine only if nothing but it (and `kin`, the
    sessions of its own other version) does."""
    c = p.check
    assert c is not None
    limit = duration(c.timeout)
    try:
        with anyio.fail_after(limit):
            if c.tcp is not None:
                stream = await anyio.connect_tcp("127.0.0.1", c.tcp)
                await stream.aclose()
                if session is not None and not sockets.held_by_session(c.tcp, session):
                    return False, f"port {c.tcp} answers, but not from this process"
                return True, ""
            if c.http is not None:
                return await _http(c.http, timeout=limit, session=session, kin=kin)
            if c.exec is not None:
                return await _exec(c.exec, cwd=cwd, env=env, uid=uid, gid=gid, groups=groups)
            if c.nats is not None:
                await nc.request(c.nats, b"{}", timeout=limit)
                return True, ""
    except (TimeoutError, httpx.TimeoutException):
        return False, f"no answer within {c.timeout}"
    except (OSError, httpx.HTTPError) as e:
        return False, reason(e)
    except Exception as e:  # a nats error: no responders, timeout
        return False, type(e).__name__
    return False, "no check"


async def _exec(
    argv: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    uid: int | None,
    gid: int | None,
    groups: Sequence[int],
) -> tuple[bool, str]:
    process = await anyio.open_process(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True, **credentials(uid, gid, groups),
    )  # fmt: skip
    try:
        await process.wait()
    finally:
        kill_group(process.pid)  # a timed-out check leaves nothing behind
        with anyio.CancelScope(shield=True):
            await process.wait()
    return process.returncode == 0, f"exit code {process.returncode}"


@functools.cache
def _tls() -> ssl.SSLContext:
    # Once: loading the certificates for every check costs ~25 ms of the host's loop each time.
    # The machine's own trust store, as a TLS client on it would use.
    return ssl.create_default_context()


LOOPBACK = ("127.0.0.1", "localhost", "::1")  # this machine: its sockets are in its /proc


async def _http(
    url: str, *, timeout: float, session: int | None = None, kin: Sequence[int] = ()
) -> tuple[bool, str]:
    """2xx passes; anything else fails with its status. A redirect is not followed (the check
    asks this process, not wherever it points), no proxy from the host's environment is used,
    and the body is never read. With `session`, an address on this machine counts only if the
    process listens on it and nothing else does but its own other version (who answered cannot
    be told otherwise; a start-first pair tells them apart by the URL, docs/modules.md)."""
    async with (
        httpx.AsyncClient(
            timeout=timeout, follow_redirects=False, trust_env=False, verify=_tls()
        ) as client,
        client.stream("GET", url) as response,
    ):
        code = response.status_code
    target = httpx.URL(url)
    if session is not None and target.host in LOOPBACK:
        port = target.port or (443 if target.scheme == "https" else 80)
        mine, others = sockets.listeners(port, session, kin=kin)
        if not mine:
            return False, f"port {port} answers, but not from this process"
        if others:
            return False, (f"port {port} is listened on by another process too: its answer "
                           "cannot be told from this process's")  # fmt: skip
    return 200 <= code < 300, f"HTTP status {code}"
