"""The package's architecture, checked: the layers contract in pyproject.toml holds
(import-linter), and import cycles stay small (function-level imports included)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
MAX_CYCLE = 3  # an array and its helpers may need each other; nothing larger


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
