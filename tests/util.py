"""Test helpers: seeded random inputs, layout conversions, error metrics, NaN poisoning.

Canonical tensors are [B, N, S, D] (SPEC 2). Only `run_dense` / `check_dense` and `full_path` touch fia (imported
lazily); the reference is tests/naive.py.
"""
from __future__ import annotations

import math
from typing import List, Sequence

import torch

import naive

INT_MAX = 2147483647

# acceptance tolerances (docs/RELIABILITY.md)
TOL = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 1e-5, torch.float64: 1e-10}
LSE_TOL = 1e-3


def seed_of(*parts) -> int:
    """A stable per-case seed (Python's hash() of strings is salted per process)."""
    import zlib
    return zlib.crc32(repr(parts).encode()) % 100000


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def randn(shape, g: torch.Generator, dtype=torch.float16, std: float = 1.0) -> torch.Tensor:
    """Fresh normal values rounded to `dtype` (never zeros/ones)."""
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(dtype)


def prompt_batch(vocab: int, seq: int, pad: int, seed: int = 1):
    """Two random token prompts (ids [2, seq]) and their attention mask, the second left-padded by `pad`, as
    generate() pads decoder-only prompts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, seq), generator=g)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, :pad] = 0
    return ids, mask


def randmask(shape, g: torch.Generator, p: float = 0.3) -> torch.Tensor:
    """Random bool mask, True (= masked) with probability p."""
    return torch.rand(*shape, generator=g) < p


def mask_as(mask: torch.Tensor, kind: str) -> torch.Tensor:
    """bool mask -> the dtype a test passes: 'bool', 'int8' or 'uint8' (values 0/1)."""
    return {"bool": mask.bool(), "int8": mask.to(torch.int8), "uint8": mask.to(torch.uint8)}[kind]


def template_mask(shape=(2048, 2048)) -> torch.Tensor:
    """The 2048x2048 template of sparse modes 2-4 (SPEC 5), optionally with leading 1-dims."""
    m = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    return m.reshape(shape)


# ---------------------------------------------------------------------------------------------- layouts
def to_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """canonical [B, N, S, D] -> BSH [B, S, N*D] / BSND [B, S, N, D] / BNSD (the input part of a layout)."""
    base = layout.split("_")[0]
    b, n, s, d = x.shape
    if base == "BSH":
        return x.permute(0, 2, 1, 3).reshape(b, s, n * d).contiguous()
    if base == "BSND":
        return x.permute(0, 2, 1, 3).contiguous()
    if base == "BNSD":
        return x.contiguous()
    raise ValueError(layout)


def from_layout(x: torch.Tensor, layout: str, n: int) -> torch.Tensor:
    """BSH / BSND / BNSD tensor -> canonical [B, N, S, D]."""
    if layout == "BSH":
        b, s, h = x.shape
        return x.reshape(b, s, n, h // n).permute(0, 2, 1, 3)
    if layout == "BSND":
        return x.permute(0, 2, 1, 3)
    if layout == "BNSD":
        return x
    raise ValueError(layout)


def out_layout(layout: str) -> str:
    """The output layout of an input_layout string (SPEC 2)."""
    if "_" in layout:
        return layout.split("_")[1]
    return layout


def out_to_canon(out: torch.Tensor, layout: str, n: int) -> torch.Tensor:
    """Output of a 3-/4-D layout -> canonical [B, N, S, Dv]. NBSD = [N, B, S, D]."""
    ol = out_layout(layout)
    if ol == "NBSD":
        return out.permute(1, 0, 2, 3)
    return from_layout(out, ol, n)


def expected_out_shape(layout: str, b: int, n: int, s: int, dv: int):
    ol = out_layout(layout)
    return {"BSH": (b, s, n * dv), "BSND": (b, s, n, dv), "BNSD": (b, n, s, dv), "NBSD": (n, b, s, dv)}[ol]


def to_tnd(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """list of per-batch [N, S_b, D] -> packed [T, N, D]."""
    return torch.cat([x.permute(1, 0, 2) for x in xs], dim=0).contiguous()


def to_ntd(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """list of per-batch [N, S_b, D] -> packed [N, T, D]."""
    return torch.cat(list(xs), dim=1).contiguous()


def tnd_split(x: torch.Tensor, lens: Sequence[int]) -> List[torch.Tensor]:
    """packed [T, N, D] -> list of per-batch [N, S_b, D]."""
    out, t = [], 0
    for l in lens:
        out.append(x[t:t + l].permute(1, 0, 2))
        t += l
    return out


def ntd_split(x: torch.Tensor, lens: Sequence[int]) -> List[torch.Tensor]:
    """packed [N, T, D] -> list of per-batch [N, S_b, D]."""
    return tnd_split(x.permute(1, 0, 2), lens)


def cumsum(lens: Sequence[int]) -> List[int]:
    out, t = [], 0
    for l in lens:
        t += l
        out.append(t)
    return out


# ---------------------------------------------------------------------------------------------- metrics
def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out - ref| / max(max|ref|, tiny) over the finite reference entries (float64)."""
    out = out.double()
    ref = ref.double()
    assert out.shape == ref.shape, (tuple(out.shape), tuple(ref.shape))
    fin = torch.isfinite(ref)
    if fin.sum() == 0:
        return 0.0
    diff = (out[fin] - ref[fin]).abs()
    if torch.isnan(diff).any():
        return math.inf
    denom = max(ref[fin].abs().max().item(), 1e-30)
    return diff.max().item() / denom


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype=None, tol=None, what="out"):
    """rel_err(out, ref) <= tolerance of the output dtype; out must be finite where ref is."""
    tol = tol if tol is not None else TOL[dtype if dtype is not None else out.dtype]
    fin = torch.isfinite(ref)
    assert torch.isfinite(out.double()[fin]).all(), f"{what}: non-finite values where the reference is finite"
    e = rel_err(out, ref)
    assert e <= tol, f"{what}: rel err {e:.3g} > {tol:g}"


def assert_lse(lse: torch.Tensor, ref: torch.Tensor, tol: float = LSE_TOL):
    """lse float32; +inf exactly where ref is +inf; very negative (< -1e11) where ref < -1e11 (fully
    user-masked rows: -1e12 + log(count)); abs err <= tol elsewhere."""
    assert lse.dtype == torch.float32, lse.dtype
    assert lse.shape == ref.shape, (tuple(lse.shape), tuple(ref.shape))
    lse = lse.double()
    inf_ref = torch.isinf(ref) & (ref > 0)
    assert torch.equal(torch.isposinf(lse), inf_ref), (
        f"lse +inf pattern differs: {int((torch.isposinf(lse) != inf_ref).sum())} entries")
    huge = ref < -1e11
    assert (lse[huge] < -1e11).all(), "lse of fully user-masked rows should be ~ -1e12"
    rest = ~inf_ref & ~huge
    if rest.any():
        err = (lse[rest] - ref[rest]).abs().max().item()
        assert err <= tol, f"lse abs err {err:.3g} > {tol:g}"


def assert_zero_rows(out_canon: torch.Tensor, lse: torch.Tensor, rows_mask: torch.Tensor):
    """rows_mask [B, N, Sq] bool: those rows must be exactly 0 in out and +inf in lse (if lse given)."""
    o = out_canon[rows_mask]
    assert (o == 0).all(), "rows without keys must be exactly 0"
    if lse is not None:
        assert torch.isposinf(lse[rows_mask]).all(), "rows without keys must have lse +inf"


# ---------------------------------------------------------------------------------------------- poison
def poison_rows(x: torch.Tensor, lens: Sequence[int]) -> torch.Tensor:
    """canonical [B, N, S, D]: NaN in rows s >= lens[b] (right padding). Returns a copy."""
    x = x.clone()
    for b, l in enumerate(lens):
        x[b, :, l:] = float("nan")
    return x


def poison_window(x: torch.Tensor, windows) -> torch.Tensor:
    """canonical [B, N, S, D]: NaN outside [lo, hi) of each batch. Returns a copy."""
    x = x.clone()
    for b, (lo, hi) in enumerate(windows):
        x[b, :, :lo] = float("nan")
        x[b, :, hi:] = float("nan")
    return x


def nan_outside(x: torch.Tensor, region) -> torch.Tensor:
    """NaN everywhere in x except the top-left region (a tuple of sizes for the trailing dims)."""
    y = torch.full_like(x, float("nan"))
    sl = tuple(slice(0, r) for r in region)
    idx = (Ellipsis,) + sl
    y[idx] = x[idx]
    return y


def expand_lengths(lens, b: int, s: int) -> List[int]:
    """SPEC 4: None -> full S; a length-1 list applies to all batches; longer -> first b."""
    if lens is None:
        return [s] * b
    lens = [int(x) for x in (lens.tolist() if hasattr(lens, "tolist") else lens)]
    if len(lens) == 1:
        return lens * b
    return lens[:b]


def batched_mask(mask: torch.Tensor, b: int, decode: bool) -> torch.Tensor:
    """An atten_mask as passed to fia -> bool [B, Sq', Skv'] in physical coordinates for the naive model.
    Prefill shapes (Q_S, KV_S), (1|B, Q_S, KV_S), (1|B, 1, Q_S, KV_S); decode (B, KV_S), (B, 1, KV_S),
    (B, 1, 1, KV_S)."""
    m = mask.bool()
    if decode:
        m = m.reshape(m.shape[0], 1, m.shape[-1])
    elif m.dim() == 2:
        m = m.unsqueeze(0)
    elif m.dim() == 4:
        m = m[:, 0]
    if m.shape[0] == 1:
        m = m.expand(b, -1, -1)
    return m


def run_dense(q, k, v, layout, *, lse=True, api="fused", **kw):
    """Call fia with canonical q/k/v converted to `layout`. Returns (raw_out, raw_lse)."""
    import fia
    n, kvn = q.shape[1], k.shape[1]
    base = layout.split("_")[0]
    qq, kk, vv = to_layout(q, base), to_layout(k, base), to_layout(v, base)
    if api == "fused":
        return fia.npu_fused_infer_attention_score(qq, kk, vv, num_heads=n, num_key_value_heads=kvn,
                                                   input_layout=layout, softmax_lse_flag=lse, **kw)
    if api == "incre":
        return fia.npu_incre_flash_attention(qq, kk, vv, num_heads=n, num_key_value_heads=kvn,
                                             input_layout=layout, **kw), None
    if api == "prompt":
        return fia.npu_prompt_flash_attention(qq, kk, vv, num_heads=n, num_key_value_heads=kvn,
                                              input_layout=layout, **kw), None
    raise ValueError(api)


def check_dense(q, k, v, *, layout="BSH", scale=None, act_q=None, act_kv=None, len_kw=None, atten_mask=None,
                sparse_mode=0, pre_tokens=None, next_tokens=None, pse=None, inner_precise=0,
                poison=True, api="fused", lse=True, naive_sparse=None, naive_pre=None, naive_next=None,
                naive_ip=None, extra=None):
    """Run one dense case through fia and through the naive model and compare (SPEC 3-6, 13).

    q/k/v canonical [B, N, S, D] in the input dtype. act_q / act_kv: per-batch int lists (right padding) used by
    the reference and for NaN poisoning; len_kw: the length keywords actually passed (default: the lists).
    Decode (Q_S == 1) follows SPEC 5: sparse_mode/pre/next ignored, only a plain mask applies.
    pre_tokens / next_tokens None = not passed (the API default); naive_* override what the reference uses.
    Returns (out_canon, lse_canon [B, N, Q_S] or None, ref_out, ref_lse)."""
    b, n, sq, d = q.shape
    skv = k.shape[2]
    dtype = q.dtype
    scale = (1.0 / math.sqrt(d)) if scale is None else scale
    decode = sq == 1
    aq = [sq] * b if act_q is None else list(act_q)
    akv = [skv] * b if act_kv is None else list(act_kv)
    if decode:
        aq = [1] * b
    if poison:
        q_in = poison_rows(q, aq)
        k_in, v_in = poison_rows(k, akv), poison_rows(v, akv)
    else:
        q_in, k_in, v_in = q, k, v
    kw = dict(extra or {})
    if len_kw is None:
        len_kw = {}
        if act_q is not None and not decode:
            len_kw["actual_seq_lengths"] = list(act_q)
        if act_kv is not None:
            len_kw["actual_seq_lengths_kv"] = list(act_kv)
    kw.update(len_kw)
    if atten_mask is not None:
        kw["atten_mask"] = atten_mask
    if pse is not None:
        kw["pse_shift"] = pse
    if api in ("fused", "prompt"):
        if pre_tokens is not None:
            kw["pre_tokens"] = pre_tokens
        if next_tokens is not None:
            kw["next_tokens"] = next_tokens
        kw["sparse_mode"] = sparse_mode
    if api == "fused":
        kw.update(scale=scale, inner_precise=inner_precise)
    else:
        kw.update(scale_value=scale)
    out, l = run_dense(q_in, k_in, v_in, layout, lse=lse, api=api, **kw)

    # reference
    mask_b = None
    ns = sparse_mode if naive_sparse is None else naive_sparse
    if atten_mask is not None and ns in (0, 1):          # modes 2-4: the template carries no information
        mask_b = batched_mask(atten_mask, b, decode)
    if decode:                                           # SPEC 5: only a plain mask applies
        ns = 1 if mask_b is not None else 0
    pse_b = None
    if pse is not None:
        pse_b = pse.double().expand(b, -1, -1, -1)
    ref_out, ref_lse = naive.attention(
        q.double(), k.double(), v.double(), scale=scale, q_windows=[(0, x) for x in aq],
        kv_windows=[(0, x) for x in akv], mask=mask_b, sparse_mode=ns,
        pre_tokens=naive_pre if naive_pre is not None else (INT_MAX if pre_tokens is None else pre_tokens),
        next_tokens=naive_next if naive_next is not None else (INT_MAX if next_tokens is None else next_tokens),
        pse=pse_b,
        inner_precise=inner_precise if naive_ip is None else naive_ip)

    dv = v.shape[3]
    assert out.dtype == dtype, (out.dtype, dtype)
    assert tuple(out.shape) == expected_out_shape(layout, b, n, sq, dv), (tuple(out.shape), layout)
    oc = out_to_canon(out, layout, n)
    assert_close(oc, ref_out, dtype)
    lc = None
    if api == "fused" and lse:
        assert tuple(l.shape) == (b, n, sq, 1), tuple(l.shape)
        lc = l[..., 0]
        assert_lse(lc, ref_lse)
    dead = torch.isposinf(ref_lse)
    assert_zero_rows(oc, lc, dead)
    return oc, lc, ref_out, ref_lse


# ---------------------------------------------------------------------------------------------- paged KV
def block_table(lens: Sequence[int], bs: int, g: torch.Generator, *, spare: int = 2, shuffle: bool = True,
                share: int = 0, extra_cols: int = 0, unused=-1):
    """Assign pool blocks to every batch's KV (SPEC 8). Returns (table int32 [B, MB], num_blocks).

    Each batch needs ceil(lens[b] / bs) blocks. `share` leading blocks are the same ids for every batch that
    needs them (a shared pool: the pool may be smaller than B x KV_S). `spare` extra pool blocks are never
    used; ids are shuffled; entries past a batch's last block are `unused` (an int, or a callable
    (b, col) -> int)."""
    need = [(l + bs - 1) // bs for l in lens]
    mb = max(need + [1]) + extra_cols
    n_own = sum(max(n - share, 0) for n in need)
    nb = share + n_own + spare
    perm = torch.randperm(nb, generator=g).tolist() if shuffle else list(range(nb))
    shared_ids, nxt = perm[:share], share
    table = []
    for b, n in enumerate(need):
        row = []
        for c in range(mb):
            if c < n:
                if c < share:
                    row.append(shared_ids[c])
                else:
                    row.append(perm[nxt])
                    nxt += 1
            else:
                row.append(unused(b, c) if callable(unused) else unused)
        table.append(row)
    return torch.tensor(table, dtype=torch.int32), nb


def paged_pool(table: torch.Tensor, lens: Sequence[int], bs: int, nb: int, kv_n: int, d: int,
               g: torch.Generator, dtype=torch.float16, poison: bool = True) -> torch.Tensor:
    """Canonical pool [NB, KV_N, bs, D]: random where some batch holds a valid token, NaN (poison) in every
    other slot (unused blocks, slots past a sequence's length)."""
    pool = randn((nb, kv_n, bs, d), g, dtype)
    if not poison or not pool.is_floating_point():
        return pool
    used = torch.zeros(nb, bs, dtype=torch.bool)
    for b, l in enumerate(lens):
        nblk = (l + bs - 1) // bs
        ids = table[b, :nblk].long()
        slots = (torch.arange(nblk * bs) < l).reshape(nblk, bs)
        used[ids] |= slots
    out = pool.clone()
    out.masked_fill_(~used[:, None, :, None].expand_as(out), float("nan"))
    return out


def gather_paged(pool: torch.Tensor, table: torch.Tensor, lens: Sequence[int], bs: int) -> torch.Tensor:
    """Canonical pool [NB, KV_N, bs, D] + table -> dense [B, KV_N, MB*bs, D] holding token p of batch b at
    position p; positions past lens[b] are NaN (float) or 0 (integer)."""
    b, mb = table.shape
    nb, kv_n, _, d = pool.shape
    fill = float("nan") if pool.is_floating_point() else 0
    out = torch.full((b, kv_n, mb * bs, d), fill, dtype=pool.dtype)
    for i, l in enumerate(lens):
        nblk = (l + bs - 1) // bs
        if nblk:
            blocks = pool[table[i, :nblk].long()]                                   # [nblk, KV_N, bs, D]
            out[i, :, :l] = blocks.permute(1, 0, 2, 3).reshape(kv_n, nblk * bs, d)[:, :l]
    return out


def pool_as_cache(pool: torch.Tensor, fmt: str) -> torch.Tensor:
    """Canonical pool [NB, KV_N, bs, D] -> the cache tensor passed to fia: '3d' (blocknum, block_size, KV_N*D)
    or '4d' (blocknum, KV_N, block_size, D)."""
    nb, kv_n, bs, d = pool.shape
    if fmt == "3d":
        return pool.permute(0, 2, 1, 3).reshape(nb, bs, kv_n * d).contiguous()
    if fmt == "4d":
        return pool.contiguous()
    raise ValueError(fmt)


def fused_kwargs(n, kvn, layout, scale, *, lse=True, sparse_mode=0, inner_precise=0, act_q=None, decode=False,
                 mask=None, pse=None, pre=None, nxt=None, **extra) -> dict:
    """Keywords of npu_fused_infer_attention_score for the storage / sequence tests; optional ones only if set."""
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout=layout, scale=scale, softmax_lse_flag=lse,
              sparse_mode=sparse_mode, inner_precise=inner_precise, **extra)
    if act_q is not None and not decode:
        kw["actual_seq_lengths"] = list(act_q)
    for name, value in (("atten_mask", mask), ("pse_shift", pse), ("pre_tokens", pre), ("next_tokens", nxt)):
        if value is not None:
            kw[name] = value
    return kw


def full_path(fn, *args, **kw):
    """fn(*args, **kw) without replay (fia.replay's key is never computed)."""
    from fia import replay
    saved = replay.key_of
    replay.key_of = lambda *a: None
    try:
        return fn(*args, **kw)
    finally:
        replay.key_of = saved


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape, strides and bits (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    if a.is_floating_point():
        it = {2: torch.int16, 4: torch.int32}[a.element_size()]
        a, b = a.view(it), b.view(it)
    return torch.equal(a, b)


EXTREMES = ("nan_q", "inf_k", "nan_v", "huge_v", "q_max", "v_max")


def plant_extreme(what: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Put one of EXTREMES into [B, N, S, D] q / k / v (S >= 21, N >= 4): a NaN, an infinity, V beyond the kernels'
    safe range (2^110), a query row at the dtype's largest value (scores beyond float32's), V at it."""
    big = torch.finfo(q.dtype).max
    if what == "nan_q":
        q[0, 1, 5, 3] = float("nan")
    elif what == "inf_k":
        k[0, 0, 9, 2] = float("inf")
    elif what == "nan_v":
        v[0, 1, 4, 0] = float("nan")
    elif what == "huge_v":
        v[0, 0, 6, :] = 2.0 ** 110
    elif what == "q_max":
        q[0, 2, 20, :] = big
    elif what == "v_max":
        v[0, 1, 0, :] = big
    else:
        raise ValueError(what)
