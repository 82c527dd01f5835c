"""The mesh's own code, carried by a module that runs it (a `mesh` bundle).

`services/host` and `services/controller` are modules inside the mesh's source. Their `mesh`
bundle is the mesh itself: `mesh push` packs the three packages the module lies among
(`mesh`, `services`, `programs`, and the project's `pyproject.toml` when there is one, as in a
checkout) into the module's archive under FOLDER, so the module's version changes with any
change of the mesh's code, and a builder makes the bundle from exactly that source.
"""

from pathlib import Path

PACKAGES = ("mesh", "services", "programs")
FOLDER = "mesh-source"  # where a module's archive carries the mesh's own code
PROJECT_FILE = "pyproject.toml"  # its dependencies, in a checkout


def project_of(module: Path) -> Path | None:
    """The folder that holds the mesh's packages, above the module's folder; None if the
    module is not part of the mesh's source."""
    for folder in Path(module).resolve().parents:
        if all((folder / p / "__init__.py").is_file() for p in PACKAGES):
            return folder
    return None


def parts(project: Path) -> dict[str, Path]:
    """Archive name -> what to pack there."""
    found = {f"{FOLDER}/{p}": project / p for p in PACKAGES}
    if (project / PROJECT_FILE).is_file():
        found[f"{FOLDER}/{PROJECT_FILE}"] = project / PROJECT_FILE
    return found
