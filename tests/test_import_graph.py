"""The package's import graph has no circle (issue 27).

The graph is read from the source with ``ast``, not by importing: a node per module of
``kvflow/`` and of ``kernels/`` (installed as ``kvflow.kernels``, see setup.py), an edge for
every ``import`` / ``from ... import`` anywhere in the file (module level, inside functions,
under ``if TYPE_CHECKING``): a lazy import inside a function still ties the two modules together.
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``.
A package's ``__init__`` is the node ``pkg``; importing ``pkg.mod`` is an edge to ``pkg.mod``
only (not to ``pkg``, which Python also runs first, so that re-exports in an ``__init__`` do not
make every module a circle with its package).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"kvflow": "kvflow", "kvflow.kernels": "kernels"}  # package name -> folder


def modules(repo: Path, roots: dict[str, str] = ROOTS) -> dict[str, tuple[Path, bool]]:
    """``{module name: (file, is a package __init__)}`` for every .py file under the roots."""
    out: dict[str, tuple[Path, bool]] = {}
    for pkg, folder in roots.items():
        base = repo / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("").parts
            if any(p.startswith((".", "__pycache__")) for p in rel):
                continue
            is_pkg = rel[-1] == "__init__"
            name = ".".join((pkg, *(rel[:-1] if is_pkg else rel)))
            out[name] = (path, is_pkg)
    return out


def imports(name: str, path: Path, is_pkg: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that the file of module ``name`` imports."""
    here = name if is_pkg else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = here.split(".")[:len(here.split(".")) - node.level + 1]
                mod = ".".join(parts + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in known:
                    out.add(sub)
                elif mod in known:
                    out.add(mod)
    out.discard(name)
    return out


def import_graph(repo: Path = REPO, roots: dict[str, str] = ROOTS) -> dict[str, set[str]]:
    mods = modules(repo, roots)
    return {name: imports(name, path, is_pkg, set(mods)) for name, (path, is_pkg) in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan, iterative), each
    as one circle through it, ``[a, b, ..., a]``, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
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
                if len(comp) > 1:
                    found.append(_circle(graph, set(comp)))
    return sorted(found)


def _circle(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest circle from the component's first module back to it (breadth first)."""
    start = min(comp)
    prev = {start: None}
    queue = [start]
    for v in queue:
        for w in sorted(graph[v] & comp):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return path[::-1] + [start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    raise AssertionError(f"no circle through {start} in {sorted(comp)}")


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert {"kvflow", "kvflow.cache", "kvflow.kernels", "kvflow.kernels.ops",
            "kvflow.kernels.numba.cpu", "kvflow.engine.engine"} <= set(graph)
    assert "kvflow.kernels.ops" in graph["kvflow.kernels"]  # a relative import of a submodule
    assert "kvflow.cache" in graph["kvflow.kernels.ops"]  # an absolute one across the roots
    found = cycles(graph)
    assert found == [], "import circles: " + "; ".join(" -> ".join(c) for c in found)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_a_circle_through_a_function_level_import_is_found_and_named(tmp_path):
    _write(tmp_path, {
        "kvflow/__init__.py": "from .a import f\n",
        "kvflow/a.py": "from .b import g\n",
        "kvflow/b.py": "def g():\n    from kvflow.a import f\n",   # lazy: still a circle
        "kvflow/c.py": "import kvflow.b\nfrom . import d\n",
        "kvflow/d.py": "",
        "kernels/__init__.py": "",
        "kernels/x.py": "from kvflow.kernels import y\n",
        "kernels/y.py": "from ..c import z\nfrom .x import q\n",  # kernels/ is kvflow.kernels
    })
    graph = import_graph(tmp_path)
    assert graph["kvflow"] == {"kvflow.a"}
    assert graph["kvflow.c"] == {"kvflow.b", "kvflow.d"}
    assert graph["kvflow.kernels.y"] == {"kvflow.c", "kvflow.kernels.x"}
    assert cycles(graph) == [["kvflow.a", "kvflow.b", "kvflow.a"],
                             ["kvflow.kernels.x", "kvflow.kernels.y", "kvflow.kernels.x"]]
