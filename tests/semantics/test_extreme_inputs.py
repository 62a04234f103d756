"""Extreme arguments give one answer on every path: a scale that is not a finite float32 is FIA's input error
(DECISIONS 49), a keyword an entry point does not take is FIA's input error naming it -- the same class and
message eagerly, on meta tensors, under FakeTensorMode and under make_fx -- and values at float32's limits or NaN /
Inf give every backend the reference's NaN / Inf pattern (DECISIONS 52)."""
from __future__ import annotations

import os
import random

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import fia
from fia.backends import registry
from fia.errors import FiaBackendUnavailable
from test_fuzz_random import build, call, draw
from util import gen, randn

pytestmark = pytest.mark.backend_independent      # parse decides before any backend: run once (conftest)

BF16 = torch.bfloat16
# entry point -> (function, its num-heads keyword, its scale keyword)
ENTRIES = {
    "fused": (fia.npu_fused_infer_attention_score, "num_heads", "scale"),
    "fused.out": (fia.npu_fused_infer_attention_score.out, "num_heads", "scale"),
    "incre": (fia.npu_incre_flash_attention, "num_heads", "scale_value"),
    "prompt": (fia.npu_prompt_flash_attention, "num_heads", "scale_value"),
    "v2": (fia.npu_fused_infer_attention_score_v2, "num_query_heads", "softmax_scale"),
}
PATHS = ("cpu", "meta", "fake", "make_fx")


def _call(entry: str, path: str, q_s: int = 1, **kw):
    """entry's call on fresh random tensors along `path`; returns the exception it raised (None: no error)."""
    fn, heads, _ = ENTRIES[entry]
    g = gen(q_s)

    def run(q, k):
        outs = {}
        if entry == "fused.out":                  # the caller's outputs, where the call's tensors live
            outs = dict(attention_out=torch.full_like(q, float("nan")),
                        softmax_lse=torch.full((1,), float("nan"), device=q.device))
        return fn(q, k, k, **{heads: 4}, input_layout="BNSD", **outs, **kw)

    def tensors(device="cpu"):
        return (randn((1, 4, q_s, 32), g, BF16).to(device), randn((1, 4, 40, 32), g, BF16).to(device))
    try:
        if path == "fake":
            with FakeTensorMode():
                run(*tensors())
        elif path == "make_fx":
            make_fx(run)(*tensors())
        else:
            run(*tensors(path))
    except Exception as e:                        # (the test compares what each path raises)
        return e
    return None


def _same_error_everywhere(entry: str, q_s: int, **kw) -> Exception:
    errors = {p: _call(entry, p, q_s, **kw) for p in PATHS}
    first = errors["cpu"]
    assert isinstance(first, fia.FiaInputError), (entry, errors)
    for p, e in errors.items():
        assert type(e) is type(first) and str(e) == str(first), (entry, p, e, first)
    return first


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("value", [float("inf"), -float("inf"), float("nan"), 1e39, -1e39])
def test_a_scale_that_is_not_a_finite_float32_is_an_input_error(entry, value):
    name = ENTRIES[entry][2]
    q_s = 1 if entry == "incre" else 3
    err = _same_error_everywhere(entry, q_s, **{name: value})
    assert str(err).startswith(f"{name}: expected a finite number within float32's range")


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_the_largest_finite_float32_scale_is_accepted(entry):
    name = ENTRIES[entry][2]
    assert _call(entry, "meta", 1 if entry == "incre" else 3, **{name: 3.4028234663852886e38}) is None


@pytest.mark.parametrize("entry,keyword,hint", [
    ("fused", "actual_seq_kvlen", "did you mean actual_seq_lengths_kv?"),      # v2's name in a v1 call
    ("fused", "return_softmax_lse", "did you mean softmax_lse_flag?"),
    ("fused.out", "num_head", "did you mean num_heads?"),
    ("incre", "actual_seq_lengths_kv", "did you mean actual_seq_lengths?"),
    ("prompt", "sparse_modes", "did you mean sparse_mode?"),
    ("v2", "scale", None),                                                   # a v1 argument v2 does not take
])
def test_an_unknown_keyword_is_the_same_input_error_on_every_path(entry, keyword, hint):
    err = _same_error_everywhere(entry, 1 if entry == "incre" else 3, **{keyword: 1})
    assert str(err).startswith(f"{keyword}: expected ")
    if hint is not None:
        assert hint in str(err)


# ---------------------------------------------------------------------------------------------- overflow
# Finite inputs at float32's limits and NaN / Inf inputs: every backend gives the reference's NaN / Inf pattern
# (DECISIONS 52). Seeded calls of test_fuzz_random, each with one extreme mutation; FIA_FUZZ_EXT_CASES (default
# 120) sets the number of seeds.
EXT_SEEDS = range(int(os.environ.get("FIA_FUZZ_EXT_CASES", "120")))
_SCALES = (1e38, -1e38, 3.4e38, 1e30, -1e30, 1e20)


def _extreme(seed: int):
    """(case, built call, what was mutated) of seed with one extreme mutation, or None where the drawn case has no
    float tensor to push to its limits."""
    c = draw(seed)
    if c.dtype not in (torch.float16, BF16, torch.float32):
        return None
    bt = build(c)
    r = random.Random(f"ext-{seed}")
    what = r.choice(("scale", "scale", "query", "key", "value", "nan"))
    if what == "scale":
        c.scale = r.choice(_SCALES)
        return c, bt, what
    name = {"query": "q_in", "key": "k_in", "value": "v_in", "nan": r.choice(("q_in", "k_in", "v_in"))}[what]
    t = getattr(bt, name)
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return None
    t = t.clone()                                        # (keeps the drawn strides)
    hit = torch.rand(t.shape, generator=gen(10_000 + seed)) < 0.02
    t[hit] = (float(r.choice(("nan", "inf", "-inf"))) if what == "nan" else
              torch.finfo(t.dtype).max * r.choice((1.0, -1.0)))
    setattr(bt, name, t)
    return c, bt, what


def _pattern(t):
    t = t.float()
    return torch.stack([torch.isnan(t), torch.isposinf(t), torch.isneginf(t)])


def test_extreme_values_give_the_references_nan_and_inf_on_every_backend():
    names = [b.name for b in registry.backends()]
    compared = 0
    for seed in EXT_SEEDS:
        got = _extreme(seed)
        if got is None:
            continue
        c, bt, what = got
        res = {}
        for be in names:
            try:
                with fia.use_backend(be), fia.validation_mode("portable"):
                    out, lse = call(c, bt)
            except FiaBackendUnavailable:
                continue
            res[be] = (out, lse if c.lse else None)
        ref_o, ref_l = res.pop("reference")
        for be, (out, lse) in res.items():
            where = f"seed {seed} ({c.api}, {c.layout}, {c.dtype}, scale {c.scale}), backend {be}"
            assert torch.equal(_pattern(out), _pattern(ref_o)), f"{where}: output NaN / Inf pattern"
            if lse is not None:
                assert torch.equal(_pattern(lse), _pattern(ref_l)), f"{where}: lse NaN / Inf pattern"
            # finite values too, where the scores keep ordinary magnitudes (scores near float32's limit lose their
            # differences to rounding, in another order on each backend)
            fin = torch.isfinite(ref_o.float())
            if what in ("value", "nan") and out.is_floating_point() and bool(fin.any()):
                a, b = out.float()[fin], ref_o.float()[fin]
                assert float((a - b).abs().max()) <= 2e-2 * max(1.0, float(b.abs().max())), f"{where}: values"
            compared += 1
    assert compared >= len(EXT_SEEDS) // 2          # (the sweep compares backends, not just draws cases)


@pytest.mark.parametrize("case", ["scale1e38", "query_at_max", "key_at_max"])
def test_finite_extremes_match_the_float64_formula_on_every_backend(case):
    """Finite inputs whose float32 scores overflow: every backend gives the float64 formula's answer (tests/naive.py)
    within the usual tolerances -- a finite output, and the lse rounded to float32 (beyond float32's range: +inf)."""
    import naive
    g = gen(20_000 + len(case))
    q, k, v = randn((2, 4, 1, 64), g, BF16), randn((2, 2, 96, 64), g, BF16), randn((2, 2, 96, 64), g, BF16)
    scale = 0.125
    if case == "scale1e38":
        scale = 1e38
    elif case == "query_at_max":
        q[0, 1, 0, :] = torch.finfo(BF16).max
    else:
        k[1, 0, 7, :] = torch.finfo(BF16).max
    want_o, want_l = naive.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), scale=scale)
    ran = []
    for be in [b.name for b in registry.backends()]:
        try:
            with fia.use_backend(be):
                out, lse = fia.npu_fused_infer_attention_score(q, k, v, num_heads=4, num_key_value_heads=2,
                                                               input_layout="BNSD", scale=scale, softmax_lse_flag=True)
        except FiaBackendUnavailable:                      # (prefill: Q_S > 1 only)
            continue
        ran.append(be)
        assert torch.isfinite(out).all(), be
        assert float((out.double() - want_o).abs().max()) <= 1e-2 * max(1.0, float(want_o.abs().max())), be
        assert torch.allclose(lse.reshape(want_l.shape), want_l.float(), rtol=1e-3, atol=1e-3), be   # (inf == inf)
    assert "reference" in ran and len(ran) >= 2, ran
