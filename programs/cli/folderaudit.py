"""Changes the command line makes on the mesh's folder, asked of or told to the controller as the
operator: `mesh operator add/remove` ask it first; `mesh machine add/remove` and `mesh cert
rotate`, which the controller has no part in, tell it once done (`folder-change`), so the audit
log has each with the operator nats-server authenticated, never a name the client wrote.

The credentials are the caller's (`--creds`, MESH_CREDS) or else the folder's admin's: whoever
holds the folder holds those."""

import argparse
import sys
from typing import Any

import msgspec

from mesh import config
from mesh.client.asking import VerbFailed, ask, connected
from mesh.meshdir import MeshDir
from mesh.model import FolderChange, FolderChangeReply, FolderChangeRequest


async def ask_as_admin(
    args: argparse.Namespace, folder: MeshDir, verb: str, reply: type[Any], body: Any, *,
    what: str,
) -> Any:  # fmt: skip
    """`verb` asked with the caller's credentials, or the folder's admin's."""
    admin = folder.creds_file("operator", "admin")
    creds = config.creds(getattr(args, "creds", None)) or (str(admin) if admin.exists() else None)
    url = folder.nats_url() or config.nats_url(getattr(args, "nats_url", None))
    timeout = getattr(args, "timeout", 10.0)
    async with connected(url=url, creds=creds, what=what) as nc:
        return await ask(nc, url=url, verb=verb, reply=reply, timeout=timeout,
                         body=msgspec.json.encode(body), attempt=timeout)  # fmt: skip


async def record(
    args: argparse.Namespace, folder: MeshDir, change: FolderChange, subject: str,
    detail: str = "",
) -> bool:  # fmt: skip
    """The change, done, told to the controller for the audit log; False, said in one line on
    stderr, if none recorded it: the change stands (a revocation or a rotation never waits for
    a controller, and a mesh whose servers are stopped has none to ask)."""
    body = FolderChangeRequest(change=change, subject=subject, detail=detail[:500])
    try:
        await ask_as_admin(args, folder, "folder-change", FolderChangeReply, body, what=change)
    except VerbFailed as e:
        print(f"mesh: {change} {subject} is done, but not in the audit log: {e}", file=sys.stderr)
        return False
    return True
