"""int8 K / V micro-kernels of the decode backend with 16-bit integer dot products (AVX512-VNNI `vpdpwssd`).

Why: int8 K / V halve the bytes of bf16, but the float32 FMA kernels (fma.py) must widen every int8
element (sign extension + convert per 16 values) and multiply 16 lanes per instruction, which left int8
decode at bf16's speed (docs/performance.md, "int8: int16 operands"). `vpdpwssd` multiplies 32 int16 pairs
and accumulates them into 16 int32 lanes in one instruction; an int8 value only needs a sign extension to int16.

The float operand is quantized to int16 by the caller (decode.kernels.softmax.quant_i16): one float32 scale per row
(max |x| / 32767), values rounded to nearest. That is an error of half a step, 1.53e-5 of the row's
largest magnitude per element: below the rounding of the fp16 / bf16 operands the hardware multiplies (its cube
unit takes the dequantized K in fp16 / bf16 and P rounded to fp16 / bf16). The integer products and sums
are exact; the 16 lanes are converted to float32 before they are summed (docs/DECISIONS.md decision 24).

* `qk_i8`: s[r, c] = qs[r] * sum_d q[r, d] * k_c[d] for int16 query rows q, scale qs (float32 per row),
  int8 key rows. Lane sums stay below 2^31 for D <= 8192 (D / 16 products of |q k| <= 32767 * 128 each;
  8 lanes: D / 8 products, D <= 4096: QK_MAX_D).
* `pv_i8`: acc[r, :] += ws[r] * sum_c w[r, c] * v_c[:] for int16 weights w (pairs of keys, as pv_dp),
  scale ws (float32 per row), int8 value rows. Keys are summed in blocks of 512 (each lane: at most 512
  products of |w v| <= 32767 * 128, below 2^31), each block added to the float32 accumulators.

CPUs without AVX-512 (fma.NARROW: 16 vector registers of 8 lanes) run 8-lane forms of both kernels
(fma.qk_narrow with an int16 QKOp, _pv_narrow_i8) on AVX2 `vpmaddwd` (pairwise int16 products summed
into int32 lanes) plus an add: the same integer arithmetic, 8 lanes per instruction. On a CPU without the
instruction the same IR computes the products with int32 multiplies (exact), so the code always compiles; the
backend selects these kernels where the instruction of the width exists (`HAS_VNNI`: AVX512-VNNI, or AVX2 for
the narrow ones), or when forced for testing (FIA_DECODE_VNNI=1). The kernels that
embed this IR are rebuilt when this file changes (cpu/kernel_cache.py).
"""
from __future__ import annotations

import os

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .fma import NARROW, fmadd, qk_narrow
from .simd import (F32, I16, I32, I64, V16F, V16I, V32H, PVOp, QKOp, ACC_BACK, c64, declare, first_only, gep,
    load, other_stream, outlined, pair_blocks, prefetch_ahead, prefetch_rows, ptr, pv_pairs_kernel,
    qk_kernel, row_blocks, shared, shuffle, splat, store, var, QK_UNROLLED, target_has)

_HOST_VNNI = target_has("avx512vnni", "avx512bw", "avx512f")
_HOST_AVX2 = target_has("avx2")
# FIA_DECODE_VNNI: "0" never use these kernels, "1" always (emulated where the CPU lacks the instruction),
# unset: where the CPU has the instruction of its width: AVX512-VNNI, or AVX2 `vpmaddwd` for the 8-lane
# (NARROW) kernels of CPUs without AVX-512, where they beat the float32 FMA kernels
# (docs/performance.md, "Kernel choices: the measurements")
HAS_VNNI = {"0": False, "1": True}.get(os.environ.get("FIA_DECODE_VNNI", ""),
                                       _HOST_AVX2 if NARROW else _HOST_VNNI)
I8_DOT = "AVX2 vpmaddwd" if NARROW else "AVX512-VNNI"     # the instruction, for fia.explain
QK_MAX_D_WIDE, QK_MAX_D_NARROW = 8192, 4096               # int32 lanes of D / 16 (D / 8) products stay < 2^31
QK_MAX_D = QK_MAX_D_NARROW if NARROW else QK_MAX_D_WIDE

_V32B = ir.VectorType(ir.IntType(8), 32)
_ZERO_I = ir.Constant(V16I, [0] * 16)
_EVEN = list(range(0, 32, 2))
_ODD = list(range(1, 32, 2))
# LLVM 22 spells the operands <32 x i16> (older versions <16 x i32>; both are accepted by 22's auto-upgrade)
_WORDS = llvm.llvm_version_info[0] >= 22


def _dpw(b: ir.IRBuilder, acc, x, y):
    """acc[l] += x[2l] * y[2l] + x[2l + 1] * y[2l + 1] for int16 pairs x, y (<16 x i32> or <32 x i16>)."""
    if _HOST_VNNI:
        t = V32H if _WORDS else V16I
        fn = declare(b, "llvm.x86.avx512.vpdpwssd.512", ir.FunctionType(V16I, [V16I, t, t]))
        return b.call(fn, [acc, b.bitcast(x, t), b.bitcast(y, t)])
    x, y = b.bitcast(x, V32H), b.bitcast(y, V32H)            # emulation: int32 products of the halves
    ev = [b.sext(shuffle(b, v, v, _EVEN), V16I) for v in (x, y)]
    od = [b.sext(shuffle(b, v, v, _ODD), V16I) for v in (x, y)]
    return b.add(b.add(acc, b.mul(*ev)), b.mul(*od))


_V8I = ir.VectorType(I32, 8)
_V8F = ir.VectorType(F32, 8)
_V16H = ir.VectorType(I16, 16)
_V16B = ir.VectorType(ir.IntType(8), 16)


def _pmadd8(b, acc, x, y):
    """acc[l] += x[2l] * y[2l] + x[2l + 1] * y[2l + 1] for <16 x i16> x, y and <8 x i32> acc: the narrow
    (8-lane) form of _dpw, AVX2 `vpmaddwd` + `vpaddd` (int32 products of the halves where AVX2 is absent)."""
    if _HOST_AVX2:
        fn = declare(b, "llvm.x86.avx2.pmadd.wd", ir.FunctionType(_V8I, [_V16H, _V16H]))
        return b.add(acc, b.call(fn, [x, y]))
    ev = [b.sext(shuffle(b, v, v, _EVEN[:8]), _V8I) for v in (x, y)]
    od = [b.sext(shuffle(b, v, v, _ODD[:8]), _V8I) for v in (x, y)]
    return b.add(b.add(acc, b.mul(*ev)), b.mul(*od))


def _widen_i8(b, p):
    """32 int8 at byte p as <32 x i16>."""
    return b.sext(load(b, p, _V32B), V32H)


def _row_scale(b, addr, r):
    """The float32 scale of row r (an i64 value) of the float32 array at addr."""
    return b.load(gep(b, ptr(b, addr, F32), r), align=4)


# ---------------------------------------------------------------------------------------------- QK
@intrinsic
def qk_i8(typingctx, qaddr, q_rs, kaddr, offaddr, n, saddr, s_rs, R, D, qsaddr, xaddr, xoffaddr, xn, xrow, xes,
          kfs):
    """s[r, c] = qs[r] * q[r, :D] . K[c, :D], r < R, c < n. q: int16 at qaddr, rows q_rs bytes apart; qs:
    float32 per row at qsaddr; key c: int8 at element offs[c] of the buffer at kaddr; offs: int64 at offaddr;
    s: float32 at saddr, rows s_rs elements apart. D % 32 == 0, D <= QK_MAX_D. Prefetching as simd.qk_dp.
    kfs: bytes from one 32-byte run of a key row to the next: 32 for rows of one run, block_size x 32 for a
    5-D NZ cache (SPEC 8b), read in place (every load is 32 or 16 bytes of one fragment)."""
    sig = types.void(*([types.int64] * 16))

    def body(b, args):
        qa, qrs, ka, oa, n_, sa, srs, R_, D_, qsa = args[:10]

        def _scaled(b, r0, NR, NC, v):
            """Row-major scores times their row's scale qs[r0 + r]."""
            scs = [_row_scale(b, qsa, b.add(r0, c64(r))) for r in range(NR)]
            sv = ir.Constant(ir.VectorType(F32, NR * NC), None)
            for i in range(NR * NC):
                sv = b.insert_element(sv, scs[i // NC], ir.Constant(I32, i))
            return b.fmul(v, sv)

        if NARROW:        # 8 lanes: 16 int8 keys (sign-extended) x 16 int16 query values per vpmaddwd
            op = QKOp(1, 16, 32, _V16H, ir.Constant(_V8I, [0] * 8),
                      lambda b, p: b.sext(load(b, p, _V16B), _V16H), _pmadd8, lambda b, a: b.sitofp(a, _V8F),
                      _scaled)
            qk_narrow(b, op, qa, qrs, ka, ptr(b, oa, I64), sa, srs, R_, n_, D_, other_stream(b, *args[10:15]),
                      kfs=args[15])
            return
        op = QKOp(1, 32, 64, V32H, _ZERO_I, _widen_i8, _dpw, lambda b, a: b.sitofp(a, V16F), _scaled)
        qk_kernel(b, op, qa, qrs, ka, ptr(b, oa, I64), sa, srs, R_, n_, D_, other_stream(b, *args[10:15]), 32,
                  QK_UNROLLED, kfs=args[15])

    def codegen(context, builder, signature, args):
        return outlined(context, builder, "fia_qk_i8", args, body)
    return sig, codegen


# ---------------------------------------------------------------------------------------------- PV
def _pv_op(b, wsa, r0):
    """int32 accumulators per block of keys, added to the float32 ones times the row's weight scale."""
    def acc_in(b, r, m0, m1):
        return _ZERO_I, _ZERO_I

    def acc_out(b, r, lo, hi, m0, m1):
        scv = splat(b, _row_scale(b, wsa, b.add(r0, c64(r))), 16)
        lo, hi = b.sitofp(lo, V16F), b.sitofp(hi, V16F)
        fma = declare(b, "llvm.fma.v16f32", ir.FunctionType(V16F, [V16F, V16F, V16F]))
        for half, m in ((ACC_BACK[:16], m0), (ACC_BACK[16:], m1)):
            store(b, b.call(fma, [shuffle(b, lo, hi, half), scv, load(b, m, V16F, 4)]), m, 4)

    return PVOp(1, _widen_i8, _dpw, acc_in, acc_out, 512)


# two rows' 16 channels interleaved byte by byte, channels 0-7 and 8-15 (`vpunpcklbw` / `vpunpckhbw`: one
# 16-byte load per row for two chunks, faster than an 8-byte load per row and chunk)
# (docs/performance.md, "Kernel choices: the measurements")
_PAIR_BYTES = [[x for i in range(h, h + 8) for x in (i, 16 + i)] for h in (0, 8)]


def _pv_narrow_i8(b, wa, w_rs, va, offp, n, aa, a_rs, R, Dv, wsa, x):
    """pv_i8's body on 8-lane vectors (as fma.qk_narrow): blocks of NR rows (4, 2, 1) x DG = 8 / NR
    chunks of 8 channels per pass over the keys, 8 int32 accumulators of `vpmaddwd` sums over key pairs (the
    two keys' bytes interleaved); blocks of 512 keys (see pv_i8), each added to the float32 accumulators
    times ws[r]."""
    vbase = ptr(b, va)

    def rows_of(NR, r0):
        DG = 8 // NR
        ngroups = b.udiv(Dv, c64(8 * DG))
        p0 = b.add(wa, b.mul(r0, w_rs))
        x_ = shared(b, x, r0, R, 4)
        scs = [splat(b, _row_scale(b, wsa, b.add(r0, c64(r))), 8) for r in range(NR)]
        with cgutils.for_range(b, ngroups) as g:
            dbyte = b.mul(g.index, c64(8 * DG))
            xg = first_only(b, x_, g.index)
            ms = [[gep(b, ptr(b, aa), b.add(b.mul(c64(4), b.add(b.mul(a_rs, b.add(r0, c64(r))), dbyte)),
                                              c64(32 * ch)))
                   for ch in range(DG)] for r in range(NR)]

            def step(accs, c, second):
                """Keys c and (second: c + 1 | else: weight 0, the row of c read twice)."""
                ra = gep(b, vbase, b.add(b.load(gep(b, offp, c)), dbyte))
                rb = gep(b, vbase, b.add(b.load(gep(b, offp, b.add(c, c64(1 if second else 0)))), dbyte))
                prefetch_rows(b, xg, c, 2)
                prefetch_ahead(b, xg, va, offp, n, Dv, c64(1), c, 2)
                pairs = []                   # 16 bytes of each row -> two chunks of interleaved pairs
                for ch in range(0, DG, 2):
                    la, lb = (load(b, gep(b, p, c64(8 * ch)), _V16B) for p in (ra, rb))
                    pairs += [b.sext(shuffle(b, la, lb, half), _V16H) for half in _PAIR_BYTES]
                for r in range(NR):
                    pp = gep(b, ptr(b, p0), b.add(b.mul(w_rs, c64(r)), b.mul(c, c64(2))))
                    w = b.load(b.bitcast(pp, I32.as_pointer()), align=2)
                    if not second:
                        w = b.and_(w, ir.Constant(I32, 0xFFFF))
                    wv = b.bitcast(splat(b, w, 8), _V16H)
                    for ch in range(DG):
                        b.store(_pmadd8(b, b.load(accs[r][ch]), wv, pairs[ch]), accs[r][ch])

            def finish(accs):
                for r in range(NR):
                    for ch in range(DG):
                        acc = b.sitofp(b.load(accs[r][ch]), _V8F)
                        store(b, fmadd(b, acc, scs[r], load(b, ms[r][ch], _V8F, 4)), ms[r][ch], 4)
            pair_blocks(b, n, 512, lambda: [[var(b, ir.Constant(_V8I, [0] * 8)) for _ in range(DG)]
                                             for _ in range(NR)], step, finish)
    row_blocks(b, R, rows_of)


@intrinsic
def pv_i8(typingctx, waddr, w_rs, vaddr, offaddr, n, aaddr, a_rs, R, Dv, wsaddr, xaddr, xoffaddr, xn, xrow, xes):
    """acc[r, :Dv] += ws[r] * sum_c w[r, c] * V[c, :Dv], r < R, c < n. w: int16 at waddr, rows w_rs bytes
    apart, read as (w[r, c], w[r, c + 1]) pairs (one readable entry past n - 1 when n is odd: its weight
    is masked to 0); ws: float32 per row at wsaddr; value c: int8 at element offs[c] of the buffer at vaddr;
    acc: float32 at aaddr, rows a_rs elements apart. Dv % 64 == 0. Prefetching as simd.pv_dp."""
    sig = types.void(*([types.int64] * 15))

    def body(b, args):
        wa, wrs, va, oa, n_, aa, ars, R_, Dv_, wsa = args[:10]
        if NARROW:
            _pv_narrow_i8(b, wa, wrs, va, ptr(b, oa, I64), n_, aa, ars, R_, Dv_, wsa, other_stream(b, *args[10:]))
            return
        pv_pairs_kernel(b, lambda r0: _pv_op(b, wsa, r0), wa, wrs, va, ptr(b, oa, I64), n_, aa, ars, R_, Dv_,
                         other_stream(b, *args[10:]))

    def codegen(context, builder, signature, args):
        return outlined(context, builder, "fia_pv_i8", args, body)
    return sig, codegen

