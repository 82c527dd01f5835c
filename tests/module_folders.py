"""The module folders tests push (a module's source: module.toml and its files), written from a
manifest, and the kinds several test modules push: the example `hello` and its secret, a module
built on the builder, a server checked by TCP, one whose health a test switches with a marker
file; and a module as the controller holds it, for composing without one."""

from pathlib import Path

from helpers import CHECKOUT

from mesh.modules.compose import ModuleVersion
from mesh.modules.gate import parse

HELLO = CHECKOUT / "docs" / "examples" / "hello"  # the example module the guides start with
HELLO_TOKEN = "s3cr3t-VALUE-7f1c"  # its secret (hello-token), as tests set it and look for it


def write_module(folder: Path, manifest: str, *, files: dict[str, str] | None = None) -> Path:
    """A module's source folder: `manifest` as its module.toml, and `files` (a path in the
    folder: its text) beside it."""
    for path, text in (files or {}).items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "module.toml").write_text(manifest)
    return folder


def built_module(
    folder: Path, script: str, *, description: str | None = None, process: bool = True,
    extra: str = "",
) -> Path:  # fmt: skip
    """Module `built`: its bundle `app` built on a builder by `script` (`sh build.sh`, its
    output out/app), and a process running it as account `app` (without `process`, the
    bundle alone); `extra` ends the manifest."""
    about = f'description = "{description}"\n' if description is not None else ""
    runs = '[account.app]\n[process.app]\nbundle = "app"\ncommand = ["./app"]\naccount = "app"\n'
    return write_module(
        folder,
        f'[module]\nname = "built"\n{about}'
        '[bundle.app]\nkind = "binary"\nsource = "src"\nbuild = ["sh", "build.sh"]\n'
        f'output = "out/app"\ntimeout = "60s"\n{runs if process else ""}{extra}',
        files={"src/build.sh": script},
    )


SERVER = """\
import socket, sys, time
version, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
print(f"version {version} starting at {time.time():.3f}", flush=True)
if mode == "crash":
    sys.exit(3)
if mode == "deaf":  # runs, never listens: never healthy
    time.sleep(3600)  # ok: the process under test runs and never listens
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port))
s.listen()
print(f"version {version} listening on {port}", flush=True)
while True:
    conn, _ = s.accept()
    conn.close()
"""

PREPARE = "import os\nopen(os.environ['MESH_FILES'] + '/prepared', 'w').write('yes')\n"


def svc_module(
    folder: Path, *, version: str, port: int, mode: str = "serve", extra: str = "",
    rollout: str = "",
) -> Path:  # fmt: skip
    """Module `svc` on node-1: SERVER (`version`, listening on `port`; mode "crash" exits 3,
    "deaf" never listens) as account `svc`, healthy once it accepts connections; `extra` ends
    its process table, `rollout` its [rollout] table; src/prepare.py is there for a `prepare`
    step to run."""
    return write_module(
        folder,
        '[module]\nname = "svc"\n'
        '[bundle.svc]\nkind = "files"\nsource = "src"\n'
        "[account.svc]\n"
        '[process.svc]\nbundle = "svc"\naccount = "svc"\n'
        f'command = ["python3", "server.py", "{version}", "{port}", "{mode}"]\n'
        f'check = {{ tcp = {port}, every = "300ms", passes = 2 }}\n'
        f"{extra}"
        # The plan waits longer than the host's own health window, so a failure a test reads
        # is the host's verdict, not the plan giving up first and reverting.
        f'[rollout]\ndeadline = "150s"\n{rollout}'
        '[assign]\nmachines = ["node-1"]\n',
        files={"src/server.py": SERVER, "src/prepare.py": PREPARE},
    )


GATED_CHECK = """\
import os, sys
root = os.path.join(os.environ["MESH_FILES"], "..", "..", "..")
mode, name = sys.argv[1], sys.argv[2]
there = os.path.exists(os.path.join(root, name))
sys.exit(0 if there == (mode == "needs") else 1)
"""


def gated_module(
    folder: Path,
    *,
    name: str = "gated",
    mode: str = "needs",
    marker: str = "",
    deadline: str = "20s",
    version: str = "1",
    tiers: str = "[0, 1, 2]",
    extra: str = "",
    check_timeout: str = "1s",
    env: str = "",
    files: dict[str, str] | None = None,
) -> Path:
    """A module whose process is healthy when `marker` exists in its host's root (mode
    "needs") or as long as it does not ("fails-if"); "" means always healthy. A test decides
    when, and on which machine, a version becomes healthy, without sleeping. A test that
    judges a process's health over a while (a soak) gives its check more than a second to
    answer (`check_timeout`): python3 starting on a loaded machine may take longer."""
    check = f'exec = ["python3", "check.py", "{mode}", "{marker}"]' if marker else 'exec = ["true"]'
    return write_module(
        folder,
        f'[module]\nname = "{name}"\ndescription = "version {version}"\n'
        '[bundle.code]\nkind = "files"\nsource = "src"\n'
        f'[process.{name}]\nbundle = "code"\ncommand = ["sleep", "3600"]\nroot = true\n{env}'
        f'check = {{ {check}, every = "200ms", timeout = "{check_timeout}", passes = 1 }}\n'
        f'[rollout]\ndeadline = "{deadline}"\n{extra}'
        f"[assign]\ntiers = {tiers}\n",
        files={"src/check.py": GATED_CHECK, **(files or {})},
    )


def module_version(name: str, body: str, *, bundles: dict[str, str] | None = None) -> ModuleVersion:
    """Module `name` (manifest `body` after its [module] table) as the controller holds it,
    for composition without a controller: its bundles' digests made up unless given."""
    manifest = parse(f'[module]\nname = "{name}"\n' + body)
    digests = bundles if bundles is not None else {b: f"sha256:{name}-{b}" for b in manifest.bundle}
    return ModuleVersion(name=name, version=f"sha256:v-{name}", manifest=manifest, bundles=digests)


def versioned_module(
    folder: Path,
    *,
    version: str,
    name: str = "versioned",
    mode: str = "needs",
    marker: str = "",
    deadline: str = "30s",
    tiers: str = "[0, 1, 2]",
) -> Path:
    """A module like gated_module (healthy by a marker, or at once), whose version shows where
    a test can read it: its process's environment carries MODULE_VERSION = `version`, and its
    bundle holds a file of it (so each version has a bundle of its own, as a release has)."""
    return gated_module(
        folder, name=name, mode=mode, marker=marker, deadline=deadline, version=version,
        tiers=tiers, env=f'env = {{ MODULE_VERSION = "{version}" }}\n',
        files={"src/VERSION": f"{version}\n"},
    )  # fmt: skip
