"""Seeded randomized mutation test of input validation (SPEC 1.4, 14): bad input gets a clear error, never a crash.

Every case is drawn from its seed alone: a small VALID random call of one family (dense prefill / decode in BSH,
BNSD, BSND; TND with cumulative lengths; paged KV with a shuffled block_table; tensor-list KV; int8 antiquant;
full int8; MLA rope; shared prefix; v2 with learnable_sink; sparse modes with the template; the .out variants;
the workspace query; npu_attention_update; one aclnn GetWorkspaceSize + execute), run once to check it is valid,
then ONE random mutation from the catalogue below. `pytest tests/validation/test_fuzz_invalid.py -k seed_123` reproduces a
case; the failure message names the family, the base call and the mutation.

Each mutation declares what the SPEC says of the mutated call:
  err     invalid: FiaInputError (status 161001/161002) or FiaUnsupportedError whose message names the argument
          (`e.argument`, or the name as an identifier in the message);
  type    a Python-level misuse (unknown keyword, wrong positional count): TypeError (FiaInputError is one);
  same    still valid with the same meaning (non-contiguous tensors, tuple / NumPy / tensor lengths, lengths
          lists longer than B, larger masks and pse, extra block_table columns, numpy scalars...): must succeed
          and equal the unmutated result;
  ok      valid with another meaning (scale 0 / negative ...): must succeed;
  nan     a NaN in an input: must succeed (SPEC 14); where the geometry is simple the NaN must reach exactly the
          outputs IEEE arithmetic says and nothing else;
  either  the validity depends on details the test does not model (zero-size axes, other layouts, pre/next
          values under a band...): success (then no NaN out of finite inputs) or a clear input error.
Anything else -- another exception type (IndexError, RuntimeError from torch, AssertionError...), a crash, a
success where an error is due, a different result for a `same` mutation -- is a finding.

The whole catalogue runs once with automatic backend selection (the `fia_backend` fixture of conftest is
overridden); a subset runs again with each registered backend forced: a forced backend may decline a VALID
problem (FiaBackendUnavailable: nothing to compare), but an invalid one must fail exactly as without forcing,
since validation runs before dispatch.

A `same` mutation (non-contiguous input) that only a backend gets wrong -- the reference backend computes the
unmutated result -- is a backend bug, outside the validation layer: it fails with a message saying so. The end
of the file holds every finding of this fuzzer as a fixed regression case.
"""
from __future__ import annotations

import inspect
import random
import re
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch

import fia
from fia import aclnn
from fia.backends import registry
from fia.errors import FiaBackendUnavailable, FiaInputError, FiaUnsupportedError
from fia.parse.entries import FUSED_DEFAULTS, V2_MAP
from util import cumsum

pytestmark = pytest.mark.backend_independent      # one run with automatic backend selection (conftest)

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
I8, I16, I32, I64, U8, BOOL, C64 = torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, \
    torch.complex64
INT_MAX = 2147483647
DTYPE_POOL = [F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, C64]

N_CASES = 700
SEEDS = list(range(N_CASES))
FORCED_SEEDS = SEEDS[::7][:100]
BACKENDS = [b.name for b in registry.backends()]


@pytest.fixture(autouse=True)
def strict_mode():
    """Validation is backend-independent: run once (automatic selection, strict mode); the forced-backend
    subset below forces each backend itself."""
    with fia.validation_mode("strict"):
        yield


# ============================================================================================ spellings
_SIG_FN = {"fused": fia.eager.npu_fused_infer_attention_score, "incre": fia.eager.npu_incre_flash_attention,
           "prompt": fia.eager.npu_prompt_flash_attention, "v2": fia.eager.npu_fused_infer_attention_score_v2}
SIGS = {k: [p for p in inspect.signature(f).parameters if p != "unknown"] for k, f in _SIG_FN.items()}
# canonical (npu_fused_infer_attention_score) keyword -> the entry point's keyword (None: not reachable)
SPELL = {
    "fused": {},
    "incre": {"actual_seq_lengths_kv": "actual_seq_lengths", "scale": "scale_value", "actual_seq_lengths": None},
    "prompt": {"scale": "scale_value", "dequant_scale1": "deq_scale1", "dequant_scale2": "deq_scale2"},
    "v2": {v1: v2 for v2, v1 in V2_MAP.items()},
}
# which signature an api uses
FAMILY_OF_API = {"fused": "fused", "incre": "incre", "prompt": "prompt", "v2": "v2", "fused_out": "fused",
                 "v2_out": "v2", "ws": "fused", "ws_v2": "v2", "aclnn_v4": "fused", "aclnn_ifa": "incre",
                 "update": None}
ACL_OP = {"aclnn_v4": "aclnnFusedInferAttentionScoreV4", "aclnn_ifa": "aclnnIncreFlashAttentionV4"}


def sp(api: str, canon: str) -> Optional[str]:
    """The api's spelling of a canonical keyword, or None when the api does not take it."""
    base = FAMILY_OF_API[api]
    if base is None:
        return canon if canon in ("lse", "local_out", "update_type") else None
    name = SPELL[base].get(canon, canon)
    return name if name in SIGS[base] else None


def canon(api: str, name: str) -> str:
    base = FAMILY_OF_API[api]
    if base is None:
        return name
    for c, n in SPELL[base].items():
        if n == name:
            return c
    return name


# ============================================================================================ calls
@dataclass
class Call:
    api: str
    kw: Dict[str, Any]              # every argument in the api's spelling (query/key/value included)
    info: Dict[str, Any]            # facts about the base call the mutations need
    positional: Optional[tuple] = None   # explicit positional arguments (positional-count mutations)

    def with_kw(self, **changes) -> "Call":
        kw = dict(self.kw)
        kw.update(changes)
        return Call(self.api, kw, self.info, self.positional)

    def without(self, name) -> "Call":
        kw = dict(self.kw)
        kw.pop(name, None)
        return Call(self.api, kw, self.info, self.positional)

    def describe(self) -> str:
        def d(v):
            if isinstance(v, torch.Tensor):
                s = f"T{tuple(v.shape)}:{str(v.dtype).replace('torch.', '')}"
                if v.device.type != "cpu":
                    s += f"@{v.device.type}"
                if v.numel() and not v.is_contiguous():
                    s += ":nc"
                return s
            if isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v):
                return "[" + ", ".join(d(t) for t in v) + "]"
            r = repr(v)
            return r if len(r) < 60 else r[:57] + "..."
        args = ", ".join(f"{k}={d(v)}" for k, v in self.kw.items())
        pos = "" if self.positional is None else f" positional={[d(p) for p in self.positional]}"
        return f"{self.api}({args}){pos}"


def make_call(api: str, f: dict, info: dict) -> Call:
    """Canonical (fused-spelled) argument dict -> a Call in the api's spelling."""
    kw = {}
    for k, v in f.items():
        if k in ("query", "key", "value") or api in ("aclnn_v4", "update") or k in ("out", "workspace",
                                                                                   "attention_out", "softmax_lse",
                                                                                   "attentionOut", "softmaxLse"):
            kw[k] = v
            continue
        name = sp(api, k)
        assert name is not None, f"builder bug: {api} has no {k}"
        kw[name] = v
    info = dict(info)
    info["api"] = api
    return Call(api, kw, info)


_FUNCS = {
    "fused": lambda: fia.npu_fused_infer_attention_score, "incre": lambda: fia.npu_incre_flash_attention,
    "prompt": lambda: fia.npu_prompt_flash_attention, "v2": lambda: fia.npu_fused_infer_attention_score_v2,
    "fused_out": lambda: fia.npu_fused_infer_attention_score.out,
    "v2_out": lambda: fia.npu_fused_infer_attention_score_v2.out,
    "ws": lambda: fia._npu_fused_infer_attention_score_get_max_workspace,
    "ws_v2": lambda: fia._npu_fused_infer_attention_score_v2_get_max_workspace,
}


def _acl_table(op: str):
    if op == "aclnnFusedInferAttentionScoreV4":
        return aclnn._V2_INPUTS + aclnn._V4_EXTRA_INPUTS + aclnn._V2_ATTRS + aclnn._V4_EXTRA_ATTRS
    return aclnn._IFA


_INCRE_DEFAULTS = {p.name: p.default for p in inspect.signature(fia.eager.npu_incre_flash_attention).parameters.values()
                   if p.default is not inspect.Parameter.empty}


def invoke(call: Call):
    """Run the call; return (out, lse-or-None) (tensors as returned, not copied)."""
    kw = dict(call.kw)
    if call.api == "update":
        args = call.positional if call.positional is not None else (kw.pop("lse"), kw.pop("local_out"),
                                                                    kw.pop("update_type"))
        out, lse = fia.npu_attention_update(*args, **kw)
        return out, lse
    if call.api in ACL_OP:
        op = ACL_OP[call.api]
        defaults = FUSED_DEFAULTS if call.api == "aclnn_v4" else _INCRE_DEFAULTS
        args = [kw.get(t, defaults.get(t)) for _, t in _acl_table(op)] + [kw["attentionOut"]]
        if call.api == "aclnn_v4":
            args.append(kw["softmaxLse"])
        if call.positional is not None:
            args = list(call.positional)
        ws, ex = getattr(aclnn, op + "GetWorkspaceSize")(*args)
        assert getattr(aclnn, op)(None, ws, ex, None) == 0
        return ex.attentionOut, (ex.softmaxLse if call.api == "aclnn_v4" and ex.write_lse else None)
    fn = _FUNCS[call.api]()
    if call.positional is not None:
        for n in ("query", "key", "value"):
            kw.pop(n, None)
        r = fn(*call.positional, **kw)
    else:
        q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
        r = fn(q, k, v, **kw)
    if call.api in ("ws", "ws_v2"):
        return r, None
    if isinstance(r, tuple):
        out, lse = r
        lse_on = call.kw.get(sp(call.api, "softmax_lse_flag") or "", False)
        if call.api in ("fused_out", "v2_out") and not lse_on:
            lse = None              # a placeholder, left untouched
        if call.api in ("v2", "v2_out") and not lse_on:
            lse = None
        return out, lse
    return r, None


def run_clone(call: Call):
    out, lse = invoke(call)
    return (out.detach().clone() if isinstance(out, torch.Tensor) else out,
            lse.detach().clone() if isinstance(lse, torch.Tensor) else lse)


# ============================================================================================ data helpers
def rn(g, *shape, dtype=F16):
    return torch.randn(*shape, generator=g).to(dtype)


def ri8(g, *shape):
    return torch.randint(-8, 8, shape, generator=g).to(I8)


def rpos(g, *shape, dtype=F32):
    return (torch.rand(*shape, generator=g) * 0.02 + 0.005).to(dtype)


def rmask(g, *shape):
    return torch.rand(*shape, generator=g) < 0.3


_TEMPLATE = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


def to_layout(x: torch.Tensor, lay: str) -> torch.Tensor:
    """canonical [B, N, S, D] -> the input part of a layout."""
    base = lay.split("_")[0]
    b, n, s, d = x.shape
    if base == "BSH":
        return x.permute(0, 2, 1, 3).reshape(b, s, n * d).contiguous()
    if base == "BSND":
        return x.permute(0, 2, 1, 3).contiguous()
    return x.contiguous()


def from_layout(x: torch.Tensor, lay: str, n: int) -> torch.Tensor:
    base = lay.split("_")[0]
    if base == "BSH":
        b, s, h = x.shape
        return x.reshape(b, s, n, h // n).permute(0, 2, 1, 3)
    if base == "BSND":
        return x.permute(0, 2, 1, 3)
    return x


# ============================================================================================ families
def _heads(R):
    kvn = R.choice([1, 2])
    return kvn * R.choice([1, 2]), kvn


def fam_dense(R, g, api=None):
    decode = R.random() < 0.4
    api = api or R.choice(["fused", "v2", "incre"] if decode else ["fused", "v2", "prompt"])
    if api == "incre":
        decode = True
    lay = R.choice(["BSH", "BNSD", "BSND"])
    dt = R.choice([F16, BF16])
    B = R.randint(1, 3)
    N, kvn = _heads(R)
    qs = 1 if decode else R.randint(2, 5)
    kvs, D = R.randint(1, 7), R.choice([16, 32])
    f = dict(query=to_layout(rn(g, B, N, qs, D, dtype=dt), lay), key=to_layout(rn(g, B, kvn, kvs, D, dtype=dt), lay),
             value=to_layout(rn(g, B, kvn, kvs, D, dtype=dt), lay), num_heads=N, input_layout=lay,
             scale=R.choice([1.0, 0.25, 0.125]))
    if kvn != N or R.random() < 0.3:
        f["num_key_value_heads"] = kvn
    info = dict(family="dense", layout=lay, B=B, N=N, KVN=kvn, QS=qs, KVS=kvs, D=D, dtype=dt, kv_dtype=dt,
                decode=decode, band=False, simple=True, mask=None)
    if R.random() < 0.35:
        shape = R.choice([(B, kvs), (B, 1, kvs), (B, 1, 1, kvs)] if decode else
                         [(qs, kvs), (B, qs, kvs), (1, qs, kvs), (B, 1, qs, kvs)])
        f["atten_mask"] = rmask(g, *shape).to(R.choice([BOOL, I8, U8]))
        info.update(mask="user", simple=False, band=not decode, mask_decode=decode)
    if R.random() < 0.3:
        f["pse_shift"] = rn(g, R.choice([1, B]), N, qs, kvs, dtype=dt)
        info["simple"] = False
    if R.random() < 0.4:
        f["actual_seq_lengths_kv"] = [R.randint(0, kvs) for _ in range(R.choice([1, B]))]
        info["simple"] = False
    if not decode and R.random() < 0.3:
        f["actual_seq_lengths"] = [R.randint(0, qs) for _ in range(R.choice([1, B]))]
        info["simple"] = False
    if api in ("fused", "v2") and R.random() < 0.5:
        f["softmax_lse_flag"] = True
    if api in ("fused", "v2", "incre") and R.random() < 0.25:
        f["inner_precise"] = R.choice([0, 1] if decode else [0, 1, 2, 3])
    info["lens_q"] = not decode
    return make_call(api, f, info)


def fam_leftpad(R, g, api="fused"):
    c = fam_dense(R, g, api="fused")
    info, kw = dict(c.info), dict(c.kw)
    B, qs, kvs = info["B"], info["QS"], info["KVS"]
    kw["kv_padding_size"] = torch.tensor([R.randint(0, 2)], dtype=R.choice([I64, I32]))
    kw.setdefault("actual_seq_lengths_kv", [R.randint(0, kvs) for _ in range(B)])
    if not info["decode"]:
        kw["query_padding_size"] = torch.tensor([R.randint(-1, 2)], dtype=I64)
        kw.setdefault("actual_seq_lengths", [R.randint(0, qs) for _ in range(B)])
    info.update(family="leftpad", simple=False, band=False)    # sparse 0 + left padding: pre/next unlimited
    return Call("fused", kw, info)


def fam_tnd(R, g, api=None):
    api = api or R.choice(["fused", "v2"])
    lay = R.choice(["TND", "TND", "NTD_TND"])      # strict: TND_NTD only with query D = 512 (SPEC 14b.4 T11)
    B = R.randint(1, 3)
    N, kvn = _heads(R)
    D = 128                                         # strict: TND without rope has D 128 / 192 (SPEC 14b.4 T16)
    ql = [R.randint(0, 3) for _ in range(B)]
    kl = [R.randint(0, 4) for _ in range(B)]
    if sum(ql) == 0:
        ql[0] = 1
    if sum(kl) == 0:
        kl[-1] = 2
    T, TK = sum(ql), sum(kl)

    def mk(n, t):
        x = rn(g, t, n, D, dtype=BF16)
        return x.permute(1, 0, 2).contiguous() if lay.startswith("NTD") else x
    f = dict(query=mk(N, T), key=mk(kvn, TK), value=mk(kvn, TK), num_heads=N, num_key_value_heads=kvn,
             input_layout=lay, scale=0.25, actual_seq_lengths=cumsum(ql), actual_seq_lengths_kv=cumsum(kl))
    if R.random() < 0.5:
        f["softmax_lse_flag"] = True
    info = dict(family="tnd", layout=lay, B=B, N=N, KVN=kvn, D=D, dtype=BF16, kv_dtype=BF16, T=T, TK=TK,
                decode=all(x == 1 for x in ql), tnd=True, dv_free=True, band=False, simple=False, mask=None)
    return make_call(api, f, info)


def fam_paged(R, g, api=None):
    decode = R.random() < 0.6
    api = api or R.choice(["fused", "v2"] + (["incre"] if decode else []))
    lay = R.choice(["BSH", "BNSD", "BSND"])
    four_d = lay == "BNSD" and R.random() < 0.5
    dt = R.choice([F16, BF16])
    B = R.randint(1, 3)
    N, kvn = _heads(R)
    D = R.choice([16, 32])
    qs = 1 if decode else R.randint(2, 4)
    bs = R.choice([16, 32]) if decode else 128
    kvl = [R.randint(1, 3 * bs if decode else 2 * bs) for _ in range(B)]
    need = [(x + bs - 1) // bs for x in kvl]
    extra_col = R.random() < 0.3
    mb = max(need) + int(extra_col)
    nb = sum(need) + R.randint(0, 2)
    ids = R.sample(range(nb), sum(need))
    table, i = [], 0
    for n in need:
        table.append(ids[i:i + n] + [-1] * (mb - n))
        i += n
    if four_d:
        kc, vc = rn(g, nb, kvn, bs, D, dtype=dt), rn(g, nb, kvn, bs, D, dtype=dt)
    else:
        kc, vc = rn(g, nb, bs, kvn * D, dtype=dt), rn(g, nb, bs, kvn * D, dtype=dt)
    f = dict(query=to_layout(rn(g, B, N, qs, D, dtype=dt), lay), key=kc, value=vc, num_heads=N,
             num_key_value_heads=kvn, input_layout=lay, scale=0.25, block_table=torch.tensor(table, dtype=I32),
             block_size=bs, actual_seq_lengths_kv=kvl)
    if api in ("fused", "v2") and R.random() < 0.4:
        f["softmax_lse_flag"] = True
    info = dict(family="paged", layout=lay, B=B, N=N, KVN=kvn, QS=qs, D=D, dtype=dt, kv_dtype=dt, decode=decode,
                paged=True, bt_exact=not extra_col, bs=bs, nb=nb, cap=mb * bs, band=False, simple=False, mask=None,
                lens_q=False)
    return make_call(api, f, info)


def fam_list(R, g, api=None):
    decode = R.random() < 0.5
    api = api or R.choice(["fused", "v2"] + (["incre"] if decode else []))
    lay = R.choice(["BSH", "BNSD", "BSND"])
    dt = R.choice([F16, BF16])
    B = R.randint(2, 3)
    N, kvn = _heads(R)
    D = 16
    qs = 1 if decode else R.randint(2, 4)
    kvs = [R.randint(1, 6) for _ in range(B)]
    f = dict(query=to_layout(rn(g, B, N, qs, D, dtype=dt), lay),
             key=[to_layout(rn(g, 1, kvn, s, D, dtype=dt), lay) for s in kvs],
             value=[to_layout(rn(g, 1, kvn, s, D, dtype=dt), lay) for s in kvs],
             num_heads=N, num_key_value_heads=kvn, input_layout=lay, scale=0.25)
    if R.random() < 0.3:
        f["actual_seq_lengths_kv"] = [R.randint(0, s) for s in kvs]
    info = dict(family="list", layout=lay, B=B, N=N, KVN=kvn, QS=qs, D=D, dtype=dt, kv_dtype=dt, decode=decode,
                kv_list=True, list_kvs=kvs, band=False, simple=False, mask=None, lens_q=not decode)
    return make_call(api, f, info)


def fam_antiquant(R, g, api=None):
    sub = R.choice(["dec_comb", "dec_sep", "pre_comb", "pre_sep"])
    lay = R.choice(["BSH", "BNSD"])
    B = R.randint(1, 2)
    N, kvn = _heads(R)
    D = 32
    decode = sub.startswith("dec")
    qs = 1 if decode else R.randint(2, 4)
    kvs = R.randint(1, 6)
    dt = F16 if sub == "pre_comb" else BF16 if sub == "pre_sep" else R.choice([F16, BF16])
    f = dict(query=to_layout(rn(g, B, N, qs, D, dtype=dt), lay), key=to_layout(ri8(g, B, kvn, kvs, D), lay),
             value=to_layout(ri8(g, B, kvn, kvs, D), lay), num_heads=N, num_key_value_heads=kvn, input_layout=lay,
             scale=0.2)
    gran = {}
    if sub in ("dec_comb", "pre_comb"):
        api = api or (R.choice(["fused", "incre"]) if decode else "fused")
        mode = 1 if decode and api == "fused" and R.random() < 0.3 else 0
        if mode == 1:
            shape, sdt = (2, B, kvs), F32
            f["antiquant_mode"] = 1
        else:
            shape = R.choice([(2,), (2, kvn, 1, D), (2, kvn, D), (2, kvn * D)])
            sdt = R.choice([dt, F32])
        f["antiquant_scale"] = rpos(g, *shape, dtype=sdt)
        if R.random() < 0.4:
            f["antiquant_offset"] = rn(g, *shape, dtype=sdt)
        gran["antiquant_scale"] = "token" if mode == 1 else "channel"
    else:
        api = api or R.choice(["fused", "v2"])
        if decode:
            mode = R.choice([0, 1, 2, 3, "k0v1"])
        else:
            mode = R.choice([0, 1])
        km, vm = (0, 1) if mode == "k0v1" else (mode, mode)
        if mode == "k0v1":
            dt = F16
            f["query"] = f["query"].to(F16)
        shapes = {0: ((1, kvn, 1, D) if decode else (kvn, D), dt), 1: ((1, B, kvs) if decode else (B, kvs), F32),
                  2: ((kvn,), dt), 3: ((B, kvn, kvs), F32)}
        for which, m in (("key", km), ("value", vm)):
            shape, sdt = shapes[m]
            f[f"{which}_antiquant_scale"] = rpos(g, *shape, dtype=sdt)
            gran[f"{which}_antiquant_scale"] = "token" if m in (1, 3) else "channel"
        if km == vm and R.random() < 0.3:
            f["key_antiquant_offset"] = rn(g, *f["key_antiquant_scale"].shape, dtype=f["key_antiquant_scale"].dtype)
            f["value_antiquant_offset"] = rn(g, *f["value_antiquant_scale"].shape,
                                             dtype=f["value_antiquant_scale"].dtype)
        if km or vm:
            f["key_antiquant_mode"], f["value_antiquant_mode"] = km, vm
    info = dict(family="antiquant", sub=sub, layout=lay, B=B, N=N, KVN=kvn, QS=qs, KVS=kvs, D=D, dtype=dt,
                kv_dtype=I8, decode=decode, gran=gran, band=False, simple=False, mask=None, lens_q=not decode)
    return make_call(api, f, info)


def fam_full8(R, g, api=None):
    api = api or R.choice(["fused", "prompt"])
    lay = R.choice(["BSH", "BNSD"])
    B = R.randint(1, 2)
    N, kvn = _heads(R)
    D, qs, kvs = 32, R.randint(2, 4), R.randint(1, 6)
    ds1 = torch.tensor([1e-3], dtype=F32)
    if R.random() < 0.3:   # the UINT64 bit-pattern form
        ds1 = torch.tensor([int(np.array([1e-3], dtype=np.float32).view(np.int32)[0])], dtype=I64)
    f = dict(query=to_layout(ri8(g, B, N, qs, D), lay), key=to_layout(ri8(g, B, kvn, kvs, D), lay),
             value=to_layout(ri8(g, B, kvn, kvs, D), lay), num_heads=N, num_key_value_heads=kvn, input_layout=lay,
             scale=0.2, dequant_scale1=ds1, quant_scale1=torch.tensor([100.0]), dequant_scale2=torch.tensor([1e-3]))
    if R.random() < 0.4:
        f["quant_scale2"] = torch.tensor([2.0])
        if R.random() < 0.5:
            f["quant_offset2"] = torch.tensor([0.5])
    info = dict(family="full8", layout=lay, B=B, N=N, KVN=kvn, QS=qs, KVS=kvs, D=D, dtype=I8, kv_dtype=I8,
                decode=False, band=False, simple=False, mask=None, lens_q=True)
    return make_call(api, f, info)


def fam_rope(R, g, api=None):
    api = api or R.choice(["fused", "v2"])
    decode = R.random() < 0.5
    lay = R.choice(["BSH", "BNSD", "BSND"])
    dt = R.choice([F16, BF16])
    B = R.randint(1, 2)
    N, kvn = _heads(R)
    D, qs, kvs = 16, (1 if decode else R.randint(2, 4)), R.randint(1, 6)
    f = dict(query=to_layout(rn(g, B, N, qs, D, dtype=dt), lay), key=to_layout(rn(g, B, kvn, kvs, D, dtype=dt), lay),
             value=to_layout(rn(g, B, kvn, kvs, D, dtype=dt), lay),
             query_rope=to_layout(rn(g, B, N, qs, 64, dtype=dt), lay),
             key_rope=to_layout(rn(g, B, kvn, kvs, 64, dtype=dt), lay),
             num_heads=N, num_key_value_heads=kvn, input_layout=lay, scale=0.2)
    info = dict(family="rope", layout=lay, B=B, N=N, KVN=kvn, QS=qs, KVS=kvs, D=D, dtype=dt, kv_dtype=dt,
                decode=decode, dv_free=True, band=False, simple=False, mask=None, lens_q=not decode)
    return make_call(api, f, info)


def fam_prefix(R, g, api="fused"):
    decode = R.random() < 0.4
    lay = R.choice(["BSH", "BNSD", "BSND"])
    dt = R.choice([F16, BF16])
    B = R.randint(1, 3)
    N, kvn = _heads(R)
    D, qs, kvs, ps = 16, (1 if decode else R.randint(2, 4)), R.randint(1, 6), R.randint(1, 5)
    f = dict(query=to_layout(rn(g, B, N, qs, D, dtype=dt), lay), key=to_layout(rn(g, B, kvn, kvs, D, dtype=dt), lay),
             value=to_layout(rn(g, B, kvn, kvs, D, dtype=dt), lay),
             key_shared_prefix=to_layout(rn(g, 1, kvn, ps, D, dtype=dt), lay),
             value_shared_prefix=to_layout(rn(g, 1, kvn, ps, D, dtype=dt), lay),
             num_heads=N, num_key_value_heads=kvn, input_layout=lay, scale=0.25)
    if R.random() < 0.6:
        f["actual_shared_prefix_len"] = [R.randint(0, ps)]
    info = dict(family="prefix", layout=lay, B=B, N=N, KVN=kvn, QS=qs, KVS=kvs, D=D, dtype=dt, kv_dtype=dt,
                decode=decode, PS=ps, band=False, simple=False, mask=None, lens_q=not decode)
    return make_call("fused", f, info)


def fam_sink(R, g, api="v2"):
    c = fam_dense(R, g, api="v2")
    N, dt = c.info["N"], c.info["dtype"]
    sink = rn(g, N, dtype=R.choice([F32, dt]))
    info = dict(c.info, family="sink", simple=False)
    return Call("v2", dict(c.kw, learnable_sink=sink), info)


def fam_sparse(R, g, api=None):
    api = api or R.choice(["fused", "v2", "prompt"])
    lay = R.choice(["BSH", "BNSD", "BSND"])
    dt = R.choice([F16, BF16])
    B = R.randint(1, 2)
    N, kvn = _heads(R)
    D, qs, kvs = 16, R.randint(2, 5), R.randint(2, 7)
    mode = R.choice([2, 3, 4])
    f = dict(query=to_layout(rn(g, B, N, qs, D, dtype=dt), lay), key=to_layout(rn(g, B, kvn, kvs, D, dtype=dt), lay),
             value=to_layout(rn(g, B, kvn, kvs, D, dtype=dt), lay), num_heads=N, num_key_value_heads=kvn,
             input_layout=lay, scale=0.25, sparse_mode=mode,
             atten_mask=_TEMPLATE.reshape(R.choice([(2048, 2048), (1, 2048, 2048), (1, 1, 2048, 2048)])))
    if mode == 4:
        f["pre_tokens"], f["next_tokens"] = R.randint(0, 4), R.randint(0, 4)
    info = dict(family="sparse", layout=lay, B=B, N=N, KVN=kvn, QS=qs, KVS=kvs, D=D, dtype=dt, kv_dtype=dt,
                decode=False, band=mode == 4, simple=False, mask="template", lens_q=True)
    return make_call(api, f, info)


def fam_out(R, g, api=None):
    api = api or R.choice(["fused_out", "v2_out"])
    c = fam_dense(R, g, api="fused" if api == "fused_out" else "v2")
    out, lse = invoke(c)
    flag = bool(c.kw.get(sp(c.api, "softmax_lse_flag"), False))
    ao = torch.full_like(out, float("nan"))          # NaN until written (checked by the "either" expectation)
    lo = torch.zeros_like(lse) if flag else R.choice([torch.zeros(1, dtype=c.info["dtype"]), torch.zeros(0),
                                                       torch.zeros(2, 3)])
    kw = dict(c.kw)
    if R.random() < 0.5:
        kw["out"] = [ao, lo]
    else:
        kw["attention_out"], kw["softmax_lse"] = ao, lo
    if R.random() < 0.3:
        kw["workspace"] = torch.empty(0, dtype=U8)
    info = dict(c.info, family="out", lse_flag=flag, out_dtype=out.dtype)
    return Call(api, kw, info)


def fam_ws(R, g, api=None):
    api = api or R.choice(["ws", "ws_v2"])
    c = fam_dense(R, g, api="fused" if api == "ws" else "v2")
    return Call(api, dict(c.kw), dict(c.info, family="ws"))


def fam_update(R, g, api="update"):
    K, Rr, D = R.randint(1, 3), R.randint(1, 6), R.randint(1, 16)
    dt = R.choice([F16, BF16, F32])
    lse = []
    for _ in range(K):
        x = torch.randn(Rr, generator=g) * 3
        if R.random() < 0.3:
            x[R.randrange(Rr)] = float("inf")
        lse.append(x)
    outs = [rn(g, Rr, D, dtype=dt) for _ in range(K)]
    info = dict(family="update", K=K, R=Rr, D=D, dtype=dt, simple=False)
    return Call("update", dict(lse=lse, local_out=outs, update_type=R.choice([0, 1])), info)


def fam_aclnn(R, g, api=None):
    api = api or R.choice(["aclnn_v4", "aclnn_v4", "aclnn_ifa"])
    if api == "aclnn_ifa":
        c = fam_dense(R, g, api="incre")
    else:
        c = (fam_paged if R.random() < 0.3 else fam_dense)(R, g, api="fused")
    out, lse = invoke(c)
    kw = dict(c.kw)
    kw["attentionOut"] = torch.full_like(out, float("nan"))      # NaN until written
    flag = bool(c.kw.get("softmax_lse_flag", False))
    if api == "aclnn_v4":
        kw["softmaxLse"] = torch.full_like(lse, float("nan")) if flag else R.choice([None, torch.zeros(1)])
    return Call(api, kw, dict(c.info, family="aclnn", lse_flag=flag, out_dtype=out.dtype, api=api))


FAMILIES: Dict[str, Tuple[Callable, int]] = {
    "dense": (fam_dense, 6), "leftpad": (fam_leftpad, 1), "tnd": (fam_tnd, 2), "paged": (fam_paged, 3), "list": (fam_list, 2),
    "antiquant": (fam_antiquant, 3), "full8": (fam_full8, 2), "rope": (fam_rope, 2), "prefix": (fam_prefix, 2),
    "sink": (fam_sink, 2), "sparse": (fam_sparse, 2), "out": (fam_out, 2), "ws": (fam_ws, 1),
    "update": (fam_update, 2), "aclnn": (fam_aclnn, 2),
}


# ============================================================================================ mutations
@dataclass
class Mut:
    call: Call
    expect: str                      # err | type | same | ok | nan | either
    names: Tuple[str, ...] = ()      # argument names an error may carry
    label: str = ""
    status: Optional[int] = None     # required aclnn status of an input error
    nan_at: Optional[tuple] = None   # (argument path, index) of an injected NaN


def tensor_slots(call: Call):
    """(path, tensor): path = (name,) or (name, i) for list elements (tensor-list KV, update lists, out=[...])."""
    for k, v in call.kw.items():
        if isinstance(v, torch.Tensor):
            yield (k,), v
        elif isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v):
            for i, t in enumerate(v):
                yield (k, i), t


def put(call: Call, path, value) -> Call:
    if len(path) == 1:
        return call.with_kw(**{path[0]: value})
    lst = list(call.kw[path[0]])
    lst[path[1]] = value
    return call.with_kw(**{path[0]: lst})


def pname(path) -> str:
    return path[0] if len(path) == 1 else f"{path[0]}[{path[1]}]"


def cname(call, path) -> str:
    """Canonical role of a tensor slot."""
    n = canon(call.api, path[0])
    if n == "out":
        return "attention_out" if path[1] == 0 else "softmax_lse"
    return {"attentionOut": "attention_out", "softmaxLse": "softmax_lse"}.get(n, n)


def names_for(call, path, *extra) -> Tuple[str, ...]:
    base = [path[0], pname(path)] + [sp(call.api, e) or e for e in extra]
    return tuple(dict.fromkeys(base))


def row_fix(call) -> bool:
    n = sp(call.api, "inner_precise")
    v = call.kw.get(n, 1 if call.api in ("incre", "aclnn_ifa") else 0) if n else 1
    return bool(isinstance(v, int) and v & 2)


def valid_dtypes(call, c: str, t: torch.Tensor):
    """The dtypes a tensor slot accepts, or None when the test does not model it."""
    info = call.info
    qdt = info.get("dtype")
    gran = info.get("gran", {})
    if c == "query":
        return {qdt}
    if c == "atten_mask":
        return {BOOL, I8, U8} | (set() if row_fix(call) else {F16})
    if c == "pse_shift":
        return {F16 if qdt == I8 else qdt}
    if c == "block_table":
        return {I32}
    if c == "learnable_sink":
        return {F32, qdt}
    if c in ("query_rope", "key_rope"):
        return {qdt}
    if c in ("key_shared_prefix", "value_shared_prefix"):
        return {info["kv_dtype"]}
    if c in ("antiquant_scale", "key_antiquant_scale", "value_antiquant_scale"):
        return {F32} if gran.get(c) == "token" else {qdt, F32}
    if c.endswith("antiquant_offset"):
        return {call.kw[sp(call.api, c.replace("offset", "scale"))].dtype}
    if c in ("dequant_scale1", "dequant_scale2"):
        return {F32, I64, getattr(torch, "uint64", I64)}
    if c == "quant_scale1":
        return {F32}
    if c == "quant_scale2":
        return {F32, BF16} if qdt == BF16 else {F32}
    if c == "quant_offset2":
        return {call.kw[sp(call.api, "quant_scale2")].dtype}
    if c in ("query_padding_size", "kv_padding_size"):
        return {I64, I32}
    if c == "lse":
        return {F32}
    if c == "local_out":
        return {F16, BF16, F32, F64} if info["K"] == 1 else {t.dtype}
    if c == "attention_out":
        return {info["out_dtype"]}
    if c == "softmax_lse":
        return {F32} if info.get("lse_flag") else "any"
    if c == "workspace":
        return "any"
    return None


def other_dtype(R, valid) -> torch.dtype:
    return R.choice([d for d in DTYPE_POOL if d not in valid])


def retype(t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    if dt == BOOL:
        return t != 0
    if dt in (I8, I16, I32, I64, U8) and t.is_floating_point():
        return (t * 4).round().clamp(-100, 100).to(dt) if dt != U8 else (t * 4).round().clamp(0, 100).to(dt)
    return t.to(dt)


# ---------------------------------------------------------------------------------------- tensor mutations
def m_dtype(call, R, g):
    slots = list(tensor_slots(call))
    path, t = R.choice(slots)
    c = cname(call, path)
    if c in ("key", "value"):
        kd = call.info.get("kv_dtype")
        if R.random() < 0.5 or call.info.get("kv_list"):
            # key and value together (every list element)
            dt = other_dtype(R, {kd})
            ch = {}
            for n in ("key", "value"):
                v = call.kw[n]
                ch[n] = [retype(x, dt) for x in v] if isinstance(v, (list, tuple)) else retype(v, dt)
            return Mut(call.with_kw(**ch), "err", ("key", "value", "query", "block_size"),
                       f"key+value dtype -> {dt}")
        dt = other_dtype(R, {kd})
        return Mut(put(call, path, retype(t, dt)), "err", ("key", "value"), f"{pname(path)} dtype -> {dt}")
    valid = valid_dtypes(call, c, t)
    if valid == "any":
        return Mut(put(call, path, retype(t, R.choice(DTYPE_POOL))), "same", (), f"{pname(path)} placeholder dtype")
    if valid is None:
        dt = R.choice(DTYPE_POOL)
        return Mut(put(call, path, retype(t, dt)), "either", names_for(call, path), f"{pname(path)} dtype -> {dt}")
    dt = other_dtype(R, valid)
    names = names_for(call, path)
    expect = "err"
    if c == "query":
        names = names + ("key", "value") + tuple(n for n in call.kw if "scale" in n or "rope" in n)
        if call.info.get("kv_dtype") == I8 and call.info.get("dtype") != I8 and dt in (F16, BF16):
            expect = "either"      # int8 K/V take a float16 or a bfloat16 query (float32 scales fit both)
    if c == "local_out":
        names = names + ("local_out",)
    return Mut(put(call, path, retype(t, dt)), expect, names, f"{pname(path)} dtype -> {dt}")


RANK_FIXED = {"query", "key", "value", "pse_shift", "block_table", "learnable_sink", "query_rope", "key_rope",
              "key_shared_prefix", "value_shared_prefix", "dequant_scale_query", "lse", "local_out", "attention_out"}


def m_rank(call, R, g):
    path, t = R.choice(list(tensor_slots(call)))
    c = cname(call, path)
    ops = [("unsqueeze(0)", lambda x: x.unsqueeze(0)), ("unsqueeze(-1)", lambda x: x.unsqueeze(-1))]
    if t.dim() > 1:
        ops += [("flatten", lambda x: x.reshape(-1)), ("[0]", lambda x: x[0])]
    if t.dim() == 1 and t.numel() > 0:
        ops += [("[0] (0-d)", lambda x: x[0])]
    label, op = R.choice(ops)
    if label == "[0]" and t.shape[0] == 0:
        return None
    new = op(t)
    names = names_for(call, path)
    expect = "either"
    if c in RANK_FIXED:
        expect = "err"
        if c == "query":
            names += ("key", "value", "num_heads", "input_layout", "query_rope", "dequant_scale_query")
        if c in ("key", "value"):
            names += ("key", "value", "block_size", "block_table", "num_key_value_heads")
    elif c == "atten_mask" and (new.dim() == 1 or new.dim() > 4):
        expect = "err"
    elif c == "softmax_lse":
        expect = "err" if call.info.get("lse_flag") else "same"
    elif c == "workspace":
        expect = "same"
    return Mut(put(call, path, new), expect, names, f"{pname(path)} rank {t.dim()} -> {new.dim()} ({label})")


def resize(g, t: torch.Tensor, axis: int, new: int) -> torch.Tensor:
    """t with axis resized to `new`: a prefix of t, or t followed by fresh values (garbage for ints)."""
    old = t.shape[axis]
    if new <= old:
        return t.narrow(axis, 0, new).clone()
    shape = list(t.shape)
    shape[axis] = new - old
    if t.dtype == BOOL:
        pad = torch.rand(*shape, generator=g) < 0.5
    elif t.is_floating_point():
        pad = torch.randn(*shape, generator=g).to(t.dtype)
    else:
        pad = torch.randint(-50, 50, shape, generator=g).to(t.dtype)
    return torch.cat([t, pad], dim=axis)


def _seq_axis(lay: str) -> int:
    return {"BSH": 1, "BSND": 1, "BNSD": 2}.get(lay.split("_")[0], -99)


def axis_expect(call, path, t, axis: int, grow: bool) -> str:
    """What the SPEC says of changing one axis of a tensor slot (by one, or by a few when growing)."""
    c = cname(call, path)
    info = call.info
    nd = t.dim()
    ax = axis % nd
    if c == "query":
        if not info.get("tnd") and ax == _seq_axis(info["layout"]) and info["family"] != "rope":
            return "either"         # another Q_S (a mask, pse, lengths or block_size may then disagree)
        return "err"
    if c in ("key", "value"):
        if c == "value" and ax == nd - 1 and info.get("dv_free"):
            return "either"
        return "err"
    if c == "atten_mask":
        if info.get("mask") == "template":
            return "err"
        if info.get("mask_decode") or info["decode"]:
            if ax == nd - 1:
                return "same" if grow else "err"
            return "either"
        q_ax = nd - 2
        if ax in (q_ax, nd - 1):
            return "same" if grow else "err"
        return "either"
    if c == "pse_shift":
        if ax in (2, 3):
            return "same" if grow else "err"
        if ax == 1:
            return "err"
        return "err"            # (the axis-0 case is decided in m_axis: 1 or B is valid)
    if c == "block_table":
        if ax == 0:
            return "err"
        return "same" if grow else ("err" if info.get("bt_exact") else "either")
    if c in ("learnable_sink", "query_rope", "key_rope", "key_shared_prefix", "value_shared_prefix", "lse",
             "attention_out"):
        return "err"
    if c in ("dequant_scale1", "dequant_scale2", "quant_scale1", "quant_scale2", "quant_offset2",
             "query_padding_size", "kv_padding_size"):
        return "err"
    if c.endswith("antiquant_offset"):
        return "err"
    if c.endswith("antiquant_scale"):
        return "either" if grow else "err"
    if c == "local_out":
        return "err" if ax == 0 or info["K"] > 1 else "either"
    if c == "softmax_lse":
        return "err" if info.get("lse_flag") else "same"
    if c == "workspace":
        return "same"
    return "either"


def m_axis(call, R, g):
    path, t = R.choice(list(tensor_slots(call)))
    if t.dim() == 0:
        return None
    ax = R.randrange(t.dim())
    old = t.shape[ax]
    if old == 2048:     # the template: shrink / grow by one
        new = old + R.choice([-1, 1])
    else:
        new = old + R.choice([1, 2, 3]) if R.random() < 0.5 or old == 0 else old - 1
    if new == old or new < 0:
        return None
    grow = new > old
    exp = axis_expect(call, path, t, ax, grow)
    c = cname(call, path)
    if c == "pse_shift" and ax == 0:
        exp = "ok" if new in (1, call.info["B"]) else "err"     # (B or 1, N, Q_S, KV_S): valid, other values
    names = names_for(call, path)
    if c == "query":
        names += ("key", "value", "num_heads", "num_key_value_heads", "actual_seq_lengths", "actual_seq_lengths_kv",
                  "block_table", "block_size", "query_rope", "learnable_sink", "atten_mask", "pse_shift",
                  "dequant_scale_query")
    elif c in ("key", "value"):
        names += ("key", "value", "num_key_value_heads", "block_size", "block_table", "key_rope")
    elif c.endswith("antiquant_scale") or c.endswith("antiquant_offset"):
        names += tuple(n for n in call.kw if "antiquant" in n)
    elif c in ("key_shared_prefix", "value_shared_prefix"):
        names += ("key_shared_prefix", "value_shared_prefix", "actual_shared_prefix_len")
    elif c == "quant_offset2":
        names += ("quant_scale2",)
    elif c in ("lse", "local_out"):
        names += ("lse", "local_out")
    elif c == "block_table":
        names += ("block_size", "actual_seq_lengths_kv")
    if c == "query" and exp == "either":
        names = None               # another Q_S: decode <-> prefill rules of any argument may apply
    new_t = resize(g, t, ax, new)
    if c == "block_table" and grow and ax == 1:
        new_t[:, old:] = torch.randint(-2 ** 31, 2 ** 31 - 1, (t.shape[0], new - old), generator=g).to(I32)
    return Mut(put(call, path, new_t), exp, names, f"{pname(path)} axis {ax}: {old} -> {new}")


def m_zero(call, R, g):
    path, t = R.choice(list(tensor_slots(call)))
    if t.dim() == 0:
        return None
    ax = R.randrange(t.dim())
    if t.shape[ax] == 0:
        return None
    new = t.narrow(ax, 0, 0)
    return Mut(put(call, path, new), "either", None, f"{pname(path)} axis {ax} -> 0 (zero-size)")


_NON_TENSORS = [("str", "abc"), ("float", 1.5), ("list of floats", [1.0, 2.0]), ("int", 3), ("bool", True),
                ("ndarray", np.zeros(3, dtype=np.float32)), ("object", object()), ("dict", {"a": 1})]
# optional tensor arguments (canonical) a non-tensor may be passed for even when the base leaves them None
_OPTIONAL_TENSORS = ["pse_shift", "atten_mask", "dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2",
                     "quant_offset2", "antiquant_scale", "antiquant_offset", "key_antiquant_scale",
                     "key_antiquant_offset", "value_antiquant_scale", "value_antiquant_offset", "block_table",
                     "query_padding_size", "kv_padding_size", "key_shared_prefix", "value_shared_prefix",
                     "query_rope", "key_rope", "dequant_scale_query", "learnable_sink"]


def m_nontensor(call, R, g):
    label, val = R.choice(_NON_TENSORS)
    if call.api == "update":
        slot = R.choice(["lse", "local_out", "lse_el", "out_el"])
        if slot in ("lse", "local_out"):
            return Mut(call.with_kw(**{slot: val}), "err", (slot,), f"{slot} = {label}")
        name = "lse" if slot == "lse_el" else "local_out"
        i = R.randrange(len(call.kw[name]))
        return Mut(put(call, (name, i), val), "err", (name,), f"{name}[{i}] = {label}")
    if call.api in ACL_OP:
        return None
    present = [p for p, _ in tensor_slots(call)]
    absent = [sp(call.api, c) for c in _OPTIONAL_TENSORS if sp(call.api, c) and call.kw.get(sp(call.api, c)) is None]
    if call.api in ("fused_out", "v2_out"):
        absent.append("workspace") if call.kw.get("workspace") is None else None
    if R.random() < 0.6:
        path = R.choice(present)
    else:
        path = (R.choice(absent),)
    c = cname(call, path)
    names = names_for(call, path)
    if c in ("query_padding_size", "kv_padding_size") and label == "int":
        return Mut(put(call, path, val), "either", names, f"{pname(path)} = {label}")
    if c in ("key_shared_prefix", "value_shared_prefix", "query_rope", "key_rope"):
        names += ("key_shared_prefix", "value_shared_prefix", "query_rope", "key_rope")
    return Mut(put(call, path, val), "err", names, f"{pname(path)} = {label}")


def noncontig(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The same values in a non-contiguous tensor (None when every axis has size <= 1)."""
    axes = [i for i, s in enumerate(t.shape) if s > 1]
    if not axes:
        return None
    ax = axes[-1]
    shape = list(t.shape)
    shape[ax] *= 2
    big = torch.zeros(shape, dtype=t.dtype)
    idx = [slice(None)] * t.dim()
    idx[ax] = slice(None, None, 2)
    view = big[tuple(idx)]
    view.copy_(t)
    if view.is_contiguous():
        return None
    torch.testing.assert_close(view, t, rtol=0, atol=0, equal_nan=True)
    return view


def m_noncontig(call, R, g):
    slots = list(tensor_slots(call))
    path, t = R.choice(slots)
    nc = noncontig(t)
    if nc is None:
        return None
    return Mut(put(call, path, nc), "same", (), f"{pname(path)} non-contiguous")


_NAN_ROLES = {"query", "key", "value", "pse_shift", "learnable_sink", "query_rope", "key_rope", "key_shared_prefix",
              "value_shared_prefix", "antiquant_scale", "antiquant_offset", "key_antiquant_scale",
              "value_antiquant_scale", "key_antiquant_offset", "value_antiquant_offset", "dequant_scale_query",
              "lse", "local_out"}


def m_nan(call, R, g):
    slots = [(p, t) for p, t in tensor_slots(call) if t.is_floating_point() and t.numel() and
             cname(call, p) in _NAN_ROLES]
    if not slots:
        return None
    path, t = R.choice(slots)
    x = t.clone()
    flat = R.randrange(x.numel())
    idx = tuple(int(i) for i in np.unravel_index(flat, tuple(x.shape)))
    x[idx] = float("nan")
    return Mut(put(call, path, x), "nan", (), f"{pname(path)}{list(idx)} = nan", nan_at=(path, idx))


def m_meta(call, R, g):
    """A tensor on another device (meta: always available)."""
    slots = [(p, t) for p, t in tensor_slots(call)]
    path, t = R.choice(slots)
    c = cname(call, path)
    new = t.to("meta")
    if c == "workspace" or (c == "softmax_lse" and not call.info.get("lse_flag")):
        return Mut(put(call, path, new), "same", (), f"{pname(path)} on meta")
    if call.api == "update" and call.info["K"] == 1:
        # every tensor of the call moved together is a consistent (meta) call
        return Mut(put(call, path, new), "either", ("lse", "local_out"), f"{pname(path)} on meta")
    names = names_for(call, path) + ("query", "key", "value")
    if c in ("lse", "local_out"):
        names += ("lse", "local_out")
    return Mut(put(call, path, new), "err", names, f"{pname(path)} on meta (query on cpu)")


def m_none_required(call, R, g):
    if call.api == "update":
        return None
    n = R.choice(["query", "key", "value"])
    return Mut(call.with_kw(**{n: None}), "err", (n,), f"{n} = None", status=161001)


# ---------------------------------------------------------------------------------------- scalar mutations
def m_num_heads(call, R, g):
    n = sp(call.api, "num_heads")
    if n is None or call.api == "update":
        return None
    N = call.info["N"]
    names = (n, sp(call.api, "num_key_value_heads"), "query", "key", "value", "query_rope")
    bsh = call.info["layout"].startswith("BSH")
    choices = [(N + 1, "either" if bsh else "err"), (2 * N, "either" if bsh else "err"), (0, "err"), (-N, "err"),
               (True, "err"), (float(N), "err"), (str(N), "err"), (None, "err"), (np.int64(N), "same"),
               (torch.tensor(N), "same"), (2 ** 40, "err"), ([N], "err")]
    v, e = R.choice(choices)
    return Mut(call.with_kw(**{n: v}), e, names, f"{n} = {v!r}")


def m_kv_heads(call, R, g):
    n = sp(call.api, "num_key_value_heads")
    if n is None or call.api == "update":
        return None
    N, K = call.info["N"], call.info["KVN"]
    names = (n, sp(call.api, "num_heads"), "key", "value")
    nd = [x for x in range(2, 2 * N + 2) if N % x]
    choices = [(-1, "err"), (-K, "err"), (True, "err"), (float(K), "err"), ("1", "err"), (np.int32(K), "same"),
               (K, "same")]
    if nd:
        choices.append((R.choice(nd), "err"))
    if K != N:
        choices.append((N, "err"))
        choices.append((0, "err"))
    else:
        choices.append((0, "same"))
    v, e = R.choice(choices)
    return Mut(call.with_kw(**{n: v}), e, names, f"{n} = {v!r}")


def m_scale(call, R, g):
    n = sp(call.api, "scale")
    if n is None or call.api == "update":
        return None
    cur = call.kw.get(n, 1.0)
    choices = [(float("nan"), "err"), (float("inf"), "err"), (-float("inf"), "err"), (1e39, "err"), ("0.5", "err"),
               (None, "err"),
               (True, "err"), ([0.5], "err"), (complex(1, 0), "err"), (torch.tensor(1 + 0j), "err"),
               (torch.tensor(True), "err"), (torch.tensor([cur, cur]), "err"), (np.float32(cur), "same"),
               (np.float64(cur), "same"), (-abs(cur), "ok"), (0.0, "ok")]
    if cur == 1.0:
        choices.append((1, "same"))
    v, e = R.choice(choices)
    return Mut(call.with_kw(**{n: v}), e, (n,), f"{n} = {v!r}")


_LAYOUTS = ["BSH", "BSND", "BNSD", "BNSD_BSND", "BSH_NBSD", "BSND_NBSD", "BNSD_NBSD", "TND", "TND_NTD", "NTD_TND"]


def m_layout(call, R, g):
    n = sp(call.api, "input_layout")
    if n is None or call.api == "update":
        return None
    cur = call.kw.get(n, "BSH")
    choices = [(cur.lower(), "err"), (cur + "X", "err"), (None, "err"), (1, "err"), ("", "err"), (" " + cur, "err"),
               ([cur], "err"), (R.choice([x for x in _LAYOUTS if x != cur]), "either")]
    # bytes: the char* of the aclnn interface (decoded there); not a str for the PyTorch functions
    choices.append((cur.encode(), "same" if call.api in ACL_OP else "err"))
    v, e = R.choice(choices)
    # another valid layout may fail on any argument (shapes, required lengths, rope dims...)
    return Mut(call.with_kw(**{n: v}), e, None if e == "either" else (n,), f"{n} = {v!r}")


def m_sparse(call, R, g):
    n = sp(call.api, "sparse_mode")
    if n is None:
        return None
    cur = call.kw.get(n, 0)
    choices = [(R.choice([5, 6, 7, 8]), "err"), (R.choice([-1, 9, 15, 2 ** 31, -2 ** 40]), "err"), (True, "err"),
               (float(cur), "err"), (str(cur), "err"), (None, "err"), (R.choice([0, 1, 2, 3, 4]), "either"),
               (np.int64(cur), "same")]
    if call.api == "prompt" and cur in (0, 1, 2, 3, 4):
        choices.append((cur + 10, "same"))
    v, e = R.choice(choices)
    if call.api != "prompt" and isinstance(v, int) and not isinstance(v, bool) and 10 <= v <= 14:
        e = "err"
    return Mut(call.with_kw(**{n: v}), e, (n, "atten_mask"), f"{n} = {v!r}")


def m_prenext(call, R, g):
    which = R.choice(["pre_tokens", "next_tokens"])
    n = sp(call.api, which)
    if n is None:
        return None
    band = call.info.get("band")
    ints = "either" if band else "same"
    choices = [(1.5, "err"), ("1", "err"), (None, "err"), (True, "err"), ([1], "err"), (2 ** 40, ints),
               (-2 ** 63, ints), (R.randint(-5, 5), ints), (np.int64(R.randint(-5, 5)), ints),
               (float("nan"), "err")]
    v, e = R.choice(choices)
    return Mut(call.with_kw(**{n: v}), e, ("pre_tokens", "next_tokens"), f"{n} = {v!r}")


def m_inner(call, R, g):
    n = sp(call.api, "inner_precise")
    if n is None:
        return None
    cur = call.kw.get(n, 1 if call.api in ("incre", "aclnn_ifa") else 0)
    decode = call.info.get("decode")
    choices = [(4, "err"), (-1, "err"), (7, "err"), (True, "err"), (1.0, "err"), ("0", "err"), (None, "err"),
               (cur ^ 1, "same"), (np.int64(cur), "same")]
    if decode:
        choices.append((R.choice([2, 3]), "err"))
    else:
        f16_mask = isinstance(call.kw.get(sp(call.api, "atten_mask") or ""), torch.Tensor) and \
            call.kw[sp(call.api, "atten_mask")].dtype == F16
        choices.append((cur ^ 2, "err" if f16_mask and not cur & 2 else "either"))
    v, e = R.choice(choices)
    return Mut(call.with_kw(**{n: v}), e, (n, "atten_mask"), f"{n} = {v!r}")


def m_block_size(call, R, g):
    n = sp(call.api, "block_size")
    if n is None:
        return None
    paged = call.info.get("paged")
    if paged:
        bs = call.info["bs"]
        choices = [(0, "err"), (-bs, "err"), (bs // 2, "err"), (bs * 2, "err"), (str(bs), "err"), (float(bs), "err"),
                   (None, "err"), (True, "err"), (np.int64(bs), "same"), (bs + 1, "err")]
    else:   # ignored without block_table (SPEC 15.11), but it must still be an int
        choices = [(16, "same"), (0, "same"), (-5, "same"), ("16", "err"), (16.0, "err"), (None, "err"),
                   ([16], "err"), (True, "err")]
    v, e = R.choice(choices)
    return Mut(call.with_kw(**{n: v}), e, (n, "block_table"), f"{n} = {v!r}")


def m_aq_mode(call, R, g):
    which = R.choice(["antiquant_mode", "key_antiquant_mode", "value_antiquant_mode", "query_quant_mode"])
    n = sp(call.api, which)
    if n is None:
        return None
    info = call.info
    sub = info.get("sub", "")
    active = (which == "antiquant_mode" and sub.endswith("comb")) or \
        (which != "antiquant_mode" and which != "query_quant_mode" and sub.endswith("sep"))
    names = (n, "key_antiquant_mode", "value_antiquant_mode", "antiquant_scale", "key_antiquant_scale",
             "value_antiquant_scale", "dequant_scale_query", "query_quant_mode", "dequant_scale_key",
             "dequant_scale_value", "key_quant_mode", "value_quant_mode")
    if which == "query_quant_mode":
        choices = [(R.choice([1, 2, 3, -1, 7]), "err"), ("0", "err"), (None, "err"), (0.0, "err")]
    elif active:
        choices = [(R.choice([-1, 7, 9, 100]), "err"), ("0", "err"), (None, "err"), (True, "err"), (1.0, "err")]
        if which == "antiquant_mode":
            choices.append((2, "err"))
        else:
            choices.append((6, "err"))       # FP4 per-token-group: unsupported
    else:   # not used by this call: any int is ignored, but it must be an int
        choices = [(R.choice([1, 2, 5]), "same"), ("0", "err"), (None, "err"), (1.5, "err"), (True, "err")]
    v, e = R.choice(choices)
    return Mut(call.with_kw(**{n: v}), e, names, f"{n} = {v!r}")


def m_lse_flag(call, R, g):
    n = sp(call.api, "softmax_lse_flag")
    if n is None or call.api in ACL_OP or call.api in ("fused_out", "v2_out"):
        return None
    cur = bool(call.kw.get(n, False))
    choices = [("True", "err"), (2, "err"), (None, "err"), (1.0, "err"), ([True], "err"), (int(cur), "same"),
               (-1, "err")]
    v, e = R.choice(choices)
    return Mut(call.with_kw(**{n: v}), e, (n,), f"{n} = {v!r}")


def m_update_type(call, R, g):
    if call.api != "update":
        return None
    v = R.choice([2, -1, True, "1", 1.0, None, [1], torch.tensor([0, 1]), np.int64(5)])
    return Mut(call.with_kw(update_type=v), "err", ("update_type",), f"update_type = {v!r}")


def m_reserved(call, R, g):
    base = FAMILY_OF_API[call.api]
    if base != "v2":
        return None
    n = R.choice(["query_dtype", "key_dtype", "value_dtype", "query_rope_dtype", "dequant_scale_key_rope",
                  "dequant_scale_query_dtype"])
    v = R.choice([1, torch.float16, "float16", torch.zeros(1)])
    return Mut(call.with_kw(**{n: v}), "err", (n,), f"{n} = {v!r}")


def m_block_ids(call, R, g):
    """Paged KV: a used block_table entry out of range must be an error (never an out-of-bounds read); an
    unused one is ignored."""
    info = call.info
    n = sp(call.api, "block_table")
    if not info.get("paged") or not isinstance(call.kw.get(n), torch.Tensor):
        return None
    bt = call.kw[n].clone()
    lens = call.kw[sp(call.api, "actual_seq_lengths_kv")]
    used = [(b, j) for b in range(bt.shape[0]) for j in range((lens[b] + info["bs"] - 1) // info["bs"])]
    unused = [(b, j) for b in range(bt.shape[0]) for j in range(bt.shape[1]) if (b, j) not in used]
    if unused and R.random() < 0.3:
        b, j = R.choice(unused)
        bt[b, j] = R.choice([info["nb"], -7, 2 ** 31 - 1, -2 ** 31])
        return Mut(call.with_kw(**{n: bt}), "same", (), f"{n}[{b}, {j}] (unused) = {int(bt[b, j])}")
    b, j = R.choice(used)
    bt[b, j] = R.choice([info["nb"], info["nb"] + 5, -1, -2, 2 ** 31 - 1, -2 ** 31])
    return Mut(call.with_kw(**{n: bt}), "err", (n,), f"{n}[{b}, {j}] (used) = {int(bt[b, j])}")


# ---------------------------------------------------------------------------------------- lengths
def _len_args(call):
    """[(keyword, kind)] of the lengths lists this call can take: kind q | kv | prefix."""
    out = []
    for c, kind in (("actual_seq_lengths", "q"), ("actual_seq_lengths_kv", "kv"), ("actual_shared_prefix_len", "p")):
        n = sp(call.api, c)
        if n is None or call.api == "update":
            continue
        if kind == "p" and call.info.get("family") != "prefix":
            continue
        out.append((n, kind))
    return out


def _effective(call, kind):
    """The per-batch list that means the same as the base (None when the test cannot tell)."""
    info = call.info
    n = sp(call.api, {"q": "actual_seq_lengths", "kv": "actual_seq_lengths_kv", "p": "actual_shared_prefix_len"}[kind])
    cur = call.kw.get(n)
    if cur is not None:
        cur = list(cur)
        if kind != "p" and len(cur) == 1 and not info.get("tnd") and info.get("B", 1) > 1:
            cur = cur * info["B"]            # a one-entry list applies to every batch
        return cur
    if kind == "p":
        return [info["PS"]]
    if info.get("tnd") or info.get("paged"):
        return None
    if kind == "q":
        return [info["QS"]] * info["B"]
    if info.get("kv_list"):
        return list(info["list_kvs"])
    return [info["KVS"]] * info["B"]


def m_lengths(call, R, g):
    args = _len_args(call)
    if not args:
        return None
    n, kind = R.choice(args)
    info = call.info
    eff = _effective(call, kind)
    tnd = info.get("tnd") and not (kind == "kv" and info.get("paged"))
    meaningless = kind == "q" and info.get("decode") and not info.get("tnd")
    val_expect = "either" if meaningless else "err"
    names = (n,) + (("block_table",) if info.get("paged") else ())
    forms = []
    if eff is not None:
        forms += [("tuple", tuple(eff), "same"), ("np.int32", np.array(eff, dtype=np.int32), "same"),
                  ("np.int64", np.array(eff, dtype=np.int64), "same"), ("int32 tensor", torch.tensor(eff, dtype=I32),
                                                                         "same"),
                  ("int64 tensor", torch.tensor(eff, dtype=I64), "same"),
                  ("np.int64 elements", [np.int64(x) for x in eff], "same")]
        if not tnd and kind != "p":
            forms.append(("too long", list(eff) + [R.randint(-9, 10 ** 6) for _ in range(R.randint(1, 3))],
                          "either" if meaningless else "same"))
        if kind == "p":
            forms += [("two entries", eff + eff, "err"), ("exceeding", [info["PS"] + 1], "err"), ("negative", [-1], "err")]
        elif tnd:
            if len(eff) >= 2:
                bad = list(eff)
                bad[0] = bad[-1] + 1
                forms.append(("decreasing", bad, "err"))
            forms += [("last != T", eff[:-1] + [eff[-1] + 1], "err"), ("extra entry", eff + [eff[-1] + 1], "err"),
                      ("negative", [-1] + eff[1:], "err")]
            if kind == "kv":
                forms.append(("one entry fewer", eff[:-1] if len(eff) > 1 else [], "err"))
        else:
            i = R.randrange(len(eff))
            neg = list(eff)
            neg[i] = -R.randint(1, 5)
            forms.append(("negative", neg, val_expect))
            lim = info["QS"] if kind == "q" else info.get("cap") or (info["list_kvs"][i] if info.get("kv_list")
                                                                     else info["KVS"])
            exc = list(eff) if len(eff) > 1 else list(eff) * 1
            exc[i if len(exc) > 1 else 0] = lim + R.randint(1, 3) if not info.get("kv_list") or len(exc) > 1 \
                else max(info["list_kvs"]) + 1
            forms.append(("exceeding", exc, val_expect))
            if info["B"] >= 3:
                forms.append(("too short", eff[:2] if len(eff) >= 3 else [eff[0]] * 2, val_expect))
            forms.append(("empty", [], val_expect))
    forms += [("float element", [1.0], "err"), ("str element", ["1"], "err"), ("nested", [[1]], "err"),
              ("None element", [None], "err"), ("bool element", [True], "err"),
              ("float ndarray", np.array([1.0, 2.0]), "err"), ("float tensor", torch.tensor([1.0]), "err"),
              ("2-D tensor", torch.ones(1, 2, dtype=I64), "err"), ("str", "1,2", "err"), ("dict", {0: 1}, "err"),
              ("scalar int", 1, "err"), ("meta tensor", torch.ones(2, dtype=I64, device="meta"), "err"),
              ("bool tensor", torch.ones(2, dtype=BOOL), "err")]
    label, v, e = R.choice(forms)
    return Mut(call.with_kw(**{n: v}), e, names, f"{n} {label}: {v!r}")


# ---------------------------------------------------------------------------------------- structural
def m_unknown_kw(call, R, g):
    if call.api in ACL_OP:
        return None
    name = R.choice(["foo", "num_head", "scale_value" if FAMILY_OF_API[call.api] == "fused" else "scale",
                     "layout", "sparse"])
    if name in call.kw or (FAMILY_OF_API[call.api] and name in SIGS[FAMILY_OF_API[call.api]]):
        return None
    return Mut(call.with_kw(**{name: 1}), "type", (name,), f"unknown keyword {name}")


def m_v2_v1only(call, R, g):
    if FAMILY_OF_API[call.api] != "v2":
        return None
    name = R.choice(["antiquant_scale", "dequant_scale1", "key_shared_prefix", "query_padding_size", "num_heads",
                     "softmax_lse_flag", "actual_seq_lengths"])
    return Mut(call.with_kw(**{name: R.choice([torch.ones(1), 1])}), "type", (name,), f"v1-only keyword {name}")


def m_positional(call, R, g):
    if call.api == "update":
        kw = call.kw
        opts = [(kw["lse"],), (kw["lse"], kw["local_out"], kw["update_type"], 5)]
        pos = R.choice(opts)
        c = Call(call.api, {}, call.info, pos)
        return Mut(c, "type", (), f"{len(pos)} positional arguments")
    if call.api in ACL_OP:
        kw = dict(call.kw)
        op = ACL_OP[call.api]
        defaults = FUSED_DEFAULTS if call.api == "aclnn_v4" else _INCRE_DEFAULTS
        args = [kw.get(t, defaults.get(t)) for _, t in _acl_table(op)] + [kw["attentionOut"]]
        if call.api == "aclnn_v4":
            args.append(kw["softmaxLse"])
        args = args[:-1] if R.random() < 0.5 else args + [None]
        return Mut(Call(call.api, call.kw, call.info, tuple(args)), "type", (), f"{len(args)} positional arguments")
    q, k, v = call.kw["query"], call.kw["key"], call.kw["value"]
    pos = R.choice([(q, k), (q,), (q, k, v, v)])
    return Mut(Call(call.api, call.kw, call.info, pos), "type", (), f"{len(pos)} positional arguments")


def m_batch_mismatch(call, R, g):
    info = call.info
    if call.api == "update" or info.get("tnd") or info.get("paged") or info.get("kv_list"):
        return None
    ch = {}
    for n in ("key", "value"):
        t = call.kw[n]
        ch[n] = resize(g, t, 0, t.shape[0] + 1)
    return Mut(call.with_kw(**ch), "err", ("key", "value", "query"), "key+value batch + 1")


def m_kv_shape(call, R, g):
    """key and value shapes disagree on a non-D axis (S for dense, blocks for paged)."""
    info = call.info
    if call.api == "update" or info.get("kv_list"):
        return None
    v = call.kw["value"]
    ax = 0 if info.get("paged") else (0 if info.get("tnd") and not info["layout"].startswith("NTD") else
                                      1 if info.get("tnd") else _seq_axis(info["layout"]))
    nv = resize(g, v, ax, v.shape[ax] + 1)
    return Mut(call.with_kw(value=nv), "err", ("value", "key"), f"value axis {ax} + 1 (key unchanged)")


def m_list(call, R, g):
    info = call.info
    if not info.get("kv_list"):
        return None
    keys, vals = list(call.kw["key"]), list(call.kw["value"])
    op = R.choice(["drop both", "drop key", "batch 2", "dtype one", "value tensor", "empty", "N differs",
                   "extra both"])
    if op == "drop both":
        return Mut(call.with_kw(key=keys[:-1], value=vals[:-1]), "err", ("key", "value"), "lists one short")
    if op == "extra both":
        return Mut(call.with_kw(key=keys + keys[:1], value=vals + vals[:1]), "err", ("key", "value"), "lists one long")
    if op == "drop key":
        return Mut(call.with_kw(key=keys[:-1]), "err", ("key", "value"), "key list one short")
    if op == "batch 2":
        i = R.randrange(len(keys))
        keys[i] = torch.cat([keys[i], keys[i]])
        vals[i] = torch.cat([vals[i], vals[i]])
        return Mut(call.with_kw(key=keys, value=vals), "err", ("key", "value"), f"element {i} batch 2")
    if op == "dtype one":
        i = R.randrange(len(keys))
        keys[i] = keys[i].to(F32)
        return Mut(call.with_kw(key=keys), "err", ("key", "value"), f"key element {i} float32")
    if op == "value tensor":
        return Mut(call.with_kw(value=vals[0]), "err", ("key", "value"), "key list, value tensor")
    if op == "empty":
        return Mut(call.with_kw(key=[], value=[]), "err", ("key", "value"), "empty lists")
    i = R.randrange(len(keys))
    ax = {"BSH": 2, "BSND": 2, "BNSD": 1}[info["layout"].split("_")[0]]
    keys[i] = resize(g, keys[i], ax, keys[i].shape[ax] + (info["D"] if ax == 2 and info["layout"] == "BSH" else 1))
    vals[i] = resize(g, vals[i], ax, vals[i].shape[ax] + (info["D"] if ax == 2 and info["layout"] == "BSH" else 1))
    return Mut(call.with_kw(key=keys, value=vals), "err", ("key", "value", "num_key_value_heads"),
               f"element {i} with another head count")


def m_out(call, R, g):
    """.out / aclnn caller buffers: wrong containers, None."""
    if call.api in ("fused_out", "v2_out"):
        ao = call.kw.get("attention_out")
        lo = call.kw.get("softmax_lse")
        if "out" in call.kw:
            ao, lo = call.kw["out"]
        base = {k: v for k, v in call.kw.items() if k not in ("out", "attention_out", "softmax_lse")}
        op = R.choice(["tensor", "one", "three", "none", "both spellings", "None in list", "missing lse kw"])
        if op == "tensor":
            return Mut(Call(call.api, dict(base, out=ao), call.info), "err", ("out",), "out = a tensor")
        if op == "one":
            return Mut(Call(call.api, dict(base, out=[ao]), call.info), "err", ("out",), "out = [attention_out]")
        if op == "three":
            return Mut(Call(call.api, dict(base, out=[ao, lo, lo]), call.info), "err", ("out",), "out of 3")
        if op == "none":
            return Mut(Call(call.api, base, call.info), "err", ("out",), "no outputs", status=161001)
        if op == "both spellings":
            return Mut(Call(call.api, dict(base, out=[ao, lo], attention_out=ao), call.info), "err", ("out",),
                       "out= and attention_out=")
        if op == "None in list":
            return Mut(Call(call.api, dict(base, out=[None, lo]), call.info), "err", ("out", "out[0]"),
                       "out[0] = None", status=161001)
        return Mut(Call(call.api, dict(base, attention_out=ao), call.info), "err", ("softmax_lse",),
                   "softmax_lse missing", status=161001)
    if call.api in ACL_OP:
        op = R.choice(["none", "lse none"])
        if op == "none":
            return Mut(call.with_kw(attentionOut=None), "err", ("attentionOut",), "attentionOut None", status=161001)
        if call.api == "aclnn_v4":
            return Mut(call.with_kw(softmaxLse=None), "err" if call.info.get("lse_flag") else "same",
                       ("softmaxLse",), "softmaxLse None")
    return None


CATALOGUE: List[Tuple[Callable, int]] = [
    (m_dtype, 12), (m_rank, 7), (m_axis, 14), (m_zero, 5), (m_nontensor, 8), (m_noncontig, 9), (m_nan, 8),
    (m_meta, 4), (m_none_required, 2), (m_num_heads, 4), (m_kv_heads, 3), (m_scale, 3), (m_layout, 3),
    (m_sparse, 3), (m_prenext, 3), (m_inner, 3), (m_block_size, 3), (m_aq_mode, 3), (m_lse_flag, 2),
    (m_update_type, 3), (m_reserved, 1), (m_block_ids, 25), (m_lengths, 12), (m_unknown_kw, 2), (m_v2_v1only, 1), (m_positional, 2),
    (m_batch_mismatch, 2), (m_kv_shape, 2), (m_list, 4), (m_out, 3),
]


def draw(seed: int):
    """seed -> (base call, mutation), both from the seed alone."""
    R = random.Random(f"fia-fuzz-invalid-{seed}")
    g = torch.Generator().manual_seed(seed)
    fams = list(FAMILIES)
    fam = R.choices(fams, weights=[FAMILIES[f][1] for f in fams])[0]
    base = FAMILIES[fam][0](R, g)
    fns = [m for m, _ in CATALOGUE]
    weights = [w for _, w in CATALOGUE]
    for _ in range(200):
        m = R.choices(fns, weights=weights)[0](base, R, g)
        if m is not None:
            return base, m
    raise AssertionError("no applicable mutation")   # pragma: no cover


# ============================================================================================ checks
def _ident(msg: str, name: str) -> bool:
    return re.search(r"(?<![A-Za-z0-9_])" + re.escape(name) + r"(?![A-Za-z0-9_])", msg) is not None


def _expand(call: Call, names) -> set:
    """The names an error may carry: as given, in the api's spelling, and (aclnn) the prototype's spelling."""
    out = set(n for n in names if n)
    out |= {sp(call.api, n) for n in list(out) if sp(call.api, n)}
    if out and call.api in ("fused_out", "v2_out", "aclnn_v4", "aclnn_ifa"):
        # a mutation that changes the output's shape is reported on the caller's output buffer
        out |= {"out", "out[0]", "out[1]", "attention_out", "softmax_lse"}
    if call.api in ACL_OP:
        back = {t: a for a, t in aclnn.names(ACL_OP[call.api]).items()}
        back.update(attention_out="attentionOut", softmax_lse="softmaxLse")
        out |= {back[n] for n in list(out) if n in back}
    return out


def names_error(err: BaseException, names: set) -> bool:
    arg = getattr(err, "argument", None)
    if arg is not None and arg in names:
        return True
    msg = str(err)
    return any(_ident(msg, n) for n in names)


def _finite(call: Call) -> bool:
    """Every input finite (the caller's output buffers are not inputs: they start as NaN)."""
    for p, t in tensor_slots(call):
        if cname(call, p) in ("attention_out", "softmax_lse", "workspace"):
            continue
        if t.is_floating_point() and t.device.type != "meta" and t.numel() and not torch.isfinite(t.float()).all():
            return False
    return True


def _tol(dt):
    return {F16: 2e-3, BF16: 1.6e-2}.get(dt, 1e-5)


def assert_same(got, want, what=""):
    for i, (x, y) in enumerate(zip(got, want)):
        if x is None or y is None:
            continue
        assert tuple(x.shape) == tuple(y.shape) and x.dtype == y.dtype, \
            f"{what} output {i}: {tuple(x.shape)}/{x.dtype} != unmutated {tuple(y.shape)}/{y.dtype}"
        if x.numel() == 0:
            continue
        if x.dtype == I8:
            assert (x.int() - y.int()).abs().max() <= 1, f"{what} output {i} differs from the unmutated call"
        elif x.is_floating_point():
            torch.testing.assert_close(x.float(), y.float(), atol=_tol(x.dtype), rtol=_tol(x.dtype), equal_nan=True,
                                       msg=lambda m, i=i: f"{what} output {i} differs from the unmutated call: {m}")
        else:
            assert torch.equal(x, y), f"{what} output {i} differs"


def check_nan(call: Call, mut: Mut, got, want):
    """Where the geometry is simple, the injected NaN reaches exactly the outputs IEEE arithmetic says."""
    info = call.info
    (path, idx) = mut.nan_at
    out, lse = got
    assert out.shape == want[0].shape, f"output shape {tuple(out.shape)} != {tuple(want[0].shape)}"
    if call.api == "update":
        k = path[1]
        r = idx[0]
        lse_k = call.kw["lse"][k][r]
        exp = torch.zeros(out.shape, dtype=torch.bool)
        if path[0] == "lse":
            exp[r, :] = True
        elif not torch.isinf(lse_k):
            exp[r, idx[1]] = True
        _compare_masked(out, want[0], exp)
        if lse is not None and path[0] == "lse":
            assert torch.isnan(lse[r]), "lse_out of the row with a NaN lse is not NaN"
        return
    if not (info.get("simple") and info["family"] == "dense" and path[0] in ("query", "key", "value")
            and call.api in ("fused", "v2", "incre", "prompt")):
        return
    lay, N, G = info["layout"], info["N"], info["N"] // info["KVN"]
    pos = torch.zeros(call.kw[path[0]].shape, dtype=torch.bool)
    pos[idx] = True
    n_of = N if path[0] == "query" else info["KVN"]
    b, n, s, d = [int(x) for x in from_layout(pos, lay, n_of).nonzero()[0]]
    exp = torch.zeros(info["B"], N, info["QS"], info["D"], dtype=torch.bool)
    if path[0] == "query":
        exp[b, n, s, :] = True
    elif path[0] == "key":
        exp[b, n * G:(n + 1) * G, :, :] = True
    else:
        exp[b, n * G:(n + 1) * G, :, d] = True
    _compare_masked(from_layout(out, lay, N), from_layout(want[0], lay, N), exp)


def _compare_masked(got, want, exp):
    nan = torch.isnan(got.float())
    assert bool(nan[exp].all()), f"the NaN did not reach {int((~nan[exp]).sum())} outputs it feeds (IEEE)"
    assert not bool(nan[~exp].any()), f"NaN in {int(nan[~exp].sum())} outputs the NaN input does not feed"
    torch.testing.assert_close(got.float()[~exp], want.float()[~exp], atol=_tol(got.dtype), rtol=_tol(got.dtype))


def _outcome(call: Call):
    try:
        return "ok", run_clone(call)
    except BaseException as e:       # every exception is judged below
        return "raise", e


def _fmt(e: BaseException) -> str:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
    return f"{type(e).__name__}: {e}\n{tb}"


def judge(base: Call, mut: Mut, base_res, forced: Optional[str] = None):
    """Assert the mutated call behaves as its expectation says."""
    call = mut.call
    ctx = f"[{base.info['family']}/{base.api}] mutation: {mut.label} (expect {mut.expect})\n  base: {base.describe()}"
    kind, res = _outcome(call)
    names = _expand(call, mut.names or ())
    if kind == "raise":
        e = res
        if forced and isinstance(e, FiaBackendUnavailable) and mut.expect in ("same", "ok", "nan", "either"):
            return
        if mut.expect == "type":
            if not isinstance(e, TypeError):
                pytest.fail(f"{ctx}\n  expected TypeError, got {_fmt(e)}")
            if names and not names_error(e, names):
                pytest.fail(f"{ctx}\n  the TypeError names none of {sorted(names)}: {e}")
            return
        if isinstance(e, FiaInputError):
            if mut.expect in ("same", "ok", "nan"):
                pytest.fail(f"{ctx}\n  a valid call was rejected: {e}")
            assert e.status in (161001, 161002), f"{ctx}\n  status {e.status}"
            if mut.status is not None:
                assert e.status == mut.status, f"{ctx}\n  status {e.status} != {mut.status}: {e}"
            if names and not names_error(e, names):
                pytest.fail(f"{ctx}\n  the error names none of {sorted(names)}: {e}")
            if mut.names is None and e.argument is None and not any(_ident(str(e), n) for n in _all_names(call)):
                pytest.fail(f"{ctx}\n  the error names no argument: {e}")
            return
        if isinstance(e, FiaUnsupportedError) and not isinstance(e, FiaBackendUnavailable):
            if mut.expect in ("same", "ok", "nan"):
                pytest.fail(f"{ctx}\n  a valid call was declared unsupported: {e}")
            if names and not names_error(e, names):
                pytest.fail(f"{ctx}\n  the unsupported error names none of {sorted(names)}: {e}")
            return
        pytest.fail(f"{ctx}\n  FINDING: {_fmt(e)}")
    got = res
    if mut.expect in ("err", "type"):
        pytest.fail(f"{ctx}\n  an invalid call succeeded (output {tuple(got[0].shape) if got[0] is not None else None})")
    if base_res is None:          # the forced backend declined the base: nothing to compare
        return
    if mut.expect == "same":
        try:
            assert_same(got, base_res, ctx)
        except AssertionError:
            known_backend_finding(mut, base_res, forced)
            raise
    elif mut.expect == "nan":
        check_nan(base, mut, got, base_res)
    elif mut.expect == "either" and _finite(call):
        for x in got:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type != "meta" and x.numel():
                if call.api == "update" and x.dim() == 1:
                    continue          # lse_out is +inf for rows without a partial
                assert not torch.isnan(x.float()).any(), f"{ctx}\n  NaN output from finite inputs"


def known_backend_finding(mut: Mut, base_res, forced: Optional[str]) -> None:
    """A non-contiguous input the reference backend computes right but the chosen (or forced) backend does not:
    a backend bug (src/fia/backends is not part of the validation layer), reported as such."""
    if "non-contiguous" not in mut.label or forced == "reference":
        return
    with fia.use_backend("reference"):
        ref = run_clone(mut.call)
    try:
        assert_same(ref, base_res)
    except AssertionError:
        return                     # the reference disagrees too: not (only) a backend stride bug
    pytest.fail(f"backend finding: {forced or 'the automatically chosen backend'} computes a wrong result for "
                 f"a non-contiguous input the reference backend gets right ({mut.label})")


def _all_names(call):
    base = FAMILY_OF_API[call.api]
    ns = set(SIGS[base]) if base else {"lse", "local_out", "update_type"}
    return _expand(call, ns | {"query", "key", "value", "out", "workspace", "attention_out", "softmax_lse"})


# ============================================================================================ tests
def run_case(seed: int, backend: Optional[str] = None):
    base, mut = draw(seed)
    if backend is None:
        base_res = run_clone(base)            # the unmutated call must be valid
    else:
        with fia.use_backend(backend):
            try:
                base_res = run_clone(base)
            except FiaBackendUnavailable:
                base_res = None
    if backend is None:
        judge(base, mut, base_res)
        return
    with fia.use_backend(backend):
        if mut.expect in ("err", "type"):
            k1, r1 = _outcome(mut.call)
            with fia.use_backend(None):
                k0, r0 = _outcome(mut.call)
            if k1 == "raise" and k0 == "raise" and type(r1) is type(r0) and str(r1) == str(r0):
                return
            if k1 == "raise" and k0 == "raise" and isinstance(r0, FiaUnsupportedError) and \
                    isinstance(r1, FiaUnsupportedError):
                return
            judge(base, mut, base_res, forced=backend)      # reports what the forced backend did
            pytest.fail(f"[{base.info['family']}] {mut.label}: forced backend {backend!r} fails differently: "
                        f"{r1!r} vs automatic {r0!r}")
        judge(base, mut, base_res, forced=backend)


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed_{s}" for s in SEEDS])
def test_fuzz_invalid(seed):
    run_case(seed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", FORCED_SEEDS, ids=[f"seed_{s}" for s in FORCED_SEEDS])
def test_fuzz_invalid_forced_backend(seed, backend):
    run_case(seed, backend)


def test_catalogue_coverage():
    """The seeds exercise every family and every expectation, and most cases are invalid calls."""
    fams, expects = set(), {}
    for s in SEEDS:
        base, mut = draw(s)
        fams.add(base.info["family"])
        expects[mut.expect] = expects.get(mut.expect, 0) + 1
    assert fams == set(FAMILIES), set(FAMILIES) - fams
    assert all(expects.get(e, 0) > 0 for e in ("err", "type", "same", "ok", "nan", "either")), expects
    assert expects.get("err", 0) >= N_CASES // 2, expects


# ============================================================================================ findings
# Every finding of this fuzzer, as a fixed regression case (the seeds above may draw them or not).
def _q(*shape, dtype=F16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(7)).to(dtype)


def _fused(**kw):
    q, k, v = _q(2, 2, 4, 16), _q(2, 2, 6, 16), _q(2, 2, 6, 16)
    args = dict(query=q, key=k, value=v, num_heads=2, input_layout="BNSD")
    args.update(kw)
    q, k, v = args.pop("query"), args.pop("key"), args.pop("value")
    return fia.npu_fused_infer_attention_score(q, k, v, **args)


def _paged(**kw):
    q, kc = _q(2, 2, 1, 16), _q(3, 16, 32)
    args = dict(num_heads=2, input_layout="BNSD", block_table=torch.tensor([[0, 2], [1, -1]], dtype=I32),
                block_size=16, actual_seq_lengths_kv=[20, 9])
    args.update(kw)
    return fia.npu_fused_infer_attention_score(q, kc, kc, **args)


def _full8(**kw):
    i8 = torch.ones(2, 2, 4, 32, dtype=I8)
    args = dict(num_heads=2, input_layout="BNSD", dequant_scale1=torch.tensor([1e-3]),
                quant_scale1=torch.tensor([100.0]), dequant_scale2=torch.tensor([1e-3]))
    args.update(kw)
    return fia.npu_fused_infer_attention_score(i8, i8, i8, **args)


def _update(lse=None, outs=None, update_type=1):
    lse = lse if lse is not None else [torch.zeros(3), torch.ones(3)]
    outs = outs if outs is not None else [_q(3, 4), _q(3, 4)]
    return fia.npu_attention_update(lse, outs, update_type)


META = torch.device("meta")
FINDINGS = [
    # a tensor on another device reached a CPU kernel: segmentation fault
    ("key on meta", lambda: _fused(key=_q(2, 2, 6, 16).to(META)), "key"),
    ("value on meta", lambda: _fused(value=_q(2, 2, 6, 16).to(META)), "value"),
    ("atten_mask on meta", lambda: _fused(atten_mask=torch.zeros(4, 6, dtype=BOOL, device=META)), "atten_mask"),
    ("pse_shift on meta", lambda: _fused(pse_shift=_q(2, 2, 4, 6).to(META)), "pse_shift"),
    ("query_rope on meta", lambda: _fused(query_rope=_q(2, 2, 4, 64).to(META), key_rope=_q(2, 2, 6, 64)),
     "query_rope"),
    # host reads of a meta tensor: NotImplementedError / RuntimeError from torch
    ("block_table on meta", lambda: _paged(block_table=torch.tensor([[0, 2], [1, -1]], dtype=I32, device=META)),
     "block_table"),
    ("lengths tensor on meta", lambda: _fused(actual_seq_lengths=torch.tensor([4, 4], device=META)),
     "actual_seq_lengths"),
    ("padding size on meta", lambda: _fused(actual_seq_lengths=[2], query_padding_size=torch.tensor([1], device=META)),
     "query_padding_size"),
    ("dequant_scale1 on meta", lambda: _full8(dequant_scale1=torch.tensor([1e-3], device=META)), "dequant_scale1"),
    ("num_heads as a meta tensor", lambda: _fused(num_heads=torch.tensor(2, device=META)), "num_heads"),
    # scalar tensors ctx.number converted with float(): TypeError for complex, bool silently 1.0
    ("scale complex tensor", lambda: _fused(scale=torch.tensor(1 + 0j)), "scale"),
    ("scale bool tensor", lambda: _fused(scale=torch.tensor(True)), "scale"),
    # integer attributes a call does not use were not type-checked at all
    ("block_size str without block_table", lambda: _fused(block_size="16"), "block_size"),
    ("antiquant_mode str with float K/V", lambda: _fused(antiquant_mode="0"), "antiquant_mode"),
    ("key_antiquant_mode None with float K/V", lambda: _fused(key_antiquant_mode=None), "key_antiquant_mode"),
    # a non-tensor was reported as the *other* argument of its pair
    ("quant_offset2 str", lambda: _fused(quant_offset2="abc"), "quant_offset2"),
    ("query_rope int", lambda: _fused(query_rope=3), "query_rope"),
    ("v2 quant_offset_out str", lambda: fia.npu_fused_infer_attention_score_v2(
        _q(2, 2, 4, 16), _q(2, 2, 6, 16), _q(2, 2, 6, 16), num_query_heads=2, input_layout="BNSD",
        quant_offset_out="abc"), "quant_offset_out"),
    ("key dtype mismatch names key", lambda: _fused(key=_q(2, 2, 6, 16).double()), "key"),
    # v1 names inside v2 messages
    ("v2 separate scales shape", lambda: fia.npu_fused_infer_attention_score_v2(
        _q(1, 2, 1, 32), torch.ones(1, 2, 3, 32, dtype=I8), torch.ones(1, 2, 3, 32, dtype=I8), num_query_heads=2,
        input_layout="BNSD", dequant_scale_key=torch.ones(1, 1, 3), dequant_scale_value=torch.ones(1, 3),
        key_quant_mode=1, value_quant_mode=1), "dequant_scale_value"),
    # npu_attention_update
    ("update int local_out", lambda: _update(outs=[torch.ones(3, 4, dtype=I32)] * 2), "local_out"),
    ("update complex local_out", lambda: _update(outs=[torch.ones(3, 4, dtype=C64)] * 2), "local_out"),
    ("update local_out on meta", lambda: _update(outs=[_q(3, 4), _q(3, 4).to(META)]), "local_out"),
    ("update lse on meta", lambda: _update(lse=[torch.zeros(3), torch.zeros(3, device=META)]), "lse"),
    ("update_type tensor", lambda: _update(update_type=torch.tensor([0, 1])), "update_type"),
]


@pytest.mark.parametrize("case", FINDINGS, ids=[f[0] for f in FINDINGS])
def test_finding_regressions(case):
    label, call, name = case
    with pytest.raises(FiaInputError) as e:
        call()
    assert e.value.argument == name, f"{label}: {e.value}"
    assert e.value.status == 161002
    if label.startswith("v2"):         # v2 messages speak v2: no v1-only keyword inside
        assert not re.search(r"key_antiquant|value_antiquant|quant_offset2|quant_scale2", str(e.value)), e.value


def test_finding_update_nan_lse_propagates():
    """A NaN lse is not an "empty partial" marker (only +-inf are): its row becomes NaN (SPEC 14)."""
    lse = [torch.tensor([0.0, float("nan"), 1.0]), torch.tensor([1.0, 0.0, float("inf")])]
    outs = [_q(3, 4, dtype=F32), _q(3, 4, dtype=F32)]
    out, l = fia.npu_attention_update(lse, outs, 1)
    ref, lref = fia.npu_attention_update([lse[0][[0, 2]], lse[1][[0, 2]]], [o[[0, 2]] for o in outs], 1)
    assert torch.isnan(out[1]).all() and torch.isnan(l[1])
    torch.testing.assert_close(out[[0, 2]], ref)
    torch.testing.assert_close(l[[0, 2]], lref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_finding_noncontiguous_head_dim(backend):
    """BACKEND FINDING (fixed): a key/value/query whose last axis has a stride != 1 must give the contiguous
    result. The prefill backend ignored that stride (wrong numbers, no error): the ATen flash kernel assumes a
    unit head-dim stride, so prefill now copies such an input."""
    q, k, v = _q(2, 1, 3, 16), _q(2, 1, 6, 16), _q(2, 1, 6, 16)
    with fia.use_backend(backend):
        try:
            want = fia.npu_fused_infer_attention_score(q, k, v, num_heads=1, input_layout="BNSD")[0]
        except FiaBackendUnavailable:
            pytest.skip(f"{backend} does not run this problem")
        for name in ("query", "key", "value"):
            args = dict(query=q, key=k, value=v)
            args[name] = noncontig(args[name])
            got = fia.npu_fused_infer_attention_score(args["query"], args["key"], args["value"], num_heads=1,
                                                      input_layout="BNSD")[0]
            assert torch.allclose(got.float(), want.float(), atol=2e-3, rtol=2e-3), \
                f"{backend} computes a wrong result for a {name} with a strided head dim"
