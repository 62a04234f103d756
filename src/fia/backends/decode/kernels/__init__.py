"""Numba kernels of the decode backend (see backend.py for the plan that feeds them), one module per stage of a
decode item:

* params.py -- the launch parameters (ip, geo, bufs layouts), the DP_* kernel-choice bits, kernel_flags;
* rows.py -- gather: row offsets (dense, paged, NZ), widening, FP4 decoding, the touch pass;
* generic.py -- QK / PV of the generic build (numba loops);
* softmax.py -- the online softmax of a chunk and the two-level sums;
* dequant.py -- int8 / int4 / FP4 dequantization factors and exceptional tokens;
* items.py -- the item driver (query rows, then chunk by chunk: gather, QK, score terms, softmax, PV);
* merge.py -- split-KV work, the merge of partials, the single-dispatch call.

Shared scalar numerics (conversions, exp) live in cpu/numerics.py; the LLVM-IR micro-kernels in cpu/.

CPU only. Everything accumulates in float32. Half-precision data is read in place as uint16 bit
patterns (numba has no float16): bf16 -> f32 is `bits << 16`; fp16 -> f32 is the bit-level widening
below (subnormals, inf and nan included). int8 is widened, int4 (eight nibbles per int32, low nibble
first, SPEC 10.4) is unpacked per row. Nothing is converted or copied ahead of the loop.

Which inner loops run QK and PV (chosen per item, see items._items):
* bf16 K / V on CPUs with AVX512-BF16: cpu.simd.qk_dp / pv_dp (bf16 dot products, LLVM IR);
* other bf16 / fp16 / int8 K / V and float32 ones (DP_F32) with head dims that are multiples of 16:
  cpu.fma.qk_fma / pv_fma (widened in registers, or loaded as they are, float32 FMAs, LLVM IR). Both read rows
  front to back and prefetch the other stream (docs/performance.md, "Micro-kernels in LLVM IR");
* the rest (int4, MLA rope, other head dims; the "generic" build): the numba loops of generic.py, which
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

Integer parameters travel in one int64 array `ip` (params.py) to keep the call overhead low.
"""
from __future__ import annotations

from ....cpu import kernel_cache

# what the package's compiled functions embed besides its own modules (cpu/kernel_cache.py). Declared before the
# modules below are imported: numba picks a function's cache locator when its decorator runs, and a module not
# declared by then is cached on its own file's stamp alone
kernel_cache.install("backends/decode/kernels/", ("cpu/numerics.py", "cpu/simd.py", "cpu/fma.py", "cpu/vnni.py",
                                                  "cpu/amx.py", "cpu/fp4.py"))
from ....cpu.numerics import (FM, bf16_to_f32, f32_to_bf16_bits, f32_to_half_bits, fexp, fexp2,  # noqa: E402,F401
                              fp16_to_f32, _f32_to_half_bits_sw, _fp16_bits_to_f32)
from .dequant import fill_factors  # noqa: E402,F401
from .items import attend_items  # noqa: E402,F401
from .merge import attend_merge, merge, replan, schedule, split_work  # noqa: E402,F401
from .params import *  # noqa: E402,F403 -- the launch layout and kernel choice (IP_*, GEO_*, BUF_*, DP_*, KF_*)
from .rows import fp4_rows, load_rows  # noqa: E402,F401
from .generic import qk_fused  # noqa: E402,F401
from .softmax import quant_i16, softmax_chunk  # noqa: E402,F401
