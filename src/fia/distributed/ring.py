"""Ring attention for prefill: the sequence is split across the ranks in rank order; each rank keeps its query
slice while the K/V slices travel the ring (isend / irecv to the next rank, posted before the local attention
so the transfer overlaps it). Every block's partial (out, lse) comes from npu_fused_infer_attention_score; the
partials are merged once at the end through npu_attention_update.

Causal (sparse_mode 3): a query sees every key of the ranks before it and the causal part of its own slice;
the slices of later ranks are never computed, and never sent where no later rank needs them. zigzag=True is the
load-balanced layout of ring-flash-attention: the sequence is cut into 2W chunks and rank r holds chunk r
followed by chunk 2W-1-r (fia.distributed.zigzag_shard builds it), so every rank does the same causal work.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import api
from ..errors import input_error
from . import args as A
from . import comm
from .partials import empty_like_partial, from_canonical, merge, to_canonical

OP = "fia.distributed.ring_attention"
RING_LAYOUTS = ("BSH", "BSND", "BNSD", "TND")
# keywords ring_attention passes through to every block's call (the rest are rejected or set per block)
_PASSED = ("num_heads", "num_key_value_heads", "scale", "input_layout", "inner_precise")
_PER_BLOCK = ("actual_seq_lengths", "actual_seq_lengths_kv", "sparse_mode", "atten_mask", "pre_tokens",
              "next_tokens")


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                   group: Optional[dist.ProcessGroup] = None, zigzag: bool = False,
                   **kw) -> Tuple[torch.Tensor, torch.Tensor]:
    """Prefill attention over a sequence split across the ranks of `group`; call it on every rank together.

    Args:
        query, key, value: this rank's contiguous slice of the sequence (rank order = sequence order), in BSH,
            BSND, BNSD or TND; TND with this rank's cumulative `actual_seq_lengths` / `actual_seq_lengths_kv`
            (per-batch slices may differ in length between ranks; batched layouts may pass per-batch local
            lengths too). Float K / V, no dequantization.
        group: the torch.distributed process group (None: the default group).
        zigzag: the load-balanced causal layout: each rank holds chunk r and chunk 2W-1-r of every sequence, one
            after the other (each sequence's local length even; batched layouts without padding).
            zigzag_shard / zigzag_unshard convert a whole sequence to and from it.
        **kw: npu_fused_infer_attention_score's keywords. sparse_mode 0 without atten_mask: full attention;
            sparse_mode 3 with FIA's 2048 x 2048 template mask: causal (each rank's query and key slices must
            then have the same per-batch lengths). Other masks, pse_shift, padding, prefix, rope and
            quantization arguments are rejected.

    Returns:
        (attention_out, softmax_lse) of this rank's query slice, as npu_fused_infer_attention_score returns them
        for the whole sequence; softmax_lse only with softmax_lse_flag=True (else the empty float32 [0] tensor).

    Raises:
        as decode_attention: FiaInputError / FiaUnsupportedError for invalid, unsplittable or differing calls on
        every rank, FiaRuntimeError when another rank fails or a transfer fails or times out.
    """
    g = comm.Group(OP, group, query)
    want_lse = bool(kw.pop("softmax_lse_flag", False))
    sig = A.call_signature(OP, query, key, value, kw, {"zigzag": bool(zigzag), "softmax_lse_flag": want_lse},
                           query_seq_free=True)
    plan: Optional[_Plan] = None
    err: Optional[BaseException] = None
    try:
        plan = _Plan(query, key, value, kw, bool(zigzag))
    except Exception as e:                      # reported to every rank by agree(), then raised here
        err = e
    comm.agree(g, sig, err)
    rows = comm.all_gather_ints(g, [plan.kv_rows] + plan.lk, "the K/V slice lengths")   # W x [1 + B]
    blocks = [(r[0], r[1:]) for r in rows]                                               # (rows, lengths)

    w, me = g.size, g.rank
    cur = [plan.key, plan.value]
    partials: List[Tuple[torch.Tensor, torch.Tensor]] = []
    for step in range(w):
        src = (me - step) % w                                      # the rank whose K/V `cur` holds
        shift = None
        if step < w - 1:
            send = cur if plan.sends(me, step, w) else None
            coming = (me - 1 - step) % w
            like = plan.kv_like(blocks[coming][0]) if plan.sends((me - 1) % w, step, w) else None
            if send is not None or like is not None:
                shift = comm.RingShift(g, send, like, step, query.device)
        err = None
        try:
            part = plan.block(src, me, cur, blocks[src][1]) if cur is not None else None    # None: not sent here
            if part is not None:
                partials.append(part)
        except Exception as e:
            if step > 0:
                raise
            err = e
        received = shift.wait() if shift is not None else None
        if step == 0:                           # FIA's own checks ran on the first block: agree on them too
            comm.agree(g, sig, err)
        cur = received
    out, lse = merge([p[0] for p in partials], [p[1] for p in partials])
    return plan.finish(out, lse, want_lse)


class _Plan:
    """One rank's view of a ring call: its slices, per-batch lengths, and how each block is attended."""

    def __init__(self, query: torch.Tensor, key, value, kw: dict, zigzag: bool):
        layout = A.in_layout(kw)
        if kw.get("input_layout", "BSH") not in RING_LAYOUTS:
            raise A.unsupported("input_layout", f"one of {RING_LAYOUTS} in ring_attention", kw.get("input_layout"))
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise input_error(name, "a dense tensor (tensor-list and paged KV are decode_attention's)",
                                  type(t).__name__)
        A.reject_unmergeable(kw)
        for name, v in kw.items():
            if name not in _PASSED + _PER_BLOCK and v is not None and not (isinstance(v, int) and v == 0):
                raise A.unsupported(name, "not supported by ring_attention (full or causal float attention only)",
                                    "a tensor" if isinstance(v, torch.Tensor) else repr(v))
        sparse, mask = kw.get("sparse_mode", 0), kw.get("atten_mask")
        if sparse == 0 and mask is not None:
            raise A.unsupported("atten_mask", "None with sparse_mode 0 in ring_attention: a user mask refers to "
                                "key positions of the whole sequence", "a mask")
        if sparse not in (0, 3):
            raise A.unsupported("sparse_mode", "0 (full attention) or 3 (causal) in ring_attention", sparse)
        if sparse == 3 and mask is None:
            raise input_error("atten_mask", "FIA's 2048 x 2048 template mask with sparse_mode 3", None)
        self.layout, self.kw = layout, {k: kw[k] for k in _PASSED if k in kw}
        self.causal, self.mask = sparse == 3, mask
        self.zigzag = zigzag and self.causal          # full attention does not care where the chunks lie
        self.query, self.key, self.value = query, key.contiguous(), value.contiguous()
        self.num_heads = int(kw.get("num_heads", 1))
        seq = A.SEQ_DIM[layout]
        self.seq = seq
        if layout == "TND":
            for n in ("actual_seq_lengths", "actual_seq_lengths_kv"):
                if kw.get(n) is None:
                    raise input_error(n, "this rank's cumulative lengths (TND)", None)
            cq = A.per_batch("actual_seq_lengths", kw["actual_seq_lengths"], len(kw["actual_seq_lengths"]))
            ck = A.per_batch("actual_seq_lengths_kv", kw["actual_seq_lengths_kv"], len(cq))
            self.lq = A.cumulative_to_lengths("actual_seq_lengths", cq)
            self.lk = A.cumulative_to_lengths("actual_seq_lengths_kv", ck)
        else:
            b = int(query.shape[0])
            self.lq = A.per_batch("actual_seq_lengths", kw.get("actual_seq_lengths"), b) or \
                [int(query.shape[seq])] * b
            self.lk = A.per_batch("actual_seq_lengths_kv", kw.get("actual_seq_lengths_kv"), b) or \
                [int(key.shape[seq])] * b
        self.kv_rows = int(key.shape[seq])
        if self.causal and self.lq != self.lk:
            raise input_error("actual_seq_lengths_kv", "the query's per-batch lengths on this rank for causal "
                              "ring_attention (a rank holds the same positions of query and key)",
                              f"{self.lk} (query: {self.lq})")
        if self.zigzag:
            if any(n % 2 for n in self.lq):
                raise input_error("actual_seq_lengths", "even per-batch lengths with zigzag=True (chunk r and "
                                  "chunk 2W-1-r, equal halves)", self.lq)
            if layout != "TND" and (any(n != query.shape[seq] for n in self.lq) or key.shape[seq] != query.shape[seq]):
                raise input_error("actual_seq_lengths", "no padding with zigzag=True in batched layouts (every "
                                  f"length = the slice's {query.shape[seq]} rows)", self.lq)

    def sends(self, src: int, step: int, world: int) -> bool:
        """Whether rank `src` passes its current block on at `step` (the same answer on both ends)."""
        if not self.causal or self.zigzag:
            return True
        # causal: block src - step is needed by ranks src - step .. W-1 only, so it never wraps to rank 0
        return src - step >= 0 and src < world - 1

    def kv_like(self, rows: int) -> List[torch.Tensor]:
        """Receive templates for a block of `rows` rows on the sequence axis (shape and dtype only)."""
        out = []
        for t in (self.key, self.value):
            shape = list(t.shape)
            shape[self.seq] = rows
            out.append(torch.empty(shape, dtype=t.dtype, device="meta"))
        return out

    def block(self, src: int, me: int, kv: Sequence[torch.Tensor], lk: List[int]):
        """The partial of this rank's query over rank src's K/V, canonical (out, lse), or None (no key seen)."""
        k, v = kv
        if not self.causal:
            return self._attend(self.query, k, v, self.lq, lk, causal=False)
        if src == me:
            return self._attend(self.query, k, v, self.lq, lk, causal=True)
        if not self.zigzag:
            return self._attend(self.query, k, v, self.lq, lk, causal=False) if src < me else None
        if src < me:                             # both query chunks come after rank src's first chunk only
            k0, v0, lk0 = self._half(k, lk, second=False), self._half(v, lk, second=False), [n // 2 for n in lk]
            return self._attend(self.query, k0, v0, self.lq, lk0, causal=False)
        # src > me: only the second query chunk comes after both of rank src's chunks
        q1, lq1 = self._half(self.query, self.lq, second=True), [n // 2 for n in self.lq]
        part = self._attend(q1, k, v, lq1, lk, causal=False)
        if part is None:
            return None
        full = self._attend_shape()
        out, lse = empty_like_partial(*full)
        if self.layout == "TND":
            idx = self._rows(self.lq, second=True)
            out[idx], lse[idx] = part
        else:
            half = self.query.shape[self.seq] // 2
            out[:, :, half:], lse[:, :, half:] = part
        return out, lse

    def _attend_shape(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Zero templates of this rank's canonical partial: out [B, N, S, Dv] / [T, N, Dv], lse without Dv."""
        q, v = self.query, self.value
        if self.layout == "BSH":
            kv_n = int(self.kw.get("num_key_value_heads", 0)) or self.num_heads
            dv = v.shape[-1] // kv_n
        else:
            dv = v.shape[-1]
        if self.layout == "TND":
            shape = (q.shape[0], self.num_heads)
        else:
            shape = (q.shape[0], self.num_heads, q.shape[self.seq])
        return q.new_zeros(shape + (dv,)), q.new_zeros(shape, dtype=torch.float32)

    def _rows(self, lengths: List[int], second: bool) -> torch.Tensor:
        """TND row indices of each sequence's first or second half."""
        idx, start = [], 0
        for n in lengths:
            h = n // 2
            idx.extend(range(start + h, start + n) if second else range(start, start + h))
            start += n
        return torch.tensor(idx, dtype=torch.long, device=self.query.device)

    def _half(self, t: torch.Tensor, lengths: List[int], second: bool) -> torch.Tensor:
        """The first or second half of every sequence of a slice (the zigzag chunks)."""
        if self.layout == "TND":
            return t.index_select(0, self._rows(lengths, second))
        h = t.shape[self.seq] // 2
        return t.narrow(self.seq, h if second else 0, h)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lq: List[int], lk: List[int],
                causal: bool):
        if not causal and (sum(lk) == 0 or sum(lq) == 0):
            return None                          # nothing to see: the partial would be all +inf
        kw = dict(self.kw)
        if self.layout == "TND":
            kw.update(actual_seq_lengths=A.lengths_to_cumulative(lq), actual_seq_lengths_kv=A.lengths_to_cumulative(lk))
        else:
            kw.update(actual_seq_lengths=lq, actual_seq_lengths_kv=lk)
        if causal:
            kw.update(sparse_mode=3, atten_mask=self.mask)
        out, lse = api.npu_fused_infer_attention_score(q, k, v, softmax_lse_flag=True, **kw)
        return to_canonical(out, self.layout, self.num_heads), lse.squeeze(-1)

    def finish(self, out: torch.Tensor, lse: torch.Tensor, want_lse: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        res = from_canonical(out, self.layout)
        if want_lse:
            return res, lse.unsqueeze(-1)
        return res, self.query.new_empty(0, dtype=torch.float32)
