"""Third-party containers, through the Docker Engine API (aiodocker; Podman serves it too).

A declared container is created and started with the host's network, labelled with this host
and the digest of its declaration, and recreated when that digest changes. A container that a
process `replaces` is stopped and removed only once that process is healthy; if it never gets
healthy, the container is left serving (the safe failure) and the apply says why.
"""

import hashlib
import logging
import os

import aiodocker
import anyio
import msgspec

from mesh.modules.compose import DContainer

log = logging.getLogger(__name__)

SOCKET = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
STOP_TIMEOUT = 10
PROBE_TIMEOUT = 5.0  # an engine that takes longer to say its version counts as none


class EngineMissing(Exception):
    """No container engine answers: containers cannot be run on this machine."""


async def _connect() -> aiodocker.Docker:
    """A client that has had one answer from the engine, or EngineMissing.

    aiodocker.Docker() asserts that it found DOCKER_HOST, a Docker context or a socket at the
    usual paths (/run/docker.sock, /var/run/docker.sock, ~/.docker/run/docker.sock): on most
    machines that is the ordinary case of having no engine, not a fault of ours."""
    try:
        docker = aiodocker.Docker()
    except Exception as e:  # AssertionError when it found nothing; ValueError for a bad URL
        why = f": {e}" if str(e) else ""
        raise EngineMissing(f"no container engine answers at {SOCKET}{why}") from None
    try:
        await docker.version()
    except Exception as e:
        await docker.close()
        raise EngineMissing(f"no container engine answers at {SOCKET}: {e}") from None
    return docker


async def probe() -> str:
    """What container engine this machine has, for its facts: '' when none answers."""
    engine = Engine(host="", root="")
    try:
        with anyio.move_on_after(PROBE_TIMEOUT):
            return await engine.version()
        return ""
    except EngineMissing:
        return ""
    finally:
        with anyio.CancelScope(shield=True):
            await engine.close()


def spec_digest(c: DContainer) -> str:
    return "sha256:" + hashlib.sha256(msgspec.json.encode(c, order="sorted")).hexdigest()


class Engine:
    """One connection to the engine, opened when first needed."""

    def __init__(self, *, host: str, root: str) -> None:
        self._host = host
        self._root = root
        self._docker: aiodocker.Docker | None = None

    async def _client(self) -> aiodocker.Docker:
        if self._docker is None:
            self._docker = await _connect()
        return self._docker

    async def version(self) -> str:
        """What answers, in words ('engine 20.10.24, API 1.41'); EngineMissing if nothing."""
        docker = await self._client()
        try:
            v = await docker.version()
        except Exception as e:
            raise EngineMissing(f"no container engine answers at {SOCKET}: {e}") from None
        return f"engine {v.get('Version', '?')}, API {v.get('ApiVersion', '?')}"

    async def close(self) -> None:
        if self._docker is not None:
            await self._docker.close()
            self._docker = None

    async def _get(self, name: str) -> "aiodocker.containers.DockerContainer | None":
        docker = await self._client()
        try:
            return await docker.containers.get(name)
        except aiodocker.DockerError as e:
            if e.status == 404:
                return None
            raise

    async def _find(self, name: str) -> dict | None:
        container = await self._get(name)
        return container._container if container else None  # the inspect document

    async def ensure(self, name: str, c: DContainer) -> None:
        spec = spec_digest(c)
        found = await self._find(name)
        if found is not None:
            labels = found.get("Config", {}).get("Labels") or {}
            running = found.get("State", {}).get("Running", False)
            if labels.get("mesh.spec") == spec:
                container = await self._get(name)
                if not running and container is not None:
                    await container.start()
                    log.info("container %s started again", name)
                return
            log.info("container %s is another version: recreating it", name)
            await self.remove(name)
        docker = await self._client()
        config = {
            "Image": c.image,
            "Env": [f"{k}={v}" for k, v in sorted(c.env.items())],
            "Labels": {"mesh.host": self._host, "mesh.root": self._root, "mesh.spec": spec},
            "HostConfig": {
                "NetworkMode": "host",
                "RestartPolicy": {"Name": "unless-stopped" if c.restart == "always" else "no"},
            },
        }
        if c.command:
            config["Cmd"] = c.command
        container = await docker.containers.create(config, name=name)
        await container.start()
        log.info("container %s created from %s and started", name, c.image)

    async def remove(self, name: str) -> bool:
        """Stop (SIGTERM, then SIGKILL after STOP_TIMEOUT) and remove; False if absent."""
        container = await self._get(name)
        if container is None:
            return False
        try:
            await container.stop(t=STOP_TIMEOUT)
        except aiodocker.DockerError as e:
            if e.status not in (304, 404):  # already stopped / gone
                raise
        await container.delete(force=True)
        log.info("container %s stopped and removed", name)
        return True

    async def mine(self) -> list[str]:
        """Names of the containers this host created."""
        docker = await self._client()
        found = await docker.containers.list(
            all=True, filters={"label": [f"mesh.host={self._host}", f"mesh.root={self._root}"]}
        )
        return sorted(c._container["Names"][0].lstrip("/") for c in found)
