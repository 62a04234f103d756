"""The decode backend against the reference backend, on randomized decode-specific paths.

Every case runs the same call twice, forced to `decode` and to `reference`, and demands the same
result: outputs within one rounding of the output dtype (both accumulate in float32), the same lse
(+inf rows identical), rows that are 0 in the reference exactly 0. Padding that must not be read is
NaN-poisoned (KV past the lengths, unused paged blocks, per-token scales past the lengths), so a wild
read shows as NaN. Paged runs also forbid the storage's gathering helper: the cache is read in place.

These tests compare two backends explicitly, so they run once, under be=decode
(`pytestmark = pytest.mark.backends("decode")`, see conftest).
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch

import fia
from fia.backends.decode import plan as DEC_PLAN
from fia.backends import registry

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
NAN = float("nan")
OUT_TOL = {F16: 2e-3, BF16: 1.6e-2, F32: 1e-4}        # one rounding of the output dtype, relative to max|ref|
LSE_TOL = 2e-4


def _dp_variants():
    """Kernel choices (ip[IP_DP]) the suite runs under: this CPU's default (bf16 dot-product kernels on AMD with
    AVX512-BF16 and with AMX, float32 FMA IR kernels for the rest, its prefetch policy, AMX tiles for items of 8+ rows
    where it has AMX), the bf16 dot-product kernels wherever the CPU has them with every prefetch request (the other
    CPU vendor's policy: nta + own rows ahead) and AMX tiles for every item, the FMA kernels alone (every other CPU's bf16 path: bf16 widened in
    even / odd halves) with t1 requests of the V rows only (PV requesting nothing: the "-v" policies, DP_NO_PV_K),
    and no prefetching with bf16 widened in order."""
    try:
        from fia.backends.decode import kernels as K
    except ImportError:                                   # numba missing: the backend is not registered
        return [None]
    every = (K.DP_FLAGS & ~K.PREFETCH_POLICIES[K.PREFETCH_POLICY]) | K.PREFETCH_POLICIES["nta+ahead"]
    if K.HAS_DP:                                      # bf16 dot products where the CPU has them (Intel: not the default)
        every |= K.DP_QK | K.DP_PV
    if K.HAS_AMX:                                     # AMX tiles for every item, not only from AMX_MIN_ROWS rows
        every |= K.DP_AMX_ANY
    return sorted({K.DP_FLAGS, every, K.PREFETCH_POLICIES["t1-v"] | K.DP_EO, 0}, reverse=True)


@pytest.fixture(autouse=True, params=_dp_variants(), ids=lambda v: f"dp{v}")
def _dp(request, monkeypatch):
    if request.param is not None:
        from fia.backends.decode import kernels as K
        monkeypatch.setattr(K, "DP_FLAGS", request.param)
        DEC_PLAN.PLANS.clear()                              # plans carry the flags: start from none
        # the suite's calls are small: without this their launches would drop the prefetch bits
        # (decode.PREFETCH_MIN_BYTES) and the prefetching code paths would go untested
        monkeypatch.setattr(DEC_PLAN, "PREFETCH_MIN_BYTES", -1)
    return request.param


# decode-vs-reference comparisons: one run each, under be=decode (conftest; none where decode is not registered)
pytestmark = pytest.mark.backends("decode")


def seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) % 100000


def gen(*parts) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed(*parts))
    return g


def randn(shape, g, dtype=F16, std=1.0):
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(dtype)


def rint8(shape, g):
    return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)


def rint4(shape, g):
    """int32 holding eight random nibbles each: shape [..., D / 8]."""
    return torch.randint(-2 ** 31, 2 ** 31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32)


def runif(shape, g, lo, hi, dtype=F32):
    return (torch.rand(*shape, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(dtype)


def to_layout(x, layout):
    """canonical [B, N, S, D] -> BSH / BSND / BNSD."""
    b, n, s, d = x.shape
    if layout == "BSH":
        return x.permute(0, 2, 1, 3).reshape(b, s, n * d).contiguous()
    if layout == "BSND":
        return x.permute(0, 2, 1, 3).contiguous()
    return x.contiguous()


def poison_kv(x, lens):
    """canonical [B, KV_N, S, D] float: NaN at positions >= lens[b]."""
    x = x.clone()
    for b, l in enumerate(lens):
        x[b, :, l:] = NAN
    return x


def paged(lens, bs, kvn, d, g, dtype, make, *, spare=3, extra_cols=1):
    """A shuffled pool: table int32 [B, MB] (unused entries -1), pool [NB, KV_N, bs, D] (unused slots
    NaN for floats), and the dense gathered view for reference-free checks."""
    need = [-(-l // bs) for l in lens]
    nb = sum(need) + spare
    perm = torch.randperm(nb, generator=g).tolist()
    mb = max(need + [1]) + extra_cols
    table = torch.full((len(lens), mb), -1, dtype=torch.int32)
    k = 0
    for b, n in enumerate(need):
        for j in range(n):
            table[b, j] = perm[k]
            k += 1
    pool = make((nb, kvn, bs, d), g) if dtype is None else randn((nb, kvn, bs, d), g, dtype)
    if pool.is_floating_point():
        used = torch.zeros(nb, bs, dtype=torch.bool)
        for b, l in enumerate(lens):
            for p in range(l):
                used[table[b, p // bs], p % bs] = True
        pool = pool.masked_fill(~used[:, None, :, None], NAN)
    return table, pool


def as_cache(pool, fmt):
    nb, kvn, bs, d = pool.shape
    if fmt == "3d":
        return pool.permute(0, 2, 1, 3).reshape(nb, bs, kvn * d).contiguous()
    return pool.contiguous()


def call(api, args, kw, be, mode):
    with fia.validation_mode(mode), fia.use_backend(be):
        r = api(*args, **kw)
    return r if isinstance(r, tuple) else (r, None)


def compare(args, kw, *, api=None, mode="portable", no_gather=False, monkeypatch=None):
    """Run decode and reference; assert they agree. Returns (out, lse) of decode."""
    api = api or fia.npu_fused_infer_attention_score
    if no_gather:
        from fia.problem import attention as P

        def forbidden(self, *a, **k):
            raise AssertionError("the decode backend gathered the paged cache")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(P.PagedKV, "rows", forbidden)
            od, ld = call(api, args, kw, "decode", mode)
    else:
        od, ld = call(api, args, kw, "decode", mode)
    orf, lr = call(api, args, kw, "reference", mode)
    assert od.dtype == orf.dtype and od.shape == orf.shape, (od.dtype, orf.dtype, od.shape, orf.shape)
    if od.dtype == torch.int8:
        assert (od.int() - orf.int()).abs().max().item() <= 1
    else:
        fin = torch.isfinite(orf)
        assert torch.isfinite(od[fin]).all(), "decode: non-finite values where the reference is finite"
        if fin.any():
            den = max(orf[fin].double().abs().max().item(), 1e-6)
            err = (od[fin].double() - orf[fin].double()).abs().max().item() / den
            assert err <= OUT_TOL[od.dtype], f"out rel err {err:.3g}"
        zero = orf == 0
        assert (od[zero] == 0).all(), "rows the reference leaves 0 must be exactly 0"
    if lr is not None and lr.numel():
        assert ld.shape == lr.shape and ld.dtype == lr.dtype
        assert torch.equal(torch.isposinf(ld), torch.isposinf(lr)), "lse +inf pattern differs"
        huge = lr < -1e11
        assert (ld[huge] < -1e11).all()
        rest = torch.isfinite(lr) & ~huge
        if rest.any():
            e = (ld[rest].double() - lr[rest].double()).abs().max().item()
            assert e <= LSE_TOL, f"lse abs err {e:.3g}"
    return od, ld


@pytest.fixture
def small_splits(monkeypatch):
    """Force split-KV (and the thread pool) on small problems, with short chunks."""
    monkeypatch.setattr(DEC_PLAN, "MIN_SPLIT", 8)
    monkeypatch.setattr(DEC_PLAN, "ITEMS_PER_THREAD", 64)
    monkeypatch.setattr(DEC_PLAN, "PARALLEL_MIN_WORK", 0)


def test_prefetch_bits_follow_the_bytes_read(monkeypatch):
    """A launch reading at most PREFETCH_MIN_BYTES of K / V (keys x KV heads x row bytes of its kinds) runs
    without the software prefetch bits of DP_FLAGS; a larger one keeps them, and the other bits stay."""
    from fia.backends.decode import kernels as K
    pf = K.DP_PREFETCH_BITS | K.DP_TOUCH
    monkeypatch.setattr(K, "DP_FLAGS", K.DP_FLAGS | pf)
    monkeypatch.setattr(DEC_PLAN, "PREFETCH_MIN_BYTES", 1 << 20)
    ip = [0] * K.IP_LEN
    flags = lambda keys, H: DEC_PLAN._dp_flags(K, DEC_PLAN._key_bytes(K, ip), keys, H)  # noqa: E731
    ip[K.IP_D], ip[K.IP_DV], ip[K.IP_K_KIND], ip[K.IP_V_KIND] = 128, 128, K.KIND_BF16, K.KIND_BF16
    assert flags(256, 8) == K.DP_FLAGS & ~pf            # 256 keys x 8 heads x 512 B = 1 MiB
    assert flags(257, 8) == K.DP_FLAGS
    ip[K.IP_K_KIND], ip[K.IP_V_KIND] = K.KIND_I8, K.KIND_I4            # 128 + 64 bytes per key
    assert flags(1024 * 1024 // 192 // 8, 8) == K.DP_FLAGS & ~pf
    assert flags(1024 * 1024 // 192 // 8 + 1, 8) == K.DP_FLAGS
    ip[K.IP_K_KIND], ip[K.IP_V_KIND], ip[K.IP_DR], ip[K.IP_R_KIND] = K.KIND_F32, K.KIND_BF16, 64, K.KIND_BF16
    assert flags(1024 * 1024 // 896, 1) == K.DP_FLAGS & ~pf     # 512 + 256 + 128 bytes per key
    assert flags(1024 * 1024 // 896 + 1, 1) == K.DP_FLAGS


# ---------------------------------------------------------------------------------------------- dense, GQA
@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
def test_dense_gqa(G, dtype, layout):
    g = gen("dense", G, dtype, layout)
    b, kvn, s, d = 3, 2, 77, 64
    n = G * kvn
    lens = [77, 13, 0]
    q = randn((b, n, 1, d), g, dtype)
    k, v = poison_kv(randn((b, kvn, s, d), g, dtype), lens), poison_kv(randn((b, kvn, s, d), g, dtype), lens)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout=layout, scale=1 / math.sqrt(d),
              softmax_lse_flag=True, actual_seq_lengths_kv=lens)
    compare((to_layout(q, layout), to_layout(k, layout), to_layout(v, layout)), kw, mode="strict")


@pytest.mark.parametrize("d", [8, 40, 48, 96, 192])
@pytest.mark.parametrize("kind", ["bf16", "fp16", "int8"])
@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
def test_head_dims(d, kind, layout):
    """Head dims the IR kernels take (multiples of 16: unrolled and looped) and the ones they leave to the
    numba fused kernels (the generic build), for every fused element kind, with split KV and GQA; BSH: items
    of all KV heads (decode.kernels.params.IP_HB), 3 of them."""
    g = gen("dims", d, kind, layout)
    b, n, kvn, s = 2, 8, 2, 150
    if layout == "BSH":
        n, kvn = 12, 3
    lens = [150, 61]
    dt = F16 if kind == "fp16" else BF16
    q = randn((b, n, 1, d), g, dt)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout=layout, scale=1 / math.sqrt(d),
              softmax_lse_flag=True, actual_seq_lengths_kv=lens)
    if kind == "int8":                               # per-tensor antiquant (key and value share the head dim)
        k, v = rint8((b, kvn, s, d), g), rint8((b, kvn, s, d), g)
        kw.update(antiquant_scale=runif((2, 1), g, 0.004, 0.02, dt), antiquant_mode=0)
    else:
        k, v = poison_kv(randn((b, kvn, s, d), g, dt), lens), poison_kv(randn((b, kvn, s, d), g, dt), lens)
    compare((to_layout(q, layout), to_layout(k, layout), to_layout(v, layout)), kw)


@pytest.mark.parametrize("touch", [True, False], ids=["touch", "no-touch"])
@pytest.mark.parametrize("kind", ["bf16", "fp16", "int8"])
def test_items_of_all_kv_heads_with_and_without_the_touch_pass(kind, touch, monkeypatch):
    """Token-major K / V (BSND: an item covers all KV heads, decode.kernels.params.IP_HB) with the touch pass
    (DP_TOUCH: the default, but on AMD Zen 4) and without it, small calls prefetching as large ones, split KV and
    uneven lengths, against the reference; fia.explain says which ran."""
    from fia.backends.decode import kernels as K
    monkeypatch.setattr(K, "DP_FLAGS", (K.DP_FLAGS | K.DP_TOUCH) if touch else (K.DP_FLAGS & ~K.DP_TOUCH))
    monkeypatch.setattr(DEC_PLAN, "PREFETCH_MIN_BYTES", -1)
    monkeypatch.setattr(DEC_PLAN, "MIN_SPLIT", 64)
    g = gen("touch", kind, touch)
    b, n, kvn, s, d = 2, 12, 3, 300, 64
    lens = [300, 173]
    dt = F16 if kind == "fp16" else BF16
    q = randn((b, n, 1, d), g, dt)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BSND", scale=1 / math.sqrt(d),
              softmax_lse_flag=True, actual_seq_lengths_kv=lens)
    if kind == "int8":
        k, v = rint8((b, kvn, s, d), g), rint8((b, kvn, s, d), g)
        kw.update(antiquant_scale=runif((2, 1), g, 0.004, 0.02, dt), antiquant_mode=0)
    else:
        k, v = poison_kv(randn((b, kvn, s, d), g, dt), lens), poison_kv(randn((b, kvn, s, d), g, dt), lens)
    args = tuple(to_layout(x, "BSND") for x in (q, k, v))
    compare(args, kw)
    text = str(fia.explain(*args, **kw))
    assert f"{kvn} KV heads per item" in text
    assert ("each chunk's rows read front to back first" in text) == touch
    if K.DP_FLAGS & K.DP_PREFETCH and not touch:     # without the pass each head requests its own rows ahead
        assert ("rows ahead: K" + ("" if kind == "int8" else ", V")) in text


@pytest.mark.parametrize("chunk", [32768, 65536 + 64 * 3])
@pytest.mark.parametrize("mode", ["chan", "tok"])
def test_int8_long_chunks(mode, chunk, monkeypatch):
    """int8 K / V with chunks of more than 512 keys (cpu.vnni.pv_i8 sums its int32 lanes in blocks of
    512 keys) and odd chunk lengths, per-channel scales + offsets / per-token scales + offsets, values at
    the int8 extremes."""
    monkeypatch.setattr(DEC_PLAN, "CHUNK_FLOATS", chunk)
    g = gen("i8chunks", mode, chunk)
    b, n, kvn, d = 2, 8, 2, 64
    lens = [1500, 1031]
    s = max(lens)
    q = randn((b, n, 1, d), g, BF16, std=2.0)
    k, v = rint8((b, kvn, s, d), g), rint8((b, kvn, s, d), g)
    k[0, 0, :40] = -128                                      # extremes of the integer products
    v[0, 1, 100:700] = 127
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=1 / math.sqrt(d),
              softmax_lse_flag=True, actual_seq_lengths_kv=lens)
    if mode == "chan":
        kw.update(key_antiquant_scale=runif((1, kvn, 1, d), g, 0.004, 0.02, BF16),
                  value_antiquant_scale=runif((1, kvn, 1, d), g, 0.004, 0.02, BF16),
                  key_antiquant_offset=runif((1, kvn, 1, d), g, -3, 3, BF16),
                  value_antiquant_offset=runif((1, kvn, 1, d), g, -3, 3, BF16),
                  key_antiquant_mode=0, value_antiquant_mode=0)
    else:
        kw.update(key_antiquant_scale=runif((1, b, s), g, 0.004, 0.02, F32),
                  value_antiquant_scale=runif((1, b, s), g, 0.004, 0.02, F32),
                  key_antiquant_offset=runif((1, b, s), g, -3, 3, F32),
                  value_antiquant_offset=runif((1, b, s), g, -3, 3, F32),
                  key_antiquant_mode=1, value_antiquant_mode=1)
    compare((q, k, v), kw)


@pytest.mark.parametrize("kind", ["bf16", "fp16", "int8-chan", "int8-tok"])
def test_repeat_calls_are_bitwise_identical(kind, small_splits):
    """The same call twice, with calls of other shapes (more query rows, longer keys, odd key counts) and two
    threads in between, gives bitwise the same output and lse: the kernels' scratch (scores, int16 weights
    with their spare column, partials) is reused across calls and must never be read where it was not
    written in this call."""
    g = gen("repeat", kind)
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def call(b, G, sq, s, lens):
            kvn, d = 2, 128
            dt = F16 if kind == "fp16" else BF16
            q = randn((b, kvn * G, sq, d), g, dt)
            kw = dict(num_heads=kvn * G, num_key_value_heads=kvn, input_layout="BNSD", scale=1 / math.sqrt(d),
                      softmax_lse_flag=True, actual_seq_lengths_kv=lens)
            if sq > 1:
                kw["actual_seq_lengths"] = [sq] * b
            if kind.startswith("int8"):
                k, v = rint8((b, kvn, s, d), g), rint8((b, kvn, s, d), g)
                if kind == "int8-chan":
                    kw.update(key_antiquant_scale=runif((1, kvn, 1, d), g, 0.004, 0.02, dt),
                              value_antiquant_scale=runif((1, kvn, 1, d), g, 0.004, 0.02, dt),
                              key_antiquant_mode=0, value_antiquant_mode=0)
                else:
                    kw.update(key_antiquant_scale=runif((1, b, s), g, 0.004, 0.02, F32),
                              value_antiquant_scale=runif((1, b, s), g, 0.004, 0.02, F32),
                              key_antiquant_mode=1, value_antiquant_mode=1)
            else:
                k, v = randn((b, kvn, s, d), g, dt), randn((b, kvn, s, d), g, dt)
            return lambda: [t.clone() for t in fia.npu_fused_infer_attention_score(q, k, v, **kw)]

        first = call(2, 4, 1, 301, [301, 167])           # odd key counts: tails, the spare weight
        other = call(3, 8, 2, 1030, [1030, 999, 513])    # more rows, longer keys: other scratch contents
        out1, lse1 = first()
        for _ in range(2):
            other()
        out2, lse2 = first()
        assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("seed", range(16))
def test_int8_random_combinations(seed, small_splits):
    """int8 K / V (the int16-operand kernels where the CPU has VNNI) combined at random with what the loop
    applies around them: GQA, Q_S up to 8, lengths (some 0), per-channel / per-token scales with or without
    offsets, user masks, pse_shift, layouts, paged storage. int8 has no NaN: positions past the lengths (and
    unused pool slots) hold the extremes 127 / -128, which a wrong read would show in the scores."""
    g = gen("i8combo", seed)
    r = torch.Generator().manual_seed(seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=r))]  # noqa: E731
    b, kvn, G, d = pick([1, 2, 3]), pick([1, 2]), pick([1, 2, 4, 8]), pick([64, 128])
    n, sq, s = kvn * G, pick([1, 1, 3, 8]), pick([20, 130, 600])
    lens = [int(x) for x in torch.randint(0, s + 1, (b,), generator=r)]
    lens[0] = s
    dt = pick([BF16, F16])
    layout = pick(["BNSD", "BSND", "BSH"]) if sq == 1 else "BNSD"
    q = randn((b, n, sq, d), g, dt)
    k, v = rint8((b, kvn, s, d), g), rint8((b, kvn, s, d), g)
    for bi, l in enumerate(lens):
        k[bi, :, l:], v[bi, :, l:] = 127, -128
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout=layout, scale=1 / math.sqrt(d),
              softmax_lse_flag=True, actual_seq_lengths_kv=lens)
    if sq > 1:
        kw["actual_seq_lengths"] = [sq] * b
    paged_kv = layout == "BNSD" and torch.rand(1, generator=r).item() < 0.4
    cap = s
    if paged_kv:
        bs = pick([32, 64, 128])
        table, kpool = paged(lens, bs, kvn, d, g, None, rint8)
        vpool = torch.full_like(kpool, -128)
        kpool.fill_(127)
        for bi, l in enumerate(lens):                 # the dense rows, placed in the table's blocks
            for p_ in range(l):
                kpool[table[bi, p_ // bs], :, p_ % bs] = k[bi, :, p_]
                vpool[table[bi, p_ // bs], :, p_ % bs] = v[bi, :, p_]
        kw.update(block_table=table, block_size=bs)
        cap = table.shape[1] * bs                     # per-token scales cover the table's positions
        args = (q, kpool, vpool)
    else:
        args = (to_layout(q, layout), to_layout(k, layout), to_layout(v, layout))
    mode = pick(["chan", "tok"])
    offsets = bool(torch.randint(2, (1,), generator=r))
    if mode == "chan":
        shp, sdt = (1, kvn, 1, d), dt
    else:
        shp, sdt = (1, b, cap), F32
    for which in ("key", "value"):
        kw[f"{which}_antiquant_scale"] = runif(shp, g, 0.002, 0.02, sdt)
        if offsets:
            kw[f"{which}_antiquant_offset"] = runif(shp, g, -4, 4, sdt)
        kw[f"{which}_antiquant_mode"] = 0 if mode == "chan" else 1
    if torch.rand(1, generator=r).item() < 0.4:
        m = torch.rand(b, sq, cap, generator=r) < 0.3
        kw["atten_mask"] = m[:, 0] if sq == 1 else m
    if torch.rand(1, generator=r).item() < 0.4:
        kw["pse_shift"] = randn((pick([1, b]), n, sq, cap), g, dt, std=2.0)
    compare(args, kw, mode="portable")


@pytest.mark.parametrize("order", ["high_first", "low_first"])
def test_int8_chunks_far_below_the_running_max(order, monkeypatch):
    """Chunks whose scores sit ~100 below the running maximum (pse_shift): their probabilities (~e^-100) are
    below what the fused int16 quantization takes (decode.kernels.softmax.softmax_chunk mode 2), so they go through
    quant_i16's float64 path; the chunk that raises the maximum later rescales what came before."""
    monkeypatch.setattr(DEC_PLAN, "CHUNK_FLOATS", 64 * 64)       # 64-key chunks at D = 64
    g = gen("i8far", order)
    b, n, kvn, s, d = 2, 8, 2, 400, 64
    q = randn((b, n, 1, d), g, BF16)
    k, v = rint8((b, kvn, s, d), g), rint8((b, kvn, s, d), g)
    pse = randn((1, n, 1, s), g, BF16)
    if order == "high_first":
        pse[..., 64:] -= 100
    else:
        pse[..., :300] -= 100
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=1 / math.sqrt(d),
              softmax_lse_flag=True, pse_shift=pse,
              key_antiquant_scale=runif((1, kvn, 1, d), g, 0.002, 0.02, BF16),
              value_antiquant_scale=runif((1, kvn, 1, d), g, 0.002, 0.02, BF16),
              key_antiquant_mode=0, value_antiquant_mode=0)
    compare((q, k, v), kw)


def test_int8_kv_float32_query_keeps_float32_accuracy():
    """A float32 query (portable mode) with int8 K / V: the float32 output is held to 1e-5 relative (tests/util.py),
    so the int16-operand kernels (cpu/vnni.py, ~7e-5) must not take it."""
    g = gen("i8f32")
    b, n, kvn, s, d = 2, 8, 2, 700, 128
    q = randn((b, n, 1, d), g, F32)
    k, v = rint8((b, kvn, s, d), g), rint8((b, kvn, s, d), g)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=1 / math.sqrt(d),
              softmax_lse_flag=True, key_antiquant_scale=runif((1, kvn, 1, d), g, 0.002, 0.02, F32),
              value_antiquant_scale=runif((1, kvn, 1, d), g, 0.002, 0.02, F32), key_antiquant_mode=0,
              value_antiquant_mode=0)
    od, ld = call(fia.npu_fused_infer_attention_score, (q, k, v), kw, "decode", "portable")
    orf, lr = call(fia.npu_fused_infer_attention_score, (q, k, v), kw, "reference", "portable")
    err = ((od.double() - orf.double()).abs().max() / orf.double().abs().max()).item()
    assert od.dtype == F32 and err <= 1e-5, err
    assert (ld - lr).abs().max().item() <= 1e-5


@pytest.mark.parametrize("where", ["query", "key_scale", "value_scale"])
def test_int8_nan_inf_propagate(where):
    """NaN / Inf reaching the int8 kernels' float operands (query, per-channel key scale folded into it,
    per-token value scale folded into the probabilities) propagate as in the reference: those rows /
    chunks are never quantized to int16 (docs/DECISIONS.md 24)."""
    g = gen("i8nan", where)
    b, n, kvn, s, d = 2, 8, 2, 300, 64
    q = randn((b, n, 1, d), g, BF16)
    k, v = rint8((b, kvn, s, d), g), rint8((b, kvn, s, d), g)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=1 / math.sqrt(d),
              softmax_lse_flag=True)
    if where == "value_scale":
        ks, vs = runif((1, b, s), g, 0.004, 0.02, F32), runif((1, b, s), g, 0.004, 0.02, F32)
        vs[0, 1, 17] = float("inf")
        kw.update(key_antiquant_mode=1, value_antiquant_mode=1)
    else:
        ks, vs = runif((1, kvn, 1, d), g, 0.004, 0.02, BF16), runif((1, kvn, 1, d), g, 0.004, 0.02, BF16)
        if where == "query":
            q[1, 3, 0, 5] = NAN
        else:
            ks[0, 1, 0, 7] = float("inf")
        kw.update(key_antiquant_mode=0, value_antiquant_mode=0)
    kw.update(key_antiquant_scale=ks, value_antiquant_scale=vs)
    od, ld = call(fia.npu_fused_infer_attention_score, (q, k, v), kw, "decode", "strict")
    orf, lr = call(fia.npu_fused_infer_attention_score, (q, k, v), kw, "reference", "strict")
    fin = torch.isfinite(orf)
    assert not fin.all() and torch.equal(torch.isfinite(od), fin)
    assert torch.equal(torch.isnan(od), torch.isnan(orf))
    assert torch.equal(od[torch.isinf(orf)], orf[torch.isinf(orf)])          # infinities with their signs
    assert torch.equal(torch.isnan(ld), torch.isnan(lr))
    err = (od[fin].double() - orf[fin].double()).abs().max().item() / orf[fin].double().abs().max().item()
    assert err <= OUT_TOL[BF16]


@pytest.mark.parametrize("chunk", [8 * 64, 8192, 32768])
@pytest.mark.parametrize("lens", [[1000, 37, 1, 0], [513], [64, 65, 127]])
def test_split_kv_merge(small_splits, monkeypatch, lens, chunk):
    """Lengths that do not divide the split / chunk length; partials merged through their LSEs."""
    monkeypatch.setattr(DEC_PLAN, "CHUNK_FLOATS", chunk)
    g = gen("split", tuple(lens), chunk)
    b, n, kvn, d = len(lens), 8, 2, 64
    s = max(lens)
    q = randn((b, n, 1, d), g, BF16, std=2.0)
    k, v = poison_kv(randn((b, kvn, s, d), g, BF16), lens), poison_kv(randn((b, kvn, s, d), g, BF16), lens)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=0.2, softmax_lse_flag=True,
              actual_seq_lengths_kv=lens)
    compare((q, k, v), kw)


# ---------------------------------------------------------------------------------------------- paged
@pytest.mark.parametrize("fmt", ["3d", "4d"])
@pytest.mark.parametrize("bs,lens", [(16, [40, 1, 16, 0]), (32, [100, 64]), (128, [300, 129])])
@pytest.mark.parametrize("G", [1, 4])
def test_paged_in_place(fmt, bs, lens, G, small_splits):
    g = gen("paged", fmt, bs, tuple(lens), G)
    b, kvn, d = len(lens), 2, 64
    n = G * kvn
    table, kpool = paged(lens, bs, kvn, d, g, F16, None)
    _, vpool = paged(lens, bs, kvn, d, g, F16, None)
    vpool = randn(vpool.shape, g, F16).masked_fill(torch.isnan(kpool), NAN)
    q = randn((b, n, 1, d), g, F16)
    kws = table.shape[1] * bs
    mask = torch.rand(b, kws, generator=g) < 0.2
    pse = randn((1, n, 1, kws), g, F16)
    layout = "BNSD" if fmt == "4d" else "BSH"
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout=layout, scale=0.125, softmax_lse_flag=True,
              actual_seq_lengths_kv=lens, block_table=table, block_size=bs, atten_mask=mask, pse_shift=pse)
    compare((to_layout(q, layout), as_cache(kpool, fmt), as_cache(vpool, fmt)), kw, mode="strict",
            no_gather=True)


@pytest.mark.parametrize("case,want", [("BSH", 3), ("BSND", 3), ("BNSD", 1), ("paged-3d", 3), ("paged-4d", 1),
                                       ("wider-row", 3), ("gaps", 1), ("one-head", 1)])
def test_heads_per_item_follows_the_layout(case, want, small_splits):
    """An item covers every KV head (decode.kernels.params.IP_HB; fia.explain says "N KV heads per item") exactly when
    a token's rows of all heads lie side by side in key and value: BSH / BSND, the paged [blocks, bs, H] cache,
    a token row wider than the heads (key and value views of one [B, S, 2 H] buffer); head by head otherwise
    (BNSD, paged [blocks, H, bs, D], rows with gaps between the heads, one KV head). Results agree either way."""
    g = gen("hb", case)
    b, kvn, s, d, G = 2, 3, 40, 32, 2
    lens = [40, 17]
    if case == "one-head":
        kvn = 1
    n = G * kvn
    q = randn((b, n, 1, d), g, BF16)
    k, v = poison_kv(randn((b, kvn, s, d), g, BF16), lens), poison_kv(randn((b, kvn, s, d), g, BF16), lens)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BSH", scale=0.2, softmax_lse_flag=True,
              actual_seq_lengths_kv=lens)
    if case in ("BNSD", "BSND"):
        kw["input_layout"] = case
        args = (to_layout(q, case), to_layout(k, case), to_layout(v, case))
    elif case.startswith("paged"):
        fmt = case[-2:]
        table, kpool = paged(lens, 16, kvn, d, g, BF16, None)
        vpool = randn(tuple(kpool.shape), g, BF16).masked_fill(kpool.isnan(), NAN)     # (the same table)
        kw.update(block_table=table, block_size=16, input_layout="BSH" if fmt == "3d" else "BNSD")
        args = (to_layout(q, kw["input_layout"]), as_cache(kpool, fmt), as_cache(vpool, fmt))
    elif case == "wider-row":                                  # [B, S, 2 H]: key | value per token
        kv = torch.cat([to_layout(k, "BSH"), to_layout(v, "BSH")], dim=-1)
        args = (to_layout(q, "BSH"), kv[..., :kvn * d], kv[..., kvn * d:])
    elif case == "gaps":                                       # [B, S, H, 2 D]: each head's row, then a gap
        kw["input_layout"] = "BSND"
        pad = torch.full((b, s, kvn, d), NAN, dtype=BF16)
        kg = torch.cat([to_layout(k, "BSND"), pad], dim=-1)[..., :d]
        vg = torch.cat([to_layout(v, "BSND"), pad], dim=-1)[..., :d]
        args = (to_layout(q, "BSND"), kg, vg)
    else:
        args = (to_layout(q, "BSH"), to_layout(k, "BSH"), to_layout(v, "BSH"))
    out, _ = compare(args, kw, no_gather=case.startswith("paged"))
    assert torch.isfinite(out).all()                           # (padding is poisoned; no valid key is)
    with fia.validation_mode("portable"), fia.use_backend("decode"):
        text = str(fia.explain(*args, **kw))
    assert (f"{want} KV heads per item" in text) == (want > 1), text
    if want > 1:
        assert "KV heads per item" in text


def test_paged_shared_blocks_and_int64_table(small_splits):
    """Blocks shared between batches (a real pool), int64 table (portable)."""
    g = gen("paged-shared")
    b, n, kvn, d, bs = 3, 4, 2, 32, 16
    lens = [48, 40, 33]
    nb = 6
    table = torch.tensor([[0, 1, 2], [0, 1, 3], [0, 1, 4]], dtype=torch.int64)
    kpool, vpool = randn((nb, kvn, bs, d), g, BF16), randn((nb, kvn, bs, d), g, BF16)
    q = randn((b, n, 1, d), g, BF16)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=0.2, softmax_lse_flag=True,
              actual_seq_lengths_kv=lens, block_table=table, block_size=bs)
    compare((q, kpool, vpool), kw, no_gather=True)


# ---------------------------------------------------------------------------------------------- antiquant
ANTIQUANT = [
    # (name, int4, key_mode, value_mode, kind, offsets)
    ("comb-tensor", False, None, None, "tensor", True),
    ("comb-channel", False, None, None, "channel", True),
    ("comb-token", False, None, None, "token", True),
    ("sep0-channel", False, 0, 0, "channel", True),
    ("sep0-tensor", False, 0, 0, "tensor", False),
    ("sep1-token", False, 1, 1, "token", True),
    ("sep2-head", False, 2, 2, "head", True),
    ("sep3-token-head", False, 3, 3, "token_head", True),
    ("sep3-token-head-b1", False, 3, 3, "token_head1", False),
    ("sep0+1", False, 0, 1, "mixed", True),
    ("int4-sep0", True, 0, 0, "channel", True),
    ("int4-sep1", True, 1, 1, "token", False),
    ("int4-sep3", True, 3, 3, "token_head", True),
    ("int4-sep0+1", True, 0, 1, "mixed", True),
]


def _scales(kind, which, g, b, kvn, s, d, lens, mode, dtype):
    """(scale, offset-or-None factory) for one of key/value with the given granularity."""
    if kind == "mixed":
        kind = "channel" if which == "key" else "token"
    if kind == "tensor":
        shape, dt = (1,), dtype
    elif kind == "channel":
        shape, dt = (1, kvn, 1, d), dtype
    elif kind == "head":
        shape, dt = (kvn,), dtype
    elif kind == "token":
        shape, dt = (1, b, s), F32
    elif kind == "token_head":
        shape, dt = (b, kvn, s), F32
    elif kind == "token_head1":
        shape, dt = (1, kvn, s), F32
    sc = runif(shape, g, 0.004, 0.02, dt)
    off = runif(shape, g, -3.0, 3.0, dt)
    if kind in ("token", "token_head"):          # positions past a batch's length: NaN (never read)
        for i, l in enumerate(lens):
            if kind == "token":
                sc[0, i, l:] = NAN
                off[0, i, l:] = NAN
            else:
                sc[i, :, l:] = NAN
                off[i, :, l:] = NAN
    return sc, off


@pytest.mark.parametrize("name,int4,km,vm,kind,offsets", ANTIQUANT, ids=[a[0] for a in ANTIQUANT])
@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
def test_antiquant_modes(name, int4, km, vm, kind, offsets, G, layout, small_splits):
    """Every dequantization form; BSH: items of all KV heads (decode.kernels.params.IP_HB), each head's factors."""
    g = gen("aq", name, G) if layout == "BNSD" else gen("aq", name, G, layout)
    b, kvn, s, d = 2, 2 if layout == "BNSD" else 3, 70, 64
    n = G * kvn
    lens = [70, 23]
    dtype = F16
    q = randn((b, n, 1, d), g, dtype)
    if int4:
        k, v = rint4((b, kvn, s, d // 8), g), rint4((b, kvn, s, d // 8), g)
    else:
        k, v = rint8((b, kvn, s, d), g), rint8((b, kvn, s, d), g)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=0.125, softmax_lse_flag=True,
              actual_seq_lengths_kv=lens)
    if km is None:                                   # combined parameters: index 0 key, 1 value
        ks, ko = _scales(kind, "key", g, b, kvn, s, d, lens, 0, dtype)
        vs, vo = _scales(kind, "value", g, b, kvn, s, d, lens, 0, dtype)
        kw.update(antiquant_scale=torch.stack([ks, vs]), antiquant_mode=1 if kind == "token" else 0)
        if offsets:
            kw["antiquant_offset"] = torch.stack([ko, vo])
    else:
        ks, ko = _scales(kind, "key", g, b, kvn, s, d, lens, km, dtype)
        vs, vo = _scales(kind, "value", g, b, kvn, s, d, lens, vm, dtype)
        kw.update(key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_mode=km, value_antiquant_mode=vm)
        if offsets:
            kw.update(key_antiquant_offset=ko, value_antiquant_offset=vo)
    kw["input_layout"] = layout
    compare((to_layout(q, layout), to_layout(k, layout), to_layout(v, layout)), kw)


@pytest.mark.parametrize("mode", [4, 5])
@pytest.mark.parametrize("offsets", [False, True])
def test_antiquant_paged_block_modes(mode, offsets, small_splits):
    """Modes 4/5: per-token scales stored by paged block, (blocknum, block_size) / (blocknum, KV_N, bs)."""
    g = gen("aq-paged", mode, offsets)
    b, n, kvn, d, bs = 3, 8, 2, 64, 32
    lens = [100, 5, 64]
    table, kpool = paged(lens, bs, kvn, d, g, None, rint8)
    _, vpool = paged(lens, bs, kvn, d, g, None, rint8)
    nb = kpool.shape[0]
    shape = (nb, bs) if mode == 4 else (nb, kvn, bs)
    ks, vs = runif(shape, g, 0.004, 0.02), runif(shape, g, 0.004, 0.02)
    q = randn((b, n, 1, d), g, F16)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=0.125, softmax_lse_flag=True,
              actual_seq_lengths_kv=lens, block_table=table, block_size=bs, key_antiquant_scale=ks,
              value_antiquant_scale=vs, key_antiquant_mode=mode, value_antiquant_mode=mode)
    if offsets:
        kw.update(key_antiquant_offset=runif(shape, g, -2, 2), value_antiquant_offset=runif(shape, g, -2, 2))
    compare((q, kpool, vpool), kw, no_gather=True)


def test_antiquant_paged_per_token_logical(small_splits):
    """Mode 1 with paged KV: per-token scales indexed by the logical position (max_blocks x block_size)."""
    g = gen("aq-paged-tok")
    b, n, kvn, d, bs = 2, 4, 2, 64, 32
    lens = [90, 33]
    table, kpool = paged(lens, bs, kvn, d, g, None, rint8)
    _, vpool = paged(lens, bs, kvn, d, g, None, rint8)
    cover = table.shape[1] * bs
    ks, vs = runif((1, b, cover), g, 0.004, 0.02), runif((1, b, cover), g, 0.004, 0.02)
    q = randn((b, n, 1, d), g, F16)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BSH", scale=0.125, softmax_lse_flag=True,
              actual_seq_lengths_kv=lens, block_table=table, block_size=bs, key_antiquant_scale=ks,
              value_antiquant_scale=vs, key_antiquant_mode=1, value_antiquant_mode=1)
    compare((q.permute(0, 2, 1, 3).reshape(b, 1, n * d), as_cache(kpool, "3d"), as_cache(vpool, "3d")), kw,
            no_gather=True)


# ---------------------------------------------------------------------------------------------- masks, pse
@pytest.mark.parametrize("shape", ["2d", "3d", "4d"])
@pytest.mark.parametrize("mdt", [torch.bool, torch.int8, torch.uint8])
def test_decode_masks(shape, mdt):
    """Decode masks (B, KV_S) / (B, 1, KV_S) / (B, 1, 1, KV_S), larger than needed; one fully masked
    row (softmax uniform over the valid keys: mean of V, lse -1e12 + log n)."""
    g = gen("mask", shape, mdt)
    b, n, kvn, s, d = 3, 8, 2, 40, 32
    lens = [40, 7, 19]
    q = randn((b, n, 1, d), g, BF16)
    k, v = poison_kv(randn((b, kvn, s, d), g, BF16), lens), poison_kv(randn((b, kvn, s, d), g, BF16), lens)
    m = torch.rand(b, s + 5, generator=g) < 0.3
    m[1] = True
    m = m.to(mdt)
    m = {"2d": m, "3d": m[:, None], "4d": m[:, None, None]}[shape]
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=0.17, softmax_lse_flag=True,
              actual_seq_lengths_kv=lens, atten_mask=m)
    compare((q, k, v), kw, mode="strict")


@pytest.mark.parametrize("sparse,pre,nxt", [(0, 3, 1), (0, 100, -2), (1, None, None), (2, None, None),
                                            (3, None, None), (4, 5, 2)])
@pytest.mark.parametrize("ip", [0, 2])
@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
def test_multi_token_masks(sparse, pre, nxt, ip, layout, small_splits):
    """Q_S in 2..16: band geometry (window-local), user masks (physical), dead rows and row-invalid
    correction (inner_precise bit 1), query lengths; BSH: items of both KV heads (decode.kernels.params.IP_HB)."""
    g = gen("mt", sparse, pre, nxt, ip) if layout == "BNSD" else gen("mt", sparse, pre, nxt, ip, layout)
    b, n, kvn, sq, s, d = 3, 4, 2, 7, 50, 64
    act_q, lens = [7, 3, 5], [50, 20, 4]
    q = randn((b, n, sq, d), g, BF16)
    k, v = poison_kv(randn((b, kvn, s, d), g, BF16), lens), poison_kv(randn((b, kvn, s, d), g, BF16), lens)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout=layout, scale=0.125, softmax_lse_flag=True,
              actual_seq_lengths=act_q, actual_seq_lengths_kv=lens, sparse_mode=sparse, inner_precise=ip)
    if sparse in (0, 1):
        m = torch.rand(b, sq, s, generator=g) < 0.3
        m[0, 2] = True                                 # a fully user-masked row
        kw["atten_mask"] = m
    else:
        kw["atten_mask"] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    if pre is not None:
        kw.update(pre_tokens=pre, next_tokens=nxt)
    compare((to_layout(q, layout), to_layout(k, layout), to_layout(v, layout)), kw)


@pytest.mark.parametrize("pdt", [F16, BF16])
@pytest.mark.parametrize("bp", [1, 3])
@pytest.mark.parametrize("sq", [1, 5])
def test_pse(pdt, bp, sq, small_splits):
    g = gen("pse", pdt, bp, sq)
    b, n, kvn, s, d = 3, 8, 2, 45, 32
    lens = [45, 30, 1]
    q = randn((b, n, sq, d), g, pdt)
    k, v = poison_kv(randn((b, kvn, s, d), g, pdt), lens), poison_kv(randn((b, kvn, s, d), g, pdt), lens)
    pse = randn((bp, n, sq + 2, s + 3), g, pdt, std=3.0)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BSND", scale=0.125, softmax_lse_flag=True,
              actual_seq_lengths_kv=lens, pse_shift=pse)
    compare((to_layout(q, "BSND"), to_layout(k, "BSND"), to_layout(v, "BSND")), kw, mode="strict")


# ---------------------------------------------------------------------------------------------- sequences
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("with_mask", [False, True])
def test_left_padding(sq, with_mask, small_splits):
    """kv_padding_size / query_padding_size with lengths: windows [S - pad - act, S - pad); masks and
    pse indexed physically; a window starting below 0 gives zeros."""
    g = gen("lp", sq, with_mask)
    b, n, kvn, s, d = 3, 4, 2, 30, 32
    act_kv, pad = [20, 5, 29], 3
    q = randn((b, n, sq, d), g, F16)
    k, v = randn((b, kvn, s, d), g, F16), randn((b, kvn, s, d), g, F16)
    for i, a in enumerate(act_kv):                   # poison outside each valid window
        lo = s - pad - a
        if lo >= 0:
            k[i, :, :lo] = NAN
            v[i, :, :lo] = NAN
        k[i, :, s - pad:] = NAN
        v[i, :, s - pad:] = NAN
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=0.17, softmax_lse_flag=True,
              actual_seq_lengths_kv=act_kv, kv_padding_size=torch.tensor([pad]))
    if sq > 1:
        kw.update(actual_seq_lengths=[4, 2, 3], query_padding_size=torch.tensor([0]))
    if with_mask:
        m = torch.rand(b, sq, s, generator=g) < 0.25
        kw["atten_mask"] = m[:, 0] if sq == 1 else m
    compare((q, k, v), kw)


@pytest.mark.parametrize("plen", [None, 0, 5])
@pytest.mark.parametrize("b,G", [(2, 4), (12, 8)])
@pytest.mark.parametrize("extra", ["none", "mask", "pse", "int8"])
@pytest.mark.parametrize("layout", ["BNSD", "BSND"])
def test_shared_prefix(plen, b, G, extra, layout, small_splits):
    """Prefix keys first (read once per group of batches), then each batch's own keys; masks and pse
    count prefix columns first. b=12, G=8: more rows than one prefix group holds. BSND: items of both KV
    heads, own keys and prefix (decode.kernels.params.IP_HB)."""
    g = gen("prefix", plen, b, G, extra) if layout == "BNSD" else gen("prefix", plen, b, G, extra, layout)
    kvn, s, ps, d = 2, 24, 9, 64
    n = G * kvn
    lens = [(7 * i + 3) % (s + 1) for i in range(b)]
    lens[0] = 0                                       # a batch with prefix keys only
    q = randn((b, n, 1, d), g, F16)
    if extra == "int8":
        k, v = rint8((b, kvn, s, d), g), rint8((b, kvn, s, d), g)
        kp, vp = rint8((1, kvn, ps, d), g), rint8((1, kvn, ps, d), g)
    else:
        k, v = poison_kv(randn((b, kvn, s, d), g, F16), lens), poison_kv(randn((b, kvn, s, d), g, F16), lens)
        kp, vp = randn((1, kvn, ps, d), g, F16), randn((1, kvn, ps, d), g, F16)
    eff = ps if plen is None else plen
    if eff < ps and extra != "int8":
        kp[:, :, eff:] = NAN
        vp[:, :, eff:] = NAN
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout=layout, scale=0.125, softmax_lse_flag=True,
              actual_seq_lengths_kv=lens, key_shared_prefix=to_layout(kp, layout),
              value_shared_prefix=to_layout(vp, layout))
    if plen is not None:
        kw["actual_shared_prefix_len"] = [plen]
    if extra == "mask":
        kw["atten_mask"] = torch.rand(b, ps + s, generator=g) < 0.3
    elif extra == "pse":
        kw["pse_shift"] = randn((b, n, 1, ps + s), g, F16, std=2.0)
    elif extra == "int8":
        kw.update(key_antiquant_scale=runif((1, kvn, 1, d), g, 0.004, 0.02, F16),
                  value_antiquant_scale=runif((1, kvn, 1, d), g, 0.004, 0.02, F16),
                  key_antiquant_offset=runif((1, kvn, 1, d), g, -2, 2, F16),
                  value_antiquant_offset=runif((1, kvn, 1, d), g, -2, 2, F16))
    compare((to_layout(q, layout), to_layout(k, layout), to_layout(v, layout)), kw)


@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
def test_tensor_list(layout, small_splits):
    """One K / V tensor per batch; BSH: items of both KV heads (decode.kernels.params.IP_HB) in each source."""
    g = gen("list") if layout == "BNSD" else gen("list", layout)
    b, n, kvn, d = 3, 8, 2, 32
    lens = [17, 40, 3]
    q = randn((b, n, 1, d), g, BF16)
    ks = [to_layout(randn((1, kvn, l, d), g, BF16), layout) for l in lens]
    vs = [to_layout(randn((1, kvn, l, d), g, BF16), layout) for l in lens]
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout=layout, scale=0.17, softmax_lse_flag=True,
              actual_seq_lengths_kv=[17, 33, 0])
    compare((to_layout(q, layout), ks, vs), kw)


@pytest.mark.parametrize("paged_kv", [False, True])
@pytest.mark.parametrize("rows", [[1, 1, 1], [3, 1, 16]])
def test_tnd(paged_kv, rows, small_splits):
    """TND: decode when every batch has one row; up to 16 rows per batch otherwise (sparse 3)."""
    g = gen("tnd", paged_kv, tuple(rows))
    n, kvn, d = 4, 2, 64
    kv_lens = [30, 70, 17]
    t = sum(rows)
    q = randn((t, n, d), g, BF16)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="TND", scale=0.125, softmax_lse_flag=True,
              actual_seq_lengths=[sum(rows[:i + 1]) for i in range(3)])
    if any(r > 1 for r in rows):
        kw.update(sparse_mode=3, atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1))
    if paged_kv:
        bs = 16
        table, kpool = paged(kv_lens, bs, kvn, d, g, BF16, None)
        vpool = randn(kpool.shape, g, BF16).masked_fill(torch.isnan(kpool), NAN)
        kw.update(block_table=table, block_size=bs, actual_seq_lengths_kv=kv_lens)
        args = (q, as_cache(kpool, "3d"), as_cache(vpool, "3d"))
    else:
        tk = sum(kv_lens)
        args = (q, randn((tk, kvn, d), g, BF16), randn((tk, kvn, d), g, BF16))
        kw["actual_seq_lengths_kv"] = [sum(kv_lens[:i + 1]) for i in range(3)]
    compare(args, kw, no_gather=paged_kv)


@pytest.mark.parametrize("paged_kv", [False, True])
def test_mla_rope(paged_kv, small_splits):
    """MLA: scores add Q_rope . K_rope (rope dim 64); values from `value` alone."""
    g = gen("mla", paged_kv)
    b, n, kvn, d, dr = 2, 16, 1, 128, 64
    lens = [50, 129]
    q, qr = randn((b, n, 1, d), g, BF16), randn((b, n, 1, dr), g, BF16)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=0.07, softmax_lse_flag=True,
              actual_seq_lengths_kv=lens)
    if paged_kv:
        bs = 64
        table, kpool = paged(lens, bs, kvn, d, g, BF16, None)
        krpool = randn((kpool.shape[0], kvn, bs, dr), g, BF16)
        kw.update(block_table=table, block_size=bs, query_rope=qr, key_rope=krpool)
        args = (q, kpool, kpool)
    else:
        s = max(lens)
        k = poison_kv(randn((b, kvn, s, d), g, BF16), lens)
        kw.update(query_rope=qr, key_rope=randn((b, kvn, s, dr), g, BF16))
        args = (q, k, k)
    compare(args, kw, no_gather=paged_kv)


@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_learnable_sink(sq, masked, small_splits):
    g = gen("sink", sq, masked)
    b, n, kvn, s, d = 3, 8, 2, 33, 32
    lens = [33, 0, 12]
    q = randn((b, n, sq, d), g, F16)
    k, v = poison_kv(randn((b, kvn, s, d), g, F16), lens), poison_kv(randn((b, kvn, s, d), g, F16), lens)
    kw = dict(num_query_heads=n, num_key_value_heads=kvn, input_layout="BNSD", softmax_scale=0.2,
              learnable_sink=randn((n,), g, F32, std=2.0), return_softmax_lse=True, actual_seq_kvlen=lens)
    if masked:
        m = torch.rand(b, sq, s, generator=g) < 0.4
        m[0, 0] = True
        kw.update(atten_mask=m if sq > 1 else m[:, 0], sparse_mode=1 if sq > 1 else 0)
    compare((q, k, v), kw, api=fia.npu_fused_infer_attention_score_v2)


def test_query_dequant_int8_query(small_splits):
    """int8 query with dequant_scale_query (query_quant_mode 3) and float K/V."""
    g = gen("qdq")
    b, n, kvn, s, d = 2, 4, 2, 30, 64
    q8 = rint8((b, n, 1, d), g)
    k, v = randn((b, kvn, s, d), g, F16), randn((b, kvn, s, d), g, F16)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=0.125, softmax_lse_flag=True,
              dequant_scale_query=runif((b, n, 1), g, 0.002, 0.02), query_quant_mode=3,
              actual_seq_lengths_kv=[30, 11])
    compare((q8, k, v), kw)


def test_query_dequant_int8_query_with_rope(small_splits):
    """MLA with an int8 query: dequant_scale_query scales the int8 query only, never the float16 query_rope
    (regression: the kernel multiplied the rope columns by the query scale too; found by test_fuzz_random)."""
    g = gen("qdq-rope")
    b, n, s, d, dr = 2, 4, 24, 64, 64
    q8 = rint8((b, n, 1, d), g)
    k = randn((b, 1, s, d), g, F16)
    kw = dict(num_heads=n, num_key_value_heads=1, input_layout="BNSD", scale=0.1, softmax_lse_flag=True,
              query_rope=randn((b, n, 1, dr), g, F16), key_rope=randn((b, 1, s, dr), g, F16),
              dequant_scale_query=runif((b, n, 1), g, 0.002, 0.02), query_quant_mode=3,
              actual_seq_lengths_kv=[24, 9])
    compare((q8, k, k), kw)


@pytest.mark.parametrize("per_channel", [False, True])
def test_output_quant(per_channel):
    g = gen("oq", per_channel)
    b, n, kvn, s, d = 2, 4, 2, 30, 32
    q, k, v = randn((b, n, 1, d), g, BF16), randn((b, kvn, s, d), g, BF16), randn((b, kvn, s, d), g, BF16)
    shape = (1, n, 1, d) if per_channel else (1,)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=0.17,
              quant_scale2=runif(shape, g, 50, 150), quant_offset2=runif(shape, g, -3, 3),
              actual_seq_lengths_kv=[30, 0])
    compare((q, k, v), kw)


def test_float32_portable(small_splits):
    g = gen("f32")
    b, n, kvn, s, d = 2, 6, 3, 20, 24
    q, k, v = randn((b, n, 1, d), g, F32), randn((b, kvn, s, d), g, F32), randn((b, kvn, s, d), g, F32)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=0.2, softmax_lse_flag=True,
              actual_seq_lengths_kv=[20, 9])
    compare((q, k, v), kw)


@pytest.fixture
def short_chunks(monkeypatch):
    """Split-KV on small problems into items of several short chunks (32 keys), on the thread pool."""
    monkeypatch.setattr(DEC_PLAN, "MIN_SPLIT", 8)
    monkeypatch.setattr(DEC_PLAN, "ITEMS_PER_THREAD", 2)
    monkeypatch.setattr(DEC_PLAN, "PARALLEL_MIN_WORK", 0)
    monkeypatch.setattr(DEC_PLAN, "CHUNK_FLOATS", 32 * 128)


@pytest.mark.parametrize("d", [64, 128, 48, 40])
@pytest.mark.parametrize("G,sq", [(1, 1), (4, 1), (8, 2), (4, 4)])
@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH"])
def test_float32_kv(d, G, sq, layout, short_chunks):
    """float32 query, K and V (portable mode): the cpu/fma.py kernels on float32 rows where the head dim is a
    multiple of 16 (kernels.DP_F32; the suite's DP_FLAGS variants without it and d = 40 run the generic loops),
    with lengths (one batch without keys), GQA, Q_S 1-4 with a user mask (a fully masked row) and query lengths,
    the lse, items of several chunks; BSND / BSH: items of both KV heads (decode.kernels.params.IP_HB), without the touch
    pass for float32 rows (DP_F32)."""
    g = gen("f32kv", d, G, sq, layout)
    b, kvn, s = 3, 2, 300
    n = G * kvn
    lens = [300, 123, 0]
    q = randn((b, n, sq, d), g, F32)
    k, v = poison_kv(randn((b, kvn, s, d), g, F32), lens), poison_kv(randn((b, kvn, s, d), g, F32), lens)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout=layout, scale=1 / math.sqrt(d),
              softmax_lse_flag=True, actual_seq_lengths_kv=lens)
    if sq > 1:
        m = torch.rand(b, sq, s, generator=g) < 0.3
        m[0, 1] = True
        kw.update(atten_mask=m, actual_seq_lengths=[sq, sq - 1, sq])
    compare((to_layout(q, layout), to_layout(k, layout), to_layout(v, layout)), kw)


@pytest.mark.parametrize("G", [1, 4])
def test_float32_kv_paged(G, short_chunks):
    """float32 K / V in a shuffled paged pool read in place (unused slots NaN), with a bool mask and the lse."""
    g = gen("f32paged", G)
    lens, bs, kvn, d = [300, 129, 1], 128, 2, 128
    b, n = len(lens), G * kvn
    table, kpool = paged(lens, bs, kvn, d, g, F32, None)
    vpool = randn(kpool.shape, g, F32).masked_fill(torch.isnan(kpool), NAN)
    q = randn((b, n, 1, d), g, F32)
    mask = torch.rand(b, table.shape[1] * bs, generator=g) < 0.2
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BNSD", scale=0.09, softmax_lse_flag=True,
              actual_seq_lengths_kv=lens, block_table=table, block_size=bs, atten_mask=mask)
    compare((q, kpool, vpool), kw, no_gather=True)


def test_nan_propagates():
    """NaN inside the valid keys is not an error: it propagates like the reference (SPEC 14)."""
    g = gen("nanprop")
    q, k, v = randn((1, 4, 1, 32), g), randn((1, 2, 10, 32), g), randn((1, 2, 10, 32), g)
    k[0, 0, 3, 5] = NAN
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD", scale=0.2, softmax_lse_flag=True)
    od, ld = call(fia.npu_fused_infer_attention_score, (q, k, v), kw, "decode", "strict")
    orf, lr = call(fia.npu_fused_infer_attention_score, (q, k, v), kw, "reference", "strict")
    assert torch.equal(torch.isnan(od), torch.isnan(orf)) and torch.isnan(od[0, :2]).all()
    assert torch.equal(torch.isnan(ld), torch.isnan(lr))


# ---------------------------------------------------------------------------------------------- dispatch
def _problem(q, k, v):
    from fia import parse
    args = dict(query=q, key=k, value=v)
    import inspect
    sig = inspect.signature(fia.eager.npu_fused_infer_attention_score)
    for name, prm in sig.parameters.items():
        if name not in args:
            args[name] = prm.default
    args.update(num_heads=q.shape[1], num_key_value_heads=k.shape[1], input_layout="BNSD")
    return parse.parse_fused(args)


def test_declared_limits():
    """What the backend does not run is declared, and dispatch falls back to another backend."""
    g = gen("limits")
    be = registry.by_name("decode")
    q, k, v = randn((1, 2, 17, 32), g), randn((1, 2, 20, 32), g), randn((1, 2, 20, 32), g)
    with fia.use_backend("decode"), pytest.raises(fia.FiaUnsupportedError, match="Q_S = 17"):
        fia.npu_fused_infer_attention_score(q, k, v, num_heads=2, input_layout="BNSD")
    with fia.use_backend(None):                                         # automatic choice: falls back
        out, _ = fia.npu_fused_infer_attention_score(q, k, v, num_heads=2, input_layout="BNSD")
    assert out.shape == q.shape
    assert any(be.not_supported_reasons(p) for p in [_problem(q, k, v)])
    with fia.validation_mode("portable"):
        q64 = randn((1, 2, 1, 32), g, torch.float64)
        with fia.use_backend("decode"), pytest.raises(fia.FiaUnsupportedError, match="float64"):
            fia.npu_fused_infer_attention_score(q64, q64, q64, num_heads=2, input_layout="BNSD")
    assert be.devices == ("cpu",)
    # many query rows per KV head with Q_S > 1 (G * Q_S > DEC.PREFILL_ROWS = 128): dispatch prefers the
    # prefill backend, but decode still runs them when forced (a preference, not a limit); 64 rows: decode
    q16 = randn((1, 32, 16, 32), g)
    p16 = _problem(q16, k, v)
    assert not be.not_supported_reasons(p16) and be.preference(p16) < be.priority
    assert be.preference(_problem(randn((1, 8, 16, 32), g), k, v)) == be.priority
    if any(b.name == "prefill" for b in registry.backends()):
        with fia.use_backend(None):
            assert registry.select(p16).name == "prefill"
    kw = dict(num_heads=32, num_key_value_heads=2, input_layout="BNSD", softmax_lse_flag=True)
    with fia.use_backend("decode"):
        out_d, lse_d = fia.npu_fused_infer_attention_score(q16, k, v, **kw)
    with fia.use_backend("reference"):
        out_r, lse_r = fia.npu_fused_infer_attention_score(q16, k, v, **kw)
    assert (out_d.float() - out_r.float()).abs().max() < 2e-2 and (lse_d - lse_r).abs().max() < 1e-3
