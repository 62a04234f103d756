"""float32 multiply-add micro-kernels of the decode backend for fp16, int8, bf16 and float32 K / V, as LLVM IR.

The counterpart of simd.py for what `vdpbf16ps` cannot take: fp16 values (no fp16 dot product on
the CPUs measured), int8 values (widened: exact), bf16 on CPUs without AVX512-BF16, and float32 K / V (portable
mode), which are loaded as they are. Every other element is widened to float32 in registers (fp16: `vcvtph2ps`;
int8: sign extension + convert; bf16: shift) and multiplied with float32 FMAs; nothing is rounded that the float32
fused kernels did not round. What they add over decode.kernels.generic.qk_fused / pv_fused is the memory side
(docs/performance.md, "Micro-kernels in LLVM IR"): every K / V row is read front to back (interleaved rows halve
what the prefetchers stream), the other stream is prefetched on the way (simd.prefetch_rows), and the accumulators
stay in registers.

* `qk_fma`: s[r, c] = q[r, :] . k_c for float32 query rows (the scale and key dequant factors folded in
  by the caller, as for qk_fused);
* `pv_fma`: acc[r, :] += sum_c p[r, c] * v_c for float32 probabilities.
D (Dv) % 16 == 0. The kernels that embed this IR are rebuilt when this file changes (cpu/kernel_cache.py).
"""
from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import (F32, I16, I32, I64, KIND_BF16, KIND_F32, KIND_FP16, KIND_I8, V16F, ZERO16, QKOp, c64, chunk_at, declare, first_only,
    gep, load, other_stream, outlined, prefetch_ahead, prefetch_rows, ptr, pv_row_blocks, qk_blocks,
    qk_kernel, row_blocks, shared, shuffle, splat, store, store_scores, switch, var, target_has)

F16C = platform.machine().lower() in ("aarch64", "arm64") or target_has("f16c")
# CPUs without AVX-512 have 16 vector registers of 8 floats: there LLVM splits each <16 x float> of the
# blocks below in two, and their 16-32 accumulators spill. NARROW kernels work on 8 lanes with at most 8
# accumulators (qk_narrow, _pv_narrow) (docs/performance.md, "Kernel choices: the measurements").
NARROW = not target_has("avx512f")
# bf16 K / V for the NARROW kernels, widened in even / odd halves (widen_eo): one 32-byte load of 16 values
# gives the even-indexed ones as `bits << 16` and the odd-indexed ones as `bits & 0xFFFF0000` (1 load + 2 ALU
# ops per 16 values; the zero-extending widening took 2 loads + 2 shuffles + 2 shifts, and on some CPUs its
# shuffles share a pipe with the FMAs: docs/performance.md, "Kernel choices: the measurements"). The caller pairs
# them: QK with the query de-interleaved the same way once per item, PV with accumulators whose 16-channel groups
# hold the even channels, then the odd ones (decode.kernels.items._items puts them back). Exact: the same products,
# only summed in another order.
KIND_BF16_EO = 5
# Keys per QK block of NR query rows (qk_narrow; 8 // NR where not listed). Elements widened one chunk at a time
# (fp16 `vcvtph2ps`, int8; float32 loaded as is) take 4 rows x 3 keys (12 accumulators, 15 of the 16 registers,
# no spills); 2 rows x 5 keys (x 6 spills). bf16 even / odd halves stay at 4 x 2: their widened halves need 2 more
# registers, and so does qk_i8 (docs/performance.md, "Kernel choices: the measurements").
QK_NC_WIDENED = {4: 3, 2: 5}
# Head dims whose float32 QK (16 lanes) is straight-line code: D = 64 too, so that its query stays in registers
# (simd.qk_kernel's preload), faster than the loop over chunks (docs/performance.md, "Kernel choices: the measurements")
QK_UNROLLED_F32 = (8, 4)


def _kinds() -> tuple:
    """The element kinds qk_fma / pv_fma specialize for besides bf16."""
    return (KIND_F32, KIND_FP16, KIND_I8, KIND_BF16_EO)


def _vec(ty, lanes):
    return ir.VectorType(ty, lanes)


def _half_bits_to_f32(b, h):
    """IEEE half bits <n x i16> -> <n x float> by integer arithmetic (targets without F16C, where LLVM
    would call a runtime helper numba does not link); exact, as cpu.numerics._fp16_bits_to_f32."""
    n = h.type.count
    vi, vf = _vec(I32, n), _vec(F32, n)

    def i32s(v):
        return ir.Constant(vi, [v] * n)
    x = b.zext(h, vi)
    em = b.and_(x, i32s(0x7FFF))
    sh = b.shl(em, i32s(13))
    f = b.fmul(b.bitcast(sh, vf), ir.Constant(vf, [5.192296858534828e33] * n))   # x 2^112
    special = b.icmp_unsigned(">=", em, i32s(0x7C00))                             # inf / nan
    f = b.select(special, b.bitcast(b.or_(sh, i32s(0x7F800000)), vf), f)
    sign = b.shl(b.and_(x, i32s(0x8000)), i32s(16))
    return b.bitcast(b.or_(b.bitcast(f, vi), sign), vf)


def widen(b, p, kind: int, lanes: int = 16):
    """`lanes` elements at byte pointer p as <lanes x float>."""
    vf, vi, vs = _vec(F32, lanes), _vec(I32, lanes), _vec(I16, lanes)
    if kind == KIND_F32:                                   # (nothing to widen)
        return load(b, p, vf)
    if kind == KIND_FP16:
        h = load(b, p, vs)
        return b.fpext(b.bitcast(h, _vec(ir.HalfType(), lanes)), vf) if F16C else _half_bits_to_f32(b, h)
    if kind == KIND_I8:
        return b.sitofp(b.sext(load(b, p, _vec(ir.IntType(8), lanes)), vi), vf)
    x = b.zext(load(b, p, vs), vi)                         # bf16: the high half of a float32
    return b.bitcast(b.shl(x, ir.Constant(vi, [16] * lanes)), vf)


def widen_eo(b, p, lanes: int = 8):
    """2 x lanes bf16 values (dwords of pairs) at byte pointer p as (even-indexed, odd-indexed) <lanes x float>:
    `bits << 16` and `bits & 0xFFFF0000`, exact (see KIND_BF16_EO)."""
    vi = _vec(I32, lanes)
    w = load(b, p, vi, 4 if lanes == 16 else 1)
    even = b.shl(w, ir.Constant(vi, [16] * lanes))
    odd = b.and_(w, ir.Constant(vi, [-65536] * lanes))
    return b.bitcast(even, _vec(F32, lanes)), b.bitcast(odd, _vec(F32, lanes))


def _esize(kind: int) -> int:
    return 1 if kind == KIND_I8 else 4 if kind == KIND_F32 else 2


def fmadd(b, x, y, acc):
    t = x.type
    return b.call(declare(b, f"llvm.fma.v{t.count}f32", ir.FunctionType(t, [t, t, t])), [x, y, acc])


# ---------------------------------------------------------------------------------------------- QK
def _qk_op(kind: int) -> QKOp:
    """Float32 query chunks of 16 x widened key chunks of 16, float32 FMAs (simd._qk_block)."""
    es = _esize(kind)
    return QKOp(es, 16 * es, 64, V16F, ZERO16, lambda b, p: widen(b, p, kind),
                lambda b, acc, q, k: fmadd(b, q, k, acc), lambda b, a: a, lambda b, r0, NR, NC, v: v)


_LO16, _HI16 = list(range(16)), list(range(16, 32))


def _qk_op_eo() -> QKOp:
    """bf16 keys in chunks of 32 widened to even / odd halves (KIND_BF16_EO) x float32 query chunks of 32 (its
    16 even-indexed values, then the 16 odd-indexed ones): two FMAs per chunk (simd._qk_block)."""
    def dot(b, acc, q, k):
        return fmadd(b, shuffle(b, q, q, _HI16), k[1], fmadd(b, shuffle(b, q, q, _LO16), k[0], acc))
    return QKOp(2, 64, 128, _vec(F32, 32), ZERO16, lambda b, p: widen_eo(b, p, 16), dot, lambda b, a: a,
                lambda b, r0, NR, NC, v: v)


@intrinsic
def qk_fma(typingctx, qaddr, q_rs, kaddr, kind, offaddr, n, saddr, s_rs, R, D, xaddr, xoffaddr, xn, xrow, xes):
    """s[r, c] = q[r, :D] . K[c, :D], r < R, c < n. q: float32 at qaddr, rows q_rs bytes apart; key c:
    `kind` elements (KIND_BF16 / FP16 / I8 / F32) at element offs[c] of the buffer at kaddr; offs: int64 at
    offaddr; s: float32 at saddr, rows s_rs elements apart. D % 16 == 0. Prefetching as qk_dp."""
    sig = types.void(*([types.int64] * 15))

    def body(b, args):
        qa, qrs, ka, kd, oa, n_, sa, srs, R_, D_ = args[:10]
        offp = ptr(b, oa, I64)
        x = other_stream(b, *args[10:])

        def emit(kind):                                      # D = 128 straight-line; others a loop
            if NARROW:
                eo = kind == KIND_BF16_EO
                qk_narrow(b, _qk_narrow_op(KIND_BF16 if eo else kind), qa, qrs, ka, offp, sa, srs, R_, n_, D_, x,
                           eo, None if eo else QK_NC_WIDENED)
            elif kind == KIND_BF16_EO:
                # D = 128 keeps its query in L1, not in registers: 4 rows x 4 chunks of 32 floats would fill
                # all 32 of them
                qk_kernel(b, _qk_op_eo(), qa, qrs, ka, offp, sa, srs, R_, n_, D_, x, 32, (4, 2), preload_max=2)
            else:
                qk_kernel(b, _qk_op(kind), qa, qrs, ka, offp, sa, srs, R_, n_, D_, x, 16,
                          QK_UNROLLED_F32 if kind == KIND_F32 else (8,))
        switch(b, kd, _kinds(), emit, KIND_BF16)

    def codegen(context, builder, signature, args):
        return outlined(context, builder, "fia_qk_fma", args, body)
    return sig, codegen


def _qk_narrow_op(kind: int) -> QKOp:
    """qk_fma's QKOp on 8 lanes: float32 query chunks of 8 x widened key chunks of 8, float32 FMAs."""
    es = _esize(kind)
    return QKOp(es, 8 * es, 32, _vec(F32, 8), ir.Constant(_vec(F32, 8), [0.0] * 8),
                lambda b, p: widen(b, p, kind, 8), lambda b, acc, q, k: fmadd(b, q, k, acc), lambda b, a: a,
                lambda b, r0, NR, NC, v: v)


def qk_narrow(b, op, qa, q_rs, ka, offp, sa, s_rs, R, n, D, x, eo=False, nc=None, kfs=None):
    """A QK kernel's body on 8-lane accumulators (qk_fma here, vnni.qk_i8): blocks of NR query rows
    (4, 2, 1) x nc[NR] keys (default 8 / NR: 8 accumulators, as two pipes of 4-cycle latency need), D in
    chunks of op.kstep / op.es elements; each query chunk is loaded once for the block's keys (their rows are
    read side by side). D = 128 is straight-line code, other D a loop over the chunks. eo: bf16 keys widened in
    even / odd halves, chunks 2i and 2i + 1 from one load, against a query de-interleaved alike (KIND_BF16_EO).
    kfs: NZ key rows (simd.chunk_at; not with eo)."""
    per = op.kstep // op.es                                  # elements per chunk
    nd = b.udiv(D, c64(per))
    qalign = op.qstep // per                                 # bytes per query element

    def variant(ND):
        def block(NR, NC, r0, q0, c, s0, xr, _qregs):
            # the prefetch requests first: placed after the FMAs, their code kept the 8 accumulators live
            # across it and LLVM spilled them (docs/performance.md, "Kernel choices: the measurements")
            prefetch_rows(b, xr, c, NC)
            prefetch_ahead(b, xr, ka, offp, n, b.mul(nd, c64(op.kstep)), c64(op.es), c, NC)
            accs = [[var(b, op.zero) for _ in range(NC)] for _ in range(NR)]
            kps = [gep(b, ptr(b, ka), b.mul(b.load(gep(b, offp, b.add(c, c64(j)))), c64(op.es)))
                   for j in range(NC)]
            qrows = [ptr(b, b.add(q0, b.mul(q_rs, c64(r)))) for r in range(NR)]

            def fmas(k, ks):
                for r in range(NR):
                    qv = load(b, gep(b, qrows[r], b.mul(k, c64(op.qstep))), op.qty, qalign)
                    for j in range(NC):
                        b.store(op.dot(b, b.load(accs[r][j]), qv, ks[j]), accs[r][j])

            def chunk(k):
                if not eo:
                    fmas(k, [op.load_k(b, chunk_at(b, kp, k, op.kstep, kfs)) for kp in kps])
                    return
                if NR <= 2:
                    # key by key (each key's halves used as soon as they are widened), the query chunks loaded
                    # first: widening every key of the step first kept 2 NC halves live beside the 8
                    # accumulators (docs/performance.md, "Kernel choices: the measurements")
                    ks = [b.add(b.mul(k, c64(2)), c64(h)) for h in range(2)]
                    qvs = [[load(b, gep(b, qrows[r], b.mul(kh, c64(op.qstep))), op.qty, qalign) for kh in ks]
                           for r in range(NR)]
                    for j, kp in enumerate(kps):
                        ev_od = widen_eo(b, gep(b, kp, b.mul(k, c64(2 * op.kstep))))
                        for h in range(2):
                            for r in range(NR):
                                b.store(op.dot(b, b.load(accs[r][j]), qvs[r][h], ev_od[h]), accs[r][j])
                    return
                # k: a pair of chunks, 2k (even-indexed values) and 2k + 1 (odd-indexed), one load per key
                halves = [widen_eo(b, gep(b, kp, b.mul(k, c64(2 * op.kstep)))) for kp in kps]
                for h in range(2):
                    fmas(b.add(b.mul(k, c64(2)), c64(h)), [ev_od[h] for ev_od in halves])
            steps = b.udiv(nd, c64(2)) if eo else nd
            if ND is None:
                with cgutils.for_range(b, steps) as loop:
                    chunk(loop.index)
            else:
                for k in range(ND // 2 if eo else ND):
                    chunk(c64(k))
            store_scores(b, op, accs, NR, NC, r0, s0, s_rs, c, 8)

        qk_blocks(b, qa, q_rs, sa, s_rs, R, n, x, block, lambda NR: (nc or {}).get(NR, 8 // NR), None)
    switch(b, nd, (128 // per,), variant, None)


# ---------------------------------------------------------------------------------------------- PV
def _pv_pass(b, kind, NR, DG, p0, p_rs, vaddr, offp, n, a0, a_rs, g, x, vrow, lanes=16):
    """acc rows a0 + r (a_rs floats apart), channels [lanes DG g, lanes DG (g + 1)) += P rows (float32, p_rs
    bytes apart) . V (rows of vrow bytes), one pass over the n keys with NR x DG accumulators in registers."""
    es = _esize(kind)
    vf = _vec(F32, lanes)
    vbase = ptr(b, vaddr)
    accs = []
    for r in range(NR):
        arow = gep(b, ptr(b, a0), b.add(b.mul(a_rs, c64(4 * r)), b.mul(g, c64(4 * lanes * DG))))
        accs.append([var(b, load(b, gep(b, arow, c64(4 * lanes * ch)), vf, 4)) for ch in range(DG)])
    with cgutils.for_range(b, n) as loop:
        c = loop.index
        # the prefetch requests first: their branches end a basic block, and emitted after the widening they
        # kept every widened chunk live across them -- at 1 row x 8 chunks (17 registers) two accumulators
        # spilled, each FMA chain then went through a store and a reload (as QK's _qk_block)
        # (docs/performance.md, "Kernel choices: the measurements")
        prefetch_rows(b, x, c, 1)
        prefetch_ahead(b, x, vaddr, offp, n, vrow, c64(es), c, 1)
        vp = gep(b, vbase, b.add(b.mul(b.load(gep(b, offp, c)), c64(es)), b.mul(g, c64(lanes * DG * es))))
        if kind == KIND_BF16_EO:                              # chunk pairs: even / odd channels (KIND_BF16_EO)
            vs = [h for ch in range(0, DG, 2) for h in widen_eo(b, gep(b, vp, c64(lanes * es * ch)), lanes)]
        else:
            vs = [widen(b, gep(b, vp, c64(lanes * es * ch)), kind, lanes) for ch in range(DG)]   # row c in order
        for r in range(NR):
            pw = b.load(b.bitcast(gep(b, ptr(b, p0), b.add(b.mul(p_rs, c64(r)), b.mul(c, c64(4)))),
                                  F32.as_pointer()), align=4)
            wv = splat(b, pw, lanes)
            for ch in range(DG):
                b.store(fmadd(b, wv, vs[ch], b.load(accs[r][ch])), accs[r][ch])
    for r in range(NR):
        arow = gep(b, ptr(b, a0), b.add(b.mul(a_rs, c64(4 * r)), b.mul(g, c64(4 * lanes * DG))))
        for ch in range(DG):
            store(b, b.load(accs[r][ch]), gep(b, arow, c64(4 * lanes * ch)), 4)


def _pv_passes(b, kind, NR, DG, r0, pa, p_rs, va, offp, n, aa, a_rs, R, Dv, x, lanes, block_rows, g0=None,
               count=None):
    """Rows r0 .. r0 + NR - 1 (one of the row blocks of block_rows rows): Dv / (lanes DG) _pv_pass passes
    (or `count` of them from channel group g0), the first of which prefetches the row block's share of the
    other stream."""
    with cgutils.for_range(b, count if count is not None else b.udiv(Dv, c64(lanes * DG))) as loop:
        g = loop.index if g0 is None else b.add(g0, loop.index)
        _pv_pass(b, kind, NR, DG, b.add(pa, b.mul(r0, p_rs)), p_rs, va, offp, n,
                 b.add(aa, b.mul(c64(4), b.mul(r0, a_rs))), a_rs, g,
                 first_only(b, shared(b, x, r0, R, block_rows), g), b.mul(Dv, c64(_esize(kind))), lanes)


def _pv_narrow(b, kind, pa, p_rs, va, offp, n, aa, a_rs, R, Dv, x):
    """pv_fma's body on 8-lane vectors: blocks of NR query rows (4, 2, 1) x 8 / NR chunks of 8 channels per
    pass over the keys (8 accumulators, see qk_narrow), fewer chunks where Dv is not a multiple."""
    def rows_of(NR, r0):
        def passes(DG):
            _pv_passes(b, kind, NR, DG, r0, pa, p_rs, va, offp, n, aa, a_rs, R, Dv, x, 8, 4)

        if NR == 4 and kind != KIND_BF16_EO:
            # widened one chunk at a time (fp16, int8; float32 loaded): 4 rows x 3 chunks (12 accumulators, as
            # QK_NC_WIDENED), passes of 24 channels, then the rest 8 at a time; bf16 even / odd halves come in
            # pairs of chunks (4 x 2) (docs/performance.md, "Kernel choices: the measurements")
            n3 = b.udiv(Dv, c64(24))
            _pv_passes(b, kind, NR, 3, r0, pa, p_rs, va, offp, n, aa, a_rs, R, Dv, x, 8, 4, c64(0), n3)
            _pv_passes(b, kind, NR, 1, r0, pa, p_rs, va, offp, n, aa, a_rs, R, Dv, x, 8, 4, b.mul(n3, c64(3)),
                       b.udiv(b.urem(Dv, c64(24)), c64(8)))
            return

        def widest(DG):                                      # Dv % 16 == 0: DG = 2 always fits
            if DG <= 2:
                passes(DG)
                return
            with b.if_else(b.icmp_unsigned("==", b.urem(Dv, c64(8 * DG)), c64(0))) as (then, otherwise):
                with then:
                    passes(DG)
                with otherwise:
                    widest(DG // 2)
        widest(8 // NR)
    row_blocks(b, R, rows_of)


def _pv_wide(b, kind, pa, p_rs, va, offp, n, aa, a_rs, R, Dv, x):
    """pv_fma's body on 16-lane vectors: 2 rows x 8 chunks (128 channels: a whole row of D = 128 per pass), or x 4,
    or x 1; Dv = 64 (Dv % 128 != 0, Dv % 64 == 0): 4 rows x 4 chunks, 16 accumulators, one pass over the V rows
    instead of two, each row widened once for 4 query rows (whole items, 4 rows, D = 64, in L2 or L3: float32
    1.08-1.10x; bf16 on Intel Emerald Rapids, G 4 / 8: 1.04x / 1.12x the whole call)."""
    def pairs():
        pv_row_blocks(b, R, Dv, ((128, 8), (64, 4), 1), lambda NR, DG, r0: _pv_passes(
            b, kind, NR, DG, r0, pa, p_rs, va, offp, n, aa, a_rs, R, Dv, x, 16, 2))
    four = b.and_(b.icmp_unsigned("!=", b.urem(Dv, c64(128)), c64(0)),
                  b.icmp_unsigned("==", b.urem(Dv, c64(64)), c64(0)))
    with b.if_else(four) as (then, otherwise):
        with then:
            row_blocks(b, R, lambda NR, r0: _pv_passes(b, kind, NR, 4, r0, pa, p_rs, va, offp, n, aa, a_rs, R, Dv, x,
                                                       16, 4))
        with otherwise:
            pairs()


@intrinsic
def pv_fma(typingctx, paddr, p_rs, vaddr, kind, offaddr, n, aaddr, a_rs, R, Dv, xaddr, xoffaddr, xn, xrow, xes):
    """acc[r, :Dv] += sum_c p[r, c] * V[c, :Dv], r < R, c < n. p: float32 at paddr, rows p_rs bytes
    apart; value c: `kind` elements at element offs[c] of the buffer at vaddr; acc: float32 at aaddr,
    rows a_rs elements apart. Dv % 16 == 0. Prefetching as pv_dp (keys c < xn, first pass only)."""
    sig = types.void(*([types.int64] * 15))

    def body(b, args):
        pa, prs, va, kd, oa, n_, aa, ars, R_, Dv_ = args[:10]
        offp = ptr(b, oa, I64)
        x = other_stream(b, *args[10:])

        def emit(kind):
            if NARROW:
                _pv_narrow(b, kind, pa, prs, va, offp, n_, aa, ars, R_, Dv_, x)
                return
            _pv_wide(b, kind, pa, prs, va, offp, n_, aa, ars, R_, Dv_, x)
        switch(b, kd, _kinds(), emit, KIND_BF16)

    def codegen(context, builder, signature, args):
        return outlined(context, builder, "fia_pv_fma", args, body)
    return sig, codegen
