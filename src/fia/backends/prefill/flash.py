"""FIA's own flash-attention kernel for the prefill backend: bf16 (CPUs with AVX512-BF16), float16 and float32;
on CPUs without AVX-512 (AVX2 + FMA) the same plan with 8-lane GEMMs (cpu/gemm_narrow.py).

A drop-in for the calls backend.py makes to ATen's CPU flash kernel, with the same contract:
    flash(q [Bq, N, L, D], k [Bq, KV_N, S, D], v [Bq, KV_N, S, Dv], is_causal, mask, scale)
      -> out [Bq, N, L, Dv] (q's dtype), lse [Bq, N, L] float32
    S = scale · Q Kᵀ (+ mask, additive, broadcast to [Bq, N, L, S]); top-left causal j <= i when is_causal;
    out = softmax(S) V with float32 accumulators; bf16: the probabilities rounded to bf16 before the PV
    product (`vdpbf16ps`, as ATen and the hardware); float16: K / V widened to float32 in registers, float32
    probabilities and FMAs (no fp16 dot product on the CPUs measured; as the decode backend's fp16 path);
    float32 (portable inputs, dequantized int8 K / V): the same float32 FMAs. Where vdpbf16ps is missing or
    slower (BF16_DP: AVX2, AVX-512 without BF16, Intel) bf16 keeps that contract with float32 FMAs: the query
    widened (exact), the probabilities rounded to bf16 values before PV, K / V widened in registers (products
    of bf16 values are exact in float32, as in `vdpbf16ps`).
Differences: a row with no finite score gets lse -inf (ATen reports 0), and Dv may differ from D.

Why: on the measured machine ATen's kernel runs the benchmark's bf16 prefill at ~35 % of the bf16 matmul
rate; the GEMMs here (cpu/gemm.py) run at ~90 % of it in cache (docs/performance.md,
"FIA's own flash kernel vs torch's"). On AVX2 CPUs ATen's kernel runs only level with SDPA; the 8-lane
variant runs 1.1-1.8x of it (docs/performance.md, "Prefill on AVX2 CPUs").
Per call: K and V are packed once into the tiles the GEMM reads (pack_items, in parallel; the size of K and
V), then the (batch entry, kv head, query block) items run on the decode backend's thread pool with dynamic
scheduling, causal items longest first.

`eligible` says when the kernel applies: CPU tensors, bf16 / float16 / float32 q / k / v (mask / bias in the
same dtype), head dims multiples of 64; bf16 where the CPU has AVX512-BF16 and no AMX-BF16 (ATen's kernel uses
the tiles there, ~5x faster), float16 where it has AVX-512 and F16C on AMD (ATen's kernel is faster on Intel),
float32 where it has AVX-512; all three on CPUs without AVX-512 that have AVX2, FMA and F16C (the 8-lane variant)
(FIA_PREFILL_OWN=1 forces all, emulated where the instructions are missing; =0 turns the kernel off).
`small_for_aten`: whole bf16 calls of at most small_aten_limit(D) query x key pairs per head, where the CPU has
AVX512-BF16, run faster on ATen's kernel; the backend sends its whole-window calls there.
"""
from __future__ import annotations

import math
import os
import struct
import threading
from typing import NamedTuple, Optional

import numpy as np
import torch

from ... import caches
from ...cpu.classes import cpu_class
from ...cpu.simd import target_has
from ...cpu.fma import NARROW
from ...cpu.gemm import F16C, HAS_DP

KT = 256            # keys per tile (scores [rows, KT] float32 stay in L2 with the packed K / V tiles)
ROWS_PER_ITEM = 96  # query rows (GQA heads x positions) per work item
# A call of fewer FLOPs runs on the calling thread alone: torch's OpenMP workers keep spinning on the other cores
# for milliseconds after each torch op, and a second FIA thread shares its core with one of them until then
# (docs/performance.md, "Work split"): below this, two threads were slower than one
PARALLEL_MIN_FLOPS = 8e8
# FIA_PREFILL_OWN: "0" never use this kernel, "1" always where eligible (emulated without F16C);
# unset: bf16 where the CPU has AVX-512 but not AMX-BF16 (vdpbf16ps on AMD with AVX512-BF16, else widened to
# float32 FMAs: gemm_bf16w; BF16_DP), float16 where it has AVX-512 and F16C on AMD, float32
# with AVX-512; all three without AVX-512 where AVX2, FMA and F16C are there (AVX2). With AMX, ATen's flash
# kernel runs its bf16 GEMMs on the tiles, faster than this kernel; without AVX-512, the 8-lane GEMMs, where ATen's
# kernel only matches SDPA (docs/performance.md, "Prefill on AVX2 CPUs" and "Kernel choices: the measurements").
_MODE = os.environ.get("FIA_PREFILL_OWN", "")
# the vendor decides three defaults below (BF16_DP, ENABLED_F16_DEFAULT, the small-call limit): the cores' FMA
# ports against their vdpbf16ps, not the instruction set (docs/performance.md, "CPU classes")
AMD = cpu_class().vendor == "AMD"
AMX_BF16 = target_has("amx-tile", "amx-bf16")
AVX2 = NARROW and target_has("avx2", "fma", "f16c")
ENABLED_DEFAULT = (target_has("avx512f") and not AMX_BF16) or AVX2
ENABLED = {"0": False, "1": True}.get(_MODE, ENABLED_DEFAULT)
# float16 with AVX-512 on AMD only: on Intel's AVX-512 CPUs ATen's kernel ran every float16 case faster (its
# float32 GEMMs on two 512-bit FMA ports; the own kernel's softmax and packing weigh more there). Emerald Rapids,
# S = 2048, own / ATen's x SDPA: causal 0.81 / 0.98, pse 0.63 / 0.98, causal pse 1.03 / 1.53, band 2.3 / 2.64; with
# Ice Lake's instruction set on that host: causal 0.82 / 0.99, pse 0.62 / 1.00. AMD Zen 4: own 1.75x SDPA (causal)
F16_NATIVE = F16C and target_has("avx512f")          # the kernel runs float16 without emulation
ENABLED_F16_DEFAULT = (F16_NATIVE and AMD) or AVX2
ENABLED_F16 = {"0": False, "1": True}.get(_MODE, ENABLED_F16_DEFAULT)
ENABLED_F32 = {"0": False, "1": True}.get(_MODE, target_has("avx512f") or AVX2)
ENABLED_FOR = {torch.bfloat16: lambda: ENABLED, torch.float16: lambda: ENABLED_F16, torch.float32: lambda: ENABLED_F32}
# BF16_DP: the bf16 GEMMs multiply with vdpbf16ps (gemm_bf16) rather than widen bf16 to float32 FMAs (gemm_bf16w).
# Where each is faster depends on the core, not the instruction set: AMD Zen 4 / 5 issue one 512-bit FMA a cycle
# and vdpbf16ps at twice that multiply rate; Intel's two 512-bit FMA ports outrun its vdpbf16ps (Emerald Rapids,
# one core, in L2: 89 against 145-155 GFLOP/s; whole causal calls 1.5x faster widened). The default follows the
# vendor; FIA_PREFILL_DP=0 / 1 forces it where HAS_DP (docs/performance.md, "CPU classes").
BF16_DP = HAS_DP and {"0": False, "1": True}.get(os.environ.get("FIA_PREFILL_DP", ""), AMD)


# A bf16 call of at most this many (query, key) positions per head runs faster on ATen's kernel where the CPU has
# AVX512-BF16 (ATen's bf16 GEMMs are native there): the own kernel's items compute 24 positions x G heads and
# 64-key blocks whatever the call's size. Whole calls, 2-core Zen 4, alternating, own / ATen: L = S = 32 1.44-1.77,
# 64 1.34-1.53, 96 1.12-1.15, 128 0.67-1.24 (8 / 2 x 64 and 32 / 8 x 128; float16: 1.03-1.05 at 32-64, kept own).
# On Intel the crossover lies far higher, and higher still for head dim 64 (Emerald Rapids, causal whole calls,
# alternating, own / ATen: 8 / 2 x 64: L = S = 32 2.14, 128 1.86, 256 1.33, 512 1.11, 1024 1.14, 2048 0.83, 4096
# 0.77; 32 / 8 x 128: 128 1.90, 256 1.22, 384 0.87, 512 0.64): SMALL_ATEN_D64 scales the limit for D <= 64.
# Callers opt in (backend._one_call: whole causal / unmasked calls).
SMALL_ATEN_POSITIONS = 64 * 64 if AMD else 320 * 320
SMALL_ATEN_D64 = 1 if AMD else 23          # (Intel: ~1536 x 1536 positions at D = 64)


def small_aten_limit(D: int) -> int:
    """The most query x key positions per head of a whole bf16 call that ATen's kernel runs faster, at head dim D."""
    return SMALL_ATEN_POSITIONS * (SMALL_ATEN_D64 if D <= 64 else 1)


def small_for_aten(dtype: torch.dtype, L: int, S: int, D: int) -> bool:
    """Whether ATen's kernel runs a whole call of L queries x S keys per head of head dim D faster
    (small_aten_limit): bf16 on AVX512-BF16 CPUs."""
    return dtype == torch.bfloat16 and HAS_DP and L * S <= small_aten_limit(D)


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> bool:
    """Whether flash() computes this call (else the caller uses ATen's kernel)."""
    dt = q.dtype
    if dt not in ENABLED_FOR or not ENABLED_FOR[dt]():
        return False
    if q.device.type != "cpu" or not (dt == k.dtype == v.dtype):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    D, Dv = q.shape[-1], v.shape[-1]
    if D % 64 or Dv % 64 or k.shape[-1] != D or D == 0 or Dv == 0:
        return False
    if q.shape[1] % k.shape[1] or k.shape[0] != q.shape[0] or v.shape[:3] != k.shape[:3] or k.shape[2] == 0:
        return False
    if mask is not None and (mask.dtype != dt or mask.dim() > 4 or mask.shape[-1] != k.shape[2] or
                             (mask.shape[-1] > 1 and mask.stride(-1) != 1)):
        return False                # keys read with unit stride (a strided or broadcast key axis would need a copy)
    return True


def _span(t: torch.Tensor) -> int:
    """How many elements from t's first one through the last one t addresses (the kernels read that 1-D span in
    place, indexing it with t's own strides)."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0


def _out_args(out: torch.Tensor, dtype: torch.dtype) -> tuple:
    """(span, (batch / head / row element strides)) of out [Bq, N, L, Dv] (its last dim unit-stride)."""
    if out.dtype != dtype or out.stride(-1) != 1 or out.device.type != "cpu":
        raise ValueError(f"out: expected a CPU {dtype} tensor with a unit-stride last dim, got {out.dtype}, "
                         f"strides {out.stride()}")
    return _span(out), out.stride()[:3]


def _mask_args(mask: Optional[torch.Tensor], shape) -> tuple:
    """fa's additive-mask entries (kernels.flash_items): (address, span) and (its element strides broadcast to
    `shape` [Bq, N, L, S], 1), or zeros without a mask. Also the broadcast view (kept alive by the caller)."""
    if mask is None:
        return (0, 0), (0, 0, 0, 0), None
    m = mask.expand(shape)
    return (m.data_ptr(), _span(m)), (*m.stride()[:3], 1), m


def user_mask_ok(um: Optional[torch.Tensor]) -> bool:
    """Whether flash() reads this user mask ([L, S], nonzero = masked) in place."""
    return um is None or (um.dim() == 2 and um.dtype in _UMASK_BYTES and
                          (um.shape[-1] <= 1 or um.stride(-1) == 1) and um.device.type == "cpu")


_UMASK_BYTES = {torch.bool: 1, torch.int8: 1, torch.uint8: 1, torch.float16: 2}


def _user_args(um: Optional[torch.Tensor]) -> tuple:
    """fa's user-mask entries: (address, bytes spanned) and (row stride in bytes, bytes per element, 1), or zeros."""
    if um is None:
        return (0, 0), (0, 0, 0)
    es = _UMASK_BYTES[um.dtype]
    return (um.data_ptr(), _span(um) * es), (um.stride(0) * es, es, 1)


V_SAFE = 2.0 ** 100     # |V| below this: the kernels' sums of weights x values stay far from float32's maximum
# the magnitude bits (sign cleared) of V_SAFE and of infinity, per V dtype (float16 never comes near V_SAFE)
_MAG = {torch.bfloat16: (0x7180, 0x7F80, 16), torch.float32: (0x71800000, 0x7F800000, 0)}


def _tame_exponent(vmag: int, dtype: torch.dtype) -> int:
    """The power of two V is scaled down by (0: none) from the largest magnitude bits of its values (pack_items'
    vmag): as backend._tame decides from |V|'s maximum -- finite values above V_SAFE only."""
    lim = _MAG.get(dtype)
    if lim is None or not lim[0] < vmag < lim[1]:
        return 0
    return math.frexp(struct.unpack("<f", struct.pack("<I", vmag << lim[2]))[0])[1]


def flash(q, k, v, is_causal: bool, mask: Optional[torch.Tensor], scale: float, out=None, lse=None,
          band=None, user_mask=None, tame: bool = False, stats: Optional[dict] = None):
    """See the module doc. Call only when eligible(q, k, v, mask). out / lse: buffers to write (tests poison
    them; out in q's dtype, any strides with a unit-stride last dim, lse contiguous float32), else allocated.
    band (pre, next): row i keeps only keys i - pre <= j <= i + next
    (with is_causal, next is capped at 0); keys outside are never computed. user_mask: [L, S] bool / int8 /
    uint8 / float16, nonzero = masked, read in place (user_mask_ok), the same for every entry and head;
    tiles it masks entirely are skipped. q, k and v are read in place, whatever their strides.
    tame: values of V above V_SAFE (finite) are scaled by a power of two first (backend._tame, from the magnitudes
    the packing saw: no pass over V of its own); the output is then that of the scaled V. stats: a dict that
    receives "tame" (the exponent, 0: none), "lse_min" (the smallest lse written, NaN if one is NaN) and "bad"
    (an output element stored infinite or NaN)."""
    from ...cpu.threads import launch
    from . import kernels as K
    q, k, v = unit_last(q), unit_last(k), unit_last(v)
    lc = _launch_of(q, k, v, is_causal, band)
    Bq, N, L, D, S, Dv = lc.dims
    kp, vp, vmag, istat = _scratch(lc)
    launch(K.pack_items, lc.packs, lc.pack_threads, (kp, vp, vmag, lc.pa, k.data_ptr(), v.data_ptr()))
    fa = lc.fa
    if not tame or out is not None or mask is not None or user_mask is not None:
        fa = fa.copy()                                       # [FA_LEN] (kernels.flash_items)
        if not tame:
            fa[K.FA_TAME:K.FA_TAME + 2] = 0
    if out is None:                                          # rows of all heads side by side, as ATen's kernel
        out = torch.empty(Bq, L, N, Dv, dtype=q.dtype).transpose(1, 2)     # [Bq, N, L, Dv] (BSND outputs: no copy)
    else:
        fa[K.FA_ON], fa[K.FA_OS:K.FA_OS + 3] = _out_args(out, q.dtype)
    if lse is None:
        lse = torch.empty(Bq, N, L, dtype=torch.float32)          # [Bq, N, L]
    elif lse.dtype != torch.float32 or not lse.is_contiguous() or lse.numel() != Bq * N * L:
        raise ValueError(f"lse: expected a contiguous float32 [Bq, N, L] tensor, got {lse.dtype} {tuple(lse.shape)}")
    if mask is not None:
        (fa[K.FA_M], fa[K.FA_MN]), fa[K.FA_MS:K.FA_MS + 4], mask = _mask_args(mask, (Bq, N, L, S))
    if user_mask is not None:
        if tuple(user_mask.shape) != (L, S):
            raise ValueError(f"user_mask: expected shape {(L, S)}, got {tuple(user_mask.shape)}")
        (fa[K.FA_U], fa[K.FA_UN]), fa[K.FA_US:K.FA_US + 3] = _user_args(user_mask)
    args = (kp, vp, vmag, istat, fa, float(scale), q.data_ptr(), out.data_ptr(), lse.data_ptr())
    launch(K.flash_items, lc.items, lc.threads, args)
    lse_min, flag = istat.min(0).tolist()                    # (one pass: the smallest lse, any bad item: -1)
    e = 0
    if flag == K.TAMED:                                      # V above the safe range: scaled, packed, run again
        e = _tame_exponent(int(vmag.max()), v.dtype)
        v = v * 2.0 ** -e                                     # (a new tensor: its own strides)
        launch(K.pack_items, lc.packs, lc.pack_threads, (kp, vp, vmag, _pack_args(k, v, S), k.data_ptr(),
                                                         v.data_ptr()))
        fa = fa.copy()
        fa[K.FA_TAME:K.FA_TAME + 2] = 0
        launch(K.flash_items, lc.items, lc.threads, (kp, vp, vmag, istat, fa, *args[5:]))
        lse_min, flag = istat.min(0).tolist()
    if stats is not None:
        stats.update(tame=e, lse_min=lse_min, bad=flag < 0)
    return out, lse


class _Scratch(threading.local):
    last = None                 # (launch, kp, vp, vmag, istat) of this thread's last small call


_SCRATCH = _Scratch()
SCRATCH_MAX = 4 << 20           # packed K / V tiles kept for the thread's next call up to this many bytes


def _scratch(lc: "_Launch") -> tuple:
    """(kp, vp, vmag, istat) for a launch: the calling thread's last ones when it was the same launch (a model's
    layers: no allocation per call; the launch's workers are done with them when flash() returns), else new
    ones, kept when small."""
    last = _SCRATCH.last
    if last is not None and last[0] is lc:
        return last[1:]
    kp, vp = np.empty(*lc.kp), np.empty(*lc.vp)              # packed K / V tiles (see kernels.pack_items)
    bufs = (kp, vp, np.empty(lc.packs.shape[0], np.int64), np.empty((lc.items.shape[0], 2), np.float32))
    if kp.nbytes + vp.nbytes <= SCRATCH_MAX:
        _SCRATCH.last = (lc, *bufs)
    return bufs


def unit_last(x: torch.Tensor) -> torch.Tensor:
    """x, or a contiguous copy where its last dim is strided: both flash kernels read each row's elements side by
    side (the own kernel reads any other strides in place; ATen's silently returns wrong numbers for a strided
    last axis, e.g. a user's `x[..., ::2]` view)."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


class _Launch(NamedTuple):
    """What flash() derives from its arguments' metadata alone (_launch_of: kept per metadata). Its arrays are
    only read by the kernels (fa is copied where a call brings its own output or masks, or no taming)."""
    dims: tuple             # Bq, N, L, D, S, Dv
    kp: tuple               # (shape, dtype) of the packed key tiles
    vp: tuple               # ... of the value tiles
    packs: np.ndarray       # pack_items' items
    pack_threads: int
    items: np.ndarray       # flash_items' items (causal-like: the longest first)
    threads: int
    pa: np.ndarray          # pack_items' argument array (kernels.PA_*)
    fa: np.ndarray          # flash_items' ... for an output flash() allocates, no masks, tame (kernels.FA_*)


_LAUNCHES = caches.BoundedCache("prefill.flash.launches", 64)


def _launch_of(q, k, v, is_causal: bool, band) -> _Launch:
    """flash()'s launch for these tensors' metadata: ~90 us of Python per call on a small call (S = 32) before it
    was kept; the tuning constants read here are part of the key (tests set them)."""
    key = (q.dtype, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), is_causal, band,
           torch.get_num_threads(), ROWS_PER_ITEM, PARALLEL_MIN_FLOPS, KT, NARROW, BF16_DP)
    lc = _LAUNCHES.get(key)
    if lc is None:
        lc = _LAUNCHES.put(key, _launch(q, k, v, is_causal, band))
    return lc


def _launch(q, k, v, is_causal: bool, band) -> _Launch:
    from . import kernels as K
    Bq, N, L, D = q.shape
    H, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = N // H
    nt = (S + KT - 1) // KT
    f16 = q.dtype != torch.bfloat16                          # uint16 elements are float16 (or float32 elements)
    wide = f16 or NARROW or not BF16_DP                      # float32 query rows and probabilities
    threads = max(1, torch.get_num_threads())
    big = L + S + 1
    pre, nxt = (big, big) if band is None else (max(min(int(band[0]), big), -big), max(min(int(band[1]), big), -big))
    if is_causal:
        nxt = min(nxt, 0)
    if 2.0 * Bq * N * _pairs(L, S, pre, nxt) * (D + Dv) < PARALLEL_MIN_FLOPS:
        threads = 1
    if f16:
        et = np.float32 if q.dtype == torch.float32 else np.uint16
        kp = ((Bq, H, nt, D, KT), et)                        # [Bq, H, nt, D, KT] key tiles transposed
        vp = ((Bq, H, nt, KT, Dv), et)                       # [Bq, H, nt, KT, Dv] value tiles
    else:
        kp = ((Bq, H, nt, D // 2, KT), np.uint32)            # [Bq, H, nt, D/2, KT] packed key tiles
        vp = ((Bq, H, nt, KT // 2, Dv), np.uint32)           # [Bq, H, nt, KT/2, Dv] packed value tiles
    n_pack = Bq * H * nt
    QB = max(1, ROWS_PER_ITEM // G)
    nqb = (L + QB - 1) // QB
    n_items = Bq * H * nqb
    items = np.arange(n_items, dtype=np.int64)
    if nxt < big and pre >= big:                              # causal-like: longest (latest query block) first
        items = items.reshape(Bq * H, nqb)[:, ::-1].T.reshape(-1).copy()
    fa = np.zeros(K.FA_LEN, np.int64)
    fa[K.FA_QN], fa[K.FA_QG:K.FA_QG + 6] = _span(q), (N, L, D, *q.stride()[:3])
    fa[K.FA_ON], fa[K.FA_OS:K.FA_OS + 3] = Bq * L * N * Dv, (L * N * Dv, Dv, N * Dv)   # flash()'s [Bq, L, N, Dv]
    fa[K.FA_BQ] = Bq
    fa[[K.FA_S, K.FA_PRE, K.FA_NXT, K.FA_QB, K.FA_F16, K.FA_WIDE]] = (S, pre, nxt, QB, f16, wide)
    fa[K.FA_TAME:K.FA_TAME + 2] = _MAG.get(v.dtype, (0, 0, 0))[:2]     # (flash(tame=False): zeros)
    return _Launch((Bq, N, L, D, S, Dv), kp, vp, np.arange(n_pack, dtype=np.int64), min(threads, n_pack), items,
                   min(threads, n_items), _pack_args(k, v, S), fa)


def _pack_args(k, v, S: int) -> np.ndarray:
    """pack_items' argument array (kernels.PA_*) of k and v: their spans and strides, S."""
    from . import kernels as K
    pa = np.zeros(K.PA_LEN, np.int64)
    pa[K.PA_KN], pa[K.PA_VN], pa[K.PA_S] = _span(k), _span(v), S
    pa[K.PA_KS:K.PA_KS + 3], pa[K.PA_VS:K.PA_VS + 3] = k.stride()[:3], v.stride()[:3]
    return pa


def _pairs(L: int, S: int, pre: int, nxt: int) -> int:
    """About how many (query, key) pairs of an [L, S] call a band (pre, nxt) keeps: rows i keep keys
    i - pre <= j <= i + nxt of [0, S) (the diagonal as the kernel's: top-left)."""
    if nxt >= S and pre >= L:
        return L * S
    kept = 0
    for i in (0, L // 2, L - 1):                  # (a band's keys per row: three rows stand for all)
        kept += max(0, min(S, i + nxt + 1) - max(0, i - pre))
    return kept * L // 3


def variant() -> str:
    """Which GEMMs the kernel runs on this CPU (for fia.explain)."""
    if NARROW:
        return "AVX2 + FMA: 8-lane float32 FMAs, 6 x 16 register blocks (cpu/gemm_narrow.py)"
    if not HAS_DP:
        return "AVX-512 without BF16: 16-lane, 6 x 64 register blocks, bf16 widened to float32 FMAs (cpu/gemm.py)"
    if not BF16_DP:
        return ("AVX-512 with BF16: 16-lane, 6 x 64 register blocks, bf16 widened to float32 FMAs (cpu/gemm.py; "
                "faster than vdpbf16ps on this CPU)")
    return "AVX-512: 16-lane, 6 x 64 register blocks (cpu/gemm.py; bf16 vdpbf16ps)"
