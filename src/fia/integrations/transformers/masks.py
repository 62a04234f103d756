"""transformers' 4-D attention masks -> FIA arguments: per-batch KV windows and sparse modes where the mask is causal /
full / banded attention over one contiguous key window per batch (analysed once per mask tensor, shared by the
layers), else a general ``atten_mask``."""
from __future__ import annotations

import weakref

import torch

from fia.caches import BoundedCache

from .common import unsupported

# id(mask) -> (weakref(mask), key, plan): one analysis per mask tensor, shared by the layers of a forward
_plans = BoundedCache("transformers.mask_plans", 17)


def _allowed(mask: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The 4-D mask as bool, True = may attend (transformers' convention), cut to the keys given."""
    if mask.dim() != 4:
        unsupported(f"a {mask.dim()}-D attention mask", "transformers hands attention functions 4-D masks")
    mask = mask[..., :kv_len]
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return mask != 0
    finite_min = torch.finfo(mask.dtype).min
    allowed = mask > finite_min / 2
    if not bool(torch.all(mask[allowed] == 0)):
        unsupported("an additive float attention bias", "the float mask holds values other than 0 and -inf/min")
    return allowed


def _plan_from_mask(allowed: torch.Tensor, q_len: int, kv_len: int, causal: bool, window):
    """FIA arguments that reproduce `allowed` [B, H, Q, KV] exactly: lengths + sparse mode when the mask is causal /
    full / banded attention over one contiguous key window per batch, else the general mask."""
    if allowed.shape[1] != 1:
        if not bool(torch.all(allowed == allowed[:, :1])):
            unsupported("per-head attention masks", "FIA's atten_mask is shared by all heads (SPEC 5)")
        allowed = allowed[:, :1]
    a = allowed[:, 0]                     # batch 1 (broadcast) stays 1: FIA applies one-entry lengths to every batch
    dev = a.device
    cols = a.any(1)                                                # [B, KV]: keys some row attends
    j = torch.arange(kv_len, device=dev)
    lo = torch.where(cols, j, kv_len).amin(-1)
    hi = torch.where(cols, j + 1, 0).amax(-1)
    empty = hi == 0
    lo = torch.where(empty, kv_len, lo)
    hi = torch.where(empty, kv_len, hi)
    jj, lo3, hi3 = j.view(1, 1, -1), lo.view(-1, 1, 1), hi.view(-1, 1, 1)
    window_keys = (jj >= lo3) & (jj < hi3)

    found = None
    if q_len == 1:                                                 # decode: a key window is all there is (SPEC 5)
        if torch.equal(window_keys, a):
            found = (False, None)
    else:
        ii = torch.arange(q_len, device=dev).view(1, -1, 1)
        diag = ii + (hi3 - q_len)                                  # right-down diagonal of each batch's window
        pre = None if not window else int(window) - 1
        cands = [(True, pre), (True, None), (False, None)] if causal else [(False, None), (True, None)]
        for is_causal, p in dict.fromkeys(cands):
            exp = window_keys
            if is_causal:
                exp = exp & (jj <= diag)
                if p is not None:
                    exp = exp & (jj >= diag - p)
            if torch.equal(exp, a):
                found = (is_causal, p)
                break
    if found is None:
        return _general(a, q_len)
    return _window_plan(found, lo.tolist(), hi.tolist(), q_len, kv_len, dev)


def general_plan(mask, q_len: int, kv_len: int) -> dict:
    """The mask as FIA's general atten_mask (True = masked), for calls that cannot take per-batch padding sizes."""
    allowed = _allowed(mask, kv_len)
    if allowed.shape[1] != 1:
        if not bool(torch.all(allowed == allowed[:, :1])):
            unsupported("per-head attention masks", "FIA's atten_mask is shared by all heads (SPEC 5)")
        allowed = allowed[:, :1]
    return _general(allowed[:, 0], q_len)


def _general(a: torch.Tensor, q_len: int) -> dict:
    """A general mask: FIA's convention, True = masked."""
    m = ~a
    return {"atten_mask": (m.unsqueeze(1) if q_len > 1 else m.view(m.shape[0], 1, 1, -1)).contiguous()}


def _decode_plan(mask: torch.Tensor, kv_len: int) -> dict:
    """_plan_from_mask of a decode step's CPU bool mask [B, 1, 1, >= kv_len] (True = may attend): byte searches over
    one copy of its rows. A decode step analyses a new mask each step, inside a model whose work between steps
    leaves little of the host code cached, so the fewer library calls the better (docs/performance.md)."""
    raw = mask.numpy()[:, 0, 0, :kv_len].tobytes()                 # [B, kv_len] bytes 0 / 1
    lo_l, hi_l = [], []
    for b in range(0, len(raw), kv_len):
        lo = raw.find(1, b, b + kv_len)
        if lo < 0:                                                 # a batch that attends no key
            lo_l.append(kv_len)
            hi_l.append(kv_len)
            continue
        hi = raw.rfind(1, lo, b + kv_len) + 1
        if raw.find(0, lo, hi) >= 0:                               # not one contiguous key window
            return _general(mask[:, 0, :, :kv_len], 1)
        lo_l.append(lo - b)
        hi_l.append(hi - b)
    return _window_plan((False, None), lo_l, hi_l, 1, kv_len, mask.device)


def _window_plan(found: tuple, lo_l: list, hi_l: list, q_len: int, kv_len: int, dev) -> dict:
    """FIA arguments of per-batch key windows [lo, hi) (found: (causal, pre_tokens or None))."""
    is_causal, p = found
    plan = {}
    if any(lo_l):                                                  # left padding: window [KV - pad - act, KV - pad)
        plan["actual_seq_lengths_kv"] = [h - lo_ for lo_, h in zip(lo_l, hi_l)]
        plan["kv_padding_size"] = torch.tensor([kv_len - h for h in hi_l], dtype=torch.int64, device=dev)
    elif any(h != kv_len for h in hi_l):                           # right padding / a static cache's unused tail
        plan["actual_seq_lengths_kv"] = hi_l
    if q_len > 1 and is_causal:
        plan["sparse_mode"] = 3 if p is None else 4
        if p is not None:
            plan["pre_tokens"], plan["next_tokens"] = p, 0
    return plan


def mask_plan(mask, q_len: int, kv_len: int, causal: bool, window) -> dict:
    if mask is None:
        if q_len == 1 or not causal:
            return {}
        if kv_len > q_len:            # transformers skips the mask only for an empty static cache: upper-left causal
            return {"sparse_mode": 3, "actual_seq_lengths_kv": [q_len]}
        return {"sparse_mode": 3}
    key = (mask._version, tuple(mask.shape), mask.data_ptr(), q_len, kv_len, causal, window)
    hit = _plans.get(id(mask))
    if hit is not None and hit[0]() is mask and hit[1] == key:
        return hit[2]
    if q_len == 1 and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1 \
            and mask.device.type == "cpu" and 0 < kv_len <= mask.shape[3]:
        plan = _decode_plan(mask, kv_len)
    else:
        plan = _plan_from_mask(_allowed(mask, kv_len), q_len, kv_len, causal, window)
    _plans.put(id(mask), (weakref.ref(mask), key, plan))
    return plan


