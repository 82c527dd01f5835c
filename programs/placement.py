"""Where machines stand: the tier and labels an operator gives a machine, registered or not
yet (hosts never choose their own), and the dev mesh's standard placement: node-1 tier 0 and the
builder, node-2 tier 1, the rest tier 2. Used by `mesh machine add`, `mesh dev place`,
`mesh dev up` and `mesh init`."""

import time
from collections.abc import Callable
from pathlib import Path

import anyio
from nats.aio.client import Client

from mesh import bus, wire
from mesh.client.asking import VerbFailed, ask, probing
from mesh.client.pages import every_page
from mesh.errors import MeshError
from mesh.model import (
    LabelReply,
    LabelRequest,
    NodesReply,
    NodesRequest,
    TierReply,
    TierRequest,
    labels_said,
)

CONTROL = {"role": "control"}  # services/controller's [assign]: the machines that run it


class NotPlaced(MeshError):
    """The machines could not be placed (no controller holds the seat, or it refused)."""


def tier_of(index: int) -> int:
    """node-1 is tier 0, node-2 tier 1, the rest tier 2 (`mesh dev up`, docs/design.md)."""
    return min(index - 1, 2)


def labels_of(index: int, *, control: int = 0) -> dict[str, str]:
    """node-1 builds bundles (modules issue); node-1 to node-`control` are control machines
    (where services/controller runs: `mesh dev init`); the others carry no labels."""
    labels = {"builder": "true"} if index == 1 else {}
    return labels | (CONTROL if index <= control else {})


async def place(
    nc: Client, *, url: str, machine: str, tier: int | None, labels: dict[str, str], timeout: float
) -> tuple[int | None, dict[str, str]]:
    """Give a machine (registered or not yet) its tier and labels, as an operator does; what the
    controller holds afterwards."""
    held_tier = None
    if tier is not None:
        body = wire.encode(TierRequest(machine=machine, tier=tier))
        moved = await ask(nc, url=url, verb="tier", reply=TierReply, timeout=timeout, body=body,
                          attempt=timeout)  # fmt: skip
        held_tier = moved.tier
    body = wire.encode(LabelRequest(machine=machine, set=labels))
    held = await ask(nc, url=url, verb="label", reply=LabelReply, timeout=timeout, body=body,
                     attempt=timeout)  # fmt: skip
    return held_tier, held.labels


async def place_new(
    nc: Client,
    *,
    url: str,
    hosts: int,
    alive: Callable[[], None],
    within: float,
    logs: Path | None = None,
    control: int = 0,
) -> list[str]:
    """node-1 tier 0 with builder=true, node-2 tier 1, the rest tier 2, as an admin places them
    (`mesh machine add --tier --label`), once a controller holds the seat. Only machines the
    store has never seen: a mesh started again keeps what its operator changed since (`mesh
    tier`, `mesh label`). A line per machine placed."""
    deadline = time.monotonic() + within
    while True:
        alive()
        try:
            nodes = await every_page(probing(nc, "nodes", NodesReply, within=1), NodesRequest())
            known = {n.name for n in nodes.nodes}
            break
        except (bus.NoAnswer, wire.RemoteError):
            if time.monotonic() > deadline:
                where = f"; logs in {logs}" if logs else ""
                raise NotPlaced(
                    f"not ready within {within:g}s: waiting for the seat's holder{where}"
                ) from None
            await anyio.sleep(0.2)
    placed = []
    for i in range(1, hosts + 1):
        name = f"node-{i}"
        if name in known:
            continue
        try:
            tier, labels = await place(
                nc, url=url, machine=name, tier=tier_of(i),
                labels=labels_of(i, control=control), timeout=30,
            )  # fmt: skip
        except VerbFailed as e:
            raise NotPlaced(f"placing {name}: {e}") from None
        shown = labels_said(labels)
        placed.append(f"machine {name} placed: tier {tier}, labels {shown}")
    return placed
