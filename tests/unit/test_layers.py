"""The import-layer contract of docs/ARCHITECTURE.md#layers, checked on the source.

A module imports only modules of its own layer or a lower one; no import cycles (function-local imports
included); no file in the library over the size limit.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "lightning_rec"
MAX_LINES = 520

# module prefix (dotted, relative to lightning_rec) -> layer; the longest matching prefix wins
LAYERS = {
    "_compat": 0,
    "sparse": 1, "configs": 1, "memory": 1,
    "fused_kinds": 1, "plans.shard_geometry": 1, "plans.kinds": 1,
    "kernels": 2, "embedding_modules": 2,
    "optim": 3, "transport": 3,
    "plans": 4, "pipeline": 4, "mc": 4, "data": 4,
    # the public facade of plans and pipeline: re-exports only
    "sharding": 5,
    "checkpoint": 5, "export": 5, "distributed": 5, "strategy": 5, "fabric": 5, "uneven": 5, "preemption": 5,
    "shard_setup": 5, "table_optimizers": 5, "rec_module": 5, "callbacks": 5, "metrics": 5, "testing": 5,
    "models": 6, "nn": 6,
    "cli": 7, "__init__": 7,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _layer(module: str) -> int:
    best = None
    for prefix, layer in LAYERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, layer)
    assert best is not None, f"lightning_rec.{module} has no layer in LAYERS: add it (and to ARCHITECTURE.md)"
    return best[1]


def _walk_runtime(tree: ast.AST):
    """ast.walk, minus `if TYPE_CHECKING:` blocks (annotations only, never executed)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in _walk_runtime(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                prefix = ".".join(["lightning_rec", *base] + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
        for name in names:
            if name == "lightning_rec" or not name.startswith("lightning_rec."):
                continue
            target = name[len("lightning_rec."):]
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def test_every_module_has_a_layer_and_imports_only_downwards() -> None:
    graph = _graph()
    upward = []
    for mod, deps in graph.items():
        for dep in deps:
            # a package's __init__ re-exports its own members; a member may not import its package back
            if mod.startswith(dep + ".") or dep.startswith(mod + "."):
                continue
            if _layer(dep) > _layer(mod):
                upward.append(f"lightning_rec.{mod} (layer {_layer(mod)}) imports lightning_rec.{dep} "
                              f"(layer {_layer(dep)})")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_no_import_cycles() -> None:
    graph = _graph()
    # packages' __init__ importing their members is not a cycle of code
    edges = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]) if dep in stack else dep)
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_file_size(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (limit {MAX_LINES}): split it"
