"""A PostgreSQL primary with a streaming standby, from the embedded binaries, and the standby's
promotion as an HA manager does it: what the store's standby tests and its fault tests share
(tests/test_store_standby.py, tests/test_store_faults.py). The `pairs` fixture (conftest.py)
stops every pair a test started."""

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from mesh.embedded import pgauth, postgres
from mesh.embedded.children import Child

DATABASE = "mesh"


@dataclass
class Pair:
    folder: Path
    primary: Child
    primary_port: int
    passwords: pgauth.Passwords
    standby: Child | None = None
    standby_port: int = 0
    children: list[Child] = field(default_factory=list)
    ca: Path | None = None  # the CA its servers' certificates are checked by, on TLS

    def url(self, *ports: int) -> str:
        """The controllers' URL, as `mesh dev up --store-standby` gives it (their role)."""
        return postgres.multi_host_url(
            list(ports), DATABASE, user=postgres.CONTROLLER_USER,
            password=self.passwords.of(postgres.CONTROLLER_USER), ca=self.ca,
        )  # fmt: skip

    def admin(self, port: int) -> str:
        """The superuser's, on one server: the test's own look inside."""
        return postgres.url(port, DATABASE, password=self.passwords.of(postgres.PG_USER),
                            ca=self.ca)  # fmt: skip


async def start_pair(folder: Path, *, synchronous: bool, ca_folder: Path | None = None) -> Pair:
    """A primary in FOLDER/pg and its standby in FOLDER/pg-standby, streaming; with
    `synchronous`, the primary's commits wait for the standby once it is caught up. With
    `ca_folder` (a mesh's CA), on TLS as `mesh dev up` runs them (behind their fronts, the
    stream through the standby's relay, with the wheel's programs)."""
    settings = (
        postgres.PRIMARY
        if synchronous
        else tuple(s for s in postgres.PRIMARY if not s.startswith("synchronous_"))
    )
    passwords = pgauth.Passwords(folder / "passwords")
    primary, url = await postgres.start(
        folder / "pg", log=folder / "primary.log", database=DATABASE, settings=settings,
        passwords=passwords, ca_folder=ca_folder,
    )  # fmt: skip
    port = int(url.split("@", 1)[1].split("/")[0].rsplit(":", 1)[1])
    ca = ca_folder / "ca.pem" if ca_folder is not None else None
    pair = Pair(folder, primary, port, passwords, children=[*primary.companions, primary], ca=ca)
    standby, standby_port = await postgres.start_standby(
        folder / "pg-standby", primary_port=port, log=folder / "standby.log",
        passwords=passwords, ca_folder=ca_folder,
    )  # fmt: skip
    pair.standby, pair.standby_port = standby, standby_port
    pair.children += [*standby.companions, standby]
    return pair


async def sync_pair(folder: Path, pairs: list[Pair], *, ca_folder: Path | None = None) -> Pair:
    """A synchronous pair (added to `pairs`, the fixture's), once the standby is in sync."""
    pair = await start_pair(folder, synchronous=True, ca_folder=ca_folder)
    pairs.append(pair)
    await postgres.wait_synchronous(
        pair.primary_port, password=pair.passwords.of(postgres.PG_USER), deadline=60,
        ca=pair.ca,
    )  # fmt: skip
    return pair


def promote(data: Path) -> None:
    """What an HA manager does (docs/operations.md, A store standby)."""
    done = subprocess.run(
        [postgres.bin("pg_ctl"), "promote", "-w", "-t", "60", "-D", str(data)],
        capture_output=True, text=True, **postgres.run_as(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
