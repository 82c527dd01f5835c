"""What the connected primary says about its replication, and a warning when it is unsafe.

The seat's epoch lives in the store: with a standby that is not synchronous, a failover can
lose the last epoch increment, so synchronous replication is the requirement for a store with a
standby (docs/operations.md). The controller calls `check` at start and logs its `warning`.
"""

import asyncpg
import msgspec


class Standby(msgspec.Struct, frozen=True):
    application_name: str
    state: str | None  # None: not visible to this role (it needs pg_read_all_stats)
    sync_state: str | None  # 'sync', 'quorum', 'potential', 'async'


class Replication(msgspec.Struct, frozen=True):
    in_recovery: bool  # connected to a standby, not a primary
    standbys: list[Standby]  # pg_stat_replication
    synchronous_standby_names: str
    synchronous_commit: str
    warning: str | None  # what makes a failover unsafe, in words; None if nothing


async def check(conn: asyncpg.Connection | asyncpg.Pool) -> Replication:
    """Ask the server `conn` is connected to (a session or a pool of them)."""
    rows = await conn.fetch(
        "SELECT application_name, state, sync_state FROM pg_stat_replication "
        "ORDER BY application_name"
    )
    names = await conn.fetchval("SELECT current_setting('synchronous_standby_names')")
    commit = await conn.fetchval("SELECT current_setting('synchronous_commit')")
    in_recovery = await conn.fetchval("SELECT pg_is_in_recovery()")
    standbys = [Standby(r["application_name"], r["state"], r["sync_state"]) for r in rows]
    return Replication(
        in_recovery=in_recovery,
        standbys=standbys,
        synchronous_standby_names=names,
        synchronous_commit=commit,
        warning=_warning(standbys, names, commit, in_recovery),
    )


def _warning(standbys: list[Standby], names: str, commit: str, in_recovery: bool) -> str | None:
    if in_recovery:
        return (
            "the store is a read-only standby: point MESH_DATABASE_URL at the primary "
            "(or list every server with target_session_attrs=read-write)"
        )
    if not standbys:
        return None
    listed = ", ".join(s.application_name or "(unnamed)" for s in standbys)
    unsafe = (
        "a failover to it can lose the seat's last epoch (and acknowledged writes); "
        "see docs/operations.md, A store standby"
    )
    if not names.strip():
        return (
            f"the store has standby {listed} without synchronous replication "
            f"(synchronous_standby_names is empty): {unsafe}"
        )
    if commit in ("off", "local"):
        return (
            f"the store has standby {listed} but synchronous_commit = {commit}, so commits "
            f"do not wait for it: {unsafe}"
        )
    known = [s for s in standbys if s.sync_state is not None]
    if known and not any(s.sync_state in ("sync", "quorum") for s in known):
        states = ", ".join(f"{s.application_name} {s.sync_state}" for s in known)
        return (
            f"the store's standbys are not synchronous ({states}; synchronous_standby_names "
            f"= {names!r} names none of them): {unsafe}"
        )
    return None
