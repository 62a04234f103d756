"""The whole suite runs once per registered backend (ARCHITECTURE: one suite for every backend).

Each test is parametrized with a backend forced through fia.use_backend; a case the forced backend
declares unsupported (FiaBackendUnavailable) is skipped for that backend, not failed. Restrict the set
with FIA_TEST_BACKENDS=reference,decode (comma-separated names).
"""
import os

# the suite tests what each backend computes, compiling where needed (tests/test_jit.py covers the tiers)
os.environ.setdefault("FIA_JIT", "sync")

import pytest

import fia
from fia.backends import registry
from fia.errors import FiaBackendUnavailable

_ALL = [b.name for b in registry.backends()]
_SEL = [n for n in os.environ.get("FIA_TEST_BACKENDS", ",".join(_ALL)).split(",") if n]


@pytest.fixture(autouse=True, params=_SEL, ids=lambda n: f"be={n}")
def fia_backend(request):
    with fia.use_backend(request.param):
        yield request.param


@pytest.hookimpl(hookwrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    outcome = yield
    exc = outcome.excinfo
    if exc is not None and issubclass(exc[0], FiaBackendUnavailable):
        outcome.force_exception(pytest.skip.Exception(f"backend cannot run this case: {exc[1]}",
                                                      _use_item_location=True))
