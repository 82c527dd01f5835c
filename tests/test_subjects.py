"""Every subject comes from `mesh/subjects.py` (issue 12): no other file of the library, the
services or the programs spells out a `mesh.ctl.`, `mesh.host.`, `mesh.event.` or `mesh.seat.`
subject, so renaming one is one edit and a typo cannot make a subject nobody serves."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
SUBJECTS = ROOT / "mesh" / "subjects.py"
SUBJECT = re.compile(r"^mesh\.(ctl|host|event|seat)\.")


def _spelled_out(path: Path) -> list[str]:
    found = []
    # An f-string's leading text is a Constant of its own, so this sees f"mesh.event.{x}" too.
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if SUBJECT.match(node.value):
                found.append(f"{path.as_posix()}:{node.lineno}: {node.value!r}")
    return found


def test_subjects_are_spelled_only_in_subjects_py() -> None:
    found = [
        hit
        for layer in ("mesh", "services", "programs")
        for path in sorted((ROOT / layer).rglob("*.py"))
        if path != SUBJECTS
        for hit in _spelled_out(path)
    ]
    assert found == []


def test_the_check_sees_a_literal(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('A = "mesh.ctl.status"\nB = f"mesh.event.{A}.applied"\n')
    assert len(_spelled_out(bad)) == 2
