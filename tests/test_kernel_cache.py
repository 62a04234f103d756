"""The Numba cache guard (fia.backends.kernel_sources): every cached kernel module carries the hash of the
files its machine code embeds, so editing or upgrading one of them invalidates the module's on-disk cache.

Read from the files' text (no numba import needed): the literal must equal the hash of the current sources,
and the dependency list must hold every module the kernel module imports, directly or through another one."""
from __future__ import annotations

import ast
import re

import pytest

from fia.backends import kernel_sources as KS


def _literal(module: str) -> str:
    text = (KS._HERE / f"{module}.py").read_text()
    m = re.search(r'^SOURCES_SHA = "([0-9a-f]{16})"', text, re.M)
    assert m, f"{module}.py has no SOURCES_SHA literal"
    return m.group(1)


def _relative_imports(name: str) -> set:
    tree = ast.parse((KS._HERE / name).read_text())
    return {f"{node.module}.py" for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module}


@pytest.mark.parametrize("module", sorted(KS.DEPENDENCIES))
def test_sources_sha_is_current(module):
    want = KS.sources_sha(module)
    assert _literal(module) == want, (
        f"{module}.SOURCES_SHA is stale (one of {', '.join(KS.DEPENDENCIES[module])} changed): set it to "
        f'"{want}" so numba rebuilds its cached kernels')


@pytest.mark.parametrize("module", sorted(KS.DEPENDENCIES))
def test_dependencies_are_complete(module):
    seen, todo = set(), [f"{module}.py"]
    while todo:
        for dep in _relative_imports(todo.pop()) - seen - {"kernel_sources.py"}:
            seen.add(dep)
            todo.append(dep)
    assert seen <= set(KS.DEPENDENCIES[module]), f"{module} also embeds {sorted(seen - set(KS.DEPENDENCIES[module]))}"


def test_hash_changes_with_a_dependency(tmp_path, monkeypatch):
    """The hash follows the bytes of every listed file (not just their names)."""
    for name in KS.DEPENDENCIES["decode_kernels"]:
        (tmp_path / name).write_bytes((KS._HERE / name).read_bytes())
    monkeypatch.setattr(KS, "_HERE", tmp_path)
    before = KS.sources_sha("decode_kernels")
    p = tmp_path / KS.DEPENDENCIES["decode_kernels"][-1]
    p.write_bytes(p.read_bytes() + b"# edited\n")
    assert KS.sources_sha("decode_kernels") != before
