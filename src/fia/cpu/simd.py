"""bf16 dot-product micro-kernels of the decode backend (AVX512-BF16 `vdpbf16ps`), emitted as LLVM IR.

Why: the fused float32 kernels (decode.kernels.generic.qk_fused / pv_fused) widen every bf16 element and then
multiply-add 16 lanes per instruction; on the machines measured that leaves the decode kernel
compute-bound at ~120 cycles per key and KV head (docs/performance.md). `vdpbf16ps` multiplies 32 bf16
pairs and accumulates them into 16 float32 lanes in one instruction at the same rate as one float32
FMA: twice the multiply-adds, and no widening. Numba has no vector types, so the loops below are
written with llvmlite's IR builder inside numba intrinsics (the arrays reach them as addresses).

* `qk_dp`: s[r, c] = scale * sum_d q[r, d] * k_c[d] for bf16 query bits q and bf16 key rows. The
  products of two bf16 values are exact in float32 and the sums accumulate in float32, as in the fused
  kernel (only the summation order differs).
* `pv_dp`: acc[r, :] += sum_c p[r, c] * v_c[:] for the probabilities p given as bf16 bits: P is
  rounded to bf16 before the product, as the hardware's cube unit and torch's bf16 flash kernel do
  (docs/DECISIONS.md).
The instruction treats bf16 subnormals (|x| < 1.2e-38) as zero; NaN and Inf propagate as usual.

On a CPU without AVX512-BF16 the same IR computes the products with float32 multiplies (exact
emulation apart from subnormals), so the code always compiles; the backend only selects these kernels
where the instruction exists (`HAS_DP`), or when forced for testing (FIA_DECODE_DP=1).

The kernels that embed this IR are rebuilt when this file changes (cpu/kernel_cache.py).
"""
from __future__ import annotations

import os
from typing import Callable, NamedTuple

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def target_has(*features: str) -> bool:
    """Whether numba compiles for a CPU with all these LLVM x86 features: the host's, or the ones numba was
    told to target (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, e.g. for portable caches), where emitting an
    instruction the target lacks fails to compile (or needs runtime helpers numba does not link)."""
    try:
        from numba.core import config
        if config.CPU_FEATURES is not None:
            feats = config.CPU_FEATURES.split(",")
            return all("+" + f in feats for f in features)
        if config.CPU_NAME not in (None, "host"):
            return False
        import llvmlite.binding as llvm
        host = llvm.get_host_cpu_features()
        return all(bool(host.get(f)) for f in features)
    except Exception:  # pragma: no cover - llvmlite without feature query
        return False


# element kinds of a buffer (every buffer reaches the kernels as bytes; decode/backend.py passes them in ip)
KIND_F32, KIND_BF16, KIND_FP16, KIND_I8, KIND_I4 = 0, 1, 2, 3, 4

_HOST_DP = target_has("avx512bf16", "avx512f")
# FIA_DECODE_DP: "0" never use the dp kernels, "1" always (emulated where the CPU lacks the instruction),
# unset: where the CPU has it
HAS_DP = {"0": False, "1": True}.get(os.environ.get("FIA_DECODE_DP", ""), _HOST_DP)


class _BFloat(ir.Type):
    """LLVM's `bfloat` (llvmlite has no class for it); only used in the intrinsic's signature."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


I8P = ir.IntType(8).as_pointer()
I16, I32, I64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
F32 = ir.FloatType()
V16F = ir.VectorType(F32, 16)
V16I = ir.VectorType(I32, 16)
V32H = ir.VectorType(I16, 32)
V32B = ir.VectorType(_BFloat(), 32)
ZERO16 = ir.Constant(V16F, [0.0] * 16)
DP_NAME = "llvm.x86.avx512bf16.dpbf16ps.512"


def declare(b, name, fnty):
    """The LLVM intrinsic `name` of type fnty, declared once in the builder's module."""
    fn = b.module.globals.get(name)
    return fn if fn is not None else ir.Function(b.module, fnty, name)


def dp(b: ir.IRBuilder, acc, x, y):
    """acc[l] += x[2l] * y[2l] + x[2l + 1] * y[2l + 1] for bf16 pairs x, y (<16 x i32> or <32 x i16>)."""
    if _HOST_DP:
        fn = declare(b, DP_NAME, ir.FunctionType(V16F, [V16F, V32B, V32B]))
        return b.call(fn, [acc, b.bitcast(x, V32B), b.bitcast(y, V32B)])
    # emulation: the low bf16 of a pair is `dword << 16`, the high one `dword & 0xffff0000`
    xi, yi = b.bitcast(x, V16I), b.bitcast(y, V16I)
    sh = ir.Constant(V16I, [16] * 16)
    hm = ir.Constant(V16I, [-65536] * 16)
    lo = b.fmul(b.bitcast(b.shl(xi, sh), V16F), b.bitcast(b.shl(yi, sh), V16F))
    hi = b.fmul(b.bitcast(b.and_(xi, hm), V16F), b.bitcast(b.and_(yi, hm), V16F))
    return b.fadd(b.fadd(acc, lo), hi)


PF_NTA = 256      # in an intrinsic's `xes` argument (above the element size): prefetchnta instead of t1
PF_AHEAD = 1024   # ... times k (k < 64): also request the kernel's own rows k keys ahead (prefetch_ahead)


def _prefetch(b, p, locality=2):
    """prefetcht1 (locality 2: into L2, the line is used a whole chunk later, after L1 has turned over),
    prefetchnta (0) or prefetcht0 (3)."""
    fn = declare(b, "llvm.prefetch.p0", ir.FunctionType(ir.VoidType(), [I8P, I32, I32, I32]))
    b.call(fn, [p, ir.Constant(I32, 0), ir.Constant(I32, locality), ir.Constant(I32, 1)])


def other_stream(b, xaddr, xoffaddr, xn, xrow, xes):
    """The prefetch description of the intrinsics' last five arguments: rows of xrow elements of xes bytes
    at element offsets xoffs[c] (int64 at xoffaddr) of the buffer at xaddr, for keys c < xn; xes + PF_NTA:
    prefetchnta instead of prefetcht1; + k * PF_AHEAD: the kernel also requests its own rows k keys ahead
    (the tuple's last item, see prefetch_ahead)."""
    nta = b.icmp_unsigned("!=", b.and_(xes, c64(PF_NTA)), c64(0))
    ahead = b.and_(b.udiv(xes, c64(PF_AHEAD)), c64(63))
    xes = b.and_(xes, c64(PF_NTA - 1))
    return xaddr, ptr(b, xoffaddr, I64), xn, b.mul(xrow, xes), xes, nta, ahead


def prefetch_rows(b, x, c, nc, locality=None):
    """Prefetch the rows of keys c .. c + nc - 1 of the other stream x (other_stream): keys at or past
    its count are skipped, and with a share (shared) the keys of other shares. While QK streams a chunk's
    K, the same keys' V rows are requested; while PV streams V, the next chunk's K rows: both streams stay
    in flight. locality: a fixed prefetch kind instead of x's (t1, or nta when x says so)."""
    xn = x[2]
    for j in range(nc):
        cj = b.add(c, c64(j))
        with b.if_then(b.icmp_unsigned("<", cj, xn)):
            ok = _in_share(b, x, cj)
            with b.if_then(ok):
                _request_row(b, x, cj, locality)


def _in_share(b, x, cj):
    """Whether key cj is in x's share (shared): key pairs with (cj / 2) % parts == part; always, without a
    share. A branch, not a select, picks the mask for a power-of-two count: the division then never runs
    there (it ran for every key of every pass, unconditionally: the PV inner loop was division-bound, 8 FMAs
    per key against a 64-bit `div`)."""
    if len(x) <= 7:
        return ir.Constant(ir.IntType(1), 1)
    part, parts = x[7:]
    h = b.lshr(cj, c64(1))
    m = b.sub(parts, c64(1))
    r = var(b, c64(0))
    with b.if_else(b.icmp_unsigned("==", b.and_(parts, m), c64(0))) as (pow2, other):
        with pow2:
            b.store(b.and_(h, m), r)
        with other:
            b.store(b.urem(h, parts), r)
    return b.icmp_unsigned("==", b.load(r), part)


def _request_row(b, x, cj, locality):
    """Prefetch the row of key cj of the other stream x (see prefetch_rows)."""
    xaddr, xoffp, _, xbytes, xes, nta = x[:6]
    row = gep(b, ptr(b, xaddr), b.mul(b.load(gep(b, xoffp, cj)), xes))
    lines = b.udiv(b.add(xbytes, c64(63)), c64(64))
    if locality is not None:
        with cgutils.for_range(b, lines) as loop:
            _prefetch(b, gep(b, row, b.mul(loop.index, c64(64))), locality)
        return
    with b.if_else(nta) as (then, otherwise):
        for loc, blk in ((0, then), (2, otherwise)):
            with blk:
                with cgutils.for_range(b, lines) as loop:
                    _prefetch(b, gep(b, row, b.mul(loop.index, c64(64))), loc)


def prefetch_ahead(b, x, addr, offp, n, row_bytes, es, c, nc):
    """Request the kernel's own rows (row_bytes each, `es`-byte elements at offsets offp[c] of the buffer at
    addr, keys < n) x's `ahead` keys past c .. c + nc - 1 into L1 (prefetcht0), when ahead != 0. The other
    stream's prefetch brings them from DRAM a phase earlier, but a share still misses when the row is
    read; this short-distance request covers it (Zen 5: two threads +2-25 %; docs/performance.md,
    "Software prefetch")."""
    ahead = x[6]
    with b.if_then(b.icmp_unsigned("!=", ahead, c64(0))):
        prefetch_rows(b, (addr, offp, n, row_bytes, es, None), b.add(c, ahead), nc, locality=3)


@intrinsic
def prefetch_span(typingctx, addr, nbytes):
    """prefetcht1 (into L2) every 64-byte line of the nbytes bytes at addr; nothing for nbytes <= 0. A prefetch never
    faults: an address outside the buffer costs a request, not an error."""
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        a, nb = args
        with builder.if_then(builder.icmp_signed(">", nb, c64(0))):
            lines = builder.udiv(builder.add(nb, c64(63)), c64(64))
            with cgutils.for_range(builder, lines) as loop:
                _prefetch(builder, gep(builder, ptr(builder, a), builder.mul(loop.index, c64(64))))
        return context.get_dummy_value()
    return sig, codegen


def outlined(context, builder, name, args, body):
    """Call a function `name` of the caller's module whose code body(builder, args) emits (created on first
    use, internal, never inlined): each kernel is optimized as its own function instead of growing the
    caller, which keeps the first-call compile time of the decode kernels down."""
    mod = builder.module
    fn = mod.globals.get(name)
    if fn is None:
        fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [a.type for a in args]), name=name)
        fn.linkage = "internal"
        fn.attributes.add("noinline")
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        body(b, list(fn.args))
        b.ret_void()
    builder.call(fn, args)
    return context.get_dummy_value()


def switch(b, value, choices, emit, default):
    """emit(c) for the runtime `value` equal to one of the compile-time `choices`, emit(default) for any
    other value: one specialization per choice (unrolled head dims, element kinds)."""
    def go(k):
        if k == len(choices):
            emit(default)
            return
        with b.if_else(b.icmp_unsigned("==", value, c64(choices[k]))) as (then, otherwise):
            with then:
                emit(choices[k])
            with otherwise:
                go(k + 1)
    go(0)


def ptr(b, addr, ty=None):
    """i8* (or ty*) at an int64 address."""
    p = b.inttoptr(addr, I8P)
    return p if ty is None else b.bitcast(p, ty.as_pointer())


def gep(b, p, off):
    return b.gep(p, [off])


def load(b, p, ty, align=1):
    return b.load(b.bitcast(p, ty.as_pointer()), align=align)


def store(b, v, p, align=1):
    b.store(v, b.bitcast(p, v.type.as_pointer()), align=align)


def c64(v):
    return ir.Constant(I64, v)


def var(b, init):
    """A mutable local (alloca in the entry block; LLVM promotes it to a register)."""
    return cgutils.alloca_once_value(b, init)


def shuffle(b, x, y, mask):
    return b.shuffle_vector(x, y, ir.Constant(ir.VectorType(I32, len(mask)), mask))


def splat(b, x, lanes):
    """<lanes x T> with every lane x."""
    t = ir.VectorType(x.type, lanes)
    return shuffle(b, b.insert_element(ir.Constant(t, None), x, ir.Constant(I32, 0)), ir.Constant(t, None),
                    [0] * lanes)


# ---------------------------------------------------------------------------------------------- reductions
def _hsum_tree(b, vecs, lanes=16):
    """Sums of the `lanes` lanes of each vector of `vecs` (a power-of-two count <= lanes): (z, out), sum i being
    lanes out[i] = (first lane, width) of the vector z (width 1 when there are `lanes` vectors). Pairwise tree:
    each step adds the lower and upper halves of every slot of two vectors into one vector with twice the
    slots (2 shuffles + 1 add per pair)."""
    items = [(v, [(i, lanes)]) for i, v in enumerate(vecs)]   # (vector, [(input index, slot width)...])
    while len(items) > 1 or items[0][1][0][1] > 1:
        if len(items) == 1:                                  # one vector left: fold it onto itself
            items.append(items[0])
            dup = True
        else:
            dup = False
        nxt = []
        for a in range(0, len(items), 2):
            (x, sx), (y, sy) = items[a], items[a + 1]
            w = sx[0][1]
            h = w // 2
            lo, hi, slots = [], [], []
            for si in range(len(sx)):
                base = si * w
                lo += list(range(base, base + h)) + list(range(lanes + base, lanes + base + h))
                hi += list(range(base + h, base + w)) + list(range(lanes + base + h, lanes + base + w))
                slots += [(sx[si][0], h), (sy[si][0], h)]
            z = b.fadd(shuffle(b, x, y, lo), shuffle(b, x, y, hi))
            nxt.append((z, slots))
        items = nxt
        if dup:                                              # both copies carry the same sums
            break
    z, slots = items[0]
    w = slots[0][1]
    out = {}
    for pos, (idx, width) in enumerate(slots):
        if idx not in out:
            out[idx] = (pos * w, width)
    return z, out


def _hsum_many(b, vecs):
    """Sums of the 16 lanes of each vector of `vecs` (a power-of-two count <= 16), as a list of float
    values in the order of `vecs` (see _hsum_tree)."""
    return _sums_of(b, *_hsum_tree(b, vecs))


def _sums_of(b, z, out):
    """The sums of _hsum_tree's (z, out) as float values."""
    res = []
    for i in range(len(out)):
        lane, width = out[i]
        v = b.extract_element(z, ir.Constant(I32, lane))
        for k in range(1, width):                            # only when a fold left lanes unsummed
            v = b.fadd(v, b.extract_element(z, ir.Constant(I32, lane + k)))
        res.append(v)
    return res


# ---------------------------------------------------------------------------------------------- QK
class QKOp(NamedTuple):
    """How a QK kernel multiplies one chunk of a key row with one chunk of a query row (see _qk_block)."""
    es: int              # bytes per key element (key rows are addressed in elements)
    kstep: int           # key bytes per chunk
    qstep: int           # query bytes per chunk
    qty: ir.Type         # query chunk vector type
    zero: ir.Constant    # accumulator start
    load_k: Callable     # (b, p) -> key chunk vector
    dot: Callable        # (b, acc, q chunk, k chunk) -> acc
    to_float: Callable   # (b, acc) -> <16 x float>
    finish: Callable     # (b, r0, NR, NC, <NR * NC x float> row-major scores of rows r0 ...) -> stored scores


def chunk_at(b, kp, k, kstep: int, kfs=None):
    """Address of chunk k (kstep bytes) of the key row at kp: a row of one run (kfs None), or an NZ row whose
    32-byte fragments lie kfs bytes apart (SPEC 8b; kstep divides 32, so no chunk straddles two fragments)."""
    if kfs is None:
        return gep(b, kp, b.mul(k, c64(kstep)))
    per = 32 // kstep
    if per == 1:
        return gep(b, kp, b.mul(k, kfs))
    return gep(b, kp, b.add(b.mul(b.udiv(k, c64(per)), kfs), b.mul(b.urem(k, c64(per)), c64(kstep))))


def _qk_block(b, op, NR, NC, r0, q0, q_rs, kaddr, offp, c, s0, s_rs, nd, ND, x, qregs, n, kfs=None):
    """Scores of NR rows (query row r at byte q0 + r * q_rs, or its chunks qregs[r] already loaded) x NC keys
    (c, c + 1, ...; n: the chunk's key count), over nd chunks (ND: the same as a compile-time count, or None). Each key row is read front to back before the next
    one: on the machines measured the hardware prefetchers stream plain ascending reads at ~30 GB/s per
    core but only half that when rows are read interleaved. With ND known the block is straight-line
    code, so the NR x NC accumulation chains overlap (vdpbf16ps has a 6-cycle latency)."""
    # the prefetch requests first, before the accumulators exist: emitted after the FMAs, their code kept
    # every accumulator live across it, as in fma.qk_narrow (docs/performance.md, "Kernel choices: the measurements")
    prefetch_rows(b, x, c, NC)
    prefetch_ahead(b, x, kaddr, offp, n, c64(ND * op.kstep) if ND else b.mul(nd, c64(op.kstep)), c64(op.es), c, NC)
    accs = [[var(b, op.zero) for _ in range(NC)] for _ in range(NR)]

    def chunk(j, kp, k, ki=None):
        kv = op.load_k(b, chunk_at(b, kp, k, op.kstep, kfs))
        for r in range(NR):
            if qregs is not None:
                qv = qregs[r][ki]
            else:
                qv = load(b, gep(b, ptr(b, b.add(q0, b.mul(q_rs, c64(r)))), b.mul(k, c64(op.qstep))), op.qty)
            b.store(op.dot(b, b.load(accs[r][j]), qv, kv), accs[r][j])

    for j in range(NC):
        kp = gep(b, ptr(b, kaddr), b.mul(b.load(gep(b, offp, b.add(c, c64(j)))), c64(op.es)))
        if ND is None:
            with cgutils.for_range(b, nd) as loop:
                chunk(j, kp, loop.index)
        else:
            for k in range(ND):
                chunk(j, kp, c64(k), k)
    store_scores(b, op, accs, NR, NC, r0, s0, s_rs, c)


def store_scores(b, op, accs, NR, NC, r0, s0, s_rs, c, lanes=16):
    """A QK block's scores: the lane sums of its NR x NC accumulators (op.to_float first), op.finish on them
    row-major, each row's NC scores in one store (keys c .. c + NC - 1 of score row r0 + r at s0 + 4 s_rs r)."""
    L = NR * NC
    if NC & (NC - 1):             # 3 or 5 keys (fma.QK_NC_WIDENED): a tree per row, padded with zeros
        for r in range(NR):
            vecs = [op.to_float(b, b.load(accs[r][j])) for j in range(NC)]
            vecs += [ir.Constant(vecs[0].type, [0.0] * lanes)] * ((1 << (NC - 1).bit_length()) - NC)
            _store_row(b, op.finish(b, b.add(r0, c64(r)), 1, NC, _as_vector(b, _sums_of(b, *_hsum_tree(
                b, vecs, lanes))[:NC])), s0, s_rs, r, c)
        return
    z, out = _hsum_tree(b, [op.to_float(b, b.load(accs[r][j])) for r in range(NR) for j in range(NC)], lanes)
    if all(out[i][1] == 1 for i in range(L)):               # as many sums as lanes: one vector, row-major
        v = shuffle(b, z, z, [out[i][0] for i in range(L)])
    else:
        v = _as_vector(b, _sums_of(b, z, out))
    v = op.finish(b, r0, NR, NC, v)
    # one shuffle per row, not NC scalar extracts: no slower (docs/performance.md, "Kernel choices: the measurements")
    for r in range(NR):
        _store_row(b, shuffle(b, v, v, [r * NC + j for j in range(NC)]) if NC > 1 else b.extract_element(
            v, ir.Constant(I32, r)), s0, s_rs, r, c)


def _as_vector(b, vals):
    """Float values as one <len x float>."""
    v = ir.Constant(ir.VectorType(F32, len(vals)), None)
    for i, val in enumerate(vals):
        v = b.insert_element(v, val, ir.Constant(I32, i))
    return v


def _store_row(b, part, s0, s_rs, r, c):
    """Scores `part` (a float or a vector) of score row r (s_rs floats apart from s0) at key c."""
    row = b.add(s0, b.mul(c64(4), b.mul(s_rs, c64(r))))
    store(b, part, gep(b, ptr(b, row), b.mul(c, c64(4))), align=4)


def qk_blocks(b, qa, q_rs, sa, s_rs, R, n, x, block, NC, preload):
    """The QK schedule shared by qk_dp, fma.qk_fma and vnni.qk_i8: query rows in blocks of 4, 2,
    1 (row_blocks), keys in blocks of NC (or NC(NR) when NC is callable) then 1; block(NR, NC, r0, q0, c, s0,
    x, qregs) emits one block (r0: its first query row, q0: that row's address, c: its first key, s0: its
    first score row address, x: the other stream for its keys, qregs: preload(NR, q0) once per row block, or
    None)."""
    nc_of = NC if callable(NC) else (lambda NR: NC)

    def rows_of(NR, r0):
        NC = nc_of(NR)
        q0 = b.add(qa, b.mul(r0, q_rs))
        s0 = b.add(sa, b.mul(c64(4), b.mul(r0, s_rs)))
        xr = shared(b, x, r0, R, 4)
        qregs = preload(NR, q0) if preload else None
        nb = b.udiv(n, c64(NC))
        with cgutils.for_range(b, nb) as loop:
            block(NR, NC, r0, q0, b.mul(loop.index, c64(NC)), s0, xr, qregs)
        with cgutils.for_range(b, b.urem(n, c64(NC))) as loop:
            block(NR, 1, r0, q0, b.add(b.mul(nb, c64(NC)), loop.index), s0, xr, qregs)
    row_blocks(b, R, rows_of)


QK_UNROLLED = (4, 2)         # D = 128, 64: straight-line blocks; other D % 32 == 0: a loop over chunks


def qk_kernel(b, op, qa, q_rs, ka, offp, sa, s_rs, R, n, D, x, chunk, unrolled, kfs=None, preload_max=4):
    """The body of a QK kernel (qk_dp, fma.qk_fma, vnni.qk_i8): op's blocks over the
    qk_blocks schedule, D in chunks of `chunk` elements; head dims of `unrolled` chunk counts as
    straight-line code, the others as a loop over chunks; the query in registers up to preload_max chunks.
    kfs: NZ key rows (chunk_at)."""
    nd = b.udiv(D, c64(chunk))

    def variant(ND):
        preload = None
        if ND is not None and ND <= preload_max:
            # the row block's query chunks stay in registers (<= 16 vectors) across its keys, in blocks of 2
            # (8 accumulators): the query was reloaded from L1 for every key (4 keys x 4 rows per block), and
            # those loads cost more than their count; the hardware prefetchers now carry the K stream
            # (docs/performance.md, "Kernel choices: the measurements")
            def preload(NR, q0):
                return [[load(b, gep(b, ptr(b, b.add(q0, b.mul(q_rs, c64(r)))), c64(k * op.qstep)), op.qty)
                         for k in range(ND)] for r in range(NR)]
        qk_blocks(b, qa, q_rs, sa, s_rs, R, n, x, lambda NR, NC, r0, q0, c, s0, xr, qregs: _qk_block(
            b, op, NR, NC, r0, q0, q_rs, ka, offp, c, s0, s_rs, nd, ND, xr, qregs, n, kfs), 2 if preload else 4,
            preload)
    switch(b, nd, unrolled, variant, None)


def first_only(b, x, r0):
    """x for the first row block, nothing to prefetch for the others (their rows were requested)."""
    first = b.icmp_unsigned("==", r0, c64(0))
    return (x[0], x[1], b.select(first, x[2], c64(0))) + tuple(x[3:6]) + (b.select(first, x[6], c64(0)),) + tuple(x[7:])


def shared(b, x, r0, R, rows):
    """x for the row block of first row r0 (blocks of `rows` rows, the last ones maybe smaller): each of
    the ceil(R / rows) passes over the keys prefetches its share of the key pairs. Requesting everything
    in the first pass (as before) left the memory idle during the others: one thread, bf16 KV from DRAM,
    R = 4: 135 -> 111 cycles per key-head (PV 54 -> 31); two threads 3-13 % (docs/performance.md,
    "Software prefetch")."""
    return tuple(x) + (b.udiv(r0, c64(rows)), b.udiv(b.add(R, c64(rows - 1)), c64(rows)))


def row_blocks(b, R, body):
    """Rows [0, R) in blocks of 4, then 2, then 1: body(NR, first row)."""
    n4 = b.udiv(R, c64(4))
    with cgutils.for_range(b, n4) as loop:
        body(4, b.mul(loop.index, c64(4)))
    r = b.mul(n4, c64(4))
    rem = b.sub(R, r)
    with b.if_then(b.icmp_unsigned(">=", rem, c64(2))):
        body(2, r)
    r1 = b.add(r, b.and_(rem, c64(2)))
    with b.if_then(b.icmp_unsigned("==", b.and_(rem, c64(1)), c64(1))):
        body(1, r1)


@intrinsic
def qk_dp(typingctx, qaddr, q_rs, kaddr, offaddr, n, saddr, s_rs, R, D, scale, xaddr, xoffaddr, xn, xrow, xes):
    """s[r, c] = scale * q[r, :D] . K[c, :D], r < R, c < n. q: bf16 bits at qaddr, rows q_rs bytes apart;
    key c: bf16 bits at element offs[c] of the buffer at kaddr; offs: int64 at offaddr; s: float32 at
    saddr, rows s_rs elements apart. D % 32 == 0. Prefetched on the way (the other stream, see
    other_stream): rows of xrow elements of xes bytes at element xoffs[c] of the buffer at xaddr, c < xn."""
    sig = types.void(*([types.int64] * 9 + [types.float32] + [types.int64] * 5))

    def body(b, args):
        qa, qrs, ka, oa, n_, sa, srs, R_, D_, sc = args[:10]
        op = QKOp(2, 64, 64, V32H, ZERO16, lambda b, p: load(b, p, V32H), dp, lambda b, a: a,
                  lambda b, r0, NR, NC, v: b.fmul(v, splat(b, sc, NR * NC)))
        qk_kernel(b, op, qa, qrs, ka, ptr(b, oa, I64), sa, srs, R_, n_, D_, other_stream(b, *args[10:]), 32,
                   QK_UNROLLED)

    def codegen(context, builder, signature, args):
        return outlined(context, builder, "fia_qk_dp", args, body)
    return sig, codegen


# ---------------------------------------------------------------------------------------------- PV
# A 32-value chunk of two V rows a (key c), b (key c + 1) becomes two bf16-pair vectors: `lo` holds
# (a[d], b[d]) for d = 8L + i, `hi` for d = 8L + 4 + i (L = 128-bit lane 0..3, i = 0..3): the
# vpunpcklwd / vpunpckhwd pattern. Accumulator lane 4L + i therefore belongs to channel 8L + i (lo)
# or 8L + 4 + i (hi); the accumulators are permuted into that order when loaded and back when stored.
_UNPACK_LO = [x for L in range(4) for i in range(4) for x in (8 * L + i, 32 + 8 * L + i)]
_UNPACK_HI = [x for L in range(4) for i in range(4) for x in (8 * L + 4 + i, 32 + 8 * L + 4 + i)]
_ACC_LO = [8 * L + i for L in range(4) for i in range(4)]          # from natural [m0 ++ m1]
_ACC_HI = [8 * L + 4 + i for L in range(4) for i in range(4)]
ACC_BACK = [(4 * (t // 8) + t % 8) if t % 8 < 4 else (16 + 4 * (t // 8) + t % 8 - 4) for t in range(32)]


class PVOp(NamedTuple):
    """How a PV kernel multiplies weight pairs with value pairs (see _pv_rows)."""
    es: int              # bytes per value element (value rows are addressed in elements)
    load_v: Callable     # (b, p) -> 32 values at byte p as <32 x i16> (bf16 bits, widened int8, ...)
    dot: Callable        # (b, acc, weight pair <16 x i32>, value pairs <32 x i16>) -> acc
    acc_in: Callable     # (b, r, m0, m1) -> (lo, hi): accumulators of row r's 32 channels at float32 m0, m1
    acc_out: Callable    # (b, r, lo, hi, m0, m1): add / store them back
    block: int           # keys per accumulation block (acc_in ... acc_out around each)


def _acc_perm_in(b, r, m0, m1):
    """The float32 accumulators of 32 channels in the lo / hi pair order (see _UNPACK_LO)."""
    x, y = load(b, m0, V16F, 4), load(b, m1, V16F, 4)
    return shuffle(b, x, y, _ACC_LO), shuffle(b, x, y, _ACC_HI)


def _acc_perm_out(b, r, lo, hi, m0, m1):
    store(b, shuffle(b, lo, hi, ACC_BACK[:16]), m0, 4)
    store(b, shuffle(b, lo, hi, ACC_BACK[16:]), m1, 4)


def _pv_rows(b, op, NR, DG, p0, p_rs, vaddr, offp, n, a0, a_rs, ngroups, x):
    """acc rows a0 + r (float32, a_rs elements apart) += P rows p0 + r (16-bit weights, p_rs bytes apart)
    . V, DG 32-channel chunks per pass over the keys (ngroups passes); keys in blocks of op.block."""
    vbase = ptr(b, vaddr)
    vstep = 32 * op.es                                      # value bytes per 32-channel chunk
    zero = ir.Constant(V32H, [0] * 32)
    with cgutils.for_range(b, ngroups) as g:
        dbyte = b.mul(g.index, c64(DG * vstep))              # value bytes of this group's first channel
        dflt = b.mul(g.index, c64(DG * 32 * 4))              # float32 bytes
        xg = first_only(b, x, g.index)
        arows = [gep(b, ptr(b, a0), b.add(b.mul(a_rs, c64(4 * r)), dflt)) for r in range(NR)]
        ms = [[(gep(b, arows[r], c64(ch * 128)), gep(b, arows[r], c64(ch * 128 + 64))) for ch in range(DG)]
              for r in range(NR)]

        def step(accs, c, second):
            """Keys c and (second: c + 1 | None: a zero row with weight 0)."""
            va = gep(b, vbase, b.add(b.mul(b.load(gep(b, offp, c)), c64(op.es)), dbyte))
            prefetch_rows(b, xg, c, 2)
            prefetch_ahead(b, xg, vaddr, offp, n, b.mul(ngroups, c64(DG * vstep)), c64(op.es), c, 2)
            xs = [op.load_v(b, gep(b, va, c64(ch * vstep))) for ch in range(DG)]   # row c front to back
            if second:
                vb = gep(b, vbase, b.add(b.mul(b.load(gep(b, offp, b.add(c, c64(1)))), c64(op.es)), dbyte))
                ys = [op.load_v(b, gep(b, vb, c64(ch * vstep))) for ch in range(DG)]
            else:
                ys = [zero] * DG
            pairs = [(shuffle(b, x, y, _UNPACK_LO), shuffle(b, x, y, _UNPACK_HI)) for x, y in zip(xs, ys)]
            for r in range(NR):
                pp = gep(b, ptr(b, p0), b.add(b.mul(p_rs, c64(r)), b.mul(c, c64(2))))
                w = b.load(b.bitcast(pp, I32.as_pointer()), align=2)
                if not second:                               # weight 0 for the missing key
                    w = b.and_(w, ir.Constant(I32, 0xFFFF))
                wv = splat(b, w, 16)
                for ch in range(DG):
                    lo_v, hi_v = accs[r][ch]
                    b.store(op.dot(b, b.load(lo_v), wv, pairs[ch][0]), lo_v)
                    b.store(op.dot(b, b.load(hi_v), wv, pairs[ch][1]), hi_v)

        def finish(accs):
            for r in range(NR):
                for ch in range(DG):
                    op.acc_out(b, r, b.load(accs[r][ch][0]), b.load(accs[r][ch][1]), *ms[r][ch])
        pair_blocks(b, n, op.block, lambda: [[tuple(var(b, a) for a in op.acc_in(b, r, *ms[r][ch]))
                                               for ch in range(DG)] for r in range(NR)], step, finish)


def pair_blocks(b, n, block, start, step, finish):
    """Keys [0, n) in blocks of `block` keys, two at a time (the key-pair PV kernels: pv_dp, pv_i8 in both
    widths): accs = start() at each block's start, step(accs, c, True) for the pair (c, c + 1),
    step(accs, c, False) for a block's odd last key, finish(accs) at its end."""
    with cgutils.for_range(b, b.udiv(b.add(n, c64(block - 1)), c64(block))) as blk:
        k0 = b.mul(blk.index, c64(block))
        m = b.sub(n, k0)
        m = b.select(b.icmp_unsigned("<", m, c64(block)), m, c64(block))
        accs = start()
        with cgutils.for_range(b, b.udiv(m, c64(2))) as loop:
            step(accs, b.add(k0, b.mul(loop.index, c64(2))), True)
        with b.if_then(b.icmp_unsigned("==", b.urem(m, c64(2)), c64(1))):
            step(accs, b.add(k0, b.sub(m, c64(1))), False)
        finish(accs)


def pv_pairs_kernel(b, op_of, pa, p_rs, va, offp, n, aa, a_rs, R, Dv, x):
    """The body of a key-pair PV kernel (pv_dp, vnni.pv_i8): _pv_rows with op_of(first row) over the
    pv_row_blocks schedule, 128 channels per pass where Dv allows; else 64 channels in blocks of 4 rows (16
    accumulators: one pass over the V rows for 4 query rows instead of two)."""
    def rows_of(NR, DG, r0, rows=2):
        _pv_rows(b, op_of(r0), NR, DG, b.add(pa, b.mul(r0, p_rs)), p_rs, va, offp, n,
                 b.add(aa, b.mul(c64(4), b.mul(r0, a_rs))), a_rs, b.udiv(Dv, c64(DG * 32)),
                 shared(b, x, r0, R, rows))
    with b.if_else(b.icmp_unsigned("==", b.urem(Dv, c64(128)), c64(0))) as (then, otherwise):
        with then:
            pv_row_blocks(b, R, Dv, (4,), rows_of)             # (Dv % 128 == 0 here: 4 chunks per pass)
        with otherwise:
            row_blocks(b, R, lambda NR, r0: rows_of(NR, 2, r0, 4))


def pv_row_blocks(b, R, Dv, widths, body):
    """The PV schedule shared by pv_dp, fma.pv_fma and vnni.pv_i8: rows in blocks of 2 (then 1),
    each pass over the keys covering as many channels as its accumulators hold. widths: ((m, DG), ..., DG_default): DG
    chunks per pass for the first m with Dv % m == 0 (128 channels: every row of D = 128 read front to
    back in one pass, the order the prefetchers stream best). body(NR, DG, first row)."""
    *pairs, last = widths

    def rows(DG):
        with cgutils.for_range(b, b.udiv(R, c64(2))) as loop:
            body(2, DG, b.mul(loop.index, c64(2)))
        with b.if_then(b.icmp_unsigned("==", b.urem(R, c64(2)), c64(1))):
            body(1, DG, b.sub(R, c64(1)))

    def go(k):
        if k == len(pairs):
            rows(last)
            return
        m, DG = pairs[k]
        with b.if_else(b.icmp_unsigned("==", b.urem(Dv, c64(m)), c64(0))) as (then, otherwise):
            with then:
                rows(DG)
            with otherwise:
                go(k + 1)
    go(0)


@intrinsic
def pv_dp(typingctx, paddr, p_rs, vaddr, offaddr, n, aaddr, a_rs, R, Dv, xaddr, xoffaddr, xn, xrow, xes):
    """acc[r, :Dv] += sum_c p[r, c] * V[c, :Dv], r < R, c < n. p: bf16 bits at paddr, rows p_rs bytes
    apart, read as (p[r, c], p[r, c + 1]) pairs (the row must have an even number of readable entries
    past c when n is odd: the missing partner's weight is masked to 0, its V row is never read);
    value c: bf16 bits at element offs[c] of the buffer at vaddr; acc: float32 at aaddr, rows a_rs
    elements apart. Dv % 64 == 0. Prefetched on the way: as in qk_dp (keys c < min(n, xn))."""
    sig = types.void(*([types.int64] * 14))

    def body(b, args):
        pa, prs, va, oa, n_, aa, ars, R_, Dv_ = args[:9]
        op = PVOp(2, lambda b, p: load(b, p, V32H), dp, _acc_perm_in, _acc_perm_out, 1 << 40)
        pv_pairs_kernel(b, lambda r0: op, pa, prs, va, ptr(b, oa, I64), n_, aa, ars, R_, Dv_,
                         other_stream(b, *args[9:]))

    def codegen(context, builder, signature, args):
        return outlined(context, builder, "fia_pv_dp", args, body)
    return sig, codegen


# ---------------------------------------------------------------------------------------------- exp pass
EXP_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _fc(v, lanes=16):
    return ir.Constant(ir.VectorType(F32, lanes), [float(np.float32(v))] * lanes)


def _exp16(b, x):
    """cpu.numerics.fexp on 16 lanes, operation for operation (x <= 0; NaN propagates; x < -87 -> 0)."""
    floor = declare(b, "llvm.floor.v16f32", ir.FunctionType(V16F, [V16F]))
    lim = _fc(-87.0)
    low = b.fcmp_ordered("<", x, lim)
    xc = b.select(low, lim, x)
    t = b.call(floor, [b.fadd(b.fmul(xc, _fc(1.4426950408889634)), _fc(0.5))])
    r = b.fsub(xc, b.fmul(t, _fc(0.693145751953125)))
    r = b.fsub(r, b.fmul(t, _fc(1.428606765330187045e-06)))
    p = _fc(EXP_P[0])
    for c in EXP_P[1:]:
        p = b.fadd(b.fmul(p, r), _fc(c))
    p = b.fadd(b.fadd(b.fmul(b.fmul(p, r), r), r), _fc(1.0))
    e = b.bitcast(b.shl(b.add(b.fptosi(t, V16I), ir.Constant(V16I, [127] * 16)), ir.Constant(V16I, [23] * 16)), V16F)
    return b.select(low, _fc(0.0), b.fmul(p, e))


def _bf16_bits16(b, v):
    """cpu.numerics.f32_to_bf16_bits on 16 lanes: round to nearest even, NaN -> quiet NaN."""
    u = b.bitcast(v, V16I)
    c = lambda k: ir.Constant(V16I, [k] * 16)  # noqa: E731
    hi = b.lshr(u, c(16))
    rnd = b.lshr(b.add(b.add(u, c(0x7FFF)), b.and_(hi, c(1))), c(16))
    nan = b.icmp_unsigned(">", b.and_(u, c(0x7FFFFFFF)), c(0x7F800000))
    return b.trunc(b.select(nan, b.or_(hi, c(0x40)), rnd), ir.VectorType(I16, 16))


@intrinsic
def exp_rows(typingctx, saddr, n, mx, paddr, mode, inv):
    """The softmax pass of decode.kernels.softmax.softmax_chunk over one row, 16 lanes at a time, for the first
    n - n % 16 scores: s[c] = fexp(s[c] - mx) in place (float32 at saddr); mode 1: also p[c] = its bf16
    bits, mode 2: p[c] = int16(min(rint(s[c] * inv), 32767)) (16-bit at paddr); returns the sum of the
    new s[c]. The caller finishes the n % 16 tail. numba vectorizes its own loop 8 lanes wide on CPUs
    where LLVM prefers 256-bit vectors: 0.84 ns per score there (Intel Xeon with AMX)."""
    sig = types.float32(types.int64, types.int64, types.float32, types.int64, types.int64, types.float32)

    def codegen(context, builder, signature, args):
        b = builder
        sa, n_, m, pa, md, iv = args
        sp = ptr(b, sa)
        pp = ptr(b, pa)
        ms = splat(b, m, 16)
        ivs = splat(b, iv, 16)
        acc = var(b, ZERO16)
        rint = declare(b, "llvm.rint.v16f32", ir.FunctionType(V16F, [V16F]))
        vmin = declare(b, "llvm.minnum.v16f32", ir.FunctionType(V16F, [V16F, V16F]))
        with cgutils.for_range(b, b.udiv(n_, c64(16))) as loop:
            o = b.mul(loop.index, c64(16))
            sp16 = gep(b, sp, b.mul(o, c64(4)))
            e = _exp16(b, b.fsub(load(b, sp16, V16F, 4), ms))
            store(b, e, sp16, 4)
            b.store(b.fadd(b.load(acc), e), acc)
            p16 = gep(b, pp, b.mul(o, c64(2)))
            with b.if_then(b.icmp_unsigned("==", md, c64(1))):
                store(b, _bf16_bits16(b, e), p16, 2)
            with b.if_then(b.icmp_unsigned("==", md, c64(2))):
                q = b.call(vmin, [b.call(rint, [b.fmul(e, ivs)]), _fc(32767.0)])
                store(b, b.fptosi(q, ir.VectorType(I16, 16)), p16, 2)
        red = declare(b, "llvm.vector.reduce.fadd.v16f32", ir.FunctionType(F32, [F32, V16F]))
        return b.call(red, [ir.Constant(F32, 0.0), b.load(acc)], fastmath=("reassoc",))
    return sig, codegen


# A flag on a float instruction keeps numba's fastmath pass (which flags only unflagged ones) off it: no
# contraction or reassociation. Where a softmax loop scales its scores inside the exp's argument, the row's
# maximum must give exactly s * scale - max = 0 (an FMA would leave the product's rounding error there:
# +-half an ulp of the maximum, ~1e23 for scores of 1e30).
EXACT = ("nsz",)


def _exact_binop(op: str, name: str):
    def fn(typingctx, x, y):
        if not (x == y == types.float32):
            return None
        sig = types.float32(types.float32, types.float32)

        def codegen(context, builder, signature, args):
            return getattr(builder, op)(args[0], args[1], flags=EXACT)
        return sig, codegen
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"float32 x {op[1:]} y, rounded on its own (never fused or reassociated by fastmath)."
    return intrinsic(fn)


mul_exact = _exact_binop("fmul", "mul_exact")
sub_exact = _exact_binop("fsub", "sub_exact")


# ---------------------------------------------------------------------------------------------- row maxima
@intrinsic
def max_f32(typingctx, addr, n, init, absolute):
    """max(init, x[0], ..., x[n - 1]) for the float32 x at addr (absolute != 0: of |x[i]|), 4 x 16 lanes at
    a time. numba's own loops keep this reduction scalar (a maxss chain, ~0.5 ns per element) unless the
    caller is compiled with nnan. NaN elements are skipped (maxnum): callers rule NaN out or do not need it
    (decode.kernels.softmax.softmax_chunk: exp(NaN - max) is NaN whatever the max)."""
    sig = types.float32(types.int64, types.int64, types.float32, types.int64)

    def codegen(context, builder, signature, args):
        b = builder
        a, n_, init, ab = args
        p = ptr(b, a, F32)
        mx = ir.FunctionType(V16F, [V16F, V16F])
        vmax = declare(b, "llvm.maxnum.v16f32", mx)
        smax = declare(b, "llvm.maxnum.f32", ir.FunctionType(F32, [F32, F32]))
        vabs = declare(b, "llvm.fabs.v16f32", ir.FunctionType(V16F, [V16F]))
        sabs = declare(b, "llvm.fabs.f32", ir.FunctionType(F32, [F32]))
        use_abs = b.icmp_unsigned("!=", ab, c64(0))
        accs = [var(b, splat(b, init, 16)) for _ in range(4)]
        with cgutils.for_range(b, b.udiv(n_, c64(64))) as loop:
            for j in range(4):
                v = load(b, gep(b, p, b.add(b.mul(loop.index, c64(64)), c64(16 * j))), V16F, 4)
                v = b.select(use_abs, b.call(vabs, [v]), v)
                b.store(b.call(vmax, [b.load(accs[j]), v]), accs[j])
        v = b.call(vmax, [b.call(vmax, [b.load(accs[0]), b.load(accs[1])]),
                          b.call(vmax, [b.load(accs[2]), b.load(accs[3])])])
        red = declare(b, "llvm.vector.reduce.fmax.v16f32", ir.FunctionType(F32, [V16F]))
        res = var(b, b.call(red, [v]))
        with cgutils.for_range(b, b.sub(n_, b.mul(b.udiv(n_, c64(64)), c64(64)))) as loop:
            x = b.load(gep(b, p, b.add(b.mul(b.udiv(n_, c64(64)), c64(64)), loop.index)), align=4)
            x = b.select(use_abs, b.call(sabs, [x]), x)
            b.store(b.call(smax, [b.load(res), x]), res)
        return b.load(res)
    return sig, codegen
