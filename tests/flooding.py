"""A host flooding its own subjects, as the attack on `mesh dev up` did (issue 39, item 5): with a
host's real credentials, registrations (each with another pid), beats or reports, published as
fast as one process can, for a number of seconds. Run as a process of its own, so the flood does
not share an event loop (nor the GIL) with the test that watches the holder:

    python tests/flooding.py --url URL --creds FILE --name node-2 --kind beats --seconds 20

It prints one JSON line at its end: how many messages it published."""

import argparse
import asyncio
import itertools
import json
import time

from mesh import bus, subjects, wire
from mesh.auth import creds as credentials
from mesh.model import Applied, Beat, Facts, ProcessesEvent, ProcessState, Register

KINDS = ("registrations", "beats", "events")
FACTS = Facts(os="linux", arch="x86_64", cpus=1, memory=1 << 30, mesh_version="flood")
YIELD_EVERY = 200  # messages between turns of the loop: nats-py's flusher gets to write


def messages(kind: str, name: str, inbox: str):
    """(subject, body, reply) for ever: each registration another pid (never the one the holder
    remembers), each beat another seq, reports alternating failed applies and processes."""
    for n in itertools.count():
        if kind == "registrations":
            req = Register(name=name, tier=None, labels={}, facts=FACTS, beat_interval=1.0,
                           pid=100_000 + n)  # fmt: skip
            yield subjects.ctl_host(name, "register"), wire.encode(req), f"{inbox}.{n}"
        elif kind == "beats":
            yield subjects.host(name, "beat"), wire.encode(Beat(name=name, seq=n, interval=1.0)), ""
        elif n % 2:
            failed = Applied(name=name, digest="sha256:" + "0" * 64, epoch=1, ok=False,
                             step="prepare", error=f"flood {n}")  # fmt: skip
            yield subjects.event(name, "applied"), wire.encode(failed), ""
        else:
            state = ProcessState(name="flood", state="running", healthy=True, pid=n)
            report = ProcessesEvent(name=name, processes=[state])
            yield subjects.event(name, "processes"), wire.encode(report), ""


async def flood(url: str, creds: str, name: str, kind: str, seconds: float) -> int:
    nc = await bus.connect(url, name=f"flood {kind}", creds=creds, reconnect=False)
    inbox = credentials.read(creds).inbox
    sent = 0
    until = time.monotonic() + seconds
    try:
        for subject, body, reply in messages(kind, name, inbox):
            await nc.publish(subject, body, reply=reply)
            sent += 1
            if sent % YIELD_EVERY == 0:
                await asyncio.sleep(0)
                if time.monotonic() >= until:
                    break
        await nc.flush(timeout=10)
    finally:
        await nc.close()
    return sent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", required=True)
    p.add_argument("--creds", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--kind", choices=KINDS, required=True)
    p.add_argument("--seconds", type=float, default=20.0)
    args = p.parse_args()
    sent = asyncio.run(flood(args.url, args.creds, args.name, args.kind, args.seconds))
    print(json.dumps({"kind": args.kind, "sent": sent, "seconds": args.seconds}), flush=True)


if __name__ == "__main__":
    main()
