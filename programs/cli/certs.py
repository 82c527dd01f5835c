"""`mesh cert rotate` / `mesh cert show`: the TLS certificates of a mesh folder's nats-servers
(the folder `mesh dev up --dir` or `mesh init` made; docs/security.md); `rotate` also the
store's (its PostgreSQL's, or its TLS front's: mesh/embedded/postgres.py).

Rotation issues every server a new key and certificate from the folder's CA, for the same name
and addresses as the certificate it replaces, swaps the files in and reloads each running server
(SIGHUP: nats-server reads its TLS files again). Clients trust the CA, not a certificate, so
nothing changes for them: open connections stay up, new ones get the new certificate. Then the
command checks what each running server presents, so "reloaded" means the new certificate is
being served, not only that a signal was sent.
"""

import argparse
import ipaddress
import os
import re
import signal
import socket
import ssl
import time
from pathlib import Path
from typing import Any, Literal

import anyio
import msgspec
from cryptography import x509
from cryptography.x509.oid import NameOID

from mesh.auth import server, tls
from mesh.embedded import pgfront, postgres
from mesh.meshdir import DEFAULT_DIR, MeshDir
from programs.cli import folderaudit
from programs.cli.args import Parser
from programs.cli.client import CliError
from programs.cli.output import print_json

RELOAD_WITHIN = 5.0  # seconds for a signalled server to present its new certificate
# Quoted or not: mesh quotes it ([::] would read as a list), a config written by hand may not.
_LISTEN = re.compile(r"^listen:\s*\"?(\S+?):(\d+)\"?\s*$", re.MULTILINE)


class CaInfo(msgspec.Struct):
    subject: str
    serial: str  # hex, as `openssl x509 -serial` prints it
    not_after: str  # ISO 8601, UTC
    cert: str  # its file (given to clients: MESH_CA, and inside credentials files)


class ServerCert(msgspec.Struct):
    name: str  # the server's folder name (n1, n2, ...)
    subject: str  # its certificate's common name
    hosts: list[str]  # the addresses and names its certificate is valid for
    serial: str
    not_after: str
    issued_by_ca: bool  # signed by the folder's CA (clients refuse it otherwise)
    running: bool
    presented: str | None  # the serial the running server presents now, if it answered
    cert: str


# "reloaded" (it presents the new certificate), "not running" (it will at its start),
# "reload failed" (it still presents another), "signalled" (it did not answer after the
# signal, or its address is unknown: it takes the new certificate when it next starts)
RotatedState = Literal["reloaded", "not running", "reload failed", "signalled"]


class Rotated(msgspec.Struct):
    name: str
    hosts: list[str]
    old_serial: str | None  # None when the server had no certificate to read
    serial: str
    not_after: str
    state: RotatedState
    presented: str | None  # the serial the server presents after the reload
    cert: str


class Shown(msgspec.Struct):
    dir: str
    ca: CaInfo
    servers: list[ServerCert]


class Rotation(msgspec.Struct):
    dir: str
    ca: CaInfo
    servers: list[Rotated]


def add_parsers(verbs: Any, common: argparse.ArgumentParser) -> None:
    cert = verbs.add_parser("cert", parents=[common], help="the nats-servers' TLS certificates")
    cert_verbs = cert.add_subparsers(dest="cert_command", metavar="COMMAND", parser_class=Parser)
    cert_verbs.required = True
    rotate = cert_verbs.add_parser(
        "rotate", parents=[common], help="new certificates for every nats-server, reloaded"
    )
    show = cert_verbs.add_parser(
        "show", parents=[common], help="the CA and every nats-server's certificate"
    )
    for p in (rotate, show):
        p.add_argument(
            "--dir", type=Path, default=None,
            help=f"the mesh's folder (env MESH_DIR, else {DEFAULT_DIR})",
        )  # fmt: skip


def _folder(args: argparse.Namespace) -> MeshDir:
    """The mesh folder, which must hold a CA and at least one nats-server."""
    given = args.dir or DEFAULT_DIR  # DEFAULT_DIR is MESH_DIR when set
    folder = MeshDir(Path(given))
    make = f"`mesh dev up --dir {given}` (or `mesh init`) makes a mesh there"
    if not folder.root.is_dir():
        raise CliError(f"no mesh folder at {folder.root}; {make}")
    missing = [p.name for p in (folder.ca, folder.tls / "ca.key") if not p.is_file()]
    if missing:
        raise CliError(
            f"no mesh CA in {folder.tls} (missing {', '.join(missing)}): {folder.root} is not a "
            f"mesh folder with TLS; {make}"
        )
    if not folder.servers():
        raise CliError(f"no nats-server in {folder.nats} (no nK/nats.conf); {make}")
    return folder


def _hex(number: int) -> str:
    text = f"{number:X}"
    return text if len(text) % 2 == 0 else "0" + text


def _when(cert: x509.Certificate) -> str:
    return cert.not_valid_after_utc.isoformat(timespec="seconds")


def _load(path: Path, what: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except OSError as e:
        raise CliError(f"{what} {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise CliError(f"{what} {path}: not a PEM certificate ({e})") from None


def _common_name(cert: x509.Certificate, fallback: str) -> str:
    found = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(found[0].value) if found else fallback


def _hosts(cert: x509.Certificate) -> list[str]:
    """The certificate's subject alternative names, IP addresses and DNS names, in order."""
    try:
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    hosts = []
    for entry in alt:
        if isinstance(entry, x509.IPAddress | x509.DNSName):
            hosts.append(str(entry.value))
    return hosts


def _ca_info(folder: MeshDir) -> tuple[CaInfo, x509.Certificate]:
    ca = _load(folder.ca, "the mesh's CA")
    info = CaInfo(subject=ca.subject.rfc4514_string(), serial=_hex(ca.serial_number),
                  not_after=_when(ca), cert=str(folder.ca))  # fmt: skip
    return info, ca


def _listen(conf: Path) -> tuple[str, int] | None:
    """Where the server of `conf` listens for clients, as a client reaches it."""
    try:
        found = _LISTEN.search(conf.read_text())
    except OSError:
        return None
    if found is None:
        return None
    host = found.group(1).strip("[]")
    try:
        if ipaddress.ip_address(host).is_unspecified:
            host = "127.0.0.1" if ipaddress.ip_address(host).version == 4 else "::1"
    except ValueError:
        pass
    return host, int(found.group(2))


def presented(host: str, port: int, ca: Path, *, timeout: float = 2.0) -> int | None:
    """The serial of the certificate the nats-server at host:port presents, checked against the
    mesh's CA; None if it does not answer. NATS sends its INFO in the clear, then the client
    starts TLS on the same connection."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False  # the serial is the question, not the name
    context.load_verify_locations(cafile=str(ca))
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw:
            info = b""
            while not info.endswith(b"\r\n"):
                chunk = raw.recv(4096)
                if not chunk:
                    return None
                info += chunk
            with context.wrap_socket(raw, server_hostname=host) as tls_sock:
                der = tls_sock.getpeercert(binary_form=True)
    except (OSError, ssl.SSLError):
        return None
    return x509.load_der_x509_certificate(der).serial_number if der else None


def _stores(folder: MeshDir) -> dict[str, Path]:
    """The folder's PostgreSQL clusters with a certificate of the mesh's CA (the primary's,
    a standby's: mesh/embedded/postgres.py), by the name their pieces have."""
    found = {"postgres": folder.root / "pg", "postgres-standby": folder.root / "pg-standby"}
    return {name: data for name, data in found.items() if (data / postgres.SERVER_CERT).is_file()}


def _postmaster(data: Path) -> tuple[int, int] | None:
    """The running server's pid and port, from its postmaster.pid; None if it is not running."""
    try:
        lines = (data / "postmaster.pid").read_text().splitlines()
        pid, port = int(lines[0]), int(lines[3])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return None
    return pid, port


def store_presented(port: int, ca: Path, *, timeout: float = 2.0) -> int | None:
    """The serial of the certificate the store on 127.0.0.1:`port` presents (PostgreSQL's own
    TLS, or its front's), after an SSLRequest; None if it does not answer with TLS."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False  # the serial is the question, not the name
    context.load_verify_locations(cafile=str(ca))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as raw:
            raw.sendall(pgfront.request(pgfront.SSL_REQUEST))
            if raw.recv(1) != b"S":
                return None
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls_sock:
                der = tls_sock.getpeercert(binary_form=True)
    except (OSError, ssl.SSLError):
        return None
    return x509.load_der_x509_certificate(der).serial_number if der else None


async def _rotate_store(folder: MeshDir, name: str, old: x509.Certificate) -> Rotated:
    """A new certificate for the store in place of `old`, for the same addresses, its files the
    server's account's as before. A front reads it again by itself (its file changed); a
    PostgreSQL with SSL of its own is told to reload (SIGHUP reads its SSL files again)."""
    data = _stores(folder)[name]
    cert_path = data / postgres.SERVER_CERT
    rotated = _swap_in(
        folder, name, cert_path, data / postgres.SERVER_KEY, old,
        _hosts(old) or ["127.0.0.1", "localhost"], what=f"the store {name}",
        owner=cert_path.stat(),
    )  # fmt: skip
    serial = int(rotated.serial, 16)
    running = _postmaster(data)
    if running is None:
        return rotated
    pid, port = running
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + RELOAD_WITHIN
    now = store_presented(port, folder.ca)
    while now != serial and time.monotonic() < deadline:
        await anyio.sleep(0.1)
        now = store_presented(port, folder.ca)
    rotated.presented = _hex(now) if now is not None else None
    rotated.state = "signalled" if now is None else "reloaded" if now == serial else "reload failed"
    return rotated


def _server_paths(folder: MeshDir, name: str) -> tuple[Path, Path, Path]:
    return folder.server_cert(name), folder.server_key(name), folder.server(name) / "nats.conf"


async def cmd_cert_show(args: argparse.Namespace) -> None:
    folder = _folder(args)
    ca_info, ca = _ca_info(folder)
    shown = []
    for name in folder.servers():
        cert_path, _, conf = _server_paths(folder, name)
        cert = _load(cert_path, f"nats-server {name}'s certificate")
        running = server.running_pid(folder.server(name) / "nats.pid") is not None
        where = _listen(conf) if running else None
        now = presented(*where, folder.ca) if where else None
        shown.append(ServerCert(
            name=name, subject=_common_name(cert, name), hosts=_hosts(cert),
            serial=_hex(cert.serial_number), not_after=_when(cert),
            issued_by_ca=tls.issued_by(cert, ca), running=running,
            presented=_hex(now) if now is not None else None, cert=str(cert_path),
        ))  # fmt: skip
    if args.json:
        print_json(Shown(dir=str(folder.root), ca=ca_info, servers=shown))
        return
    print(f"CA {ca_info.subject}: serial {ca_info.serial}, expires {ca_info.not_after} "
          f"({ca_info.cert})")  # fmt: skip
    for s in shown:
        line = (
            f"{s.name} ({s.subject}): {', '.join(s.hosts) or 'no addresses'}; serial {s.serial}, "
            f"expires {s.not_after}"
        )
        if not s.issued_by_ca:
            line += "; NOT issued by this folder's CA (clients refuse it; `mesh cert rotate`)"
        if not s.running:
            line += "; not running"
        elif s.presented is None:
            line += "; running, but did not answer a TLS handshake"
        elif s.presented != s.serial:
            line += f"; running with serial {s.presented} (reload it: `mesh cert rotate`)"
        print(line)


async def cmd_cert_rotate(args: argparse.Namespace) -> None:
    folder = _folder(args)
    ca_info, _ = _ca_info(folder)
    # Read every current certificate first: a folder with one unreadable leaves all untouched.
    current = {}
    for name in folder.servers():
        cert_path, _, _ = _server_paths(folder, name)
        cert = _load(cert_path, f"nats-server {name}'s certificate")
        hosts = _hosts(cert)
        if not hosts:
            raise CliError(
                f"nats-server {name}'s certificate {cert_path} names no address: cannot tell "
                "which ones the new one must be valid for"
            )
        current[name] = (cert, hosts)
    stores = {name: _load(data / postgres.SERVER_CERT, f"the store {name}'s certificate")
              for name, data in _stores(folder).items()}  # fmt: skip
    rotated = []
    for name, (old, hosts) in current.items():
        rotated.append(await _rotate_one(folder, name, old, hosts))
    for name, old in stores.items():
        rotated.append(await _rotate_store(folder, name, old))
    if args.json:
        print_json(Rotation(dir=str(folder.root), ca=ca_info, servers=rotated))
    else:
        for r in rotated:
            old = r.old_serial or "none"
            state = r.state
            if r.state == "reload failed":
                state += f" (it still presents serial {r.presented}; see its log)"
            elif r.state == "signalled":
                state += " (it did not answer since: it takes the new certificate when it starts)"
            print(f"{r.name}: serial {old} → {r.serial}, expires {r.not_after}, {state}")
    servers = ",".join(r.name for r in rotated)
    await folderaudit.record(
        args,
        folder,
        "cert-rotate",
        servers,
        "; ".join(
            f"{r.name} serial {r.old_serial or 'none'} to {r.serial}, {r.state}" for r in rotated
        ),
    )
    failed = [r.name for r in rotated if r.state == "reload failed"]
    if failed:
        raise CliError(
            f"the new certificates are in place, but {', '.join(failed)} did not take them on "
            f"reload; see its log (in {folder.root / 'logs'} for a dev mesh), or restart it"
        )


def _swap_in(
    folder: MeshDir, name: str, cert_path: Path, key_path: Path, old: x509.Certificate,
    hosts: list[str], *, what: str, owner: os.stat_result | None = None,
) -> Rotated:  # fmt: skip
    """A new key and certificate in place of `old`'s, for the same name and `hosts`: issued
    beside the files first, then moved over them (a rename each, the key first), so a failure
    while issuing leaves the old pair in use, and a server that reads them when signalled (or,
    a front, when the certificate's file changes) never reads half a pair. `owner`: the
    account the files stay with (the store's)."""
    new_cert = cert_path.with_name(f".{cert_path.name}.new")
    new_key = key_path.with_name(f".{key_path.name}.new")
    try:
        tls.issue_server(folder.tls, new_cert, new_key, name=_common_name(old, name), hosts=hosts)
    except tls.TlsError as e:
        raise CliError(f"{what}: {e}") from None
    if owner is not None:
        for path in (new_cert, new_key):
            os.chown(path, owner.st_uid, owner.st_gid)
    os.replace(new_key, key_path)
    os.replace(new_cert, cert_path)
    cert = _load(cert_path, f"{what}'s new certificate")
    return Rotated(
        name=name, hosts=hosts, old_serial=_hex(old.serial_number), serial=_hex(cert.serial_number),
        not_after=_when(cert), state="not running", presented=None, cert=str(cert_path),
    )  # fmt: skip


async def _rotate_one(
    folder: MeshDir, name: str, old: x509.Certificate, hosts: list[str]
) -> Rotated:
    cert_path, key_path, conf = _server_paths(folder, name)
    rotated = _swap_in(folder, name, cert_path, key_path, old, hosts, what=f"nats-server {name}")
    serial = int(rotated.serial, 16)
    try:
        server.reload(folder.server(name) / "nats.pid")
    except server.ServerNotRunning:
        return rotated
    where = _listen(conf)
    deadline = time.monotonic() + RELOAD_WITHIN
    now = None
    while where is not None:
        now = presented(*where, folder.ca)
        if now == serial or time.monotonic() > deadline:
            break
        await anyio.sleep(0.1)
    rotated.presented = _hex(now) if now is not None else None
    if where is None or now is None:  # nothing to ask, or no answer: the result is not known
        rotated.state = "signalled"
    else:
        rotated.state = "reloaded" if now == serial else "reload failed"
    return rotated


COMMANDS = {
    ("cert", "rotate"): cmd_cert_rotate,
    ("cert", "show"): cmd_cert_show,
}
