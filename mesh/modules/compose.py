"""Composition: one canonical declaration per machine from every module assigned to it.

Identical duplicates merge (the same account from two modules); conflicts are errors naming
both modules: two processes of one name, one account with different settings, two checks on
one port, two containers of one name. A declaration is canonical: the same inputs give the same
bytes and the same sha256, whatever the order of modules or of fields (design.md §3, must).
"""

import hashlib

import msgspec

from mesh.modules.manifest import Check, Manifest


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


class DProcess(msgspec.Struct):
    module: str
    bundle: str  # a key of Declaration.bundles
    command: list[str]
    account: str | None
    root: bool
    env: dict[str, str]
    files: dict[str, DFile]
    prepare: list[str] | None
    prepare_timeout: str
    restart: str
    check: Check | None
    update: str
    replaces: str | None
    stop_timeout: str


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


class ModuleVersion(msgspec.Struct):
    """A registered module: its manifest and the digests of its bundles (packed or built)."""

    name: str
    version: str  # digest of the module's source archive
    manifest: Manifest
    bundles: dict[str, str]  # bundle name -> digest (absent for system bundles)


_encoder = msgspec.json.Encoder(order="sorted")


def canonical(decl: Declaration) -> bytes:
    return _encoder.encode(decl)


def digest(decl: Declaration) -> str:
    return "sha256:" + hashlib.sha256(canonical(decl)).hexdigest()


def bundle_key(kind: str, digest: str | None, path: str | None) -> str:
    if kind == "system":
        return f"system:{path or ''}"
    if not digest:
        raise ValueError(f"a {kind} bundle without a digest (not packed or built yet)")
    return digest


def compose(
    machine: str, modules: list[ModuleVersion], secrets: dict[str, int] | None = None
) -> Declaration:
    """The declaration of `machine` from the modules assigned to it. Raises Conflict."""
    secrets = secrets or {}
    decl = Declaration(machine=machine, modules={})
    account_from: dict[str, str] = {}
    port_from: dict[int, tuple[str, str]] = {}
    for mv in sorted(modules, key=lambda m: m.name):
        m = mv.manifest
        decl.modules[mv.name] = mv.version
        for name, a in m.account.items():
            account = DAccount(home=a.home, groups=sorted(set(a.groups)), shell=a.shell)
            if name in decl.accounts and decl.accounts[name] != account:
                raise Conflict(
                    f"account {name} is declared differently by modules "
                    f"{account_from[name]} and {mv.name} (on {machine})"
                )
            decl.accounts[name] = account
            account_from.setdefault(name, mv.name)
        for name, p in m.process.items():
            if name in decl.processes:
                raise Conflict(
                    f"process {name} is declared by modules {decl.processes[name].module} "
                    f"and {mv.name} (on {machine})"
                )
            assert p.bundle is not None  # the gate made sure
            b = m.bundle[p.bundle]
            key = bundle_key(b.kind, mv.bundles.get(p.bundle), b.path)
            decl.bundles[key] = DBundle(kind=b.kind, digest=mv.bundles.get(p.bundle), path=b.path)
            if p.check is not None and p.check.tcp is not None:
                other = port_from.get(p.check.tcp)
                if other is not None:
                    raise Conflict(
                        f"port {p.check.tcp} is checked by process {other[1]} of module "
                        f"{other[0]} and process {name} of module {mv.name} (on {machine})"
                    )
                port_from[p.check.tcp] = (mv.name, name)
            decl.processes[name] = DProcess(
                module=mv.name,
                bundle=key,
                command=p.command,
                account=p.account,
                root=p.root,
                env=p.env,
                files={
                    path: DFile(
                        mode=f.mode,
                        text=f.text,
                        secret=f.secret,
                        secret_version=secrets.get(f.secret, 0) if f.secret else None,
                    )
                    for path, f in p.files.items()
                },
                prepare=p.prepare,
                prepare_timeout=p.prepare_timeout,
                restart=p.restart,
                check=p.check,
                update=p.update,
                replaces=p.replaces,
                stop_timeout=p.stop_timeout,
            )
        for name, c in m.container.items():
            if name in decl.containers:
                raise Conflict(
                    f"container {name} is declared by modules {decl.containers[name].module} "
                    f"and {mv.name} (on {machine})"
                )
            assert c.image is not None
            decl.containers[name] = DContainer(
                module=mv.name,
                image=c.image,
                command=c.command,
                env=c.env,
                ports=c.ports,
                restart=c.restart,
            )
    return decl
