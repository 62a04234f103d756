"""GEMM micro-kernels of the prefill flash kernel for CPUs without AVX-512 (AVX2 + FMA: 16 ymm registers of 8
floats), as LLVM IR: the counterpart of gemm.py there, with the same calling convention.

Why: gemm.py's blocks hold 24 <16 x float> accumulators; on 8-lane targets LLVM splits each in two and the 48
halves spill. Here a block is NR = 6 rows x NJ = 2 vectors of 8 columns: 12 accumulators, 2 B vectors and one
broadcast of A in the 16 registers (the classic AVX2 sgemm shape: per reduction step 2 loads of B, 6 broadcasts,
12 FMAs; docs/performance.md, "Prefill on AVX2 CPUs", has the variants measured).

C[R, NCOL] (float32, `=` or `+=`) = sum over the reduction axis of A[r, k] * B[k, :], A float32 rows:
* `gemm_f32n`: B float32 rows;
* `gemm_f16n`: B float16 rows widened in registers (`vcvtph2ps`, F16C);
* `gemm_bf16n`: B "pair-packed" bf16 as gemm.gemm_bf16 reads it (row p holds, per column, the dword
  (x[2p, c], x[2p + 1, c])), A float32 rows over 2 * nk elements: one 32-byte load gives the even-indexed
  values as `bits << 16` and the odd-indexed ones as `bits & 0xFFFF0000` (fma.KIND_BF16_EO), each multiplied
  with A's element 2p / 2p + 1. Products of bf16-valued operands are exact in float32 (as `vdpbf16ps`).
R must be a multiple of ROWS and NCOL of COLS (the callers pad their scratch).

The prefill kernels that embed this IR are rebuilt when this file changes (cpu/kernel_cache.py).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from llvmlite import ir

from .fma import F16C, widen_eo, widen
from .gemm import fma_block, gemm_body, gemm_intrinsic
from .simd import F32, KIND_FP16, load

NR, NJ = 6, 2                 # rows x 8-column vectors per register block (12 of the 16 ymm registers)
ROWS = NR                     # R must be a multiple of this
COLS = 8 * NJ                 # NCOL must be a multiple of this
V8F = ir.VectorType(F32, 8)
__all__ = ["F16C", "ROWS", "COLS", "gemm_f32n", "gemm_f16n", "gemm_bf16n"]


class _Op(NamedTuple):
    """What a variant loads (see _block)."""
    b_vec: int           # bytes of B per 8-column vector (and 8 x bytes per column)
    halves: int          # A elements per reduction step (2: bf16 pairs)
    load_b: Callable     # (b, p) -> tuple of `halves` <8 x float> B operands at byte p


_F32 = _Op(32, 1, lambda b, p: (load(b, p, V8F, 4),))
_F16 = _Op(16, 1, lambda b, p: (widen(b, p, KIND_FP16, 8),))
_BF16 = _Op(32, 2, widen_eo)


def _block(b, op, a0, a_rs, bp0, b_rs, nk, c0, c_rs, acc_in, nr, nj):
    """One nr x 8 nj block: A rows at a0, B columns starting at bp0, C at c0."""
    fma_block(b, V8F, op.halves, op.load_b, op.b_vec, nr, nj, a0, a_rs, bp0, b_rs, nk, c0, c_rs, acc_in)


def _intrinsic(op: _Op, name: str, doc: str, nr: int = NR, nj: int = NJ):
    """gemm.gemm_intrinsic of this module's nr x nj blocks."""
    return gemm_intrinsic(gemm_body(lambda b, *a: _block(b, op, *a, nr, nj), nr, 8 * nj, op.b_vec // 8), name, doc)


gemm_f32n = _intrinsic(_F32, "fia_gemm_f32n", """C (float32 at caddr, rows c_rs bytes apart) [+]= A . B
    for float32 A rows (a_rs bytes apart) and float32 B rows (b_rs bytes apart) over nk steps, R rows (multiple
    of ROWS) x NCOL columns (multiple of COLS); accumulate != 0: C += (else C =).""")
gemm_f16n = _intrinsic(_F16, "fia_gemm_f16n", """gemm_f32n with float16 B rows (widened in registers).""")
gemm_bf16n = _intrinsic(_BF16, "fia_gemm_bf16n", """gemm_f32n over nk bf16 pairs: B pair-packed (see the
    module doc), A float32 rows of 2 nk elements.""")
