"""The standbys the holder has heard from: each announces itself every second while it waits
(`announce`); and what every controller hears on the seat's subjects (`SeatEvents`).
"""

import time

import anyio
from nats.aio.client import Client
from nats.aio.msg import Msg

from mesh import origin, subjects, wire
from mesh.auth.signing import Signing
from mesh.model import SeatAnnounce, Standby

ANNOUNCE_EVERY = 1.0
FORGET_AFTER = 3.5  # a standby silent this long is gone


class Standbys:
    def __init__(self, *, own_instance: str) -> None:
        self._own = own_instance
        self._seen: dict[str, tuple[SeatAnnounce, float]] = {}
        # The list as last made, until something is heard or gone or the first of them would
        # expire: `status` asks on every call, standbys change about once a second.
        self._listed: list[Standby] | None = None
        self._listed_until = 0.0

    def heard(self, announce: SeatAnnounce) -> None:
        if announce.instance != self._own:
            self._seen[announce.instance] = (announce, time.monotonic())
            self._listed = None

    def gone(self, instance: str) -> None:
        self._seen.pop(instance, None)
        self._listed = None

    def heard_since(self, t: float) -> bool:
        """Whether any standby announced itself since `t` (time.monotonic())."""
        return any(at >= t for _, at in self._seen.values())

    def current(self) -> list[Standby]:
        """The standbys heard within FORGET_AFTER, by instance (the list is shared: read it)."""
        now = time.monotonic()
        if self._listed is not None and now < self._listed_until:
            return self._listed
        for instance in [i for i, (_, t) in self._seen.items() if now - t > FORGET_AFTER]:
            del self._seen[instance]
        self._listed = [
            Standby(instance=a.instance, pid=a.pid, host=a.host, since=a.since, version=a.version)
            for a, _ in sorted(self._seen.values(), key=lambda s: s[0].instance)
        ]
        self._listed_until = min((t for _, t in self._seen.values()), default=now) + FORGET_AFTER
        return self._listed


async def announce(nc: Client, me: SeatAnnounce, signing: Signing) -> None:
    """A standby's announcements, signed, every ANNOUNCE_EVERY seconds until cancelled."""
    subject = subjects.seat("standby")
    body = wire.encode(me)
    headers = signing.headers(subject, body)
    while True:
        await nc.publish(subject, body, headers=headers)
        await anyio.sleep(ANNOUNCE_EVERY)


RELEASE_KEPT = 60.0  # seconds a holder's `released` is remembered: a takeover follows in ms
HANDING_KEPT = 30.0  # a handover begun this long ago is over: its lock released, or kept
RELEASES_KEPT = 64  # and at most this many (every controller that ever let go is a new name)


class Releases:
    """When (monotonic) each holder was heard letting go of the seat, so the next holder can
    tell a handover from a crash and measure the gap. Bounded: old entries are forgotten."""

    def __init__(self) -> None:
        self._at: dict[str, float] = {}
        # Holders heard beginning a handover: (when, the epoch they said), until they say
        # `held` again (they kept the seat) or HANDING_KEPT passes.
        self._handing: dict[str, tuple[float, int]] = {}

    def __len__(self) -> int:
        return len(self._at)

    def heard(self, instance: str, at: float | None = None) -> None:
        now = time.monotonic() if at is None else at
        self._at.pop(instance, None)
        self._at[instance] = now
        for old in [i for i, t in self._at.items() if now - t > RELEASE_KEPT]:
            del self._at[old]
        while len(self._at) > RELEASES_KEPT:
            del self._at[next(iter(self._at))]  # the oldest

    def begins(self, instance: str, epoch: int) -> None:
        """`instance` announced a handover of the seat it holds at `epoch`."""
        now = time.monotonic()
        self._handing.pop(instance, None)
        self._handing[instance] = (now, epoch)
        while len(self._handing) > RELEASES_KEPT:
            del self._handing[next(iter(self._handing))]  # the oldest

    def kept(self, instance: str) -> None:
        """`instance` holds the seat (again): what it said before of handing over or letting
        go is over. A release remembered past that would make the next takeover from it look
        planned, and a planned one does not close the old holder's connection: the nemesis
        saw a holder cut from NATS 13 s after its previous release, taken over "handed over",
        its subscriptions left on the server, and a status request lost to them."""
        self._handing.pop(instance, None)
        self._at.pop(instance, None)

    def handing(self, instance: str) -> int | None:
        """The epoch `instance` said as it began handing over lately, if it did; forgotten
        once asked."""
        said = self._handing.pop(instance, None)
        if said is None or time.monotonic() - said[0] > HANDING_KEPT:
            return None
        return said[1]

    def take(self, instance: str) -> float | None:
        """When `instance` let go, if heard lately; forgotten once taken."""
        at = self._at.pop(instance, None)
        if at is not None and time.monotonic() - at > RELEASE_KEPT:
            return None
        return at


class SeatEvents:
    """What a controller hears on mesh.seat.mesh-controller.*, signed by the controllers alone:
    standbys announcing themselves, holders taking the seat (`held`) or letting it go
    (`released`, remembered for the next holder's handover)."""

    def __init__(self, *, signing: Signing, standbys: Standbys, released: Releases) -> None:
        self._signing = signing
        self._standbys = standbys
        self._released = released

    async def subscribe(self, nc: Client) -> None:
        await origin.subscribe(nc, subjects.SEAT_EVENTS, cb=self.on_event)

    async def on_event(self, msg: Msg) -> None:
        announce = self._signing.announcement(msg, subscribed=subjects.SEAT_EVENTS)
        if announce is None:
            return
        if msg.subject.endswith(".standby"):
            self._standbys.heard(announce)
        elif msg.subject.endswith((".held", ".released")):
            self._standbys.gone(announce.instance)
            if msg.subject.endswith(".released"):
                self._released.heard(announce.instance)
            else:
                self._released.kept(announce.instance)
        elif msg.subject.endswith(".handover"):
            self._released.begins(announce.instance, announce.epoch)
