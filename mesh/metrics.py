"""Prometheus metrics over HTTP, for the controller and hosts alike (`--metrics ADDR:PORT`).

Each service keeps its metrics in a registry of its own (services/controller/metrics.py,
services/host/metrics.py) and serves it here: `GET /metrics` in Prometheus' text format. The
server runs in the service's own event loop, not in a thread as prometheus_client's
`start_http_server` does, so collectors read the service's state where it changes, without
locks, and the server stops with the service.
"""

import logging
from collections.abc import Callable
from typing import Any

import anyio
from anyio.abc import SocketStream, TaskStatus
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    exposition,
)
from prometheus_client.exposition import generate_latest

from mesh.errors import MeshError
from mesh.looplag import LoopLag

log = logging.getLogger(__name__)

DEFAULT_ADDR = "127.0.0.1"  # loopback unless an address is given
HEAD_LIMIT = 8 * 1024  # bytes of request line and headers; a scraper sends a few hundred
READ_WITHIN = 5.0  # a client that does not finish its request in this long is dropped

Listen = tuple[str, int]
# The text format every Prometheus reads (2.x included: Debian's); prometheus_client 0.22+
# calls its latest 1.0.0, which only differs for names outside [a-zA-Z0-9_:], never ours.
CONTENT_TYPE = getattr(exposition, "CONTENT_TYPE_PLAIN_0_0_4", CONTENT_TYPE_LATEST)


class MetricsError(MeshError):
    """The metrics endpoint cannot listen where it was asked to."""


def parse_listen(text: str) -> Listen:
    """`ADDR:PORT`, `[V6ADDR]:PORT` or `PORT` (meaning 127.0.0.1:PORT). Raises ValueError
    saying what is wrong (the command line names the flag)."""
    addr, sep, port = text.rpartition(":")
    if not sep:
        addr = DEFAULT_ADDR
    addr = addr.removeprefix("[").removesuffix("]")
    if not addr or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not ADDR:PORT or PORT (a port 1 to 65535)")
    return addr, int(port)


def url(listen: Listen) -> str:
    addr, port = listen
    return f"http://{f'[{addr}]' if ':' in addr else addr}:{port}/metrics"


def verbs(registry: CollectorRegistry) -> Callable[[str, str, float], None]:
    """The verb metrics both services have, fed by mesh/serving.py (the one place verbs are
    counted): requests by verb and outcome (`ok` or the error reply's code) and their
    latency. Returns the observer a serving.Stats calls with (verb, outcome, seconds)."""
    requests = Counter(
        "mesh_verb_requests", "Verb requests answered, by verb and outcome (ok or error code)",
        ["verb", "outcome"], registry=registry,
    )  # fmt: skip
    seconds = Histogram(
        "mesh_verb_duration_seconds", "Time from a verb's request arriving to its reply",
        ["verb"], registry=registry,
        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    )  # fmt: skip

    # Each verb's children, looked up once: `labels()` costs more than the verb `status`
    # itself (4.7 of its 10 µs in the serving path, bench/verbs.py). Verb names are a fixed
    # table's keys (or UNKNOWN) and outcomes error codes, so these stay few.
    counted: dict[tuple[str, str], Any] = {}
    timed: dict[str, Any] = {}

    def observe(verb: str, outcome: str, took: float) -> None:
        count = counted.get((verb, outcome))
        if count is None:
            count = counted[verb, outcome] = requests.labels(verb, outcome)
        count.inc()
        timer = timed.get(verb)
        if timer is None:
            timer = timed[verb] = seconds.labels(verb)
        timer.observe(took)

    return observe


def loop_lag(registry: CollectorRegistry, lag: LoopLag) -> None:
    """The event loop's lag (mesh/looplag.py), now and at worst over its window."""
    Gauge(
        "mesh_event_loop_lag_seconds", "How late the event loop ran a timer, at its last wake-up",
        registry=registry,
    ).set_function(lambda: lag.last)  # fmt: skip
    Gauge(
        "mesh_event_loop_lag_max_seconds",
        f"The event loop's worst lag over the last {lag.window:g} seconds", registry=registry,
    ).set_function(lag.worst)  # fmt: skip


async def serve(
    registry: CollectorRegistry,
    listen: Listen,
    what: str,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `registry` on `listen` until cancelled. Started with `task_group.start`, a port
    that cannot be had is raised (one line) before the service goes on."""
    addr, port = listen
    try:
        listener = await anyio.create_tcp_listener(local_host=addr, local_port=port)
    except OSError as e:
        raise MetricsError(
            f"--metrics: cannot listen on {addr}:{port}: {e.strerror or e}"
        ) from None
    log.info("%s: metrics on %s", what, url(listen))
    task_status.started()

    async def handle(stream: SocketStream) -> None:
        async with stream:
            try:
                await _answer(stream, registry)
            except (anyio.EndOfStream, anyio.BrokenResourceError, TimeoutError, OSError):
                pass  # a scraper that went away: nothing to answer

    async with listener:
        await listener.serve(handle)


async def _answer(stream: SocketStream, registry: CollectorRegistry) -> None:
    head = b""
    with anyio.fail_after(READ_WITHIN):
        while b"\r\n\r\n" not in head and b"\n\n" not in head:
            if len(head) > HEAD_LIMIT:
                await stream.send(_response(431, b"request header too large\n"))
                return
            head += await stream.receive(4096)
    method, _, rest = head.split(b"\n", 1)[0].decode("latin-1").strip().partition(" ")
    path = rest.split(" ", 1)[0].split("?", 1)[0]
    if method not in ("GET", "HEAD"):
        await stream.send(_response(405, b"only GET\n", allow=True))
    elif path == "/metrics":
        body = generate_latest(registry)
        await stream.send(_response(200, body, CONTENT_TYPE, head_only=method == "HEAD"))
    elif path == "/":
        await stream.send(_response(200, b"mesh: metrics at /metrics\n"))
    else:
        await stream.send(_response(404, b"not found: metrics are at /metrics\n"))


_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 431: "Too Large"}


def _response(
    status: int,
    body: bytes,
    content_type: str = "text/plain; charset=utf-8",
    *,
    head_only: bool = False,
    allow: bool = False,
) -> bytes:
    lines = [
        f"HTTP/1.1 {status} {_REASONS[status]}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: close",  # one request per connection: nothing to keep alive or time out
        *(["Allow: GET, HEAD"] if allow else []),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (b"" if head_only else body)
