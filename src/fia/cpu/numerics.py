"""Scalar numerics the CPU kernels of every backend share (decode and prefill): bit casts, half-precision
conversions (bf16 / fp16 bits <-> float32, exact, with or without F16C), the vectorizable float32 exp / exp2, atomics
and raw buffers (an (address, bytes) pair as an array).

Half-precision data is read in place as uint16 bit patterns (numba has no float16): bf16 -> f32 is `bits << 16`;
fp16 -> f32 the bit-level widening below (subnormals, inf and nan included) or `fpext half` where the CPU has F16C.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .fma import F16C


# fastmath without nnan / ninf: NaN and Inf in the inputs must propagate (SPEC 14)
FM = {"reassoc", "contract", "nsz", "arcp"}


@intrinsic
def addr_ptr(typingctx, addr):
    """int64 address -> void* (the caller keeps the memory alive for the call)."""
    sig = types.voidptr(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())
    return sig, codegen


@intrinsic
def unowned(typingctx, arr):
    """The same array without its owner (meminfo and parent NULL): numba's reference counts of it and of every
    view made from it are a null test instead of an atomic add. The caller keeps the owner alive past every use
    (`alive`)."""
    if not isinstance(arr, types.Array):
        return None
    sig = arr(arr)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        src = context.make_array(aryty)(context, builder, args[0])
        dst = context.make_array(aryty)(context, builder)
        for name in ("nitems", "itemsize", "data", "shape", "strides"):
            setattr(dst, name, getattr(src, name))
        dst.meminfo = cgutils.get_null_value(dst.meminfo.type)
        dst.parent = cgutils.get_null_value(dst.parent.type)
        return dst._getvalue()
    return sig, codegen


@intrinsic
def alive(typingctx, owners):
    """Nothing, as a call numba keeps: the owners of `unowned` arrays live up to here."""
    sig = types.none(owners)

    def codegen(context, builder, signature, args):
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def fetch_add(typingctx, arr, idx, val):
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
def copy32(typingctx, dst, src):
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
    t = fetch_add(counter, 0, 1)
    return items[t] if t < items.shape[0] else -1


@njit(cache=True, inline="always")
def buf_bytes(bufs, k):
    """Buffer k as a uint8 array (no copy)."""
    return carray(addr_ptr(bufs[0, k]), (bufs[1, k],), np.uint8)


@njit(cache=True, inline="always")
def buf_f32(bufs, k):
    """Buffer k as a float32 array (no copy)."""
    return carray(addr_ptr(bufs[0, k]), (bufs[1, k] // 4,), np.float32)


@intrinsic
def u32_as_f32(typingctx, x):
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return sig, codegen


@intrinsic
def f32_as_u32(typingctx, x):
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return sig, codegen


@njit(fastmath=FM, cache=True, inline="always")
def bf16_to_f32(h):
    return u32_as_f32(np.uint32(np.uint32(h) << np.uint32(16)))


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
    f = u32_as_f32(np.uint32(em << np.uint32(13))) * np.float32(5.192296858534828e33)
    if em >= np.uint32(0x7C00):                      # inf / nan: all-ones exponent, payload kept
        f = u32_as_f32(np.uint32((em << np.uint32(13)) | np.uint32(0x7F800000)))
    return u32_as_f32(np.uint32(f32_as_u32(f) | ((x & np.uint32(0x8000)) << np.uint32(16))))


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
    u = f32_as_u32(x)
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    a = u & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x47800000):                       # >= 65536: inf, or NaN
        o = np.uint32(0x7E00) if a > np.uint32(0x7F800000) else np.uint32(0x7C00)
    elif a < np.uint32(0x38800000):                      # below 2^-14: subnormal half or zero
        magic = np.uint32(0x3F000000)                    # ((127 - 15) + (23 - 10) + 1) << 23
        o = f32_as_u32(u32_as_f32(a) + u32_as_f32(magic)) - magic
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
    u = f32_as_u32(x)
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
    e = u32_as_f32(np.uint32((np.int32(t) + np.int32(127)) << np.int32(23)))
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
    v = u32_as_f32(f32_as_u32(p) + np.uint32(np.int32(fi) << np.int32(23)))
    return np.float32(0.0) if t < np.float32(-125.0) else v


@njit(fastmath=FM, cache=True, inline="always")
def round_bf16_value(x):
    """x rounded to the nearest bf16 value (ties to even), as float32, without a NaN test: a NaN may come out
    as another value. For loops whose running sum takes x itself (a NaN there makes the whole row NaN)."""
    u = f32_as_u32(x)
    return u32_as_f32((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000))
