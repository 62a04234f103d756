"""Numba kernels of the decode backend (see backend.py for the plan that feeds them).

CPU only. Everything accumulates in float32. Half-precision data is read in place as uint16 bit
patterns (numba has no float16): bf16 -> f32 is `bits << 16`; fp16 -> f32 is the bit-level widening
below (subnormals, inf and nan included). int8 is widened, int4 (eight nibbles per int32, low nibble
first, SPEC 10.4) is unpacked per row. Nothing is converted or copied ahead of the loop.

Which inner loops run QK and PV (chosen per item, see `_items`):
* bf16 K / V on CPUs with AVX512-BF16: cpu.simd.qk_dp / pv_dp (bf16 dot products, LLVM IR);
* other bf16 / fp16 / int8 K / V and float32 ones (DP_F32) with head dims that are multiples of 16:
  cpu.fma.qk_fma / pv_fma (widened in registers, or loaded as they are, float32 FMAs, LLVM IR). Both read rows
  front to back and prefetch the other stream (docs/performance.md, "Micro-kernels in LLVM IR");
* the rest (int4, MLA rope, other head dims; the "generic" build): the numba loops below, which
  widen each row into a small float32 chunk buffer (load_rows + qk_block / pv_block) or straight from the
  cache (qk_fused / pv_fused).

Work item = (work entry w, KV head h): query group i = work_i[w] (one batch, or a group of batches
for the shared prefix), its R = G * Q_S rows of KV head h, keys at positions [work_lo[w], work_hi[w])
of one KV source. The item streams its keys in chunks of C: K chunk -> scores [R, C] -> online
softmax -> V chunk -> acc [R, Dv]; it writes an unnormalized partial (acc, running max m, sum l).
`merge` combines the partials of every row through their LSEs (split-KV, shared prefix, sink).

Dequantization is folded out of the inner loops (SPEC 10: x = (x_q + offset) * scale):
* per-channel / per-tensor / per-head key: q~ = q * scale_k and qadd = q~ . offset_k are prepared by
  the caller, so the loop computes q~ . k_q + qadd;
* per-token key: s = (q . k_q + offset_j * sum(q)) * scale_j;
* per-token value: weights p_j * scale_j, plus p_j * scale_j * offset_j added to every channel;
* per-channel value: applied once per row in `merge`: out = scale_v * (acc + offset_v * sum p) / L.

Integer parameters travel in one int64 array `ip` (indices below) to keep the call overhead low.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ...cpu.amx import HAS_AMX, PV_MAX_DV, QK_MAX_CHUNKS, QK_MAX_ROWS, pv_amx, qk_amx
from ...cpu.fma import F16C, KIND_BF16_EO, NARROW, pv_fma, qk_fma
from ...cpu.fp4 import fp4_group_bf16
from ...cpu import kernel_cache
from ...cpu.simd import (HAS_DP, KIND_BF16, KIND_F32, KIND_FP16, KIND_I4, KIND_I8, PF_AHEAD, PF_NTA, exp_rows,
    max_f32, pv_dp, qk_dp, target_has)
from ...cpu.vnni import HAS_VNNI, I8_DOT, QK_MAX_D, pv_i8, qk_i8  # noqa: F401 - I8_DOT for fia.explain

# FP4 K / V rows decoded to bf16 at a time before the dp kernels run on them: 64 rows of D = 128 (16 KB) stay in L1
FP4_SUB = 64
# FP4 E2M1 K / V (antiquant mode 6, SPEC 10b.1): two values a byte, low nibble first, decoded per row by fp4_rows
# with their per-token-group FLOAT8_E8M0 scales (which travel in the per-token slots: IP_KT_* / BUF_KTS, IP_VT_* /
# BUF_VTS, one byte per 32 channels); the generic loops run them (cpu.fma.KIND_BF16_EO is 5)
KIND_FP4 = 6

# Numba's cache of these kernels also follows the files whose code they embed (cpu/kernel_cache.py)
kernel_cache.install()

# ip[IP_DP] of a call (kernel choice): the bf16 dp kernels where the CPU has AVX512-BF16 (cpu.simd.HAS_DP),
# the other stream prefetched by the IR kernels (DP_NTA: with prefetchnta, not prefetcht1: Zen 5, two
# threads, interleaved A/B: int8 +8-13 %, paged bf16 +7-9 %, bf16 dense 0-4 %; fp16 -2-4 % without DP_AHEAD
# but +7-22 % with it). (bf16 / fp16 / int8 K and V that the dp kernels do not take
# go through the float32 FMA kernels of cpu/fma.py when the head dim is a multiple of 16.)
# int8 K / V use the 16-bit integer dot-product kernels of cpu/vnni.py where the CPU has AVX512-VNNI (or AVX2,
# for the 8-lane kernels of CPUs without AVX-512).
# DP_AHEAD: each kernel also requests its own rows AHEAD_BYTES ahead into L1 (at most 63 rows; Zen 5, two
# threads, interleaved A/B against nta alone: bf16 dense +9-12 %, fp16 +7-25 %, int8 +9-13 %, paged +2-9 %;
# the PV request for int8 V measured -4 % and is left out; 2 / 4 / 6 / 8 KB ahead: bf16 and int8 level,
# fp16 best at 8 KB).
DP_QK, DP_PV, DP_PREFETCH, DP_I8, DP_NTA, DP_AHEAD, DP_AMX, DP_AMX_ANY = 1, 2, 4, 8, 16, 32, 64, 128
# DP_EO: the 8-lane FMA kernels (CPUs without AVX-512) widen bf16 K / V in even / odd halves
# (cpu.fma.KIND_BF16_EO): the query rows de-interleaved per 16 channels, PV's accumulators restored at the end
DP_EO = 256
# DP_NO_PV_K: PV does not request the next chunk's K rows (QK still requests its chunk's V rows): the "-v"
# policies below. The hardware prefetchers stream QK's K rows read front to back, not PV's passes over V
# (32 bytes per row per pass): Zen 3, kernels alone from DRAM (4 rows, bf16, ns per key): QK 24.7
# against 19.5 in L2, PV 52.9 against 16.7. What PV requests of the next K chunk competes with its own misses.
DP_NO_PV_K = 512
# DP_TOUCH: items of several KV heads (IP_HB > 1) first read the chunk's rows of all their heads front to back
# (touch_rows: demand loads, which the hardware prefetchers stream), then run each head's kernels on them from
# the caches. One head's rows alone are 256 bytes every KV_N x 256 (BSH): no prefetcher streams that, and
# software prefetches of them did not help (Zen 3, one thread, 256 MB: 256-byte rows every 2 KB
# 7.0-7.5 GB/s with or without prefetcht1 4-64 rows ahead, every 512 bytes 7.5, contiguous 14.5-19; a copy of
# all heads' rows in token order 12.4 GB/s against 3.5-3.9 head by head). Left out for launches that read at
# most PREFETCH_MIN_BYTES (likely cached), as the prefetch bits.
DP_TOUCH = 1024
# Which prefetch policy pays depends on the CPU (two threads, bench shapes, same code, GB/s):
# * AMD Zen 5: nta + ahead 37-43, t1 alone 33-36 -> "nta+ahead";
# * Intel Xeon with AMX: t1 alone 20-22.6, t1 + ahead 19-20, nta 18-21, nta + ahead 8.3-8.9
#   (prefetchnta lines land in L1 only there and are evicted before the use a chunk later), none 14.5-15 -> "t1".
# * AMD Zen 3, AVX2 only (in process, alternating rounds, time against nta + ahead): nta-v bf16 two
#   threads 0.93 (40 rounds) / 0.95 (30), one thread 0.90 (30); int8 0.96 / one thread 0.93; fp16 0.98; paged
#   bf16 / fp16 1.04 / 0.97 (20); nta alone 1.04; the pipeline of the two kernels from DRAM 0.81-0.83 -> "nta-v".
# The default follows the vendor (sse4a: AMD only) and, on AMD, AVX-512 (Zen 4 / 5 vs Zen 3); FIA_DECODE_PREFETCH
# overrides it.
PREFETCH_POLICIES = {"off": 0, "t1": DP_PREFETCH, "t1+ahead": DP_PREFETCH | DP_AHEAD,
                     "nta": DP_PREFETCH | DP_NTA, "nta+ahead": DP_PREFETCH | DP_NTA | DP_AHEAD,
                     "t1-v": DP_PREFETCH | DP_NO_PV_K, "nta-v": DP_PREFETCH | DP_NTA | DP_NO_PV_K}
DP_PREFETCH_BITS = DP_PREFETCH | DP_NTA | DP_AHEAD | DP_NO_PV_K     # every bit a policy sets
PREFETCH_DEFAULT = ("t1" if not target_has("sse4a") else "nta+ahead" if target_has("avx512f") else "nta-v")
PREFETCH_POLICY = os.environ.get("FIA_DECODE_PREFETCH", "") or PREFETCH_DEFAULT
if PREFETCH_POLICY not in PREFETCH_POLICIES:     # a typo must not break `import fia`: say so, keep the default
    warnings.warn(f"FIA_DECODE_PREFETCH: expected one of {', '.join(PREFETCH_POLICIES)}, got "
                  f"{PREFETCH_POLICY!r}; using {PREFETCH_DEFAULT!r}", RuntimeWarning, stacklevel=2)
    PREFETCH_POLICY = PREFETCH_DEFAULT
# DP_AMX: the bf16 dp kernels run their whole 16-key blocks on AMX tiles (cpu/amx.py) where the CPU has them,
# for items of AMX_MIN_ROWS query rows or more (DP_AMX_ANY: any count; tests). Intel Xeon with AMX, two threads, KV
# from DRAM, AMX vs dp: 4 rows (GQA 4, one token) -3 % (QK alone -11 %: its tile loads from DRAM stall
# the core although it computes twice as fast in L2: 19.4 vs 30 ns per key and KV head), 8 rows +18 %,
# 16 rows +60 %.
AMX_MIN_ROWS = 8
# DP_F32: float32 K / V (portable mode) run the cpu/fma.py kernels too (a plain load where the other kinds widen);
# without it the generic loops (load_rows into a float32 chunk, qk_block / pv_block), which never prefetch. Whatever
# the policy, they prefetch as "t1+ahead" (kernel_flags; only "off" turns it off): a float32 chunk is twice a bf16
# one (128 KB of K and of V at D = 128), and prefetchnta (into L1) or t0 lines of the other stream are evicted before
# their use. Kernels alone, 4 rows, D = 128, 128 MB of K / V from DRAM, two threads, one process (AVX-512 host): t1
# 10.6 GB/s, nta 5.3, nta + ahead 5.6, no prefetch 7.6; PV requesting nothing 0.88-0.93x of t1 (also on the 8-lane
# AVX2 kernels). Whole calls, B = 4, 32 / 8 heads of 128, 4096 keys, emulated Zen 3 (8 lanes): t1 + ahead 1.20x t1.
# Their items of several KV heads (IP_HB) run no touch pass (DP_TOUCH): it reads a float32 chunk (2 MB of K and V
# at 8 heads of 128) with nothing to overlap; the heads' kernels request their own rows as for one head (BSND,
# B = 4, 32 / 8 heads of 128, 4096 keys, without the pass: 1.08-1.11x faster on the AVX-512 host, 1.02-1.04x
# emulating Zen 3).
DP_F32 = 2048
# FIA_DECODE_TOUCH=0 turns DP_TOUCH off, FIA_DECODE_F32=0 DP_F32 (A / B measurements)
DP_FLAGS = ((DP_QK | DP_PV if HAS_DP else 0) | (DP_I8 if HAS_VNNI else 0) | (DP_AMX if HAS_AMX else 0)
            | (DP_EO if NARROW else 0) | PREFETCH_POLICIES[PREFETCH_POLICY]
            | (0 if os.environ.get("FIA_DECODE_TOUCH", "1") == "0" else DP_TOUCH)
            | (0 if os.environ.get("FIA_DECODE_F32", "1") == "0" else DP_F32))
AHEAD_BYTES = 8192              # 32 rows of bf16 / fp16 at D = 128, 63 of int8

# fastmath without nnan / ninf: NaN and Inf in the inputs must propagate (SPEC 14)
FM = {"reassoc", "contract", "nsz", "arcp"}
MASK_FILL = np.float32(-1e12)
# The int16 query of the cpu/vnni.py QK kernels (quant_i16: one step per row, max |q~| / 32767) is used only while
# its rounding keeps every score within I8_QK_MAX_ERR: the bound is the score error's standard deviation for keys
# of int8 magnitude (|k| <= 128) of random signs, step * 128 * sqrt(D / 12) (times the largest per-token key scale
# of a chunk). Past it (a query with an outlier channel: the step grows with that channel, every other channel
# loses precision) QK runs the float32 FMA kernels. 2^-11 is half an fp16 ulp of relative weight error: the output
# stays within 2 fp16 ulp of the reference (tests/test_reliability_decode.py); an ordinary query (randn, per-channel
# scales 0.004-0.02, D = 128) sits near 1e-4 of it, an outlier channel of 20-30 (x the softmax scale) reaches it.
I8_QK_MAX_ERR = np.float32(2.0 ** -11)
# Per-token dequant factors whose product with an int8 value (|x + offset| * |scale|) may exceed EXC_FACTOR, or that
# are NaN / infinite: that token's scores (key) or value rows (value) are computed as the reference does, element by
# element (x + offset) * scale in float32, so that an overflow to inf, inf * 0 and inf - inf give what they give
# there (folding the scale out of the dot product would turn the NaN of inf - inf into a finite or one-signed score).
EXC_FACTOR = np.float32(2.0 ** 100)


# ---------------------------------------------------------------------------------------------- ip layout
(IP_R0, IP_BPG, IP_R, IP_B, IP_G, IP_QS, IP_H, IP_D, IP_DR, IP_DV, IP_C, IP_BS) = (
    0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)
(IP_Q_KIND, IP_Q_SN, IP_Q_SS, IP_QR_KIND, IP_QR_SN, IP_QR_SS, IP_QD, IP_QD_SB, IP_QD_SN, IP_QD_SS, IP_KC_MODE) = (
    12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22)
(IP_K_BLK, IP_K_H, IP_K_S, IP_K_KIND, IP_R_BLK, IP_R_H, IP_R_S, IP_R_KIND, IP_V_BLK, IP_V_H, IP_V_S, IP_V_KIND) = (
    23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34)
(IP_KT_MODE, IP_KT_BS, IP_KT_BLK, IP_KT_H, IP_KT_S, IP_VT_MODE, IP_VT_BS, IP_VT_BLK, IP_VT_H, IP_VT_S) = (
    35, 36, 37, 38, 39, 40, 41, 42, 43, 44)
(IP_PSE_KIND, IP_PSE_B, IP_PSE_N, IP_PSE_S, IP_PSE_K, IP_MASK, IP_M_B, IP_M_S, IP_M_K, IP_BAND, IP_COL_BASE,
 IP_WANT_ANY, IP_PREFIX_PASS) = (
    45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57)
IP_DP = 58               # kernel choice: DP_* bits below
# IP_HB: KV heads per item. 1, unless every KV head's rows of a token lie side by side (BSH / BSND, the paged
# [blocks, block_size, H] cache): then an item covers all of them, chunk by chunk, so that each chunk's rows are
# read front to back across the heads (DP_TOUCH) instead of one head's 256 bytes every KV_N x 256 (see DP_TOUCH).
IP_HB = 59
# NZ caches (SPEC 8b): a row's D elements are D / FW fragments of FW elements, FS elements apart (FS = 0: one run)
(IP_K_FS, IP_K_FW, IP_V_FS, IP_V_FW, IP_R_FS, IP_R_FW) = (60, 61, 62, 63, 64, 65)
IP_LEN = 66
# rows of the per-batch geometry array geo [GEO_LEN, B]
GEO_QLO, GEO_QHI, GEO_S2, GEO_PRE, GEO_NEXT, GEO_JOFS, GEO_QBASE, GEO_QRBASE = range(8)
GEO_LEN = 8


# buffers reach the kernels as (address, bytes) pairs: bufs int64 [2, BUF_LEN]
(BUF_Q, BUF_QR, BUF_QDS, BUF_K, BUF_R, BUF_V, BUF_KTS, BUF_KTO, BUF_VTS, BUF_VTO, BUF_PSE, BUF_MASK) = range(12)
BUF_LEN = 12


@intrinsic
def _addr_ptr(typingctx, addr):
    """int64 address -> void* (the caller keeps the memory alive for the call)."""
    sig = types.voidptr(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())
    return sig, codegen


@intrinsic
def _fetch_add(typingctx, arr, idx, val):
    """Atomic arr[idx] += val on an int64 array; returns the old value (work sharing between threads)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None
    sig = types.int64(arr, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]])
        return builder.atomic_rmw("add", ptr, args[2], "monotonic")
    return sig, codegen


@intrinsic
def _copy32(typingctx, dst, src):
    """Copy the 32 bytes at address src to address dst (one unaligned vector load and store)."""
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        vt = ir.VectorType(ir.IntType(8), 32).as_pointer()
        v = builder.load(builder.inttoptr(args[1], vt), align=1)
        builder.store(v, builder.inttoptr(args[0], vt), align=1)
        return context.get_dummy_value()
    return sig, codegen


@njit(nogil=True, cache=True, inline="always")
def claim(items, counter):
    """The next entry of `items` for the calling thread (the threads of a launch share the atomic `counter`:
    dynamic scheduling), or -1 when none is left."""
    t = _fetch_add(counter, 0, 1)
    return items[t] if t < items.shape[0] else -1


@njit(cache=True, inline="always")
def buf_bytes(bufs, k):
    """Buffer k as a uint8 array (no copy)."""
    return carray(_addr_ptr(bufs[0, k]), (bufs[1, k],), np.uint8)


@njit(cache=True, inline="always")
def buf_f32(bufs, k):
    """Buffer k as a float32 array (no copy)."""
    return carray(_addr_ptr(bufs[0, k]), (bufs[1, k] // 4,), np.float32)


# ---------------------------------------------------------------------------------------------- bit casts
@intrinsic
def _u32_as_f32(typingctx, x):
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return sig, codegen


@intrinsic
def _f32_as_u32(typingctx, x):
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return sig, codegen


@njit(fastmath=FM, cache=True, inline="always")
def bf16_to_f32(h):
    return _u32_as_f32(np.uint32(np.uint32(h) << np.uint32(16)))


@intrinsic
def _half_bits_to_f32(typingctx, x):
    """IEEE half bits -> float32 through LLVM's `fpext half` (one vcvtph2ps per 8 values with F16C)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return sig, codegen


@njit(fastmath=FM, cache=True, inline="always")
def _fp16_bits_to_f32(h):
    """IEEE half bits -> float32 by integer arithmetic (CPUs without F16C), exact for normals,
    subnormals, zeros, inf and nan."""
    x = np.uint32(h)
    em = x & np.uint32(0x7FFF)
    # exponent/mantissa shifted into float32 position is the value times 2^-112 (normals and
    # subnormals alike): rescale by 2^112
    f = _u32_as_f32(np.uint32(em << np.uint32(13))) * np.float32(5.192296858534828e33)
    if em >= np.uint32(0x7C00):                      # inf / nan: all-ones exponent, payload kept
        f = _u32_as_f32(np.uint32((em << np.uint32(13)) | np.uint32(0x7F800000)))
    return _u32_as_f32(np.uint32(_f32_as_u32(f) | ((x & np.uint32(0x8000)) << np.uint32(16))))


@njit(fastmath=FM, cache=True, inline="always")
def _fp16_hw_to_f32(h):
    return _half_bits_to_f32(np.uint16(h))


fp16_to_f32 = _fp16_hw_to_f32 if F16C else _fp16_bits_to_f32


@intrinsic
def _f32_to_half_bits(typingctx, x):
    """float32 -> IEEE half bits (round to nearest even; vcvtps2ph with F16C)."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return sig, codegen


@njit(fastmath=FM, cache=True, inline="always")
def _f32_to_half_bits_sw(x):
    """float32 -> IEEE half bits, round to nearest even, by integer arithmetic (targets without F16C, where
    LLVM's fptrunc calls a runtime helper numba does not link). F. Giesen's float_to_half_fast3_rtne:
    overflow -> inf, NaN -> quiet NaN, subnormals through one float add of a magic number."""
    u = _f32_as_u32(x)
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    a = u & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x47800000):                       # >= 65536: inf, or NaN
        o = np.uint32(0x7E00) if a > np.uint32(0x7F800000) else np.uint32(0x7C00)
    elif a < np.uint32(0x38800000):                      # below 2^-14: subnormal half or zero
        magic = np.uint32(0x3F000000)                    # ((127 - 15) + (23 - 10) + 1) << 23
        o = _f32_as_u32(_u32_as_f32(a) + _u32_as_f32(magic)) - magic
    else:
        odd = (a >> np.uint32(13)) & np.uint32(1)
        o = (a + np.uint32(0xC8000FFF) + odd) >> np.uint32(13)   # rebias exponent (-112 << 23), round
    return np.uint16(o | sign)


@njit(fastmath=FM, cache=True, inline="always")
def _f32_to_half_bits_hw(x):
    return _f32_to_half_bits(x)


f32_to_half_bits = _f32_to_half_bits_hw if F16C else _f32_to_half_bits_sw


@njit(fastmath=FM, cache=True, inline="always")
def f32_to_bf16_bits(x):
    """float32 -> bfloat16 bits, round to nearest even; NaN stays a (quiet) NaN."""
    u = _f32_as_u32(x)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    u = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return np.uint16(u >> np.uint32(16))


@njit(fastmath=FM, cache=True, inline="always")
def fexp(x):
    """exp(x) in float32 for x <= 0 (vectorizable; rel. error ~1e-7). NaN propagates; x < -87 -> 0."""
    xc = np.float32(-87.0) if x < np.float32(-87.0) else x
    t = np.floor(xc * np.float32(1.4426950408889634) + np.float32(0.5))
    r = xc - t * np.float32(0.693145751953125)
    r = r - t * np.float32(1.428606765330187045e-06)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    e = _u32_as_f32(np.uint32((np.int32(t) + np.int32(127)) << np.int32(23)))
    v = p * e
    return np.float32(0.0) if x < np.float32(-87.0) else v



@njit(fastmath=FM, cache=True, inline="always")
def fexp2(t):
    """2^t in float32 (vectorizable, ~10 vector operations per 8 values; rel. error < 2.5e-7): a degree-5
    near-minimax polynomial of the fraction in [-0.5, 0.5] times 2^rint(t). NaN propagates; t < -125 -> 0
    (also t = -inf, whose fraction is NaN: the final select drops it, so the argument needs no clamp).
    For softmax loops that want exp(d) as fexp2(d * log2(e)): no Cody-Waite reduction (the product's
    rounding costs |d| * 6e-8 of relative error, where exp(d) is tiny once |d| is large)."""
    fi = np.rint(t)
    f = t - fi
    p = np.float32(1.3266970636323094e-3)
    p = p * f + np.float32(9.675459936261177e-3)
    p = p * f + np.float32(5.550742521882057e-2)
    p = p * f + np.float32(2.4022121727466583e-1)
    p = p * f + np.float32(6.931469440460205e-1)
    p = p * f + np.float32(1.0000001192092896)
    v = _u32_as_f32(_f32_as_u32(p) + np.uint32(np.int32(fi) << np.int32(23)))
    return np.float32(0.0) if t < np.float32(-125.0) else v


@njit(fastmath=FM, cache=True, inline="always")
def round_bf16_value(x):
    """x rounded to the nearest bf16 value (ties to even), as float32, without a NaN test: a NaN may come out
    as another value. For loops whose running sum takes x itself (a NaN there makes the whole row NaN)."""
    u = _f32_as_u32(x)
    return _u32_as_f32((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000))

# ---------------------------------------------------------------------------------------------- row loads
# Hot loops index 2-D arrays directly (a[r, d]) and never take row views: a view costs an atomic
# reference count update, and those serialize threads that share an array.
@njit(fastmath=FM, cache=True, inline="always")
def views(buf):
    """The typed views of a byte buffer: (int8, uint16, int32, float32), each cut to whole elements.
    One kernel specialization serves every dtype: the dtype is a runtime `kind`."""
    n = buf.shape[0]
    return (buf.view(np.int8), buf[:n - n % 2].view(np.uint16), buf[:n - n % 4].view(np.int32),
            buf[:n - n % 4].view(np.float32))


@njit(fastmath=FM, cache=True)
def load_rows(b8, b16, b32, bf, offs, nr, kind, dst, d0, n):
    """dst[c, d0:d0 + n] = float32 of the n logical elements at element offs[c] of the buffer, c < nr
    (element = one value of its kind; int4: one int32 holding eight values).

    Indices are unsigned on purpose: a signed computed index makes numba emit a wraparound select
    per element, which stops LLVM from vectorizing the loop (10x slower)."""
    n_ = np.uint64(n)
    d0_ = np.uint64(d0)
    if kind == KIND_BF16:
        for c in range(nr):
            o = np.uint64(offs[c])
            for d in range(n_):
                dst[c, d0_ + d] = bf16_to_f32(b16[o + d])
    elif kind == KIND_FP16:
        for c in range(nr):
            o = np.uint64(offs[c])
            for d in range(n_):
                dst[c, d0_ + d] = fp16_to_f32(b16[o + d])
    elif kind == KIND_I8:
        for c in range(nr):
            o = np.uint64(offs[c])
            for d in range(n_):
                dst[c, d0_ + d] = np.float32(b8[o + d])
    elif kind == KIND_I4:
        # eight values per int32, low nibble first (SPEC 10.4): on a little-endian machine byte k of a
        # row holds value 2k in its low and value 2k + 1 in its high nibble (two's complement each)
        for c in range(nr):
            o = np.uint64(offs[c]) * np.uint64(4)
            for k in range(n_ // np.uint64(2)):
                x = np.int32(b8[o + k])                  # sign-extended byte
                lo = x & 0xF
                dst[c, d0_ + np.uint64(2) * k] = np.float32(lo - ((lo & 8) << 1))
                dst[c, d0_ + np.uint64(2) * k + np.uint64(1)] = np.float32(x >> 4)
    else:
        for c in range(nr):
            o = np.uint64(offs[c])
            for d in range(n_):
                dst[c, d0_ + d] = bf[o + d]


@njit(fastmath=FM, cache=True, inline="always")
def e8m0_to_f32(e):
    """FLOAT8_E8M0 byte -> 2^(e - 127) as float32 (0 -> 2^-127, a subnormal; 0xFF -> NaN)."""
    u = np.uint32(e)
    return _u32_as_f32(np.uint32(0x00400000) if u == 0 else (np.uint32(0x7FC00000) if u == 255 else u << np.uint32(23)))


@njit(fastmath=FM, cache=True)
def fp4_rows(b8, offs, c0, nr, sc8, soffs, dst, n, rows):
    """Row c - c0 of dst (bf16 bits, rows n apart), c0 <= c < c0 + nr, = e2m1(value) * 2^(E - 127) for the n FP4
    values at byte offset offs[c] of b8 (value 2k in the low, 2k + 1 in the high nibble of byte k) and their E8M0 exponents E, one per 32
    values, at byte offset soffs[c] of sc8 (SPEC 10b.1); rows[c] = its element offset (for qk_fma / pv_fma). Exact in
    bf16: the float32 product has at most two significant bits (0, NaN and inf included)."""
    ng = n // 32
    src = b8.ctypes.data
    out = dst.ctypes.data
    for c in range(c0, c0 + nr):
        o = src + offs[c]
        so = np.uint64(soffs[c])
        base = (c - c0) * n
        for gi in range(ng):                            # 16 bytes -> 32 bf16 (cpu/fp4.py)
            fp4_group_bf16(out + 2 * (base + 32 * gi), o + 16 * gi, e8m0_to_f32(sc8[so + np.uint64(gi)]))
        rows[c] = np.int64(base)


# ---------------------------------------------------------------------------------------------- QK / PV
@njit(fastmath=FM, cache=True)
def qk_block(q, kf, s, R, n, dq):
    """s[r, c] = q[r, :dq] . kf[c, :dq] for r < R, c < n (2 rows x 4 keys per block)."""
    r = 0
    while r + 1 < R:
        c = 0
        while c + 3 < n:
            a00 = np.float32(0.0); a01 = np.float32(0.0); a02 = np.float32(0.0); a03 = np.float32(0.0)  # noqa: E702
            a10 = np.float32(0.0); a11 = np.float32(0.0); a12 = np.float32(0.0); a13 = np.float32(0.0)  # noqa: E702
            for d in range(dq):
                x0 = q[r, d]
                x1 = q[r + 1, d]
                y0 = kf[c, d]
                y1 = kf[c + 1, d]
                y2 = kf[c + 2, d]
                y3 = kf[c + 3, d]
                a00 += x0 * y0; a01 += x0 * y1; a02 += x0 * y2; a03 += x0 * y3  # noqa: E702
                a10 += x1 * y0; a11 += x1 * y1; a12 += x1 * y2; a13 += x1 * y3  # noqa: E702
            s[r, c] = a00; s[r, c + 1] = a01; s[r, c + 2] = a02; s[r, c + 3] = a03  # noqa: E702
            s[r + 1, c] = a10; s[r + 1, c + 1] = a11; s[r + 1, c + 2] = a12; s[r + 1, c + 3] = a13  # noqa: E702
            c += 4
        while c < n:
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            for d in range(dq):
                y = kf[c, d]
                a0 += q[r, d] * y
                a1 += q[r + 1, d] * y
            s[r, c] = a0
            s[r + 1, c] = a1
            c += 1
        r += 2
    if r < R:
        c = 0
        while c + 3 < n:
            a0 = np.float32(0.0); a1 = np.float32(0.0); a2 = np.float32(0.0); a3 = np.float32(0.0)  # noqa: E702
            for d in range(dq):
                x0 = q[r, d]
                a0 += x0 * kf[c, d]; a1 += x0 * kf[c + 1, d]; a2 += x0 * kf[c + 2, d]; a3 += x0 * kf[c + 3, d]  # noqa: E702
            s[r, c] = a0; s[r, c + 1] = a1; s[r, c + 2] = a2; s[r, c + 3] = a3  # noqa: E702
            c += 4
        while c < n:
            a0 = np.float32(0.0)
            for d in range(dq):
                a0 += q[r, d] * kf[c, d]
            s[r, c] = a0
            c += 1


@njit(fastmath=FM, cache=True)
def pv_block(p, vf, acc, R, n, dv):
    """acc[r, :dv] += sum_c p[r, c] * vf[c, :dv] (2 rows x 4 keys per block)."""
    c = 0
    while c + 3 < n:
        r = 0
        while r + 1 < R:
            p00 = p[r, c]; p01 = p[r, c + 1]; p02 = p[r, c + 2]; p03 = p[r, c + 3]  # noqa: E702
            p10 = p[r + 1, c]; p11 = p[r + 1, c + 1]; p12 = p[r + 1, c + 2]; p13 = p[r + 1, c + 3]  # noqa: E702
            for d in range(dv):
                x0 = vf[c, d]
                x1 = vf[c + 1, d]
                x2 = vf[c + 2, d]
                x3 = vf[c + 3, d]
                acc[r, d] += p00 * x0 + p01 * x1 + p02 * x2 + p03 * x3
                acc[r + 1, d] += p10 * x0 + p11 * x1 + p12 * x2 + p13 * x3
            r += 2
        if r < R:
            p00 = p[r, c]; p01 = p[r, c + 1]; p02 = p[r, c + 2]; p03 = p[r, c + 3]  # noqa: E702
            for d in range(dv):
                acc[r, d] += p00 * vf[c, d] + p01 * vf[c + 1, d] + p02 * vf[c + 2, d] + p03 * vf[c + 3, d]
        c += 4
    while c < n:
        for r in range(R):
            pr = p[r, c]
            for d in range(dv):
                acc[r, d] += pr * vf[c, d]
        c += 1


# ---------------------------------------------------------------------------------------------- fused
# bf16 / fp16 / int8 K and V straight from the cache: each element is widened where it is used, the
# 4 query rows of a block share every widened K/V vector (no conversion pass, no float32 chunk).
def cvt(buf, i, kind):
    """float32 of element i of a buffer whose element type says the format: uint16 = bf16, int16 =
    fp16 (bit patterns), int8 = int8. Resolved at compile time: no per-element branch."""


@overload(cvt, jit_options={"fastmath": FM})
def _cvt_impl(buf, i, kind):
    if buf.dtype == types.uint16:
        def impl(buf, i, kind):
            return bf16_to_f32(buf[i])
        return impl
    if buf.dtype == types.int16:
        def impl(buf, i, kind):
            return fp16_to_f32(np.uint16(buf[i]))
        return impl
    if buf.dtype == types.int8:
        def impl(buf, i, kind):
            return np.float32(buf[i])
        return impl
    return None


@njit(fastmath=FM, cache=True)
def qk_fused(q, buf, kind, offs, n, s, R, D):
    """s[r, c] = q[r, :D] . K[c, :D] with key c at element offs[c] of buf (blocks: 4 rows x 2 keys)."""
    D_ = np.uint64(D)
    r = 0
    while r + 3 < R:
        c = 0
        while c + 1 < n:
            o0 = np.uint64(offs[c])
            o1 = np.uint64(offs[c + 1])
            a00 = np.float32(0.0); a01 = np.float32(0.0); a10 = np.float32(0.0); a11 = np.float32(0.0)  # noqa: E702
            a20 = np.float32(0.0); a21 = np.float32(0.0); a30 = np.float32(0.0); a31 = np.float32(0.0)  # noqa: E702
            for d in range(D_):
                y0 = cvt(buf, o0 + d, kind)
                y1 = cvt(buf, o1 + d, kind)
                x0 = q[r, d]
                x1 = q[r + 1, d]
                x2 = q[r + 2, d]
                x3 = q[r + 3, d]
                a00 += x0 * y0; a01 += x0 * y1; a10 += x1 * y0; a11 += x1 * y1  # noqa: E702
                a20 += x2 * y0; a21 += x2 * y1; a30 += x3 * y0; a31 += x3 * y1  # noqa: E702
            s[r, c] = a00; s[r, c + 1] = a01; s[r + 1, c] = a10; s[r + 1, c + 1] = a11  # noqa: E702
            s[r + 2, c] = a20; s[r + 2, c + 1] = a21; s[r + 3, c] = a30; s[r + 3, c + 1] = a31  # noqa: E702
            c += 2
        if c < n:
            o0 = np.uint64(offs[c])
            a0 = np.float32(0.0); a1 = np.float32(0.0); a2 = np.float32(0.0); a3 = np.float32(0.0)  # noqa: E702
            for d in range(D_):
                y0 = cvt(buf, o0 + d, kind)
                a0 += q[r, d] * y0; a1 += q[r + 1, d] * y0; a2 += q[r + 2, d] * y0; a3 += q[r + 3, d] * y0  # noqa: E702
            s[r, c] = a0; s[r + 1, c] = a1; s[r + 2, c] = a2; s[r + 3, c] = a3  # noqa: E702
        r += 4
    while r < R:
        c = 0
        while c + 3 < n:
            o0 = np.uint64(offs[c])
            o1 = np.uint64(offs[c + 1])
            o2 = np.uint64(offs[c + 2])
            o3 = np.uint64(offs[c + 3])
            a0 = np.float32(0.0); a1 = np.float32(0.0); a2 = np.float32(0.0); a3 = np.float32(0.0)  # noqa: E702
            for d in range(D_):
                x0 = q[r, d]
                a0 += x0 * cvt(buf, o0 + d, kind); a1 += x0 * cvt(buf, o1 + d, kind)  # noqa: E702
                a2 += x0 * cvt(buf, o2 + d, kind); a3 += x0 * cvt(buf, o3 + d, kind)  # noqa: E702
            s[r, c] = a0; s[r, c + 1] = a1; s[r, c + 2] = a2; s[r, c + 3] = a3  # noqa: E702
            c += 4
        while c < n:
            o0 = np.uint64(offs[c])
            a0 = np.float32(0.0)
            for d in range(D_):
                a0 += q[r, d] * cvt(buf, o0 + d, kind)
            s[r, c] = a0
            c += 1
        r += 1


@njit(fastmath=FM, cache=True)
def pv_fused(p, buf, kind, offs, n, acc, R, Dv):
    """acc[r, :Dv] += sum_c p[r, c] * V[c, :Dv] with value c at element offs[c] of buf
    (blocks: 4 rows x 4 keys)."""
    Dv_ = np.uint64(Dv)
    r = 0
    while r + 3 < R:
        c = 0
        while c + 3 < n:
            o0 = np.uint64(offs[c])
            o1 = np.uint64(offs[c + 1])
            o2 = np.uint64(offs[c + 2])
            o3 = np.uint64(offs[c + 3])
            p00 = p[r, c]; p01 = p[r, c + 1]; p02 = p[r, c + 2]; p03 = p[r, c + 3]  # noqa: E702
            p10 = p[r + 1, c]; p11 = p[r + 1, c + 1]; p12 = p[r + 1, c + 2]; p13 = p[r + 1, c + 3]  # noqa: E702
            p20 = p[r + 2, c]; p21 = p[r + 2, c + 1]; p22 = p[r + 2, c + 2]; p23 = p[r + 2, c + 3]  # noqa: E702
            p30 = p[r + 3, c]; p31 = p[r + 3, c + 1]; p32 = p[r + 3, c + 2]; p33 = p[r + 3, c + 3]  # noqa: E702
            for d in range(Dv_):
                y0 = cvt(buf, o0 + d, kind)
                y1 = cvt(buf, o1 + d, kind)
                y2 = cvt(buf, o2 + d, kind)
                y3 = cvt(buf, o3 + d, kind)
                acc[r, d] += p00 * y0 + p01 * y1 + p02 * y2 + p03 * y3
                acc[r + 1, d] += p10 * y0 + p11 * y1 + p12 * y2 + p13 * y3
                acc[r + 2, d] += p20 * y0 + p21 * y1 + p22 * y2 + p23 * y3
                acc[r + 3, d] += p30 * y0 + p31 * y1 + p32 * y2 + p33 * y3
            c += 4
        while c < n:
            o0 = np.uint64(offs[c])
            p00 = p[r, c]; p10 = p[r + 1, c]; p20 = p[r + 2, c]; p30 = p[r + 3, c]  # noqa: E702
            for d in range(Dv_):
                y0 = cvt(buf, o0 + d, kind)
                acc[r, d] += p00 * y0
                acc[r + 1, d] += p10 * y0
                acc[r + 2, d] += p20 * y0
                acc[r + 3, d] += p30 * y0
            c += 1
        r += 4
    while r < R:
        c = 0
        while c + 3 < n:
            o0 = np.uint64(offs[c])
            o1 = np.uint64(offs[c + 1])
            o2 = np.uint64(offs[c + 2])
            o3 = np.uint64(offs[c + 3])
            p00 = p[r, c]; p01 = p[r, c + 1]; p02 = p[r, c + 2]; p03 = p[r, c + 3]  # noqa: E702
            for d in range(Dv_):
                acc[r, d] += (p00 * cvt(buf, o0 + d, kind) + p01 * cvt(buf, o1 + d, kind)
                              + p02 * cvt(buf, o2 + d, kind) + p03 * cvt(buf, o3 + d, kind))
            c += 4
        while c < n:
            o0 = np.uint64(offs[c])
            p00 = p[r, c]
            for d in range(Dv_):
                acc[r, d] += p00 * cvt(buf, o0 + d, kind)
            c += 1
        r += 1


@njit(cache=True, inline="always")
def elem_layout(kind, d):
    """(bytes per element, elements per row of d values) of a buffer kind (int4: int32 of eight values)."""
    if kind == KIND_F32:
        return 4, d
    if kind == KIND_I8:
        return 1, d
    if kind == KIND_I4:
        return 4, d // 8
    if kind == KIND_FP4:
        return 1, d // 2
    return 2, d


# ---------------------------------------------------------------------------------------------- int16 operands
@njit(fastmath=FM, cache=True)
def quant_i16(x, R, n, dst, sc):
    """dst[r, :n] = x[r, :n] / sc[r] rounded to int16, sc[r] = max |x[r, :n]| / 32767: the integer operand
    of the cpu/vnni.py kernels (one scale per row; error: half a step, 1.53e-5 of the row's largest
    magnitude). Returns False, leaving nothing usable, when x holds a NaN or an infinity: the caller then
    runs the float32 kernels, which propagate them (SPEC 14). Rows of tiny values (max < 1e-30, e.g.
    subnormal probabilities) are scaled in float64, where the reciprocal does not overflow (their float32
    scale itself is subnormal below ~4e-34 and 0 below ~2e-41: negligible beside a softmax sum >= 1 or
    scores of order 1)."""
    n_ = np.uint64(n)
    for r in range(R):
        t = np.float32(0.0)
        for c in range(n_):
            t += x[r, c] * np.float32(0.0)                 # NaN for any NaN or infinity
        if t != np.float32(0.0):
            return False
        mx = max_f32(x.ctypes.data + r * x.strides[0], n, np.float32(0.0), 1)
        sc[r] = np.float32(np.float64(mx) / 32767.0)
        if mx >= np.float32(1e-30):
            inv = np.float32(32767.0) / mx
            for c in range(n_):
                dst[r, c] = np.int16(np.rint(x[r, c] * inv))
        else:                                               # float64: 32767 / mx would overflow float32
            inv64 = 32767.0 / np.float64(mx) if mx > 0 else 0.0
            for c in range(n_):
                dst[r, c] = np.int16(np.rint(np.float64(x[r, c]) * inv64))
    return True


# ---------------------------------------------------------------------------------------------- softmax
@njit(fastmath=FM, cache=True, inline="always")
def drain_chunk(cacc, hh, tacc, R, Dv):
    """cacc[hh, :R, :Dv] += tacc[:R, :Dv], then tacc = 0: a chunk's PV sums into its block of chunks (the item's
    two-level sums, see _items). Inlined and indexed: a call (or a row view) reference-counts its arrays, atomics
    that cost ~1 % per chunk helper (int8, one thread)."""
    for r in range(R):
        for d in range(np.uint64(Dv)):
            cacc[hh, r, d] += tacc[r, d]
            tacc[r, d] = 0.0


@njit(fastmath=FM, cache=True, inline="always")
def drain_block(acc, ll, vx, cacc, cll, cvx, hh, R, Dv):
    """The block of chunks' sums (cacc / cll / cvx[hh]) into the item's partial (acc, ll, vx), then zeroed."""
    for r in range(R):
        for d in range(np.uint64(Dv)):
            acc[r, d] += cacc[hh, r, d]
            cacc[hh, r, d] = 0.0
        ll[r] += cll[hh, r]
        cll[hh, r] = 0.0
        vx[r] += cvx[hh, r]
        cvx[hh, r] = 0.0


@njit(fastmath=FM, cache=True, inline="always")
def softmax_chunk(s, R, n, m, ll, vx, acc, Dv, p2, mode, wsc, kshift, cll, cvx, cacc, hh):
    """Online softmax of the chunk's scores s[:R, :n] (replaced by exp(s - running max)); the running max
    m, sum ll, the value extras vx and the accumulators acc [R, Dv] are rescaled, and so are the sums of the current
    block of chunks cll / cvx / cacc[hh] (see _items); the chunk's sum of weights is added to cll. The "max" is the
    scores' maximum plus kshift = ln 2^k, 2^k >= the item's keys: every weight is <= 2^-k, so the item's sums (of
    weights, acc) stay below 1 x max |V|, and a V of 3e38 does not overflow before merge normalizes. mode 1: also
    write the probabilities as bf16 bits to p2 (rounded to nearest even: what the hardware's cube unit multiplies,
    docs/DECISIONS.md 23); mode 2: also as int16 to p2 with the row scales wsc (quant_i16 fused into the
    pass: the row's largest probability is exp(chunk max - running max)). Returns False when mode 2 left
    p2 unusable (a NaN or infinite probability sum, or a chunk maximum below 1e-30 of the running one): the
    caller then runs quant_i16 (its float64 path, or the float32 kernels). Unsigned indices: signed ones
    stop LLVM from vectorizing the loops."""
    n_ = np.uint64(n)
    n16 = n_ & ~np.uint64(15)
    ok = True
    p2i = p2.view(np.int16)
    for r in range(R):
        mo = m[r]
        cm = max_f32(s.ctypes.data + r * s.strides[0], n, np.float32(-np.inf), 0)   # NaN scores: see max_f32
        cmk = cm + kshift
        mx = cmk if cmk > mo else mo
        alpha = fexp(mo - mx)
        # what the pass writes to p2 (pm) -- mode 2 without a usable row scale writes nothing (ok = False) --
        # then the whole 16-score blocks in cpu.simd.exp_rows (16 lanes), the tail here
        pm = mode
        inv = np.float32(0.0)
        if mode == 2:
            wmax = fexp(cm - mx)
            if wmax >= np.float32(1e-30):
                inv = np.float32(32767.0) / wmax
                wsc[r] = wmax / np.float32(32767.0)
            else:
                ok = False
                pm = 0
        ls = exp_rows(s.ctypes.data + r * s.strides[0], n, mx, p2.ctypes.data + r * p2.strides[0], pm, inv)
        for c in range(n16, n_):
            e = fexp(s[r, c] - mx)
            s[r, c] = e
            if pm == 1:
                p2[r, c] = f32_to_bf16_bits(e)
            elif pm == 2:
                p2i[r, c] = np.int16(min(np.rint(e * inv), np.float32(32767.0)))
            ls += e
        if mode == 2 and not (ls < np.float32(np.inf)):          # NaN or infinite: not quantized
            ok = False
        m[r] = mx
        if alpha != np.float32(1.0):
            ll[r] *= alpha
            cll[hh, r] *= alpha
            vx[r] *= alpha
            cvx[hh, r] *= alpha
            for d in range(np.uint64(Dv)):
                acc[r, d] *= alpha
                cacc[hh, r, d] *= alpha
        cll[hh, r] += ls
    return ok


@njit(fastmath=FM, cache=True)
def nz_pack(buf, offs, n, es, d, fs, fw, dst):
    """The n rows at element offsets offs[c] of an NZ cache (SPEC 8b: a row is d / fw fragments of fw elements
    of es bytes, fs elements apart) copied side by side into the byte scratch dst; offs[c] becomes row c's
    element offset there. Every kernel then reads them as the rows of an ND cache: the same sums in the same
    order (NZ results equal the 4-D cache's), for one copy of the chunk through L1."""
    fb = fw * es
    nf = d // fw
    rb = d * es
    fsb = fs * es
    src = buf.ctypes.data
    out = dst.ctypes.data
    if fb == 32 and nf <= 8:                           # every NZ cache of SPEC 8b: 32 int8 or 16 bf16 / fp16;
        for c in range(n):                             # row by row for few fragments (int8 D = 128: 1.5x the
            o = src + offs[c] * es                     # rate of columns outside), else column by column (MLA
            t = out + c * rb                           # D = 512: 32 streams; 1.3x the rate of rows outside)
            for f in range(nf):
                _copy32(t + f * 32, o + f * fsb)
    elif fb == 32:
        for f in range(nf):
            for c in range(n):
                _copy32(out + c * rb + f * 32, src + offs[c] * es + f * fsb)
    else:
        for c in range(n):
            b0 = np.uint64(offs[c] * es)
            t0 = np.uint64(c * rb)
            for f in range(np.uint64(nf)):
                for j in range(np.uint64(fb)):
                    dst[t0 + f * np.uint64(fb) + j] = buf[b0 + f * np.uint64(fsb) + j]
    for c in range(n):
        offs[c] = c * d


@njit(fastmath=FM, cache=True, inline="always")
def nz_lines(offs, n, d, fw, fs):
    """The kernels' prefetch rows for n NZ rows at element offsets offs[c] (rewritten in place): row p becomes
    the d elements of fragment column p % (d / fw) of rows p - p % (d / fw) .. (a run of d / fw slots, side by side
    in a block), so that requesting n "rows" of d elements requests every fragment of the n rows."""
    nf = d // fw
    for p in range(n):
        f = p % nf
        offs[p] = offs[p - f] + f * fs


# ---------------------------------------------------------------------------------------------- the pass
@njit(fastmath=FM, cache=True, inline="always")
def row_offsets(tbl, i, c0, n, bs, s_blk, base, s_s, dst):
    """dst[c] = element offset of key position c0 + c (c < n) of query group i: block tbl[i, p // bs]
    (the paged block, or the batch for unpaged storage with bs = "infinite") times s_blk + base + the
    slot (p % bs) times s_s; one block segment at a time (affine inside a block)."""
    bi = c0 // bs
    sl = c0 - bi * bs
    c = 0
    while c < n:
        seg = min(n - c, bs - sl)
        o = tbl[i, bi] * s_blk + base + sl * s_s
        c_ = np.uint64(c)
        for j in range(np.uint64(seg)):                  # unsigned: vectorizes
            dst[c_ + j] = o + np.int64(j) * s_s
        c += seg
        sl += seg
        if sl == bs:
            sl = 0
            bi += 1


@njit(fastmath=FM, cache=True, inline="always")
def touch_rows(buf, offs, n, es, span):
    """Read the span bytes at element offset offs[c] (elements of es bytes) of buf for keys c < n, front to
    back, and return their xor: demand loads that bring a chunk's rows of several KV heads into the caches in
    address order (DP_TOUCH). The 8-byte words that hold them, cut to the buffer."""
    w = buf[:buf.shape[0] - buf.shape[0] % 8].view(np.uint64)
    nw = np.uint64(w.shape[0])
    x = np.uint64(0)
    for c in range(n):
        b0 = np.uint64(offs[c] * es)
        j0 = b0 >> np.uint64(3)
        j1 = min((b0 + np.uint64(span) + np.uint64(7)) >> np.uint64(3), nw)
        for j in range(j0, j1):
            x ^= w[j]
    return x


# factor specs (fill_factors): one row per factor tensor, FS_* columns
FS_ADDR, FS_KIND, FS_GRAN, FS_SHAPE, FS_STRIDE, FS_LEN = 0, 1, 2, 3, 7, 11
GRAN_TENSOR, GRAN_CHANNEL, GRAN_HEAD = 0, 1, 2


@njit(cache=True)
def fill_factors(specs, kchan, vcs, vco):
    """The dequant factors applied outside the loop as float32 from the factor tensors in place: rows of specs
    [4, FS_LEN] (key scale, key offset, value scale, value offset; address 0: absent) give each tensor's
    address, element kind, granularity (GRAN_*: one value for all, H x D values, one per head), and shape /
    element strides padded to 4 dims (shape 1). Key scale / offset go to kchan[0] / kchan[1] [H, D], value
    scale / offset to vcs / vco [H, Dv]; the values in the tensor's logical order (as torch's reshape).
    Returns whether a scale / offset pair lies outside EXC_FACTOR (NaN / infinite included): folded out of the loop,
    such factors would not give the reference's element-wise inf * 0 and overflows (backend.py then runs the call
    with the reference's formulas)."""
    for f in range(4):
        addr = specs[f, FS_ADDR]
        if addr == 0:
            continue
        out = kchan[min(f, 1)] if f < 2 else (vcs if f == 2 else vco)
        flat = out.reshape(-1)                             # [H * D] (contiguous)
        H, Dd = out.shape
        kind = specs[f, FS_KIND]
        gran = specs[f, FS_GRAN]
        last = 0
        for d in range(4):
            last += (specs[f, FS_SHAPE + d] - 1) * specs[f, FS_STRIDE + d]
        es = 4 if kind == KIND_F32 else 2
        buf = carray(_addr_ptr(addr), ((last + 1) * es,), np.uint8)
        b16 = buf.view(np.uint16) if es == 2 else buf[:0].view(np.uint16)
        b32 = buf.view(np.float32) if es == 4 else buf[:0].view(np.float32)
        n0, n1, n2, n3 = specs[f, FS_SHAPE], specs[f, FS_SHAPE + 1], specs[f, FS_SHAPE + 2], specs[f, FS_SHAPE + 3]
        s0, s1, s2 = specs[f, FS_STRIDE], specs[f, FS_STRIDE + 1], specs[f, FS_STRIDE + 2]
        s3 = specs[f, FS_STRIDE + 3]
        i = 0
        for a in range(n0):
            for b in range(n1):
                for c in range(n2):
                    o = a * s0 + b * s1 + c * s2
                    for _e in range(n3):
                        if kind == KIND_F32:
                            x = b32[o]
                        elif kind == KIND_BF16:
                            x = bf16_to_f32(b16[o])
                        else:
                            x = fp16_to_f32(b16[o])
                        o += s3
                        if gran == GRAN_CHANNEL:
                            flat[i] = x
                        elif gran == GRAN_HEAD:
                            for j in range(Dd):
                                out[i, j] = x
                        else:
                            for j in range(H * Dd):
                                flat[j] = x
                        i += 1
    bad = False
    for k in range(2):                                     # (key: kchan[0] / kchan[1]; value: vcs / vco)
        if specs[2 * k, FS_ADDR] == 0:
            continue
        sc = kchan[0] if k == 0 else vcs
        has_off = specs[2 * k + 1, FS_ADDR] != 0
        off = kchan[min(1, kchan.shape[0] - 1)] if k == 0 else vco
        for a in range(sc.shape[0]):
            for d in range(sc.shape[1]):
                x = abs(sc[a, d]) * (np.float32(128.0) + (abs(off[a, d]) if has_off else np.float32(0.0)))
                if not x <= EXC_FACTOR:
                    bad = True
    return bad


@njit(fastmath=FM, cache=True)
def token_scales(tbl, i, h, c0, n, tb, s_blk, s_h, s_s, mode, sc, off, dst_s, dst_o):
    """Per-token dequant factors of the chunk's keys [c0, c0 + n) of query group i, KV head h: scale into
    dst_s (and offset into dst_o when mode == 2). Token p's factor is element tbl[i, p // tb] * s_blk +
    h * s_h + (p % tb) * s_s (by batch, or by paged block: the same addressing as the keys, row_offsets),
    copied one block segment at a time (contiguous factors: a vectorized copy)."""
    bi = c0 // tb
    sl = c0 - bi * tb
    c = 0
    while c < n:
        seg = min(n - c, tb - sl)
        o = tbl[i, bi] * s_blk + h * s_h + sl * s_s
        _copy_strided(sc, o, s_s, dst_s, c, seg)
        if mode == 2:
            _copy_strided(off, o, s_s, dst_o, c, seg)
        c += seg
        sl += seg
        if sl == tb:
            sl = 0
            bi += 1


@njit(fastmath=FM, cache=True, inline="always")
def exceptional(sc, off, mode, n):
    """Whether a token of the chunk (< n) has per-token factors outside EXC_FACTOR (see there; NaN included).
    A count of compares, not an early exit or a max: the loop vectorizes (a float max without nnan does not)."""
    bad = 0
    if mode == 2:
        for c in range(np.uint64(n)):
            bad += 0 if abs(sc[c]) * (np.float32(128.0) + abs(off[c])) <= EXC_FACTOR else 1
    else:
        for c in range(np.uint64(n)):
            bad += 0 if abs(sc[c]) * np.float32(128.0) <= EXC_FACTOR else 1
    return bad != 0


@njit(fastmath=FM, cache=True, inline="always")
def exceptional_row(c, sc, off, mode, x8, x16, x32, xfl, kind, xoff, D, dst, offs):
    """Whether token c's dequant factors are exceptional (past EXC_FACTOR); if so dst[0, :D] = its row dequantized
    element by element in float32, (x + offset) * scale_c, as the reference does."""
    o = off[c] if mode == 2 else np.float32(0.0)
    t = sc[c]
    if abs(t) * (np.float32(128.0) + abs(o)) <= EXC_FACTOR:
        return False
    offs[0] = xoff[c]
    load_rows(x8, x16, x32, xfl, offs, 1, kind, dst, 0, D)
    for d in range(D):
        dst[0, d] = (dst[0, d] + o) * t
    return True


@njit(fastmath=FM, cache=True)
def exact_key_tokens(s, R, n, sc, off, mode, kbuf, k_kind, koff, qraw, D, scale, kf, offs):
    """The scores s[:R, c] of the chunk's exceptional key tokens c (exceptional), as the reference computes them:
    (q . ((k + offset) * scale_c)) * softmax scale, the key dequantized element by element in float32; qraw [R, D]:
    the rows' query (times dequant_scale_query)."""
    k8, k16, k32, kfl = views(kbuf)
    for c in range(n):
        if not exceptional_row(c, sc, off, mode, k8, k16, k32, kfl, k_kind, koff, D, kf, offs):
            continue
        for r in range(R):
            a = np.float32(0.0)
            for d in range(D):
                a += qraw[r, d] * kf[0, d]
            s[r, c] = a * scale


@njit(fastmath=FM, cache=True)
def exact_value_tokens(s, R, n, sc, off, mode, vbuf, v_kind, voff, Dv, tacc, vf, offs):
    """The chunk's exceptional value tokens c (exceptional): tacc[r, :] += w[r, c] * ((v + offset) * scale_c), the
    value dequantized element by element in float32 as the reference does; their weights and factors are then
    zeroed, so the other paths (weights times scale, offset extras) leave them out."""
    v8, v16, v32, vfl = views(vbuf)
    for c in range(n):
        if not exceptional_row(c, sc, off, mode, v8, v16, v32, vfl, v_kind, voff, Dv, vf, offs):
            continue
        for r in range(R):
            w = s[r, c]
            for d in range(Dv):
                tacc[r, d] += w * vf[0, d]
            s[r, c] = np.float32(0.0)
        sc[c] = np.float32(0.0)
        off[c] = np.float32(0.0)


@njit(fastmath=FM, cache=True, inline="always")
def _copy_strided(src, o, st, dst, c, n):
    """dst[c:c + n] = src[o], src[o + st], ... (unsigned indices: the unit-stride loop vectorizes)."""
    o_, c_ = np.uint64(o), np.uint64(c)
    if st == 1:
        for j in range(np.uint64(n)):
            dst[c_ + j] = src[o_ + j]
    else:
        for j in range(n):
            dst[c + j] = src[o + j * st]


@njit(fastmath=FM, cache=True)
def eo_rows(x, R, D, tmp, back):
    """x[r, :D] (D % 16 == 0) per 16 channels: the even-indexed ones, then the odd-indexed ones (the layout of
    cpu.fma.KIND_BF16_EO's halves: the query for qk_fma), or back from it (pv_fma's accumulators). tmp:
    scratch of >= 16 floats in row 0."""
    for r in range(R):
        for j in range(0, D, 16):
            for i in range(16):
                tmp[0, i] = x[r, j + i]
            if back:
                for i in range(8):
                    x[r, j + 2 * i] = tmp[0, i]
                    x[r, j + 2 * i + 1] = tmp[0, 8 + i]
            else:
                for i in range(8):
                    x[r, j + i] = tmp[0, 2 * i]
                    x[r, j + 8 + i] = tmp[0, 2 * i + 1]


@njit(fastmath=FM, cache=True, inline="always")
def _i8_tokens_ok(qerr, tsk, n):
    """Whether the int16 query keeps the chunk's scores within I8_QK_MAX_ERR under its per-token key scales
    (every |scale| <= I8_QK_MAX_ERR / qerr; a count of compares: vectorizes, see exceptional)."""
    lim = I8_QK_MAX_ERR / qerr if qerr > np.float32(0.0) else np.float32(np.inf)
    bad = 0
    for c in range(np.uint64(n)):
        bad += 0 if abs(tsk[c]) <= lim else 1
    return bad == 0


# what kernel_flags reports (bits)
(KF_DP_QK, KF_DP_PV, KF_I8_QK, KF_I8_PV, KF_FMA_QK, KF_FMA_PV, KF_PREFETCH, KF_NTA, KF_AHEAD_K, KF_AHEAD_V,
 KF_AMX_QK, KF_AMX_PV, KF_EO_QK, KF_EO_PV, KF_PV_K, KF_TOUCH) = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048,
                                                                4096, 8192, 16384, 32768)


@njit(cache=True, inline="always")
def kernel_flags(ip):
    """The kernels a launch's items run (KF_* bits), from its int parameters alone: the one place that
    decides (the items read it, and fia.explain names the kernels from it). QK / PV neither dp, VNNI nor
    FMA: the generic float32 loops (int4 / rope K or V, head dims not multiples of 16, float32 without DP_F32)."""
    D = ip[IP_D]
    Dr = ip[IP_DR]
    Dv = ip[IP_DV]
    k_kind = ip[IP_K_KIND]
    v_kind = ip[IP_V_KIND]
    f = 0
    # bf16 dot-product kernels (cpu/simd.py): raw bf16 query bits in q2, the scale applied to the scores
    # (FP4 K / V too: each chunk decoded to exact bf16 rows first, fp4_rows; their KT / VT slots hold group scales)
    if ((ip[IP_DP] & DP_QK) != 0 and ip[IP_Q_KIND] == KIND_BF16 and Dr == 0 and ip[IP_KC_MODE] == 0
            and ip[IP_QD] == 0 and D % 32 == 0
            and ((k_kind == KIND_BF16 and ip[IP_KT_MODE] == 0) or k_kind == KIND_FP4)):
        f |= KF_DP_QK
    if ((ip[IP_DP] & DP_PV) != 0 and Dv % 64 == 0
            and ((v_kind == KIND_BF16 and ip[IP_VT_MODE] == 0) or v_kind == KIND_FP4)):
        f |= KF_DP_PV
    # ... their 16-key blocks on AMX tiles (cpu/amx.py; query rows in groups of 16 for QK)
    amx = (ip[IP_DP] & DP_AMX) != 0 and (ip[IP_R] >= AMX_MIN_ROWS or (ip[IP_DP] & DP_AMX_ANY) != 0)
    if amx and (f & KF_DP_QK) != 0 and D <= 32 * QK_MAX_CHUNKS:
        f |= KF_AMX_QK
    if amx and (f & KF_DP_PV) != 0 and Dv <= PV_MAX_DV:
        f |= KF_AMX_PV
    # int16 x int8 dot-product kernels (cpu/vnni.py) for int8 K / V: the query (times the key scales) and the
    # probabilities quantized to int16 per row (quant_i16). Not for a float32 query (portable mode): its
    # float32 output is held to float32 accuracy, the float32 kernels keep it. (PV falls back to FMA for a
    # chunk whose probabilities cannot be quantized: NaN / Inf, see quant_i16; QK for a head whose query holds a
    # NaN / Inf or whose int16 rounding would move a score by more than I8_QK_MAX_ERR: decided per item and chunk
    # from the data, counted in decode.QK_STATS.)
    i8 = (ip[IP_DP] & DP_I8) != 0 and ip[IP_Q_KIND] != KIND_F32
    if i8 and k_kind == KIND_I8 and Dr == 0 and D % 32 == 0 and D <= QK_MAX_D:
        f |= KF_I8_QK
    if i8 and v_kind == KIND_I8 and Dv % 64 == 0:
        f |= KF_I8_PV
    # float32 FMA kernels (cpu/fma.py) for the other bf16 / fp16 / int8 cases and float32 K / V (DP_F32); the build
    # without the generic paths only runs those (backend.py sends head dims that are not multiples of 16 to the
    # generic build)
    f32 = (ip[IP_DP] & DP_F32) != 0
    if ((f & KF_DP_QK) == 0 and Dr == 0 and D % 16 == 0
            and (k_kind == KIND_BF16 or k_kind == KIND_FP16 or k_kind == KIND_I8 or (f32 and k_kind == KIND_F32))):
        f |= KF_FMA_QK
    if ((f & KF_DP_PV) == 0 and Dv % 16 == 0
            and (v_kind == KIND_BF16 or v_kind == KIND_FP16 or v_kind == KIND_I8 or (f32 and v_kind == KIND_F32))):
        f |= KF_FMA_PV
    # ... bf16 ones widened in even / odd halves on 8 lanes (DP_EO)
    eo = NARROW and (ip[IP_DP] & DP_EO) != 0
    if eo and (f & KF_FMA_QK) != 0 and k_kind == KIND_BF16:
        f |= KF_EO_QK
    if eo and (f & KF_FMA_PV) != 0 and v_kind == KIND_BF16:
        f |= KF_EO_PV
    if (ip[IP_DP] & DP_PREFETCH) != 0:             # prefetch the other stream inside the IR kernels
        f |= KF_PREFETCH
        # float32 K or V: "t1+ahead" whatever the policy (see DP_F32)
        wide = k_kind == KIND_F32 or v_kind == KIND_F32
        if (ip[IP_DP] & DP_NTA) != 0 and not wide:     # with prefetchnta (see DP_NTA)
            f |= KF_NTA
        if (ip[IP_DP] & DP_NO_PV_K) == 0 or wide:      # PV requests the next chunk's K rows (see DP_NO_PV_K)
            f |= KF_PV_K
        if (ip[IP_DP] & DP_AHEAD) != 0 or wide:        # own rows ahead (see DP_AHEAD): QK, PV except int8 V
            f |= KF_AHEAD_K
            if v_kind != KIND_I8:
                f |= KF_AHEAD_V
    # items of several KV heads read each chunk's rows front to back first (DP_TOUCH), but not float32 ones in the
    # IR kernels (see DP_F32)
    if ((ip[IP_DP] & DP_TOUCH) != 0 and ip[IP_HB] > 1
            and not (k_kind == KIND_F32 and v_kind == KIND_F32 and (f & KF_FMA_QK) != 0 and (f & KF_FMA_PV) != 0)):
        f |= KF_TOUCH
    return f


@njit(fastmath=FM, cache=True)
def _items(items, counter, ip, fp, geo, work, tbl, qbuf, qrbuf, qds, kchan, kbuf, rbuf, vbuf,
          kt_tbl, kts, kto, vt_tbl, vts, vto, pse, mask, po, pm, pl, pany,
          qvh, qah, qsh, rb, rnh, rs, tmp, offs, kf, vf, s, vxh, koff, voff, roff, tsk, tok, tsv, tov, q2h, p2, knext,
          isch, i8q, sinks, generic, tacc, cacc, cll, cvx, qerr, qraw, stats, kscr, vscr, rscr, vlines):
    """The items of `items` (w * (KV_N / HB) + h / HB) this thread claims through `counter`, one after another. The
    claim loop is here, not in the caller: numba reference-counts every array argument of a call (an atomic
    add at entry and exit), and per item the ~47 arrays of this function were ~100 atomics, ~0.5 us per item
    (a quarter of the kernel time of the benchmark's small call, perf samples in NRT_incref / NRT_decref).
    An item covers HB = ip[IP_HB] KV heads: their query rows are made first (per-head scratch [HB, ...]), then
    chunk by chunk every head's QK / softmax / PV (the state of head h in po / pm / pl / pany[w, h]).
    Sums over an item's keys run in two levels, so that no float32 sum takes more than ~2 sqrt(chunks) terms (one
    running sum over 2^20 keys drifts by 1e-3 relative): each chunk's PV sums go to tacc [R, Dv], tacc to the block
    of chunks' cacc, every `blk` chunks (~sqrt of the item's) cacc to the partial acc; the same for the sum of
    weights (cll -> ll) and the value extras (cvx -> vx). Plain sums: fastmath's reassociation keeps them."""
    H = ip[IP_H]
    HB = ip[IP_HB]
    NG = H // HB
    # views, constants and flags of the launch, made once (each array view is an allocation and reference counts)
    q8, q16, q32, qfl = views(qbuf)
    kf_ = kernel_flags(ip)
    p2i = p2.view(np.int16)
    R0 = ip[IP_R0]
    BPG = ip[IP_BPG]
    R = ip[IP_R]
    B = ip[IP_B]
    G = ip[IP_G]
    QS = ip[IP_QS]
    D = ip[IP_D]
    Dr = ip[IP_DR]
    Dv = ip[IP_DV]
    dq = D + Dr
    C = ip[IP_C]
    bs = ip[IP_BS]
    scale = np.float32(fp[0])
    kc_mode = ip[IP_KC_MODE]
    dp_qk = (kf_ & KF_DP_QK) != 0
    dp_pv = (kf_ & KF_DP_PV) != 0
    amx_qk = (kf_ & KF_AMX_QK) != 0
    amx_pv = (kf_ & KF_AMX_PV) != 0
    pf = (kf_ & KF_PREFETCH) != 0
    pv_k = (kf_ & KF_PV_K) != 0
    i8_qk_kernels = (kf_ & KF_I8_QK) != 0
    i8_pv = (kf_ & KF_I8_PV) != 0
    fma_qk = (kf_ & KF_FMA_QK) != 0
    fma_pv = (kf_ & KF_FMA_PV) != 0
    eo_qk = (kf_ & KF_EO_QK) != 0
    eo_pv = (kf_ & KF_EO_PV) != 0
    touch = (kf_ & KF_TOUCH) != 0
    # NZ sources: each chunk's rows are packed into kscr / vscr / rscr (nz_pack) and read there; the other stream's
    # prefetch rows are the chunk's fragment runs (nz_lines), the kernels' own rows ahead are off (in scratch)
    k_fs = ip[IP_K_FS]
    v_fs = ip[IP_V_FS]
    r_fs = ip[IP_R_FS]
    # value and key the same NZ cache (MLA callers pass the latent cache as both): V reuses K's packed rows
    kv_same = (kbuf.ctypes.data == vbuf.ctypes.data and k_fs == v_fs and D == Dv and ip[IP_K_KIND] == ip[IP_V_KIND]
               and ip[IP_K_BLK] == ip[IP_V_BLK] and ip[IP_K_H] == ip[IP_V_H] and ip[IP_K_S] == ip[IP_V_S]
               and ip[IP_K_FW] == ip[IP_V_FW])
    k_blk = ip[IP_K_BLK]
    k_h = ip[IP_K_H]
    k_s = ip[IP_K_S]
    k_kind = ip[IP_K_KIND]
    r_blk = ip[IP_R_BLK]
    r_h = ip[IP_R_H]
    r_s = ip[IP_R_S]
    r_kind = ip[IP_R_KIND]
    v_blk = ip[IP_V_BLK]
    v_h = ip[IP_V_H]
    v_s = ip[IP_V_S]
    v_kind = ip[IP_V_KIND]
    k_es, k_row = elem_layout(k_kind, D)              # bytes per element, elements per row (prefetching)
    v_es, v_row = elem_layout(v_kind, Dv)
    k_span = ((HB - 1) * k_h + k_row) * k_es          # bytes of a token's rows of an item's heads (DP_TOUCH)
    v_span = ((HB - 1) * v_h + v_row) * v_es
    k_es_ = k_es
    v_es_ = v_es
    # the other-stream prefetch hints: the K row size and hints travel to PV, the V ones to QK
    if (kf_ & KF_NTA) != 0:                            # prefetchnta instead of t1 (see DP_NTA)
        k_es += PF_NTA
        v_es += PF_NTA
    if (kf_ & KF_AHEAD_K) != 0 and k_fs == 0:                        # QK's own K rows ahead (see DP_AHEAD)
        v_es += PF_AHEAD * min(63, max(1, AHEAD_BYTES // ((k_es & 255) * k_row)))
    if (kf_ & KF_AHEAD_V) != 0 and v_fs == 0:                        # PV's own V rows ahead
        k_es += PF_AHEAD * min(63, max(1, AHEAD_BYTES // ((v_es & 255) * v_row)))
    kt_mode = ip[IP_KT_MODE] if k_kind != KIND_FP4 else 0   # FP4: the KT / VT slots hold the group scales
    vt_mode = ip[IP_VT_MODE] if v_kind != KIND_FP4 else 0   # (applied by fp4_rows, not per token)
    kgs = kts.view(np.uint8)
    vgs = vts.view(np.uint8)
    kf16 = kf.reshape(kf.size).view(np.uint16)            # FP4 chunks decoded to bf16 (fp4_rows) for qk_fma / pv_fma
    vf16 = vf.reshape(vf.size).view(np.uint16)
    pse_kind = ip[IP_PSE_KIND]            # -1: no pse
    has_mask = ip[IP_MASK]
    has_band = ip[IP_BAND]
    col_base = ip[IP_COL_BASE]
    want_any = ip[IP_WANT_ANY]
    prefix_pass = ip[IP_PREFIX_PASS]
    sink = np.uint64(0)
    n_i8 = 0                                               # chunks x heads whose QK ran qk_i8, of n_qk (stats)
    n_qk = 0
    while True:
        it = claim(items, counter)
        if it < 0:
            break
        w = it // NG
        h0 = (it % NG) * HB
        i = work[0, w]
        lo = work[1, w]
        hi = work[2, w]
        for h in range(h0, h0 + HB):
            acc = po[w, h]                                     # [R, Dv]
            m = pm[w, h]                                       # [R]
            ll = pl[w, h]                                      # [R]
            anyu = pany[w, h]                                  # [R]
            for r in range(R):
                m[r] = -np.inf
                ll[r] = 0.0
                anyu[r] = 0
                cll[h - h0, r] = 0.0
                cvx[h - h0, r] = 0.0
                for d in range(Dv):
                    acc[r, d] = 0.0
                    cacc[h - h0, r, d] = 0.0
        if hi <= lo:
            continue
        # weights exp(s - max - ln 2^k) with 2^k >= the item's keys: its sums stay <= 1 x max |V| (softmax_chunk)
        kb = 0
        while (1 << kb) < hi - lo:
            kb += 1
        kshift = np.float32(kb * 0.6931471805599453)
        nch = (hi - lo + C - 1) // C                     # chunks of the item; blocks of blk of them
        blk = 1
        while blk * blk < nch:
            blk += 1
        # (the typed views of K / V / rope / pse are made where a path reads them: an array view checks its
        # size, which numba cannot drop, and 24 of them per item were ~9 % of a small call's kernel time)

        # ---- each head's query rows: r = (batch in group) * R0 + g * Q_S + s, head n = h * G + g.
        # q = query * scale (* dequant_scale_query) (* per-channel key scale); rows outside the query
        # window stay 0 (never computed, merge writes their 0 / +inf).
        # (scratch per head hh = h - h0: qv [R, dq], qa / qs [R], rn [R]: query head of a row; rb / rs [R]:
        # batch, physical row of a row)
        for hh in range(HB):
            h = h0 + hh
            qv = qvh[hh]
            q2 = q2h[hh]
            qa = qah[hh]
            qs = qsh[hh]
            rn = rnh[hh]
            i8_qk = i8_qk_kernels                # (per head: cleared below when its query holds a NaN or an inf)
            for r in range(R):
                bl = r // R0
                b = i * BPG + bl
                rem = r - bl * R0
                g = rem // QS
                si = rem - g * QS
                n = h * G + g
                if b >= B:
                    b = B - 1
                rb[r] = b
                rn[r] = n
                rs[r] = si
                qa[r] = 0.0
                qs[r] = 0.0
                if si < geo[GEO_QLO, b] or si >= geo[GEO_QHI, b]:
                    for d in range(dq):
                        qv[r, d] = 0.0
                    if kt_mode != 0:
                        for d in range(D):
                            qraw[hh, r, d] = 0.0
                    if dp_qk:
                        for d in range(D):
                            q2[r, d] = 0
                    continue
                offs[0] = geo[GEO_QBASE, b] + n * ip[IP_Q_SN] + si * ip[IP_Q_SS]
                if dp_qk:
                    qo = np.uint64(offs[0])
                    for d in range(np.uint64(D)):
                        q2[r, d] = q16[qo + d]
                load_rows(q8, q16, q32, qfl, offs, 1, ip[IP_Q_KIND], tmp, 0, D)
                if Dr > 0:
                    offs[0] = geo[GEO_QRBASE, b] + n * ip[IP_QR_SN] + si * ip[IP_QR_SS]
                    qr8, qr16, qr32, qrfl = views(qrbuf)
                    load_rows(qr8, qr16, qr32, qrfl, offs, 1, ip[IP_QR_KIND], tmp, D, Dr)
                f = scale
                if ip[IP_QD] != 0:
                    f = f * qds[b * ip[IP_QD_SB] + n * ip[IP_QD_SN] + si * ip[IP_QD_SS]]
                for d in range(D):
                    qv[r, d] = tmp[0, d] * f
                if kt_mode != 0:                               # (the reference's query, for exact_key_tokens)
                    fq = qds[b * ip[IP_QD_SB] + n * ip[IP_QD_SN] + si * ip[IP_QD_SS]] if ip[IP_QD] != 0 else 1.0
                    for d in range(D):
                        qraw[hh, r, d] = tmp[0, d] * np.float32(fq)
                # the rope part (columns D..D+Dr) is not quantized: dequant_scale_query applies to the int8
                # query only (SPEC 11: Q = Q_q * scale; Q_rope keeps its float16/bfloat16 values)
                for d in range(D, dq):
                    qv[r, d] = tmp[0, d] * scale
                if kc_mode != 0:
                    for d in range(D):
                        qv[r, d] *= kchan[0, h, d]
                    if kc_mode == 2:
                        t = np.float32(0.0)
                        for d in range(D):
                            t += qv[r, d] * kchan[1, h, d]
                        qa[r] = t
                t = np.float32(0.0)
                for d in range(D):
                    t += qv[r, d]
                qs[r] = t
            if eo_qk:                                      # qk_fma's even / odd bf16 halves (cpu.fma.KIND_BF16_EO)
                eo_rows(qv, R, D, tmp, False)
            if i8_qk:
                i8_qk = quant_i16(qv, R, D, q2.view(np.int16), isch[hh, 0])
            if i8_qk:                                      # the int16 query's score error (I8_QK_MAX_ERR)
                st = np.float32(0.0)
                for r in range(R):
                    st = max(st, isch[hh, 0, r])
                qerr[hh] = st * np.float32(128.0) * np.float32(np.sqrt(D / 12.0))
                if kt_mode == 0 and not qerr[hh] <= I8_QK_MAX_ERR:
                    i8_qk = False
            i8q[hh] = i8_qk
            for r in range(R):
                vxh[hh, r] = 0.0
        for c0 in range(lo, hi, C):
            n = min(C, hi - c0)
            n_ = np.uint64(n)
            ci = (c0 - lo) // C
            flush = (ci + 1) % blk == 0 or c0 + C >= hi  # the block of chunks ends: its sums into the partial
            if touch:                                  # the chunk's rows of every head, front to back (DP_TOUCH)
                row_offsets(tbl, i, c0, n, bs, k_blk, h0 * k_h, k_s, koff)
                sink ^= touch_rows(kbuf, koff, n, k_es_, k_span)
                row_offsets(tbl, i, c0, n, bs, v_blk, h0 * v_h, v_s, voff)
                sink ^= touch_rows(vbuf, voff, n, v_es_, v_span)
            for hh in range(HB):
                h = h0 + hh
                qv = qvh[hh]
                q2 = q2h[hh]
                qa = qah[hh]
                qs = qsh[hh]
                rn = rnh[hh]
                vx = vxh[hh]
                isc = isch[hh]
                i8_qk = i8q[hh]
                acc = po[w, h]
                m = pm[w, h]
                ll = pl[w, h]
                anyu = pany[w, h]
                # ---- element offsets of the chunk's keys
                row_offsets(tbl, i, c0, n, bs, k_blk, h * k_h, k_s, koff)
                row_offsets(tbl, i, c0, n, bs, v_blk, h * v_h, v_s, voff)
                if Dr > 0:
                    row_offsets(tbl, i, c0, n, bs, r_blk, h * r_h, r_s, roff)
                kbu = kbuf
                vbu = vbuf
                vpf = voff                                 # the V rows QK requests on the way (NZ: their runs)
                rbu = rbuf
                if Dr > 0 and r_fs != 0:
                    r_es_, _ = elem_layout(r_kind, Dr)
                    nz_pack(rbuf, roff, n, r_es_, Dr, r_fs, ip[IP_R_FW], rscr)
                    rbu = rscr
                if v_fs != 0:
                    if pf:
                        for c in range(n):
                            vlines[c] = voff[c]
                        nz_lines(vlines, n, Dv, ip[IP_V_FW], v_fs)
                        vpf = vlines
                if kt_mode != 0:
                    token_scales(kt_tbl, i, h, c0, n, ip[IP_KT_BS], ip[IP_KT_BLK], ip[IP_KT_H], ip[IP_KT_S],
                                 kt_mode, kts, kto, tsk, tok)
                if vt_mode != 0:
                    token_scales(vt_tbl, i, h, c0, n, ip[IP_VT_BS], ip[IP_VT_BLK], ip[IP_VT_H], ip[IP_VT_S],
                                 vt_mode, vts, vto, tsv, tov)
                # int16 x int8 QK for this head and chunk (the NaN / outlier / token-scale checks)
                i8_now = not dp_qk and i8_qk and (kt_mode == 0 or _i8_tokens_ok(qerr[hh], tsk, n))
                kfs = 32                                   # bytes between a key row's 32-byte runs (qk_i8)
                k_packed = False
                if k_fs != 0:                              # NZ K: qk_i8 reads it in place, the others packed
                    if i8_now and ip[IP_K_FW] * k_es_ == 32:
                        kfs = k_fs * k_es_
                    else:
                        nz_pack(kbuf, koff, n, k_es_, D, k_fs, ip[IP_K_FW], kscr)
                        kbu = kscr
                        k_packed = True
                # ---- K chunk -> scores (the softmax scale is folded into q)
                n_qk += 1
                if dp_qk:
                    # V rows of the same keys are requested on the way. AMX: the whole 16-key blocks, 16 query rows
                    # at a time (the first group prefetches), then the rest of the keys as below
                    ka = kbu.ctypes.data
                    ko = koff
                    step = n
                    if k_kind == KIND_FP4:                 # bf16 rows first (knext: group scales, then rows),
                        row_offsets(kt_tbl, i, c0, n, ip[IP_KT_BS], ip[IP_KT_BLK], h * ip[IP_KT_H], ip[IP_KT_S],
                                    knext)
                        ka = kf16.ctypes.data
                        ko = knext
                        step = n if amx_qk else FP4_SUB    # FP4_SUB rows at a time (they stay in L1); AMX all
                    for c1 in range(0, n, step):
                        m1 = min(step, n - c1)
                        if k_kind == KIND_FP4:
                            fp4_rows(kbu, koff, c1, m1, kgs, knext, kf16, D, knext)
                        n0 = 0
                        if amx_qk:
                            n0 = m1 & ~15
                            for r0 in range(0, R, QK_MAX_ROWS):
                                qk_amx(q2.ctypes.data + r0 * q2.shape[1] * 2, q2.shape[1] * 2, ka,
                                       ko.ctypes.data + 8 * c1, n0, s.ctypes.data + r0 * s.shape[1] * 4 + 4 * c1,
                                       s.shape[1], min(QK_MAX_ROWS, R - r0), D, scale, vbuf.ctypes.data,
                                       vpf.ctypes.data + 8 * c1, n0 if pf and r0 == 0 else 0, v_row, v_es)
                        if n0 < m1:
                            d0 = c1 + n0
                            qk_dp(q2.ctypes.data, q2.shape[1] * 2, ka, ko.ctypes.data + 8 * d0, m1 - n0,
                                  s.ctypes.data + 4 * d0, s.shape[1], R, D, scale, vbuf.ctypes.data,
                                  vpf.ctypes.data + 8 * d0, m1 - n0 if pf else 0, v_row, v_es)
                elif i8_now:
                    n_i8 += 1
                    qk_i8(q2.ctypes.data, q2.shape[1] * 2, kbu.ctypes.data, koff.ctypes.data, n, s.ctypes.data,
                          s.shape[1], R, D, isc.ctypes.data, vbuf.ctypes.data, vpf.ctypes.data, n if pf else 0,
                          v_row, v_es, kfs)
                elif fma_qk or generic is None:
                    # (the build without generic paths: numba prunes every other branch when `generic` is None,
                    # which keeps the first-call compile time down)
                    qk_fma(qv.ctypes.data, qv.shape[1] * 4, kbu.ctypes.data, KIND_BF16_EO if eo_qk else k_kind,
                           koff.ctypes.data, n, s.ctypes.data,
                           s.shape[1], R, D, vbuf.ctypes.data, vpf.ctypes.data, n if pf else 0, v_row, v_es)
                elif Dr == 0 and k_kind == KIND_BF16:
                    qk_fused(qv, views(kbu)[1], k_kind, koff, n, s, R, D)
                elif Dr == 0 and k_kind == KIND_FP16:
                    qk_fused(qv, views(kbu)[1].view(np.int16), k_kind, koff, n, s, R, D)
                elif Dr == 0 and k_kind == KIND_I8:
                    qk_fused(qv, views(kbu)[0], k_kind, koff, n, s, R, D)
                elif k_kind == KIND_FP4:     # the chunk as bf16 (knext: group scales, then rows), then qk_fma
                    row_offsets(kt_tbl, i, c0, n, ip[IP_KT_BS], ip[IP_KT_BLK], h * ip[IP_KT_H], ip[IP_KT_S], knext)
                    fp4_rows(kbu, koff, 0, n, kgs, knext, kf16, D, knext)
                    qk_fma(qv.ctypes.data, qv.shape[1] * 4, kf16.ctypes.data, KIND_BF16, knext.ctypes.data, n,
                           s.ctypes.data, s.shape[1], R, D, vbuf.ctypes.data, vpf.ctypes.data, n if pf else 0, v_row,
                           v_es)
                else:
                    k8, k16, k32, kfl = views(kbu)
                    load_rows(k8, k16, k32, kfl, koff, n, k_kind, kf, 0, D)
                    if Dr > 0:
                        r8, r16, r32, rfl = views(rbu)
                        load_rows(r8, r16, r32, rfl, roff, n, r_kind, kf, D, Dr)
                    qk_block(qv, kf, s, R, n, dq)
                if kt_mode != 0:
                    for r in range(R):
                        qsr = qs[r]
                        for c in range(n_):
                            s[r, c] = (s[r, c] + tok[c] * qsr) * tsk[c]
                    if Dr == 0 and exceptional(tsk, tok, kt_mode, n):
                        if kfs != 32:                      # (NZ read in place so far: the rows, packed)
                            nz_pack(kbuf, koff, n, k_es_, D, k_fs, ip[IP_K_FW], kscr)
                            kbu = kscr
                            k_packed = True
                        exact_key_tokens(s, R, n, tsk, tok, kt_mode, kbu, k_kind, koff, qraw[hh], D, scale, kf, offs)
                elif kc_mode == 2:
                    for r in range(R):
                        qar = qa[r]
                        for c in range(n_):
                            s[r, c] += qar
                if pse_kind >= 0:
                    p8, p16, p32, pfl = views(pse)
                    sk = np.uint64(ip[IP_PSE_K])
                    for r in range(R):
                        base = (rb[r] * ip[IP_PSE_B] + rn[r] * ip[IP_PSE_N] + rs[r] * ip[IP_PSE_S]
                                + (col_base + c0) * ip[IP_PSE_K])
                        ub = np.uint64(base)
                        if pse_kind == KIND_F32:
                            for c in range(n_):
                                s[r, c] += pfl[ub + c * sk]
                        elif pse_kind == KIND_BF16:
                            for c in range(n_):
                                s[r, c] += bf16_to_f32(p16[ub + c * sk])
                        else:
                            for c in range(n_):
                                s[r, c] += fp16_to_f32(p16[ub + c * sk])
                if has_mask != 0 or has_band != 0:
                    mk = np.uint64(ip[IP_M_K])
                    for r in range(R):
                        b = rb[r]
                        il = rs[r] - geo[GEO_QLO, b]
                        pre = geo[GEO_PRE, b]
                        nxt = geo[GEO_NEXT, b]
                        j0 = c0 if prefix_pass != 0 else geo[GEO_JOFS, b] + c0
                        mbase = np.uint64(b * ip[IP_M_B] + rs[r] * ip[IP_M_S] + (col_base + c0) * ip[IP_M_K])
                        seen = 0
                        for c in range(n):
                            hide = False
                            if has_mask != 0 and mask[mbase + np.uint64(c) * mk] != 0:
                                hide = True
                            if has_band != 0:
                                j = j0 + c
                                if j > il + nxt or j < il - pre:
                                    hide = True
                            if hide:
                                s[r, c] = MASK_FILL
                            else:
                                seen = 1
                        if want_any != 0 and seen != 0:
                            anyu[r] = 1
                # ---- online softmax over the chunk (and the bf16 probabilities of pv_dp)
                sm_mode = 1 if dp_pv else (2 if i8_pv and vt_mode == 0 else 0)
                fused = softmax_chunk(s, R, n, m, ll, vx, acc, Dv, p2, sm_mode, isc[1], kshift, cll, cvx, cacc, hh)
                if v_fs != 0 and k_packed and kv_same:     # V is K (MLA's latent cache): its packed rows
                    for c in range(n):
                        voff[c] = koff[c]
                    vbu = kscr
                elif v_fs != 0:                            # (after QK, which requested its fragments)
                    nz_pack(vbuf, voff, n, v_es_, Dv, v_fs, ip[IP_V_FW], vscr)
                    vbu = vscr
                # ---- V chunk -> tacc (zero here), then into the block's sums cacc[hh]
                if vt_mode != 0:
                    if exceptional(tsv, tov, vt_mode, n):
                        exact_value_tokens(s, R, n, tsv, tov, vt_mode, vbu, v_kind, voff, Dv, tacc, vf, offs)
                    for r in range(R):
                        for c in range(n_):
                            s[r, c] *= tsv[c]
                        if vt_mode == 2:
                            t = np.float32(0.0)
                            for c in range(n_):
                                t += s[r, c] * tov[c]
                            cvx[hh, r] += t
                use_i8 = i8_pv and ((sm_mode == 2 and fused) or quant_i16(s, R, n, p2i, isc[1]))
                if dp_pv or use_i8 or fma_pv or generic is None:
                    # the next chunk's K rows are requested on the way
                    nn = 0
                    if pv_k and c0 + C < hi:
                        nn = min(C, hi - c0 - C)
                        row_offsets(tbl, i, c0 + C, nn, bs, k_blk, h * k_h, k_s, knext)
                        if k_fs != 0:
                            nz_lines(knext, nn, D, ip[IP_K_FW], k_fs)
                    if dp_pv:
                        va = vbu.ctypes.data
                        vo = voff
                        step = n
                        if v_kind == KIND_FP4:             # as K (roff: free, FP4 never has a rope)
                            row_offsets(vt_tbl, i, c0, n, ip[IP_VT_BS], ip[IP_VT_BLK], h * ip[IP_VT_H],
                                        ip[IP_VT_S], roff)
                            va = vf16.ctypes.data
                            vo = roff
                            step = n if amx_pv else FP4_SUB
                        for c1 in range(0, n, step):
                            m1 = min(step, n - c1)
                            if v_kind == KIND_FP4:
                                fp4_rows(vbu, voff, c1, m1, vgs, roff, vf16, Dv, roff)
                            pk = max(0, min(m1, nn - c1))     # the next chunk's K rows requested with these keys
                            n0 = m1 & ~15 if amx_pv else 0       # AMX: the whole 16-key blocks (they prefetch)
                            if n0 > 0:
                                pv_amx(p2.ctypes.data + 2 * c1, p2.shape[1] * 2, va, vo.ctypes.data + 8 * c1, n0,
                                       tacc.ctypes.data, Dv, R, Dv, kbuf.ctypes.data, knext.ctypes.data + 8 * c1, pk,
                                       k_row, k_es)
                                pk = 0
                            if n0 < m1:
                                d0 = c1 + n0
                                pv_dp(p2.ctypes.data + 2 * d0, p2.shape[1] * 2, va, vo.ctypes.data + 8 * d0, m1 - n0,
                                      tacc.ctypes.data, Dv, R, Dv, kbuf.ctypes.data, knext.ctypes.data + 8 * c1, pk,
                                      k_row, k_es)
                    elif use_i8:
                        pv_i8(p2.ctypes.data, p2.shape[1] * 2, vbu.ctypes.data, voff.ctypes.data, n, tacc.ctypes.data,
                              Dv, R, Dv, isc.ctypes.data + 4 * R, kbuf.ctypes.data, knext.ctypes.data, nn, k_row, k_es)
                    else:
                        pv_fma(s.ctypes.data, s.shape[1] * 4, vbu.ctypes.data, KIND_BF16_EO if eo_pv else v_kind,
                               voff.ctypes.data, n,
                               tacc.ctypes.data, Dv, R, Dv, kbuf.ctypes.data, knext.ctypes.data, nn, k_row, k_es)
                elif v_kind == KIND_BF16:
                    pv_fused(s, views(vbu)[1], v_kind, voff, n, tacc, R, Dv)
                elif v_kind == KIND_FP16:
                    pv_fused(s, views(vbu)[1].view(np.int16), v_kind, voff, n, tacc, R, Dv)
                elif v_kind == KIND_I8:
                    pv_fused(s, views(vbu)[0], v_kind, voff, n, tacc, R, Dv)
                elif v_kind == KIND_FP4:     # as K (roff: unused without rope, which FP4 never has)
                    row_offsets(vt_tbl, i, c0, n, ip[IP_VT_BS], ip[IP_VT_BLK], h * ip[IP_VT_H], ip[IP_VT_S], roff)
                    fp4_rows(vbu, voff, 0, n, vgs, roff, vf16, Dv, roff)
                    pv_fma(s.ctypes.data, s.shape[1] * 4, vf16.ctypes.data, KIND_BF16, roff.ctypes.data, n,
                           tacc.ctypes.data, Dv, R, Dv, kbuf.ctypes.data, knext.ctypes.data, 0, k_row, k_es)
                else:
                    v8, v16, v32, vfl = views(vbu)
                    load_rows(v8, v16, v32, vfl, voff, n, v_kind, vf, 0, Dv)
                    pv_block(s, vf, tacc, R, n, Dv)
                drain_chunk(cacc, hh, tacc, R, Dv)
                if flush:
                    drain_block(acc, ll, vx, cacc, cll, cvx, hh, R, Dv)
        for h in range(h0, h0 + HB):
            acc = po[w, h]
            if vt_mode == 2:
                for r in range(R):
                    x = vxh[h - h0, r]
                    for d in range(Dv):
                        acc[r, d] += x
            if eo_pv:                                      # pv_fma's even / odd channel groups back in order
                eo_rows(acc, R, Dv, tmp, True)
    sinks[0] = sink                                        # (keeps the touch loads)
    _fetch_add(stats, 0, n_i8)
    _fetch_add(stats, 1, n_qk)


@njit(nogil=True, fastmath=FM, cache=True)
def attend_items(items, counter, ip, fp, geo, work, tbl, bufs, kchan, kt_tbl, vt_tbl, po, pm, pl, pany,
                 generic, stats):
    """Items (w * (KV_N / HB) + h / HB) without the GIL. Every thread running this call takes the next item of
    `items` (longest first) through the shared atomic `counter` until none is left: dynamic
    scheduling, so a thread that loses its core to another process does not hold up the call.
    Buffers come as (address, bytes) in `bufs` (see BUF_*). `generic`: None compiles (and runs) only
    the fused bf16 / fp16 / int8 paths; an array (any) adds float32, int4 and MLA-rope K/V. stats int64 [2]: the
    chunks (x KV heads) whose QK ran the int16 query kernels and all of them are added to it (decode.QK_STATS)."""
    R = ip[IP_R]
    dq = ip[IP_D] + ip[IP_DR]
    Dv = ip[IP_DV]
    C = ip[IP_C]
    qbuf = buf_bytes(bufs, BUF_Q)
    qrbuf = buf_bytes(bufs, BUF_QR)
    qds = buf_f32(bufs, BUF_QDS)
    kbuf = buf_bytes(bufs, BUF_K)
    rbuf = buf_bytes(bufs, BUF_R)
    vbuf = buf_bytes(bufs, BUF_V)
    kts = buf_f32(bufs, BUF_KTS)
    kto = buf_f32(bufs, BUF_KTO)
    vts = buf_f32(bufs, BUF_VTS)
    vto = buf_f32(bufs, BUF_VTO)
    pse = buf_bytes(bufs, BUF_PSE)
    mask = buf_bytes(bufs, BUF_MASK)
    HB = ip[IP_HB]
    # scratch, once per call (per thread); [HB, ...]: per KV head of an item
    qv = np.zeros((HB, R, dq), np.float32)
    qa = np.zeros((HB, R), np.float32)
    qs = np.zeros((HB, R), np.float32)
    rb = np.zeros(R, np.int64)
    rn = np.zeros((HB, R), np.int64)
    rs = np.zeros(R, np.int64)
    tmp = np.zeros((1, dq), np.float32)
    offs = np.zeros(1, np.int64)
    kf = np.empty((C, dq), np.float32)
    vf = np.empty((C, Dv), np.float32)
    s = np.empty((R, C), np.float32)
    vx = np.zeros((HB, R), np.float32)
    koff = np.zeros(C, np.int64)
    voff = np.zeros(C, np.int64)
    roff = np.zeros(C, np.int64)
    tsk = np.ones(C, np.float32)
    tok = np.zeros(C, np.float32)
    tsv = np.ones(C, np.float32)
    tov = np.zeros(C, np.float32)
    q2 = np.zeros((HB, R, dq), np.uint16)       # bf16 query bits of the dp kernels
    p2 = np.zeros((R, C + 2), np.uint16)        # bf16 / int16 probabilities (pv_dp / pv_i8 read pairs: a spare column)
    isc = np.zeros((HB, 2, R), np.float32)      # the int16 query / probability scales (quant_i16)
    i8q = np.zeros(HB, np.bool_)                # the int16 query of a head is usable (quant_i16)
    sinks = np.zeros(1, np.uint64)              # what touch_rows read
    knext = np.zeros(C, np.int64)               # the next chunk's K row offsets (prefetched during PV)
    tacc = np.zeros((R, Dv), np.float32)        # a chunk's PV sums (left 0 after each chunk)
    cacc = np.zeros((HB, R, Dv), np.float32)    # the current block of chunks' acc, sum of weights, value extras
    cll = np.zeros((HB, R), np.float32)
    cvx = np.zeros((HB, R), np.float32)
    qerr = np.zeros(HB, np.float32)             # the int16 query's score error per unit key scale (I8_QK_MAX_ERR)
    qraw = np.zeros((HB, R, ip[IP_D] if ip[IP_KT_MODE] != 0 else 0), np.float32)   # exact_key_tokens' query
    kscr = np.empty(C * ip[IP_D] * elem_layout(ip[IP_K_KIND], 1)[0] if ip[IP_K_FS] != 0 else 0, np.uint8)  # nz_pack
    vscr = np.empty(C * Dv * elem_layout(ip[IP_V_KIND], 1)[0] if ip[IP_V_FS] != 0 else 0, np.uint8)
    rscr = np.empty(C * ip[IP_DR] * elem_layout(ip[IP_R_KIND], 1)[0] if ip[IP_R_FS] != 0 else 0, np.uint8)
    _items(items, counter, ip, fp, geo, work, tbl, qbuf, qrbuf, qds, kchan, kbuf, rbuf, vbuf,
           kt_tbl, kts, kto, vt_tbl, vts, vto, pse, mask, po, pm, pl, pany,
           qv, qa, qs, rb, rn, rs, tmp, offs, kf, vf, s, vx, koff, voff, roff, tsk, tok, tsv, tov, q2, p2, knext,
           isc, i8q, sinks, generic, tacc, cacc, cll, cvx, qerr, qraw, stats, kscr, vscr, rscr,
           np.zeros(C, np.int64))


# ---------------------------------------------------------------------------------------------- planning
@njit(nogil=True, cache=True)
def split_work(lens, lo, H, threads, C, min_split, per_thread):
    """Work entries [3, W] (group, lo, hi) covering [lo_i, lo_i + lens_i) of every group i, and
    wrange [2, NI] (first entry, end) per group. Sequences longer than the split length L are cut so
    that there are about `per_thread` items (entries x KV heads) per thread; L is a multiple of C."""
    ni = lens.shape[0]
    total = 0
    for i in range(ni):
        total += lens[i]
    wrange = np.zeros((2, ni), np.int64)
    if total <= 0:
        return np.zeros((3, 0), np.int64), wrange
    L = max(min_split, -(-(H * total) // (threads * per_thread)))
    L = -(-L // C) * C
    W = 0
    for i in range(ni):
        if lens[i] > 0:
            W += -(-lens[i] // L)
    work = np.empty((3, W), np.int64)
    w = 0
    for i in range(ni):
        wrange[0, i] = w
        p = lo[i]
        end = lo[i] + lens[i]
        while p < end:
            work[0, w] = i
            work[1, w] = p
            work[2, w] = min(p + L, end)
            p += L
            w += 1
        wrange[1, i] = w
    return work, wrange


# ---------------------------------------------------------------------------------------------- merge
@njit(fastmath=FM, cache=True, inline="always")
def _partials_max(pm, pl, w0, w1, h, r, M):
    """max(M, the maxima of the non-empty partials w0 <= w < w1 of row r, head h); NaN wins."""
    for w in range(w0, w1):
        lw = pl[w, h, r]
        if lw > 0 or lw != lw:
            x = pm[w, h, r]
            if x > M or x != x:
                M = x
    return M


@njit(fastmath=FM, cache=True, inline="always")
def _partials_sum(pm, pl, pany, w0, w1, h, r, M, lk, seen):
    """The sum of weights lk of the partials w0 <= w < w1 of row r, head h, rescaled to the maximum M, and whether
    any of them saw an unmasked key (seen), continued from the given ones."""
    for w in range(w0, w1):
        lw = pl[w, h, r]
        if lw > 0 or lw != lw:
            lk += lw * np.float32(np.exp(pm[w, h, r] - M))
        if pany[w, h, r] != 0:
            seen = 1
    return lk, seen


@njit(fastmath=FM, cache=True, inline="always")
def _partials_add(po, pm, pl, w0, w1, h, r, M, inv, o, Dv):
    """o[:Dv] += the partials w0 <= w < w1 of row r, head h, rescaled to the maximum M and divided by the total
    sum of weights (times inv = 1 / it): normalized as they are added, a V near float32's maximum does not overflow."""
    for w in range(w0, w1):
        lw = pl[w, h, r]
        if lw > 0 or lw != lw:
            f = np.float32(np.exp(pm[w, h, r] - M)) * inv
            for d in range(Dv):
                o[d] += po[w, h, r, d] * f


@njit(nogil=True, fastmath=FM, cache=True)
def merge(mp, geo, po, pm, pl, pany, wrange, ppo, ppm, ppl, ppany, pwrange, sink, vcs, vco, obase, obufs):
    """Combine the partials of every row; normalize; dequantize per-channel V; special rows.

    mp: int64 [B, G, Q_S, KV_N, has_prefix, has_sink, v_chan (0 none, 1 scale, 2 scale+offset),
               row_fix (a row whose every key is masked is dead), prefix batches per group, has_band].
    geo: the per-batch geometry (GEO_* rows). po/pm/pl/pany: own-key partials [W, KV_N, R(, Dv)];
    wrange [2, B]: work entries of batch b. ppo/...: prefix partials [Wp, KV_N, Rp(, Dv)], pwrange
    [2, groups]. sink [N] float32. vcs/vco [KV_N, Dv].
    Output written in place, in the output layout and dtype (no epilogue copy): obufs [2, 2] holds
    (address, bytes) of the output tensor (column 0) and the float32 lse (column 1); row s of head n
    of batch b starts at element
    obase[0, b] + n * mp[10] + s * mp[11] of out and obase[1, b] + n * mp[12] + s * mp[13] of lse;
    rows s >= obase[2, b] do not exist (packed layouts); mp[14]: 0 float32, 1 bf16, 2 fp16 output.
    A row is computed when it lies inside the query window, its batch has keys and the band leaves it
    a key; every other row is 0 with lse +inf (SPEC 4, 6).
    """
    B = mp[0]
    G = mp[1]
    QS = mp[2]
    H = mp[3]
    has_prefix = mp[4]
    has_sink = mp[5]
    v_chan = mp[6]
    row_fix = mp[7]
    pbpg = mp[8]
    has_band = mp[9]
    R = G * QS
    Dv = po.shape[3]
    o_sn = mp[10]
    o_ss = mp[11]
    l_sn = mp[12]
    l_ss = mp[13]
    okind = mp[14]
    out = buf_bytes(obufs, 0)
    lse = buf_f32(obufs, 1)
    nb = out.shape[0]
    of = out[:nb - nb % 4].view(np.float32)
    oh = out[:nb - nb % 2].view(np.uint16)
    o = np.empty(Dv, np.float32)
    for it in range(B * H):
        b = it // H
        h = it % H
        for r in range(R):
            g = r // QS
            si = r - g * QS
            n = h * G + g
            if si >= obase[2, b]:
                continue
            ob = obase[0, b] + n * o_sn + si * o_ss
            lb = obase[1, b] + n * l_sn + si * l_ss
            ok = si >= geo[GEO_QLO, b] and si < geo[GEO_QHI, b] and geo[GEO_S2, b] > 0
            if ok and has_band != 0:
                il = si - geo[GEO_QLO, b]
                jlo = max(0, il - geo[GEO_PRE, b])
                jhi = min(geo[GEO_S2, b] - 1, il + geo[GEO_NEXT, b])
                ok = jlo <= jhi
            if not ok:
                for d in range(Dv):
                    o[d] = 0.0
                _store(of, oh, okind, ob, o, Dv)
                lse[lb] = np.inf
                continue
            # the running maximum over every non-empty partial (and the sink)
            M = _partials_max(pm, pl, wrange[0, b], wrange[1, b], h, r, -np.inf)
            gi = 0
            rp = 0
            if has_prefix != 0:
                gi = b // pbpg
                rp = (b - gi * pbpg) * R + r
                M = _partials_max(ppm, ppl, pwrange[0, gi], pwrange[1, gi], h, rp, M)
            sk = np.float32(0.0)
            if has_sink != 0:
                sk = sink[n]
                if sk > M:
                    M = sk
            for d in range(Dv):
                o[d] = 0.0
            lk, seen = _partials_sum(pm, pl, pany, wrange[0, b], wrange[1, b], h, r, M, np.float32(0.0), 0)
            if has_prefix != 0:
                lk, seen = _partials_sum(ppm, ppl, ppany, pwrange[0, gi], pwrange[1, gi], h, rp, M, lk, seen)
            if row_fix != 0 and seen == 0 and has_sink == 0:
                for d in range(Dv):
                    o[d] = 0.0
                _store(of, oh, okind, ob, o, Dv)
                lse[lb] = np.inf
                continue
            lt = lk
            if has_sink != 0:
                lt = lk + np.float32(np.exp(sk - M))
            inv = np.float32(1.0) / lt
            _partials_add(po, pm, pl, wrange[0, b], wrange[1, b], h, r, M, inv, o, Dv)
            if has_prefix != 0:
                _partials_add(ppo, ppm, ppl, pwrange[0, gi], pwrange[1, gi], h, rp, M, inv, o, Dv)
            if v_chan == 1:
                for d in range(Dv):
                    o[d] = o[d] * vcs[h, d]
            elif v_chan == 2:
                lw = lk * inv                                 # (the own and prefix keys' share of the weights)
                for d in range(Dv):
                    o[d] = (o[d] + vco[h, d] * lw) * vcs[h, d]
            _store(of, oh, okind, ob, o, Dv)
            lse[lb] = M + np.float32(np.log(lt))


@njit(fastmath=FM, cache=True, inline="always")
def _store(of, oh, okind, ob, o, Dv):
    """One output row: float32, or rounded to bf16 / fp16 (round to nearest even, like torch)."""
    if okind == 0:
        for d in range(Dv):
            of[ob + d] = o[d]
    elif okind == KIND_BF16:
        for d in range(Dv):
            oh[ob + d] = f32_to_bf16_bits(o[d])
    else:
        for d in range(Dv):
            oh[ob + d] = f32_to_half_bits(o[d])


# ---------------------------------------------------------------------------------------------- one dispatch
@njit(nogil=True, cache=True)
def attend_merge(items, ip, fp, geo, work, tbl, bufs, kchan, kt_tbl, vt_tbl, generic, mp, wrange, pwrange, sink,
                 vcs, vco, obase, dims, out_addr, lse_addr, stats):
    """A single-threaded call without a prefix (fia.replay): attend_items on the calling thread, then merge, in
    one dispatch -- the partials [W, KV_N, R(, Dv)] (dims = W, KV_N, R, Dv, output bytes, lse bytes), the
    counter and obufs made here. On a small call each numba dispatch and each numpy allocation costs the
    host microseconds (the benchmark's small call)."""
    W = max(dims[0], 1)
    po = np.empty((W, dims[1], dims[2], dims[3]), np.float32)
    pm = np.empty((W, dims[1], dims[2]), np.float32)
    pl = np.zeros((W, dims[1], dims[2]), np.float32)
    pany = np.zeros((W, dims[1], dims[2]), np.uint8)
    counter = np.zeros(1, np.int64)
    attend_items(items, counter, ip, fp, geo, work, tbl, bufs, kchan, kt_tbl, vt_tbl, po, pm, pl, pany, generic,
                 stats)
    obufs = np.empty((2, 2), np.int64)
    obufs[0, 0] = out_addr
    obufs[0, 1] = lse_addr
    obufs[1, 0] = dims[4]
    obufs[1, 1] = dims[5]
    merge(mp, geo, po, pm, pl, pany, wrange, po, pm, pl, pany, pwrange, sink, vcs, vco, obase, obufs)
