"""The controller keeps parsed manifests for a bounded number of module versions."""

from datetime import UTC, datetime

from mesh.store.modules import StoredVersion
from services.controller.fleet.publishing import PARSED_KEPT, Manifests


def _version(i: int) -> StoredVersion:
    text = f'[module]\nname = "m{i}"\n'
    return StoredVersion(
        id=i, module=f"m{i}", version=f"v{i}", manifest=text, bundles={},
        pushed_at=datetime.now(UTC), pushed_by="test",
    )  # fmt: skip


def test_parsed_manifests_are_bounded_and_the_recently_used_stay() -> None:
    manifests = Manifests()  # parsing touches neither the store nor the bus
    first = manifests.of(_version(0))
    for i in range(1, PARSED_KEPT * 3):
        manifests.of(_version(i))
        manifests.of(_version(0))  # used all along: never the least recently used
    assert len(manifests._parsed) == PARSED_KEPT
    assert manifests.of(_version(0)) is first  # still the parsed one, not parsed again
    assert 1 not in manifests._parsed and PARSED_KEPT * 3 - 1 in manifests._parsed
