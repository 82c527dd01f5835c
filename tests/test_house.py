"""House rules the code can be read for (docs/architecture.md), checked on the three layers'
own source (`mesh/`, `services/`, `programs/`) so that they stay true:

- short functions: none over MAX_LINES lines unless its docstring says why it is kept whole
  (a process's `run` is wiring of named tasks that live where a reader looks for them);
- words on the wire are types: a state (or an apply's step kind) is compared only with words a
  `Literal` declares (mesh/model.py: plan, step, process, tool server states, apply steps), so
  a typo is found here even where no type checker runs;
- tests and benches share what they share through modules meant for it: no test module
  (tests/test_*.py) imports another (conftest.py's fixtures, helpers.py and the named modules
  beside them are what tests share), and no bench imports another but bench/common.py;
- the controller's packages stand in floors (FLOORS, docs/architecture.md): a module imports
  its own package's modules and those of the floors below it, never one above;
- the controller's read side (what the read verbs answer from) imports none of its write side
  (what changes the catalog and steers plans).
"""

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).parent.parent
LAYERS = ("mesh", "services", "programs")
MAX_LINES = 80  # a function's lines, from `def` to its end, docstring included
KEPT_WHOLE = "kept whole"  # what a longer function's docstring says, with why
COMPARED = ("state", "step_kind")  # attributes that hold a declared word
CONTROLLER = ROOT / "services" / "controller"
# The controller's parts, top floor first: the process and its hold; the verbs; the changes
# operators ask; a plan's life; what changes and plans are made of (the catalog's parts, the
# seat); the fleet as heard; who asked, and the metrics, which everything may use.
FLOORS = (
    ("main", "hold"),
    ("serving",),
    ("changes",),
    ("plans",),
    ("catalog", "seat"),
    ("fleet",),
    ("trust", "metrics"),
)
READ_SIDE = ("serving.views",)  # the read verbs' answers
# the changes operators ask (every module of `changes`), a plan's recording, approval, steering,
# cancel and loop
WRITE_SIDE = ("changes", "plans.recording", "plans.approvals", "plans.steering", "plans.states",
              "plans.writes", "plans.planner")  # fmt: skip


def _files() -> Iterator[Path]:
    for layer in LAYERS:
        yield from sorted((ROOT / layer).rglob("*.py"))


def _trees() -> Iterator[tuple[Path, ast.Module]]:
    for path in _files():
        yield path, ast.parse(path.read_text(), filename=str(path))


def _long(path: Path, tree: ast.Module) -> list[str]:
    """Functions over MAX_LINES whose docstring does not say why they are kept whole."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            why = (ast.get_docstring(node) or "").lower()
            if lines > MAX_LINES and KEPT_WHOLE not in why:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    return found


def _declared(trees: list[tuple[Path, ast.Module]]) -> set[str]:
    """Every word some `Literal[...]` of the layers declares."""
    words = set()
    for _, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "Literal":
                words |= {
                    n.value
                    for n in ast.walk(node.slice)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str)
                }
    return words


def _compared(path: Path, tree: ast.Module, declared: set[str]) -> list[str]:
    """Comparisons of a state (`x.state == "..."`, `x.state in (...)`) with undeclared words."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if not any(isinstance(s, ast.Attribute) and s.attr in COMPARED for s in sides):
            continue
        for side in sides:
            items = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno} compares with {item.value!r}"
                for item in items
                if isinstance(item, ast.Constant)
                and isinstance(item.value, str)
                and item.value not in declared
            ]
    return found


def _imported(tree: ast.Module) -> set[str]:
    """The top-level names of the modules a file imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def _imports_of_siblings(folder: Path, *, may: set[str]) -> list[str]:
    """Files of `folder` that import another file of it which is not in `may`: a test module
    importing another test module, a bench importing another bench."""
    siblings = {p.stem for p in folder.glob("*.py")}
    found = []
    for path in sorted(folder.glob("*.py")):
        if path.name == "conftest.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        others = (_imported(tree) & siblings) - may - {path.stem}
        found += [f"{folder.name}/{path.name} imports {name}" for name in sorted(others)]
    return found


def test_no_test_module_imports_another_nor_a_bench_another_bench() -> None:
    tests = {p.stem for p in (ROOT / "tests").glob("*.py") if not p.name.startswith("test_")}
    assert _imports_of_siblings(ROOT / "tests", may=tests) == []
    assert _imports_of_siblings(ROOT / "bench", may={"common"}) == []


def test_no_function_is_long_without_saying_why() -> None:
    assert [f for path, tree in _trees() for f in _long(path, tree)] == []


def test_states_are_compared_only_with_declared_words() -> None:
    trees = list(_trees())
    declared = _declared(trees)
    assert [f for path, tree in trees for f in _compared(path, tree, declared)] == []


def test_the_checks_can_fail(tmp_path: Path) -> None:
    # Each check must be able to fail: a long function, a typo in a compared state.
    body = "".join(f"    x = {i}\n" for i in range(MAX_LINES))
    source = tmp_path / "bad.py"
    source.write_text(
        'from typing import Literal\nW = Literal["running"]\n'
        f"def long():\n{body}\n"
        f'def whole():\n    """Kept whole: a reason."""\n{body}\n'
        'def typo(p):\n    return p.state == "runing" or p.state == "running"\n'
    )
    tree = ast.parse(source.read_text())
    assert [f.split(" ", 1)[1] for f in _long(ROOT / "x.py", tree)] == [
        f"long: {MAX_LINES + 1} lines"
    ]
    found = _compared(ROOT / "x.py", tree, _declared([(source, tree)]))
    assert [f.split(" ", 1)[1] for f in found] == ["compares with 'runing'"]


def test_the_import_check_can_fail(tmp_path: Path) -> None:
    # A test module importing another (as `from`, as `import`) is found; a shared module not.
    (tmp_path / "helpers.py").write_text("X = 1\n")
    (tmp_path / "test_a.py").write_text("from helpers import X\n")
    (tmp_path / "test_b.py").write_text("from test_a import X\nimport test_a.sub\n")
    (tmp_path / "test_c.py").write_text("import test_b, helpers\n")
    found = _imports_of_siblings(tmp_path, may={"helpers"})
    assert [f.split(" ", 1)[1] for f in found] == ["imports test_a", "imports test_b"]


def _controller_imports(path: Path) -> set[str]:
    """The controller's own modules `path` imports, dotted below `services.controller`
    (`plans.planner`; a package imported whole, or a top module: `metrics`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            parts = node.module.split(".")
            if parts[:2] != ["services", "controller"]:
                continue
            if len(parts) > 2:
                found.add(".".join(parts[2:]))
            else:
                found |= {a.name for a in node.names}
            if len(parts) == 3 and (CONTROLLER / parts[2]).is_dir():
                found |= {f"{parts[2]}.{a.name}" for a in node.names}
    return found


def _floor(name: str) -> int:
    top = name.split(".")[0]
    return next(i for i, floor in enumerate(FLOORS) if top in floor)


def _upward(path: Path, root: Path = CONTROLLER) -> list[str]:
    """The imports of `path` (a controller module under `root`) that reach a floor above its
    own."""
    me = path.relative_to(root).with_suffix("").parts[0]
    return sorted(
        f"{path.relative_to(root)} imports {name}"
        for name in _controller_imports(path)
        if name.split(".")[0] != me and _floor(name) < _floor(me)
    )


def test_the_controllers_packages_stand_in_floors() -> None:
    files = [p for p in CONTROLLER.rglob("*.py") if p.name != "__init__.py"]
    parts = {p.relative_to(CONTROLLER).with_suffix("").parts[0] for p in files}
    assert parts <= {name for floor in FLOORS for name in floor}, "a part not in FLOORS"
    assert [u for p in sorted(files) for u in _upward(p)] == []


def _writes(name: str) -> bool:
    return any(name == w or name.startswith(w + ".") for w in WRITE_SIDE)


def test_the_controllers_read_side_imports_none_of_its_write_side() -> None:
    crossing = {
        name: sorted(n for n in _controller_imports(_path(name)) if _writes(n))
        for name in READ_SIDE
    }
    assert {k: v for k, v in crossing.items() if v} == {}


def _path(name: str) -> Path:
    return CONTROLLER.joinpath(*name.split(".")).with_suffix(".py")


def test_the_controller_checks_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "views.py"
    bad.write_text(
        "from services.controller.changes import modules\n"
        "from services.controller.plans import rollout\n"
    )
    assert sorted(n for n in _controller_imports(bad) if _writes(n)) == [
        "changes",
        "changes.modules",
    ]
    # a fleet module importing the planner reaches up two floors
    (tmp_path / "fleet").mkdir()
    upward = tmp_path / "fleet" / "probe.py"
    upward.write_text("from services.controller.plans.planner import Planner\n")
    assert _upward(upward, root=tmp_path) == ["fleet/probe.py imports plans.planner"]
