"""Errors in words: what a log line or the command line says about a failure."""

import logging
from asyncio import CancelledError

import pytest

from mesh import bus
from mesh.errors import MeshError, leaf, reason
from mesh.store import db


def test_reason_says_what_an_exception_without_a_message_is() -> None:
    assert reason(TimeoutError()) == "no answer in time"  # it said "" in the step-down logs
    assert reason(ConnectionResetError()) == "ConnectionResetError"
    assert reason(OSError(113, "No route to host")) == "[Errno 113] No route to host"


def test_leaf_finds_the_failure_inside_task_groups() -> None:
    lost = MeshError("the seat's store session failed: no answer in time")
    nested = ExceptionGroup("outer", [ExceptionGroup("inner", [lost])])
    assert leaf(nested) is lost
    with_cancels = BaseExceptionGroup("g", [CancelledError(), lost])
    assert leaf(with_cancels) is lost
    both = ExceptionGroup("g", [lost, MeshError("lost NATS for more than 3s")])
    assert str(leaf(both)) == f"{lost}; lost NATS for more than 3s"
    bug = KeyError("x")
    assert leaf(ExceptionGroup("g", [lost, bug])) is bug  # a bug is never hidden behind words


def test_the_store_pools_reconnect_failures_are_one_line(caplog: pytest.LogCaptureFixture) -> None:
    assert db.__name__  # importing the store installs the filter on asyncpg's pool logger
    try:
        raise db.StoreUnreachable("cannot reach PostgreSQL at 10.0.0.1:5432/mesh: no answer")
    except db.StoreUnreachable:
        with caplog.at_level(logging.WARNING, logger="asyncpg.pool"):
            logging.getLogger("asyncpg.pool").warning(
                "Failed to restore the pool connection floor; retrying", exc_info=True
            )
    (record,) = caplog.records
    text = logging.Formatter("%(name)s: %(message)s").format(record)
    assert text == (
        "asyncpg.pool: Failed to restore the pool connection floor; retrying: "
        "cannot reach PostgreSQL at 10.0.0.1:5432/mesh: no answer"
    )
    assert "Traceback" not in caplog.text


def test_a_drain_cut_at_its_deadline_leaves_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert bus.__name__  # importing the bus installs the filter on asyncio's logger
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        unread = CancelledError()  # what nats-py's drain gather holds once we cancel the drain
        logging.getLogger("asyncio").error(
            "_GatheringFuture exception was never retrieved\nfuture: <_GatheringFuture>",
            exc_info=(CancelledError, unread, None),
        )
        real = RuntimeError("boom")  # a real failure nobody read is still said
        logging.getLogger("asyncio").error(
            "Future exception was never retrieved", exc_info=(RuntimeError, real, None)
        )
    assert [r.exc_info[1] for r in caplog.records if r.exc_info] == [real]
