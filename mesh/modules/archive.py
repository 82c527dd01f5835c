"""Canonical archives of module sources and bundles: the same tree gives the same bytes.

Entries are sorted, owners and times zeroed, modes reduced to 0755/0644, and nothing but
regular files, folders and symlinks that stay inside the tree is accepted, packing or reading.
Packing streams each file into the archive and measures it before reading a byte of it: a tree
too large for an archive is refused at the first file that would take it past the limit,
named, whatever its size (a 10 GiB file was read whole first: a MemoryError).
"""

import hashlib
import io
import os
import posixpath
import shutil
import stat
import tarfile
from pathlib import Path

SKIP = {".git", "__pycache__", ".mesh"}
MAX_ARCHIVE = 128 * 2**20  # bytes of the archive itself: a module's source or one bundle (a mesh
# bundle, the mesh and the packages it needs, is about 50 MiB)
MAX_ENTRIES = 50_000  # files, folders and symlinks in one archive
MAX_UNPACKED = MAX_ARCHIVE  # bytes of all its files together, once unpacked


class ArchiveRefused(ValueError):
    """An entry that would escape its root or is not a plain file, folder or inner symlink."""


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _inside(link_dir: str, target: str) -> bool:
    """A first, textual check; `members` also resolves targets through the other links."""
    if target.startswith("/"):
        return False
    joined = posixpath.normpath(posixpath.join(link_dir, target))
    return not (joined == ".." or joined.startswith("../"))


def _resolve(
    base: list[str], target: str, links: dict[str, str], depth: int = 0
) -> list[str] | None:
    """Where `target`, followed from folder `base`, ends up: through every symlink of the
    archive on the way. None if it leaves the root, is absolute, or loops."""
    if target.startswith("/") or depth > 40:
        return None
    parts = list(base)
    for comp in target.split("/"):
        if comp in ("", "."):
            continue
        if comp == "..":
            if not parts:
                return None
            parts.pop()
            continue
        parts.append(comp)
        key = "/".join(parts)
        if key in links:
            parts.pop()
            resolved = _resolve(parts, links[key], links, depth + 1)
            if resolved is None:
                return None
            parts = resolved
    return parts


def _info(
    name: str, *, kind: bytes, mode: int = 0o644, size: int = 0, link: str = ""
) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.size = size
    info.linkname = link
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def pack(root: Path, *, extra: dict[str, Path] | None = None) -> bytes:
    """Pack the file or folder `root` canonically; a file becomes one entry under its name.
    `extra` adds folders or files found elsewhere, each under its name in the archive (the
    mesh's own code beside a module that is part of it: mesh.modules.meshsource)."""
    root = Path(root)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        if root.is_file() and not root.is_symlink() and not extra:
            _add_file(tar, root, root.name)
        else:
            where = {rel: root / rel for rel in _walk(root)}
            for name, folder in (extra or {}).items():
                parts = name.split("/")
                for i in range(1, len(parts)):
                    where.setdefault("/".join(parts[:i]), Path(folder).parent)
                where[name] = Path(folder)
                if Path(folder).is_dir() and not Path(folder).is_symlink():
                    where |= {f"{name}/{rel}": Path(folder) / rel for rel in _walk(folder)}
            for rel in sorted(where):
                path = where[rel]
                st = path.lstat()
                if stat.S_ISLNK(st.st_mode):
                    target = os.readlink(path)
                    if not _inside(posixpath.dirname(rel), target):
                        raise ArchiveRefused(
                            f"{rel}: symlink to {target!r} points outside the module"
                        )
                    tar.addfile(_info(rel, kind=tarfile.SYMTYPE, mode=0o777, link=target))
                elif stat.S_ISDIR(st.st_mode):
                    tar.addfile(_info(rel, kind=tarfile.DIRTYPE, mode=0o755))
                elif stat.S_ISREG(st.st_mode):
                    _add_file(tar, path, rel)
                else:
                    raise ArchiveRefused(f"{rel}: not a regular file, folder or symlink")
    data = out.getvalue()
    if len(data) > MAX_ARCHIVE:
        raise ArchiveRefused(f"the archive is {len(data)} bytes, at most {MAX_ARCHIVE}")
    members(data)  # the full check: links resolved through each other
    return data


def read(data: bytes, name: str) -> bytes | None:
    """The contents of the regular file `name` in the archive, or None."""
    info = members(data).get(name)
    if info is None or not info.isfile():
        return None
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        f = tar.extractfile(info)
        return f.read() if f else None


def _add_file(tar: tarfile.TarFile, path: Path, name: str) -> None:
    # Never follow a link here: the tree may belong to a build that is still changing it.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ArchiveRefused(f"{name}: not a regular file")
        before = tar.offset  # the archive's bytes so far
        if before + tarfile.BLOCKSIZE + st.st_size > MAX_ARCHIVE:
            so_far = f", {before} packed before it" if before else ""
            raise ArchiveRefused(f"{name} is {st.st_size} bytes: more than the archive may "
                                 f"hold ({MAX_ARCHIVE} bytes at most{so_far})")  # fmt: skip
        mode = 0o755 if st.st_mode & 0o111 else 0o644
        info = _info(name, kind=tarfile.REGTYPE, mode=mode, size=st.st_size)
        try:
            tar.addfile(info, f)  # copied in chunks: never the whole file in memory
        except OSError as e:  # tarfile's "unexpected end of data": it shrank meanwhile
            raise ArchiveRefused(f"{name}: changed while it was packed ({e})") from None


def _walk(root: Path) -> list[str]:
    found: list[str] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP)
        base = Path(folder).relative_to(root).as_posix()
        for name in dirs + sorted(files):
            rel = name if base == "." else f"{base}/{name}"
            found.append(rel)
        if len(found) > MAX_ENTRIES:  # stop walking: the archive would be refused anyway
            raise ArchiveRefused(f"more than {MAX_ENTRIES} entries")
    return sorted(found)


def _entries(data: bytes) -> list[tarfile.TarInfo]:
    """The archive's headers, read within the limits; anything that is not a well-formed tar
    archive is refused, never an error of another kind."""
    if len(data) > MAX_ARCHIVE:
        raise ArchiveRefused(f"the archive is {len(data)} bytes, at most {MAX_ARCHIVE}")
    found: list[tarfile.TarInfo] = []
    unpacked = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for info in tar:
                found.append(info)
                if len(found) > MAX_ENTRIES:
                    raise ArchiveRefused(f"more than {MAX_ENTRIES} entries")
                if info.issparse():  # holes that unpack to far more than the archive holds
                    raise ArchiveRefused(f"{info.name}: sparse files are not accepted")
                unpacked += info.size if info.isfile() else 0
                if unpacked > MAX_UNPACKED:
                    raise ArchiveRefused(
                        f"{info.name}: its files unpack to more than {MAX_UNPACKED} bytes"
                    )
    except (tarfile.TarError, EOFError, UnicodeError) as e:
        raise ArchiveRefused(f"not a tar archive: {e}") from None
    return found


def members(data: bytes) -> dict[str, tarfile.TarInfo]:
    """The entries of an archive, each checked: no absolute or `..` names, no links out, no
    hard links, no devices, within the size and count limits. Raises ArchiveRefused naming the
    entry."""
    entries: dict[str, tarfile.TarInfo] = {}
    links: dict[str, str] = {}
    for info in _entries(data):
        name = info.name
        norm = posixpath.normpath(name)
        if "\0" in name or "\0" in info.linkname:
            raise ArchiveRefused(f"{name!r}: a NUL character in a name")
        try:  # tarfile keeps bytes that are not UTF-8 as lone surrogates
            name.encode()
            info.linkname.encode()
        except UnicodeEncodeError:
            raise ArchiveRefused(f"{name!r}: a name that is not UTF-8") from None
        if name.startswith("/") or norm == ".." or norm.startswith("../"):
            raise ArchiveRefused(f"{name}: escapes the archive's root")
        if norm == "." and not info.isdir():
            raise ArchiveRefused(f"{name!r}: only a folder can be the archive's root")
        if len(norm.encode()) > 4096 or any(len(p.encode()) > 255 for p in norm.split("/")):
            raise ArchiveRefused(f"{name[:64]}…: a name longer than a file system takes")
        if info.issym():
            if not info.linkname:
                raise ArchiveRefused(f"{name}: symlink to nothing")
            if not _inside(posixpath.dirname(norm), info.linkname):
                raise ArchiveRefused(f"{name}: symlink to {info.linkname!r} points outside")
        elif info.islnk():
            raise ArchiveRefused(f"{name}: hard links are not accepted")
        elif not (info.isfile() or info.isdir()):
            raise ArchiveRefused(f"{name}: not a regular file, folder or symlink")
        if norm in entries:
            raise ArchiveRefused(f"{name}: appears twice")
        entries[norm] = info
        if info.issym():
            links[norm] = info.linkname
    for name in entries:
        parents = name.split("/")[:-1]
        for i in range(1, len(parents) + 1):
            parent = "/".join(parents[:i])
            if parent in links:
                raise ArchiveRefused(f"{name}: lies under a symlink")  # would write through it
            if parent in entries and not entries[parent].isdir():
                raise ArchiveRefused(f"{name}: lies under the file {parent}")
    for name, target in links.items():
        if _resolve(name.split("/")[:-1], target, links) is None:
            raise ArchiveRefused(f"{name}: symlink to {target!r} points outside")
    return entries


def subtree(data: bytes, path: str) -> bytes:
    """The canonical archive of `path` (a file or folder) inside the archive `data`."""
    entries = members(data)
    path = posixpath.normpath(path)
    if path not in entries:
        raise ArchiveRefused(f"{path}: not in the module")
    out = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(data), mode="r:") as src,
        tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        top = entries[path]
        if top.isfile():
            chosen = [(posixpath.basename(path), top)]
        else:
            prefix = path + "/"
            chosen = sorted(
                (n[len(prefix) :], i) for n, i in entries.items() if n.startswith(prefix)
            )
        for name, info in chosen:
            copy = _info(name, kind=info.type, mode=info.mode, size=info.size, link=info.linkname)
            if info.isfile():
                tar.addfile(copy, src.extractfile(info))
            else:
                tar.addfile(copy)
    packed = out.getvalue()
    members(packed)  # a symlink that stayed inside the module may leave this subtree
    return packed


def unpack(data: bytes, dest: Path) -> None:
    """Write the archive's entries under `dest` (an empty folder), each checked first."""
    entries = members(data)
    dest = Path(dest)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for name in sorted(entries):
            info = entries[name]
            target = dest / name
            if info.isdir():
                target.mkdir(parents=True, exist_ok=True)
            elif info.issym():
                target.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(info.linkname, target)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(info)
                assert src is not None
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as out:
                    shutil.copyfileobj(src, out)
                os.chmod(target, 0o755 if info.mode & 0o111 else 0o644)
