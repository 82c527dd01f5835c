"""Prometheus metrics: each controller's and host's `/metrics`, scraped over HTTP and parsed
with prometheus_client's own parser, shows what the test did (the seat, verbs it called, a plan
it rolled out, the process it runs); `mesh dev up` turns them on; a real Prometheus reads one."""

import os
import shutil
import signal
import socket
import subprocess

import anyio
import httpx
import pytest
from helpers import MESH, DevUp, ask, await_until, mesh_cli, ok_json, wait_until
from module_folders import write_module
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from mesh import metrics
from mesh.embedded import ports

TICKER = """\
import time
while True:
    time.sleep(1)  # ok: the supervised process's own pace, not a wait in the test
"""


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


async def scrape(port: int) -> dict:
    """The families of a piece's /metrics, by name (a counter's without `_total`)."""
    async with httpx.AsyncClient(timeout=5) as client:
        r = await client.get(f"http://127.0.0.1:{port}/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return _families(r.text)


def value(families: dict, sample: str, **labels: str) -> float | None:
    """The value of one sample (`mesh_verb_requests_total`, ...) with exactly these labels."""
    for family in families.values():
        for s in family.samples:
            if s.name == sample and s.labels == labels:
                return s.value
    return None


# --- without servers ---------------------------------------------------------------------------


def test_the_metrics_flag_takes_addr_port_or_a_port_alone() -> None:
    assert metrics.parse_listen("9100") == ("127.0.0.1", 9100)
    assert metrics.parse_listen("0.0.0.0:9100") == ("0.0.0.0", 9100)
    assert metrics.parse_listen("[::1]:9100") == ("::1", 9100)
    assert metrics.url(("::1", 9100)) == "http://[::1]:9100/metrics"
    for bad in ("", "abc", "host:", ":9100", "1.2.3.4:0", "1.2.3.4:65536", "1.2.3.4:x"):
        with pytest.raises(ValueError, match="ADDR:PORT"):
            metrics.parse_listen(bad)
    for command in (["controller", "run"], ["host", "run", "--name", "node-1"]):
        done = subprocess.run([*MESH, *command, "--metrics", "nine"], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert done.returncode == 2 and "Traceback" not in done.stderr
        assert done.stderr.count("\n") == 1 and "--metrics: 'nine'" in done.stderr, done.stderr


async def test_the_endpoint_serves_its_own_registry_and_nothing_else() -> None:
    registry = CollectorRegistry()
    Counter("mesh_test_things", "things", registry=registry).inc(3)
    port = ports.free_port()
    async with anyio.create_task_group() as tg:
        await tg.start(metrics.serve, registry, ("127.0.0.1", port), "test")
        async with httpx.AsyncClient(timeout=5) as client:
            r = await client.get(f"http://127.0.0.1:{port}/metrics")
            assert r.status_code == 200
            families = _families(r.text)
            assert families["mesh_test_things"].type == "counter"
            assert value(families, "mesh_test_things_total") == 3
            assert "python_gc_objects_collected" not in families  # not the default registry
            assert (await client.get(f"http://127.0.0.1:{port}/other")).status_code == 404
            assert (await client.post(f"http://127.0.0.1:{port}/metrics")).status_code == 405
        # The port is taken now: a second endpoint there says so in one line.
        with pytest.raises(metrics.MetricsError, match=rf"--metrics: cannot listen on .*:{port}"):
            await tg.start(metrics.serve, registry, ("127.0.0.1", port), "test")
        tg.cancel_scope.cancel()


# --- a controller, a standby and a host ---------------------------------------------------------


@pytest.fixture
async def watched(nc, start_controller, start_host):
    """ctl-a holds the seat, ctl-b stands by, node-1 (tier 0) is up; each serves metrics."""
    port = {name: ports.free_port() for name in ("ctl-a", "ctl-b", "node-1")}
    start_controller("ctl-a", "--metrics", str(port["ctl-a"]))

    async def holder():
        s = await ask(nc, "mesh.ctl.status")
        return s if s and s["seat"] and s["seat"]["holder"] == "ctl-a" else None

    await await_until(holder, within=30, what="ctl-a to hold the seat")
    start_controller("ctl-b", "--metrics", f"127.0.0.1:{port['ctl-b']}")
    start_host("node-1", "--tier", "0", "--metrics", str(port["node-1"]))

    async def ready():
        s = await ask(nc, "mesh.ctl.status")
        return s if s and s["standbys"] and s["nodes"]["up"] == 1 else None

    await await_until(ready, within=30, what="a standby and node-1 up")
    return port


async def test_the_seat_and_verbs_as_the_holder_and_the_standby_count_them(nc, watched):
    port = watched
    status = await ask(nc, "mesh.ctl.status")
    holder = await scrape(port["ctl-a"])
    assert holder["mesh_seat_holder"].type == "gauge"
    assert value(holder, "mesh_seat_holder") == 1
    assert value(holder, "mesh_seat_epoch") == status["seat"]["epoch"]
    assert value(holder, "mesh_seat_handovers_total", kind="first") == 1
    assert holder["mesh_machines"].type == "gauge"
    assert value(holder, "mesh_machines", state="up") == 1
    assert value(holder, "mesh_machines", state="down") == 0

    async def standby_scraped():  # its endpoint may come a moment after it announced itself
        try:
            return await scrape(port["ctl-b"])
        except httpx.HTTPError:
            return None

    standby = await await_until(standby_scraped, within=10, what="ctl-b's metrics")
    assert value(standby, "mesh_seat_holder") == 0
    assert value(standby, "mesh_seat_epoch") == 0  # it never held the seat
    assert "mesh_machines" not in standby  # the fleet is the holder's to report

    # A verb called N times shows N more, each timed; an unknown one is counted, not named.
    before = value(holder, "mesh_verb_requests_total", verb="status", outcome="ok") or 0
    timed = value(holder, "mesh_verb_duration_seconds_count", verb="status") or 0
    for _ in range(7):
        assert (await ask(nc, "mesh.ctl.status"))["seat"]["holder"] == "ctl-a"
    reply = await ask(nc, "mesh.ctl.no-such-verb")
    assert reply["error"]["code"] == "unknown_verb"
    holder = await scrape(port["ctl-a"])
    assert holder["mesh_verb_requests"].type == "counter"
    assert value(holder, "mesh_verb_requests_total", verb="status", outcome="ok") == before + 7
    assert holder["mesh_verb_duration_seconds"].type == "histogram"
    assert value(holder, "mesh_verb_duration_seconds_count", verb="status") == timed + 7
    assert value(holder, "mesh_verb_requests_total", verb="(unknown)", outcome="unknown_verb") == 1
    assert value(holder, "mesh_verb_requests_total", verb="register", outcome="ok") >= 1

    # The host counts its own verbs.
    assert (await ask(nc, "mesh.host.node-1.status"))["name"] == "node-1"
    host = await scrape(port["node-1"])
    assert value(host, "mesh_verb_requests_total", verb="status", outcome="ok") >= 1


async def test_a_plan_shows_on_the_controller_and_the_host(nc, watched, nats_url, tmp_path):
    port = watched
    folder = write_module(
        tmp_path / "ticker",
        '[module]\nname = "ticker"\n[bundle.code]\nkind = "files"\nsource = "src"\n'
        '[process.ticker]\nbundle = "code"\ncommand = ["python3", "tick.py"]\nroot = true\n'
        'check = { exec = ["true"], every = "200ms", passes = 1 }\n[assign]\ntiers = [0]\n',
        files={"src/tick.py": TICKER},
    )
    pushed = mesh_cli("--json", "push", str(folder), "--wait", nats_url=nats_url, answer=60,
                      timeout=180)  # fmt: skip
    plan = ok_json(pushed)["plan"]
    assert plan is not None

    async def plan_counted():  # the holder counts the store's plans every few seconds
        families = await scrape(port["ctl-a"])
        return families if value(families, "mesh_plans", state="done") == 1 else None

    ctl = await await_until(plan_counted, within=20, what="mesh_plans{state=done} 1")
    assert value(ctl, "mesh_plans", state="rolling") == 0
    assert value(ctl, "mesh_plan_step_duration_seconds_count", state="done") == 1
    assert value(ctl, "mesh_declarations_published_total") >= 1

    nodes = await ask(nc, "mesh.ctl.nodes")
    applied = nodes["nodes"][0]["digest_applied"]
    host = await scrape(port["node-1"])
    assert host["mesh_host_processes"].type == "gauge"
    assert value(host, "mesh_host_processes", state="running") == 1
    assert value(host, "mesh_host_process_healthy", process="ticker") == 1
    assert host["mesh_host_apply_duration_seconds"].type == "histogram"
    assert value(host, "mesh_host_apply_duration_seconds_count", outcome="ok") >= 1
    assert value(host, "mesh_host_bundle_fetches_total", outcome="ok") == 1
    assert value(host, "mesh_host_bundle_fetched_bytes_total") > 0
    assert value(host, "mesh_host_checks_total", process="ticker", result="pass") >= 1
    # An info metric: in Prometheus' text format, a gauge named `_info` whose value is 1.
    assert host["mesh_host_declaration_info"].type == "gauge"
    epoch = (await ask(nc, "mesh.ctl.status"))["seat"]["epoch"]
    assert value(host, "mesh_host_declaration_info", digest=applied, epoch=str(epoch)) == 1

    # A restart by policy is counted: kill the process, it comes back.
    state = await ask(nc, "mesh.host.node-1.status")
    pid = next(p["pid"] for p in state["processes"] if p["name"] == "ticker")
    os.kill(pid, signal.SIGKILL)

    async def restarted():
        families = await scrape(port["node-1"])
        return value(families, "mesh_host_process_restarts_total", process="ticker") == 1

    await await_until(restarted, within=20, what="the restart counted")


async def test_a_port_in_use_stops_the_piece_with_one_line(nats_url, procs, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = procs.start(
            "node-9",
            [*MESH, "host", "run", "--name", "node-9", "--root", str(tmp_path / "hosts" / "n9"),
             "--metrics", str(port)],
            env={"MESH_NATS_URL": nats_url}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert proc.wait(timeout=60) == 1
    err = proc.stderr.read().decode()
    assert f"mesh: error: --metrics: cannot listen on 127.0.0.1:{port}" in err, err
    assert "Traceback" not in err


PROMETHEUS = shutil.which("prometheus")


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus here (apt-get install prometheus)")
async def test_a_real_prometheus_scrapes_the_holder(nc, watched, procs, tmp_path):
    port = watched
    web = ports.free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n"
        "scrape_configs:\n  - job_name: mesh\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{port['ctl-a']}', '127.0.0.1:{port['node-1']}']\n"
    )
    proc = procs.start("prometheus", [
        PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{web}",
    ])  # fmt: skip
    epoch = (await ask(nc, "mesh.ctl.status"))["seat"]["epoch"]

    async def queried():
        assert proc.poll() is None, proc.log_path.read_text()[-3000:]
        try:
            async with httpx.AsyncClient(timeout=5) as client:
                r = await client.get(f"http://127.0.0.1:{web}/api/v1/query",
                                     params={"query": "mesh_seat_epoch"})  # fmt: skip
        except httpx.HTTPError:
            return None
        result = r.json()["data"]["result"] if r.status_code == 200 else []
        return result or None

    result = await await_until(queried, within=60, what="prometheus to answer mesh_seat_epoch")
    assert [float(r["value"][1]) for r in result] == [epoch]
    assert result[0]["metric"]["instance"] == f"127.0.0.1:{port['ctl-a']}"
    proc.send_signal(signal.SIGTERM)


# --- mesh dev up -------------------------------------------------------------------------------


@pytest.mark.slow
async def test_dev_up_prints_each_pieces_metrics_url_and_the_holder_shows_its_epoch(tmp_path):
    folder = tmp_path / "dev"
    dev = DevUp(folder, hosts=1)
    try:
        url = dev.ready()
        started = [line for line in dev.seen if " started (pid " in line]
        assert len(started) == 3, dev.seen  # ctl-1, ctl-2, node-1
        for line in started:
            assert ", metrics http://127.0.0.1:" in line and line.endswith("/metrics)"), line
        listed = dict(line.split() for line in (folder / "metrics").read_text().splitlines())
        assert set(listed) == {"ctl-1", "ctl-2", "node-1"}
        creds = str(folder / "creds" / "admin.creds")
        status = ok_json(mesh_cli("--json", "--ca", str(folder / "tls" / "ca.pem"),
                                  "status", nats_url=url, creds=creds))  # fmt: skip
        holder = status["seat"]["holder"]
        async with httpx.AsyncClient(timeout=5) as client:
            text = (await client.get(listed[holder])).text
        assert value(_families(text), "mesh_seat_epoch") == status["seat"]["epoch"]
        dev.stop()
    finally:
        dev.kill()
    wait_until(lambda: dev.proc.poll() is not None, within=10, what="dev up to exit")
