"""Containers through a real Docker Engine: declared ones run and go when undeclared; the one a
process `replaces` is removed only after that process passed its checks, and left serving when
the process never gets healthy (the seed's safe failure).

Images are made here with `docker import` from a rootfs holding a static busybox: no registry
is reachable. Without an engine or busybox, these tests skip and say why.
"""

import io
import json
import os
import subprocess
import tarfile
import uuid
from pathlib import Path

import pytest
from helpers import await_until, engine_answers, next_failure, node_named, ok
from module_folders import svc_module, write_module

from mesh.embedded import ports

# One tag per test session: the workers of one run each make their image and remove their own.
IMAGE = f"mesh-test/busybox:{os.getpid()}"


@pytest.fixture(scope="session")
def image():
    if not engine_answers():
        pytest.skip("no Docker Engine answers (.ci/run starts dockerd where it can)")
    if not Path("/bin/busybox").exists():
        pytest.skip("no static busybox to make an image from (apt-get install busybox-static)")
    rootfs = io.BytesIO()
    with tarfile.open(fileobj=rootfs, mode="w") as tar:
        tar.add("/bin/busybox", arcname="bin/busybox")
        for applet in ("sh", "sleep", "nc", "httpd", "true"):
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type = tarfile.SYMTYPE
            link.linkname = "busybox"
            tar.addfile(link)
    done = subprocess.run(
        ["docker", "import", "-", IMAGE], input=rootfs.getvalue(), capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    yield IMAGE
    subprocess.run(["docker", "rmi", "-f", IMAGE], capture_output=True, timeout=60)


@pytest.fixture
def names():
    made: list[str] = []

    def name(kind: str) -> str:
        made.append(f"mesh-test-{kind}-{uuid.uuid4().hex[:8]}")
        return made[-1]

    yield name
    for n in made:
        subprocess.run(["docker", "rm", "-f", n], capture_output=True, timeout=60)


def _engine_version() -> str:
    done = subprocess.run(
        ["docker", "version", "--format", "{{.Server.Version}}"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def inspect(name: str) -> dict | None:
    done = subprocess.run(["docker", "inspect", name], capture_output=True, text=True, timeout=30)
    return json.loads(done.stdout)[0] if done.returncode == 0 else None


def replacing(folder: Path, *, old: str, port: int, mode: str) -> Path:
    """module_folders.svc_module at version 1, replacing container `old` once healthy."""
    extra = f'replaces = "{old}"\nupdate = "start-first"\n'
    return svc_module(folder, version="1", port=port, mode=mode, extra=extra)


def _old_container(image: str, name: str) -> None:
    done = subprocess.run(
        ["docker", "run", "-d", "--name", name, "--network", "host", image, "sleep", "3600"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


async def test_replaces_waits_for_two_passes(image, names, host, nc, tmp_path, cli) -> None:
    old = names("old")
    _old_container(image, old)
    assert inspect(old)["State"]["Running"]
    port = ports.free_port()
    ok(cli("push", str(replacing(tmp_path / "m", old=old, port=port, mode="serve"))))

    async def gone():
        return inspect(old) is None

    await await_until(gone, within=60, what=f"container {old} to be removed")
    log = (tmp_path / "node-1.log").read_text()
    healthy_at = log.index("process svc is healthy (2 passes)")
    removed_at = log.index(f"container {old} stopped and removed")
    assert healthy_at < removed_at  # the container went only after two passes


async def test_a_never_healthy_process_leaves_the_container_serving(
    image, names, host, nc, tmp_path, cli
) -> None:
    old = names("old")
    _old_container(image, old)
    events = await nc.subscribe("mesh.event.node-1.applied")
    await nc.flush()
    port = ports.free_port()
    ok(cli("push", str(replacing(tmp_path / "m", old=old, port=port, mode="deaf"))))
    event = await next_failure(events, within=120)
    assert event["step"] == f"replaces {old}"
    assert "left serving" in event["error"]
    assert inspect(old)["State"]["Running"]


async def test_a_container_answering_on_the_port_does_not_make_the_process_healthy(
    image, names, host, nc, tmp_path, cli
) -> None:
    # The seed's safe failure, when the old container listens where the new process should:
    # the process never listens, the container answers the tcp check, and it must stay.
    old = names("old")
    port = ports.free_port()
    done = subprocess.run(
        ["docker", "run", "-d", "--name", old, "--network", "host", image,
         "nc", "-ll", "-p", str(port), "-e", "true"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    events = await nc.subscribe("mesh.event.node-1.applied")
    await nc.flush()
    ok(cli("push", str(replacing(tmp_path / "m", old=old, port=port, mode="deaf"))))
    event = await next_failure(events, within=120)
    assert event["step"] == f"replaces {old}" and "left serving" in event["error"]
    assert "not from this process" in event["error"]
    assert inspect(old)["State"]["Running"]


async def test_declared_containers_run_and_go_when_undeclared(
    image, names, host, nc, tmp_path, cli
) -> None:
    name = names("c")
    folder = write_module(
        tmp_path / "m",
        f'[module]\nname = "cache"\n[container.{name}]\nimage = "{image}"\n'
        'command = ["sleep", "3600"]\n[assign]\nmachines = ["node-1"]\n',
    )
    ok(cli("push", str(folder)))

    async def running():
        found = inspect(name)
        return found if found and found["State"]["Running"] else None

    found = await await_until(running, within=60, what=f"container {name} running")
    # The machine says it has an engine, and which (mesh nodes, before anything is assigned).
    engine = (await node_named(nc, "node-1"))["facts"]["container_engine"]
    assert engine.startswith(f"engine {_engine_version()},"), engine
    assert found["Config"]["Labels"]["mesh.host"] == "node-1"
    assert found["HostConfig"]["NetworkMode"] == "host"
    ok(cli("unassign", "cache", "node-1"))

    async def gone():
        return inspect(name) is None

    await await_until(gone, within=60, what=f"container {name} removed once undeclared")
