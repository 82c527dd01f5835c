"""Files a process declares (config and credentials), in its own folder: written atomically
(a temporary file in the same folder, then rename) with their owner and mode, so a process never
reads half a file and a secret is never readable by anyone else, even for a moment."""

import os
from pathlib import Path

from services.host.accounts import Identity


def write(folder: Path, rel: str, data: bytes, *, mode: int, owner: Identity) -> Path:
    target = (folder / rel).resolve()
    if folder.resolve() not in target.parents:
        raise ValueError(f"{rel!r} escapes the process's folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        if os.geteuid() == 0:
            os.fchown(f.fileno(), owner.uid, owner.gid)
        os.fchmod(f.fileno(), mode)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    return target


def ensure_folder(folder: Path, *, owner: Identity) -> Path:
    """The process's own folder ($MESH_FILES): present even with no files, its account's alone."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.chown(folder, owner.uid, owner.gid)
    folder.chmod(0o700)
    return folder
