"""Where to find the bus and the store: flags override the environment, which overrides defaults."""

import os

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def nats_url(flag: str | None = None, creds: str | None = None) -> str:
    """The NATS server(s), comma-separated: the flag, MESH_NATS_URL, the ones the credentials
    file names (a file `mesh machine add` made carries them), or the default."""
    return flag or os.environ.get("MESH_NATS_URL") or _creds_servers(creds) or DEFAULT_NATS_URL


def servers(url: str) -> list[str]:
    """`tls://a:4222,tls://b:4222` as a list; every client is given every server."""
    return [part.strip() for part in url.split(",") if part.strip()]


def ca(flag: str | None = None) -> str | None:
    """The mesh's CA certificate file: the flag, MESH_CA, or `ca.pem` among the files the host
    wrote for this process (a module can give its process the CA as a file of that name).
    Without any, the CA a credentials file carries is used."""
    given = flag or os.environ.get("MESH_CA")
    if given:
        return given
    folder = os.environ.get("MESH_FILES")
    found = os.path.join(folder, "ca.pem") if folder else None
    return found if found and os.path.isfile(found) else None


def _creds_servers(path: str | None) -> str | None:
    if not path:
        return None
    from mesh.auth import creds as credentials  # only when a file is named

    try:
        return credentials.read(path).servers
    except credentials.CredsError:
        return None  # the connection reports the file's trouble


def database_url(flag: str | None = None) -> str | None:
    return flag or os.environ.get("MESH_DATABASE_URL") or _from_files("database-url") or None


def creds(flag: str | None = None) -> str | None:
    """A credentials file: the flag, MESH_CREDS, or `nats.creds` among the files the host wrote
    for this process (like systemd's LoadCredential=); an empty one means none."""
    given = flag or os.environ.get("MESH_CREDS")
    if given:
        return given
    folder = os.environ.get("MESH_FILES")
    found = os.path.join(folder, "nats.creds") if folder else None
    return found if found and os.path.isfile(found) and os.path.getsize(found) > 0 else None


def _from_files(name: str) -> str | None:
    """A value the host wrote as a file for this process ($MESH_FILES/NAME), stripped."""
    folder = os.environ.get("MESH_FILES")
    if not folder:
        return None
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None
