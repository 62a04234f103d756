"""Lengths as int tensors inside torch.compile(fullgraph=True) (vllm-ascend's graph mode keeps them as tensors):
no graph break, one compile for a decode loop whose lengths change every step, the numbers of the list form, and
FIA's validation of the lengths when the graph runs."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import fia
from util import gen, randn

pytestmark = pytest.mark.backend_independent      # graph plumbing: run once (conftest)

F16 = torch.float16
B, N, KVN, S, D = 2, 8, 2, 64, 64


def _qkv(seed: int):
    g = gen(seed)
    return randn((B, N, 1, D), g, F16), randn((B, KVN, S, D), g, F16), randn((B, KVN, S, D), g, F16)


# entry point -> (function, keywords of the call, name of its KV lengths argument)
ENTRIES = {
    "fused": (fia.npu_fused_infer_attention_score, dict(num_heads=N, num_key_value_heads=KVN, scale=0.125),
              "actual_seq_lengths_kv"),
    "incre": (fia.npu_incre_flash_attention, dict(num_heads=N, num_key_value_heads=KVN, scale_value=0.125),
              "actual_seq_lengths"),
    "v2": (fia.npu_fused_infer_attention_score_v2, dict(num_query_heads=N, num_key_value_heads=KVN,
                                                        softmax_scale=0.125), "actual_seq_kvlen"),
}


def _first(r):
    return r[0] if isinstance(r, tuple) else r


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_decode_loop_with_lengths_tensors_compiles_once(entry, dtype):
    fn, kw, lens_name = ENTRIES[entry]
    q, k, v = _qkv(1)
    cnt = CompileCounter()
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend=cnt)
    def step(q, k, v, lens):
        return _first(fn(q, k, v, input_layout="BNSD", **{lens_name: lens}, **kw))

    for n in range(5, 64, 6):
        lens = [n, 64 - n]
        got = step(q, k, v, torch.tensor(lens, dtype=dtype))
        want = _first(fn(q, k, v, input_layout="BNSD", **{lens_name: lens}, **kw))
        assert torch.equal(got, want), n
        assert torch.isfinite(want).all() and want.abs().max() > 0
    assert cnt.frame_count == 1


def test_padding_sizes_and_lengths_as_tensors():
    q, k, v = _qkv(2)
    kw = dict(num_heads=N, num_key_value_heads=KVN, input_layout="BNSD", scale=0.125)
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="eager")
    def step(q, k, v, lens, pad):
        return fia.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=lens, kv_padding_size=pad, **kw)[0]

    for n, pad in ((20, 3), (33, 10), (7, 0)):
        got = step(q, k, v, torch.tensor([n, n + 2]), torch.tensor([pad], dtype=torch.int64))
        want = fia.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[n, n + 2],
                                                   kv_padding_size=torch.tensor([pad]), **kw)[0]
        assert torch.equal(got, want), (n, pad)


def test_invalid_lengths_tensor_is_fias_error_when_the_graph_runs():
    q, k, v = _qkv(3)
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="eager")
    def step(q, k, v, lens):
        return fia.npu_fused_infer_attention_score(q, k, v, num_heads=N, num_key_value_heads=KVN, input_layout="BNSD",
                                                   actual_seq_lengths_kv=lens)[0]

    step(q, k, v, torch.tensor([10, 20]))
    with pytest.raises(fia.FiaInputError, match=r"actual_seq_lengths_kv: expected values in \[0, 64\]"):
        step(q, k, v, torch.tensor([S + 1, 20]))
    with pytest.raises(fia.FiaInputError, match="actual_seq_lengths_kv"):
        step(q, k, v, torch.tensor([1.5, 2.0]))


def test_packed_layouts_take_lengths_tensors_too():
    """TND: the query's cumulative lengths and the KV lengths as tensors -- a paged decode step (one row per batch,
    vllm-ascend's shape) and a dense packed prefill."""
    g = gen(4)
    n, kvn, d, bs = 8, 2, 128, 128
    kc = randn((8, bs, kvn * d), g, torch.bfloat16)
    table = torch.randperm(8, generator=g)[:6].to(torch.int32).reshape(3, 2)
    q = randn((3, n, d), g, torch.bfloat16)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="TND", block_table=table, block_size=bs)
    cnt = CompileCounter()
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend=cnt)
    def step(q, kc, ql, kl):
        return fia.npu_fused_infer_attention_score(q, kc, kc, actual_seq_lengths=ql, actual_seq_lengths_kv=kl, **kw)[0]

    for m in (20, 70, 200):
        ql, kl = [1, 2, 3], [m, m + 5, 256]
        want = fia.npu_fused_infer_attention_score(q, kc, kc, actual_seq_lengths=ql, actual_seq_lengths_kv=kl, **kw)[0]
        assert torch.equal(step(q, kc, torch.tensor(ql), torch.tensor(kl)), want), m
        assert torch.isfinite(want).all()
    assert cnt.frame_count == 1

    qp, kp = randn((12, n, d), g, torch.bfloat16), randn((12, kvn, d), g, torch.bfloat16)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="TND")
    dense = torch.compile(lambda q, k, ql, kl: fia.npu_fused_infer_attention_score(
        q, k, k, actual_seq_lengths=ql, actual_seq_lengths_kv=kl, **kw)[0], fullgraph=True, backend="eager")
    want = fia.npu_fused_infer_attention_score(qp, kp, kp, actual_seq_lengths=[5, 12], actual_seq_lengths_kv=[4, 12],
                                               **kw)[0]
    assert torch.equal(dense(qp, kp, torch.tensor([5, 12]), torch.tensor([4, 12])), want)
