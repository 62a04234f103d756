"""`ruff check src tests` passes with the configuration of pyproject.toml ([tool.ruff]): CI enforces the lint.

ruff comes with requirements-ci.txt (and the `dev` extra); the test skips only where it is not installed.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from paths import ROOT

pytestmark = pytest.mark.backend_independent      # one run with automatic backend selection (conftest)



@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed")
def test_ruff_check_passes():
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "src", "tests"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"ruff check src tests:\n{res.stdout}{res.stderr}"
