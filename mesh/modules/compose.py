"""Composition: one canonical declaration per machine from every module assigned to it.

Identical duplicates merge (the same account from two modules); conflicts are errors naming
both modules: two processes of one name, one account with different settings, two checks on
one port, two containers of one name, two tool servers of one name or a tool server named like
a process (they share a folder and a log). A declaration is canonical: the same inputs give the same
bytes and the same sha256, whatever the order of modules or of fields (docs/design.md).
"""

import hashlib
import re
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from mesh.modules.gate import memory
from mesh.modules.manifest import Check, File, Manifest, Process, Runs


class Conflict(ValueError):
    """Two modules want incompatible things on one machine."""


class DFile(msgspec.Struct):
    mode: str
    text: str | None = None
    secret: str | None = None  # the name only: values travel to the host, never in here
    secret_version: int | None = None  # bumps the digest when the secret changes


class DBundle(msgspec.Struct):
    kind: str
    digest: str | None = None  # of the packed (or built) bundle; None for `system`
    path: str | None = None  # `system`: where it is on the machine


class DAccount(msgspec.Struct):
    home: str | None
    groups: list[str]
    shell: str
    # UNSET (left out of the bytes) when none: an account without them keeps its digest. The
    # host adds them to `groups`, and refuses a privileged group that is not here.
    privileged_groups: list[str] | UnsetType = UNSET


class DLimits(msgspec.Struct, omit_defaults=True):
    """A process's limits as a machine enforces them (services/host/limits.py): memory in
    bytes ("1G" and "1024M" are one limit), cpu in cores; None: unlimited (left out)."""

    memory: int | None = None
    cpu: float | None = None
    tasks: int | None = None
    files: int | None = None


class DRuns(msgspec.Struct):
    """What a declared process and tool server both carry (encoded with sorted keys: the
    fields' order here changes no byte)."""

    module: str
    bundle: str  # a key of Declaration.bundles
    command: list[str]
    account: str | None
    root: bool
    env: dict[str, str]
    files: dict[str, DFile]


class DProcess(DRuns):
    prepare: list[str] | None
    prepare_timeout: str
    restart: str
    check: Check | None
    update: str
    replaces: str | None
    stop_timeout: str
    # UNSET (left out of the bytes) when it declares none: a process without limits keeps the
    # digest it had before limits existed.
    limits: DLimits | UnsetType = UNSET


class DTool(DRuns):
    """A tool server as a machine runs it (docs/modules.md, [tool.NAME])."""

    timeout: str
    stop_timeout: str
    limits: DLimits | UnsetType = UNSET  # as a process's


class DContainer(msgspec.Struct):
    module: str
    image: str
    command: list[str] | None
    env: dict[str, str]
    ports: list[str]
    restart: str


class Declaration(msgspec.Struct):
    machine: str
    modules: dict[str, str]  # module name -> version digest
    accounts: dict[str, DAccount] = {}
    bundles: dict[str, DBundle] = {}
    processes: dict[str, DProcess] = {}
    containers: dict[str, DContainer] = {}
    # UNSET (left out of the bytes) when the machine has none: a declaration without tool
    # servers keeps the bytes, and so the digest, it had before tool servers existed.
    tools: dict[str, DTool] | UnsetType = UNSET


def tools_of(decl: Declaration) -> dict[str, DTool]:
    return decl.tools or {}


class ModuleVersion(msgspec.Struct):
    """A registered module: its manifest and the digests of its bundles (packed or built)."""

    name: str
    version: str  # digest of the module's source archive
    manifest: Manifest
    bundles: dict[str, str]  # bundle name -> digest (absent for system bundles)


_encoder = msgspec.json.Encoder(order="sorted")


def canonical_process(p: DRuns) -> bytes:
    return _encoder.encode(p)


def canonical(decl: Declaration) -> bytes:
    return _encoder.encode(decl)


def digest(decl: Declaration) -> str:
    return "sha256:" + hashlib.sha256(canonical(decl)).hexdigest()


def bundle_key(kind: str, digest: str | None, path: str | None) -> str:
    if kind == "system":
        return f"system:{path or ''}"
    if not digest:
        raise ValueError(f"a {kind} bundle without a digest (not packed or built yet)")
    return f"{kind}:{digest}"  # the same bytes as `files` and as `python` are two bundles


MACHINE_WORD = b"${machine}"  # in a process's or container's words: the machine's name


class Piece(msgspec.Struct):
    """One account, bundle, process or container of a module, with its canonical bytes."""

    value: Any
    raw: msgspec.Raw  # compared for equality byte by byte, inserted into encodings as is
    per_machine: bool = False  # says ${machine}: made again for each machine (_for_machine)


class Prepared(msgspec.Struct):
    """A module version turned into declaration pieces once, for every machine it goes to."""

    name: str
    version: str
    accounts: dict[str, Piece]
    bundles: dict[str, Piece]
    processes: dict[str, Piece]
    containers: dict[str, Piece]
    ports: dict[int, str]  # a port it declares or checks on this machine -> its process
    tools: dict[str, Piece] = {}


def _piece(value: Any) -> Piece:
    raw = _encoder.encode(value)
    return Piece(value=value, raw=msgspec.Raw(raw), per_machine=MACHINE_WORD in raw)


LOCAL = ("127.0.0.1", "localhost", "[::1]")  # an http check's address on the machine itself


def _ports_of(p: Process) -> list[int]:
    """The ports a process uses on its machine: those it declares, its tcp check's, and its
    http check's when that asks the machine itself."""
    found = list(p.ports)
    if p.check is not None and p.check.tcp is not None:
        found.append(p.check.tcp)
    if p.check is not None and p.check.http is not None:
        m = re.match(r"https?://([^/:]+|\[[^]]+\])(?::(\d+))?", p.check.http)
        if m and m.group(1) in LOCAL:
            found.append(int(m.group(2) or (443 if p.check.http.startswith("https") else 80)))
    return found


def prepare(mv: ModuleVersion, secrets: dict[str, int] | None = None) -> Prepared:
    """The pieces of one module version (given the secrets' versions)."""
    secrets = secrets or {}
    m = mv.manifest
    out = Prepared(
        name=mv.name, version=mv.version, accounts={}, bundles={}, processes={}, containers={},
        ports={},
    )  # fmt: skip
    for name, a in m.account.items():
        privileged = sorted(set(a.privileged_groups)) or UNSET
        out.accounts[name] = _piece(
            DAccount(home=a.home, groups=sorted(set(a.groups)), shell=a.shell,
                     privileged_groups=privileged)
        )  # fmt: skip
    for name, p in m.process.items():
        key = _bundle(out, mv, p.bundle)
        for port in _ports_of(p):
            out.ports[port] = name
        files = _files(p.files, secrets)
        out.processes[name] = _piece(
            DProcess(
                module=mv.name, bundle=key, command=p.command, account=p.account, root=p.root,
                env=p.env, files=files, prepare=p.prepare, prepare_timeout=p.prepare_timeout,
                restart=p.restart, check=p.check, update=p.update, replaces=p.replaces,
                stop_timeout=p.stop_timeout, limits=limits_of(p),
            )
        )  # fmt: skip
    for name, t in m.tool.items():
        out.tools[name] = _piece(
            DTool(
                module=mv.name, bundle=_bundle(out, mv, t.bundle), command=t.command,
                account=t.account, root=t.root, env=t.env, files=_files(t.files, secrets),
                timeout=t.timeout, stop_timeout=t.stop_timeout, limits=limits_of(t),
            )
        )  # fmt: skip
    for name, c in m.container.items():
        assert c.image is not None
        out.containers[name] = _piece(
            DContainer(
                module=mv.name, image=c.image, command=c.command, env=c.env,
                ports=sorted(set(c.ports)),
                restart=c.restart,
            )
        )  # fmt: skip
    return out


def _bundle(out: Prepared, mv: ModuleVersion, name: str | None) -> str:
    """The declaration's key of a process's or tool server's bundle, put among `out`'s."""
    assert name is not None  # the gate made sure
    b = mv.manifest.bundle[name]
    key = bundle_key(b.kind, mv.bundles.get(name), b.path)
    out.bundles[key] = _piece(DBundle(kind=b.kind, digest=mv.bundles.get(name), path=b.path))
    return key


def limits_of(p: Runs) -> DLimits | UnsetType:
    """A process's or tool server's limits, canonical (the gate has checked them)."""
    if p.memory_max is None and p.cpu_max is None and p.tasks_max is None and p.files_max is None:
        return UNSET
    return DLimits(
        memory=memory(p.memory_max) if p.memory_max is not None else None,
        cpu=p.cpu_max, tasks=p.tasks_max, files=p.files_max,
    )  # fmt: skip


def _files(files: dict[str, File], secrets: dict[str, int]) -> dict[str, DFile]:
    return {
        path: DFile(
            mode=f"{int(f.mode, 8):04o}",  # "400" and "0400" are one mode
            text=f.text,
            secret=f.secret,
            secret_version=secrets.get(f.secret, 0) if f.secret else None,
        )
        for path, f in files.items()
    }


class Merged(msgspec.Struct):
    machine: str
    modules: dict[str, str]
    accounts: dict[str, Piece]
    bundles: dict[str, Piece]
    processes: dict[str, Piece]
    containers: dict[str, Piece]
    tools: dict[str, Piece] = {}


def merge(machine: str, prepared: list[Prepared]) -> Merged:
    """Put a machine's modules together: identical duplicates merge, conflicts name both.
    This runs once per machine per change: keep it to dict operations."""
    mods = sorted(prepared, key=lambda p: p.name)
    out = Merged(
        machine=machine, modules={}, accounts={}, bundles={}, processes={}, containers={},
        tools={},
    )  # fmt: skip
    port_from: dict[int, tuple[str, str]] = {}
    accounts, processes, containers, tools = out.accounts, out.processes, out.containers, out.tools
    for mod in mods:
        out.modules[mod.name] = mod.version
        for name, piece in mod.accounts.items():
            have = accounts.setdefault(name, piece)
            if have is not piece and have.raw != piece.raw:
                first = next(m.name for m in mods if name in m.accounts)
                raise Conflict(
                    f"account {name} is declared differently by modules {first} and {mod.name} "
                    f"(on {machine})"
                )
        out.bundles.update(mod.bundles)  # keyed by content: the same key is the same bundle
        for kind, mine, theirs in (("process", processes, mod.processes),
                                   ("container", containers, mod.containers),
                                   ("tool server", tools, mod.tools)):  # fmt: skip
            common = mine.keys() & theirs.keys()
            if common:
                name = min(common)
                raise Conflict(
                    f"{kind} {name} is declared by modules {mine[name].value.module} "
                    f"and {mod.name} (on {machine})"
                )
            mine.update(_for_machine(machine, theirs))
        # A tool server and a process share a folder and a log under their name (a module's
        # own pair is refused by the gate).
        pairs = ((tools, mod.processes, "process", "tool server"),
                 (processes, mod.tools, "tool server", "process"))  # fmt: skip
        for mine, theirs, ours, other in pairs:
            common = mine.keys() & theirs.keys()
            if common:
                name = min(common)
                raise Conflict(
                    f"{other} {name} of module {mine[name].value.module} and {ours} {name} of "
                    f"module {mod.name} would share a folder and a log (on {machine})"
                )
        for port, process in mod.ports.items():
            other = port_from.setdefault(port, (mod.name, process))
            if other[0] != mod.name:
                raise Conflict(
                    f"port {port} is used by process {other[1]} of module {other[0]} "
                    f"and process {process} of module {mod.name} (on {machine})"
                )
    return out


def _for_machine(machine: str, pieces: dict[str, Piece]) -> dict[str, Piece]:
    """`${machine}` replaced by the machine's name wherever a process or container says it
    (command, env, files' text, prepare, checks). A name is [a-z0-9-]: safe inside the JSON
    strings of the piece's canonical bytes. Pieces without the word are shared untouched."""
    if not any(p.per_machine for p in pieces.values()):
        return pieces
    out = dict(pieces)
    for name, p in pieces.items():
        if p.per_machine:
            raw = memoryview(p.raw).tobytes().replace(MACHINE_WORD, machine.encode())
            value = msgspec.json.decode(raw, type=type(p.value))
            out[name] = Piece(value=value, raw=msgspec.Raw(raw))
    return out


class _Encoded(msgspec.Struct):
    # The same field names as Declaration: encoded sorted, the bytes are canonical(decl).
    machine: str
    modules: dict[str, str]
    accounts: dict[str, msgspec.Raw]
    bundles: dict[str, msgspec.Raw]
    processes: dict[str, msgspec.Raw]
    containers: dict[str, msgspec.Raw]
    tools: dict[str, msgspec.Raw] | UnsetType = UNSET


def encode(merged: Merged) -> tuple[bytes, str]:
    """The canonical bytes and the digest of a merged declaration, from the pieces' bytes."""
    body = _encoder.encode(
        _Encoded(
            machine=merged.machine,
            modules=merged.modules,
            accounts={k: p.raw for k, p in merged.accounts.items()},
            bundles={k: p.raw for k, p in merged.bundles.items()},
            processes={k: p.raw for k, p in merged.processes.items()},
            containers={k: p.raw for k, p in merged.containers.items()},
            tools={k: p.raw for k, p in merged.tools.items()} if merged.tools else UNSET,
        )
    )
    return body, "sha256:" + hashlib.sha256(body).hexdigest()


def declaration(merged: Merged) -> Declaration:
    return Declaration(
        machine=merged.machine,
        modules=merged.modules,
        accounts={k: p.value for k, p in merged.accounts.items()},
        bundles={k: p.value for k, p in merged.bundles.items()},
        processes={k: p.value for k, p in merged.processes.items()},
        containers={k: p.value for k, p in merged.containers.items()},
        tools={k: p.value for k, p in merged.tools.items()} if merged.tools else UNSET,
    )


def compose(
    machine: str, modules: list[ModuleVersion], secrets: dict[str, int] | None = None
) -> Declaration:
    """The declaration of `machine` from the modules assigned to it. Raises Conflict."""
    return declaration(merge(machine, [prepare(mv, secrets) for mv in modules]))
