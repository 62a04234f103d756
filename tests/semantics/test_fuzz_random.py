"""Seeded randomized differential test: feature combinations a real user would write, fia vs naive float64.

Every case is drawn from its seed alone (`random.Random(f"fia-fuzz-{seed}")` for the configuration, a torch
generator for the data), so `pytest tests/semantics/test_fuzz_random.py -k seed_123` reproduces one case on every
backend, and the case id already summarizes what was drawn. A failure message starts with the full drawn
configuration.

Drawn per case, inside the VALID domain of SPEC.md in strict mode (float16 / bfloat16 only):
  entry point (fused / v2 / incre / prompt), layout (BSH, BSND, BNSD, BNSD_BSND, *_NBSD, TND, TND_NTD, NTD_TND),
  B 1-4, KV_N 1/2/4 with GQA groups 1-8, D 64/128, Q_S 1 / 2-16 / 17-80, KV_S 1-300, per-batch query and KV
  lengths (0 and full included, length-1 and longer-than-B lists, list / tuple / tensor forms), KV storage
  (dense, paged with shuffled / shared blocks and garbage in unused table entries, tensor list), left padding,
  shared prefix, masks (none, bool / int8 / uint8 user masks in modes 0/1 with padded shapes, the template in
  modes 2/3/4 with random pre/next), pse_shift, int8 K/V dequantization (combined modes 0/1, separate modes
  0-5 and key 0 + value 1), inner_precise 0-3, softmax_lse_flag, learnable sink (v2), output quantization;
  and a small MLA family (D 512 + rope 64 absorbed, TND D 128 + rope 64).
Combination rules follow SPEC 2-13/15 (and docs/DECISIONS.md where the SPEC is silent); a drawn case the
library rejects is reported as a failure ("fia rejected a case the fuzzer considers SPEC-valid").

The reference is tests/naive.py (float64, no fia) on per-batch physical tensors: the test gathers paged
blocks, concatenates the shared prefix in front of every batch's keys, concatenates the rope parts
(Q·Kᵀ + Q_rope·K_ropeᵀ = [Q|Q_rope]·[K|K_rope]ᵀ) and dequantizes int8 K/V itself. Everything fia must not read
is NaN: query rows and keys outside the valid windows, unused paged slots, prefix positions past P, per-token
scales outside the windows, pse_shift padding (and pse entries outside each batch's windows).

FIA_FUZZ_CASES (default 200) and FIA_FUZZ_FIRST (default 0) select the seeds, for longer local fuzzing.
"""
from __future__ import annotations

import math
import os
import random
from typing import List, Optional

import numpy as np
import pytest
import torch

import fia
import naive
from fia.errors import FiaBackendUnavailable, FiaInputError, FiaUnsupportedError
from test_quant_helpers import (assert_int8_within, assert_within_amb, f32, int8_attention, out_quant_bounds,
                                pack_int4, rand_int, rand_uniform, round_half_even, uint64_form)
from util import (INT_MAX, assert_close, assert_lse, block_table, gather_paged, gen, mask_as, ntd_split,
                  out_to_canon, expected_out_shape, paged_pool, pool_as_cache, randn, tnd_split, to_layout,
                  to_ntd, to_tnd, cumsum)

F16, BF16, F32, I8 = torch.float16, torch.bfloat16, torch.float32, torch.int8
NAN = float("nan")
CLAMP = naive.CLAMP

N_CASES = int(os.environ.get("FIA_FUZZ_CASES", "200"))
FIRST = int(os.environ.get("FIA_FUZZ_FIRST", "0"))
SEEDS = list(range(FIRST, FIRST + N_CASES))

_TEMPLATE = {}


def template(shape_kind: int) -> torch.Tensor:
    """The 2048x2048 template of sparse modes 2-4 (cached: it is built once per shape)."""
    if shape_kind not in _TEMPLATE:
        m = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
        _TEMPLATE[shape_kind] = m.reshape(((2048, 2048), (1, 2048, 2048), (1, 1, 2048, 2048))[shape_kind])
    return _TEMPLATE[shape_kind]


# ================================================================================================ drawing
class Case:
    """The drawn configuration (plain attributes; data is built from it and the seed)."""

    def __init__(self, seed: int):
        self.seed = seed
        self.family = "main"
        self.api = "fused"
        self.layout = "BSH"
        self.dtype = F16
        self.B = self.N = self.kvn = 1
        self.D = self.Dv = 64
        self.rope = 0                  # rope head dim (MLA), 0 = none
        self.latent = False            # MLA absorbed: key and value are the same tensor
        self.QS = 1
        self.KVS = 1
        self.q_lens = None             # packed: per-batch query lengths
        self.kv_lens = None            # packed: per-batch KV lengths
        self.act_q = None              # padded layouts: the list passed (None = not passed)
        self.act_kv = None
        self.len_form = "list"
        self.storage = "dense"         # dense | paged | list
        self.list_lens = None          # tensor list: physical S per batch
        self.bs = 0
        self.cache_fmt = "3d"
        self.share = self.spare = self.extra_cols = 0
        self.unused = -1
        self.qpad = self.kvpad = None
        self.prefix_s = 0              # 0 = no shared prefix
        self.prefix_len = None         # actual_shared_prefix_len (None = not passed)
        self.mode = 0
        self.mask = None               # None | "user" | "template"
        self.mask_p = 0.3
        self.mask_dtype = "bool"
        self.mask_shape = 0
        self.mask_pad = (0, 0)
        self.mask_b1 = False
        self.pre = None                # None = not passed
        self.nxt = None
        self.pse = False
        self.pse_b1 = False
        self.pse_pad = (0, 0)
        self.pse_std = 1.0
        self.ip = 0                    # inner_precise (None = not passed: the entry point's default)
        self.prompt_hp = False         # prompt: sparse_mode + 10 (high precision)
        self.lse = False
        self.scale = None
        self.kvn_arg0 = False          # pass num_key_value_heads=0 (means = num_heads)
        self.aq = None                 # antiquant variant name
        self.aq_shape = 0
        self.aq_offset = False
        self.outq = None               # None | "tensor" | "channel"
        self.outq_shape = 0
        self.outq_dtype = F32
        self.outq_offset = False
        self.sink = False
        self.views = {}                # tensor name -> "pad_last" | "offset" | "perm" (non-contiguous inputs)
        self.tiles = {}                # backend tiling knobs shrunk for this case (see _TILE_KNOBS)
        self.rich = False              # feature probabilities boosted (more combinations per case)
        self.qdq = False               # int8 query + dequant_scale_query, query_quant_mode 3 (SPEC 11)
        self.full8 = None              # full int8 (SPEC 11): dict(ds1, qs1, ds2, form)
        self.aq_both = False           # separate antiquant + (ignored, NaN) combined parameters (SPEC 10.2)
        self.int4 = False              # int4 K/V packed eight to an int32 (SPEC 10.4) instead of int8

    def p(self, base: float) -> float:
        """Probability of an optional feature: boosted in "rich" cases."""
        return min(0.8, base * 2.5) if self.rich else base

    # ------------------------------------------------------------------ derived
    @property
    def packed(self) -> bool:
        return self.layout.split("_")[0] in ("TND", "NTD")

    @property
    def inp(self) -> str:
        return self.layout.split("_")[0]

    @property
    def decode(self) -> bool:
        """SPEC 15.10: a packed call is a decode call when every batch's query length is 1."""
        if self.packed:
            return len(self.q_lens) > 0 and all(x == 1 for x in self.q_lens)
        return self.QS == 1

    def short_id(self) -> str:
        parts = [f"seed_{self.seed:03d}", self.api, self.layout, {F16: "fp16", BF16: "bf16", I8: "int8"}[self.dtype],
                 f"q{self.QS}", f"kv{self.KVS}", self.storage]
        if self.family != "main":
            parts.insert(1, self.family)
        if self.mask:
            parts.append(f"m{self.mode}{'u' if self.mask == 'user' else 't'}")
        elif self.mode:
            parts.append(f"m{self.mode}")
        for flag, name in ((self.tiles, "tiles"), (self.views, "views"), (self.pse, "pse"), (self.prefix_s, "prefix"), (self.qpad is not None or
                           self.kvpad is not None, "lpad"), (self.aq, f"aq-{self.aq}{'-int4' if self.int4 else ''}"), (self.outq, "oq"),
                           (self.sink, "sink"), (self.qdq, "qdq")):
            if flag:
                parts.append(name)
        return "-".join(parts)

    def describe(self) -> str:
        keys = [k for k in vars(self)]
        return "fuzz case " + self.short_id() + "\n  " + ", ".join(f"{k}={getattr(self, k)!r}" for k in keys)


def _rand_len(r: random.Random, full: int) -> int:
    x = r.random()
    if x < 0.1 or full == 0:
        return 0
    if x < 0.35:
        return full
    return r.randint(1, full)


def _lens_arg(r: random.Random, b: int, full, *, allow_none=True, required=False):
    """A lengths argument for padded layouts: None, a one-element list, a per-batch list (maybe longer)."""
    fulls = full if isinstance(full, list) else [full] * b
    x = r.random()
    if allow_none and not required and x < 0.3:
        return None
    if x < 0.4 and not isinstance(full, list):
        return [_rand_len(r, fulls[0])]
    lens = [_rand_len(r, f) for f in fulls]
    if r.random() < 0.1:
        lens += [r.randint(0, 5) for _ in range(r.randint(1, 2))]      # longer list: the first B entries count
    return lens


def _kv_s(r: random.Random, hi: int = 300) -> int:
    return r.choice([r.randint(1, 16), r.randint(17, min(128, hi)), r.randint(min(129, hi), hi)])


def _pre_next(r: random.Random, c: Case, mode: int, s_q: int, s_kv: int):
    """Valid pre/next tokens where a band is active (SPEC 14, DECISIONS 6): not both negative, pre + next >= 0;
    mode 0 also |next| < Q_S and |pre| < KV_S(+prefix) when negative. Output quantization with mode 4 needs
    non-negative values (SPEC 12)."""
    kind = r.random()
    if kind < 0.15:
        return None, None
    if kind < 0.22:
        return r.choice([INT_MAX, 2 ** 30]), r.choice([INT_MAX, 0, 2 ** 28])
    nonneg = mode == 4 and c.outq is not None
    for _ in range(50):
        pre = r.randint(0, s_kv + 4) if (nonneg or r.random() < 0.75) else -r.randint(1, max(s_kv - 1, 1))
        nxt = r.randint(0, s_q + s_kv) if (nonneg or r.random() < 0.75) else -r.randint(1, max(s_q - 1, 1))
        if r.random() < 0.2:
            nxt = 0
        if pre < 0 and nxt < 0:
            continue
        if pre + nxt < 0:
            continue
        if mode == 0 and ((nxt < 0 and -nxt >= s_q) or (pre < 0 and -pre >= s_kv)):
            continue
        return pre, nxt
    return s_kv, 0


def draw(seed: int) -> Case:
    r = random.Random(f"fia-fuzz-{seed}")
    c = Case(seed)
    c.rich = r.random() < 0.35
    fam = r.random()
    if fam < 0.08:
        _draw_mla(r, c)
    elif fam < 0.13:
        _draw_full8(r, c)
    else:
        _draw_main(r, c)
    if r.random() < c.p(0.3):
        # real clients pass views: q split off a fused qkv projection, K/V slices of a bigger cache, ...
        for name in ("query", "key", "value", "query_rope", "key_rope", "atten_mask", "pse_shift",
                     "key_shared_prefix", "value_shared_prefix"):
            if r.random() < 0.5:
                c.views[name] = r.choice(["pad_last", "offset", "perm"])
    if r.random() < c.p(0.3):
        c.tiles = {name: r.choice(values) for name, values in _TILE_KNOBS.items()}
    return c


# Tiling knobs of the fast backends, shrunk so that the brief's small shapes run the code paths long
# sequences take (row blocks, key chunks, split-KV merges, prefix groups, pse tile skipping). Semantics
# never depend on them (SPEC 15.8), so every value must give the same result.
_TILE_KNOBS = {
    "prefill.block_q": [16, 32, 64],
    "prefill.band_block_q": [16, 32, 48],
    "prefill.band_split": [False, True],
    "prefill.pse_skip_min": [0, 1 << 30],
    "prefill.pse_rows": [16, 40],
    "prefill.pse_tile": [8, 16, 32],
    "prefill.mask_chunk_elems": [1 << 10, 1 << 13, 1 << 21],
    "decode.MIN_SPLIT": [8, 16, 40, 512],
    "decode.ITEMS_PER_THREAD": [4, 16],
    "decode.CHUNK_FLOATS": [512, 2048, 32768],
    "decode.PARALLEL_MIN_WORK": [0, 16384],
    "decode.PREFIX_ROWS": [1, 8, 64],
}


def apply_tiles(c: Case, monkeypatch) -> None:
    if not c.tiles:
        return
    import fia.backends.decode.plan as dec      # (the decode tiling knobs)
    from fia.backends import registry
    pre = registry.by_name("prefill")
    for name, value in c.tiles.items():
        where, attr = name.split(".")
        monkeypatch.setattr(pre if where == "prefill" else dec, attr, value)


def _draw_main(r: random.Random, c: Case) -> None:
    c.api = r.choices(["fused", "v2", "incre", "prompt"], [62, 14, 12, 12])[0]
    regime = "decode" if c.api == "incre" else r.choices(["decode", "short", "prefill"], [34, 33, 33])[0]
    if c.api == "incre":
        layouts = ["BSH", "BSND", "BNSD"]
    elif c.api == "prompt":
        layouts = ["BSH", "BSND", "BNSD"] + (["BNSD_BSND"] if regime != "decode" else [])
    else:
        # (TND_NTD only with query D = 512 in strict mode: SPEC 14b.4 T11 -- the MLA family draws it)
        layouts = ["BSH"] * 3 + ["BSND"] * 2 + ["BNSD"] * 3 + ["TND"] * 3 + ["NTD_TND"]
        if regime != "decode":
            layouts.append("BNSD_BSND")
        if regime != "prefill":
            layouts += ["BSH_NBSD", "BSND_NBSD", "BNSD_NBSD"]
    c.layout = r.choice(layouts)
    c.dtype = r.choice([F16, BF16])
    c.B = r.randint(1, 4)
    c.kvn = r.choice([1, 1, 2, 2, 4])
    g = r.randint(1, 8)
    while c.kvn * g > 16:
        g -= 1
    if r.random() < 0.08:              # now and then a wide group (G 9-16, MQA-like): many rows per KV head
        c.kvn, g = r.choice([1, 2]), r.randint(9, 16)
    c.N = c.kvn * g
    c.kvn_arg0 = c.kvn == c.N and r.random() < 0.5
    c.D = c.Dv = 128 if c.packed else r.choice([64, 128])     # TND without rope: D 128 (SPEC 14b.4 T16)
    c.QS = {"decode": 1, "short": r.randint(2, 16), "prefill": r.randint(17, 80)}[regime]
    c.KVS = _kv_s(r)
    c.scale = 1.0 / math.sqrt(c.D) if r.random() < 0.7 else round(r.uniform(0.03, 0.3), 4)
    c.len_form = r.choices(["list", "tuple", "i32", "i64", "np"], [70, 8, 8, 8, 6])[0]

    # ---- storage (SPEC 8)
    if c.api == "prompt":
        c.storage = "dense"
    else:
        opts = ["dense"] * 6 + ["paged"] * 3 + ([] if c.packed else ["list"] * 2)
        c.storage = r.choice(opts)
    if c.storage == "dense" and not c.packed and r.random() < 0.03:
        c.KVS = 0                      # SPEC 4: empty key/value -> all-zero output (lse +inf)
    if c.packed and c.dtype == F16 and c.storage != "paged":
        c.dtype = BF16                 # TND without rope: bfloat16 (float16 only with paged KV), strict

    # ---- output quantization decided early (it constrains pre/next of mode 4)
    if not c.packed and r.random() < c.p(0.1):    # TND: no output quantization (SPEC 14b.4 T17)
        c.outq = r.choice(["tensor", "channel"])
        c.outq_dtype = BF16 if (c.dtype == BF16 and r.random() < 0.4) else F32
        c.outq_offset = r.random() < 0.5
        c.outq_shape = r.randint(0, 1)

    # ---- lengths (SPEC 2, 4)
    if c.packed:
        if regime == "decode":
            c.q_lens = [1] * c.B
        else:
            c.q_lens = [_rand_len(r, c.QS) for _ in range(c.B)]
            if sum(c.q_lens) == 0:
                c.q_lens[0] = c.QS
        c.QS = max(c.q_lens)
        c.kv_lens = [_rand_len(r, c.KVS) for _ in range(c.B)]
        if sum(c.kv_lens) == 0:
            c.kv_lens[-1] = c.KVS
    else:
        if c.storage == "list":
            c.list_lens = [r.randint(1, c.KVS) for _ in range(c.B)]
            c.KVS = max(c.list_lens)
            if r.random() < 0.5:
                c.act_kv = _lens_arg(r, c.B, list(c.list_lens))
        else:
            c.act_kv = _lens_arg(r, c.B, c.KVS, required=c.storage == "paged")
            if c.storage == "paged":
                c.act_kv = [_rand_len(r, c.KVS) for _ in range(c.B)]
        if regime == "decode":
            if c.api in ("fused", "v2") and r.random() < 0.15:
                c.act_q = [1] * c.B           # meaningless for decode, accepted
        elif c.api != "incre":
            c.act_q = _lens_arg(r, c.B, c.QS)

    # ---- paged details (SPEC 8)
    if c.storage == "paged":
        _draw_paged(r, c)

    # ---- left padding (SPEC 4): dense / list KV, no prefix, not packed, not v2/prompt
    if not c.packed and c.storage != "paged" and c.api in ("fused", "incre") and r.random() < c.p(0.2):
        if c.api == "fused" and regime != "decode" and r.random() < 0.7:
            c.qpad = r.randint(-2, c.QS)
        if r.random() < 0.7:
            c.kvpad = r.randint(-2, c.KVS)
        if c.qpad is None and c.kvpad is None:
            c.kvpad = r.randint(0, 3)

    # ---- shared prefix (SPEC 7): fused, dense KV, no left padding
    if c.api == "fused" and not c.packed and c.storage == "dense" and c.qpad is None and c.kvpad is None \
            and r.random() < c.p(0.14):
        c.prefix_s = r.randint(1, 64)
        c.prefix_len = r.choice([None, None, 0, r.randint(0, c.prefix_s), c.prefix_s])

    # ---- masks and sparse modes (SPEC 5)
    decode = c.decode
    if decode:
        opts = {"none": 40, "m0": 25, "m1": 20}
        if c.api in ("fused", "v2"):
            opts["tmpl"] = 15
        if c.api == "incre":
            opts.pop("m1")
        if c.packed:
            opts = {"none": 60, "tmpl": 40}
        kind = r.choices(list(opts), list(opts.values()))[0]
    elif c.packed:                 # sparse 4 only with paged KV (SPEC 14b.4 T2, 15.11)
        kind = r.choices(["none", "m3", "m4"], [40, 35, 25 if c.storage == "paged" else 0])[0]
    else:
        kind = r.choices(["none", "m0", "m1", "m2", "m3", "m4"], [25, 20, 15, 10, 15, 15])[0]
    _draw_mask(r, c, kind, probs=(0.05, 0.2, 0.4, 0.7, 0.97), padded=True)
    if c.packed and c.mode == 3 and not decode:
        # strict TND sparse 3: per-batch act_q <= act_kv (SPEC 15.11 allows equality)
        c.kv_lens = [max(k, q) for k, q in zip(c.kv_lens, c.q_lens)]
        if c.storage == "paged":
            _draw_paged(r, c)          # the table must cover the new lengths
    # pre/next: where a band is active draw valid values; elsewhere sometimes pass anything harmless
    ext = _kv_ext(c)
    band = (not decode) and ((c.mode == 0 and c.mask == "user" and not _left_padded(c)) or c.mode == 4)
    if c.api in ("fused", "v2", "prompt"):
        if band:
            c.pre, c.nxt = _pre_next(r, c, c.mode, c.QS, ext)
            if c.api == "prompt" and c.nxt is None and c.mode == 0:
                pass                   # prompt's default next_tokens = 0: a valid causal band
        elif r.random() < 0.2:
            c.pre, c.nxt = r.randint(0, 500), r.randint(0, 500)

    # ---- pse_shift (SPEC 3): not for TND
    if not c.packed and r.random() < c.p(0.2):
        c.pse = True
        c.pse_b1 = r.random() < 0.4
        c.pse_pad = (r.choice([0, 0, 2]), r.choice([0, 0, 5]))
        c.pse_std = r.choice([0.5, 1.0, 3.0])

    # ---- precision flags, lse
    if c.api in ("fused", "v2"):
        c.ip = r.choice([0, 1]) if decode else r.choice([0, 1, 2, 3])
        c.lse = r.random() < 0.7
    elif c.api == "incre":
        c.ip = r.choice([None, 0, 1])
    else:
        c.ip = None
        c.prompt_hp = r.random() < 0.3

    # ---- learnable sink (v2 only)
    if c.api == "v2" and r.random() < c.p(0.25):
        c.sink = True

    # ---- KV dequantization (SPEC 10)
    # (packed layouts: decode only, where per-channel / per-head factors are unambiguous; per-token ones
    # only with paged KV, whose positions are per batch)
    # (TND: no dequantization in strict mode, SPEC 14b.4 T17)
    if c.api in ("fused", "v2", "incre") and not c.packed and c.KVS > 0 and r.random() < c.p(0.2):
        _draw_antiquant(r, c, decode)

    # ---- int8 query with dequant_scale_query (SPEC 11, DECISIONS 13): float K/V, float16 output
    if c.api in ("fused", "v2") and c.aq is None and not c.prefix_s and not c.packed and r.random() < c.p(0.05):
        c.qdq = True
        if c.outq is not None:
            c.outq_dtype = F32             # bfloat16 quant_scale2 only with a bfloat16 query

    # ---- the output-quantization offset rule (SPEC 12): no offset when a band leaves rows without keys
    if c.outq is not None:
        if c.outq == "channel" and _left_padded(c):
            c.outq = "tensor"          # per-channel does not combine with left padding
        if c.outq_offset and _band_leaves_empty_rows(c):
            c.outq_offset = False


def _draw_mask(r: random.Random, c: Case, kind: str, probs=(0.1, 0.4, 0.9), padded=False) -> None:
    """The mask of a drawn `kind`: none, m0/m1 (a user mask of density from `probs`, optionally with padded
    trailing dims), tmpl (a random sparse mode 2-4) or m2/m3/m4 (the template of that mode)."""
    if kind == "none":
        c.mode, c.mask = 0, None
    elif kind in ("m0", "m1"):
        c.mode, c.mask = int(kind[1]), "user"
        c.mask_p = r.choice(list(probs))
        c.mask_dtype = r.choice(["bool", "int8", "uint8"])
        c.mask_shape = r.randint(0, 2)
        if padded:
            c.mask_pad = (r.choice([0, 0, 1, 3]), r.choice([0, 0, 2, 17]))
        c.mask_b1 = r.random() < 0.3
    else:
        c.mode, c.mask = (r.choice([2, 3, 4]) if kind == "tmpl" else int(kind[1])), "template"
        c.mask_shape = r.randint(0, 2)


def _draw_paged(r: random.Random, c: Case) -> None:
    lens = c.kv_lens if c.packed else c.act_kv
    int8 = c.aq is not None
    if c.decode:
        c.bs = r.choice([32, 64, 128] if int8 else [16, 32, 48, 64, 128, 256])
    else:
        c.bs = r.choice([128, 128, 256])
    if c.packed and c.D != 512:
        c.bs = r.choice([128, 128, 512])            # paged TND: block_size 128 / 512 / 1024 (SPEC 14b.4 T14)
    c.cache_fmt = r.choice(["3d", "4d"]) if c.inp in ("BNSD", "TND") else "3d"
    c.spare = r.randint(0, 3)
    c.extra_cols = r.choice([0, 0, 0, 1, 2])
    c.share = r.choice([0, 0, 0, 1]) if max(lens) > c.bs else 0
    c.unused = r.choice([-1, -1, 0, 7777])


def _draw_antiquant(r: random.Random, c: Case, decode: bool) -> None:
    """Pick an int8 K/V dequantization variant valid for this case (SPEC 10.1-10.3, DECISIONS 11/12)."""
    per_token_ok = c.prefix_s == 0 and (not c.packed or c.storage == "paged")   # DECISIONS 12: no prefix
    opts = []
    if decode:
        if c.api in ("fused", "incre"):         # npu_incre_flash_attention has no antiquant_mode: mode 0 only
            opts += ["comb0"] * 3 + (["comb1"] * 2 if per_token_ok and c.api == "fused" else [])
        if c.api in ("fused", "v2"):
            opts += ["sep0"] * 2 + ["sep2"]
            if per_token_ok:
                opts += ["sep1", "sep3"]
                if c.dtype == F16:
                    opts.append("k0v1")
                if c.storage == "paged":
                    opts += ["sep4", "sep5"]

    else:
        if c.api == "fused" and c.dtype == F16:
            opts += ["comb0"] * 2
        if c.api in ("fused", "v2") and c.dtype == BF16 and c.QS <= 16 and c.storage == "dense" \
                and not _left_padded(c):
            opts += ["sep0"] + (["sep1"] if per_token_ok else [])
    if not opts:
        return
    c.aq = r.choice(opts)
    if c.api == "fused" and c.aq.startswith(("sep", "k0v1")) and r.random() < 0.3:
        c.aq_both = True                               # the separate set wins; the combined one is never read
    c.aq_shape = r.randint(0, 5)
    c.aq_offset = r.random() < 0.5
    # int4 (SPEC 10.4): separate modes 0, 1, 3, key 0 + value 1; no output quantization, paged KV, left padding
    if c.aq in ("sep0", "sep1", "sep3", "k0v1") and c.outq is None and c.storage != "paged" and not c.prefix_s \
            and not _left_padded(c) and r.random() < 0.3:
        c.int4 = True
    if c.storage == "paged" and decode and c.bs % 32:
        c.bs = r.choice([32, 64, 128])                 # int8 decode: block_size a multiple of 32


def _draw_mla(r: random.Random, c: Case) -> None:
    """MLA (SPEC 9): absorbed (D 512 + rope 64, one KV head, key = value = the latent cache) or TND D 128 + rope 64."""
    c.family = "mla"
    c.api = r.choice(["fused", "fused", "v2"])
    c.dtype = r.choice([F16, BF16])
    c.rope = 64
    c.len_form = "list"
    if r.random() < 0.65:
        c.latent = True
        c.D = c.Dv = 512
        c.kvn, c.N = 1, r.choice([1, 2, 4, 8, 16])
        c.QS = 1 if r.random() < 0.6 else r.randint(2, 16)
        layouts = ["BSH", "BSND", "BNSD", "BSH_NBSD", "BSND_NBSD", "BNSD_NBSD"]   # not BNSD_BSND (SPEC 14b.1 M5)
        c.layout = r.choice(layouts)
        c.B = r.randint(1, 3)
        c.KVS = r.randint(1, 160)
        c.storage = r.choice(["dense", "paged"])
        if c.storage == "paged":
            c.act_kv = [_rand_len(r, c.KVS) for _ in range(c.B)]
        else:
            c.act_kv = _lens_arg(r, c.B, c.KVS)
        if c.QS > 1:
            c.act_q = _lens_arg(r, c.B, c.QS)
        if c.QS == 1:
            kind = r.choice(["none", "m4"])
        else:
            kind = r.choice(["m3", "m4", "m0"])    # Q_S > 1: no sparse 0 without a mask (SPEC 14b.1 M6)
    else:
        c.layout = r.choice(["TND", "TND", "NTD_TND"])    # D 128 + rope: TND / NTD_TND (SPEC 14b.3)
        c.D = c.Dv = 128
        c.kvn = r.choice([1, 2])
        c.N = c.kvn * r.randint(1, 8)
        c.B = r.randint(1, 4)
        c.QS = r.choice([1, r.randint(2, 16), r.randint(17, 48)])
        c.q_lens = [1] * c.B if c.QS == 1 else [_rand_len(r, c.QS) for _ in range(c.B)]
        if sum(c.q_lens) == 0:
            c.q_lens[0] = c.QS
        c.QS = max(c.q_lens)
        c.KVS = _kv_s(r, 200)
        c.kv_lens = [_rand_len(r, c.KVS) for _ in range(c.B)]
        if sum(c.kv_lens) == 0:
            c.kv_lens[0] = c.KVS
        c.storage = "dense"                        # SPEC 14b.3: no paged KV
        kind = r.choice(["none", "m3"])            # dense TND: sparse 0 without mask or 3 (SPEC 14b.4 T2)
        if kind == "m3" and not c.decode:
            c.kv_lens = [max(k, q) for k, q in zip(c.kv_lens, c.q_lens)]
    if c.storage == "paged":
        _draw_paged(r, c)
    c.scale = 1.0 / math.sqrt(c.D + c.rope)
    _draw_mask(r, c, kind)
    # with rope, a decode call keeps its sparse mode (SPEC 5: only Q_S = 1 *without rope* ignores it)
    if (c.mode == 0 and c.mask == "user") or c.mode == 4:
        c.pre, c.nxt = _pre_next(r, c, c.mode, c.QS, _kv_ext(c))
    c.ip = r.choice([0, 1]) if c.decode else r.choice([0, 1, 2, 3])
    c.lse = r.random() < 0.6
    if c.latent and r.random() < 0.3:     # (D 128 TND MLA: no quantization, SPEC 14b.3)
        c.qdq = True                       # MLA with an int8 query (query_quant_mode 3), rope in c.dtype


def _draw_full8(r: random.Random, c: Case) -> None:
    """Full int8 (SPEC 11): int8 Q, K, V with per-tensor dequant/quant scales; prefill only; float16 output or
    int8 with output quantization. No prefix / paged KV with an int8 query."""
    c.family = "int8"
    c.api = r.choice(["fused", "fused", "prompt"])
    c.layout = r.choice(["BSH", "BSND", "BNSD", "BNSD_BSND"])
    c.dtype = I8
    c.B = r.randint(1, 3)
    c.kvn = r.choice([1, 2])
    c.N = c.kvn * r.randint(1, 4)
    c.D = c.Dv = r.choice([64, 128])
    c.QS = r.choice([r.randint(2, 16), r.randint(17, 64)])
    c.KVS = _kv_s(r, 200)
    c.scale = 1.0 / math.sqrt(c.D)
    c.full8 = dict(ds1=r.uniform(2e-4, 8e-4), qs1=r.choice([127.0, 40.0, 600.0]), ds2=r.uniform(1e-4, 5e-4),
                   form=r.choice(["f32", "u64"]))
    c.act_q = _lens_arg(r, c.B, c.QS)
    c.act_kv = _lens_arg(r, c.B, c.KVS)
    if c.api == "fused" and r.random() < c.p(0.15):
        c.qpad = r.randint(-1, c.QS)
        c.kvpad = r.randint(-1, c.KVS)
    if r.random() < c.p(0.15):
        c.outq = r.choice(["tensor", "channel"])
        c.outq_dtype = F32
        c.outq_offset = r.random() < 0.5
        c.outq_shape = r.randint(0, 1)
    kind = r.choices(["none", "m0", "m1", "m2", "m3", "m4"], [30, 20, 15, 10, 15, 10])[0]
    _draw_mask(r, c, kind)
    if (c.mode == 0 and c.mask == "user" and not _left_padded(c)) or c.mode == 4:
        c.pre, c.nxt = _pre_next(r, c, c.mode, c.QS, _kv_ext(c))
    elif c.api == "prompt" and r.random() < 0.5:
        c.pre, c.nxt = INT_MAX, INT_MAX
    if not _left_padded(c) and r.random() < c.p(0.15):
        c.pse, c.pse_b1, c.pse_pad, c.pse_std = True, r.random() < 0.5, (0, r.choice([0, 3])), 1.0
    if c.api == "fused":
        c.ip = r.choice([0, 1, 2, 3])
        c.lse = r.random() < 0.6
    else:
        c.ip = None
        c.prompt_hp = r.random() < 0.3
    if c.outq is not None:
        if c.outq == "channel" and _left_padded(c):
            c.outq = "tensor"
        if c.outq_offset and _band_leaves_empty_rows(c):
            c.outq_offset = False


# ================================================================================================ geometry
def _left_padded(c: Case) -> bool:
    """Is any left padding active (SPEC 4: only together with the matching actual lengths)?"""
    return _qpad_on(c) or _kvpad_on(c)


def _qpad_on(c: Case) -> bool:
    return c.qpad is not None and c.act_q is not None and not c.decode and not c.packed


def _kvpad_on(c: Case) -> bool:
    return c.kvpad is not None and c.act_kv is not None and c.storage == "dense" and not c.packed


def _expand(lens, b: int, full: List[int]) -> List[int]:
    if lens is None:
        return list(full)
    lens = list(lens)
    return lens * b if len(lens) == 1 else lens[:b]


def _kv_phys(c: Case) -> List[int]:
    """Physical KV positions per batch (paged: max_blocks x block_size)."""
    if c.storage == "paged":
        lens = c.kv_lens if c.packed else c.act_kv
        mb = max([(x + c.bs - 1) // c.bs for x in lens] + [1]) + c.extra_cols
        return [mb * c.bs] * c.B
    if c.packed:
        return list(c.kv_lens)
    if c.storage == "list":
        return list(c.list_lens)
    return [c.KVS] * c.B


def _prefix_p(c: Case) -> int:
    if not c.prefix_s:
        return 0
    return c.prefix_s if c.prefix_len is None else c.prefix_len


def _kv_ext(c: Case) -> int:
    """Columns a mask / pse must cover: longest physical KV (+ prefix, whose columns come first)."""
    return max(_kv_phys(c)) + _prefix_p(c)


def _windows(c: Case):
    """Per-batch physical (q_lo, q_hi), (kv_lo, kv_hi) of the batch's own keys; dead batches (0,0),(0,0)."""
    phys = _kv_phys(c)
    if c.packed:
        akv = list(c.kv_lens)
        aq = list(c.q_lens)
    else:
        aq = [1] * c.B if c.decode else _expand(c.act_q, c.B, [c.QS] * c.B)
        akv = _expand(c.act_kv, c.B, phys)
    qw, kw = [], []
    for b in range(c.B):
        q = (0, aq[b])
        if _qpad_on(c):
            lo = c.QS - max(c.qpad, 0) - aq[b]
            q = None if lo < 0 else (lo, c.QS - max(c.qpad, 0))
        k = (0, akv[b])
        if _kvpad_on(c):
            lo = phys[b] - max(c.kvpad, 0) - akv[b]
            k = None if lo < 0 else (lo, phys[b] - max(c.kvpad, 0))
        if q is None or k is None:
            q, k = (0, 0), (0, 0)
        qw.append(q)
        kw.append(k)
    return qw, kw


def _band_active(c: Case) -> bool:
    """MaskSpec kind "band" (what SPEC 12's output-quantization rules look at)."""
    if c.decode and not c.rope:
        return False
    if c.mode == 0:
        if c.mask != "user" or _left_padded(c):
            return False
        pre, nxt = _eff_pre_next(c)
        big = c.QS + _kv_ext(c)
        return not (pre >= big and nxt >= big)
    return c.mode in (2, 3, 4)


def _eff_pre_next(c: Case):
    pre = INT_MAX if c.pre is None else c.pre
    nxt = (0 if c.api == "prompt" else INT_MAX) if c.nxt is None else c.nxt
    return min(pre, CLAMP), min(nxt, CLAMP)


def _band_leaves_empty_rows(c: Case) -> bool:
    """SPEC 12: with quant_offset2 every batch must keep keys for every row (the parse rule, per batch)."""
    if not _band_active(c):
        return False
    pre, nxt = _eff_pre_next(c)
    qw, kw = _windows(c)
    p = _prefix_p(c)
    for (ql, qh), (kl, kh) in zip(qw, kw):
        s1, s2 = qh - ql, kh - kl + p
        m = c.mode
        if (m == 0 and (s1 - s2 - pre > 0 or nxt < 0)) or (m == 3 and s2 - s1 < 0) or \
                (m == 4 and (pre < 0 or nxt + s2 - s1 < 0)):
            return True
    return False


# ================================================================================================ building
def _lens_value(c: Case, lens):
    if lens is None:
        return None
    return {"list": list, "tuple": tuple, "i32": lambda x: torch.tensor(x, dtype=torch.int32),
            "i64": lambda x: torch.tensor(x, dtype=torch.int64),
            "np": lambda x: np.array(x, dtype=np.int64)}[c.len_form](lens)


def _poison_q(x: torch.Tensor, qw) -> torch.Tensor:
    """canonical [B, N, S, D]: NaN outside each batch's query window."""
    x = x.clone()
    for b, (lo, hi) in enumerate(qw):
        x[b, :, :lo] = NAN
        x[b, :, hi:] = NAN
    return x


class Built:
    """fia keyword arguments + what the naive model needs."""

    def __init__(self):
        self.q_in = self.k_in = self.v_in = None
        self.kw = {}
        self.ref_q = []        # per batch float64 [N, Sq_b, D(+rope)]
        self.ref_k = []        # per batch float64 [KV_N, S_b(+P), D(+rope)] (physical, prefix first)
        self.ref_v = []
        self.q_win = []
        self.kv_win = []       # windows into ref_k (prefix included)
        self.mask = None       # per batch bool [>=Sq, >=Skv] or None
        self.pse = None        # per batch float64 [N, >=Sq, >=Skv] or None
        self.sink = None
        self.outq = None       # (scale, offset) float64 broadcastable to [N, rows, Dv]
        self.q8 = self.k8 = self.v8 = None   # canonical dense q / k / v (full int8 reference)
        self.pse_full = None   # float64 [Bp, N, Qp, Kp]


def _dequant_factor(gran: str, t: Optional[torch.Tensor], b: int, length: int, c: Case, table=None):
    """A dequantization parameter -> float64 broadcastable to [KV_N, length, D] for batch b, positions 0..length-1
    (physical for dense / list, logical for paged). Written from SPEC 10, independently of fia."""
    if t is None:
        return 0.0
    t = t.double()
    if gran == "tensor":
        return t.reshape(())
    if gran == "channel":
        return t.reshape(c.kvn, -1)[:, None, :]
    if gran == "head":
        return t.reshape(c.kvn)[:, None, None]
    if gran == "token":
        t2 = t.reshape(-1, t.shape[-1])
        return t2[b if t2.shape[0] > 1 else 0, :length][None, :, None]
    if gran == "token_head":
        return t[b if t.shape[0] > 1 else 0, :, :length][:, :, None]
    if gran in ("block_token", "block_token_head"):
        out = torch.full((c.kvn, length), NAN, dtype=torch.float64)
        for p in range(length):
            col = p // c.bs
            if col >= len(table[b]):
                continue
            blk = int(table[b][col])
            if blk < 0 or blk >= t.shape[0]:
                continue
            out[:, p] = t[blk, p % c.bs] if gran == "block_token" else t[blk, :, p % c.bs]
        return out[:, :, None]
    raise AssertionError(gran)


def _aq_params(c: Case, g: torch.Generator, kv_win, tokens: int, table, nb: int):
    """(fia kwargs, key (gran, scale, offset), value (gran, scale, offset)) for the drawn antiquant variant.
    Per-token scales outside each batch's KV window are NaN (never read)."""
    kvn, d, b = c.kvn, c.D, c.B
    qdt = c.dtype

    def uni(shape, lo, hi, dt):
        return rand_uniform(shape, g, lo, hi, dt)

    def poison_tokens(t, per_batch_axis0: bool):
        # t [..., S] with batch on axis -2 (token) or axis 0 (token_head); NaN outside windows
        t = t.clone()
        for i, (lo, hi) in enumerate(kv_win):
            if per_batch_axis0:
                t[i, ..., :lo] = NAN
                t[i, ..., hi:] = NAN
            else:
                t[..., i, :lo] = NAN
                t[..., i, hi:] = NAN
        return t

    v = c.aq
    kw = {}
    if v in ("comb0",):
        shapes = [(2,), (2, kvn, 1, d), (2, kvn, d), (2, kvn * d)]
        shape = shapes[c.aq_shape % 4]
        sc = uni(shape, 0.004, 0.02, qdt)
        off = uni(shape, -6, 6, qdt) if c.aq_offset else None
        gran = "tensor" if shape == (2,) else "channel"
        kw.update(antiquant_scale=sc, antiquant_mode=0)
        if off is not None:
            kw["antiquant_offset"] = off
        ks = (gran, sc[0], None if off is None else off[0])
        vs = (gran, sc[1], None if off is None else off[1])
        return kw, ks, vs
    if v == "comb1":
        s = tokens + (3 if c.aq_shape % 2 else 0)
        sc = poison_tokens(uni((2, b, s), 0.002, 0.03, F32), False)
        off = poison_tokens(uni((2, b, s), -8, 8, F32), False) if c.aq_offset else None
        kw.update(antiquant_scale=sc, antiquant_mode=1)
        if off is not None:
            kw["antiquant_offset"] = off
        return kw, ("token", sc[0], None if off is None else off[0]), \
            ("token", sc[1], None if off is None else off[1])

    def side(mode, which):
        """One side of the separate parameters: (scale, offset, granularity)."""
        if mode == 0:
            if c.decode:
                shapes = [(1, kvn, 1, d), (1, kvn, d), (1, kvn * d), (1,)]
            else:
                shapes = [(kvn, d), (kvn, 1, d), (kvn * d,)]
            shape = shapes[c.aq_shape % len(shapes)]
            gran = "tensor" if shape == (1,) else "channel"
            return uni(shape, 0.004, 0.02, qdt), (uni(shape, -6, 6, qdt) if c.aq_offset else None), gran
        if mode == 1:
            s = tokens + (2 if c.aq_shape % 2 else 0)
            shape = (1, b, s) if c.decode else (b, s)
            sc = poison_tokens(uni(shape, 0.002, 0.03, F32), False)
            off = poison_tokens(uni(shape, -8, 8, F32), False) if c.aq_offset else None
            return sc, off, "token"
        if mode == 2:
            return uni((kvn,), 0.004, 0.02, qdt), (uni((kvn,), -6, 6, qdt) if c.aq_offset else None), "head"
        if mode == 3:
            s = tokens + (2 if c.aq_shape % 2 else 0)
            bb = 1 if (c.aq_shape >= 4) else b
            sc = uni((bb, kvn, s), 0.002, 0.03, F32)
            off = uni((bb, kvn, s), -8, 8, F32) if c.aq_offset else None
            if bb == b:
                sc = poison_tokens(sc, True)
                off = None if off is None else poison_tokens(off, True)
            return sc, off, "token_head"
        if mode in (4, 5):
            shape = (nb, c.bs) if mode == 4 else (nb, kvn, c.bs)
            sc = uni(shape, 0.002, 0.03, F32)
            off = uni(shape, -8, 8, F32) if c.aq_offset else None
            used = torch.zeros(nb, c.bs, dtype=torch.bool)
            for i, (lo, hi) in enumerate(kv_win):
                for p in range(lo, hi):
                    used[int(table[i][p // c.bs]), p % c.bs] = True
            m = ~used if mode == 4 else ~used[:, None, :].expand(nb, kvn, c.bs)
            sc = sc.masked_fill(m, NAN)            # slots no valid token maps to: never read
            off = None if off is None else off.masked_fill(m, NAN)
            return sc, off, "block_token" if mode == 4 else "block_token_head"
        raise AssertionError(mode)

    km, vm = {"sep0": (0, 0), "sep1": (1, 1), "sep2": (2, 2), "sep3": (3, 3), "sep4": (4, 4), "sep5": (5, 5),
              "k0v1": (0, 1)}[v]
    ksc, koff, kg = side(km, "key")
    vsc, voff, vg = side(vm, "value")
    if c.api == "v2":
        kw.update(dequant_scale_key=ksc, dequant_scale_value=vsc, key_quant_mode=km, value_quant_mode=vm)
        if koff is not None:
            kw.update(dequant_offset_key=koff, dequant_offset_value=voff)
    else:
        kw.update(key_antiquant_scale=ksc, value_antiquant_scale=vsc, key_antiquant_mode=km, value_antiquant_mode=vm)
        if koff is not None:
            kw.update(key_antiquant_offset=koff, value_antiquant_offset=voff)
    return kw, (kg, ksc, koff), (vg, vsc, voff)


def build(c: Case) -> Built:
    g = gen(c.seed)
    B, N, kvn, D, Dv, QS, dt = c.B, c.N, c.kvn, c.D, c.Dv, c.QS, c.dtype
    R = c.rope
    out = Built()
    kw = out.kw
    qw, kvw = _windows(c)
    phys = _kv_phys(c)
    P = _prefix_p(c)
    int8 = c.aq is not None
    decode = c.decode

    # ------------------------------------------------------------------ query
    q8 = c.qdq or c.full8 is not None                  # an int8 query
    dsq = None
    if c.qdq:                                          # (B, Q_N, Q_S) float32, NaN outside the query windows
        dsq = rand_uniform((B, N, QS), g, 0.002, 0.02, F32)
        for b, (lo, hi) in enumerate(qw):
            dsq[b, :, :lo] = NAN
            dsq[b, :, hi:] = NAN
        kw.update(dequant_scale_query=dsq, query_quant_mode=3)

    def q_rows(b, x):                                  # x [N, S, D] of batch b -> float64 (dequantized)
        x = x.double()
        return x * dsq[b, :, :x.shape[1], None].double() if dsq is not None else x

    def make_q(shape):
        return rand_int(shape, g) if q8 else randn(shape, g, dt)

    if c.packed:
        qs = [make_q((N, l, D)) for l in c.q_lens]
        qrs = [randn((N, l, R), g, dt) for l in c.q_lens] if R else None
        pack = to_ntd if c.inp == "NTD" else to_tnd
        out.q_in = pack(qs)
        if R:
            kw["query_rope"] = pack(qrs)
        out.ref_q = [torch.cat([q_rows(b, q), qr.double()], -1) if R else q_rows(b, q)
                     for b, (q, qr) in enumerate(zip(qs, qrs or qs))]
    else:
        q = make_q((B, N, QS, D))
        out.q_in = to_layout(q if q8 else _poison_q(q, qw), c.inp)
        out.q8 = q
        qr = None
        if R:
            qr = randn((B, N, QS, R), g, dt)
            kw["query_rope"] = to_layout(_poison_q(qr, qw), c.inp)
        out.ref_q = [torch.cat([q_rows(b, q[b]), qr[b].double()], -1) if R else q_rows(b, q[b]) for b in range(B)]
    out.q_win = list(qw)

    # ------------------------------------------------------------------ keys / values
    kv8 = int8 or c.full8 is not None

    def rnd_kv(shape, d):
        if c.int4:
            return rand_int(shape[:-1] + (d,), g, -8, 7)
        return rand_int(shape[:-1] + (d,), g) if kv8 else randn(shape[:-1] + (d,), g, dt)

    def enc(x):                                        # int4: eight values packed to an int32 (SPEC 10.4)
        if not c.int4:
            return x
        if x.numel() == 0:                             # an empty batch of a packed layout
            return torch.zeros(tuple(x.shape[:-1]) + (x.shape[-1] // 8,), dtype=torch.int32)
        return pack_int4(x)

    table = None
    nb = 0
    if c.storage == "paged":
        lens = c.kv_lens if c.packed else c.act_kv
        table, nb = block_table(lens, c.bs, g, spare=c.spare, share=c.share, extra_cols=c.extra_cols,
                                unused=c.unused)
        if int8:
            kpool = rand_int((nb, kvn, c.bs, D), g)
            vpool = rand_int((nb, kvn, c.bs, Dv), g)
        else:
            kpool = paged_pool(table, lens, c.bs, nb, kvn, D, g, dt)
            vpool = kpool if c.latent else paged_pool(table, lens, c.bs, nb, kvn, Dv, g, dt)
        kd, vd = gather_paged(kpool, table, lens, c.bs), gather_paged(vpool, table, lens, c.bs)
        out.k_in = pool_as_cache(kpool, c.cache_fmt)
        out.v_in = out.k_in if c.latent else pool_as_cache(vpool, c.cache_fmt)
        k_b = [kd[b] for b in range(B)]
        v_b = [vd[b] for b in range(B)]
        if R:
            krpool = paged_pool(table, lens, c.bs, nb, kvn, R, g, dt)
            kw["key_rope"] = pool_as_cache(krpool, c.cache_fmt)
            krd = gather_paged(krpool, table, lens, c.bs)
            kr_b = [krd[b] for b in range(B)]
        kw["block_table"] = table
        kw["block_size"] = c.bs
    elif c.packed:
        k_b = [rnd_kv((kvn, l, D), D) for l in c.kv_lens]
        v_b = k_b if c.latent else [rnd_kv((kvn, l, Dv), Dv) for l in c.kv_lens]
        pack = to_ntd if c.inp == "NTD" else to_tnd
        out.k_in, out.v_in = pack([enc(k) for k in k_b]), pack([enc(v) for v in v_b])
        if R:
            kr_b = [randn((kvn, l, R), g, dt) for l in c.kv_lens]
            kw["key_rope"] = pack(kr_b)
    elif c.storage == "list":
        k_b, v_b = [], []
        for b, s in enumerate(c.list_lens):
            kk, vv = rnd_kv((kvn, s, D), D), rnd_kv((kvn, s, Dv), Dv)
            if not kv8:
                lo, hi = kvw[b]
                kk, vv = kk.clone(), vv.clone()
                for t in (kk, vv):
                    t[:, :lo] = NAN
                    t[:, hi:] = NAN
            k_b.append(kk)
            v_b.append(vv)
        out.k_in = [to_layout(enc(k[None]), c.inp) for k in k_b]
        out.v_in = [to_layout(enc(v[None]), c.inp) for v in v_b]
    else:
        k = rnd_kv((B, kvn, c.KVS, D), D)
        v = k if c.latent else rnd_kv((B, kvn, c.KVS, Dv), Dv)
        if not kv8:
            k = _poison_q(k, kvw)
            v = k if c.latent else _poison_q(v, kvw)
        out.k8, out.v8 = k, v
        out.k_in = to_layout(enc(k), c.inp)
        out.v_in = out.k_in if c.latent else to_layout(enc(v), c.inp)
        k_b = [k[b] for b in range(B)]
        v_b = [v[b] for b in range(B)]
        if R:
            kr = _poison_q(randn((B, kvn, c.KVS, R), g, dt), kvw)
            kw["key_rope"] = to_layout(kr, c.inp)
            kr_b = [kr[b] for b in range(B)]

    # ------------------------------------------------------------------ dequantization (SPEC 10)
    if int8:
        tokens = max(phys)
        akw, (kg, ksc, koff), (vg, vsc, voff) = _aq_params(c, g, kvw, tokens, table.tolist() if table is not None
                                                           else None, nb)
        kw.update(akw)
        if c.aq_both:                                  # combined set as well: the separate one wins
            kw.update(antiquant_scale=torch.full((2,), NAN, dtype=dt), antiquant_mode=0)
        tl = table.tolist() if table is not None else None
        k64 = [(k_b[b].double() + _dequant_factor(kg, koff, b, k_b[b].shape[1], c, tl))
               * _dequant_factor(kg, ksc, b, k_b[b].shape[1], c, tl) for b in range(B)]
        v64 = [(v_b[b].double() + _dequant_factor(vg, voff, b, v_b[b].shape[1], c, tl))
               * _dequant_factor(vg, vsc, b, v_b[b].shape[1], c, tl) for b in range(B)]
    else:
        k64 = [k.double() for k in k_b]
        v64 = [v.double() for v in v_b]
    if R:
        k64 = [torch.cat([k, kr.double()], -1) for k, kr in zip(k64, kr_b)]

    # ------------------------------------------------------------------ shared prefix (SPEC 7)
    if c.prefix_s:
        ps = c.prefix_s
        if int8:
            kp, vp = rand_int((1, kvn, ps, D), g), rand_int((1, kvn, ps, Dv), g)
            kp_in, vp_in = kp, vp
            kp64 = (kp[0].double() + _dequant_factor(kg, koff, 0, ps, c)) * _dequant_factor(kg, ksc, 0, ps, c)
            vp64 = (vp[0].double() + _dequant_factor(vg, voff, 0, ps, c)) * _dequant_factor(vg, vsc, 0, ps, c)
        else:
            kp, vp = randn((1, kvn, ps, D), g, dt), randn((1, kvn, ps, Dv), g, dt)
            kp_in, vp_in = kp.clone(), vp.clone()
            kp_in[:, :, P:] = NAN                       # prefix positions past P are never read
            vp_in[:, :, P:] = NAN
            kp64, vp64 = kp[0].double(), vp[0].double()
        kw["key_shared_prefix"] = to_layout(kp_in, c.inp)
        kw["value_shared_prefix"] = to_layout(vp_in, c.inp)
        if c.prefix_len is not None:
            kw["actual_shared_prefix_len"] = [c.prefix_len]
        k64 = [torch.cat([kp64[:, :P], k], 1) for k in k64]
        v64 = [torch.cat([vp64[:, :P], v], 1) for v in v64]
    out.ref_k, out.ref_v = k64, v64
    # windows into the reference keys: prefix columns first (prefix excludes left padding: kv_lo = 0)
    out.kv_win = [(lo, hi + P) for lo, hi in kvw]

    # ------------------------------------------------------------------ lengths
    if c.packed:
        kw["actual_seq_lengths"] = _lens_value(c, cumsum(c.q_lens))
        kw["actual_seq_lengths_kv"] = _lens_value(c, list(c.kv_lens) if c.storage == "paged"
                                                  else cumsum(c.kv_lens))
    else:
        if c.act_q is not None:
            kw["actual_seq_lengths"] = _lens_value(c, c.act_q)
        if c.act_kv is not None:
            kw["actual_seq_lengths_kv"] = _lens_value(c, c.act_kv)
    if c.qpad is not None:
        kw["query_padding_size"] = torch.tensor([c.qpad], dtype=torch.int64)
    if c.kvpad is not None:
        kw["kv_padding_size"] = torch.tensor([c.kvpad], dtype=torch.int64)

    # ------------------------------------------------------------------ masks (SPEC 5)
    ext = _kv_ext(c)
    if c.mask == "template":
        kw["atten_mask"] = template(c.mask_shape)
    elif c.mask == "user":
        qm = 1 if decode else QS + c.mask_pad[0]
        km = ext + c.mask_pad[1]
        bm = 1 if c.mask_b1 else B
        m = torch.rand(bm, qm, km, generator=g) < c.mask_p          # True = masked
        if decode and not R:
            shape = [(bm, km), (bm, 1, km), (bm, 1, 1, km)][c.mask_shape]
        else:
            shape = [(qm, km) if bm == 1 else (bm, qm, km), (bm, qm, km), (bm, 1, qm, km)][c.mask_shape]
        kw["atten_mask"] = mask_as(m.reshape(shape), c.mask_dtype)
        out.mask = [m[b if bm > 1 else 0] for b in range(B)]
    if c.mode or c.api == "prompt":
        kw["sparse_mode"] = c.mode + (10 if c.prompt_hp else 0)
    if c.pre is not None:
        kw["pre_tokens"] = c.pre
    if c.nxt is not None:
        kw["next_tokens"] = c.nxt

    # ------------------------------------------------------------------ pse_shift (SPEC 3)
    if c.pse:
        bp = 1 if c.pse_b1 else B
        qp, kp_ = QS + c.pse_pad[0], ext + c.pse_pad[1]
        pse = randn((bp, N, qp, kp_), g, F16 if q8 else dt, std=c.pse_std)   # float16 for an int8 query
        pse_in = pse.clone()
        pse_in[:, :, QS:] = NAN                       # padding past the needed region
        pse_in[:, :, :, ext:] = NAN
        if bp == B:                                   # entries outside each batch's windows are never read
            for b in range(B):
                (ql, qh), (kl, kh) = qw[b], out.kv_win[b]
                pse_in[b, :, :ql] = NAN
                pse_in[b, :, qh:] = NAN
                pse_in[b, :, :, :kl] = NAN
                pse_in[b, :, :, kh:] = NAN
        kw["pse_shift"] = pse_in
        out.pse = [pse[b if bp > 1 else 0].double() for b in range(B)]
        out.pse_full = pse.double()

    # ------------------------------------------------------------------ full int8 scales (SPEC 11)
    if c.full8:
        f = c.full8

        def sarg(x, form):
            return uint64_form(x) if form == "u64" else torch.tensor([x], dtype=F32)
        names = ("deq_scale1", "quant_scale1", "deq_scale2") if c.api == "prompt" else \
            ("dequant_scale1", "quant_scale1", "dequant_scale2")
        kw[names[0]] = sarg(f["ds1"], f["form"])
        kw[names[1]] = sarg(f["qs1"], "f32")
        kw[names[2]] = sarg(f["ds2"], f["form"])

    # ------------------------------------------------------------------ sink, output quantization
    if c.sink:
        sink = randn((N,), g, F32 if (c.seed % 2 or q8) else dt, std=2.0)   # float32 or the query dtype
        kw["learnable_sink"] = sink
        out.sink = sink.double()
    if c.outq:
        if c.outq == "tensor":
            sc = rand_uniform((1,), g, 5.0, 60.0, c.outq_dtype)
        else:
            shapes = {"BSH": [(1, 1, N * Dv), (N * Dv,)], "BNSD": [(1, N, 1, Dv), (N, Dv)],
                      "BSND": [(1, 1, N, Dv), (N, Dv)]}.get(c.layout.split("_")[-1], [(N, Dv), (N * Dv,)])
            sc = rand_uniform(shapes[c.outq_shape % len(shapes)], g, 5.0, 60.0, c.outq_dtype)
        off = rand_uniform(tuple(sc.shape), g, -20.0, 20.0, c.outq_dtype) if c.outq_offset else None
        kw["quant_scale2"] = sc
        if off is not None:
            kw["quant_offset2"] = off

        def canon(t):
            if t is None:
                return 0.0
            return t.double().reshape(()) if t.numel() == 1 else t.double().reshape(N, 1, Dv)
        out.outq = (canon(sc), canon(off))
    apply_views(c, out, g)
    return out


def _as_view(x: torch.Tensor, kind: str, g: torch.Generator) -> torch.Tensor:
    """The same values as a non-contiguous view (or one with a storage offset); the memory around is garbage
    (NaN for floats) that must never be read. The last dimension stays contiguous."""
    fill = (lambda n: torch.full(n, NAN, dtype=x.dtype)) if x.is_floating_point() else \
        (lambda n: torch.randint(0, 2, n, generator=g).to(x.dtype))
    if kind == "pad_last":
        big = fill(tuple(x.shape[:-1]) + (x.shape[-1] + 8,))
        big[..., :x.shape[-1]] = x
        return big[..., :x.shape[-1]]
    if kind == "offset":
        big = fill((x.numel() + 24,))
        big[24:] = x.reshape(-1)
        return big[24:].view(x.shape)
    if kind == "perm" and x.dim() >= 3:
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    return x


def apply_views(c: Case, bt: "Built", g: torch.Generator) -> None:
    if not c.views:
        return
    same = bt.k_in is bt.v_in
    for name, kind in c.views.items():
        if name == "query":
            bt.q_in = _as_view(bt.q_in, kind, g)
        elif name in ("key", "value"):
            cur = bt.k_in if name == "key" else bt.v_in
            new = [_as_view(t, kind, g) for t in cur] if isinstance(cur, list) else _as_view(cur, kind, g)
            if name == "key":
                bt.k_in = new
                if same:
                    bt.v_in = new
            elif not same:
                bt.v_in = new
        elif name in bt.kw and isinstance(bt.kw[name], torch.Tensor) and \
                not (name == "atten_mask" and c.mask == "template"):
            bt.kw[name] = _as_view(bt.kw[name], kind, g)


# ================================================================================================ calling
def call(c: Case, bt: Built):
    """Call the drawn entry point. Returns (out, lse or None)."""
    kw = dict(bt.kw)
    kvn_arg = 0 if c.kvn_arg0 else c.kvn
    if c.api == "fused":
        if c.ip is not None:
            kw["inner_precise"] = c.ip
        return fia.npu_fused_infer_attention_score(bt.q_in, bt.k_in, bt.v_in, num_heads=c.N,
                                                   num_key_value_heads=kvn_arg, input_layout=c.layout,
                                                   scale=c.scale, softmax_lse_flag=c.lse, **kw)
    if c.api == "v2":
        ren = {"actual_seq_lengths": "actual_seq_qlen", "actual_seq_lengths_kv": "actual_seq_kvlen",
               "quant_scale2": "quant_scale_out", "quant_offset2": "quant_offset_out"}
        kw = {ren.get(k, k): v for k, v in kw.items()}
        if c.ip is not None:
            kw["inner_precise"] = c.ip
        return fia.npu_fused_infer_attention_score_v2(bt.q_in, bt.k_in, bt.v_in, num_query_heads=c.N,
                                                      num_key_value_heads=kvn_arg, input_layout=c.layout,
                                                      softmax_scale=c.scale, return_softmax_lse=c.lse, **kw)
    if c.api == "incre":
        kw.pop("actual_seq_lengths", None)
        assert kw.pop("antiquant_mode", 0) == 0
        if "actual_seq_lengths_kv" in kw:
            kw["actual_seq_lengths"] = kw.pop("actual_seq_lengths_kv")
        if c.ip is not None:
            kw["inner_precise"] = c.ip
        return fia.npu_incre_flash_attention(bt.q_in, bt.k_in, bt.v_in, num_heads=c.N, num_key_value_heads=kvn_arg,
                                             input_layout=c.layout, scale_value=c.scale, **kw), None
    if c.api == "prompt":
        return fia.npu_prompt_flash_attention(bt.q_in, bt.k_in, bt.v_in, num_heads=c.N,
                                              num_key_value_heads=kvn_arg, input_layout=c.layout,
                                              scale_value=c.scale, **kw), None
    raise AssertionError(c.api)


def _naive_masking(c: Case, bt: Built):
    """(sparse_mode, per-batch mask or None, pre, next, inner_precise) as the naive model takes them."""
    decode_plain = c.decode and not c.rope             # SPEC 5: only a plain mask applies, sparse ignored
    mode = c.mode
    mask = bt.mask
    pre, nxt = _eff_pre_next(c)
    if decode_plain:
        mode = 1 if mask is not None else 0
    if mode in (0, 1) and mask is not None and _left_padded(c):
        pre = nxt = INT_MAX                            # SPEC 4: sparse 0 + left padding: pre/next unlimited
    if mode not in (0, 1):
        mask = None                                    # the template carries no information
    ip = c.ip
    if c.api == "prompt":
        ip = 0 if c.prompt_hp else 1
    elif ip is None:
        ip = 1
    return mode, mask, pre, nxt, ip


def reference(c: Case, bt: Built):
    """naive float64: per batch lists out [N, Sq_b, Dv], lse [N, Sq_b] (full int8: also amb)."""
    mode, mask, pre, nxt, ip = _naive_masking(c, bt)
    if c.full8:
        f = c.full8
        o, l, amb = int8_attention(bt.q8, bt.k8, bt.v8, ds1=f32(f["ds1"]), qs1=f32(f["qs1"]), ds2=f32(f["ds2"]),
                                   scale=f32(c.scale), q_windows=bt.q_win, kv_windows=bt.kv_win, mask=mask,
                                   sparse_mode=mode, pre_tokens=pre, next_tokens=nxt, pse=bt.pse_full,
                                   inner_precise=ip)
        return list(o), list(l), list(amb)
    return naive.attention(bt.ref_q, bt.ref_k, bt.ref_v, scale=c.scale, q_windows=bt.q_win, kv_windows=bt.kv_win,
                           mask=mask, sparse_mode=mode, pre_tokens=pre, next_tokens=nxt, pse=bt.pse,
                           inner_precise=ip, stack=False, sink=bt.sink) + (None,)


def fia_rows(c: Case, out: torch.Tensor, lse):
    """fia outputs -> per batch [N, Sq_b, Dv] and [N, Sq_b] (or None)."""
    N, Dv = c.N, c.Dv
    if c.packed:
        t = sum(c.q_lens)
        ol = c.layout.split("_")[-1] if "_" in c.layout else c.inp
        if ol == "NTD":
            assert tuple(out.shape) == (N, t, Dv), (tuple(out.shape), c.layout)
            outs = ntd_split(out, c.q_lens)
        else:
            assert tuple(out.shape) == (t, N, Dv), (tuple(out.shape), c.layout)
            outs = tnd_split(out, c.q_lens)
        lses = None
        if lse is not None:
            assert tuple(lse.shape) == (t, N, 1), tuple(lse.shape)
            lses = [x[..., 0] for x in tnd_split(lse, c.q_lens)]
        return outs, lses
    assert tuple(out.shape) == expected_out_shape(c.layout, c.B, N, c.QS, Dv), (tuple(out.shape), c.layout)
    oc = out_to_canon(out, c.layout, N)
    lses = None
    if lse is not None:
        assert tuple(lse.shape) == (c.B, N, c.QS, 1), tuple(lse.shape)
        lses = [lse[b, :, :, 0] for b in range(c.B)]
    return [oc[b] for b in range(c.B)], lses


def check(c: Case, bt: Built, out, lse):
    ref_o, ref_l, ref_amb = reference(c, bt)
    want_dtype = I8 if c.outq else (F16 if c.dtype == I8 else (F16 if c.qdq and not c.rope else c.dtype))
    assert out.dtype == want_dtype, (out.dtype, want_dtype)
    if c.api in ("fused", "v2") and not c.lse:
        if c.api == "fused":
            assert lse.dtype == F32 and tuple(lse.shape) == (0,), (lse.dtype, tuple(lse.shape))
        else:
            assert lse.dtype == F32 and tuple(lse.shape) == (1,) and float(lse[0]) == 0.0
        lse = None
    outs, lses = fia_rows(c, out, lse)
    o = torch.cat(list(outs), 1)                       # [N, rows, Dv]
    ro = torch.cat(list(ref_o), 1)
    rl = torch.cat(list(ref_l), 1)
    dead = torch.isposinf(rl)                          # [N, rows]
    if o.numel() == 0:
        return
    amb = None if ref_amb is None else torch.cat(list(ref_amb), 1)
    if c.outq:
        sc, off = bt.outq
        lo, hi = out_quant_bounds(ro, amb, sc, off)
        assert_int8_within(o, lo, hi)
        zero_q = round_half_even(torch.zeros_like(ro) * sc + off).clamp(-128, 127)
        assert torch.equal(o.double()[dead], zero_q[dead]), "rows never computed must quantize 0 exactly"
    elif amb is not None:
        assert_within_amb(o, ro, amb, rel=1e-3)
        assert (o[dead] == 0).all(), "rows without keys must be exactly 0"
    else:
        assert_close(o, ro, want_dtype)
        assert (o[dead] == 0).all(), "rows without keys must be exactly 0"
    if lses is not None:
        lc = torch.cat(list(lses), 1)
        assert_lse(lc, rl)


# ================================================================================================ the test
CASES = [draw(s) for s in SEEDS]


@pytest.mark.case(q_s=lambda p: p["case"].QS, decode=lambda p: p["case"].decode,
                  full_quant=lambda p: p["case"].full8 is not None)
@pytest.mark.parametrize("case", CASES, ids=[c.short_id() for c in CASES])
def test_fuzz(case: Case, monkeypatch):
    apply_tiles(case, monkeypatch)
    bt = build(case)
    try:
        out, lse = call(case, bt)
    except FiaBackendUnavailable:
        raise                                           # conftest: this backend skips the case
    except (FiaInputError, FiaUnsupportedError) as e:
        pytest.fail(f"{case.describe()}\nfia rejected a case the fuzzer considers SPEC-valid: "
                    f"{type(e).__name__}: {e}")
    try:
        check(case, bt, out, lse)
    except AssertionError as e:
        raise AssertionError(f"{case.describe()}\n{e}") from e
