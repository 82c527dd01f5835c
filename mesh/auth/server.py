"""The nats-server side: the `authorization` block every connection is checked against, and
reloading a running server after it changes (users are reloadable: a revoked user's open
connections are closed by the server)."""

import json
import os
import signal
from collections.abc import Iterable
from pathlib import Path

from mesh.auth.policy import User, permissions


class ServerNotRunning(Exception):
    pass


def render(users: Iterable[User]) -> str:
    """The `authorization { users = [...] }` block. Strings are JSON-quoted, which nats-server
    reads literally (no `$variable` expansion inside quotes)."""
    users = sorted(users, key=lambda u: (u.kind, u.name))
    if not users:
        # An empty user list would leave the server open to anyone: never write one.
        raise ValueError("no users: refusing to write an authorization block that admits anyone")
    q = json.dumps
    lines = [
        "# Written by mesh from the mesh's users (creds/users.json): edits here are overwritten.",
        "authorization {",
        "  users = [",
    ]
    for user in users:
        p = permissions(user)
        lines += [
            f"    # {user.describe()}",
            "    {",
            f"      nkey: {q(user.public)}",
            "      permissions: {",
            f"        publish: {{ allow: [{', '.join(q(s) for s in p.publish)}] }}",
            f"        subscribe: {{ allow: [{', '.join(q(s) for s in p.subscribe)}] }}",
        ]
        if p.responses:
            lines.append("        allow_responses: true")
        lines += ["      }", "    }"]
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def write(path: Path, users: Iterable[User]) -> None:
    text = render(users)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def running_pid(pid_file: Path) -> int | None:
    """The pid in `pid_file` if that process is alive, else None."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, someone else's: the reload will say so
    return pid


def reload(pid_file: Path) -> int:
    """Ask the server whose pid is in `pid_file` to reload its configuration (SIGHUP)."""
    pid = running_pid(pid_file)
    if pid is None:
        raise ServerNotRunning(f"no nats-server is running for {pid_file}")
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        raise ServerNotRunning(f"nats-server (pid {pid}) has stopped") from None
    return pid
