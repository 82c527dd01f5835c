"""The controller's Prometheus metrics (served by mesh/metrics.py with `--metrics`): a registry
of its own, named as Prometheus names things (units in names, counters ending `_total`).
docs/operations.md ("What operators see: metrics") says what each means.

The holder's view of the fleet (machines, plans) is read when scraped, from the Fleet it holds
and from counts of the store's plans kept fresh by the holder; a standby reports none of it.
"""

import logging
from collections.abc import Iterator
from typing import Protocol, get_args

import anyio
import asyncpg
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from mesh import metrics
from mesh.looplag import LoopLag
from mesh.model import NodeCounts, PlanState
from mesh.store import plans

log = logging.getLogger(__name__)

PLANS_EVERY = 5.0  # seconds between counts of the store's plans
PLAN_STATES: tuple[PlanState, ...] = get_args(PlanState)  # held, paused, cancelled too

REGISTRY = CollectorRegistry()

SEAT_HOLDER = Gauge(
    "mesh_seat_holder", "1 while this controller holds the seat mesh-controller, else 0",
    registry=REGISTRY,
)  # fmt: skip
SEAT_EPOCH = Gauge(
    "mesh_seat_epoch", "The seat's epoch this controller holds, or last held (0: never)",
    registry=REGISTRY,
)  # fmt: skip
HANDOVERS = Counter(
    "mesh_seat_handovers",
    "Times this controller took the seat, by kind: planned (handed over by the holder), "
    "takeover (the holder went without handing over), first (nobody held it before)",
    ["kind"], registry=REGISTRY,
)  # fmt: skip
VERB_ANSWERED = metrics.verbs(REGISTRY)
LOOP_LAG = LoopLag()  # run by the controller's main task group, holder or standby
metrics.loop_lag(REGISTRY, LOOP_LAG)
PLAN_STEP_SECONDS = Histogram(
    "mesh_plan_step_duration_seconds",
    "Time from a plan step's declaration being sent to its machine being done (or failing)",
    ["state"], registry=REGISTRY,
    buckets=(0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300),
)  # fmt: skip
DECLARATIONS_PUBLISHED = Counter(
    "mesh_declarations_published",
    "Declarations this controller put in the KV bucket mesh-declarations",
    registry=REGISTRY,
)  # fmt: skip
EVENTS_PRUNED = Counter(
    "mesh_events_pruned", "Events this controller deleted from the store as their holder, by "
    "reason: age (older than --events-max-age), count (beyond --events-max-count)",
    ["reason"], registry=REGISTRY,
)  # fmt: skip
BUNDLES_PRUNED = Counter(
    "mesh_bundles_pruned", "Bundles and source archives this controller deleted from the bundle "
    "store as their holder: of versions past each module's newest --versions-kept",
    registry=REGISTRY,
)  # fmt: skip
BUILDS = Counter(
    "mesh_builds", "Builds this controller asked of a builder host, by outcome "
    "(built, failed, no_answer)", ["outcome"], registry=REGISTRY,
)  # fmt: skip


class Counted(Protocol):
    """What the gauges read of the holder's fleet (services/controller/fleet/fleet.py)."""

    def counts(self) -> NodeCounts: ...

    def drained_count(self) -> int: ...


class Held(Collector):
    """What only the holder knows, read when scraped: machines by state, plans by state."""

    def __init__(self) -> None:
        self.fleet: Counted | None = None
        self.plans: dict[str, int] | None = None
        self.soaking = 0  # plans whose canaries (or a whole tier) are soaking now

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.fleet is None:
            return
        counts = self.fleet.counts()
        machines = GaugeMetricFamily(
            "mesh_machines", "Machines the holder knows, by state (up, down)", labels=["state"]
        )
        machines.add_metric(["up"], counts.up)
        machines.add_metric(["down"], counts.down)
        yield machines
        yield GaugeMetricFamily(
            "mesh_machines_drained", "Machines drained out of every plan (mesh drain), up or down",
            value=self.fleet.drained_count(),
        )  # fmt: skip
        if self.plans is None:
            return
        by_state = GaugeMetricFamily("mesh_plans", "Plans in the store, by state", labels=["state"])
        for state in PLAN_STATES:
            by_state.add_metric([state], self.plans.get(state, 0))
        yield by_state
        yield GaugeMetricFamily(
            "mesh_plans_soaking", "Plans rolling whose canaries (or, without canaries, a whole "
            "tier) are soaking now: counted as rolling in mesh_plans too", value=self.soaking,
        )  # fmt: skip

    async def holding(self, fleet: Counted, pool: asyncpg.Pool) -> None:
        """While this controller holds the seat (cancelled when it stops): report `fleet`,
        and count the store's plans every PLANS_EVERY seconds."""
        self.fleet = fleet
        try:
            while True:
                try:
                    self.plans = await plans.counts(pool)
                    self.soaking = await plans.soaking(pool)
                except (OSError, asyncpg.PostgresError) as e:
                    log.warning("metrics: could not count plans: %s", e)
                await anyio.sleep(PLANS_EVERY)
        finally:
            self.fleet = self.plans = None


HELD = Held()
REGISTRY.register(HELD)


def took_seat(epoch: int, *, planned: bool, previous: str | None) -> None:
    SEAT_HOLDER.set(1)
    SEAT_EPOCH.set(epoch)
    HANDOVERS.labels("planned" if planned else "takeover" if previous else "first").inc()


def left_seat() -> None:
    SEAT_HOLDER.set(0)
