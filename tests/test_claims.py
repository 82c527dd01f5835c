"""NATS JWTs as mesh signs them (mesh/auth/claims.py): read back with their issuer's signature,
refused when a byte is changed or another key signed; and a real nats-server in operator mode
taking them: a user admitted by its JWT alone, held to its permissions, and cut off at once
when the account's new JWT revokes it."""

import json
import time
from pathlib import Path

import pytest
from helpers import already, await_until, wait_until

from mesh import bus
from mesh.auth import claims, creds, server
from mesh.auth.trust import CLAIMS_INBOX, Revoked, Trust
from mesh.embedded import natsd, ports


def test_a_jwt_reads_back_and_a_changed_byte_or_another_signer_is_refused() -> None:
    account = claims.new_key("account")
    user = claims.new_key("user")
    token = claims.user(account, account_public=account.public, subject=user.public,
                        name="u", publish=["a.>"], subscribe=[], responses=True)  # fmt: skip
    read = claims.decode(token)
    assert (read["iss"], read["sub"], read["nats"]["type"]) == (account.public, user.public, "user")
    assert read["nats"]["pub"] == {"allow": ["a.>"]} and read["nats"]["sub"] == {"deny": [">"]}
    assert read["nats"]["resp"] == {"max": 1, "ttl": 0} and "issuer_account" not in read["nats"]
    head, _, signature = token.split(".")
    changed = claims._b64(json.dumps({**read, "sub": account.public}).encode())
    for bad in (f"{head}.{changed}.{signature}", token[:-4] + "AAAA", "x.y", ""):
        with pytest.raises(claims.ClaimsError):
            claims.decode(bad)
    signer = claims.new_key("account")  # a signing key: the JWT names the account it is for
    signed = claims.decode(claims.user(signer, account_public=account.public, subject=user.public,
                                       name="u", publish=["a"], subscribe=["b"]))  # fmt: skip
    assert signed["nats"]["issuer_account"] == account.public


async def test_a_server_admits_a_signed_user_holds_it_to_its_permissions_and_cuts_it_off(
    tmp_path: Path, procs
) -> None:
    trust = Trust.of(tmp_path)
    auth = tmp_path / "auth.conf"
    auth.write_text(trust.server_block([]))
    port = ports.free_port()
    conf = natsd.write_config(tmp_path / "n1", port=port, name=f"jwt-{port}", auth=auth)
    procs.start("nats-server", natsd.argv(conf))
    url = f"nats://127.0.0.1:{port}"

    def issue(name: str, token: str, key: claims.Key, inbox: str = "_INBOX") -> str:
        path = tmp_path / f"{name}.creds"
        creds.write(path, who=name, seed=key.seed, inbox=inbox, jwt=token)
        return str(path)

    alice_key = claims.new_key("user")
    alice = issue("alice", claims.user(trust.signer, account_public=trust.account.public,
                                       subject=alice_key.public, name="alice",
                                       publish=["a.>", "_INBOX.>"],
                                       subscribe=["a.>", "_INBOX.>"]), alice_key)  # fmt: skip
    pusher_key = claims.new_key("user")
    pusher = issue("claims", trust.claims_jwt(pusher_key.public), pusher_key, CLAIMS_INBOX)
    stranger = claims.new_key("account")  # signs, but the servers do not know it
    other = issue("other", claims.user(stranger, account_public=trust.account.public,
                                       subject=alice_key.public, name="x", publish=["a.>"],
                                       subscribe=[]), alice_key)  # fmt: skip

    wait_until(lambda: not ports.port_free(port), within=10, what="nats-server listening")
    denied: list[str] = []
    nc = await bus.connect(url, name="alice", creds=alice, reconnect=False, denied=denied.append)
    got: list[bytes] = []

    async def heard(msg) -> None:
        got.append(msg.data)

    sub = await nc.subscribe("a.x", cb=heard)
    await nc.publish("a.x", b"mine")
    await nc.publish("b.x", b"not mine")
    await nc.flush()
    await await_until(lambda: already(bool(got) and bool(denied)), within=5, what="both")
    assert got == [b"mine"] and any("b.x" in d for d in denied), (got, denied)
    await sub.unsubscribe()
    with pytest.raises(bus.Unauthorized):
        await bus.connect(url, name="other", creds=other, reconnect=False)

    # Revoked: a new account JWT pushed to the server, which closes alice's connection.
    pushing = await bus.connect(url, name="claims", creds=pusher, reconnect=False)
    await server.publish_account(pushing, trust, [Revoked(public=alice_key.public,
                                                          at=int(time.time()))])  # fmt: skip
    await pushing.close()
    await await_until(lambda: already(nc.is_closed or not nc.is_connected), within=10,
                      what="alice's connection closed")  # fmt: skip
    with pytest.raises(bus.Unauthorized):
        await bus.connect(url, name="alice", creds=alice, reconnect=False)
