"""The standbys the holder has heard from: each announces itself every second while it waits."""

import time

from mesh.model import SeatAnnounce, Standby

ANNOUNCE_EVERY = 1.0
FORGET_AFTER = 3.5  # a standby silent this long is gone


class Standbys:
    def __init__(self, *, own_instance: str) -> None:
        self._own = own_instance
        self._seen: dict[str, tuple[SeatAnnounce, float]] = {}

    def heard(self, announce: SeatAnnounce) -> None:
        if announce.instance != self._own:
            self._seen[announce.instance] = (announce, time.monotonic())

    def gone(self, instance: str) -> None:
        self._seen.pop(instance, None)

    def current(self) -> list[Standby]:
        now = time.monotonic()
        for instance in [i for i, (_, t) in self._seen.items() if now - t > FORGET_AFTER]:
            del self._seen[instance]
        return [
            Standby(instance=a.instance, pid=a.pid, host=a.host, since=a.since)
            for a, _ in sorted(self._seen.values(), key=lambda s: s[0].instance)
        ]
