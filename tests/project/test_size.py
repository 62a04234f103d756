"""The package's pieces stay readable one at a time (docs/ARCHITECTURE.md): no function over 200 lines, no
module over 1,000 lines -- kernels included (the decode item driver runs over inline stage functions)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fia

pytestmark = pytest.mark.backend_independent      # reads the sources: run once, not per backend (conftest)

PACKAGE = Path(fia.__file__).resolve().parent
MAX_FUNCTION_LINES = 200
MAX_MODULE_LINES = 1000
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _long_functions(path: Path) -> list:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_over_the_limit():
    found = [f"{p.relative_to(PACKAGE)}: {name} ({n} lines)" for p in SOURCES for name, n in _long_functions(p)]
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {found}"


def test_no_module_over_the_limit():
    found = [f"{p.relative_to(PACKAGE)} ({n} lines)" for p in SOURCES
             if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    assert not found, f"modules over {MAX_MODULE_LINES} lines: {found}"


def test_the_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    src = tmp_path / "m.py"
    src.write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n    return 0\n")
    assert _long_functions(src) == [("long", MAX_FUNCTION_LINES + 2)]
