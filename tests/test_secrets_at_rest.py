"""Secrets at rest (mesh/auth/secretkeys.py, services/controller/catalog/secretkeys.py): the store
holds ciphertext only, the key is a file the controllers are given, `mesh secret rotate-key` moves
every secret to a new key while hosts go on getting theirs, and a controller without the key
says so in one line. Real controllers, hosts, NATS, PostgreSQL and its own pg_dump."""

import base64
import json
import os
import subprocess
from pathlib import Path

import anyio
import anyio.to_thread
import asyncpg
import pytest
from helpers import MESH, await_until, ok, ok_json, one_line_error
from module_folders import HELLO, HELLO_TOKEN
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from mesh import subjects
from mesh.auth import secretkeys
from mesh.embedded import postgres


def _token(tmp_path: Path, machine: str) -> Path:
    return tmp_path / "hosts" / machine / "processes" / "hello" / "files" / "token"


async def _hello_on_node_1(start_fleet, cli, tmp_path: Path) -> None:
    await start_fleet(hosts=1)
    ok(cli("secret", "set", "hello-token", stdin=HELLO_TOKEN))
    ok(cli("push", str(HELLO)))
    ok(cli("assign", "hello", "node-1", "--wait"))
    assert _token(tmp_path, "node-1").read_text() == HELLO_TOKEN


def _dump(database_url: str) -> str:
    """The store as `pg_dump` (the embedded PostgreSQL's own) writes it."""
    done = subprocess.run(
        [postgres.bin("pg_dump"), "--dbname", database_url], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_a_dump_of_the_store_holds_no_secret_value(
    start_fleet, cli, tmp_path, database_url, secrets_key_file
) -> None:
    await _hello_on_node_1(start_fleet, cli, tmp_path)
    dump = _dump(database_url)
    assert "COPY public.secrets " in dump and "hello-token" in dump  # the row is there
    value = HELLO_TOKEN.encode()
    for form in (HELLO_TOKEN, value.hex(), base64.b64encode(value).decode()):
        assert form not in dump  # as text, as bytea's hex, as base64
    for raw in secretkeys.read(secrets_key_file).keys:  # nor the key that opens them
        assert base64.b64encode(raw).decode() not in dump and raw.hex() not in dump


async def test_a_host_fetching_while_the_key_rotates_never_fails(
    start_fleet, cli, nc, tmp_path, database_url, monkeypatch
) -> None:
    key_file = tmp_path / "keys" / "secrets.key"
    first = secretkeys.make(key_file)
    monkeypatch.setenv("MESH_SECRETS_KEY_FILE", str(key_file))  # this test's controllers
    await _hello_on_node_1(start_fleet, cli, tmp_path)

    answers: list[str] = []
    failures: list[str] = []
    rotations: list[dict] = []

    async def fetch_until(done: anyio.Event) -> None:
        """The host's own request for its secret, as its agent asks it, again and again."""
        body = json.dumps({"name": "hello-token"}).encode()
        while not done.is_set():
            try:
                msg = await nc.request(subjects.ctl_host("node-1", "secret"), body, timeout=5)
            except (NoRespondersError, NatsTimeout) as e:
                failures.append(repr(e))
                continue
            reply = json.loads(msg.data)
            if "value" not in reply:
                failures.append(msg.data.decode())
                continue
            answers.append(base64.b64decode(reply["value"]).decode())

    async def fetched(more_than: int) -> bool:
        return len(answers) > more_than

    def rotate() -> None:
        for _ in range(3):
            done = cli("--json", "secret", "rotate-key", "--key-file", str(key_file))
            rotations.append(ok_json(done))

    done = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(fetch_until, done)
        await await_until(lambda: fetched(0), within=10, what="the first fetch")
        await anyio.to_thread.run_sync(rotate)
        after = len(answers)
        await await_until(lambda: fetched(after), within=10, what="a fetch after the rotations")
        done.set()
    assert failures == []
    assert len(answers) > 3 and set(answers) == {HELLO_TOKEN}

    # Every rotation moved the secret to a new key, and the file holds that key alone.
    keys = [r["key"] for r in rotations]
    assert len(set(keys)) == 3 and first.active not in keys
    assert [r["rewrapped"] for r in rotations] == [1, 1, 1]
    assert rotations[0]["previous"] == [first.active]
    ring = secretkeys.read(key_file)
    assert ring.ids() == [keys[-1]]
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT key_id FROM secrets")
        store_key = await conn.fetchval("SELECT key_id FROM secrets_key")
        audited = await conn.fetch("SELECT detail FROM audit WHERE verb = 'secret-rotate-key' "
                                   "AND outcome = 'ok' ORDER BY id")  # fmt: skip
    finally:
        await conn.close()
    assert [r["key_id"] for r in rows] == [keys[-1]] and store_key == keys[-1]
    # Each rotation's audit entry names the key it brought (not a plan's "no plan").
    assert [r["detail"] for r in audited] == [f"the secrets under key {k}" for k in keys]
    # The store's secrets still reach the host, under the new key.
    ok(cli("secret", "set", "hello-token", "--wait", stdin=HELLO_TOKEN + "-2"))
    assert _token(tmp_path, "node-1").read_text() == HELLO_TOKEN + "-2"


def _controller_run(database_url: str, nats_url: str, key_file: Path) -> str:
    """`mesh controller run` given `key_file`, which stops it: the one line it says."""
    return one_line_error(subprocess.run(
        [*MESH, "controller", "run", "--instance", "ctl-keyless"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "MESH_NATS_URL": nats_url,
             "MESH_DATABASE_URL": database_url, "MESH_SECRETS_KEY_FILE": str(key_file)},
    ))  # fmt: skip


async def test_a_controller_without_the_key_says_so_in_one_line(
    start_fleet, cli, nats_url, tmp_path, database_url
) -> None:
    await _hello_on_node_1(start_fleet, cli, tmp_path)
    missing = tmp_path / "lost" / "secrets.key"
    said = await anyio.to_thread.run_sync(_controller_run, database_url, nats_url, missing)
    assert str(missing) in said and "no such file" in said and "backup" in said

    other = tmp_path / "other" / "secrets.key"
    made = secretkeys.make(other)
    said = await anyio.to_thread.run_sync(_controller_run, database_url, nats_url, other)
    assert str(other) in said and made.active in said and "wrapped under k-" in said

    other.chmod(0o644)
    said = await anyio.to_thread.run_sync(_controller_run, database_url, nats_url, other)
    assert "mode 0644" in said and f"chmod 600 {other}" in said

    # The key's own name is never a secret of the store.
    said = one_line_error(cli("secret", "set", "mesh-secrets-key", stdin="x"))
    assert "name: mesh-secrets-key" in said


async def test_plaintext_secrets_of_an_older_mesh_are_sealed_at_takeover(
    start_fleet, cli, tmp_path, database_url
) -> None:
    ok(subprocess.run([*MESH, "controller", "migrate", "--database-url", database_url],
                      capture_output=True, text=True, timeout=60))  # fmt: skip
    conn = await asyncpg.connect(database_url)
    try:  # as an older mesh stored it: the value itself, no key
        await conn.execute(
            "INSERT INTO secrets (name, value, version) VALUES ('hello-token', $1, 4)",
            HELLO_TOKEN.encode(),
        )
    finally:
        await conn.close()
    await start_fleet(hosts=1)

    async def sealed() -> asyncpg.Record | None:
        conn = await asyncpg.connect(database_url)
        try:
            row = await conn.fetchrow("SELECT value, key_id, version FROM secrets")
        finally:
            await conn.close()
        return row if row["key_id"] is not None else None

    row = await await_until(sealed, within=30, what="the plaintext secret sealed")
    assert HELLO_TOKEN.encode() not in bytes(row["value"]) and row["version"] == 4
    assert HELLO_TOKEN not in _dump(database_url)
    ok(cli("push", str(HELLO)))
    ok(cli("assign", "hello", "node-1", "--wait"))
    assert _token(tmp_path, "node-1").read_text() == HELLO_TOKEN


# --- the envelope alone (mesh/auth/secretkeys.py) ------------------------------------------------


def test_a_seal_opens_only_as_the_secret_and_version_it_was_made_for() -> None:
    ring = secretkeys.KeyRing((secretkeys.new_key(),))
    sealed = ring.seal(name="db-password", version=3, value=b"hunter2")
    assert b"hunter2" not in sealed.value + sealed.data_key
    assert ring.open(name="db-password", version=3, sealed=sealed) == b"hunter2"
    with pytest.raises(secretkeys.SecretsKeyError, match="copied from another secret"):
        ring.open(name="other", version=3, sealed=sealed)  # a row copied under another name
    with pytest.raises(secretkeys.SecretsKeyError, match="does not open as version 2"):
        ring.open(name="db-password", version=2, sealed=sealed)  # an older version put back
    other = secretkeys.KeyRing((secretkeys.new_key(),))
    with pytest.raises(secretkeys.KeyMissing, match=sealed.key_id):
        other.open(name="db-password", version=3, sealed=sealed)


def test_a_rotation_rewraps_the_data_key_and_keeps_the_value() -> None:
    old = secretkeys.KeyRing((secretkeys.new_key(),))
    sealed = old.seal(name="token", version=1, value=b"v")
    both = old.first(secretkeys.new_key())
    moved = both.rewrap(name="token", sealed=sealed)
    assert moved.key_id == both.active != old.active and moved.value == sealed.value
    assert both.only_active().open(name="token", version=1, sealed=moved) == b"v"


def test_a_key_file_that_cannot_be_used_is_said_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "secrets.key"
    for text, said in (("# nothing\n", "holds no key"), ("not base64!\n", "line 1 is not base64"),
                       ("QUJD\n", "line 1 holds 3 bytes, not 32")):  # fmt: skip
        path.write_text(text)
        path.chmod(0o600)
        with pytest.raises(secretkeys.SecretsKeyError, match=said):
            secretkeys.read(path)
    made = tmp_path / "keys" / "secrets.key"
    ring = secretkeys.make(made)
    assert secretkeys.read(made) == ring and made.stat().st_mode & 0o777 == 0o600
    with pytest.raises(secretkeys.SecretsKeyError, match="exists already"):
        secretkeys.make(made)  # never over a key a store may need
