"""Join tokens in the store (migration 012): their terms, the hash of their secrets (never the
secret), who made and revoked them, and the machines that used them. The store's clock decides
when a token expires, so every controller agrees whatever its own clock says."""

import json
from datetime import datetime

import asyncpg
import msgspec

_COLUMNS = (
    "seq, id, secret_sha256, created_at, created_by, expires_at, uses_left, revoked_at,"
    " revoked_by, tier, labels, control, site, used_by"
)


class TokenRow(msgspec.Struct, frozen=True):
    seq: int
    id: str
    secret_sha256: bytes
    created_at: datetime
    created_by: str
    expires_at: datetime
    uses_left: int
    revoked_at: datetime | None
    revoked_by: str | None
    tier: int
    labels: dict[str, str]
    control: bool
    site: str | None
    used_by: list[str]


def _row(r: asyncpg.Record) -> TokenRow:
    return TokenRow(**{**dict(r), "labels": json.loads(r["labels"]), "used_by": list(r["used_by"])})


async def insert(
    conn: asyncpg.Connection,
    *,
    token_id: str,
    secret_sha256: bytes,
    by: str,
    ttl: float,
    uses: int,
    tier: int,
    labels: dict[str, str],
    control: bool,
    site: str | None,
) -> TokenRow | None:
    """A new token, expiring `ttl` seconds from the store's now; None if its id is taken."""
    r = await conn.fetchrow(
        f"""
        INSERT INTO join_tokens (id, secret_sha256, created_by, expires_at, uses_left, tier,
                                 labels, control, site)
        VALUES ($1, $2, $3, now() + make_interval(secs => $4), $5, $6, $7::jsonb, $8, $9)
        ON CONFLICT (id) DO NOTHING
        RETURNING {_COLUMNS}
        """,
        token_id, secret_sha256, by, ttl, uses, tier, json.dumps(labels, sort_keys=True),
        control, site,
    )  # fmt: skip
    return _row(r) if r else None


async def locked(conn: asyncpg.Connection, token_id: str) -> TokenRow | None:
    """The token's row, locked until the end of `conn`'s transaction (a use, a revocation)."""
    r = await conn.fetchrow(f"SELECT {_COLUMNS} FROM join_tokens WHERE id = $1 FOR UPDATE",
                            token_id)  # fmt: skip
    return _row(r) if r else None


async def revoke(conn: asyncpg.Connection, token_id: str, *, by: str) -> TokenRow:
    return await _updated(conn, token_id, "revoked_at = now(), revoked_by = $2", by)


async def use(conn: asyncpg.Connection, token_id: str, *, machine: str) -> TokenRow:
    """One use of the token (locked by `locked`, with a use left), by `machine`."""
    return await _updated(
        conn, token_id, "uses_left = uses_left - 1, used_by = used_by || $2::text", machine
    )


async def _updated(conn: asyncpg.Connection, token_id: str, change: str, value: str) -> TokenRow:
    """The token's row after `change` (one of the constant SET clauses above; $2 is `value`)."""
    r = await conn.fetchrow(
        f"UPDATE join_tokens SET {change} WHERE id = $1 RETURNING {_COLUMNS}", token_id, value
    )
    return _row(r)


async def page(
    conn: asyncpg.Connection | asyncpg.Pool, *, before: int | None, limit: int
) -> list[TokenRow]:
    """The newest tokens first, from before `before` (a row's seq; None: the newest)."""
    rows = await conn.fetch(
        f"SELECT {_COLUMNS} FROM join_tokens WHERE ($1::bigint IS NULL OR seq < $1)"
        " ORDER BY seq DESC LIMIT $2",
        before, limit,
    )  # fmt: skip
    return [_row(r) for r in rows]


async def now(conn: asyncpg.Connection) -> datetime:
    """The store's clock, as it reads now (not the transaction's start)."""
    when: datetime = await conn.fetchval("SELECT clock_timestamp()")
    return when
