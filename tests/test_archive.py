"""Canonical archives: the same tree gives the same bytes; nothing escapes its root."""

import io
import os
import tarfile
from pathlib import Path

import pytest

from mesh.modules.archive import ArchiveRefused, digest, members, pack, subtree, unpack


def _tree(root: Path) -> Path:
    (root / "src" / "lib").mkdir(parents=True)
    (root / "src" / "run").write_text("#!/bin/sh\necho hi\n")
    (root / "src" / "run").chmod(0o755)
    (root / "src" / "lib" / "a.txt").write_text("a")
    (root / "module.toml").write_text("[module]\nname = 'x'\n")
    os.symlink("lib/a.txt", root / "src" / "link")
    return root


def test_same_tree_same_bytes_whatever_the_times_and_order(tmp_path: Path) -> None:
    one = _tree(tmp_path / "one")
    two = _tree(tmp_path / "two")
    os.utime(two / "src" / "lib" / "a.txt", (1, 1))
    assert pack(one) == pack(two)
    (two / "src" / "lib" / "a.txt").write_text("b")
    assert digest(pack(one)) != digest(pack(two))


def test_symlink_out_of_the_module_is_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path / "m")
    os.symlink("../../etc/passwd", root / "src" / "escape")
    with pytest.raises(ArchiveRefused, match="src/escape"):
        pack(root)


def test_absolute_symlink_is_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path / "m")
    os.symlink("/etc/passwd", root / "src" / "abs")
    with pytest.raises(ArchiveRefused, match="src/abs"):
        pack(root)


def test_subtree_and_unpack_round_trip(tmp_path: Path) -> None:
    data = pack(_tree(tmp_path / "m"))
    src = subtree(data, "src")
    assert set(members(src)) == {"lib", "lib/a.txt", "run", "link"}
    out = tmp_path / "out"
    out.mkdir()
    unpack(src, out)
    assert (out / "run").read_text() == "#!/bin/sh\necho hi\n"
    assert os.access(out / "run", os.X_OK)
    assert (out / "link").read_text() == "a"


def test_subtree_refuses_a_symlink_that_leaves_it(tmp_path: Path) -> None:
    root = _tree(tmp_path / "m")
    os.symlink("../module.toml", root / "src" / "up")  # inside the module, outside src/
    with pytest.raises(ArchiveRefused, match="up"):
        subtree(pack(root), "src")


def _evil(entry: tarfile.TarInfo, data: bytes = b"") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        entry.size = len(data)
        tar.addfile(entry, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.parametrize(
    ("name", "kind", "link"),
    [
        ("../outside", tarfile.REGTYPE, ""),
        ("/etc/cron.d/x", tarfile.REGTYPE, ""),
        ("a/../../x", tarfile.REGTYPE, ""),
        ("hard", tarfile.LNKTYPE, "/etc/passwd"),
        ("dev", tarfile.CHRTYPE, ""),
        ("fifo", tarfile.FIFOTYPE, ""),
        ("sym", tarfile.SYMTYPE, "../../etc"),
        ("not-utf8-\udcff", tarfile.REGTYPE, ""),  # found by tests/test_fuzz.py
        ("sym-not-utf8", tarfile.SYMTYPE, "x\udcff"),
    ],
)
def test_hostile_archive_entries_are_refused(
    tmp_path: Path, name: str, kind: bytes, link: str
) -> None:
    entry = tarfile.TarInfo(name)
    entry.type = kind
    entry.linkname = link
    data = _evil(entry)
    with pytest.raises(ArchiveRefused):
        members(data)
    with pytest.raises(ArchiveRefused):
        unpack(data, tmp_path)
    assert list(tmp_path.iterdir()) == []


def _links_then_file(links: list[tuple[str, str]], file: str | None) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, target in links:
            entry = tarfile.TarInfo(name)
            entry.type = tarfile.SYMTYPE
            entry.linkname = target
            tar.addfile(entry)
        if file:
            entry = tarfile.TarInfo(file)
            entry.size = 5
            tar.addfile(entry, io.BytesIO(b"pwned"))
    return out.getvalue()


@pytest.mark.parametrize(
    ("links", "file"),
    [
        ([("d/l", ".."), ("d/l/x", "..")], "d/l/x/pwned"),  # a chain of links, each "inside"
        ([("d/l", "..")], "d/l/pwned"),  # a file written through a link
        ([("d/l", ".."), ("m", "d/l/..")], None),  # textually inside, really outside
        ([("a", "b"), ("b", "a")], None),  # a loop
    ],
)
def test_chained_symlinks_cannot_escape(tmp_path: Path, links, file) -> None:
    data = _links_then_file(links, file)
    dest = tmp_path / "scratch" / "dest"
    dest.mkdir(parents=True)
    with pytest.raises(ArchiveRefused):
        members(data)
    with pytest.raises(ArchiveRefused):
        unpack(data, dest)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["dest", "scratch"]


def test_unused_bundles_are_collected_after_a_grace(tmp_path: Path) -> None:
    from services.host import bundles

    store = tmp_path / "bundles"
    for name in ("files-sha256-a", "files-sha256-b"):
        (store / name).mkdir(parents=True)
        (store / name / "f").write_text("x")
        (store / name).chmod(0o555)
    unused: dict[str, float] = {}
    assert bundles.collect(tmp_path, {"files:sha256:a"}, unused, now=1000.0) == []
    assert (
        bundles.collect(tmp_path, {"files:sha256:a"}, unused, now=1000.0 + bundles.GRACE - 1) == []
    )
    assert (store / "files-sha256-b").exists()
    removed = bundles.collect(tmp_path, {"files:sha256:a"}, unused, now=1000.0 + bundles.GRACE)
    assert removed == ["files-sha256-b"]
    assert sorted(p.name for p in store.iterdir()) == ["files-sha256-a"]
