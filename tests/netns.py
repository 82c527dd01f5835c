"""Machines with their own network, for tests: a switch and N network namespaces.

The switch is a bridge inside a namespace of its own, so nothing here touches the host's
network: every member namespace has loopback up and one veth (`eth0` inside, `v<i>` on the
switch) with its own address in a private /24 (10.213.X.0/24, X picked so that no interface of
the root namespace has it). Names start with `meshtest-<pid in hex><random>-`, so a leftover is
recognisable, its session known, and concurrent sessions never collide; `remove_stale` removes
the leftovers of sessions whose process is gone.

A process runs inside a member with `argv(member, [...])` (`ip netns exec`), or is forked from
inside it with `inside(member)`, which moves the calling thread (setns) and back: a child
inherits the namespace of the thread that forks it, even one that drops root (PostgreSQL), and
the sockets the thread opens while inside belong to it too (a test's own clients).

Faults: `cut` takes a member's link down at the switch (a pulled cable: packets vanish, nothing
is told), `restore` brings it back; `block` adds `prohibit` routes inside a member towards some
addresses only (say the NATS servers, not PostgreSQL), `unblock` removes them. No iptables.

Root only: `unavailable()` says why a test must skip (not root, no `ip`, `ip netns add` refused
as in an unprivileged container).
"""

import contextlib
import ctypes
import ipaddress
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

PREFIX = "meshtest-"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsError(Exception):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


def namespaces() -> list[str]:
    done = _ip("netns", "list", check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"{PREFIX}{os.getpid():x}{secrets.token_hex(2)}-probe"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"`ip netns add` was refused: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def remove_stale() -> list[str]:
    """Remove the namespaces left by sessions of this harness whose process is gone."""
    removed = []
    for name in namespaces():
        found = re.fullmatch(rf"{PREFIX}([0-9a-f]+)[0-9a-f]{{4}}-.*", name)
        if not found:
            continue
        try:
            os.kill(int(found.group(1), 16), 0)
            continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _ip("netns", "del", name, check=False)
        removed.append(name)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    used = [
        ipaddress.ip_interface(addr).network
        for addr in re.findall(r"inet (\S+)", _ip("-4", "addr", "show").stdout)
    ]
    for x in [*secrets.SystemRandom().sample(range(1, 255), 254)]:
        net = ipaddress.ip_network(f"10.213.{x}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetnsError("no free 10.213.X.0/24 subnet")


class Network:
    """A switch and one namespace per member, each with its own address on the switch."""

    def __init__(self, members: list[str]) -> None:
        self.session = f"{PREFIX}{os.getpid():x}{secrets.token_hex(2)}"
        self.switch = f"{self.session}-sw"
        self.subnet = _free_subnet()
        hosts = list(self.subnet.hosts())
        self.members = {m: i for i, m in enumerate(members, start=1)}
        self.addresses = {m: str(hosts[10 + i]) for m, i in self.members.items()}
        self._made: list[str] = []

    def ns(self, member: str) -> str:
        return f"{self.session}-{member}"

    def address(self, member: str) -> str:
        return self.addresses[member]

    def _port(self, member: str) -> str:
        return f"v{self.members[member]}"

    def create(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for member in self.members:
            ns, port = self.ns(member), self._port(member)
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "add", port, "type", "veth",
                "peer", "name", "eth0", "netns", ns)  # fmt: skip
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            prefix = self.subnet.prefixlen
            _ip("-n", ns, "addr", "add", f"{self.addresses[member]}/{prefix}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def remove(self) -> None:
        """Every namespace made (their interfaces go with them); never raises."""
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    # --- running things inside ---------------------------------------------------------------

    def argv(self, member: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(member), *argv]

    def run(self, member: str, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(member, list(argv)), capture_output=True, text=True,
                              timeout=30)  # fmt: skip

    @contextlib.contextmanager
    def inside(self, member: str) -> Iterator[None]:
        """The calling thread in `member`'s namespace for the block, then back where it was."""
        back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            there = os.open(Path("/run/netns") / self.ns(member), os.O_RDONLY)
            try:
                _setns(there)
            finally:
                os.close(there)
            try:
                yield
            finally:
                _setns(back)
        finally:
            os.close(back)

    def peers(self, member: str, port: int) -> set[str]:
        """The addresses `member` has established TCP connections to, on remote `port`."""
        out = self.run(member, "ss", "-Htn", "state", "established").stdout
        found = set()
        for line in out.splitlines():
            fields = line.split()
            if len(fields) >= 4:
                host, _, remote = fields[3].rpartition(":")
                if remote == str(port):
                    found.add(host.strip("[]"))
        return found

    # --- faults ------------------------------------------------------------------------------

    def cut(self, member: str) -> None:
        """Take `member`'s link down at the switch: its packets vanish both ways."""
        _ip("-n", self.switch, "link", "set", self._port(member), "down")

    def restore(self, member: str) -> None:
        _ip("-n", self.switch, "link", "set", self._port(member), "up")

    def block(self, member: str, addresses: list[str]) -> None:
        """Inside `member`, refuse to route to `addresses` (the rest of the network stays)."""
        for addr in addresses:
            _ip("-n", self.ns(member), "route", "add", "prohibit", f"{addr}/32")

    def unblock(self, member: str, addresses: list[str]) -> None:
        for addr in addresses:
            _ip("-n", self.ns(member), "route", "del", "prohibit", f"{addr}/32", check=False)


@contextlib.contextmanager
def network(members: list[str]) -> Iterator[Network]:
    """A Network made for the block and removed after it, whatever happens."""
    remove_stale()
    net = Network(members)
    try:
        net.create()
        yield net
    finally:
        net.remove()
