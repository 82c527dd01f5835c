"""A push's steps before anything is stored, which the dry run of a push takes too (`views.py`,
`diff`): the pushed manifest gated and its source archive read and checked against it, its bundles
packed (or taken from the build cache), the version registered, and a plan's settings from its
`[rollout]`. The write side (`changes/modules.py`) stores what they give; the read side only looks,
so neither depends on the other (tests/test_house.py).
"""

import anyio
import anyio.to_thread
import asyncpg
import msgspec
from nats.aio.client import Client
from nats.js.object_store import ObjectStore

from mesh import blobs, wire
from mesh.model import PlanSettings
from mesh.modules import archive, gate, load, meshsource
from mesh.modules.manifest import ON_THE_MACHINE, Assign, Bundle, Manifest
from mesh.store import modules, selectors
from services.controller.catalog import builds as build_requests
from services.controller.fleet.fleet import Fleet

UNBUILT = "unbuilt:"  # the stand-in for a bundle not built yet (a dry run, a building plan)


class ToBuild(msgspec.Struct, frozen=True):
    """A bundle a push has to build: its name, build key, table and source folder's digest."""

    name: str
    key: str
    bundle: Bundle
    source: str


async def read_source(
    *, nc: Client, manifest_text: str, source: str, upload: str | None
) -> tuple[Manifest, bytes]:
    """The pushed manifest, gated, and its source archive, checked against it: from the
    uploads' bucket where the client left it (`upload`), else from the bundle store (a client
    from before). Nothing is stored: a push that is refused leaves nothing behind."""
    try:
        manifest = gate.parse(manifest_text)
    except gate.Refused as e:
        raise wire.BadRequest(str(e), code="refused") from None
    try:
        if upload is None:
            data = await blobs.get(nc, source)
        else:
            data = await blobs.staged_bytes(nc, upload, d=source, bucket=blobs.UPLOADS)
    except (blobs.BlobMissing, blobs.BlobCorrupt) as e:
        raise wire.BadRequest(f"source: {e}", code="not_found") from None
    try:
        # Archive work is CPU on up to 64 MiB: off the event loop that answers verbs.
        await anyio.to_thread.run_sync(load.check_sources, manifest, data)
        inside = await anyio.to_thread.run_sync(archive.read, data, "module.toml")
    except (gate.Refused, archive.ArchiveRefused) as e:
        raise wire.BadRequest(str(e), code="refused") from None
    if inside is None or inside.decode(errors="replace") != manifest_text:
        # The version is the archive's digest: what is registered must be what it holds.
        raise wire.BadRequest(
            "manifest: differs from the module.toml in the source archive", code="refused"
        )
    return manifest, data


async def pack_bundles(
    *, pool: asyncpg.Pool, obs: ObjectStore, manifest: Manifest, data: bytes, dry: bool
) -> tuple[dict[str, str], list[ToBuild]]:
    """Bundle name -> digest, packing what is not stored yet (unless dry) and taking cached
    builds; the builds still to run, whose digests here are stand-ins (UNBUILT + key)."""
    digests: dict[str, str] = {}
    todo: list[ToBuild] = []
    for name, b in sorted(manifest.bundle.items()):
        if b.kind in ON_THE_MACHINE:
            continue
        # A mesh bundle's source is the mesh's own code, packed beside the module at push.
        path = meshsource.FOLDER if b.kind == "mesh" else b.source
        assert path is not None  # the gate made sure
        try:
            # A build sees only its source folder, so its key covers exactly that.
            tree = await anyio.to_thread.run_sync(load.source_tree, data, path)
        except archive.ArchiveRefused as e:
            raise wire.BadRequest(
                f"module {manifest.module.name}: bundle.{name}.source: {e}", code="refused"
            ) from None
        tree_digest = archive.digest(tree) if dry else await blobs.put(obs, tree)
        if b.build is None and b.kind != "mesh":
            digests[name] = tree_digest
            continue
        key = build_requests.build_key(tree=tree_digest, bundle=b)
        hit = await build_requests.cached(pool, obs, key)
        if hit is not None:
            digests[name] = hit
            continue
        todo.append(ToBuild(name=name, key=key, bundle=b, source=tree_digest))
        digests[name] = UNBUILT + key
    return digests, todo


async def register(
    conn: asyncpg.Connection,
    *,
    fleet: Fleet,
    manifest: Manifest,
    text: str,
    version: str,
    bundles: dict[str, str],
    by: str,
    note: str = "",
) -> list[str]:
    """Record the version (and, at the first push, the default assignment); return the
    machines the module is assigned to."""
    name = manifest.module.name
    first = name not in await modules.current_modules(conn)
    named = manifest.assign.machines if first and manifest.assign else []
    unknown = [m for m in named if m not in fleet.machines]
    if unknown:  # placed nowhere, silently, it would be
        raise wire.BadRequest(
            f"assign.machines: {', '.join(unknown)}: no such machine has registered "
            "(mesh nodes lists those that have; assign one later with mesh assign)",
            code="not_found",
        )
    await modules.record_version(
        conn, module=name, version=version, manifest=text, bundles=bundles, by=by, note=note
    )
    if first and manifest.assign:
        await modules.assign(conn, module=name, machines=_default(fleet, manifest.assign))
        if manifest.assign.labels:  # a standing selector (changes/following.py)
            await selectors.record(conn, module=name, labels=manifest.assign.labels, by=by)
    return sorted(m for m, mods in (await modules.assignments(conn)).items() if name in mods)


def _default(fleet: Fleet, a: Assign) -> list[str]:
    """Registered machines named, in one of the tiers, or carrying all the labels."""
    chosen = {m for m in a.machines if m in fleet.machines}
    for m in fleet.machines.values():
        in_tier = bool(a.tiers) and m.tier in a.tiers
        labelled = bool(a.labels) and all(m.labels.get(k) == v for k, v in a.labels.items())
        if in_tier or labelled:
            chosen.add(m.name)
    return sorted(chosen)


def settings_of(manifest: Manifest | None) -> PlanSettings:
    """A plan's rollout settings, from the module's `[rollout]` table."""
    if manifest is None:
        return PlanSettings()
    r = manifest.rollout
    return PlanSettings(
        deadline=gate.duration(r.deadline), max_parallel=r.max_parallel,
        auto_revert=r.auto_revert, skip_down=r.skip_down, canary=r.canary,
        soak=gate.duration(r.soak) if r.soak else 0.0, pause_after=sorted(set(r.pause_after)),
        crash_loop=r.crash_loop,
    )  # fmt: skip
