"""The bf16 dot-product micro-kernels of the decode backend (cpu.simd.qk_dp / pv_dp) against float64.

Both the native AVX512-BF16 code (where the CPU has it) and the float32 emulation every other CPU compiles
are checked, on row counts that exercise every row block (4, 2, 1), key counts that exercise every key block
(4 / 1 for QK, pairs / odd tail for PV), every unrolled head dim and the generic loop. Scores and
accumulators outside the written range are NaN-poisoned (must stay NaN / untouched), the unused partner
weight of an odd key count is poisoned (must be ignored), keys are read through a shuffled offset table
(paged-like), and the prefetch arguments point at real rows (prefetching never changes results).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

numba = pytest.importorskip("numba")
from numba import njit  # noqa: E402
from kernel_util import compiling_with, frozen  # noqa: E402

from fia.cpu import simd as S  # noqa: E402

pytestmark = pytest.mark.backend_independent      # kernel-level: run once, not per backend (conftest)


def _kernels(native: bool):
    """Fresh numba wrappers compiled with the native instruction or the emulation."""
    with compiling_with(S, "_HOST_DP", native):
        @njit
        def qk(q, kbuf, offs, n, s, R, D, scale, xbuf, xoffs, xn, xrow, xes):
            S.qk_dp(q.ctypes.data, q.shape[1] * 2, kbuf.ctypes.data, offs.ctypes.data, n, s.ctypes.data,
                    s.shape[1], R, D, scale, xbuf.ctypes.data, xoffs.ctypes.data, xn, xrow, xes)

        @njit
        def pv(p, vbuf, offs, n, acc, R, Dv, xbuf, xoffs, xn, xrow, xes):
            S.pv_dp(p.ctypes.data, p.shape[1] * 2, vbuf.ctypes.data, offs.ctypes.data, n, acc.ctypes.data,
                    acc.shape[1], R, Dv, xbuf.ctypes.data, xoffs.ctypes.data, xn, xrow, xes)

        # compile now, while _HOST_DP says which code to emit
        one16 = np.zeros((1, 32), np.uint16)
        buf = np.zeros(64, np.uint16)
        offs = np.zeros(2, np.int64)
        qk(one16, buf, offs, 1, np.zeros((1, 2), np.float32), 1, 32, np.float32(1), buf, offs, 1, 32, 2)
        pv(np.zeros((1, 4), np.uint16), buf, offs, 1, np.zeros((1, 64), np.float32), 1, 64, buf, offs, 1, 64, 2)
    return frozen(qk, pv)


MODES = [False] + ([True] if S._HOST_DP else [])


@pytest.fixture(scope="module", params=MODES, ids=lambda m: "native" if m else "emulated")
def kernels(request):
    return _kernels(request.param)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("R", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("n", [1, 3, 4, 6, 13, 64])
@pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
def test_qk_dp(kernels, R, n, D):
    qk, _ = kernels
    g = torch.Generator().manual_seed(R * 1000 + n * 10 + D)
    q = torch.randn(R, D, generator=g).bfloat16()
    pool = torch.randn(3 * n + 5, D, generator=g).bfloat16()
    rows = torch.randperm(pool.shape[0], generator=g)[:n]
    offs = (rows * D).numpy().astype(np.int64)
    s = np.full((R, n + 7), np.nan, np.float32)
    qk(_bits(q), _bits(pool).reshape(-1), offs, n, s, R, D, np.float32(0.3), _bits(pool).reshape(-1), offs, n,
       D, 2)
    ref = 0.3 * (q.double() @ pool[rows].double().T).numpy()
    np.testing.assert_allclose(s[:, :n], ref, rtol=1e-5, atol=1e-4)
    assert np.isnan(s[:, n:]).all()                       # nothing written past the keys


@pytest.mark.parametrize("R", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("n", [1, 2, 3, 8, 13, 64])
@pytest.mark.parametrize("Dv", [64, 128, 192, 256])
def test_pv_dp(kernels, R, n, Dv):
    _, pv = kernels
    g = torch.Generator().manual_seed(R * 1000 + n * 10 + Dv + 7)
    p = torch.rand(R, n, generator=g).bfloat16()
    pool = torch.randn(3 * n + 5, Dv, generator=g).bfloat16()
    rows = torch.randperm(pool.shape[0], generator=g)[:n]
    offs = (rows * Dv).numpy().astype(np.int64)
    p2 = np.full((R, n + 2), 0x7FC0, np.uint16)          # NaN weights past the keys: must never be used
    p2[:, :n] = _bits(p)
    acc0 = torch.randn(R, Dv + 16, generator=g).numpy()
    acc0[:, Dv:] = np.nan
    acc = acc0.copy()
    pv(p2, _bits(pool).reshape(-1), offs, n, acc, R, Dv, _bits(pool).reshape(-1), offs, n, Dv, 2)
    ref = acc0[:, :Dv] + (p.double() @ pool[rows].double()).numpy()
    np.testing.assert_allclose(acc[:, :Dv], ref, rtol=1e-5, atol=1e-4)
    assert np.isnan(acc[:, Dv:]).all()                    # nothing written past Dv


def test_nan_and_inf_propagate(kernels):
    qk, pv = kernels
    D = 64
    q = torch.randn(4, D).bfloat16()
    k = torch.randn(4, D).bfloat16()
    k[1, 5] = float("nan")
    k[2, 7] = float("inf")
    offs = (torch.arange(4) * D).numpy().astype(np.int64)
    s = np.zeros((4, 4), np.float32)
    kb = _bits(k).reshape(-1)
    qk(_bits(q), kb, offs, 4, s, 4, D, np.float32(1), kb, offs, 0, 0, 2)
    assert np.isnan(s[:, 1]).all() and np.isfinite(s[:, [0, 3]]).all()
    assert (np.isinf(s[:, 2]) | np.isnan(s[:, 2])).all()
    p2 = np.zeros((1, 6), np.uint16)
    p2[0, :4] = _bits(torch.tensor([0.25, 0.5, 0.0, 0.25]).bfloat16())
    acc = np.zeros((1, D), np.float32)
    pv(p2, kb, offs, 4, acc, 1, D, kb, offs, 0, 0, 2)
    assert np.isnan(acc[0, 5]) and np.isnan(acc[0, 7])   # NaN * 0.5 and Inf * 0 are NaN
    assert np.isfinite(np.delete(acc[0], [5, 7])).all()


# ---------------------------------------------------------------------------------------------- FMA kernels
from fia.cpu import fma as FM  # noqa: E402

KINDS = {"bf16": (FM.KIND_BF16, torch.bfloat16), "fp16": (FM.KIND_FP16, torch.float16),
         "int8": (FM.KIND_I8, torch.int8), "f32": (FM.KIND_F32, torch.float32)}
ESIZE = {"bf16": 2, "fp16": 2, "int8": 1, "f32": 4}


def _fma_kernels(f16c: bool, narrow: bool):
    """Fresh wrappers compiled with fp16 widened by F16C or by integer arithmetic, on 8-lane (narrow) or
    16-lane vectors."""
    with compiling_with(FM, "F16C", f16c), compiling_with(FM, "NARROW", narrow):
        @njit
        def qk(q, kbuf, kind, offs, n, s, R, D, xbuf, xoffs, xn, xrow, xes):
            FM.qk_fma(q.ctypes.data, q.shape[1] * 4, kbuf.ctypes.data, kind, offs.ctypes.data, n, s.ctypes.data,
                      s.shape[1], R, D, xbuf.ctypes.data, xoffs.ctypes.data, xn, xrow, xes)

        @njit
        def pv(p, vbuf, kind, offs, n, acc, R, Dv, xbuf, xoffs, xn, xrow, xes):
            FM.pv_fma(p.ctypes.data, p.shape[1] * 4, vbuf.ctypes.data, kind, offs.ctypes.data, n,
                      acc.ctypes.data, acc.shape[1], R, Dv, xbuf.ctypes.data, xoffs.ctypes.data, xn, xrow, xes)

        buf = np.zeros(64, np.uint8)
        offs = np.zeros(2, np.int64)
        qk(np.zeros((1, 16), np.float32), buf, 2, offs, 1, np.zeros((1, 2), np.float32), 1, 16, buf, offs, 1, 16, 2)
        pv(np.zeros((1, 2), np.float32), buf, 2, offs, 1, np.zeros((1, 16), np.float32), 1, 16, buf, offs, 1, 16, 2)
    return frozen(qk, pv)


F16C_MODES = [False] + ([True] if FM.F16C else [])


@pytest.fixture(scope="module", params=[(f, w) for f in F16C_MODES for w in (False, True)],
                ids=lambda m: ("f16c" if m[0] else "f16-bits") + ("-narrow" if m[1] else "-wide"))
def fma_kernels(request):
    return _fma_kernels(*request.param) + (request.param[1],)


def _eo(x, w, back=False):
    """Rows of x per w channels: the even-indexed ones, then the odd-indexed ones (fma.KIND_BF16_EO), or back."""
    R, D = x.shape
    g = x.reshape(R, D // w, 2, w // 2) if back else x.reshape(R, D // w, w // 2, 2)
    return np.ascontiguousarray(g.swapaxes(2, 3)).reshape(R, D)


@pytest.mark.parametrize("R", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", [1, 4, 13])
@pytest.mark.parametrize("D", [32, 64, 128, 192])
def test_fma_bf16_even_odd_halves(fma_kernels, R, n, D):
    """bf16 widened in even / odd halves (KIND_BF16_EO): QK against a query de-interleaved per group of 16 (8 lanes)
    or 32 (16 lanes) channels, PV into accumulators in that order (head dims of whole groups: 16-lane PV widens
    pairs of them, Dv % 64). Exact products: the float64 reference within float32 summation."""
    qk, pv, narrow = fma_kernels
    w = 16 if narrow else 32
    g = torch.Generator().manual_seed(R * 100 + n * 7 + D)
    pool, buf = _pool("bf16", 3 * n + 5, D, g)
    rows = torch.randperm(pool.shape[0], generator=g)[:n]
    offs = (rows * D).numpy().astype(np.int64)
    q = torch.randn(R, D, generator=g)
    s = np.full((R, n + 7), np.nan, np.float32)
    qk(_eo(q.numpy(), w), buf, FM.KIND_BF16_EO, offs, n, s, R, D, buf, offs, n, D, 2)
    np.testing.assert_allclose(s[:, :n], (q.double() @ pool[rows].double().T).numpy(), rtol=1e-5, atol=1e-3)
    assert np.isnan(s[:, n:]).all()
    if D % (w if narrow else 2 * w):
        return
    p = torch.rand(R, n + 3, generator=g)
    p[:, n:] = float("nan")                                 # weights past the keys: never read
    acc0 = torch.randn(R, D + 16, generator=g).numpy()
    acc0[:, D:] = np.nan
    acc = acc0.copy()
    acc[:, :D] = _eo(acc0[:, :D], w)
    pv(p.numpy(), buf, FM.KIND_BF16_EO, offs, n, acc, R, D, buf, offs, n, D, 2)
    ref = acc0[:, :D] + (p[:, :n].double() @ pool[rows].double()).numpy()
    np.testing.assert_allclose(_eo(acc[:, :D], w, back=True), ref, rtol=1e-5, atol=1e-3)
    assert np.isnan(acc[:, D:]).all()


def _pool(kind, rows, d, g):
    _, dt = KINDS[kind]
    if dt == torch.int8:
        t = torch.randint(-128, 128, (rows, d), generator=g, dtype=torch.int8)
        return t, t.numpy().reshape(-1).view(np.uint8)
    if dt == torch.float32:                                  # (loaded as is: no widening)
        t = torch.randn(rows, d, generator=g)
        return t, t.numpy().reshape(-1).view(np.uint8)
    t = torch.randn(rows, d, generator=g).to(dt)
    return t, t.view(torch.int16).numpy().reshape(-1).view(np.uint8)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("R", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n", [1, 3, 4, 13, 64])
@pytest.mark.parametrize("D", [16, 48, 64, 128, 256])
def test_qk_fma(fma_kernels, kind, R, n, D):
    _qk_fma = fma_kernels[0]
    g = torch.Generator().manual_seed(R * 1000 + n * 10 + D + len(kind))
    q = torch.randn(R, D, generator=g, dtype=torch.float32)
    pool, buf = _pool(kind, 3 * n + 5, D, g)
    rows = torch.randperm(pool.shape[0], generator=g)[:n]
    offs = (rows * D).numpy().astype(np.int64)
    s = np.full((R, n + 7), np.nan, np.float32)
    es = ESIZE[kind]
    _qk_fma(q.numpy(), buf, KINDS[kind][0], offs, n, s, R, D, buf, offs, n, D, es)
    ref = (q.double() @ pool[rows].double().T).numpy()
    np.testing.assert_allclose(s[:, :n], ref, rtol=1e-5, atol=1e-3)
    assert np.isnan(s[:, n:]).all()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("R", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", [1, 2, 13, 64])
@pytest.mark.parametrize("Dv", [16, 48, 64, 128, 192, 256])
def test_pv_fma(fma_kernels, kind, R, n, Dv):
    _pv_fma = fma_kernels[1]
    g = torch.Generator().manual_seed(R * 1000 + n * 10 + Dv + 3 * len(kind))
    p = torch.rand(R, n + 3, generator=g, dtype=torch.float32)
    p[:, n:] = float("nan")                                 # weights past the keys: never read
    pool, buf = _pool(kind, 3 * n + 5, Dv, g)
    rows = torch.randperm(pool.shape[0], generator=g)[:n]
    offs = (rows * Dv).numpy().astype(np.int64)
    acc0 = torch.randn(R, Dv + 16, generator=g).numpy()
    acc0[:, Dv:] = np.nan
    acc = acc0.copy()
    es = ESIZE[kind]
    _pv_fma(p.numpy(), buf, KINDS[kind][0], offs, n, acc, R, Dv, buf, offs, n, Dv, es)
    ref = acc0[:, :Dv] + (p[:, :n].double() @ pool[rows].double()).numpy()
    np.testing.assert_allclose(acc[:, :Dv], ref, rtol=1e-5, atol=1e-3)
    assert np.isnan(acc[:, Dv:]).all()


def test_fp16_bits_widening_exact(fma_kernels):
    """Every fp16 bit pattern (normals, subnormals, zeros, inf, nan) widens exactly, by either method."""
    qk = fma_kernels[0]
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)           # one key per 16 patterns
    vals = torch.from_numpy(bits.view(np.int16)).view(torch.float16).float().reshape(4096, 16)
    buf = bits.view(np.uint8)
    offs = (np.arange(4096) * 16).astype(np.int64)
    for lane in range(16):                                             # score = the lane's value
        q = np.zeros((1, 16), np.float32)
        q[0, lane] = 1.0
        s = np.zeros((1, 4096), np.float32)
        qk(q, buf, FM.KIND_FP16, offs, 4096, s, 1, 16, buf, offs, 0, 16, 2)
        want = vals[:, lane].numpy()
        fin = np.isfinite(want)
        np.testing.assert_array_equal(s[0, fin], want[fin])
        assert np.isnan(s[0, np.isnan(want)]).all()
        assert (np.isinf(s[0, np.isinf(want)]) | np.isnan(s[0, np.isinf(want)])).all()   # inf * 0 adds NaN


def test_f32_to_half_software_rounding_matches_torch():
    """The fp16 output rounding used where the target lacks F16C equals torch's, bit for bit."""
    from fia.backends.decode import kernels as K

    @njit
    def conv(a, out):
        for i in range(a.shape[0]):
            out[i] = K._f32_to_half_bits_sw(a[i])

    rng = np.random.default_rng(0)
    bits = np.concatenate([rng.integers(0, 2 ** 32, 400_000, dtype=np.uint64).astype(np.uint32),
                           np.arange(0x33000000, 0x48000000, 211, dtype=np.uint32)])   # subnormal..overflow
    bits = np.concatenate([bits, bits | np.uint32(0x80000000)])
    x = bits.view(np.float32)
    out = np.empty(x.shape, np.uint16)
    conv(x, out)
    ref = torch.from_numpy(x).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(out[~nan], ref[~nan])
    assert np.isnan(out[nan].view(np.float16)).all()


@njit
def _exp_rows(s, n, mx, p, mode, inv):
    return S.exp_rows(s.ctypes.data, n, mx, p.ctypes.data, mode, inv)


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("n", [16, 37, 256])
def test_exp_rows_matches_the_scalar_pass(mode, n):
    """exp_rows (the 16-lane softmax pass) against decode.kernels' scalar fexp / bf16 rounding / int16
    quantization on the same scores: whole 16-score blocks only (the rest untouched), NaN, -inf, very
    negative and zero differences included, the sum of the written values returned."""
    from fia.backends.decode import kernels as K
    g = np.random.default_rng(n * 10 + mode)
    x = (g.standard_normal(n) * 6 - 3).astype(np.float32)
    x[:6] = [np.nan, -np.inf, -100.0, -87.5, 0.0, 1.0]
    mx = np.float32(1.0)
    n16 = n - n % 16
    s = x.copy()
    p = np.full(n + 2, 0xABCD, np.uint16)
    inv = np.float32(32767.0 / 0.9)
    total = _exp_rows(s, n, mx, p, mode, inv)
    want = np.array([K.fexp(np.float32(v - mx)) for v in x[:n16]], np.float32)
    np.testing.assert_allclose(s[:n16], want, rtol=2e-7, atol=1e-30, equal_nan=True)
    assert np.isnan(s[0]) and s[1] == 0 and s[2] == 0 and s[4] == want[4]
    assert np.array_equal(s[n16:], x[n16:])                        # the tail is the caller's
    assert np.isnan(total)                                          # a NaN score makes the sum NaN
    clean = x.copy()
    clean[0] = -1.0
    total = _exp_rows(clean, n, mx, p.copy(), mode, inv)
    np.testing.assert_allclose(total, np.nansum(want[1:]) + K.fexp(np.float32(-2.0)) if n16 else 0.0, rtol=1e-5)
    if mode == 1:
        assert np.array_equal(p[:n16], [K.f32_to_bf16_bits(v) for v in s[:n16]])
    elif mode == 2:
        fin = ~np.isnan(s[:n16])
        q = np.minimum(np.rint(s[:n16][fin] * inv), 32767).astype(np.int16)
        assert np.array_equal(p[:n16].view(np.int16)[fin], q)
    else:
        assert (p[:n16] == 0xABCD).all()
    assert (p[n16:] == 0xABCD).all()
