"""Following a list verb's pages (mesh/paging.py, their serving side) to one whole list, as if
the controller had answered in one reply. `every_page` is handed how one page is asked (a
probe's, a bench's own request) and says which page comes next and how the pages join;
`ask_list` asks each page as `asking.ask` asks a verb."""

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client

from mesh import wire
from mesh.client.asking import VerbFailed, ask
from mesh.model import (
    PAGE_MOST,
    AuditReply,
    DiffReply,
    HistoryReply,
    ModulesReply,
    NodesReply,
    PlanReply,
    PlansReply,
    SecretsReply,
    TokenListReply,
    ToolsReply,
)

T = TypeVar("T")


@dataclass(frozen=True)
class Listing:
    """What a list verb's pages hold: the field of the items, and an item's identity. The
    whole list has one entry per identity: a later page's entry takes an earlier one's place
    (a machine moved to a later tier while the pages were read is shown at its new place), or
    is joined to it (`join`: a module on many machines comes in several entries)."""

    items: str
    key: Callable[[Any], object]
    join: Callable[[Any, Any], Any] = lambda old, new: new


def _join_module(old: Any, new: Any) -> Any:
    return msgspec.structs.replace(new, assigned=old.assigned + new.assigned)


LISTINGS: dict[type, Listing] = {
    NodesReply: Listing("nodes", key=lambda n: n.name),
    PlanReply: Listing("steps", key=lambda s: s.machine),
    PlansReply: Listing("plans", key=lambda p: p.id),
    ModulesReply: Listing("modules", key=lambda m: m.name, join=_join_module),
    DiffReply: Listing("machines", key=lambda m: m.machine),
    ToolsReply: Listing("tools", key=lambda t: (t.machine, t.server, t.name)),
    HistoryReply: Listing("versions", key=lambda v: v.version),
    AuditReply: Listing("entries", key=lambda e: e.id),
    TokenListReply: Listing("tokens", key=lambda t: t.id),
    SecretsReply: Listing("secrets", key=lambda s: s.name),
}


async def every_page(
    ask_page: Callable[[Any], Awaitable[T]], request: Any, *, want: int | None = None
) -> T:
    """Ask for `request`'s first page (through `ask_page`, the caller's one request), then for
    the page after each, until the last: the last page holding every item in order, as if the
    controller had answered in one reply (`next` None). With `want`, at most that many items,
    asking only for the pages they need (`total` still says how many there are). The first
    page is asked for as `request` says (its default `limit` goes unsaid, so a controller from
    before pages answers it, whole); those after it as large as a request may (PAGE_MOST
    items): their bytes decide."""
    got: dict[object, Any] = {}
    after: str | None = None
    while True:
        asked = request
        if want is not None:  # one past it: the last entry may go on (a module's machines)
            asked = msgspec.structs.replace(asked, limit=min(PAGE_MOST, want + 1 - len(got)))
        elif after is not None:
            asked = msgspec.structs.replace(asked, limit=PAGE_MOST)
        page: Any = await ask_page(msgspec.structs.replace(asked, after=after))
        listing = LISTINGS[type(page)]
        for item in getattr(page, listing.items):
            key = listing.key(item)
            old = got.pop(key, None)
            got[key] = item if old is None else listing.join(old, item)
        if page.next is None or (want is not None and len(got) > want):
            break
        if page.next == after:  # a controller that does not move on would be asked forever
            raise VerbFailed(f"the controller gave the same page twice (cursor {after[:40]})")
        after = page.next
    items = list(got.values())
    return msgspec.structs.replace(page, **{listing.items: items[:want], "next": None})


async def ask_list(
    nc: Client,
    *,
    url: str,
    verb: str,
    reply: type[T],
    request: Any,
    timeout: float,
    want: int | None = None,
    attempt: float = 1.0,
) -> T:
    """A list verb, every page of it (or the first `want` items) as one reply, each page asked
    as `ask` asks a verb (retried to `timeout`, each try bounded by `attempt`)."""

    async def page(body: Any) -> T:
        return await ask(nc, url=url, verb=verb, reply=reply, timeout=timeout,
                         body=wire.encode(body), attempt=attempt)  # fmt: skip

    return await every_page(page, request, want=want)
