"""The declarations' puts (services/controller/fleet/publishing.py), on a real nats-server.

A tier's puts are all sent before any acknowledgement is awaited, at most PUTS_PENDING of them
awaiting one: past that a put waits for a free slot, and only then with a deadline (nats-py's
deadline on that wait makes a task of every put, which tripled a tier's time). These tests
cross that limit: with a server that acknowledges, and with one stopped (SIGSTOP) that does not.
`keep_published` puts again what the store holds and the bucket may not: not a put still
awaiting its acknowledgement (a tier's puts were all put twice).
"""

import os
import signal
import subprocess

import anyio
import asyncpg
import pytest
from helpers import await_until

from mesh import blobs, wire
from mesh.model import DeclarationReply
from mesh.store import declarations
from mesh.store.migrate import migrate
from services.controller.fleet import publishing
from services.controller.fleet.publishing import Manifests, Publisher

MACHINES = publishing.PUTS_PENDING + 20  # past the limit: some puts wait for a slot


def bodies(version: int) -> dict[str, tuple[str, bytes]]:
    return {
        f"pub-{i:05d}": (f"sha256:v{version}", b'{"version":%d}' % version) for i in range(MACHINES)
    }


async def stored(database_url: str, tier: dict[str, tuple[str, bytes]]) -> None:
    """The machines and their declarations in a store of this test's, as the holder wrote them."""
    conn = await asyncpg.connect(database_url)
    try:
        await migrate(conn)
        await conn.execute("INSERT INTO machines (name) SELECT unnest($1::text[])", list(tier))
        await declarations.write_declarations(conn, tier, epoch=7)
    finally:
        await conn.close()


async def test_a_tier_past_the_limit_of_pending_puts_is_all_put(nc) -> None:
    kv, _ = await blobs.ensure(nc)
    publisher = Publisher(pool=None, nc=nc, epoch=7, manifests=Manifests(), holder="ctl-t")  # type: ignore[arg-type]
    await publisher.publish(bodies(1))

    assert publisher.wanted == {m: "sha256:v1" for m in bodies(1)}
    for machine in ("pub-00000", f"pub-{MACHINES - 1:05d}"):
        put = wire.decode((await kv.get(machine)).value, DeclarationReply)
        assert (put.machine, put.epoch, put.holder, bytes(put.declaration)) == (
            machine, 7, "ctl-t", b'{"version":1}',
        )  # fmt: skip


async def test_puts_a_stopped_server_never_acknowledges_fail_by_the_deadline(
    nc, nats_server: subprocess.Popen, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    kv, _ = await blobs.ensure(nc)
    publisher = Publisher(pool=None, nc=nc, epoch=7, manifests=Manifests(), holder="ctl-t")  # type: ignore[arg-type]
    monkeypatch.setattr(publishing, "PUT_WITHIN", 1.0)
    os.kill(nats_server.pid, signal.SIGSTOP)
    try:
        # One deadline for the whole publish, not one per stalled put (20 of them here).
        with anyio.fail_after(10):
            await publisher.publish(bodies(1))
    finally:
        os.kill(nats_server.pid, signal.SIGCONT)
    assert publisher.wanted == {}  # nothing acknowledged: all left for keep_published
    assert f"could not publish the declaration of {MACHINES} machine(s)" in caplog.text

    # The server back: the same publisher puts them all (its slots were freed).
    monkeypatch.undo()
    await publisher.publish(bodies(2))
    assert publisher.wanted == {m: "sha256:v2" for m in bodies(2)}
    put = wire.decode((await kv.get("pub-00000")).value, DeclarationReply)
    assert bytes(put.declaration) == b'{"version":2}'


async def test_keep_published_leaves_puts_awaiting_acknowledgement_alone(
    nc, nats_server: subprocess.Popen, database_url: str
) -> None:
    await blobs.ensure(nc)
    tier = dict(list(bodies(1).items())[:50])
    await stored(database_url, tier)
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    publisher = Publisher(pool=pool, nc=nc, epoch=7, manifests=Manifests(), holder="ctl-t")
    wanted = {m: d for m, (d, _) in tier.items()}

    async def all_put() -> bool:
        return publisher.wanted == wanted

    try:
        async with anyio.create_task_group() as tg:
            # The tier's puts, held unacknowledged by a stopped server while keep_published
            # looks twice (each look at the bucket waits out its 5 s): it finds nothing to put
            # (else it would wait for acknowledgements too, PUT_WITHIN, past the deadline).
            os.kill(nats_server.pid, signal.SIGSTOP)
            try:
                tg.start_soon(publisher.publish, tier)
                await anyio.wait_all_tasks_blocked()
                with anyio.fail_after(publishing.PUT_WITHIN - 5):
                    for _ in range(2):
                        await publisher.put_behind()
            finally:
                os.kill(nats_server.pid, signal.SIGCONT)
            await await_until(all_put, within=30, what="the tier's puts acknowledged")
        info = await nc.jsm().stream_info(f"KV_{blobs.DECLARATIONS}")
        assert info.state.messages == len(tier)  # each put once
        await publisher.put_behind()  # and nothing is behind once they are acknowledged
        info = await nc.jsm().stream_info(f"KV_{blobs.DECLARATIONS}")
        assert info.state.messages == len(tier)
    finally:
        await pool.close()


async def test_a_bucket_made_again_has_every_declaration_put_again(nc, database_url: str) -> None:
    """The bucket removed (`nats stream rm`, or a server that lost its store): the next look
    finds it gone, makes it again, and puts every stored declaration again, those the
    publisher had seen acknowledged included."""
    await blobs.ensure(nc)
    tier = dict(list(bodies(1).items())[:20])
    await stored(database_url, tier)
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    try:
        publisher = Publisher(pool=pool, nc=nc, epoch=7, manifests=Manifests(), holder="ctl-t")
        await publisher.publish(tier)
        await publisher.put_behind()  # nothing behind: nothing put
        info = await nc.jsm().stream_info(f"KV_{blobs.DECLARATIONS}")
        assert info.state.messages == len(tier)

        await nc.jsm().delete_stream(f"KV_{blobs.DECLARATIONS}")
        await publisher.put_behind()
        kv = await nc.jetstream().key_value(blobs.DECLARATIONS)
        assert sorted(await kv.keys()) == sorted(tier)
        put = wire.decode((await kv.get("pub-00000")).value, DeclarationReply)
        assert (put.epoch, bytes(put.declaration)) == (7, b'{"version":1}')
    finally:
        await pool.close()
