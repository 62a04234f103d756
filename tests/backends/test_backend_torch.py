"""The torch backend against the reference backend, on random problems with NaN-poisoned padding.

Every case runs the same call (portable validation: the hardware alignment rules do not matter here) forced
to `reference` and to `torch`, the torch backend under four tilings: its defaults, the online schedule with
tiny tiles (many key chunks and row blocks) with every batch in one group (chunks of padding keys) and with
one group per length, and the rows schedule with tiny key chunks; each tiling once more with torch's default
device set to meta (a tensor created without its input's device would fail the call); where CUDA exists, also
on the GPU. Results must agree: outputs within one rounding of the output dtype (both accumulate in float32),
lse within LSE_TOL (+inf rows identical), rows that are 0 in the reference exactly 0, and no NaN (KV past the
lengths, unused paged blocks, query rows past the lengths and per-token scales past the lengths are NaN: a wild
read would show). Also: memory stays O(chunk) for a long prefill, and the backend's rank.

These tests compare two backends explicitly, so they run once whatever backend the suite forces.
"""
from __future__ import annotations
import contextlib

import os
import subprocess
import sys
import types
import zlib

import pytest
import torch

import fia
from fia.backends import registry
from fia.backends.torchops.backend import TorchBackend
from fia.backends.torchops import plan

pytestmark = pytest.mark.backend_independent      # one run with automatic backend selection (conftest)

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
NAN = float("nan")
FUSED, FUSED_V2 = fia.npu_fused_infer_attention_score, fia.npu_fused_infer_attention_score_v2
OUT_TOL = {F16: 2e-3, BF16: 1.6e-2, F32: 1e-5, F64: 1e-10, torch.int8: 1.01}   # relative to max|ref| (int8: codes)
LSE_TOL = 1e-4

_TINY = dict(kv_elems=16 * 64, score_elems=16 * 16, rows_elems=0, max_chunk=16)
_ONE_GROUP = dict(group_waste=1e9, group_min_cost=1 << 60)
TILINGS = {
    "default": {},
    "online": dict(_TINY, **_ONE_GROUP),                           # padding keys inside tiles, chunks of padding
    "online-split": dict(_TINY, group_waste=1.0, group_min_cost=0),   # one group per length
    "rows": dict(kv_elems=16 * 64, rows_elems=1 << 40, **_ONE_GROUP),
    # the budgets used off the CPU (TorchBackend.device_scale), here on the CPU
    "device": {n: getattr(TorchBackend, n) * f for n, f in TorchBackend.device_scale.items()},
}


def _gen(*parts) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(zlib.crc32(repr(parts).encode()) % 100000)
    return g


def _randn(shape, g, dtype, std=1.0):
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(dtype)


def _poison(x: torch.Tensor, lens, dim: int = 2) -> torch.Tensor:
    """canonical [B, N, S, D]: NaN at positions >= lens[b] along dim."""
    x = x.clone()
    for b, n in enumerate(lens):
        x.narrow(0, b, 1).narrow(dim, n, x.shape[dim] - n).fill_(NAN)
    return x


def _bsh(x: torch.Tensor) -> torch.Tensor:
    b, n, s, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, s, n * d)


def _check(o, l, ro, rl, what):
    assert o.shape == ro.shape and o.dtype == ro.dtype, what
    tol = OUT_TOL[o.dtype]
    rel = o.dtype.is_floating_point                                   # int8 outputs: in codes
    o, ro = o.to(torch.float64), ro.to(torch.float64)
    assert not torch.isnan(o).any() and not torch.isnan(ro).any(), f"{what}: NaN in the output"
    scale = max(ro.abs().max().item(), 1e-30) if rel and ro.numel() else 1.0
    err = (o - ro).abs().max().item() / scale if ro.numel() else 0.0
    assert err <= tol, f"{what}: out error {err:.3g} > {tol}"
    zero = ro == 0
    assert (o[zero] == 0).all(), f"{what}: rows 0 in the reference are not 0"
    if rl is None:
        assert l is None or l.numel() == 0 or l.shape == (1,), what
        return
    assert torch.equal(torch.isposinf(l), torch.isposinf(rl)), f"{what}: +inf lse rows differ"
    fin = torch.isfinite(rl)
    d = ((l[fin] - rl[fin]).abs() / rl[fin].abs().clamp(min=1.0)).max().item() if fin.any() else 0.0
    assert d <= LSE_TOL, f"{what}: lse error {d:.3g}"


@contextlib.contextmanager
def _default_device(dev):
    """torch's default device set to meta for the "meta-default" run (inputs stay on the CPU)."""
    if dev != "meta-default":
        yield
        return
    old = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(old)


def _on(dev, x):
    """x with every tensor (also inside lists / tuples / dicts: the keywords) moved to dev."""
    if dev == "meta-default":
        return x
    if isinstance(x, torch.Tensor):
        return x.to(dev)
    if isinstance(x, (list, tuple)):
        return type(x)(_on(dev, y) for y in x)
    if isinstance(x, dict):
        return {k: _on(dev, y) for k, y in x.items()}
    return x


CUDA = torch.cuda.is_available()


def both(monkeypatch, fn, *args, _tol=None, _mode="portable", **kw):
    """fn(*args, **kw) -> (out, lse) under the reference, then under the torch backend with each tiling (and
    on CUDA where there is one, tensors moved there); every result compared with the reference's. One CPU run
    makes "meta" the default device: a tensor the backend creates without naming its input's device would land
    there and fail the call or the comparison, so the backend is shown to follow its inputs' device."""
    runs = [(name, dev) for name in TILINGS for dev in ("cpu", "meta-default")]
    runs += [("default", "cuda"), ("online", "cuda")] if CUDA else []
    with fia.validation_mode(_mode):
        with fia.use_backend("reference"):
            ro, rl = fn(*args, **kw)
        for name, dev in runs:
            with monkeypatch.context() as m:
                for k, v in TILINGS[name].items():
                    m.setattr(TorchBackend, k, v)
                with fia.use_backend("torch"), _default_device(dev):
                    o, l = fn(*_on(dev, args), **_on(dev, kw))
            o, l = o.cpu(), None if l is None else l.cpu()
            if _tol is not None:
                OUT_TOL[o.dtype], old = _tol, OUT_TOL.get(o.dtype)
                try:
                    _check(o, l, ro, rl, f"tiling {name} on {dev}")
                finally:
                    OUT_TOL[o.dtype] = old
            else:
                _check(o, l, ro, rl, f"tiling {name} on {dev}")
    return ro, rl


# ------------------------------------------------------------------------------------------------ decode
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("layout", ["BSH", "BNSD", "BSND"])
def test_decode_gqa_lengths(dtype, layout, monkeypatch):
    """GQA 8:2 decode, per-batch KV lengths from 1 to S (one batch of them short: several groups)."""
    B, N, KVN, S, D = 4, 8, 2, 300, 64
    g = _gen("dec", dtype, layout)
    lens = [300, 1, 77, 150]
    q = _randn((B, N, 1, D), g, dtype)
    k = _poison(_randn((B, KVN, S, D), g, dtype), lens)
    v = _poison(_randn((B, KVN, S, D), g, dtype), lens)
    conv = {"BSH": _bsh, "BNSD": lambda x: x, "BSND": lambda x: x.permute(0, 2, 1, 3)}[layout]
    both(monkeypatch, FUSED, conv(q), conv(k), conv(v), num_heads=N, num_key_value_heads=KVN,
         input_layout=layout, scale=D ** -0.5, actual_seq_lengths_kv=lens, softmax_lse_flag=True)


def test_decode_paged_int8_per_token(monkeypatch):
    """Paged int8 KV with per-token-per-head scales stored by block (mode 5) and offsets: the pool's unused
    slots and blocks are NaN-poisoned scales and random codes."""
    B, N, KVN, D, bs = 3, 8, 2, 32, 16
    g = _gen("paged-int8")
    lens = [70, 5, 33]
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 3
    perm = torch.randperm(nb, generator=g).tolist()
    table = torch.full((B, max(need) + 1), -1, dtype=torch.int32)
    it = iter(perm)
    for b, n in enumerate(need):
        for c in range(n):
            table[b, c] = next(it)
    kq = torch.randint(-128, 128, (nb, KVN, bs, D), generator=g, dtype=torch.int8)
    vq = torch.randint(-128, 128, (nb, KVN, bs, D), generator=g, dtype=torch.int8)
    used = torch.zeros(nb, bs, dtype=torch.bool)
    for b, n in enumerate(lens):
        for p in range(n):
            used[table[b, p // bs], p % bs] = True

    def scales(std):
        s = (torch.rand(nb, KVN, bs, generator=g) * std + 0.01).float()
        return s.masked_fill(~used[:, None, :], NAN)
    ks, vs, ko, vo = scales(0.02), scales(0.02), scales(3.0), scales(3.0)
    q = _randn((B, N, 1, D), g, F16)
    both(monkeypatch, FUSED, q, kq, vq, num_heads=N, num_key_value_heads=KVN, input_layout="BNSD",
         scale=D ** -0.5, block_table=table, block_size=bs, actual_seq_lengths_kv=lens, key_antiquant_scale=ks,
         value_antiquant_scale=vs, key_antiquant_offset=ko, value_antiquant_offset=vo, key_antiquant_mode=5,
         value_antiquant_mode=5, softmax_lse_flag=True)


@pytest.mark.parametrize("granularity", ["channel", "token"])
def test_decode_dense_int8_antiquant(granularity, monkeypatch):
    """int8 K / V, combined parameters: per-channel (mode 0) or per-token (mode 1) with offsets; per-token
    scales past the lengths are NaN."""
    B, N, KVN, S, D = 3, 4, 2, 96, 32
    g = _gen("aq", granularity)
    lens = [96, 40, 7]
    q = _randn((B, N, 1, D), g, F16)
    kq = torch.randint(-128, 128, (B, KVN, S, D), generator=g, dtype=torch.int8)
    vq = torch.randint(-128, 128, (B, KVN, S, D), generator=g, dtype=torch.int8)
    if granularity == "channel":
        sc = (torch.rand(2, KVN, 1, D, generator=g) * 0.02 + 0.005).to(F16)
        off = _randn((2, KVN, 1, D), g, F16, 2.0)
        kw = dict(antiquant_scale=sc, antiquant_offset=off, antiquant_mode=0)
    else:
        sc = torch.rand(2, B, S, generator=g) * 0.02 + 0.005
        off = torch.randn(2, B, S, generator=g) * 2.0
        for b, n in enumerate(lens):
            sc[:, b, n:] = NAN
            off[:, b, n:] = NAN
        kw = dict(antiquant_scale=sc, antiquant_offset=off, antiquant_mode=1)
    both(monkeypatch, FUSED, q, kq, vq, num_heads=N, num_key_value_heads=KVN, input_layout="BNSD",
         scale=D ** -0.5, actual_seq_lengths_kv=lens, softmax_lse_flag=True, **kw)


# ------------------------------------------------------------------------------------------------ prefill
MASK_CASES = {
    "mode0-user-band": dict(sparse_mode=0, user=True, pre=20, nxt=5),
    "mode0-user-rowfix": dict(sparse_mode=0, user=True, ip=2, dense_mask=0.95),
    "mode1": dict(sparse_mode=1, user=True),
    "mode2": dict(sparse_mode=2),
    "mode3": dict(sparse_mode=3),
    "mode3-pse": dict(sparse_mode=3, pse=True),
    "mode4": dict(sparse_mode=4, pre=9, nxt=2),
    "none-pse": dict(sparse_mode=0, pse=True),
}


@pytest.mark.parametrize("case", list(MASK_CASES))
def test_prefill_masks_lengths(case, monkeypatch):
    """Prefill GQA 4:2 with per-batch query / KV lengths (one batch a single row), every sparse mode, user
    masks (one so dense that whole rows are masked: with inner_precise 2 they are 0 / +inf), pse."""
    c = MASK_CASES[case]
    B, N, KVN, QS, KS, D = 3, 4, 2, 70, 90, 32
    g = _gen("pre", case)
    aq, ak = [70, 33, 1], [90, 50, 12]
    q = _poison(_randn((B, N, QS, D), g, F16), aq)
    k = _poison(_randn((B, KVN, KS, D), g, F16), ak)
    v = _poison(_randn((B, KVN, KS, D), g, F16), ak)
    kw = dict(sparse_mode=c["sparse_mode"], inner_precise=c.get("ip", 0))
    if c.get("user"):
        kw["atten_mask"] = torch.rand(B, QS, KS, generator=g) < c.get("dense_mask", 0.3)
    elif c["sparse_mode"] in (2, 3, 4):
        kw["atten_mask"] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
    if "pre" in c:
        kw.update(pre_tokens=c["pre"], next_tokens=c["nxt"])
    if c.get("pse"):
        kw["pse_shift"] = _randn((B, N, QS, KS), g, F16)
    both(monkeypatch, FUSED, _bsh(q), _bsh(k), _bsh(v), num_heads=N, num_key_value_heads=KVN,
         input_layout="BSH", scale=D ** -0.5, actual_seq_lengths=aq, actual_seq_lengths_kv=ak, softmax_lse_flag=True,
         **kw)


def test_prefill_tnd_causal(monkeypatch):
    """TND (packed rows) causal prefill with very different lengths: several groups, rows written by index."""
    N, KVN, D = 4, 1, 32
    g = _gen("tnd")
    ql, kl = [5, 64, 17, 1], [9, 64, 40, 3]
    q = _randn((sum(ql), N, D), g, BF16)
    k = _randn((sum(kl), KVN, D), g, BF16)
    v = _randn((sum(kl), KVN, D), g, BF16)
    cum = lambda xs: [sum(xs[:i + 1]) for i in range(len(xs))]   # noqa: E731
    both(monkeypatch, FUSED, q, k, v, num_heads=N, num_key_value_heads=KVN, input_layout="TND",
         scale=D ** -0.5, sparse_mode=3, atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1),
         actual_seq_lengths=cum(ql), actual_seq_lengths_kv=cum(kl), softmax_lse_flag=True)


def test_prefill_left_padding(monkeypatch):
    """Left padding (SPEC 4): windows at different offsets per batch; everything outside them NaN."""
    B, N, QS, KS, D = 3, 2, 24, 40, 16
    g = _gen("lpad")
    aq, ak = [10, 24, 3], [17, 40, 5]
    qp, kp = 2, 3
    q = _randn((B, N, QS, D), g, F16)
    k = _randn((B, N, KS, D), g, F16)
    v = _randn((B, N, KS, D), g, F16)
    for b in range(B):      # valid rows: [S - pad - len, S - pad)
        for x, s, pad, n in ((q, QS, qp, aq[b]), (k, KS, kp, ak[b]), (v, KS, kp, ak[b])):
            x[b, :, :s - pad - n] = NAN
            x[b, :, s - pad:] = NAN
    both(monkeypatch, FUSED, q, k, v, num_heads=N, input_layout="BNSD", scale=0.25, actual_seq_lengths=aq,
         actual_seq_lengths_kv=ak, query_padding_size=torch.tensor([qp]), kv_padding_size=torch.tensor([kp]),
         softmax_lse_flag=True)


def test_prefill_paged(monkeypatch):
    """Paged prefill (block 16, shuffled table, NaN in every slot no batch holds), causal."""
    B, N, KVN, QS, D, bs = 2, 4, 2, 20, 32, 16
    g = _gen("paged-pre")
    lens, aq = [50, 21], [20, 7]
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 2
    perm = torch.randperm(nb, generator=g).tolist()
    table = torch.full((B, max(need)), -1, dtype=torch.int32)
    it = iter(perm)
    for b, n in enumerate(need):
        for c in range(n):
            table[b, c] = next(it)
    pool_k = _randn((nb, KVN, bs, D), g, F16)
    pool_v = _randn((nb, KVN, bs, D), g, F16)
    used = torch.zeros(nb, bs, dtype=torch.bool)
    for b, n in enumerate(lens):
        for p in range(n):
            used[table[b, p // bs], p % bs] = True
    for pool in (pool_k, pool_v):
        pool.masked_fill_(~used[:, None, :, None], NAN)
    q = _poison(_randn((B, N, QS, D), g, F16), aq)
    both(monkeypatch, FUSED, q, pool_k, pool_v, num_heads=N, num_key_value_heads=KVN, input_layout="BNSD",
         scale=D ** -0.5, block_table=table, block_size=bs, actual_seq_lengths=aq, actual_seq_lengths_kv=lens,
         sparse_mode=3, atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1), softmax_lse_flag=True)


def test_full_int8_prefill(monkeypatch):
    """Full int8 quantization (SPEC 11) with lengths: P quantized between the products, two passes over keys.
    P8 entries at a rounding boundary may land either side: one code of P8 x V tolerance."""
    B, N, QS, KS, D = 2, 2, 12, 50, 16
    g = _gen("int8")
    q8 = torch.randint(-128, 128, (B, N, QS, D), generator=g, dtype=torch.int8)
    k8 = torch.randint(-128, 128, (B, N, KS, D), generator=g, dtype=torch.int8)
    v8 = torch.randint(-128, 128, (B, N, KS, D), generator=g, dtype=torch.int8)
    both(monkeypatch, FUSED, q8, k8, v8, num_heads=N, input_layout="BNSD", scale=0.1,
         dequant_scale1=torch.tensor([0.002]), quant_scale1=torch.tensor([200.0]), dequant_scale2=torch.tensor([0.01]),
         actual_seq_lengths=[12, 5], actual_seq_lengths_kv=[50, 20], softmax_lse_flag=True, _tol=2e-2)


def test_sink_and_float64(monkeypatch):
    """learnable_sink with a causal mask (v2), and the float64 portable path (float64 accumulation)."""
    B, N, QS, KS, D = 2, 4, 30, 45, 16
    g = _gen("sink")
    q = _randn((B, N, QS, D), g, F16)
    k = _randn((B, N, KS, D), g, F16)
    v = _randn((B, N, KS, D), g, F16)
    sink = _randn((N,), g, F32)
    both(monkeypatch, FUSED_V2, q, k, v, num_query_heads=N, input_layout="BNSD", softmax_scale=0.25,
         learnable_sink=sink, sparse_mode=3, atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1),
         actual_seq_kvlen=[45, 30], return_softmax_lse=True)
    q64, k64, v64 = (x.to(F64) for x in (q, k, v))
    both(monkeypatch, FUSED, q64, k64, v64, num_heads=N, input_layout="BNSD", scale=0.25,
         actual_seq_lengths_kv=[45, 3], softmax_lse_flag=True, sparse_mode=2,
         atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1))


# ------------------------------------------------------------------------------------------------ plan
def test_groups_split_by_cost():
    """Equal lengths: one group; batches of very different lengths run in separate groups (little padding)."""
    ns = types.SimpleNamespace
    geo = lambda lens: tuple(ns(s1=1, s2=n, q_lo=0, kv_lo=0, prefix=0) for n in lens)  # noqa: E731
    mk = lambda lens: ns(geometry=geo(lens), N=2, kv=ns(kind="dense"), device=torch.device("cpu"),  # noqa: E731
                         mask=ns(band_for=lambda s1, s2: None))
    assert [g.bidx for g in plan.groups(mk([4096] * 4))] == [[0, 1, 2, 3]]
    gs = plan.groups(mk([4096, 4096, 100000, 5]), waste=1.0, min_cost=0)
    assert sorted(tuple(g.bidx) for g in gs) == [(0, 1), (2,), (3,)]


def test_rank_below_cpu_kernels_and_first_elsewhere():
    be = registry.by_name("torch")
    cpu = types.SimpleNamespace(device=torch.device("cpu"))
    gpu = types.SimpleNamespace(device=torch.device("cuda"))
    others = {b.name: b.priority for b in registry.backends()}
    assert others["reference"] < be.preference(cpu) < min(v for n, v in others.items() if n in ("decode", "prefill"))
    assert be.preference(gpu) > max(others.values())


# ------------------------------------------------------------------------------------------------ memory
_MEM = r"""
import resource, sys, torch, fia
S = 8192
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 1, S, 64, generator=g) for _ in range(3))
kw = dict(num_heads=1, input_layout="BNSD", scale=0.125)
with fia.validation_mode("portable"), fia.use_backend(sys.argv[1]):
    fia.npu_fused_infer_attention_score(q[:, :, :64].contiguous(), k[:, :, :64].contiguous(),
                                        v[:, :, :64].contiguous(), **kw)
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = fia.npu_fused_infer_attention_score(q, k, v, **kw)[0]
    r1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ref = torch.softmax((q[0, 0, :512] @ k[0, 0].T) * 0.125, -1) @ v[0, 0]
assert (out[0, 0, :512] - ref).abs().max() < 1e-4
print((r1 - r0) * 1024)
"""


def test_prefill_memory_is_o_chunk():
    """Q_S = KV_S = 8192 (B = N = 1, D = 64, float32): the peak RSS growth of the call (child process, its
    high-water mark) stays below 1/4 of the 256 MiB score matrix."""
    env = dict(os.environ, FIA_VALIDATION="portable")
    r = subprocess.run([sys.executable, "-c", _MEM, "torch"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    grew = int(r.stdout.split()[-1])
    assert grew < 64 * 2 ** 20, f"peak RSS grew {grew / 2 ** 20:.0f} MiB (scores would be 256 MiB)"


# ------------------------------------------------------------------------------------------------ device
def test_every_factory_call_names_a_device():
    """Every tensor the backend creates names its device (the meta-default runs reach only the common paths)."""
    import ast
    import pathlib
    factories = {"zeros", "ones", "full", "empty", "arange", "tensor", "as_tensor", "linspace", "eye"}
    files = sorted(pathlib.Path(sys.modules[TorchBackend.__module__].__file__).parent.glob("*.py"))
    calls, missing = 0, []
    for f in files:
        for n in ast.walk(ast.parse(f.read_text())):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in factories
                    and isinstance(n.func.value, ast.Name) and n.func.value.id == "torch"):
                calls += 1
                if "device" not in {k.arg for k in n.keywords}:
                    missing.append(f"{f.name}:{n.lineno} torch.{n.func.attr}")
    assert calls > 20, calls
    assert not missing, missing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu_reference():
    """On CUDA the torch backend is chosen by default and matches the CPU reference (decode paged + prefill)."""
    g = _gen("cuda")
    B, N, KVN, S, D = 2, 8, 2, 200, 64
    q = _randn((B, N, 1, D), g, BF16)
    k = _poison(_randn((B, KVN, S, D), g, BF16), [200, 31])
    v = _poison(_randn((B, KVN, S, D), g, BF16), [200, 31])
    kw = dict(num_heads=N, num_key_value_heads=KVN, input_layout="BNSD", scale=D ** -0.5,
              actual_seq_lengths_kv=[200, 31], softmax_lse_flag=True)
    assert fia.explain(q.cuda(), k.cuda(), v.cuda(), **kw).selected == "torch"
    o, l = fia.npu_fused_infer_attention_score(q.cuda(), k.cuda(), v.cuda(), **kw)
    with fia.use_backend("reference"):
        ro, rl = fia.npu_fused_infer_attention_score(q, k, v, **kw)
    _check(o.cpu(), l.cpu(), ro, rl, "cuda decode")
    qp = _randn((B, N, 100, D), g, F16)
    kp, vp = _randn((B, KVN, 150, D), g, F16), _randn((B, KVN, 150, D), g, F16)
    kw = dict(num_heads=N, num_key_value_heads=KVN, input_layout="BNSD", scale=D ** -0.5, sparse_mode=3,
              atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1), softmax_lse_flag=True)
    o, l = fia.npu_fused_infer_attention_score(qp.cuda(), kp.cuda(), vp.cuda(),
                                               **dict(kw, atten_mask=kw["atten_mask"].cuda()))
    with fia.use_backend("reference"):
        ro, rl = fia.npu_fused_infer_attention_score(qp, kp, vp, **kw)
    _check(o.cpu(), l.cpu(), ro, rl, "cuda prefill")
