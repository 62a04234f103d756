"""The Numba cache guard (fia.cpu.kernel_cache): a kernel module's cached machine code is reused only while the
files it embeds are unchanged, so editing or upgrading one of them rebuilds the module's kernels.

The dependency lists are checked against the kernel modules' imports (read from the files' text); the guard
itself on a toy kernel module in child processes with their own cache folder: a second process loads from the
cache, an edit of a dependency makes the next process compile again."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fia.backends.decode.kernels  # each kernel module declares its dependencies (kernel_cache.install)
import fia.backends.prefill.kernels
import fia.backends.prefill.pse_kernels  # noqa: F401
from fia.cpu import kernel_cache as KC

pytestmark = pytest.mark.backend_independent      # the cache guard: run once, not per backend (conftest)


def _imports(rel: str) -> set:
    """The package files a module imports with relative imports (paths in the package)."""
    here = (KC.PACKAGE / rel).parent
    out = set()
    for node in ast.walk(ast.parse((KC.PACKAGE / rel).read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here
            for _ in range(node.level - 1):
                base = base.parent
            for name in ([node.module] if node.module else [a.name for a in node.names]):
                p = base.joinpath(*name.split("."))
                if p.with_suffix(".py").is_file():
                    out.add(p.with_suffix(".py").relative_to(KC.PACKAGE).as_posix())
    return out


@pytest.mark.parametrize("module", sorted(KC.DEPENDENCIES))
def test_dependencies_are_complete(module):
    """What a kernel module (or every module of a kernel package, "folder/") imports, transitively, is listed."""
    listed = set(KC._files(module, KC.PACKAGE))
    start = sorted(f for f in listed if f.startswith(module)) if module.endswith("/") else [module]
    assert start, module
    seen, todo = set(start), list(start)
    while todo:
        for dep in _imports(todo.pop()) - seen - {"cpu/kernel_cache.py"}:
            seen.add(dep)
            todo.append(dep)
    assert seen - set(start) <= listed, f"{module} also embeds {sorted(seen - set(start) - listed)}"


def test_every_cached_kernel_is_keyed_on_its_dependencies():
    """Every cached compiled function of a kernel module or package uses FIA's locator (its cache keyed on the
    dependencies' hash): numba picks the locator when the decorator runs, so a package must declare its
    dependencies before its modules are imported -- else an edit of cpu/simd.py left the old kernels cached."""
    import importlib
    import sys as _sys

    from numba.core.registry import CPUDispatcher
    checked = 0
    for name, mod in list(_sys.modules.items()):
        f = getattr(mod, "__file__", None) or ""
        if not name.startswith("fia.") or KC.module_of(f) is None and not f.endswith("__init__.py"):
            continue
        for obj in vars(importlib.import_module(name)).values():
            if isinstance(obj, CPUDispatcher) and obj.py_func.__module__ == name and obj._cache is not None \
                    and type(obj._cache).__name__ != "NullCache":
                loc = obj._cache._impl.locator
                assert getattr(type(loc), "_fia", False), f"{name}.{obj.py_func.__name__}: {type(loc).__name__}"
                checked += 1
    assert checked >= 10


def test_hash_changes_with_a_dependency(tmp_path):
    """The hash follows the bytes of every listed file (not just their names)."""
    module = "backends/prefill/kernels.py"
    KC.sources_sha.cache_clear()                  # (read once per process: the files may have changed since)
    for name in KC.DEPENDENCIES[module]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes((KC.PACKAGE / name).read_bytes())
    before = KC.sources_sha(module, tmp_path)
    assert before == KC.sources_sha(module)
    p = tmp_path / KC.DEPENDENCIES[module][-1]
    p.write_bytes(p.read_bytes() + b"# edited\n")
    KC.sources_sha.cache_clear()
    assert KC.sources_sha(module, tmp_path) != before


_CHILD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from fia.cpu import kernel_cache as KC
    root = Path(sys.argv[1])
    KC.PACKAGE, KC.DEPENDENCIES = root, {"toy.py": ("dep.py",)}
    KC.install()
    sys.path.insert(0, str(root))
    import toy
    assert toy.twice(1.5) == 3.0
    print(json.dumps({"hits": sum(toy.twice.stats.cache_hits.values()),
                      "misses": sum(toy.twice.stats.cache_misses.values())}))
""")


def test_an_edited_dependency_rebuilds_the_cached_kernel(tmp_path):
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "toy.py").write_text("from numba import njit\n\n\n@njit(cache=True)\ndef twice(x):\n    return 2.0 * x\n")
    (root / "dep.py").write_text("A = 1\n")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))

    def run():
        r = subprocess.run([sys.executable, "-c", _CHILD, str(root)], capture_output=True, text=True, env=env,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    assert run() == {"hits": 0, "misses": 1}                  # compiles, writes the cache
    assert run() == {"hits": 1, "misses": 0}                  # loads it
    (root / "dep.py").write_text("A = 2\n")                   # the toy module itself untouched
    assert run() == {"hits": 0, "misses": 1}                  # rebuilds
    assert run() == {"hits": 1, "misses": 0}
    assert any(Path(tmp_path / "cache").rglob("*.nbi"))
