"""Where to find the bus and the store: flags override the environment, which overrides defaults."""

import os

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def nats_url(flag: str | None = None) -> str:
    return flag or os.environ.get("MESH_NATS_URL") or DEFAULT_NATS_URL


def database_url(flag: str | None = None) -> str | None:
    return flag or os.environ.get("MESH_DATABASE_URL") or None


def creds(flag: str | None = None) -> str | None:
    return flag or os.environ.get("MESH_CREDS") or None
