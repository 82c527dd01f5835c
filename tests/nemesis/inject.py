"""The nemesis's faults done and healed on the cluster (tests/nemesis/cluster.py), each recorded
in the history with the process or server its role named when it started."""

import os
import signal

import anyio

from .cluster import CONTROLLERS, HOSTS, NATS, Cluster
from .schedule import Fault


class Injector:
    def __init__(self, cluster: Cluster) -> None:
        self.c = cluster
        self.holder: str | None = None  # the holder the last status answer named (workload)

    def target(self, fault: Fault) -> str:
        holder = self.holder if self.holder in CONTROLLERS else CONTROLLERS[fault.pick % 2]
        match fault.role:
            case "holder":
                return holder
            case "standby":
                return next(c for c in CONTROLLERS if c != holder)
            case "host":
                return HOSTS[fault.pick % len(HOSTS)]
            case "nats":
                return NATS[fault.pick % len(NATS)]
            case _:
                return self.c.primary

    async def run(self, fault: Fault) -> None:
        """Start `fault`, wait its duration, heal it; the history says when each happened."""
        target = self.target(fault)
        fid = self.c.history.next_id()
        start = getattr(self, "_" + fault.kind.replace("-", "_"))
        self.c.history.add("fault", phase="start", id=fid, kind=fault.kind, role=fault.role,
                           target=target, lasts=fault.lasts)  # fmt: skip
        heal = await start(target)
        await anyio.sleep(fault.lasts)  # ok: the fault's planned duration
        after = await heal()
        self.c.history.add("fault", phase="end", id=fid, kind=fault.kind, target=target)
        if after is not None:
            await after()

    def _signal(self, name: str, sig: signal.Signals) -> None:
        try:
            os.kill(self.c.procs[name].pid, sig)
        except ProcessLookupError:
            pass

    async def _kill(self, target: str):
        self.c.down.add(target)
        self._signal(target, signal.SIGKILL)
        await anyio.to_thread.run_sync(self.c.procs[target].wait)

        async def heal() -> None:
            self.c.restart(target)
            self.c.down.discard(target)

        return heal

    async def _pause(self, target: str):
        self.c.down.add(target)  # stopped, it has not exited: nothing for the supervisor
        self._signal(target, signal.SIGSTOP)

        async def heal() -> None:
            self._signal(target, signal.SIGCONT)
            self.c.down.discard(target)

        return heal

    async def _cut(self, target: str):
        self.c.net.cut(target)

        async def heal() -> None:
            self.c.net.restore(target)

        return heal

    async def _blocked(self, target: str, addresses: list[str]):
        self.c.net.block(target, addresses)

        async def heal() -> None:
            self.c.net.unblock(target, addresses)

        return heal

    async def _block_nats(self, target: str):
        return await self._blocked(target, [self.c.net.address(n) for n in NATS])

    async def _block_store(self, target: str):
        return await self._blocked(target, list(self.c.pg.values()))

    async def _servers_killed(self, names: list[str]):
        for name in names:
            self._signal(name, signal.SIGKILL)
            await anyio.to_thread.run_sync(self.c.procs[name].wait)

        async def heal() -> None:
            for name in names:
                self.c.run_nats(name)
            for name in names:
                await self.c.nats_healthy(name)

        return heal

    async def _nats_kill(self, target: str):
        return await self._servers_killed([target])

    async def _nats_majority(self, target: str):
        other = NATS[(NATS.index(target) + 1) % len(NATS)]
        return await self._servers_killed([target, other])

    async def _pg_failover(self, target: str):
        """The primary's machine dies (its whole process group); the heal is the HA manager's
        promotion of the standby, after the fault's duration (its decision time). The store is
        back then: the fault ends; the old primary is copied again as the new one's
        synchronous standby after that (recorded as a note)."""
        self.c.down.add(target)
        try:
            os.killpg(self.c.procs[target].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await anyio.to_thread.run_sync(self.c.procs[target].wait)

        async def heal():
            await self.c.promote()

            async def rebuild() -> None:
                await self.c.copy_standby(target, of=self.c.primary)
                self.c.down.discard(target)
                self.c.history.add("note", what=f"{target} copied again from {self.c.primary}, "
                                   "its synchronous standby")  # fmt: skip

            return rebuild

        return heal
