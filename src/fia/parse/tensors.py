"""Dtypes, ranks, heads and dims of query / key / value; KV storage (dense, packed, tensor list)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..spec.layout import LAYOUTS, Layout, heads_dim, seq_dim, to_canonical
from ..spec.problem import DenseKV, ListKV, PackedKV
from .context import Ctx, dtype_name

FLOAT_STRICT = (torch.float16, torch.bfloat16)
FLOAT_PORTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

MAX_B, MAX_N, MAX_D, MAX_G, MAX_LIST_B = 65536, 256, 512, 64, 256


def parse_layout(ctx: Ctx, s) -> Layout:
    if not isinstance(s, str) or s not in LAYOUTS:
        raise ctx.err("input_layout", "one of " + ", ".join(LAYOUTS), s)
    return LAYOUTS[s]


def query_dtype(ctx: Ctx, q: torch.Tensor) -> None:
    if q.dtype in FLOAT_STRICT:
        return
    if q.dtype in FLOAT_PORTABLE:
        e = ctx.hw("query", "dtype float16 or bfloat16", f"dtype {dtype_name(q.dtype)}")
        if e:
            raise e
        return
    if q.dtype == torch.int8:
        return  # full quantization; checked with the quant arguments
    allowed = "float16, bfloat16 or int8" + (" (float32/float64 in portable mode)" if ctx.strict else ", float32, float64")
    raise ctx.err("query", f"dtype {allowed}", f"dtype {dtype_name(q.dtype)}")


@dataclass(frozen=True)
class Dims:
    B: int
    N: int
    KV_N: int
    Q_S: int          # padded query length; packed: T
    D: int
    Dv: int


def _kv_tensors(ctx: Ctx, name: str, x):
    """key/value: a tensor, or a list/tuple of tensors (tensor-list KV). Returns (tensor | tuple)."""
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
    raise ctx.err(name, "a torch.Tensor or a list of tensors", x)


def _heads_and_dim(ctx: Ctx, layout: Layout, t: torch.Tensor, heads: int, name: str, heads_arg: str):
    """(N, D) of a tensor in the input layout, checked against the head count argument."""
    inp = layout.inp
    hd = heads_dim(inp)
    if hd is None:  # BSH: H = N * D
        h = t.shape[2]
        if heads <= 0 or h % heads:
            raise ctx.err(heads_arg, f"a positive divisor of {name}'s H = {h}", heads)
        return heads, h // heads
    n = t.shape[hd]
    if n != heads:
        raise ctx.err(heads_arg, f"{n} (the N axis of {name} in layout {layout.name})", heads)
    return n, t.shape[-1]


def parse_qkv(ctx: Ctx, layout: Layout, query: torch.Tensor, key, value, num_heads, num_kv_heads,
              *, allow_dv_differs: bool):
    """Validate shapes/heads; return (Dims, canonical query, kv storage, per-batch physical kv lengths)."""
    key = _kv_tensors(ctx, "key", key)
    value = _kv_tensors(ctx, "value", value)
    num_heads = ctx.integer("num_heads", num_heads)
    num_kv_heads = ctx.integer("num_key_value_heads", num_kv_heads)
    if query.dim() != layout.rank:
        raise ctx.err("query", f"a {layout.rank}-D tensor for input_layout {layout.name}", query)
    if num_heads <= 0:
        raise ctx.err("num_heads", "a positive integer", num_heads)
    if num_kv_heads < 0:
        raise ctx.err("num_key_value_heads", "0 (same as num_heads) or a positive integer", num_kv_heads)
    kv_n = num_kv_heads or num_heads
    n, d = _heads_and_dim(ctx, layout, query, num_heads, "query", "num_heads")
    if n % kv_n:
        raise ctx.err("num_key_value_heads", f"a divisor of num_heads = {n}", num_kv_heads)
    if ctx.strict and n // kv_n > MAX_G:
        raise ctx.hw("num_key_value_heads", f"num_heads / num_key_value_heads <= {MAX_G}", f"{n} / {kv_n}")
    if ctx.strict and n > MAX_N:
        raise ctx.hw("num_heads", f"at most {MAX_N} query heads", n)
    if ctx.strict and d > MAX_D:
        raise ctx.hw("query", f"head dim D <= {MAX_D}", f"D = {d}")

    is_list = isinstance(key, tuple) or isinstance(value, tuple)
    if is_list:
        if not (isinstance(key, tuple) and isinstance(value, tuple)):
            raise ctx.err("value" if isinstance(key, tuple) else "key",
                          "the same kind as the other of key/value (both tensors or both lists)",
                          "a tensor" if isinstance(key, tuple) else "a list")
        if len(key) != len(value):
            raise ctx.err("value", f"a list of {len(key)} tensors like key", f"{len(value)} tensors")
        if len(key) == 1 and not layout.packed and key[0].dim() == layout.rank \
                and key[0].shape[0] == query.shape[0]:
            key, value, is_list = key[0], value[0], False  # one tensor holding every batch: dense
    qc = to_canonical(query, layout.inp, n)
    if is_list:
        return _parse_list(ctx, layout, query, qc, key, value, n, kv_n, d, num_kv_heads, allow_dv_differs)

    for name, t in (("key", key), ("value", value)):
        if t.dim() != layout.rank:
            raise ctx.err(name, f"a {layout.rank}-D tensor for input_layout {layout.name}", t)
    kn, kd = _heads_and_dim(ctx, layout, key, kv_n, "key", "num_key_value_heads")
    if kd != d:
        raise ctx.err("key", f"head dim D = {d} (the query's)", f"D = {kd} ({tuple(key.shape)})")
    if layout.inp == "BSH":
        if value.shape[2] % kv_n:
            raise ctx.err("value", f"H divisible by num_key_value_heads = {kv_n}", value)
        vd = value.shape[2] // kv_n
    else:
        vn = value.shape[heads_dim(layout.inp)]
        if vn != kv_n:
            raise ctx.err("value", f"{kv_n} heads like key", value)
        vd = value.shape[-1]
    if key.shape[:-1] != value.shape[:-1] or (vd != d and not allow_dv_differs):
        raise ctx.err("value", f"the shape of key {tuple(key.shape)}", value)
    sd = seq_dim(layout.inp)
    if layout.packed:
        dims = Dims(B=-1, N=n, KV_N=kv_n, Q_S=query.shape[sd], D=d, Dv=vd)
        kv = PackedKV(to_canonical(key, layout.inp, kv_n), to_canonical(value, layout.inp, kv_n))
        return dims, qc, kv, None
    b = query.shape[0]
    if key.shape[0] != b:
        raise ctx.err("key", f"batch {b} (the query's)", key)
    if ctx.strict and b > MAX_B:
        raise ctx.hw("query", f"batch B <= {MAX_B}", f"B = {b}")
    dims = Dims(B=b, N=n, KV_N=kv_n, Q_S=query.shape[sd], D=d, Dv=vd)
    kv = DenseKV(to_canonical(key, layout.inp, kv_n), to_canonical(value, layout.inp, kv_n))
    return dims, qc, kv, (key.shape[sd],) * b


def _parse_list(ctx, layout, query, qc, keys, values, n, kv_n, d, num_kv_heads, allow_dv_differs):
    if layout.packed:
        raise ctx.err("key", "a tensor (tensor-list KV is not available with TND layouts)", keys)
    b = query.shape[0]
    if len(keys) != b:
        raise ctx.err("key", f"a list of B = {b} tensors (one per batch)", f"{len(keys)} tensors")
    if ctx.strict and b > MAX_LIST_B:
        raise ctx.hw("key", f"at most {MAX_LIST_B} tensors in a tensor list", len(keys))
    sd = seq_dim(layout.inp)
    ks, vs, lens = [], [], []
    vd = None
    for i, (k, v) in enumerate(zip(keys, values)):
        for name, t in (("key", k), ("value", v)):
            if t.dim() != layout.rank or t.shape[0] != 1:
                raise ctx.err(name, f"list element {i} of rank {layout.rank} with batch 1", t)
        if k.dtype != keys[0].dtype or v.dtype != values[0].dtype:
            raise ctx.err("key" if k.dtype != keys[0].dtype else "value",
                          "the same dtype in every list element", f"element {i}: {k.dtype}/{v.dtype}")
        _, kd = _heads_and_dim(ctx, layout, k, kv_n, "key", "num_key_value_heads")
        if kd != d:
            raise ctx.err("key", f"head dim D = {d} in every list element", f"element {i}: D = {kd}")
        if k.shape != v.shape:
            raise ctx.err("value", f"element {i} shaped like key {tuple(k.shape)}", v)
        ks.append(to_canonical(k, layout.inp, kv_n)[0])
        vs.append(to_canonical(v, layout.inp, kv_n)[0])
        lens.append(k.shape[sd])
        vd = ks[-1].shape[-1]
    dims = Dims(B=b, N=n, KV_N=kv_n, Q_S=query.shape[sd], D=d, Dv=vs[0].shape[-1])
    return dims, qc, ListKV(tuple(ks), tuple(vs)), tuple(lens)


def kv_dtype(ctx: Ctx, q: torch.Tensor, kv) -> torch.dtype:
    """key/value dtype; equal to the query's for the float paths (quantized KV is checked elsewhere)."""
    if isinstance(kv, DenseKV) or isinstance(kv, PackedKV):
        kd, vd = kv.key.dtype, kv.value.dtype
    else:
        kd, vd = kv.keys[0].dtype, kv.values[0].dtype
    if kd != vd:
        raise ctx.err("value", f"dtype {dtype_name(kd)} (the key's)", f"dtype {dtype_name(vd)}")
    return kd
