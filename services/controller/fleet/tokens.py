"""Join tokens on the controller: made, listed and revoked by admins (`mesh token create`,
`list`, `revoke`: the verbs `token-create`, `token-list`, `token-revoke`), and redeemed by a
machine that joins (`redeem`, for `mesh join`'s verb to call in its own transaction).

The command line makes a token's secret and sends only its SHA-256 (mesh.tokens.secret_hash),
so the secret never crosses the bus nor reaches a controller, its log or the store; a redeem
hashes what the machine presents and compares the digests in constant time. Creating, revoking
and using a token are audited in their own transactions; a token's secret or hash never is.
"""

import hmac
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import asyncpg
import msgspec

from mesh import paging, wire
from mesh.model import (
    Grant,
    TokenCreated,
    TokenCreateRequest,
    TokenInfo,
    TokenListReply,
    TokenListRequest,
    TokenRevokeReply,
    TokenRevokeRequest,
    labels_said,
)
from mesh.names import InvalidName, check_name
from mesh.store import audit, seats
from mesh.store import tokens as store
from mesh.tokens import secret_hash
from services.controller.fleet.admission import Admission
from services.controller.trust.audit import Audit

CONTROL = {"role": "control"}  # what a control machine is labelled (services/controller's [assign])
MAX_LABELS = 64  # as a machine carries at most (mesh.model.Labels)
USE = "token-use"  # the audit's verb for a token used by a joining machine
_ID = re.compile(r"[0-9a-f]{12}")
_NAMED = 5  # machines a used-up token's refusal names


def is_id(text: str) -> bool:
    """Whether `text` is a join token's id (12 lowercase hex digits)."""
    return _ID.fullmatch(text) is not None


def _when(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def info(row: store.TokenRow) -> TokenInfo:
    """The token as operators see it: never its secret's hash."""
    return TokenInfo(
        id=row.id, created=row.created_at, by=row.created_by, expires=row.expires_at,
        uses_left=row.uses_left, revoked=row.revoked_at, tier=row.tier, labels=row.labels,
        control=row.control, site=row.site, used_by=row.used_by,
    )  # fmt: skip


def _labels(req: TokenCreateRequest) -> dict[str, str]:
    """The labels a machine joining with the token gets: role=control for a control machine."""
    labels = dict(req.labels)
    if req.control:
        if labels.get("role", "control") != "control":
            raise wire.BadRequest(
                f"labels: role={labels['role']} with control: a control machine is labelled "
                "role=control"
            )
        labels |= CONTROL
    if len(labels) > MAX_LABELS:
        raise wire.BadRequest(f"labels: {len(labels)} with role=control, at most {MAX_LABELS}")
    return labels


@dataclass
class Tokens:
    """The admins' verbs on join tokens; `admission` signs a token's bearer credentials (None
    where the controllers cannot sign)."""

    pool: asyncpg.Pool
    epoch: int
    budget: Callable[[], int]  # bytes of a page (mesh/paging.py)
    admission: Admission | None

    async def create(self, req: TokenCreateRequest, audit: Audit) -> TokenCreated:
        labels = _labels(req)
        async with self.pool.acquire() as conn, conn.transaction():
            await seats.fence(conn, epoch=self.epoch)
            row = None
            while row is None:  # 48 random bits: taken ids are rare, and the loop ends
                row = await store.insert(
                    conn, token_id=secrets.token_hex(6),
                    secret_sha256=bytes.fromhex(req.secret_sha256), by=audit.who, ttl=req.ttl,
                    uses=req.uses, tier=req.tier, labels=labels, control=req.control,
                    site=req.site,
                )  # fmt: skip
            terms = f"tier {row.tier}, labels {labels_said(row.labels)}, {row.uses_left} use(s)"
            terms += f", site {row.site}" if row.site else ""
            await audit.write(conn, subject=row.id,
                              detail=f"{terms}, expires {_when(row.expires_at)}")  # fmt: skip
        made = info(row)
        bearer = self.admission.bearer(made.id, expires=made.expires) if self.admission else None
        return TokenCreated(**msgspec.structs.asdict(made), bearer=bearer)

    async def listing(self, req: TokenListRequest) -> TokenListReply:
        """The newest first, a page at a time; the cursor is the last token's place in the
        order they were made in."""
        at = paging.after(req.after, verb="token-list", shape=(int,))
        rows = await store.page(self.pool, before=at[0] if at else None, limit=req.limit + 1)
        page = paging.fill(
            (((r.seq,), info(r)) for r in rows),
            verb="token-list", limit=req.limit,
            room=paging.room(self.budget(), TokenListReply(tokens=[])),
            what=lambda i: f"join token {i.id}",
        )  # fmt: skip
        return TokenListReply(tokens=page.items, next=page.next)

    async def revoke(self, req: TokenRevokeRequest, audit: Audit) -> TokenRevokeReply:
        async with self.pool.acquire() as conn, conn.transaction():
            await seats.fence(conn, epoch=self.epoch)
            row = await store.locked(conn, req.id)
            if row is None:
                raise wire.BadRequest(f"no join token {req.id}", code="not_found")
            if row.revoked_at is not None:
                raise wire.BadRequest(
                    f"join token {req.id} was revoked already, at {_when(row.revoked_at)} by "
                    f"{row.revoked_by}",
                    code="conflict",
                )
            await store.revoke(conn, req.id, by=audit.who)
            await audit.write(conn, subject=req.id, detail=f"{row.uses_left} use(s) left, "
                              f"would expire {_when(row.expires_at)}")  # fmt: skip
        return TokenRevokeReply(id=req.id, revoked=True)


def _forbidden(message: str) -> wire.BadRequest:
    return wire.BadRequest(message, code="forbidden")


async def redeem(
    conn: asyncpg.Connection,
    *,
    token_id: str,
    secret: str,
    machine: str,
    by: str,
    epoch: int | None = None,
) -> Grant:
    """One use of a join token by `machine`, in the caller's transaction on `conn` (which fences
    the seat's epoch first, as every write of the holder does): the token's row locked, its
    uses decremented, the machine recorded, the use audited (`by` is who the audit names: the
    joining machine, `join:<machine>`). Refused `forbidden` in one line when the token is
    unknown, wrong (its secret: never which part), revoked, expired or used up; nothing is
    written then, and the caller records the refusal on its own (`refused`), after its
    transaction rolled back. A machine that asks again after a use needs another use."""
    try:
        check_name(machine, field="machine")
    except InvalidName as e:
        raise wire.BadRequest(str(e)) from None
    row = await store.locked(conn, token_id) if _ID.fullmatch(token_id) else None
    if row is None:
        raise _forbidden(f"join token {token_id[:24]}: unknown to this mesh")
    # The secret first: who does not hold it learns nothing of the token's state.
    if not hmac.compare_digest(row.secret_sha256, bytes.fromhex(secret_hash(secret))):
        raise _forbidden(f"join token {token_id}: wrong token")
    if row.revoked_at is not None:
        raise _forbidden(f"join token {token_id} was revoked at {_when(row.revoked_at)} by "
                         f"{row.revoked_by}")  # fmt: skip
    if row.expires_at <= await store.now(conn):
        raise _forbidden(f"join token {token_id} expired at {_when(row.expires_at)}")
    if row.uses_left <= 0:
        named = ", ".join(row.used_by[-_NAMED:])
        more = f" and {len(row.used_by) - _NAMED} more" if len(row.used_by) > _NAMED else ""
        raise _forbidden(f"join token {token_id} is used up: its {len(row.used_by)} use(s) "
                         f"went to {named or 'nobody'}{more}")  # fmt: skip
    used = await store.use(conn, token_id, machine=machine)
    await audit.record(conn, who=by, verb=USE, subject=token_id, outcome="ok",
                       detail=f"machine {machine}, {used.uses_left} use(s) left, tier {used.tier}",
                       epoch=epoch)  # fmt: skip
    return Grant(tier=used.tier, labels=used.labels, control=used.control, site=used.site)


async def refused(
    conn: asyncpg.Connection | asyncpg.Pool,
    *,
    token_id: str,
    by: str,
    error: wire.BadRequest,
    epoch: int | None = None,
) -> None:
    """The audit entry of a refused redeem, written on its own (the refusal's transaction
    rolled back): a token's id only if it is one, so junk never lands in the log."""
    subject = token_id if _ID.fullmatch(token_id) else "(not a join token's id)"
    await audit.record(conn, who=by, verb=USE, subject=subject, outcome=error.code,
                       detail=str(error)[:500], epoch=epoch)  # fmt: skip
