"""Where a message came from, checked before anything acts on it (docs/security.md, the bus).

nats-server checks who may publish to a subject, but two routes reach a subscription without
that check, and both were used in an attack on a running mesh:

- **Deliveries.** A JetStream push consumer delivers to a `deliver_subject` its creator chose,
  which the server does not check against the creator's permissions (nor does a pull request's
  reply subject). Such a message keeps the subject it was stored under (`$O.…`, `$KV.…`), so a
  subscription refuses every message whose subject is not one it subscribed to (`expected`).
  A verb is never taken from such a subject's last token.
- **Reflections.** A request's reply subject is not checked either: whoever may ask a service
  (the JetStream API, a controller's verb) can name any subject as the reply, and the answer
  lands there with no reply subject of its own. So the mesh's services serve and answer only a
  request whose reply is an inbox (`asked`); a JetStream API answer is never decoded as one of
  the mesh's messages (`mesh.wire.decode`); and what hosts obey from the controllers is signed
  (`mesh.auth.signing`).

Refusals are logged once per window per subscription, with a count: a flood of them must not
cost a log line each.
"""

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = logging.getLogger(__name__)

INBOX = "_INBOX"  # every identity's inbox prefix starts so (mesh.auth.policy.inbox)
SAY_EVERY = 60.0  # seconds between log lines about refused messages of one subscription


def matches(pattern: str, subject: str) -> bool:
    """Whether `subject` is one that a subscription to `pattern` (NATS wildcards `*` and a
    final `>`) asked for."""
    want = pattern.split(".")
    got = subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or (token != "*" and token != got[i]):
            return False
    return len(want) == len(got)


def matcher(pattern: str) -> Callable[[str], bool]:
    """`matches` for one pattern, made once per subscription: a verb subscription's pattern is
    `a.b.*` or `a.b.>`, checked by its prefix (a third of `matches`' cost, on every request)."""
    head, _, tail = pattern.rpartition(".")
    if head and "*" not in head and ">" not in head and tail in ("*", ">"):
        prefix = head + "."
        cut = len(prefix)
        if tail == ">":
            return lambda subject: subject.startswith(prefix)
        return lambda subject: subject.startswith(prefix) and "." not in subject[cut:]
    tokens = pattern.split(".")
    wild = [i for i, token in enumerate(tokens) if token == "*"]
    fixed = [t for t in tokens if t != "*"]
    if wild and wild == list(range(wild[0], wild[-1] + 1)) and not any("*" in t or ">" in t
                                                                       for t in fixed):  # fmt: skip
        # Fixed tokens around a run of `*` (mesh.host.*.beat, mesh.event.*.*: the hosts'
        # subscriptions, a flood passes here per message): its ends and its count of tokens.
        head = ".".join(tokens[: wild[0]]) + "." if wild[0] else ""
        tail = "." + ".".join(tokens[wild[-1] + 1 :]) if wild[-1] + 1 < len(tokens) else ""
        dots = len(tokens) - 1
        return lambda subject: (
            subject.startswith(head) and subject.endswith(tail) and subject.count(".") == dots
        )
    return lambda subject: matches(pattern, subject)


def asked(msg: Msg) -> bool:
    """A request someone made: its reply goes to an inbox. An answer reflected here (from the
    JetStream API, or from a service asked with our subject as its reply) has no reply."""
    return msg.reply.startswith(INBOX)


class Strays:
    """Messages a subscription refused: logged at the first of a window, then counted."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, float]] = {}

    def refused(self, where: str, msg: Msg, why: str) -> None:
        now = time.monotonic()
        count, since = self._seen.get(where, (0, float("-inf")))
        if now - since < SAY_EVERY:
            self._seen[where] = (count + 1, since)
            return
        more = f" ({count} more since the last said)" if count else ""
        log.warning("refused a message on %s: %s (it came as %s)%s", where, why,
                    msg.subject[:128], more)  # fmt: skip
        self._seen[where] = (0, now)


STRAYS = Strays()  # one per process: every subscription's refusals


def expected(pattern: str, msg: Msg, match: Callable[[str], bool] | None = None) -> bool:
    """`msg` arrived as a subject `pattern` asked for (`match`, made by `matcher(pattern)`,
    says so faster); otherwise it is refused (and said)."""
    if match(msg.subject) if match is not None else matches(pattern, msg.subject):
        return True
    STRAYS.refused(pattern, msg, "not a subject it subscribed to: a delivery someone aimed here")
    return False


async def subscribe(
    nc: Client,
    subject: str,
    *,
    cb: Callable[[Msg], Awaitable[None]] | None = None,
    queue: str = "",
    **options: Any,
) -> Subscription:
    """`nc.subscribe`, refusing what did not arrive as `subject` asked (with `cb`; without,
    read the messages through `arrivals`)."""
    if cb is None:
        return await nc.subscribe(subject, queue=queue, **options)

    match = matcher(subject)  # made once: a host's flood passes here per message

    async def checked(msg: Msg) -> None:
        if expected(subject, msg, match):
            await cb(msg)

    return await nc.subscribe(subject, queue=queue, cb=checked, **options)


async def arrivals(sub: Subscription) -> AsyncIterator[Msg]:
    """The messages of a subscription made without a callback, refusing strays."""
    async for msg in sub.messages:
        if expected(sub.subject, msg):
            yield msg
