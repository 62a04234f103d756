"""Call replay (fia/replay.py, DecodeBackend.replay): a repeated call's prepared launch must return exactly what
the full path returns, on new data every call, and must never serve a call it does not cover."""
import threading

import numpy as np

import pytest
import torch

import fia
from fia import replay
from fia.backends.decode import backend as DEC
from fia.backends.decode import inputs as DEC_INPUTS, plan as DEC_PLAN
from fia.parse import memo

import naive
from util import bits_equal, full_path, gen, randn, to_layout

pytestmark = [pytest.mark.skipif(not DEC.numba_available(), reason="numba not installed"),
              pytest.mark.backends("decode")]      # only the decode backend offers replays (conftest)


@pytest.fixture(autouse=True)
def fresh(monkeypatch, fia_backend):
    """The decode backend's replay (the suite's other backends offer none); an empty replay table, the memo
    looking up every call, counters from zero."""
    monkeypatch.setattr(memo, "_TRIAL", 1 << 30)
    replay.clear()
    monkeypatch.setattr(replay, "stats", {"admitted": 0, "refused": 0, "replayed": 0})


def inputs(seed, B, N, KV_N, Q_S, S, D, dtype, layout):
    g = gen(seed)
    q = randn((B, N, Q_S, D), g, dtype)
    k = randn((B, KV_N, S, D), g, dtype)
    v = randn((B, KV_N, S, D), g, dtype)
    return q, k, v, to_layout(q, layout), to_layout(k, layout), to_layout(v, layout)


CASES = [  # (B, N, KV_N, Q_S, S, D, dtype, layout, lse)
    (1, 8, 8, 1, 128, 128, torch.bfloat16, "BNSD", False),
    (2, 8, 2, 1, 200, 64, torch.float16, "BSH", True),
    (3, 4, 1, 1, 77, 32, torch.bfloat16, "BSND", True),
    (2, 16, 4, 3, 96, 128, torch.float16, "BNSD", True),
    (2, 8, 2, 1, 2000, 128, torch.bfloat16, "BSND", False),       # split KV, two threads where there are two
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[7]}-{c[6]}-qs{c[3]}-kv{c[4]}-lse{int(c[8])}")
def test_replay_equals_full_path_on_new_data(case):
    B, N, KV_N, Q_S, S, D, dt, layout, lse = case
    kw = dict(num_heads=N, num_key_value_heads=KV_N, input_layout=layout, scale=D ** -0.5, softmax_lse_flag=lse)
    for step in range(5):
        q0, k0, v0, q, k, v = inputs(100 + step, B, N, KV_N, Q_S, S, D, dt, layout)
        got_out, got_lse = fia.npu_fused_infer_attention_score(q, k, v, **kw)
        want_out, want_lse = full_path(fia.npu_fused_infer_attention_score, q, k, v, **kw)
        assert bits_equal(got_out, want_out) and bits_equal(got_lse, want_lse)
        ref, _ = naive.attention(q0.double(), k0.double(), v0.double(), scale=D ** -0.5)
        assert torch.allclose(to_layout(ref, layout).to(dt).float(), got_out.float(), atol=2e-2, rtol=2e-2)
    assert replay.stats["admitted"] == 1 and replay.stats["replayed"] >= 2, replay.stats


def test_replay_reads_the_call_s_own_views():
    """Two windows of one cache with equal metadata (different addresses), and a query view into a bigger
    buffer: every call reads its own tensors."""
    B, N, KV_N, S, D = 2, 4, 2, 64, 64
    g = gen(7)
    cache_k = randn((B, KV_N, 4 * S, D), g, torch.bfloat16)
    cache_v = randn((B, KV_N, 4 * S, D), g, torch.bfloat16)
    qbuf = randn((B, N, 3, D), g, torch.bfloat16)
    kw = dict(num_heads=N, num_key_value_heads=KV_N, input_layout="BNSD", scale=0.125)
    for w in (0, 1, 2, 3, 2, 1, 0):
        k, v, q = cache_k[:, :, w * S:(w + 1) * S], cache_v[:, :, w * S:(w + 1) * S], qbuf[:, :, w % 3:w % 3 + 1]
        got, _ = fia.npu_fused_infer_attention_score(q, k, v, **kw)
        want, _ = full_path(fia.npu_fused_infer_attention_score, q, k, v, **kw)
        assert bits_equal(got, want)
    assert replay.stats["replayed"] >= 3, replay.stats


def test_incre_and_prompt_entry_points_replay():
    B, N, KV_N, S, D = 2, 8, 2, 96, 64
    for step in range(4):
        q0, k0, v0, q, k, v = inputs(300 + step, B, N, KV_N, 1, S, D, torch.float16, "BSH")
        got = fia.npu_incre_flash_attention(q, k, v, num_heads=N, num_key_value_heads=KV_N, input_layout="BSH",
                                            scale_value=0.125)
        want = full_path(fia.npu_incre_flash_attention, q, k, v, num_heads=N, num_key_value_heads=KV_N,
                         input_layout="BSH", scale_value=0.125)
        assert type(got) is torch.Tensor and bits_equal(got, want)
        got = fia.npu_prompt_flash_attention(q, k, v, num_heads=N, num_key_value_heads=KV_N, input_layout="BSH",
                                             scale_value=0.125, next_tokens=65536)
        want = full_path(fia.npu_prompt_flash_attention, q, k, v, num_heads=N, num_key_value_heads=KV_N,
                         input_layout="BSH", scale_value=0.125, next_tokens=65536)
        assert type(got) is torch.Tensor and bits_equal(got, want)
    assert replay.stats["admitted"] == 2 and replay.stats["replayed"] >= 4, replay.stats


def test_key_separates_what_the_full_path_separates():
    q = torch.randn(1, 4, 1, 32).to(torch.float16)
    k = torch.randn(1, 4, 16, 32).to(torch.float16)
    base = dict(num_heads=4, input_layout="BNSD", scale=0.5)
    key = replay.key_of("f", q, k, k, base)
    assert key is not None
    assert key != replay.key_of("f", q, k, k, dict(base, scale=-0.5))
    assert replay.key_of("f", q, k, k, dict(base, scale=0.0)) != replay.key_of("f", q, k, k, dict(base, scale=-0.0))
    assert replay.key_of("f", q, k, k, dict(base, num_heads=4.0)) != key         # 4.0 is not 4
    assert replay.key_of("f", q, k, k, dict(base, softmax_lse_flag=1)) != replay.key_of(
        "f", q, k, k, dict(base, softmax_lse_flag=True))
    assert replay.key_of("f", q, k.transpose(2, 3).contiguous().transpose(2, 3), k, base) != key   # strides
    assert replay.key_of("g", q, k, k, base) != key
    with fia.validation_mode("portable"):
        assert replay.key_of("f", q, k, k, base) != key
    with fia.use_backend("reference"):
        assert replay.key_of("f", q, k, k, base) != key
    # never keyed: another tensor argument, a lengths list, a tensor subclass
    assert replay.key_of("f", q, k, k, dict(base, atten_mask=torch.zeros(1, 1, 16, dtype=torch.bool))) is None
    assert replay.key_of("f", q, k, k, dict(base, actual_seq_lengths_kv=[16])) is None
    assert replay.key_of("f", torch.nn.Parameter(q.float()), k, k, base) is None
    # dequantization tensors: keyed by their metadata, not their values; with a lengths list too (its count)
    sc = torch.rand(2, 128)
    kq = replay.key_of("f", q, k, k, dict(base, antiquant_scale=sc))
    assert kq is not None and kq != key
    assert replay.key_of("f", q, k, k, dict(base, antiquant_scale=torch.rand(2, 128))) == kq
    assert replay.key_of("f", q, k, k, dict(base, antiquant_scale=sc.half())) != kq
    assert replay.key_of("f", q, k, k, dict(base, antiquant_scale=sc.reshape(2, 4, 32))) != kq
    assert replay.key_of("f", q, k, k, dict(base, antiquant_scale=sc.t().contiguous().t())) != kq
    assert replay.key_of("f", q, k, k, dict(base, key_antiquant_scale=sc)) != kq
    kl = replay.key_of(FUSED, q, k, k, dict(base, antiquant_scale=sc, actual_seq_lengths_kv=[16]))
    assert kl is not None and kl[-3:] == (("antiquant_scale",), "actual_seq_lengths_kv", None)
    kw9 = dict(base, antiquant_scale=torch.rand(2, 128), actual_seq_lengths_kv=[9])
    assert replay.key_of(FUSED, q, k, k, kw9) == kl
    assert replay.key_of(FUSED, q, k, k, dict(base, antiquant_scale=sc.half(), actual_seq_lengths_kv=[16])) != kl


def test_forced_backend_and_mode_are_respected():
    B, N, KV_N, S, D = 1, 4, 4, 64, 64
    kw = dict(num_heads=N, num_key_value_heads=KV_N, input_layout="BNSD", scale=0.125)
    for step in range(3):
        _, _, _, q, k, v = inputs(400 + step, B, N, KV_N, 1, S, D, torch.bfloat16, "BNSD")
        fia.npu_fused_infer_attention_score(q, k, v, **kw)
    assert replay.stats["admitted"] == 1
    calls = []
    real = DEC.DecodeBackend.run
    with fia.use_backend("reference"):          # a forced backend is part of the key: the reference runs
        try:
            DEC.DecodeBackend.run = lambda self, p: calls.append(p) or real(self, p)
            for _ in range(3):
                fia.npu_fused_infer_attention_score(q, k, v, **kw)
        finally:
            DEC.DecodeBackend.run = real
    assert calls == []


def test_stale_plan_takes_the_full_path(monkeypatch):
    B, N, KV_N, S, D = 2, 4, 2, 1500, 64
    kw = dict(num_heads=N, num_key_value_heads=KV_N, input_layout="BNSD", scale=0.125)
    _, _, _, q, k, v = inputs(500, B, N, KV_N, 1, S, D, torch.bfloat16, "BNSD")
    for _ in range(3):
        fia.npu_fused_infer_attention_score(q, k, v, **kw)
    assert replay.stats["admitted"] == 1
    monkeypatch.setattr(DEC_PLAN, "MIN_SPLIT", 8)       # another split: the prepared plan is stale
    monkeypatch.setattr(DEC_PLAN, "ITEMS_PER_THREAD", 64)
    seen = []
    real = DEC_PLAN._plan
    monkeypatch.setattr(DEC_PLAN, "_plan", lambda *a: seen.append(1) or real(*a))
    got, _ = fia.npu_fused_infer_attention_score(q, k, v, **kw)
    assert seen, "the stale replay ran instead of a new plan"
    want, _ = full_path(fia.npu_fused_infer_attention_score, q, k, v, **kw)
    assert bits_equal(got, want)


def test_not_offered_where_other_data_are_read():
    """int4 K/V (packed: the factors' views are not the call's), a mask: no replay (never keyed or never
    offered)."""
    B, N, KV_N, S, D = 1, 4, 4, 64, 64
    g = gen(9)
    q = randn((B, N, 1, D), g, torch.float16)
    k4 = torch.randint(-2 ** 31, 2 ** 31 - 1, (B, KV_N, S, D // 8), dtype=torch.int64).to(torch.int32)
    chan = torch.rand(2, KV_N, D, generator=g).half() + 0.5
    mask = torch.rand(B, 1, 1, S, generator=g) < 0.2
    for kw in (dict(key_antiquant_scale=chan[0], value_antiquant_scale=chan[1]), dict(atten_mask=mask)):
        k = k4 if "key_antiquant_scale" in kw else randn((B, KV_N, S, D), g, torch.float16)
        for _ in range(3):
            fia.npu_fused_infer_attention_score(q, k, k, num_heads=N, num_key_value_heads=KV_N, input_layout="BNSD",
                                                scale=0.125, **kw)
    assert replay.stats["admitted"] == 0 and replay.stats["replayed"] == 0


def _antiquant_args(g, mode: str, KV_N: int, D: int, dt, B: int = 2, S: int = 96):
    """Dequantization arguments of one kind (new values every call, the same metadata)."""
    def pos(*shape, dt=dt):
        return (torch.rand(*shape, generator=g) + 0.5).to(dt)

    def off(*shape, dt=dt):
        return torch.randn(*shape, generator=g).to(dt)
    f32 = torch.float32
    if mode == "tok":                                # per token, key and value in one [2, B, S] tensor
        return dict(antiquant_scale=pos(2, B, S, dt=f32), antiquant_offset=off(2, B, S, dt=f32), antiquant_mode=1)
    if mode == "sep-tok":
        return dict(key_antiquant_scale=pos(1, B, S, dt=f32), value_antiquant_scale=pos(1, B, S, dt=f32),
                    key_antiquant_mode=1, value_antiquant_mode=1)
    if mode == "sep-tok-head":                       # per token and head: slices of wider tensors
        sc, of = pos(B, KV_N, 2 * S, dt=f32), off(B, KV_N, 2 * S, dt=f32)
        return dict(key_antiquant_scale=sc[..., :S], value_antiquant_scale=sc[..., S:],
                    key_antiquant_offset=of[..., :S], value_antiquant_offset=of[..., S:],
                    key_antiquant_mode=3, value_antiquant_mode=3)
    if mode == "chan+tok":                           # key per channel, value per token (fp16 query)
        return dict(key_antiquant_scale=pos(KV_N, D), key_antiquant_offset=off(KV_N, D),
                    value_antiquant_scale=pos(1, B, S, dt=f32), value_antiquant_offset=off(1, B, S, dt=f32),
                    key_antiquant_mode=0, value_antiquant_mode=1)
    if mode == "chan":
        return dict(antiquant_scale=pos(2, KV_N * D), antiquant_mode=0)
    if mode == "chan-offset":
        return dict(antiquant_scale=pos(2, KV_N, 1, D), antiquant_offset=off(2, KV_N, 1, D), antiquant_mode=0)
    if mode == "tensor":
        return dict(antiquant_scale=pos(2), antiquant_offset=off(2), antiquant_mode=0)
    if mode == "sep-chan":
        return dict(key_antiquant_scale=pos(KV_N, D), value_antiquant_scale=pos(KV_N, D),
                    key_antiquant_offset=off(KV_N, D), value_antiquant_offset=off(KV_N, D))
    if mode == "sep-head":
        return dict(key_antiquant_scale=pos(KV_N), value_antiquant_scale=pos(KV_N), key_antiquant_mode=2,
                    value_antiquant_mode=2)
    raise AssertionError(mode)


@pytest.mark.parametrize("mode,S", [("chan", 96), ("chan-offset", 96), ("tensor", 96), ("sep-chan", 96),
                                    ("sep-head", 96), ("chan-offset", 2048), ("tok", 96), ("sep-tok", 96),
                                    ("sep-tok-head", 96), ("chan+tok", 96), ("sep-tok-head", 2048)])
@pytest.mark.parametrize("qdt", [torch.bfloat16, torch.float16])
def test_antiquant_replay_equals_full_path_on_new_scales(mode, S, qdt):
    """int8 K/V whose dequantization factors are per tensor / channel / head / token: replayed, each call's
    factors taken from its own scale / offset tensors (new values every call, and one changed in place; per
    token: read in place at each call's addresses). 2048 keys: the threaded launch (merge apart) where torch
    has two threads."""
    if mode == "chan+tok" and qdt == torch.bfloat16:
        pytest.skip("key per channel + value per token takes a float16 query")
    B, N, KV_N, D = 2, 8, 2, 64
    g = gen(11)
    q0 = randn((B, N, 1, D), g, qdt)
    base = dict(num_heads=N, num_key_value_heads=KV_N, input_layout="BNSD", scale=0.125)
    served, steps = 0, []                                  # steps: each step's kwargs
    for step in range(5):
        q = randn((B, N, 1, D), g, qdt) if step else q0
        k8 = torch.randint(-128, 128, (B, KV_N, S, D), generator=g, dtype=torch.int8)
        v8 = torch.randint(-128, 128, (B, KV_N, S, D), generator=g, dtype=torch.int8)
        kw = dict(base, **_antiquant_args(g, mode, KV_N, D, qdt, B, S))
        if step == 4:                                     # the same tensors again, one scale changed in place
            kw = steps[-1]
            name = "antiquant_scale" if "antiquant_scale" in kw else "value_antiquant_scale"
            kw[name].mul_(1.5)
        want = full_path(fia.npu_fused_infer_attention_score, q, k8, v8, **kw)
        before = replay.stats["replayed"]
        got = fia.npu_fused_infer_attention_score(q, k8, v8, **kw)
        served += replay.stats["replayed"] - before
        assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1]), (mode, step)
        steps.append(kw)
    assert replay.stats["admitted"] == 1 and served >= 3


def test_threads_share_a_replay():
    B, N, KV_N, S, D = 1, 8, 8, 128, 128
    kw = dict(num_heads=N, num_key_value_heads=KV_N, input_layout="BNSD", scale=D ** -0.5)
    data = [inputs(600 + i, B, N, KV_N, 1, S, D, torch.bfloat16, "BNSD")[3:] for i in range(4)]
    want = [full_path(fia.npu_fused_infer_attention_score, *d, **kw)[0] for d in data]
    for d in data:
        fia.npu_fused_infer_attention_score(*d, **kw)
    bad = []

    def worker(j):
        for i in range(50):
            d = (i + j) % 4
            if not bits_equal(fia.npu_fused_infer_attention_score(*data[d], **kw)[0], want[d]):
                bad.append((j, i))

    ts = [threading.Thread(target=worker, args=(j,)) for j in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad and replay.stats["replayed"] >= 100


# ---------------------------------------------------------------------------------------------- lengths replay
FUSED = "npu_fused_infer_attention_score"
LENS_CASES = [  # (B, N, KV_N, Q_S, S, D, dtype, layout, lse)
    (1, 8, 8, 1, 128, 128, torch.bfloat16, "BNSD", False),
    (3, 8, 2, 1, 200, 64, torch.float16, "BSH", True),
    (2, 16, 4, 3, 96, 128, torch.float16, "BNSD", True),
    (2, 8, 2, 1, 2000, 128, torch.bfloat16, "BSND", False),       # split KV, two threads where there are two
]


def _lengths_sequence(g, B, S, steps):
    """KV lengths lists a decode loop might pass: growing, random, empty batches, full, one value for every
    batch, more values than batches, tuples."""
    out = []
    for i in range(steps):
        kind = i % 6
        if kind == 0:
            lens = [min(S, 1 + i * 7 + b) for b in range(B)]
        elif kind == 1:
            lens = torch.randint(0, S + 1, (B,), generator=g).tolist()
        elif kind == 2:
            lens = [0] * B if B > 1 else [S]
            lens[-1] = S
        elif kind == 3:
            lens = [int(torch.randint(1, S + 1, (1,), generator=g))]
        elif kind == 4:
            lens = torch.randint(1, S + 1, (B + 2,), generator=g).tolist()
        else:
            lens = tuple(torch.randint(1, S + 1, (B,), generator=g).tolist())
        out.append(lens)
    return out


@pytest.mark.parametrize("case", LENS_CASES, ids=lambda c: f"{c[7]}-{c[6]}-qs{c[3]}-kv{c[4]}-lse{int(c[8])}")
def test_lengths_replay_equals_full_path_every_call(case):
    """A decode loop's KV lengths change every call: each call's output and lse equal the full path's bit for
    bit (new query data every call), and the calls replay."""
    B, N, KV_N, Q_S, S, D, dt, layout, lse = case
    kw = dict(num_heads=N, num_key_value_heads=KV_N, input_layout=layout, scale=D ** -0.5, softmax_lse_flag=lse)
    g = gen(700)
    _, k0, v0, _, k, v = inputs(700, B, N, KV_N, Q_S, S, D, dt, layout)
    seq = _lengths_sequence(g, B, S, 24)
    for step, lens in enumerate(seq):
        q0, _, _, q, _, _ = inputs(710 + step, B, N, KV_N, Q_S, 1, D, dt, layout)
        got_out, got_lse = fia.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=lens, **kw)
        want_out, want_lse = full_path(fia.npu_fused_infer_attention_score, q, k, v, actual_seq_lengths_kv=lens,
                                       **kw)
        assert bits_equal(got_out, want_out) and bits_equal(got_lse, want_lse), (step, lens)
        L = (list(lens) * B)[:B] if len(lens) == 1 else list(lens)[:B]
        for b in range(B):                               # against the float64 reference, batch by batch
            if L[b] == 0:
                continue
            ref, _ = naive.attention(q0[b:b + 1].double(), k0[b:b + 1, :, :L[b]].double(),
                                     v0[b:b + 1, :, :L[b]].double(), scale=D ** -0.5)
            want = to_layout(ref, layout).to(dt).float()
            assert torch.allclose(want, got_out.float()[b:b + 1], atol=2e-2, rtol=2e-2), (step, b, lens)
    # list / tuple and the value count are separate keys; each is admitted on its second call
    forms = len({(type(x), len(x)) for x in seq})
    assert replay.stats["admitted"] == forms and replay.stats["refused"] == 0, replay.stats
    assert replay.stats["replayed"] == len(seq) - 2 * forms, replay.stats


def test_lengths_replay_rejects_what_parse_rejects():
    """After admission, lengths parse would refuse take the full path and raise its error; valid ones still
    replay."""
    B, N, KV_N, S, D = 3, 4, 2, 64, 32
    kw = dict(num_heads=N, num_key_value_heads=KV_N, input_layout="BNSD", scale=0.2)
    _, _, _, q, k, v = inputs(800, B, N, KV_N, 1, S, D, torch.bfloat16, "BNSD")
    for lens in ([5, 6, 7], [8, 9, 10], [11, 12, 13]):
        fia.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=lens, **kw)
    assert replay.stats["admitted"] == 1
    for bad in ([S + 1, 1, 1], [1, -1, 1], [1, 2], [], [1, 2, 3.0], [True, 1, 1]):
        with pytest.raises(Exception) as got:
            fia.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=bad, **kw)
        with pytest.raises(Exception) as want:
            full_path(fia.npu_fused_infer_attention_score, q, k, v, actual_seq_lengths_kv=bad, **kw)
        assert type(got.value) is type(want.value) and str(got.value) == str(want.value), bad
    n = replay.stats["replayed"]
    out, _ = fia.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[S, 0, 3], **kw)
    assert replay.stats["replayed"] == n + 1
    assert bits_equal(out, full_path(fia.npu_fused_infer_attention_score, q, k, v, actual_seq_lengths_kv=[S, 0, 3],
                                     **kw)[0])


def test_incre_lengths_replay():
    B, N, KV_N, S, D = 2, 8, 2, 96, 64
    _, _, _, q, k, v = inputs(900, B, N, KV_N, 1, S, D, torch.float16, "BSH")
    kw = dict(num_heads=N, num_key_value_heads=KV_N, input_layout="BSH", scale_value=0.125)
    for i in range(6):
        lens = [10 + 9 * i, 90 - 7 * i]
        got = fia.npu_incre_flash_attention(q, k, v, actual_seq_lengths=lens, **kw)
        want = full_path(fia.npu_incre_flash_attention, q, k, v, actual_seq_lengths=lens, **kw)
        assert bits_equal(got, want), lens
    assert replay.stats["admitted"] == 1 and replay.stats["replayed"] >= 3, replay.stats


def test_lengths_key():
    q = torch.randn(2, 4, 1, 32).to(torch.float16)
    k = torch.randn(2, 4, 16, 32).to(torch.float16)
    base = dict(num_heads=4, input_layout="BNSD", scale=0.5)

    def key(**kw):
        return replay.key_of(FUSED, q, k, k, dict(base, **kw))
    assert key(actual_seq_lengths_kv=[3, 4]) == key(actual_seq_lengths_kv=[16, 0]) is not None   # values: per call
    assert key(actual_seq_lengths_kv=[3, 4]) != key(actual_seq_lengths_kv=(3, 4))               # list vs tuple
    assert key(actual_seq_lengths_kv=[3, 4]) != key(actual_seq_lengths_kv=[3])                  # count
    assert key(actual_seq_lengths_kv=[3, 4]) != key()
    assert key(actual_seq_lengths_kv=[3, 4], actual_seq_lengths=[1, 1]) != key(
        actual_seq_lengths_kv=[3, 4], actual_seq_lengths=[1, 2])                               # query lengths: values
    assert key(actual_seq_lengths_kv=[3, 4], kv_padding_size=2) is None                        # left padding
    assert key(actual_seq_lengths_kv=[3, 4], actual_seq_lengths=[1.0, 1]) is None
    assert key(actual_seq_lengths=[1, 1]) is None                                               # no KV lengths list
    bt = torch.zeros(2, 4, dtype=torch.int32)
    paged = key(actual_seq_lengths_kv=[3, 4], block_table=bt, block_size=16)
    assert paged is not None and paged == key(actual_seq_lengths_kv=[9, 1], block_table=bt + 3, block_size=16)
    assert paged != key(actual_seq_lengths_kv=[3, 4], block_table=torch.zeros(2, 5, dtype=torch.int32), block_size=16)
    assert paged != key(actual_seq_lengths_kv=[3, 4], block_table=bt.long(), block_size=16)
    assert key(block_table=bt, block_size=16) is None                                          # no lengths list
    assert key(actual_seq_lengths_kv=[3, 4], block_table=torch.nn.Parameter(bt.float(), False)) is None
    assert key(actual_seq_lengths_kv=[3, 4], atten_mask=bt.bool()) is None                     # other tensors


def test_relength_equals_a_new_plan():
    """decode._relength (the lengths replay's re-plan) gives what _plan gives for the new windows."""
    import dataclasses
    from fia.backends.decode import kernels as K
    g = gen(950)
    for B, N, KV_N, Q_S, S in ((1, 8, 8, 1, 128), (3, 8, 2, 1, 3000), (2, 16, 4, 3, 96), (5, 4, 4, 1, 700)):
        _, _, _, q, k, v = inputs(951, B, N, KV_N, Q_S, S, 64, torch.bfloat16, "BNSD")
        p = full_path(fia.eager.fused_problem, dict(_fused_defaults(), query=q, key=k, value=v, num_heads=N,
                                                      num_key_value_heads=KV_N, input_layout="BNSD",
                                                      actual_seq_lengths_kv=[S] * B))
        x = DEC_INPUTS.Inputs(p)
        for threads in (1, 2):
            plan0 = DEC_PLAN._plan(p, x, K, threads)
            for _ in range(6):
                lens = torch.randint(0, S + 1, (B,), generator=g).tolist()
                geom = tuple(dataclasses.replace(gm, kv_hi=L) for gm, L in zip(p.geometry, lens))
                want = DEC_PLAN._plan(p.evolve(geometry=geom), x, K, threads)
                got = DEC_PLAN.relength(plan0, p, np.array(lens, np.int64), K, threads)
                if want.own[0] is None:
                    assert got is None
                    continue
                for f in ("geo", "wrange", "pwrange", "mp", "obase", "fp"):
                    assert np.array_equal(getattr(got, f), getattr(want, f)), f
                assert got.W == want.W
                a, b = got.own[0], want.own[0]
                assert np.array_equal(a.ip, b.ip) and np.array_equal(a.work, b.work)
                assert np.array_equal(a.items, b.items) and a.threads == b.threads and (a.w0, a.w1) == (b.w0, b.w1)


def _fused_defaults():
    import inspect
    sig = inspect.signature(fia.eager.npu_fused_infer_attention_score)
    return {n: prm.default for n, prm in sig.parameters.items()}


@pytest.mark.parametrize("dims", [3, 4])
def test_paged_lengths_replay_equals_full_path_every_call(dims):
    """A paged decode loop: new lengths and a new block table (other ids, in other order) every call; each
    call equals the full path bit for bit and the calls replay."""
    B, N, KV_N, D, bs, nb, mb = 3, 8, 2, 64, 16, 40, 6
    g = gen(1000)
    layout = "BNSD" if dims == 4 else "BSH"
    shape = (nb, KV_N, bs, D) if dims == 4 else (nb, bs, KV_N * D)
    kc, vc = randn(shape, g, torch.bfloat16), randn(shape, g, torch.bfloat16)
    kw = dict(num_heads=N, num_key_value_heads=KV_N, input_layout=layout, scale=0.125, block_size=bs,
              softmax_lse_flag=True)
    seq = [lens for lens in _lengths_sequence(g, B, mb * bs, 16) if type(lens) is list and len(lens) == B]
    for step, lens in enumerate(seq):
        q0 = randn((B, N, 1, D), g, torch.bfloat16)
        q = to_layout(q0, layout)
        bt = torch.randperm(nb, generator=g)[:B * mb].reshape(B, mb).to(torch.int32)
        got = fia.npu_fused_infer_attention_score(q, kc, vc, block_table=bt, actual_seq_lengths_kv=lens, **kw)
        want = full_path(fia.npu_fused_infer_attention_score, q, kc, vc, block_table=bt, actual_seq_lengths_kv=lens,
                         **kw)
        assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1]), (step, lens)
    assert replay.stats["admitted"] == 1 and replay.stats["refused"] == 0, replay.stats
    assert replay.stats["replayed"] == len(seq) - 2, replay.stats
    # a block id outside the pool in a used column: parse's error; in an unused column: no error, replayed
    lens = [bs * 2, 1, bs]
    bt = torch.randperm(nb, generator=g)[:B * mb].reshape(B, mb).to(torch.int32)
    bad = bt.clone()
    bad[1, 0] = nb
    with pytest.raises(fia.FiaInputError) as got:
        fia.npu_fused_infer_attention_score(q, kc, vc, block_table=bad, actual_seq_lengths_kv=lens, **kw)
    with pytest.raises(fia.FiaInputError) as want:
        full_path(fia.npu_fused_infer_attention_score, q, kc, vc, block_table=bad, actual_seq_lengths_kv=lens, **kw)
    assert str(got.value) == str(want.value)
    bad = bt.clone()
    bad[1, 1] = -5                                       # batch 1 uses one block
    n = replay.stats["replayed"]
    got = fia.npu_fused_infer_attention_score(q, kc, vc, block_table=bad, actual_seq_lengths_kv=lens, **kw)
    want = full_path(fia.npu_fused_infer_attention_score, q, kc, vc, block_table=bad, actual_seq_lengths_kv=lens, **kw)
    assert bits_equal(got[0], want[0]) and replay.stats["replayed"] == n + 1
    with pytest.raises(fia.FiaInputError):               # lengths past the table's columns
        fia.npu_fused_infer_attention_score(q, kc, vc, block_table=bt, actual_seq_lengths_kv=[mb * bs + 1, 1, 1], **kw)


@pytest.mark.parametrize("mode", ["chan-offset", "sep-head", "tok", "sep-tok-head", "chan+tok"])
def test_antiquant_lengths_replay_equals_full_path_every_call(mode):
    """A decode loop over an int8 cache with dequantization tensors: new lengths, new scales (new tensors, and
    the same ones changed in place) every call; each call equals the full path bit for bit, and they replay."""
    B, N, KV_N, S, D = 3, 8, 2, 300, 64
    g = gen(1050 + len(mode))
    qdt = torch.float16
    k8 = torch.randint(-128, 128, (B, KV_N, S, D), generator=g, dtype=torch.int8)
    v8 = torch.randint(-128, 128, (B, KV_N, S, D), generator=g, dtype=torch.int8)
    base = dict(num_heads=N, num_key_value_heads=KV_N, input_layout="BNSD", scale=0.125, softmax_lse_flag=True)
    seq = [lens for lens in _lengths_sequence(g, B, S, 14) if type(lens) is list and len(lens) == B]
    aq = _antiquant_args(g, mode, KV_N, D, qdt, B, S)
    for step, lens in enumerate(seq):
        if step % 2:
            aq = _antiquant_args(g, mode, KV_N, D, qdt, B, S)
        else:
            next(t for t in aq.values() if type(t) is torch.Tensor).mul_(1.25)
        q = randn((B, N, 1, D), g, qdt)
        kw = dict(base, actual_seq_lengths_kv=lens, **aq)
        got = fia.npu_fused_infer_attention_score(q, k8, v8, **kw)
        want = full_path(fia.npu_fused_infer_attention_score, q, k8, v8, **kw)
        assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1]), (step, lens)
    assert replay.stats["admitted"] == 1 and replay.stats["refused"] == 0, replay.stats
    assert replay.stats["replayed"] == len(seq) - 2, replay.stats


@pytest.mark.parametrize("mode", [4, 5])
def test_paged_per_token_lengths_replay_follows_the_table(mode):
    """Per-token factors stored by paged block (modes 4 / 5: [blocks, bs] / [blocks, KV_N, bs]) in a paged
    decode loop: each call's factors are found through its own block table."""
    B, N, KV_N, D, bs, nb, mb = 2, 8, 2, 64, 32, 10, 3
    g = gen(1070 + mode)
    kc = torch.randint(-128, 128, (nb, KV_N, bs, D), generator=g, dtype=torch.int8)
    vc = torch.randint(-128, 128, (nb, KV_N, bs, D), generator=g, dtype=torch.int8)
    shape = (nb, bs) if mode == 4 else (nb, KV_N, bs)
    kw = dict(num_heads=N, num_key_value_heads=KV_N, input_layout="BNSD", scale=0.125, block_size=bs,
              key_antiquant_mode=mode, value_antiquant_mode=mode, softmax_lse_flag=True)
    seq = [lens for lens in _lengths_sequence(g, B, mb * bs, 12) if type(lens) is list and len(lens) == B]
    for step, lens in enumerate(seq):
        q = randn((B, N, 1, D), g, torch.float16)
        bt = torch.randperm(nb, generator=g)[:B * mb].reshape(B, mb).to(torch.int32)
        ks, vs = torch.rand(shape, generator=g) + 0.5, torch.rand(shape, generator=g) + 0.5
        args = dict(kw, block_table=bt, actual_seq_lengths_kv=lens, key_antiquant_scale=ks, value_antiquant_scale=vs)
        got = fia.npu_fused_infer_attention_score(q, kc, vc, **args)
        want = full_path(fia.npu_fused_infer_attention_score, q, kc, vc, **args)
        assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1]), (step, lens)
    assert replay.stats["admitted"] == 1 and replay.stats["replayed"] == len(seq) - 2, replay.stats


def test_stale_lengths_replay_is_replaced(monkeypatch):
    """Tuning changed after admission: the lengths replay gives way (full path, a new plan) and a new one is
    admitted; every call still equals the full path."""
    B, N, KV_N, S, D = 2, 4, 2, 1500, 64
    kw = dict(num_heads=N, num_key_value_heads=KV_N, input_layout="BNSD", scale=0.125)
    _, _, _, q, k, v = inputs(1100, B, N, KV_N, 1, S, D, torch.bfloat16, "BNSD")
    for i in range(3):
        fia.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[S - i, 700 + i], **kw)
    assert replay.stats["admitted"] == 1 and replay.stats["replayed"] == 1
    monkeypatch.setattr(DEC_PLAN, "MIN_SPLIT", 8)       # another split: the replay is stale
    monkeypatch.setattr(DEC_PLAN, "ITEMS_PER_THREAD", 64)
    for i in range(4):
        lens = [S - 10 * i, 600 + i]
        got, _ = fia.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=lens, **kw)
        want, _ = full_path(fia.npu_fused_infer_attention_score, q, k, v, actual_seq_lengths_kv=lens, **kw)
        assert bits_equal(got, want), lens
    assert replay.stats["admitted"] == 2 and replay.stats["replayed"] == 1 + 3, replay.stats   # re-admitted at once


@pytest.mark.parametrize("growing", [False, True], ids=["lengths", "growing"])
def test_lengths_replay_between_one_thread_and_two(growing, monkeypatch):
    """A lengths replay re-plans a one-thread call inside its kernel dispatch (attend_merge) and hands lengths that
    take two threads to plan.relength: a loop whose lengths cross that line both ways (and a growing cache's KV_S
    with them) equals the full path bit for bit every call, and both launches ran."""
    monkeypatch.setattr(DEC_PLAN, "PARALLEL_MIN_WORK", 2048)     # more than 2048 keys x rows: two threads
    monkeypatch.setattr(DEC_PLAN, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(DEC_PLAN, "MIN_SPLIT", 64)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    B, N, KV_N, S, D = 2, 8, 2, 700, 64
    kw = dict(num_heads=N, num_key_value_heads=KV_N, input_layout="BNSD", scale=0.125)
    made = []
    real = DEC_PLAN.relength
    monkeypatch.setattr("fia.backends.decode.replay.relength", lambda *a: made.append(a[2].tolist()) or real(*a))
    g = gen(1150)
    try:
        for step, n in enumerate((30, 40, 600, 50, 650, 60, 690, 20, 680)):
            lens = [n, max(1, n - 17)]
            kv_s = n if growing else S              # a growing cache: a new contiguous K / V of n positions
            q, k, v = randn((B, N, 1, D), g, torch.bfloat16), *(randn((B, KV_N, kv_s, D), g, torch.bfloat16)
                                                               for _ in range(2))
            call = dict(kw) if growing else dict(kw, actual_seq_lengths_kv=lens)
            got = fia.npu_fused_infer_attention_score(q, k, v, **call)
            want = full_path(fia.npu_fused_infer_attention_score, q, k, v, **call)
            assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1]), (step, lens)
    finally:
        torch.set_num_threads(threads)
    assert replay.stats["admitted"] == 1 and replay.stats["replayed"] == 7, replay.stats
    big = [m for m in made if max(m) >= 600]
    assert big and len(big) == len(made), made           # relength: the two-thread lengths alone


def test_all_zero_lengths_do_not_block_a_lengths_replay():
    B, N, KV_N, S, D = 2, 4, 2, 64, 32
    kw = dict(num_heads=N, num_key_value_heads=KV_N, input_layout="BNSD", scale=0.2)
    _, _, _, q, k, v = inputs(1200, B, N, KV_N, 1, S, D, torch.float16, "BNSD")
    for lens in ([0, 0], [0, 0], [5, 3], [7, 0], [9, 9]):
        got = fia.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=lens, **kw)
        want = full_path(fia.npu_fused_infer_attention_score, q, k, v, actual_seq_lengths_kv=lens, **kw)
        assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1]), lens
    assert replay.stats == {"admitted": 1, "refused": 0, "replayed": 2}, replay.stats


def test_random_decode_loops_equal_the_full_path():
    """Randomized decode loops (shapes, GQA, dtypes, layouts, lse, threads, dense or paged with 3-D / 4-D caches,
    fused or incre entry, lengths lists of B or 1 values, new block tables): every call, replayed or not, equals
    the full path bit for bit or raises the same error."""
    import random
    rnd = random.Random(13)
    threads = torch.get_num_threads()
    calls = 0
    try:
        for case in range(10):
            B, KV_N, G = rnd.choice([1, 2, 3]), rnd.choice([1, 2]), rnd.choice([1, 4, 8])
            N, D = KV_N * G, rnd.choice([64, 128])
            dt = rnd.choice([torch.bfloat16, torch.float16])
            layout, lse = rnd.choice(["BSH", "BSND", "BNSD"]), rnd.random() < 0.5
            paged, entry = rnd.random() < 0.4, rnd.choice(["fused", "incre"])
            QS = 1 if entry == "incre" or paged else rnd.choice([1, 2])
            torch.set_num_threads(rnd.choice([1, 2]))
            g = gen(1300 + case)
            if paged:
                bs, mb = rnd.choice([16, 32]), rnd.choice([2, 4])
                nb, S = B * mb + 3, mb * bs
                shape = (nb, KV_N, bs, D) if layout == "BNSD" and rnd.random() < 0.5 else (nb, bs, KV_N * D)
                k, v = randn(shape, g, dt), randn(shape, g, dt)
            else:
                S = rnd.choice([40, 300, 2100])
                k, v = (to_layout(randn((B, KV_N, S, D), g, dt), layout) for _ in range(2))
            for step in range(8):
                q = to_layout(randn((B, N, QS, D), g, dt), layout)
                lens = [rnd.randint(0, S) for _ in range(B)] if rnd.random() > 0.15 else [rnd.randint(1, S + 1)]
                kw = dict(num_heads=N, num_key_value_heads=KV_N, input_layout=layout)
                if paged:
                    kw.update(block_table=torch.stack([torch.randperm(nb, generator=g)[:mb] for _ in range(B)]).int(),
                              block_size=bs)
                if entry == "fused":
                    fn = fia.npu_fused_infer_attention_score
                    kw.update(scale=D ** -0.5, softmax_lse_flag=lse, actual_seq_lengths_kv=lens)
                else:
                    fn = fia.npu_incre_flash_attention
                    kw.update(scale_value=D ** -0.5, actual_seq_lengths=lens)
                got = want = None
                try:
                    got = fn(q, k, v, **kw)
                except fia.FiaInputError as e:
                    with pytest.raises(fia.FiaInputError) as w:
                        full_path(fn, q, k, v, **kw)
                    assert str(w.value) == str(e), (case, step)
                    continue
                want = full_path(fn, q, k, v, **kw)
                got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
                assert all(bits_equal(a, b) for a, b in zip(got, want)), (case, step, lens)
                calls += 1
    finally:
        torch.set_num_threads(threads)
    assert calls >= 60 and replay.stats["refused"] == 0 and replay.stats["replayed"] >= calls // 2, replay.stats


def test_growing_cache_replays_equal_the_full_path():
    """A cache that grows a token a step (a new contiguous K / V every call, as transformers' DynamicCache): keyed
    without KV_S, every call -- replayed or not -- equals the full path bit for bit, in each layout, entry point,
    with and without a lengths list, across a split-KV length (two threads where there are two), or raises the
    same error."""
    import random
    rnd = random.Random(31)
    calls = 0
    for case in range(8):
        B, KV_N, G = rnd.choice([1, 2, 3]), rnd.choice([1, 2]), rnd.choice([1, 4])
        N, D = KV_N * G, rnd.choice([32, 64])
        dt = rnd.choice([torch.bfloat16, torch.float16])
        layout, lse, with_lens = rnd.choice(["BSH", "BSND", "BNSD"]), rnd.random() < 0.5, case % 2 == 1
        entry = rnd.choice(["fused", "incre"])
        g = gen(1700 + case)
        S0 = rnd.choice([30, 1990])
        replay.clear()
        replay.stats.update(admitted=0, refused=0, replayed=0)
        for step in range(10):
            S = S0 + step * rnd.choice([1, 1, 7])
            q = to_layout(randn((B, N, 1, D), g, dt), layout)
            k, v = (to_layout(randn((B, KV_N, S, D), g, dt), layout) for _ in range(2))
            kw = dict(num_heads=N, num_key_value_heads=KV_N, input_layout=layout)
            lens = [rnd.randint(0, S) for _ in range(B)] if step != 6 else [S + 1] * B    # step 6: parse's error
            if entry == "fused":
                fn = fia.npu_fused_infer_attention_score
                kw.update(scale=D ** -0.5, softmax_lse_flag=lse)
                if with_lens:
                    kw["actual_seq_lengths_kv"] = lens
            else:
                fn = fia.npu_incre_flash_attention
                kw["scale_value"] = D ** -0.5
                if with_lens:
                    kw["actual_seq_lengths"] = lens
            try:
                got = fn(q, k, v, **kw)
            except fia.FiaInputError as e:
                with pytest.raises(fia.FiaInputError) as w:
                    full_path(fn, q, k, v, **kw)
                assert str(w.value) == str(e) and with_lens and step == 6, (case, step)
                continue
            want = full_path(fn, q, k, v, **kw)
            got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
            assert all(bits_equal(a, b) for a, b in zip(got, want)), (case, step)
            calls += 1
        assert replay.stats["admitted"] == 1 and replay.stats["refused"] == 0, (case, replay.stats)
        assert replay.stats["replayed"] >= 6, (case, replay.stats)
    assert calls >= 75


def test_growing_key():
    """The growing key leaves out KV_S alone: other K / V dims, dtypes, a non-contiguous cache, a paged call,
    a mask or dequantization tensors key as before (or not at all)."""
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD", scale=0.5)
    q = torch.randn(2, 4, 1, 32).to(torch.float16)

    def cache(S, D=32, dt=torch.float16):
        return torch.randn(2, 2, S, D).to(dt)
    k10, k11 = cache(10), cache(11)
    a, b = replay.key_of(FUSED, q, k10, k10, kw), replay.key_of(FUSED, q, k11, k11, kw)
    assert a is not None and a == b and a[-1] == 2
    assert replay.key_of(FUSED, q, k10, cache(10, 16), kw) != a
    assert replay.key_of(FUSED, q, k10, cache(10, dt=torch.bfloat16), kw) != a
    nc = torch.randn(2, 2, 12, 32).to(torch.float16)[:, :, :10]                 # strides of 12 positions
    assert replay.key_of(FUSED, q, nc, nc, kw)[-1] is None
    bsh = dict(kw, input_layout="BSH")
    qb = q.transpose(1, 2).reshape(2, 1, 128)
    kb = torch.randn(2, 10, 64).to(torch.float16)
    assert replay.key_of(FUSED, qb, kb, kb, bsh)[-1] == 1
    assert replay.key_of(FUSED, q, k10, k10, dict(kw, input_layout="TND")) is None or \
        replay.key_of(FUSED, q, k10, k10, dict(kw, input_layout="TND"))[-1] is None
    sc = torch.rand(2, 64)
    assert replay.key_of(FUSED, q, k10.to(torch.int8), k10.to(torch.int8), dict(kw, antiquant_scale=sc))[-1] is None
    assert replay.key_of(FUSED, q, k10, k10, dict(kw, atten_mask=torch.zeros(2, 1, 10, dtype=torch.bool))) is None


def _site_call(site, guard, q, k, v, kw):
    return site.call(guard, fia.npu_fused_infer_attention_score, q, k, v, dict(kw))


def _decode_buffers(g, int8: bool, B: int, KV_N: int, cap: int, D: int):
    """(K, V [B, KV_N, cap, D], extra keyword arguments): random bf16 buffers, or int8 ones with per-token scales
    (antiquant mode 3)."""
    kb, vb = randn((B, KV_N, cap, D), g, torch.bfloat16), randn((B, KV_N, cap, D), g, torch.bfloat16)
    if not int8:
        return kb, vb, {}
    kb, vb = (torch.randint(-127, 128, (B, KV_N, cap, D), generator=g, dtype=torch.int8) for _ in range(2))
    return kb, vb, dict(key_antiquant_scale=torch.rand(B, KV_N, cap, generator=g) * 0.02 + 1e-3,
                        value_antiquant_scale=torch.rand(B, KV_N, cap, generator=g) * 0.02 + 1e-3,
                        key_antiquant_mode=3, value_antiquant_mode=3)


@pytest.mark.parametrize("cache", ["buffers", "growing", "int8"])
def test_site_serves_a_decode_loop_exactly(cache):
    """replay.Site (the transformers integration's call site): a decode loop over preallocated buffers (FiaCache),
    a cache that grows by a token a step (DynamicCache) and int8 buffers with per-token scales. Each step's
    result equals the full path bit for bit; the site serves the steps after admission; a change of thread count,
    validation mode or query dtype under the same guard is a new site key (never another call's replay)."""
    site = replay.Site("npu_fused_infer_attention_score", "test")
    g = gen(961)
    B, N, KV_N, D, cap = 2, 8, 2, 64, 96
    kb, vb, extra = _decode_buffers(g, cache == "int8", B, KV_N, cap, D)
    served0 = replay.stats["replayed"]
    threads = torch.get_num_threads()
    try:
        for step, length in enumerate(range(40, 70)):
            qdt = torch.float16 if step in (20, 21) else torch.bfloat16
            torch.set_num_threads(1 if step in (10, 11, 12) else max(2, threads))
            q = randn((B, N, 1, D), g, qdt)
            if cache == "growing":
                k, v = kb[:, :, :length].contiguous(), vb[:, :, :length].contiguous()
                kw = {}
            else:
                k, v = kb, vb
                kw = dict(actual_seq_lengths_kv=[length, length - 7], **extra)
            if cache != "int8" and qdt != kb.dtype:
                k, v = k.to(qdt), v.to(qdt)
            kw.update(num_heads=N, num_key_value_heads=KV_N, input_layout="BNSD", scale=D ** -0.5)
            guard = ("test", tuple(kw))
            if step in (25, 26):
                with fia.validation_mode("portable"):
                    got = _site_call(site, guard, q, k, v, kw)
                    want = full_path(fia.npu_fused_infer_attention_score, q, k, v, **kw)
            else:
                got = _site_call(site, guard, q, k, v, kw)
                want = full_path(fia.npu_fused_infer_attention_score, q, k, v, **kw)
            assert bits_equal(got[0], want[0]) and got[1].shape == want[1].shape, step
    finally:
        torch.set_num_threads(threads)
    assert replay.stats["replayed"] - served0 >= 20
    metas = list(site.table)
    assert len({m[1] for m in metas}) == 2                      # query dtypes bf16 / fp16: separate entries
    assert len({m[-1] for m in metas}) >= 2                     # thread counts


@pytest.mark.parametrize("cache", ["buffers", "int8"])
def test_lane_serves_a_decode_loop_exactly(cache, monkeypatch):
    """replay.Lane (an FiaCache layer's memo of its site's replay): over the same buffer objects the steps replay
    without the site's lookup key, each equal to the full path bit for bit; another K / V object of the same
    metadata, a new thread count, validation mode or query dtype under the same guard go through the site's
    lookup (and the lane notes the replay served there)."""
    site = replay.Site("npu_fused_infer_attention_score", "test-lane")
    lane = replay.Lane()
    looked_up = []
    meta = replay.Site._meta
    monkeypatch.setattr(replay.Site, "_meta", lambda self, *a: looked_up.append(1) or meta(self, *a))
    g = gen(962)
    B, N, KV_N, D, cap = 2, 8, 2, 64, 96
    kb, vb, extra = _decode_buffers(g, cache == "int8", B, KV_N, cap, D)
    kc, vc = kb.clone(), vb.clone()                             # other objects, the same metadata
    threads = torch.get_num_threads()
    steps = 0
    try:
        for step, length in enumerate(range(40, 70)):
            qdt = torch.float16 if step in (20, 21) and cache == "int8" else torch.bfloat16
            torch.set_num_threads(1 if step in (10, 11) else max(2, threads))
            q = randn((B, N, 1, D), g, qdt)
            k, v = (kc, vc) if step in (15, 16) else (kb, vb)
            kw = dict(actual_seq_lengths_kv=[length, length - 7], **extra)
            kw.update(num_heads=N, num_key_value_heads=KV_N, input_layout="BNSD", scale=D ** -0.5)
            guard = ("test", tuple(kw))
            if step in (25, 26):
                with fia.validation_mode("portable"):
                    got = site.call(guard, fia.npu_fused_infer_attention_score, q, k, v, dict(kw), lane)
                    want = full_path(fia.npu_fused_infer_attention_score, q, k, v, **kw)
            else:
                got = site.call(guard, fia.npu_fused_infer_attention_score, q, k, v, dict(kw), lane)
                want = full_path(fia.npu_fused_infer_attention_score, q, k, v, **kw)
            assert bits_equal(got[0], want[0]) and got[1].shape == want[1].shape, step
            steps += 1
    finally:
        torch.set_num_threads(threads)
    assert lane.state is not None and lane.state[0] is kb
    # looked up: the first steps (admission), and each step whose objects or modes differ from the noted call's
    # and the step after it (back to the noted ones)
    assert 6 <= len(looked_up) <= 12, len(looked_up)                # (without the lane: 30)


def test_lane_is_not_copied():
    """A copied or pickled lane (an FiaCache deep-copied by a generation mode) starts empty: its replays hold
    per-thread tables."""
    import copy
    import pickle
    lane = replay.Lane()
    lane.state = ("anything",)
    assert copy.deepcopy(lane).state is None
    assert pickle.loads(pickle.dumps(lane)).state is None
