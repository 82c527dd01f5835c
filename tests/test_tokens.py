"""Join tokens (issue 40, item 2): the token as text (versioned, one line, refused in one line
naming what is wrong and never its secret); made, listed and revoked by an admin through the
command line against a real nats-server with operators' credentials, a controller and
PostgreSQL, refused to a viewer and a deployer; the secret in no reply, table or audit entry;
and `redeem`, what `mesh join` will call, against the real store: one use, and each refusal
in its words."""

import hashlib
import json
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import anyio
import asyncpg
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from faults import query
from helpers import MESH, await_until, mesh_cli, ok, ok_json, one_line_error
from secured import Secured

from mesh import paging, tokens, wire
from mesh.auth import creds as credentials
from mesh.auth import registry, tls
from mesh.auth.keys import new_user
from mesh.model import Grant, TokenCreateRequest, TokenRevokeRequest
from mesh.store.migrate import migrate
from programs.cli.tokens import _mesh_ca, ttl
from services.controller.fleet import tokens as served
from services.controller.fleet.tokens import Tokens
from services.controller.trust.audit import Audit

CA_HEX = "ab" * 32
ID = "0123456789ab"

# --- the token as text ---------------------------------------------------------------------------


def test_a_token_reads_back_as_it_was_made() -> None:
    made = tokens.JoinToken(urls=["tls://10.0.0.1:4222", "tls://[fd00::2]:4222"],
                            ca_sha256=CA_HEX, id=ID, secret=tokens.new_secret())  # fmt: skip
    text = made.encode()
    assert text.startswith("mesh1-0123456789ab.") and len(text.split()) == 1
    assert tokens.decode(f"  {text}\n") == made  # as pasted
    with_extra = tokens.JoinToken(urls=["nats://h:4222"], ca_sha256=CA_HEX, id=ID,
                                  secret=made.secret, extra="a bearer's words")  # fmt: skip
    assert tokens.decode(with_extra.encode()) == with_extra
    assert made.secret not in repr(made) and made.secret not in str(made)


def test_a_malformed_token_is_refused_naming_what_never_the_secret() -> None:
    secret = tokens.new_secret()
    good = tokens.JoinToken(urls=["tls://h:4222"], ca_sha256=CA_HEX, id=ID, secret=secret)
    text = good.encode()
    rest = text.split("-", 1)[1]
    parts = rest.split(".")
    cases = {
        "": "it is empty",
        "hello": "does not start with mesh1-",
        "mesh2-" + rest: "version mesh2, and this mesh reads mesh1",
        text[:60]: "2 parts after mesh1-",
        text[:-4] + " " + text[-3:]: "is not one a join token has",
        text + "." + parts[3] + ".x": "6 parts",
        "mesh1-" + ".".join(["XYZ", *parts[1:]]): "its id 'XYZ' is not 12 lowercase hex digits",
        "mesh1-" + ".".join([ID, secret[:-1], *parts[2:]]): "its secret is 42 characters",
        "mesh1-" + ".".join([ID, secret, "00ff", parts[3]]): "CA fingerprint '00ff'",
        "mesh1-" + ".".join([ID, secret, CA_HEX, "A"]): "its servers are not base64url",
        "mesh1-" + ".".join([ID, secret, CA_HEX, tokens._b64("http://h:80")]): "is not nats://",
        "mesh1-" + ".".join([ID, secret, CA_HEX, tokens._b64("tls://u:pw@h:1")]): "without a user",
        "x" * 5000: "5000 characters",
    }
    for bad, said in cases.items():
        with pytest.raises(tokens.TokenError) as refused:
            tokens.decode(bad)
        message = str(refused.value)
        assert said in message and "\n" not in message, (bad[:80], message)
        assert secret not in message and secret[:20] not in message and "pw" not in message


def test_the_cas_fingerprint_is_its_certificates(tmp_path: Path) -> None:
    ca = tls.ensure_ca(tmp_path / "tls")
    pem = ca.read_text()
    cert = x509.load_pem_x509_certificate(pem.encode())
    assert tokens.ca_sha256(pem, where=str(ca)) == cert.fingerprint(hashes.SHA256()).hex()
    with pytest.raises(tokens.TokenError, match="holds 2 certificates: name the one"):
        tokens.ca_sha256(pem + pem, where="two")
    with pytest.raises(tokens.TokenError, match=r"\(nothing\): not a PEM certificate"):
        tokens.ca_sha256("junk", where="nothing")
    # The command line's: --ca (MESH_CA) first, else the one its credentials file carries.
    held = tmp_path / "op.creds"
    credentials.write(held, who="t", seed=_seed(), inbox="_INBOX.operator.t", ca=pem)
    assert _mesh_ca(str(held)) == (pem, f"the CA in {held}")


def _seed() -> str:
    return new_user().seed


def test_durations_and_counts_as_the_command_line_takes_them() -> None:
    assert (ttl("1h"), ttl("90s"), ttl("15m"), ttl("7d"), ttl("30")) == (3600, 90, 900, 604800, 30)
    for text, said in (("0", "'0' is shorter than 1s"), ("31d", "longer than 30d"),
                       ("soon", "not a duration")):  # fmt: skip
        with pytest.raises(Exception, match=said):
            ttl(text)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["create", "--ttl", "0"], "argument --ttl: '0' is shorter than 1s"),
        (["create", "--uses", "0"], "argument --uses: 0 is out of range (1 to 1000)"),
        (["create", "--label", "no-equals"], "argument --label: 'no-equals' is not key=value"),
        (["create", "--tier", "12"], "argument --tier: 12 is out of range (0 to 9)"),
        (["create", "--site", "a.b"], "site: 'a.b' is not a valid name"),
        (["create", "--control", "--label", "role=web"], "--control labels the machine role="),
        (["revoke", "xyz"], "ID: 'xyz' is not a join token's id"),
    ],
)
def test_bad_input_is_one_line_naming_the_field_and_value(args: list[str], said: str) -> None:
    # Refused before anything is asked: there is no server at that port.
    done = mesh_cli("token", *args, nats_url="nats://127.0.0.1:1", timeout=60)
    assert done.returncode in (1, 2) and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], done.stderr


# --- redeem, against the real store ----------------------------------------------------------


@pytest.fixture
async def pool(database_url: str):
    conn = await asyncpg.connect(database_url)
    try:
        await migrate(conn)  # the seat at epoch 0, which `trust` holds (the tokens' verbs)
    finally:
        await conn.close()
    p = await asyncpg.create_pool(database_url, min_size=1, max_size=4)
    yield p
    await p.close()


@pytest.fixture
def trust(pool) -> Tokens:
    return Tokens(pool=pool, epoch=0, budget=lambda: paging.budget(1 << 20), admission=None)


async def _made(trust: Tokens, **terms) -> tuple[str, str]:
    """A token made as the admin asked (its audit entry too): its id and secret."""
    secret = tokens.new_secret()
    made = await trust.create(
        TokenCreateRequest(secret_sha256=tokens.secret_hash(secret), **terms),
        Audit(who="admin", verb="token-create", subject="", epoch=0),
    )
    return made.id, secret


async def _redeem(pool, token_id: str, secret: str, machine: str) -> Grant:
    async with pool.acquire() as conn, conn.transaction():
        return await served.redeem(conn, token_id=token_id, secret=secret, machine=machine,
                                   by=f"join:{machine}")  # fmt: skip


async def _refusal(pool, token_id: str, secret: str, machine: str) -> str:
    with pytest.raises(wire.BadRequest) as refused:
        await _redeem(pool, token_id, secret, machine)
    assert refused.value.code == "forbidden"
    await served.refused(pool, token_id=token_id, by=f"join:{machine}", error=refused.value)
    message = str(refused.value)
    assert "\n" not in message and secret not in message
    return message


async def test_a_token_is_redeemed_once_then_refused_in_its_words(
    pool, trust, database_url
) -> None:
    token_id, secret = await _made(trust, uses=1, tier=1, labels={"zone": "a"}, control=True,
                                   site="lab-1")  # fmt: skip
    grant = await _redeem(pool, token_id, secret, "node-7")
    assert grant == Grant(tier=1, labels={"zone": "a", "role": "control"}, control=True,
                          site="lab-1")  # fmt: skip
    row = (await query(database_url, "SELECT uses_left, used_by FROM join_tokens"))[0]
    assert (row["uses_left"], row["used_by"]) == (0, ["node-7"])

    said = await _refusal(pool, token_id, secret, "node-8")
    assert said == f"join token {token_id} is used up: its 1 use(s) went to node-7"
    said = await _refusal(pool, token_id, tokens.new_secret(), "node-8")
    assert said == f"join token {token_id}: wrong token"  # before its state: nothing told
    said = await _refusal(pool, "fedcba987654", secret, "node-8")
    assert said == "join token fedcba987654: unknown to this mesh"

    entries = await query(database_url, "SELECT who, verb, subject, outcome, detail FROM audit"
                                          " ORDER BY id")  # fmt: skip
    said_by = [(e["who"], e["verb"], e["subject"], e["outcome"]) for e in entries]
    assert said_by == [
        ("admin", "token-create", token_id, "ok"),
        ("join:node-7", "token-use", token_id, "ok"),
        ("join:node-8", "token-use", token_id, "forbidden"),
        ("join:node-8", "token-use", token_id, "forbidden"),
        ("join:node-8", "token-use", "fedcba987654", "forbidden"),
    ], said_by
    assert "machine node-7" in entries[1]["detail"]
    await _nothing_holds_the_secret(pool, secret)


async def test_expired_and_revoked_tokens_are_refused_saying_when(pool, trust) -> None:
    expiring, secret = await _made(trust, ttl=3600)
    async with pool.acquire() as conn:
        # Past its time, as the store's clock says (set, rather than waited for).
        expired_at = await conn.fetchval(
            "UPDATE join_tokens SET expires_at = now() - interval '5 minutes' WHERE id = $1"
            " RETURNING expires_at",
            expiring,
        )
    said = await _refusal(pool, expiring, secret, "node-1")
    when = expired_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    assert said == f"join token {expiring} expired at {when}"

    revoked, secret = await _made(trust, uses=5)
    asked = Audit(who="olga", verb="token-revoke", subject=revoked, epoch=0)
    assert (await trust.revoke(TokenRevokeRequest(id=revoked), asked)).revoked
    with pytest.raises(wire.BadRequest, match=r"revoked already, at .* by olga") as again:
        await trust.revoke(TokenRevokeRequest(id=revoked), asked)
    assert again.value.code == "conflict"
    said = await _refusal(pool, revoked, secret, "node-1")
    assert said.startswith(f"join token {revoked} was revoked at 2") and said.endswith(" by olga")
    # A wrong secret is told as such whatever the token's state: no state is told without it.
    assert await _refusal(pool, revoked, tokens.new_secret(), "node-1") == (
        f"join token {revoked}: wrong token"
    )


async def test_two_machines_racing_for_a_last_use_get_one_between_them(pool, trust) -> None:
    token_id, secret = await _made(trust, uses=1)
    outcomes: dict[str, object] = {}

    async def join(machine: str) -> None:
        try:
            outcomes[machine] = await _redeem(pool, token_id, secret, machine)
        except wire.BadRequest as e:
            outcomes[machine] = str(e)

    async with anyio.create_task_group() as tg:
        for machine in ("node-a", "node-b"):
            tg.start_soon(join, machine)
    grants = [m for m, o in outcomes.items() if isinstance(o, Grant)]
    assert len(grants) == 1, outcomes
    other = ({"node-a", "node-b"} - set(grants)).pop()
    assert outcomes[other] == f"join token {token_id} is used up: its 1 use(s) went to {grants[0]}"


async def _nothing_holds_the_secret(pool, secret: str) -> None:
    """The store keeps the secret's SHA-256 alone; the audit log neither it nor the hash."""
    digest = hashlib.sha256(secret.encode()).hexdigest()
    async with pool.acquire() as conn:
        rows = [r[0] for r in await conn.fetch("SELECT row_to_json(t)::text FROM join_tokens t")]
        audit = [r[0] for r in await conn.fetch("SELECT row_to_json(a)::text FROM audit a")]
        stored = await conn.fetch("SELECT secret_sha256 FROM join_tokens")
    assert rows and not [r for r in rows if secret in r]
    assert bytes.fromhex(digest) in {r["secret_sha256"] for r in stored}
    assert audit and not [a for a in audit if secret in a or digest in a]


# --- the command line, as an admin, a viewer and a deployer ------------------------------------


@pytest.fixture
async def controller(secured: Secured, procs, database_url: str) -> Secured:
    """A controller with its own credentials on the secured nats-server, holding the seat;
    the mesh's CA made (a token names it: `--ca`)."""
    tls.ensure_ca(secured.dir.tls)
    procs.start(
        "ctl-a",
        [*MESH, "controller", "run", "--instance", "ctl-a",
         "--creds", secured.creds("controller", registry.CONTROLLER)],
        env={"MESH_NATS_URL": secured.url, "MESH_DATABASE_URL": database_url},
    )  # fmt: skip

    async def holding() -> bool:
        done = await anyio.to_thread.run_sync(
            lambda: secured.cli(secured.viewer, "--json", "status", "--timeout", "2")
        )
        return done.returncode == 0 and json.loads(done.stdout)["seat"] is not None

    await await_until(holding, within=60, what="the controller holding the seat")
    return secured


def _token(secured: Secured, creds: str | None, *args: str) -> subprocess.CompletedProcess:
    return secured.cli(creds, "token", *args, "--ca", str(secured.dir.ca))


async def test_an_admin_makes_lists_and_revokes_tokens(controller: Secured, database_url) -> None:
    s, admin = controller, controller.admin
    out = ok(_token(s, admin, "create", "--tier", "1", "--label", "zone=a", "--uses", "2",
                    "--ttl", "2h", "--site", "lab-1"))  # fmt: skip
    assert len(out.splitlines()) == 1, out  # one line: the token
    made = tokens.decode(out)
    cert = x509.load_pem_x509_certificate(s.dir.ca.read_bytes())
    assert made.urls == [s.url] and made.ca_sha256 == cert.fingerprint(hashes.SHA256()).hex()
    control = ok_json(_token(s, admin, "create", "--control", "--json"))
    assert tokens.decode(control["token"]).id == control["id"]
    assert control["labels"] == {"role": "control"} and control["control"] is True
    assert control["tier"] == 2 and control["uses_left"] == 1  # the defaults, as machine add's

    listed = ok_json(_token(s, admin, "list", "--json"))
    assert set(listed) == {"tokens"}
    first, second = listed["tokens"][1], listed["tokens"][0]  # newest first
    assert set(first) == {"id", "created", "by", "expires", "uses_left", "revoked", "tier",
                          "labels", "control", "site", "used_by"}  # fmt: skip
    assert (first["id"], first["by"], first["tier"], first["labels"], first["uses_left"],
            first["site"], first["revoked"], first["used_by"]) == (
        made.id, "admin", 1, {"zone": "a"}, 2, "lab-1", None, [])  # fmt: skip
    lasts = datetime.fromisoformat(first["expires"]) - datetime.fromisoformat(first["created"])
    assert lasts.total_seconds() == pytest.approx(7200, abs=1)
    assert second["id"] == control["id"]
    table = ok(_token(s, admin, "list"))
    assert made.id in table and "usable" in table and "zone=a" in table

    assert ok_json(_token(s, admin, "revoke", made.id, "--json")) == {"id": made.id,
                                                                      "revoked": True}  # fmt: skip
    line = one_line_error(_token(s, admin, "revoke", made.id))
    assert f"join token {made.id} was revoked already, at " in line and "by admin" in line
    line = one_line_error(_token(s, admin, "revoke", "fedcba987654"))
    assert "no join token fedcba987654" in line
    assert "revoked" in ok(_token(s, admin, "list"))

    # The secret: in no reply, no row, no audit entry; the audit has the changes, by admin.
    for text in (ok(_token(s, admin, "list", "--json")), ok(s.cli(admin, "audit", "--json"))):
        assert made.secret not in text and tokens.secret_hash(made.secret) not in text
    said = {(e["who"], e["verb"], e["subject"], e["outcome"])
            for e in ok_json(s.cli(admin, "audit", "--json"))["entries"]}  # fmt: skip
    assert {("admin", "token-create", made.id, "ok"), ("admin", "token-revoke", made.id, "ok"),
            ("admin", "token-revoke", made.id, "conflict")} <= said, said  # fmt: skip
    assert not [e for e in said if e[1] == "token-list"]  # a read: not audited
    rows = await query(database_url, "SELECT row_to_json(t)::text AS r FROM join_tokens t")
    assert len(rows) == 2 and not [r for r in rows if made.secret in r["r"]]

    # The token the command line printed is the one the store checks.
    conn = await asyncpg.connect(database_url)
    try:
        async with conn.transaction():
            grant = await served.redeem(conn, token_id=control["id"], secret=tokens.decode(
                control["token"]).secret, machine="node-9", by="join:node-9")  # fmt: skip
    finally:
        await conn.close()
    assert grant.control and grant.labels == {"role": "control"}
    assert ok_json(_token(s, admin, "list", "--json"))["tokens"][0]["used_by"] == ["node-9"]


async def test_a_viewer_and_a_deployer_may_not_touch_tokens(controller: Secured) -> None:
    s = controller
    made = tokens.decode(ok(_token(s, s.admin, "create")))
    dora = ok_json(s.cli(None, "operator", "add", "dora", "--role", "deployer", "--modules",
                         "web-*", "--dir", str(s.dir.root), "--json"))["creds"]  # fmt: skip
    for who, creds in (("viewer", s.viewer), ("dora", dora)):
        for args, verb in ((["create"], "token-create"), (["list"], "token-list"),
                           (["revoke", made.id], "token-revoke")):  # fmt: skip
            line = one_line_error(_token(s, creds, *args))
            # Refused by nats-server: the request never reaches a controller.
            assert "forbidden" in line and f"mesh.op.{who}.{verb}" in line, line
    listed = ok_json(_token(s, s.admin, "list", "--json"))["tokens"]
    assert [(t["id"], t["revoked"]) for t in listed] == [(made.id, None)]  # nothing changed
