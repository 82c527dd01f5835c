"""A machine joins a mesh with one command (`mesh join TOKEN`), as a user tries it: `mesh dev up`
(TLS, every piece with its own credentials), `mesh token create` as its admin, and `mesh join`
run with none of that mesh's settings, into a folder of its own: checked against the CA before
it sends anything, admitted on the servers with no file copied, its host agent up in `mesh
nodes` with the token's tier and labels; refused in one line for a used, wrong or revoked
token, a CA that is not the token's, a name taken and a second join; `mesh machine remove`
revokes it on every server at once."""

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import MESH, DevUp, await_until, env_file, node_named, ok, ok_json

from mesh import bus
from mesh.auth import claims
from mesh.client.join import JoinError, ask_to_join, mesh_ca
from mesh.tokens import JoinToken, decode

OTHER_MESH = ("MESH_NATS_URL", "MESH_CA", "MESH_CREDS", "MESH_DIR", "MESH_DATABASE_URL")


def _mesh(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*MESH, *args], capture_output=True, text=True, env=env, timeout=180)


def _joining(*args: str) -> subprocess.CompletedProcess:
    """`mesh join` as on a new machine: none of the mesh's settings in its environment."""
    env = {k: v for k, v in os.environ.items() if k not in OTHER_MESH}
    return subprocess.run([*MESH, "join", *args], capture_output=True, text=True, env=env,
                          timeout=180)  # fmt: skip


def _refused(done: subprocess.CompletedProcess) -> str:
    assert done.returncode != 0, done.stdout
    lines = done.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("mesh: error: "), done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return lines[-1]


def _ours(folder: Path) -> list[int]:
    """Processes whose command line names `folder`: a joined host runs detached, and outlives
    a test that failed before it learnt its pid."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(folder).encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            pass
    return found


@pytest.fixture
def dev(tmp_path: Path):
    up = DevUp(tmp_path / "dev", hosts=1)
    try:
        up.ready()
        yield up
    finally:
        up.kill()
        for pid in _ours(tmp_path):  # joined hosts, their process groups too
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


async def test_a_machine_joins_with_a_token_and_is_removed_everywhere_at_once(
    dev, tmp_path: Path
) -> None:
    env = {**os.environ, **env_file(dev.folder)}
    token = ok(_mesh(env, "token", "create", "--tier", "1", "--label", "zone=a")).strip()
    assert len(token.splitlines()) == 1 and token.startswith("mesh1-")

    done = _joining(token, "--name", "joiner", "--dir", str(tmp_path / "joiner"), "--root",
                    str(tmp_path / "joiner" / "host"), "--json")  # fmt: skip
    joined = json.loads(ok(done))
    assert (joined["name"], joined["tier"], joined["labels"]) == ("joiner", 1, {"zone": "a"})
    assert "the servers present the CA the token names" in done.stderr
    creds = Path(joined["creds"])
    assert oct(creds.stat().st_mode & 0o777) == "0o600"
    # The machine's own key: its seed only here, its JWT signed by the mesh's signer.
    jwt = claims.decode(creds.read_text().split("-----BEGIN NATS USER JWT-----\n")[1].split()[0])
    assert jwt["nats"]["issuer_account"] and jwt["name"] == "host:joiner"

    # Reconnecting: the commands below run as subprocesses while this test's loop waits, and a
    # loaded machine can keep it from answering the server's pings for longer than it allows.
    admin = await bus.connect(env["MESH_NATS_URL"], name="test", creds=env["MESH_CREDS"],
                              ca=env["MESH_CA"], reconnect=True)  # fmt: skip
    try:

        async def up(want: bool):
            node = await node_named(admin, "joiner", timeout=5)
            return node if node is not None and node["up"] is want else None

        node = await await_until(lambda: up(True), within=30, what="joiner up in nodes")
        assert (node["tier"], node["labels"]) == (1, {"zone": "a"})
        listed = ok_json(_mesh(env, "token", "list", "--json"))["tokens"]
        assert listed[0]["uses_left"] == 0 and listed[0]["used_by"] == ["joiner"]
        entries = ok_json(_mesh(env, "audit", "--json"))["entries"]
        assert ("join:joiner", "token-use", "ok") in {(e["who"], e["verb"], e["outcome"])
                                                       for e in entries}  # fmt: skip
        assert token.split(".")[1] not in json.dumps(entries)  # never the secret

        # Refused, each in one line, nothing half made.
        again = _refused(_joining(token, "--name", "other", "--dir", str(tmp_path / "other")))
        assert "is used up: its 1 use(s) went to joiner" in again
        assert not (tmp_path / "other" / "creds").exists()
        twice = _refused(_joining(token, "--name", "joiner", "--dir", str(tmp_path / "joiner")))
        assert "joined a mesh already, as joiner" in twice
        fresh = ok(_mesh(env, "token", "create")).strip()
        taken = _refused(_joining(fresh, "--name", "node-1", "--dir", str(tmp_path / "n1")))
        assert "the name is taken" in taken
        parts = decode(fresh)
        wrong = JoinToken(urls=parts.urls, ca_sha256=parts.ca_sha256, id=parts.id,
                          secret="A" * 43, extra=parts.extra).encode()  # fmt: skip
        assert "wrong token" in _refused(_joining(wrong, "--dir", str(tmp_path / "w")))
        other_ca = JoinToken(urls=parts.urls, ca_sha256="0" * 64, id=parts.id,
                             secret=parts.secret, extra=parts.extra).encode()  # fmt: skip
        line = _refused(_joining(other_ca, "--dir", str(tmp_path / "ca")))
        assert "does not present the CA the token names" in line and "nothing was sent" in line
        ok(_mesh(env, "token", "revoke", parts.id))
        revoked = _refused(_joining(fresh, "--name", "late", "--dir", str(tmp_path / "late")))
        assert f"join token {parts.id} was revoked at" in revoked

        # Removed: its key revoked on the servers, which close its host's connection.
        removed = ok_json(_mesh(env, "machine", "remove", "joiner", "--dir", str(dev.folder),
                                "--json"))  # fmt: skip
        assert removed["reloaded"] and "which it joined with" in removed["revoked"]
        await await_until(lambda: up(False), within=30, what="joiner down once revoked")
        with pytest.raises(bus.Unauthorized):
            await bus.connect(env["MESH_NATS_URL"], name="gone", creds=str(creds),
                              ca=env["MESH_CA"], reconnect=False)  # fmt: skip
    finally:
        await admin.close()


async def test_a_machine_whose_answer_was_lost_asks_again_without_another_use(
    dev, tmp_path: Path
) -> None:
    env = {**os.environ, **env_file(dev.folder)}
    token = decode(ok(_mesh(env, "token", "create")).strip())
    ca = tmp_path / "ca.pem"
    ca.write_text(mesh_ca(token))
    key = claims.new_key("user")
    first = await ask_to_join(token, ca=ca, machine="lost", public=key.public)
    second = await ask_to_join(token, ca=ca, machine="lost", public=key.public)
    assert (first.again, second.again) == (False, True)
    assert claims.decode(second.jwt)["sub"] == key.public
    listed = ok_json(_mesh(env, "token", "list", "--json"))["tokens"]
    assert listed[0]["used_by"] == ["lost"]  # one use, whatever was asked twice
    stranger = claims.new_key("user")  # the same name with another key: refused
    with pytest.raises(JoinError, match="has joined already, with another key or token"):
        await ask_to_join(token, ca=ca, machine="lost", public=stranger.public)
