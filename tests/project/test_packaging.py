"""Packaging: one version source (fia.__version__, read by pyproject.toml), the py.typed marker, the licence."""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

import fia
from paths import ROOT

pytestmark = pytest.mark.backend_independent      # packaging metadata: run once, not per backend (conftest)



def test_installed_version_is_fia_version():
    try:
        installed = importlib.metadata.version("fia")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("fia is not installed (imported from the source tree)")
    assert installed == fia.__version__


def test_py_typed_and_license():
    assert (Path(fia.__file__).parent / "py.typed").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'license = "BSD-3-Clause"' in pyproject
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License")
