"""Benchmark: composing every machine's declaration (prepare, merge, encode), for a large fleet.

What it measures: the controller's pure CPU work of turning modules into declarations, in one
process, with no bus, no store and no I/O. A pool of `--pool` modules (default 60) is built
directly as `Manifest` Structs (mesh/modules/manifest.py), each checked once by the registration
gate (not timed) and wrapped in a `ModuleVersion`. The mix is meant to look like a real fleet:
each module has 1-3 processes (files, binary, python and system bundles; tcp, http, exec and nats
checks; env, text files and secret files, some prepare steps, some `replaces`), 1-2 accounts of
its own, and about half the modules also declare one of a few shared accounts with identical
settings (which composition merges); a few modules add a third-party container. Process names,
container names and tcp check ports are unique per module, so no machine has a conflict.

Each of `--machines` machines (default 10,000) gets `--modules-per-machine` modules (default 20)
drawn from the pool with a seeded random (the same run for the same flags). The timed part is
what the controller does when it recomposes a fleet: `prepare()` each module version once (its
pieces and their canonical bytes), then per machine `merge()` (conflict checks) and `encode()`
(the canonical JSON bytes + sha256). Choosing the modules is not timed.
The script prints the total, the mean,
p50, p99 and max per machine in µs, and whether the aim is met: all machines composed in under
one second (on the 2-core VM of docs/performance.md). It never fails on a timing.

    .venv/bin/python bench/compose.py [--machines 10000] [--modules-per-machine 20] [--pool 60]
                                      [--seed 1] [--profile]

`--profile` runs the timed loop once more under cProfile and prints where the time goes. The
script also reads from `/proc/stat` how many cores anything else kept busy during the timed run
("others"); above 0.15 it prints a warning: the figures are disturbed, run again.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import io
import os
import platform
import pstats
import random
import statistics
import time

import msgspec

from mesh.modules.compose import ModuleVersion, Prepared, canonical, compose, encode, merge, prepare
from mesh.modules.gate import check
from mesh.modules.manifest import (
    Account,
    Assign,
    Bundle,
    Check,
    Container,
    File,
    Manifest,
    ModuleHead,
    Process,
)

AIM_SECONDS = 1.0
BUSY_OTHERS = 0.15  # cores used by other processes above which a run is flagged as disturbed

# Accounts several modules declare identically (merged by composition, never a conflict).
SHARED_ACCOUNTS = {
    "metrics": Account(home="/var/lib/metrics", privileged_groups=["adm"]),
    "logship": Account(home="/var/lib/logship", privileged_groups=["adm", "systemd-journal"]),
    "backup": Account(home="/var/backups/mesh"),
}


def _sha(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def make_module(index: int, rng: random.Random) -> ModuleVersion:
    """One realistic module `mod-NN`: 1-2 own accounts, maybe a shared one, 1-3 processes."""
    name = f"mod-{index:03d}"
    own = f"m{index:03d}"
    accounts = {own: Account(home=f"/var/lib/{name}")}
    if rng.random() < 0.3:
        accounts[f"{own}-ro"] = Account(home=f"/var/lib/{name}-ro", groups=[own])
    if rng.random() < 0.5:
        shared = rng.choice(sorted(SHARED_ACCOUNTS))
        accounts[shared] = SHARED_ACCOUNTS[shared]
    account_names = sorted(accounts)

    bundles: dict[str, Bundle] = {}
    digests: dict[str, str] = {}
    processes: dict[str, Process] = {}
    containers: dict[str, Container] = {}
    for k in range(rng.randint(1, 3)):
        pname = f"{name}-p{k}"
        kind = rng.choice(["files", "binary", "python", "python", "system"])
        bname = f"b{k}"
        if kind == "system":
            bundles[bname] = Bundle(kind="system", path="/usr/bin")
            command = ["/usr/bin/env", f"{pname}-agent", "--listen", f"127.0.0.1:{20000 + k}"]
        elif kind == "binary":
            bundles[bname] = Bundle(
                kind="binary", source="cmd", build=["make", "release"], output=f"out/{pname}"
            )
            digests[bname] = _sha(f"{name}/{bname}/binary")
            command = [f"./{pname}", "--config", "app.conf", "--port", str(20000 + k)]
        else:
            bundles[bname] = Bundle(kind=kind, source=f"src/{bname}")
            digests[bname] = _sha(f"{name}/{bname}/{kind}")
            command = ["python3", "-m", f"{own}_p{k}", "--port", str(20000 + k)]
        env = {f"{own.upper()}_VAR{v}": f"value-{index}-{k}-{v}" for v in range(rng.randint(2, 6))}
        env["MESH_NATS_URL"] = "nats://127.0.0.1:4222"
        files = {"app.conf": File(text=f"# {pname}\nport = {20000 + k}\nlevel = info\n" * 3)}
        for s in range(rng.randint(0, 2)):
            files[f"secrets/token-{s}"] = File(secret=f"{name}-token-{s}", mode="0400")
        if rng.random() < 0.3:
            files["tls/ca.pem"] = File(
                text="-----BEGIN CERTIFICATE-----\n" + "A" * 600, mode="0444"
            )
        port = 10000 + index * 10 + k  # unique per module and process: never a port conflict
        check_kind = rng.choice(["tcp", "tcp", "tcp", "http", "exec", "nats"])
        if check_kind == "tcp":
            chk = Check(tcp=port, every="2s", passes=2)
        elif check_kind == "http":
            chk = Check(http=f"http://127.0.0.1:{port}/health", every="5s", timeout="2s")
        elif check_kind == "exec":
            chk = Check(exec=[f"./{pname}", "health"], every="10s", passes=3)
        else:
            chk = Check(nats=f"{name}.p{k}.health", every="1s")
        processes[pname] = Process(
            command=command,
            bundle=bname,
            account=rng.choice(account_names),
            env=env,
            files=files,
            prepare=[f"./{pname}", "migrate"] if rng.random() < 0.3 else None,
            restart=rng.choice(["always", "always", "on-failure"]),
            check=chk,
            update=rng.choice(["start-first", "stop-first"]),
            replaces=f"{pname}-legacy" if rng.random() < 0.1 else None,
        )
    if rng.random() < 0.15:
        containers[f"{name}-cache"] = Container(
            image="docker.io/library/redis:7",
            command=["redis-server", "--save", ""],
            ports=[f"{30000 + index}:6379"],
        )
    manifest = Manifest(
        module=ModuleHead(name=name, description=f"benchmark module {index}"),
        bundle=bundles,
        account=accounts,
        process=processes,
        container=containers,
        assign=Assign(tiers=[2]),
    )
    check(manifest)  # the gate's rules: the pool is made of modules a push would accept
    version = _sha(msgspec.json.encode(manifest).decode())
    return ModuleVersion(name=name, version=version, manifest=manifest, bundles=digests)


def make_fleet(
    *, machines: int, per_machine: int, pool: int, seed: int
) -> tuple[list[ModuleVersion], list[tuple[str, list[ModuleVersion]]], dict[str, int]]:
    rng = random.Random(seed)
    modules = [make_module(i, rng) for i in range(pool)]
    secrets = {
        f.secret: rng.randint(1, 5)
        for mv in modules
        for p in mv.manifest.process.values()
        for f in p.files.values()
        if f.secret
    }
    fleet = [(f"node-{n + 1}", rng.sample(modules, per_machine)) for n in range(machines)]
    return modules, fleet, secrets


def run(
    fleet: list[tuple[str, list[ModuleVersion]]], secrets: dict[str, int]
) -> tuple[float, list[int], int, int, int]:
    """Compose + digest every machine: (total s, ns per machine, bytes, processes, gc runs)."""
    per: list[int] = []
    collections = sum(s["collections"] for s in gc.get_stats())
    size = processes = 0
    clock = time.perf_counter_ns
    start = clock()
    prepared: dict[str, Prepared] = {}
    for _, modules in fleet:
        for mv in modules:
            if mv.name not in prepared:
                prepared[mv.name] = prepare(mv, secrets)
    for machine, modules in fleet:
        t0 = clock()
        merged = merge(machine, [prepared[mv.name] for mv in modules])
        encode(merged)
        per.append(clock() - t0)
        processes += len(merged.processes)
    total = (clock() - start) / 1e9
    collections = sum(s["collections"] for s in gc.get_stats()) - collections
    # Sizes outside the timed loop (one more encode per machine would skew the figures).
    for machine, modules in fleet[:100]:
        size += len(canonical(compose(machine, modules, secrets)))
    return total, per, size, processes, collections


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--machines", type=int, default=10_000)
    parser.add_argument("--modules-per-machine", type=int, default=20)
    parser.add_argument("--pool", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="also run once under cProfile")
    args = parser.parse_args()
    if args.modules_per_machine > args.pool:
        parser.error("--modules-per-machine must not exceed --pool")

    modules, fleet, secrets = make_fleet(
        machines=args.machines, per_machine=args.modules_per_machine, pool=args.pool, seed=args.seed
    )
    n_proc = sum(len(m.manifest.process) for m in modules)
    n_acct = sum(len(m.manifest.account) for m in modules)
    n_file = sum(len(p.files) for m in modules for p in m.manifest.process.values())
    print(
        f"machine: {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"msgspec {msgspec.__version__}, load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"fleet: {args.machines} machines x {args.modules_per_machine} modules from a pool of "
        f"{args.pool} ({n_proc} processes, {n_acct} accounts, {n_file} files, "
        f"{len(secrets)} secrets in the pool; seed {args.seed})"
    )

    run(fleet[: min(200, len(fleet))], secrets)  # warm up
    busy0, own0, wall0 = busy_seconds(), time.process_time(), time.perf_counter()
    total, per, size, processes, collections = run(fleet, secrets)
    wall = time.perf_counter() - wall0
    others = max(0.0, (busy_seconds() - busy0) - (time.process_time() - own0)) / wall
    us = [ns / 1000 for ns in per]
    print(
        f"declarations: {processes / len(fleet):.1f} processes per machine on average, "
        f"{size / min(100, len(fleet)) / 1024:.1f} KiB of canonical JSON each (first 100)"
    )
    print(
        f"compose + digest: total {total:.3f} s for {len(fleet)} machines; per machine "
        f"mean {statistics.fmean(us):.0f} µs, p50 {percentile(per, 0.50) / 1000:.0f} µs, "
        f"p99 {percentile(per, 0.99) / 1000:.0f} µs, max {max(us):.0f} µs "
        f"({collections} gc collections during the run)"
    )
    print(f"others: {others:.2f} cores busy with other work during the run")
    if others > BUSY_OTHERS:
        print(f"warning: other work used {others:.2f} cores (> {BUSY_OTHERS}): run again")
    met = total < AIM_SECONDS
    print(
        f"aim: all {len(fleet)} machines in under {AIM_SECONDS:.0f} s: "
        f"{'met' if met else 'NOT met'} ({total:.3f} s)"
    )

    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        run(fleet, secrets)
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
        print(out.getvalue())


if __name__ == "__main__":
    main()
