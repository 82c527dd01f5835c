"""The registration gate: what `push` refuses, each refusal naming module, field and value.

Refused: unknown fields; a NUL byte in any string or key; a shell string where argv is
required; a container built from the module's own source (a module's own code is bundles, never
an image); a process naming an unknown bundle or account; a path that escapes its root (`..`,
absolute, symlink out); durations and modes that do not parse; names that are not valid subject
tokens; numbers out of their range (tiers, `max_parallel`, `canary`, `pause_after`); privileged
accounts and groups
(mesh.osaccounts: `root`, the mesh's own accounts, groups such as `sudo` or `docker` unless named
in `privileged_groups`).
"""

import posixpath
import re
import tomllib
import types
import typing
from collections.abc import Sized
from typing import Annotated, Any, Literal, Union

import msgspec

from mesh import osaccounts
from mesh.model import MACHINES_NAMED, MAX_TIER, LabelKey, Word
from mesh.modules.manifest import (
    ON_THE_MACHINE,
    Account,
    Assign,
    Bundle,
    Check,
    Container,
    Manifest,
    Process,
    Runs,
    Tool,
)
from mesh.names import InvalidName, check_name

MAX_MANIFEST = 256 * 1024  # bytes of module.toml
# How much one module may declare (docs/modules.md, Process limits): each refusal names the table.
MAX_BUNDLES = 64
MAX_ACCOUNTS = 64
MAX_PROCESSES = 64
MAX_CONTAINERS = 64
MAX_TOOLS = 64  # tool servers of one module
MAX_TOOL_TIMEOUT = 3600.0  # a tool call's limit, in seconds: a call holds one of its host's slots
MAX_FILES = 64  # files of one process
MAX_ENV = 256  # environment variables of one process or container
MAX_ARGV = 1024  # words of one command
MAX_DURATION = 7 * 24 * 3600.0  # a week, in seconds: any timeout, interval or deadline
MAX_PARALLEL = 10_000  # machines at once within a tier (`[rollout] max_parallel`; 0: all)
MAX_LABELS = 64  # of `[assign] labels`, as of a machine
SHELLS = {"sh", "bash", "dash", "zsh", "ksh", "ash", "fish", "csh", "tcsh"}  # by basename
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_MODE = re.compile(r"0?[0-7]{3}")
_ACCOUNT = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class Refused(ValueError):
    """A module the gate will not register. str() is one line: module, field, value, why."""

    def __init__(self, module: str, field: str, message: str) -> None:
        line = f"module {module}: {field}: {message}"
        if not line.isprintable():  # a key or value with a newline must not make it two lines
            line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)
        super().__init__(line)
        self.module = module
        self.field = field


def duration(text: str) -> float:
    """'500ms', '2s', '1.5m', '1h' -> seconds, at most MAX_DURATION."""
    m = _DURATION.fullmatch(text)
    if not m:
        raise ValueError(f"{text!r} is not a duration (like 500ms, 2s, 1m, 1h)")
    seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if not seconds <= MAX_DURATION:  # inf too: it would be encoded as null, then not read back
        raise ValueError(f"{text[:20]!r} is longer than {MAX_DURATION / 3600:g}h")
    return seconds


_SHARE = re.compile(r"(\d+(?:\.\d+)?)%")


def canary(value: int | str) -> tuple[int, float]:
    """`[rollout] canary` as a count or a share of each tier: (N, 0.0) for N machines,
    (0, P) for "P%" (0 < P <= 100). A canary of none is no `canary` at all: 0 is refused."""
    if isinstance(value, int):
        if not 1 <= value <= MAX_PARALLEL:
            raise ValueError(
                f"{value} is out of range (1 to {MAX_PARALLEL} machines of each tier, or a "
                'share like "10%"; leave canary out for none)'
            )
        return value, 0.0
    m = _SHARE.fullmatch(value)
    if not m:
        raise ValueError(f'{value[:20]!r} is not a number of machines nor a share like "10%"')
    share = float(m.group(1))
    if not 0 < share <= 100:
        raise ValueError(f"{value!r} is out of range (more than 0% and at most 100% of a tier)")
    return 0, share


def mode(text: str) -> int:
    if not _MODE.fullmatch(text):
        raise ValueError(f'{text!r} is not an octal file mode (like "0400")')
    return int(text, 8)


def parse(text: str, *, origin: str = "module.toml") -> Manifest:
    """Parse and strictly decode a manifest. Refusals name the field (`$.process.x.command`)."""
    try:
        size = len(text.encode())
    except UnicodeEncodeError as e:
        raise Refused("?", origin, f"not UTF-8 text: {e.reason} at {e.start}") from None
    if size > MAX_MANIFEST:
        raise Refused("?", origin, f"is larger than {MAX_MANIFEST} bytes")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise Refused("?", origin, f"not valid TOML: {e}") from None
    except ValueError as e:  # Python's own limit: "Exceeds the limit (4300 digits) … ; use sys…"
        raise Refused("?", origin, f"not valid TOML: {str(e).split(';')[0]}") from None
    except RecursionError:
        raise Refused("?", origin, "arrays or tables nested too deeply") from None
    name = raw.get("module", {}).get("name", "?") if isinstance(raw.get("module"), dict) else "?"
    module = str(name)[:64]
    _refuse_nul(module, raw)
    _refuse_shell_strings(module, raw)
    try:
        manifest = msgspec.convert(raw, Manifest)
    except msgspec.ValidationError as e:
        field, _, why = _split(_locate(raw) or str(e))
        if why.startswith("Invalid enum value") and (allowed := _choices(field)):
            why += f": one of {', '.join(allowed)}"
        raise Refused(module, field, why) from None
    check(manifest)
    return manifest


def _choices(field: str) -> list[str]:
    """The values a field of the manifest takes (`process.web.restart`), if it is one of a
    list; [] when it is not, or the path names nothing."""
    kind: Any = Manifest
    for part in field.split("."):
        kind = _bare(kind)
        if typing.get_origin(kind) is dict:
            kind = typing.get_args(kind)[1]  # `part` is the table's key: its value's type
        elif isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            kind = typing.get_type_hints(kind, include_extras=True).get(part)
        else:
            return []
    kind = _bare(kind)
    return [repr(v) for v in typing.get_args(kind)] if typing.get_origin(kind) is Literal else []


def _bare(kind: Any) -> Any:
    """`kind` without Annotated's metadata and without None (an optional field's type)."""
    while typing.get_origin(kind) is Annotated:
        kind = typing.get_args(kind)[0]
    if typing.get_origin(kind) in (Union, types.UnionType):
        rest = [k for k in typing.get_args(kind) if k is not type(None)]
        kind = rest[0] if len(rest) == 1 else kind
    return kind


_SECTIONS = {
    "bundle": Bundle, "account": Account, "process": Process, "container": Container, "tool": Tool,
}  # fmt: skip


def _locate(raw: dict[str, Any]) -> str | None:
    """msgspec writes a table's key as `[...]`; find the entry that fails, to name it."""
    for section, kind in _SECTIONS.items():
        table = raw.get(section)
        if not isinstance(table, dict):
            continue
        for key, value in table.items():
            try:
                msgspec.convert(value, kind)
            except msgspec.ValidationError as e:
                why, sep, at = str(e).rpartition(" - at ")
                path = at.strip("`").removeprefix("$") if sep else ""
                return f"{why if sep else e} - at `$.{section}.{key}{path}`"
    return None


def _split(message: str) -> tuple[str, str, str]:
    # msgspec: "Object contains unknown field `x` - at `$.process.hello`"
    why, sep, at = message.rpartition(" - at ")
    field = at.strip("`").removeprefix("$").removeprefix(".") if sep else ""
    unknown = re.fullmatch(r"Object contains unknown field `(.+)`", why if sep else message)
    if unknown:
        return ".".join(p for p in (field, unknown.group(1)) if p), "", "unknown field"
    if not sep:
        return "module.toml", "", message
    return field or "module.toml", "", why


def _refuse_nul(module: str, raw: dict[str, Any]) -> None:
    """No string or key holds a NUL byte: the OS takes none in an argument, an environment
    variable or a file name (the host would fail at start, and the plan wait out its deadline),
    nor does PostgreSQL in text."""
    todo: list[tuple[str, Any]] = [("", raw)]
    while todo:
        field, value = todo.pop()
        if isinstance(value, dict):
            for key, inner in reversed(value.items()):
                at = f"{field}.{key}" if field else key
                if "\0" in key:
                    raise Refused(module, at, f"the key {key[:64]!r} holds a NUL byte")
                todo.append((at, inner))
        elif isinstance(value, list):
            todo.extend((field, inner) for inner in reversed(value))
        elif isinstance(value, str) and "\0" in value:
            raise Refused(
                module, field, f"{value[:64]!r} holds a NUL byte, which no argument, "
                "environment variable, file name or text the mesh stores can carry",
            )  # fmt: skip


def _argv_fields(raw: dict[str, Any]) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    for kind, fields in (("process", ("command", "prepare")), ("bundle", ("build",)),
                         ("container", ("command",)), ("tool", ("command",))):  # fmt: skip
        section = raw.get(kind)
        if not isinstance(section, dict):
            continue  # not a table: strict decoding refuses it, naming the field
        for name, table in section.items():
            if not isinstance(table, dict):
                continue
            for f in fields:
                if f in table:
                    found.append((f"{kind}.{name}.{f}", table[f]))
            check_table = table.get("check") if kind == "process" else None
            if isinstance(check_table, dict) and "exec" in check_table:
                found.append((f"{kind}.{name}.check.exec", check_table["exec"]))
    return found


def _runs_shell_string(argv: list[Any]) -> bool:
    """A shell given a command string: `sh -c …`, `bash -o pipefail -lc …`, `sh +e -c …`,
    `/usr/bin/env sh -ec …`, `env -S "sh -c …"`, `busybox sh -c …`."""
    words = [w for w in argv if isinstance(w, str)]
    while words:
        base = posixpath.basename(words[0])
        if base == "env":
            if any(w.startswith(("-S", "--split-string")) for w in words[1:]):
                return True  # env splits a string into a command: a shell string by another name
            words = words[1:]
            while words and ("=" in words[0] or words[0].startswith("-")):
                words = words[1:]
        elif base == "busybox":
            words = words[1:]
        else:
            break
    if not words or posixpath.basename(words[0]) not in SHELLS:
        return False
    i = 1
    while i < len(words):
        word = words[i]
        if word == "--" or not word.startswith(("-", "+")):
            return False  # a script path: the shell runs a file, not a string
        if word in ("-o", "+o", "-O", "+O"):
            i += 2  # an option that takes a name
            continue
        if not word.startswith("--") and "c" in word[1:]:
            return True
        i += 1
    return False


def _refuse_shell_strings(module: str, raw: dict[str, Any]) -> None:
    for field, value in _argv_fields(raw):
        if isinstance(value, str):
            words = value.split()
            raise Refused(
                module,
                field,
                f"{value!r} is a shell string; commands are argv lists, "
                f"like {msgspec.json.encode(words).decode()}",
            )
        if isinstance(value, list) and _runs_shell_string(value):
            raise Refused(
                module,
                field,
                f"{value!r} runs a shell string; write the command as argv instead",
            )
        if isinstance(value, list) and not value:
            raise Refused(module, field, "an empty command")


def _name(module: str, field: str, value: str) -> None:
    try:
        check_name(value, field=field)
    except InvalidName as e:
        raise Refused(module, field, str(e).split(": ", 1)[1]) from None


def _relative(module: str, field: str, value: str) -> None:
    norm = posixpath.normpath(value)
    if value.startswith("/") or norm == ".." or norm.startswith("../") or "\0" in value:
        raise Refused(module, field, f"{value!r} escapes the module: use a path inside it")


def _absolute(module: str, field: str, value: str) -> None:
    if not value.startswith("/") or ".." in value.split("/"):
        raise Refused(module, field, f"{value!r} must be an absolute path without '..'")


def _duration(module: str, field: str, value: str) -> None:
    try:
        duration(value)
    except ValueError as e:
        raise Refused(module, field, str(e)) from None


def _canary_and_soak(mod: str, m: Manifest) -> None:
    """`[rollout] canary`, `soak` and `pause_after` (a tier must be one: 0 to MAX_TIER)."""
    r = m.rollout
    if r.canary is not None:
        try:
            canary(r.canary)
        except ValueError as e:
            raise Refused(mod, "rollout.canary", str(e)) from None
    if r.soak is not None:
        _duration(mod, "rollout.soak", r.soak)
    for t in r.pause_after:
        if not 0 <= t <= MAX_TIER:
            raise Refused(mod, "rollout.pause_after", f"{t} is not a tier (0 to {MAX_TIER})")


def _count(mod: str, field: str, items: Sized, limit: int, what: str) -> None:
    if len(items) > limit:
        raise Refused(mod, field, f"{len(items)} {what}, at most {limit}")


def check(m: Manifest) -> None:
    """Every rule msgspec cannot express. Raises Refused at the first problem."""
    mod = m.module.name
    _name(mod, "module.name", mod)
    _count(mod, "bundle", m.bundle, MAX_BUNDLES, "bundles")
    _count(mod, "account", m.account, MAX_ACCOUNTS, "accounts")
    _count(mod, "process", m.process, MAX_PROCESSES, "processes")
    _count(mod, "container", m.container, MAX_CONTAINERS, "containers")
    _count(mod, "tool", m.tool, MAX_TOOLS, "tool servers")
    for name, b in m.bundle.items():
        f = f"bundle.{name}"
        _name(mod, f, name)
        if b.kind in ON_THE_MACHINE:
            if b.source or b.build or b.output:
                raise Refused(
                    mod, f, f"a {b.kind} bundle is already on the machine: no source/build"
                )
            if b.path:
                _absolute(mod, f"{f}.path", b.path)
        elif b.kind == "mesh":
            if b.source or b.build or b.output or b.path:
                raise Refused(
                    mod, f, "a mesh bundle is the mesh's own code, built from the source the "
                    "module lies in: no source, build, output or path",
                )  # fmt: skip
        elif not b.source:
            raise Refused(mod, f"{f}.source", f"a {b.kind} bundle needs a source folder or file")
        if b.source:
            _relative(mod, f"{f}.source", b.source)
        if b.output:
            _relative(mod, f"{f}.output", b.output)
        if b.build is not None:
            _count(mod, f"{f}.build", b.build, MAX_ARGV, "words")
        if b.build and not b.output:
            raise Refused(mod, f"{f}.output", "a bundle with build must say which output it keeps")
        _duration(mod, f"{f}.timeout", b.timeout)
    _duration(mod, "rollout.deadline", m.rollout.deadline)
    if not 0 <= m.rollout.max_parallel <= MAX_PARALLEL:
        raise Refused(
            mod, "rollout.max_parallel", f"{m.rollout.max_parallel} is out of range (0 to "
            f"{MAX_PARALLEL}; 0: the whole tier at once)",
        )  # fmt: skip
    _canary_and_soak(mod, m)
    for name, a in m.account.items():
        _account(mod, name, a)
    ports: dict[int, str] = {}
    for name, p in m.process.items():
        _process(mod, name, p, m, ports)
    for name, t in m.tool.items():
        _tool(mod, name, t, m)
    for name, c in m.container.items():
        f = f"container.{name}"
        _name(mod, f, name)
        _count(mod, f"{f}.env", c.env, MAX_ENV, "variables")
        if c.command is not None:
            _count(mod, f"{f}.command", c.command, MAX_ARGV, "words")
        if c.build is not None:
            raise Refused(
                mod,
                f"{f}.build",
                "a container built from the module's own source: a module's own code is a "
                f"bundle, never an image; declare [bundle.{name}] and [process.{name}] instead",
            )
        if not c.image:
            raise Refused(mod, f"{f}.image", "a container needs a third-party image")
        if c.image.startswith((".", "/")):
            raise Refused(mod, f"{f}.image", f"{c.image!r} is a local path, not an image")
        for port in c.ports:
            found = re.fullmatch(r"(\d{1,5})(?::(\d{1,5}))?(/(tcp|udp))?", port)
            numbers = [int(n) for n in found.groups()[:2] if n] if found else []
            if not found or not all(1 <= n <= 65535 for n in numbers):
                raise Refused(mod, f"{f}.ports", f'{port!r} is not like "8080:80"')
    if m.assign:
        _assign(mod, m.assign)


def _account(mod: str, name: str, a: Account) -> None:
    f = f"account.{name}"
    if not _ACCOUNT.fullmatch(name):
        raise Refused(mod, f, f"{name!r} is not a valid account name ([a-z_][a-z0-9_-], ≤32)")
    if a.home:
        _absolute(mod, f"{f}.home", a.home)
    for field, groups in (("groups", a.groups), ("privileged_groups", a.privileged_groups)):
        for g in groups:
            if not _ACCOUNT.fullmatch(g):
                raise Refused(mod, f"{f}.{field}", f"{g!r} is not a valid group name")
    owner = osaccounts.OWNED_ACCOUNTS.get(name)
    if owner is not None and owner != mod:
        raise Refused(mod, f, f"{name!r} is module {owner}'s alone: it reads that module's "
                      "credentials")  # fmt: skip
    for g in a.groups:  # an account's own group reads what the account lets its group read
        owner = osaccounts.OWNED_ACCOUNTS.get(g)
        if g in osaccounts.RESERVED_ACCOUNTS and g != "root":  # root: NEVER_GROUPS says why
            raise Refused(mod, f"{f}.groups", f"{g!r} is the group of the reserved account {g}")
        if owner is not None and owner != mod:
            raise Refused(mod, f"{f}.groups", f"{g!r} is the group of module {owner}'s account")
    refused = osaccounts.refusal(name, groups=a.groups, privileged_groups=a.privileged_groups)
    if refused is not None:
        field, why = refused
        raise Refused(mod, f"{f}.{field}" if field else f, why)


def _assign(mod: str, a: Assign) -> None:
    _count(mod, "assign.machines", a.machines, MACHINES_NAMED, "machines")
    for machine in a.machines:
        _name(mod, "assign.machines", machine)
    for t in a.tiers:
        if not 0 <= t <= MAX_TIER:
            raise Refused(mod, "assign.tiers", f"{t} is not a tier (0 to {MAX_TIER})")
    _count(mod, "assign.labels", a.labels, MAX_LABELS, "labels")
    for key, value in a.labels.items():
        for kind, word in ((LabelKey, key), (Word, value)):
            try:
                msgspec.convert(word, kind)
            except msgspec.ValidationError as e:
                why = str(e).split(" - at ")[0]
                raise Refused(mod, f"assign.labels.{key}", f"{word[:64]!r}: {why}") from None


AGENT = "mesh-host"  # the host agent itself (services/host/module.toml): see _agent
AGENT_COMMAND = ["./mesh", "host", "run"]


def _agent(mod: str, f: str, p: Process, m: Manifest) -> None:
    """The process named mesh-host is the host agent itself: the running agent hands itself over
    to it (services/host/successor.py) rather than supervising it. It runs from a mesh bundle,
    as root, with the arguments the agent was started with (a machine's own name, credentials
    and NATS address never travel in a declaration), and nothing else a process may have."""
    if p.bundle is None or p.bundle not in m.bundle or m.bundle[p.bundle].kind != "mesh":
        raise Refused(mod, f"{f}.bundle", "the host agent (mesh-host) runs from a mesh bundle")
    if p.command != AGENT_COMMAND:
        raise Refused(
            mod, f"{f}.command", f"the host agent's command is {AGENT_COMMAND} (it adds the "
            "arguments it was started with), not {p.command}",
        )  # fmt: skip
    if not p.root or p.account is not None:
        raise Refused(mod, f"{f}.root", "the host agent runs as root: set root = true")
    # No limits either: its processes' cgroups are under its own, so a limit of its cgroup
    # would bound them all (docs/operations.md, Process limits).
    taken = ("env", "files", "prepare", "check", "replaces", *LIMIT_FIELDS)
    extras = [k for k in taken if getattr(p, k)]
    if extras:
        raise Refused(mod, f"{f}.{extras[0]}", "the host agent takes no " + extras[0])


def _process(mod: str, name: str, p: Process, m: Manifest, ports: dict[int, str]) -> None:
    f = f"process.{name}"
    _name(mod, f, name)
    _count(mod, f"{f}.command", p.command, MAX_ARGV, "words")
    if p.prepare is not None:
        _count(mod, f"{f}.prepare", p.prepare, MAX_ARGV, "words")
    _count(mod, f"{f}.files", p.files, MAX_FILES, "files")
    _count(mod, f"{f}.env", p.env, MAX_ENV, "variables")
    if p.bundle is None:
        raise Refused(mod, f"{f}.bundle", "a process runs from a bundle: name one")
    if name == AGENT:
        _agent(mod, f, p, m)
    _runs(mod, f, p, m, what="processes")
    _duration(mod, f"{f}.stop_timeout", p.stop_timeout)
    _duration(mod, f"{f}.prepare_timeout", p.prepare_timeout)
    if p.replaces is not None:
        _name(mod, f"{f}.replaces", p.replaces)
        if p.check is None:
            # Without a check a process is healthy the moment it starts: its container would
            # be removed before the process had stayed up across two checks.
            raise Refused(
                mod,
                f"{f}.replaces",
                f"container {p.replaces!r} is removed only once this process passes its "
                "check: add a check",
            )
    if p.check is not None:
        _check(mod, f"{f}.check", p.check, name, ports)
    _ports(mod, f, p, name, ports)


def _runs(mod: str, f: str, p: Runs, m: Manifest, *, what: str) -> None:
    """What a process and a tool server share: the bundle it runs from, who it runs as, its
    environment and its files."""
    if p.bundle not in m.bundle:
        known = ", ".join(sorted(m.bundle)) or "none declared"
        raise Refused(mod, f"{f}.bundle", f"unknown bundle {p.bundle!r} (known: {known})")
    if p.account is None and not p.root:
        raise Refused(mod, f"{f}.account", f"{what} never run as root unless said: name an account")
    if p.account is not None and p.root:
        raise Refused(mod, f"{f}.root", "name an account or set root = true, not both")
    if p.account is not None and p.account not in m.account:
        known = ", ".join(sorted(m.account)) or "none declared"
        raise Refused(mod, f"{f}.account", f"unknown account {p.account!r} (known: {known})")
    _limits(mod, f, p)
    for key in p.env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise Refused(mod, f"{f}.env", f"{key!r} is not a valid environment variable name")
    for path, spec in p.files.items():
        ff = f"{f}.files.{path}"
        _relative(mod, ff, path)
        if posixpath.normpath(path) in (".", "") or path.endswith("/"):
            raise Refused(mod, ff, f"{path!r} is not a file name")
        if (spec.text is None) == (spec.secret is None):
            raise Refused(mod, ff, "a file has either text or secret, exactly one")
        try:
            bits = mode(spec.mode)
        except ValueError as e:
            raise Refused(mod, f"{ff}.mode", str(e)) from None
        if spec.secret is not None:
            _name(mod, f"{ff}.secret", spec.secret)
            if bits & 0o077:
                raise Refused(
                    mod, f"{ff}.mode", f"{spec.mode!r} lets others read a secret: use 0400 or 0600"
                )


def _tool(mod: str, name: str, t: Tool, m: Manifest) -> None:
    """A tool server is checked as a process is (docs/modules.md, [tool.NAME]); it has its own
    folder and log under its name, so no process of the module may share it."""
    f = f"tool.{name}"
    _name(mod, f, name)
    _count(mod, f"{f}.command", t.command, MAX_ARGV, "words")
    _count(mod, f"{f}.files", t.files, MAX_FILES, "files")
    _count(mod, f"{f}.env", t.env, MAX_ENV, "variables")
    if name in m.process:
        raise Refused(
            mod, f, f"process {name} has this name too: a tool server and a process have their "
            "folder and log under their name, so name them differently",
        )  # fmt: skip
    if t.bundle is None:
        raise Refused(mod, f"{f}.bundle", "a tool server runs from a bundle: name one")
    _runs(mod, f, t, m, what="tool servers")
    _duration(mod, f"{f}.timeout", t.timeout)
    if not 0 < duration(t.timeout) <= MAX_TOOL_TIMEOUT:
        raise Refused(mod, f"{f}.timeout", f"{t.timeout!r}: a call's limit is more than 0 and "
                      f"at most {MAX_TOOL_TIMEOUT / 60:g}m")  # fmt: skip
    _duration(mod, f"{f}.stop_timeout", t.stop_timeout)


MAX_PORTS = 64  # ports one process declares


def _ports(mod: str, f: str, p: Process, process: str, ports: dict[int, str]) -> None:
    """`ports`: each a TCP port, none another process of the module uses (declares or checks)."""
    _count(mod, f"{f}.ports", p.ports, MAX_PORTS, "ports")
    for port in p.ports:
        if not 1 <= port <= 65535:
            raise Refused(mod, f"{f}.ports", f"{port} is not a port (1-65535)")
        if ports.get(port, process) != process:
            raise Refused(mod, f"{f}.ports", f"port {port} is used by process {ports[port]} too")
        ports[port] = process


def _check(mod: str, f: str, c: Check, process: str, ports: dict[int, str]) -> None:
    kinds = [k for k in ("tcp", "http", "exec", "nats") if getattr(c, k) is not None]
    if len(kinds) != 1:
        raise Refused(mod, f, "a check is exactly one of tcp, http, exec, nats")
    if c.tcp is not None:
        if not 1 <= c.tcp <= 65535:
            raise Refused(mod, f"{f}.tcp", f"{c.tcp} is not a port (1-65535)")
        if ports.get(c.tcp, process) != process:
            raise Refused(mod, f"{f}.tcp", f"port {c.tcp} is used by process {ports[c.tcp]} too")
        ports[c.tcp] = process
    if c.exec is not None:
        _count(mod, f"{f}.exec", c.exec, MAX_ARGV, "words")
    if c.http is not None and not c.http.startswith(("http://", "https://")):
        raise Refused(mod, f"{f}.http", f"{c.http!r} is not an http(s) URL")
    if c.nats is not None and not re.fullmatch(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*", c.nats):
        raise Refused(mod, f"{f}.nats", f"{c.nats!r} is not a subject without wildcards")
    if not 1 <= c.passes <= 100:
        raise Refused(mod, f"{f}.passes", f"{c.passes} is out of range (1-100)")
    _duration(mod, f"{f}.every", c.every)
    _duration(mod, f"{f}.timeout", c.timeout)


LIMIT_FIELDS = ("memory_max", "cpu_max", "tasks_max", "files_max")
MEMORY_MIN = 4 * 2**20  # less, and a process is killed before it has started
MEMORY_MAX = 2**50
CPU_MIN = 0.01  # one millisecond of every 100 ms period
CPU_MAX = 4096.0
TASKS_MAX = 4_194_304  # the kernel's pid_max at most
FILES_MAX = 1_048_576  # the kernel's nr_open by default
_MEMORY = re.compile(r"(\d+)([KMGT]?)")
_MEMORY_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def memory(value: str | int) -> int:
    """'256M', '1G', 1048576 -> bytes (K, M, G, T are powers of 1024)."""
    if isinstance(value, int):
        return value
    m = _MEMORY.fullmatch(value)
    if not m:
        raise ValueError(f'{value[:20]!r} is not an amount of memory (like "256M" or "1G")')
    return int(m.group(1)) * _MEMORY_UNITS[m.group(2)]


def _limits(mod: str, f: str, p: Runs) -> None:
    """A process's or tool server's limits (docs/modules.md, Process limits), each in its range."""
    if p.memory_max is not None:
        try:
            amount = memory(p.memory_max)
        except ValueError as e:
            raise Refused(mod, f"{f}.memory_max", str(e)) from None
        if not MEMORY_MIN <= amount <= MEMORY_MAX:
            raise Refused(mod, f"{f}.memory_max", f"{p.memory_max!r} is out of range (4M to 1024T)")
    if p.cpu_max is not None and not CPU_MIN <= p.cpu_max <= CPU_MAX:
        raise Refused(mod, f"{f}.cpu_max", f"{p.cpu_max:g} is out of range (cores: more than 0, "
                      f"from {CPU_MIN:g} to {CPU_MAX:g})")  # fmt: skip
    for field, value, top in (("tasks_max", p.tasks_max, TASKS_MAX),
                              ("files_max", p.files_max, FILES_MAX)):  # fmt: skip
        if value is not None and not 1 <= value <= top:
            raise Refused(mod, f"{f}.{field}", f"{value} is out of range (1 to {top})")
