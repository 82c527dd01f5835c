"""MCP over stdio, the client side: newline-delimited JSON-RPC 2.0 written to a tool server's
stdin and read from its stdout (the MCP stdio transport).

It knows JSON-RPC and the three things the host asks a tool server (`initialize` followed by
`notifications/initialized`, `tools/list` following `nextCursor`, `tools/call` with a
deadline), and nothing of any SDK or language: a tool server is whatever answers these on its
stdio. Everything a server sends is bounded and checked, and anything wrong ends the session
with a `ProtocolError` that says what it did, for that server alone: a line longer than
MAX_LINE, JSON nested deeper than mesh.wire.MAX_DEPTH, something that is not a JSON-RPC
message, an answer to an id never asked, too many tools or pages. A call that runs out of
time is told to the server (`notifications/cancelled`) and its late answer ignored. The
server's own requests are answered (`ping`; anything else "method not found"); its
notifications are ignored but `notifications/tools/list_changed`.
"""

import itertools
import logging
import os
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import msgspec

from mesh import wire

log = logging.getLogger(__name__)

PROTOCOL = "2025-06-18"  # the MCP revision the host offers; it takes the one the server answers
MAX_LINE = 4 * 2**20  # bytes of one message from a server: a result larger is refused
MAX_PAGES = 32  # of tools/list, following nextCursor
MAX_TOOLS = 256  # of one server
CHUNK = 64 * 1024
WRITE_WITHIN = 5.0  # a server that does not read its stdin for this long is not speaking MCP
EXPIRED_KEPT = 1024  # ids of calls that ran out of time, whose late answers are ignored
CLIENT = {"name": "mesh-host", "version": "1"}


class ProtocolError(Exception):
    """The server does not speak MCP over stdio (or stopped): the session is over."""


class Closed(ProtocolError):
    """Its stdout ended: it exited, or closed it."""


class CallError(Exception):
    """One request answered with a JSON-RPC error, or not answered in time; the session goes on."""

    def __init__(self, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


def _preview(data: bytes) -> str:
    text = data[:80].decode(errors="replace")
    return repr(text + ("…" if len(data) > 80 else ""))


async def read_lines(fd: int, *, limit: int = MAX_LINE) -> AsyncIterator[bytes]:
    """The lines a non-blocking pipe gives, until its end; a line longer than `limit` (or a
    last line without its newline) is a ProtocolError."""
    buffer = bytearray()
    while True:
        await anyio.wait_readable(fd)
        try:
            chunk = os.read(fd, CHUNK)
        except BlockingIOError:
            continue
        except OSError as e:
            raise ProtocolError(f"its stdout cannot be read ({e.strerror or e})") from None
        if not chunk:
            if buffer.strip():
                raise ProtocolError(f"its stdout ended inside a line: {_preview(bytes(buffer))}")
            return
        start = len(buffer)
        buffer += chunk
        at = buffer.find(b"\n", start)
        while at >= 0:
            line = bytes(buffer[:at])
            del buffer[: at + 1]
            if len(line) > limit:
                raise ProtocolError(f"it wrote a line of {len(line)} bytes, at most {limit}")
            yield line
            at = buffer.find(b"\n")
        if len(buffer) > limit:
            raise ProtocolError(f"it wrote a line longer than {limit} bytes")


async def write_all(fd: int, data: bytes) -> None:
    """All of `data` to a non-blocking pipe; a server gone is a ProtocolError."""
    view = memoryview(data)
    while view:
        try:
            done = os.write(fd, view)
        except BlockingIOError:
            await anyio.wait_writable(fd)
            continue
        except (BrokenPipeError, OSError) as e:
            raise ProtocolError(f"its stdin is closed ({e.strerror or e})") from None
        view = view[done:]


class _Pending:
    def __init__(self) -> None:
        self.done = anyio.Event()
        self.result: Any = None
        self.error: Exception | None = None


class Session:
    """One MCP session over a server's pipes. `run` reads until the server's stdout ends (or
    it answers badly) and must run while requests are made; when it ends, every request
    waiting fails with why."""

    def __init__(
        self, *, stdin: int, stdout: int, on_list_changed: Callable[[], None] | None = None
    ) -> None:
        self._stdin: int | None = stdin  # None once closed (end_input): never written again
        self._stdout = stdout
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._expired: deque[int] = deque(maxlen=EXPIRED_KEPT)
        self._writing = anyio.Lock()
        self._on_list_changed = on_list_changed
        self.closed: str | None = None  # why the session ended
        self.server: dict[str, Any] = {}  # serverInfo, once initialized
        self.protocol = ""

    async def run(self) -> None:
        """Read the server's messages until its stdout ends; raises ProtocolError when it
        writes something that is not MCP. Either way the session is over."""
        try:
            async for line in read_lines(self._stdout):
                if line.strip():
                    await self._received(line)
            raise Closed("its stdout closed (it exited)")
        except ProtocolError as e:
            self._close(str(e))
            raise
        except BaseException:
            self._close("the host stopped reading it")
            raise

    def _close(self, why: str) -> None:
        if self.closed is None:
            self.closed = why
        for pending in self._pending.values():
            pending.error = ProtocolError(self.closed)
            pending.done.set()
        self._pending.clear()

    async def _received(self, line: bytes) -> None:
        try:
            message = wire.decode_json(line)
        except wire.TooDeep as e:
            raise ProtocolError(
                f"it wrote JSON nested {e.depth} deep on stdout, at most {e.limit}"
            ) from None
        except msgspec.DecodeError:
            raise ProtocolError(
                f"it wrote something that is not JSON on stdout: {_preview(line)}"
            ) from None
        if isinstance(message, list):
            raise ProtocolError("it wrote a JSON-RPC batch, which MCP over stdio does not use")
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            raise ProtocolError(
                f"it wrote JSON that is not a JSON-RPC 2.0 message: {_preview(line)}"
            )
        method = message.get("method")
        if isinstance(method, str):
            if "id" in message:  # a request of the server's own
                await self._answer_request(message["id"], method)
            elif method == "notifications/tools/list_changed" and self._on_list_changed:
                self._on_list_changed()
            return
        if "id" not in message or ("result" not in message and "error" not in message):
            raise ProtocolError(f"it wrote a JSON-RPC message that is neither a request, a "
                                f"notification nor a response: {_preview(line)}")  # fmt: skip
        ident = message["id"]
        ours = type(ident) is int  # our ids are ints (not bools, which equal 0 and 1)
        pending = self._pending.pop(ident, None) if ours else None
        if pending is None:
            if ours and ident in self._expired:
                return  # the late answer to a call that ran out of time
            raise ProtocolError(f"it answered id {str(ident)[:40]!r}, which was never asked")
        error = message.get("error")
        if error is not None:
            what = error.get("message", "") if isinstance(error, dict) else error
            code = error.get("code", "?") if isinstance(error, dict) else "?"
            pending.error = CallError(f"{str(what)[:500]} (JSON-RPC error {code})")
        else:
            pending.result = message.get("result")
        pending.done.set()

    async def _answer_request(self, ident: Any, method: str) -> None:
        if method == "ping":
            reply: dict[str, Any] = {"jsonrpc": "2.0", "id": ident, "result": {}}
        else:
            why = f"the mesh host does not serve {method[:64]}"
            reply = {"jsonrpc": "2.0", "id": ident, "error": {"code": -32601, "message": why}}
        await self._send(reply)

    async def _send(self, message: dict[str, Any]) -> None:
        data = msgspec.json.encode(message) + b"\n"
        async with self._writing:
            if self._stdin is None:
                raise ProtocolError(self.closed or "its stdin is closed")
            with anyio.move_on_after(WRITE_WITHIN) as writing:
                await write_all(self._stdin, data)
        if writing.cancelled_caught:
            raise ProtocolError(f"it did not read its stdin for {WRITE_WITHIN:g}s")

    async def end_input(self) -> None:
        """Close the server's stdin (MCP's way of asking it to exit), once no write is under
        way; nothing is written after. Idempotent."""
        with anyio.CancelScope(shield=True):
            async with self._writing:
                if self._stdin is not None:
                    fd, self._stdin = self._stdin, None
                    os.close(fd)

    async def notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        await self._send(message)

    async def request(self, method: str, params: dict[str, Any], *, timeout: float) -> Any:
        """The result of one request, or CallError (an error answer, or none within `timeout`:
        the server is told to cancel it) or ProtocolError (the session is over)."""
        if self.closed is not None:
            raise ProtocolError(self.closed)
        ident = next(self._ids)
        pending = self._pending[ident] = _Pending()
        try:
            with anyio.move_on_after(timeout) as waiting:
                await self._send(
                    {"jsonrpc": "2.0", "id": ident, "method": method, "params": params}
                )
                await pending.done.wait()
        except BaseException:
            self._pending.pop(ident, None)
            raise
        if waiting.cancelled_caught:
            self._pending.pop(ident, None)
            self._expired.append(ident)
            if self.closed is None:
                with anyio.move_on_after(1):  # best effort: the call is over for us either way
                    await self.notify("notifications/cancelled",
                                      {"requestId": ident, "reason": "timed out"})  # fmt: skip
            raise CallError(f"{method} got no answer within {timeout:g}s", timeout=True)
        if pending.error is not None:
            raise pending.error
        return pending.result

    async def initialize(self, *, timeout: float) -> None:
        """The handshake: initialize, then notifications/initialized."""
        try:
            result = await self.request(
                "initialize",
                {"protocolVersion": PROTOCOL, "capabilities": {}, "clientInfo": CLIENT},
                timeout=timeout,
            )
        except CallError as e:
            raise ProtocolError(f"it did not answer initialize: {e}") from None
        if not isinstance(result, dict) or not isinstance(result.get("capabilities", {}), dict):
            raise ProtocolError(
                f"its answer to initialize is not an InitializeResult: {result!r:.80}"
            )
        self.protocol = str(result.get("protocolVersion", ""))[:40]
        info = result.get("serverInfo")
        self.server = info if isinstance(info, dict) else {}
        await self.notify("notifications/initialized")

    async def list_tools(self, *, timeout: float) -> list[dict[str, Any]]:
        """Every tool the server lists, following nextCursor (at most MAX_PAGES pages and
        MAX_TOOLS tools); each a dict with at least a string `name`."""
        tools: list[dict[str, Any]] = []
        cursor: Any = None
        for _ in range(MAX_PAGES):
            params = {} if cursor is None else {"cursor": cursor}
            try:
                result = await self.request("tools/list", params, timeout=timeout)
            except CallError as e:
                raise ProtocolError(f"it did not list its tools: {e}") from None
            page = result.get("tools") if isinstance(result, dict) else None
            if not isinstance(page, list):
                raise ProtocolError(
                    f"its answer to tools/list has no list of tools: {result!r:.80}"
                )
            for tool in page:
                if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                    raise ProtocolError(f"it listed a tool without a name: {tool!r:.80}")
            tools += page
            if len(tools) > MAX_TOOLS:
                raise ProtocolError(f"it lists more than {MAX_TOOLS} tools")
            cursor = result.get("nextCursor")
            if cursor is None or cursor == "":
                return tools
        raise ProtocolError(f"its tools/list goes on past {MAX_PAGES} pages")

    async def call_tool(self, name: str, arguments: dict[str, Any], *, timeout: float) -> Any:
        return await self.request("tools/call", {"name": name, "arguments": arguments},
                                  timeout=timeout)  # fmt: skip
