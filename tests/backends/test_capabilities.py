"""Each backend's capabilities are declared once (Backend.capabilities): the README's feature table is rendered
from them, and not_supported_reasons refuses exactly what they exclude."""
from __future__ import annotations

import inspect

import pytest
import torch

import fia
from fia import parse
from fia.backends import base, registry
from paths import ROOT

pytestmark = pytest.mark.backend_independent      # reads the declarations: run once, not per backend (conftest)

README = ROOT / "README.md"
ORDER = ("reference", "torch", "decode", "prefill")             # the README's columns


def test_readme_feature_table_is_the_capability_data():
    names = [b.name for b in registry.backends()]
    table = base.feature_table([registry.by_name(n) for n in ORDER if n in names])
    assert table in README.read_text(), "README's feature table differs from base.feature_table(); paste:\n" + table


def _problem(q_s: int, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(q_s)
    q = torch.randn(1, 4, q_s, 64, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, 96, 64, generator=g).to(dtype) for _ in range(2))
    args = {n: prm.default for n, prm in inspect.signature(fia.eager.npu_fused_infer_attention_score).parameters.items()}
    args.update(query=q.to(device), key=k.to(device), value=v.to(device), num_heads=4, num_key_value_heads=2,
                input_layout="BNSD")
    with fia.validation_mode("portable"):
        return parse.parse_fused(args)


@pytest.mark.parametrize("name", [n for n in ORDER if n in [b.name for b in registry.backends()]])
def test_refusals_follow_the_declared_capabilities(name):
    be = registry.by_name(name)
    caps = be.capabilities
    for q_s in (1, 2, 17):
        reasons = be.not_supported_reasons(_problem(q_s))
        too_long = caps.max_q_s is not None and q_s > caps.max_q_s
        decode_refused = not caps.decode and q_s == 1
        assert bool(reasons) == (too_long or decode_refused), (name, q_s, reasons)
    reasons = be.not_supported_reasons(_problem(2, torch.float64))
    assert bool(reasons) == (torch.float64 not in caps.compute_dtypes), reasons
    meta = be.not_supported_reasons(_problem(2, device="meta"))
    assert meta, f"{name} accepted a meta problem"
