"""The package's architecture, checked: the layers contract in pyproject.toml holds
(import-linter), and import cycles stay small (function-level imports included)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
MAX_CYCLE = 3  # an array and its helpers may need each other; nothing larger
DOC = ROOT / "docs" / "architecture.md"
MODULES = sorted(str(p.relative_to(ROOT / "shardfn")) for p in (ROOT / "shardfn").rglob("*.py"))


def test_layers_contract_is_kept() -> None:
    """``lint-imports``: each layer imports only those below it, deferred imports included."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def _largest_cycle(graph: grimp.ImportGraph) -> list[str]:
    """The largest strongly connected component of the import graph (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    best: list[str] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > len(best):
                        best = sorted(comp)
    return best


def test_largest_import_cycle_is_small() -> None:
    graph = grimp.build_graph("shardfn", cache_dir=None)
    cycle = _largest_cycle(graph)
    assert len(cycle) <= MAX_CYCLE, f"modules that all import each other (directly or not): {cycle}"


def test_cycle_finder_sees_function_level_imports(tmp_path: Path, monkeypatch) -> None:
    """The measure counts an import inside a function as an edge (a deferred import that
    runs upwards is still a dependency)."""
    pkg = tmp_path / "cyc_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("def g():\n    from . import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _largest_cycle(grimp.build_graph("cyc_pkg", cache_dir=None)) == ["cyc_pkg.a", "cyc_pkg.b", "cyc_pkg.c"]


def _doc_paths() -> set[str]:
    """The ``*.py`` paths docs/architecture.md names (``arrays/array.py``, ``shard_map/io.py``, ...)."""
    return set(re.findall(r"[\w./]*\w\.py\b", DOC.read_text()))


def test_architecture_doc_names_only_modules_that_exist() -> None:
    """Every file path docs/architecture.md mentions exists: paths of the repository as they
    are, other paths as the tail of a shardfn module's path, bare names as a module's name."""
    missing = []
    for path in sorted(_doc_paths()):
        if path.startswith(("shardfn/", "tests/", "tools/", "benchmarks/", "examples/")):
            ok = (ROOT / path).exists()
        elif "/" in path:
            ok = any(("/" + m).endswith("/" + path) for m in MODULES)
        else:
            ok = any(m.rsplit("/", 1)[-1] == path for m in MODULES)
        if not ok:
            missing.append(path)
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_architecture_doc_lists_every_module() -> None:
    """Each module of shardfn (``__init__.py`` aside) is named by its path below shardfn/,
    so a new or moved module shows up in the doc's list."""
    text = DOC.read_text()
    unlisted = [m for m in MODULES if not m.endswith("__init__.py") and f"`{m}`" not in text]
    assert not unlisted, (f"docs/architecture.md's module list lacks {unlisted}: add one line each under "
                          f"'Modules, by layer' saying what the module holds")


def _module_list() -> list[tuple[str, str]]:
    """(package heading, module path) for each line of the doc's "Modules, by layer" list."""
    text = DOC.read_text()
    section = text[text.index("### Modules, by layer"):text.index("Where a lower layer needs")]
    rows, package = [], None
    for line in section.splitlines():
        if m := re.match(r"^- `([\w/]+)/`", line):
            package = m.group(1)
        elif m := re.match(r"^  - `([\w/]+\.py)`:", line):
            rows.append((package, m.group(1)))
    return rows


def test_module_list_names_each_module_once_under_its_package() -> None:
    """The module list has one line per module of shardfn (``__init__.py`` aside), each under
    its top-level package's heading: none missing, none twice, none that does not exist."""
    rows = _module_list()
    listed = [path for _, path in rows]
    twice = sorted({path for path in listed if listed.count(path) > 1})
    assert not twice, f"docs/architecture.md's module list names {twice} more than once"
    modules = [m for m in MODULES if not m.endswith("__init__.py")]
    assert sorted(listed) == modules, (f"module list vs shardfn: missing {sorted(set(modules) - set(listed))}, "
                                       f"not modules {sorted(set(listed) - set(modules))}")
    misplaced = [(package, path) for package, path in rows if path.split("/")[0] != package]
    assert not misplaced, f"listed under another package's heading: {misplaced}"


def test_package_inits_only_re_export() -> None:
    """A package's ``__init__.py`` holds imports (re-exports), ``__all__`` and a docstring only."""
    import ast

    for init in sorted((ROOT / "shardfn").rglob("__init__.py")):
        if init.parent == ROOT / "shardfn":
            continue  # the root also installs what needs every layer loaded (docs/architecture.md)
        body = ast.parse(init.read_text()).body
        for node in body:
            doc = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            all_ = isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
            assert isinstance(node, (ast.Import, ast.ImportFrom)) or doc or all_, (
                f"{init.relative_to(ROOT)} line {node.lineno}: only re-exports belong in a package's __init__.py")
        for n, line in enumerate(init.read_text().splitlines(), 1):
            assert "noqa: F401" not in line, (
                f"{init.relative_to(ROOT)} line {n} imports a module for what importing it does: shardfn/__init__.py "
                f"installs such things, after every layer is loaded")
