"""Work written in batches, one item per key: callers wait for the batch their item lands in.

Made for a takeover's storm of registrations: ten thousand hosts asking at once, each a store
write. Written one at a time they take longer than a host waits for its answer, so hosts ask
again and the work grows with every retry (a metastable failure). Here a batch is written while
the next one gathers, so the batches grow with the load and need no timer; and an item whose
key is already waiting replaces the waiting one (a host asking again is one registration, not
two), so retries add no work; nor does the same item again while its batch is being written. Every
caller gets the answer of the item that was written.
"""

import itertools
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Generic, TypeVar

import anyio

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
R = TypeVar("R")


@dataclass(eq=False)
class _Waiting(Generic[V, R]):
    item: V
    done: anyio.Event = field(default_factory=anyio.Event)
    result: R | None = None
    error: BaseException | None = None
    trace: TracebackType | None = None  # where `error` was raised, in `write`


class Batches(Generic[K, V, R]):
    """`submit(item)` waits until `write` has written a batch holding it and returns the item's
    result (items submitted before `run` starts wait for it). `write(items)` gets at most
    `most` items with distinct keys, in the order they came, and returns each key's result;
    what it raises, every caller of that batch raises. `run` writes batches for as long as it
    runs; when it stops, callers still waiting raise what `stopped()` makes."""

    def __init__(
        self,
        *,
        key: Callable[[V], K],
        write: Callable[[list[V]], Awaitable[dict[K, R]]],
        most: int,
        stopped: Callable[[], BaseException],
    ) -> None:
        self._key = key
        self._write = write
        self._most = most
        self._stopped = stopped
        self._waiting: dict[K, _Waiting[V, R]] = {}  # the next batches, in arrival order
        self._ready = anyio.Event()
        self._writing: dict[K, _Waiting[V, R]] = {}  # the batch `write` has now
        self._ended = False  # once `run` has stopped, nothing more is taken

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def submit(self, item: V) -> R:
        w = self.put(item)
        if w is None:
            raise self._stopped()
        await w.done.wait()
        if w.error is not None:
            # Every caller of a batch raises the one error: from where it was raised each time,
            # or each raise would add its caller's frames to the last one's (a batch of 5,000
            # callers logged tracebacks of 5,000 callers' frames, 170 MB).
            raise w.error.with_traceback(w.trace)
        return w.result  # type: ignore[return-value]

    def put(self, item: V) -> _Waiting[V, R] | None:
        """Add `item` to the next batch without waiting for it (`write` must then report its
        own failures: nobody hears them). None, and nothing taken, once `run` has ended."""
        k = self._key(item)
        being_written = self._writing.get(k)
        if being_written is not None and being_written.item == item:
            return being_written  # the same word again (a retry): its answer is on the way
        w = self._waiting.get(k)
        if w is None:
            if self._ended:
                return None
            w = self._waiting[k] = _Waiting(item)
            self._ready.set()
        else:
            w.item = item  # the newer word of the same key wins; both callers hear it
        return w

    async def run(self) -> None:
        writing: list[_Waiting[V, R]] = []
        try:
            while True:
                await self._ready.wait()
                self._ready = anyio.Event()
                while self._waiting:
                    keys = list(itertools.islice(self._waiting, self._most))
                    writing = [self._waiting.pop(k) for k in keys]
                    self._writing = dict(zip(keys, writing, strict=True))
                    try:
                        results = await self._write([w.item for w in writing])
                    except Exception as e:
                        for w in writing:
                            w.error, w.trace = e, e.__traceback__
                    else:
                        for k, w in zip(keys, writing, strict=True):
                            w.result = results.get(k)
                    for w in writing:
                        w.done.set()
                    writing, self._writing = [], {}
        finally:
            self._ended = True
            for w in [*writing, *self._waiting.values()]:
                if not w.done.is_set():
                    w.error = self._stopped()
                    w.done.set()
            self._waiting.clear()
