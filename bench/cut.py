"""Benchmark: the holder cut off while its process lives (issue 29), `--cuts` times each kind.

On the network-namespace mesh of tests/netmesh.py (3 nats-servers in a TLS cluster,
PostgreSQL, 2 controllers, 3 hosts, each in a namespace of its own; root only), the holder is
cut off from NATS only (routes to the nats-servers refused in its namespace), from the store
only (the route to PostgreSQL refused), or from both (its link down at the switch). Through
each cut the real command line, `mesh --json status` with its defaults (--timeout 5), starts
every 0.5 s, and a bus probe asks `status` every 0.1 s (each once, 1 s): tests/cutting.py.
After each cut the link is restored and the old holder, which stepped down and exited, is
started again to stand by.

It prints each cut, then per kind the gap from the cut to the new holder's first answer
(median and max, as the bus probe saw it and as the command line did, which adds its own
start) and the command lines that got no answer. The aim (issue 29): none unanswered, the
probe's median gap within 3 s. It never fails on a timing (docs/performance.md).

    sudo .venv/bin/python bench/cut.py [--cuts 10] [--kinds nats,store,both]
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the namespace mesh and the cut are the tests' own
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import netns  # noqa: E402
from common import secrets_key_file  # noqa: E402
from conftest import Procs  # noqa: E402
from cutting import KINDS, Cut, cut_once, stand_by_again, summary  # noqa: E402
from netmesh import MEMBERS, NetMesh, started  # noqa: E402


def _figures(gaps: list[float | None]) -> str:
    got = [g for g in gaps if g is not None]
    if not got:
        return "no answer by a new holder"
    missing = f", {len(gaps) - len(got)} without one" if len(got) < len(gaps) else ""
    return f"median {statistics.median(got):.2f}s, max {max(got):.2f}s{missing}"


async def bench(args: argparse.Namespace, folder: Path) -> dict[str, list[Cut]]:
    cuts: dict[str, list[Cut]] = {kind: [] for kind in args.kinds}
    procs = Procs(folder)
    with netns.network(MEMBERS) as net, net.inside("client"):
        m = NetMesh(net, procs, folder)
        os.environ["MESH_CA"] = m.ca
        os.environ.pop("MESH_CREDS", None)
        os.environ["MESH_SECRETS_KEY_FILE"] = secrets_key_file(folder)
        try:
            nc = await started(m)
            try:
                for i in range(args.cuts):
                    for kind in args.kinds:
                        cut = await cut_once(m, nc, kind)
                        cuts[kind].append(cut)
                        print(f"cut {i + 1}/{args.cuts} {summary(cut)}", flush=True)
                        await stand_by_again(m, nc, cut.holder)
            finally:
                await nc.close()
        finally:
            procs.kill_all()
            m.stop_postgres()
    return cuts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuts", type=int, default=10, help="cuts of each kind (10)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="nats,store,both")
    args = parser.parse_args()
    args.kinds = [k for k in args.kinds.split(",") if k]
    if bad := [k for k in args.kinds if k not in KINDS]:
        sys.exit(f"bench/cut.py: --kinds: {bad[0]!r} is not one of {', '.join(KINDS)}")
    if why := netns.unavailable():
        sys.exit(f"bench/cut.py: {why}")
    folder = Path(f"/tmp/mesh-bench-cut-{os.getpid()}")
    folder.mkdir()
    started_at = time.monotonic()
    cuts = anyio.run(bench, args, folder)
    print(f"\n{args.cuts} cut(s) of each kind in {time.monotonic() - started_at:.0f}s, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")  # fmt: skip
    for kind, done in cuts.items():
        lost = sum(len(c.unanswered()) for c in done)
        asked = sum(len(c.answers) for c in done)
        skipped = sum(c.skipped for c in done)
        baseline = statistics.median(c.baseline for c in done) if done else 0.0
        busy = f"; {skipped} not started, the machine too busy" if skipped else ""
        print(f"{kind:>5}: gap {_figures([c.gap(probes=True) for c in done])} (bus probe); "
              f"{_figures([c.gap() for c in done])} (command line); "
              f"{lost} of {asked} status unanswered{busy}; a command line alone took "
              f"{baseline:.2f}s (median, before the cuts)")  # fmt: skip


if __name__ == "__main__":
    main()
