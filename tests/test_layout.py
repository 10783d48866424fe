"""The package's layering, read from the source: every `k3.*` import (top level or inside a
function) is an edge between two parts of k3, where a part is a subpackage (`k3.model`, `k3.serve`,
...) or a top-level module (`k3.config`, `k3.cli`, ...). The graph must have no cycle, serving must
not import training, and the model must not import serving, training or checkpoint formats."""
from __future__ import annotations

import ast
import functools
import itertools
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
K3 = ROOT / "k3"

# (importer, imported) pairs that must never appear, with the reason a failure prints.
FORBIDDEN = {
    ("k3.serve", "k3.train"): "serving never imports training (shared formats live in k3.text / k3.checkpoint)",
    ("k3.model", "k3.serve"): "model code is single-device math with no serving types",
    ("k3.model", "k3.train"): "model code knows nothing of training",
    ("k3.model", "k3.checkpoint"): "model code has no file I/O",
    ("k3.serve", "k3.data"): "serving reads no corpora; the media processors it shares live in k3.media",
    ("k3.rl", "k3.sft"): "RL and SFT are peers: the task world they share is k3.tasks",
    ("k3.tasks", "k3.sft"): "the task world serves SFT and RL, and imports neither",
    ("k3.tasks", "k3.rl"): "the task world serves SFT and RL, and imports neither",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(K3.rglob("*.py"))}


def part_of(module: str) -> str:
    """The node a module belongs to: `k3` itself, a subpackage, or a top-level module."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def runtime_nodes(tree: ast.AST):
    """ast.walk, less the bodies of `if TYPE_CHECKING:` (imports for annotations never run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


@functools.cache
def _import_nodes(path: Path, mtime_ns: int, size: int) -> tuple[ast.Import | ast.ImportFrom, ...]:
    """The import statements of one version of a file that run: parsed once, not once per test
    (each test walks every file of k3)."""
    return tuple(node for node in runtime_nodes(ast.parse(path.read_text(), str(path)))
                 if isinstance(node, (ast.Import, ast.ImportFrom)))


def imported_modules(path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """Every k3 module `path` imports at run time, with the line; `from k3.x import y` names k3.x.y
    when that is a module (a submodule import), else k3.x."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    stat = path.stat()
    for node in _import_nodes(path, stat.st_mtime_ns, stat.st_size):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "k3"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "k3":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in modules else target, node.lineno))
    return found


def import_graph() -> dict[tuple[str, str], list[str]]:
    """(importer part, imported part) -> the `file:line`s that make the edge."""
    modules = all_modules()
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for name, path in modules.items():
        src = part_of(name)
        for target, line in imported_modules(path, modules):
            dst = part_of(target)
            if dst != src:
                edges[(src, dst)].append(f"{path.relative_to(ROOT)}:{line}")
    return edges


def find_cycle(edges) -> list[str] | None:
    """One cycle of the part graph as [a, b, ..., a], or None."""
    graph = defaultdict(set)
    for src, dst in edges:
        graph[src].add(dst)
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_graph_sees_the_known_parts():
    """Guards the walker itself: a graph with no edges would pass every check below."""
    edges = import_graph()
    assert ("k3.serve", "k3.model") in edges, sorted(edges)
    assert ("k3.model", "k3.ops") in edges, sorted(edges)


def test_no_import_cycle_between_parts():
    edges = import_graph()
    cycle = find_cycle(edges)
    if cycle:
        where = "; ".join(f"{a} -> {b} at {', '.join(edges[(a, b)][:3])}" for a, b in itertools.pairwise(cycle))
        pytest.fail(f"import cycle {' -> '.join(cycle)}: {where}")


@pytest.mark.parametrize("src,dst", list(FORBIDDEN), ids=[f"{s}-not-{d}" for s, d in FORBIDDEN])
def test_forbidden_edge(src, dst):
    edges = import_graph()
    assert (src, dst) not in edges, f"{src} imports {dst} at {', '.join(edges[(src, dst)])}: {FORBIDDEN[(src, dst)]}"


def test_nothing_imports_rl():
    """RL is a leaf: the verbs reach it by name (k3/cli.py), nothing else builds on its internals."""
    edges = import_graph()
    users = {src: where for (src, dst), where in edges.items() if dst == "k3.rl"}
    assert not users, f"k3.rl is imported by {', '.join(f'{s} ({w[0]})' for s, w in users.items())}"


def test_walker_resolves_relative_and_function_level_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "k3"
    (pkg / "serve").mkdir(parents=True)
    (pkg / "train").mkdir()
    for f in ("__init__.py", "serve/__init__.py", "train/__init__.py", "train/loop.py"):
        (pkg / f).write_text("")
    (pkg / "serve" / "engine.py").write_text("def f():\n    from ..train import loop\n")
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "ROOT", tmp_path)
    monkeypatch.setattr(this, "K3", pkg)
    assert ("k3.serve", "k3.train") in import_graph()


def test_no_import_cycle_inside_a_part():
    """Inside a package, modules import one way too (k3/checkpoint: files <- official <- packed <-
    pretrained), so no module needs a function-level import to dodge a circle."""
    modules = all_modules()
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for name, path in modules.items():
        for target, line in imported_modules(path, modules):
            if part_of(target) == part_of(name) != "k3" and target != name:
                edges[(name, target)].append(f"{path.relative_to(ROOT)}:{line}")
    assert edges, "the walker found no import inside any package"
    cycle = find_cycle(edges)
    if cycle:
        where = "; ".join(f"{a} -> {b} at {', '.join(edges[(a, b)][:3])}" for a, b in itertools.pairwise(cycle))
        pytest.fail(f"import cycle {' -> '.join(cycle)}: {where}")


def test_find_cycle_names_it():
    assert find_cycle({("a", "b"): [], ("b", "c"): [], ("c", "a"): [], ("c", "d"): []}) == ["a", "b", "c", "a"]
    assert find_cycle({("a", "b"): [], ("a", "c"): [], ("b", "c"): []}) is None
