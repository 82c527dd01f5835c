"""Files a process declares (config and credentials), in its own folder: written atomically
(a temporary file in the same folder, then rename) with their owner and mode, so a process never
reads half a file and a secret is never readable by anyone else, even for a moment.

The folder belongs to the process's account, which may change it at any time: every step is
taken relative to an open folder, never following a symlink, so the host (root) can never be led
to write outside it.
"""

import os
import secrets
from pathlib import Path

from services.host.accounts import Identity

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def _open_folder(folder: Path, parts: list[str]) -> int:
    """The folder `folder/parts...`, created as needed, opened without following any link."""
    fd = os.open(folder, _DIR)
    try:
        for part in parts:
            try:
                os.mkdir(part, 0o700, dir_fd=fd)
            except FileExistsError:
                pass
            child = os.open(part, _DIR, dir_fd=fd)  # ELOOP/ENOTDIR if it is a link
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def write(folder: Path, rel: str, data: bytes, *, mode: int, owner: Identity) -> None:
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise ValueError(f"{rel!r} escapes the process's folder")
    fd = _open_folder(folder, parts[:-1])
    name = parts[-1]
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    try:
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
        with os.fdopen(out, "wb") as f:
            if os.geteuid() == 0:
                os.fchown(f.fileno(), owner.uid, owner.gid)
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=fd)
        except OSError:
            pass
        raise
    finally:
        os.close(fd)


def ensure_folder(folder: Path, *, owner: Identity) -> Path:
    """The process's own folder ($MESH_FILES): present even with no files, its account's alone."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, _DIR)
    try:
        if os.geteuid() == 0:
            os.fchown(fd, owner.uid, owner.gid)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return folder
