"""Builds in the store: one row per build key (builder, state, the bundle it made, the log's
last lines and its object name)."""

import asyncpg
import msgspec

from mesh.store import db

MAX_LOG_TAIL = 4096  # bytes of a build's last lines kept in its row (a builder sends no more)


def clip_tail(text: str, limit: int = MAX_LOG_TAIL) -> str:
    """The end of `text`, at most `limit` bytes: a builder's reply is not trusted to be short."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return "…" + data[-(limit - 3) :].decode(errors="ignore")  # "…" is 3 bytes


class BuildRow(msgspec.Struct):
    key: str
    module: str
    bundle: str
    state: str
    digest: str | None
    builder: str | None
    log_tail: str
    log_object: str | None


_BUILD = "key, module, bundle, state, digest, builder, log_tail, log_object"


async def build(conn: asyncpg.Connection | asyncpg.Pool, key: str) -> BuildRow | None:
    return await db.one(conn, BuildRow, f"SELECT {_BUILD} FROM builds WHERE key = $1", key)


async def last_build(
    conn: asyncpg.Connection | asyncpg.Pool, *, module: str, bundle: str | None
) -> BuildRow | None:
    return await db.one(
        conn, BuildRow,
        f"SELECT {_BUILD} FROM builds WHERE module = $1 AND ($2::text IS NULL OR bundle = $2)"
        " ORDER BY started DESC LIMIT 1",
        module, bundle,
    )  # fmt: skip


async def start_build(
    conn: asyncpg.Connection | asyncpg.Pool,
    *,
    key: str,
    module: str,
    bundle: str,
    source: str,
    builder: str,
) -> None:
    await conn.execute(
        """
        INSERT INTO builds (key, module, bundle, source, builder, state)
        VALUES ($1, $2, $3, $4, $5, 'running')
        ON CONFLICT (key) DO UPDATE SET builder = $5, state = 'running', started = now(),
            finished = NULL, digest = NULL
        """,
        key,
        module,
        bundle,
        source,
        builder,
    )


async def finish_build(
    conn: asyncpg.Connection | asyncpg.Pool,
    *,
    key: str,
    ok: bool,
    digest: str | None,
    tail: str,
    log_object: str | None,
) -> None:
    await conn.execute(
        "UPDATE builds SET state = $2, digest = $3, log_tail = $4, log_object = $5,"
        " finished = now() WHERE key = $1",
        key,
        "done" if ok else "failed",
        digest,
        clip_tail(tail),
        log_object,
    )
