"""Fast CPU prefill backend (Q_S > 1): blocked online softmax with tiles derived from the geometry.

The arithmetic core is a fused flash-attention kernel with the contract of ATen's CPU kernel
(`torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`, the kernel behind SDPA on CPU). Per call it
computes, for q [1, N, L, E], k/v [1, KV_N, S, E] (GQA natively: head n reads kv head n // G, no copies):
    S = scale · Q Kᵀ (+ attn_mask, additive, same dtype as q) ; top-left causal j <= i when is_causal
    out = softmax(S) V   (online softmax, float32 accumulators, bf16/fp16 matmuls for bf16/fp16 inputs)
    lse [1, N, L] float32 (float64 for float64), natural log.
`_flash` runs FIA's own bf16 / fp16 / float32 kernel (flash.py: AVX-512 GEMMs, ~2x ATen's speed for
bf16 / fp16 on the machine measured) when it applies, else ATen's. The own kernel also takes a band
(pre, next) as geometry, reads a user mask in place and takes Dv != D: for its calls the whole batch window
is one call, keys outside the band and fully user-masked key tiles are never computed (no mask tiles).
ATen's kernel cannot take a geometry mask without materializing it, skip tiles of a band, take Dv != D,
survive an empty key set (SIGFPE), or say which rows saw no key (their lse comes back 0). For its calls
this module does those parts:

* plan (plan.py): per batch, from BatchGeometry and MaskSpec.band_for, split the rows x keys
  rectangle into segments: FULL (every row sees every key: no mask), CAUSAL (a top-left triangle: the
  kernel's is_causal) and MASKED (a band edge or a user-mask tile: mask built for that tile only; the band
  tile is the same for every interior block and cached). Keys outside the band are never visited (tile
  skipping); runs of interior band blocks go to ONE kernel call as batch entries of overlapping strided
  views of q/k/v (no copies). A user-mask tile that masks everything is skipped, one that masks nothing
  runs unmasked. Nothing of size Q_S x KV_S is ever allocated.
* pse without a mask (pse.py): key tiles whose scores are provably more than 50 below the row
  maximum (Cauchy-Schwarz + tile max of the bias vs. an exact score) are not computed.
* run segments, merge the partial results of a row block through their lse (float32), then apply SPEC 6 /
  1.1b to special rows: geometry-empty rows 0 / +inf; rows whose keys are all user-masked -> mean of V over
  the batch's keys with lse -1e12 + log(S2) (uniform softmax of the finite fill), or 0 / +inf with
  row-invalid correction; learnable sink merged as one extra score column.
* masked keys score SPEC 3's finite fill (-1e12), which the kernels' -inf masks leave out: it only carries
  weight in rows whose visible scores all lie near or below it (huge |scale| or inputs), detected from the
  row lse (one reduction per block) and merged in exactly (_fill_rows). ATen's is_causal applies its -inf
  before the scale, so a causal call with scale <= 0 gets -q and -scale (scale 0: a zero q) instead.
* B = 1 with one call covering the whole window (causal, no mask, pse below the skipping size): the
  kernel's own output is returned, exactly what SDPA does.
Declared unsupported: decode (Q_S = 1), full int8 quantization (P is requantized between the products).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from ... import caches
from ...cpu import jit
from ...problem.attention import MASK_FILL, AttentionProblem
from . import flash as prefill_flash
from . import replay as prefill_replay
from ..base import PRIORITY_PREFILL, Backend, BackendResult, Capabilities
from .plan import CAUSAL, FULL, MASKED, RCAUSAL, BlockPlan, band_outside_tile, dead_row_ranges, plan_batch
from .pse import key_tile_norms, needed_ranges
from ..reference import ReferenceBackend, batch_keys, batch_query, unless_non_finite

_aten_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _own(q, k, v, attn_mask, small_aten: bool) -> bool:
    """Whether _flash runs FIA's own kernel on these tensors (their metadata decide)."""
    return prefill_flash.eligible(q, k, v, attn_mask) and \
        not (small_aten and prefill_flash.small_for_aten(q.dtype, q.shape[-2], k.shape[-2], q.shape[-1]))


def _flash(q, k, v, dropout: float, is_causal: bool, attn_mask=None, scale=None, stats: Optional[dict] = None,
           small_aten: bool = False, own: Optional[bool] = None):
    """One fused-kernel call (ATen's contract, see the module doc): FIA's own kernel where it applies
    (prefill_flash.eligible; `stats` then receives its findings, prefill_flash.flash), else ATen's CPU flash
    kernel -- also, with `small_aten`, for the small calls it runs faster (prefill_flash.small_for_aten).
    own: _own's answer where the caller kept it (a replay: the same metadata)."""
    if own if own is not None else _own(q, k, v, attn_mask, small_aten):
        st = {} if stats is None else stats
        o, l = prefill_flash.flash(q, k, v, is_causal, attn_mask, scale, tame=True, stats=st)
        return _untame(o, st["tame"]), l
    v, e, v_finite = _tame(v)
    if is_causal and scale is not None and scale <= 0:
        # ATen fills the causal -inf before scaling (-inf * 0 = NaN, -inf * -s = +inf): fold the sign into q,
        # exact in every dtype; scale 0 is an all-zero score matrix (uniform weights)
        q, scale = (torch.zeros_like(q), 1.0) if scale == 0 else (-q, -scale)
    o, l = _aten_flash(q, k, v, dropout, is_causal, attn_mask=attn_mask, scale=scale)
    lo, hi = (float(x) for x in torch.aminmax(l)) if l.numel() else (0.0, 0.0)
    if hi == math.inf:
        raise ScoreOverflow                # (its row's output came back 0, not the formula's)
    if stats is not None:
        # the output is a convex combination of V's rows: finite where V and every row's lse are (a NaN score
        # makes its row's lse NaN); otherwise "bad" asks the caller for its own check
        stats.update(tame=e, lse_min=lo, bad=not (v_finite and math.isfinite(lo) and math.isfinite(hi)))
    return _untame(o, e), l


class ScoreOverflow(Exception):
    """A score of ATen's kernel beyond float32's range (an lse of +inf, which no row with keys has otherwise): the
    kernel leaves that row's output 0. The backend answers such a call with the reference's numbers, as it
    answers non-finite results (DECISIONS 52)."""


_V_SAFE = prefill_flash.V_SAFE


def _tame(v: torch.Tensor):
    """The fused kernels sum unnormalized weights x values, which overflow for V near float32's maximum (the
    reference normalizes first): such a V is scaled by a power of two (exact) -> (v, exponent to restore, whether
    every value of V is finite; False: not looked at)."""
    if v.dtype in (torch.float64, torch.float16) or v.numel() == 0:      # (float16's largest value: 65504)
        return v, 0, False
    lo, hi = torch.aminmax(v)                      # one pass, no |v| copy
    vmax = max(-float(lo), float(hi))              # (NaN in v: NaN in both, no scaling)
    if not vmax > _V_SAFE or math.isinf(vmax):
        return v, 0, math.isfinite(vmax)
    e = math.frexp(vmax)[1]
    return v * 2.0 ** -e, e, True


def _untame(o: torch.Tensor, e: int) -> torch.Tensor:
    return o if e == 0 else o * 2.0 ** (e // 2) * 2.0 ** (e - e // 2)    # (2^e alone may not fit o's dtype)

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_NEG_INF = float("-inf")


class PrefillPlan(NamedTuple):
    """What running a prefill problem needs from its metadata alone (PrefillBackend.plan)."""
    kernel_dtype: torch.dtype       # the kernels' dtype (_kernel_dtype)
    out_dtype: torch.dtype          # the canonical output's (the compute dtype where the output is quantized)
    one_call: Optional[int]         # FULL / CAUSAL: one kernel call may cover the problem (_one_call); else None
    batches: tuple                  # the batches with query rows and keys
    direct: bool = False            # _one_call's window: views of the canonical tensors (_direct)


# the backend's kernel sets (fia.cpu.jit), their warm-up calls in fia.kernel_warmup (made through the public API)
jit.register(jit.KernelSet("prefill", "fia.backends.prefill.kernels", ("pack_items", "flash_items"),
                           "fia.kernel_warmup:run_prefill"))
jit.register(jit.KernelSet("prefill-pse", "fia.backends.prefill.pse_kernels", ("row_stats",),
                           "fia.kernel_warmup:run_prefill_pse"))


class PrefillBackend(Backend):
    name = "prefill"
    priority = PRIORITY_PREFILL
    replay_trial = False        # its replays run the full path's launch (prefill/replay.py): fia.replay admits them
    #                             from the first call of their key, without a trial
    capabilities = Capabilities(
        devices=("cpu",), decode=False, full_quant=False, numba="no (FIA's own kernel: yes)",
        why={"decode": "decode (Q_S = 1): this backend covers prefill (Q_S > 1) only",
             "full quant": "full int8 quantization (SPEC 11: P is quantized to int8 between the two products, "
                           "which the fused kernel cannot do)",
             "compute": "kernel supports float32/float64 accumulation"},
        notes={"fp4": "no (decode only)", "float64": "yes (torch's kernel)"})

    # tiling (tuned on a 2-core AVX2 machine, docs/performance.md, "Tile sizes and memory")
    block_q = 256          # query rows per block when the band or a user mask needs blocking
    band_block_q = 192     # band blocks (>= 192 keeps the kernel's 64-row q split; smaller wastes fewer keys)
    band_split = False     # see plan.plan_batch
    pse_skip = True        # pse without mask: drop key tiles below float32 resolution (pse.py)
    pse_skip_min = 4096 * 4096  # ... for windows of at least this many scores (below: no measured gain)
    pse_rows = 768         # row block of the pse path (>= 768: the kernel splits q by 256, its fastest)
    pse_tile = 128         # key tile of the pse bounds
    mask_chunk_elems = 1 << 21   # max elements of one materialized mask/bias tile (N x rows x cols)

    def kernel_sets(self, p: AttentionProblem):
        """fia.cpu.jit: FIA's own flash kernel where it serves this dtype on this CPU; the pse statistics pass."""
        on = prefill_flash.ENABLED_FOR.get(_kernel_dtype(p))       # the dtype the kernel runs in
        own = ("prefill",) if on is not None and on() else ()
        pse = p.pse is not None and p.mask.user_mask is None and self.pse_skip and p.Q_S * p.KV_S >= self.pse_skip_min
        return own + ("prefill-pse",) if pse else own

    def describe(self, p: AttentionProblem) -> Optional[str]:
        kd = _kernel_dtype(p)
        on = prefill_flash.ENABLED_FOR.get(kd)
        name = str(kd).replace('torch.', '')
        if on is not None and on() and self._one_call_kind(p, kd) is not None and \
                prefill_flash.small_for_aten(kd, p.geometry[0].s1, p.geometry[0].s2, p.D):     # (_one_call's window)
            return (f"kernel: ATen's CPU flash kernel in {name} (a whole call of at most "
                    f"{prefill_flash.small_aten_limit(p.D)} query x key pairs per head: faster there than FIA's own "
                    "kernel)")
        if on is not None and on():
            return (f"kernel: FIA's own flash kernel in {name}, "
                    f"{prefill_flash.variant()} (head dims multiples of 64; else ATen's CPU flash kernel)")
        return f"kernel: ATen's CPU flash kernel in {name}"

    # ------------------------------------------------------------------------------------------ plan / launch
    def plan(self, p: AttentionProblem) -> PrefillPlan:
        """p's metadata decisions: kernel and output dtypes, whether one fused call may cover it, the batches."""
        kd = _kernel_dtype(p)
        out_dt = p.compute_dtype if p.out_quant is not None else p.out_dtype
        batches = tuple(b for b, g in enumerate(p.geometry) if g.s1 != 0 and g.s2 != 0)
        one = self._one_call_kind(p, kd)
        return PrefillPlan(kd, out_dt, one, batches, one is not None and _direct(p, kd))

    def launch(self, p: AttentionProblem, plan: PrefillPlan, own: Optional[bool] = None) -> BackendResult:
        """own: _one_call_own's answer where the caller kept it (a replay)."""
        try:
            if plan.one_call is not None:
                direct = self._one_call(p, plan.one_call, plan.kernel_dtype, own, plan.direct)   # (results checked)
                if direct is not None:
                    return direct
            cd = p.compute_dtype
            dev = p.device
            out = torch.zeros(p.out_shape(), dtype=plan.out_dtype, device=dev)             # never computed: 0
            lse = torch.full(p.lse_shape(), float("inf"), dtype=cd, device=dev) if p.want_lse else None
            for b in plan.batches:
                self._run_batch(p, b, p.geometry[b], plan.kernel_dtype, out, lse)
            return unless_non_finite(p, BackendResult(out, lse))
        except ScoreOverflow:
            return ReferenceBackend().run(p)

    def _one_call_own(self, p: AttentionProblem, plan: PrefillPlan) -> Optional[bool]:
        """Whether _one_call runs FIA's own kernel on p (its metadata decide); None without a one-call plan."""
        if plan.one_call is None:
            return None
        g = p.geometry[0]
        return _own(*_window(p, g, plan.kernel_dtype, plan.direct), _window_bias(p, g), True)

    def replay(self, p: AttentionProblem, query, key, value, lengths: bool = False, extras: tuple = (),
               kv_axis: Optional[int] = None):
        """fia.replay's prepared launch of p's call (prefill/replay.py: the stored problem's launch), or None."""
        return prefill_replay.prepare(self, p, self.plan(p), lengths, extras)

    def _one_call_kind(self, p: AttentionProblem, kd) -> Optional[int]:
        """The segment kind (FULL / CAUSAL) when one kernel call may cover p (_one_call), else None: B = 1, the
        whole padded query window valid, one unmasked / causal block (metadata only)."""
        if p.packed or p.B != 1 or p.sink is not None or p.out_quant is not None or p.mask.user_mask is not None:
            return None
        g = p.geometry[0]
        if g.q_lo != 0 or g.s1 != p.Q_S or g.s2 == 0 or kd != p.out_dtype or p.Dv != p.D or \
                p.query_rope is not None:
            return None
        band = p.mask.band_for(g.s1, g.s2)
        blocks = plan_batch(g.s1, g.s2, band, False, self.block_q, 1 << 30)
        if len(blocks) != 1 or len(blocks[0].segments) != 1 or blocks[0].i0 != 0 or blocks[0].i1 != g.s1:
            return None
        if p.pse is not None and self.pse_skip and g.s1 * g.s2 >= self.pse_skip_min and band is None:
            return None
        seg = blocks[0].segments[0]
        if seg.kind not in (FULL, CAUSAL) or (seg.c0, seg.c1) != (0, g.s2):
            return None
        return seg.kind

    def _one_call(self, p: AttentionProblem, kind: int, kd, own: Optional[bool] = None,
                  direct: Optional[bool] = None) -> Optional[BackendResult]:
        """One kernel call over p's whole window (kind: _one_call_kind's): return the kernel's own output (what
        SDPA would), no zero-filled buffer and no copy; None where the result needs the general path. own /
        direct: _one_call_own's / _direct's answers where the caller has them."""
        g = p.geometry[0]
        q, k, v = _window(p, g, kd, direct)                    # [1, N, S1, D], [1, KV_N, S2, D] x 2
        bias = _window_bias(p, g)
        st = {}
        o, l = _flash(q, k, v, 0.0, kind == CAUSAL, attn_mask=bias, scale=p.scale, stats=st, small_aten=True,
                      own=own)
        lmin = st["lse_min"]
        if kind == CAUSAL and lmin < _fill_threshold(g.s2):
            return None                                        # masked keys' fill takes weight: _fill_rows
        res = BackendResult(o, l.contiguous() if p.want_lse else None)   # [1, N, S, D] (kernel strides)
        # finite as the kernel stored it (and V not rescaled): base.non_finite's passes would find nothing
        finite = st["tame"] == 0 and not st["bad"] and (not p.want_lse or lmin > _NEG_INF)
        return res if finite else unless_non_finite(p, res)

    def _run_batch(self, p: AttentionProblem, b: int, g, kd, out, lse) -> None:
        s1, s2 = g.s1, g.s2
        q = batch_query(p, b, g, kd)                           # [N, S1, E] (a view when nothing to convert)
        k, v = _keys(p, b, g, kd)                              # [KV_N, S2, E], [KV_N, S2, Dv]
        dv = v.shape[-1]
        band = p.mask.band_for(s1, s2)
        um = None
        if p.mask.user_mask is not None:
            umt = p.mask.user_mask
            um = umt[b if umt.shape[0] > 1 else 0, g.q_lo:g.q_hi, g.kv_lo:g.kv_lo + s2]     # [S1, S2] view
        pse = None
        if p.pse is not None:
            pse = p.pse[b if p.pse.shape[0] > 1 else 0, :, g.q_lo:g.q_hi, g.kv_lo:g.kv_lo + s2]  # [N, S1, S2]
        n = q.shape[0]
        chunk = max(64, self.mask_chunk_elems // (max(1, n if pse is not None else 1) * self.block_q))
        vm = {}

        vd = v                                                  # [KV_N, S2, Dv] before any padding

        def vmean():                                            # computed once, only if a row needs it
            if "v" not in vm:
                vm["v"] = _vmean(vd, n)
            return vm["v"]

        pse_skip = pse is not None and um is None and band is None and self.pse_skip and \
            s1 * s2 >= self.pse_skip_min
        bias = None if pse is None else pse[None]                  # [1, N, S1, S2] view
        if not pse_skip and prefill_flash.user_mask_ok(um) and \
                prefill_flash.eligible(q[None], k[None], v[None], bias):
            # the own kernel takes the band as geometry, reads the user mask in place and takes Dv != D: one
            # call for the whole window, keys outside the band and fully user-masked tiles never computed, no
            # mask tiles, no padded head dims
            st = {}
            o, l = prefill_flash.flash(q[None], k[None], v[None], False, bias, p.scale, band=band, user_mask=um,
                                       tame=True, stats=st)          # [1, N, S1, Dv], [1, N, S1]
            o = _untame(o, st["tame"])
            o, l = _fill_rows(0, s1, band, s2, o[0], l[0], um, vd)
            o, l = _special_rows(p, BlockPlan(0, s1), band, s2, o, l, vmean, um is not None)
            _write(p, b, g, 0, s1, o, l, out, lse)
            return
        q, k, v = _same_head_dim(q, k, v)                       # ATen's kernel: one head dim, unit stride
        q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        if pse_skip:
            self._run_pse_skipping(p, b, g, q4, k4, v4, pse, dv, out, lse)
            return
        batched = pse is None and um is None and q4.device.type == "cpu"
        for blk in plan_batch(s1, s2, band, um is not None, self.block_q, chunk, band_split=self.band_split,
                              band_batched=batched, band_block_q=self.band_block_q):
            if blk.nb > 1:
                o, l = self._run_batched(p, blk, q4, k4, v4, kd, band)
            else:
                o, l = self._run_block(p, blk, q4, k4, v4, um, pse, kd, band)
            if o is None:                                       # no segment ran: every row is special
                o = torch.zeros(n, blk.i1 - blk.i0, dv, dtype=p.compute_dtype, device=q.device)
                l = torch.full((n, blk.i1 - blk.i0), _NEG_INF, dtype=p.compute_dtype, device=q.device)
            o = o[..., :dv]
            o, l = _fill_rows(blk.i0, blk.i1, band, s2, o, l, um, vd)
            o, l = _special_rows(p, blk, band, s2, o, l, vmean, um is not None)
            _write(p, b, g, blk.i0, blk.i1, o, l, out, lse)

    def _run_pse_skipping(self, p, b, g, q4, k4, v4, pse, dv, out, lse):
        """pse_shift, no mask: per row block and kv head group, only the key range whose tiles can matter
        (pse.needed_ranges); groups with the same range share one call."""
        n, kv_n = q4.shape[1], k4.shape[1]
        G = n // kv_n
        s1 = g.s1
        kmax = key_tile_norms(k4[0], self.pse_tile)
        for i0 in range(0, s1, self.pse_rows):
            i1 = min(s1, i0 + self.pse_rows)
            ranges = needed_ranges(q4[0, :, i0:i1], k4[0], pse[:, i0:i1], p.scale, G, self.pse_tile, kmax)
            h = 0
            while h < kv_n:
                h2 = h + 1
                while h2 < kv_n and ranges[h2] == ranges[h]:
                    h2 += 1
                c0, c1 = ranges[h]
                n0, n1 = h * G, h2 * G
                bias = pse[None, n0:n1, i0:i1, c0:c1]
                if bias.dtype != q4.dtype:
                    bias = bias.to(q4.dtype)                    # the kernel takes the query's dtype
                o, l = _flash(q4[:, n0:n1, i0:i1], k4[:, h:h2, c0:c1], v4[:, h:h2, c0:c1], 0.0, False,
                              attn_mask=bias, scale=p.scale)
                o, l = o[0, ..., :dv], l[0]
                if p.sink is not None:
                    sk = p.sink[n0:n1].to(l.dtype)[:, None]
                    lt = torch.logaddexp(l, sk)
                    o = o.to(lt.dtype) * torch.exp(l - lt).unsqueeze(-1)
                    l = lt
                _write(p, b, g, i0, i1, o, l, out, lse, n0, n1)
                h = h2

    def _run_batched(self, p, blk: BlockPlan, q4, k4, v4, kd, band):
        """nb interior band blocks in one kernel call: block t = batch entry t of overlapping strided views
        (q rows i0 + t*bq, keys c0 + t*bq): o [N, nb*bq, E], l [N, nb*bq]."""
        nb, bq = blk.nb, blk.bq
        seg = blk.segments[0]
        w = seg.c1 - seg.c0
        mask, _ = _band_float_tile(blk.i0, blk.i0 + bq, seg.c0, seg.c1, band, kd, q4.device)

        def blocks(x, start, rows):                            # x [1, H, S, E] -> [nb, H, rows, E] view
            x = x[0]
            sh, ss, se = x.stride()
            return x.as_strided((nb, x.shape[0], rows, x.shape[2]), (bq * ss, sh, ss, se),
                                x.storage_offset() + start * ss)

        o, l = _flash(blocks(q4, blk.i0, bq), blocks(k4, seg.c0, w), blocks(v4, seg.c0, w), 0.0, False,
                      attn_mask=mask, scale=p.scale)           # [nb, N, bq, E], [nb, N, bq]
        n, e = o.shape[1], o.shape[3]
        return (o.permute(1, 0, 2, 3).reshape(n, nb * bq, e), l.permute(1, 0, 2).reshape(n, nb * bq))

    def _run_block(self, p, blk: BlockPlan, q4, k4, v4, um, pse, kd, band):
        """Run every segment of one row block and merge them: o [N, rows, E] (kd or fp32), l [N, rows]."""
        i0, i1 = blk.i0, blk.i1
        outs, lses = [], []
        qv = q4[:, :, i0:i1]
        for seg in blk.segments:
            c0, c1 = seg.c0, seg.c1
            bias = None if pse is None else pse[None, :, i0:i1, c0:c1]        # [1, N, rows, cols] view
            if bias is not None and bias.dtype != kd:
                bias = bias.to(kd)
            mask = bias
            empty_rows = None
            if seg.kind == RCAUSAL:                                           # flipped tiles, top-left causal
                if bias is not None:
                    bias = bias.flip(2, 3)
                o, l = _flash(qv.flip(2), k4[:, :, c0:c1].flip(2), v4[:, :, c0:c1].flip(2), 0.0, True,
                              attn_mask=bias, scale=p.scale)
                outs.append(o[0].flip(1))
                lses.append(l[0].flip(1))
                continue
            if seg.kind == MASKED:
                if um is None and bias is None:                               # band only: cached tile
                    mask, empty_rows = _band_float_tile(i0, i1, c0, c1, band, kd, q4.device)
                else:
                    m = _band_tile(i0, i1, c0, c1, band, q4.device) if seg.band else None  # True = masked
                    if um is not None:
                        u = um[i0:i1, c0:c1] != 0
                        m = u if m is None else (m | u)
                    if m is not None:
                        keep = (~m).sum(dim=-1)                               # [rows]
                        if not bool(keep.any()):
                            continue                                          # fully masked tile: skipped
                        if bool(m.any()):
                            empty_rows = keep == 0
                            if bias is None:
                                mask = torch.zeros(m.shape, dtype=kd, device=m.device).masked_fill_(m, _NEG_INF)
                                mask = mask[None, None]
                            else:
                                mask = bias.masked_fill(m, _NEG_INF)
            o, l = _flash(qv, k4[:, :, c0:c1], v4[:, :, c0:c1], 0.0, seg.kind == CAUSAL, attn_mask=mask,
                          scale=p.scale)
            o, l = o[0], l[0]                                  # [N, rows, E], [N, rows]
            if empty_rows is not None and bool(empty_rows.any()):
                l = l.clone()
                l[:, empty_rows] = _NEG_INF                   # the kernel reports 0 for rows without keys
            outs.append(o)
            lses.append(l)
        if not outs:
            return None, None
        if len(outs) == 1:
            return outs[0], lses[0]
        return _merge(outs, lses)


# ---------------------------------------------------------------------------------------------- helpers
@caches.memoize("prefill.band_tiles", 64)
def _band_float_tile_rel(rows: int, cols: int, off: int, pre: int, nxt: int, kd, device):
    """Band tile relative to its block (key c0 = i0 + off): the same for every interior block."""
    m = band_outside_tile(0, rows, off, off + cols, (pre, nxt), device)
    keep = (~m).sum(dim=-1)
    mask = torch.zeros(m.shape, dtype=kd, device=device).masked_fill_(m, _NEG_INF)[None, None]
    empty = keep == 0
    return mask, (empty if bool(empty.any()) else None)


def _band_float_tile(i0, i1, c0, c1, band, kd, device):
    """(float mask [1, 1, rows, cols] with -inf outside the band, rows without key or None)."""
    return _band_float_tile_rel(i1 - i0, c1 - c0, c0 - i0, band[0], band[1], kd, device)


def _band_tile(i0, i1, c0, c1, band, device):
    return band_outside_tile(i0, i1, c0, c1, band, device)


def _kernel_dtype(p: AttentionProblem) -> torch.dtype:
    """bf16/fp16 matmuls for bf16/fp16 queries (accuracy targets allow it); else the compute dtype. With output
    quantization the compute dtype too: the kernels return their query's dtype, and int8 codes are quantized
    from the float32 result, as the hardware's fused epilogue does (SPEC 12, DECISIONS 44)."""
    if p.dtype in (torch.float16, torch.bfloat16) and p.query_dequant is None and p.antiquant is None \
            and p.compute_dtype == torch.float32 and p.out_quant is None:
        return p.dtype      # dequantized K/V rounded to bf16 would cost ~2e-3 of lse: antiquant stays float32
    return p.compute_dtype


def _keys(p: AttentionProblem, b: int, g, kd):
    """Effective keys/values of batch b in the kernel dtype. Dequantization (SPEC 10) happens in the
    compute dtype first (one rounding to kd afterwards), exactly like the reference."""
    if p.antiquant is not None:
        k, v = batch_keys(p, b, g, p.compute_dtype)
        return k.to(kd), v.to(kd)
    return batch_keys(p, b, g, kd)


def _direct(p: AttentionProblem, kd) -> bool:
    """Whether batch 0's window (_window) is a view of the canonical tensors: nothing to convert or join."""
    q, kv = p.query, p.kv
    return (kv.kind == "dense" and p.antiquant is None and p.prefix is None and kv.key_rope is None and
            p.query_rope is None and p.query_dequant is None and q.dtype == kd and kv.key.dtype == kd and
            kv.value.dtype == kd and q.shape[-1] == kv.value.shape[-1])


def _window(p: AttentionProblem, g, kd, direct: Optional[bool] = None):
    """Batch 0's window for one kernel call (_one_call): q [1, N, S1, D], k / v [1, KV_N, S2, D] -- views of the
    canonical tensors where nothing needs converting (the usual call; the tensors themselves where the window is
    all of them), else batch_query / _keys' tensors. direct: _direct's answer where the caller has it."""
    if direct if direct is not None else _direct(p, kd):
        unit = prefill_flash.unit_last
        q, k, v = p.query, p.kv.key, p.kv.value
        if g.q_lo or g.q_hi != q.shape[2] or q.shape[0] != 1:
            q = q[:1, :, g.q_lo:g.q_hi]
        if g.kv_lo or g.kv_hi != k.shape[2] or k.shape[0] != 1:
            k, v = k[:1, :, g.kv_lo:g.kv_hi], v[:1, :, g.kv_lo:g.kv_hi]
        return unit(q), unit(k), unit(v)
    q, k, v = _same_head_dim(batch_query(p, 0, g, kd), *_keys(p, 0, g, kd))   # (D == Dv here: strides only)
    return q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)


def _window_bias(p: AttentionProblem, g) -> Optional[torch.Tensor]:
    """pse_shift over batch 0's window (_window): [1, N, S1, S2], or None."""
    return None if p.pse is None else p.pse[:1, :, g.q_lo:g.q_hi, g.kv_lo:g.kv_lo + g.s2]


def _same_head_dim(q, k, v):
    """The kernel needs one head size for q, k and v: zero-pad the smaller side (zeros add nothing to Q·Kᵀ;
    padded V columns are cut from the output), and a unit stride on that head dim."""
    q, k, v = prefill_flash.unit_last(q), prefill_flash.unit_last(k), prefill_flash.unit_last(v)
    e, dv = q.shape[-1], v.shape[-1]
    if e == dv:
        return q, k, v
    if e > dv:
        return q, k, torch.nn.functional.pad(v, (0, e - dv))
    pad = (0, dv - e)
    return torch.nn.functional.pad(q, pad), torch.nn.functional.pad(k, pad), v


def _merge(outs, lses):
    """Merge partial results of the same rows over disjoint key sets through their lse (float32 or the
    compute dtype): out = sum_k exp(lse_k - L) out_k, L = logsumexp_k lse_k; lse -inf contributes nothing."""
    ls = torch.stack(lses)                                     # [K, N, rows]
    L = torch.logsumexp(ls, dim=0)
    w = torch.exp(ls - L.masked_fill(torch.isneginf(L), 0.0))  # [K, N, rows]
    o = outs[0].to(w.dtype) * w[0].unsqueeze(-1)
    for k in range(1, len(outs)):
        o.addcmul_(outs[k].to(w.dtype), w[k].unsqueeze(-1))
    return o, L


def _vmean(v, n):
    """Mean of V over the batch's keys per query head: [N, Dv] (fully user-masked rows, SPEC 6)."""
    kv_n = v.shape[0]
    m = v.to(torch.float64).mean(dim=1)                        # [KV_N, Dv]
    return m.repeat_interleave(n // kv_n, dim=0)               # [N, Dv] (heads n = h*G + i)


# a row whose lse is below fill + log(S2) + this margin may give the masked keys' fill weight above 1e-26
_FILL_MARGIN = 60.0
_FILL_ROWS_ELEMS = 1 << 22      # max elements of one [rows, S2] visibility tile of _fill_rows


def _fill_threshold(s2: int) -> float:
    return MASK_FILL + math.log(max(s2, 1)) + _FILL_MARGIN


def _fill_rows(i0: int, i1: int, band, s2: int, o, l, um, v):
    """SPEC 3: masked keys score the finite fill -1e12, not -inf. They carry weight only in rows whose visible
    scores all lie near or below the fill (huge |scale| or inputs); there they are merged in as one part: the
    mean of V over the row's masked keys, lse = fill + log(count). Rows without a visible key (lse -inf) are
    _special_rows'. o [N, rows, Dv], l [N, rows] for window rows [i0, i1); um [S1, S2] or None; v [KV_N, S2, Dv].

    One reduction when no row is concerned (the usual case)."""
    if band is None and um is None:
        return o, l
    thr = _fill_threshold(s2)
    if float(l.amin()) >= thr:
        return o, l
    near = (l < thr) & ~torch.isneginf(l)                      # [N, rows]
    rows = near.any(dim=0).nonzero().flatten()                 # [R] block-local
    if rows.numel() == 0:
        return o, l
    o = o.to(l.dtype) if o.dtype != l.dtype else o.clone()
    l = l.clone()
    n, kv_n = o.shape[0], v.shape[0]
    vf = v.to(torch.float64)                                   # [KV_N, S2, Dv]
    fill = torch.tensor(MASK_FILL, dtype=l.dtype).to(torch.float64)   # the fill as the scores' dtype holds it
    step = max(1, _FILL_ROWS_ELEMS // max(s2, 1))
    for a in range(0, rows.numel(), step):
        r = rows[a:a + step]                                   # [R]
        i = (r + i0).unsqueeze(1)                              # [R, 1] window rows
        j = torch.arange(s2, device=l.device).unsqueeze(0)     # [1, S2]
        masked = torch.zeros(r.numel(), s2, dtype=torch.bool, device=l.device)
        if band is not None:
            masked |= (j > i + band[1]) | (j < i - band[0])
        if um is not None:
            masked |= um[i0 + r] != 0
        cnt = masked.sum(dim=-1)                               # [R]
        vsum = torch.matmul(masked.to(torch.float64), vf)      # [KV_N, R, Dv]
        mean = (vsum / cnt.clamp(min=1).unsqueeze(-1)).repeat_interleave(n // kv_n, dim=0)   # [N, R, Dv]
        lf = (fill + torch.log(cnt.to(torch.float64))).unsqueeze(0)        # [1, R] (-inf: no masked key)
        lr = l[:, r].to(torch.float64)                         # [N, R]
        L = torch.logaddexp(lr, lf)
        w1, w2 = torch.exp(lr - L).unsqueeze(-1), torch.exp(lf - L).unsqueeze(-1)
        merged = w1 * o[:, r].to(torch.float64) + w2 * mean    # [N, R, Dv]
        sel = near[:, r]                                       # [N, R]
        o[:, r] = torch.where(sel.unsqueeze(-1), merged.to(o.dtype), o[:, r])
        l[:, r] = torch.where(sel, L.to(l.dtype), l[:, r])
    return o, l


def _special_rows(p: AttentionProblem, blk: BlockPlan, band, s2: int, o, l, vmean, user: bool):
    """SPEC 6 / 1.1b for the rows of one block. o [N, rows, Dv], l [N, rows] (lse -inf = no key seen).

    Tensor work only where needed: between kernel calls every small op costs a parallel-region wake-up."""
    dead = dead_row_ranges(blk.i0, blk.i1, s2, band) if band is not None else []
    if p.sink is not None:
        sk = p.sink.to(l.dtype)[:, None]                       # [N, 1]
        lt = torch.logaddexp(l, sk)
        o = o.to(lt.dtype) * torch.exp(l - lt).unsqueeze(-1)   # fully user-masked rows -> 0, lse = sink
        l = lt
    elif user:
        udead = torch.isneginf(l[0])                           # [rows]: every key of the row masked
        for a, b in dead:
            udead[a:b] = False
        if bool(udead.any()):
            o = o.clone() if o.dtype == l.dtype else o.to(l.dtype)        # fp32 (fp64 for fp64 input)
            l = l.clone()
            if p.row_invalid_fix:
                o[:, udead] = 0
                l[:, udead] = float("inf")
            else:
                o[:, udead] = vmean()[:, None, :].to(o.dtype)
                l[:, udead] = torch.tensor(MASK_FILL, dtype=l.dtype) + math.log(s2)
    if dead:
        o = o.clone()
        l = l.clone()
        for a, b in dead:
            o[:, a:b] = 0
            l[:, a:b] = float("inf")
    return o, l


def _write(p: AttentionProblem, b: int, g, i0: int, i1: int, o, l, out, lse, n0: int = 0, n1=None) -> None:
    """Rows [i0, i1) (window-local) of heads [n0, n1) of batch b into the canonical outputs."""
    if p.packed:
        r0 = g.q_offset + g.q_lo + i0
        out[n0:n1, r0:r0 + (i1 - i0)] = o
        if lse is not None:
            lse[n0:n1, r0:r0 + (i1 - i0)] = l
    else:
        out[b, n0:n1, g.q_lo + i0:g.q_lo + i1] = o
        if lse is not None:
            lse[b, n0:n1, g.q_lo + i0:g.q_lo + i1] = l
