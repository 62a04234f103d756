"""FP4 E2M1 -> bf16 decoding of one 32-value group, vectorized (the mode-6 K / V of SPEC 10b.1).

Why: the decode kernels read FP4 K / V a chunk at a time as exact bf16 rows (decode.kernels.rows.fp4_rows) and run
the bf16 kernels on them; decoding nibble by nibble in scalar code cost more than the FMA kernels themselves
(FP4 slower than bf16 although it reads a quarter of the bytes). Here 16 bytes become 32 bf16 with integer vector
ops: a code's float32 bits computed from its bits, times the group's E8M0 scale (a power of
two: the product is exact, 0 / NaN / inf / subnormal scales included), the top 16 bits kept (exact in bf16: at
most two significant bits). Plain LLVM vector IR: AVX-512 or AVX2 lowers it, nothing CPU-specific; with AVX512-BW a
16-entry bf16 table and one `vpermw` a group, with AVX512-VBMI also the indices by `vpermb` and the table scaled by
an exponent add (docs/performance.md, "FP4 (mode 6)").
"""
from __future__ import annotations

import struct

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .simd import F32, I32, declare, load, ptr, shuffle, splat, store, target_has

# AVX512-BW: the 16 scaled values as a bf16 table, one vpermw for the 32 values of a group (10 instructions a group
# against ~35 for the arithmetic form, which other CPUs run)
_PERMW = target_has("avx512bw")
# AVX512-VBMI too (Ice Lake, Zen 4 and later): the nibbles as vpermw indices by one vpermb + one vpsrlvw, and, for the
# scales whose products stay normal bf16 (E8M0 2..252), the table scaled by an integer add to the exponent field:
# 3 shuffles a group instead of ~8 (they share one port on Intel)
_VBMI = _PERMW and target_has("avx512vbmi")

_V16B = ir.VectorType(ir.IntType(8), 16)
_V16I = ir.VectorType(I32, 16)
_V16F = ir.VectorType(F32, 16)
_V32I = ir.VectorType(I32, 32)
_V32F = ir.VectorType(F32, 32)
_V32H = ir.VectorType(ir.IntType(16), 32)
_INTERLEAVE = [i // 2 + (16 if i % 2 else 0) for i in range(32)]     # lo[0], hi[0], lo[1], hi[1], ...
# the E2M1 codes 0..15 as float32 (bit 3 the sign)
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _const(v: int):
    return ir.Constant(_V16I, [v] * 16)


def _e2m1(b: ir.IRBuilder, c):
    """<16 x i32> codes (0..15: bit 3 sign, bits 2-1 exponent bias 1, bit 0 mantissa) -> <16 x float>: magnitude
    code m >= 2 is (m + 252) << 22, 1 is 0.5 (0x3F000000), 0 is 0."""
    m = b.and_(c, _const(7))
    mag = b.shl(b.add(m, _const(252)), _const(22))
    mag = b.select(b.icmp_unsigned("==", m, _const(1)), _const(0x3F000000), mag)
    mag = b.select(b.icmp_unsigned("==", m, _const(0)), _const(0), mag)
    sign = b.shl(b.and_(c, _const(8)), _const(28))
    return b.bitcast(b.or_(sign, mag), _V16F)


def _scaled_table(b: ir.IRBuilder, scale):
    """The 16 codes' values times `scale` as bf16 bits, twice (<32 x i16>: vpermw reads index bits 0-4)."""
    tab = b.fmul(ir.Constant(_V16F, _E2M1), splat(b, scale, 16))                    # exact: a power of two
    tab = b.trunc(b.lshr(b.bitcast(tab, _V16I), _const(16)), ir.VectorType(ir.IntType(16), 16))
    return shuffle(b, tab, ir.Constant(tab.type, None), list(range(16)) * 2)


def _permw(b: ir.IRBuilder, tab, idx):
    """tab[idx[i] & 31] for the 32 words of idx (`vpermw`)."""
    fn = declare(b, "llvm.x86.avx512.permvar.hi.512", ir.FunctionType(_V32H, [_V32H, _V32H]))
    return b.call(fn, [tab, idx])


def _group_permw(b: ir.IRBuilder, dst, src, scale):
    x = load(b, ptr(b, src), _V16B)
    nib = shuffle(b, b.and_(x, ir.Constant(_V16B, [15] * 16)), b.lshr(x, ir.Constant(_V16B, [4] * 16)),
                  _INTERLEAVE)                                                      # <32 x i8> codes in order
    store(b, _permw(b, _scaled_table(b, scale), b.zext(nib, _V32H)), ptr(b, dst))


_V64B = ir.VectorType(ir.IntType(8), 64)
_I16 = ir.IntType(16)
_DUP4 = [j // 4 for j in range(64)]             # words 2k and 2k + 1 both hold byte k (twice)
_NIBBLE_SHIFT = [0, 4] * 16                     # word 2k: the low nibble, 2k + 1: the high one (index bits 0-3)
_E2M1_BF16 = [(int.from_bytes(struct.pack("<f", v), "little") >> 16) for v in _E2M1] * 2
_NONZERO = [0 if v == 0 else 0xFFFF for v in _E2M1] * 2


def _group_vbmi(b: ir.IRBuilder, dst, src, scale):
    x = load(b, ptr(b, src), _V16B)
    x = shuffle(b, x, ir.Constant(_V16B, None), list(range(16)) + [16] * 48)
    fn = declare(b, "llvm.x86.avx512.permvar.qi.512", ir.FunctionType(_V64B, [_V64B, _V64B]))
    w = b.bitcast(b.call(fn, [x, ir.Constant(_V64B, _DUP4)]), _V32H)
    idx = b.lshr(w, ir.Constant(_V32H, _NIBBLE_SHIFT))     # vpermw reads bits 0-4: the table is 16 entries twice
    bits = b.bitcast(scale, I32)
    e = b.lshr(bits, ir.Constant(I32, 23))
    # 2^(e - 127) with e in 2..252: every product 0.5 .. 6 times it is a normal float, so bf16(v) + (e - 127) << 7
    normal = b.and_(b.icmp_unsigned("==", b.and_(bits, ir.Constant(I32, 0x807FFFFF)), ir.Constant(I32, 0)),
                    b.icmp_unsigned("<=", b.sub(e, ir.Constant(I32, 2)), ir.Constant(I32, 250)))
    with b.if_else(normal) as (fast, slow):
        with fast:
            k = b.trunc(b.shl(b.sub(e, ir.Constant(I32, 127)), ir.Constant(I32, 7)), _I16)
            step = b.and_(splat(b, k, 32), ir.Constant(_V32H, _NONZERO))
            store(b, _permw(b, b.add(ir.Constant(_V32H, _E2M1_BF16), step), idx), ptr(b, dst))
        with slow:                                       # 0, tiny, huge or NaN scales: exact float products
            store(b, _permw(b, _scaled_table(b, scale), idx), ptr(b, dst))


def _group_arith(b: ir.IRBuilder, dst, src, scale):
    x = b.zext(load(b, ptr(b, src), _V16B), _V16I)
    f = splat(b, scale, 16)
    lo = b.fmul(_e2m1(b, b.and_(x, _const(15))), f)
    hi = b.fmul(_e2m1(b, b.lshr(x, _const(4))), f)
    v = b.bitcast(shuffle(b, lo, hi, _INTERLEAVE), _V32I)
    store(b, b.trunc(b.lshr(v, ir.Constant(_V32I, [16] * 32)), _V32H), ptr(b, dst))


def _group_intrinsic(emit):
    def group(typingctx, dst, src, scale):
        """The 32 FP4 values of the 16 bytes at address src (value 2k in the low, 2k + 1 in the high nibble of
        byte k) times the float32 `scale`, as 32 bf16 at address dst."""
        sig = types.void(types.int64, types.int64, types.float32)

        def codegen(context, builder, signature, args):
            emit(builder, *args)
            return context.get_dummy_value()
        return sig, codegen
    return intrinsic(group)


fp4_group_vbmi = _group_intrinsic(_group_vbmi)        # AVX512-BW + VBMI only
fp4_group_permw = _group_intrinsic(_group_permw)      # AVX512-BW only
fp4_group_arith = _group_intrinsic(_group_arith)      # any CPU
fp4_group_bf16 = fp4_group_vbmi if _VBMI else fp4_group_permw if _PERMW else fp4_group_arith
