"""Building a bundle on this host (labelled builder=true), as the controller asks.

The module's source is fetched by digest and verified, unpacked into a scratch folder, and the
build's argv runs there as the unprivileged account `mesh-build` (the current user in dev mode),
in its own process group, with a time limit. The output is packed canonically and left in the
builds' bucket under its digest, the log's last LOG_KEEP bytes as `build-log-<key>` (a first
line says how much was cut before them); the controller checks both and stores them in the
bundle store (a builder may write nowhere else: mesh/blobs.py). The log's last lines (at most
TAIL_BYTES) go back in the reply.
"""

import logging
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from nats.aio.client import Client

from mesh import blobs, osaccounts
from mesh.model import BuildReply, BuildRequest
from mesh.modules import archive
from services.host import meshbuild

log = logging.getLogger(__name__)

BUILD_ACCOUNT = osaccounts.BUILD_ACCOUNT  # no module may declare it (the gate)
TAIL_LINES = 20
TAIL_BYTES = 4096  # of those lines: they travel in the reply and an error message
LOG_KEEP = 256 * 1024  # of a build's output, its end is kept: a chatty build costs no memory


def _credentials() -> dict[str, Any]:
    if os.geteuid() != 0:
        return {}  # dev mode: builds run as the current user
    osaccounts.ensure_system_account(BUILD_ACCOUNT)
    return {"user": BUILD_ACCOUNT, "group": BUILD_ACCOUNT, "extra_groups": []}


def _inside(root: Path, rel: str) -> Path:
    path = (root / rel).resolve()
    if path != root.resolve() and root.resolve() not in path.parents:
        raise ValueError(f"{rel!r} escapes the build folder")
    return path


def _tail(text: str) -> str:
    tail = "\n".join(text.splitlines()[-TAIL_LINES:])
    data = tail.encode()
    if len(data) <= TAIL_BYTES:
        return tail
    return "…" + data[-(TAIL_BYTES - 3) :].decode(errors="ignore")  # "…" is 3 bytes


def _read_log(output: Path) -> str:
    """The build's output, or its last LOG_KEEP bytes from a whole line on, after a first line
    saying how many bytes were cut; only that much is ever read."""
    try:
        f = open(output, "rb")
    except FileNotFoundError:
        return ""
    with f:
        size = f.seek(0, os.SEEK_END)
        if size <= LOG_KEEP:
            f.seek(0)
            return f.read(LOG_KEEP).decode(errors="replace")
        f.seek(size - LOG_KEEP)
        kept = f.read(LOG_KEEP)
    newline = kept.find(b"\n")
    if 0 <= newline < len(kept) - 1:
        kept = kept[newline + 1 :]  # no half line first (a single huge line is kept as cut)
    return f"[… {size - len(kept)} bytes cut …]\n" + kept.decode(errors="replace")


async def build(nc: Client, req: BuildRequest, *, root: Path) -> BuildReply:
    """Always a reply, never an exception: the controller waits on it holding its change lock."""
    try:
        return await _build(nc, req, root=root)
    except Exception as e:
        log.exception("build of %s/%s failed", req.module, req.bundle)
        return BuildReply(ok=False, digest=None, tail="", log="", error=f"{type(e).__name__}: {e}")


def _give(scratch: Path, account: str) -> None:
    entry = pwd.getpwnam(account)
    for path in [scratch, *scratch.rglob("*")]:
        os.lchown(path, entry.pw_uid, entry.pw_gid)


async def _build(nc: Client, req: BuildRequest, *, root: Path) -> BuildReply:
    log_name = "build-log-" + req.key.replace(":", "-")
    obs = await blobs.staged(nc)
    folder = root / "builds"
    folder.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{req.module}-{req.bundle}-", dir=folder))
    output = scratch.with_suffix(".log")
    try:
        source = await blobs.get(nc, req.source)
        await anyio.to_thread.run_sync(archive.unpack, source, scratch)
        workdir = _inside(scratch, req.path)
        if req.kind == "mesh":
            return await _build_mesh(obs, req, workdir, log_name)
        credentials = _credentials()
        if credentials:
            os.chmod(folder, 0o711)
            await anyio.to_thread.run_sync(_give, scratch, BUILD_ACCOUNT)
        log.info("building %s/%s in %s: %s", req.module, req.bundle, workdir, req.argv)
        code, timed_out = await _run(req, workdir=workdir, output=output, credentials=credentials)
        text = _read_log(output)
        staged_log = await blobs.stage(obs, log_name, text.encode())
        if timed_out:
            return _failed(text, staged_log, f"timed out after {req.timeout:g}s")
        if code != 0:
            return _failed(text, staged_log, f"exit code {code}")
        result = _inside(workdir, req.output)
        if not result.exists():
            return _failed(text, staged_log, f"the build left no {req.output!r}")
        packed = await anyio.to_thread.run_sync(archive.pack, result)
        reply = await _built(obs, packed, tail=_tail(text), staged_log=staged_log)
        log.info("built %s/%s: %s", req.module, req.bundle, reply.digest)
        return reply
    except (blobs.BlobMissing, blobs.BlobCorrupt, archive.ArchiveRefused, ValueError, OSError) as e:
        return BuildReply(ok=False, digest=None, tail="", log="", error=str(e))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        output.unlink(missing_ok=True)


async def _build_mesh(obs: Any, req: BuildRequest, source: Path, log_name: str) -> BuildReply:
    """The mesh's own code and what it needs, made here by meshbuild (no argv, no account)."""
    made = source.parent / (source.name + ".bundle")
    log.info("building %s/%s: the mesh's code from its source", req.module, req.bundle)
    try:
        lines = await anyio.to_thread.run_sync(meshbuild.make, source, made)
        packed = await anyio.to_thread.run_sync(archive.pack, made)
    except meshbuild.MeshBuildFailed as e:
        staged_log = await blobs.stage(obs, log_name, str(e).encode())
        return BuildReply(
            ok=False, digest=None, tail=str(e), log=staged_log, error=str(e), staged=True
        )
    finally:
        await anyio.to_thread.run_sync(lambda: shutil.rmtree(made, ignore_errors=True))
    lines.append(f"bundle: {len(packed) // 1024} KiB packed")
    text = "\n".join(lines)
    staged_log = await blobs.stage(obs, log_name, text.encode())
    reply = await _built(obs, packed, tail=_tail(text), staged_log=staged_log)
    log.info("built %s/%s: %s (%d KiB)", req.module, req.bundle, reply.digest,
             len(packed) // 1024)  # fmt: skip
    return reply


def _failed(text: str, staged_log: str, error: str) -> BuildReply:
    """A build that ran and failed: its log is staged (the controller adopts it)."""
    return BuildReply(ok=False, digest=None, tail=_tail(text), log=staged_log, error=error,
                      staged=True)  # fmt: skip


async def _built(obs: Any, packed: bytes, *, tail: str, staged_log: str) -> BuildReply:
    """The bundle staged beside its log, for the controller to check and adopt."""
    d = blobs.digest(packed)
    staged_as = await blobs.stage(obs, blobs.object_name(d), packed)
    return BuildReply(ok=True, digest=d, tail=tail, log=staged_log, staged=True,
                      staged_as=staged_as)  # fmt: skip


async def _run(
    req: BuildRequest, *, workdir: Path, output: Path, credentials: dict[str, Any]
) -> tuple[int | None, bool]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(workdir),
        "LANG": "C.UTF-8",
    }
    with open(output, "wb") as out:
        process = await anyio.open_process(
            req.argv,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **credentials,
        )
        try:
            with anyio.move_on_after(req.timeout) as limit:
                await process.wait()
            if limit.cancelled_caught:
                return None, True
            return process.returncode, False
        finally:
            # Always, not only on a timeout: nothing a build started may outlive it (and change
            # its output while it is packed).
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            with anyio.CancelScope(shield=True):
                await process.wait()
