"""Which process holds a listening TCP port, read from /proc: a tcp or http check must be answered
by the process it checks, not by an old version or the container it replaces listening on the
same port (that would remove the container while nothing of ours serves), nor by another machine's
process sharing the port (`mesh dev up`'s hosts are one machine)."""

import os
from collections.abc import Sequence
from pathlib import Path


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(inode)
    return inodes


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[3]) == sid:  # field 6: session id
            pids.append(int(entry))
    return pids


def held_by_session(port: int, sid: int) -> bool:
    """Whether a process of session `sid` (a supervised process and what it started) listens
    on `port`."""
    wanted = _listening_inodes(port)
    return bool(wanted and _held(wanted, sid))


def listeners(port: int, sid: int, *, kin: Sequence[int] = ()) -> tuple[bool, bool]:
    """Whether session `sid` listens on `port`, and whether anything but it and the sessions
    `kin` does too (a socket shared with SO_REUSEPORT, or the port on another address): a
    connection may reach either."""
    wanted = _listening_inodes(port)
    mine = _held(wanted, sid) if wanted else set()
    known = set(mine)
    for other in kin:
        known |= _held(wanted - known, other) if wanted - known else set()
    return bool(mine), bool(wanted - known)


def _held(inodes: set[str], sid: int) -> set[str]:
    """Those of `inodes` a process of session `sid` holds."""
    found: set[str] = set()
    for pid in _session_pids(sid):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                found.add(target[8:-1])
    return found
