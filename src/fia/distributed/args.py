"""Argument handling shared by decode_attention and ring_attention: the call signature every rank compares,
layout facts (where the sequence axis is), lengths as per-batch lists, and the checks of arguments that
cannot be split across ranks."""
from __future__ import annotations

import numbers
from typing import Dict, List, Optional, Sequence

import torch

from ..errors import FiaUnsupportedError, input_error

INT_MAX = 2147483647

# the sequence axis of Q / K / V in each input layout (the part before an underscore)
SEQ_DIM = {"BSH": 1, "BSND": 1, "BNSD": 2, "TND": 0, "NTD": 1}

# arguments whose partial results cannot be merged: why, and what to do instead
UNMERGEABLE = {
    "quant_scale2": "an int8 output cannot be merged through its lse; quantize the merged output instead",
    "quant_offset2": "an int8 output cannot be merged through its lse; quantize the merged output instead",
    "key_shared_prefix": "a shared prefix would be attended on every rank (counted once per rank); pass the "
                         "prefix keys as part of one rank's key slice",
    "value_shared_prefix": "a shared prefix would be attended on every rank (counted once per rank); pass the "
                           "prefix values as part of one rank's value slice",
}


def in_layout(kw: dict) -> str:
    """The input part of input_layout ('BSH' default), checked to be one fia.distributed can split."""
    layout = kw.get("input_layout", "BSH")
    first = layout.partition("_")[0] if isinstance(layout, str) else None
    if first not in SEQ_DIM:
        raise input_error("input_layout", f"a layout whose input part is one of {sorted(SEQ_DIM)}", repr(layout))
    return first


def unsupported(argument: str, why: str, received: object) -> FiaUnsupportedError:
    return FiaUnsupportedError(f"{argument}: {why} (got {received})")


def reject_unmergeable(kw: dict) -> None:
    for name, why in UNMERGEABLE.items():
        if kw.get(name) is not None:
            raise unsupported(name, why, "a tensor" if isinstance(kw[name], torch.Tensor) else repr(kw[name]))


def _tensor_sig(t: object, drop: Optional[int] = None) -> object:
    """dtype, device type and shape (axis `drop` shown as '*': it may differ between ranks)."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    shape: List[object] = list(t.shape)
    if drop is not None and -len(shape) <= drop < len(shape):
        shape[drop] = "*"
    return (str(t.dtype).replace("torch.", ""), t.device.type, tuple(shape))


def kv_signature(t: object, layout: str, paged: bool) -> object:
    """What must match between ranks for key / value: all but the sequence (or block-count) axis."""
    if isinstance(t, (list, tuple)):
        return ("list", len(t)) + tuple(_tensor_sig(x, SEQ_DIM[layout]) for x in t[:1])
    return _tensor_sig(t, 0 if paged else SEQ_DIM[layout])


def call_signature(op: str, query: object, key: object, value: object, kw: dict,
                   extra: Dict[str, object], query_seq_free: bool = False) -> Dict[str, object]:
    """The comparable description of a call: shapes / dtypes / layout / flags (never values that legitimately
    differ between ranks, such as key lengths or per-token scales; nor the query's sequence axis when each rank
    holds its own query slice: `query_seq_free`)."""
    layout = kw.get("input_layout", "BSH")
    first = layout.partition("_")[0] if isinstance(layout, str) else ""
    paged = kw.get("block_table") is not None
    qdrop = SEQ_DIM.get(first) if query_seq_free else None
    sig: Dict[str, object] = {"operation": op, "query": _tensor_sig(query, qdrop)}
    if first in SEQ_DIM:
        sig["key"] = kv_signature(key, first, paged)
        sig["value"] = kv_signature(value, first, paged)
    for name, v in kw.items():
        if isinstance(v, torch.Tensor):
            sig[name] = (str(v.dtype).replace("torch.", ""), v.dim())
        elif isinstance(v, (list, tuple)):
            sig[name] = f"{len(v)} values"
        elif v is None or isinstance(v, (bool, numbers.Number, str)):
            sig[name] = v
        else:
            sig[name] = type(v).__name__
    sig.update(extra)
    return sig


def per_batch(name: str, v: object, batch: int) -> Optional[List[int]]:
    """A lengths / offsets argument -> a list of `batch` ints (one value applies to every batch; SPEC 4)."""
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        v = [int(v)]
    if not isinstance(v, (list, tuple)) or not v or not all(
            isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in v):
        raise input_error(name, "an int or a list of ints", repr(v))
    vals = [int(x) for x in v]
    if len(vals) == 1:
        vals = vals * batch
    if len(vals) < batch:
        raise input_error(name, f"1 or at least {batch} values (one per batch)", f"{len(vals)} values")
    return vals[:batch]


def cumulative_to_lengths(name: str, cum: Sequence[int]) -> List[int]:
    """TND's cumulative lengths -> per-batch lengths."""
    out, prev = [], 0
    for c in cum:
        if c < prev:
            raise input_error(name, "non-decreasing cumulative lengths (TND)", list(cum))
        out.append(c - prev)
        prev = c
    return out


def lengths_to_cumulative(lengths: Sequence[int]) -> List[int]:
    out, acc = [], 0
    for n in lengths:
        acc += n
        out.append(acc)
    return out
