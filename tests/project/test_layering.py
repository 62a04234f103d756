"""The package's import layering (docs/ARCHITECTURE.md): a module imports only modules of its own layer or
below, and no import circle exists -- module-level and function-level imports alike, read from the sources."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fia

pytestmark = pytest.mark.backend_independent      # reads the sources: run once, not per backend (conftest)

PACKAGE = Path(fia.__file__).resolve().parent

# bottom to top; a module belongs to the first layer whose prefix matches its dotted name
LAYERS = [
    ("fia.errors", "fia.config", "fia.caches"),
    ("fia.problem",),
    ("fia.parse",),
    ("fia.cpu",),
    ("fia.backends",),
    ("fia.finalize", "fia.merge", "fia.outvariants", "fia.replay", "fia.eager"),
    ("fia.graph", "fia.api", "fia.aclnn", "fia.dispatch_report", "fia.kernel_warmup", "fia.torch_npu",
     "fia.__main__", "fia"),
    ("fia.bench", "fia.integrations", "fia.distributed"),
]


def _modules() -> dict:
    mods = {}
    for p in PACKAGE.rglob("*.py"):
        parts = ("fia",) + p.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


MODULES = _modules()


def _layer(mod: str) -> int:
    for i, names in enumerate(LAYERS):
        for n in names:
            if mod == n or (n != "fia" and mod.startswith(n + ".")):
                return i
    raise AssertionError(f"{mod} is in no layer: add it to LAYERS and docs/ARCHITECTURE.md")


def _imports(mod: str) -> set:
    """The package modules `mod` imports (a `from package import name` counts the submodule when it is one)."""
    path = MODULES[mod]
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:              # `import fia.x.y` names fia.x.y; a symbol's module is above it
                t = t.rpartition(".")[0]
            if t and t != mod:
                out.add(t)
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def test_every_module_has_a_layer():
    for m in MODULES:
        _layer(m)


def test_no_import_against_the_layering():
    bad = sorted(f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
                 for m, ts in GRAPH.items() for t in ts if _layer(t) > _layer(m))
    assert not bad, "\n".join(bad)


def test_no_import_circle():
    # the package's own __init__ re-exports from everything below it: it is the root, not part of a circle
    graph = {m: {t for t in ts if t != "fia"} for m, ts in GRAPH.items() if m != "fia"}
    state, stack, circles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                circles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not circles, "\n".join(circles)


def test_no_import_runs_back_up_to_the_package():
    """Only the layers above the package's own namespace (tools, integrations, aliases of it) import `fia` itself;
    the modules it is made of import the module they need."""
    bad = sorted(m for m, ts in GRAPH.items() if "fia" in ts and _layer(m) <= _layer("fia"))
    assert not bad, bad


BACKENDS = ("decode", "prefill", "torchops")


def test_backends_import_no_other_backend():
    """A backend imports nothing of another backend (what two of them share lives in fia.cpu, fia.problem or the
    reference); the registry is the one module that knows them all."""
    bad = []
    for m, ts in GRAPH.items():
        parts = m.split(".")
        if len(parts) > 2 and parts[1] == "backends" and parts[2] in BACKENDS:
            bad += [f"{m} -> {t}" for t in ts
                    if t.split(".")[:2] == ["fia", "backends"] and len(t.split(".")) > 2
                    and t.split(".")[2] in BACKENDS and t.split(".")[2] != parts[2]]
    assert not bad, "\n".join(bad)


def test_the_checks_see_imports():
    """The graph is not empty by accident: known edges are found."""
    assert "fia.parse.core" in GRAPH["fia.eager"] or "fia.parse" in GRAPH["fia.eager"]
    assert "fia.backends.registry" in GRAPH["fia.eager"]
    assert "fia.problem.attention" in GRAPH["fia.backends.base"]
    assert "fia.cpu.numerics" in GRAPH["fia.backends.prefill.kernels"]
    assert "fia.backends.decode.kernels.params" in GRAPH["fia.backends.decode.kernels.items"]


def test_cpu_names_no_backend():
    """fia.cpu is the kernel mechanism: no string in its code names a backend module or path (each backend
    registers its kernel sets, each kernel module declares what it embeds)."""
    bad = []
    for m, path in MODULES.items():
        if not m.startswith("fia.cpu"):
            continue
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        bad += [f"{m}: {n.value!r}" for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                and id(n) not in docs and ("backends." in n.value or "backends/" in n.value)]
    assert not bad, "\n".join(bad)
