"""Changes asked as an operator asks them, for any program that asks them (the command line,
`mesh init`, `mesh dev init`): a module pushed (its archive uploaded to the bundle store first),
a secret set, and a change's plan followed to its end. On the library's client (asking.py), so
no program runs the command line to make a change."""

import base64
import getpass
from collections.abc import Callable

from nats.aio.client import Client

from mesh import blobs, wire
from mesh.client.asking import VerbFailed, ask
from mesh.client.progress import follow_plan
from mesh.model import ChangeReply, PlanProgress, PlanReply, PushRequest, SecretSetRequest
from mesh.modules.load import LocalModule

CHANGE_TIMEOUT = 900.0  # a push may wait for a build (10 minutes by default) and then some


async def upload(nc: Client, module: LocalModule) -> str | None:
    """The module's archive, left in the uploads' bucket for the controller to adopt (an
    operator writes nowhere else: mesh/auth/policy.py); the name it is staged under. A mesh
    whose controller has not made that bucket yet (an older one) takes it in the bundle store,
    as it did: None. Raises blobs.BlobMissing."""
    try:
        uploads = await blobs.staged(nc, blobs.UPLOADS)
    except blobs.BlobMissing:
        await blobs.put(await blobs.store(nc), module.source)
        return None
    return await blobs.stage(uploads, blobs.object_name(module.version), module.source)


def push_request(
    module: LocalModule, *, hold: bool = False, upload: str | None = None, note: str = ""
) -> PushRequest:
    # `by` is the local name; a mesh with operators records the operator it verified instead.
    return PushRequest(
        manifest=module.manifest_text, source=module.version, by=getpass.getuser(), hold=hold,
        upload=upload, note=note,
    )  # fmt: skip


async def push(
    nc: Client, *, url: str, module: LocalModule, hold: bool = False, note: str = "",
    timeout: float = CHANGE_TIMEOUT,
) -> ChangeReply:  # fmt: skip
    """Upload, then ask `push`, tried once per answer window (a slow answer, e.g. a build, must
    not be taken for a lost request and sent again)."""
    staged = await upload(nc, module)
    body = wire.encode(push_request(module, hold=hold, upload=staged, note=note))
    return await ask(nc, url=url, verb="push", reply=ChangeReply, timeout=timeout, body=body,
                     attempt=timeout)  # fmt: skip


def secret_request(name: str, value: bytes, *, modules: str | None = None) -> SecretSetRequest:
    return SecretSetRequest(name=name, value=base64.b64encode(value).decode(),
                            by=getpass.getuser(), modules=modules)  # fmt: skip


async def set_secret(
    nc: Client, *, url: str, name: str, value: bytes, timeout: float = CHANGE_TIMEOUT
) -> ChangeReply:
    body = wire.encode(secret_request(name, value))
    return await ask(nc, url=url, verb="secret-set", reply=ChangeReply, timeout=timeout,
                     body=body, attempt=timeout)  # fmt: skip


async def until_done(
    nc: Client, *, url: str, plan_id: int, show: Callable[[PlanReply | PlanProgress], None]
) -> PlanReply:
    """Follow the plan to its end (follow_plan); VerbFailed, naming its failure, unless done."""
    final = await follow_plan(nc, url=url, plan_id=plan_id, show=show)
    if final.state != "done":
        why = f": {final.failure}" if final.failure else ""
        raise VerbFailed(f"plan {plan_id} ended {final.state}{why}")
    return final
