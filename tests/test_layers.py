"""The package's layers, read from the source with ast (nothing is imported): every import statement of
nanoqwen/**/*.py, at module level or inside a function, is an edge of the module graph. That graph must
be acyclic (a function-level import may defer a cost, never hide a cycle), so must the graph of its
layers, and no layer may reach, through any chain of imports, a layer FORBIDDEN to it.
`python tests/test_layers.py` (or `pytest -s tests/test_layers.py`) prints the layer graph that
docs/architecture.md shows."""

from __future__ import annotations

import ast
import graphlib
from collections import deque
from pathlib import Path

import pytest

import nanoqwen

PACKAGE = Path(nanoqwen.__file__).parent

# A layer is a top-level module or subpackage of nanoqwen (codegen, runtime, reference, ...), the package's
# own __init__, or a third-party top-level package (cuda: the CUDA Python bindings).
CUDA = ("cuda", "codegen", "runtime")
FORBIDDEN: dict[str, tuple[str, ...]] = {       # layer -> layers it must never reach
    "codegen": ("runtime", "bench", "tuning", "cli"),
    "runtime": ("tuning", "bench", "cli"),
    "bench": ("tuning", "cli"),                 # the sweep (tuning) sits on top of bench, not beside it
    "nqfile": CUDA,
    "quant": CUDA,
    "reference": CUDA,
}

Graph = dict[str, dict[str, str]]               # importer -> {imported: "file:line" of the first import}


def modules(root: Path, package: str) -> dict[str, Path]:
    """Module name -> source file, for every .py under the package directory ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(root: Path, package: str) -> Graph:
    """Every import in every module, wherever it stands. ``from X import y`` is an edge to module X.y when
    the package has one, else to X; an import of the package resolves to its longest existing module;
    third-party names are kept whole (``cuda.bindings``)."""
    mods = modules(root, package)
    graph: Graph = {name: {} for name in mods}
    for name, path in mods.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                if target == package or target.startswith(package + "."):
                    while target not in mods:
                        target = target.rpartition(".")[0]
                if target != name:
                    graph[name].setdefault(target, f"{path.relative_to(root.parent)}:{node.lineno}")
    return graph


def layer(module: str, package: str) -> str:
    parts = module.split(".")
    if parts[0] != package:
        return parts[0]
    return parts[1] if len(parts) > 1 else "__init__"


def internal(graph: Graph) -> dict[str, set[str]]:
    return {m: {t for t in deps if t in graph} for m, deps in graph.items()}


def find_cycle(deps: dict[str, set[str]]) -> list[str] | None:
    try:
        tuple(graphlib.TopologicalSorter(deps).static_order())
    except graphlib.CycleError as e:
        return e.args[1]
    return None


def layer_graph(graph: Graph, package: str) -> dict[str, set[str]]:
    """Layer -> the other layers of the package it imports."""
    out: dict[str, set[str]] = {}
    for m, deps in internal(graph).items():
        out.setdefault(layer(m, package), set()).update(layer(t, package) for t in deps)
    return {lay: deps - {lay} for lay, deps in out.items()}


def render(graph: Graph, package: str) -> str:
    """The layer graph bottom-up, one line per layer: its depth (1 + the deepest layer it imports), its
    name and what it imports. Ordered by depth, then name, so the text changes only when the graph does."""
    layers = layer_graph(graph, package)
    depth: dict[str, int] = {}
    for lay in graphlib.TopologicalSorter(layers).static_order():
        depth[lay] = 1 + max((depth[d] for d in layers[lay]), default=-1)
    width = max(map(len, layers))
    return "\n".join(f"{depth[lay]}  {lay:<{width}}  <- {', '.join(sorted(layers[lay])) or '-'}"
                      for lay in sorted(layers, key=lambda x: (depth[x], x)))


def violations(graph: Graph, package: str, rules: dict[str, tuple[str, ...]]) -> list[str]:
    """One line per module that reaches a forbidden layer: the chain of imports, each with file:line."""
    out = []
    for start in graph:
        banned = rules.get(layer(start, package), ())
        back: dict[str, str | None] = {start: None}
        todo = deque([start])
        while todo:
            m = todo.popleft()
            if layer(m, package) in banned:
                chain = [m]
                while back[chain[-1]] is not None:
                    chain.append(back[chain[-1]])
                chain.reverse()
                steps = ", ".join(f"{a} -> {b} ({graph[a][b]})" for a, b in zip(chain, chain[1:]))
                out.append(f"{layer(start, package)} must not reach {layer(m, package)}: {steps}")
                break
            for t in graph.get(m, ()):
                if t not in back:
                    back[t] = m
                    todo.append(t)
    return out


def _cycle_message(graph: Graph, cycle: list[str]) -> str:
    return "import cycle: " + ", ".join(f"{a} -> {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:]))


# ---- the package ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph(PACKAGE, "nanoqwen")


def test_graph_sees_module_and_function_level_imports(graph):
    assert len(graph) > 40 and {"codegen", "runtime", "cli", "reference"} <= set(layer_graph(graph, "nanoqwen"))
    assert "nanoqwen.codegen.kernels.gemv" in graph["nanoqwen.runtime.decoder"]      # module level
    assert "nanoqwen.tuning.sweep" in graph["nanoqwen.cli.tune"]                     # inside main()


def test_module_graph_is_acyclic(graph):
    cycle = find_cycle(internal(graph))
    assert cycle is None, _cycle_message(graph, cycle)


def test_layer_graph_is_acyclic_and_printed(graph):
    cycle = find_cycle(layer_graph(graph, "nanoqwen"))
    assert cycle is None, f"layer cycle: {' -> '.join(cycle)}"
    print("\n" + render(graph, "nanoqwen"))


def test_no_layer_reaches_a_forbidden_one(graph):
    assert violations(graph, "nanoqwen", FORBIDDEN) == []


# ---- the checker itself, on a made-up package ---------------------------------------------------------------

def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_checker_finds_a_cycle_hidden_in_a_function_and_a_forbidden_chain(tmp_path):
    _write(tmp_path / "pkg", {
        "__init__.py": "",
        "low/__init__.py": "from .a import f\n",
        "low/a.py": "from ..mid import b\n\ndef f():\n    from . import c\n",
        "low/c.py": "import os\n",
        "mid/__init__.py": "",
        "mid/b.py": "import json\n\n\ndef g():\n    from ..low import a\n    from ..top import d\n",
        "top/__init__.py": "",
        "top/d.py": "from cuda.bindings import driver\n",
    })
    g = import_graph(tmp_path / "pkg", "pkg")
    assert g["pkg.low.a"] == {"pkg.mid.b": "pkg/low/a.py:1", "pkg.low.c": "pkg/low/a.py:4"}
    assert g["pkg.mid.b"] == {"json": "pkg/mid/b.py:1", "pkg.low.a": "pkg/mid/b.py:5", "pkg.top.d": "pkg/mid/b.py:6"}
    assert set(find_cycle(internal(g))) == {"pkg.low.a", "pkg.mid.b"}
    assert find_cycle(layer_graph(g, "pkg")) is not None
    found = violations(g, "pkg", {"low": ("cuda",)})
    assert len(found) == 2          # pkg.low and pkg.low.a; pkg.low.c imports nothing of the package
    assert ("low must not reach cuda: pkg.low.a -> pkg.mid.b (pkg/low/a.py:1), pkg.mid.b -> pkg.top.d "
            "(pkg/mid/b.py:6), pkg.top.d -> cuda.bindings (pkg/top/d.py:1)") in found
    assert violations(g, "pkg", {"top": ("low", "mid")}) == []


def test_checker_passes_a_clean_package(tmp_path):
    _write(tmp_path / "pkg", {"__init__.py": "", "low.py": "import numpy\n",
                              "high.py": "from . import low\n\ndef f():\n    from .low import x\n"})
    g = import_graph(tmp_path / "pkg", "pkg")
    assert g["pkg.high"] == {"pkg.low": "pkg/high.py:1"}
    assert find_cycle(internal(g)) is None and violations(g, "pkg", {"low": ("high",)}) == []
    assert render(g, "pkg").splitlines() == ["0  __init__  <- -", "0  low       <- -",
                                            "1  high      <- low"]


if __name__ == "__main__":
    print(render(import_graph(PACKAGE, "nanoqwen"), "nanoqwen"))
