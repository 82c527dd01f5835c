"""The nemesis's schedule: a seeded random list of faults, each healed after a random duration.

The same seed gives the same schedule (kinds, roles, waits, durations); which process a role
names (the holder, a standby, a host) is resolved when the fault starts. The first faults are
every kind once, in a seeded order, so that even a short run meets each; then kinds are drawn
by weight. One fault at a time: a violation is then read against one cause.
"""

import random
from dataclasses import dataclass

# kind -> (roles it may target, weight after the first round)
KINDS: dict[str, tuple[tuple[str, ...], int]] = {
    "kill": (("holder", "standby", "host"), 3),  # SIGKILL, started again at the heal
    "pause": (("holder", "standby", "host"), 2),  # SIGSTOP, SIGCONT at the heal
    "cut": (("holder", "standby", "host"), 3),  # its link down at the switch
    "block-nats": (("holder", "standby", "host"), 2),  # routes to every nats-server refused
    "block-store": (("holder", "standby"), 2),  # routes to both PostgreSQL servers refused
    "nats-kill": (("nats",), 2),  # one nats-server SIGKILLed, started again
    "nats-majority": (("nats",), 1),  # two nats-servers SIGKILLed (documented: no quorum)
    "pg-failover": (("store",), 1),  # the primary SIGKILLed, the standby promoted (documented)
}


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the workload started
    kind: str
    role: str
    lasts: float  # seconds until its heal
    pick: int  # which of the role's candidates (a host, a nats-server), modulo their number

    def __str__(self) -> str:
        return f"{self.at:6.1f}s {self.kind} {self.role} for {self.lasts:.1f}s"


def schedule(seed: int, seconds: float, *, gap: tuple[float, float] = (2.0, 5.0),
             lasts: tuple[float, float] = (2.0, 10.0)) -> list[Fault]:  # fmt: skip
    """The faults of a run of `seconds`, from `seed`. Each fault's start is planned after the
    previous one's planned end plus a gap (the run itself waits for a heal to finish)."""
    rng = random.Random(seed)
    first = list(KINDS)
    rng.shuffle(first)
    kinds, weights = list(KINDS), [w for _, w in KINDS.values()]
    faults: list[Fault] = []
    at = rng.uniform(*gap)
    while at < seconds:
        kind = first.pop(0) if first else rng.choices(kinds, weights)[0]
        role = rng.choice(KINDS[kind][0])
        fault = Fault(round(at, 1), kind, role, round(rng.uniform(*lasts), 1), rng.randrange(1000))
        faults.append(fault)
        at += fault.lasts + rng.uniform(*gap)
    return faults
