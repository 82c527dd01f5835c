"""How verbs are served (issue 11, item 3): a reply past the NATS server's max_payload, an
unexpected exception, a reply that cannot be sent, too many slow verbs at once, host requests
side by side, a standby that never hears `held`, and memories that stay bounded.

Real nats-server, PostgreSQL and controller processes. A store stall is a real one: the test
locks a table the verb reads, in its own session, and lets go when it has seen what it needs.
"""

import json
import logging
import os
import re
import subprocess
import time
from datetime import UTC, datetime

import asyncpg
import msgspec
import nats
import pytest
from helpers import ask, await_until, mesh_cli, ok, ok_json, one_line_error
from module_folders import write_module
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeout

from mesh import bus, paging, subjects, wire
from mesh.client import asking
from mesh.model import SeatAnnounce
from services.controller.plans import heard
from services.controller.seat import handover, standbys
from services.controller.serving.verbs import SLOW_IN_FLIGHT

FACTS = {"os": "linux", "arch": "x86_64", "cpus": 1, "memory": 1, "mesh_version": "0"}


def _registration(name: str) -> dict:
    return {"name": name, "tier": 0, "labels": {}, "facts": FACTS, "beat_interval": 1, "pid": 1}


async def _holding(nc: Client) -> dict:
    async def held() -> dict | None:
        s = await ask(nc, "mesh.ctl.status")
        return s if s and s.get("seat") else None

    return await await_until(held, within=30, what="a controller to hold the seat")


def _log(proc: subprocess.Popen) -> str:
    return proc.log_path.read_text(errors="replace")  # type: ignore[attr-defined]


# --- 1. a reply too large for the NATS server ----------------------------------------------------

SMALL_PAYLOAD = 16 * 1024


def _module(folder, name: str, *, words: int = 1) -> None:
    """A module of one process whose command says `${machine}` `words` times: on a machine of
    a long name its declaration is many times larger than its manifest (and its push)."""
    argv = ", ".join(['"sleep"', *['"${machine}"'] * words])
    write_module(
        folder,
        f'[module]\nname = "{name}"\n[bundle.code]\nkind = "files"\nsource = "src"\n'
        f'[process.{name}]\nbundle = "code"\ncommand = [{argv}]\nroot = true\n',
        files={"src/run.sh": "sleep 3600\n"},
    )


@pytest.mark.parametrize("nats_server", [SMALL_PAYLOAD], indirect=True)
async def test_a_reply_past_max_payload_is_too_large_and_the_holder_stays(
    nats_server, nc, nats_url, start_controller, tmp_path
) -> None:
    """On a server taking 16 KiB: `plan` of a plan too big for one reply (the query of death
    of issue 17: it took the holder down, then the standby) comes in pages; a declaration too
    big to send and a machine too big for a page get `too_large` saying why; the holder goes on
    holding the seat and answering, and the standby never hears any of it."""
    ctl = start_controller("ctl-a")
    first = await _holding(nc)
    standby = start_controller("ctl-b")

    async def standing_by() -> bool:
        s = await ask(nc, "mesh.ctl.status")
        return bool(s) and [b["instance"] for b in s["standbys"]] == ["ctl-b"]

    await await_until(standing_by, within=30, what="ctl-b to stand by")
    assert nc.max_payload == SMALL_PAYLOAD
    # A step each in `plan` (~190 bytes): ~28 KiB in all. Short names keep `assign`'s reply small.
    long = "l" * 64  # a name as long as names go, first in the plan
    names = [long] + [f"m-{i:03d}" for i in range(150)]
    for name in names:
        reply = await ask(nc, f"mesh.ctl.host.{name}.register", _registration(name), timeout=10)
        assert reply is not None and "error" not in reply, reply
    # Its declaration: 450 words of its name, ~30 KB, from a push of ~6 KB; its plan rolls
    # (tier 0) at once, storing it.
    _module(tmp_path / "wide", "wide", words=450)
    ok(mesh_cli("push", str(tmp_path / "wide"), nats_url=nats_url))
    ok(mesh_cli("assign", "wide", long, nats_url=nats_url))
    _module(tmp_path / "big", "big")
    # ...and an archive of 48 KiB that does not compress: stored in chunks the server takes
    (tmp_path / "big" / "src" / "noise.bin").write_bytes(os.urandom(48 * 1024))
    ok(mesh_cli("push", str(tmp_path / "big"), nats_url=nats_url))
    assigned = ok_json(mesh_cli("--json", "assign", "big", "--tier", "0", nats_url=nats_url))
    assert assigned["changed"] == len(names), assigned

    # plan: pages, each under the server's limit, every step once
    steps, body, pages = [], {"id": assigned["plan"]}, 0
    while True:
        msg = await nc.request("mesh.ctl.plan", json.dumps(body).encode(), timeout=10)
        assert len(msg.data) <= SMALL_PAYLOAD
        page = json.loads(msg.data)
        assert "error" not in page, page
        steps += [s["machine"] for s in page["steps"]]
        pages += 1
        if page["next"] is None:
            break
        body = {"id": assigned["plan"], "after": page["next"]}
    assert steps == names and pages > 1, (pages, steps[:3])
    shown = ok_json(mesh_cli("--json", "plan", str(assigned["plan"]), nats_url=nats_url))
    assert [s["machine"] for s in shown["steps"]] == names and "next" not in shown

    # declaration: one machine's, too big for this server
    async def stored() -> dict | None:
        r = await ask(nc, "mesh.ctl.declaration", {"machine": long}, timeout=10)
        return r if r and r.get("error", {}).get("code") != "not_found" else None

    reply = await await_until(stored, within=30, what="the declaration to be stored")
    assert reply["error"]["code"] == "too_large", reply
    message = reply["error"]["message"]
    assert message.startswith("the reply to declaration is too large: "), message
    assert str(SMALL_PAYLOAD) in message and "max_payload must be larger" in message, message
    line = one_line_error(mesh_cli("declaration", long, nats_url=nats_url))
    assert "too large" in line, line  # at once: too_large is not tried again

    # nodes: one machine alone larger than a page
    fat = _registration("fat") | {"labels": {f"k{i}": "v" * 200 for i in range(50)}}
    reply = await ask(nc, "mesh.ctl.host.fat.register", fat, timeout=10)
    assert reply is not None and "error" not in reply, reply
    reply = await ask(nc, "mesh.ctl.nodes", {"limit": 5000}, timeout=10)
    assert reply["error"]["code"] == "too_large", reply
    assert reply["error"]["message"].startswith("nodes: machine fat alone is "), reply

    after = await ask(nc, "mesh.ctl.status", timeout=5)
    assert after is not None and ctl.poll() is None, _log(ctl)
    assert (after["seat"]["pid"], after["seat"]["epoch"]) == (
        first["seat"]["pid"],
        first["seat"]["epoch"],
    )
    assert [b["instance"] for b in after["standbys"]] == ["ctl-b"], after
    assert "answered too_large" in _log(ctl)
    assert standby.poll() is None and "too_large" not in _log(standby), _log(standby)


async def test_answer_refuses_a_reply_past_the_servers_max_payload(nc) -> None:
    """bus.answer, as every controller and host verb uses it, on a server's default 1 MiB."""

    async def huge() -> dict:
        return {"data": "x" * (nc.max_payload + 1)}

    async def on(msg) -> None:
        await bus.answer(msg, huge, service="host")

    async def paged(msg) -> None:  # as a verb that pages says it (serving.Verb.too_large)
        await bus.answer(msg, huge, service="controller", hint=paging.HINT)

    await nc.subscribe("test.huge", cb=on)
    await nc.subscribe("test.paged", cb=paged)
    reply = json.loads((await nc.request("test.huge", b"{}", timeout=5)).data)
    assert reply["error"]["code"] == "too_large", reply
    assert reply["error"]["message"].startswith("the reply to huge is too large: "), reply
    assert reply["error"]["message"].endswith("; ask for less"), reply
    reply = json.loads((await nc.request("test.paged", b"{}", timeout=5)).data)
    assert reply["error"]["message"].endswith("; ask with a smaller `limit`, or follow `next`")


# --- 2. `internal` says where to look, not what went wrong ---------------------------------------


@pytest.mark.parametrize("service", ["controller", "host"])
async def test_an_unexpected_exception_is_answered_with_an_id_the_log_has(
    nc, caplog, service
) -> None:
    async def boom() -> None:
        raise RuntimeError("connection to postgres://mesh:hunter2@db failed")

    async def on(msg) -> None:
        if service == "controller":  # the default
            await bus.answer(msg, boom)
        else:
            await bus.answer(msg, boom, service=service)

    await nc.subscribe("test.boom", cb=on)
    with caplog.at_level(logging.ERROR, logger="mesh.bus"):
        reply = json.loads((await nc.request("test.boom", b"{}", timeout=5)).data)
    assert reply["error"]["code"] == "internal", reply
    said = re.fullmatch(
        rf"internal error ([0-9a-f]{{8}}); see the {service}'s log", reply["error"]["message"]
    )
    assert said, reply
    assert "hunter2" not in json.dumps(reply)
    logged = [r for r in caplog.records if said.group(1) in r.getMessage()]
    assert len(logged) == 1, caplog.text
    assert logged[0].exc_info is not None and "hunter2" in str(logged[0].exc_info[1])
    assert "test.boom" in logged[0].getMessage()


async def test_a_reply_that_cannot_be_sent_is_logged_not_raised(nc, nats_url, caplog) -> None:
    """The connection a request came in on is closed before the reply: answer logs it and
    returns (before, the exception left the verb handler and took the holder with it)."""
    serving = await nats.connect(nats_url)
    sub = await serving.subscribe("test.gone")
    await serving.flush()
    await nc.publish("test.gone", b"{}", reply=nc.new_inbox())
    msg = await sub.next_msg(timeout=5)
    await serving.close()

    async def fine() -> dict:
        return {"ok": True}

    with caplog.at_level(logging.WARNING, logger="mesh.bus"):
        await bus.answer(msg, fine)
    assert "could not reply on test.gone: ConnectionClosedError" in caplog.text


# --- 3. slow verbs are bounded: past the bound, `busy` -------------------------------------------


async def _lock_table(database_url: str, table: str) -> asyncpg.Connection:
    """A store stall: `table` locked in an open transaction until the connection is closed."""
    conn = await asyncpg.connect(database_url)
    await conn.execute("BEGIN")
    await conn.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
    return conn


async def _waiting_on_locks(database_url: str) -> int:
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
    finally:
        await conn.close()


async def test_slow_verbs_past_the_bound_are_answered_busy(
    nc, start_controller, database_url
) -> None:
    """SLOW_IN_FLIGHT `plans` stuck on a locked table fill the bound; the next slow verb is
    answered `busy` at once, `status` goes on, and once the store moves all are answered."""
    ctl = start_controller("ctl-a")
    first = await _holding(nc)
    stuck = await _lock_table(database_url, "plans")
    try:
        inbox = nc.new_inbox()
        replies = await nc.subscribe(inbox)
        # Published in order on one connection: the controller sees all of these first.
        for _ in range(SLOW_IN_FLIGHT):
            await nc.publish("mesh.ctl.plans", b"{}", reply=inbox)
        await await_until(
            lambda: _waiting_on_locks(database_url), within=10, what="plans to wait on the lock"
        )
        extra = await nc.request("mesh.ctl.plans", b"{}", timeout=5)
        refused = json.loads(extra.data)
        assert refused["error"]["code"] == "busy", refused
        assert "try again" in refused["error"]["message"], refused
        status = await ask(nc, "mesh.ctl.status", timeout=5)  # fast verbs are not held up
        assert status is not None and status["seat"]["epoch"] == first["seat"]["epoch"]
        with pytest.raises(NatsTimeout):  # and the stuck ones are still stuck
            await replies.next_msg(timeout=0.2)
    finally:
        await stuck.close()  # the store moves again
    for _ in range(SLOW_IN_FLIGHT):
        answered = json.loads((await replies.next_msg(timeout=10)).data)
        assert answered == {"plans": [], "next": None, "total": 0}, answered
    again = await ask(nc, "mesh.ctl.plans", timeout=5)  # every slot was given back
    assert again == {"plans": [], "next": None, "total": 0}, again
    assert ctl.poll() is None and "busy: refused plans" in _log(ctl)


async def test_the_command_line_retries_busy_until_its_deadline(nc, nats_url) -> None:
    """`busy` (like `unavailable`) is retried with backoff; past the deadline it is the error.
    The controller here is a stand-in on a real NATS server, answering busy twice."""
    asked = 0

    async def on(msg) -> None:
        nonlocal asked
        asked += 1
        await msg.respond(wire.error("busy", "busy; try again") if asked <= 2 else b'{"n": 1}')

    sub = await nc.subscribe("mesh.ctl.plans", cb=on)
    await nc.flush()
    got = await asking.ask(nc, url=nats_url, verb="plans", reply=dict, timeout=5)
    assert (got, asked) == ({"n": 1}, 3)
    await sub.unsubscribe()

    async def always_busy(msg) -> None:
        await msg.respond(wire.error("busy", "the controller is busy; try again"))

    await nc.subscribe("mesh.ctl.modules", cb=always_busy)
    await nc.flush()
    started = time.monotonic()
    with pytest.raises(asking.VerbFailed, match="modules: the controller is busy"):
        await asking.ask(nc, url=nats_url, verb="modules", reply=dict, timeout=1.5)
    assert 1.0 < time.monotonic() - started < 3.0


# --- 4. host requests side by side ---------------------------------------------------------------


async def test_a_stalled_secret_request_does_not_hold_up_a_registration(
    nc, start_controller, database_url
) -> None:
    ctl = start_controller("ctl-a")
    await _holding(nc)
    stuck = await _lock_table(database_url, "declarations")  # what a secret request reads first
    try:
        inbox = nc.new_inbox()
        secret = await nc.subscribe(inbox)
        await nc.publish("mesh.ctl.host.node-s.secret", b'{"name": "token"}', reply=inbox)
        await await_until(
            lambda: _waiting_on_locks(database_url), within=10, what="secret to wait on the lock"
        )
        reply = await ask(nc, "mesh.ctl.host.node-r.register", _registration("node-r"), timeout=5)
        assert reply is not None, "the registration waited behind the stalled secret request"
        assert reply["name"] == "node-r", reply
    finally:
        await stuck.close()
    answered = json.loads((await secret.next_msg(timeout=10)).data)
    assert answered["error"]["code"] == "forbidden", answered  # no declaration names it
    assert ctl.poll() is None


# --- 5. a standby that never hears `held` leaves the verb group on time --------------------------


async def test_a_standby_that_misses_held_leaves_the_verb_group_after_early_for(
    nc, start_controller
) -> None:
    a = start_controller("ctl-a")
    first = await _holding(nc)
    b = start_controller("ctl-b")

    async def standby() -> dict | None:
        s = await ask(nc, "mesh.ctl.status")
        return s if s and [x["instance"] for x in s["standbys"]] == ["ctl-b"] else None

    await await_until(standby, within=30, what="ctl-b standing by")
    # A handover that never happens: nobody releases the seat and no `held` follows.
    ready = await nc.subscribe(subjects.seat("ready"))
    ghost = SeatAnnounce(instance="ctl-ghost", pid=1, host="nowhere", since=datetime.now(UTC))
    await nc.publish(subjects.seat("handover"), msgspec.json.encode(ghost))
    said = wire.decode((await ready.next_msg(timeout=10)).data, SeatAnnounce)
    assert said.instance == "ctl-b"
    joined = time.monotonic()

    # While ctl-b is in the group, requests that land on it wait for a seat that is not coming;
    # once it leaves, every request is answered by the holder at once.
    prompt = 0
    deadline = joined + handover.EARLY_FOR + 10
    while prompt < 12 or "the seat did not come" not in _log(b):
        assert time.monotonic() < deadline, f"ctl-b still in the verb group:\n{_log(b)}"
        s = await ask(nc, "mesh.ctl.status", timeout=1)
        prompt = prompt + 1 if s is not None else 0
        if s is not None:
            assert s["seat"]["pid"] == first["seat"]["pid"]
    assert time.monotonic() - joined > handover.EARLY_FOR - 1  # it did wait for the seat
    assert a.poll() is None and b.poll() is None
    assert await await_until(standby, within=10, what="ctl-b still standing by")


# --- 6. bounded memories -------------------------------------------------------------------------


def test_the_planners_process_names_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(heard, "NAMES_KEPT", 100)
    p = heard.Heard(fleet=None)  # type: ignore[arg-type]
    body = b'{"machine": "m", "modules": {}, "processes": {}}'
    for i in range(150):
        assert p.names(f"sha256:{i}", body) == frozenset()
    assert len(p._names) == 100
    p.names("sha256:60", body)  # used again: the newest
    p.names("sha256:new", body)
    assert "sha256:60" in p._names and "sha256:50" not in p._names


def test_releases_heard_are_forgotten_by_age_and_number() -> None:
    r = standbys.Releases()
    now = time.monotonic()
    r.heard("old", at=now - standbys.RELEASE_KEPT - 1)
    r.heard("ctl-1", at=now)
    assert len(r) == 1 and r.take("old") is None
    for i in range(standbys.RELEASES_KEPT + 10):
        r.heard(f"ctl-{i}", at=now)
    assert len(r) == standbys.RELEASES_KEPT
    assert r.take(f"ctl-{standbys.RELEASES_KEPT + 9}") == now
    assert r.take(f"ctl-{standbys.RELEASES_KEPT + 9}") is None  # taken once
    assert r.take("ctl-0") is None  # the oldest went first


def test_a_release_is_void_once_its_controller_holds_again() -> None:
    """ctl-0 let go, then held the seat again: a takeover from it now is not a handover (the
    new holder closes its connection, which a cut holder's subscriptions need)."""
    r = standbys.Releases()
    r.heard("ctl-0")
    r.begins("ctl-0", 7)
    r.kept("ctl-0")  # its `held`
    assert r.take("ctl-0") is None and r.handing("ctl-0") is None
