"""GEMM micro-kernels of the prefill flash kernel (bf16: AVX512-BF16 `vdpbf16ps`; fp16: widen + FMA), as LLVM IR.

Why: ATen's CPU flash kernel (what SDPA runs) reaches ~35 % of this machine's bf16 matmul rate on the
benchmark's prefill cases (docs/performance.md, "FIA's own flash kernel vs torch's"); a register-blocked
`vdpbf16ps` loop reaches ~90 % of it in cache (measured: 195 GFLOP/s QK, 227 GFLOP/s PV on one core).

`gemm_bf16`: C[R, NCOL] (float32, `=` or `+=`) = sum over pairs p of A[r, p] * B[p, :] where
* A: rows of bf16 *pairs* (one dword = two consecutive elements of the reduction axis), rows a_rs bytes apart;
* B: the other operand "VNNI-packed": row p holds, for every output column c, the dword (x[2p, c], x[2p+1, c]),
  rows b_rs bytes apart.
For QK, A = query rows (pairs along the head dim) and B = a key tile packed [D/2, keys]; for PV, A = bf16
probabilities (pairs along keys) and B = a value tile packed [keys/2, Dv]. Blocks of NR = 6 rows x 64
columns (24 accumulators): per pair step 4 loads of B, 6 broadcasts of A, 24 `vdpbf16ps`. R must be a
multiple of 6 and NCOL of 64 (the callers pad their scratch). Products of bf16 values are exact in float32;
the sums accumulate in float32 (bf16 subnormals count as zero, as in simd.py).

`gemm_bf16w`: gemm_bf16 where AVX512-BF16 is missing (AVX-512 without BF16: Skylake-SP to Ice Lake): A float32
rows (the query widened once per item, the probabilities rounded to bf16 values), B as gemm_bf16's, each pair
widened in registers to its even / odd halves, float32 FMAs.

`gemm_f16`: the same blocks for float16 operands (no fp16 dot product on the CPUs measured): A float32 rows
(the query converted once per item, the probabilities unrounded), B float16 rows widened in registers
(`vcvtph2ps`), float32 FMAs (a key tile transposed [D, keys] for QK, value rows [keys, Dv] for PV).

The prefill kernels that embed this IR are rebuilt when this file (or simd.py) changes (cpu/kernel_cache.py).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .fma import F16C, fmadd, widen, widen_eo
from .simd import (F32, HAS_DP, I32, KIND_FP16, V16F, V16I, c64, dp, gep, load, outlined, ptr, splat, store, var)

NR, NJ = 6, 4                 # rows x 16-column vectors per register block (24 of the 32 zmm registers)
ROWS = NR                     # R must be a multiple of this
COLS = 16 * NJ                # NCOL must be a multiple of this
__all__ = ["F16C", "HAS_DP", "ROWS", "COLS", "gemm_bf16", "gemm_bf16w", "gemm_f16", "gemm_f32"]


class _Op(NamedTuple):
    """What a GEMM variant loads and multiplies (see _block)."""
    b_vec: int           # bytes of B per 16-column vector (and 16 x bytes per column)
    load_b: Callable     # (b, p) -> <16 x float or i32> B operand at byte p
    madd: Callable       # (b, acc, splat A dword / float as <16 x i32>, B operand) -> acc


def _fma_madd(b, acc, wv, bv):
    return fmadd(b, b.bitcast(wv, V16F), bv, acc)


_BF16 = _Op(64, lambda b, p: load(b, p, V16I, 4), dp)
_F16 = _Op(32, lambda b, p: widen(b, p, KIND_FP16), _fma_madd)
_F32 = _Op(64, lambda b, p: load(b, p, V16F, 4), _fma_madd)


def register_block(b, vt, nr, nj, a0, a_rs, bp0, b_rs, nk, c0, c_rs, acc_in, load_b, b_vec, step):
    """The loops of one nr x nj-vector register block (this module's and gemm_narrow.py's): accumulators of
    type vt loaded from C (acc_in) or zero; per reduction step p the nj B operands load_b(b, address) at
    b_vec bytes apart in B's row p, then step(b, p, arow, bv, accs) does the block's multiply-adds (arow: the
    nr A row pointers); the accumulators stored back to C's rows (c_rs bytes apart from c0)."""
    vb = 4 * vt.count
    crow = [gep(b, ptr(b, c0), b.mul(c_rs, c64(r))) for r in range(nr)]
    if acc_in:
        accs = [[var(b, load(b, gep(b, crow[r], c64(vb * j)), vt, 4)) for j in range(nj)] for r in range(nr)]
    else:
        zero = ir.Constant(vt, [0.0] * vt.count)
        accs = [[var(b, zero) for _ in range(nj)] for _ in range(nr)]
    arow = [ptr(b, b.add(a0, b.mul(a_rs, c64(r)))) for r in range(nr)]
    with cgutils.for_range(b, nk) as lp:
        p = lp.index
        brow = gep(b, ptr(b, bp0), b.mul(p, b_rs))
        step(b, p, arow, [load_b(b, gep(b, brow, c64(b_vec * j))) for j in range(nj)], accs)
    for r in range(nr):
        for j in range(nj):
            store(b, b.load(accs[r][j]), gep(b, crow[r], c64(vb * j)), 4)


def _block(b, op, a0, a_rs, bp0, b_rs, npair, c0, c_rs, acc_in):
    """One NR x COLS block: A rows at a0, B columns starting at bp0, C at c0."""
    def step(b, p, arow, bv, accs):
        for r in range(NR):
            w = b.load(b.bitcast(gep(b, arow[r], b.mul(p, c64(4))), I32.as_pointer()), align=2)
            wv = splat(b, w, 16)
            for j in range(NJ):
                b.store(op.madd(b, b.load(accs[r][j]), wv, bv[j]), accs[r][j])
    register_block(b, V16F, NR, NJ, a0, a_rs, bp0, b_rs, npair, c0, c_rs, acc_in, op.load_b, op.b_vec, step)


def gemm_body(block: Callable, nr: int, cols: int, col_bytes: int) -> Callable:
    """The body of a GEMM intrinsic (args aaddr, a_rs, baddr, b_rs, nk, caddr, c_rs, R, NCOL, accumulate): column
    blocks of `cols` (col_bytes of B each) x row blocks of `nr`, each emitted by block(b, a0, a_rs, bp0, b_rs, nk,
    c0, c_rs, acc_in); one copy of the loops for `=` and one for `+=` (gemm_narrow.py shares it)."""
    def body(b, args):
        aa, ars, ba, brs, nk, ca, crs, R_, N_, acc = args
        nrb = b.udiv(R_, c64(nr))

        def blocks(acc_in):
            with cgutils.for_range(b, b.udiv(N_, c64(cols))) as jl:
                j0 = b.mul(jl.index, c64(cols))
                with cgutils.for_range(b, nrb) as rl:
                    r0 = b.mul(rl.index, c64(nr))
                    block(b, b.add(aa, b.mul(r0, ars)), ars, b.add(ba, b.mul(j0, c64(col_bytes))), brs, nk,
                          b.add(ca, b.add(b.mul(r0, crs), b.mul(j0, c64(4)))), crs, acc_in)
        with b.if_else(b.icmp_unsigned("!=", acc, c64(0))) as (then, otherwise):
            with then:
                blocks(True)
            with otherwise:
                blocks(False)
    return body


def gemm_intrinsic(body: Callable, name: str, doc: str):
    """A numba intrinsic (aaddr, a_rs, baddr, b_rs, nk, caddr, c_rs, R, NCOL, accumulate) running `body` (gemm_body)
    as its own outlined function `name`."""
    def gemm(typingctx, aaddr, a_rs, baddr, b_rs, nk, caddr, c_rs, R, NCOL, accumulate):
        sig = types.void(*([types.int64] * 10))

        def codegen(context, builder, signature, args):
            return outlined(context, builder, name, args, body)
        return sig, codegen
    gemm.__name__ = gemm.__qualname__ = name
    gemm.__doc__ = doc
    return intrinsic(gemm)


def _gemm_intrinsic(op: _Op, name: str, doc: str):
    return gemm_intrinsic(gemm_body(lambda b, *a: _block(b, op, *a), NR, COLS, op.b_vec // 16), name, doc)


def fma_block(b, vt, halves, load_b, b_vec, nr, nj, a0, a_rs, bp0, b_rs, nk, c0, c_rs, acc_in):
    """One register block of float32 FMAs (register_block): float32 A rows of `halves` elements per reduction step,
    each broadcast against the B operands load_b gives (a tuple of `halves` vectors of type vt). gemm_bf16w's
    blocks (16 lanes, B pairs widened to even / odd halves) and gemm_narrow.py's (8 lanes)."""
    def step(b, p, arow, bv, accs):
        for h in range(halves):
            for r in range(nr):
                ap = gep(b, arow[r], b.add(b.mul(p, c64(4 * halves)), c64(4 * h)))
                av = splat(b, b.load(b.bitcast(ap, F32.as_pointer()), align=4), vt.count)
                for j in range(nj):
                    b.store(fmadd(b, av, bv[j][h], b.load(accs[r][j])), accs[r][j])
    register_block(b, vt, nr, nj, a0, a_rs, bp0, b_rs, nk, c0, c_rs, acc_in, load_b, b_vec, step)


def _block_pairs(b, a0, a_rs, bp0, b_rs, npair, c0, c_rs, acc_in):
    """One NR x COLS block of gemm_bf16w: float32 A rows (elements 2p, 2p + 1 per pair step), B pair-packed."""
    fma_block(b, V16F, 2, lambda b, p: widen_eo(b, p, 16), 64, NR, NJ, a0, a_rs, bp0, b_rs, npair, c0, c_rs,
              acc_in)


gemm_bf16 = _gemm_intrinsic(_BF16, "fia_gemm_bf16", """C (float32 at caddr, rows c_rs bytes apart) [+]= A . B
    over nk bf16 pairs, R rows (multiple of 6) x NCOL columns (multiple of 64); see the module doc.
    accumulate != 0: C += (else C =).""")
gemm_f16 = _gemm_intrinsic(_F16, "fia_gemm_f16", """C (float32) [+]= A . B for float32 A rows (a_rs bytes
    apart) and float16 B rows (b_rs bytes apart) over nk steps of the reduction axis: widen + float32 FMA
    (`vcvtph2ps`, `vfmadd231ps`; half the multiply rate of gemm_bf16). R a multiple of 6, NCOL of 64;
    accumulate as gemm_bf16.""")
gemm_f32 = _gemm_intrinsic(_F32, "fia_gemm_f32", """gemm_f16 with float32 B rows (float32 calls, dequantized
    int8 K / V).""")
gemm_bf16w = gemm_intrinsic(gemm_body(_block_pairs, NR, COLS, 4), "fia_gemm_bf16w", """gemm_bf16 for CPUs without
    AVX512-BF16: A float32 rows of 2 nk elements, B pair-packed bf16 widened in registers (even / odd halves),
    float32 FMAs (half gemm_bf16's multiply rate; products of bf16 values are exact either way).""")
