"""`mesh console`: a read-only web page of the fleet, live (docs/operations.md, "What operators
see: the console").

What the page shows comes from the controller's read verbs (status, nodes, modules, plans, plan),
asked at start and again whenever the bus says something changed; the store is never polled.
The bus: hosts' reports (mesh.event.<name>.*) and beats, the seat's announcements, plans'
progress (mesh.plan.<id>), machines drained, undrained or skipped by a plan for their drain
(mesh.machine.<name>). The server keeps each verb's last answer and sends every new one to the
open pages as a server-sent event; a burst of events is one refresh. A machine's page reads a
process's log from its host (`logs`, as `mesh logs` does). Viewer credentials are enough for
all of it. The one thing it changes: run with an operator's credentials that may steer plans
(an admin's, a deployer's), a held plan's page approves or rejects it as that operator
(`plan-approve` bound to the digest shown, `plan-reject` with a reason). Such a write must come
from the console's own page: its Origin, and the session's write token (`/api/me`), which a
page of another site can neither send nor read.

It asks who you are (docs/security.md, the console): over TCP, every request must carry the
console's token (a new one at each start, printed with its URL): `?token=` once, which sets a
cookie and sends the page to its address without the token, then the cookie; or `Authorization:
Bearer`. Over its unix socket (`--socket`, mode 0600), the socket's mode and the peer's uid say
who it is. Anything else is 401: the page, the API and the events alike.
"""

import functools
import hmac
import logging
import os
import re
import secrets
import socket
import stat
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec
import nats.errors
from aiohttp import web
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream
from multidict import MultiDict
from nats.aio.client import Client
from nats.aio.msg import Msg

from mesh import bus, subjects, wire
from mesh.client.asking import VerbFailed, ask, connected
from mesh.client.pages import ask_list
from mesh.errors import MeshError
from mesh.lifetime import stop_on_signals
from mesh.model import (
    AuditReply,
    AuditRequest,
    Beat,
    Digest,
    LogsReply,
    LogsRequest,
    ModulesReply,
    ModulesRequest,
    NodesReply,
    NodesRequest,
    Note,
    OperatorsReply,
    OperatorsRequest,
    PlanReply,
    PlanRequest,
    PlansReply,
    PlansRequest,
    PlanSummary,
    SeatAnnounce,
    StatusReply,
    SteerReply,
    SteerRequest,
)
from mesh.names import InvalidName, check_name

log = logging.getLogger("mesh.console")
T = TypeVar("T")

STATIC = Path(__file__).parent / "static"
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
ASK_WITHIN = 5.0  # seconds a verb is tried (the command line's --timeout default)
PLANS_LISTED = 20
LOG_TAIL = 64 * 1024  # bytes of a process's log a page shows (what `mesh logs` shows first)
FOLLOW_WAIT = 20.0  # seconds a page's read of new output may wait at the host (`mesh logs -f`'s)
SILENT_BEATS = 3  # beats missed before the controller is asked again (its --down-after default)
STANDBY_SILENT = 3.5  # a standby unheard this long is gone (the holder's FORGET_AFTER)
ASKS_PER_SILENCE = 15  # once a second, then the console waits for the bus to say more
PAGE_QUEUE = 256  # events a page may lag behind; past that it is dropped and reconnects
KEEPALIVE = 15.0  # a comment line on an idle stream, so proxies and browsers keep it open
# Asked in this order in a round: `status` after `nodes`, so its counts are never older than the
# machines shown above them.
SECTIONS = ("nodes", "status", "plans", "modules", "audit")
AUDIT_LISTED = 20  # the audit log's newest entries the page shows
TOKEN_BYTES = 32  # secrets.token_urlsafe: 43 characters, never guessed
TOKEN_ENV = "MESH_CONSOLE_TOKEN"  # how a supervisor (`mesh dev up`) gives it: never on argv (ps)
TOKEN_FORM = re.compile(r"[A-Za-z0-9_-]{32,256}")  # a given token: URL- and cookie-safe, long
WRITE_HEADER = "X-Mesh-Console-Write"  # the session's write token, on approve and reject
COOKIE = "mesh-console"  # its name; `-PORT` added once bound: two consoles on one host coexist


class ConsoleError(MeshError):
    """The console cannot start (where it listens, the bus)."""


def page_url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/"


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def check_token(token: str, *, field: str = TOKEN_ENV) -> str:
    """A token given to the console (not made by it): long enough, and safe in a URL and a
    cookie. The message never shows it: it is a secret."""
    if not TOKEN_FORM.fullmatch(token):
        raise ConsoleError(
            f"{field}: not a console token ({len(token)} characters): it must be 32 to 256 of "
            "A-Z a-z 0-9 - _ (python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return token


def _frame(event: str, data: Any) -> bytes:
    """One server-sent event: msgspec's JSON has no newline, so one `data:` line holds it."""
    return b"event: " + event.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


class Console:
    def __init__(self, nc: Client, *, url: str, listen_host: str | None, token: str) -> None:
        self.nc = nc
        self.url = url  # the bus, as errors name it
        self._loopback = listen_host is None or listen_host in LOOPBACK
        self._token = token.encode()
        self.cookie = COOKIE
        self._pages: set[MemoryObjectSendStream[bytes]] = set()
        self._frames: dict[str, bytes] = {}  # section -> its last answer, as a page gets it
        self._problems: dict[str, str] = {}  # section -> why its last refresh failed
        self._dirty: set[str] = set()
        self._plans_dirty: set[int] = set()
        self._wake = anyio.Event()
        self._latest_plan: tuple[int, bytes] | None = None  # a new page's plan to show
        # What the bus says, to know when an answer is out of date.
        self._up: dict[str, bool] = {}  # machine -> up, as `nodes` last said
        self._standbys: set[str] = set()  # as `status` last said
        self._beats: dict[str, tuple[float, float]] = {}  # machine -> (heard at, interval)
        self._standby_heard: dict[str, float] = {}
        self._asked: dict[str, int] = {}  # a silent machine or standby -> asks since
        self._started = time.monotonic()
        self.write_token = secrets.token_urlsafe(TOKEN_BYTES)  # sent with each write
        self.role: str | None = None  # the console's operator's, once asked (`operators`)

    # --- what the bus says -------------------------------------------------------------------

    async def subscribe(self) -> None:
        await self.nc.subscribe(subjects.EVENTS, cb=self._on_report)
        await self.nc.subscribe(subjects.HOST_BEATS, cb=self._on_beat)
        await self.nc.subscribe(subjects.SEAT_EVENTS, cb=self._on_seat)
        await self.nc.subscribe(subjects.PLANS, cb=self._on_plan)
        await self.nc.subscribe(subjects.MACHINES, cb=self._on_machine)
        await self.nc.flush()

    async def _on_report(self, msg: Msg) -> None:
        # applied or processes: the machine's processes, digests or apply error changed
        self.mark("nodes", "status")

    async def _on_beat(self, msg: Msg) -> None:
        try:
            beat = wire.decode(msg.data, Beat)
        except wire.BadRequest:
            return  # noise
        if msg.subject != subjects.host(beat.name, "beat"):
            return  # a machine speaks only for itself
        self._beats[beat.name] = (time.monotonic(), beat.interval)
        self._asked.pop(beat.name, None)
        self.send("beat", {"name": beat.name, "interval": beat.interval})
        if "nodes" in self._frames and not self._up.get(beat.name, False):
            # back up, or new: the controller says so soon (a machine it does not list, such
            # as one removed whose agent still runs, is not asked about at every beat)
            self._ask_again(f"heard {beat.name}", "nodes", "status")

    async def _on_seat(self, msg: Msg) -> None:
        if subjects.last(msg.subject) != "standby":
            self.mark("status", "nodes")  # held, released, handover
            return
        try:
            who = wire.decode(msg.data, SeatAnnounce)
        except wire.BadRequest:
            return
        self._standby_heard[who.instance] = time.monotonic()
        self._asked.pop(f"standby {who.instance}", None)
        if "status" in self._frames and who.instance not in self._standbys:
            self.mark("status")

    async def _on_plan(self, msg: Msg) -> None:
        try:
            summary = wire.decode(msg.data, PlanSummary)
        except wire.BadRequest:
            return
        self.send("progress", summary)  # the page's plan list moves at once
        self._plans_dirty.add(summary.id)
        # a plan starting or ending changes assignments (modules) and the seat's summary
        self.mark("plans", "status", *(() if summary.state == "rolling" else ("modules", "audit")))

    async def _on_machine(self, msg: Msg) -> None:
        # drained, undrained, or skipped for its drain: no host reports it, the holder tells it
        self.mark("nodes", "audit")

    async def watch_silence(self) -> None:
        """Once a second: a machine whose beats stopped, or a standby that went quiet, while
        the last answer still shows it there: ask again (the controller judges, a little after
        the console notices), at most ASKS_PER_SILENCE times."""
        while True:
            await anyio.sleep(1)
            now = time.monotonic()
            for name, (at, interval) in self._beats.items():
                if self._up.get(name) and now - at > SILENT_BEATS * interval + 0.5:
                    self._ask_again(name, "nodes", "status")
            for instance in self._standbys:
                heard = self._standby_heard.get(instance, self._started)
                if now - heard > STANDBY_SILENT:
                    self._ask_again(f"standby {instance}", "status")

    def _ask_again(self, key: str, *sections: str) -> None:
        asks = self._asked.get(key, 0)
        if asks < ASKS_PER_SILENCE:
            self._asked[key] = asks + 1
            self.mark(*sections)

    # --- asking the controller ---------------------------------------------------------------

    def mark(self, *sections: str) -> None:
        self._dirty.update(sections)
        self._wake.set()

    async def refreshing(self) -> None:
        """Ask what changed, one verb at a time: events that come meanwhile are one more round."""
        self.mark(*SECTIONS)
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            sections, self._dirty = self._dirty, set()
            plan_ids, self._plans_dirty = self._plans_dirty, set()
            for section in SECTIONS:
                if section in sections:
                    await self._refresh(section)
            for plan_id in sorted(plan_ids):
                await self._refresh_plan(plan_id)

    async def verb(self, name: str, reply: type[T], body: Any = None) -> T:
        return await ask(
            self.nc, url=self.url, verb=name, reply=reply, timeout=ASK_WITHIN,
            body=wire.encode(body) if body is not None else b"{}",
        )  # fmt: skip

    async def listed(self, name: str, reply: type[T], request: Any, want: int | None = None) -> T:
        """A list verb, every page of it (or the first `want` items), as one answer."""
        return await ask_list(self.nc, url=self.url, verb=name, reply=reply, request=request,
                              timeout=ASK_WITHIN, want=want)  # fmt: skip

    async def _refresh(self, section: str) -> None:
        try:
            if section == "status":
                status = await self.verb("status", StatusReply)
                self._standbys = {s.instance for s in status.standbys}
                answer: Any = status
            elif section == "nodes":
                nodes = await self.listed("nodes", NodesReply, NodesRequest())
                self._up = {n.name: n.up for n in nodes.nodes}
                for name in [n for n, up in self._up.items() if up]:
                    self._asked.pop(f"heard {name}", None)
                answer = nodes
            elif section == "modules":
                answer = await self.listed("modules", ModulesReply, ModulesRequest())
            elif section == "audit":  # who changed what: asked again as plans and machines change
                answer = await self.listed("audit", AuditReply, AuditRequest(), want=AUDIT_LISTED)
            else:
                plans = await self.listed("plans", PlansReply, PlansRequest(), want=PLANS_LISTED)
                if plans.plans and self._latest_plan is None:
                    self._plans_dirty.add(plans.plans[0].id)  # the first page shows it
                    self._wake.set()
                answer = plans
        except (VerbFailed, nats.errors.Error) as e:  # the bus going: said on the page, asked again
            self._problem(section, str(e) or type(e).__name__)
            return
        self._frames[section] = _frame(section, answer)
        self._broadcast(self._frames[section])
        self._problem(section, None)

    async def _refresh_plan(self, plan_id: int) -> None:
        try:
            plan = await self.listed("plan", PlanReply, PlanRequest(id=plan_id))
        except (VerbFailed, nats.errors.Error) as e:
            self._problem("plan", str(e) or type(e).__name__)
            return
        frame = _frame("plan", plan)
        if self._latest_plan is None or plan_id >= self._latest_plan[0]:
            self._latest_plan = (plan_id, frame)
        self._broadcast(frame)
        self._problem("plan", None)

    def _problem(self, section: str, message: str | None) -> None:
        if message is None:
            if self._problems.pop(section, None) is not None:
                log.info("%s: answered again", section)
                self.send("problem", {"section": section, "message": None})
            return
        if self._problems.get(section) != message:  # once, not at every event while it lasts
            log.info("%s: could not read it: %s", section, message)
        self._problems[section] = message
        self.send("problem", {"section": section, "message": message})

    # --- the pages ---------------------------------------------------------------------------

    def send(self, event: str, data: Any) -> None:
        self._broadcast(_frame(event, data))

    def _broadcast(self, frame: bytes) -> None:
        for page in list(self._pages):
            try:
                page.send_nowait(frame)
            except anyio.WouldBlock:  # a page that does not keep up starts again (it reconnects)
                page.close()
                self._pages.discard(page)
            except anyio.BrokenResourceError:
                self._pages.discard(page)

    def close_pages(self) -> None:
        for page in self._pages:
            page.close()
        self._pages.clear()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=4096)
        app.router.add_get("/", self._index)
        app.router.add_get("/events", self._events)
        app.router.add_get("/api/plan/{id}", self._plan)
        app.router.add_get("/api/logs/{machine}/{process}", self._logs)
        app.router.add_get("/api/me", functools.partial(me, self))
        app.router.add_post(
            "/api/plan/{id}/{action:approve|reject}", functools.partial(steer, self)
        )
        app.router.add_static("/static/", STATIC, follow_symlinks=False)
        return app

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        over_socket = _over_socket(request)
        # On loopback, only pages this machine's browser opened by that name: another site's
        # page whose name resolves to 127.0.0.1 (DNS rebinding) is refused.
        if (self._loopback or over_socket) and request.url.host not in LOOPBACK:
            return web.Response(status=403, text=f"unexpected Host: {request.host[:100]}\n")
        refused = self._who(request, over_socket)
        if refused is not None:
            return refused
        if request.method not in ("GET", "HEAD"):
            refused = self._write_refused(request)
            if refused is not None:
                return refused
        response = await handler(request)
        if response.prepared:  # the event stream: its headers are gone already (set there)
            return response
        # Nothing but the page's own files runs, whatever a machine's name or a log says.
        response.headers["Content-Security-Policy"] = (
            "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
            "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'"
        )
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        return response

    def _write_refused(self, request: web.Request) -> web.Response | None:
        """None for a write from the console's own page: a held plan's approve or reject,
        from its own origin, with the session's write token."""
        if not re.fullmatch(r"/api/plan/[^/]+/(approve|reject)", request.path):
            return web.Response(status=405, text="the console only reads, but for a held "
                                "plan's approve and reject\n")  # fmt: skip
        origin = request.headers.get("Origin", "")
        if origin != f"http://{request.host}":
            return _error(403, f"a write from another origin ({origin[:100] or 'none said'})")
        given = request.headers.get(WRITE_HEADER, "").encode(errors="replace")
        if not hmac.compare_digest(given, self.write_token.encode()):
            return _error(403, f"a write without the page's session token ({WRITE_HEADER})")
        return None

    def _is_token(self, given: str) -> bool:
        # In constant time: how long a wrong guess took says nothing of the token.
        return hmac.compare_digest(given.encode(errors="replace"), self._token)

    def _who(self, request: web.Request, over_socket: bool) -> web.StreamResponse | None:
        """None for a request the console serves; else the answer to whoever sent it."""
        if over_socket:
            # Only the console's account (and root) can open a socket of mode 0600; the peer's
            # uid is checked as well, for a connection made before the mode was set.
            uid = _peer_uid(request)
            if uid in (os.geteuid(), 0):
                return None
            return _refused(request, f"the console's socket is not for uid {uid}")
        given = request.query.get("token")
        if given is not None:
            if not self._is_token(given):
                return _refused(request, "that is not the console's token (it prints a new one "
                                "each time it starts)")  # fmt: skip
            # The first visit: a cookie from now on, and the address without the token, so it
            # stays out of the browser's history and off the screen.
            rest = MultiDict((k, v) for k, v in request.query.items() if k != "token")
            moved = web.Response(status=303, headers={
                "Location": str(request.rel_url.with_query(rest)), "Cache-Control": "no-store",
                "Referrer-Policy": "no-referrer",
            })  # fmt: skip
            moved.set_cookie(self.cookie, given, path="/", httponly=True, samesite="Strict")
            return moved
        scheme, _, bearer = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and self._is_token(bearer.strip()):
            return None
        cookie = request.cookies.get(self.cookie)
        if cookie is not None and self._is_token(cookie):
            return None
        return _refused(request, "the console asks who you are: open the URL it printed "
                        "(…/?token=…), or send Authorization: Bearer TOKEN")  # fmt: skip

    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html")

    async def _events(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                     "X-Content-Type-Options": "nosniff"}
        )  # fmt: skip
        await response.prepare(request)
        send, receive = anyio.create_memory_object_stream[bytes](PAGE_QUEUE)
        self._pages.add(send)  # first: what changes while the state below goes out follows it
        log.info("a page opened (%d open)", len(self._pages))
        try:
            frames = [self._frames[s] for s in SECTIONS if s in self._frames]
            if self._latest_plan is not None:
                frames.append(self._latest_plan[1])
            frames += [_frame("problem", {"section": s, "message": m})
                       for s, m in self._problems.items()]  # fmt: skip
            await response.write(b"".join(frames) + b"event: ready\ndata: {}\n\n")
            async with receive:
                while True:
                    frame = b": keepalive\n\n"
                    with anyio.move_on_after(KEEPALIVE):
                        frame = await receive.receive()
                    await response.write(frame)
        except (anyio.EndOfStream, ConnectionResetError, anyio.ClosedResourceError):
            pass  # the page went, or the console stops
        finally:
            self._pages.discard(send)
            send.close()
            log.info("a page closed (%d open)", len(self._pages))
        return response

    async def _plan(self, request: web.Request) -> web.StreamResponse:
        text = request.match_info["id"]
        if not text.isdigit() or not 1 <= int(text) < 2**63:
            return _error(400, f"plan id: {text[:40]!r} is not a plan number")
        try:
            # With what each step changes: the page shows it (a held plan's review)
            plan = await self.listed("plan", PlanReply, PlanRequest(id=int(text), changes=True))
        except VerbFailed as e:
            return _error(404 if e.code == "not_found" else 502, str(e))
        return _json(plan)

    async def _logs(self, request: web.Request) -> web.StreamResponse:
        machine, process = request.match_info["machine"], request.match_info["process"]
        try:
            check_name(machine, field="machine")
            check_name(process, field="process")
        except InvalidName as e:
            return _error(400, str(e))
        # ?offset=N&wait=S: the output from N on, waiting at the host up to S seconds for some
        # (the page follows a log as `mesh logs -f` does); without: the tail.
        offset, wait = request.query.get("offset"), request.query.get("wait", "0")
        if offset is not None and not (offset.isdigit() and int(offset) < 2**63):
            return _error(400, f"offset: {offset[:40]!r} is not a byte offset")
        if not (wait.isdigit() and int(wait) <= FOLLOW_WAIT):
            return _error(400, f"wait: {wait[:40]!r} is not 0 to {FOLLOW_WAIT:g} seconds")
        req = LogsRequest(
            process=process, offset=None if offset is None else int(offset), max=LOG_TAIL,
            wait=float(wait),
        )  # fmt: skip
        subject = subjects.host(machine, "logs")
        within = ASK_WITHIN + req.wait
        try:
            data = await bus.request(
                self.nc, subject, wire.encode(req), deadline=time.monotonic() + within,
                attempt_timeout=within,
            )  # fmt: skip
            return _json(wire.decode_reply(data, LogsReply))
        except bus.NoAnswer:
            return _error(504, f"host {machine} did not answer on {subject}; is it up?")
        except wire.RemoteError as e:
            return _error(404 if e.code == "not_found" else 502, f"logs: {e}")


STEERS = frozenset({"admin", "deployer"})  # the roles that approve and reject (a deployer's glob)


async def me(console: "Console", request: web.Request) -> web.StreamResponse:
    """Who the console acts as, whether it may steer plans, and the session's write token."""
    operator = bus.operator_of(console.nc)
    if operator is not None and console.role is None:
        try:
            known = await console.verb("operators", OperatorsReply, OperatorsRequest())
            console.role = next((o.role for o in known.operators if o.name == operator), "")
        except VerbFailed:
            console.role = ""  # may not even list the operators (a tools operator): no steering
    role = console.role if operator is not None else None
    steers = operator is None or role in STEERS  # on a bus with no identities, the controller says
    return _json({"operator": operator, "role": role, "steers": steers,
                  "write_token": console.write_token})  # fmt: skip


async def steer(console: "Console", request: web.Request) -> web.StreamResponse:
    """A held plan approved (bound to the digest the page showed) or rejected, as the console's
    operator: the controller decides whether that operator may."""
    text, action = request.match_info["id"], request.match_info["action"]
    if not text.isdigit() or not 1 <= int(text) < 2**63:
        return _error(400, f"plan id: {text[:40]!r} is not a plan number")
    try:
        asked = msgspec.json.decode(await request.read() or b"{}", type=SteerAsked)
        body = SteerRequest(id=int(text), digest=asked.digest, reason=asked.reason)
    except msgspec.ValidationError as e:
        return _error(400, str(e))
    except msgspec.DecodeError:
        return _error(400, "the body is not a JSON object")
    try:
        reply = await ask(console.nc, url=console.url, verb=f"plan-{action}", reply=SteerReply,
                          timeout=ASK_WITHIN, body=wire.encode(body),
                          attempt=ASK_WITHIN)  # fmt: skip
    except VerbFailed as e:
        status = {"forbidden": 403, "conflict": 409, "not_found": 404, "bad_request": 400}
        return _error(status.get(e.code or "", 502), str(e))
    log.info("plan %s %s from the console: %s", text, action, reply.message)
    console.mark("plans", "status", "audit")
    return _json(reply)


class SteerAsked(msgspec.Struct, forbid_unknown_fields=True):
    """What the page sends with an approve or a reject."""

    digest: Digest | None = None
    reason: Note = ""


def _over_socket(request: web.Request) -> bool:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    return sock is not None and sock.family == socket.AF_UNIX


def _peer_uid(request: web.Request) -> int | None:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (AttributeError, OSError):
        return None
    return struct.unpack("3i", creds)[1]


def _refused(request: web.Request, message: str) -> web.Response:
    """401: JSON for the page's own requests (it shows `error`), text for a person."""
    headers = {"WWW-Authenticate": 'Bearer realm="mesh console"', "Cache-Control": "no-store"}
    if request.path.startswith("/api/"):
        return web.Response(status=401, body=msgspec.json.encode({"error": message}),
                            content_type="application/json", headers=headers)  # fmt: skip
    return web.Response(status=401, text=message + "\n", headers=headers)


def bind_socket(path: Path) -> socket.socket:
    """A unix socket of mode 0600 at `path`, listening. One left by a console that is gone is
    replaced; a live one, or anything else at `path`, is an error naming --socket."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise ConsoleError(f"--socket: {path}: {e.strerror or e}") from None
    if mode is not None:
        if not stat.S_ISSOCK(mode):
            raise ConsoleError(f"--socket: {path} exists and is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(2)  # a live one whose backlog is full answers late, not never
            try:
                probe.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                path.unlink(missing_ok=True)  # a console that is gone left it
            except OSError as e:
                raise ConsoleError(f"--socket: {path}: {e.strerror or e}") from None
            else:
                raise ConsoleError(f"--socket: {path} is in use (another console answers there)")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Made 0600 by bind itself: no moment when another account could connect.
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    except OSError as e:
        sock.close()
        raise ConsoleError(f"--socket: cannot listen on {path}: {e.strerror or e}") from None
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _json(data: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return web.Response(
        status=status, body=msgspec.json.encode({"error": message}),
        content_type="application/json",
    )  # fmt: skip


async def run(
    *, url: str, creds: str | None, listen: tuple[str, int] | None,
    socket_path: Path | None = None, token: str | None = None,
    task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:  # fmt: skip
    """Serve the console until SIGTERM/SIGINT (or cancelled); `task_status` gets its URL (with
    its token). `token`: the one to ask for, given by whoever started it (else a new one, said
    in the log with the URL; a given one never is: its log may be readable by others)."""
    host = listen[0] if listen is not None else None
    refused: list[str] = []
    shown: list[Console] = []

    def denied(what: str) -> None:  # a subscription or request these credentials may not make
        refused.append(what)
        log.warning("NATS refused to let %s %s", creds or "(no credentials)", what)
        for console in shown:
            console.send("problem", {"section": "bus", "message": f"NATS refused to {what}"})

    # Once as a command does, failing at once in one line (a wrong URL, unknown credentials);
    # then for good: a service's connection, which rides over NATS going and coming back.
    async with connected(url=url, creds=creds, what="console"):
        pass
    try:
        nc = await bus.connect(
            url, name="mesh console", creds=creds, reconnect=True, link=(link := bus.Link()),
            denied=denied,
        )  # fmt: skip
    except (bus.Unreachable, bus.Unauthorized) as e:
        raise ConsoleError(str(e)) from None
    given = token is not None
    token = token if token is not None else new_token()
    console = Console(nc, url=url, listen_host=host, token=token)
    shown.append(console)

    def back() -> None:  # events were missed while the bus was gone: ask everything again
        console.mark(*SECTIONS)

    link.on_up = back
    runner = web.AppRunner(console.app(), access_log=None, shutdown_timeout=1.0)
    made: os.stat_result | None = None  # the socket we made, removed when we stop
    try:
        await console.subscribe()
        if refused:
            raise ConsoleError(
                f"NATS refused to let the credentials {creds or '(none)'} {refused[0]}: "
                "the console needs a viewer's (or an admin's)"
            )
        await runner.setup()
        places, where, made = await _sites(runner, console, listen=listen,
                                           socket_path=socket_path,
                                           shown=None if given else token)  # fmt: skip
        log.info("console on %s (read-only; the fleet on %s%s)", " and ".join(places), url,
                 "; the token as given" if given and listen is not None else "")  # fmt: skip
        task_status.started(f"{where}?token={token}" if listen is not None else where)
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_on_signals, tg.cancel_scope)
            tg.start_soon(console.refreshing)
            tg.start_soon(console.watch_silence)
    finally:
        with anyio.CancelScope(shield=True):
            console.close_pages()
            await runner.cleanup()
            await bus.close(nc, drain=False)
            if made is not None and socket_path is not None:
                _remove_ours(socket_path, made)


async def _sites(
    runner: web.AppRunner, console: "Console", *, listen: tuple[str, int] | None,
    socket_path: Path | None, shown: str | None,
) -> tuple[list[str], str, os.stat_result | None]:  # fmt: skip
    """Where the console serves: its TCP port (its cookie named after the port) and its unix
    socket; the places said in the log (with the token `shown`), the page's address, and the
    socket made (or None)."""
    places: list[str] = []
    where = ""
    made: os.stat_result | None = None
    if listen is not None:
        site = web.TCPSite(runner, listen[0], listen[1])
        try:
            await site.start()
        except OSError as e:
            raise ConsoleError(
                f"--listen: cannot listen on {listen[0]}:{listen[1]}: {e.strerror or e}"
            ) from None
        bound = site._server.sockets[0].getsockname()[1] if site._server else listen[1]  # type: ignore[union-attr]
        console.cookie = f"{COOKIE}-{bound}"
        where = page_url(listen[0], bound)
        places.append(f"{where}?token={shown}" if shown is not None else where)
    if socket_path is not None:
        sock = bind_socket(socket_path)
        made = os.stat(socket_path)
        await web.SockSite(runner, sock).start()
        places.append(f"unix socket {socket_path} (mode 0600: no token)")
        where = where or f"unix:{socket_path}"
    return places, where, made


def _remove_ours(path: Path, made: os.stat_result) -> None:
    """The socket we made, unless another console has put its own there since."""
    try:
        now = path.lstat()
        if (now.st_dev, now.st_ino) == (made.st_dev, made.st_ino):
            path.unlink()
    except OSError:
        pass
