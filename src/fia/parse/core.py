"""parse_fused: raw npu_fused_infer_attention_score arguments -> AttentionProblem.

The order of checks follows the data flow: tensors and layout, heads and dims, KV storage, lengths
and padding, prefix, masks, pse, quantization, precision flags. Every check runs before any computation.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..config import is_strict
from ..problem.attention import AttentionProblem, BatchGeometry, cache_dim
from . import lengths as L
from . import masking as M
from . import memo
from . import quant as QT
from . import sequence as Q
from . import tensors as T
from . import v4_rules as V4
from .context import Ctx, describe, dtype_name
from .unimplemented import reject_unimplemented
from .outputs import output_dtype
from .paged import paged_kv

FLOAT32_MAX = 3.4028234663852886e38          # the largest finite float32: the operator takes scale as a float


def parse_fused(a: dict, api: str = "npu_fused_infer_attention_score", aliases: Optional[dict] = None,
                *, decode_only: bool = False) -> AttentionProblem:
    """Arguments -> problem. A call whose only tensors are query, key, value (and a block table or antiquant
    scales / offsets) is fully parsed until its metadata's signature is stored; later calls with the same
    signature re-view their tensors (parse/memo.py)."""
    sig, p = memo.lookup(a, api, aliases, decode_only)
    if p is None:
        p = _parse(a, api, aliases, decode_only)
        if sig is not None:
            p = memo.remember(sig, p, a)
    return p


def _parse(a: dict, api: str, aliases: Optional[dict], decode_only: bool) -> AttentionProblem:
    ctx = Ctx(api, is_strict(), dict(aliases or {}))
    a = _resolve_neg(a)
    query = ctx.tensor("query", a["query"], optional=False)
    key = T.kv_arg(ctx, "key", a["key"])
    value = T.kv_arg(ctx, "value", a["value"])
    _optional_tensors(ctx, a)
    _reserved(ctx, a)
    _same_device(ctx, query, a)
    layout = T.parse_layout(ctx, a["input_layout"])
    if decode_only and layout.name not in ("BSH", "BSND", "BNSD"):
        raise ctx.err("input_layout", "BSH, BSND or BNSD for npu_incre_flash_attention", layout.name)
    T.query_dtype(ctx, query)
    reject_unimplemented(ctx, a)
    # integer attributes only some calls use are still integers (torch_npu's schema types them `int`): a str,
    # float, bool or None is an error even where the value itself is ignored (block_size without block_table,
    # SPEC 15.11; antiquant modes with float key/value). Their ranges are checked where they are used.
    for name in ("block_size", "antiquant_mode", "key_antiquant_mode", "value_antiquant_mode"):
        ctx.integer(name, a.get(name, 0))
    qd = T.query_dims(ctx, layout, query, a["num_heads"], a["num_key_value_heads"])
    T.same_kind(ctx, key, value)
    key, value = T.split_list(layout, query, key, value)
    is_list = isinstance(key, tuple)
    kind = QT.classify(ctx, a, query, *T.raw_kv_dtypes(key, value))
    q_rope, key_rope = Q.rope_pair(ctx, layout, query, a["query_rope"], a["key_rope"], qd)
    if kind.full and q_rope is not None:                # (DECISIONS 46)
        raise ctx.err("query_rope", "None with dequant_scale1 / quant_scale1 / dequant_scale2 full quantization (an "
                      "int8 query takes a rope only in MLA full quantization: dequant_scale_query with "
                      "query_quant_mode 3, SPEC 10b.3)", a["query_rope"])
    paged = a["block_table"] is not None

    q_lens_raw = ctx.int_list("actual_seq_lengths", a["actual_seq_lengths"])
    kv_lens_raw = ctx.int_list("actual_seq_lengths_kv", a["actual_seq_lengths_kv"])

    # ---- batches and query rows
    if layout.packed:
        q_off = L.cumulative(ctx, "actual_seq_lengths", q_lens_raw, qd.S)
        b = len(q_off) - 1
        q_rows = [q_off[i + 1] - q_off[i] for i in range(b)]
        if ctx.strict and qd.S > L.MAX_T:
            raise ctx.hw("query", f"T <= {L.MAX_T}", f"T = {qd.S}")
        decode = b > 0 and all(r == 1 for r in q_rows)
        q_s = max(q_rows, default=0)
    else:
        b, q_s = qd.B, qd.S
        q_off = (0,) * (b + 1)
        decode = q_s == 1
        q_rows = [q_s] * b
    if decode_only and not decode:
        raise ctx.err("query", "Q_S = 1 (decode only)", query)
    _check_layout_use(ctx, layout, decode, q_s, query, a)

    # ---- KV storage (SPEC 8)
    allow_dv = layout.packed or q_rope is not None
    kv_off = (0,) * (b + 1)
    if paged:
        if kv_lens_raw is None:
            raise ctx.err("actual_seq_lengths_kv", "per-batch KV lengths (required with block_table)", "None")
        bt = ctx.tensor("block_table", a["block_table"])
        bs = ctx.integer("block_size", a["block_size"])
        cap = bt.shape[-1] * bs if bt.dim() == 2 and bs > 0 else 2 ** 62
        kv_lens = L.per_batch(ctx, "actual_seq_lengths_kv", kv_lens_raw, b, (cap,) * b,
                              f"paged KV: block_table has {bt.shape[-1]} columns x block_size {bs} = {cap} "
                              "positions per batch" if cap < 2 ** 62 else "paged KV")
        kv, dv, kv_s = paged_kv(ctx, layout, qd, b, key, value, key_rope, bt, bs, kv_lens, decode=decode,
                                kv_dtype=T.raw_kv_dtypes(key, value)[0], pack=kind.pack,
                                allow_dv_differs=allow_dv)
        kv_phys = (kv_s,) * b
    elif is_list:
        kv, dv, kv_phys = T.list_kv(ctx, layout, qd, key, value, key_rope, pack=kind.pack)
    else:
        kv, dv, kv_phys = T.dense_kv(ctx, layout, qd, key, value, key_rope, allow_dv_differs=allow_dv,
                                     pack=kind.pack)
        if layout.packed:
            kv_off = L.cumulative(ctx, "actual_seq_lengths_kv", kv_lens_raw, kv.key.shape[1])
            if len(kv_off) != len(q_off):
                raise ctx.err("actual_seq_lengths_kv", f"{b} entries like actual_seq_lengths", len(kv_off) - 1)
            kv_phys = tuple(kv_off[i + 1] - kv_off[i] for i in range(b))
    kd = T.raw_kv_dtypes(key, value)[0]
    if key_rope is not None:
        if key_rope.dtype != q_rope.dtype or (kd != torch.int8 and key_rope.dtype != kd):
            raise ctx.err("key_rope", f"dtype {dtype_name(q_rope.dtype)} (query_rope's, and the key's)",
                          f"dtype {dtype_name(key_rope.dtype)}")
        if (cache_dim(kv.key_rope) if paged else kv.key_rope.shape[-1]) != q_rope.shape[-1]:
            raise ctx.err("key_rope", f"rope head dim {q_rope.shape[-1]} (query_rope's)", key_rope)
    _check_alignment(ctx, kind, query, qd.D, decode, a)

    # ---- lengths and left padding (SPEC 4)
    qpad = Q.padding_size(ctx, "query_padding_size", a["query_padding_size"], b)
    kvpad = Q.padding_size(ctx, "kv_padding_size", a["kv_padding_size"], b)
    if paged and (qpad is not None or kvpad is not None):
        raise ctx.err("query_padding_size" if qpad is not None else "kv_padding_size",
                      "None with block_table (paged KV does not support left padding)", "a padding size")
    if layout.packed and (qpad is not None or kvpad is not None):
        raise ctx.err("query_padding_size" if qpad is not None else "kv_padding_size",
                      "None for TND layouts (no left padding)", "a padding size")
    qpad_on = qpad is not None and q_lens_raw is not None and not decode
    kvpad_on = kvpad is not None and kv_lens_raw is not None and kv.kind == "dense"   # lists: right padding
    if layout.packed:
        q_lens = tuple(q_rows)
        kv_lens = kv_lens if paged else kv_phys
    else:
        q_lens = (1,) * b if decode else L.per_batch(ctx, "actual_seq_lengths", q_lens_raw, b, (q_s,) * b)
        if not paged:
            kv_lens = L.per_batch(ctx, "actual_seq_lengths_kv", kv_lens_raw, b, kv_phys)

    # ---- shared prefix (SPEC 7)
    prefix = Q.shared_prefix(ctx, layout, qd, key, a["key_shared_prefix"], a["value_shared_prefix"],
                             a["actual_shared_prefix_len"], kd, pack=kind.pack)
    if prefix is not None:
        for bad, what in ((paged, "block_table (paged KV)"), (is_list, "tensor-list key/value"),
                          (qpad_on or kvpad_on, "left padding"), (q_rope is not None, "MLA rope"),
                          (query.dtype == torch.int8, "an int8 query")):
            if bad:
                raise ctx.err("key_shared_prefix", f"None with {what}: shared prefix does not combine with it",
                              "a shared prefix")
        if prefix.value.shape[-1] * kind.pack != dv:
            raise ctx.err("value_shared_prefix", f"head dim {dv // kind.pack} like value",
                          f"D = {prefix.value.shape[-1]}")
    p_len = 0 if prefix is None else prefix.length

    geometry = []
    for i in range(b):
        qw = Q.left_window(q_rows[i], qpad[i], q_lens[i]) if qpad_on else (0, q_lens[i])
        kw = Q.left_window(kv_phys[i], kvpad[i], kv_lens[i]) if kvpad_on else (0, kv_lens[i])
        if qw is None or kw is None:      # the window starts below 0: the batch's output is zeros
            qw, kw = (0, 0), (0, 0)
        geometry.append(BatchGeometry(q_rows[i], qw[0], qw[1], kv_phys[i], kw[0], kw[1], p_len,
                                      q_offset=q_off[i], kv_offset=kv_off[i]))

    # ---- masks, pse, precision (SPEC 3, 5, 6)
    kv_ext = max(kv_phys, default=0) + p_len      # columns a mask / pse must cover (prefix first)
    ip = M.inner_precise(ctx, a["inner_precise"], decode)
    mode = M.sparse_mode(ctx, a["sparse_mode"])
    pre, nxt = M.pre_next(ctx, a["pre_tokens"], a["next_tokens"])
    if layout.packed and mode == 3 and ctx.strict and not decode:
        for i, g in enumerate(geometry):   # the documents say act_q < act_kv; SPEC 15.11 allows ==
            if g.s1 > g.s2 > 0:          # act_kv == 0: a graph-padded request (SPEC 14b.4 T13, 14b.7)
                raise ctx.hw("actual_seq_lengths", "per-batch query length <= KV length for TND with "
                             "sparse_mode 3", f"batch {i}: {g.s1} > {g.s2}")
    mask = M.build_mask(ctx, a["atten_mask"], mode, pre, nxt, ignore_sparse=decode and q_rope is None,
                        decode_shapes=decode, packed=layout.packed, left_padded=qpad_on or kvpad_on,
                        row_fix=bool(ip & 2), b=b, q_s=q_s, kv_s=kv_ext)
    pse = M.pse_shift(ctx, a["pse_shift"], q_dtype=query.dtype, decode=decode, packed=layout.packed, b=b,
                      n=qd.N, d=qd.D, q_s=q_s, kv_s=kv_ext)
    sink = M.learnable_sink(ctx, a.get("learnable_sink"), query.dtype, qd.N)
    scale = ctx.number("scale", a["scale"])
    if not abs(scale) <= FLOAT32_MAX:                # inf, -inf, NaN, or no float32 (DECISIONS 49)
        raise ctx.err("scale", "a finite number within float32's range (|scale| <= 3.4028235e38: the operator's "
                      "float attribute)", describe(a["scale"]))
    lse_flag = a["softmax_lse_flag"]
    if not isinstance(lse_flag, (bool, int)) or lse_flag not in (0, 1):
        raise ctx.err("softmax_lse_flag", "a bool", describe(lse_flag))
    # ---- the V4 strict tables (SPEC 14b.1-14b.6), before the quantization arguments are read
    V4.check(ctx, a, layout=layout, query=query, key=key, value=value, qd=qd, dv=dv, q_rows=q_rows, q_s=q_s,
             decode=decode, q_rope=q_rope, key_rope=key_rope, kind=kind, paged=paged, is_list=is_list,
             left_padded=qpad_on or kvpad_on, prefix=prefix is not None, mode=mode, ip=ip)

    # ---- quantization (SPEC 10-12)
    antiquant = full = qdq = None
    if kind.kv is not None:
        ext = QT.KVExtent(b, qd.KV_N, qd.D, dv, max(kv_phys, default=0),
                          (kv.key.shape[0], kv.block_size) if paged else None)
        antiquant = QT.antiquant(ctx, a, kind, q_rope.dtype if kind.query_dequant and q_rope is not None
                                 else (torch.float16 if query.dtype == torch.int8 else query.dtype), ext,
                                 decode=decode, q_s=q_s, is_list=is_list, left_padded=qpad_on or kvpad_on,
                                 paged=paged, has_prefix=prefix is not None, nz=paged and kv.nz)
    if kind.full:
        full = QT.full_quant(ctx, a, decode=decode)
        if paged:
            raise ctx.err("block_table", "None with an int8 query (paged KV is not available for full "
                          "quantization)", a["block_table"])
    if kind.query_dequant:
        qdq = QT.query_dequant(ctx, a, b, qd.N, qd.S if not layout.packed else q_s, layout.inp,
                               tuple(q_off) if layout.packed else None)
    out_q = QT.output_quant(ctx, a, q_dtype=query.dtype, n=qd.N, dv=dv, out_layout=layout.out,
                            int4=kind.kv == "int4", left_padded=qpad_on or kvpad_on, mask=mask, geometry=geometry)
    out_dtype = output_dtype(ctx, a, query, out_q is not None)

    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    return AttentionProblem(
        api=api, layout=layout, B=b, N=qd.N, KV_N=qd.KV_N, Q_S=q_s, KV_S=max(kv_phys, default=0), D=qd.D, Dv=dv,
        T=qd.S if layout.packed else 0, dtype=query.dtype, out_dtype=out_dtype, compute_dtype=compute,
        query=T.to_canonical(query, layout.inp, qd.N), kv=kv, geometry=tuple(geometry), mask=mask, pse=pse,
        scale=scale, row_invalid_fix=bool(ip & 2), high_precision=not (ip & 1), want_lse=bool(lse_flag),
        is_decode=decode, strict=ctx.strict, query_rope=q_rope, prefix=prefix, antiquant=antiquant,
        full_quant=full, query_dequant=qdq, out_quant=out_q, sink=sink)


# arguments whose values are only read on the host (ctx.host rejects meta): they may live on any device --
# torch_npu's int[] lengths, and the block table / padding sizes / per-tensor int8 scales, which graph mode
# replaces by CPU stand-ins while tracing (fia.graph._HOST_READ) whatever the query's device
_HOST_ARGS = ("actual_seq_lengths", "actual_seq_lengths_kv", "actual_shared_prefix_len", "block_table",
              "query_padding_size", "kv_padding_size", "dequant_scale1", "quant_scale1", "dequant_scale2")


# optional tensor arguments (torch_npu's `Tensor?`); the padding sizes also take a Python int (sequence.py)
_OPTIONAL_TENSORS = (
    "pse_shift", "atten_mask", "dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2", "quant_offset2",
    "antiquant_scale", "antiquant_offset", "key_antiquant_scale", "key_antiquant_offset", "value_antiquant_scale",
    "value_antiquant_offset", "block_table", "key_shared_prefix", "value_shared_prefix", "query_rope", "key_rope",
    "key_rope_antiquant_scale", "dequant_scale_query", "learnable_sink")




# reserved arguments the documents say have no effect (keyRopeAntiquantScale: "预留参数，当前版本不生效"; v2's
# dequant_scale_key_rope maps onto it): None accepted, a tensor is an input error -- one rule in every entry point
# (DECISIONS 39)
RESERVED_TENSORS = ("key_rope_antiquant_scale",)


def _reserved(ctx: Ctx, a: dict) -> None:
    for name in RESERVED_TENSORS:
        if a.get(name) is not None:
            raise ctx.err(name, "None (a reserved argument with no effect in the documents)", a[name])


def _resolve_neg(a: dict) -> dict:
    """Tensors with the lazy negation bit (torch's `_neg_view`, the imaginary part of a conjugate) as the
    values they stand for: kernels read memory, which holds the un-negated values."""
    neg = [n for n, x in a.items() if (isinstance(x, torch.Tensor) and x.is_neg()) or
           (isinstance(x, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.is_neg() for t in x))]
    if not neg:
        return a
    a = dict(a)
    for n in neg:
        x = a[n]
        a[n] = x.resolve_neg() if isinstance(x, torch.Tensor) else type(x)(
            t.resolve_neg() if isinstance(t, torch.Tensor) else t for t in x)
    return a


def _optional_tensors(ctx: Ctx, a: dict) -> None:
    """An optional tensor argument is None or a tensor -- checked before any rule pairs it with another one,
    so `quant_offset2="abc"` is reported as what it is, not as "quant_scale2: a tensor when quant_offset2 is
    given" (and query_rope=3 not as a missing key_rope)."""
    for name in _OPTIONAL_TENSORS:
        ctx.tensor(name, a.get(name))


def _same_device(ctx: Ctx, query: torch.Tensor, a: dict) -> None:
    """Every tensor argument the computation reads lives on the query's device (DECISIONS 20).

    Without this a key (or mask, pse, scale...) on another device reaches a CPU kernel that reads its data
    pointer: a meta tensor has none (segmentation fault), a CUDA one is not host memory."""
    dev = query.device
    on_cpu = query.is_cpu               # (the common case: `is_cpu` is far cheaper than building a device)
    for name, x in a.items():
        if x is None or name in _HOST_ARGS or name == "query":       # (most arguments are None: keep it cheap)
            continue
        if isinstance(x, torch.Tensor):
            if (not x.is_cpu) if on_cpu else x.device != dev:
                raise ctx.err(name, f"a tensor on {dev} (the query's device)", f"a tensor on {x.device}")
        elif name in ("key", "value") and isinstance(x, (list, tuple)):
            for i, t in enumerate(x):
                if isinstance(t, torch.Tensor) and t.device != dev:
                    raise ctx.err(name, f"a tensor on {dev} (the query's device)",
                                  f"a tensor on {t.device} (list element {i})")


def _check_layout_use(ctx: Ctx, layout, decode: bool, q_s: int, query: torch.Tensor, a: dict) -> None:
    """Which layouts the documents allow where (inputLayout table of FusedInferAttentionScoreV4)."""
    if not ctx.strict:
        return
    if layout.name == "BNSD_BSND" and decode:
        raise ctx.hw("input_layout", "BNSD_BSND only for Q_S > 1", f"{layout.name} with Q_S = 1")
    if layout.out == "NBSD" and q_s > 16:
        raise ctx.hw("input_layout", f"{layout.name} only for 1 <= Q_S <= 16", f"Q_S = {q_s}")
    if layout.packed and a["query_rope"] is None and query.dtype != torch.bfloat16 and not \
            (query.dtype == torch.float16 and a["block_table"] is not None):
        raise ctx.hw("query", f"dtype bfloat16 for {layout.name} without rope", f"dtype {dtype_name(query.dtype)}")


def _check_alignment(ctx: Ctx, kind, query: torch.Tensor, d: int, decode: bool, a: dict) -> None:
    """D alignment (hardware): 64 with int4, 32 with int8 anywhere (prefill), 16 for float16/bfloat16 prefill."""
    if not ctx.strict:
        return
    if kind.kv == "int4":
        if d % 64:
            raise ctx.hw("key", "head dim D % 64 == 0 with int4 key/value", f"D = {d}")
        return
    if decode:
        return
    int8 = query.dtype == torch.int8 or kind.kv == "int8" or a.get("quant_scale2") is not None
    if int8 and d % 32:
        raise ctx.hw("query", "head dim D % 32 == 0 when int8 is involved (Q_S > 1)", f"D = {d}")
    if d % 16:
        raise ctx.hw("query", "head dim D % 16 == 0 for Q_S > 1", f"D = {d}")
