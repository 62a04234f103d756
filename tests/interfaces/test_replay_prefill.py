"""The prefill backend's replay (backends/prefill/replay.py): a model's prefill repeats one call per layer; its
replay must return exactly what the full path returns, on new data every call, and hand every call it does not
serve back to the full path."""
import pytest
import torch

import fia
from fia import replay
from fia.backends import registry
from fia.backends.prefill import backend as PB
from fia.parse import memo

from util import bits_equal, from_layout, full_path, gen, plant_extreme, randn, to_layout

pytestmark = pytest.mark.backends("prefill")

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
TEMPLATE = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


@pytest.fixture(autouse=True)
def fresh(monkeypatch, fia_backend):
    monkeypatch.setattr(memo, "_TRIAL", 1 << 30)
    replay.clear()
    monkeypatch.setattr(replay, "stats", {"admitted": 0, "refused": 0, "replayed": 0})


def call(q, k, v, kw):
    """The call under the case's validation mode (float32: portable), through the public entry point."""
    with fia.validation_mode("portable" if q.dtype == F32 else "strict"):
        got = fia.npu_fused_infer_attention_score(q, k, v, **kw)
        want = full_path(fia.npu_fused_infer_attention_score, q, k, v, **kw)
    return got, want


CASES = [  # (N, KV_N, S, D, dtype, layout, mask, lse)
    (8, 2, 32, 64, BF16, "BNSD_BSND", "causal", False),       # transformers' prefill (ATen's kernel where small)
    (8, 2, 100, 64, BF16, "BNSD", "causal", True),
    (4, 4, 48, 128, F16, "BSND", "none", True),
    (8, 2, 40, 64, F32, "BSH", "causal", False),
    (8, 1, 72, 64, BF16, "BSND", "lengths", True),              # a cache window: lengths + right-down causal
    (4, 2, 33, 32, BF16, "BNSD", "causal", True),              # head dim 32: ATen's kernel
]


def reference(q, k, v, scale: float, causal: bool):
    """float64 softmax(scale q k^T) v, GQA, top-left causal where asked (Q_S = KV_S here): [1, N, S, Dv]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = scale * q.double() @ k.transpose(-1, -2)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def kwargs(N, KV_N, S, D, layout, mask, lse):
    kw = dict(num_heads=N, num_key_value_heads=KV_N, input_layout=layout, scale=D ** -0.5, softmax_lse_flag=lse)
    if mask != "none":
        kw.update(sparse_mode=3, atten_mask=TEMPLATE.clone())   # (a new template every call: keyed by metadata)
    if mask == "lengths":
        kw["actual_seq_lengths_kv"] = [S]
    return kw


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[5]}-{c[4]}-s{c[2]}-d{c[3]}-{c[6]}")
def test_prefill_replay_equals_full_path_on_new_data(case):
    N, KV_N, S, D, dt, layout, mask, lse = case
    cap = S + 24 if mask == "lengths" else S                   # (a cache buffer beyond the written keys)
    for step in range(5):
        g = gen(300 + step)
        q0, k0, v0 = randn((1, N, S, D), g, dt), randn((1, KV_N, cap, D), g, dt), randn((1, KV_N, cap, D), g, dt)
        if mask == "lengths":
            k0[:, :, S:], v0[:, :, S:] = float("nan"), float("nan")     # never read
        q, k, v = to_layout(q0, layout.split("_")[0]), to_layout(k0, layout.split("_")[0]), \
            to_layout(v0, layout.split("_")[0])
        (got_o, got_l), (want_o, want_l) = call(q, k, v, kwargs(N, KV_N, S, D, layout, mask, lse))
        assert bits_equal(got_o, want_o) and bits_equal(got_l, want_l), step
        want = reference(q0, k0[:, :, :S], v0[:, :, :S], D ** -0.5, mask != "none")
        got = from_layout(got_o, layout.split("_")[-1], N)
        assert torch.allclose(want.to(dt).float(), got.float(), atol=2e-2, rtol=2e-2), step
    assert replay.stats["replayed"] >= 3 and replay.stats["refused"] == 0, replay.stats


BLOCKED = [  # (B, N, KV_N, S, D, dtype, layout, extra keywords): batches, bands and lengths (the blocked path)
    (3, 8, 2, 64, 64, BF16, "BSND", dict(sparse_mode=3, actual_seq_lengths_kv=[64, 55, 44])),
    (2, 4, 2, 80, 64, F16, "BNSD", dict(sparse_mode=4, pre_tokens=16, next_tokens=0)),
    (2, 8, 4, 48, 64, F32, "BSH", dict(actual_seq_lengths_kv=[43])),
    (1, 8, 2, 300, 64, BF16, "BNSD", dict(sparse_mode=4, pre_tokens=100, next_tokens=0)),
]


@pytest.mark.parametrize("case", BLOCKED, ids=lambda c: f"b{c[0]}-{c[6]}-{c[5]}-s{c[3]}-{sorted(c[7])}")
def test_blocked_prefill_replays_equal_full_path(case):
    """Batches with per-batch lengths, band masks, a broadcast length: the replay runs the blocked path's launch;
    every call equals the full path bit for bit (NaN beyond each batch's keys is never read), and a call with
    other lengths under the same key is the full path's."""
    B, N, KV_N, S, D, dt, layout, extra = case
    lens = extra.get("actual_seq_lengths_kv")
    for step in range(6):
        g = gen(500 + step)
        q0, k0, v0 = randn((B, N, S, D), g, dt), randn((B, KV_N, S, D), g, dt), randn((B, KV_N, S, D), g, dt)
        kw = dict(num_heads=N, num_key_value_heads=KV_N, input_layout=layout, scale=D ** -0.5, softmax_lse_flag=True,
                  **extra)
        if "sparse_mode" in kw:
            kw["atten_mask"] = TEMPLATE
        if lens is not None:
            kw["actual_seq_lengths_kv"] = [x - 3 for x in lens] if step == 4 else list(lens)
            for b in range(B):
                n = kw["actual_seq_lengths_kv"][b if len(lens) > 1 else 0]
                k0[b, :, n:], v0[b, :, n:] = float("nan"), float("nan")
        q, k, v = (to_layout(x, layout) for x in (q0, k0, v0))
        (got_o, got_l), (want_o, want_l) = call(q, k, v, kw)
        assert bits_equal(got_o, want_o) and bits_equal(got_l, want_l), step
        assert not torch.isnan(got_o).any(), step
    assert replay.stats["replayed"] >= 3 and replay.stats["refused"] == 0, replay.stats


def test_calls_the_replay_does_not_serve_take_the_full_path(monkeypatch):
    """Other KV lengths under one key, data the one-call launch hands to the general path (NaN, V beyond the
    kernels' safe range, an overflowing score) and changed tuning constants: every result is the full path's."""
    N, KV_N, S, D = 8, 2, 40, 64
    g = gen(77)
    served = {}
    real = PB.prefill_replay.PrefillReplay.__call__
    what = None

    def spy(self, *a, **k):
        r = real(self, *a, **k)
        served[what] = r is not None
        return r
    monkeypatch.setattr(PB.prefill_replay.PrefillReplay, "__call__", spy)
    for what in ("plain", "plain", "plain", "lengths", "nan_v", "huge_v", "q_max", "tuning", "again"):
        q, k, v = randn((1, N, S, D), g, BF16), randn((1, KV_N, S + 8, D), g, BF16), randn((1, KV_N, S + 8, D), g, BF16)
        kw = dict(num_heads=N, num_key_value_heads=KV_N, input_layout="BNSD", scale=D ** -0.5, softmax_lse_flag=True,
                  sparse_mode=3, atten_mask=TEMPLATE, actual_seq_lengths_kv=[S - 5 if what == "lengths" else S])
        if what in ("nan_v", "huge_v", "q_max"):
            plant_extreme(what, q, k, v)
        elif what == "tuning":
            monkeypatch.setattr(registry.by_name("prefill"), "block_q", 16)
        (got_o, got_l), (want_o, want_l) = call(q, k, v, kw)
        assert bits_equal(got_o, want_o) and bits_equal(got_l, want_l), what
    # every call was asked (one key); declined: other lengths, changed tuning (then admitted afresh). The data
    # cases are served where the one-call launch answers them itself (the reference's numbers), else declined
    assert len(served) == 7 and served["plain"] and served["again"], sorted(served.items())
    assert not served["lengths"] and not served["tuning"], served


def test_inputs_that_require_grad_get_no_history_from_a_replay():
    """A call whose tensors require grad takes the full path (no autograd history, DECISIONS 30), also once its key
    replays."""
    N, KV_N, S, D = 8, 2, 32, 64
    kw = dict(num_heads=N, num_key_value_heads=KV_N, input_layout="BNSD", scale=0.125, sparse_mode=3,
              atten_mask=TEMPLATE)
    for step in range(5):
        g = gen(900 + step)
        q, k, v = randn((1, N, S, D), g, BF16), randn((1, KV_N, S, D), g, BF16), randn((1, KV_N, S, D), g, BF16)
        if step == 4:
            q.requires_grad_(True)
        with fia.use_backend("prefill"):
            got, _ = fia.npu_fused_infer_attention_score(q, k, v, **kw)
            want, _ = full_path(fia.npu_fused_infer_attention_score, q, k, v, **kw)
        assert got.grad_fn is None and not got.requires_grad and bits_equal(got, want.detach()), step
    assert replay.stats["replayed"] >= 2, replay.stats


@pytest.mark.parametrize("mask", ["none", "ones", "non-causal"])
def test_the_transformers_attention_function_replays_a_prefill_exactly(mask, monkeypatch):
    """The transformers integration's prefill call (its guard on fia.replay.Site): every layer's call, new data
    each, equals the full path bit for bit, and the layers after admission replay from the site's table."""
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from fia.integrations.transformers import common
    from fia.integrations.transformers.attention import fia_attention_forward
    monkeypatch.setattr(common, "_SITE", replay.Site("npu_fused_infer_attention_score", "test"))

    class Layer(torch.nn.Module):
        is_causal = mask != "non-causal"
    B, N, KV_N, S, D = 1, 8, 2, 40, 64
    attn = None
    if mask == "ones":                                   # transformers' 4-D bool mask: all allowed, causal
        attn = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
    for layer in range(6):
        g = gen(40 + layer)
        q = randn((B, S, N, D), g, BF16).transpose(1, 2)    # (the model's transposed projection)
        k, v = randn((B, KV_N, S, D), g, BF16), randn((B, KV_N, S, D), g, BF16)
        got, _ = fia_attention_forward(Layer(), q, k, v, attn, scaling=D ** -0.5)
        with monkeypatch.context() as m:                         # (no site, no replay: the full path)
            m.setattr(common, "_call", lambda q, k, v, guard, kw, lane=None: full_path(
                fia.npu_fused_infer_attention_score, q, k, v, **kw))
            want, _ = fia_attention_forward(Layer(), q, k, v, attn, scaling=D ** -0.5)
        assert bits_equal(got, want), layer
    assert replay.stats["replayed"] >= 3 and len(common._SITE.table) == 1, (replay.stats, len(common._SITE.table))
