"""Context-parallel decode: the KV cache is sharded across the ranks, every rank attends the same query to its
own keys with FIA, and the partial outputs are merged through their LSEs (npu_attention_update) on every rank.

Traffic per step: one all_gather of each rank's partial output and lse, W * B * N * Q_S * (Dv * itemsize + 4)
bytes in all, however long the cache is (docs/distributed.md).
"""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .. import api
from ..errors import input_error
from . import args as A
from . import comm
from .partials import TOKEN_LAYOUTS, from_canonical, merge, out_layout, to_canonical

OP = "fia.distributed.decode_attention"

Offsets = Union[int, List[int], Tuple[int, ...], torch.Tensor, None]


def decode_attention(query: torch.Tensor, key, value, *, group: Optional[dist.ProcessGroup] = None,
                     key_offset: Offsets = None, **kw) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of the same query over the keys of every rank of `group`; call it on every rank together.

    Args:
        query: the whole query (every batch, every head), identical on every rank, in `input_layout`.
        key, value: this rank's slice of each sequence's keys / values: dense, a tensor list or a paged cache
            (`block_table` local to this rank), any dequantization form npu_fused_infer_attention_score takes.
        group: the torch.distributed process group (None: the default group).
        key_offset: the global position of this rank's first key, one int for every batch or a list of B ints.
            It lets an `atten_mask` / `pse_shift` given in global key coordinates be used: each rank slices the
            columns of its own keys. Without it, arguments that refer to key positions are rejected.
        **kw: npu_fused_infer_attention_score's keywords; `actual_seq_lengths_kv` are this rank's local lengths
            (0 where it holds no key of a sequence). Not accepted: sparse modes 2-4 where they apply (Q_S > 1 or
            rope), a shared prefix, output quantization (quant_scale2 / quant_offset2).

    Returns:
        (attention_out, softmax_lse) as npu_fused_infer_attention_score returns them for the concatenation of
        every rank's keys, identical on every rank; softmax_lse only with softmax_lse_flag=True (else FIA's empty
        float32 [0] tensor).

    Raises:
        FiaInputError / FiaUnsupportedError for invalid or unsplittable arguments, and on every rank when the
        ranks' calls differ (the message names the argument and each rank's value); FiaRuntimeError on every
        other rank when one rank fails, and when a collective fails or times out (a dead rank).
    """
    g = comm.Group(OP, group, query)
    want_lse = bool(kw.pop("softmax_lse_flag", False))
    sig = A.call_signature(OP, query, key, value, kw, {"key_offset": "given" if key_offset is not None else None,
                                                       "softmax_lse_flag": want_lse})
    out = lse = None
    err: Optional[BaseException] = None
    try:
        call_kw = _local_arguments(query, key, kw, key_offset)
        out, lse = api.npu_fused_infer_attention_score(query, key, value, softmax_lse_flag=True, **call_kw)
    except Exception as e:                       # reported to every rank by agree(), then raised here
        err = e
    comm.agree(g, sig, err)

    layout = out_layout(kw.get("input_layout", "BSH"))
    c_out = to_canonical(out, layout, int(kw.get("num_heads", 1)))     # [B, N, S, Dv] or [T, N, Dv]
    c_lse = lse.squeeze(-1)                                             # [B, N, S] or [T, N]
    outs = comm.all_gather(g, c_out, "the partial outputs")
    lses = comm.all_gather(g, c_lse, "the partial lse")
    m_out, m_lse = merge(outs, lses)
    result = from_canonical(m_out, layout)
    if want_lse:
        return result, m_lse.unsqueeze(-1)
    return result, query.new_empty(0, dtype=torch.float32)


def _query_len(query: torch.Tensor, layout: str) -> int:
    return int(query.shape[A.SEQ_DIM[layout]]) if layout not in TOKEN_LAYOUTS else -1


def _local_capacity(key, layout: str, kw: dict) -> int:
    """The number of key columns a mask / pse for this rank's keys must have."""
    if kw.get("block_table") is not None:
        return int(kw["block_table"].shape[1]) * int(kw.get("block_size", 0))
    if isinstance(key, (list, tuple)):
        return max((int(t.shape[A.SEQ_DIM[layout]]) for t in key), default=0)
    return int(key.shape[A.SEQ_DIM[layout]])


def _local_arguments(query: torch.Tensor, key, kw: dict, key_offset: Offsets) -> dict:
    """Checks what cannot be split across ranks; slices a global mask / pse to this rank's keys."""
    A.reject_unmergeable(kw)
    layout = A.in_layout(kw)
    q_s = _query_len(query, layout)
    sparse = kw.get("sparse_mode", 0)
    # Q_S = 1 without rope ignores sparse modes (SPEC 5); elsewhere 2-4 place keys relative to the sequence end
    if sparse in (2, 3, 4) and (q_s != 1 or kw.get("query_rope") is not None):
        raise A.unsupported("sparse_mode", "0 or 1 in decode_attention: modes 2-4 place keys relative to the end "
                            "of the whole sequence, which one rank's slice does not hold (ring_attention runs "
                            "causal prefill)", sparse)
    positional = [n for n in ("atten_mask", "pse_shift") if kw.get(n) is not None]
    if not positional:
        if key_offset is not None:
            A.per_batch("key_offset", key_offset, 1 if layout in TOKEN_LAYOUTS else int(query.shape[0]))
        return kw
    name = positional[0]
    if key_offset is None:
        raise input_error(name, "None, or key_offset= (this rank's first global key position per batch), so that "
                          f"the {name} (in global key coordinates) is sliced to this rank's keys",
                          f"{name} without key_offset")
    if layout in TOKEN_LAYOUTS:
        raise A.unsupported(name, "sliced per rank only for the batched layouts BSH / BSND / BNSD", layout)
    if kw.get("kv_padding_size") is not None:
        raise A.unsupported(name, "sliced per rank only without kv_padding_size (left padding indexes the mask "
                            "by physical positions)", "kv_padding_size")
    if q_s > 1 and sparse == 0 and (kw.get("pre_tokens", A.INT_MAX) < A.INT_MAX or
                                    kw.get("next_tokens", A.INT_MAX) < A.INT_MAX):
        raise A.unsupported("pre_tokens", "the default (unbounded) band in decode_attention: a band counts key "
                            "positions from the start of each rank's window", (kw.get("pre_tokens"),
                                                                               kw.get("next_tokens")))
    batch = int(query.shape[0])
    offsets = A.per_batch("key_offset", key_offset, batch)
    if any(o < 0 for o in offsets):
        raise input_error("key_offset", "non-negative global key positions", offsets)
    cols = _local_capacity(key, layout, kw)
    kw = dict(kw)
    if kw.get("atten_mask") is not None:
        kw["atten_mask"] = _slice_keys("atten_mask", kw["atten_mask"], offsets, cols, q_s, fill=1)
    if kw.get("pse_shift") is not None:
        kw["pse_shift"] = _slice_keys("pse_shift", kw["pse_shift"], offsets, cols, q_s, fill=0)
    return kw


def _slice_keys(name: str, t: torch.Tensor, offsets: List[int], cols: int, q_s: int, fill) -> torch.Tensor:
    """A mask / pse over global key positions -> [B, X, Q, cols] over this rank's keys (columns past the
    global tensor's end get `fill`)."""
    if not isinstance(t, torch.Tensor) or t.dim() not in (2, 3, 4):
        raise input_error(name, "a 2-D, 3-D or 4-D tensor over global key positions",
                          tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__)
    if t.dim() == 2:          # decode [B, K]; prefill [Q, K]
        t4 = t[:, None, None, :] if q_s == 1 else t[None, None]
    elif t.dim() == 3:        # [B or 1, Q, K]
        t4 = t[:, None]
    else:
        t4 = t                # [B or 1, X, Q, K]
    batch = len(offsets)
    if t4.shape[0] not in (1, batch):
        raise input_error(name, f"a batch axis of 1 or {batch}", tuple(t.shape))
    t4 = t4.expand(batch, *t4.shape[1:])
    width = t4.shape[-1]
    pos = torch.tensor(offsets, device=t.device)[:, None] + torch.arange(cols, device=t.device)   # [B, cols]
    inside = pos < width
    idx = pos.clamp(max=max(width - 1, 0))[:, None, None, :].expand(batch, t4.shape[1], t4.shape[2], cols)
    if width == 0:
        return torch.full(idx.shape, fill, dtype=t.dtype, device=t.device)
    picked = torch.gather(t4, 3, idx)                                                          # [B, X, Q, cols]
    return torch.where(inside[:, None, None, :], picked, torch.full((), fill, dtype=t.dtype, device=t.device))
