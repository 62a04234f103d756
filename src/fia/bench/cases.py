"""The case table and the input builders.

Every case is BNSD unless its name says otherwise. Decode: Q_S = 1, no mask; the K/V cache is dense, paged
(block 128, a shuffled block table over a shared pool), int8 with per-channel (mode 0) or per-token (mode 1)
antiquant scales, or FP4 E2M1 with per-token-group FLOAT8_E8M0 scales (mode 6, the "-fp4" cases); the "-bsnd" cases keep a dense cache as [B, S, KV_N, D] (BSND), the "-bsh" paged ones a pool
[blocks, block_size, KV_N * D] (BSH): a token's rows of all KV heads side by side. "-int8-paged": a 4-D paged int8
pool [blocks, KV_N, block_size, D] with per-channel scales; "-int8-nz": the same pool as the 5-D NZ cache
(blocks, KV_N, D/32, block_size, 32) of SPEC 8b, whose twin is the 4-D pool (not a dense cache). "decode-fp32-*":
float32 query, K and V (portable mode, as float32 models run), SDPA in float32.
Prefill: Q_S = KV_S = S, one of causal (sparse_mode 2 + the 2048x2048 template), band (sparse_mode 4,
pre = next = 256, template), pse_shift (an ALiBi bias [1, N, S, S], no mask) or "psecausal": the ALiBi bias with the
causal mask (sparse_mode 2 + template).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np
import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
FP32 = {"fp32": torch.float32}       # the float32 decode cases (portable mode: float32 is not an NPU input dtype)
STORAGES = ("dense", "paged", "int8-chan", "int8-tok")
MASKS = ("causal", "band", "pse", "psecausal")


@dataclass(frozen=True)
class Case:
    name: str
    kind: str                 # "decode" | "prefill"
    dtype: str                # "fp16" | "bf16" | "fp32" (dense decode only)
    B: int
    N: int                    # query heads
    KV_N: int
    D: int
    S_q: int
    S_kv: int
    storage: str = "dense"    # dense | paged | int8-chan | int8-tok | fp4 | int8-paged | int8-nz
    layout: str = "BNSD"      # BNSD | BSND (dense) | BSH (paged): how K / V (and Q) are laid out
    mask: str = "none"        # none | causal | band | pse | psecausal
    block_size: int = 128
    pre: int = 256
    next: int = 256
    min_repeats: int = 0      # timed calls at least (tiny calls need many for a stable median)

    @property
    def G(self) -> int:
        return self.N // self.KV_N

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES.get(self.dtype) or FP32[self.dtype]

    def unmasked_pairs(self) -> int:
        """Number of (query row, key) pairs that take part, per (batch, head)."""
        s1, s2 = self.S_q, self.S_kv
        if self.mask in ("none", "pse"):
            return s1 * s2
        i = np.arange(s1, dtype=np.int64)
        if self.mask in ("causal", "psecausal"):       # sparse_mode 2: j <= i
            lo, hi = np.zeros_like(i), np.minimum(i, s2 - 1)
        else:                                          # sparse_mode 4: band on the bottom-right diagonal
            pre, nxt = self.pre - s2 + s1, self.next + s2 - s1
            lo, hi = np.maximum(i - pre, 0), np.minimum(i + nxt, s2 - 1)
        return int(np.clip(hi - lo + 1, 0, None).sum())

    def flops(self) -> int:
        """4·B·N·D·(unmasked pairs): QKᵀ and PV, 2 flop per multiply-add, masked work not counted."""
        return 4 * self.B * self.N * self.D * self.unmasked_pairs()

    def kv_bytes(self) -> int:
        """Bytes of K and V as stored (int8: 1 byte/element, plus their scales); paged: the used blocks."""
        elems = self.B * self.KV_N * self.S_kv * self.D
        if self.storage == "fp4":                      # two values a byte + one E8M0 byte per 32 values
            return 2 * (elems // 2 + elems // 32)
        if self.storage.startswith("int8"):
            scales = 2 * (self.KV_N * self.D * 2 if self.per_channel else self.B * self.S_kv * 4)
            return 2 * elems + scales
        return 2 * elems * self.torch_dtype.itemsize

    @property
    def per_channel(self) -> bool:
        return self.storage in ("int8-chan", "int8-paged", "int8-nz")

    @property
    def paged(self) -> bool:
        return self.storage in ("paged", "int8-paged", "int8-nz")

    def dense_twin(self) -> Optional["Case"]:
        """The same decode problem with a dense K / V cache of the case's dtype, for paged and int8 cases:
        the paged (within 15 % of dense) and int8 (>= 1.6x our dense run) targets are ratios to it,
        so the bench times it in the same blocks as the case (a ratio of two cases timed minutes apart
        measures the host's drift: the same call took 7.0-18.9 ms within the hour)."""
        if self.kind != "decode" or (self.storage == "dense" and self.layout == "BNSD"):
            return None
        if self.storage == "int8-nz":                  # NZ: the same pool as a 4-D cache (within 15 % of it)
            return replace(self, name=f"{self.name}:4d", storage="int8-paged")
        return replace(self, name=f"{self.name}:dense", storage="dense", layout="BNSD")

    def input_bytes(self) -> int:
        """Rough resident size of the inputs (for the memory guard)."""
        esz = self.torch_dtype.itemsize
        pse = self.B * self.N * self.S_q * self.S_kv * esz if self.mask.startswith("pse") else 0
        return self.kv_bytes() + self.B * self.N * self.S_q * self.D * esz + pse


def decode_case(dtype: str, storage: str, S_kv: int, B=8, N=32, KV_N=8, D=128, layout="BNSD") -> Case:
    tag = ("paged128" if storage == "paged" else storage) + ("" if layout == "BNSD" else f"-{layout.lower()}")
    return Case(f"decode-{dtype}-{tag}-kv{S_kv}", "decode", dtype, B, N, KV_N, D, 1, S_kv, storage=storage,
                layout=layout)


def token_major_cases(S_kv: int, dtype="bf16") -> list[Case]:
    """The decode cases whose K / V hold a token's rows of all KV heads side by side (the operator's BSH /
    BSND layouts, the paged [blocks, block_size, H] cache); their dense twin is the BNSD case."""
    return [decode_case(dtype, "dense", S_kv, layout="BSND"), decode_case(dtype, "paged", S_kv, layout="BSH")]


def multi_token_decode_case(S_q: int, S_kv: int, dtype="bf16") -> Case:
    """Short multi-token decode (speculative / MTP steps): S_q query tokens per batch, 4 S_q query rows per
    KV head; the compute grows with S_q while the KV bytes do not."""
    return Case(f"decode-{dtype}-dense-qs{S_q}-kv{S_kv}", "decode", dtype, 8, 32, 8, 128, S_q, S_kv)


def small_decode_case() -> Case:
    """The small call: the per-call host cost (validation, dispatch, launch) dominates here."""
    return Case("decode-bf16-small-b1n8-kv128", "decode", "bf16", 1, 8, 8, 128, 1, 128, min_repeats=300)


def prefill_case(dtype: str, mask: str, S: int, B=1, N=32, KV_N=8, D=128) -> Case:
    return Case(f"prefill-{dtype}-{mask}-s{S}", "prefill", dtype, B, N, KV_N, D, S, S, mask=mask)


def full_table() -> list[Case]:
    cases = [small_decode_case()]
    cases += [decode_case(dt, st, s) for s in (1024, 4096, 16384) for dt in DTYPES for st in STORAGES]
    cases += [decode_case("bf16", "fp4", s) for s in (4096, 16384)]
    cases += [decode_case("fp32", "dense", s) for s in (4096, 16384)]
    cases += [decode_case("bf16", "int8-nz", s, N=64) for s in (4096, 16384)]
    cases += [c for s in (4096, 16384) for c in token_major_cases(s)]
    cases += [multi_token_decode_case(q, 4096) for q in (2, 4)]
    cases += [prefill_case(dt, m, s) for s in (1024, 2048, 8192) for dt in ("bf16", "fp16") for m in MASKS]
    return cases


def quick_table() -> list[Case]:
    cases = [small_decode_case()] + [decode_case(dt, st, 4096) for dt in DTYPES for st in STORAGES]
    cases += [decode_case("bf16", "fp4", 4096), decode_case("bf16", "int8-nz", 4096, N=64),
              decode_case("fp32", "dense", 4096)]
    cases += token_major_cases(4096)
    cases += [prefill_case("bf16", m, 1024) for m in MASKS] + [prefill_case("fp16", "causal", 1024)]
    return cases


def select(cases: list[Case], regex: Optional[str]) -> list[Case]:
    if not regex:
        return cases
    pat = re.compile(regex)
    return [c for c in cases if pat.search(c.name)]


# --------------------------------------------------------------------------------------------------
# inputs

def template_mask() -> torch.Tensor:
    return torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)  # [2048, 2048], True = masked


@dataclass
class Inputs:
    case: Case
    q: torch.Tensor                              # [B, N, S_q, D]
    key: torch.Tensor                            # dense/int8 [B, KV_N, S_kv, D]; paged pool [blocks, KV_N, bs, D]
    #                                              (views of the case's layout: fia_args gives it)
    value: torch.Tensor                          # like key
    block_table: Optional[torch.Tensor] = None   # int32 [B, S_kv / bs]
    k_scale: Optional[torch.Tensor] = None       # int8-chan [1, KV_N, 1, D] (dtype); int8-tok [1, B, S_kv] f32;
    #                                              fp4 [1, B, KV_N, S_kv, D/32] float8_e8m0fnu
    v_scale: Optional[torch.Tensor] = None       # like k_scale
    pse: Optional[torch.Tensor] = None           # [1, N, S_q, S_kv] (dtype)
    mask: Optional[torch.Tensor] = None          # template [2048, 2048] bool
    extra: dict = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.case.D)

    def fia_kwargs(self) -> dict:
        """Keyword arguments of npu_fused_infer_attention_score (besides query/key/value)."""
        c = self.case
        kw = dict(num_heads=self.q.shape[1], num_key_value_heads=self.key.shape[1], scale=self.scale,
                  input_layout=c.layout)
        if c.paged:
            kw.update(block_table=self.block_table, block_size=c.block_size, actual_seq_lengths_kv=[c.S_kv] * c.B)
        if c.storage.startswith("int8"):
            mode = 0 if c.per_channel else 1
            kw.update(key_antiquant_scale=self.k_scale, value_antiquant_scale=self.v_scale,
                      key_antiquant_mode=mode, value_antiquant_mode=mode)
            if c.paged:                                # (NZ int8 requires it, SPEC 14b.5; the 4-D twin the same)
                kw.update(inner_precise=1)
        elif c.storage == "fp4":
            kw.update(key_antiquant_scale=self.k_scale, value_antiquant_scale=self.v_scale,
                      key_antiquant_mode=6, value_antiquant_mode=6)
        if c.mask == "causal":
            kw.update(atten_mask=self.mask, sparse_mode=2)
        elif c.mask == "band":
            kw.update(atten_mask=self.mask, sparse_mode=4, pre_tokens=c.pre, next_tokens=c.next)
        elif c.mask == "pse":
            kw.update(pse_shift=self.pse)
        elif c.mask == "psecausal":
            kw.update(pse_shift=self.pse, atten_mask=self.mask, sparse_mode=2)
        return kw

    def fia_args(self) -> tuple:
        """(query, key, value) as the case's layout lays them out (views of the same memory; BSH: the query
        reshaped)."""
        lay, q, k, v = self.case.layout, self.q, self.key, self.value
        if lay == "BSND":                                  # [B, S, N, D]
            return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if lay == "BSH":                                   # query [B, S_q, N * D], pool [blocks, bs, KV_N * D]
            B, N, S_q, D = q.shape
            tok = lambda t: t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)  # noqa: E731
            return q.transpose(1, 2).reshape(B, S_q, N * D), tok(k), tok(v)
        return q, k, v

    def canonical_out(self, out: torch.Tensor) -> torch.Tensor:
        """FIA's output in the case's layout -> [B, N, S_q, D]."""
        lay = self.case.layout
        if lay == "BSND":
            return out.transpose(1, 2)
        if lay == "BSH":
            B, N, S_q, D = self.q.shape
            return out.reshape(B, S_q, N, D).transpose(1, 2)
        return out

    def head_slice(self) -> "Inputs":
        """The same problem restricted to KV head 0 and its G query heads (contiguous copies).

        Head groups are independent, so its output equals heads [0, G) of the full output.
        """
        G = self.case.G
        # (copies in the case's layout, so that fia_args gives them as the case does)
        one = lambda t: None if t is None else _like_layout(t[:, :1], self.case.layout)  # noqa: E731
        per_chan = self.case.per_channel
        if self.case.storage == "fp4":                 # [1, B, KV_N, S_kv, D/32]: head 0
            grp = lambda t: t[:, :, :1].contiguous()   # noqa: E731
        else:
            grp = lambda t: one(t) if per_chan else t   # noqa: E731
        # (portable: a head group alone may be outside the hardware's head-count tables, e.g. NZ caches)
        return Inputs(self.case, _like_layout(self.q[:, :G], self.case.layout), one(self.key), one(self.value),
                      self.block_table, grp(self.k_scale), grp(self.v_scale),
                      None if self.pse is None else self.pse[:, :G].contiguous(), self.mask, {"portable": True})


def to_nz(pool: torch.Tensor, d0: int) -> torch.Tensor:
    """Pool [NB, KV_N, bs, D] -> the NZ cache (NB, KV_N, D/d0, bs, d0) (SPEC 8b.1)."""
    nb, kvn, bs, d = pool.shape
    return pool.reshape(nb, kvn, bs, d // d0, d0).permute(0, 1, 3, 2, 4).contiguous()


def from_nz(cache: torch.Tensor) -> torch.Tensor:
    """The NZ cache (NB, KV_N, D/d0, bs, d0) -> pool [NB, KV_N, bs, D]."""
    nb, kvn, f, bs, d0 = cache.shape
    return cache.permute(0, 1, 3, 2, 4).reshape(nb, kvn, bs, f * d0)


def _like_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A contiguous copy of a canonical [X, N, S, D] view, stored in the layout (BNSD: as is; BSND / BSH: token
    major) and returned as the canonical view of that storage."""
    if layout == "BNSD":
        return t.contiguous()
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _token_major(*shape, randn) -> torch.Tensor:
    """randn stored token-major ([X, S, N, D]) as the canonical [X, N, S, D] view."""
    x, n, s, d = shape
    return randn(x, s, n, d).transpose(1, 2)


def alibi(N: int, S_q: int, S_kv: int, dtype: torch.dtype) -> torch.Tensor:
    """ALiBi bias -slope_h·|i - j| as a pse_shift [1, N, S_q, S_kv], built one head at a time."""
    dist = (torch.arange(S_q, dtype=torch.float32)[:, None] - torch.arange(S_kv, dtype=torch.float32)[None]).abs_()
    out = torch.empty(1, N, S_q, S_kv, dtype=dtype)
    for h in range(N):
        out[0, h] = dist * -(2.0 ** (-8.0 * (h + 1) / N))
    return out


def build(case: Case, seed: int = 0) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    dt = case.torch_dtype
    B, N, KV_N, D, S_q, S_kv = case.B, case.N, case.KV_N, case.D, case.S_q, case.S_kv
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=dt)  # noqa: E731
    kv = randn if case.layout == "BNSD" else lambda *shape: _token_major(*shape, randn=randn)
    q = kv(B, N, S_q, D)                                               # [B, N, S_q, D]
    inp = Inputs(case, q, None, None, extra={"portable": True} if case.dtype in FP32 else {})
    if case.storage == "dense":
        inp.key, inp.value = kv(B, KV_N, S_kv, D), kv(B, KV_N, S_kv, D)
    elif case.storage == "paged":
        bs = case.block_size
        nb = -(-S_kv // bs)
        blocks = B * nb + 8                                            # a shared pool with spare blocks
        inp.key, inp.value = kv(blocks, KV_N, bs, D), kv(blocks, KV_N, bs, D)
        perm = torch.randperm(blocks, generator=g)[: B * nb]
        inp.block_table = perm.view(B, nb).to(torch.int32)             # [B, nb]
    elif case.storage in ("int8-paged", "int8-nz"):                    # a shared int8 pool + per-channel scales
        bs = case.block_size
        nb = -(-S_kv // bs)
        blocks = B * nb + 8
        rint = lambda: torch.randint(-127, 128, (blocks, KV_N, bs, D), generator=g, dtype=torch.int8)  # noqa: E731
        inp.key, inp.value = rint(), rint()                            # [blocks, KV_N, bs, D]
        if case.storage == "int8-nz":                                  # (blocks, KV_N, D/32, bs, 32)
            inp.key, inp.value = to_nz(inp.key, 32), to_nz(inp.value, 32)
        inp.block_table = torch.randperm(blocks, generator=g)[: B * nb].view(B, nb).to(torch.int32)
        sc = lambda: ((torch.rand(1, KV_N, 1, D, generator=g) + 0.5) / 64).to(dt)  # noqa: E731
        inp.k_scale, inp.v_scale = sc(), sc()
    elif case.storage == "fp4":                                        # FP4 bytes + E8M0 group scales
        byts = lambda: torch.randint(0, 256, (B, KV_N, S_kv, D // 2), generator=g,  # noqa: E731
                                     dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
        exps = lambda: torch.randint(120, 130, (1, B, KV_N, S_kv, D // 32), generator=g,  # noqa: E731
                                     dtype=torch.uint8).view(torch.float8_e8m0fnu)
        inp.key, inp.value = byts(), byts()
        inp.k_scale, inp.v_scale = exps(), exps()
    else:                                                              # int8 + antiquant scales
        rint = lambda: torch.randint(-127, 128, (B, KV_N, S_kv, D), generator=g, dtype=torch.int8)  # noqa: E731
        inp.key, inp.value = rint(), rint()
        if case.storage == "int8-chan":
            sc = lambda: ((torch.rand(1, KV_N, 1, D, generator=g) + 0.5) / 64).to(dt)  # noqa: E731
        else:
            sc = lambda: (torch.rand(1, B, S_kv, generator=g) + 0.5) / 64              # noqa: E731
        inp.k_scale, inp.v_scale = sc(), sc()
    if case.mask in ("causal", "band", "psecausal"):
        inp.mask = template_mask()
    if case.mask.startswith("pse"):
        inp.pse = alibi(N, S_q, S_kv, dt)
    return inp
