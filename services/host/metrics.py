"""The host agent's Prometheus metrics (served by mesh/metrics.py with `--metrics`): a registry
of its own, named as Prometheus names things. docs/operations.md ("What operators see:
metrics") says what each means. Processes are read from the supervisor when scraped.
"""

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, Info
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from mesh import metrics
from mesh.model import ProcessState, ProcessStatus

REGISTRY = CollectorRegistry()

VERB_ANSWERED = metrics.verbs(REGISTRY)
RESTARTS = Counter(
    "mesh_host_process_restarts", "Restarts of a process by its restart policy",
    ["process"], registry=REGISTRY,
)  # fmt: skip
CHECKS = Counter(
    "mesh_host_checks", "A process's check results, by result (pass, fail)",
    ["process", "result"], registry=REGISTRY,
)  # fmt: skip
APPLY_SECONDS = Histogram(
    "mesh_host_apply_duration_seconds", "Time an apply of a new declaration took, by outcome "
    "(ok, failed)", ["outcome"], registry=REGISTRY,
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)  # fmt: skip
APPLY_FAILURES = Counter(
    "mesh_host_apply_failures", "Applies that stopped, by the kind of step that failed (limits, "
    "account, bundle, file, containers, prepare, processes, tools, replaces, agent, apply)",
    ["step"], registry=REGISTRY,
)  # fmt: skip
OOM_KILLS = Counter(
    "mesh_host_process_oom_kills", "Processes the kernel killed in a process's cgroup for its "
    "memory limit (memory_max)", ["process"], registry=REGISTRY,
)  # fmt: skip
BUNDLE_FETCHES = Counter(
    "mesh_host_bundle_fetches", "Bundles fetched from the object store, by outcome (ok, failed)",
    ["outcome"], registry=REGISTRY,
)  # fmt: skip
BUNDLE_BYTES = Counter(
    "mesh_host_bundle_fetched_bytes", "Bytes of bundles fetched from the object store",
    registry=REGISTRY,
)  # fmt: skip
DECLARATION = Info(
    "mesh_host_declaration", "The declaration this host applied last: its digest and epoch",
    registry=REGISTRY,
)  # fmt: skip


def applied(digest: str, epoch: int) -> None:
    DECLARATION.info({"digest": digest, "epoch": str(epoch)})


class Processes(Collector):
    """The supervisor's processes, read when scraped: how many in each state, and whether each
    is healthy."""

    def __init__(self) -> None:
        self.states: Callable[[], list[ProcessState]] | None = None
        # Each running process's CPU seconds (its current instance's, cgroup and children).
        self.cpu_seconds: Callable[[], dict[str, float]] = dict

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.states is None:
            return
        now = [p for p in self.states() if not p.trial]
        by_state = GaugeMetricFamily(
            "mesh_host_processes", "Processes by state (starting, running, restarting, exited, "
            "failed, stopped)", labels=["state"],
        )  # fmt: skip
        counts: dict[ProcessStatus, int] = {"running": 0}
        for p in now:
            counts[p.state] = counts.get(p.state, 0) + 1
        for state, n in sorted(counts.items()):
            by_state.add_metric([state], n)
        yield by_state
        healthy = GaugeMetricFamily(
            "mesh_host_process_healthy", "1 if a process passes its check (or has none and "
            "runs), else 0", labels=["process"],
        )  # fmt: skip
        for p in now:
            healthy.add_metric([p.name], 1 if p.healthy else 0)
        yield healthy
        memory = GaugeMetricFamily(
            "mesh_host_process_memory_bytes", "Memory a running process uses (its cgroup's, "
            "less the page cache it may give back)", labels=["process"],
        )  # fmt: skip
        for p in now:
            if p.memory is not None and p.pid is not None:
                memory.add_metric([p.name], p.memory)
        yield memory
        cpu = GaugeMetricFamily(
            "mesh_host_process_cpu_seconds", "CPU seconds a running process (its current "
            "instance and its children) has used", labels=["process"],
        )  # fmt: skip
        for name, seconds in sorted(self.cpu_seconds().items()):
            cpu.add_metric([name], seconds)
        yield cpu


PROCESSES = Processes()
REGISTRY.register(PROCESSES)
