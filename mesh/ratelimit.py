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
            self._tidied = now
            full = [k for k in self._buckets if self._tokens(k, now) >= self.burst]
            for k in full:
                del self._buckets[k]

    def take(self, key: K) -> bool:
        """`allows` and `spend` in one; False (and nothing spent) when held back."""
        if not self.allows(key):
            return False
        self.spend(key)
        return True

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
