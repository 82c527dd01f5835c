"""What a machine tells the controller about itself when it registers."""

import os
import platform
import socket
import sys

from mesh import __version__
from mesh.model import Facts
from services.host.limits import Cgroups


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def gather(*, container_engine: str = "", cgroups: Cgroups | None = None) -> Facts:
    return Facts(
        os=platform.system().lower(),
        arch=platform.machine(),
        cpus=os.cpu_count() or 1,
        memory=_memory_bytes(),
        mesh_version=__version__,
        hostname=socket.gethostname(),
        python=platform.python_version() or sys.version.split()[0],
        container_engine=container_engine,
        limits=cgroups.can() if cgroups else None,  # None: not asked (limits.probe)
        cgroups=cgroups.version if cgroups else "",
    )
