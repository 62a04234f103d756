"""bf16 decode micro-kernels on Intel AMX tiles (`tdpbf16ps`), emitted as LLVM IR.

Why: on the Intel Xeon hosts measured (with AMX) the AVX512-BF16 kernels of simd.py cost ~29
cycles per key for QK and as much for PV (4 query rows, D = 128, keys in L2): with softmax and the rest,
~30 ns per key and KV head per thread, more than the memory needs to deliver those 512 bytes on one
thread. One `tdpbf16ps` multiplies a 16 x 32 bf16 tile by a 32 x 16 one (8192 multiply-adds); both
products below read the KV rows straight from memory as tiles, with no shuffles:

* `qk_amx`: S^T[key, row] = K[key, :] . Q[row, :]. The A tile is 16 key rows x 32 channels, loaded with
  the row stride of the cache; B holds the query in the pair layout the instruction wants (built once per
  call); C is 16 keys x 16 rows (rows past R are zero columns). C is stored and transposed into s[r, c].
* `pv_amx`: acc[r, :] += sum_c p[r, c] * V[c, :]. The B tile is 16 value rows x 32 channels as they lie in
  memory: the instruction then sums pairs of *adjacent channels* of one key, so each query row gets two A
  rows: (p_c, 0) pairs for the even channels, (0, p_c) for the odd ones. C = 16 A rows (8 query rows) x 16
  channel pairs, interleaved back into the accumulators at the end of the call.

Both take only whole blocks of 16 keys (the caller runs the tail through simd.py's qk_dp / pv_dp) and
the same arguments as qk_dp / pv_dp, including the other-stream prefetch. A block whose 16 rows are not
evenly spaced (a paged block boundary, a shared prefix) is first copied to a stack buffer. The products
of two bf16 values are exact in float32 and accumulate in float32, as in qk_dp / pv_dp (only the summation
order differs); subnormal bf16 inputs count as zero, as for `vdpbf16ps`.

Tiles are per-thread state: each call loads its tile configuration (ldtilecfg) and releases the tiles at
the end. Linux hands AMX state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM): `HAS_AMX`
is true where the CPU has AMX-BF16 and that request succeeded; FIA_DECODE_AMX=0 turns the kernels off. On
other CPUs the intrinsics compile to nothing and are never selected. The kernels that embed this IR are
rebuilt when this file changes (cpu/kernel_cache.py).
"""
from __future__ import annotations

import os
import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import (I32, I64, V16F, V16I, c64, declare, first_only, gep, load, other_stream, outlined,
    prefetch_rows, ptr, shuffle, splat, store, switch, var, target_has)

I8 = ir.IntType(8)
V16S = ir.VectorType(ir.IntType(16), 16)
V64B = ir.VectorType(I8, 64)
V16L = ir.VectorType(I64, 16)
_HOST_AMX = target_has("amx-tile", "amx-bf16", "avx512f")


def _request_amx() -> bool:
    """Ask Linux for the AMX tile state of this process (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): without
    it the first tile instruction kills the process with SIGILL. Idempotent (torch's oneDNN asks too)."""
    if not _HOST_AMX or platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0      # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA
    except Exception:  # pragma: no cover - no libc / syscall
        return False


# FIA_DECODE_AMX: "0" never use these kernels; unset: where the CPU has AMX-BF16 and Linux grants it
HAS_AMX = os.environ.get("FIA_DECODE_AMX", "") != "0" and _request_amx()

KEYS = 16                 # keys per tile block (the callers pass n % 16 == 0)
QK_MAX_ROWS = 16          # query rows per qk_amx call (columns of its C tile)
SPAN = 256                # keys per span: the kernels run all tile products of a span, then read them out
QK_MAX_CHUNKS = 4         # D / 32 <= 4: the query tiles stay loaded for the whole call
PV_MAX_DV = 512           # value channels of pv_amx (its stack copy of uneven rows: 16 rows)


def _tile(b, name, *args):
    """Call the AMX intrinsic llvm.x86.<name>; i8 arguments given as Python ints are tile numbers."""
    tys, vals = [], []
    for a in args:
        if isinstance(a, int):
            tys.append(I8)
            vals.append(ir.Constant(I8, a))
        else:
            tys.append(a.type)
            vals.append(a)
    fn = declare(b, "llvm.x86." + name, ir.FunctionType(ir.VoidType(), tys))
    b.call(fn, vals)


def _configure(b):
    """ldtilecfg: palette 1, tiles 0-7 all 16 rows x 64 bytes (unused rows / columns are zero data)."""
    p = _stack(b, 64)
    cgutils.memset(b, p, c64(64), 0)
    b.store(ir.Constant(I8, 1), p)
    for t in range(8):
        store(b, ir.Constant(ir.IntType(16), 64), gep(b, p, c64(16 + 2 * t)), 1)
        b.store(ir.Constant(I8, 16), gep(b, p, c64(48 + t)))
    _tile(b, "ldtilecfg", p)


def _stack(b, nbytes):
    """A 64-byte aligned stack buffer (in the entry block)."""
    a = cgutils.alloca_once(b, ir.ArrayType(I8, nbytes))
    a.align = 64
    return b.bitcast(a, I8.as_pointer())


def _rows_of(b, base, offp, c, es, row_bytes, scratch):
    """(address, stride in bytes) of the 16 rows of keys c .. c + 15 (element offsets offp[c + j], es bytes
    per element): the cache itself when the rows are evenly spaced, else a copy in `scratch`. A branch, not
    a select: the tile loads then start on the predicted path instead of waiting for the check (a select
    measured +1 ns per key)."""
    o0 = b.load(gep(b, offp, c))
    step = b.sub(b.load(gep(b, offp, b.add(c, c64(1)))), o0)
    offs = load(b, gep(b, b.bitcast(offp, I8.as_pointer()), b.mul(c, c64(8))), V16L, 8)
    want = b.add(splat(b, o0, 16), b.mul(splat(b, step, 16), ir.Constant(V16L, list(range(16)))))
    same = b.bitcast(b.icmp_signed("==", offs, want), ir.IntType(16))
    addr = var(b, scratch)
    stride = var(b, row_bytes)
    with b.if_else(b.icmp_unsigned("==", same, ir.Constant(ir.IntType(16), 0xFFFF)), likely=True) as (then, other):
        with then:
            b.store(gep(b, base, b.mul(o0, es)), addr)
            b.store(b.mul(step, es), stride)
        with other:
            chunks = b.udiv(row_bytes, c64(64))
            for j in range(KEYS):
                src = gep(b, base, b.mul(b.load(gep(b, offp, b.add(c, c64(j)))), es))
                dst = gep(b, scratch, b.mul(row_bytes, c64(j)))
                with cgutils.for_range(b, chunks) as loop:
                    o = b.mul(loop.index, c64(64))
                    store(b, load(b, gep(b, src, o), V64B), gep(b, dst, o))
    return b.load(addr), b.load(stride)


def _transpose_plan(NRp):
    """Shuffles that turn 16 vectors (key j: lanes = the scores of query rows 0..15) into NRp vectors (row r:
    lanes = the scores of keys 0..15), for the rows r < NRp (a power of two <= 16): a list of steps
    (out, a, b, mask) over numbered vectors (0..15 the inputs); returns (steps, output vector numbers).
    Phase 1 merges the keys' rows r < NRp pairwise until each vector is full (16 / NRp keys x NRp rows);
    phase 2 splits those by rows, halving the row set per step, until each holds one row of all 16 keys.
    NRp = 4: 12 + 8 shuffles per 16 keys instead of 64 scalar loads and inserts."""
    content = {j: [(j, r) for r in range(16)] for j in range(16)}   # vector -> (key, row) of each lane
    steps, nxt = [], [16]

    def merge(a, bv, keep):
        both = content[a] + content[bv]
        lanes = sorted(keep, key=lambda kr: (kr[1], kr[0]))
        mask = [both.index(kr) for kr in lanes]
        o = nxt[0]
        nxt[0] += 1
        content[o] = lanes + [lanes[-1]] * (16 - len(lanes))
        steps.append((o, a, bv, mask + [mask[-1]] * (16 - len(mask))))
        return o

    def need(v, rows):
        return [kr for kr in dict.fromkeys(content[v]) if kr[1] in rows]

    vecs = list(range(16))
    rows = set(range(NRp))
    while len(vecs) > NRp:
        vecs = [merge(vecs[i], vecs[i + 1], need(vecs[i], rows) + need(vecs[i + 1], rows))
                for i in range(0, len(vecs), 2)]
    groups = [(v, sorted(rows)) for v in vecs]          # each vector: all its keys x these rows
    while len(groups[0][1]) > 1:
        out = []
        for i in range(0, len(groups), 2):
            (a, ra), (bv, _) = groups[i], groups[i + 1]
            h = len(ra) // 2
            for half in (ra[:h], ra[h:]):
                out.append((merge(a, bv, need(a, set(half)) + need(bv, set(half))), half))
        groups = sorted(out, key=lambda g: g[1][0])      # pair vectors of the same rows next
    order = sorted(groups, key=lambda g: g[1][0]) if NRp > 1 else groups
    return steps, [g[0] for g in order]


@intrinsic
def qk_amx(typingctx, qaddr, q_rs, kaddr, offaddr, n, saddr, s_rs, R, D, scale, xaddr, xoffaddr, xn, xrow, xes):
    """qk_dp (simd.py) on AMX tiles, for n % 16 == 0, R <= 16 and D in {32, 64, 96, 128}."""
    sig = types.void(*([types.int64] * 9 + [types.float32] + [types.int64] * 5))

    def body(b, args):
        if not _HOST_AMX:
            return
        qa, qrs, ka, oa, n_, sa, srs, R_, D_, sc = args[:10]
        x = other_stream(b, *args[10:])
        offp = ptr(b, oa, I64)
        _configure(b)
        nd = b.udiv(D_, c64(32))
        row_bytes = b.mul(D_, c64(2))
        # B tiles: qb[d][k][r] = dword 16 d + k of query row r (a pair of channels), zero for r >= R
        qb = _stack(b, QK_MAX_CHUNKS * 1024)
        cgutils.memset(b, qb, c64(QK_MAX_CHUNKS * 1024), 0)
        qb32 = b.bitcast(qb, I32.as_pointer())
        with cgutils.for_range(b, R_) as r:
            qrow = ptr(b, b.add(qa, b.mul(r.index, qrs)), I32)
            with cgutils.for_range(b, b.mul(nd, c64(16))) as k:
                kk = k.index
                dst = b.add(b.add(b.mul(b.udiv(kk, c64(16)), c64(256)), b.mul(b.urem(kk, c64(16)), c64(16))), r.index)
                b.store(b.load(gep(b, qrow, kk)), gep(b, qb32, dst))
        for d in range(QK_MAX_CHUNKS):
            with b.if_then(b.icmp_unsigned("<", c64(d), nd)):
                _tile(b, "tileloadd64", 2 + d, gep(b, qb, c64(d * 1024)), c64(64))
        kscr = [_stack(b, KEYS * QK_MAX_CHUNKS * 64) for _ in range(2)]
        kbase = ptr(b, ka)
        st = _stack(b, SPAN * 64)                              # C tiles stored: [keys][16 rows] float32
        vs = splat(b, sc, 16)

        def blocks(c, c_st, nb):
            """nb (1 or 2) blocks of 16 keys from key c (stored at key c_st of st), C tiles 6, 7 together."""
            srcs = []
            for t in range(nb):
                srcs.append(_rows_of(b, kbase, offp, b.add(c, c64(KEYS * t)), c64(2), row_bytes, kscr[t]))
                _tile(b, "tilezero", 6 + t)
            for d in range(QK_MAX_CHUNKS):
                with b.if_then(b.icmp_unsigned("<", c64(d), nd)):
                    for t in range(nb):
                        _tile(b, "tileloadd64", t, gep(b, srcs[t][0], c64(64 * d)), srcs[t][1])
                        _tile(b, "tdpbf16ps", 6 + t, t, 2 + d)
            prefetch_rows(b, x, c, KEYS * nb)
            for t in range(nb):
                _tile(b, "tilestored64", 6 + t, gep(b, st, b.mul(b.add(c_st, c64(KEYS * t)), c64(64))), c64(64))

        # spans of up to SPAN keys: tiles first, then the scores out of the stored tiles (reading a tile
        # store right after it stalls)
        with cgutils.for_range(b, b.udiv(b.add(n_, c64(SPAN - 1)), c64(SPAN))) as sp:
            c0 = b.mul(sp.index, c64(SPAN))
            m = b.sub(n_, c0)
            m = b.select(b.icmp_unsigned("<", m, c64(SPAN)), m, c64(SPAN))
            npair = b.udiv(m, c64(2 * KEYS))
            with cgutils.for_range(b, npair) as loop:
                cl = b.mul(loop.index, c64(2 * KEYS))
                blocks(b.add(c0, cl), cl, 2)
            with b.if_then(b.icmp_unsigned("!=", b.urem(m, c64(2 * KEYS)), c64(0))):
                cl = b.mul(npair, c64(2 * KEYS))
                blocks(b.add(c0, cl), cl, 1)
            # the scores out of the stored tiles: 16 keys x NRp rows transposed in registers per block
            def out(NRp):
                steps, outs = _transpose_plan(NRp)
                with cgutils.for_range(b, b.udiv(m, c64(KEYS))) as blk:
                    v = {j: load(b, gep(b, st, b.add(b.mul(blk.index, c64(KEYS * 64)), c64(64 * j))), V16F, 64)
                         for j in range(KEYS)}
                    for o, x1, x2, mask in steps:
                        v[o] = shuffle(b, v[x1], v[x2], mask)
                    for r in range(NRp):
                        with b.if_then(b.icmp_unsigned("<", c64(r), R_)):
                            dst = b.add(sa, b.mul(c64(4), b.add(b.mul(srs, c64(r)), b.add(c0, b.mul(blk.index, c64(KEYS))))))
                            store(b, b.fmul(v[outs[r]], vs), ptr(b, dst), 4)
            nrp = c64(16)
            for k in (8, 4, 2, 1):
                nrp = b.select(b.icmp_unsigned("<=", R_, c64(k)), c64(k), nrp)
            switch(b, nrp, (1, 2, 4, 8), out, 16)
        _tile(b, "tilerelease")

    def codegen(context, builder, signature, args):
        return outlined(context, builder, "fia_qk_amx", args, body)
    return sig, codegen


# interleave the even-channel and odd-channel sums of one query row back into channel order
_INTER_LO = [x for i in range(8) for x in (i, 16 + i)]
_INTER_HI = [x for i in range(8, 16) for x in (i, 16 + i)]


@intrinsic
def pv_amx(typingctx, paddr, p_rs, vaddr, offaddr, n, aaddr, a_rs, R, Dv, xaddr, xoffaddr, xn, xrow, xes):
    """pv_dp (simd.py) on AMX tiles, for n % 16 == 0, Dv % 32 == 0 and Dv <= PV_MAX_DV (any R: 8 query
    rows and 128 channels per pass over the keys)."""
    sig = types.void(*([types.int64] * 14))

    def body(b, args):
        if not _HOST_AMX:
            return
        pa, prs, va, oa, n_, aa, ars, R_, Dv_ = args[:9]
        x = other_stream(b, *args[9:])
        offp = ptr(b, oa, I64)
        _configure(b)
        nch = b.udiv(Dv_, c64(32))                          # 32-channel chunks
        row_bytes = b.mul(Dv_, c64(2))
        ascr = _stack(b, 1024)                             # A tile: [16 rows][16 keys x (p, 0) / (0, p)]
        cs = _stack(b, 1024)
        vscr = _stack(b, KEYS * 2 * PV_MAX_DV)               # uneven rows
        vbase = ptr(b, va)
        ngr = b.udiv(b.add(R_, c64(7)), c64(8))
        ncg = b.udiv(b.add(nch, c64(3)), c64(4))
        with cgutils.for_range(b, ngr) as rg:
            r0 = b.mul(rg.index, c64(8))
            nr = b.sub(R_, r0)
            nr = b.select(b.icmp_unsigned("<", nr, c64(8)), nr, c64(8))
            cgutils.memset(b, ascr, c64(1024), 0)
            with cgutils.for_range(b, ncg) as cg:
                ch0 = b.mul(cg.index, c64(4))
                m = b.sub(nch, ch0)
                xg = first_only(b, x, b.add(rg.index, cg.index))

                def group(NCH):
                    for t in range(NCH):
                        _tile(b, "tilezero", 4 + t)
                    with cgutils.for_range(b, b.udiv(n_, c64(KEYS))) as blk:
                        c = b.mul(blk.index, c64(KEYS))
                        with cgutils.for_range(b, nr) as r:
                            pw = load(b, ptr(b, b.add(pa, b.add(b.mul(b.add(r0, r.index), prs),
                                                                 b.mul(c, c64(2))))), V16S, 2)
                            w = b.zext(pw, V16I)
                            row = gep(b, ascr, b.mul(r.index, c64(128)))
                            store(b, w, row, 64)
                            store(b, b.shl(w, ir.Constant(V16I, [16] * 16)), gep(b, row, c64(64)), 64)
                        _tile(b, "tileloadd64", 0, ascr, c64(64))
                        src, stride = _rows_of(b, vbase, offp, c, c64(2), row_bytes, vscr)
                        prefetch_rows(b, xg, c, KEYS)
                        for t in range(NCH):
                            tb = 1 + (t & 1)
                            _tile(b, "tileloadd64", tb, gep(b, src, b.mul(b.add(ch0, c64(t)), c64(64))), stride)
                            _tile(b, "tdpbf16ps", 4 + t, 0, tb)
                    for t in range(NCH):
                        _tile(b, "tilestored64", 4 + t, cs, c64(64))
                        with cgutils.for_range(b, nr) as r:
                            ev = load(b, gep(b, cs, b.mul(r.index, c64(128))), V16F, 64)
                            od = load(b, gep(b, cs, b.add(b.mul(r.index, c64(128)), c64(64))), V16F, 64)
                            arow = b.add(aa, b.mul(c64(4), b.add(b.mul(b.add(r0, r.index), ars),
                                                              b.mul(b.add(ch0, c64(t)), c64(32)))))
                            for h, mask in ((0, _INTER_LO), (64, _INTER_HI)):
                                p = ptr(b, b.add(arow, c64(h)))
                                store(b, b.fadd(load(b, p, V16F, 4), shuffle(b, ev, od, mask)), p, 4)

                switch(b, b.select(b.icmp_unsigned("<", m, c64(4)), m, c64(4)), (1, 2, 3), group, 4)
        _tile(b, "tilerelease")

    def codegen(context, builder, signature, args):
        return outlined(context, builder, "fia_pv_amx", args, body)
    return sig, codegen
