"""The NATS connection and the one way to make a request: retried with backoff up to a deadline.

A controller handover or crash leaves a short window with no responder; callers (the command
line, a registering host) ride over it by retrying "no responders" and timeouts until their own
deadline, so a user sees a slow answer rather than an error.
"""

import logging
import re
import secrets
import ssl
import time
import urllib.parse
import weakref
from asyncio import CancelledError
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.aio.transport import TcpTransport
from nats.errors import NoRespondersError, NoServersError
from nats.errors import TimeoutError as NatsTimeout

from mesh import config, subjects, wire
from mesh.auth import creds as credentials
from mesh.auth import tls
from mesh.errors import MeshError, reason
from mesh.ratelimit import Said, more

log = logging.getLogger(__name__)


class _AsyncioNoise(logging.Filter):
    # asyncio warns at every TLS connection nats-py closes (its protocol's eof_received returns
    # True, which TLS transports ignore): harmless, and it would fill every log. A drain that
    # we cut at its deadline leaves nats-py's gather with a CancelledError nobody reads: our
    # own line already says the drain did not finish, and the traceback says nothing more.
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "eof_received()" in message:
            return False
        # exc_info is a tuple, or None, or False (asyncio's handler for a context without an
        # exception): only a tuple holds one
        cancelled = isinstance(record.exc_info, tuple) and isinstance(
            record.exc_info[1], CancelledError
        )
        return not (cancelled and "exception was never retrieved" in message)


logging.getLogger("asyncio").addFilter(_AsyncioNoise())


async def _process_pong(self: Client) -> None:
    """nats-py's own, but a PONG whose flush gave up already (timed out, or its task was
    cancelled: a hold's round trips at its end) is skipped. nats-py sets the result of that
    cancelled future, the InvalidStateError ends its read loop, and the connection then reads
    nothing more, silently, until its own pings find it stale 10-15 s later: a controller that
    had just handed the seat over stood by deaf, missed the next `handover` and took the seat
    13 s late (the planned handover's rare lost requests, issue 29)."""
    if self._pongs:
        future = self._pongs.pop(0)
        if not future.done():
            future.set_result(True)
        self._pongs_received += 1
        self._pings_outstanding = 0


Client._process_pong = _process_pong  # type: ignore[method-assign]

_start_tls = TcpTransport.connect_tls


async def _connect_tls(self: TcpTransport, *args: Any, **kwargs: Any) -> None:
    """nats-py's own, but a handshake that fails (a server killed during it, a certificate not
    trusted) leaves no plain stream behind. asyncio's start_tls took that socket's protocol and
    closed the socket, so the plain writer's `wait_closed` never ends, and nats-py awaits it as
    it closes after the failed try: a command connecting to a cluster while a server died
    waited for ever (the nemesis, issue 29)."""
    try:
        await _start_tls(self, *args, **kwargs)
    except BaseException:
        self._io_reader = self._io_writer = None
        self._bare_io_reader = self._bare_io_writer = None
        raise


TcpTransport.connect_tls = _connect_tls  # type: ignore[method-assign]


class Unreachable(MeshError):
    """The NATS server at the URL did not accept a connection."""


class Untrusted(Unreachable):
    """A server answered over TLS with a certificate of a CA this client was not given."""


class NoAnswer(Exception):
    """Nobody answered the subject before the deadline."""


class Unauthorized(MeshError):
    """The NATS server refused the connection: no credentials, or ones it does not know."""


_VIOLATION = re.compile(
    r"permissions violation for (publish|subscription) to \"?([^\"']+)", re.IGNORECASE
)
_REFUSED = re.compile(r"authorization violation|authentication", re.IGNORECASE)


def violation(error: Exception) -> str | None:
    """What the server refused, in words, if `error` is a permissions violation it reported
    (nats-py hands those to the error callback; the publish or subscribe is silently dropped)."""
    found = _VIOLATION.search(str(error))
    if found is None:
        return None
    what = "publish to" if found.group(1).lower() == "publish" else "subscribe to"
    return f"{what} {found.group(2).strip()}"


# nats-py reports some errors once per message: a message a subscription's pending limits
# dropped (SlowConsumerError), a reply the server refused because it came after the server had
# forgotten the request (a permissions violation: a backlog answered minutes late). A host's
# flood made those 500,000 lines in a minute (issue 39): each kind is said once a window, with
# a count. Kinds are few: the error's class, and the subscription or the refused subject's
# first token (an inbox prefix: one per identity), never the message's own subject.
_ERRORS_SAID = Said[tuple[str, str]](burst=3, every=10.0)


def _kind(e: Exception) -> tuple[str, str]:
    if isinstance(e, nats.errors.SlowConsumerError):
        return type(e).__name__, e.sub.subject if e.sub is not None else ""
    refused = violation(e)
    if refused is not None:
        return "violation", refused.partition(".")[0][:80]
    return type(e).__name__, ""


async def _quiet(e: Exception) -> None:
    # Connection trouble is reported by the callers (once, not per reconnect attempt); anything
    # else, such as an exception escaping a subscription callback, must not vanish.
    if isinstance(
        e,
        OSError
        | NatsTimeout
        | nats.errors.ConnectionClosedError
        | nats.errors.StaleConnectionError
        | nats.errors.UnexpectedEOF,
    ):
        return
    kind = _kind(e)
    unsaid = _ERRORS_SAID.unsaid(kind)
    if unsaid is None:
        return
    if isinstance(e, nats.errors.SlowConsumerError):  # its own words name the Subscription object
        log.warning("nats: the subscription to %s is behind: its pending limits dropped a message "
                    "on %s%s", kind[1], e.subject[:128], more(unsaid))  # fmt: skip
    else:
        log.warning("nats: %s: %s%s", type(e).__name__, str(e)[:300], more(unsaid))


# Per connection: the subscriptions (by sid) whose messages are checked as they are parsed.
_ADMITTING: "weakref.WeakKeyDictionary[Client, dict[int, Callable[[str, bytes], bool]]]" = (
    weakref.WeakKeyDictionary()
)


def admit(sub: Subscription, admits: Callable[[str, bytes], bool]) -> None:
    """Drop each message of `sub` that `admits(subject, body)` refuses as nats-py parses it:
    before it builds a message, queues it or calls back (`admits` may keep the body for later).
    A host flooding its own subjects then costs the subscriber a check per message, where a
    message would cost several times that and, its queue full, crowd out other hosts'
    (docs/architecture.md, the hosts' traffic). What is dropped still counts as received in the
    connection's stats (the traffic is there: a link busy with it is not silent). `admits` must
    be quick; one that raises lets the message in."""
    nc: Client = sub._conn
    checks = _ADMITTING.get(nc)
    if checks is None:
        checks = _ADMITTING[nc] = {}
        process = nc._process_msg

        async def admitting(
            sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
        ) -> None:
            check = checks.get(sid)
            if check is not None:
                try:
                    admitted = check(subject.decode(), data)
                except Exception:
                    admitted = True
                if not admitted:
                    nc.stats["in_msgs"] += 1
                    nc.stats["in_bytes"] += len(data)
                    return
            await process(sid, subject, reply, data, headers)

        nc._process_msg = admitting  # type: ignore[method-assign]
    for sid in [sid for sid in checks if sid not in nc._subs]:  # unsubscribed since
        del checks[sid]
    checks[sub._id] = admits


class Link:
    """The state of one connection, fed by nats-py's disconnect/reconnect callbacks, so a
    service can act on an outage that lasts (step down) and on its end (forgive lost beats)."""

    def __init__(self, name: str = "the NATS connection") -> None:
        self.name = name  # in its lines: a service with two connections says which
        self.up = True
        self.on_up: Callable[[], None] | None = None
        self._changed = anyio.Event()
        self.answered_at = time.monotonic()  # the server's last answer to our round trips
        # When the round trip the server last answered was sent: whatever the server sent us
        # before that has been read (answered_at is later by the backlog read before the PONG)
        self.caught_up = self.answered_at
        self.heard_at = self.answered_at  # when anything last came in on the connection
        self.silent = False  # the round trips found no answer for longer than they allow
        self.nc: Client | None = None  # set by connect: its own close is not a lost link

    async def round_trips(
        self, nc: Client, *, every: float, within: float, late: float | None = None,
        lagging: Callable[[], bool] = lambda: False,
    ) -> None:  # fmt: skip
        """Forever: every `every` seconds a PING the server must answer within `within`;
        `answered_at` is when it last did, and `silent` says it has not for `within` + `every`
        and nothing else came in meanwhile either (kept once the round trips stop: what they
        last found). A silent link shows here within seconds, where nats-py's own pings take
        10-15 s (and over TLS its close then waits out the SSL shutdown before it reports the
        disconnection). A PONG that is only late, behind a backlog of messages this process
        has not read yet (a storm of requests), is not silence: the messages keep coming.
        While `lagging()` (this process's own event loop has run late lately: a PONG may sit
        unread behind it), silence takes `late` + `every` instead. While nats-py says the
        connection is down (it reconnects), nothing here is silence: `down_for` judges that."""
        self.answered_at = self.heard_at = self.caught_up = time.monotonic()
        self.silent = False
        received = nc.stats["in_msgs"]
        # One PING out at a time, each given long to come back: nats-py fails its read loop on
        # a PONG whose flush has timed out already, so silence is judged here, not by the
        # flush's own timeout.
        patience = 2 * max(within, late or 0.0)
        outstanding = False

        async def ping() -> None:
            nonlocal outstanding
            outstanding = True
            sent = time.monotonic()
            try:
                with anyio.fail_after(patience + 1):
                    await nc.flush(timeout=patience)
                self.answered_at, self.caught_up = time.monotonic(), sent
            except Exception:  # timeouts, closed or reconnecting: all say "no answer"
                pass
            finally:
                outstanding = False

        async with anyio.create_task_group() as pings:
            while True:
                await anyio.sleep(every)
                if not outstanding:
                    pings.start_soon(ping)
                now = time.monotonic()
                if nc.stats["in_msgs"] != received:
                    received, self.heard_at = nc.stats["in_msgs"], now
                quiet = now - max(self.answered_at, self.heard_at)
                allowed = late if late is not None and lagging() else within
                # An outage nats-py reports (reconnecting, maybe to another server of the
                # cluster) is `down_for`'s to judge: silence is of a link it thinks is up.
                self.silent = nc.is_connected and quiet > allowed + every
                self._kick()

    def answers(self, nc: Client) -> bool:
        """NATS is there to hear us: connected, and not silent to our round trips (draining
        on a silent link would only time out)."""
        return nc.is_connected and not self.silent

    def unanswered(self) -> None:
        """A drain or flush of ours ran out of time: that says what a round trip would."""
        self.silent = True
        self._kick()

    async def silent_for(self) -> None:
        """Return once the round trips find the server silent."""
        while not self.silent:
            await self._changed.wait()

    def _kick(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def disconnected(self) -> None:
        closing = self.nc is not None and (self.nc.is_closed or self.nc.is_draining)
        if self.up and not closing:  # nats-py says "disconnected" on our own close too
            log.info("lost %s; reconnecting", self.name)
        self.up = False
        self._kick()

    async def reconnected(self) -> None:
        log.info("%s is back", self.name)
        self.up = True
        # the server answered us just now (what it sent before is lost: the callers forgive it)
        self.answered_at = self.heard_at = self.caught_up = time.monotonic()
        if self.on_up:
            self.on_up()
        self._kick()

    async def down_for(self, grace: float) -> None:
        """Return once the connection has been down for `grace` seconds without a break."""
        while True:
            while self.up:
                await self._changed.wait()
            with anyio.move_on_after(grace) as waiting:
                while not self.up:
                    await self._changed.wait()
            if waiting.cancelled_caught:
                return


async def connect(
    url: str,
    *,
    name: str,
    creds: str | None = None,
    reconnect: bool = True,
    link: Link | None = None,
    denied: Callable[[str], None] | None = None,
    ca: str | None = None,
    beside: Client | None = None,
) -> Client:
    """Connect to NATS. Services reconnect forever; one-shot clients fail fast. `beside`: first
    to the server that connection is on (a second connection of one service, which is then
    lost with the first when that server goes, not at another moment).

    `url` may list several servers, comma-separated (a cluster): the client is given all of
    them and moves to another when its server goes. TLS is used whenever the mesh's CA is known
    (`ca`, the CA a credentials file carries, MESH_CA) and required for `tls://` URLs; only the
    mesh's CA is trusted.

    `creds` is a credentials file (mesh.auth.creds): its identity authenticates the connection
    and its inbox prefix is the one the server lets this identity subscribe to. `denied` hears
    every permissions violation the server reports (what was refused, in words)."""

    connecting = True
    told = False

    async def on_error(e: Exception) -> None:
        nonlocal told
        if isinstance(e, nats.errors.Error) and _REFUSED.search(str(e)):
            if connecting:  # raised out of nc.connect: wrong credentials do not get better
                raise Unauthorized(_unauthorized(url, creds))
            if not told:  # revoked while running: say so once, not at every reconnect
                log.warning("%s", _unauthorized(url, creds))
                told = True
                nc.options["reconnect_time_wait"] = 5.0  # and knock less often
            return
        refused = violation(e)
        if refused is not None and denied is not None:
            denied(refused)
            return
        await _quiet(e)

    options = _options(url, name=name, reconnect=reconnect, creds=creds, ca=ca)
    if beside is not None and beside.connected_url is not None:
        on = beside.connected_url.netloc
        options["servers"].sort(key=lambda s: urllib.parse.urlsplit(s).netloc != on)
        options["dont_randomize"] = True
    options["error_cb"] = on_error
    nc = Client()
    if link:
        link.nc = nc
        options["disconnected_cb"] = link.disconnected
        options["reconnected_cb"] = link.reconnected
    try:
        await nc.connect(**options)
    except ssl.SSLCertVerificationError as e:
        raise _untrusted(url, e, given_ca="tls" in options) from None
    except (NoServersError, OSError, NatsTimeout) as e:
        raise Unreachable(f"cannot reach NATS at {url}: {reason(e)}") from None
    except Unauthorized:
        await _discard(nc)
        raise
    except nats.errors.Error as e:
        await _discard(nc)
        if _REFUSED.search(str(e)):
            raise Unauthorized(_unauthorized(url, creds)) from None
        raise
    connecting = False
    if creds:
        _OPERATORS[nc] = credentials.read(creds).operator
    return nc


# Which operator each connection authenticated as (its credentials file's `# mesh-operator:`):
# the client asks its changes on that operator's own subjects (mesh.client.asking).
_OPERATORS: "weakref.WeakKeyDictionary[Client, str | None]" = weakref.WeakKeyDictionary()


def authenticated(nc: Client) -> bool:
    """Whether `nc` connected with credentials."""
    return nc in _OPERATORS


def operator_of(nc: Client) -> str | None:
    """The operator `nc` connected as, None for a connection without operator credentials."""
    return _OPERATORS.get(nc)


def _options(
    url: str, *, name: str, reconnect: bool, creds: str | None, ca: str | None
) -> dict[str, Any]:
    """nats-py's options but the callbacks: the servers, how to reconnect and ping, who we
    are (credentials and their inbox prefix), TLS."""
    servers = config.servers(url)
    options: dict[str, Any] = {
        "servers": servers,
        "name": name,
        "connect_timeout": 2,
        # A one-shot client of a cluster moves to another server when its own goes (a
        # `mesh assign --wait` must ride over the loss of one), but gives up within seconds
        # when none answers; a one-shot client of a lone server fails at once.
        "allow_reconnect": reconnect or len(servers) > 1,
        "max_reconnect_attempts": -1 if reconnect else 2,
        "reconnect_time_wait": 0.25,
        "ping_interval": 5,
        "max_outstanding_pings": 2,
    }
    held = credentials.read(creds) if creds else None
    if held is not None:
        if held.jwt:
            options["user_credentials"] = held.path
        else:
            options["nkeys_seed_str"] = held.seed
        options["inbox_prefix"] = held.inbox
    options.update(_tls(url, ca, held))
    return options


def _untrusted(url: str, e: ssl.SSLCertVerificationError, *, given_ca: bool) -> Untrusted:
    """A mesh's server answered, over TLS, with a certificate of a CA this command was not
    given: most often a shell without the mesh's settings (`given_ca`: one was given, or came
    with the credentials, and it is another mesh's)."""
    needs = (
        "the CA it was given did not sign it: is that this mesh's CA? (MESH_CA or --ca)"
        if given_ca
        else "it needs the mesh's CA (MESH_CA or --ca) and credentials (MESH_CREDS)"
    )
    return Untrusted(
        f"NATS at {url} answers over TLS with a certificate this command cannot check "
        f"(certificate verify failed: {e.verify_message}): {needs}"
    )


def _tls(url: str, ca: str | None, held: credentials.Creds | None) -> dict[str, Any]:
    """nats-py's TLS options: a context trusting the mesh's CA alone, when one is known."""
    # Given (--ca, MESH_CA) first, so a changed CA can be named over the one a file carries.
    cafile = ca or config.ca()
    cadata = held.ca if held is not None and cafile is None else None
    if cafile is None and cadata is None:
        if any(s.startswith("tls://") for s in config.servers(url)):
            raise Unreachable(
                f"{url} is TLS and the mesh's CA is not known: set MESH_CA (or --ca) to its "
                "certificate, or use a credentials file that carries it"
            )
        return {}
    try:
        return {"tls": tls.client_context(cafile=cafile, cadata=cadata)}
    except tls.TlsError as e:
        raise Unreachable(f"cannot connect to {url}: {e}") from None


def _unauthorized(url: str, creds: str | None) -> str:
    if not creds:
        return (
            f"NATS at {url} refused a connection without credentials: set MESH_CREDS "
            "(or --creds) to a credentials file"
        )
    return f"NATS at {url} refused the credentials in {creds} (unknown or revoked)"


async def _discard(nc: Client) -> None:
    try:
        await nc.close()
    except Exception:  # half-open after a refusal: nothing left worth reporting
        pass


async def answer(
    msg: Msg,
    serve: Callable[[], Awaitable[object]],
    *,
    service: str = "controller",
    hint: str = "ask for less",
) -> str | None:
    """Reply to a request with what `serve` returns, or with an error reply: a BadRequest's
    code and message, `internal` for anything else (logged under a short id the reply names;
    the exception's text stays in `service`'s log), `too_large` for a reply the NATS server
    would not take, saying what to do (`hint`: a verb that pages names its cursor and limit,
    mesh.paging.HINT). A publish gets no reply. Never raises but for cancellation: a reply that
    cannot be sent is logged, since one caller's request must not take a service down.
    Returns the outcome, `ok` or the error reply's code (None for a publish), for counting."""
    if not msg.reply:
        return None
    outcome = "ok"
    try:
        body = wire.encode(await serve())
    except anyio.get_cancelled_exc_class():
        # The service is stopping (a handover's deadline for slow verbs): say so rather than
        # leave the caller waiting out its timeout; trying again reaches the next holder.
        with anyio.CancelScope(shield=True), anyio.move_on_after(1):
            await _respond(msg, wire.error("unavailable", f"the {service} stopped before it "
                                           "answered; try again"))  # fmt: skip
        raise
    except wire.BadRequest as e:
        outcome = e.code
        body = wire.error(e.code, str(e))
    except Exception:
        ref = secrets.token_hex(4)
        # With its traceback a few times a window: a caller repeating the request that fails
        # must not cost a traceback each (the reply names the id either way).
        unsaid = _ANSWERS_SAID.unsaid(("internal", subjects.last(msg.subject)[:64]))
        if unsaid is not None:
            log.exception("request on %s failed: internal error %s%s", msg.subject[:128], ref,
                          more(unsaid))  # fmt: skip
        outcome = "internal"
        body = wire.error("internal", f"internal error {ref}; see the {service}'s log")
    # nats-py refuses (MaxPayloadError) a payload past the server's max_payload; refused here
    # first, the caller hears why instead of waiting out its timeout.
    limit = msg._client.max_payload  # of the connection the request came in on
    if len(body) > limit:
        verb = subjects.last(msg.subject)[:64]
        unsaid = _ANSWERS_SAID.unsaid(("too_large", verb))
        if unsaid is not None:
            log.warning("reply to %s is %d bytes, more than the NATS server takes (%d): "
                        "answered too_large%s", msg.subject[:128], len(body), limit,
                        more(unsaid))  # fmt: skip
        outcome = "too_large"
        body = wire.error(
            "too_large",
            f"the reply to {verb[:64]} is too large: {len(body)} bytes, more than the NATS "
            f"server takes ({limit}); {hint}",
        )
    await _respond(msg, body)
    return outcome


async def _respond(msg: Msg, body: bytes) -> None:
    """Send a reply; a failure (connection closed or draining, too large, ...) is logged."""
    try:
        await msg.respond(body)
    except Exception as e:
        unsaid = _ANSWERS_SAID.unsaid(("reply", type(e).__name__))
        if unsaid is not None:
            log.warning("could not reply on %s: %s: %s%s", msg.subject[:128], type(e).__name__, e,
                        more(unsaid))  # fmt: skip


# A request's answer can fail once per request (a connection closed under a backlog of them, a
# verb that fails for every caller): said a few times a window per verb, then counted.
_ANSWERS_SAID = Said[tuple[str, str]](burst=3, every=10.0)


CLOSE_WITHIN = 3.0  # a close's bound: a drain past it is cut and the connection just closed


async def close(nc: Client, *, drain: bool = True, within: float = CLOSE_WITHIN) -> None:
    """Drain when connected (in-flight replies go out) and `drain`; otherwise, or once the drain
    has taken half of `within`, just close. Never raises, never takes much longer than `within`,
    even from a cancelled scope, and leaves none of nats-py's tasks behind: a reconnect loop
    that outlived its cancellation kept a stopped host running (issue 29)."""
    with anyio.CancelScope(shield=True):
        try:
            if nc.is_connected and drain:
                with anyio.move_on_after(within / 2):
                    await nc.drain()
            if not nc.is_closed:
                with anyio.move_on_after(within / 2):
                    await nc.close()
        except Exception as e:
            log.warning("closing the NATS connection: %s", reason(e))
        await _end_reconnecting(nc, within=within / 2)


async def _end_reconnecting(nc: Client, *, within: float) -> None:
    """Cancel nats-py's reconnect task until it has ended. Python 3.11's wait_for can swallow
    a cancellation that comes as its connect attempt fails (it raises the OSError instead),
    and nats-py's loop then goes on reconnecting to a server that is gone, for ever."""
    task = nc._reconnection_task
    if task is None or task.done():
        return
    nc._status = Client.CLOSED  # a reconnect that still succeeds must find us closed
    with anyio.move_on_after(within):
        while not task.done():
            task.cancel()
            await anyio.sleep(0.01)
    if not task.done():
        log.warning("closing the NATS connection: its reconnect task did not end")


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
