"""Which backend each test runs against (ARCHITECTURE: one suite for every backend).

A test that computes attention runs once per registered backend that can run its case: one item per
(case, backend), id ``[be=<name>-...]``, with that backend forced through ``fia.use_backend`` by the
``fia_backend`` fixture (a test may take ``fia_backend`` as an argument: the forced backend's name).
The items are GENERATED (pytest_generate_tests below), never collected just to be skipped:

* ``@pytest.mark.backend_independent`` (or ``pytestmark = ...`` for a module or class): parse, interface,
  kernel and process-level tests, and tests that name / compare backends themselves -> ONE item, no ``be=``
  id, automatic backend selection (``fia_backend`` is None). This marker is the one way out of the
  per-backend runs: a test module may not override the ``fia_backend`` fixture (collection fails).
* ``@pytest.mark.backends("decode", ...)``: only these backends (one backend's own behaviour).
* ``@pytest.mark.case(**features)``: what the case asks of a backend, for cases some backend cannot run
  (backend_caps.py: ``q_s``, ``decode``, ``full_quant``, ``compute``); a feature's value is a constant, the
  name of one of the test's parameters, or a function of the parameter dict. Only the backends
  backend_caps.can_run accepts get an item. Examples::

      @pytest.mark.case(q_s=1)                   # a decode call: no be=prefill item
      @pytest.mark.case(full_quant=True)         # int8 Q/K/V: reference and torch only
      @pytest.mark.case(q_s="sq")                # per case, from the test's `sq` parameter
* no marker: every backend.

Safety net: a case a forced backend still refuses at run time (FiaBackendUnavailable) is reported as a
skip, not a failure -- keep those rare by describing the case with ``case``. FIA_TEST_AUDIT=1 generates
the excluded items too and demands that each one really is refused (an excluded case the backend runs
fails the audit: the filter lost coverage). FIA_TEST_BACKENDS=reference,decode restricts the backends.
"""
import os
import sys

from paths import FOLDERS

# the suite tests what each backend computes, compiling where needed (tests/cpu/test_jit.py covers the tiers)
os.environ.setdefault("FIA_JIT", "sync")

import pytest

import fia
from backend_caps import can_run
from fia.backends import registry
from fia.errors import FiaBackendUnavailable

# the test folders (one per layer: validation, semantics, backends, cpu, interfaces, reliability, clients, project)
# import the helpers at the top of tests/ and each other's by module name
for _d in reversed(FOLDERS):
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))

_ALL = [b.name for b in registry.backends()]
_SEL = [n for n in os.environ.get("FIA_TEST_BACKENDS", ",".join(_ALL)).split(",") if n]
_AUDIT = os.environ.get("FIA_TEST_AUDIT", "") == "1"


def pytest_configure(config):
    for line in ("backend_independent: one run with automatic backend selection, not one per backend (conftest)",
                 "backends(*names): run only under these backends (conftest)",
                 "case(**features): what the case asks of a backend; backends that cannot run it get no "
                 "item (conftest, backend_caps.py)",
                 "fia_excluded(reason): set by conftest under FIA_TEST_AUDIT=1 on items the case filter excludes"):
        config.addinivalue_line("markers", line)


@pytest.fixture(autouse=True)
def fia_backend(request):
    """The backend this item forces (its ``be=`` parameter), or None: automatic selection."""
    name = getattr(request, "param", None)
    with fia.use_backend(name):
        yield name


def _backends_of(metafunc):
    """The backends a test function is parametrized over; None: backend-independent (one item)."""
    defs = metafunc._arg2fixturedefs.get("fia_backend", ())
    if len(defs) != 1:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: overrides the fia_backend fixture; mark the module "
                                "or test @pytest.mark.backend_independent instead (conftest)")
    if "fia_backend" not in metafunc.fixturenames:
        return None
    if metafunc.definition.get_closest_marker("backend_independent") is not None:
        return None
    names = list(_SEL)
    for m in metafunc.definition.iter_markers("backends"):
        names = [n for n in names if n in m.args]
    return names


def _features(metafunc, params):
    feats = {}
    for m in reversed(list(metafunc.definition.iter_markers("case"))):   # the closest marker wins
        for k, v in m.kwargs.items():
            if callable(v):
                v = v(params)
            elif isinstance(v, str) and v in params:
                v = params[v]
            feats[k] = v
    return feats


@pytest.hookimpl(wrapper=True)
def pytest_generate_tests(metafunc):
    names = _backends_of(metafunc)
    if names is not None:
        metafunc.parametrize("fia_backend", names, indirect=True, ids=[f"be={n}" for n in names])
    res = yield
    if names is None or metafunc.definition.get_closest_marker("case") is None:
        return res
    kept = []
    for cs in metafunc._calls:
        why = can_run(cs.params["fia_backend"], **_features(metafunc, cs.params))
        if why is True:
            kept.append(cs)
        elif _AUDIT:
            cs.marks.append(pytest.mark.fia_excluded(why).mark)
            kept.append(cs)
    if not kept and metafunc._calls:           # no backend can run any case: one visible skip, not silence
        metafunc._calls[0].marks.append(pytest.mark.skip(reason="no selected backend runs these cases").mark)
        kept = metafunc._calls[:1]
    metafunc._calls[:] = kept
    return res


@pytest.hookimpl(hookwrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    outcome = yield
    exc = outcome.excinfo
    excluded = pyfuncitem.get_closest_marker("fia_excluded")
    if exc is not None and issubclass(exc[0], FiaBackendUnavailable):
        why = f"excluded at collection ({excluded.args[0]}), confirmed" if excluded else "backend cannot run this case"
        outcome.force_exception(pytest.skip.Exception(f"{why}: {exc[1]}", _use_item_location=True))
    elif excluded is not None and exc is None:
        outcome.force_exception(pytest.fail.Exception(
            f"conftest/backend_caps excluded this case ({excluded.args[0]}) but the backend ran it: coverage lost",
            pytrace=False))


@pytest.fixture
def fia_calls(monkeypatch):
    """The keyword arguments of every fia.npu_fused_infer_attention_score call, with the query / key shapes and the
    key dtype (q_shape, k_shape, k_dtype): integrations look the function up at call time."""
    import fia
    seen = []
    real = fia.npu_fused_infer_attention_score

    def spy(q, k, v, **kw):
        seen.append(dict(kw, q_shape=tuple(q.shape), k_shape=tuple(k.shape), k_dtype=k.dtype))
        return real(q, k, v, **kw)

    monkeypatch.setattr(fia, "npu_fused_infer_attention_score", spy)
    return seen
