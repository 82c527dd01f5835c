"""The `mesh` bundle: the mesh installed on this machine, as an executable `./mesh`.

The mesh runs its own services (the controller) as processes from this bundle. The host writes
a small launcher into ROOT/bundles/mesh-installed: an interpreter every account may execute,
the installed packages on its path, then the `mesh` command line. Nothing is fetched: upgrading
this bundle is installing a newer mesh on the machine.
"""

import os
import stat
import sys
import sysconfig
from pathlib import Path

import mesh


class NotReachable(Exception):
    """The installed mesh cannot be run by the processes' accounts."""


def _open_to_others(path: Path) -> bool:
    """Every folder on the way is searchable by others, and the file readable (or runnable)."""
    path = path.resolve()
    for folder in path.parents:
        if not folder.stat().st_mode & stat.S_IXOTH:
            return False
    mode = path.stat().st_mode
    return bool(mode & (stat.S_IXOTH if path.is_file() else stat.S_IROTH | stat.S_IXOTH))


def interpreter(*, shared: bool) -> str:
    """This Python, or one of the same version that other accounts may run (`shared`)."""
    if not shared:
        return sys.executable
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (sys.executable, f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        if os.path.isfile(candidate) and _open_to_others(Path(candidate)):
            return candidate
    raise NotReachable(
        f"no {version} that other accounts may run (this one is {sys.executable}); "
        f"install {version} system-wide"
    )


def paths() -> list[str]:
    """Where the installed packages are: this mesh's own folder first, then its site-packages."""
    own = str(Path(mesh.__file__).resolve().parent.parent)
    site = [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    return list(dict.fromkeys([own, *site]))


def launcher(*, shared: bool) -> str:
    if shared:
        for p in paths():
            if not _open_to_others(Path(p)):
                raise NotReachable(
                    f"the mesh installed at {p} is not readable by other accounts; "
                    "install it where they can read it (e.g. under /opt)"
                )
    return (
        f"#!{interpreter(shared=shared)}\n"
        "# Made by mesh-host: runs the mesh installed on this machine.\n"
        "import sys\n"
        f"sys.path[:0] = {paths()!r}\n"
        "from programs.cli.main import main\n"
        "main()\n"
    )


def ensure(folder: Path) -> Path:
    """ROOT/bundles/mesh-installed with `./mesh` in it, rewritten when the install moved."""
    text = launcher(shared=os.geteuid() == 0)  # as root, processes run as other accounts
    target = folder / "mesh"
    if target.is_file() and target.read_text() == text:
        return folder
    if folder.exists():
        folder.chmod(0o755)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / ".mesh.tmp"
    tmp.write_text(text)
    tmp.chmod(0o555)
    tmp.replace(target)
    folder.chmod(0o555)
    return folder
