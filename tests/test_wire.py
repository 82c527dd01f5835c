"""Strict decoding: every refusal names what was wrong; and the words a newer mesh may add
(mesh/model.py), kept rather than refused."""

from typing import cast

import asyncpg
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from mesh import subjects, wire
from mesh.model import (
    Applied,
    Beat,
    ProcessesEvent,
    Register,
    StatusRequest,
    ToolsEvent,
    apply_step,
)
from services.controller.fleet.fleet import Fleet
from services.controller.fleet.noisy import Budgets
from services.controller.fleet.publishing import Publisher
from services.controller.fleet.reports import HostReports

FACTS = {"os": "linux", "arch": "x86_64", "cpus": 1, "memory": 1, "mesh_version": "0"}


def test_empty_body_is_an_empty_request() -> None:
    assert wire.decode(b"", StatusRequest) == StatusRequest()


def test_wrong_type_names_the_field() -> None:
    body = {"name": "n", "tier": "x", "labels": {}, "facts": FACTS, "beat_interval": 1, "pid": 1}
    with pytest.raises(wire.BadRequest) as refused:
        wire.decode(wire.encode(body), Register)
    assert "$.tier" in str(refused.value)


def test_unknown_field_is_refused_by_name() -> None:
    with pytest.raises(wire.BadRequest) as refused:
        wire.decode(b'{"verbose": true}', StatusRequest)
    assert "verbose" in str(refused.value)


def test_malformed_json_is_refused() -> None:
    with pytest.raises(wire.BadRequest) as refused:
        wire.decode(b"{not json", StatusRequest)
    assert "not valid JSON" in str(refused.value)


def test_oversized_body_is_refused_before_decoding() -> None:
    with pytest.raises(wire.BadRequest) as refused:
        wire.decode(b" " * (wire.MAX_BODY + 1), StatusRequest)
    assert refused.value.code == "too_large"


def test_error_reply_round_trips_as_remote_error() -> None:
    with pytest.raises(wire.RemoteError) as raised:
        wire.decode_reply(wire.error("forbidden", "no"), StatusRequest)
    assert raised.value.code == "forbidden"
    assert str(raised.value) == "no"


def test_a_name_with_a_trailing_newline_is_refused() -> None:
    # A newline in a subject token would end a NATS protocol line.
    with pytest.raises(wire.BadRequest) as refused:
        wire.decode(b'{"name": "node-x\\n", "seq": 1, "interval": 1}', Beat)
    assert "$.name" in str(refused.value)


def test_an_apply_step_with_a_name_keeps_its_form_on_the_wire() -> None:
    applied = Applied(name="node-1", digest="d", epoch=1, ok=False,
                      step=apply_step("bundle", "mesh:sha256:ab"), error="gone")  # fmt: skip
    assert b'"step":"bundle mesh:sha256:ab"' in wire.encode(applied)
    assert applied.step_kind == "bundle"
    assert Applied(name="node-1", digest="d", epoch=1, ok=False, step="fence").step_kind == "fence"


def test_a_newer_hosts_words_keep_its_reports() -> None:
    # During an upgrade an older controller hears newer hosts (mesh/model.py, Peer): a process
    # or tool server state it does not know is kept as it came, not a reason to drop the report.
    processes = [{"name": "web", "state": "restarting", "healthy": False, "pid": None}]
    event = wire.decode(wire.encode({"name": "node-1", "processes": processes}), ProcessesEvent)
    assert event.processes[0].state == "restarting"
    servers = [{"name": "files", "state": "draining"}]
    tools = wire.decode(wire.encode({"name": "node-1", "servers": servers}), ToolsEvent)
    assert tools.servers[0].state == "draining"


async def test_an_apply_step_of_a_newer_host_is_a_failure_of_its_machine() -> None:
    # Only `fence` says nothing of the machine; a kind of step this controller does not know
    # is a failed apply like any other (the plan's step fails, `mesh nodes` shows why).
    fleet = Fleet(pool=cast(asyncpg.Pool, None), epoch=1)
    reports = HostReports(fleet=fleet, publisher=cast(Publisher, None), budgets=Budgets())
    applied = Applied(name="node-1", digest="sha256:new", epoch=1, ok=False,
                      step="snapshot db", error="disk full")  # fmt: skip
    subject = subjects.event("node-1", "applied")
    await reports.on_event(Msg(cast(Client, None), subject=subject, data=wire.encode(applied)))
    assert fleet.apply_errors["node-1"] == "snapshot db: disk full"
    assert fleet.failed_digest["node-1"] == "sha256:new"
