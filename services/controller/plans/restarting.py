"""A restart plan's steps, sent as restarts (`mesh restart`): each machine keeps its
declaration, and its host restarts the module's processes and tool servers one by one
(`mesh.host.<name>.restart`, as an admin's restart of one process does). The step is judged as
any other, on what the fleet hears, with one rule more (heard.py): a process that has not started
again since the restart was asked is not yet healthy. A restart the host refuses, or does not
answer, fails the step at once, saying why.
"""

import logging

import anyio
import msgspec
from nats.aio.client import Client
from nats.errors import Error as NatsError

from mesh import subjects, wire
from mesh.model import RestartReply, RestartRequest
from mesh.modules.compose import Declaration, tools_of
from mesh.store.plans import Step
from services.controller.fleet.fleet import Fleet
from services.controller.plans.heard import Heard

log = logging.getLogger(__name__)

RESTART_WITHIN = 60.0  # a host's answer to one restart: it stops the process first (stop_timeout)
AT_ONCE = 16  # machines asked at once


def of_module(module: str, body: bytes) -> list[str]:
    """The processes and tool servers of `module` in a declaration, by name."""
    decl = msgspec.json.decode(body, type=Declaration)
    runs = {**decl.processes, **tools_of(decl)}
    return sorted(name for name, r in runs.items() if r.module == module)


async def restart(
    nc: Client | None, fleet: Fleet, heard: Heard, *, module: str, steps: list[Step]
) -> None:
    """Ask each step's machine to restart `module`'s processes, each noted first as running
    what it ran (heard.restarting); a machine that refuses or does not answer is heard as
    failed, which fails its step."""
    if nc is None:
        return
    limit = anyio.Semaphore(AT_ONCE)

    async def one(s: Step) -> None:
        names = of_module(module, s.after_body)
        heard.restarting(s.machine, names)
        async with limit:
            for name in names:
                body = wire.encode(RestartRequest(process=name))
                try:
                    msg = await nc.request(subjects.host(s.machine, "restart"), body,
                                           timeout=RESTART_WITHIN)  # fmt: skip
                    wire.decode_reply(msg.data, RestartReply)
                except (NatsError, wire.RemoteError, TimeoutError) as e:
                    why = f"could not restart {name}: {str(e) or type(e).__name__}"
                    log.info("machine %s: %s", s.machine, why)
                    fleet.heard_applied(s.machine, s.after, why, fleet.processes.get(s.machine, []))
                    return

    async with anyio.create_task_group() as tg:
        for s in steps:
            tg.start_soon(one, s)
