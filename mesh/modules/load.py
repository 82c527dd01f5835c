"""Reading a module folder as a user points at it (`mesh push DIR`, `mesh plan diff DIR`)."""

from pathlib import Path

import msgspec

from mesh.modules import archive, gate, meshsource
from mesh.modules.manifest import Manifest


class LocalModule(msgspec.Struct):
    manifest_text: str
    manifest: Manifest
    source: bytes  # the canonical archive of the whole folder
    version: str  # its digest


def load(folder: Path) -> LocalModule:
    """Parse, gate and pack the module in `folder`. Raises gate.Refused with one-line reasons."""
    folder = Path(folder)
    toml = folder / "module.toml"
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "no such folder"
        raise gate.Refused("?", str(folder), f"{what}: a module is a folder with a module.toml")
    if not toml.is_file():
        raise gate.Refused("?", str(toml), "no module.toml here: a module is a folder with one")
    if toml.stat().st_size > gate.MAX_MANIFEST:  # before reading it whole
        raise gate.Refused("?", str(toml), f"is larger than {gate.MAX_MANIFEST} bytes")
    try:
        text = toml.read_bytes().decode()
    except UnicodeDecodeError as e:
        why = f"not UTF-8 text: {e.reason} at byte {e.start}"
        raise gate.Refused("?", str(toml), why) from None
    manifest = gate.parse(text, origin=str(toml))
    try:
        source = archive.pack(folder, extra=_mesh_source(manifest, folder))
    except archive.ArchiveRefused as e:
        raise gate.Refused(manifest.module.name, "source", str(e)) from None
    check_sources(manifest, source)
    return LocalModule(
        manifest_text=text, manifest=manifest, source=source, version=archive.digest(source)
    )


def _mesh_source(manifest: Manifest, folder: Path) -> dict[str, Path] | None:
    """The mesh's own code, for a module with a `mesh` bundle: packed beside the module."""
    wants = [name for name, b in manifest.bundle.items() if b.kind == "mesh"]
    if not wants:
        return None
    project = meshsource.project_of(folder)
    if project is None:
        raise gate.Refused(
            manifest.module.name, f"bundle.{wants[0]}.kind",
            f"a mesh bundle is the mesh's own code, but {folder} is not inside the mesh's "
            f"source (no {', '.join(meshsource.PACKAGES)} packages above it)",
        )  # fmt: skip
    return meshsource.parts(project)


def check_sources(manifest: Manifest, source: bytes) -> None:
    """Every bundle's source is in the archive and stays inside it."""
    try:
        entries = archive.members(source)
    except archive.ArchiveRefused as e:
        raise gate.Refused(manifest.module.name, "source", str(e)) from None
    for name, b in manifest.bundle.items():
        if b.source is None:
            continue
        path = b.source.strip("/").removeprefix("./") or "."
        if path not in entries and path != ".":
            raise gate.Refused(
                manifest.module.name, f"bundle.{name}.source", f"{b.source!r} is not in the module"
            )
        if b.build is None and path != ".":
            try:
                archive.subtree(source, path)
            except archive.ArchiveRefused as e:
                raise gate.Refused(manifest.module.name, f"bundle.{name}.source", str(e)) from None


def source_tree(source: bytes, path: str) -> bytes:
    """The canonical archive of `path` (a file or folder) in the module's archive."""
    path = path.strip("/").removeprefix("./") or "."
    return source if path == "." else archive.subtree(source, path)


def bundle_archive(manifest: Manifest, name: str, source: bytes) -> bytes:
    """The canonical archive of a bundle that needs no build: its source path in the module."""
    b = manifest.bundle[name]
    assert b.source is not None and b.build is None
    return source_tree(source, b.source)
