"""Which mesh this process runs: the digest of the mesh bundle it was started from, or
`installed` when it runs from the mesh installed on the machine (pip, a checkout).

A host stores every bundle in a folder named after its kind and digest
(ROOT/bundles/mesh-sha256-<hex>), so the running code knows its own digest from where it lies:
the bundle cannot carry its own digest inside it.
"""

import re
from pathlib import Path

import mesh

INSTALLED = "installed"
_BUNDLE_FOLDER = re.compile(r"mesh-sha256-([0-9a-f]{64})")


def of(path: Path) -> str:
    """The version of the mesh whose package lies at `path`."""
    for folder in Path(path).resolve().parents:
        found = _BUNDLE_FOLDER.fullmatch(folder.name)
        if found:
            return "sha256:" + found.group(1)
    return INSTALLED


def running() -> str:
    """This process's mesh: `sha256:<hex>` (a mesh bundle) or `installed`."""
    return of(Path(mesh.__file__))


def short(version: str) -> str:
    """For tables: `sha256:1a2b3c4d5e6f` stays readable, `installed` stays itself."""
    return version[: len("sha256:") + 12] if version.startswith("sha256:") else version
