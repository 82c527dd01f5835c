"""The layers hold: the library (`mesh/`) imports neither the services nor the programs that
start them, and the services (`services/`) never import the programs (`programs/`). Read from
the code's own import statements, so a new arrow up fails here before anyone builds on it."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
# `python -m mesh` must reach the command line: the library's one look up, by design.
ENTRY = ROOT / "mesh" / "__main__.py"


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
        if path != ENTRY
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
