"""The bundle store: bundles fetched by digest, verified, unpacked safely and kept read-only
under ROOT/bundles/<kind>-<digest>. A bundle is made whole in a scratch folder and renamed into
place, so a half-unpacked bundle is never seen."""

import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

import anyio
import anyio.to_thread
from nats.aio.client import Client

from mesh import blobs
from mesh.modules import archive
from mesh.modules.compose import DBundle
from services.host import metrics

log = logging.getLogger(__name__)


def folder(root: Path, key: str) -> Path:
    return root / "bundles" / key.replace(":", "-")


def _read_only(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):
            continue
        if stat.S_ISDIR(st.st_mode):
            p.chmod(0o555)
        else:
            p.chmod(0o555 if st.st_mode & 0o111 else 0o444)


def _unpack(data: bytes, scratch: Path, final: Path) -> None:
    archive.unpack(data, scratch)
    _read_only(scratch)
    os.rename(scratch, final)


async def ensure(nc: Client, root: Path, key: str, bundle: DBundle) -> Path | None:
    """The bundle's folder, fetched if absent; None for a `system` bundle (already here)."""
    if bundle.kind == "system" or bundle.digest is None:
        return None
    final = folder(root, key)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = await blobs.get(nc, bundle.digest)  # verified against its digest
    except Exception:
        metrics.BUNDLE_FETCHES.labels("failed").inc()
        raise
    metrics.BUNDLE_FETCHES.labels("ok").inc()
    metrics.BUNDLE_BYTES.inc(len(data))
    scratch = Path(tempfile.mkdtemp(prefix=".unpacking-", dir=final.parent))
    try:
        await anyio.to_thread.run_sync(_unpack, data, scratch, final)
    except BaseException:
        for p in [scratch, *scratch.rglob("*")]:
            if p.is_dir() and not p.is_symlink():
                p.chmod(0o755)
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    log.info("bundle %s stored in %s", key, final)
    return final


GRACE = 600.0  # an unused bundle is kept this long (a rollback may want it back)


def collect(root: Path, keep: set[str], unused_since: dict[str, float], now: float) -> list[str]:
    """Remove bundles that no declaration has used for GRACE seconds; `unused_since` (key ->
    when first seen unused) is updated in place. Returns the removed keys."""
    store = root / "bundles"
    if not store.is_dir():
        return []
    kept = {key.replace(":", "-") for key in keep}
    removed = []
    for path in sorted(store.iterdir()):
        if path.name.startswith("."):
            continue
        if path.name in kept:
            unused_since.pop(path.name, None)
            continue
        since = unused_since.setdefault(path.name, now)
        if now - since >= GRACE:
            for p in [path, *path.rglob("*")]:
                if p.is_dir() and not p.is_symlink():
                    p.chmod(0o755)
            shutil.rmtree(path, ignore_errors=True)
            unused_since.pop(path.name, None)
            removed.append(path.name)
            log.info("bundle %s unused for %gs: removed", path.name, GRACE)
    return removed
