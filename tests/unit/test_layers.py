"""The import-layer contract of docs/ARCHITECTURE.md#layers, checked on the source.

A module imports only modules of its own layer or a lower one; no import cycles (function-local imports
included, and, separately, annotation-only imports too); no private attribute of torch, Lightning or fbgemm
reached outside ``_compat``; no file in the library over the size limit.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "lightning_rec"
MAX_LINES = 500  # ruff format's layout; a file past it is two ideas

# module prefix (dotted, relative to lightning_rec) -> layer; the longest matching prefix wins
LAYERS = {
    "_compat": 0,
    "sparse": 1,
    "configs": 1,
    "host_syncs": 1,
    "memory": 1,
    "fused_kinds": 1,
    "plans.shard_geometry": 1,
    "plans.kinds": 1,
    "kernels": 2,
    "embedding_modules": 2,
    "feature_layout": 2,
    "optim": 3,
    "transport": 3,
    "plans": 4,
    "pipeline": 4,
    "mc": 4,
    "data": 4,
    # the public facade of plans and pipeline: re-exports only
    "sharding": 5,
    "checkpoint": 5,
    "export": 5,
    "program": 5,
    "distributed": 5,
    # the core every front end calls; the Lightning front end (strategies, their core, RecModule, callbacks)
    "front_end": 5,
    "lightning": 5,
    "metrics": 5,
    "testing": 5,
    "quant": 5,
    "models": 6,
    "nn": 6,
    "cli": 7,
    "__init__": 7,
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


def _walk_runtime(tree: ast.AST) -> Iterator[ast.AST]:
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


def _imports(module: str, path: Path, known: set[str], annotations: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(tree) if annotations else _walk_runtime(tree):
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
            target = name[len("lightning_rec.") :]
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


def _graph(annotations: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods), annotations) for m, p in mods.items()}


def test_every_module_has_a_layer_and_imports_only_downwards() -> None:
    graph = _graph()
    upward = []
    for mod, deps in graph.items():
        for dep in deps:
            # a package's __init__ re-exports its own members; a member may not import its package back
            if mod.startswith(dep + ".") or dep.startswith(mod + "."):
                continue
            if _layer(dep) > _layer(mod):
                upward.append(
                    f"lightning_rec.{mod} (layer {_layer(mod)}) imports lightning_rec.{dep} (layer {_layer(dep)})"
                )
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def _code_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    # packages' __init__ importing their members is not a cycle of code
    return {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    edges = _code_edges(graph)
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep) :] + [dep] if dep in stack else [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Every group of two or more modules that all reach each other through imports."""
    edges = _code_edges(graph)

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for dep in edges.get(todo.pop(), ()):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    reaches = {m: reach(m) for m in edges}
    tangles: list[set[str]] = []
    for mod in sorted(edges):
        group = {mod} | {d for d in reaches[mod] if mod in reaches.get(d, ())}
        if len(group) > 1 and group not in tangles:
            tangles.append(group)
    return tangles


def test_no_import_cycles_with_annotations() -> None:
    """Imports under `if TYPE_CHECKING:` count too: a cycle there is still two modules that need each other."""
    graph = _graph(annotations=True)
    # whole tangles, not the one cycle the search names per back edge, so nothing hides behind the allowed one
    tangles = list(_tangles(graph))
    cycles = [c for c in _cycles(graph) if any(set(c) <= t for t in tangles)]
    assert not tangles, (
        "import cycles (annotation-only imports included), among:\n"
        + "\n".join(", ".join(sorted(t)) for t in tangles)
        + "\nfor example:\n"
        + "\n".join(" -> ".join(c) for c in cycles)
    )


# packages whose private attributes only _compat may reach (it pins and documents each one)
GUARDED_ROOTS = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "fbgemm_gpu")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _guarded(dotted: str) -> bool:
    return dotted.split(".")[0] in GUARDED_ROOTS


def _private_uses(path: Path) -> list[str]:
    """``line: expression`` of every private attribute reached from a name a guarded package's import binds."""
    tree = ast.parse(path.read_text())
    roots: set[str] = set()  # names bound anywhere in the file to a guarded module or one of its members
    hits: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _guarded(alias.name):
                    continue
                roots.add(alias.asname or alias.name.split(".")[0])
                if any(_private(part) for part in alias.name.split(".")):
                    hits.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and not node.level and _guarded(node.module or ""):
            roots.update(alias.asname or alias.name for alias in node.names)
            if any(_private(part) for part in node.module.split(".")) or any(_private(a.name) for a in node.names):
                hits.append((node.lineno, ast.unparse(node)))

    def chain(node: ast.expr) -> tuple[ast.expr, list[str]]:
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        return node, attrs[::-1]

    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Attribute):
            base, attrs = chain(node)
            if isinstance(base, ast.Name) and base.id in roots and any(_private(a) for a in attrs):
                hits.append((node.lineno, ast.unparse(node)))
            todo.append(base)  # `torch.f()._x` is an attribute of a value, but `torch.f` is still reached
            continue
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            base, _ = chain(node.args[0])
            if isinstance(base, ast.Name) and base.id in roots:
                hits.append((node.lineno, ast.unparse(node)))
        todo.extend(ast.iter_child_nodes(node))
    return [f"{path.relative_to(ROOT.parent)}:{line}: {expr}" for line, expr in sorted(set(hits))]


# private attributes of torch's and Lightning's *instances* (an nn.Module's registries and hooks, a strategy's
# launcher, a LightningModule's trainer): reached on any object, they are version-dependent all the same
INSTANCE_PRIVATES = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_forward_hooks",
        "_forward_pre_hooks",
        "_backward_hooks",
        "_state_dict_hooks",
        "_load_state_dict_pre_hooks",
        "_register_state_dict_hook",
        "_register_load_state_dict_pre_hook",
        "_launcher",
        "_trainer",
        "_strategy",
        "_accelerator_connector",
        "_forward_module",
        "_original_module",
    }
)


def _instance_private_uses(path: Path) -> list[str]:
    """``line: expression`` of every attribute in INSTANCE_PRIVATES reached on any value."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in INSTANCE_PRIVATES:
            hits.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {ast.unparse(node)}")
    return sorted(set(hits))


def _in_compat(module: str) -> bool:
    # the compat package and its subject modules (torch_internals, dtensors, lightning_internals)
    return module == "_compat" or module.startswith("_compat.")


def test_private_instance_attributes_only_in_compat() -> None:
    """``m._parameters``, ``self._modules[name]``, ``strategy._launcher``: the private state of torch's and Lightning's
    objects goes through ``_compat`` too (INSTANCE_PRIVATES)."""
    hits = [
        hit for mod, path in sorted(_modules().items()) if not _in_compat(mod) for hit in _instance_private_uses(path)
    ]
    assert not hits, "private instance attributes of torch / Lightning outside lightning_rec/_compat/:\n" + "\n".join(
        hits
    )


def test_private_symbols_only_in_compat() -> None:
    """torch, Lightning and fbgemm change their private attributes between minor releases without notice; every
    use goes through a documented function of ``_compat``, so a version bump has one package to check."""
    hits = [hit for mod, path in sorted(_modules().items()) if not _in_compat(mod) for hit in _private_uses(path)]
    assert not hits, "private attributes of torch / Lightning / fbgemm outside lightning_rec/_compat/:\n" + "\n".join(
        hits
    )


def test_private_symbol_check_sees_aliases() -> None:
    source = (
        "import torch\nimport torch.distributed as dist\nfrom torch import nn\nimport torch._dynamo\n"
        "from torch.x._y import z\nfrom lightning.fabric import _w\n"
        "def f(t):\n    dist.distributed_c10d._get_default_group()\n    torch._C._foo(t)\n"
        "    nn.Module.__init__(t)\n    t._version\n    self._x\n    getattr(torch, '_y', None)\n"
        "    torch.f()._z\n"
    )
    path = ROOT / "_private_probe.py"
    try:
        path.write_text(source)
        hits = [h.split(": ", 1)[1] for h in _private_uses(path)]
    finally:
        path.unlink()
    assert hits == [
        "import torch._dynamo",
        "from torch.x._y import z",
        "from lightning.fabric import _w",
        "dist.distributed_c10d._get_default_group",
        "torch._C._foo",
        "getattr(torch, '_y', None)",
    ]


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_file_size(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (limit {MAX_LINES}): split it"
