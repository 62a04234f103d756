"""The decode kernels' launch parameters and kernel choice: the layout of the int64 parameter array `ip` (IP_*),
of the per-batch geometry `geo` (GEO_*) and of the buffer table `bufs` (BUF_*); the DP_* bits of ip[IP_DP] that the
plan sets from the CPU (which micro-kernels and prefetch policy); `kernel_flags`, the one place that turns a launch's
parameters into the kernels its items run (KF_* bits: the items read it, fia.explain names the kernels from it).

Why each policy is the default on each CPU class: docs/performance.md ("Decode kernels: choices per CPU").
"""
from __future__ import annotations

import os
import warnings

import numpy as np
from numba import njit

from ....cpu.amx import HAS_AMX, PV_MAX_DV, QK_MAX_CHUNKS
from ....cpu.fma import NARROW
from ....cpu.simd import HAS_DP, KIND_BF16, KIND_F32, KIND_FP16, KIND_I4, KIND_I8, target_has  # noqa: F401
from ....cpu.vnni import HAS_VNNI, I8_DOT, QK_MAX_D  # noqa: F401 - I8_DOT for fia.explain
from ....cpu import kernel_cache

# Numba's cache of these kernels also follows the files whose code they embed (cpu/kernel_cache.py)
kernel_cache.install()


# FP4 K / V rows decoded to bf16 at a time before the dp kernels run on them: 64 rows of D = 128 (16 KB) stay in L1
FP4_SUB = 64
# FP4 E2M1 K / V (antiquant mode 6, SPEC 10b.1): two values a byte, low nibble first, decoded per row by fp4_rows
# with their per-token-group FLOAT8_E8M0 scales (which travel in the per-token slots: IP_KT_* / BUF_KTS, IP_VT_* /
# BUF_VTS, one byte per 32 channels); the generic loops run them (cpu.fma.KIND_BF16_EO is 5)
KIND_FP4 = 6
# ip[IP_DP] of a call (kernel choice): the bf16 dp kernels where the CPU has AVX512-BF16 (cpu.simd.HAS_DP) and
# they are the faster form (DP_DEFAULT),
# the other stream prefetched by the IR kernels (DP_NTA: with prefetchnta, not prefetcht1, where that measured
# faster). (bf16 / fp16 / int8 K and V that the dp kernels do not take
# go through the float32 FMA kernels of cpu/fma.py when the head dim is a multiple of 16.)
# int8 K / V use the 16-bit integer dot-product kernels of cpu/vnni.py where the CPU has AVX512-VNNI (or AVX2,
# for the 8-lane kernels of CPUs without AVX-512).
# DP_AHEAD: each kernel also requests its own rows AHEAD_BYTES ahead into L1 (at most 63 rows; PV leaves it out
# for int8 V, where it measured slower). The measurements behind each bit and policy below: docs/performance.md,
# "Kernel choices: the measurements".
DP_QK, DP_PV, DP_PREFETCH, DP_I8, DP_NTA, DP_AHEAD, DP_AMX, DP_AMX_ANY = 1, 2, 4, 8, 16, 32, 64, 128
# DP_EO: the FMA kernels widen bf16 K / V in even / odd halves (cpu.fma.KIND_BF16_EO): the query rows
# de-interleaved per EO_GROUP channels, PV's accumulators restored at the end
DP_EO = 256
EO_GROUP = 16 if NARROW else 32
# DP_NO_PV_K: PV does not request the next chunk's K rows (QK still requests its chunk's V rows): the "-v"
# policies below. The hardware prefetchers stream QK's K rows read front to back, not PV's passes over V
# (32 bytes per row per pass): what PV requests of the next K chunk competes with its own misses
# (docs/performance.md, "Kernel choices: the measurements").
DP_NO_PV_K = 512
# DP_TOUCH: items of several KV heads (IP_HB > 1) first read the chunk's rows of all their heads front to back
# (touch_rows: demand loads, which the hardware prefetchers stream), then run each head's kernels on them from
# the caches. One head's rows alone are 256 bytes every KV_N x 256 (BSH): no prefetcher streams that, and
# software prefetches of them did not help (docs/performance.md, "Kernel choices: the measurements"). Left out for
# launches that read at most PREFETCH_MIN_BYTES (likely cached), as the prefetch bits, and by default on AMD Zen 4
# (TOUCH_DEFAULT).
DP_TOUCH = 1024
# Which prefetch policy pays depends on the CPU: "nta+ahead" on AMD Zen 5 (AVX-512 and AVX-VNNI), "t1" on Zen 4
# (AVX-512 without AVX-VNNI: nta+ahead ran dense bf16 at 0.76-0.82x of t1's speed) and on Intel (prefetchnta lines
# land in L1 only there and are evicted before the use a chunk later), "nta-v" on AMD with AVX2 only
# (docs/performance.md, "Kernel choices: the measurements").
# The default follows the vendor (sse4a: AMD only) and, on AMD, the generation's features; FIA_DECODE_PREFETCH
# overrides it.
PREFETCH_POLICIES = {"off": 0, "t1": DP_PREFETCH, "t1+ahead": DP_PREFETCH | DP_AHEAD,
                     "nta": DP_PREFETCH | DP_NTA, "nta+ahead": DP_PREFETCH | DP_NTA | DP_AHEAD,
                     "t1-v": DP_PREFETCH | DP_NO_PV_K, "nta-v": DP_PREFETCH | DP_NTA | DP_NO_PV_K}
DP_PREFETCH_BITS = DP_PREFETCH | DP_NTA | DP_AHEAD | DP_NO_PV_K     # every bit a policy sets
AMD = target_has("sse4a")          # (AMD only; cpu.classes names the vendor the same way)
PREFETCH_DEFAULT = ("t1" if not AMD else "nta+ahead" if target_has("avx512f", "avxvnni") else
                    "t1" if target_has("avx512f") else "nta-v")
PREFETCH_POLICY = os.environ.get("FIA_DECODE_PREFETCH", "") or PREFETCH_DEFAULT
if PREFETCH_POLICY not in PREFETCH_POLICIES:     # a typo must not break `import fia`: say so, keep the default
    warnings.warn(f"FIA_DECODE_PREFETCH: expected one of {', '.join(PREFETCH_POLICIES)}, got "
                  f"{PREFETCH_POLICY!r}; using {PREFETCH_DEFAULT!r}", RuntimeWarning, stacklevel=2)
    PREFETCH_POLICY = PREFETCH_DEFAULT
# DP_AMX: the bf16 dp kernels run their whole 16-key blocks on AMX tiles (cpu/amx.py) where the CPU has them,
# for items of AMX_MIN_ROWS query rows or more (DP_AMX_ANY: any count; tests): below that, the tile loads from DRAM
# stall the core more than the faster compute gains (docs/performance.md, "Kernel choices: the measurements").
AMX_MIN_ROWS = 8
# DP_F32: float32 K / V (portable mode) run the cpu/fma.py kernels too (a plain load where the other kinds widen);
# without it the generic loops (load_rows into a float32 chunk, qk_block / pv_block), which never prefetch. Whatever
# the policy, they prefetch as "t1+ahead" (kernel_flags; only "off" turns it off): a float32 chunk is twice a bf16
# one (128 KB of K and of V at D = 128), and prefetchnta (into L1) or t0 lines of the other stream are evicted before
# their use. Their items of several KV heads (IP_HB) run no touch pass (DP_TOUCH): it reads a float32 chunk (2 MB
# of K and V at 8 heads of 128) with nothing to overlap; the heads' kernels request their own rows as for one head
# (docs/performance.md, "Kernel choices: the measurements").
DP_F32 = 2048
# The touch pass by default only where the prefetch policy is not "t1" (AMD Zen 3 and Zen 5): under "t1" (AMD
# Zen 4, Intel) the heads' own kernels, each requesting its rows ahead (kernel_flags), ran items of all KV heads
# faster without it (Zen 4: 1.07-1.14x; Intel Emerald Rapids: 1.27-1.46x; docs/performance.md, "Token-major K / V:
# items of all KV heads").
TOUCH_DEFAULT = PREFETCH_DEFAULT != "t1"
# The bf16 dp kernels (DP_QK / DP_PV) by default where `vdpbf16ps` outruns float32 FMAs: on AMD (Zen 4 / 5: one
# 512-bit FMA a cycle, `vdpbf16ps` twice its rate) and with AMX (whose tiles run the larger items on the dp path).
# Intel's two 512-bit FMA ports run bf16 widened in even / odd halves (DP_EO) faster than its `vdpbf16ps`: Emerald
# Rapids, in cache 1.1-1.15x, from DRAM FP4 1.1x, token-major 1.03-1.1x, dense level (docs/performance.md, "CPU
# classes"). FIA_DECODE_DP=1 forces them (where the CPU has the instruction, or emulated), =0 leaves them out.
DP_DEFAULT = HAS_DP and (os.environ.get("FIA_DECODE_DP") == "1" or AMD or target_has("amx-tile"))
# FIA_DECODE_TOUCH=0 / 1 turns DP_TOUCH off / on, FIA_DECODE_F32=0 DP_F32 off, FIA_DECODE_EO=0 DP_EO off
# (A / B measurements)
DP_FLAGS = ((DP_QK | DP_PV if DP_DEFAULT else 0) | (DP_I8 if HAS_VNNI else 0) | (DP_AMX if HAS_AMX else 0)
            | (0 if os.environ.get("FIA_DECODE_EO", "1") == "0" else DP_EO) | PREFETCH_POLICIES[PREFETCH_POLICY]
            | (DP_TOUCH if {"0": False, "1": True}.get(os.environ.get("FIA_DECODE_TOUCH", ""), TOUCH_DEFAULT) else 0)
            | (0 if os.environ.get("FIA_DECODE_F32", "1") == "0" else DP_F32))
AHEAD_BYTES = 8192              # 32 rows of bf16 / fp16 at D = 128, 63 of int8
MASK_FILL = np.float32(-1e12)
# The int16 query of the cpu/vnni.py QK kernels (quant_i16: one step per row, max |q~| / 32767) is used only while
# its rounding keeps every score within I8_QK_MAX_ERR: the bound is the score error's standard deviation for keys
# of int8 magnitude (|k| <= 128) of random signs, step * 128 * sqrt(D / 12) (times the largest per-token key scale
# of a chunk). Past it (a query with an outlier channel: the step grows with that channel, every other channel
# loses precision) QK runs the float32 FMA kernels. 2^-11 is half an fp16 ulp of relative weight error: the output
# stays within 2 fp16 ulp of the reference (tests/reliability/test_reliability_decode.py); an ordinary query (randn, per-channel
# scales 0.004-0.02, D = 128) sits near 1e-4 of it, an outlier channel of 20-30 (x the softmax scale) reaches it.
I8_QK_MAX_ERR = np.float32(2.0 ** -11)
# Per-token dequant factors whose product with an int8 value (|x + offset| * |scale|) may exceed EXC_FACTOR, or that
# are NaN / infinite: that token's scores (key) or value rows (value) are computed as the reference does, element by
# element (x + offset) * scale in float32, so that an overflow to inf, inf * 0 and inf - inf give what they give
# there (folding the scale out of the dot product would turn the NaN of inf - inf into a finite or one-signed score).
EXC_FACTOR = np.float32(2.0 ** 100)
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
# a lengths replay's re-plan inside attend_merge (plan.lengths_params): int64 lp [LP_LEN]
(LP_NG, LP_THREADS, LP_MIN_SPLIT, LP_PER_THREAD, LP_H, LP_R, LP_MIN_WORK, LP_MIN_BYTES, LP_FLAGS, LP_FLAGS_SMALL,
 LP_PREFETCH_MIN) = range(11)
LP_LEN = 11
# attend_merge's launch array L (int64): a head of (offset, rows, columns) per part (a 1-D part: columns 1), then
# the parts -- one array to unbox per call instead of eleven (~1 us each in a model, where every object is cold)
(LA_ITEMS, LA_IP, LA_GEO, LA_WORK, LA_MP, LA_WRANGE, LA_PWRANGE, LA_OBASE, LA_DIMS, LA_LP, LA_UNITS) = range(11)
LA_PARTS = 11
# buffers reach the kernels as (address, bytes) pairs: bufs int64 [2, BUF_LEN]
(BUF_Q, BUF_QR, BUF_QDS, BUF_K, BUF_R, BUF_V, BUF_KTS, BUF_KTO, BUF_VTS, BUF_VTO, BUF_PSE, BUF_MASK) = range(12)
BUF_LEN = 12
# factor specs (fill_factors): one row per factor tensor, FS_* columns
FS_ADDR, FS_KIND, FS_GRAN, FS_SHAPE, FS_STRIDE, FS_LEN = 0, 1, 2, 3, 7, 11
GRAN_TENSOR, GRAN_CHANNEL, GRAN_HEAD = 0, 1, 2
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
    # ... bf16 ones widened in even / odd halves (DP_EO) where the head dim holds whole groups: 16 channels on 8
    # lanes; on 16 lanes 32 for QK, 64 for PV (its passes widen pairs of 32-channel groups). FP4 off the dp kernels
    # too: the generic build decodes each chunk to bf16 rows for the same FMA kernels
    eo = (ip[IP_DP] & DP_EO) != 0
    bf16_k = ((f & KF_FMA_QK) != 0 and k_kind == KIND_BF16) or (k_kind == KIND_FP4 and (f & KF_DP_QK) == 0)
    bf16_v = ((f & KF_FMA_PV) != 0 and v_kind == KIND_BF16) or (v_kind == KIND_FP4 and (f & KF_DP_PV) == 0)
    if eo and bf16_k and (NARROW or D % 32 == 0):
        f |= KF_EO_QK
    if eo and bf16_v and (NARROW or Dv % 64 == 0):
        f |= KF_EO_PV
    if (ip[IP_DP] & DP_PREFETCH) != 0:             # prefetch the other stream inside the IR kernels
        f |= KF_PREFETCH
        # float32 K or V: "t1+ahead" whatever the policy (see DP_F32)
        wide = k_kind == KIND_F32 or v_kind == KIND_F32
        if (ip[IP_DP] & DP_NTA) != 0 and not wide:     # with prefetchnta (see DP_NTA)
            f |= KF_NTA
        if (ip[IP_DP] & DP_NO_PV_K) == 0 or wide:      # PV requests the next chunk's K rows (see DP_NO_PV_K)
            f |= KF_PV_K
        # own rows ahead (see DP_AHEAD): QK, PV except int8 V; also for items of several KV heads without the touch
        # pass (TOUCH_DEFAULT), whose rows of one head no hardware prefetcher streams
        several = ip[IP_HB] > 1 and (ip[IP_DP] & DP_TOUCH) == 0
        if (ip[IP_DP] & DP_AHEAD) != 0 or wide or several:
            f |= KF_AHEAD_K
            if v_kind != KIND_I8:
                f |= KF_AHEAD_V
    # items of several KV heads read each chunk's rows front to back first (DP_TOUCH), but not float32 ones in the
    # IR kernels (see DP_F32)
    if ((ip[IP_DP] & DP_TOUCH) != 0 and ip[IP_HB] > 1
            and not (k_kind == KIND_F32 and v_kind == KIND_F32 and (f & KF_FMA_QK) != 0 and (f & KF_FMA_PV) != 0)):
        f |= KF_TOUCH
    return f


# what the package re-exports as the kernels' namespace (decode.loader.K): the constants and kernel_flags
__all__ = [n for n in dir() if n.isupper()] + ["kernel_flags"]
