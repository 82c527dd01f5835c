"""NATS service discovery: the controllers (holder and standby) and every host answer `$SRV`
as nats.micro services do (`mesh-controller`, `mesh-host`), the holder and the hosts listing
their verbs as endpoints with the counts mesh/serving.py keeps; who may ask is the policy's
(mesh/auth/policy.py), checked against a real nats-server with real credentials."""

import json
import time

import pytest
from helpers import ask, await_until
from nats.aio.client import Client
from nats.micro.service import ServiceInfo, ServicePing, ServiceStats

from mesh import discovery, subjects, wire
from mesh.serving import Endpoint, Stats, Verb
from services.controller.serving.verbs import HOST_VERBS, VERBS
from services.host.verbs import VERBS as HOST_OWN_VERBS


async def gather(nc: Client, subject: str, *, expect: int, within: float = 5) -> list[dict]:
    """Every reply to one request, as `nats micro ls` gathers them: until `expect` came, or
    `within` seconds."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    replies: list[dict] = []
    try:
        await nc.publish(subject, b"", reply=inbox)
        deadline = time.monotonic() + within
        while len(replies) < expect and (left := deadline - time.monotonic()) > 0:
            try:
                replies.append(json.loads((await sub.next_msg(timeout=left)).data))
            except TimeoutError:
                break
    finally:
        await sub.unsubscribe()
    return replies


async def _all_answer(nc: Client, subject: str, count: int) -> list[dict]:
    async def answered():
        replies = await gather(nc, subject, expect=count, within=2)
        return replies if len(replies) == count else None

    return await await_until(answered, within=30, what=f"{count} answers on {subject}")


# --- without servers ---------------------------------------------------------------------------


async def _noop(_: object, __: object) -> dict:
    return {}


def test_the_answers_are_what_nats_micro_reads() -> None:
    endpoints = [Endpoint("verbs", "mesh.ctl.*", {"status": Verb(dict, dict, _noop)},
                          queue="mesh-controller")]  # fmt: skip
    stats = Stats()
    stats.record("verbs", "status", "ok", time.perf_counter_ns() - 2_000_000)
    stats.record("verbs", "status", "not_found", time.perf_counter_ns() - 1_000_000)
    d = discovery.Discovery(
        None, name="mesh-controller", id="ctl-a", description="d", stats=stats,  # type: ignore[arg-type]
        endpoints=lambda: endpoints, metadata=lambda: {"seat": "holding"},
    )  # fmt: skip
    ping = ServicePing.from_dict(json.loads(wire.encode(d.ping())))
    assert (ping.name, ping.id, ping.metadata) == ("mesh-controller", "ctl-a", {"seat": "holding"})
    assert json.loads(wire.encode(d.ping()))["type"] == "io.nats.micro.v1.ping_response"
    info = ServiceInfo.from_dict(json.loads(wire.encode(d.info())))
    assert info.type == "io.nats.micro.v1.info_response"
    assert [(e.name, e.subject, e.queue_group) for e in info.endpoints] == [
        ("status", "mesh.ctl.status", "mesh-controller")
    ]
    s = ServiceStats.from_dict(json.loads(wire.encode(d.stats())))
    [status] = s.endpoints
    assert (status.num_requests, status.num_errors, status.last_error) == (2, 1, "not_found")
    assert status.processing_time >= 3_000_000
    assert status.average_processing_time == status.processing_time // 2
    assert subjects.srv("INFO", "mesh-host", "node-2") == "$SRV.INFO.mesh-host.node-2"


# --- a controller, a standby and two hosts ------------------------------------------------------


@pytest.fixture
async def mesh_of_two(nc, start_controller, start_host):
    start_controller("ctl-a")

    async def holder():
        s = await ask(nc, "mesh.ctl.status")
        return s if s and s["seat"] and s["seat"]["holder"] == "ctl-a" else None

    await await_until(holder, within=30, what="ctl-a to hold the seat")
    start_controller("ctl-b")
    start_host("node-1", "--tier", "0")
    start_host("node-2", "--tier", "1")

    async def ready():
        s = await ask(nc, "mesh.ctl.status")
        return s if s and s["standbys"] and s["nodes"]["up"] == 2 else None

    return await await_until(ready, within=30, what="a standby and two hosts up")


async def test_ping_info_and_stats_show_the_controllers_and_the_hosts(nc, mesh_of_two):
    pings = await _all_answer(nc, "$SRV.PING", 4)
    assert sorted((p["name"], p["id"]) for p in pings) == [
        ("mesh-controller", "ctl-a"), ("mesh-controller", "ctl-b"),
        ("mesh-host", "node-1"), ("mesh-host", "node-2"),
    ]  # fmt: skip
    assert {p["type"] for p in pings} == {"io.nats.micro.v1.ping_response"}
    assert len(await _all_answer(nc, "$SRV.PING.mesh-host", 2)) == 2

    # The holder lists its verbs; the standby says it stands by and lists none.
    infos = {i["id"]: i for i in await _all_answer(nc, "$SRV.INFO.mesh-controller", 2)}
    holder, standby = infos["ctl-a"], infos["ctl-b"]
    assert holder["metadata"]["seat"] == "holding"
    assert holder["metadata"]["epoch"] == str(mesh_of_two["seat"]["epoch"])
    listed = {(e["name"], e["subject"], e["queue_group"]) for e in holder["endpoints"]}
    assert {(v, f"mesh.ctl.{v}", "mesh-controller") for v in VERBS} <= listed
    assert {(v, f"mesh.ctl.host.*.{v}", "mesh-controller") for v in HOST_VERBS} <= listed
    assert standby["metadata"]["seat"] == "standby" and standby["endpoints"] == []
    [node] = await _all_answer(nc, "$SRV.INFO.mesh-host.node-2", 1)
    assert {e["subject"] for e in node["endpoints"]} == {
        f"mesh.host.node-2.{v}" for v in HOST_OWN_VERBS
    }
    assert node["metadata"]["machine"] == "node-2"

    # STATS counts the verbs called, errors included, with their time.
    async def status_stats() -> dict:
        [stats] = await _all_answer(nc, "$SRV.STATS.mesh-controller.ctl-a", 1)
        return {e["name"]: e for e in stats["endpoints"]}

    before = await status_stats()
    for _ in range(5):
        assert (await ask(nc, "mesh.ctl.status"))["seat"]["holder"] == "ctl-a"
    reply = await ask(nc, "mesh.ctl.declaration", {"machine": "no-such-machine"})
    assert "error" in reply
    after = await status_stats()
    assert after["status"]["num_requests"] == before["status"]["num_requests"] + 5
    assert after["status"]["processing_time"] > before["status"]["processing_time"]
    assert after["declaration"]["num_errors"] == before["declaration"]["num_errors"] + 1
    assert after["declaration"]["last_error"] == reply["error"]["code"]
    assert (await ask(nc, "mesh.host.node-1.status"))["name"] == "node-1"
    [host] = await _all_answer(nc, "$SRV.STATS.mesh-host.node-1", 1)
    assert {e["name"]: e["num_requests"] for e in host["endpoints"]}["status"] >= 1

    # After a handover the new holder lists the verbs and the old one stands by.
    reply = await ask(nc, "mesh.ctl.handover")
    assert reply["holder"] == "ctl-a", reply

    async def moved():
        infos = {i["id"]: i for i in await gather(nc, "$SRV.INFO.mesh-controller", expect=2)}
        seats = {k: v["metadata"]["seat"] for k, v in infos.items()}
        return infos if seats == {"ctl-a": "standby", "ctl-b": "holding"} else None

    infos = await await_until(moved, within=30, what="ctl-b to hold and ctl-a to stand by")
    assert infos["ctl-a"]["endpoints"] == [] and len(infos["ctl-b"]["endpoints"]) == len(listed)


# --- who may ask, with real credentials ----------------------------------------------------------


async def test_operators_may_ask_and_hosts_only_answer_for_themselves(
    secured_fleet, secured, as_identity
):
    # The services answer under their own credentials; a viewer asks and hears them all.
    viewer = await secured.connect(secured.viewer)
    try:
        pings = await _all_answer(viewer, "$SRV.PING", 3)
        assert sorted((p["name"], p["id"]) for p in pings) == [
            ("mesh-controller", "ctl-a"), ("mesh-host", "node-1"), ("mesh-host", "node-2"),
        ]  # fmt: skip
        [info] = await _all_answer(viewer, "$SRV.INFO.mesh-host.node-1", 1)
        assert {e["name"] for e in info["endpoints"]} == set(HOST_OWN_VERBS)
    finally:
        await viewer.close()
    for creds in (secured.viewer, secured.admin):
        who = await as_identity(creds)
        for subject in ("$SRV.PING", "$SRV.INFO.mesh-controller", "$SRV.STATS.mesh-host.node-2"):
            assert not await who.publish_refused(subject), (creds, subject)

    # A host answers for itself only, and asks nothing.
    host = await as_identity(secured.creds("host", "node-1"))
    for subject in ("$SRV.PING", "$SRV.INFO.mesh-host", "$SRV.STATS.mesh-host.node-1"):
        assert not await host.subscribe_refused(subject), subject
    for subject in ("$SRV.INFO.mesh-host.node-2", "$SRV.INFO.mesh-controller", "$SRV.>",
                    "$SRV.*", "$SRV.INFO.*", "$SRV.*.mesh-host.*"):  # fmt: skip
        assert await host.subscribe_refused(subject), subject
    for subject in ("$SRV.PING", "$SRV.INFO.mesh-host.node-2", "$SRV.STATS.mesh-controller"):
        assert await host.publish_refused(subject), subject
