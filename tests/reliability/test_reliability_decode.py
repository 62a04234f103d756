"""Reliability of the decode backend where its fast arithmetic departs from the reference's: a query with an
outlier channel on int8 K / V (the int16 query), threads with different thread counts sharing its pool, sums over
2^20 keys, and IEEE special values in the dequantization factors, the value and the head dim.

Every test compares the decode backend with the reference backend or with a float64 formula on random inputs.
Precision is stated in fp16 ulps of the reference's largest output magnitude (ulp(x) = 2^(floor(log2 x) - 10)),
on float32 outputs (the backends' results before the output dtype's rounding) unless said otherwise.
"""
from __future__ import annotations

import inspect
import math
import threading
import time

import pytest
import torch

import fia
from fia import parse
from fia.backends.decode import backend as DEC
from fia.backends.decode import execute as DEC_EXECUTE, plan as DEC_PLAN
from fia.cpu import threads
from fia.backends import registry

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

pytestmark = [pytest.mark.backend_independent, pytest.mark.skipif(not DEC.numba_available(), reason="numba not installed")]


def gen(*parts) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(sum(ord(c) * (i + 1) for i, c in enumerate(repr(parts))) % 100003)
    return g


def ulp16(x: float) -> float:
    """One fp16 ulp at magnitude x."""
    return 2.0 ** (math.floor(math.log2(x)) - 10)


def problem(q, k, v, **kw):
    """The parsed problem of npu_fused_infer_attention_score(q, k, v, **kw)."""
    args = dict(query=q, key=k, value=v)
    for name, prm in inspect.signature(fia.eager.npu_fused_infer_attention_score).parameters.items():
        args.setdefault(name, prm.default)
    args.update(kw)
    return parse.parse_fused(args)


def run32(be, q, k, v, **kw):
    """(out, lse) of backend `be` in float32: the problem's output dtype set to float32 (no output rounding)."""
    p = problem(q, k, v, **kw).evolve(out_dtype=F32, memo_key=None)
    r = registry.by_name(be).run(p)
    return r.out.to(F32), r.lse


def both(q, k, v, mode="strict", be="decode", **kw):
    """{backend: (out, lse)} of the public call under `be` (stored as "fast") and reference."""
    r = {}
    for name in (be, "reference"):
        with fia.validation_mode(mode), fia.use_backend(name):
            r["fast" if name == be else name] = fia.npu_fused_infer_attention_score(q, k, v, **kw)
    return r


def same_specials(a: torch.Tensor, b: torch.Tensor) -> None:
    """NaN, +inf and -inf at the same places; the finite values within 2 fp16 ulps of the largest."""
    for f in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(f(a), f(b)), f"{f.__name__} pattern differs"
    fin = torch.isfinite(b)
    if fin.any():
        den = b[fin].double().abs().max().item()
        err = (a[fin].double() - b[fin].double()).abs().max().item()
        assert den == 0 or err <= 2 * ulp16(den) + 1e-6 * den, err


# ---------------------------------------------------------------------------------------------- int8: query outliers
def int8_case(dt, mode, outlier, *, seed=0, b=2, n=8, kvn=2, s=700, d=128, heads=None):
    """int8 K / V with per-channel (chan) or per-token (tok) scales and a query whose channel 5 is `outlier` (in the
    query heads `heads`, all by default)."""
    g = gen("outlier", dt, mode, outlier, seed)
    q = torch.randn(b, n, 1, d, generator=g, dtype=torch.float64)
    if outlier:
        q[:, slice(None) if heads is None else heads, :, 5] = outlier
    q = q.to(dt)
    k = torch.randint(-128, 128, (b, kvn, s, d), generator=g, dtype=torch.int8)
    v = torch.randint(-128, 128, (b, kvn, s, d), generator=g, dtype=torch.int8)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=1 / math.sqrt(d), softmax_lse_flag=True)
    if mode == "chan":
        kw.update(key_antiquant_scale=(torch.rand(1, kvn, 1, d, generator=g) * 0.016 + 0.004).to(dt),
                  value_antiquant_scale=(torch.rand(1, kvn, 1, d, generator=g) * 0.016 + 0.004).to(dt),
                  key_antiquant_offset=(torch.rand(1, kvn, 1, d, generator=g) * 4 - 2).to(dt),
                  value_antiquant_offset=(torch.rand(1, kvn, 1, d, generator=g) * 4 - 2).to(dt),
                  key_antiquant_mode=0, value_antiquant_mode=0)
    else:
        kw.update(key_antiquant_scale=torch.rand(1, b, s, generator=g) * 0.016 + 0.004,
                  value_antiquant_scale=torch.rand(1, b, s, generator=g) * 0.016 + 0.004,
                  key_antiquant_offset=torch.rand(1, b, s, generator=g) * 4 - 2,
                  value_antiquant_offset=torch.rand(1, b, s, generator=g) * 4 - 2,
                  key_antiquant_mode=1, value_antiquant_mode=1)
    return (q, k, v), kw


@pytest.mark.parametrize("outlier", [0, 10, 30, 300, 3000, 1e4])
@pytest.mark.parametrize("mode", ["chan", "tok"])
@pytest.mark.parametrize("dt", [F16, BF16])
def test_int8_query_outlier_within_two_fp16_ulp(dt, mode, outlier):
    """A query channel far above the others (LLM queries carry such channels) must not cost the others their
    precision: the float32 output stays within 2 fp16 ulps of the reference's (measured: <= 0.35 ulp up to 3000,
    ~1 ulp at 1e4 -- there the scores are ~2000 and float32's own rounding of them dominates), the lse within
    2e-4 + 2e-6 |lse|; fp16 outputs of the public call within 2 fp16 ulps too."""
    args, kw = int8_case(dt, mode, outlier)
    od, ld = run32("decode", *args, **kw)
    orf, lr = run32("reference", *args, **kw)
    den = orf.double().abs().max().item()
    err = (od.double() - orf.double()).abs().max().item()
    assert err <= 2 * ulp16(den), f"out err {err / ulp16(den):.2f} fp16 ulp"
    lerr = (ld.double() - lr.double()).abs() - 2e-6 * lr.double().abs()
    assert lerr.max().item() <= 2e-4
    if dt == F16:
        r = both(*args, **kw)
        o16, r16 = r["fast"][0].double(), r["reference"][0].double()
        assert (o16 - r16).abs().max().item() <= 2 * ulp16(r16.abs().max().item())


@pytest.mark.parametrize("outlier", [3e4, 6e4, 1e6, 1e20])
@pytest.mark.parametrize("mode", ["chan", "tok"])
def test_int8_query_outlier_never_blows_up(mode, outlier):
    """Past 1e4 the scores (thousands and more) carry float32 rounding of ~1e-7 of their size in both backends: held
    against the float64 formula, decode's float32 output is within 2 fp16 ulps plus twice the reference's own
    error (measured: decode 0.4-11 ulps where the reference is 1.8-55 off), never a share of the output (the int16
    query alone: 34 % at 6e4). bf16 queries past fp16's 65504."""
    args, kw = int8_case(F16 if outlier <= 6e4 else BF16, mode, outlier)
    od, _ = run32("decode", *args, **kw)
    orf, _ = run32("reference", *args, **kw)
    p = problem(*args, **kw).evolve(out_dtype=torch.float64, compute_dtype=torch.float64, memo_key=None)
    exact = registry.by_name("reference").run(p).out.double()
    assert torch.isfinite(exact).all() and torch.isfinite(od).all()
    u = ulp16(exact.abs().max().item())
    err, ref_err = ((o.double() - exact).abs().max().item() for o in (od, orf))
    assert err <= 2 * u + 2 * ref_err, f"out err {err / u:.2f} fp16 ulp (reference: {ref_err / u:.2f})"


def qk_paths(args, kw):
    """(chunks x KV heads whose QK ran the int16 query kernels, all of them) in one decode call."""
    before = DEC_EXECUTE.QK_STATS.copy()
    with fia.use_backend("decode"):
        fia.npu_fused_infer_attention_score(*args, **kw)
    i8, total = (DEC_EXECUTE.QK_STATS - before).tolist()
    return i8, total


@pytest.mark.parametrize("mode", ["chan", "tok"])
@pytest.mark.parametrize("dt", [F16, BF16])
def test_int8_ordinary_query_keeps_the_int16_path(dt, mode):
    """The speed of int8 decode comes from the int16 query kernels (cpu/vnni.py): an ordinary query (no outlier)
    runs every chunk there; a query whose every head has an outlier of 300 none; an outlier in one KV head's query
    heads only sends that head's chunks to the float32 kernels, the others stay."""
    from fia.backends.decode import kernels as K
    if not K.DP_FLAGS & K.DP_I8:
        pytest.skip("no int16 x int8 dot-product kernels on this CPU")
    args, kw = int8_case(dt, mode, 0)
    i8, total = qk_paths(args, kw)
    assert total > 0 and i8 == total
    args, kw = int8_case(dt, mode, 300)
    i8, total = qk_paths(args, kw)
    assert total > 0 and i8 == 0
    args, kw = int8_case(dt, mode, 300, heads=slice(0, 4))            # query heads 0-3: KV head 0 (G = 4)
    i8, total = qk_paths(args, kw)
    assert i8 * 2 == total


# ---------------------------------------------------------------------------------------------- threads
def test_threads_with_their_own_thread_counts(monkeypatch):
    """Python threads calling the decode backend at once, each setting its own torch.set_num_threads (1..4) before
    each call (process-wide in torch: the counts the calls see vary): every call returns the reference's result.
    The pool grows while others use it (reset every round: the growth a fresh process goes through) -- a grown pool
    must not shut down the one another call still submits to (that raised "cannot schedule new futures after
    shutdown" in 4-7 % of these calls). Small calls, split and threaded (as the suite's small_splits), so that the
    rounds are many; a pause between getting the pool and submitting to it widens the race's window."""
    monkeypatch.setattr(DEC_PLAN, "MIN_SPLIT", 8)
    monkeypatch.setattr(DEC_PLAN, "ITEMS_PER_THREAD", 16)
    monkeypatch.setattr(DEC_PLAN, "PARALLEL_MIN_WORK", 0)
    pool = threads.pool

    def slow_pool(n):
        got = pool(n)
        time.sleep(0.002)
        return got
    monkeypatch.setattr(threads, "pool", slow_pool)
    counts = [1, 2, 3, 4, 1, 2, 3, 4]
    cases = []
    for i in range(len(counts)):
        g = gen("threads", i)
        b, n, kvn, s, d = 2, 8, 2, 96 + 16 * i, 64
        q = torch.randn(b, n, 1, d, generator=g).to(F16)
        k = torch.randn(b, kvn, s, d, generator=g).to(F16)
        v = torch.randn(b, kvn, s, d, generator=g).to(F16)
        kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=1 / math.sqrt(d))
        with fia.use_backend("reference"):
            ref = fia.npu_fused_infer_attention_score(q, k, v, **kw)[0]
        cases.append((q, k, v, kw, ref))
    rounds, calls = 20, 3
    barrier = threading.Barrier(len(counts))
    errors, done = [], [0]

    def worker(i):
        torch.set_num_threads(counts[i])
        q, k, v, kw, ref = cases[i]
        for _ in range(rounds):
            barrier.wait()
            if i == 0:
                with threads._POOL_LOCK:
                    threads._POOL, threads._POOL_SIZE = None, 0
            barrier.wait()
            for _ in range(calls):
                torch.set_num_threads(counts[i])            # (process-wide in torch: the threads take turns)
                try:
                    with fia.use_backend("decode"):
                        out = fia.npu_fused_infer_attention_score(q, k, v, **kw)[0]
                    err = (out.double() - ref.double()).abs().max().item()
                    if err > 2 * ulp16(ref.double().abs().max().item()):
                        errors.append(f"thread {i}: err {err}")
                except Exception as e:                      # collected, asserted below
                    errors.append(f"thread {i}: {e!r}")
                done[0] += 1

    prev = torch.get_num_threads()
    try:
        workers = [threading.Thread(target=worker, args=(i,)) for i in range(len(counts))]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    finally:
        torch.set_num_threads(prev)
    assert not errors, f"{len(errors)} of {done[0]} calls: {errors[:3]}"
    assert done[0] == len(counts) * rounds * calls


# ---------------------------------------------------------------------------------------------- 2^20 keys
@pytest.mark.parametrize("dt", [F16, BF16])
def test_long_sequence_does_not_drift(dt):
    """2^20 keys of two kinds (rows a and b alternating, so the weights are not all 1; D = 16): output and lse
    against the float64 formula out = (w_a v_a + w_b v_b) / (w_a + w_b), w = exp(s - max), lse = max +
    log(2^19 (w_a + w_b)): within 4e-6 of max |v| and 4e-6 (measured <= 1.6e-6 / 1.2e-6 at 2^20 and 2^22, as at
    2^12; one float32 running sum over the keys drifted to 1e-3 at 2^20)."""
    S, d = 1 << 20, 16
    g = gen("long", dt)
    q = torch.randn(1, 1, 1, d, generator=g).to(dt)
    ka, kb, va, vb = (torch.randn(d, generator=g).to(dt) for _ in range(4))
    k = torch.stack([ka, kb]).repeat(S // 2, 1).reshape(1, 1, S, d)
    v = torch.stack([va, vb]).repeat(S // 2, 1).reshape(1, 1, S, d)
    kw = dict(num_heads=1, num_key_value_heads=1, input_layout="BNSD", scale=1 / math.sqrt(d), softmax_lse_flag=True)
    od, ld = run32("decode", q, k, v, **kw)
    sa, sb = ((q.double().flatten() @ x.double()).item() / math.sqrt(d) for x in (ka, kb))
    m = max(sa, sb)
    wa, wb = math.exp(sa - m), math.exp(sb - m)
    want = (wa * va.double() + wb * vb.double()) / (wa + wb)
    vmax = torch.stack([va, vb]).double().abs().max().item()
    err = (od.double().flatten() - want).abs().max().item() / vmax
    assert err <= 4e-6, err
    lse = m + math.log((S // 2) * (wa + wb))
    assert abs(ld.double().item() - lse) <= 4e-6


# ---------------------------------------------------------------------------------------------- IEEE specials
FAST = ["decode", "torch"]      # arithmetic departs from the reference's (both() stores theirs as r["fast"])

@pytest.mark.parametrize("be", FAST)
def test_infinite_per_channel_value_scale(be):
    """A per-channel value scale of +inf: the reference dequantizes element by element, so an int8 value 0 gives
    inf * 0 = NaN (and +inf with -inf: NaN), a channel of nonzero values of one sign +-inf; decode agrees (it
    folds finite scales out of the loop, these not)."""
    g = gen("inf-vscale")
    b, n, kvn, s, d = 2, 4, 2, 40, 64
    q = torch.randn(b, n, 1, d, generator=g).to(F16)
    k = torch.randint(-128, 128, (b, kvn, s, d), generator=g, dtype=torch.int8)
    v = torch.randint(1, 128, (b, kvn, s, d), generator=g, dtype=torch.int8)
    v[:, :, :, 1::2] *= -1                                   # odd channels negative
    v[:, 0, 7, 4] = 0                                        # one zero in channel 4 of KV head 0
    v[:, 1, :, 6] = torch.randint(-128, 128, (b, s), generator=g, dtype=torch.int8)   # mixed signs
    vs = (torch.rand(1, kvn, 1, d, generator=g) * 0.02 + 0.004).to(F16)
    vs[..., 2:8] = float("inf")
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=1 / math.sqrt(d), softmax_lse_flag=True,
              key_antiquant_scale=(torch.rand(1, kvn, 1, d, generator=g) * 0.02 + 0.004).to(F16),
              value_antiquant_scale=vs, key_antiquant_mode=0, value_antiquant_mode=0)
    r = both(q, k, v, be=be, **kw)
    assert torch.isnan(r["reference"][0][:, :2, :, 4]).all()              # the zero: NaN
    same_specials(r["fast"][0], r["reference"][0])
    same_specials(r["fast"][1], r["reference"][1])


@pytest.mark.parametrize("be", FAST)
@pytest.mark.parametrize("which", ["key", "value", "both"])
def test_huge_per_token_scale(which, be):
    """A per-token scale of 3.4e38 on one token: the reference's dequantized row overflows element by element
    (+-inf, NaN where they meet in the dot product); decode computes such tokens as it does and agrees, instead of a
    score that is one large finite (or one-signed infinite) number which zeroes the other tokens' weights."""
    g = gen("huge-token", which)
    b, n, kvn, s, d = 2, 4, 2, 300, 64
    q = torch.randn(b, n, 1, d, generator=g).to(BF16)
    k = torch.randint(-128, 128, (b, kvn, s, d), generator=g, dtype=torch.int8)
    v = torch.randint(-128, 128, (b, kvn, s, d), generator=g, dtype=torch.int8)
    ks = torch.rand(1, b, s, generator=g) * 0.02 + 0.004
    vs = torch.rand(1, b, s, generator=g) * 0.02 + 0.004
    if which in ("key", "both"):
        ks[0, 0, 37] = 3.4e38
    if which in ("value", "both"):
        vs[0, 1, 210] = 3.4e38
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=1 / math.sqrt(d), softmax_lse_flag=True,
              key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_mode=1, value_antiquant_mode=1)
    od, ld = run32(be, q, k, v, **kw)
    orf, lr = run32("reference", q, k, v, **kw)
    same_specials(od, orf)
    same_specials(ld, lr)
    if which == "key":                                       # batch 1 untouched, finite
        assert torch.isfinite(od[1]).all()


@pytest.mark.parametrize("be", FAST)
def test_huge_bf16_value(be):
    """bf16 V near float32's maximum (2e38 - 3.3e38, both signs): the weighted sum is normalized before it could
    overflow, so the output is the reference's (within 2 fp16 ulps), not inf."""
    g = gen("huge-v")
    b, n, kvn, s, d = 2, 4, 2, 700, 64
    q = torch.randn(b, n, 1, d, generator=g).to(BF16)
    k = torch.randn(b, kvn, s, d, generator=g).to(BF16)
    v = (torch.rand(b, kvn, s, d, generator=g, dtype=torch.float64) * 1.3e38 + 2e38)
    v = (v * torch.where(torch.rand(b, kvn, s, d, generator=g) < 0.3, -1.0, 1.0)).to(BF16)
    v[0, 0] = torch.tensor(3e38).to(BF16)                    # a head of V all 3e38
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=1 / math.sqrt(d), softmax_lse_flag=True)
    od, _ = run32(be, q, k, v, **kw)
    orf, _ = run32("reference", q, k, v, **kw)
    assert torch.isfinite(orf).all() and torch.isfinite(od).all()
    same_specials(od, orf)
    r = both(q, k, v, be=be, **kw)
    assert torch.equal(r["fast"][0][0, :2], r["reference"][0][0, :2])     # 3.0041e38 exactly, not inf


@pytest.mark.parametrize("be", FAST)
def test_head_dim_zero_lse(be):
    """Portable mode, D = 0: every score is 0, so the lse of a row is log(its keys) -- the reference's -- and the
    output is empty."""
    b, n, kvn, s = 2, 4, 2, 9
    q = torch.zeros(b, n, 1, 0, dtype=F16)
    k = torch.zeros(b, kvn, s, 0, dtype=F16)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", softmax_lse_flag=True,
              actual_seq_lengths_kv=[9, 4])
    r = both(q, k, k, mode="portable", be=be, **kw)
    assert r["fast"][0].shape == r["reference"][0].shape and r["fast"][0].numel() == 0
    assert torch.allclose(r["fast"][1], r["reference"][1])
    assert torch.allclose(r["fast"][1][1].flatten(), torch.full((n,), math.log(4.0)))
