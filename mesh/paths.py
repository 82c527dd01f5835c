"""Filesystem helpers shared by the dev servers and the host."""

import os
import stat
from pathlib import Path


def open_path_to(path: Path) -> None:
    """Let every user traverse the folders above `path` (o+x, not read): a process that runs as
    its own account must reach its folder under a root-owned tree (or PostgreSQL its data)."""
    for folder in Path(path).resolve().parents:
        mode = folder.stat().st_mode
        if not mode & stat.S_IXOTH:
            folder.chmod(mode | stat.S_IXOTH)


def write_private(path: Path, data: bytes) -> None:
    """Written 0600 whatever the umask, in a folder made 0700 if new, atomically: never
    readable by others, never half."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
