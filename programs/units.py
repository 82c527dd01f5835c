"""systemd units for the pieces of a mesh: each nats-server, PostgreSQL (and its TLS front, where
its programs lack SSL) and the host agent that `mesh init` starts, and the host of a machine
`mesh machine add` admits.

A unit is written from what the piece is started with (mesh.embedded.children records argv,
environment, working folder and account at spawn), never from a shell string. `ExecStart=` is
quoted by systemd's rules (systemd.service(5), "Command lines"): every word in double quotes with
C escapes, `$` doubled (no variable expansion) and `%` doubled (no specifier), so the argv
systemd runs is the argv given; `split` reads a line back the way systemd does, for tests.

The host agent's unit is `Type=notify` (the agent says READY=1 once registered), `NotifyAccess=all`
and `KillMode=process`: its processes are not the unit's to stop, and a new version of the agent,
started by the old one, tells systemd `MAINPID=` (services/host/successor.py).
"""

import os
import pwd
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec

from mesh.embedded.children import Child
from mesh.errors import MeshError

SYSTEM_UNITS = Path("/etc/systemd/system")
# What a piece's environment carries into its unit: the mesh's own settings and how programs are
# found; not the rest of the shell's (a terminal, an agent socket) that `mesh init` ran in.
_KEPT = ("PATH", "PYTHONUNBUFFERED")
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r", "%": "%%"}


class UnitError(MeshError):
    pass


class Unit(msgspec.Struct, frozen=True):
    name: str  # the unit's file name: mesh-host-node-1.service
    description: str
    argv: list[str]
    env: dict[str, str] = {}
    user: str | None = None  # None: root
    cwd: str | None = None
    agent: bool = False  # the host agent: Type=notify, KillMode=process, after the network
    after: list[str] = []  # units of this machine started before it (the host: its servers)
    kill_signal: str | None = None  # PostgreSQL: SIGINT, its fast shutdown
    piece: str = ""  # the name `mesh init` gave the process it started: nats-n1, postgres


def systemd_runs() -> bool:
    """systemd is this machine's service manager (PID 1): sd_booted()'s test."""
    return Path("/run/systemd/system").is_dir()


def _quoted(word: str, *, dollars: bool) -> str:
    out = []
    for ch in word:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ch == "$" and dollars:
            out.append("$$")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def exec_line(argv: list[str]) -> str:
    """`argv` as an ExecStart= value. A program not named by an absolute path is found on
    systemd's search path through /usr/bin/env, as a shell would find it on PATH."""
    if not argv:
        raise UnitError("a unit needs a command")
    if not argv[0].startswith("/"):
        argv = ["/usr/bin/env", *argv]
    return " ".join(_quoted(word, dollars=True) for word in argv)


def environment_line(key: str, value: str) -> str:
    """One Environment= value: systemd expands specifiers in it, not variables."""
    return _quoted(f"{key}={value}", dollars=False)


_UNESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
              "\\": "\\", '"': '"', "'": "'", "s": " "}  # fmt: skip


def split(line: str) -> list[str]:
    """An ExecStart= value as systemd splits it into argv: words apart at whitespace, quotes
    and C escapes undone, `%%` and `$$` made single. Enough of systemd's rules to read back
    what exec_line writes (and plain words); a specifier or a variable is refused."""
    words: list[str] = []
    i, n = 0, len(line)
    while i < n:
        if line[i] in " \t":
            i += 1
            continue
        word, quote = [], ""
        while i < n and (quote or line[i] not in " \t"):
            ch = line[i]
            if ch in "\"'" and (not quote or ch == quote):
                quote = "" if quote else ch
                i += 1
            elif ch == "\\":
                nxt = line[i + 1 : i + 2]
                if nxt == "x":
                    word.append(chr(int(line[i + 2 : i + 4], 16)))
                    i += 4
                elif nxt in _UNESCAPES:
                    word.append(_UNESCAPES[nxt])
                    i += 2
                else:
                    raise UnitError(f"an escape split does not know: {line[i : i + 2]!r}")
            elif ch in "%$":
                if line[i + 1 : i + 2] != ch:
                    raise UnitError(f"a specifier or variable in {line!r} at {i}")
                word.append(ch)
                i += 2
            else:
                word.append(ch)
                i += 1
        if quote:
            raise UnitError(f"an unclosed quote in {line!r}")
        words.append("".join(word))
    return words


def render(unit: Unit) -> str:
    after = ["network-online.target" if unit.agent else "network.target", *unit.after]
    lines = [
        "[Unit]",
        f"Description={unit.description.replace('%', '%%')}",
        f"After={' '.join(after)}",
        # Restarted however often it fails (a host started before its nats-server listens
        # exits, and is started again): never given up on after five quick tries.
        "StartLimitIntervalSec=0",
    ]
    if unit.agent:
        lines.append("Wants=network-online.target")
    lines += [
        "",
        "[Service]",
        f"Type={'notify' if unit.agent else 'exec'}",
        f"ExecStart={exec_line(unit.argv)}",
        *(f"Environment={environment_line(k, v)}" for k, v in sorted(unit.env.items())),
    ]
    if unit.user is not None:
        lines.append(f"User={unit.user}")
    if unit.cwd is not None:
        lines.append(f"WorkingDirectory={unit.cwd.replace('%', '%%')}")  # a path as it is
    lines += ["Restart=always", "RestartSec=1"]
    if unit.agent:
        lines += [
            "NotifyAccess=all",  # its new version, which the agent starts, says MAINPID=
            "KillMode=process",  # stopping the agent never stops its processes
            "TimeoutStartSec=infinity",  # ready once registered: a controller may be away
        ]
    if unit.kill_signal is not None:
        lines.append(f"KillSignal={unit.kill_signal}")
    lines += ["", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)


def _account() -> str | None:
    """The account pieces run as when nothing else drops them: the one running `mesh init`."""
    return None if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name


def service_env(env: Mapping[str, str] | None) -> dict[str, str]:
    if env is None:
        return {}
    return {
        k: v for k, v in env.items() if (k.startswith("MESH_") and k != "MESH_CREDS") or k in _KEPT
    }


def of_child(
    child: Child, *, name: str, description: str, agent: bool = False,
    after: Iterable[str] = (), kill_signal: str | None = None,
) -> Unit:  # fmt: skip
    """The unit that starts `child` again as it was started."""
    return Unit(
        name=name, description=description, argv=child.argv, env=service_env(child.env),
        user=child.user or _account(), cwd=str(child.cwd) if child.cwd else None, agent=agent,
        after=list(after), kill_signal=kill_signal, piece=child.name,
    )  # fmt: skip


def of_mesh(children: list[Child], *, host: str, folder: Path) -> list[Unit]:
    """The units of what `mesh init` started in `folder`: its nats-servers, PostgreSQL and the
    host agent `host`, which starts after them."""
    units: list[Unit] = []
    for child in children:
        if child.name.startswith("nats-"):
            server = child.name.removeprefix("nats-")
            units.append(of_child(child, name=f"mesh-nats-{server}.service",
                                  description=f"mesh nats-server {server} ({folder})"))  # fmt: skip
        elif child.name == "postgres":
            units.append(of_child(child, name="mesh-postgres.service",
                                  description=f"mesh PostgreSQL ({folder})",
                                  kill_signal="SIGINT"))  # fmt: skip
        elif child.name == "postgres-front":
            # The store's TLS front (a PostgreSQL built without SSL: mesh/embedded/pgfront.py)
            units.append(of_child(child, name="mesh-postgres-front.service",
                                  description=f"mesh PostgreSQL's TLS front ({folder})",
                                  after=["mesh-postgres.service"]))  # fmt: skip
    servers = [u.name for u in units]
    for child in children:
        if child.name == host:
            units.append(of_child(child, name=f"mesh-host-{host}.service", agent=True,
                                  description=f"mesh host agent {host} ({folder})",
                                  after=servers))  # fmt: skip
    return units


def host_unit(name: str, argv: list[str], *, env: Mapping[str, str] | None = None) -> Unit:
    return Unit(
        name=f"mesh-host-{name}.service", description=f"mesh host agent {name}", argv=argv,
        env=dict(env or {}), agent=True,
    )  # fmt: skip


def write(units: list[Unit], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for unit in units:
        path = folder / unit.name
        path.write_text(render(unit))
        written.append(path)
    return written


def systemctl(*args: str) -> str:
    try:
        done = subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise UnitError(f"systemctl {' '.join(args)} did not finish within 120s") from None
    if done.returncode != 0:
        raise UnitError(f"systemctl {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout.strip()


def install(units: list[Unit]) -> list[Path]:
    """Into /etc/systemd/system, enabled: they start at every boot. Not started here."""
    paths = write(units, SYSTEM_UNITS)
    systemctl("daemon-reload")
    systemctl("enable", *(u.name for u in units))
    return paths


def main_pid(unit: str) -> int:
    return int(systemctl("show", "--property=MainPID", "--value", unit) or 0)


def shown(units: list[Unit], paths: list[Path]) -> str:
    """The units as printed: each under a line naming its file."""
    return "\n".join(f"# {path}\n{render(unit)}" for unit, path in zip(units, paths, strict=True))
