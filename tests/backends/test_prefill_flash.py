"""FIA's own bf16 prefill flash kernel (prefill.flash.flash, prefill.kernels, cpu.gemm.gemm_bf16).

* gemm_bf16 / gemm_f16, native (vdpbf16ps / vcvtph2ps where the CPU has them) and the emulations every
  other CPU compiles: C = / += A . B against float64 on every row / column block count, with C poisoned
  (NaN) outside the R x NCOL block it may write.
* flash() against a float64 softmax on fresh random inputs: GQA, L != S, S not a multiple of the key tile or
  odd, Dv != D, top-left causal, additive bf16 masks (full, broadcast over batch / heads, -inf rows), query
  views with overlapping strides (the band path's batched calls); outputs NaN-poisoned before the call.
  bf16, float16 and float32. Tolerances: bf16 probabilities are rounded to bf16 before the PV product (as in ATen's
  kernel and on the hardware), ~2^-9 relative per weight -> 1e-2 of max |out|; float16 (float32
  probabilities) 2e-3; float32 2e-5; lse (float32 throughout) 1e-4.
* rows without any finite score: output 0, lse -inf; NaN in the query propagates to its rows only.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

numba = pytest.importorskip("numba")
from numba import njit  # noqa: E402
from kernel_util import compiling_with, frozen  # noqa: E402

from fia.cpu import fma as DF  # noqa: E402
from fia.cpu import simd as DS  # noqa: E402
from fia.backends.prefill import flash as PF  # noqa: E402
from fia.cpu import threads as PF_threads  # noqa: E402
from fia.cpu import gemm as PS  # noqa: E402

pytestmark = pytest.mark.backend_independent      # kernel-level: run once, not per backend (conftest)


def _wrapper(module, flag, native, gemm, a0, b0):
    """A fresh njit wrapper of `gemm` compiled with module.flag = native (the emitted instruction or its
    emulation), then frozen (kernel_util)."""
    with compiling_with(module, flag, native):
        @njit
        def g(a, b, c, n, R, ncol, acc):
            gemm(a.ctypes.data, a.strides[0], b.ctypes.data, b.strides[0], n, c.ctypes.data, c.strides[0], R, ncol,
                 acc)
        g(a0, b0, np.zeros((6, 64), np.float32), 1, 6, 64, 0)
    return frozen(g)[0]


def _gemm(native: bool):
    return _wrapper(DS, "_HOST_DP", native, PS.gemm_bf16, np.zeros((6, 2), np.uint32), np.zeros((1, 64), np.uint32))


MODES = [False] + ([True] if DS._HOST_DP else [])


def _gemm16(native: bool, f32: bool = False):
    if f32:
        return _wrapper(DF, "F16C", native, PS.gemm_f32, np.zeros((6, 1), np.float32), np.zeros((1, 64), np.float32))
    return _wrapper(DF, "F16C", native, PS.gemm_f16, np.zeros((6, 1), np.float32), np.zeros((1, 64), np.uint16))


@pytest.mark.parametrize("native", [False] + ([True] if DF.F16C else []), ids=lambda m: "native" if m else "emulated")
@pytest.mark.parametrize("f32", [False, True], ids=["f16", "f32"])
def test_gemm_f16(native, f32):
    """float32 A x float16 B (widened in registers) or float32 B, C = / +=, NaN-poisoned outside R x NCOL."""
    g = _gemm16(native, f32)
    rng = np.random.default_rng(2)
    for R, ncol, nk, acc in [(6, 64, 1, 0), (12, 128, 128, 1), (18, 192, 37, 0), (30, 64, 256, 1)]:
        a = rng.standard_normal((R + 3, nk + 5)).astype(np.float32)
        bm = torch.randn(nk + 2, ncol + 32)
        bm = bm if f32 else bm.half()
        bb = bm.numpy() if f32 else bm.view(torch.int16).numpy().view(np.uint16)
        c = np.full((R + 2, ncol + 16), np.nan, np.float32)
        c0 = rng.standard_normal((R, ncol)).astype(np.float32)
        if acc:
            c[:R, :ncol] = c0
        g(a, bb, c, nk, R, ncol, acc)
        ref = torch.from_numpy(a[:R, :nk]).double() @ bm[:nk, :ncol].double()
        if acc:
            ref = ref + torch.from_numpy(c0).double()
        bound = torch.from_numpy(np.abs(a[:R, :nk])).double() @ bm[:nk, :ncol].double().abs() + 1
        err = (torch.from_numpy(c[:R, :ncol]).double() - ref).abs() / bound
        assert err.max().item() < 1e-6, (R, ncol, nk, acc)
        assert np.isnan(c[R:]).all() and np.isnan(c[:, ncol:]).all()


@pytest.mark.parametrize("native", MODES, ids=lambda m: "native" if m else "emulated")
def test_gemm_bf16(native):
    g = _gemm(native)
    rng = np.random.default_rng(1)
    for R, ncol, npair, acc in [(6, 64, 1, 0), (12, 128, 64, 0), (18, 192, 33, 1), (6, 64, 256, 1), (30, 64, 7, 0)]:
        a = torch.randn(R + 3, 2 * npair + 6).bfloat16()             # rows longer than npair pairs: must be ignored
        bm = torch.randn(2 * npair + 2, ncol + 32).bfloat16()        # [2 * npair (+ 2 unused), ncol (+ 32 unused)]
        a32 = a.view(torch.int16).numpy().view(np.uint32)            # [R + 3, npair + 3] pairs
        # packed: row p = (bm[2p, c], bm[2p + 1, c]) as one dword
        pk = bm.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
        bp = np.ascontiguousarray(pk[0::2] | (pk[1::2] << 16))         # [npair + 1, ncol + 32]
        c = np.full((R + 2, ncol + 16), np.nan, np.float32)
        c0 = rng.standard_normal((R, ncol)).astype(np.float32)
        if acc:
            c[:R, :ncol] = c0
        g(a32, bp, c, npair, R, ncol, acc)
        ref = a[:R, :2 * npair].double() @ bm[:2 * npair, :ncol].double()
        if acc:
            ref = ref + torch.from_numpy(c0).double()
        bound = a[:R, :2 * npair].double().abs() @ bm[:2 * npair, :ncol].double().abs() + 1
        err = (torch.from_numpy(c[:R, :ncol]).double() - ref).abs() / bound
        assert err.max().item() < 1e-6, (R, ncol, npair, acc)
        assert np.isnan(c[R:]).all() and np.isnan(c[:, ncol:]).all()


def _ref(q, k, v, causal, mask, scale, band=None):
    """float64 softmax attention (GQA by repeat), lse natural log; rows without a finite score: 0 / -inf.
    band (pre, next): row i keeps keys i - pre <= j <= i + next."""
    G = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = q.double() @ kk.transpose(-1, -2) * scale                     # [B, N, L, S]
    if mask is not None:
        s = s + mask.double()
    if causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
    if band is not None:
        i = torch.arange(s.shape[-2])[:, None]
        j = torch.arange(s.shape[-1])[None]
        s = s.masked_fill((j < i - band[0]) | (j > i + band[1]), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ vv, lse


def _poisoned(B, N, L, Dv, dt=torch.bfloat16):
    return torch.full((B, N, L, Dv), float("nan")).to(dt), torch.full((B, N, L), float("nan"))


def _check(o, lse, ro, rl, tag, tol=1e-2):
    scale = ro.abs().max().item() + 1e-30
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), tag
    assert (o.double() - ro).abs().max().item() <= tol * scale, tag
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), fin), tag
    if fin.any():
        assert (lse.double()[fin] - rl[fin]).abs().max().item() <= 1e-4, tag
    assert (o.double()[~fin] == 0).all(), tag


CASES = [  # B, N, KV_N, L, S, D, Dv, causal, mask[, band]
    (1, 8, 2, 100, 300, 128, 128, False, None),
    (1, 8, 2, 300, 1000, 128, 128, False, None, (40, 300)),
    (2, 4, 2, 700, 700, 64, 64, True, "bcast", (256, 256)),
    (1, 4, 4, 500, 520, 128, 64, False, "full", (-100, 130)),
    (1, 4, 1, 129, 600, 128, 128, False, None, (5000, -70)),
    (1, 2, 1, 64, 64, 128, 128, False, None, (-10, -20)),
    (2, 4, 4, 37, 515, 64, 128, True, None),
    (1, 32, 8, 257, 257, 128, 128, True, None),
    (1, 6, 3, 64, 701, 128, 64, False, "full"),
    (2, 4, 1, 50, 50, 128, 128, True, "bcast"),
    (3, 2, 2, 9, 1, 64, 64, False, None),
    (1, 128, 1, 5, 77, 64, 64, True, "full"),
    (2, 8, 8, 200, 130, 192, 64, False, "rows"),
]


# bf16: tested wherever the kernel runs natively, also where it is not the default (CPUs with AMX, whose
# bf16 prefill goes to ATen's kernel): the autouse fixture below turns it on for these tests
BF16_RUNS = PF.ENABLED or (PF.HAS_DP and os.environ.get("FIA_PREFILL_OWN", "") != "0")
# float16 likewise where it runs natively but ATen's kernel is the default (Intel's AVX-512 CPUs)
F16_RUNS = PF.ENABLED_F16 or (PF.F16_NATIVE and os.environ.get("FIA_PREFILL_OWN", "") != "0")


@pytest.fixture(autouse=True)
def _bf16_on(monkeypatch):
    monkeypatch.setattr(PF, "ENABLED", BF16_RUNS)
    monkeypatch.setattr(PF, "ENABLED_F16", F16_RUNS)
    monkeypatch.setattr(PF, "PARALLEL_MIN_FLOPS", 0)              # small calls on every thread too


def test_small_calls_run_on_one_thread(monkeypatch):
    """A call below PARALLEL_MIN_FLOPS launches its items on the calling thread alone; a larger one on every thread;
    both equal the float64 formula."""
    launched = []
    real = PF_threads.launch

    def spy(fn, items, t, args):
        launched.append(t)
        return real(fn, items, t, args)
    monkeypatch.setattr(PF_threads, "launch", spy)
    monkeypatch.setattr(PF, "ENABLED", True)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 96, 64, generator=g).to(torch.float16) for _ in range(3))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for floor, want in ((1e12, 1), (0, 2)):
            monkeypatch.setattr(PF, "PARALLEL_MIN_FLOPS", floor)
            launched.clear()
            out, _ = PF.flash(q, k, v, True, None, 0.125)
            assert launched and set(launched) == {want}, launched
            ref = torch.softmax((q.double() @ k.double().transpose(-1, -2) * 0.125).masked_fill(
                torch.ones(96, 96, dtype=torch.bool).triu(1), float("-inf")), -1) @ v.double()
            assert (out.double() - ref).abs().max().item() < 2e-3
    finally:
        torch.set_num_threads(threads)


DTYPES = [d for d, on in ((torch.bfloat16, BF16_RUNS), (torch.float16, F16_RUNS),
                           (torch.float32, PF.ENABLED_F32)) if on]
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5}


@pytest.mark.skipif(not DTYPES, reason="own prefill kernel disabled on this CPU")
@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_flash_matches_float64(case, dt):
    _flash_case(case, dt)


# where the CPU has AVX512-BF16 the bf16 GEMMs run vdpbf16ps or bf16 widened to float32 FMAs, by vendor
# (BF16_DP): the form this CPU does not choose, on the cases of several tiles, GQA, bands and masks
OTHER_BF16_FORM = [not PF.BF16_DP] if BF16_RUNS and PF.HAS_DP else []


@pytest.mark.parametrize("dp", OTHER_BF16_FORM, ids=lambda d: "vdpbf16ps" if d else "widened")
@pytest.mark.parametrize("case", [CASES[i] for i in (1, 2, 7, 8, 12)], ids=lambda c: "-".join(map(str, c)))
def test_flash_bf16_other_gemm_form_matches_float64(case, dp, monkeypatch):
    monkeypatch.setattr(PF, "BF16_DP", dp)
    assert ("vdpbf16ps)" in PF.variant()) == dp
    _flash_case(case, torch.bfloat16)


def _flash_case(case, dt):
    B, N, H, L, S, D, Dv, causal, mk = case[:9]
    band = case[9] if len(case) > 9 else None
    torch.manual_seed(hash(case) % 1000)
    q = torch.randn(B, N, L, D).to(dt)
    k = torch.randn(B, H, S, D).to(dt)
    v = torch.randn(B, H, S, Dv).to(dt)
    mask = None
    if mk == "full":
        mask = (torch.randn(B, N, L, S) * 2).to(dt)
    elif mk == "bcast":
        mask = (torch.randn(1, 1, L, S) * 3).to(dt)
    elif mk == "rows":                                         # some rows fully masked, some keys cut
        mask = torch.zeros(1, N, L, S)
        mask[:, :, ::7] = float("-inf")
        mask[:, :, :, ::3] = float("-inf")
        mask = mask.to(dt)
    scale = 1 / math.sqrt(D)
    assert PF.eligible(q, k, v, mask)
    out, lse = _poisoned(B, N, L, Dv, dt)
    o, l = PF.flash(q, k, v, causal, mask, scale, out=out, lse=lse, band=band)
    assert o is out and l is lse
    ro, rl = _ref(q, k, v, causal, mask, scale, band)
    _check(o, l, ro, rl, case, TOL[dt])
    if mk == "rows":
        assert (o[:, :, ::7] == 0).all() and torch.isneginf(l[:, :, ::7]).all()


@pytest.mark.skipif(not BF16_RUNS, reason="own prefill kernel disabled on this CPU")
def test_flash_overlapping_query_views_and_nan():
    """Batch entries as overlapping strided windows (the band path), and a NaN query row."""
    torch.manual_seed(3)
    N, H, T, D, w, bq, nb = 8, 2, 600, 128, 160, 64, 5
    q = torch.randn(1, N, T, D).bfloat16()
    k = torch.randn(1, H, T, D).bfloat16()
    v = torch.randn(1, H, T, D).bfloat16()

    def blocks(x, rows):
        x = x[0]
        sh, ss, se = x.stride()
        return x.as_strided((nb, x.shape[0], rows, x.shape[2]), (bq * ss, sh, ss, se), x.storage_offset())
    qb, kb, vb = blocks(q, bq), blocks(k, w), blocks(v, w)
    mask = (torch.randn(1, 1, bq, w)).bfloat16()
    out, lse = _poisoned(nb, N, bq, D)
    o, l = PF.flash(qb, kb, vb, False, mask, 0.1, out=out, lse=lse)
    ro, rl = _ref(qb, kb, vb, False, mask, 0.1)
    _check(o, l, ro, rl, "windows")
    q[0, 3, 5, 7] = float("nan")
    o, l = PF.flash(q, k, v, True, None, 0.1)
    assert torch.isnan(o[0, 3, 5]).all() and torch.isnan(l[0, 3, 5])
    o[0, 3, 5] = 0
    l[0, 3, 5] = 0
    assert not torch.isnan(o).any() and not torch.isnan(l).any()


def test_bf16_default_follows_amx():
    """bf16 prefill uses this kernel by default on CPUs with AVX512-BF16 and without AMX-BF16, and on CPUs
    without AVX-512 that have AVX2, FMA and F16C (the 8-lane variant)."""
    from fia.cpu.simd import target_has
    assert PF.AMX_BF16 == target_has("amx-tile", "amx-bf16")
    assert PF.AVX2 == (not target_has("avx512f") and target_has("avx2", "fma", "f16c"))
    assert PF.ENABLED_DEFAULT == ((PF.HAS_DP and not PF.AMX_BF16) or PF.AVX2)
    assert PF.AMD == target_has("sse4a")
    assert PF.ENABLED_F16_DEFAULT == ((PF.F16C and target_has("avx512f", "sse4a")) or PF.AVX2)


def test_eligibility():
    q, k = torch.randn(1, 4, 8, 64).bfloat16(), torch.randn(1, 2, 8, 64).bfloat16()
    assert PF.eligible(q, k, k, None) == PF.ENABLED
    assert PF.eligible(q.half(), k.half(), k.half(), None) == PF.ENABLED_F16
    assert PF.eligible(q.float(), k.float(), k.float(), None) == PF.ENABLED_F32
    assert not PF.eligible(q.double(), k.double(), k.double(), None)
    assert not PF.eligible(q.half(), k, k, None)                                      # mixed dtypes
    assert not PF.eligible(q, k, k, torch.zeros(8, 8).half())                         # mask dtype != q's
    assert not PF.eligible(q[..., :32], k[..., :32], k[..., :32], None)             # D % 64
    assert not PF.eligible(q, k, k, torch.zeros(8, 8))                                # float32 mask
    assert not PF.eligible(q, k, k, torch.zeros(8, 16).bfloat16()[:, ::2])            # strided mask keys
    assert not PF.eligible(q, k, k, torch.zeros(8, 1).bfloat16())                     # broadcast over keys
    assert not PF.eligible(q, k[:, :, :0], k[:, :, :0], None)                         # no keys


@pytest.mark.skipif(not BF16_RUNS, reason="own prefill kernel disabled on this CPU")
@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.uint8, torch.float16])
def test_flash_user_mask_in_place(dtype):
    """A user mask [L, S] (nonzero = masked) read in place from a row-strided view of a larger mask, with a
    band, fully masked rows and fully masked key tiles (skipped); float16: -0.0 keeps, NaN masks."""
    torch.manual_seed(7)
    N, H, L, S, D = 8, 2, 300, 700, 128
    q, k, v = torch.randn(1, N, L, D).bfloat16(), torch.randn(1, H, S, D).bfloat16(), torch.randn(1, H, S, D).bfloat16()
    masked = torch.rand(L + 5, S + 9) < 0.4
    masked[:, 256:512] = True                                  # a whole key tile
    masked[2 + 17] = True                                      # a row without any key (um row 17)
    masked[202:262, :600] = True
    if dtype == torch.float16:
        big = torch.where(masked, torch.tensor(1.0), torch.tensor(-0.0)).half()
        big[5, 9] = float("nan")
        masked[5, 9] = True
    else:
        big = (masked.to(torch.int16) * (1 if dtype == torch.bool else 3)).to(dtype)
    um = big[2:2 + L, 4:4 + S]                                  # row stride S + 9, offset into storage
    keep = ~masked[2:2 + L, 4:4 + S]
    assert PF.user_mask_ok(um)
    band = (400, 150)
    add = torch.zeros(L, S).masked_fill(~keep, float("-inf"))
    out, lse = _poisoned(1, N, L, D)
    o, l = PF.flash(q, k, v, False, None, 0.09, out=out, lse=lse, band=band, user_mask=um)
    ro, rl = _ref(q, k, v, False, add, 0.09, band)
    _check(o, l, ro, rl, dtype)
    assert torch.isneginf(l[0, :, 17]).all() and (o[0, :, 17] == 0).all()
    assert not PF.user_mask_ok(big[:, ::2])                     # strided keys: not read in place
    assert not PF.user_mask_ok(big.float())


def test_softmax_exp_helpers():
    """fexp2 (the prefill softmax's exp) against float64 over its range, -inf / NaN / underflow; round_bf16_value
    against torch's bf16 rounding (ties to even); the scaled difference stays unfused under fastmath: the row's
    maximum gives exactly 0 even where the product's rounding error is ~1e23."""
    from fia.cpu.numerics import FM, fexp2, round_bf16_value
    from fia.cpu.simd import mul_exact, sub_exact

    @njit(fastmath=FM)
    def run(t, x, s, scale, mx, e, r, d):
        for i in range(t.size):
            e[i] = fexp2(t[i])
        for i in range(x.size):
            r[i] = round_bf16_value(x[i])
        for i in range(s.size):
            d[i] = sub_exact(mul_exact(s[i], scale), mx)

    g = np.random.default_rng(7)
    t = np.concatenate([g.uniform(-130, 0.5, 200_000), [-np.inf, np.nan, -1e30, -125.0, -126.0, 0.0]]).astype(np.float32)
    x = np.concatenate([g.uniform(0, 1, 100_000), np.ldexp(1 + np.arange(1, 256) / 256 + 2 ** -9, -3)]).astype(np.float32)
    s = (g.standard_normal(1000) * 10).astype(np.float32)
    scale = np.float32(1e30)
    mx = np.float32(s.max() * scale)
    e, r, d = np.full_like(t, np.nan), np.full_like(x, np.nan), np.full_like(s, np.nan)
    run(t, x, s, scale, mx, e, r, d)
    ref = np.exp2(t.astype(np.float64))
    live = t >= -125
    assert np.abs(e[live] / ref[live] - 1).max() < 2.5e-7
    assert (e[~live & ~np.isnan(t)] == 0).all() and np.isnan(e[np.isnan(t)]).all()
    want = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(r, want)
    assert d[s.argmax()] == 0 and (d <= 0).all()


@pytest.mark.parametrize("dt", [d for d in DTYPES if d != torch.float16], ids=str)
def test_flash_reads_strided_views_tames_v_and_reports_its_findings(dt):
    """q, k and v read in place whatever their strides (transposed, sliced); V with values above V_SAFE is scaled
    as backend._tame scales it, from the magnitudes the packing saw; `stats` reports the exponent, the smallest lse
    and whether an output element was stored non-finite."""
    from fia.backends.prefill import backend as PB
    torch.manual_seed(11)
    B, N, H, L, S, D = 1, 8, 2, 90, 200, 64
    q = torch.randn(B, L, N, D).to(dt).transpose(1, 2)                 # [B, N, L, D] of a [B, L, N, D] buffer
    k = torch.randn(B, H, S + 37, D).to(dt)[:, :, 5:S + 5]              # a window of a longer cache
    v = torch.randn(B, S, H, D).to(dt).transpose(1, 2)
    v[0, 1, 17, 3] = 2.0 ** 110                                         # above V_SAFE: scaled by 2^-111
    for x in (q, k, v):
        assert not x.is_contiguous()
    st = {}
    o, l = PF.flash(q, k, v, True, None, 0.125, tame=True, stats=st)
    tv, e, _ = PB._tame(v)
    assert e == 111 and st["tame"] == e
    ro, rl = _ref(q, k, tv, True, None, 0.125)
    _check(o, l, ro, rl, "strided, tamed")
    assert st["lse_min"] == float(l.min()) and st["bad"] is False
    q[0, 3, 7, 5] = float("nan")                                       # a NaN row: the lse and output flagged
    st = {}
    o, l = PF.flash(q, k, v, True, None, 0.125, stats=st)
    assert st["tame"] == 0 and math.isnan(st["lse_min"]) and st["bad"] is True
    assert torch.isnan(o[0, 3, 7]).all() and not torch.isnan(o[0, 3, 8]).any()
    q[0, 3, 7, 5] = 0.5
    for qx, kx, vx in ((q, k, torch.randn(B, H, S, 2 * D).to(dt)[..., ::2]),        # a strided head dim: copied
                       (torch.randn(B, N, L, 3 * D).to(dt)[..., D::2][..., :D], k, v)):
        assert vx.stride(-1) != 1 or qx.stride(-1) != 1
        o, l = PF.flash(qx, kx, vx, False, None, 0.125)
        ro, rl = _ref(qx, kx, vx, False, None, 0.125)
        _check(o, l, ro, rl, "strided head dim")


@pytest.mark.skipif(not (BF16_RUNS and PF.HAS_DP), reason="AVX512-BF16 and the own bf16 kernel")
@pytest.mark.parametrize("S,own", [(48, False), (64, False), (65, True), (200, True)])
def test_small_bf16_calls_take_aten_s_kernel(S, own, monkeypatch):
    """A whole bf16 call of at most small_aten_limit(D) positions per head runs on ATen's kernel (faster there on
    AVX512-BF16 CPUs), larger ones on the own kernel; both give the float64 reference's numbers. The limit set
    here to 64 x 64 at D = 64 (the AMD one)."""
    import fia
    monkeypatch.setattr(PF, "ENABLED", True)
    monkeypatch.setattr(PF, "SMALL_ATEN_POSITIONS", 64 * 64)
    monkeypatch.setattr(PF, "SMALL_ATEN_D64", 1)
    ran = []
    real = PF.flash
    monkeypatch.setattr(PF, "flash", lambda *a, **k: ran.append(1) or real(*a, **k))
    torch.manual_seed(S)
    q, k, v = torch.randn(1, S, 8, 64).bfloat16().transpose(1, 2), *(torch.randn(1, 2, S, 64).bfloat16() for _ in "kv")
    tmpl = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
    with fia.use_backend("prefill"):
        o, l = fia.npu_fused_infer_attention_score(q, k, v, num_heads=8, num_key_value_heads=2, input_layout="BNSD",
                                                   scale=0.125, sparse_mode=3, atten_mask=tmpl, softmax_lse_flag=True)
    assert bool(ran) == own, S
    with fia.use_backend("prefill"):
        said = str(fia.explain(q, k, v, num_heads=8, num_key_value_heads=2, input_layout="BNSD", scale=0.125,
                               sparse_mode=3, atten_mask=tmpl))
    assert ("FIA's own flash kernel" in said) == own and ("ATen's CPU flash kernel in bfloat16 (a whole" in said) != own
    ro, rl = _ref(q, k, v, True, None, 0.125)
    _check(o, l[..., 0], ro, rl, f"S = {S}")
