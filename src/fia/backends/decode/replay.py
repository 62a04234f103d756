"""Decode's fast replay (fia.replay): a call's plan kept and re-launched on each later call of the same metadata
with only the query, key and value addresses (and, for lengths replays, the KV lengths and block table; for int8
K / V, the dequantization tensors) refilled -- no parse, no dispatch, no Inputs.

`prepare` decides whether a call can be served so (it reads no other data) and builds the Replay; fia.replay
keeps it per call signature and checks it once against the full path before use.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from ...cpu.threads import launch as launch_threads
from ...parse.lengths import broadcast
from ...parse.paged import bad_block
from ...problem.attention import AttentionProblem
from ...problem.outputs import expected_outputs
from ... import caches
from . import loader
from .execute import QK_STATS, launch_array, lse_target, merge, partials
from .inputs import Inputs, factor_meta, factor_specs, fill_factors, no_factors, view_address, views_of
from .plan import PLANS, Plan, lengths_params, plan_key, plan_of, relength, tuning


def prepare(p: AttentionProblem, query, key, value, lengths: bool = False, extras: tuple = (),
            kv_axis: Optional[int] = None) -> Optional["Replay"]:
    """fia.replay's prepared launch of p's call (query, key, value as passed), or None where the call
    reads more than those three tensors' data (or writes through the shared epilogue's Python).
    lengths: the call's KV lengths list varies between the calls it will serve (right padding: every
    batch's keys from position 0); the launch is then re-planned per lengths (relength). extras: the
    call's dequantization tensors (fia.replay._TENSOR_ARGS): int8 K / V whose factors (per tensor, channel,
    head or token) are views of them are served -- per-token ones read in place at each call's addresses,
    the others re-derived from each call's. kv_axis: the sequence axis of a growing cache's key and value
    (fia.replay), whose KV_S each call brings: only a dense source without dequantization tensors."""
    if kv_axis is not None and (p.kv.kind != "dense" or p.antiquant is not None or p.kv.key_rope is not None):
        return None
    if lengths and (p.mask.kind == "band" or any(g.kv_lo != 0 or g.prefix != 0 for g in p.geometry)):
        return None
    aq = p.antiquant
    views = None
    if aq is not None:
        if aq.int4 or (views := views_of(aq, extras)) is None:
            return None
    if ((p.memo_key is None and not lengths) or p.kv.kind not in (("dense", "paged") if lengths else ("dense",))
            or p.pse is not None
            or p.mask.user_mask is not None or p.query_rope is not None or p.query_dequant is not None
            or p.prefix is not None or p.sink is not None or p.out_quant is not None or p.full_quant is not None
            or p.kv.key_rope is not None or p.packed or min(query.numel(), key.numel(), value.numel()) == 0
            or p.B == 0 or p.N == 0 or p.Dv == 0 or p.Q_S == 0):
        return None
    K = loader.kernels()
    x = Inputs(p)
    if x.q is not p.query or x.exceptional:   # (the query is copied first: not a view of the call's)
        return None
    if aq is not None:                        # per-token factors read in place: parse's tensors, not copies
        src = x.sources[0]
        for tok, spec in ((src.ktok, aq.key), (src.vtok, aq.value)):
            if tok.mode and (tok.scale is not spec.scale or tok.offset is not spec.offset):
                return None
    plan = plan_of(p, x, K)
    if plan.prefix is not None or len(plan.own) != 1 or plan.own[0] is None:
        return None
    return Replay(p, x, plan, K, (query, key, value), lengths, views, kv_axis)


_NO_LENS = np.zeros(0, np.int64)                 # attend_merge's kv_lens when the plan is run as given
_NO_UNITS = np.zeros((0, 2), np.int64)           # ... its units where no stride grows


class Replay:
    """A call's launch prepared once (fia.replay): the plan, the buffer table with the query, key and value
    slots refilled from each call's tensors (same metadata: same spans, offsets of the canonical views from
    the tensors passed), the output allocated directly in its final layout (the epilogue's result for this
    problem). Returns (out, lse) as the entry point's full path does, or None when the plan went stale.

    With `lengths` the calls it serves pass KV lengths that vary (a decode loop): each call's lengths are
    checked as parse checks them (1 or >= B values in [0, KV_S]; anything else: None, and the full path
    raises its error) and its plan is the admitting one re-planned for them -- inside attend_merge's dispatch
    where they keep the call on one thread (`fused`: dense K / V), else by relength (a few per replay
    kept)."""

    _MAX_LENGTHS = 8                # plans kept per lengths replay (cleared when full)

    def __init__(self, p: AttentionProblem, x: Inputs, plan: Plan, K, tensors: tuple, lengths: bool = False,
                 aq_views: Optional[tuple] = None, kv_axis: Optional[int] = None):
        src = x.sources[0]
        # a growing cache (kv_axis): the K / V strides that scale with KV_S (the batch's; the head's when the
        # sequence axis lies inside it), as multiples of the admitting call's KV_S (contiguous K and V)
        self.growing = None
        if kv_axis is not None:
            s0 = p.KV_S
            ipk = plan.own[0].ip
            self.growing = (s0, tuple((i, int(ipk[i])) for i in (
                (K.IP_K_BLK, K.IP_V_BLK) + ((K.IP_K_H, K.IP_V_H) if kv_axis == 2 else ()))))
            if s0 <= 0 or any(st % s0 for _, st in self.growing[1]):
                raise AssertionError(f"strides {self.growing} of a contiguous cache of KV_S {s0}")
        self.memo_key = p.memo_key
        self.bufs = x.addresses(K)                  # [2, BUF_LEN]: spans fixed by the metadata
        src.addresses(self.bufs, K)
        views = (x.q, src.key, src.value)           # the canonical views the kernels read
        self.deltas = tuple(c.data_ptr() - t.data_ptr() for c, t in zip(views, tensors))
        self.bufs[0, [K.BUF_Q, K.BUF_K, K.BUF_V]] = 0     # (no address of the admitting call survives)
        # Inputs' dummies only (no sink here; dequant factors: made per call from its tensors, see _factors):
        # no tensor of the admitting call is kept
        self.aq = None
        self.tok_slots = ()
        self.tok_follow = (False, False)
        if aq_views is not None:                # (the factors' metadata; their tensors: each call's views)
            self.aq = (factor_meta(p), aq_views)
            aq = p.antiquant                    # (specs of the admitting call; no address of it survives)
            self.fspecs = factor_specs(self.aq[0], (aq.key.scale, aq.key.offset, aq.value.scale, aq.value.offset))
            self.fslots = tuple(f for f in range(4) if self.fspecs[f, 0] != 0)
            self.fspecs[:, 0] = 0
            x.kchan, x.vcs, x.vco = no_factors()
            # per-token factors (read in place): (buffer slot, index in aq_views) per tensor, each call's address;
            # factors stored by paged block follow each call's block table
            slots = ((src.ktok, K.BUF_KTS, K.BUF_KTO, 0), (src.vtok, K.BUF_VTS, K.BUF_VTO, 2))
            self.tok_slots = tuple((slot, j + i) for tok, s0, s1, j in slots if tok.mode
                                   for i, slot in enumerate((s0, s1)) if aq_views[j + i] is not None)
            self.bufs[0, [slot for slot, _ in self.tok_slots]] = 0
            self.tok_follow = tuple(bool(tok.mode) and tok.tbl is src.tbl for tok in (src.ktok, src.vtok))
        self.kchan, self.factors = x.kchan, (x.sink, x.vcs, x.vco)
        self.tbls = (src.tbl, src.ktok.tbl, src.vtok.tbl)
        self.out_shape, _, lse_shape = expected_outputs(p)      # the epilogue's output = the plan's, contiguous
        self.want_lse, self.lse_shape = p.want_lse, lse_shape
        # unwanted lse: one scratch per replay (merge only writes it: concurrent calls may share it)
        self.scratch = None if p.want_lse else lse_target(p.lse_shape(), False)
        self.lse_bytes = math.prod(lse_shape) * 4 if p.want_lse else self.scratch[1][1]
        self.rows = (p.KV_N, p.G * p.Q_S, p.Dv)
        # paged (lengths replays only): block size, blocks in the pool -- each call's table is range-checked
        self.paged = (p.kv.block_size, p.kv.key.shape[0]) if p.kv.kind == "paged" else None
        self.lengths = None
        self.lp, self.units = np.zeros(K.LP_LEN, np.int64), _NO_UNITS
        self.fused = False                          # whether attend_merge re-plans each call's lengths itself
        if lengths:                                 # what re-planning reads: metadata only (the tensors dropped)
            self.lengths = caches.BoundedCache("decode.replay.lengths", self._MAX_LENGTHS, register=False)
            self.p = p.evolve(query=None, kv=None, antiquant=None)
            self.tuning = tuning(K)
            # a single-threaded call (a short cache: where the host's share is largest) re-plans inside its one
            # dispatch; relength's Python, once per step and layer 0's, cost ~85 us in a model (cold caches)
            self.fused = self.paged is None
            self.lp = lengths_params(plan, p, K, self.tuning[0])
            if self.growing is not None:
                s0 = self.growing[0]
                self.units = np.array([(i, st // s0) for i, st in self.growing[1]], np.int64).reshape(-1, 2)
        self.prepared = self._prepare(plan)

    def stale(self) -> bool:
        """Whether the tuning (thread count, constants) changed since the replay was made."""
        if self.lengths is not None:
            return tuning(loader.K) != self.tuning
        return PLANS.get(plan_key(self.memo_key, loader.K)) is not self.prepared[0]

    def _prepare(self, plan: Plan, lens: tuple = ()) -> tuple:
        """(plan, its launch, partials' dims, attend_merge's launch array, paged: the table columns each batch
        uses)."""
        parts = (plan.W,) + self.rows
        used = None
        if self.paged is not None:
            bs = self.paged[0]
            used = np.array([(n + bs - 1) // bs for n in lens], np.int64)
        launch = plan.own[0]
        K = loader.K
        L = launch_array(K, {K.LA_ITEMS: launch.items, K.LA_IP: launch.ip, K.LA_GEO: plan.geo, K.LA_WORK: launch.work,
                             K.LA_MP: plan.mp, K.LA_WRANGE: plan.wrange, K.LA_PWRANGE: plan.pwrange,
                             K.LA_OBASE: plan.obase, K.LA_DIMS: parts + (plan.out_bytes, self.lse_bytes),
                             K.LA_LP: self.lp, K.LA_UNITS: self.units})
        return plan, launch, parts, L, used

    def _table(self, table, used: np.ndarray) -> Optional[np.ndarray]:
        """A paged call's block table as the kernels read it (int64 [B, MB]), or None where parse would refuse
        it (an id outside the pool among the used columns: the full path raises the error)."""
        if type(table) is not torch.Tensor:
            return None
        host = table.numpy()                         # (bad_block: the same check as parse's, on the same array)
        if bad_block(host, used, self.paged[1]) is not None:
            return None
        return host.astype(np.int64)

    def _checked(self, lens, K, kv_s: Optional[int] = None) -> Optional[tuple]:
        """A call's KV lengths (a growing replay: of KV_S kv_s; lens None: all KV_S) as parse accepts them, or None
        (invalid lengths, stale tuning)."""
        if tuning(K) != self.tuning:
            return None
        S = self.p.KV_S if kv_s is None else kv_s
        if lens is None and kv_s is not None:
            return (S,) * self.p.B
        if type(lens) not in (list, tuple) or (lens := broadcast(lens, self.p.B)) is None:
            return None
        for v in lens:
            if type(v) is not int or v < 0 or v > S:
                return None
        return tuple(lens)

    def _for_lengths(self, lens: tuple, K, kv_s: Optional[int] = None) -> Optional[tuple]:
        """The prepared plan for checked KV lengths (_checked; a growing replay: and its KV_S), or None (no
        work)."""
        ck = lens if kv_s is None else (lens, kv_s)
        got = self.lengths.get(ck)
        if got is None:
            grown = ()                              # a growing cache: the K / V strides of kv_s positions
            if kv_s is not None:
                s0, scaled = self.growing
                grown = tuple((i, st // s0 * kv_s) for i, st in scaled)
            plan = relength(self.prepared[0], self.p, np.array(lens, np.int64), K, self.tuning[0], grown)
            if plan is None:
                return None
            got = self.lengths.put(ck, self._prepare(plan, lens))
        return got

    def _factors(self, extras: tuple) -> tuple:
        """(kchan, (sink, vcs, vco)) of a call: the dequant factors from its own tensors (self.aq): the admitting
        call's specs (shapes, strides, kinds: the key's metadata) at the addresses of this call's views."""
        if self.aq is None:
            return self.kchan, self.factors
        meta, views = self.aq
        specs = self.fspecs.copy()
        for f in self.fslots:
            specs[f, 0] = view_address(views[f], extras)
        kchan, vcs, vco, exceptional = fill_factors(meta, specs)
        return None if exceptional else (kchan, (self.factors[0], vcs, vco))

    def __call__(self, q, k, v, lens=None, table=None, extras=(), kv_s=None, lse=True):
        """(out, lse) of a call (lse False: (out, None) where the call wants no lse), or None: the full path."""
        K = loader.K
        tbl = self.tbls[0]
        prepared = self.prepared
        kvl = _NO_LENS                              # lengths attend_merge re-plans for (self.fused)
        kb = vb = -1                                # K / V spans that vary (a growing cache's; contiguous: whole)
        if self.lengths is not None:
            if self.growing is not None:
                if kv_s is None:
                    return None
                kb, vb = k.nbytes, v.nbytes
            lens = self._checked(lens, K, kv_s)
            if lens is None:
                return None
            if self.fused:
                kvl = np.array(lens, np.int64)
            else:
                prepared = self._for_lengths(lens, K, kv_s)
                if prepared is None:
                    return None
                if self.paged is not None:
                    tbl = self._table(table, prepared[4])
                    if tbl is None:
                        return None
        elif self.stale():
            return None
        plan, launch, parts, L, _ = prepared
        if self.aq is None:
            kchan, factors = self.kchan, self.factors
        else:
            got = self._factors(extras)
            if got is None:                         # exceptional factors: the full path (decode backend: the reference)
                return None
            kchan, factors = got
        d = self.deltas
        qa, ka, va = q.data_ptr() + d[0], k.data_ptr() + d[1], v.data_ptr() + d[2]
        bufs = self.bufs                            # (shared: the query, key and value slots are filled in a copy)
        kt_tbl, vt_tbl = self.tbls[1], self.tbls[2]
        if self.tok_slots:
            bufs = bufs.copy()
            views = self.aq[1]
            for slot, j in self.tok_slots:
                bufs[0, slot] = view_address(views[j], extras)
            kt_tbl = tbl if self.tok_follow[0] else kt_tbl
            vt_tbl = tbl if self.tok_follow[1] else vt_tbl
        out = torch.empty(*self.out_shape, dtype=plan.out_dtype)    # (unpacked: a faster argument parse)
        if self.want_lse:
            lse, lse_addr = lse_target(self.lse_shape, True)
        else:
            lse, lse_addr = torch.empty(0, dtype=torch.float32) if lse else None, self.scratch[1]
        if kvl is not _NO_LENS or launch.threads == 1:      # attend + merge in one dispatch (non-finite: the full path)
            got = K.attend_merge(L, plan.fp, kvl, kv_s or 0, launch.key_bytes, tbl, bufs, kchan, kt_tbl, vt_tbl,
                                 launch.generic, *factors, QK_STATS, qa, ka, va, kb, vb, out.data_ptr(), lse_addr[0])
            if got == 0:
                return out, lse
            if got > 0 or (prepared := self._for_lengths(lens, K, kv_s)) is None:
                return None
            plan, launch, parts, L, _ = prepared     # (-1: threaded, planned by relength)
        bufs = bufs.copy()
        bufs[0, K.BUF_Q], bufs[0, K.BUF_K], bufs[0, K.BUF_V] = qa, ka, va
        if kb >= 0:
            bufs[1, K.BUF_K], bufs[1, K.BUF_V] = kb, vb
        po = partials(*parts)
        launch_threads(K.attend_items, launch.items, launch.threads,
                (launch.ip, plan.fp, plan.geo, launch.work, tbl, bufs, kchan, kt_tbl, vt_tbl, *po,
                 launch.generic, QK_STATS))
        if merge(K, plan, factors, out, lse_addr, po, po):
            return None
        return out, lse
