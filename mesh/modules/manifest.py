"""`module.toml` as msgspec Structs (docs/design.md).

Decoding is strict: an unknown field is an error naming it. Checks that msgspec cannot express
(argv vs shell strings, paths, durations, modes, cross-references) are the gate's (`gate.py`).
"""

from typing import Annotated, Literal

import msgspec

BundleKind = Literal["binary", "files", "python", "system", "mesh"]
# Bundles already on the machine: nothing is packed, built or fetched for them. (`mesh` is the
# mesh's own code, built from the source the module lies in: mesh.modules.meshsource.)
ON_THE_MACHINE = ("system",)
Restart = Literal["always", "on-failure", "never"]
Update = Literal["start-first", "stop-first"]


class Strict(msgspec.Struct, forbid_unknown_fields=True):
    # No omit_defaults: a Check carried into a declaration must encode every field, or two
    # equal checks written differently would give different digests.
    pass


class ModuleHead(Strict):
    name: str
    description: str = ""


class Bundle(Strict):
    kind: BundleKind
    source: str | None = None  # folder in the module; not for `system`
    build: list[str] | None = None  # argv, run on a builder host in a scratch copy of source
    output: str | None = None  # what the build leaves (relative to source) that is the bundle
    timeout: str = "10m"  # the build's time limit
    path: str | None = None  # `system`: where it is on the machine (e.g. /usr/bin)


class Account(Strict):
    home: str | None = None
    groups: list[str] = []
    # Groups whose members are root in all but name (mesh.osaccounts.PRIVILEGED_GROUPS: sudo,
    # docker, disk, adm, ...): refused in `groups`, taken only here, where the module says so.
    privileged_groups: list[str] = []
    shell: str = "/usr/sbin/nologin"


class File(Strict):
    text: str | None = None
    secret: str | None = None
    mode: str = "0400"  # readable by the process's account alone


class Check(Strict):
    tcp: int | None = None
    http: str | None = None
    exec: list[str] | None = None
    nats: str | None = None
    every: str = "2s"
    timeout: str = "1s"
    passes: int = 2


class Runs(Strict):
    """What a process and a tool server both are: a command from a bundle, as an account, with
    its environment and its files."""

    command: list[str]
    bundle: str | None = None
    account: str | None = None
    root: bool = False  # run as root: only when said
    env: dict[str, str] = {}
    files: dict[str, File] = {}
    # docs/modules.md, Process limits: enforced by the host (services/host/limits.py); None:
    # unlimited. memory_max: bytes, or a number with K, M, G or T ("256M"); cpu_max: cores.
    memory_max: str | int | None = None
    cpu_max: float | None = None
    tasks_max: int | None = None  # processes and threads, all told
    files_max: int | None = None  # open files of each of its processes (RLIMIT_NOFILE)


class Process(Runs):
    prepare: list[str] | None = None
    prepare_timeout: str = "5m"
    restart: Restart = "always"
    check: Check | None = None
    update: Update = "stop-first"
    replaces: str | None = None
    stop_timeout: str = "10s"
    # The TCP ports it listens on: two processes of a machine's modules may not share one
    # (refused when composed, naming both). A composition check only: not in a declaration.
    ports: list[int] = []


class Tool(Runs):
    """A tool server (docs/modules.md, [tool.NAME]): a process that speaks MCP over stdio to the
    host, which launches it, lists its tools and calls them for the fleet."""

    timeout: str = "30s"  # a call's time limit (a caller may ask for less, never more)
    stop_timeout: str = "10s"  # after its stdin closes and SIGTERM, before SIGKILL


class Container(Strict):
    image: str | None = None
    build: str | dict | None = None  # present only so the gate can refuse it by name
    command: list[str] | None = None
    env: dict[str, str] = {}
    ports: list[str] = []
    restart: Restart = "always"


class Assign(Strict):
    """The default assignment, applied when the module is first pushed."""

    machines: list[str] = []
    tiers: list[int] = []
    labels: dict[str, str] = {}


class Rollout(Strict):
    """How a plan that changes this module's machines rolls out (docs/modules.md, [rollout])."""

    deadline: str = "60s"  # per machine: applied and every process healthy within this
    max_parallel: int = 0  # machines changed at once within a tier; 0: all of the tier
    auto_revert: bool = True  # on the first failure, give changed machines their old declaration
    skip_down: bool = False  # a machine down when its tier starts is skipped, not failed
    # Canaries and soaks (docs/modules.md, [rollout]): N machines of each tier, or "P%" of
    # them, go first; a soak (a duration) they (without canaries: each tier) must stay healthy
    # before the rest go; tiers after which the plan pauses itself until `mesh plan resume`.
    canary: int | str | None = None
    soak: str | None = None
    pause_after: list[int] = []
    # A process its host restarted this many times in a step fails the step at once, with why
    # it exited, rather than when the deadline passes (Kubernetes' CrashLoopBackOff).
    crash_loop: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 3


class Manifest(Strict):
    module: ModuleHead
    bundle: dict[str, Bundle] = {}
    account: dict[str, Account] = {}
    process: dict[str, Process] = {}
    container: dict[str, Container] = {}
    tool: dict[str, Tool] = {}
    assign: Assign | None = None
    rollout: Rollout = msgspec.field(default_factory=Rollout)
