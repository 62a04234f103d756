"""Quantization arguments (SPEC 10-12): KV dequantization, full int8, query dequantization, int8 output."""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional

import torch

from ..problem.attention import MaskSpec
from ..problem.quant import FP4_GROUP, AntiQuant, FullQuant, KVDequant, OutputQuant, QueryDequant
from .context import Ctx, dtype_name

COMBINED = ("antiquant_scale", "antiquant_offset")
SEPARATE = ("key_antiquant_scale", "key_antiquant_offset", "value_antiquant_scale", "value_antiquant_offset")
FULL = ("dequant_scale1", "quant_scale1", "dequant_scale2")
_SEP_GRAN = {0: None, 1: "token", 2: "head", 3: "token_head", 4: "block_token", 5: "block_token_head"}
FP4 = torch.float4_e2m1fn_x2        # FP4 E2M1 K/V, two values per byte (SPEC 10b.1)
E8M0 = torch.float8_e8m0fnu         # their per-token-group scales
MODE_FP4 = 6


@dataclass(frozen=True)
class QuantKind:
    kv: Optional[str]        # None (float K/V) | "int8" | "int4" | "fp4"
    full: bool               # int8 Q, K, V with dequant_scale1/quant_scale1/dequant_scale2 (SPEC 11)
    query_dequant: bool      # int8 query with dequant_scale_query (query_quant_mode 3)

    @property
    def pack(self) -> int:
        """Stored last dim of K/V = real last dim / pack (int4 packed eight to an int32, FP4 two to a byte)."""
        return 8 if self.kv == "int4" else 2 if self.kv == "fp4" else 1


def classify(ctx: Ctx, a: dict, query: torch.Tensor, kdt: torch.dtype, vdt: torch.dtype) -> QuantKind:
    if kdt != vdt:
        # blame the one whose dtype no call takes with this query (a float64 key beside a float16 value is the
        # key's error, not "value: expected dtype float64"); when both are possible, the value follows the key
        ok = (torch.int8, torch.float16, torch.bfloat16) if query.dtype == torch.int8 else \
            (query.dtype, torch.int8, torch.int32, FP4)
        if kdt not in ok and vdt in ok:
            raise ctx.err("key", f"dtype {dtype_name(vdt)} (the value's)", f"dtype {dtype_name(kdt)}")
        raise ctx.err("value", f"dtype {dtype_name(kdt)} (the key's)", f"dtype {dtype_name(vdt)}")
    qmode = ctx.integer("query_quant_mode", a.get("query_quant_mode", 0))
    dsq = a.get("dequant_scale_query")
    if query.dtype != torch.int8:
        if dsq is not None:
            raise ctx.err("dequant_scale_query", "None unless the query is int8", dsq)
        if qmode != 0:
            raise ctx.err("query_quant_mode", "0 unless the query is int8 with dequant_scale_query", qmode)
        for name in FULL:
            if a.get(name) is not None:
                raise ctx.err(name, f"None with a {dtype_name(query.dtype)} query (full int8 quantization needs "
                              "int8 query, key and value)", a[name])
        if kdt == query.dtype:
            for name in COMBINED + SEPARATE:
                if a.get(name) is not None:
                    raise ctx.err(name, f"None with {dtype_name(kdt)} key/value (dequantization parameters need "
                                  "int8/int4 key and value)", a[name])
            return QuantKind(None, False, False)
        if kdt == torch.int8:
            return QuantKind("int8", False, False)
        if kdt == torch.int32:
            return QuantKind("int4", False, False)
        if kdt == FP4:
            return QuantKind("fp4", False, False)
        # SPEC 14b.6 F9: FLOAT16, BFLOAT16, INT8, INT4 (INT32) and FP4 only (float8 K/V included: 10b.2)
        raise ctx.err("key", f"dtype {dtype_name(query.dtype)} (the query's), int8, int32 (packed int4) or "
                      "float4_e2m1fn_x2 (FP4 E2M1, antiquant mode 6)", f"dtype {dtype_name(kdt)}")
    # int8 query
    if dsq is not None:
        if qmode != 3:
            raise ctx.err("query_quant_mode", "3 (per-token per-head) with dequant_scale_query", qmode)
        for name in FULL:
            if a.get(name) is not None:
                raise ctx.err(name, "None with dequant_scale_query (query dequantization path)", a[name])
        if kdt in (torch.float16, torch.bfloat16):
            return QuantKind(None, False, True)
        if kdt == torch.int8:
            return QuantKind("int8", False, True)
        raise ctx.err("key", "dtype float16, bfloat16 or int8 with an int8 query and dequant_scale_query",
                      f"dtype {dtype_name(kdt)}")
    if qmode != 0:
        raise ctx.err("dequant_scale_query", f"a float32 (B, Q_N, Q_S) tensor with query_quant_mode {qmode}", "None")
    if ctx.api.endswith("_v2"):         # full int8 is not reachable through the v2 names (SPEC 1.1b)
        raise ctx.err("dequant_scale_query", "a float32 (B, Q_N, Q_S) tensor with query_quant_mode 3 for an int8 "
                      "query (full int8 quantization with dequant_scale1 / quant_scale1 / dequant_scale2 is only "
                      "reachable through npu_fused_infer_attention_score)", "None")
    if kdt != torch.int8:
        raise ctx.err("key", "dtype int8 with an int8 query (full quantization)", f"dtype {dtype_name(kdt)}")
    for name in COMBINED + SEPARATE:
        if a.get(name) is not None:
            raise ctx.err(name, "None with an int8 query (full quantization uses dequant_scale1/quant_scale1/"
                          "dequant_scale2)", a[name])
    return QuantKind(None, True, False)


# ---------------------------------------------------------------------------------------------- scalars
def _per_tensor_float(ctx: Ctx, name: str, t, *, uint64_ok: bool) -> float:
    t = ctx.tensor(name, t)
    if t is None:
        raise ctx.err(name, "a per-tensor scale (dequant_scale1, quant_scale1 and dequant_scale2 are all "
                      "required for full int8 quantization)", "None")
    allowed = (torch.float32, torch.int64, torch.uint64) if uint64_ok else (torch.float32,)
    if t.dtype not in allowed:
        raise ctx.err(name, "dtype float32" + (" or int64 (the UINT64 bit-pattern form)" if uint64_ok else ""),
                      f"dtype {dtype_name(t.dtype)}")
    if t.numel() != 1:
        raise ctx.err(name, "a per-tensor scale with one element", t)
    v = ctx.host(name, t).reshape(-1)[0].item()
    if t.dtype in (torch.int64, torch.uint64):   # low 32 bits hold the float32 bit pattern
        v = struct.unpack("<f", struct.pack("<I", int(v) & 0xFFFFFFFF))[0]
    return float(v)


def full_quant(ctx: Ctx, a: dict, *, decode: bool) -> FullQuant:
    if decode:
        raise ctx.err("query", "float16/bfloat16 for decode (Q_S = 1): int8 query, key and value are "
                      "prefill only", "an int8 query with Q_S = 1")
    return FullQuant(_per_tensor_float(ctx, "dequant_scale1", a.get("dequant_scale1"), uint64_ok=True),
                     _per_tensor_float(ctx, "quant_scale1", a.get("quant_scale1"), uint64_ok=False),
                     _per_tensor_float(ctx, "dequant_scale2", a.get("dequant_scale2"), uint64_ok=True))


def query_dequant(ctx: Ctx, a: dict, b: int, n: int, q_s: int, inp: str = "BNSD",
                  q_off: Optional[tuple] = None) -> QueryDequant:
    """The (B, Q_N, Q_S) view of dequant_scale_query. Accepted shapes (SPEC 11, 10b.3): (B, Q_N, Q_S) for every
    padded layout (read that way when both match: Q_S = Q_N; for Q_S = 1 they are the same numbers); token-major
    as clients pass it: (B, Q_S, Q_N) for BSH / BSND queries, (T, Q_N) or (T, Q_N, 1) for TND / NTD queries (q_off: the cumulative query offsets; gathered per batch
    into (B, Q_N, Q_S), a small copy)."""
    t = ctx.tensor("dequant_scale_query", a.get("dequant_scale_query"))
    if t.dtype != torch.float32:
        raise ctx.err("dequant_scale_query", "dtype float32", f"dtype {dtype_name(t.dtype)}")
    if q_off is not None:                              # packed: (T, Q_N) / (T, Q_N, 1), token-major
        T = q_off[-1]
        if t.dim() in (2, 3) and t.shape[0] >= T and t.shape[1] == n and (t.dim() == 2 or t.shape[2] == 1):
            tm = t.reshape(t.shape[0], n)
            idx = (torch.tensor(q_off[:-1], dtype=torch.long)[:, None] + torch.arange(q_s)).clamp_(
                max=max(t.shape[0] - 1, 0)).to(t.device)                          # [B, Q_S]
            return QueryDequant(tm[idx].permute(0, 2, 1) if t.shape[0] else t.new_zeros((b, n, q_s)))
    if t.dim() == 3 and t.shape[0] == b:
        if t.shape[1] == n and t.shape[2] >= q_s:
            return QueryDequant(t)
        if inp in ("BSH", "BSND") and t.shape[2] == n and t.shape[1] >= q_s:
            return QueryDequant(t.permute(0, 2, 1))   # (B, Q_S, Q_N) token-major -> (B, Q_N, Q_S) view
    exp = f"shape (B, Q_N, Q_S) = ({b}, {n}, {q_s})"
    if q_off is not None:
        exp += f" or (T, Q_N) / (T, Q_N, 1) = ({q_off[-1]}, {n}) for {inp} (token-major)"
    elif inp in ("BSH", "BSND"):
        exp += f" or (B, Q_S, Q_N) = ({b}, {q_s}, {n}) (token-major)"
    raise ctx.err("dequant_scale_query", exp, t)


# ---------------------------------------------------------------------------------------------- KV dequant
@dataclass(frozen=True)
class KVExtent:
    b: int
    kv_n: int
    d: int                     # real (unpacked) head dim of the key
    dv: int                    # real head dim of the value
    tokens: int                # positions a per-token scale must cover (KV_S, or max_blocks * block_size)
    paged_blocks: Optional[tuple]  # (blocknum, block_size) when paged


def _param_dtype(ctx: Ctx, name: str, t: torch.Tensor, gran: str, q_dtype: torch.dtype) -> None:
    if gran in ("token", "token_head", "block_token", "block_token_head"):
        if t.dtype != torch.float32:
            raise ctx.err(name, "dtype float32 for per-token dequantization", f"dtype {dtype_name(t.dtype)}")
    elif t.dtype not in (q_dtype, torch.float32):
        raise ctx.err(name, f"dtype {dtype_name(q_dtype)} (the query's) for per-tensor/per-channel/per-head "
                      "dequantization", f"dtype {dtype_name(t.dtype)}")


def _normalize(ctx: Ctx, name: str, t: torch.Tensor, gran: Optional[str], e: KVExtent, d: int, lead: tuple):
    """Match t against the accepted shapes of its granularity; return (granularity, normalized view).

    lead: () for separate parameters, (2,) for combined ones (then the result keeps the leading 2).
    gran None: mode 0 (per-tensor or per-channel, decided by the shape)."""
    s = tuple(t.shape)
    core = s[len(lead):] if s[:len(lead)] == lead else None
    kv_n, h = e.kv_n, e.kv_n * d
    if core is not None:
        if gran is None:
            if core in ((1,), ()) or (lead and core == ()):
                return "tensor", t.reshape(*lead, 1)
            if core in ((1, kv_n, 1, d), (1, kv_n, d), (1, h), (kv_n, d), (kv_n, 1, d), (h,)):
                return "channel", t.reshape(*lead, kv_n, d)
        elif gran == "head":
            if core == (kv_n,):
                return gran, t
        elif gran == "token":
            if len(core) in (2, 3) and (len(core) == 2 or core[0] == 1) and core[-2] in (1, e.b) \
                    and core[-1] >= e.tokens:
                return gran, t.reshape(*lead, core[-2], core[-1])
        elif gran == "token_head":
            if len(core) == 3 and core[0] in (1, e.b) and core[1] == kv_n and core[2] >= e.tokens:
                return gran, t
        elif gran == "block_token" and e.paged_blocks:
            if core == e.paged_blocks:
                return gran, t
        elif gran == "block_token_head" and e.paged_blocks:
            if core == (e.paged_blocks[0], kv_n, e.paged_blocks[1]):
                return gran, t
    exp = {
        None: f"per-tensor (1,) or per-channel (1, KV_N, 1, D), (1, KV_N, D), (1, H), (KV_N, D), (KV_N, 1, D), "
              f"(H,) with KV_N = {kv_n}, D = {d}",
        "head": f"(KV_N,) = ({kv_n},)",
        "token": f"(1, B, KV_S) or (B, KV_S) with B = {e.b}{'' if e.b == 1 else ' (or 1)'} and KV_S >= {e.tokens}",
        "token_head": f"(B or 1, KV_N, KV_S) with B = {e.b}, KV_N = {kv_n}, KV_S >= {e.tokens}",
        "block_token": f"(blocknum, block_size) = {e.paged_blocks} (needs block_table)",
        "block_token_head": "(blocknum, KV_N, block_size) = " + (f"({e.paged_blocks[0]}, {kv_n}, "
                            f"{e.paged_blocks[1]})" if e.paged_blocks else "(needs block_table)"),
    }[gran]
    if lead:
        exp = f"a leading axis of 2 (key, value) then {exp}"
    raise ctx.err(name, exp, t)


def _offset(ctx: Ctx, name: str, off, scale_name: str, scale_raw: torch.Tensor, view_like):
    if off is None:
        return None
    off = ctx.tensor(name, off)
    if off.shape != scale_raw.shape or off.dtype != scale_raw.dtype:
        raise ctx.err(name, f"the shape and dtype of {ctx.n(scale_name)} ({tuple(scale_raw.shape)}, "
                      f"{dtype_name(scale_raw.dtype)})", off)
    return view_like(off)


def antiquant(ctx: Ctx, a: dict, kind: QuantKind, q_dtype: torch.dtype, e: KVExtent, *, decode: bool,
              q_s: int, is_list: bool, left_padded: bool, paged: bool, has_prefix: bool,
              nz: bool = False) -> AntiQuant:
    sep = any(a.get(n) is not None for n in SEPARATE)
    if sep:
        aq = _separate(ctx, a, kind, q_dtype, e, decode=decode, q_s=q_s, is_list=is_list, left_padded=left_padded,
                       paged=paged, nz=nz)
    else:
        aq = _combined(ctx, a, kind, q_dtype, e, decode=decode)
    if has_prefix and (aq.key.per_token or aq.value.per_token):      # (DECISIONS 46)
        raise ctx.err("key_shared_prefix", "None with per-token key/value dequantization (its scales cover each "
                      "batch's own tokens; the shared prefix's tokens have none)", a["key_shared_prefix"])
    if kind.kv == "int4":
        if paged:
            raise ctx.err("block_table", "None with int4 key/value (paged KV does not take int4)", a["block_table"])
        if left_padded:
            raise ctx.err("kv_padding_size", "None with int4 key/value (no left padding with int4)",
                          "an active padding size")
    return aq


def _combined(ctx: Ctx, a: dict, kind: QuantKind, q_dtype, e: KVExtent, *, decode: bool) -> AntiQuant:
    mode = ctx.integer("antiquant_mode", a.get("antiquant_mode", 0))
    sc = ctx.tensor("antiquant_scale", a.get("antiquant_scale"))
    if sc is None:
        raise ctx.err("antiquant_scale", "dequantization scales for int8/int4/FP4 key and value (antiquant_scale or "
                      "key_antiquant_scale + value_antiquant_scale)", "None")
    if kind.kv == "int4":
        raise ctx.err("antiquant_scale", "the separate key_/value_antiquant_scale parameters for int4 key/value "
                      "(int4 supports only separate modes 0, 1, 3 and key 0 + value 1)", sc)
    if mode not in (0, 1):
        raise ctx.err("antiquant_mode", "0 (per-tensor/per-channel) or 1 (per-token)", mode)
    if kind.kv == "fp4":         # SPEC 14b.6 F4 / F8: FP4 needs mode 6, which the combined set does not take
        raise ctx.err("antiquant_scale", "the separate key_/value_antiquant_scale parameters with key/value "
                      "antiquant mode 6 for FP4 key/value (the combined antiquant_mode takes only 0 and 1)", sc)
    if mode == 1 and not decode:
        raise ctx.err("antiquant_mode", "0 unless Q_S = 1 (per-token combined dequantization is decode only)", mode)
    if not decode and ctx.strict and q_dtype != torch.float16:
        raise ctx.hw("antiquant_scale", "a float16 query for combined dequantization with Q_S > 1",
                     f"a {dtype_name(q_dtype)} query")
    gran_in = None if mode == 0 else "token"
    if e.d != e.dv and gran_in is None:
        pass
    gran, view = _normalize(ctx, "antiquant_scale", sc, gran_in, e, e.d, (2,))
    _param_dtype(ctx, "antiquant_scale", sc, gran, q_dtype)
    off = _offset(ctx, "antiquant_offset", a.get("antiquant_offset"), "antiquant_scale", sc,
                  lambda t: t.reshape(view.shape))
    return AntiQuant(KVDequant(gran, view[0], None if off is None else off[0]),
                     KVDequant(gran, view[1], None if off is None else off[1]), kind.kv == "int4")


def _separate(ctx: Ctx, a: dict, kind: QuantKind, q_dtype, e: KVExtent, *, decode: bool, q_s: int,
              is_list: bool, left_padded: bool, paged: bool, nz: bool = False) -> AntiQuant:
    ks, vs = a.get("key_antiquant_scale"), a.get("value_antiquant_scale")
    ko, vo = a.get("key_antiquant_offset"), a.get("value_antiquant_offset")
    if ks is None or vs is None:
        missing = "key_antiquant_scale" if ks is None else "value_antiquant_scale"
        raise ctx.err(missing, "a tensor (key_antiquant_scale and value_antiquant_scale come together)", "None")
    if (ko is None) != (vo is None):
        missing = "key_antiquant_offset" if ko is None else "value_antiquant_offset"
        raise ctx.err(missing, "a tensor (key_antiquant_offset and value_antiquant_offset come together)", "None")
    km = ctx.integer("key_antiquant_mode", a.get("key_antiquant_mode", 0))
    vm = ctx.integer("value_antiquant_mode", a.get("value_antiquant_mode", 0))
    for name, m in (("key_antiquant_mode", km), ("value_antiquant_mode", vm)):
        if m not in _SEP_GRAN and m != MODE_FP4:
            raise ctx.err(name, "0..6", m)
    if kind.kv == "fp4" or MODE_FP4 in (km, vm):
        return _mode6(ctx, a, kind, e, km, vm, decode=decode, paged=paged)
    if km != vm and not (km == 0 and vm == 1):
        raise ctx.err("value_antiquant_mode", f"{km} like key_antiquant_mode (the only mixed pair is key 0 + "
                      "value 1)", vm)
    if kind.kv == "int4" and (km, vm) not in ((0, 0), (1, 1), (3, 3), (0, 1)):
        raise ctx.err("key_antiquant_mode", "0, 1, 3 or key 0 + value 1 for int4 key/value", f"{km}/{vm}")
    if km in (4, 5) and not paged:
        raise ctx.err("key_antiquant_mode", "0..3 without block_table (modes 4/5 store scales by paged block)", km)
    if not decode:
        if km not in (0, 1) or vm != km:
            raise ctx.err("key_antiquant_mode", "0 or 1 (equal for key and value) unless Q_S = 1", f"{km}/{vm}")
        if ctx.strict:
            if q_s > 16:
                raise ctx.hw("query", "Q_S <= 16 with separate key/value dequantization", f"Q_S = {q_s}")
            if q_dtype != torch.bfloat16:
                raise ctx.hw("query", "dtype bfloat16 with separate key/value dequantization and Q_S > 1",
                             f"dtype {dtype_name(q_dtype)}")
        for bad, what in ((is_list, "tensor-list key/value"), (left_padded, "left padding"),
                          (paged and not nz, "block_table (paged KV)")):   # NZ: SPEC 8b.2 (a), 10b.3
            if bad and ctx.strict:
                raise ctx.hw("key_antiquant_scale", f"no {what} with separate dequantization and Q_S > 1",
                             what)
    key = _one(ctx, "key", ks, ko, _SEP_GRAN[km], q_dtype, e, e.d)
    value = _one(ctx, "value", vs, vo, _SEP_GRAN[vm], q_dtype, e, e.dv)
    if km == vm and ks.shape != vs.shape:
        raise ctx.err("value_antiquant_scale", f"the shape of key_antiquant_scale {tuple(ks.shape)}", vs)
    if (km, vm) == (0, 1) and kind.kv == "int8" and ctx.strict and q_dtype != torch.float16:
        raise ctx.hw("query", "dtype float16 for key per-channel + value per-token with int8 key/value",
                     f"dtype {dtype_name(q_dtype)}")
    return AntiQuant(key, value, kind.kv == "int4")


def _mode6(ctx: Ctx, a: dict, kind: QuantKind, e: KVExtent, km: int, vm: int, *, decode: bool,
           paged: bool) -> AntiQuant:
    """Antiquant mode 6 (SPEC 10b.1): FP4 E2M1 key/value, per-token-group FLOAT8_E8M0 scales
    (1, B, KV_N, S, D/32) or (B, KV_N, S, D/32), no offsets, decode only; the strict rules F1-F8 (SPEC 14b.6)."""
    fp4 = kind.kv == "fp4"
    if fp4 and km != MODE_FP4:      # F4: per-tensor / per-channel / per-token modes are INT8 / INT4 only
        raise ctx.err("key_antiquant_mode", "6 (per-token-group FLOAT8_E8M0 scales) with FP4 (float4_e2m1fn_x2) "
                      "key/value", km)
    if km != vm:                    # F5
        raise ctx.err("value_antiquant_mode", f"{km} like key_antiquant_mode (mode 6 pairs only with mode 6)", vm)
    if not decode:                  # F6
        raise ctx.err("query", "Q_S = 1 with antiquant mode 6 (per-token-group dequantization is decode only)",
                      "Q_S > 1")
    for which in ("key", "value"):  # F3
        sc = ctx.tensor(f"{which}_antiquant_scale", a[f"{which}_antiquant_scale"])
        if sc.dtype != E8M0:
            raise ctx.err(f"{which}_antiquant_scale", "dtype float8_e8m0fnu (FLOAT8_E8M0) with antiquant mode 6",
                          f"dtype {dtype_name(sc.dtype)}")
    for which in ("key", "value"):  # F2
        off = a.get(f"{which}_antiquant_offset")
        if off is not None:
            raise ctx.err(f"{which}_antiquant_offset", "None with antiquant mode 6 (no offset)", off)
    if not fp4:                     # F1
        raise ctx.err("key", "dtype float4_e2m1fn_x2 (FP4 E2M1) key/value with antiquant mode 6",
                      f"dtype {dtype_name(a['key'][0].dtype if isinstance(a['key'], (list, tuple)) else a['key'].dtype)}")
    if a.get("quant_scale2") is not None:
        raise ctx.err("quant_scale2", "None with FP4 key/value (antiquant mode 6: the output has the query dtype)",
                      a["quant_scale2"])
    views = []
    for which, d in (("key", e.d), ("value", e.dv)):
        if d % FP4_GROUP:
            raise ctx.err(which, f"a head dim D divisible by {FP4_GROUP} with FP4 key/value (one FLOAT8_E8M0 scale per "
                          f"{FP4_GROUP} channels)", f"D = {d}")
        if ctx.strict and d % 64:
            raise ctx.hw(which, "a head dim D % 64 == 0 with FP4 key/value", f"D = {d}")
        name = f"{which}_antiquant_scale"
        sc = a[name]
        core = tuple(sc.shape[1:]) if sc.dim() == 5 and sc.shape[0] == 1 else tuple(sc.shape)
        if len(core) != 4 or core[0] != e.b or core[1] != e.kv_n or core[2] < e.tokens or core[3] != d // FP4_GROUP:
            what = "block_table.shape[1] x block_size" if paged else "KV_S"
            raise ctx.err(name, f"shape (1, B, KV_N, S, D/32) or (B, KV_N, S, D/32) with B = {e.b}, KV_N = {e.kv_n}, "
                          f"S >= {what} = {e.tokens}, D/32 = {d // FP4_GROUP}", sc)
        views.append(sc.reshape(core))
    if paged and ctx.strict and e.paged_blocks[1] % 64:
        raise ctx.hw("block_size", "a multiple of 64 with FP4 key/value", e.paged_blocks[1])
    return AntiQuant(KVDequant("token_group", views[0]), KVDequant("token_group", views[1]))


def _one(ctx: Ctx, which: str, sc, off, gran, q_dtype, e: KVExtent, d: int) -> KVDequant:
    sname, oname = f"{which}_antiquant_scale", f"{which}_antiquant_offset"
    sc = ctx.tensor(sname, sc)
    g, view = _normalize(ctx, sname, sc, gran, e, d, ())
    _param_dtype(ctx, sname, sc, g, q_dtype)
    o = _offset(ctx, oname, off, sname, sc, lambda t: t.reshape(view.shape))
    return KVDequant(g, view, o)


# ---------------------------------------------------------------------------------------------- output
def output_quant(ctx: Ctx, a: dict, *, q_dtype, n: int, dv: int, out_layout: str, int4: bool,
                 left_padded: bool, mask: MaskSpec, geometry) -> Optional[OutputQuant]:
    qs, qo = a.get("quant_scale2"), a.get("quant_offset2")
    if qs is None:
        if qo is not None:
            raise ctx.err("quant_scale2", f"a tensor when {ctx.n('quant_offset2')} is given", "None")
        return None
    qs = ctx.tensor("quant_scale2", qs)
    if int4:
        raise ctx.err("quant_scale2", "None with int4 key/value (no output quantization with int4)", qs)
    allowed = (torch.float32, torch.bfloat16) if q_dtype == torch.bfloat16 else (torch.float32,)
    if qs.dtype not in allowed:
        raise ctx.err("quant_scale2", "dtype " + " or ".join(dtype_name(d) for d in allowed) +
                      " (bfloat16 only with a bfloat16 query)", f"dtype {dtype_name(qs.dtype)}")
    if qs.numel() == 1 and n * dv != 1:
        view = qs.reshape(1)
    elif qs.numel() == n * dv:
        view = qs.reshape(n, dv)
    else:
        what = "H" if out_layout == "BSH" else "N*D"
        raise ctx.err("quant_scale2", f"per-tensor (1,) or per-channel with product of dims = {what} = {n * dv}",
                      qs)
    off = None
    if qo is not None:
        qo = ctx.tensor("quant_offset2", qo)
        if qo.shape != qs.shape or qo.dtype != qs.dtype:
            raise ctx.err("quant_offset2", f"the shape and dtype of quant_scale2 ({tuple(qs.shape)}, "
                          f"{dtype_name(qs.dtype)})", qo)
        off = qo.reshape(view.shape)
    if view.dim() == 2 and left_padded:
        raise ctx.err("quant_scale2", "per-tensor with left padding (per-channel output quantization does not "
                      "support left padding)", qs)
    if mask.kind == "band" and mask.sparse_mode == 4 and (mask.pre < 0 or mask.next < 0):
        raise ctx.err("pre_tokens" if mask.pre < 0 else "next_tokens",
                      "non-negative pre_tokens/next_tokens with sparse_mode 4 and int8 output",
                      f"pre_tokens = {mask.pre}, next_tokens = {mask.next}")
    if off is not None and mask.kind == "band":
        for i, g in enumerate(geometry):
            s1, s2 = g.s1, g.s2
            m = mask.sparse_mode
            bad = ((m == 0 and (s1 - s2 - mask.pre > 0 or mask.next < 0)) or (m == 3 and s2 - s1 < 0) or
                   (m == 4 and (mask.pre < 0 or mask.next + s2 - s1 < 0)))
            if bad:
                raise ctx.err("quant_offset2", f"None when the band leaves rows without keys (batch {i}: "
                              f"S1 = {s1}, S2 = {s2}, sparse_mode {m}, pre_tokens {mask.pre}, next_tokens "
                              f"{mask.next})", qo, "quantize outside FIA in this case")
    return OutputQuant(view, off)
