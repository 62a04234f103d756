"""Dtypes, ranks, heads and dims of query / key / value; dense, packed and tensor-list KV (SPEC 2, 8)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..problem.layout import LAYOUTS, Layout, heads_dim, seq_dim, to_canonical
from ..problem.attention import DenseKV, ListKV, PackedKV
from .context import Ctx, describe, dtype_name

FLOAT_STRICT = (torch.float16, torch.bfloat16)
FLOAT_PORTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

MAX_B, MAX_N, MAX_D, MAX_G, MAX_LIST_B = 65536, 256, 512, 64, 256


def parse_layout(ctx: Ctx, s) -> Layout:
    if not isinstance(s, str) or s not in LAYOUTS:
        raise ctx.err("input_layout", "one of " + ", ".join(LAYOUTS), describe(s))
    return LAYOUTS[s]


def query_dtype(ctx: Ctx, q: torch.Tensor) -> None:
    if q.dtype in FLOAT_STRICT or q.dtype == torch.int8:
        return   # int8: full quantization, checked with the quant arguments
    if q.dtype in FLOAT_PORTABLE:
        e = ctx.hw("query", "dtype float16, bfloat16 or int8", f"dtype {dtype_name(q.dtype)}")
        if e:
            raise e
        return
    allowed = "float16, bfloat16 or int8" + (" (float32/float64 in portable mode)" if ctx.strict else
                                              ", float32, float64")
    raise ctx.err("query", f"dtype {allowed}", f"dtype {dtype_name(q.dtype)}")


@dataclass(frozen=True)
class QueryDims:
    B: int            # -1 for packed layouts (the lengths list decides)
    N: int
    KV_N: int
    S: int            # padded Q_S; packed: T
    D: int


def kv_arg(ctx: Ctx, name: str, x):
    """key/value: a tensor, or a list/tuple of tensors (tensor-list KV). Returns tensor | tuple."""
    if x is None:
        raise ctx.err(name, "a tensor or a list of tensors", "None", status=161001)
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)):
        if len(x) == 0:
            raise ctx.err(name, "a non-empty list of tensors", "an empty list")
        for i, t in enumerate(x):
            if not isinstance(t, torch.Tensor):
                raise ctx.err(name, "a list of torch.Tensor", f"element {i} = {type(t).__name__}")
        return tuple(x)
    raise ctx.err(name, "a torch.Tensor or a list of tensors", describe(x))


def heads_and_dim(ctx: Ctx, layout: Layout, t: torch.Tensor, heads: int, name: str, heads_arg: str):
    """(N, D) of a tensor in the input layout, checked against the head count argument."""
    hd = heads_dim(layout.inp)
    if hd is None:  # BSH: H = N * D
        h = t.shape[2]
        if heads <= 0 or h % heads:
            raise ctx.err(heads_arg, f"a positive divisor of {name}'s H = {h}", heads)
        return heads, h // heads
    n = t.shape[hd]
    if n != heads:
        raise ctx.err(heads_arg, f"{n} (the N axis of {name} in layout {layout.name})", heads)
    return n, t.shape[-1]


def query_dims(ctx: Ctx, layout: Layout, query: torch.Tensor, num_heads, num_kv_heads) -> QueryDims:
    num_heads = ctx.integer("num_heads", num_heads)
    num_kv_heads = ctx.integer("num_key_value_heads", num_kv_heads)
    if query.dim() != layout.rank:
        raise ctx.err("query", f"a {layout.rank}-D tensor for input_layout {layout.name}", query)
    if num_heads <= 0:
        raise ctx.err("num_heads", "a positive integer", num_heads)
    if num_kv_heads < 0:
        raise ctx.err("num_key_value_heads", "0 (same as num_heads) or a positive integer", num_kv_heads)
    kv_n = num_kv_heads or num_heads
    n, d = heads_and_dim(ctx, layout, query, num_heads, "query", "num_heads")
    if n % kv_n:
        raise ctx.err("num_key_value_heads", f"a divisor of num_heads = {n}", num_kv_heads)
    # G <= 64, except absorbed MLA (D = 512, one KV head: the documents list 32/64/128 query heads)
    if ctx.strict and n // kv_n > MAX_G and not (d == 512 and kv_n == 1):
        raise ctx.hw("num_key_value_heads", f"num_heads / num_key_value_heads <= {MAX_G}", f"{n} / {kv_n}")
    if ctx.strict and n > MAX_N:
        raise ctx.hw("num_heads", f"at most {MAX_N} query heads", n)
    if ctx.strict and d > MAX_D:
        raise ctx.hw("query", f"head dim D <= {MAX_D}", f"D = {d}")
    b = -1 if layout.packed else query.shape[0]
    if ctx.strict and b > MAX_B:
        raise ctx.hw("query", f"batch B <= {MAX_B}", f"B = {b}")
    return QueryDims(b, n, kv_n, query.shape[seq_dim(layout.inp)], d)


def value_dim(ctx: Ctx, layout: Layout, value: torch.Tensor, kv_n: int, name: str = "value") -> int:
    if layout.inp == "BSH":
        if value.shape[2] % kv_n:
            raise ctx.err(name, f"H divisible by num_key_value_heads = {kv_n}", value)
        return value.shape[2] // kv_n
    if value.shape[heads_dim(layout.inp)] != kv_n:
        raise ctx.err(name, f"{kv_n} heads (num_key_value_heads)", value)
    return value.shape[-1]


def _bsh_hint(ctx: Ctx, layout: Layout, qd: QueryDims) -> Optional[str]:
    """BSH derives D from H and the head counts: say so when a D disagrees (a wrong head count is the usual cause)."""
    if layout.inp != "BSH":
        return None
    return (f"BSH: the query's D = H / {ctx.n('num_heads')} = {qd.N * qd.D} / {qd.N}, the key's D = H / "
            f"{ctx.n('num_key_value_heads')} (0 = {ctx.n('num_heads')}) = H / {qd.KV_N}")


def dense_kv(ctx: Ctx, layout: Layout, qd: QueryDims, key: torch.Tensor, value: torch.Tensor,
             key_rope: Optional[torch.Tensor], *, allow_dv_differs: bool, pack: int = 1):
    """Dense / packed KV. Returns (storage, real Dv, per-batch physical KV lengths or None for packed).

    pack: 8 for int4 packed in int32 (stored last dim = real / 8), 2 for FP4 (two values a byte)."""
    kv_n, d = qd.KV_N, qd.D
    for name, t in (("key", key), ("value", value)):
        if t.dim() != layout.rank:
            raise ctx.err(name, f"a {layout.rank}-D tensor for input_layout {layout.name}", t)
    _, kd = heads_and_dim(ctx, layout, key, kv_n, "key", "num_key_value_heads")
    if kd * pack != d:
        raise ctx.err("key", f"head dim D = {d // pack} (the query's D = {d}" + (f" / {pack} for {'int4' if pack == 8 else 'FP4'})" if pack > 1 else ")"),
                      f"D = {kd} ({tuple(key.shape)})", _bsh_hint(ctx, layout, qd))
    vd = value_dim(ctx, layout, value, kv_n) * pack
    if key.shape[:-1] != value.shape[:-1] or (vd != d and not allow_dv_differs) \
            or (layout.inp == "BSH" and value.shape[2] % kv_n):
        raise ctx.err("value", f"the shape of key {tuple(key.shape)}", value)
    krc = None
    if key_rope is not None:
        if key_rope.dim() != layout.rank or key_rope.shape[:-1] != key.shape[:-1]:
            raise ctx.err("key_rope", f"the shape of key {tuple(key.shape)} except the last dim", key_rope)
        if layout.inp == "BSH" and key_rope.shape[2] % kv_n:
            # checked before the canonical view: unflatten would raise a RuntimeError on an indivisible H
            raise ctx.err("key_rope", f"H divisible by num_key_value_heads = {kv_n}", key_rope)
        krc = to_canonical(key_rope, layout.inp, kv_n)
    kc, vc = to_canonical(key, layout.inp, kv_n), to_canonical(value, layout.inp, kv_n)
    if layout.packed:
        return PackedKV(kc, vc, krc), vd, None
    if key.shape[0] != qd.B:
        raise ctx.err("key", f"batch {qd.B} (the query's)", key)
    return DenseKV(kc, vc, krc), vd, (key.shape[seq_dim(layout.inp)],) * qd.B


def list_kv(ctx: Ctx, layout: Layout, qd: QueryDims, keys: tuple, values: tuple, key_rope, pack: int = 1):
    """Tensor-list KV: B tensors with batch 1 and individual S. Returns (storage, Dv, per-batch lengths)."""
    if layout.packed:
        raise ctx.err("key", "a tensor (tensor-list KV is not available with TND layouts)", keys)
    if key_rope is not None:
        raise ctx.err("key_rope", "None with tensor-list key/value (MLA does not support tensor lists)", key_rope)
    b = qd.B
    if len(keys) != b:
        raise ctx.err("key", f"a list of B = {b} tensors (one per batch)", f"{len(keys)} tensors")
    if len(values) != len(keys):
        raise ctx.err("value", f"a list of {len(keys)} tensors like key", f"{len(values)} tensors")
    if ctx.strict and b > MAX_LIST_B:
        raise ctx.hw("key", f"at most {MAX_LIST_B} tensors in a tensor list", len(keys))
    sd = seq_dim(layout.inp)
    ks, vs, lens = [], [], []
    ref = [d for j, d in enumerate(keys[0].shape) if j != sd]
    for i, (k, v) in enumerate(zip(keys, values)):
        for name, t in (("key", k), ("value", v)):
            if t.dim() != layout.rank or t.shape[0] != 1:
                raise ctx.err(name, f"list element {i} of rank {layout.rank} with batch 1", t)
        if [d for j, d in enumerate(k.shape) if j != sd] != ref:
            raise ctx.err("key", f"identical N and D in every list element (element 0: {tuple(keys[0].shape)})",
                          f"element {i}: {tuple(k.shape)}")
        if k.dtype != keys[0].dtype or v.dtype != values[0].dtype:
            raise ctx.err("key" if k.dtype != keys[0].dtype else "value",
                          "the same dtype in every list element", f"element {i}: {k.dtype}/{v.dtype}")
        _, kd = heads_and_dim(ctx, layout, k, qd.KV_N, "key", "num_key_value_heads")
        if kd * pack != qd.D:
            raise ctx.err("key", f"head dim D = {qd.D // pack} in every list element (the query's D = {qd.D}" +
                          ((" / 8: int32 key/value hold packed int4)" if pack == 8 else f" / {pack}: FP4 key/value hold two values a byte)")
                           if pack > 1 else ")"), f"element {i}: D = {kd}",
                          _bsh_hint(ctx, layout, qd))
        if k.shape != v.shape:
            raise ctx.err("value", f"element {i} shaped like key {tuple(k.shape)}", v)
        ks.append(to_canonical(k, layout.inp, qd.KV_N)[0])
        vs.append(to_canonical(v, layout.inp, qd.KV_N)[0])
        lens.append(k.shape[sd])
    return ListKV(tuple(ks), tuple(vs)), vs[0].shape[-1] * pack, tuple(lens)


def split_list(layout: Layout, query: torch.Tensor, key, value):
    """A one-element list holding every batch is a dense tensor."""
    if isinstance(key, tuple) and isinstance(value, tuple) and len(key) == 1 and len(value) == 1 \
            and not layout.packed and key[0].dim() == layout.rank and query.dim() == layout.rank \
            and key[0].shape[0] == query.shape[0] and query.shape[0] != 1:
        return key[0], value[0]
    return key, value


def same_kind(ctx: Ctx, key, value) -> None:
    if isinstance(key, tuple) != isinstance(value, tuple):
        raise ctx.err("value", "the same kind as key (both tensors or both lists)",
                      "a list" if isinstance(value, tuple) else "a tensor")


def raw_kv_dtypes(key, value) -> Tuple[torch.dtype, torch.dtype]:
    """dtypes of key/value as passed (tensor or list of tensors)."""
    k = key[0] if isinstance(key, tuple) else key
    v = value[0] if isinstance(value, tuple) else value
    return k.dtype, v.dtype
