"""Each machine's canonical declaration in the store: its digest, body and the epoch that
wrote it (the KV bucket `mesh-declarations` holds a copy)."""

import asyncpg


async def declarations(
    conn: asyncpg.Connection, machines: list[str] | None = None
) -> dict[str, tuple[str, bytes, int]]:
    """machine -> (digest, canonical body, epoch)."""
    rows = await conn.fetch(
        "SELECT machine, digest, body, epoch FROM declarations"
        " WHERE $1::text[] IS NULL OR machine = ANY($1::text[])",
        machines,
    )
    return {r["machine"]: (r["digest"], bytes(r["body"]), r["epoch"]) for r in rows}


async def digests(conn: asyncpg.Connection) -> dict[str, str]:
    return {
        r["machine"]: r["digest"]
        for r in await conn.fetch("SELECT machine, digest FROM declarations")
    }


async def write_declarations(
    conn: asyncpg.Connection, bodies: dict[str, tuple[str, bytes]], *, epoch: int
) -> None:
    """machine -> (digest, body), in one statement."""
    await conn.executemany(
        """
        INSERT INTO declarations (machine, digest, body, epoch) VALUES ($1, $2, $3, $4)
        ON CONFLICT (machine) DO UPDATE SET digest = $2, body = $3, epoch = $4, updated_at = now()
        """,
        [(m, d, b, epoch) for m, (d, b) in sorted(bodies.items())],
    )
