"""How often one key (a machine) may cause a piece of work: a token bucket per key.

A host can send as fast as its link allows, and each of its messages may be a store write and a
log line of the controller's: without a bound, one compromised machine grows the store and the
log as it likes. Each key may do `burst` at once, then one each `every` seconds; what it asks
beyond that is held back (the caller decides how: answered from memory, written later, not
logged) and counted, and the counts are said once per `every`, never once per message.
Keys whose bucket is full again are forgotten, so memory follows the keys that are busy now.
"""

import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class PerKey(Generic[K]):
    def __init__(
        self, *, burst: int, every: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.burst = burst
        self.every = every
        self._clock = clock
        self._buckets: dict[K, tuple[float, float]] = {}  # key -> (tokens, when counted)
        self._held: dict[K, int] = {}  # held back since the counts were last said
        self._said = self._tidied = clock()

    def _tokens(self, key: K, now: float) -> float:
        tokens, at = self._buckets.get(key, (float(self.burst), now))
        return min(float(self.burst), tokens + (now - at) / self.every)

    def allows(self, key: K) -> bool:
        """Whether `key` may do one more now (nothing is spent: `spend` once it is done)."""
        return self._tokens(key, self._clock()) >= 1.0

    def spend(self, key: K) -> None:
        """One done for `key` (counted even past its allowance: work already under way)."""
        now = self._clock()
        self._buckets[key] = (self._tokens(key, now) - 1.0, now)
        if now - self._tidied >= self.every:
            self._tidy(now)

    def _tidy(self, now: float) -> None:
        self._tidied = now
        full = [k for k in self._buckets if self._tokens(k, now) >= self.burst]
        for k in full:
            del self._buckets[k]

    def take(self, key: K) -> bool:
        """`allows` and `spend` in one; False (and nothing spent) when held back. (One look at
        the clock and the bucket: a host's flood is checked here once per message.)"""
        now = self._clock()
        tokens = self._tokens(key, now)
        if tokens < 1.0:
            return False
        self._buckets[key] = (tokens - 1.0, now)
        if now - self._tidied >= self.every:
            self._tidy(now)
        return True

    def refund(self, key: K) -> None:
        """One given back to `key` (work it was allowed that is over: a request answered), up
        to its burst: a bucket of requests in flight rather than of a rate."""
        now = self._clock()
        if key in self._buckets:
            self._buckets[key] = (min(float(self.burst), self._tokens(key, now) + 1.0), now)

    def hold(self, key: K) -> None:
        """One held back for `key`: counted for the next `held`."""
        self._held[key] = self._held.get(key, 0) + 1

    def held(self) -> dict[K, int] | None:
        """Once every `every` seconds, the keys held back since the last time, each with how
        many times (possibly none); None in between."""
        now = self._clock()
        if now - self._said < self.every:
            return None
        self._said = now
        held, self._held = self._held, {}
        return held

    def held_for(self, key: K) -> int:
        """How many times `key` was held back since this was last asked for it (reset)."""
        return self._held.pop(key, 0)


class Said(Generic[K]):
    """A log line that could repeat once per message (a NATS error per message dropped, a reply
    refused for each of a flood's requests): said `burst` times at once per key, then once each
    `every` seconds with how many were not, on `PerKey`'s buckets. Keys are few and fixed by the
    caller (an error's kind, a subscription), never a message's own words."""

    def __init__(
        self, *, burst: int = 1, every: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._keys = PerKey[K](burst=burst, every=every, clock=clock)

    def unsaid(self, key: K) -> int | None:
        """None: not now (this one is counted); otherwise say it now, with this many others
        not said since the last time (0: none)."""
        if not self._keys.take(key):
            self._keys.hold(key)
            return None
        return self._keys.held_for(key)


def more(unsaid: int) -> str:
    """What a line said after a silence adds: how many were not said."""
    return f" (and {unsaid} more not logged since the last said)" if unsaid else ""
