"""How late the event loop runs what is due: the measure of a service too busy to keep time.

A task sleeps `every` seconds and notes how much later than asked it woke. The seat's holder
pings its lock session and the bus on timers in this loop, so its lag is the margin the seat
has left under load (docs/architecture.md, Liveness: shedding): a lag near the ping
deadlines means a standby may take over from a holder that is only busy.
"""

import time
from collections import deque

import anyio

EVERY = 0.1  # seconds between wake-ups: fine enough to see a stall, cheap when idle
WINDOW = 10.0  # seconds over which `worst` looks back


class LoopLag:
    """The loop's lag now and at worst over the last WINDOW seconds."""

    def __init__(self, *, every: float = EVERY, window: float = WINDOW) -> None:
        self.every = every
        self.window = window
        self.last = 0.0  # seconds late, at the last wake-up
        self.before = 0.0  # seconds late, at the wake-up before it
        self._seen: deque[tuple[float, float]] = deque()  # (monotonic time, lag), newest last

    def behind(self, threshold: float) -> float | None:
        """How late the loop runs, if it has run later than `threshold` at its last two
        wake-ups: work arriving faster than it is done. One late wake-up alone is one long
        piece of work that has ended; refusing requests after it would help nothing."""
        return self.last if min(self.last, self.before) > threshold else None

    def worst(self) -> float:
        """The largest lag seen in the last `window` seconds (0 before the first wake-up)."""
        self._forget(time.monotonic())
        return max((lag for _, lag in self._seen), default=0.0)

    def _forget(self, now: float) -> None:
        while self._seen and self._seen[0][0] < now - self.window:
            self._seen.popleft()

    async def run(self) -> None:
        """Forever (cancel to stop)."""
        while True:
            asked = time.monotonic()
            await anyio.sleep(self.every)
            now = time.monotonic()
            self.before, self.last = self.last, max(0.0, now - asked - self.every)
            # Keep only what could be the worst: a smaller lag before a larger one never is.
            while self._seen and self._seen[-1][1] <= self.last:
                self._seen.pop()
            self._seen.append((now, self.last))
            self._forget(now)
