"""No answer is too big (issue 17): every list verb answers in pages (mesh/paging.py) and the
command line follows them to one list.

First the mechanism itself, in memory: pages by count and by bytes, cursors, the errors of a
bad cursor or limit, an item too big alone, and the client's joining of pages. Then a test per
list verb at a size past 1 MiB against a real nats-server (its default max_payload, 1 MiB),
PostgreSQL and controller: every raw page is under max_payload, `mesh --json VERB` gives every
item once, in order, as one document, and `--limit` cuts. Fleets of thousands are written
straight into the store before the controller starts (it loads them at takeover): registering
each through the verb would take most of a minute.
"""

import json
import time
from datetime import UTC, datetime
from pathlib import Path

import anyio
import asyncpg
import pytest
from helpers import ask, await_until, mesh_cli, ok, ok_json
from module_folders import write_module

from mesh import paging, wire
from mesh.client.asking import VerbFailed
from mesh.client.pages import every_page
from mesh.model import (
    PAGE_LIMIT,
    LogsReply,
    LogsRequest,
    ModuleInfo,
    ModulesReply,
    ModulesRequest,
    Node,
    NodesReply,
    NodesRequest,
)
from mesh.store.migrate import migrate
from services.host import verbs as host_verbs

MiB = 1024 * 1024
PUSHED = datetime(2026, 1, 1, tzinfo=UTC)
FACTS = {"os": "linux", "arch": "x86_64", "cpus": 2, "memory": 1 << 30, "mesh_version": "0.1.0",
         "hostname": "vm", "python": "3.11.7"}  # fmt: skip


# --- the mechanism, in memory ----------------------------------------------------------------


def _rows(n: int, *, size: int = 10) -> list[tuple[paging.Key, str]]:
    return [((i // 100, f"m-{i:05d}"), "x" * size) for i in range(n)]


def test_a_page_stops_at_its_limit_and_its_cursor_goes_on_after_its_last_item() -> None:
    rows = _rows(250)
    first = paging.fill(iter(rows), verb="nodes", limit=100, room=MiB, what=str)
    assert first.items == [item for _, item in rows[:100]]
    at = paging.after(first.next, verb="nodes", shape=(int, str))
    assert at == rows[99][0]
    keys = [k for k, _ in rows]
    start = paging.start(keys, at)
    assert start == 100
    last = paging.fill(iter(rows[200:]), verb="nodes", limit=100, room=MiB, what=str)
    assert len(last.items) == 50 and last.next is None


def test_a_page_stops_before_the_item_that_would_take_it_past_its_bytes() -> None:
    rows = _rows(100, size=1000)  # "xxx…" is 1002 bytes as JSON, and a comma
    page = paging.fill(iter(rows), verb="nodes", limit=5000, room=10 * 1003, what=str)
    assert len(page.items) == 10 and page.next is not None
    assert len(wire.encode(page.items)) - len("[]") <= 10 * 1003


def test_one_item_larger_than_a_page_is_too_large_and_named() -> None:
    rows = [((0, "huge"), "x" * 5000)]
    with pytest.raises(wire.BadRequest) as e:
        paging.fill(iter(rows), verb="nodes", limit=10, room=4000, what=lambda _: "machine huge")
    assert e.value.code == "too_large"
    assert str(e.value).startswith("nodes: machine huge alone is 5003 bytes, more than a page")


def test_a_page_of_the_default_budget_fits_the_default_max_payload() -> None:
    assert paging.budget(MiB) == paging.PAGE_BYTES == MiB // 2
    assert paging.budget(16 * 1024) == 8 * 1024  # a small server: half of it


@pytest.mark.parametrize(
    "text",
    ["nope", "", "e30", paging.cursor("plans", (3,)), paging.cursor("nodes", ("0", "m")),
     paging.cursor("nodes", (0,)), "\u00e9t\u00e9"],
)  # fmt: skip
def test_a_cursor_that_is_not_one_of_this_verb_is_refused_naming_the_field(text: str) -> None:
    with pytest.raises(wire.BadRequest) as e:
        paging.after(text, verb="nodes", shape=(int, str))
    assert e.value.code == "bad_request"
    assert str(e.value).startswith(f"after: {text[:40]!r} is not a cursor of nodes"), e.value


@pytest.mark.parametrize("limit", [0, -1, 5001])
def test_a_limit_out_of_range_is_refused_naming_the_field_and_value(limit: int) -> None:
    with pytest.raises(wire.BadRequest) as e:
        wire.decode(json.dumps({"limit": limit}).encode(), NodesRequest)
    assert str(e.value) == f"invalid body: limit: {limit} is out of range (1 to 5000)"
    assert wire.decode(b"{}", NodesRequest).limit == PAGE_LIMIT


def test_a_log_too_big_as_json_keeps_its_tail_saying_what_was_cut() -> None:
    text = "\x1b" * 10_000 + "the end\n"  # each escape is 6 bytes as JSON
    kept = paging.fitting_tail(text, 6000)
    assert paging.encoded_size(kept) <= 6000 and kept.endswith("the end\n")
    cut = len(text) - len(kept.split("\n", 1)[1])
    assert kept.startswith(f"[… {cut} characters cut to fit a reply …]\n")
    assert paging.fitting_tail("short", 6000) == "short"


@pytest.mark.parametrize("offset", [None, 1000])
def test_a_hosts_logs_reply_keeps_what_fits_and_says_where_the_next_read_goes_on(offset) -> None:
    """512 KiB of control characters is 3 MiB as JSON: a tail keeps its last bytes, a read
    from an offset its first, its `offset` where the next read goes on (nothing lost)."""
    data = b"\x01" * (512 * 1024)
    end = (offset or 0) + len(data)  # where logwriter.read says the data ends
    room = paging.room(MiB // 2, LogsReply(process="p", offset=end, data=""))  # as the verb has
    reply = host_verbs._fitting(LogsRequest(process="p", offset=offset), end, data, room=room)
    assert paging.encoded_size(reply) <= MiB // 2 < paging.encoded_size(data.decode())
    kept = len(reply.data)
    assert 0 < kept < len(data)
    assert reply.offset == (end if offset is None else offset + kept)


def _node(name: str, tier: int) -> Node:
    return Node(name=name, tier=tier, labels={}, up=True, last_seen=None, facts=None,
                processes=[])  # fmt: skip


async def test_the_client_follows_pages_to_one_list_keeping_each_machine_once() -> None:
    """Pages made by paging.fill itself over a fleet that changes between them: a machine
    moved to a later tier is shown once, at its new place; `want` cuts."""
    fleet = {f"m-{i:03d}": i % 3 for i in range(300)}

    async def nodes(req: NodesRequest) -> NodesReply:
        order = sorted((t, n) for n, t in fleet.items())
        at = paging.after(req.after, verb="nodes", shape=(int, str))
        rows = ((k, _node(k[1], k[0])) for k in order[paging.start(order, at) :])
        page = paging.fill(rows, verb="nodes", limit=min(req.limit, 40), room=MiB,
                           what=lambda n: n.name)  # fmt: skip
        if req.after is not None and fleet["m-000"] == 0:
            fleet["m-000"] = 2  # moves past the cursor between two pages
        return NodesReply(nodes=page.items, next=page.next, total=len(fleet))

    whole = await every_page(nodes, NodesRequest())
    names = [n.name for n in whole.nodes]
    assert sorted(names) == sorted(fleet) and len(names) == len(set(names)) == 300
    assert [(n.tier, n.name) for n in whole.nodes] == sorted((t, n) for n, t in fleet.items())
    assert whole.next is None
    cut = await every_page(nodes, NodesRequest(), want=55)
    assert [n.name for n in cut.nodes] == names[:55] and cut.total == 300


async def test_the_client_joins_the_entries_of_a_module_on_many_machines() -> None:
    machines = [f"m-{i:04d}" for i in range(2500)]
    chunks = [machines[i : i + 1000] for i in range(0, 2500, 1000)]
    entries = [(("a", chunk[-1]), chunk) for chunk in chunks]

    async def modules(req: ModulesRequest) -> ModulesReply:
        at = paging.after(req.after, verb="modules", shape=(str, str))
        rows = [(k, ModuleInfo(name="a", version="v", pushed_at=PUSHED, pushed_by="", assigned=m,
                               processes=[], containers=[]))
                for k, m in entries if at is None or k > at]  # fmt: skip
        page = paging.fill(iter(rows), verb="modules", limit=1, room=MiB, what=str)
        return ModulesReply(modules=page.items, next=page.next, total=1)

    whole = await every_page(modules, ModulesRequest())
    assert [m.name for m in whole.modules] == ["a"] and whole.modules[0].assigned == machines


async def test_a_cursor_that_does_not_move_stops_the_client() -> None:
    async def stuck(req: NodesRequest) -> NodesReply:
        return NodesReply(nodes=[_node("m", 0)], next=paging.cursor("nodes", (0, "m")))

    with pytest.raises(VerbFailed, match="the same page twice"):
        await every_page(stuck, NodesRequest())


# --- each list verb past 1 MiB, against a real controller ---------------------------------------


async def _store(database_url: str, names: list[str], *, tiers: list[int] | None = None,
                 labels: dict[str, str] | None = None) -> None:  # fmt: skip
    """Machines straight into the store (up, beating every hour), before a controller starts."""
    conn = await asyncpg.connect(database_url)
    try:
        await migrate(conn)
        await conn.execute(
            "INSERT INTO machines (name, tier, labels, facts, up, last_seen, beat_interval,"
            " version) SELECT n, t, $3::jsonb, $4::jsonb, true, now(), 3600, 'installed'"
            " FROM unnest($1::text[], $2::int[]) AS u(n, t)",
            names, tiers or [2] * len(names), json.dumps(labels or {}), json.dumps(FACTS),
        )  # fmt: skip
    finally:
        await conn.close()


async def _holding(nc, machines: int) -> dict:
    async def held() -> dict | None:
        s = await ask(nc, "mesh.ctl.status")
        return s if s and s.get("seat") and s["nodes"]["total"] >= machines else None

    return await await_until(held, within=60, what="a controller holding the seat")


async def _pages(nc, verb: str, body: dict) -> list[bytes]:
    """Every raw page of `verb`, asked for as large as a request may be: each under the
    server's max_payload."""
    pages = []
    body = {**body, "limit": 5000}
    while True:
        msg = await nc.request(f"mesh.ctl.{verb}", json.dumps(body).encode(), timeout=60)
        assert len(msg.data) <= nc.max_payload, len(msg.data)
        page = json.loads(msg.data)
        assert "error" not in page, page
        pages.append(msg.data)
        if page["next"] is None:
            return pages
        body = {**body, "after": page["next"]}


def _long(i: int) -> str:
    """A machine's name of 60 characters: a plan's step, a module's machine are that much more."""
    return f"machine-{i:05d}-" + "x" * 46


async def test_nodes_pages_a_fleet_past_1_mib(nc, start_controller, database_url, cli, nats_url):
    """2,500 machines of ~600 bytes each, in three tiers; 40 more register through the verb
    and one moves tier while the controller holds (the order it keeps is kept as they come)."""
    names = [f"m-{i:05d}" for i in range(2500)]
    labels = {"role": "web", "zone": "z" * 200, "rack": "r" * 150}
    await _store(database_url, names, tiers=[i % 3 for i in range(2500)], labels=labels)
    start_controller("ctl-a")
    await _holding(nc, 2500)
    registered = [f"n-{i:03d}" for i in range(40)]

    async def register(name: str, tier: int) -> None:
        body = {"name": name, "tier": tier, "labels": labels, "facts": FACTS,
                "beat_interval": 3600, "pid": 1}  # fmt: skip
        reply = await ask(nc, f"mesh.ctl.host.{name}.register", body, timeout=30)
        assert reply is not None and "error" not in reply, reply

    async with anyio.create_task_group() as tg:
        for i, name in enumerate(registered):
            tg.start_soon(register, name, i % 3)
    ok(mesh_cli("tier", "m-00001", "0", nats_url=nats_url))
    tier_of = {n: i % 3 for i, n in enumerate(names)} | {n: i % 3 for i, n in
                                                         enumerate(registered)}  # fmt: skip
    tier_of["m-00001"] = 0
    expected = sorted(tier_of, key=lambda n: (tier_of[n], n))

    pages = await _pages(nc, "nodes", {})
    assert sum(map(len, pages)) > 1 * MiB and len(pages) > 2
    walked = [n["name"] for page in pages for n in json.loads(page)["nodes"]]
    assert walked == expected

    started = time.monotonic()
    shown = ok_json(cli("--json", "nodes"))
    took = time.monotonic() - started
    assert [(n["tier"], n["name"]) for n in shown["nodes"]] == [(tier_of[n], n) for n in expected]
    assert "next" not in shown and shown["total"] == len(expected), took
    one = shown["nodes"][0]
    assert {"name", "tier", "labels", "up", "last_seen", "facts", "processes", "version"} <= set(
        one
    )

    # An old client (no after, no limit) gets the first page, and a way on.
    first = json.loads((await nc.request("mesh.ctl.nodes", b"{}", timeout=30)).data)
    assert 0 < len(first["nodes"]) <= PAGE_LIMIT and first["next"] is not None
    assert [n["name"] for n in first["nodes"]] == expected[: len(first["nodes"])]
    # A machine registering before the cursor meanwhile shifts nothing: the next page goes on
    # from where this one ended.
    await register("a-newcomer", 0)
    second = await ask(nc, "mesh.ctl.nodes", {"after": first["next"]}, timeout=30)
    assert second["nodes"][0]["name"] == expected[len(first["nodes"])]

    cut = ok_json(cli("--json", "nodes", "--limit", "10"))
    assert [n["name"] for n in cut["nodes"]] == ["a-newcomer", *expected][:10]
    table = ok(cli("nodes", "--limit", "10"))
    assert f"… {len(expected) + 1 - 10:,} more machines; raise --limit to see them" in table

    refusals = [
        ({"limit": 0}, "limit: 0 is out of range (1 to 5000)"),
        ({"after": "nope"}, "after: 'nope' is not a cursor of nodes"),
        ({"after": paging.cursor("plans", (1,))}, "is not a cursor of nodes"),
    ]
    for body, says in refusals:
        reply = await ask(nc, "mesh.ctl.nodes", body, timeout=10)
        assert reply["error"]["code"] == "bad_request" and says in reply["error"]["message"]
    refused = mesh_cli("nodes", "--limit", "0", nats_url=nats_url)
    assert refused.returncode == 2 and "--limit: 0 is not a count" in refused.stderr


def _module(folder: Path, name: str, *, assign: str = "") -> Path:
    return write_module(
        folder,
        f'[module]\nname = "{name}"\n[bundle.code]\nkind = "files"\nsource = "src"\n'
        f"[account.{name}]\n"
        f'[process.{name}]\nbundle = "code"\naccount = "{name}"\n'
        f'command = ["sleep", "3600", "${{machine}}"]\n'
        f'env = {{ GREETING = "{"hello " * 10}" }}\n' + assign,
        files={"src/run.sh": "sleep 3600\n"},
    )


async def test_plan_pages_its_steps_past_1_mib(
    nc, start_controller, database_url, tmp_path, cli, nats_url
) -> None:
    """An assign to 5,000 machines (and one in tier 0, which never applies: the plan waits
    there, its 5,000 steps in tier 2 pending)."""
    names = [_long(i) for i in range(5000)]
    await _store(database_url, ["first", *names], tiers=[0] + [2] * 5000, labels={"big": "yes"})
    start_controller("ctl-a")
    await _holding(nc, 5001)
    ok(mesh_cli("push", str(_module(tmp_path / "m", "wide")), nats_url=nats_url))
    reply = ok_json(cli("--json", "assign", "wide", "--label", "big=yes"))
    assert reply["changed"] == 5001 and len(reply["machines"]) == 1000, reply["changed"]
    assert reply["machines"] == sorted(["first", *names])[:1000]
    assert "and 4996 more" in reply["message"] and len(reply["message"]) < 1000

    pages = await _pages(nc, "plan", {"id": reply["plan"]})
    assert sum(map(len, pages)) > 1 * MiB and len(pages) > 1
    walked = [s["machine"] for page in pages for s in json.loads(page)["steps"]]
    assert walked == ["first", *names]
    for page in map(json.loads, pages):  # every page has the plan's header and all its tiers
        assert [(t["tier"], t["total"]) for t in page["tiers"]] == [(0, 1), (2, 5000)]

    shown = ok_json(cli("--json", "plan", str(reply["plan"])))
    assert [s["machine"] for s in shown["steps"]] == ["first", *names]
    assert {"id", "state", "steps"} <= set(shown) and "next" not in shown
    assert {"machine", "tier", "state", "started", "finished", "error"} <= set(shown["steps"][0])
    table = ok(cli("plan", str(reply["plan"]), "--limit", "3"))
    assert "… 4,998 more steps; raise --limit to see them" in table and names[1] in table
    assert names[2] not in table


async def test_diff_pages_the_machines_a_push_would_change_past_1_mib(
    nc, start_controller, database_url, tmp_path, cli
) -> None:
    """The dry run of a first push whose [assign] takes 5,000 machines."""
    names = [_long(i) for i in range(5000)]
    await _store(database_url, names, labels={"big": "yes"})
    start_controller("ctl-a")
    await _holding(nc, 5000)
    folder = _module(tmp_path / "m", "wide", assign='[assign]\nlabels = { big = "yes" }\n')
    shown = ok_json(cli("--json", "plan", "diff", str(folder)))
    assert [m["machine"] for m in shown["machines"]] == names and "next" not in shown
    assert len(json.dumps(shown)) > 1 * MiB
    assert {c["op"] + c["kind"] for c in shown["machines"][0]["changes"]} == {
        "+account", "+bundle", "+process"
    }  # fmt: skip
    table = ok(cli("plan", "diff", str(folder), "--limit", "2"))
    assert "5000 machine(s) would change" in table
    assert "… 4,998 more machines; raise --limit to see them" in table


async def test_modules_pages_modules_on_thousands_of_machines_past_1_mib(
    nc, start_controller, database_url, tmp_path, cli, nats_url
) -> None:
    """Four modules on 5,000 machines each (the assignments written to the store: each would be
    a plan of 5,000 steps): a module on more than 1000 comes in several entries, joined."""
    names = [_long(i) for i in range(5000)]
    await _store(database_url, names)
    start_controller("ctl-a")
    await _holding(nc, 5000)
    modules = ["m1", "m2", "m3", "m4"]
    for name in modules:
        ok(mesh_cli("push", str(_module(tmp_path / name, name)), nats_url=nats_url))
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "INSERT INTO assignments (module, machine) SELECT m, n"
            " FROM unnest($1::text[]) AS m, unnest($2::text[]) AS n", modules, names,
        )  # fmt: skip
    finally:
        await conn.close()

    pages = await _pages(nc, "modules", {})
    assert sum(map(len, pages)) > 1 * MiB and len(pages) > 1
    entries = [m for page in pages for m in json.loads(page)["modules"]]
    assert len(entries) == 4 * 5 and {len(m["assigned"]) for m in entries} == {1000}

    shown = ok_json(cli("--json", "modules"))
    assert [m["name"] for m in shown["modules"]] == modules and "next" not in shown
    assert all(m["assigned"] == names for m in shown["modules"])
    table = ok(cli("modules", "--limit", "2"))  # a row names 10 machines
    assert names[9] in table and names[10] not in table and "4,990" in table
    assert "… 2 more modules; raise --limit to see them" in table and "m3" not in table


async def test_plans_pages_thousands_of_plans_past_1_mib(
    nc, start_controller, database_url, cli
) -> None:
    """5,000 finished plans in the store, newest first."""
    conn = await asyncpg.connect(database_url)
    try:
        await migrate(conn)
        await conn.execute(
            "INSERT INTO plans (trigger, subject, state, epoch, requested_by, started, finished)"
            " SELECT 'assign', $1, 'done', 1, 'someone', now(), now()"
            " FROM generate_series(1, 5000)", "s" * 64,
        )  # fmt: skip
    finally:
        await conn.close()
    start_controller("ctl-a")
    await _holding(nc, 0)

    pages = await _pages(nc, "plans", {})
    assert sum(map(len, pages)) > 1 * MiB and len(pages) > 1
    walked = [p["id"] for page in pages for p in json.loads(page)["plans"]]
    assert walked == list(range(5000, 0, -1))

    shown = ok_json(cli("--json", "plan", "--limit", "5000"))
    assert [p["id"] for p in shown["plans"]] == walked and shown["total"] == 5000
    table = ok(cli("plan"))  # the newest 20
    assert "… 4,980 more plans; raise --limit to see them" in table
    newest = ok_json(cli("--json", "plan", "--limit", "3"))
    assert [p["id"] for p in newest["plans"]] == [5000, 4999, 4998]
    older = await ask(
        nc, "mesh.ctl.plans", {"limit": 2, "after": paging.cursor("plans", (10,))}, timeout=10
    )
    assert [p["id"] for p in older["plans"]] == [9, 8]
