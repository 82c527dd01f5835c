"""A process's preparation step (`prepare`): run as its account before a new version starts,
bounded by `prepare_timeout`, its output kept for `mesh logs --prepare` (the last
PREPARE_KEPT bytes, each line with its time, as a process's log has them)."""

import logging
import subprocess
import time
from pathlib import Path

import anyio

from mesh.modules.gate import duration
from services.host import logwriter
from services.host.processes import credentials, kill_group
from services.host.steps import StepFailed
from services.host.supervisor import Launch

log = logging.getLogger(__name__)

PREPARE_KEPT = 256 * 1024  # bytes of a preparation's output kept (the last), for `logs --prepare`


async def prepare(launch: Launch) -> None:
    """The prepare step, as the account, before a new version starts; a failure leaves
    whatever runs now running."""
    assert launch.decl.prepare is not None
    limit = duration(launch.decl.prepare_timeout)
    log.info("process %s: prepare %s", launch.name, launch.decl.prepare)
    try:
        process = await anyio.open_process(
            launch.decl.prepare, cwd=launch.cwd, env=launch.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            **credentials(launch.uid, launch.gid, launch.groups),
        )  # fmt: skip
    except (OSError, ValueError) as e:
        raise StepFailed("prepare", str(e), name=launch.name) from None
    output, at_start = b"", True
    said = f"[mesh] prepare {launch.decl.prepare} of {launch.name}, spec {launch.spec[:19]}\n"
    kept = logwriter.stamp(time.time()) + said.encode()
    try:
        with anyio.fail_after(limit):
            assert process.stdout is not None
            async for chunk in process.stdout:
                output = (output + chunk)[-8192:]
                chunk, at_start = logwriter.stamped(
                    chunk, at_start=at_start, now=logwriter.stamp(time.time())
                )
                kept = (kept + chunk)[-PREPARE_KEPT:]
            await process.wait()
    except TimeoutError:
        raise StepFailed("prepare", f"timed out after {limit:g}s", name=launch.name) from None
    finally:
        kill_group(process.pid)  # nothing it started outlives it
        with anyio.CancelScope(shield=True):
            await process.wait()
            ended = f"[mesh] prepare ended: exit code {process.returncode}\n".encode()
            last = (b"" if at_start else b"\n") + logwriter.stamp(time.time()) + ended
            _keep(launch.log_file.with_name("prepare.log"), kept + last)
    if process.returncode != 0:
        tail = output.decode(errors="replace").strip().splitlines()[-3:]
        raise StepFailed(
            "prepare", f"exit code {process.returncode}: {' | '.join(tail)}", name=launch.name
        )


def _keep(path: Path, output: bytes) -> None:
    """A preparation's output, for `mesh logs --prepare` (the host's alone: it may carry
    secrets); lost, if it cannot be written, without failing the step."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.parent.chmod(0o700)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_bytes(output)
        temporary.chmod(0o600)
        temporary.replace(path)
    except OSError as e:
        log.warning("prepare output not kept in %s: %s", path, e)
