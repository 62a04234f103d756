"""Gaps found by running torch_npu's own unit tests against FIA (DECISIONS 38-42):

* npu_fused_infer_attention_score_v2's `out_dtype` and `quant_scale_p` keywords (graph schema included);
* the graph-capture helpers `_npu_fused_infer_attention_score[_v2]_infer_output`;
* fia.explain for every entry point's spelling (a function first, or api=);
* the reserved key_rope_antiquant_scale / dequant_scale_key_rope / keyRopeAntiquantScaleOptional: one rule;
* aclnnIncreFlashAttentionV4 / npu_incre_flash_attention per-token antiquant ((2, B, S) float32 scales);
  per-batch padding sizes (shape (B)); the MLA layouts NTD, BSH_BNSD, BSND_BNSD;
* messages with B = 1 never print "1 or 1" / "(or 1)".

Results are compared with an independent float64 formulation (`ref`) written here.
"""
import math

import pytest
import torch

import fia
import fia.torch_npu as drop_in
from fia import aclnn, graph
from fia.backends import registry
from util import gen, randn

pytestmark = pytest.mark.backend_independent

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
V1, V2 = "npu_fused_infer_attention_score", "npu_fused_infer_attention_score_v2"
IO1, IO2 = "_npu_fused_infer_attention_score_infer_output", "_npu_fused_infer_attention_score_v2_infer_output"


def ref(q, k, v, scale, q_win=None, kv_win=None):
    """float64 attention on canonical [B, N, S, D] tensors (GQA by repeating KV heads). Windows per batch:
    rows outside q_win are 0, keys outside kv_win take no part; a row without keys is 0."""
    q, k, v = q.double(), k.double(), v.double()
    b, n, sq, _ = q.shape
    g = n // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    out = torch.zeros(b, n, sq, v.shape[-1], dtype=torch.float64)
    for i in range(b):
        ql, qh = q_win[i] if q_win else (0, sq)
        kl, kh = kv_win[i] if kv_win else (0, k.shape[2])
        if qh <= ql or kh <= kl:
            continue
        s = q[i, :, ql:qh] @ k[i, :, kl:kh].transpose(-1, -2) * scale
        out[i, :, ql:qh] = torch.softmax(s, -1) @ v[i, :, kl:kh]
    return out


def close(a, b, tol=1e-2):
    a, b = a.double(), b.double()
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= tol * max(1.0, b.abs().max().item()), err


def bnsd_qkv(seed, b=2, n=4, kvn=2, sq=1, skv=24, d=32, dtype=F16):
    g = gen(seed)
    return randn((b, n, sq, d), g, dtype), randn((b, kvn, skv, d), g, dtype), randn((b, kvn, skv, d), g, dtype)


# ------------------------------------------------------------------------------ 1. v2 out_dtype / quant_scale_p
class TestV2NewKeywords:
    def test_none_is_accepted_and_changes_nothing(self):
        q, k, v = bnsd_qkv(1, sq=3)
        kw = dict(num_query_heads=4, num_key_value_heads=2, input_layout="BNSD", softmax_scale=0.2)
        base, _ = fia.npu_fused_infer_attention_score_v2(q, k, v, **kw)
        out, lse = fia.npu_fused_infer_attention_score_v2(q, k, v, quant_scale_p=None, out_dtype=None, **kw)
        assert torch.equal(out, base) and lse.shape == (1,)
        close(out, ref(q, k, v, 0.2))
        for same in (5, F16):             # the output's own dtype: torch_npu's number or a torch.dtype
            out2, _ = fia.npu_fused_infer_attention_score_v2(q, k, v, out_dtype=same, **kw)
            assert torch.equal(out2, base)

    def test_quant_scale_p_is_reserved(self):
        q, k, v = bnsd_qkv(2)
        with pytest.raises(fia.FiaInputError, match="quant_scale_p") as e:
            fia.npu_fused_infer_attention_score_v2(q, k, v, num_query_heads=4, num_key_value_heads=2,
                                                   input_layout="BNSD", quant_scale_p=torch.ones(1))
        assert e.value.status == 161002

    @pytest.mark.parametrize("bad", [15, torch.bfloat16, 1, "float16", 999, True])
    def test_out_dtype_of_a_float_query_is_its_own(self, bad):
        q, k, v = bnsd_qkv(3)
        with pytest.raises(fia.FiaInputError, match="out_dtype"):
            fia.npu_fused_infer_attention_score_v2(q, k, v, num_query_heads=4, num_key_value_heads=2,
                                                   input_layout="BNSD", out_dtype=bad)

    @pytest.mark.parametrize("od,want", [(None, F16), (5, F16), (15, BF16), (torch.bfloat16, BF16)])
    def test_out_dtype_of_an_int8_query(self, od, want):
        """int8 query dequantized by dequant_scale_query (query_quant_mode 3): out_dtype picks float16 or bfloat16."""
        b, n, kvn, sq, skv, d = 2, 4, 2, 3, 20, 32
        g = gen(4)
        q8 = torch.randint(-100, 100, (b, n, sq, d), generator=g, dtype=torch.int8)
        k, v = randn((b, kvn, skv, d), g, F16), randn((b, kvn, skv, d), g, F16)
        dsq = torch.rand(b, n, sq, generator=g) * 0.01 + 0.002
        out, _ = fia.npu_fused_infer_attention_score_v2(
            q8, k, v, num_query_heads=n, num_key_value_heads=kvn, input_layout="BNSD", softmax_scale=0.17,
            dequant_scale_query=dsq, query_quant_mode=3, out_dtype=od)
        assert out.dtype == want
        close(out, ref(q8.double() * dsq.double()[..., None], k, v, 0.17), 2e-2)
        with pytest.raises(fia.FiaInputError, match="out_dtype"):
            fia.npu_fused_infer_attention_score_v2(
                q8, k, v, num_query_heads=n, num_key_value_heads=kvn, input_layout="BNSD",
                dequant_scale_query=dsq, query_quant_mode=3, out_dtype=torch.int8)

    def test_out_dtype_with_output_quantization(self):
        q, k, v = bnsd_qkv(5)
        kw = dict(num_query_heads=4, num_key_value_heads=2, input_layout="BNSD", softmax_scale=0.2,
                  quant_scale_out=torch.tensor([50.0]))
        base, _ = fia.npu_fused_infer_attention_score_v2(q, k, v, **kw)
        out, _ = fia.npu_fused_infer_attention_score_v2(q, k, v, out_dtype=1, **kw)
        assert out.dtype == torch.int8 and torch.equal(out, base)
        with pytest.raises(fia.FiaInputError, match="out_dtype"):
            fia.npu_fused_infer_attention_score_v2(q, k, v, out_dtype=F16, **kw)

    @pytest.mark.parametrize("fp8", [n for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)])
    @pytest.mark.parametrize("sq", [1, 5])
    def test_fp8_quantized_output(self, fp8, sq):
        """out_dtype FP8 with quant_scale_out: the float32 result times the scale (+ offset), saturated to the
        format's largest finite value and rounded to nearest even; without quant_scale_out an input error."""
        dt = getattr(torch, fp8)
        q, k, v = bnsd_qkv(50 + sq, sq=sq)
        g = gen(60 + sq)
        big = torch.finfo(dt).max
        scale_out = torch.rand(4, 32, generator=g) * 4 * big + 1          # per channel [N, Dv]: some saturate
        off = torch.randn(4, 32, generator=g)
        kw = dict(num_query_heads=4, num_key_value_heads=2, input_layout="BNSD", softmax_scale=0.2,
                  quant_scale_out=scale_out, quant_offset_out=off)
        out, _ = fia.npu_fused_infer_attention_score_v2(q, k, v, out_dtype=dt, **kw)
        assert out.dtype == dt and out.shape == q.shape
        y = ref(q, k, v, 0.2) * scale_out.double()[None, :, None, :] + off.double()[None, :, None, :]
        m = torch.finfo(dt).max
        want = y.clamp(-m, m)
        assert (out.float().abs() <= m).all() and not out.float().isnan().any()
        assert (want.abs() >= m).any(), "no value saturates: the test would not see saturation"
        rel, tiny = {torch.float8_e4m3fn: (2 ** -3, 2 ** -9), torch.float8_e5m2: (2 ** -2, 2 ** -16)}[dt]
        assert ((out.double() - want).abs() <= 0.51 * rel * want.abs() + tiny).all()   # half an ulp (subnormals)
        with pytest.raises(fia.FiaInputError, match="out_dtype"):
            fia.npu_fused_infer_attention_score_v2(q, k, v, out_dtype=dt, num_query_heads=4, num_key_value_heads=2,
                                                   input_layout="BNSD")

    def test_graph_schema_and_variants(self):
        schema = graph.op(V2)._schema
        types = {a.name: str(a.type) for a in schema.arguments}
        assert types["quant_scale_p"] == "Optional[Tensor]" and types["out_dtype"] == "Optional[int]"
        names = [a.name for a in schema.arguments]
        assert names.index("quant_scale_p") == names.index("quant_offset_out") + 1 and names[-1] == "out_dtype"
        assert "out_dtype" in [a.name for a in graph.op(V2, out=True)._schema.arguments]
        assert "out_dtype" in [a.name for a in graph.op("_" + V2 + "_get_max_workspace")._schema.arguments]
        # .out and the fake kernel honour out_dtype
        b, n, sq, d = 1, 2, 2, 32
        g = gen(6)
        q8 = torch.randint(-100, 100, (b, n, sq, d), generator=g, dtype=torch.int8)
        k, v = randn((b, n, 10, d), g, F16), randn((b, n, 10, d), g, F16)
        dsq = torch.full((b, n, sq), 0.01)
        kw = dict(num_query_heads=n, input_layout="BNSD", dequant_scale_query=dsq, query_quant_mode=3,
                  out_dtype=torch.bfloat16)
        want, _ = fia.npu_fused_infer_attention_score_v2(q8, k, v, **kw)
        buf = torch.full(want.shape, float("nan"), dtype=BF16)          # NaN until written
        fia.npu_fused_infer_attention_score_v2.out(q8, k, v, out=[buf, torch.empty(1)], **kw)
        assert torch.equal(buf, want)
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode() as mode:
            fq, fk, fv, fd = (mode.from_tensor(t) for t in (q8, k, v, dsq))
            out, _ = fia.npu_fused_infer_attention_score_v2(fq, fk, fv, **dict(kw, dequant_scale_query=fd))
        assert out.dtype == BF16 and tuple(out.shape) == tuple(want.shape)


# ------------------------------------------------------------------------------ 2. _infer_output helpers
def _call_pair(api, q, k, v, **kw):
    fn = getattr(fia, api)
    return fn(q, k, v, **kw)


@pytest.mark.parametrize("layout", ["BSH", "BNSD", "BSND", "BNSD_BSND", "BSH_NBSD", "BSH_BNSD", "BSND_BNSD"])
@pytest.mark.parametrize("lse", [False, True])
def test_infer_output_matches_the_call(layout, lse):
    b, n, kvn, sq, skv, d = 2, 4, 2, 3, 16, 32
    q, k, v = bnsd_qkv(10, b, n, kvn, sq, skv, d)
    from util import to_layout
    q, k, v = (to_layout(t, layout) for t in (q, k, v))
    for api, infer, kw in (
            (V1, IO1, dict(num_heads=n, num_key_value_heads=kvn, input_layout=layout, softmax_lse_flag=lse)),
            (V2, IO2, dict(num_query_heads=n, num_key_value_heads=kvn, input_layout=layout,
                           return_softmax_lse=lse))):
        want, want_lse = _call_pair(api, q, k, v, **kw)
        out, l = getattr(fia, infer)(q, v, **kw)
        assert (out.shape, out.dtype) == (want.shape, want.dtype)
        assert (l.shape, l.dtype) == (want_lse.shape, want_lse.dtype)
        # the capture pattern: .out into the helper's buffers equals the functional call (the buffers are
        # uninitialized: NaN in those the call writes, so an element left unwritten fails every run)
        out.fill_(float("nan"))
        if lse:
            l.fill_(float("nan"))
        fn = getattr(fia, api)
        fn.out(q, k, v, out=[out, l], **kw)
        assert torch.equal(out, want)
        if lse:
            assert torch.equal(l, want_lse)


def test_infer_output_value_head_dim_paged_int4_quant():
    g = gen(11)
    b, n, kvn, d, bs = 2, 4, 1, 64, 16
    q = randn((b, 1, n * d), g, F16)
    # paged caches: (blocks, bs, H) and (blocks, KV_N, bs, D)
    for cache in (randn((6, bs, kvn * d), g, F16), randn((6, kvn, bs, d), g, F16)):
        out, lse = fia._npu_fused_infer_attention_score_infer_output(
            q, cache, num_heads=n, num_key_value_heads=kvn, block_table=torch.zeros(b, 3, dtype=torch.int32))
        assert out.shape == (b, 1, n * d) and out.dtype == F16 and lse.shape == (0,)
    # int4 value (eight values per int32) and a quantized output
    v4 = torch.zeros(b, 20, kvn * d // 8, dtype=torch.int32)
    out, _ = fia._npu_fused_infer_attention_score_v2_infer_output(q, v4, num_query_heads=n, num_key_value_heads=kvn,
                                                                  quant_scale_out=torch.ones(1))
    assert out.shape == (b, 1, n * d) and out.dtype == torch.int8
    # value head dim differs from the query's (TND / MLA): the output follows the value
    qt, vt = randn((7, n, 64), g, BF16), randn((9, kvn, 32), g, BF16)
    out, lse = fia._npu_fused_infer_attention_score_v2_infer_output(qt, vt, num_query_heads=n, num_key_value_heads=kvn,
                                                                    input_layout="TND_NTD", return_softmax_lse=True)
    assert out.shape == (n, 7, 32) and lse.shape == (7, n, 1)
    # int8 query: float16, or query_rope's dtype, or out_dtype
    q8 = torch.zeros(b, 1, n * d, dtype=torch.int8)
    v8 = torch.zeros(b, 5, kvn * d, dtype=torch.int8)
    assert fia._npu_fused_infer_attention_score_infer_output(q8, v8, num_heads=n,
                                                             num_key_value_heads=kvn)[0].dtype == F16
    assert fia._npu_fused_infer_attention_score_infer_output(q8, v8, num_heads=n, num_key_value_heads=kvn,
                                                             query_rope=torch.zeros(b, 1, n * 64, dtype=BF16)
                                                             )[0].dtype == BF16
    assert fia._npu_fused_infer_attention_score_v2_infer_output(
        q8, torch.zeros(b, 5, kvn * d, dtype=torch.int8), num_query_heads=n, num_key_value_heads=kvn,
        out_dtype=15)[0].dtype == BF16
    with pytest.raises(fia.FiaInputError, match="query_dtype"):
        fia._npu_fused_infer_attention_score_v2_infer_output(q, v4, num_query_heads=n, query_dtype=1)
    with pytest.raises(fia.FiaInputError, match="num_query_heads"):
        fia._npu_fused_infer_attention_score_v2_infer_output(q, v4, num_query_heads=3)


def test_infer_output_is_exported_and_traceable():
    for name in (IO1, IO2):
        assert name in fia.__all__ and name in drop_in.__all__
        assert getattr(drop_in, name) is getattr(fia, name)
    q, k, v = bnsd_qkv(12, sq=2)
    kw = dict(num_query_heads=4, num_key_value_heads=2, input_layout="BNSD", return_softmax_lse=True)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        out, lse = fia._npu_fused_infer_attention_score_v2_infer_output(mode.from_tensor(q), mode.from_tensor(v),
                                                                        **kw)
    assert tuple(out.shape) == (2, 4, 2, 32) and tuple(lse.shape) == (2, 4, 2, 1)

    def f(q, v):
        return fia._npu_fused_infer_attention_score_v2_infer_output(q, v, **kw)
    torch._dynamo.reset()
    o2, l2 = torch.compile(f, fullgraph=True, backend="eager")(q, v)
    assert o2.shape == (2, 4, 2, 32) and l2.shape == (2, 4, 2, 1)


# ------------------------------------------------------------------------------ 3. fia.explain for every spelling
class TestExplainSpellings:
    def _selected(self, problem):
        return registry.select(problem).name

    def test_incre_and_prompt(self):
        q, k, v = bnsd_qkv(20)
        r = fia.explain(fia.npu_incre_flash_attention, q, k, v, num_heads=4, num_key_value_heads=2,
                        input_layout="BNSD", scale_value=0.125, actual_seq_lengths=[24, 9])
        p = fia.parse.parse_incre(dict(query=q, key=k, value=v, padding_mask=None, pse_shift=None, atten_mask=None,
                                       actual_seq_lengths=[24, 9], dequant_scale1=None, quant_scale1=None,
                                       dequant_scale2=None, quant_scale2=None, quant_offset2=None,
                                       antiquant_scale=None, antiquant_offset=None, block_table=None,
                                       kv_padding_size=None, num_heads=4, scale_value=0.125, input_layout="BNSD",
                                       num_key_value_heads=2, block_size=0, inner_precise=1))
        assert r.api == "npu_incre_flash_attention" and r.selected == self._selected(p)
        assert str(r).startswith("npu_incre_flash_attention:")
        r2 = fia.explain(q, k, v, api="npu_incre_flash_attention", num_heads=4, num_key_value_heads=2,
                         input_layout="BNSD", scale_value=0.125)
        assert r2.api == "npu_incre_flash_attention"
        qp, kp, vp = bnsd_qkv(21, sq=8)
        r3 = fia.explain(qp, kp, vp, api="npu_prompt_flash_attention", num_heads=4, num_key_value_heads=2,
                         input_layout="BNSD", scale_value=0.1, next_tokens=0, sparse_mode=10)
        assert r3.api == "npu_prompt_flash_attention" and r3.supported and "Q_S=8" in r3.summary

    def test_v2_and_aclnn(self):
        q, k, v = bnsd_qkv(22, sq=2)
        r = fia.explain(fia.npu_fused_infer_attention_score_v2, q, k, v, num_query_heads=4, num_key_value_heads=2,
                        input_layout="BNSD", softmax_scale=0.1, return_softmax_lse=True, out_dtype=None)
        assert r.api == V2 and r.supported and "lse" in r.summary
        # the workspace query and the .out spelling name the same entry point
        assert fia.explain(fia._npu_fused_infer_attention_score_v2_get_max_workspace, q, k, v, num_query_heads=4,
                           num_key_value_heads=2, input_layout="BNSD").api == V2
        qd, kd, vd = bnsd_qkv(23)
        nones = dict(pseShift=None, attenMask=None, actualSeqLengths=[24, 5], dequantScale1=None, quantScale1=None,
                     dequantScale2=None, quantScale2=None, quantOffset2=None, antiquantScale=None,
                     antiquantOffset=None, blocktable=None, kvPaddingSize=None, numHeads=4, scaleValue=0.1,
                     inputLayout="BNSD", numKeyValueHeads=2, blockSize=0, innerPrecise=1)
        r = fia.explain(aclnn.aclnnIncreFlashAttentionV4GetWorkspaceSize, qd, [kd], [vd], **nones)
        assert r.api == "aclnnIncreFlashAttentionV4" and r.supported
        r = fia.explain(qd, [kd], [vd], api="aclnnIncreFlashAttentionV4", **nones)
        assert r.api == "aclnnIncreFlashAttentionV4"
        v4 = {p: None for p in list(aclnn.names("aclnnFusedInferAttentionScoreV4"))[3:]}
        v4.update(numHeads=4, scaleValue=0.1, preTokens=2147483647, nextTokens=2147483647, inputLayout="BNSD",
                  numKeyValueHeads=2, sparseMode=0, innerPrecise=0, blockSize=0, antiquantMode=0,
                  softmaxLseFlag=False, keyAntiquantMode=0, valueAntiquantMode=0, queryQuantMode=0)
        r = fia.explain(q, [k], [v], api="aclnnFusedInferAttentionScoreV4GetWorkspaceSize", **v4)
        assert r.api == "aclnnFusedInferAttentionScoreV4" and r.supported
        with pytest.raises(fia.FiaInputError, match="numHeads"):
            fia.explain(q, [k], [v], api="aclnnFusedInferAttentionScoreV4", **dict(v4, numHeads=3))
        with pytest.raises(TypeError, match="missing"):
            fia.explain(q, [k], [v], api="aclnnFusedInferAttentionScoreV4", numHeads=4)

    def test_fused_spelling_and_errors(self):
        q, k, v = bnsd_qkv(24)
        r = fia.explain(q, k, v, num_heads=4, num_key_value_heads=2, input_layout="BNSD", scale=0.1)
        assert r.api == V1 and r.supported
        with pytest.raises(TypeError):
            fia.explain(q, k, v, num_heads=4, scale_value=0.1)             # not a fused keyword
        with pytest.raises(fia.FiaInputError, match="scale_value"):
            fia.explain(fia.npu_incre_flash_attention, q, k, v, num_heads=4, num_key_value_heads=2,
                        input_layout="BNSD", scale_value="x")
        with pytest.raises(fia.FiaInputError, match="bogus"):                 # v2 collects unknown keywords
            fia.explain(q, k, v, api=V2, num_query_heads=4, num_key_value_heads=2, input_layout="BNSD", bogus=1)
        with pytest.raises(TypeError, match="disagree"):
            fia.explain(fia.npu_incre_flash_attention, q, k, v, api=V2)
        with pytest.raises(TypeError, match="unknown entry point"):
            fia.explain(q, k, v, api="npu_flash_attention")


# ------------------------------------------------------------------------------ 4. reserved key rope antiquant scale
def test_key_rope_antiquant_scale_is_reserved_everywhere():
    q, k, v = bnsd_qkv(30)
    t = torch.ones(1)
    kw1 = dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD")
    kw2 = dict(num_query_heads=4, num_key_value_heads=2, input_layout="BNSD")
    a, _ = fia.npu_fused_infer_attention_score(q, k, v, key_rope_antiquant_scale=None, **kw1)
    b, _ = fia.npu_fused_infer_attention_score_v2(q, k, v, dequant_scale_key_rope=None, **kw2)
    assert torch.equal(a, b)
    errors = []
    with pytest.raises(fia.FiaInputError) as e:
        fia.npu_fused_infer_attention_score(q, k, v, key_rope_antiquant_scale=t, **kw1)
    errors.append((e.value, "key_rope_antiquant_scale"))
    with pytest.raises(fia.FiaInputError) as e:
        fia.npu_fused_infer_attention_score_v2(q, k, v, dequant_scale_key_rope=t, **kw2)
    errors.append((e.value, "dequant_scale_key_rope"))
    v4 = {p: None for p in list(aclnn.names("aclnnFusedInferAttentionScoreV4"))[3:]}
    v4.update(numHeads=4, scaleValue=1.0, preTokens=2147483647, nextTokens=2147483647, inputLayout="BNSD",
              numKeyValueHeads=2, sparseMode=0, innerPrecise=0, blockSize=0, antiquantMode=0, softmaxLseFlag=False,
              keyAntiquantMode=0, valueAntiquantMode=0, queryQuantMode=0)
    out = torch.empty_like(q)
    aclnn.aclnnFusedInferAttentionScoreV4GetWorkspaceSize(q, [k], [v], **v4, attentionOut=out, softmaxLse=None)
    with pytest.raises(fia.FiaInputError) as e:
        aclnn.aclnnFusedInferAttentionScoreV4GetWorkspaceSize(q, [k], [v], **dict(v4, keyRopeAntiquantScaleOptional=t),
                                                               attentionOut=out, softmaxLse=None)
    errors.append((e.value, "keyRopeAntiquantScaleOptional"))
    for err, name in errors:             # one rule: the same class, status and message, in each entry's spelling
        assert type(err) is fia.FiaInputError and err.status == 161002 and err.argument == name
        assert str(err).startswith(f"{name}: ") and "reserved" in str(err)


# ------------------------------------------------------------------------------ 5. IFA per-token antiquant, padding
def _per_token_case(seed, b=2, n=4, kvn=2, skv=40, d=64):
    g = gen(seed)
    q = randn((b, n, 1, d), g, F16)
    k8 = torch.randint(-100, 100, (b, kvn, skv, d), generator=g, dtype=torch.int8)
    v8 = torch.randint(-100, 100, (b, kvn, skv, d), generator=g, dtype=torch.int8)
    sc = torch.rand(2, b, skv, generator=g) * 0.02 + 0.005
    off = torch.randn(2, b, skv, generator=g) * 3
    kd = (k8.double() + off[0].double()[:, None, :, None]) * sc[0].double()[:, None, :, None]
    vd = (v8.double() + off[1].double()[:, None, :, None]) * sc[1].double()[:, None, :, None]
    return q, k8, v8, sc, off, kd, vd


@pytest.mark.parametrize("with_offset", [False, True])
def test_incre_per_token_antiquant(with_offset):
    q, k8, v8, sc, off, kd, vd = _per_token_case(40)
    if not with_offset:
        off = None
        kd = k8.double() * sc[0].double()[:, None, :, None]
        vd = v8.double() * sc[1].double()[:, None, :, None]
    s = 1 / math.sqrt(64)
    out = fia.npu_incre_flash_attention(q, k8, v8, antiquant_scale=sc, antiquant_offset=off, num_heads=4,
                                        num_key_value_heads=2, input_layout="BNSD", scale_value=s,
                                        actual_seq_lengths=[40, 23])
    want = ref(q, kd, vd, s, kv_win=[(0, 40), (0, 23)])
    close(out, want)
    # the same through aclnnIncreFlashAttentionV4 (its antiquantScale (2, B, S): per-token)
    att = torch.full_like(q, float("nan"))              # NaN until written
    ws, ex = aclnn.aclnnIncreFlashAttentionV4GetWorkspaceSize(
        q, [k8], [v8], None, None, [40, 23], None, None, None, None, None, sc, off, None, None, 4, s, "BNSD", 2, 0,
        1, att)
    assert aclnn.aclnnIncreFlashAttentionV4(None, ws, ex, None) == 0
    assert torch.equal(att, out)
    # and through the fused function's antiquant_mode=1
    fo, _ = fia.npu_fused_infer_attention_score(q, k8, v8, antiquant_scale=sc, antiquant_offset=off, antiquant_mode=1,
                                                num_heads=4, num_key_value_heads=2, input_layout="BNSD", scale=s,
                                                actual_seq_lengths_kv=[40, 23])
    close(fo, want)


def test_incre_per_token_shape_error_with_b1_says_no_or_1():
    q, k8, v8, sc, off, _, _ = _per_token_case(41, b=1)
    with pytest.raises(fia.FiaInputError) as e:
        fia.npu_incre_flash_attention(q, k8, v8, antiquant_scale=sc[:, :, :7].contiguous(), num_heads=4,
                                      num_key_value_heads=2, input_layout="BNSD")
    msg = str(e.value)
    assert "antiquant_scale" in msg and "(or 1)" not in msg and "B = 1" in msg


def test_per_batch_kv_padding_incre_and_aclnn():
    """kv_padding_size of shape (B): each batch's window [S - pad_b - act_b, S - pad_b); a window starting below
    0 gives zeros; a negative padding counts as 0."""
    q, k, v = bnsd_qkv(50, b=3, skv=30)
    pad = torch.tensor([4, -2, 20], dtype=torch.int64)
    act = [20, 30, 15]
    s = 0.15
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD", scale_value=s, actual_seq_lengths=act)
    out = fia.npu_incre_flash_attention(q, k, v, kv_padding_size=pad, **kw)
    want = ref(q, k, v, s, kv_win=[(6, 26), (0, 30), (0, 0)])
    close(out, want)
    assert (out[2] == 0).all()
    # one element still means every batch
    one = fia.npu_incre_flash_attention(q, k, v, kv_padding_size=torch.tensor([4]), **dict(kw, actual_seq_lengths=[20]))
    close(one, ref(q, k, v, s, kv_win=[(6, 26)] * 3))
    att = torch.full_like(q, float("nan"))              # NaN until written
    ws, ex = aclnn.aclnnIncreFlashAttentionV4GetWorkspaceSize(
        q, [k], [v], None, None, act, None, None, None, None, None, None, None, None, pad, 4, s, "BNSD", 2, 0, 1, att)
    aclnn.aclnnIncreFlashAttentionV4(None, ws, ex, None)
    assert torch.equal(att, out)
    with pytest.raises(fia.FiaInputError, match="kv_padding_size"):
        fia.npu_incre_flash_attention(q, k, v, kv_padding_size=torch.tensor([1, 2], dtype=torch.int64), **kw)


def test_per_batch_query_and_kv_padding_fused():
    b, n, kvn, sq, skv, d = 2, 2, 1, 9, 14, 32
    g = gen(51)
    q, k, v = randn((b, n, sq, d), g, F16), randn((b, kvn, skv, d), g, F16), randn((b, kvn, skv, d), g, F16)
    qpad, kvpad = torch.tensor([2, 0]), torch.tensor([1, 5])
    aq, akv = [5, 9], [10, 9]
    out, _ = fia.npu_fused_infer_attention_score(q, k, v, num_heads=n, num_key_value_heads=kvn, input_layout="BNSD",
                                                 scale=0.2, query_padding_size=qpad, kv_padding_size=kvpad,
                                                 actual_seq_lengths=aq, actual_seq_lengths_kv=akv)
    want = ref(q, k, v, 0.2, q_win=[(2, 7), (0, 9)], kv_win=[(3, 13), (0, 9)])
    close(out, want)


@pytest.mark.parametrize("new,base", [("BSH_BNSD", "BSH"), ("BSND_BNSD", "BSND"), ("NTD", "NTD_TND")])
def test_mla_layouts(new, base):
    """The layouts torch_npu's MLA section lists: the same numbers as their base layout, in the output layout
    after the underscore."""
    from util import to_layout
    if new == "NTD":
        g = gen(60)
        n, t, d = 2, 10, 32
        q, k, v = randn((n, t, d), g, BF16), randn((n, t, d), g, BF16), randn((n, t, d), g, BF16)
        kw = dict(num_heads=n, actual_seq_lengths=[4, 10], actual_seq_lengths_kv=[4, 10], softmax_lse_flag=True)
        with fia.validation_mode("portable"):
            o_new, l_new = fia.npu_fused_infer_attention_score(q, k, v, input_layout=new, **kw)
            o_base, l_base = fia.npu_fused_infer_attention_score(q, k, v, input_layout=base, **kw)
        assert o_new.shape == (n, t, d) and torch.equal(o_new, o_base.permute(1, 0, 2))
        assert torch.equal(l_new, l_base)
        qc = q.double()
        want = torch.cat([ref(qc[None, :, :4], k[None, :, :4], v[None, :, :4], 1.0)[0],
                          ref(qc[None, :, 4:], k[None, :, 4:], v[None, :, 4:], 1.0)[0]], 1)
        close(o_new, want)
        return
    q, k, v = bnsd_qkv(61, sq=3)
    q, k, v = (to_layout(t, base) for t in (q, k, v))
    kw = dict(num_query_heads=4, num_key_value_heads=2, softmax_scale=0.2)
    o_new, _ = fia.npu_fused_infer_attention_score_v2(q, k, v, input_layout=new, **kw)
    o_base, _ = fia.npu_fused_infer_attention_score_v2(q, k, v, input_layout=base, **kw)
    from util import out_to_canon
    assert torch.equal(o_new, out_to_canon(o_base, base, 4).contiguous())


# ------------------------------------------------------------------------------ 6. messages with B = 1
def test_b1_messages_never_say_1_or_1():
    q, k, v = bnsd_qkv(70, b=1)
    pse = torch.zeros(3, 4, 1, 24, dtype=F16)
    with pytest.raises(fia.FiaInputError) as e:
        fia.npu_fused_infer_attention_score(q, k, v, pse_shift=pse, num_heads=4, num_key_value_heads=2,
                                            input_layout="BNSD")
    assert "pse_shift" in str(e.value) and "1 or 1" not in str(e.value) and "(1, 4," in str(e.value)
    with pytest.raises(fia.FiaInputError) as e:
        fia.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=[], num_heads=4, num_key_value_heads=2,
                                            input_layout="BNSD")
    assert "B = 1 entries" not in str(e.value)
