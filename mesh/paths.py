"""Filesystem helpers shared by the dev servers and the host."""

import stat
from pathlib import Path


def open_path_to(path: Path) -> None:
    """Let every user traverse the folders above `path` (o+x, not read): a process that runs as
    its own account must reach its folder under a root-owned tree (or PostgreSQL its data)."""
    for folder in Path(path).resolve().parents:
        mode = folder.stat().st_mode
        if not mode & stat.S_IXOTH:
            folder.chmod(mode | stat.S_IXOTH)
