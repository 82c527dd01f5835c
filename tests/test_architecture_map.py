"""docs/architecture.md's map of the code is true: it names every Python file of the three
layers (`mesh/`, `services/`, `programs/`), and every file it names exists. A file added, moved
or removed without the map is found here."""

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
MAP = ROOT / "docs" / "architecture.md"
LAYERS = ("mesh", "services", "programs")


def _rows() -> list[tuple[list[str], list[str]]]:
    """Each row of the map's tables: the paths of its code column, the names of the rest."""
    text = MAP.read_text()
    pieces = text[text.index("## The pieces") : text.index("## Subjects")]
    rows = []
    for line in pieces.splitlines():
        cells = line.split("|")
        if len(cells) < 4 or not line.startswith("| ") or set(cells[2].strip()) <= {"-"}:
            continue
        code = re.findall(r"`([^`]+)`", cells[2])
        names = re.findall(r"`([^`/ ]+\.(?:py|toml))`", "|".join(cells[3:]))
        rows.append((code, names))
    return rows


def _named() -> tuple[set[Path], list[str]]:
    named: set[Path] = set()
    missing: list[str] = []
    for code, names in _rows():
        folders = [ROOT / c for c in code if c.endswith("/")]
        for c in code:
            if not (ROOT / c).exists():
                missing.append(c)
            elif not c.endswith("/"):
                named.add(ROOT / c)
        for name in names:
            found = [f / name for f in folders if (f / name).exists()]
            found += [ROOT / c for c in code if Path(c).name == name and (ROOT / c).exists()]
            if not found:
                missing.append(f"{name} (in {', '.join(code)})")
            named.update(found)
    return named, missing


def test_the_map_names_every_file_and_only_files_that_exist() -> None:
    named, missing = _named()
    files = {
        p
        for layer in LAYERS
        for p in (ROOT / layer).rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }
    assert missing == [], f"the map names what does not exist: {missing}"
    unnamed = sorted(str(p.relative_to(ROOT)) for p in files - named)
    assert unnamed == [], f"files the map does not name: {unnamed}"


def test_the_map_is_read_at_all() -> None:
    # The check itself must be able to fail: it reads rows and finds files in them.
    named, _ = _named()
    assert ROOT / "services" / "host" / "apply.py" in named
    assert len(_rows()) >= 10
