"""The machines' declarations: composed from the store, published to the KV bucket
`mesh-declarations` (key = the machine, with the holder's epoch), and kept published.

The store is the truth and the KV its copy: a put that fails is put again by `keep_published`,
and a new holder puts every stored declaration again under its epoch (`republish`).
"""

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from datetime import datetime

import anyio
import anyio.lowlevel
import asyncpg
import msgspec
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js.api import PubAck
from nats.js.errors import NotFoundError

from mesh import blobs, wire
from mesh.errors import MeshError, reason
from mesh.model import DeclarationReply
from mesh.modules import gate
from mesh.modules.compose import Conflict, ModuleVersion, Prepared, encode, merge, prepare
from mesh.modules.manifest import Manifest
from mesh.store import declarations, modules, plans, seats, secrets
from mesh.store.modules import StoredVersion
from services.controller import metrics

log = logging.getLogger(__name__)

MAX_DECLARATION = 768 * 1024  # bytes of one declaration: with its envelope, under 1 MiB
YIELD_EVERY = 500  # machines composed or sent between two turns of the event loop
STREAM = f"KV_{blobs.DECLARATIONS}"
PUT_WITHIN = 30.0  # seconds for the server to acknowledge every put of one publish
PUTS_PENDING = 4000  # puts awaiting the server's acknowledgement (nats-py's default)
LOGGED_FROM = 500  # declarations in one publish from which it logs its time
PARSED_KEPT = 256  # manifests kept parsed (by version id): enough for every module's current one


class Manifests:
    """Module versions' manifests, parsed once: composing, assigning and listing modules all
    read them, and parsing every time costs more than the rest of a compose."""

    def __init__(self) -> None:
        # module_versions.id -> its manifest, the least recently used dropped past PARSED_KEPT
        self._parsed: OrderedDict[int, Manifest] = OrderedDict()

    def of(self, v: StoredVersion) -> Manifest:
        manifest = self._parsed.get(v.id)
        if manifest is not None:
            self._parsed.move_to_end(v.id)
            return manifest
        manifest = self._parsed[v.id] = gate.parse(v.manifest)
        if len(self._parsed) > PARSED_KEPT:
            self._parsed.popitem(last=False)
        return manifest


class Publisher:
    def __init__(
        self, *, pool: asyncpg.Pool, nc: Client, epoch: int, manifests: Manifests,
        holder: str = "",
    ) -> None:  # fmt: skip
        self._pool = pool
        # Its own context: publish_async's acknowledgements come to one inbox of its own, and
        # its count of puts awaiting one is this publisher's alone.
        self._js = nc.jetstream(publish_async_max_pending=PUTS_PENDING)
        self._nc = nc
        self._created: datetime | None = None  # the bucket's, when last looked at
        self._epoch = epoch
        self._holder = holder  # named in every envelope: hosts refuse one epoch from two
        self._manifests = manifests
        self.wanted: dict[str, str] = {}  # machine -> digest of its published declaration
        # machine -> digest of a put awaiting its acknowledgement: `keep_published` leaves it
        # alone (a tier's puts, acknowledged over a second or more, were all put twice)
        self._putting: dict[str, str] = {}

    async def compose(
        self, conn: asyncpg.Connection, machines: Iterable[str]
    ) -> dict[str, tuple[str, bytes]]:
        """machine -> (digest, canonical declaration), composed from the store as this
        transaction sees it. A conflict names both modules and rolls the transaction back."""
        current = await modules.current_modules(conn)
        assigned = await modules.assignments(conn)
        versions = await secrets.secret_versions(conn)
        prepared: dict[str, Prepared] = {}  # each module version once, for all machines
        composed: dict[str, tuple[str, bytes]] = {}
        for n, machine in enumerate(sorted(set(machines))):
            if n % YIELD_EVERY == YIELD_EVERY - 1:
                # Ten thousand machines take most of a second: let the seat's pings and the
                # beats in between (the transaction waits, nothing else sees it).
                await anyio.lowlevel.checkpoint()
            mine = []
            for name in sorted(assigned.get(machine, ())):
                if name not in prepared:
                    v = current[name]
                    mv = ModuleVersion(
                        name=name, version=v.version, manifest=self._manifests.of(v),
                        bundles=v.bundles,
                    )  # fmt: skip
                    prepared[name] = prepare(mv, versions)
                mine.append(prepared[name])
            try:
                body, digest = encode(merge(machine, mine))
            except Conflict as e:
                raise wire.BadRequest(str(e), code="conflict") from None
            if len(body) > MAX_DECLARATION:  # the KV (and the bus) could not carry it
                raise wire.BadRequest(
                    f"machine {machine}'s declaration would be {len(body)} bytes, more than "
                    f"{MAX_DECLARATION}: assign fewer or smaller modules to it",
                    code="too_large",
                )
            composed[machine] = (digest, body)
        return composed

    async def publish(self, bodies: dict[str, tuple[str, bytes]]) -> None:
        """After the commit. A put that fails is logged, not raised: the change is stored, and
        `keep_published` puts it again (the store is the truth, the KV its copy). Every put is
        sent before any acknowledgement is awaited (JetStream's asynchronous publish, bounded
        by PUTS_PENDING): as 64 requests in flight, a tier of 9,000 machines published at
        3,000 puts a second, half this rate (bench/rollout.py)."""
        self._putting.update((machine, d) for machine, (d, _) in bodies.items())
        try:
            await self._publish(bodies)
        finally:
            for machine, (d, _) in bodies.items():
                if self._putting.get(machine) == d:
                    del self._putting[machine]

    async def _publish(self, bodies: dict[str, tuple[str, bytes]]) -> None:
        sent: list[tuple[str, str, asyncio.Future[PubAck]]] = []
        failed: dict[str, str] = {}  # machine -> why
        began = time.monotonic()
        deadline = began + PUT_WITHIN
        for n, (machine, (d, body)) in enumerate(sorted(bodies.items())):
            if n % YIELD_EVERY == YIELD_EVERY - 1:
                await anyio.lowlevel.checkpoint()  # a send rarely waits: let the loop turn
            envelope = DeclarationReply(
                machine=machine, digest=d, epoch=self._epoch, declaration=msgspec.Raw(body),
                holder=self._holder,
            )  # fmt: skip
            # A stall's deadline only where a put can stall: nats-py waits for a free slot
            # through asyncio.wait_for, which with a timeout makes a task of every put, and
            # that tripled the time of a tier's puts (docs/performance.md, the plan's pace).
            stall = None
            if self._js.publish_async_pending() >= PUTS_PENDING:
                stall = max(0.0, deadline - time.monotonic())
            try:
                ack = await self._js.publish_async(
                    blobs.declaration_subject(machine), wire.encode(envelope), wait_stall=stall
                )
            except Exception as e:
                failed[machine] = f"{type(e).__name__}: {e}"
                continue
            sent.append((machine, d, ack))
        handed = time.monotonic()
        with anyio.move_on_after(max(0.0, deadline - handed)):
            if sent:  # each outcome is read below, whatever it is
                await asyncio.wait([ack for _, _, ack in sent])
        if len(bodies) >= LOGGED_FROM:  # a tier's worth: how long the bus took to store it
            acked = time.monotonic() - handed
            log.info("put %d declaration(s): handed to the bus in %.2f s, acknowledged "
                     "%.2f s later", len(bodies), handed - began, acked)  # fmt: skip
        for machine, d, ack in sent:
            if not ack.done():  # not acknowledged in time: given up (its slot freed)
                ack.cancel()
                failed[machine] = f"not acknowledged within {PUT_WITHIN:g}s"
            elif ack.cancelled():  # the connection closing
                failed[machine] = "its put was cancelled"
            elif (e := ack.exception()) is not None:
                failed[machine] = f"{type(e).__name__}: {e}"
            else:
                self.wanted[machine] = d
                metrics.DECLARATIONS_PUBLISHED.inc()
        if failed:
            first = min(failed)
            log.warning("could not publish the declaration of %d machine(s) (will retry): "
                        "%s: %s", len(failed), first, failed[first])  # fmt: skip

    async def keep_published(self, every: float = 5.0) -> None:
        while True:
            await anyio.sleep(every)
            await self.put_behind()

    async def put_behind(self) -> None:
        """Put again every stored declaration whose digest the KV does not have yet, and no
        put of it awaits an acknowledgement; every one, if the bucket was made again."""
        lost = await self._made_again()
        async with self._pool.acquire() as conn:
            stored = await declarations.digests(conn)
            done, putting = self.wanted, self._putting
            behind = [
                m for m, d in stored.items()
                if lost or d not in (done.get(m), putting.get(m))
            ]  # fmt: skip
            bodies = await declarations.declarations(conn, behind) if behind else {}
        if bodies:
            await self.publish({m: (d, body) for m, (d, body, _) in bodies.items()})

    async def _made_again(self) -> bool:
        """Whether the bucket is another than when last looked at: someone removed it (`nats
        stream rm`), or the server lost its store. Gone, it is made again here, and every
        declaration put again: hosts watch the new one (services/host/watch.py). The bus not
        answering says nothing (asked again at the next look)."""
        jsm = self._nc.jsm()
        gone = False
        try:
            try:
                info = await jsm.stream_info(STREAM)
            except NotFoundError:
                log.warning("the declarations' bucket is gone (removed, or its server lost its "
                            "store): making it again, with every declaration")  # fmt: skip
                gone = True
                await blobs.ensure(self._nc)
                info = await jsm.stream_info(STREAM)
        except (NatsError, OSError, MeshError) as e:
            log.debug("could not look at the declarations' bucket: %s", reason(e))
            return False
        before, self._created = self._created, info.created
        if gone:
            return True
        if before in (None, info.created):
            return False
        log.warning("the declarations' bucket was made again: putting every declaration again")
        return True

    async def republish(self) -> int:
        """At takeover: every stored declaration, under this holder's epoch. Plans an earlier
        holder left `building` are failed: that holder's push can no longer register them."""
        async with self._pool.acquire() as conn:
            async with conn.transaction():
                await seats.fence(conn, epoch=self._epoch)
                stale = await plans.fail_building(
                    conn,
                    "the controller building it stopped before its builds finished; push again",
                    before_epoch=self._epoch,
                )
            if stale:
                log.info("plan(s) %s left building by an earlier holder: failed",
                         ", ".join(map(str, stale)))  # fmt: skip
            stored = await declarations.declarations(conn)
        await self.publish({m: (d, body) for m, (d, body, _) in stored.items()})
        return len(stored)
