"""`mesh console`: in a real browser (Debian's chromium, headless, driven by Playwright) against a
whole `mesh dev up`, whose console runs with the viewer's credentials. What a person sees: the
three machines; a plan rolling out tier 0, then 1, then 2 while the page stays open (never
reloaded); a machine's processes and its log, followed; the seat handed over; a machine going
down, and when it was last heard from on a page opened after. A screenshot of each state is
kept in the test's folder (the paths are printed). Around it, what needs no browser: the listen
address, no bus, a port in use, the token (then the cookie) it asks for, the Host check, the
headers, bad names and numbers in URLs, and what a viewer may hear on the bus. (Another account
of the machine, the unix socket and `mesh dev up`'s console: tests/test_attacks.py.)"""

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from helpers import MESH, DevUp, mesh_cli, ok, ok_json, one_line_error
from module_folders import write_module

from mesh import subjects
from mesh.auth.policy import OPERATOR_WATCH, User, permissions
from mesh.embedded import ports
from programs.console import server
from programs.console.server import Console

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
TRAP = '<img src=x onerror="window.owned=1">'
TOKEN = server.new_token()
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SEEN_WITHIN = 60_000  # ms a page has to show a state (Playwright polls the page until then)

# A module whose process is healthy once a marker file exists in its host's root, so the test
# decides when each tier's step is done and sees the page between tiers, without sleeping.
CHECK = """\
import os, sys
root = os.path.join(os.environ["MESH_FILES"], "..", "..", "..")
sys.exit(0 if os.path.exists(os.path.join(root, sys.argv[1])) else 1)
"""
# It says hello, then more once told to (a marker again), so the test sees a log followed live.
RUN = """\
echo gated says hello
while ! [ -e "$MESH_FILES/../../../more" ]; do sleep 0.2; done
echo and more
exec sleep 3600
"""
MODULE = """\
[module]
name = "gated"
description = "healthy where its marker is"
[bundle.code]
kind = "files"
source = "src"
[process.gated]
bundle = "code"
command = ["sh", "run.sh"]
root = true
check = { exec = ["python3", "check.py", "go-gated"], every = "200ms", passes = 1 }
[rollout]
deadline = "300s"
"""


# --- without a browser -------------------------------------------------------------------------


def test_a_bad_listen_address_or_no_bus_is_one_line() -> None:
    done = mesh_cli("console", "--listen", "localhost", nats_url="nats://x:1")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "argument --listen: 'localhost' is not ADDR:PORT or PORT" in done.stderr
    line = one_line_error(mesh_cli("console", nats_url="nats://127.0.0.1:1"))
    assert line.startswith("mesh: error: cannot reach NATS at nats://127.0.0.1:1")


def test_a_port_in_use_is_one_line(nats_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_line_error(mesh_cli("console", "--listen", f"127.0.0.1:{port}",
                                       nats_url=nats_url))  # fmt: skip
    assert line.startswith(f"mesh: error: --listen: cannot listen on 127.0.0.1:{port}: "), line


def test_operators_hear_the_fleet_but_not_its_verbs() -> None:
    viewer = permissions(User(name="viewer", kind="operator", public="U", role="viewer"))
    admin = permissions(User(name="admin", kind="operator", public="U", role="admin"))
    for who in (viewer, admin):
        assert set(OPERATOR_WATCH) <= set(who.subscribe)
        # never a verb's request or another identity's replies
        assert not [s for s in who.subscribe if s.startswith(("mesh.ctl", "_INBOX.>", "mesh.>"))]
        assert "mesh.host.*.logs" not in who.subscribe
    controller = permissions(User(name="controller", kind="controller", public="U"))
    assert subjects.plan("*") in controller.publish  # the planner tells plans' progress
    host = permissions(User(name="node-1", kind="host", public="U"))
    assert subjects.plan("*") not in host.publish


@pytest.fixture
async def page_server():
    """The console's web side on a loopback port, with no bus behind it."""
    console = Console(None, url="nats://nowhere", listen_host="127.0.0.1", token=TOKEN)  # type: ignore[arg-type]
    client = TestClient(TestServer(console.app(), host="127.0.0.1"))
    await client.start_server()
    yield client
    await client.close()


async def test_the_page_is_served_with_headers_that_keep_it_its_own(page_server) -> None:
    index = await page_server.get("/", headers=AUTH)
    assert index.status == 200 and "/static/app.js" in await index.text()
    csp = index.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert index.headers["X-Content-Type-Options"] == "nosniff"
    script = await page_server.get("/static/app.js", headers=AUTH)
    assert script.status == 200 and "textContent" in await script.text()
    assert "innerHTML" not in (server.STATIC / "app.js").read_text()  # text nodes only


async def test_it_asks_for_its_token_then_takes_the_cookie_it_set(page_server) -> None:
    for path in ("/", "/events", "/api/plan/1", "/api/logs/node-3/steal", "/static/app.js"):
        for headers in ({}, {"Authorization": "Bearer " + server.new_token()},
                        {"Cookie": f"{server.COOKIE}={server.new_token()}"}):  # fmt: skip
            refused = await page_server.get(path, headers=headers, allow_redirects=False)
            assert refused.status == 401, (path, headers)
            assert "Set-Cookie" not in refused.headers
    wrong = await page_server.get("/?token=" + TOKEN[:-1] + "x", allow_redirects=False)
    assert wrong.status == 401 and "not the console's token" in await wrong.text()
    # The first visit: a cookie, and the same address without the token (its other queries kept).
    first = await page_server.get(f"/api/logs/node.1/gated?wait=1&token={TOKEN}",
                                  allow_redirects=False)  # fmt: skip
    assert first.status == 303 and first.headers["Location"] == "/api/logs/node.1/gated?wait=1"
    cookie = first.cookies[server.COOKIE]
    assert cookie.value == TOKEN and cookie["httponly"] and cookie["samesite"] == "Strict"
    assert cookie["path"] == "/" and first.headers["Cache-Control"] == "no-store"
    home = await page_server.get(f"/?token={TOKEN}", allow_redirects=False)
    assert home.status == 303 and home.headers["Location"] == "/"
    # Then the cookie alone.
    alone = {"Cookie": f"{server.COOKIE}={TOKEN}"}
    assert (await page_server.get("/", headers=alone)).status == 200
    assert (await page_server.get("/static/app.js", headers=alone)).status == 200


async def test_another_host_name_and_writes_are_refused(page_server) -> None:
    # A page of another site whose name resolves to 127.0.0.1 (DNS rebinding) reads nothing.
    rebound = await page_server.get("/", headers={"Host": "evil.example:8080", **AUTH})
    assert rebound.status == 403 and "unexpected Host" in await rebound.text()
    assert (await page_server.get("/", headers={"Host": "localhost:8080", **AUTH})).status == 200
    assert (await page_server.post("/events", headers=AUTH)).status == 405
    assert (await page_server.post("/events")).status == 401  # nothing said to a stranger


async def test_a_bad_name_or_number_in_a_url_is_refused_naming_it(page_server) -> None:
    reply = await page_server.get("/api/logs/node.1/gated", headers=AUTH)
    assert reply.status == 400
    assert "machine" in (await reply.json())["error"]
    for query, field in (("wait=600", "wait"), ("wait=nan", "wait"), ("offset=-1", "offset")):
        reply = await page_server.get(f"/api/logs/node-1/gated?{query}", headers=AUTH)
        assert reply.status == 400, query
        assert (await reply.json())["error"].startswith(f"{field}: "), query
    reply = await page_server.get("/api/plan/x1", headers=AUTH)
    assert reply.status == 400 and "plan id" in (await reply.json())["error"]


def test_a_token_given_that_is_not_one_is_one_line_that_does_not_show_it() -> None:
    env = {**os.environ, server.TOKEN_ENV: "short secret", "MESH_NATS_URL": "nats://x:1"}
    done = subprocess.run([*MESH, "console", "--listen", "127.0.0.1:1"], capture_output=True,
                          text=True, timeout=60, env=env)  # fmt: skip
    line = one_line_error(done)
    assert line.startswith(f"mesh: error: {server.TOKEN_ENV}: not a console token"), line
    assert "short secret" not in done.stderr


# --- in a browser ------------------------------------------------------------------------------


def _browser_or_skip():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("Playwright for Python is not installed (pip install -e '.[test]')")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium)")
    return sync_playwright


@pytest.mark.slow
def test_the_console_in_a_browser(tmp_path: Path) -> None:
    sync_playwright = _browser_or_skip()
    from playwright.sync_api import expect

    folder = tmp_path / "dev"
    shots: list[Path] = []
    dev = DevUp(folder)
    try:
        console_url = dev.match(r"console (http://127\.0\.0\.1:\d+/\?token=[\w-]+) ",
                                within=180).group(1)  # fmt: skip
        nats_url = dev.ready(within=60)
        admin = str(folder / "creds" / "admin.creds")
        started = re.compile(r"host node-3 started \(pid (\d+)")
        node_3 = int(next(m for line in dev.seen if (m := started.match(line))).group(1))
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                expect.set_options(timeout=SEEN_WITHIN)  # a loaded machine is slow to show
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))

                def shot(name: str) -> None:
                    path = tmp_path / f"{len(shots) + 1}-{name}.png"
                    page.screenshot(path=str(path), full_page=True)
                    shots.append(path)

                def row(machine: str):
                    return page.locator(f'#machines tr[data-machine="{machine}"]')

                # 1. The fleet: three machines up, the seat held with a standby. The URL's token
                # becomes a cookie, and the address bar shows the page without it.
                page.goto(console_url)
                assert "token" not in page.url and page.url == console_url.split("?")[0], page.url
                for i, name in enumerate(("node-1", "node-2", "node-3")):
                    expect(row(name).locator(".state")).to_have_text("up", timeout=SEEN_WITHIN)
                    expect(row(name).locator(".tier")).to_have_text(str(i))
                expect(page.locator("#holder")).to_have_text(re.compile(r"^ctl-[12]$"))
                expect(page.locator("#connection")).to_have_text("live")
                expect(row("node-1").locator(".beat")).to_have_text(
                    re.compile(r"just now|\ds ago"), timeout=SEEN_WITHIN
                )
                shot("three-machines")
                page.evaluate("window.notReloaded = true")  # gone if the page ever reloads
                # A label's value is an operator's or a machine's words: the page shows them as
                # text and never runs them (seen once the plan below has the nodes asked again).
                ok(mesh_cli("label", "node-1", f"note={TRAP}", nats_url=nats_url, creds=admin))

                # 2. A plan, pushed and assigned while the page is open, tier by tier.
                gated = write_module(tmp_path / "gated", MODULE,
                                     files={"src/check.py": CHECK, "src/run.sh": RUN})  # fmt: skip
                ok(mesh_cli("push", str(gated), nats_url=nats_url, creds=admin))
                ok(mesh_cli("assign", "gated", "node-1", "node-2", "node-3",
                            nats_url=nats_url, creds=admin))  # fmt: skip

                def tier(t: int):
                    return page.locator(f'#plan-tiers tr[data-tier="{t}"] .state')

                expect(tier(0)).to_have_text("rolling", timeout=SEEN_WITHIN)
                expect(tier(1)).to_have_text("pending")
                expect(tier(2)).to_have_text("pending")
                shot("plan-tier-0-rolling")
                for t in (0, 1, 2):
                    (folder / "hosts" / f"node-{t + 1}" / "go-gated").touch()
                    expect(tier(t)).to_have_text("done", timeout=SEEN_WITHIN)
                    step = page.locator(f'#plan-steps tr[data-machine="node-{t + 1}"] .state')
                    expect(step).to_have_text("done")
                    for later in range(t + 1, 3):  # not yet: its machine is not healthy
                        expect(tier(later)).not_to_have_text("done")
                    shot(f"plan-tier-{t}-done")
                expect(page.locator("#plan-summary")).to_contain_text("assign gated")
                expect(page.locator("#plan-summary .done")).to_have_text("done")
                # What each step changed in its machine's declaration, with nothing but the id.
                expect(page.locator('#plan-changes li[data-machine="node-2"]')).to_contain_text(
                    "+ process gated"
                )
                expect(page.locator('#modules tr[data-module="gated"] .assigned')).to_have_text(
                    "node-1, node-2, node-3", timeout=SEEN_WITHIN
                )
                # Who did it, as the mesh verified it (the admin's credentials): the audit log.
                newest = page.locator("#audit tbody tr").first
                expect(newest).to_contain_text("assign", timeout=SEEN_WITHIN)
                expect(newest.locator(".who")).to_have_text("admin")
                expect(row("node-3").locator(".processes")).to_contain_text(
                    "gated running healthy", timeout=SEEN_WITHIN
                )
                assert page.evaluate("window.notReloaded") is True  # all of it live

                # 3. A machine's page: its processes and the tail of one's log.
                row("node-1").locator(".name a").click()
                expect(page.locator('#processes tr[data-process="gated"] .health')).to_have_text(
                    "healthy", timeout=SEEN_WITHIN
                )
                expect(page.locator('#processes tr[data-process="gated"] .restarts')).to_have_text(
                    "0"
                )
                page.locator('button[data-log="gated"]').click()
                expect(page.locator("#log-text")).to_contain_text(
                    "gated says hello", timeout=SEEN_WITHIN
                )
                (folder / "hosts" / "node-1" / "more").touch()  # it says more: the page follows
                # each line with its time in front (services/host/logwriter.py)
                expect(page.locator("#log-text")).to_contain_text(
                    re.compile(r"gated says hello\n\S+Z and more")
                )
                expect(page.locator('[data-field="labels"]')).to_contain_text(f"note={TRAP}")
                assert page.evaluate("window.owned") is None
                shot("machine-node-1")
                page.locator("a", has_text="← the fleet").click()

                # 4. The seat handed over: the page shows the new holder and how it came to be.
                holder = page.locator("#holder").inner_text()
                standby = {"ctl-1": "ctl-2", "ctl-2": "ctl-1"}[holder]
                ok(mesh_cli("handover", nats_url=nats_url, creds=admin))
                expect(page.locator("#holder")).to_have_text(standby)
                expect(page.locator('#seat [data-field="last handover"]')).to_contain_text(
                    f"{holder} handed it to {standby}"
                )
                expect(page.locator('#seat [data-field="standbys"]')).to_contain_text(holder)
                shot("seat-handed-over")

                # 5. A machine going down: its host killed, the page says so.
                os.kill(node_3, signal.SIGKILL)
                expect(row("node-3").locator(".state")).to_have_text("down", timeout=SEEN_WITHIN)
                expect(row("node-1").locator(".state")).to_have_text("up")
                expect(row("node-3").locator(".processes")).to_contain_text("as last reported")
                expect(page.locator('#seat [data-field="machines"]')).to_have_text(
                    "2 up, 1 down, 3 in all"
                )
                shot("node-3-down")
                assert page.evaluate("window.notReloaded") is True

                # 6. A page opened now says when each machine was last heard from before any
                # beat reaches it: node-3 sends none, so only `nodes`' last_seen can say it.
                page.reload()
                expect(row("node-3").locator(".state")).to_have_text("down")
                expect(row("node-3").locator(".beat")).to_have_text(re.compile(r"^\d+s ago$"))
                shot("node-3-last-seen")
                assert errors == [], errors
            finally:
                browser.close()
    finally:
        for path in shots:
            print(f"screenshot: {path}")
        dev.kill()
        dev.drain()  # what `mesh dev up` said, shown by pytest when the test fails
        print("mesh dev up said:", *dev.seen[-400:], sep="\n")


async def test_writes_need_the_page_s_origin_and_its_session_token(page_server) -> None:
    """A held plan's approve and reject are the console's only writes: from its own page
    (Origin) with the session's write token (/api/me), refused otherwise before anything is
    asked; any other write is still refused."""
    path = "/api/plan/7/approve"
    own = {"Origin": f"http://{page_server.host}:{page_server.port}"}
    wrong = {**own, server.WRITE_HEADER: server.new_token()}
    cases = (({}, "another origin"), ({"Origin": "http://evil.example"}, "another origin"),
             (own, "session token"), (wrong, "session token"))  # fmt: skip
    for headers, said in cases:
        refused = await page_server.post(path, headers={**AUTH, **headers}, json={})
        assert refused.status == 403, headers
        assert said in (await refused.json())["error"], headers
    assert (await page_server.post("/api/plan/7/delete", headers={**AUTH, **own})).status == 405
    assert (await page_server.post(path, headers=own)).status == 401  # a stranger: nothing said


@pytest.mark.slow
def test_a_held_plan_is_approved_and_rejected_in_the_console(tmp_path: Path) -> None:
    """A console run as an admin shows a held plan's author, digest and approvals, and its
    Approve (bound to the digest shown) and Reject act as that admin; dev up's console, a
    viewer's, shows the review without the buttons."""
    sync_playwright = _browser_or_skip()
    from playwright.sync_api import expect

    folder = tmp_path / "dev"
    dev = DevUp(folder)
    console: subprocess.Popen | None = None
    try:
        viewer_url = dev.match(r"console (http://127\.0\.0\.1:\d+/\?token=[\w-]+) ",
                               within=180).group(1)  # fmt: skip
        nats_url = dev.ready(within=60)
        admin = str(folder / "creds" / "admin.creds")
        dora = ok_json(mesh_cli("operator", "add", "dora", "--role", "admin", "--dir", str(folder),
                                "--json", nats_url=nats_url, creds=admin))["creds"]  # fmt: skip
        for name in ("site", "blog"):  # two modules: a held change of one supersedes its last
            manifest = f'[module]\nname = "{name}"\n[bundle.web]\nkind = "files"\nsource = "src"\n'
            made = write_module(tmp_path / name, manifest, files={"src/index.html": "hi\n"})
            ok(mesh_cli("push", str(made), nats_url=nats_url, creds=admin))

        def held(module: str, machine: str) -> dict:
            asked = ok_json(mesh_cli("--json", "assign", module, machine, "--hold",
                                     nats_url=nats_url, creds=dora))  # fmt: skip
            return ok_json(mesh_cli("--json", "plan", str(asked["plan"]), nats_url=nats_url,
                                    creds=admin))  # fmt: skip

        token, port = server.new_token(), ports.free_port()
        console = subprocess.Popen(
            [*MESH, "console", "--listen", f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "MESH_NATS_URL": nats_url, "MESH_CREDS": admin,
                 server.TOKEN_ENV: token},
        )  # fmt: skip
        admin_url = f"http://127.0.0.1:{port}/?token={token}"
        first, second = held("site", "node-1"), held("blog", "node-2")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                expect.set_options(timeout=SEEN_WITHIN)
                page.goto(viewer_url)  # the viewer's: the review, no buttons
                page.goto(viewer_url.split("?")[0] + f"#/plan/{first['id']}")
                expect(page.locator("#plan-author")).to_have_text("dora")
                expect(page.locator("#plan-digest")).to_have_text(first["digest"])
                expect(page.locator("#plan-approvals")).to_contain_text("0 of 1 approval(s)")
                expect(page.locator("#approve")).to_be_hidden()

                _until_served(admin_url)
                page.goto(admin_url)
                page.goto(admin_url.split("?")[0] + f"#/plan/{first['id']}")
                expect(page.locator("#plan-digest")).to_have_text(first["digest"])
                page.locator("#approve").click()
                expect(page.locator("#plan-acted")).to_contain_text(
                    f"plan {first['id']} approved by admin ({first['digest']}"
                )
                page.goto(admin_url.split("?")[0] + f"#/plan/{second['id']}")
                page.locator("#reject-reason").fill("not on node-2")
                expect(page.locator("#reject-reason")).to_have_value("not on node-2")
                page.locator("#reject").click()
                expect(page.locator("#plan-acted")).to_contain_text(
                    f"plan {second['id']} rejected by admin: not on node-2"
                )
            finally:
                browser.close()
        states = {p["id"]: p["state"] for p in ok_json(
            mesh_cli("--json", "plan", nats_url=nats_url, creds=admin))["plans"]}  # fmt: skip
        assert states[second["id"]] == "rejected", states
        assert states[first["id"]] in ("pending", "rolling", "done"), states  # approved: it runs
        said = {(e["who"], e["verb"], e["subject"]) for e in ok_json(
            mesh_cli("--json", "audit", nats_url=nats_url, creds=admin))["entries"]}  # fmt: skip
        assert ("admin", "plan-approve", f"plan {first['id']}") in said, said
        assert ("admin", "plan-reject", f"plan {second['id']}") in said, said
    finally:
        if console is not None:
            os.killpg(console.pid, signal.SIGKILL)
            console.wait()
        dev.kill()
        dev.drain()
        print("mesh dev up said:", *dev.seen[-200:], sep="\n")


def _until_served(url: str) -> None:
    """The console started by the test answers (its port bound), within a minute."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", int(url.split(":")[2].split("/")[0])), 1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)  # ok: polling a port with a deadline
