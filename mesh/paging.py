"""Pages of a list verb: a reply is never too big for the bus, whatever the fleet's size.

A list verb (`nodes`, `plan`'s steps, `plans`, `modules`, `diff`, `history`) answers a
**page**: its items in their stable order, starting after the request's cursor (`after`: the
`next` of the page before; none: the first page), at most the request's `limit` of them, and no
more than a byte budget well under the NATS server's max_payload, so no page is refused by the
bus whatever its items' sizes. The reply's `next` is the cursor of the page after it, None on
the last page.

A cursor is the key of the last item given, not an offset: items added or removed meanwhile
before it shift nothing, so an item that stays where it is is given once, never twice or not at
all. An item whose key changes while a client walks the pages (a machine moved to another tier)
is given at its new place: again if that is after the cursor (a client keeps its last entry),
not at all if it is before it. A cursor is opaque to clients (base64url of JSON: the verb and
the key), and one verb's cursor is refused by another.

One item alone larger than the budget cannot be given: that is a `too_large` error naming the
item (for most verbs impossible by their own limits, on a server with the default 1 MiB).

Pure: the caller finds where the page starts (a bisection of keys it keeps sorted, or a query
`WHERE key > cursor`) and hands the items from there on; `fill` takes what fits.

A new list verb pages in four steps: its request takes `after: Cursor | None` and `limit`
(checked by mesh.model.check_limit in `__post_init__`, with `omit_defaults`), its reply `next`
and `total`; its handler reads `after(req.after, verb=..., shape=...)`, starts there and
returns `fill(...)`'s items and `next`, with `room(budget, the reply without items)`; its Verb
says `too_large=HINT`; and mesh/client/pages.py's LISTINGS names its items' field and key,
so `every_page` (the command line, the console, dev up, the benches) follows it.
"""

import base64
import binascii
import bisect
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec

from mesh import wire

T = TypeVar("T")
Key = tuple[int | str, ...]

PAGE_BYTES = 512 * 1024  # a page's items at most: half the default max_payload of 1 MiB
CURSOR_ROOM = 600  # bytes kept for the reply's `next`: a key of names and numbers, as base64
# What a `too_large` reply of a verb that pages says to do (mesh.bus.answer).
HINT = "ask with a smaller `limit`, or follow `next`"


def budget(max_payload: int) -> int:
    """Bytes of a page on a server that takes `max_payload`: half of it, at most PAGE_BYTES.
    The other half is the envelope's and slack: the reply as encoded is measured again before
    it is sent (mesh.bus.answer)."""
    return max(1, min(PAGE_BYTES, max_payload // 2))


def room(budget: int, envelope: object) -> int:
    """Bytes left for the items of a reply shaped like `envelope` (the reply with no items)."""
    return budget - len(wire.encode(envelope)) - CURSOR_ROOM


def cursor(verb: str, key: Key) -> str:
    text = json.dumps([verb, *key], separators=(",", ":"))
    return base64.urlsafe_b64encode(text.encode()).rstrip(b"=").decode()


def after(text: str | None, *, verb: str, shape: tuple[type, ...]) -> Key | None:
    """The key a request's `after` names (None: the first page). A cursor that is not one
    this verb gave, with a key of `shape` (its types, in order), is refused naming the field."""
    if text is None:
        return None
    try:
        decoded = wire.decode_json(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    except (ValueError, binascii.Error, msgspec.DecodeError):  # not base64, not JSON
        decoded = None
    fits = (
        isinstance(decoded, list)
        and len(decoded) == len(shape) + 1
        and decoded[0] == verb
        and all(type(v) is t for v, t in zip(decoded[1:], shape, strict=True))
    )
    if not fits:
        raise wire.BadRequest(
            f"after: {text[:40]!r} is not a cursor of {verb} (pass the `next` of the page before)"
        )
    return tuple(decoded[1:])


def start(keys: Sequence[Key], at: Key | None) -> int:
    """Where the page after the cursor `at` starts in `keys` (sorted): the first key past it."""
    return 0 if at is None else bisect.bisect_right(keys, at)


@dataclass(frozen=True)
class Page(Generic[T]):
    items: list[T]
    next: str | None  # the cursor after the last item; None: no item is left


def fill(
    rows: Iterable[tuple[Key, T]],
    *,
    verb: str,
    limit: int,
    room: int,
    what: Callable[[T], str],
    instead: str = "the NATS server's max_payload is too small for it",
) -> Page[T]:
    """The page of `rows` (key and item, in order, from just after the cursor): items until
    `limit` of them, or until the next would take their encoded size past `room` bytes. Rows
    are read one past the page, to know whether there is more; build items lazily (a generator)
    and a page costs what it holds, not what is left. An item alone larger than `room` is
    refused `too_large`, naming it (`what`) and what to do (`instead`)."""
    items: list[T] = []
    used = 0
    last: Key = ()
    for key, item in rows:
        if len(items) >= limit:  # limit >= 1 (mesh.model.check_limit): items has some
            return Page(items=items, next=cursor(verb, last))
        size = len(wire.encode(item)) + 1  # and the comma before the next
        if used + size > room:
            if not items:
                raise wire.BadRequest(
                    f"{verb}: {what(item)} alone is {size} bytes, more than a page holds "
                    f"({max(room, 0)} bytes on this NATS server); {instead}",
                    code="too_large",
                )
            return Page(items=items, next=cursor(verb, last))
        items.append(item)
        used += size
        last = key
    return Page(items=items, next=None)


def largest(most: int, fits: Callable[[int], bool]) -> int:
    """The largest n in 0..most for which `fits(n)` holds (fits is monotone: true up to some n,
    false after; fits(0) is taken as true). Where a text is cut to fit a reply: a log's tail."""
    low, high = 0, most
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def encoded_size(value: object) -> int:
    return len(wire.encode(value))


def fitting_tail(text: str, room: int) -> str:
    """`text`, or its longest tail whose JSON fits `room` bytes, after a first line saying how
    much was cut (as JSON a control character takes 6 bytes: a log of 256 KiB may not fit)."""
    if encoded_size(text) <= room:
        return text
    room -= 64  # the first line

    def fits(n: int) -> bool:
        return encoded_size(text[len(text) - n :]) <= room

    kept = largest(len(text), fits)
    return f"[… {len(text) - kept} characters cut to fit a reply …]\n" + text[len(text) - kept :]
