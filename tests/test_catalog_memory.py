"""The controller's catalog keeps parsed manifests for a bounded number of module versions."""

from datetime import UTC, datetime
from typing import Any

from mesh.store.catalog import StoredVersion
from services.controller.catalog import PARSED_KEPT, Catalog


def _version(i: int) -> StoredVersion:
    text = f'[module]\nname = "m{i}"\n'
    return StoredVersion(
        id=i, module=f"m{i}", version=f"v{i}", manifest=text, bundles={},
        pushed_at=datetime.now(UTC), pushed_by="test",
    )  # fmt: skip


def test_parsed_manifests_are_bounded_and_the_recently_used_stay() -> None:
    unused: Any = None  # parsing touches neither the store nor the bus
    cat = Catalog(pool=unused, nc=unused, kv=unused, obs=unused, fleet=unused, epoch=1)
    first = cat._manifest(_version(0))
    for i in range(1, PARSED_KEPT * 3):
        cat._manifest(_version(i))
        cat._manifest(_version(0))  # used all along: never the least recently used
    assert len(cat._parsed) == PARSED_KEPT
    assert cat._manifest(_version(0)) is first  # still the parsed one, not parsed again
    assert 1 not in cat._parsed and PARSED_KEPT * 3 - 1 in cat._parsed
