"""Strict decoding: every refusal names what was wrong."""

import pytest

from mesh import wire
from mesh.model import Beat, Register, StatusRequest

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
