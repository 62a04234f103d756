"""The int8 K / V micro-kernels of the decode backend (cpu.vnni.qk_i8 / pv_i8) and their helpers
(cpu.simd.max_f32, decode.kernels.softmax.quant_i16) against float64 / numpy.

Both widths (16 lanes for AVX-512; 8 lanes, cpu.fma.NARROW, for CPUs without it) are checked on every CPU,
each with the native instruction (AVX512-VNNI vpdpwssd / AVX2 vpmaddwd, where the CPU has it) and the int32
emulation, on row counts that exercise every row block (4, 2, 1 for QK; 2, 1 for wide PV, 4, 2, 1 narrow), key counts that exercise
every key block (4 / 1 for QK, pairs / odd tail and the 512-key int32 blocks for PV), the unrolled head dims
and the generic loop. The integer products are exact and the int32 lane sums are converted to float32 before
they are summed, so the tolerance is a few float32 roundings of the summed magnitudes (1e-6 of them); extreme
operands (|q| = 32767, k = -128 / 127, D = 8192, narrow 4096; 32767-weights of -128-values over more than 1024 keys) must not
overflow the int32 lanes. Scores and accumulators outside the written range (past n / Dv, past R) are
NaN-poisoned and must stay NaN, query rows carry poisoned padding past D, the spare weight past the last key
of an odd count is poisoned (must be ignored), keys are read through a shuffled offset table (paged-like),
and the prefetch arguments point at real rows (prefetching never changes results).

max_f32 is checked against numpy for every vector / tail split, both modes, with reads past n poisoned;
quant_i16 for its scale, rounding bound, zero and tiny rows, NaN / Inf rejection and untouched outputs.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

numba = pytest.importorskip("numba")
from numba import njit  # noqa: E402
from kernel_util import compiling_with, frozen  # noqa: E402

from fia.backends.decode import kernels as K  # noqa: E402
from fia.cpu import simd as S  # noqa: E402
from fia.cpu import vnni as V  # noqa: E402

pytestmark = pytest.mark.backend_independent      # kernel-level: run once, not per backend (conftest)

U = 2.0 ** -24                  # float32 unit roundoff


def _kernels(native: bool, narrow: bool):
    """Fresh numba wrappers compiled with the native instruction (vpdpwssd; narrow: AVX2 vpmaddwd) or the
    int32 emulation, in the 16-lane (AVX-512) or the 8-lane (narrow) form."""
    flag = "_HOST_AVX2" if narrow else "_HOST_VNNI"
    with compiling_with(V, flag, native), compiling_with(V, "NARROW", narrow):
        @njit
        def qk(q, kbuf, offs, n, s, R, D, qs, xbuf, xoffs, xn, xrow, xes, kfs):
            V.qk_i8(q.ctypes.data, q.shape[1] * 2, kbuf.ctypes.data, offs.ctypes.data, n, s.ctypes.data,
                    s.shape[1], R, D, qs.ctypes.data, xbuf.ctypes.data, xoffs.ctypes.data, xn, xrow, xes, kfs)

        @njit
        def pv(w, vbuf, offs, n, acc, R, Dv, ws, xbuf, xoffs, xn, xrow, xes):
            V.pv_i8(w.ctypes.data, w.shape[1] * 2, vbuf.ctypes.data, offs.ctypes.data, n, acc.ctypes.data,
                    acc.shape[1], R, Dv, ws.ctypes.data, xbuf.ctypes.data, xoffs.ctypes.data, xn, xrow, xes)

        # compile now, while _HOST_VNNI says which code to emit
        buf = np.zeros(64, np.int8)
        offs = np.zeros(2, np.int64)
        one = np.ones(1, np.float32)
        qk(np.zeros((1, 32), np.int16), buf, offs, 1, np.zeros((1, 2), np.float32), 1, 32, one, buf, offs, 1, 32, 1,
           32)
        pv(np.zeros((1, 4), np.int16), buf, offs, 1, np.zeros((1, 64), np.float32), 1, 64, one, buf, offs, 1, 64, 1)
    return frozen(qk, pv)


# (native, narrow): both widths on every CPU, the native instruction where the CPU has it
MODES = ([(False, False)] + ([(True, False)] if V._HOST_VNNI else [])
         + [(False, True)] + ([(True, True)] if V._HOST_AVX2 else []))


@pytest.fixture(scope="module", params=MODES,
                ids=lambda m: ("native" if m[0] else "emulated") + ("-narrow" if m[1] else "-wide"))
def mode(request):
    return request.param


@pytest.fixture(scope="module")
def kernels(mode):
    return _kernels(*mode)


def _ints(shape, lo, hi, g, dtype):
    """Uniform integers in [lo, hi] (inclusive)."""
    return torch.randint(lo, hi + 1, tuple(shape), generator=g, dtype=torch.int64).to(dtype)


def _signs(shape, g):
    return torch.randint(0, 2, tuple(shape), generator=g, dtype=torch.int64) * 2 - 1


# ---------------------------------------------------------------------------------------------- QK
def _run_qk(qk, q, qs, pool, rows):
    """s = qk_i8 of int16 query rows q [R, D] (scales qs [R]) with the int8 keys pool[rows] (read through a
    shuffled offset table, prefetching the same rows); returns the written scores [R, n] after checking that
    nothing past them (columns >= n, row R) was touched, and the float64 reference."""
    R, D = q.shape
    n = rows.shape[0]
    qp = np.full((R, D + 32), 32767, np.int16)           # row padding past D: never read
    qp[:, :D] = q.numpy()
    kb = pool.numpy().reshape(-1)
    offs = (rows * D).numpy().astype(np.int64)
    s = np.full((R + 1, n + 7), np.nan, np.float32)
    qsn = np.append(qs.numpy().astype(np.float32), np.float32(np.nan))   # a scale past R: never used
    qk(qp, kb, offs, n, s, R, D, qsn, kb, offs, n, D, 1, 32)
    assert np.isnan(s[:R, n:]).all()                      # nothing written past the keys
    assert np.isnan(s[R]).all()                           # nor past the rows
    kr = pool[rows].double()
    qd = q.double()
    ref = (qs.double()[:, None] * (qd @ kr.T)).numpy()
    mag = (qs.double().abs()[:, None] * (qd.abs() @ kr.abs().T)).numpy()   # sum of |q k|: the rounding scale
    return s[:R, :n], ref, mag


def _check_qk(s, ref, mag):
    # lanes exact in int32, then <= 16 conversions + a 4-level sum + the scale in float32: < 6 U * sum |q k|
    err = np.abs(s.astype(np.float64) - ref)
    assert np.isfinite(s).all()
    assert (err <= 1e-6 * mag + 1e-30).all(), f"max err {err.max()} (scale {mag.max()})"
    assert err.max() <= 1e-6 * np.abs(ref).max() + 1e-30


@pytest.mark.parametrize("R", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("n", [1, 3, 4, 6, 13, 64])
@pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
def test_qk_i8(kernels, R, n, D):
    qk, _ = kernels
    g = torch.Generator().manual_seed(R * 1000 + n * 10 + D)
    q = _ints((R, D), -32767, 32767, g, torch.int16)
    qs = (torch.rand(R, generator=g, dtype=torch.float64) * 1.5 + 0.5).float() * 1e-4   # distinct per row
    pool = _ints((3 * n + 5, D), -128, 127, g, torch.int8)
    rows = torch.randperm(pool.shape[0], generator=g)[:n]
    s, ref, mag = _run_qk(qk, q, qs, pool, rows)
    _check_qk(s, ref, mag)


@pytest.mark.parametrize("R", [1, 5])
@pytest.mark.parametrize("n", [6, 13, 64])
@pytest.mark.parametrize("D", [32, 128])
def test_qk_i8_nz_rows(kernels, R, n, D):
    """Keys of a 5-D NZ cache (SPEC 8b: a row is D / 32 fragments of 32 bytes, block_size x 32 bytes apart) read in
    place with kfs = block_size x 32: the scores of the same keys as plain rows. The bytes between a row's
    fragments (other slots of the block) are extreme values a wrong stride would pick up."""
    qk, _ = kernels
    g = torch.Generator().manual_seed(R * 7000 + n * 13 + D)
    bs = 16
    q = _ints((R, D), -32767, 32767, g, torch.int16)
    qs = (torch.rand(R, generator=g, dtype=torch.float64) * 1.5 + 0.5).float() * 1e-4
    nb = 3 * n // bs + 3
    nz = torch.where(torch.rand(nb, D // 32, bs, 32, generator=g) < 0.5, torch.tensor(127, dtype=torch.int8),
                     torch.tensor(-128, dtype=torch.int8))                      # [nb, D/32, bs, 32]
    slots = torch.randperm(nb * bs, generator=g)[:n]                            # (block, slot) of each key
    keys = _ints((n, D), -128, 127, g, torch.int8)
    for c in range(n):
        nz[slots[c] // bs, :, slots[c] % bs] = keys[c].view(D // 32, 32)
    qp = np.full((R, D + 32), 32767, np.int16)
    qp[:, :D] = q.numpy()
    kb = nz.numpy().reshape(-1)
    offs = ((slots // bs) * D * bs + (slots % bs) * 32).numpy().astype(np.int64)
    s = np.full((R, n + 7), np.nan, np.float32)
    qk(qp, kb, offs, n, s, R, D, qs.numpy().astype(np.float32), kb, offs, 0, D, 1, bs * 32)
    assert np.isnan(s[:, n:]).all()
    kd, qd = keys.double(), q.double()
    ref = (qs.double()[:, None] * (qd @ kd.T)).numpy()
    _check_qk(s[:, :n], ref, (qs.double().abs()[:, None] * (qd.abs() @ kd.abs().T)).numpy())


@pytest.mark.parametrize("R", [1, 3, 4, 7])
@pytest.mark.parametrize("n", [1, 5, 13])
@pytest.mark.parametrize("D", [32, 64, 128, 256, 1024])
def test_qk_i8_extremes(kernels, R, n, D):
    """|q| = 32767 and k in {-128, 127} with random signs: the largest products, both signs."""
    qk, _ = kernels
    g = torch.Generator().manual_seed(R * 1000 + n * 10 + D + 1)
    q = (_signs((R, D), g) * 32767).to(torch.int16)
    qs = torch.rand(R, generator=g).float() + 0.5
    pool = torch.where(_signs((3 * n + 5, D), g) > 0, 127, -128).to(torch.int8)
    rows = torch.randperm(pool.shape[0], generator=g)[:n]
    s, ref, mag = _run_qk(qk, q, qs, pool, rows)
    _check_qk(s, ref, mag)


@pytest.mark.parametrize("D", [128, 4096, 8192])
@pytest.mark.parametrize("qv", [32767, -32767])
def test_qk_i8_lane_limit(kernels, mode, D, qv):
    """Every product the largest of one sign: each int32 lane reaches D / 16 * 32767 * 128 (8 lanes: D / 8 *
    ...; just below 2^31 at the documented limit, D = 8192, narrow 4096). The lane sums and their float32 total
    are exact here."""
    limit = V.QK_MAX_D_NARROW if mode[1] else V.QK_MAX_D_WIDE
    if D > limit:
        pytest.skip(f"D = {D} is past this width's limit {limit} (kernel_flags sends it to the float32 kernels)")
    qk, _ = kernels
    R, n = 5, 6
    q = torch.full((R, D), qv, dtype=torch.int16)
    q[1] = -q[1]                                          # a row of the other sign
    pool = torch.full((n + 2, D), -128, dtype=torch.int8)
    pool[3] = 127
    rows = torch.tensor([5, 0, 3, 7, 1, 2])
    qs = torch.tensor([1.0, 1.0, 0.5, 2.0, 0.25])
    s, ref, _ = _run_qk(qk, q, qs, pool, rows)
    np.testing.assert_array_equal(s, ref.astype(np.float32))
    if D == limit:
        lanes = 8 if mode[1] else 16
        assert abs(float(ref[0, 0])) == lanes * (2 ** 31 - 2 ** 16)   # lanes of 2^31 - 2^16: no wrap-around


def test_qk_i8_prefetch_rows_change_nothing(kernels):
    """No prefetch (xn = 0), the same rows, and other real rows of another buffer: identical scores."""
    qk, _ = kernels
    g = torch.Generator().manual_seed(5)
    R, n, D = 5, 13, 128
    q = _ints((R, D), -32767, 32767, g, torch.int16).numpy()
    qs = np.linspace(1e-3, 2e-3, R).astype(np.float32)
    kb = _ints((3 * n, D), -128, 127, g, torch.int8).numpy().reshape(-1)
    offs = (torch.randperm(3 * n, generator=g)[:n] * D).numpy().astype(np.int64)
    other = np.arange(2 * n * 64, dtype=np.int64).astype(np.uint16).view(np.int8)   # 2-byte elements
    ooffs = (np.arange(n)[::-1] * 64).astype(np.int64)
    outs = []
    for xb, xo, xn, xrow, xes in ((kb, offs, 0, 0, 1), (kb, offs, n, D, 1), (other, ooffs, n, 64, 2),
                                  (other, ooffs, 3, 64, 2)):
        s = np.full((R, n), np.nan, np.float32)
        qk(q, kb, offs, n, s, R, D, qs, xb, xo, xn, xrow, xes, 32)
        outs.append(s)
    assert np.isfinite(outs[0]).all()
    for s in outs[1:]:
        np.testing.assert_array_equal(s, outs[0])


# ---------------------------------------------------------------------------------------------- PV
def _run_pv(pv, w, ws, pool, rows, acc0, spare=32767):
    """acc = acc0 + pv_i8 of int16 weights w [R, n] (scales ws [R]) with the int8 values pool[rows] (shuffled
    offset table, the same rows prefetched). The weight entries past n (the pair partner of an odd count) are
    `spare`; the offset past n points at a real row. Checks that nothing past Dv or past row R was written;
    returns the written accumulators [R, Dv], the float64 reference and the rounding scale."""
    R, n = w.shape
    Dv = pool.shape[1]
    w2 = np.full((R + 1, n + 3), spare, np.int16)
    w2[:R, :n] = w.numpy()
    vb = pool.numpy().reshape(-1)
    offs = np.append((rows * Dv).numpy(), (pool.shape[0] - 1) * Dv).astype(np.int64)
    acc = acc0.copy()
    wsn = np.append(ws.numpy().astype(np.float32), np.float32(np.nan))
    pv(w2, vb, offs, n, acc, R, Dv, wsn, vb, offs, n, Dv, 1)
    assert np.isnan(acc[:R, Dv:]).all()                   # nothing written past Dv
    np.testing.assert_array_equal(acc[R:], acc0[R:])      # nor past the rows (NaN included: equal_nan)
    vr = pool[rows].double()
    wd = w.double()
    a0 = torch.from_numpy(acc0[:R, :Dv]).double()
    ref = (a0 + ws.double()[:, None] * (wd @ vr)).numpy()
    mag = (a0.abs() + ws.double().abs()[:, None] * (wd.abs() @ vr.abs())).numpy()
    return acc[:R, :Dv], ref, mag


def _check_pv(acc, ref, mag, n):
    # int32 block sums exact; per block of 512 keys one conversion + one fma in float32
    blocks = max(1, -(-n // 512))
    err = np.abs(acc.astype(np.float64) - ref)
    assert np.isfinite(acc).all()
    assert (err <= 3 * U * (blocks + 1) * mag + 1e-30).all(), f"max err {err.max()} (scale {mag.max()})"
    assert err.max() <= 1e-6 * np.abs(ref).max() + 1e-30


def _acc0(R, Dv, g):
    a = torch.randn(R + 1, Dv + 16, generator=g).numpy()
    a[:, Dv:] = np.nan
    return a


@pytest.mark.parametrize("R", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("n", [1, 2, 3, 13, 64, 1100])
@pytest.mark.parametrize("Dv", [64, 128, 192, 256])
def test_pv_i8(kernels, R, n, Dv):
    _, pv = kernels
    g = torch.Generator().manual_seed(R * 1000 + n * 10 + Dv + 7)
    w = _ints((R, n), -32767, 32767, g, torch.int16)
    ws = (torch.rand(R, generator=g, dtype=torch.float64) * 1.5 + 0.5).float() * 1e-7   # distinct per row
    pool = _ints((3 * n + 5, Dv), -128, 127, g, torch.int8)
    rows = torch.randperm(pool.shape[0] - 1, generator=g)[:n]
    acc, ref, mag = _run_pv(pv, w, ws, pool, rows, _acc0(R, Dv, g))
    _check_pv(acc, ref, mag, n)


@pytest.mark.parametrize("n", [511, 512, 513, 1023, 1024, 1100, 1537])
@pytest.mark.parametrize("R,Dv", [(1, 64), (2, 128), (3, 192)])
@pytest.mark.parametrize("wv", [32767, -32767])
def test_pv_i8_int32_blocks(kernels, n, R, Dv, wv):
    """|w| = 32767 times v = -128 for every key: 512 keys fill an int32 lane to 2^31 - 2^16, 1024 would wrap.
    Row 1 gets the opposite sign; the last value row is 127 (a product of the other sign)."""
    _, pv = kernels
    g = torch.Generator().manual_seed(n + R + Dv)
    w = torch.full((R, n), wv, dtype=torch.int16)
    if R > 1:
        w[1] = -w[1]
    pool = torch.full((n + 6, Dv), -128, dtype=torch.int8)
    pool[n + 2] = 127
    rows = torch.randperm(n + 5, generator=g)[:n]
    ws = torch.tensor([1e-9, 3e-9, 7e-10][:R])
    acc, ref, mag = _run_pv(pv, w, ws, pool, rows, _acc0(R, Dv, g))
    _check_pv(acc, ref, mag, n)


@pytest.mark.parametrize("n", [1, 3, 13, 513, 1537])
def test_pv_i8_extremes_mixed(kernels, n):
    """|w| = 32767 with random signs, v in {-128, 127}; odd counts with the spare weight at -32767 too."""
    _, pv = kernels
    g = torch.Generator().manual_seed(n + 11)
    R, Dv = 3, 128
    w = (_signs((R, n), g) * 32767).to(torch.int16)
    pool = torch.where(_signs((n + 6, Dv), g) > 0, 127, -128).to(torch.int8)
    rows = torch.randperm(n + 5, generator=g)[:n]
    ws = torch.tensor([1e-7, 2e-7, 5e-8])
    for spare in (32767, -32767):
        acc, ref, mag = _run_pv(pv, w, ws, pool, rows, _acc0(R, Dv, g), spare=spare)
        _check_pv(acc, ref, mag, n)


def test_pv_i8_ignores_spare_weight(kernels):
    """An odd count with every real weight 0: the result is exactly acc0 although the spare entry past n
    holds 32767 and the offset table past n points at a row of 127s."""
    _, pv = kernels
    for n in (1, 3, 513):
        R, Dv = 3, 64
        w = torch.zeros(R, n, dtype=torch.int16)
        pool = torch.full((n + 2, Dv), 127, dtype=torch.int8)
        acc0 = _acc0(R, Dv, torch.Generator().manual_seed(n))
        acc, _, _ = _run_pv(pv, w, torch.ones(R), pool, torch.arange(n), acc0)
        np.testing.assert_array_equal(acc, acc0[:R, :Dv])


def test_pv_i8_prefetch_rows_change_nothing(kernels):
    _, pv = kernels
    g = torch.Generator().manual_seed(9)
    R, n, Dv = 3, 13, 128
    w = np.zeros((R, n + 1), np.int16)
    w[:, :n] = _ints((R, n), -32767, 32767, g, torch.int16).numpy()
    ws = np.array([1e-7, 2e-7, 3e-7], np.float32)
    vb = _ints((3 * n, Dv), -128, 127, g, torch.int8).numpy().reshape(-1)
    offs = (torch.randperm(3 * n, generator=g)[:n] * Dv).numpy().astype(np.int64)
    other = np.arange(2 * n * 64, dtype=np.int64).astype(np.uint16).view(np.int8)   # 2-byte elements
    ooffs = (np.arange(n)[::-1] * 64).astype(np.int64)
    acc0 = torch.randn(R, Dv, generator=g).numpy()
    outs = []
    for xb, xo, xn, xrow, xes in ((vb, offs, 0, 0, 1), (vb, offs, n, Dv, 1), (other, ooffs, n, 64, 2),
                                  (other, ooffs, 4, 64, 2)):
        acc = acc0.copy()
        pv(w, vb, offs, n, acc, R, Dv, ws, xb, xo, xn, xrow, xes)
        outs.append(acc)
    assert not np.array_equal(outs[0], acc0)
    for a in outs[1:]:
        np.testing.assert_array_equal(a, outs[0])


# ---------------------------------------------------------------------------------------------- max_f32
@njit
def _max_f32(x, n, init, absolute):
    return S.max_f32(x.ctypes.data, n, init, absolute)


@pytest.mark.parametrize("n", [0, 1, 5, 15, 16, 17, 63, 64, 65, 200, 1000])
@pytest.mark.parametrize("absolute", [0, 1])
@pytest.mark.parametrize("start", [0, 3])
def test_max_f32(n, absolute, start):
    """max(init, x[:n]) (or of |x|) for every vector / tail split, from an aligned and an unaligned start;
    the elements past n are huge (must not be read)."""
    rng = np.random.default_rng(n * 4 + absolute * 2 + start)
    buf = np.full(start + n + 70, 3e38, np.float32)
    buf[start:start + n] = (rng.standard_normal(n) * 10).astype(np.float32)
    if n:
        buf[start + rng.integers(n)] = np.float32(-50.0)            # the largest |x|, negative
    x = buf[start:]
    vals = np.abs(x[:n]) if absolute else x[:n]
    for init in (np.float32(-rng.uniform(0.1, 100)), np.float32(-3e38), np.float32(-0.05),
                 np.float32(1e4)):
        got = _max_f32(x, n, init, absolute)
        want = np.float32(max(init, vals.max())) if n else init
        assert isinstance(got, float)
        assert got == want, (init, got, want)
    if n:                                                # all-negative data: the largest (negative) element
        neg = -np.abs(x[:n]) - np.float32(1)
        xn = np.concatenate([neg, np.full(70, 3e38, np.float32)])
        want = np.abs(neg).max() if absolute else neg.max()
        assert _max_f32(xn, n, np.float32(-1e30), absolute) == want


@pytest.mark.parametrize("n", [1, 17, 64, 65, 200])
def test_max_f32_nan_does_not_crash(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n + 8).astype(np.float32)
    x[n:] = 3e38
    for pos in {0, n // 2, n - 1}:
        y = x.copy()
        y[pos] = np.nan
        rest = np.delete(y[:n], pos)
        for absolute in (0, 1):
            got = _max_f32(y, n, np.float32(-7.0), absolute)
            vals = np.abs(rest) if absolute else rest
            want = np.float32(max(-7.0, vals.max())) if rest.size else np.float32(-7.0)
            assert np.isnan(got) or got == want, (pos, absolute, got, want)
    y = np.full(n + 8, np.nan, np.float32)
    got = _max_f32(y, n, np.float32(-7.0), 1)
    assert np.isnan(got) or got == np.float32(-7.0)


# ---------------------------------------------------------------------------------------------- quant_i16
def _quant(x, R, n):
    """quant_i16 on x with poisoned outputs: dst past n / past R and sc past R must stay as they were."""
    dst = np.full((x.shape[0] + 1, x.shape[1] + 4), 12345, np.int16)
    sc = np.full(x.shape[0] + 1, np.nan, np.float32)
    ok = K.quant_i16(x, R, n, dst, sc)
    assert (dst[:, n:] == 12345).all() and (dst[R:] == 12345).all()
    assert np.isnan(sc[R:]).all()
    return ok, dst[:R, :n], sc[:R]


@pytest.mark.parametrize("n", [1, 7, 64, 65, 300])
def test_quant_i16_values(n):
    """sc = max |x| / 32767 per row; dst = x / sc rounded: |dst sc - x| <= sc / 2 plus the float32 rounding of
    x / sc (3 U of |x|); the largest magnitude maps to +-32767. Rows span magnitudes from the float64 branch
    (max < 1e-30) to 1e30; one row is all zeros, one has a negative maximum."""
    rng = np.random.default_rng(n)
    mags = [1.0, 1e-3, 1e4, 1e30, 3e-25, 1e-32, 0.0, 2.0]
    R = len(mags)
    x = np.full((R + 1, n + 5), np.nan, np.float32)        # NaN past n and past R: never read
    for r, m in enumerate(mags):
        x[r, :n] = (rng.standard_normal(n) * m).astype(np.float32)
    x[7, rng.integers(n)] = np.float32(-40.0)
    ok, dst, sc = _quant(x, R, n)
    assert ok is True
    xs = x[:R, :n].astype(np.float64)
    mx = np.abs(xs).max(axis=1)
    np.testing.assert_allclose(sc, (mx / 32767.0).astype(np.float32), rtol=2 * U, atol=0)
    assert sc[6] == 0 and (dst[6] == 0).all()
    d = dst.astype(np.int64)
    for r in range(R):
        if mx[r] == 0:
            continue
        k = np.argmax(np.abs(xs[r]))
        assert d[r, k] == np.sign(xs[r, k]) * 32767, r
        assert np.abs(d[r]).max() <= 32767
        err = np.abs(d[r] * np.float64(sc[r]) - xs[r])
        assert (err <= 0.5 * np.float64(sc[r]) * (1 + 1e-6) + 4 * U * np.abs(xs[r]) + 1e-45).all(), (r, err.max())
        assert (np.sign(d[r]) * np.sign(xs[r]) >= 0).all()


def test_quant_i16_tiny_rows():
    """Rows whose largest magnitude is ~1e-38 (normal) or ~1e-42 (subnormal) still quantize to the full int16
    range: dst = x * 32767 / max |x| rounded (computed in float64)."""
    n = 33
    rng = np.random.default_rng(1)
    x = np.zeros((4, n), np.float32)
    x[0] = (rng.uniform(-1, 1, n) * 1e-38).astype(np.float32)
    x[1] = (rng.uniform(-1, 1, n) * 1e-42).astype(np.float32)            # subnormal float32
    x[2] = (rng.uniform(-1, 1, n) * 1e-34).astype(np.float32)
    x[3, 5] = np.float32(-1.4e-45)                                       # the smallest subnormal, alone
    ok, dst, sc = _quant(x, 4, n)
    assert ok is True
    xs = x.astype(np.float64)
    mx = np.abs(xs).max(axis=1)
    assert (mx > 0).all()
    for r in range(4):
        k = np.argmax(np.abs(xs[r]))
        assert int(dst[r, k]) == np.sign(xs[r, k]) * 32767, r
        want = np.rint(xs[r] * 32767.0 / mx[r])
        assert np.abs(dst[r].astype(np.float64) - want).max() <= 1, r   # a tie may round either way
        assert (np.sign(dst[r]) * np.sign(xs[r]) >= 0).all()
        assert sc[r] == np.float32(mx[r] / 32767.0) or abs(sc[r] - mx[r] / 32767.0) <= 1.5e-45
    assert (dst[3] == np.where(np.arange(n) == 5, -32767, 0)).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [(0, 0), (0, 12), (2, 5), (3, 12)])
def test_quant_i16_rejects_nan_inf(bad, where):
    R, n = 4, 13
    rng = np.random.default_rng(3)
    x = rng.standard_normal((R + 1, n + 3)).astype(np.float32)
    x[:, n:] = bad                                        # past n and past R: ignored
    x[R] = bad
    ok, _, _ = _quant(x.copy(), R, n)
    assert ok is True
    x[where] = bad
    ok, _, _ = _quant(x, R, n)
    assert ok is False
