"""A standby's TLS relay to its primary, for programs whose libpq has no SSL (the wheel's).

pg_basebackup and the standby's walreceiver connect to a Unix socket in a folder of mode 0700
(the server's account's); for each connection the relay opens TCP to the primary's front
(mesh/embedded/pgfront.py) or to a PostgreSQL with SSL, sends the SSLRequest, checks the
server's certificate against the mesh's CA and the address it dialled (what libpq's
`sslmode=verify-full` checks), and relays the bytes both ways. A server that does not take TLS,
or whose certificate does not check, gets no byte of the client's: the client is told why in a
PostgreSQL ErrorResponse. One line at start; then errors only.

    python -m mesh.embedded.pgrelay --socket PATH --to HOST:PORT --ca CA [--owner ACCOUNT]
"""

import argparse
import contextlib
import os
import shutil
import ssl
import sys
from pathlib import Path

import anyio
from anyio.abc import ByteStream, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.tls import TLSStream

from mesh.auth.tls import TlsError, client_context
from mesh.embedded.pgfront import (
    HANDSHAKE_WITHIN,
    SSL_REQUEST,
    ProtocolError,
    address,
    close_quietly,
    error_response,
    guarded,
    read_start,
    reason,
    relay,
    request,
    say,
    send_then_close,
)


class Relay:
    def __init__(self, *, to: tuple[str, int], context: ssl.SSLContext) -> None:
        self.to = to
        self.context = context

    async def handle(self, client: SocketStream) -> None:
        where = f"{self.to[0]}:{self.to[1]}"
        try:
            with anyio.fail_after(HANDSHAKE_WITHIN):
                server = await self._secured()
        except (TimeoutError, OSError, ssl.SSLError, anyio.EndOfStream,
                anyio.BrokenResourceError, RefusedTls) as e:  # fmt: skip
            why = f"the store at {where}: {reason(e)}"
            say(f"postgres-relay: {why}")
            # The client's start read first: an answer sent before it, then the close, can
            # break the client's own send, and it reports a broken connection, not this.
            with anyio.move_on_after(HANDSHAKE_WITHIN), contextlib.suppress(
                ProtocolError, anyio.IncompleteRead, anyio.EndOfStream, anyio.BrokenResourceError,
                OSError,
            ):  # fmt: skip
                await read_start(BufferedByteReceiveStream(client))
            await send_then_close(client, error_response(why, code="08001"))
            return
        await relay(client, server)

    async def _secured(self) -> ByteStream:
        host, port = self.to
        stream = await anyio.connect_tcp(host, port)
        try:
            await stream.send(request(SSL_REQUEST))
            answer = await stream.receive(1)
            if answer != b"S":
                raise RefusedTls("it does not take TLS (it answered the SSLRequest "
                                 f"{answer!r})")  # fmt: skip
            return await TLSStream.wrap(
                stream, server_side=False, hostname=host, ssl_context=self.context,
                standard_compatible=False,
            )  # fmt: skip
        except BaseException:
            await close_quietly(stream)
            raise


class RefusedTls(Exception):
    pass


def _listener_path(socket: Path, owner: str | None) -> None:
    """The socket's folder: made 0700, its owner's (the server's account, whose programs
    connect); the socket file likewise."""
    socket.parent.mkdir(parents=True, exist_ok=True)
    socket.parent.chmod(0o700)
    if owner:
        shutil.chown(socket.parent, owner, owner)
    socket.unlink(missing_ok=True)  # left by a relay that was killed


async def serve(*, socket: Path, to: tuple[str, int], ca: Path, owner: str | None) -> None:
    context = client_context(cafile=str(ca))
    _listener_path(socket, owner)
    # Bound and listening under another name, then renamed: whoever sees the socket's name can
    # connect (a name seen between bind and listen refuses).
    making = socket.with_name(f".{socket.name}.new")
    making.unlink(missing_ok=True)
    listener = await anyio.create_unix_listener(making, mode=0o600)
    if owner:
        shutil.chown(making, owner, owner)
    making.rename(socket)
    say(f"postgres-relay: {socket} to {to[0]}:{to[1]} over TLS (verify-full against {ca})")
    await listener.serve(guarded("postgres-relay", Relay(to=to, context=context).handle))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mesh.embedded.pgrelay")
    parser.add_argument("--socket", type=Path, required=True, help="the Unix socket to listen on")
    parser.add_argument("--to", type=address, required=True, metavar="HOST:PORT")
    parser.add_argument("--ca", type=Path, required=True, help="the mesh's CA certificate")
    parser.add_argument("--owner", help="the account whose programs connect (root only)")
    args = parser.parse_args(argv)
    if args.owner and os.geteuid() != 0:
        sys.exit("postgres-relay: --owner takes root")
    try:
        anyio.run(lambda: serve(socket=args.socket, to=args.to, ca=args.ca, owner=args.owner))
    except (OSError, TlsError) as e:
        sys.exit(f"postgres-relay: {e}")
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
