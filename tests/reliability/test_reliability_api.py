"""Reliability of the API layer: tables rewritten between the aclnn phases, argument overflow, per-thread
settings, inputs that carry autograd state, lazily negated views, requests larger than memory."""
import os
import subprocess
import sys
import threading

import pytest
import torch

import fia
from fia import aclnn
from util import gen, randn
from paths import child_env

pytestmark = pytest.mark.backend_independent      # one run with automatic backend selection (conftest)

INT_MAX = 2147483647
BS, N, D = 16, 2, 16


# ---------------------------------------------------------------------------------------------- aclnn table
def _paged(seed):
    g = gen(seed)
    kc, vc = randn((6, BS, N * D), g), randn((6, BS, N * D), g)          # [NB, bs, H]
    q = randn((2, 1, N * D), g)                                          # BSH decode
    table = torch.tensor([[4, 0, 2], [1, 3, 5]], dtype=torch.int32)
    return q, kc, vc, table


def _v4_plan(q, kc, vc, table, out, lens=(40, 33)):
    o = {k: None for k, _ in aclnn._V2_INPUTS[3:] + aclnn._V4_EXTRA_INPUTS}
    o.update(blockTableOptional=table, actualSeqLengthsKvOptional=list(lens))
    attrs = dict(numHeads=N, scaleValue=D ** -0.5, preTokens=INT_MAX, nextTokens=INT_MAX, inputLayout="BSH",
                 numKeyValueHeads=0, sparseMode=0, innerPrecise=0, blockSize=BS, antiquantMode=0,
                 softmaxLseFlag=False, keyAntiquantMode=0, valueAntiquantMode=0, queryQuantMode=0)
    return aclnn.aclnnFusedInferAttentionScoreV4GetWorkspaceSize(q, [kc], [vc], *o.values(), *attrs.values(),
                                                                   out, None)


@pytest.mark.parametrize("backend", ["reference", "decode"])
def test_aclnn_table_rewritten_between_phases_counts(backend):
    """The table as it is when phase 2 runs is the one every backend reads (graph-capture callers rewrite it in
    place between steps); the result equals an eager call with the new table."""
    q, kc, vc, table = _paged(11)
    new = torch.tensor([[5, 1, 3], [0, 2, 4]], dtype=torch.int32)
    kw = dict(num_heads=N, input_layout="BSH", scale=D ** -0.5, block_table=new, block_size=BS,
              actual_seq_lengths_kv=[40, 33])
    with fia.use_backend("reference"):
        want, _ = fia.npu_fused_infer_attention_score(q, kc, vc, **kw)
    out = torch.full_like(want, float("nan"))
    with fia.use_backend(backend):
        ws, ex = _v4_plan(q, kc, vc, table, out)
        table.copy_(new)
        assert aclnn.aclnnFusedInferAttentionScoreV4(None, ws, ex) == 0
    assert ex.backend.name == backend
    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("backend", ["reference", "decode"])
@pytest.mark.parametrize("bad", [6, 7, -5])              # (a far id: the child-process test below)
def test_aclnn_table_rewritten_out_of_range_is_an_error(backend, bad):
    q, kc, vc, table = _paged(12)
    out = torch.full((2, 1, N * D), float("nan"), dtype=q.dtype)
    with fia.use_backend(backend):
        ws, ex = _v4_plan(q, kc, vc, table, out)
        table[1, 2] = bad                                               # column 2 of batch 1 is in use (33 > 32)
        with pytest.raises(fia.FiaInputError, match=rf"blockTableOptional: .*\[0, 6\).* {bad} at \[1, 2\]") as e:
            aclnn.aclnnFusedInferAttentionScoreV4(None, ws, ex)
    assert e.value.status == 161002 and e.value.argument == "blockTableOptional"
    assert torch.isnan(out).all()                                       # nothing written


def test_aclnn_wild_table_id_never_crashes_the_process():
    """A regression would be a segmentation fault: run it in a child process."""
    code = (
        "import torch, fia\n"
        "from fia import aclnn\n"
        "import test_reliability_api as t\n"
        "q, kc, vc, table = t._paged(13)\n"
        "out = torch.zeros((2, 1, t.N * t.D), dtype=q.dtype)\n"
        "with fia.use_backend('decode'):\n"
        "    ws, ex = t._v4_plan(q, kc, vc, table, out)\n"
        "    table[0, 0] = 2147483647\n"
        "    try:\n"
        "        aclnn.aclnnFusedInferAttentionScoreV4(None, ws, ex)\n"
        "    except fia.FiaInputError:\n"
        "        print('raised')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       cwd=__file__.rsplit("/", 1)[0], env=child_env(dict(os.environ)))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "raised"


# ---------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("value", [10 ** 400, -(10 ** 400)], ids=["1e400", "-1e400"])
def test_scale_beyond_float64_names_scale(value):
    g = gen(21)
    q, k = randn((1, 2, 1, 16), g), randn((1, 2, 8, 16), g)
    with pytest.raises(fia.FiaInputError, match=r"^scale: expected a number within the float64 range"):
        fia.npu_fused_infer_attention_score(q, k, k, num_heads=2, input_layout="BNSD", scale=value)
    with pytest.raises(fia.FiaInputError, match=r"^scale_value: "):
        fia.npu_incre_flash_attention(q, k, k, num_heads=2, input_layout="BNSD", scale_value=value)
    with pytest.raises(fia.FiaInputError, match=r"^scale: expected a number within the float64 range"):
        fia.explain(q, k, k, num_heads=2, input_layout="BNSD", scale=value)


def test_set_validation_mode_is_per_thread():
    """One thread switching to portable leaves the others (and threads started later) strict."""
    seen = {}
    go, done = threading.Event(), threading.Event()

    def switcher():
        fia.set_validation_mode("portable")
        seen["switcher"] = fia.get_validation_mode()
        go.set()
        done.wait(5)

    def other():
        go.wait(5)
        seen["other"] = fia.get_validation_mode()

    before = fia.get_validation_mode()
    ts = [threading.Thread(target=switcher), threading.Thread(target=other)]
    for t in ts:
        t.start()
    ts[1].join()
    late = threading.Thread(target=lambda: seen.setdefault("late", fia.get_validation_mode()))
    late.start()
    late.join()
    done.set()
    ts[0].join()
    assert seen == {"switcher": "portable", "other": before, "late": before}
    assert fia.get_validation_mode() == before


# ---------------------------------------------------------------------------------------------- autograd state
BACKENDS = ["reference", "decode", "prefill"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_parameter_inputs_in_grad_mode(backend):
    """A model holds the sink (and may hold anything) as an nn.Parameter: every backend accepts inputs that
    require grad, gives the numbers of the plain tensors and returns results without autograd history."""
    g = gen(31)
    qs = 1 if backend == "decode" else 4
    q = randn((2, 4, qs, 64), g, torch.bfloat16)
    k, v = randn((2, 2, 48, 64), g, torch.bfloat16), randn((2, 2, 48, 64), g, torch.bfloat16)
    sink = randn((4,), g, torch.float32)
    kw = dict(num_query_heads=4, num_key_value_heads=2, input_layout="BNSD", softmax_scale=0.125,
              return_softmax_lse=True, sparse_mode=3 if qs > 1 else 0,
              atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1) if qs > 1 else None)
    with fia.use_backend(backend):
        want = fia.npu_fused_infer_attention_score_v2(q, k, v, learnable_sink=sink, **kw)
        params = [torch.nn.Parameter(t.clone()) for t in (q, k, v, sink)]
        with torch.enable_grad():
            got = fia.npu_fused_infer_attention_score_v2(*params[:3], learnable_sink=params[3], **kw)
    for a, b in zip(got, want):
        assert not a.requires_grad and a.grad_fn is None
        assert torch.equal(a, b)


@pytest.mark.parametrize("api", ["fused", "incre", "prompt"])
def test_outputs_never_carry_autograd_history(api):
    g = gen(32)
    q = randn((1, 2, 1 if api == "incre" else 3, 16), g).requires_grad_()
    k = randn((1, 2, 20, 16), g).requires_grad_()
    if api == "fused":
        out = fia.npu_fused_infer_attention_score(q, k, k, num_heads=2, input_layout="BNSD",
                                                  softmax_lse_flag=True)
    elif api == "incre":
        out = (fia.npu_incre_flash_attention(q, k, k, num_heads=2, input_layout="BNSD"),)
    else:
        out = (fia.npu_prompt_flash_attention(q, k, k, num_heads=2, input_layout="BNSD"),)
    assert all(not t.requires_grad for t in out)


# ---------------------------------------------------------------------------------------------- lazy negation
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["query", "key", "value", "atten_mask_free_all"])
def test_lazily_negated_views_read_as_their_values(backend, which):
    """torch._neg_view(x) holds x's memory with a negation bit: FIA computes with -x, on every path (the first
    calls, the memoized parse and the replay of repeated calls)."""
    g = gen(41)
    qs = 1 if backend == "decode" else 5
    t = {"query": randn((2, 4, qs, 32), g), "key": randn((2, 2, 40, 32), g), "value": randn((2, 2, 40, 32), g)}
    names = list(t) if which == "atten_mask_free_all" else [which]
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD", scale=0.2, softmax_lse_flag=True)
    with fia.use_backend("reference"):
        want = fia.npu_fused_infer_attention_score(
            *[-x if n in names else x for n, x in t.items()], **kw)
    with fia.use_backend(backend):
        for _ in range(4):                                              # full path, memo, replay
            args = [torch._neg_view(x) if n in names else x for n, x in t.items()]
            assert all(a.is_neg() for a, n in zip(args, t) if n in names)
            got = fia.npu_fused_infer_attention_score(*args, **kw)
            torch.testing.assert_close(got[0], want[0], atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)
        plain = fia.npu_fused_infer_attention_score(*t.values(), **kw)  # the same metadata, no negation bit
    with fia.use_backend("reference"):
        torch.testing.assert_close(plain[0], fia.npu_fused_infer_attention_score(*t.values(), **kw)[0],
                                   atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------------------------------------- memory
def test_request_beyond_memory_fails_at_once_naming_the_buffer():
    """1e14 bytes of reference scores: an error before anything is allocated, not seconds of paging."""
    import time
    g = gen(51)
    s = 1 << 20
    q = randn((1, 8, 1, 64), g).expand(1, 8, s, 64)                    # stride-0 views: no memory behind them
    k = randn((1, 8, 1, 64), g).expand(1, 8, s, 64)
    t0 = time.perf_counter()
    with fia.use_backend("reference"), pytest.raises(fia.FiaMemoryError, match=r"\[8, 1048576, 1048576\] scores") as e:
        fia.npu_fused_infer_attention_score(q, k, k, num_heads=8, input_layout="BNSD")
    assert time.perf_counter() - t0 < 5
    assert isinstance(e.value, MemoryError) and e.value.status == 361001 and e.value.need > e.value.available


def test_output_beyond_memory_names_attention_out(monkeypatch):
    from fia.backends import base
    monkeypatch.setattr(base, "available_memory", lambda: 1 << 30)     # a 1 GiB machine
    g = gen(52)
    q = randn((1, 32, 16, 128), g).expand(4096, 32, 16, 128)          # out: 1 GiB in float32, twice
    k = randn((1, 32, 64, 128), g).expand(4096, 32, 64, 128)
    with pytest.raises(fia.FiaMemoryError, match=r"largest part is attention_out \[4096, 32, 16, 128\] float32"):
        fia.npu_fused_infer_attention_score(q, k, k, num_heads=32, input_layout="BNSD")
