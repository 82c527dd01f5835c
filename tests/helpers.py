"""Small helpers shared by tests: verb calls over a real NATS connection."""

import asyncio
import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

MESH = [sys.executable, "-P", "-m", "mesh"]


async def ask(nc: Client, subject: str, body: bytes | dict = b"{}", timeout: float = 2) -> Any:
    """One request; returns the decoded JSON reply, or None if nobody answered in time."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    try:
        msg = await nc.request(subject, data, timeout=timeout)
    except (NoRespondersError, NatsTimeout):
        return None
    return json.loads(msg.data)


def wait_until(predicate: Callable[[], object], *, within: float, what: str) -> object:
    """Poll `predicate` until it returns something truthy; fail the test after `within` s."""
    deadline = time.monotonic() + within
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {within:g}s waiting for {what}")
        time.sleep(0.05)  # ok: polling interval of a condition with a deadline


async def await_until(predicate, *, within: float, what: str):
    """Async form of wait_until: `predicate` is an async callable."""
    deadline = time.monotonic() + within
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {within:g}s waiting for {what}")
        await asyncio.sleep(0.05)  # ok: polling interval of a condition with a deadline


def mesh_cli(
    *args: str, nats_url: str, timeout: float = 60, creds: str | None = None
) -> subprocess.CompletedProcess:
    """Run the `mesh` command line as a user would (with `creds` as MESH_CREDS, or none)."""
    env = {k: v for k, v in os.environ.items() if k != "MESH_CREDS"}
    return subprocess.run(
        [*MESH, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**env, "MESH_NATS_URL": nats_url, **({"MESH_CREDS": creds} if creds else {})},
    )


async def next_failure(events, *, within: float) -> dict:
    """The next apply event that failed, from a subscription to mesh.event.<name>.applied."""
    deadline = time.monotonic() + within
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"no failed apply within {within:g}s")
        event = json.loads((await events.next_msg(timeout=left)).data)
        if not event["ok"]:
            return event


def engine_answers() -> bool:
    """A Docker Engine is here and answers."""
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


def account_of(pid: int) -> str:
    """The name of the account a process runs as."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return pwd.getpwuid(int(line.split()[1])).pw_name
    raise AssertionError(f"no Uid line for pid {pid}")


def ok(done: subprocess.CompletedProcess) -> str:
    """A command that worked: its output."""
    assert done.returncode == 0, done.stderr
    return done.stdout


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """A command that failed as a user should see it: exit 1, one line, no traceback."""
    assert done.returncode == 1, done.stdout
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]
