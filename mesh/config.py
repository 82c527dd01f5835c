"""Where to find the bus and the store, and the controller's settings: flags override the
environment, which overrides defaults."""

import os
import re
import urllib.parse

import msgspec

from mesh.errors import MeshError

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
    """The flag, MESH_DATABASE_URL, or `database-url` among the files the host wrote for this
    process, in which a relative `sslrootcert` names a file beside it (the controllers' module
    is given the mesh's CA as `store-ca.pem` there: services/controller/module.toml)."""
    given = flag or os.environ.get("MESH_DATABASE_URL")
    if given:
        return given
    written = _from_files("database-url")
    return _files_relative(written) if written else None


def _files_relative(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    folder = os.environ.get("MESH_FILES") or ""
    if not any(k == "sslrootcert" and v and not os.path.isabs(v) for k, v in query):
        return url
    query = [
        (k, os.path.join(folder, v) if k == "sslrootcert" and not os.path.isabs(v) else v)
        for k, v in query
    ]
    return parts._replace(query=urllib.parse.urlencode(query, safe="/")).geturl()


def secrets_key_file(flag: str | None = None) -> str | None:
    """The key of the secrets (mesh/auth/secretkeys.py), for the controller: the flag,
    MESH_SECRETS_KEY_FILE, or `secrets.key` among the files the host wrote for this process
    (named even if it is missing there: the controller says so in one line)."""
    given = flag or os.environ.get("MESH_SECRETS_KEY_FILE")
    if given:
        return given
    folder = os.environ.get("MESH_FILES")
    return os.path.join(folder, "secrets.key") if folder else None


def creds(flag: str | None = None) -> str | None:
    """A credentials file: the flag, MESH_CREDS, or `nats.creds` among the files the host wrote
    for this process (like systemd's LoadCredential=); an empty one means none."""
    return flag or os.environ.get("MESH_CREDS") or _nonempty_file("nats.creds")


def system_creds(flag: str | None = None) -> str | None:
    """The NATS system account's kicker (controller: mesh/auth/system.py): the flag,
    MESH_SYSTEM_CREDS, or `system.creds` among the files the host wrote for this process; an
    empty one means none (a mesh whose servers have no system account)."""
    return flag or os.environ.get("MESH_SYSTEM_CREDS") or _nonempty_file("system.creds")


def nats_signer_file(flag: str | None = None) -> str | None:
    """The mesh's NATS signing key (controller: services/controller/fleet/admission.py), which
    admits machines that join: the flag, MESH_NATS_SIGNER_FILE, or `signer.nk` among the files the
    host wrote for this process; an empty one means none (joins are then refused, saying why)."""
    return flag or os.environ.get("MESH_NATS_SIGNER_FILE") or _nonempty_file("signer.nk")


def _nonempty_file(name: str) -> str | None:
    folder = os.environ.get("MESH_FILES")
    found = os.path.join(folder, name) if folder else None
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


class ConfigError(MeshError):
    """A setting whose value cannot be used; the message names the setting and the value."""


# How much history the holder keeps in the store's `events` table (services/controller/
# pruning.py); docs/operations.md, "Keeping the store's size", says what each means.
EVENTS_MAX_AGE = "30d"
EVENTS_MAX_COUNT = "1000000"
EVENTS_PRUNE_EVERY = "1m"
_SPAN = re.compile(r"(\d+(?:\.\d+)?)(s|m|h|d)")
_SPAN_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_AGE_MOST = 3650 * 86400.0  # ten years: further back than the store's clock arithmetic cares to
_EVERY = (0.1, 86400.0)
_COUNT_MOST = 10**12


class EventsKept(msgspec.Struct, frozen=True):
    """Events older than `max_age` seconds, and all but the newest `max_count`, are deleted by
    the holder every `every` seconds; None keeps them all."""

    max_age: float | None
    max_count: int | None
    every: float


def events_kept(
    *, max_age: str | None = None, max_count: str | None = None, every: str | None = None
) -> EventsKept:
    """The flags' values (None: not given), else MESH_EVENTS_MAX_AGE, MESH_EVENTS_MAX_COUNT,
    MESH_EVENTS_PRUNE_EVERY, else the defaults. `off` keeps events of any age, or any number."""
    age_name, age = _setting("--events-max-age", "MESH_EVENTS_MAX_AGE", max_age, EVENTS_MAX_AGE)
    count_name, count = _setting(
        "--events-max-count", "MESH_EVENTS_MAX_COUNT", max_count, EVENTS_MAX_COUNT
    )
    every_name, every_text = _setting(
        "--events-prune-every", "MESH_EVENTS_PRUNE_EVERY", every, EVENTS_PRUNE_EVERY
    )
    kept_age = None if age == "off" else _span(age_name, age, most=_AGE_MOST, off=True)
    kept_count: int | None = None
    if count != "off":
        if not count.isascii() or not count.isdigit() or int(count) > _COUNT_MOST:
            raise ConfigError(
                f"{count_name}: {count[:40]!r} is not a number of events (0 to {_COUNT_MOST}, "
                "or off)"
            )
        kept_count = int(count)
    prune_every = _span(every_name, every_text, most=_EVERY[1])
    if prune_every < _EVERY[0]:
        raise ConfigError(f"{every_name}: {every_text!r} is shorter than {_EVERY[0]:g}s")
    return EventsKept(max_age=kept_age, max_count=kept_count, every=prune_every)


def _setting(flag: str, env: str, given: str | None, default: str) -> tuple[str, str]:
    """(the name to cite in an error, the value): the flag's, else the environment's."""
    if given is not None:
        return flag, given.strip()
    from_env = os.environ.get(env)
    if from_env is not None and from_env.strip():
        return env, from_env.strip()
    return flag, default


def _span(name: str, text: str, *, most: float, off: bool = False) -> float:
    """'90s', '15m', '12h', '30d' (or '0') as seconds."""
    if text == "0":
        return 0.0
    m = _SPAN.fullmatch(text)
    if not m:
        raise ConfigError(f"{name}: {text[:40]!r} is not a duration (like 90s, 15m, 12h, 30d"
                          f"{', or off' if off else ''})")  # fmt: skip
    seconds = float(m.group(1)) * _SPAN_UNITS[m.group(2)]
    if seconds > most:
        raise ConfigError(f"{name}: {text!r} is longer than {most / 86400:g}d")
    return seconds


# How many versions of each module keep their bundles in the bundle store (services/controller/
# bundles.py): a rollback to one of them needs no push and no build. docs/operations.md,
# "Keeping the store and the log bounded", says what each means.
VERSIONS_KEPT = "10"
VERSIONS_PRUNE_EVERY = "10m"
_VERSIONS_MOST = 1_000_000


class VersionsKept(msgspec.Struct, frozen=True):
    """The bundles and source archives of each module's newest `count` versions (and of its
    current one) stay; the holder deletes older versions' every `every` seconds. None keeps
    every version's."""

    count: int | None
    every: float


def versions_kept(*, count: str | None = None, every: str | None = None) -> VersionsKept:
    """The flags' values (None: not given), else MESH_VERSIONS_KEPT, MESH_VERSIONS_PRUNE_EVERY,
    else the defaults. `off` keeps the bundles of every version."""
    count_name, count_text = _setting("--versions-kept", "MESH_VERSIONS_KEPT", count, VERSIONS_KEPT)
    every_name, every_text = _setting(
        "--versions-prune-every", "MESH_VERSIONS_PRUNE_EVERY", every, VERSIONS_PRUNE_EVERY
    )
    kept: int | None = None
    if count_text != "off":
        if (
            not count_text.isascii()
            or not count_text.isdigit()
            or not 1 <= int(count_text) <= _VERSIONS_MOST
        ):
            raise ConfigError(
                f"{count_name}: {count_text[:40]!r} is not a number of versions (1 to "
                f"{_VERSIONS_MOST}, or off)"
            )
        kept = int(count_text)
    prune_every = _span(every_name, every_text, most=_EVERY[1])
    if prune_every < _EVERY[0]:
        raise ConfigError(f"{every_name}: {every_text!r} is shorter than {_EVERY[0]:g}s")
    return VersionsKept(count=kept, every=prune_every)
