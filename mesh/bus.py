"""The NATS connection and the one way to make a request: retried with backoff up to a deadline.

A controller handover or crash leaves a short window with no responder; callers (the command
line, a registering host) ride over it by retrying "no responders" and timeouts until their own
deadline, so a user sees a slow answer rather than an error.
"""

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import nats
from nats.aio.client import Client
from nats.errors import NoRespondersError, NoServersError
from nats.errors import TimeoutError as NatsTimeout

log = logging.getLogger(__name__)


class Unreachable(Exception):
    """The NATS server at the URL did not accept a connection."""


class NoAnswer(Exception):
    """Nobody answered the subject before the deadline."""


async def _quiet(_: Exception) -> None:
    # nats-py logs every reconnect attempt by default; the caller reports what matters.
    return None


async def connect(
    url: str,
    *,
    name: str,
    creds: str | None = None,
    reconnect: bool = True,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
) -> Client:
    """Connect to NATS. Services reconnect forever; one-shot clients fail fast."""
    options: dict[str, Any] = {
        "servers": [url],
        "name": name,
        "error_cb": _quiet,
        "connect_timeout": 2,
        "allow_reconnect": reconnect,
        "max_reconnect_attempts": -1 if reconnect else 1,
        "reconnect_time_wait": 0.25,
        "ping_interval": 5,
        "max_outstanding_pings": 2,
    }
    if creds:
        options["user_credentials"] = creds
    if on_disconnect:
        options["disconnected_cb"] = on_disconnect
    if on_reconnect:
        options["reconnected_cb"] = on_reconnect
    try:
        return await nats.connect(**options)
    except (NoServersError, OSError, NatsTimeout) as e:
        raise Unreachable(f"cannot reach NATS at {url}: {e or type(e).__name__}") from None


async def request(
    nc: Client,
    subject: str,
    body: bytes,
    *,
    deadline: float,
    attempt_timeout: float = 1.0,
) -> bytes:
    """Request `subject`, retrying no-responders and timeouts with backoff until `deadline`
    (a time.monotonic() value). Raises NoAnswer when the deadline passes."""
    backoff = 0.05
    last = "no responders"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise NoAnswer(f"no answer on {subject} ({last})")
        try:
            msg = await nc.request(subject, body, timeout=min(attempt_timeout, max(left, 0.05)))
            return msg.data
        except NoRespondersError:
            last = "no responders"
        except NatsTimeout:
            last = "timed out"
        left = deadline - time.monotonic()
        if left <= 0:
            raise NoAnswer(f"no answer on {subject} ({last})")
        await anyio.sleep(min(backoff, left))
        backoff = min(backoff * 2, 0.5)
