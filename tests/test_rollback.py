"""Which version a rollback takes (services/controller/catalog/versions.py), without a mesh: by
number, by digest or a prefix of it, and by default the newest version below the current one that
ran; every refusal in one line naming what was asked and listing the versions there are. End to end
in test_history.py."""

from datetime import UTC, datetime

import pytest

from mesh import wire
from mesh.model import PlanState
from mesh.store.modules import HistoryRow
from services.controller.catalog import versions as rollback

AT = datetime(2026, 12, 1, tzinfo=UTC)


def version(number: int, state: PlanState | None = "done", *, current: bool = False) -> HistoryRow:
    return HistoryRow(
        id=100 + number, number=number, digest=f"sha256:{number:x}{'0' * 63}"[:71],
        pushed_at=AT, pushed_by="ann", plan=number, state=state, current=current, pruned=False,
    )  # fmt: skip


# newest first, as mesh.store.modules.history gives them
ROWS = [version(4, current=True), version(3, "reverted"), version(2, "cancelled"), version(1)]


def refused(rows: list[HistoryRow], to: str | None) -> str:
    with pytest.raises(wire.BadRequest) as e:
        rollback.pick(rows, module="web", to=to)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_the_default_is_the_newest_version_below_the_current_one_that_ran() -> None:
    assert rollback.pick(ROWS, module="web", to=None).number == 1  # 3 and 2 never ran
    back_at_2 = [version(4), version(3), version(2, current=True), version(1, None)]
    assert rollback.pick(back_at_2, module="web", to=None).number == 1  # below 2, not 4
    assert (
        rollback.pick([version(2, current=True), version(1, None)], module="web", to=None).number
        == 1
    )  # fmt: skip  (no plan: it changed no machine)


def test_a_version_is_named_by_number_digest_or_a_prefix() -> None:
    assert rollback.pick(ROWS, module="web", to="3").number == 3
    assert rollback.pick(ROWS, module="web", to=ROWS[2].digest).number == 2
    assert rollback.pick(ROWS, module="web", to="sha256:1000").number == 1
    # Digits alone are a number: a digest prefix of digits only needs its `sha256:`.
    assert "has no version 1000;" in refused(ROWS, "1000")
    hexed = [version(2, current=True), version(1)]
    hexed[1] = HistoryRow(**{**_fields(hexed[1]), "digest": "sha256:beef" + "0" * 60})
    assert rollback.pick(hexed, module="web", to="beef").number == 1


def test_refusals_list_the_versions_there_are() -> None:
    listed = rollback.known(ROWS)
    assert listed.startswith("4 (sha256:400000000000, current), 3 (sha256:300000000000), ")
    assert refused(ROWS, "9") == f"module web has no version 9; its versions: {listed}"
    assert "to: 'sha256:12' is neither a version number nor a digest" in refused(ROWS, "sha256:12")
    assert "to: 'xyz1' is neither" in refused(ROWS, "xyz1")
    assert "module web has never been pushed" == refused([], "1")
    first = refused([version(1, current=True)], None)
    assert first.startswith("module web has no version before its current one (1) that ran")
    taken_back = refused([version(1, "reverted")], None)
    assert "has no current version (its first push is held, or was taken back)" in taken_back
    assert taken_back.endswith("its versions: 1 (sha256:100000000000)")


def _fields(row: HistoryRow) -> dict:
    return {f: getattr(row, f) for f in row.__struct_fields__}


def test_a_prefix_that_names_two_versions_asks_for_more() -> None:
    rows = [version(2, current=True), version(1)]
    rows = [HistoryRow(**{**_fields(r), "digest": f"sha256:abcd{r.number}" + "0" * 59})
            for r in rows]  # fmt: skip
    assert "to: 'abcd' names 2 versions of module web (2, 1): give more of the digest" in (
        refused(rows, "abcd")
    )
    assert rollback.pick(rows, module="web", to="abcd1").number == 1


def test_a_long_history_is_listed_newest_first_with_the_rest_counted() -> None:
    many = [version(n, current=n == 30) for n in range(30, 0, -1)]
    listed = rollback.known(many)
    assert listed.startswith("30 (") and listed.endswith(" and 10 older (mesh history)")
    assert listed.count("sha256:") == rollback.LISTED
