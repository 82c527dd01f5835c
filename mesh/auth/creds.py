"""Credentials files: one identity's nkey seed, decorated the way NATS tools write it (so the
`nats` command line reads the same file with `--nkey`), with a header naming whose it is and the
inbox prefix its permissions allow. A file can also carry what a machine needs to reach the
mesh: the NATS servers (`# mesh-nats-url:`) and the mesh's CA certificate, so one file is all a
new machine is handed (`mesh machine add`).

The mesh's own files are NATS `.creds` files (a user JWT, then the seed: mesh/auth/trust.py),
which the `nats` command line reads as they are. A file made by another tool is read too (a
`.creds` file of another operator; a bare seed file, of a mesh from before JWTs), with the
default inbox prefix.
"""

import os
import re
from pathlib import Path

import msgspec

from mesh.auth.keys import public_of
from mesh.errors import MeshError

DEFAULT_INBOX = "_INBOX"
_SEED_BEGIN = "-----BEGIN USER NKEY SEED-----"
_SEED_END = "------END USER NKEY SEED------"
_JWT_BEGIN = "-----BEGIN NATS USER JWT-----"
_JWT_END = "------END NATS USER JWT------"
_JWT_LINE = re.compile(r"-----BEGIN NATS USER JWT-----\s*\n\s*(\S+)\s*\n")
_INBOX_LINE = re.compile(r"^# mesh-inbox: (\S+)\s*$", re.MULTILINE)
_SEED_LINE = re.compile(r"^\s*(SU[A-Z2-7]+)\s*$", re.MULTILINE)
_SERVERS_LINE = re.compile(r"^# mesh-nats-url: (\S+)\s*$", re.MULTILINE)
_CONTROLLER_LINE = re.compile(r"^# mesh-controller: (U[A-Z2-7]+)\s*$", re.MULTILINE)
_OPERATOR_LINE = re.compile(r"^# mesh-operator: (\S+)\s*$", re.MULTILINE)
_CERT = re.compile(
    r"-----BEGIN CERTIFICATE-----\s+[A-Za-z0-9+/=\s]+?-----END CERTIFICATE-----", re.MULTILINE
)


class CredsError(MeshError):
    """A credentials file that cannot be used; the message names the file and why."""


class Creds(msgspec.Struct, frozen=True):
    path: str
    seed: str | None
    inbox: str  # the inbox prefix this identity may subscribe to
    jwt: bool = False  # a user JWT precedes the seed: the client reads the file itself
    user_jwt: str | None = None
    ca: str | None = None  # the mesh's CA certificate (PEM), when the file carries it
    servers: str | None = None  # the NATS URL(s), comma-separated, when the file carries them
    # The controllers' public key: what they sign, a host checks with it (mesh.auth.signing).
    controller: str | None = None
    # The operator these credentials are (`# mesh-operator:`): the client asks its changes on
    # that operator's own subjects (mesh.op.<name>.<verb>), which only it may publish on.
    operator: str | None = None


def render(
    *, who: str, seed: str, inbox: str, ca: str | None = None, servers: str | None = None,
    controller: str | None = None, operator: str | None = None, jwt: str | None = None,
) -> str:  # fmt: skip
    lines = [
        f"# mesh credentials: {who}",
        "# Whoever holds this file connects to the mesh's NATS as this identity:",
        "# keep it secret (mode 0600). Revoke it by removing the identity from the mesh.",
        f"# mesh-inbox: {inbox}",
    ]
    if servers:
        lines.append(f"# mesh-nats-url: {servers}")
    if controller:
        lines.append(f"# mesh-controller: {controller}")
    if operator:
        lines.append(f"# mesh-operator: {operator}")
    if jwt:
        lines += [_JWT_BEGIN, jwt, _JWT_END, ""]
    lines += [_SEED_BEGIN, seed, _SEED_END]
    if ca:
        lines += [
            "",
            "# the mesh's CA: the servers' certificates are checked against it",
            ca.strip(),
        ]
    return "\n".join([*lines, ""])


def write(
    path: Path, *, who: str, seed: str, inbox: str, ca: str | None = None,
    servers: str | None = None, controller: str | None = None, operator: str | None = None,
    jwt: str | None = None,
) -> None:  # fmt: skip
    """Write the file readable by its owner alone (0600), atomically: never a moment when it is
    readable by others or half written."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        text = render(who=who, seed=seed, inbox=inbox, ca=ca, servers=servers,
                      controller=controller, operator=operator, jwt=jwt)  # fmt: skip
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read(path: str | Path) -> Creds:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise CredsError(f"credentials {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise CredsError(f"credentials {path}: not a text file") from None
    user_jwt = _JWT_LINE.search(text)
    found = _SEED_LINE.search(text)
    if found is None:
        raise CredsError(f"credentials {path}: no NATS user seed (a line starting SU) in it")
    seed = found.group(1)
    try:
        public_of(seed)
    except ValueError as e:
        raise CredsError(f"credentials {path}: {e}") from None
    inbox = _INBOX_LINE.search(text)
    servers = _SERVERS_LINE.search(text)
    controller = _CONTROLLER_LINE.search(text)
    operator = _OPERATOR_LINE.search(text)
    certs = _CERT.findall(text)
    return Creds(
        path=str(path),
        seed=seed,
        inbox=inbox.group(1) if inbox else DEFAULT_INBOX,
        ca="\n".join(certs) + "\n" if certs else None,
        servers=servers.group(1) if servers else None,
        controller=controller.group(1) if controller else None,
        operator=operator.group(1) if operator else None,
        jwt=user_jwt is not None,
        user_jwt=user_jwt.group(1) if user_jwt else None,
    )
