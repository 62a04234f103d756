"""Where the suite lives: the test folders (one per layer, see conftest.py) share the helper modules at the top of
tests/ and import each other's helpers by module name, so every folder is on sys.path (conftest.py) and on the
PYTHONPATH of the child processes tests start."""
from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FOLDERS = [TESTS] + sorted(d for d in TESTS.iterdir() if d.is_dir() and (d / "__init__.py").exists() is False
                           and any(d.glob("test_*.py")))
PYTHONPATH = os.pathsep.join(str(d) for d in FOLDERS)


def child_env(env: dict) -> dict:
    """env with the test folders in front of its PYTHONPATH."""
    return dict(env, PYTHONPATH=os.pathsep.join(p for p in (PYTHONPATH, env.get("PYTHONPATH", "")) if p))
