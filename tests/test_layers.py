"""The layers hold: the library (`mesh/`) imports neither the services nor the programs that
start them, and the services (`services/`) never import the programs (`programs/`). Read from
the code's own import statements, so a new arrow up fails here before anyone builds on it."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module a file imports (top level or inside functions), with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _arrows_up(layer: str, above: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted((ROOT / layer).rglob("*.py"))
        for line, module in _imports(path)
        if module.split(".")[0] in above
    ]


@pytest.mark.parametrize(
    ("layer", "above"), [("mesh", ("services", "programs")), ("services", ("programs",))]
)
def test_no_layer_imports_one_above_it(layer: str, above: tuple[str, ...]) -> None:
    assert _arrows_up(layer, above) == []


def test_the_walk_sees_an_arrow_up(tmp_path: Path) -> None:
    # The check itself must be able to fail: a file that imports a service is found.
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from services.host import main\n")
    assert _imports(bad) == [(2, "services.host")]


def test_python_m_mesh_still_reaches_the_command_line() -> None:
    # Units written by earlier versions run `python -m mesh ...`: it becomes the command's
    # entry (`python -m programs.cli`) without importing it.
    done = subprocess.run(
        [sys.executable, "-P", "-m", "mesh", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: mesh")


def test_the_forward_keeps_the_interpreters_flags() -> None:
    from mesh.__main__ import _forwarded

    assert _forwarded(["/usr/bin/python3", "-P", "-X", "dev", "-m", "mesh", "host", "run"]) == [
        "/usr/bin/python3", "-P", "-X", "dev", "-m", "programs.cli", "host", "run",
    ]  # fmt: skip
