"""The V4 strict tables (SPEC 14b.1-14b.6): scenario rules of FusedInferAttentionScoreV4.

Each rule cites its SPEC id (M1.., Q1.., T1.., G1.., F1..) and the line of
docs/seeds/FusedInferAttentionScoreV4.md it comes from. Hardware-only rules raise through `Ctx.hw` (strict mode
only; `fia.validation_mode('portable')` lifts them); rules that define what a call means (NZ cache geometry, mode 6
/ FP4) are semantic and checked in both modes. What SPEC 15.11 keeps for real clients stays accepted; such rules
are named in a comment and not checked (M4, lse in M9 / Q6 / T10, Q_S > 1 sparse 0 with a mask in M6, paged TND
sparse 4 in T2, act_q == act_kv in T13, MLA full quantization's ND caches and TND form in 14b.2).

`check` is called once by parse/core.py, after lengths, storage, prefix, masks and pse are parsed and before the
quantization arguments are read (so mode 6 meets its combination rules here, before the quantization parse).
The tables read a `V4Call` (facts parse already knows) and the raw arguments (which optional parameters were
passed); both can be built directly, so the rules for features parse does not accept yet (5-D NZ caches §8b,
FP4 K/V §10b.1) are testable today and apply unchanged once those features land.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .context import Ctx, dtype_name
from .masking import is_template

F16, BF16, I8 = torch.float16, torch.bfloat16, torch.int8
FP4 = getattr(torch, "float4_e2m1fn_x2", None)          # §10b.1: FP4 E2M1, two per byte
E8M0 = getattr(torch, "float8_e8m0fnu", None)           # §10b.1: mode 6 scale dtype

MLA_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)               # M1 (1471)
TND_MLA_HEADS = (32, 64, 128)                           # T6 (1380)
GQA_NZ_HEADS = ((10, 1), (64, 8), (80, 8), (128, 16))   # G4 (1628)
TND_BLOCK_SIZES = (128, 512, 1024)                      # T14 (1421)
_DEQUANT_OFFSETS = ("antiquant_offset", "key_antiquant_offset", "value_antiquant_offset")


@dataclass(frozen=True)
class V4Call:
    """What the tables need to know of a call (parse's facts; raw shapes of the K/V tensors as passed)."""
    layout: str                          # the input_layout string
    query_dtype: torch.dtype
    kv_dtype: torch.dtype                # key's dtype as passed
    n: int
    kv_n: int
    d: int                               # query head dim (real)
    dv: int                              # value head dim (real)
    q_s: int                             # Q_S; TND family: the longest request
    q_rows: Tuple[int, ...] = ()         # TND family: every request's query length
    decode: bool = False
    rope: bool = False
    rope_d: int = 0
    query_rope_dtype: Optional[torch.dtype] = None
    key_rope_dtype: Optional[torch.dtype] = None
    key_shape: Tuple[int, ...] = ()      # raw shapes (5-D: an NZ cache, §8b.1); () for tensor lists
    value_shape: Tuple[int, ...] = ()
    key_rope_shape: Tuple[int, ...] = ()
    paged: bool = False
    block_size: int = 0
    table_cols: int = 0                  # block_table.shape[1]
    is_list: bool = False
    left_padded: bool = False
    prefix: bool = False
    sparse_mode: int = 0
    inner_precise: int = 0
    kv_quant: Optional[str] = None       # parse's QuantKind.kv: None | "int8" | "int4" (| FP4 once parsed)
    full: bool = False                   # full int8 (dequant_scale1 / quant_scale1 / dequant_scale2)
    query_dequant: bool = False          # int8 query with dequant_scale_query

    @property
    def packed(self) -> bool:
        return self.layout.split("_")[0] in ("TND", "NTD")

    @property
    def nz(self) -> bool:
        return len(self.key_shape) == 5


def check(ctx: Ctx, a: dict, *, layout, query, key, value, qd, dv, q_rows, q_s, decode, q_rope, key_rope, kind,
          paged, is_list, left_padded, prefix, mode, ip) -> None:
    """The hook parse/core.py calls: build the call's facts, run every table that applies."""
    k0 = key[0] if isinstance(key, tuple) else key
    bt = a.get("block_table")
    c = V4Call(
        layout=layout.name, query_dtype=query.dtype, kv_dtype=k0.dtype, n=qd.N, kv_n=qd.KV_N, d=qd.D, dv=dv,
        q_s=q_s, q_rows=tuple(q_rows) if layout.packed else (), decode=decode, rope=q_rope is not None,
        rope_d=int(q_rope.shape[-1]) if q_rope is not None else 0,
        query_rope_dtype=q_rope.dtype if q_rope is not None else None,
        key_rope_dtype=key_rope.dtype if key_rope is not None else None,
        key_shape=() if is_list else tuple(key.shape), value_shape=() if is_list else tuple(value.shape),
        key_rope_shape=tuple(key_rope.shape) if key_rope is not None else (), paged=paged,
        block_size=ctx.integer("block_size", a.get("block_size", 0)) if paged else 0,
        table_cols=int(bt.shape[-1]) if paged and bt.dim() == 2 else 0, is_list=is_list, left_padded=left_padded,
        prefix=prefix, sparse_mode=mode, inner_precise=ip, kv_quant=kind.kv, full=kind.full,
        query_dequant=kind.query_dequant)
    check_call(ctx, a, c)


def check_call(ctx: Ctx, a: dict, c: V4Call) -> None:
    fp4_mode6(ctx, a, c)                                   # 14b.6 (semantic: runs in both modes)
    if c.nz:
        nz_geometry(ctx, c)                                # M10 / 8b.1 (semantic)
    if c.nz and c.kv_dtype == I8 and c.query_dtype != I8:
        gqa_nz(ctx, a, c)                                  # 14b.5 (the specific table for int8 NZ + float query)
    if c.rope and c.d == 512:
        if c.query_dtype == I8:
            mla_full_quant(ctx, a, c)                      # 14b.2
        else:
            mla_d512(ctx, a, c)                            # 14b.1
    if c.rope and c.d == 128:
        mla_d128(ctx, a, c)                                # 14b.3
    if c.packed:
        tnd(ctx, a, c)                                     # 14b.4


# ------------------------------------------------------------------------------------------------ helpers
def _hw(ctx: Ctx, name: str, expected: str, received, table: str) -> None:
    """A hardware-only rule of a V4 table: raise in strict mode, nothing in portable mode."""
    e = ctx.hw(name, expected, received, table)
    if e is not None:
        raise e


def _mask(a: dict):
    return a.get("atten_mask")


def _template(a: dict) -> bool:
    m = _mask(a)
    return m is not None and is_template(m)


def _no_extras(ctx: Ctx, a: dict, c: V4Call, table: str, *, lse_ok: bool = True, quant: bool = True,
               paged: bool = False) -> None:
    """The "not supported" rows every table ends with: left padding, tensor list, pse, prefix, output
    quantization (and, where the row lists them, dequantization and paged KV)."""
    what = f"None for {table}"
    if c.left_padded:
        name = "query_padding_size" if a.get("query_padding_size") is not None else "kv_padding_size"
        _hw(ctx, name, f"{what} (no left padding)", "an active padding size", table)
    if c.is_list:
        _hw(ctx, "key", f"a tensor for {table} (no tensor-list key/value)", "a list of tensors", table)
    if a.get("pse_shift") is not None:
        _hw(ctx, "pse_shift", f"{what} (no pse)", a["pse_shift"], table)
    if c.prefix:
        _hw(ctx, "key_shared_prefix", f"{what} (no shared prefix)", a.get("key_shared_prefix"), table)
    if paged and c.paged:
        _hw(ctx, "block_table", f"{what} (no paged KV)", a.get("block_table"), table)
    if a.get("quant_scale2") is not None:
        _hw(ctx, "quant_scale2", f"{what} (no output quantization: the output has the query's dtype)",
            a["quant_scale2"], table)
    if quant and c.kv_quant is not None and c.query_dtype != I8:
        _hw(ctx, "key", f"dtype {dtype_name(c.query_dtype)} (the query's) for {table} (no KV dequantization)",
            f"dtype {dtype_name(c.kv_dtype)}", table)


# ------------------------------------------------------------------------------------------------ 14b.1
def mla_d512(ctx: Ctx, a: dict, c: V4Call) -> None:
    """SPEC 14b.1: MLA with query D = 512 and rope, fp16 / bf16 query (lines 1457-1559)."""
    t = "MLA with query D = 512 (SPEC 14b.1)"
    # M1 (1471): query fp16 / bf16 (float32 is the general hardware rule), Q_S in [1, 16], Q_N in {1, 2, 4, ..., 128}
    if c.q_s > 16:
        _hw(ctx, "query", "Q_S in [1, 16] for MLA with query D = 512 (M1, line 1471)", f"Q_S = {c.q_s}", t)
    if c.n not in MLA_HEADS:
        _hw(ctx, "num_heads", f"one of {', '.join(map(str, MLA_HEADS))} for MLA with query D = 512 (M1, line 1471)",
            c.n, t)
    # M2 (1476, 1481): KV_N = 1; key/value dtype = the query's (int8 K/V = dequantization, M9)
    if c.kv_n != 1:
        _hw(ctx, "num_key_value_heads", "1 for MLA with query D = 512 (M2, lines 1476, 1481)", c.kv_n, t)
    # M5 (1496): the layouts; BNSD / BNSD_NBSD not with 5-D (NZ) key / value
    allowed = ("BSH", "BSND", "BNSD", "BNSD_NBSD", "BSND_NBSD", "BSH_NBSD", "TND", "TND_NTD")
    if c.layout not in allowed:
        _hw(ctx, "input_layout", f"one of {', '.join(allowed)} for MLA with query D = 512 (M5, line 1496)",
            c.layout, t)
    if c.nz and c.layout in ("BNSD", "BNSD_NBSD"):
        _hw(ctx, "input_layout", "BSH, BSND, BSH_NBSD, BSND_NBSD, TND or TND_NTD with 5-D (NZ) key/value for "
            "MLA with query D = 512 (M5, line 1496)", c.layout, t)
    # M6 (1502): Q_S = 1: sparse 0 without mask or sparse 4 with the template; Q_S > 1: sparse 3 / 4 with the
    # template. [15.11] Q_S > 1 with a per-request mask under sparse 0 stays accepted.
    m, mode = _mask(a), c.sparse_mode
    if c.q_s <= 1:
        ok = (mode == 0 and m is None) or (mode == 4 and _template(a))
        exp = "sparse_mode 0 without atten_mask, or 4 with the 2048x2048 template, for Q_S = 1"
    else:
        ok = (mode in (3, 4) and _template(a)) or (mode == 0 and m is not None)
        exp = "sparse_mode 3 or 4 with the 2048x2048 template (or 0 with a per-request mask) for Q_S > 1"
    if not ok:
        _hw(ctx, "sparse_mode", f"{exp} for MLA with query D = 512 (M6, line 1502)",
            f"sparse_mode {mode} " + ("without atten_mask" if m is None else f"with a mask of shape {tuple(m.shape)}"),
            t)
    # M7 (1537-1544): paged KV with block_size 128. [reading] dense D = 512 and other block sizes stay as FIA
    # accepts them for ND caches; an NZ cache is paged with block_size 128 (8b.2 b).
    if c.nz:
        _nz_paged(ctx, a, c, (128,), "M7, lines 1537-1544", t)
    # M8 (464-485, 1459, 1464): rope shapes / dtypes / D = 64 -- checked by parse/sequence.py rope_pair and core.
    # M4 (1491): actual_seq_lengths only with TND and Q_S > 1 -- [15.11] (mla_cp passes BSND + lengths): not checked.
    # M9 (1559): no left padding, tensor list, pse, prefix, dequantization, output quantization (M3, 1486: the
    # output has the query's dtype). [15.11] softmax_lse stays accepted.
    _no_extras(ctx, a, c, "MLA with query D = 512 (M3 line 1486, M9 line 1559)")


def nz_geometry(ctx: Ctx, c: V4Call) -> None:
    """M10 (1477, 1514) and 8b.1: an NZ cache is (blocknum, KV_N, D / D0, block_size, D0) with D0 = 32 bytes /
    element size: 16 for fp16 / bf16 (1477, 1482, 1534), 32 for int8 (1514, 1519, 1614, 1619). Semantic: it
    defines where each element is."""
    for name, shape, d, dt in (("key", c.key_shape, c.d, c.kv_dtype), ("value", c.value_shape, c.dv, c.kv_dtype),
                               ("key_rope", c.key_rope_shape, c.rope_d, c.key_rope_dtype)):
        if len(shape) != 5 or dt is None:
            continue
        d0 = 32 if dt == I8 else 16
        want = f"(blocknum, {c.kv_n}, {d // d0}, block_size, {d0})"
        if shape[1] != c.kv_n or shape[4] != d0 or shape[2] * shape[4] != d or (c.paged and shape[3] != c.block_size):
            raise ctx.err(name, f"an NZ cache {want} for {dtype_name(dt)} (SPEC 8b.1 / M10, lines 1477, 1514: "
                          f"D0 = 32 bytes / element size, D = {d}, KV_N = {c.kv_n})", f"shape {tuple(shape)}")


def _nz_paged(ctx: Ctx, a: dict, c: V4Call, sizes, cite: str, table: str) -> None:
    """An NZ cache is a paged pool: block_table required, block_size one of `sizes`."""
    if not c.paged:
        _hw(ctx, "block_table", f"a block table with a 5-D (NZ) key/value ({cite}: PagedAttention required)",
            "None", table)
    elif c.block_size not in sizes:
        _hw(ctx, "block_size", f"{' or '.join(map(str, sizes))} with a 5-D (NZ) key/value ({cite})", c.block_size,
            table)


# ------------------------------------------------------------------------------------------------ 14b.2
def mla_full_quant(ctx: Ctx, a: dict, c: V4Call) -> None:
    """SPEC 14b.2 / 10b.3: MLA full quantization (int8 query with dequant_scale_query, int8 NZ K/V, bf16 rope).

    Open (10b.3): the ND-cache form (int8 query with ND fp16 / bf16 / int8 K/V, DECISIONS 13) and the TND form
    (Q8, line 1401) stay as FIA has them, so these rules apply to NZ (5-D) caches only."""
    if not c.nz:
        return
    t = "MLA full quantization (SPEC 14b.2)"
    # Q1 (503, 680): dequant_scale_query float32, query_quant_mode 3
    dsq = a.get("dequant_scale_query")
    if dsq is None:
        _hw(ctx, "dequant_scale_query", "a float32 per-token per-head scale for an int8 query with 5-D (NZ) "
            "key/value (Q1, line 503)", "None", t)
    elif dsq.dtype != torch.float32:
        _hw(ctx, "dequant_scale_query", "dtype float32 (Q1, line 503)", f"dtype {dtype_name(dsq.dtype)}", t)
    if a.get("query_quant_mode", 0) != 3:
        _hw(ctx, "query_quant_mode", "3 (per-token per-head) for MLA full quantization (Q1, line 680)",
            a.get("query_quant_mode", 0), t)
    # Q2 (1513, 1518): key and value int8, both 5-D
    if c.kv_dtype != I8:
        _hw(ctx, "key", "dtype int8 for MLA full quantization (Q2, line 1513)", f"dtype {dtype_name(c.kv_dtype)}", t)
    if len(c.value_shape) != 5:
        _hw(ctx, "value", "a 5-D (NZ) int8 cache like key (Q2, line 1518: 5-D only)", f"shape {c.value_shape}", t)
    # Q3 (1523) / Q4 (1528, 1533): output bf16 = the query_rope dtype; key_rope bf16 and 5-D
    if c.query_rope_dtype != BF16:
        _hw(ctx, "query_rope", "dtype bfloat16 for MLA full quantization (Q4, line 1528; Q3, line 1523: the "
            "output is bfloat16)", f"dtype {dtype_name(c.query_rope_dtype)}", t)
    if c.key_rope_dtype != BF16:
        _hw(ctx, "key_rope", "dtype bfloat16 for MLA full quantization (Q4, line 1533)",
            f"dtype {dtype_name(c.key_rope_dtype)}", t)
    if len(c.key_rope_shape) != 5:
        _hw(ctx, "key_rope", "a 5-D (NZ) bfloat16 cache (Q4, line 1533: 5-D only)", f"shape {c.key_rope_shape}", t)
    # Q5 (1537-1544): paged KV, block_size 128
    _nz_paged(ctx, a, c, (128,), "Q5, lines 1537-1544", t)
    # 10b.3: Q_S 1..16 and the sparse modes of M6; layouts without BNSD forms (1496); Q8 (TND, 1401) is open
    if c.q_s > 16:
        _hw(ctx, "query", "Q_S in [1, 16] for MLA full quantization (SPEC 10b.3, line 1471)", f"Q_S = {c.q_s}", t)
    if c.layout in ("BNSD", "BNSD_NBSD", "BNSD_BSND", "NTD_TND"):
        _hw(ctx, "input_layout", "BSH, BSND, BSH_NBSD or BSND_NBSD for MLA full quantization (SPEC 10b.3, line "
            "1496)", c.layout, t)
    # Q6 (1559): no output quantization, left padding, pse, prefix, dequantization offsets. [15.11] lse accepted.
    for name in _DEQUANT_OFFSETS:
        if a.get(name) is not None:
            _hw(ctx, name, "None for MLA full quantization (SPEC 10b.3: no dequantization offsets)", a[name], t)
    _no_extras(ctx, a, c, "MLA full quantization (Q6, line 1559)", quant=False)
    # Q7 (1896): an int8 query at Q_S = 1 without dequant_scale_query is all-int8 decode -- parse/quant.py
    # full_quant rejects it.


# ------------------------------------------------------------------------------------------------ 14b.3
def mla_d128(ctx: Ctx, a: dict, c: V4Call) -> None:
    """SPEC 14b.3: MLA with query D = 128 and rope (lines 1562-1583)."""
    t = "MLA with query D = 128 (SPEC 14b.3)"
    # layouts TND or NTD_TND (1565)
    if c.layout not in ("TND", "NTD_TND"):
        _hw(ctx, "input_layout", "TND or NTD_TND for MLA with query D = 128 (SPEC 14b.3, line 1565)", c.layout, t)
    # Q_D = K_D = V_D = 128 (1426); K_D = Q_D is checked by parse
    if c.dv != 128:
        _hw(ctx, "value", "head dim V_D = 128 for MLA with query D = 128 (SPEC 14b.3, line 1426)", f"D = {c.dv}", t)
    # bfloat16 (1411): parse/core.py's TND rule (fp16 kept with rope: T12's dlinfer exception)
    # not with paged KV, left padding, tensor list, pse, prefix, any quantization (1583)
    if c.query_dtype == I8:
        _hw(ctx, "query", f"dtype {dtype_name(BF16)} for MLA with query D = 128 (SPEC 14b.3, line 1583: no "
            "quantization)", f"dtype {dtype_name(c.query_dtype)}", t)
    _no_extras(ctx, a, c, "MLA with query D = 128 (SPEC 14b.3, line 1583)", paged=True)


# ------------------------------------------------------------------------------------------------ 14b.4
def tnd(ctx: Ctx, a: dict, c: V4Call) -> None:
    """SPEC 14b.4: the TND family (lines 1348-1434). T1 (T <= 1,048,576), T3 (both lengths lists, <= 4096
    entries), T12 (bfloat16; fp16 with paged KV or rope) and T13 (sparse 3: act_q <= act_kv) are checked by
    parse/core.py and parse/lengths.py; pse / left padding / tensor list / prefix with TND by parse too."""
    # T2 (1350): sparse 0 without mask, or 3 with the template (parse/masking.py rejects the rest); sparse 4
    # [15.11] only with paged KV (sliding window)
    # ([15.11] a decode call without rope ignores its sparse mode: not checked there)
    if c.sparse_mode == 4 and not c.paged and not (c.decode and not c.rope):
        _hw(ctx, "sparse_mode", f"0 without atten_mask or 3 with the template for {c.layout} (T2, line 1350; "
            "sparse_mode 4 only with paged KV)", "sparse_mode 4 with dense key/value", "SPEC 14b.4")
    if c.d == 512:
        _tnd_mla(ctx, a, c)
    else:
        _tnd_gqa(ctx, a, c)


def _tnd_mla(ctx: Ctx, a: dict, c: V4Call) -> None:
    t = f"{c.layout} with query D = 512 (SPEC 14b.4)"
    # T4 (1372): layouts TND or TND_NTD
    if c.layout not in ("TND", "TND_NTD"):
        _hw(ctx, "input_layout", "TND or TND_NTD with query D = 512 (T4, line 1372)", c.layout, t)
    # T5 (1376): every request's query length 1..16 ([15.11] zero-length requests stay accepted)
    for i, r in enumerate(c.q_rows):
        if r > 16:
            _hw(ctx, "actual_seq_lengths", "per-request query lengths in [1, 16] with query D = 512 (T5, line 1376)",
                f"request {i}: {r}", t)
    # T6 (1380): num_heads 32, 64 or 128
    if c.n not in TND_MLA_HEADS:
        _hw(ctx, "num_heads", f"32, 64 or 128 for {c.layout} with query D = 512 (T6, line 1380)", c.n, t)
    # T7 (1384): KV_N = 1
    if c.kv_n != 1:
        _hw(ctx, "num_key_value_heads", f"1 for {c.layout} with query D = 512 (T7, line 1384)", c.kv_n, t)
    # T8 (1387-1393): paged KV required (per-batch KV lengths <= the table's positions: parse/core.py)
    if not c.paged:
        _hw(ctx, "block_table", f"a block table for {c.layout} with query D = 512 (T8, lines 1387-1393: "
            "PagedAttention required)", "None", t)
    # T9 (1398): rope D = 64 -- parse/sequence.py rope_pair.
    # T10 (1401): no dequantization, full quantization, output quantization ([15.11] lse accepted; left padding,
    # tensor list, pse, prefix: parse). The int8-query MLA (dequant_scale_query) with TND is open (SPEC 10b.3).
    if c.full:
        _hw(ctx, "query", f"dtype float16 or bfloat16 for {c.layout} with query D = 512 (T10, line 1401: no full "
            "quantization)", "an int8 query with dequant_scale1 / quant_scale1 / dequant_scale2", t)
    _no_extras(ctx, a, c, f"{c.layout} with query D = 512 (T10, line 1401)", quant=not c.query_dequant)


def _tnd_gqa(ctx: Ctx, a: dict, c: V4Call) -> None:
    t = f"{c.layout} with query D != 512 (SPEC 14b.4)"
    # T11 (1407): layouts TND or NTD_TND
    if c.layout not in ("TND", "NTD_TND"):
        _hw(ctx, "input_layout", "TND or NTD_TND with query D != 512 (T11, line 1407)", f"{c.layout} with D = {c.d}",
            t)
    # T14 (1421): paged block_size 128, 512 or 1024 (1024 overrides line 911's "<= 512" for TND)
    if c.paged and c.block_size not in TND_BLOCK_SIZES:
        _hw(ctx, "block_size", f"128, 512 or 1024 for paged {c.layout} (T14, line 1421)", c.block_size, t)
    if c.rope:
        # T15 (1426): with rope Q_D = K_D = V_D = 128
        if c.d != 128:
            _hw(ctx, "query", f"head dim 128 for {c.layout} with rope (T15, line 1426)", f"D = {c.d}", t)
        if c.dv != 128:
            _hw(ctx, "value", f"head dim 128 for {c.layout} with rope (T15, line 1426)", f"D = {c.dv}", t)
    else:
        # T16 (1431): TND (128, 128, 128) or Q_D = K_D = 192 with V_D 128 / 192; NTD_TND Q_D = K_D 128 / 192
        # with V_D 128; GQA and paged KV: no V_D = 192. (K_D = Q_D is checked by parse.)
        if c.d not in (128, 192):
            _hw(ctx, "query", f"head dim 128 or 192 for {c.layout} without rope (T16, line 1431)", f"D = {c.d}", t)
        if c.layout == "TND":
            dvs = (128,) if c.d == 128 else (128, 192)
        else:
            dvs = (128,)
        if (c.n != c.kv_n or c.paged) and 192 in dvs:
            dvs = (128,)
        if c.dv not in dvs:
            why = " (GQA / paged KV: no V_D = 192)" if (c.n != c.kv_n or c.paged) and c.dv == 192 else ""
            _hw(ctx, "value", f"head dim {' or '.join(map(str, dvs))} for {c.layout} with query D = {c.d} (T16, line "
                f"1431){why}", f"D = {c.dv}", t)
    # T17 (1434): no dequantization, full quantization or output quantization (left padding, tensor list, pse,
    # prefix: parse)
    if c.query_dtype == I8:
        _hw(ctx, "query", f"dtype bfloat16 for {c.layout} with query D != 512 (T17, line 1434: no full "
            "quantization)", f"dtype {dtype_name(c.query_dtype)}", t)
    _no_extras(ctx, a, c, f"{c.layout} with query D != 512 (T17, line 1434)")


# ------------------------------------------------------------------------------------------------ 14b.5
def gqa_nz(ctx: Ctx, a: dict, c: V4Call) -> None:
    """SPEC 14b.5 / 8b.2 (a): GQA / MHA / MQA dequantization on int8 NZ caches (lines 1588-1700)."""
    t = "dequantization with 5-D (NZ) key/value (SPEC 14b.5)"
    # G1 (1608): query bf16, D = 128, Q_S in [1, 16]
    if c.query_dtype != BF16:
        _hw(ctx, "query", "dtype bfloat16 with 5-D (NZ) int8 key/value (G1, line 1608)",
            f"dtype {dtype_name(c.query_dtype)}", t)
    if c.d != 128:
        _hw(ctx, "query", "head dim 128 with 5-D (NZ) int8 key/value (G1, line 1608)", f"D = {c.d}", t)
    if c.q_s > 16:
        _hw(ctx, "query", "Q_S in [1, 16] with 5-D (NZ) int8 key/value (G1, line 1608)", f"Q_S = {c.q_s}", t)
    # G2 (1613, 1618): key and value int8 NZ only
    if len(c.value_shape) != 5:
        _hw(ctx, "value", "a 5-D (NZ) int8 cache like key (G2, line 1618)", f"shape {c.value_shape}", t)
    # G3 (1623): BSH, BSND or BNSD
    if c.layout not in ("BSH", "BSND", "BNSD"):
        _hw(ctx, "input_layout", "BSH, BSND or BNSD with 5-D (NZ) int8 key/value (G3, line 1623)", c.layout, t)
    # G4 (1628): (num_heads, num_key_value_heads)
    if (c.n, c.kv_n) not in GQA_NZ_HEADS:
        _hw(ctx, "num_heads", "(num_heads, num_key_value_heads) in (10, 1), (64, 8), (80, 8), (128, 16) with 5-D "
            "(NZ) int8 key/value (G4, line 1628)", f"({c.n}, {c.kv_n})", t)
    # G5 (1633): inner_precise 1 (high performance)
    if c.inner_precise != 1:
        _hw(ctx, "inner_precise", "1 with 5-D (NZ) int8 key/value (G5, line 1633)", c.inner_precise, t)
    # G6 (1638): Q_S = 1: sparse 0 without mask ([15.11] decode with sparse 2-4 and the template stays
    # accepted, the template ignored); Q_S 2..16: sparse 3 with the (2048, 2048) template
    m, mode = _mask(a), c.sparse_mode
    if c.q_s <= 1:
        ok = (mode == 0 and m is None) or (mode in (2, 3, 4) and _template(a))
        exp = "sparse_mode 0 without atten_mask for Q_S = 1"
    else:
        ok = mode == 3 and _template(a)
        exp = "sparse_mode 3 with the 2048x2048 template for Q_S 2..16"
    if not ok:
        _hw(ctx, "sparse_mode", f"{exp} with 5-D (NZ) int8 key/value (G6, line 1638)",
            f"sparse_mode {mode} " + ("without atten_mask" if m is None else f"with a mask of shape {tuple(m.shape)}"),
            t)
    # G7 (1642): separate K/V parameters only, no offsets, no rope
    if a.get("antiquant_scale") is not None:
        _hw(ctx, "antiquant_scale", "None with 5-D (NZ) int8 key/value: key_antiquant_scale / value_antiquant_scale "
            "only (G7, line 1642)", a["antiquant_scale"], t)
    for name in _DEQUANT_OFFSETS:
        if a.get(name) is not None:
            _hw(ctx, name, "None with 5-D (NZ) int8 key/value (G7, line 1642: symmetric only)", a[name], t)
    if c.rope:
        _hw(ctx, "query_rope", "None with 5-D (NZ) int8 key/value (G7, line 1642)", a.get("query_rope"), t)
    # G8 (1645-1683): key / value mode 0 (per-channel) or 1 (per-token), equal. The per-token scale's
    # S >= block_table.shape[1] x block_size (1679) is parse/quant.py's paged coverage rule.
    km, vm = a.get("key_antiquant_mode", 0), a.get("value_antiquant_mode", 0)
    if (km, vm) not in ((0, 0), (1, 1)):
        _hw(ctx, "key_antiquant_mode", "0 (per-channel) or 1 (per-token), equal for key and value, with 5-D (NZ) "
            "int8 key/value (G8, lines 1645-1683)", f"key {km}, value {vm}", t)
    # G9 (1687-1694): paged KV, block_size 128 or 512
    _nz_paged(ctx, a, c, (128, 512), "G9, lines 1687-1694", t)
    # G10 (1697): no pse or output quantization (nor left padding, tensor list, prefix)
    _no_extras(ctx, a, c, "5-D (NZ) int8 key/value (G10, line 1697)", quant=False)


# ------------------------------------------------------------------------------------------------ 14b.6
def fp4_mode6(ctx: Ctx, a: dict, c: V4Call) -> None:
    """SPEC 14b.6 / 10b.1: antiquant mode 6 (per-token-group FLOAT8_E8M0 scales) and FP4 E2M1 K/V. Semantic:
    mode 6 is defined only for FP4, FP4 only by mode 6. F8 (1285: the combined antiquant_mode takes 0 and 1) is
    parse/quant.py's combined-mode rule; F9 (154, 169: K/V dtypes) its classify."""
    km, vm = a.get("key_antiquant_mode", 0), a.get("value_antiquant_mode", 0)
    fp4 = FP4 is not None and c.kv_dtype == FP4
    if c.kv_quant is None and not fp4:
        return                                  # float K/V: the modes are not used (DECISIONS 21)
    if fp4:
        # F4 (1300-1301): FP4 K/V only with mode 6 (separate parameters)
        if a.get("antiquant_scale") is not None:
            raise ctx.err("antiquant_scale", "None with FP4 key/value: key_antiquant_scale / value_antiquant_scale "
                          "with key/value_antiquant_mode 6 (F4, lines 1300-1301)", a["antiquant_scale"])
        if km != 6 or vm != 6:
            raise ctx.err("key_antiquant_mode" if km != 6 else "value_antiquant_mode", "6 (per-token-group) with "
                          "FP4 key/value (F4, lines 1300-1301: per-channel / per-tensor are INT8 / INT4 only)",
                          km if km != 6 else vm)
    if 6 not in (km, vm):
        return
    # F5 (1288): key mode = value mode
    if km != vm:
        raise ctx.err("value_antiquant_mode", f"{km} like key_antiquant_mode (F5, line 1288: mode 6 for both)", vm)
    # F6 (1243): Q_S = 1 only
    if not c.decode:
        raise ctx.err("key_antiquant_mode", "0 or 1 unless Q_S = 1 (F6, line 1243: mode 6 is decode only)",
                      f"6 with Q_S = {c.q_s}")
    # F2 (1946): no offsets
    for name in ("key_antiquant_offset", "value_antiquant_offset"):
        if a.get(name) is not None:
            raise ctx.err(name, "None with mode 6 (F2, line 1946: per-token-group scales have no offset)", a[name])
    # F3 (1946): scales FLOAT8_E8M0
    for name in ("key_antiquant_scale", "value_antiquant_scale"):
        s = a.get(name)
        if s is not None and s.dtype != E8M0:
            raise ctx.err(name, "dtype float8_e8m0fnu with mode 6 (F3, line 1946)", f"dtype {dtype_name(s.dtype)}")
    # F1 (1946): mode 6 only with FP4 K/V
    if not fp4:
        raise ctx.err("key", "dtype float4_e2m1fn_x2 (FP4) with key/value_antiquant_mode 6 (F1, line 1946)",
                      f"dtype {dtype_name(c.kv_dtype)}")
    # F7 (1946): the scale's token axis (second to last) >= KV_S dense, >= block_table.shape[1] x block_size paged
    if c.paged:
        need = c.table_cols * c.block_size
        for name in ("key_antiquant_scale", "value_antiquant_scale"):
            s = a.get(name)
            if s is not None and (s.dim() < 2 or s.shape[-2] < need):
                raise ctx.err(name, f"a token axis (second to last) >= block_table.shape[1] x block_size = {need} "
                              "(F7, line 1946)", s)
