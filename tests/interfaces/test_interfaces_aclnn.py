"""The two-phase aclnn interface (SPEC 1.2): the documents' sample programs, status codes, executors."""
import math

import pytest
import torch

import fia
from fia import aclnn
from fia.aclnn import (aclnnFusedInferAttentionScoreV2, aclnnFusedInferAttentionScoreV2GetWorkspaceSize,
                       aclnnFusedInferAttentionScoreV4, aclnnFusedInferAttentionScoreV4GetWorkspaceSize,
                       aclnnIncreFlashAttentionV4, aclnnIncreFlashAttentionV4GetWorkspaceSize)
from fia.backends import registry
from util import gen, randn, to_layout

pytestmark = pytest.mark.backend_independent      # one run with automatic backend selection (conftest)

ACL_SUCCESS = 0
F16 = torch.float16
INT_MAX = 2147483647


# ---------------------------------------------------------------------------------------------- helpers
def v2_args(query, key, value, out, lse=None, *, num_heads, layout="BNSD", kv_heads=0, lse_flag=False,
            **opt):
    """The 39 positional arguments of aclnnFusedInferAttentionScoreV2GetWorkspaceSize (prototype order)."""
    o = {k: None for k, _ in aclnn._V2_INPUTS[3:]}
    attrs = dict(numHeads=num_heads, scaleValue=1.0, preTokens=INT_MAX, nextTokens=INT_MAX, inputLayout=layout,
                 numKeyValueHeads=kv_heads, sparseMode=0, innerPrecise=0, blockSize=0, antiquantMode=0,
                 softmaxLseFlag=lse_flag, keyAntiquantMode=0, valueAntiquantMode=0)
    for k, val in opt.items():
        if k in o:
            o[k] = val
        elif k in attrs:
            attrs[k] = val
        else:
            raise TypeError(k)
    return [query, key, value] + list(o.values()) + list(attrs.values()) + [out, lse]


def plan_and_run_v2(*args):
    ws, ex = aclnnFusedInferAttentionScoreV2GetWorkspaceSize(*args)
    assert aclnnFusedInferAttentionScoreV2(None, ws, ex, None) == ACL_SUCCESS
    return ex


# ---------------------------------------------------------------------------------------------- the samples
def test_v2_sample_program():
    """FusedInferAttentionScoreV2.md "调用示例", translated line by line (ACL setup/teardown dropped)."""
    # 2. 构造输入与输出
    batchSize = 1
    numHeads = 2
    numKeyValueHeads = 2
    sequenceLengthQ = 1
    sequenceLengthKV = 512
    headDims = 128
    queryShape = [batchSize, numHeads, sequenceLengthQ, headDims]           # BNSD
    keyShape = [batchSize, numKeyValueHeads, sequenceLengthKV, headDims]    # BNSD
    valueShape = [batchSize, numKeyValueHeads, sequenceLengthKV, headDims]  # BNSD
    attenMaskShape = [batchSize, 1, 1, sequenceLengthKV]                    # B11S
    outShape = [batchSize, numHeads, sequenceLengthQ, headDims]             # BNSD
    queryTensor = torch.full(queryShape, 1.0, dtype=torch.float16)          # CreateAclTensor(..., ACL_FLOAT16)
    keyTensor = torch.full(keyShape, 1.0, dtype=torch.float16)
    tensorKeyList = [keyTensor]                                             # aclCreateTensorList(tensorsOfKey, 1)
    valueTensor = torch.full(valueShape, 1.0, dtype=torch.float16)
    tensorValueList = [valueTensor]
    attenMaskTensor = torch.zeros(attenMaskShape, dtype=torch.int8)         # ACL_INT8 (created, then not passed)
    outTensor = torch.full(outShape, 1.0, dtype=torch.float16)
    actualSeqLengths = [sequenceLengthKV]                                   # aclCreateIntArray (not passed)
    scaleValue = 1 / math.sqrt(headDims)
    preTokens = 65535
    nextTokens = 65535
    layerOut = "BNSD"
    sparseMode = 0
    innerPrecise = 0
    blockSize = 0
    antiquantMode = 0
    softmaxLseFlag = False
    keyAntiquantMode = 0
    valueAntiquantMode = 0
    nullptr = None

    # 3. 调用CANN算子库API
    workspaceSize, executor = aclnnFusedInferAttentionScoreV2GetWorkspaceSize(
        queryTensor, tensorKeyList, tensorValueList, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
        nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
        nullptr, nullptr, numHeads, scaleValue, preTokens, nextTokens, layerOut, numKeyValueHeads, sparseMode,
        innerPrecise, blockSize, antiquantMode, softmaxLseFlag, keyAntiquantMode, valueAntiquantMode, outTensor,
        nullptr)
    workspaceAddr = None
    if workspaceSize > 0:
        workspaceAddr = torch.empty(workspaceSize, dtype=torch.uint8)   # aclrtMalloc
    ret = aclnnFusedInferAttentionScoreV2(workspaceAddr, workspaceSize, executor, None)
    assert ret == ACL_SUCCESS

    # 5. 获取输出的值: every V row is ones, so every output value is 1
    resultData = outTensor.reshape(-1).tolist()
    assert len(resultData) == batchSize * numHeads * sequenceLengthQ * headDims
    assert all(x == 1.0 for x in resultData)
    del attenMaskTensor, actualSeqLengths
    # softmaxLse was nullptr and softmaxLseFlag false: a (1,) zero tensor stands for it
    assert torch.equal(executor.softmaxLse, torch.zeros(1))


def _v4_sample_inputs():
    """The tensors of FusedInferAttentionScoreV4.md's sample (BNSD, decode, D = 16, KV_S = 16)."""
    batchSize, numHeads, sequenceLengthQ, headDims, keyNumHeads, sequenceLengthKV = 1, 2, 1, 16, 2, 16
    q = torch.full([batchSize, numHeads, sequenceLengthQ, headDims], 1.0, dtype=F16)
    k = torch.full([batchSize, keyNumHeads, sequenceLengthKV, headDims], 1.0, dtype=F16)
    v = torch.full([batchSize, keyNumHeads, sequenceLengthKV, headDims], 1.0, dtype=F16)
    out = torch.full([batchSize, numHeads, sequenceLengthQ, headDims], 1.0, dtype=F16)
    return q, [k], [v], out, numHeads, headDims


def test_v4_sample_program():
    """FusedInferAttentionScoreV4.md "调用示例", translated line by line -- with the prototype's argument
    count: the sample passes 24 optional inputs and no queryQuantMode; the prototype (which wins, SPEC 1.2)
    has 25 optional inputs and ends its attributes with queryQuantMode."""
    queryTensor, tensorKeyList, tensorValueList, outTensor, numHeads, headDims = _v4_sample_inputs()
    attenTensor = torch.zeros([1, 1, 1, 16], dtype=torch.bool)     # ACL_BOOL (created, then not passed)
    actualSeqLengths = [16]                                          # created, not passed
    numKeyValueHeads = numHeads
    scaleValue = 1 / math.sqrt(headDims)
    preTokens = 65535
    nextTokens = 65535
    layerOut = "BNSD"
    sparseMode = 0
    innerPrecise = 1
    blockSize = 0
    antiquantMode = 0
    softmaxLseFlag = False
    keyAntiquantMode = 0
    valueAntiquantMode = 0
    queryQuantMode = 0                                               # the prototype's extra attribute
    nullptr = None
    workspaceSize, executor = aclnnFusedInferAttentionScoreV4GetWorkspaceSize(
        queryTensor, tensorKeyList, tensorValueList, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
        nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
        nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,          # 25 optional inputs
        numHeads, scaleValue, preTokens, nextTokens, layerOut, numKeyValueHeads, sparseMode, innerPrecise,
        blockSize, antiquantMode, softmaxLseFlag, keyAntiquantMode, valueAntiquantMode, queryQuantMode,
        outTensor, nullptr)
    workspaceAddr = torch.empty(workspaceSize, dtype=torch.uint8) if workspaceSize > 0 else None
    ret = aclnnFusedInferAttentionScoreV4(workspaceAddr, workspaceSize, executor, None)
    assert ret == ACL_SUCCESS
    assert torch.equal(outTensor, torch.ones_like(outTensor))
    del attenTensor, actualSeqLengths


def test_v4_sample_argument_count_is_the_prototypes():
    """The sample's literal call (24 optional inputs, no queryQuantMode) does not bind to the prototype."""
    q, k, v, out, n, d = _v4_sample_inputs()
    literal = [q, k, v] + [None] * 24 + [n, 1 / math.sqrt(d), 65535, 65535, "BNSD", n, 0, 1, 0, 0, False, 0, 0,
                                         out, None]
    with pytest.raises(TypeError):
        aclnnFusedInferAttentionScoreV4GetWorkspaceSize(*literal)


def test_ifa_v4_sample_program():
    """IncreFlashAttentionV4.md "调用示例", translated line by line (mask and actualSeqLengths are passed;
    blockSize = 1 without a block table is ignored, SPEC 15.11)."""
    batchSize = 1
    numHeads = 2
    headDims = 16
    keyNumHeads = 2
    sequenceLengthKV = 16
    queryShape = [batchSize, numHeads, 1, headDims]                   # BNSD
    keyShape = [batchSize, keyNumHeads, sequenceLengthKV, headDims]   # BNSD
    valueShape = [batchSize, keyNumHeads, sequenceLengthKV, headDims]  # BNSD
    attenShape = [batchSize, 1, 1, sequenceLengthKV]                  # B11S
    outShape = [batchSize, numHeads, 1, headDims]                     # BNSD
    queryTensor = torch.full(queryShape, 1.0, dtype=torch.float16)
    keyTensor = torch.full(keyShape, 1.0, dtype=torch.float16)
    tensorKeyList = [keyTensor]
    valueTensor = torch.full(valueShape, 1.0, dtype=torch.float16)
    tensorValueList = [valueTensor]
    attenTensor = torch.zeros(attenShape, dtype=torch.int8)           # ACL_INT8
    outTensor = torch.full(outShape, 1.0, dtype=torch.float16)
    actualSeqLengths = [sequenceLengthKV]
    numKeyValueHeads = numHeads
    blockSize = 1
    innerPrecise = 1
    scaleValue = 1 / math.sqrt(headDims)
    layerOut = "BNSD"
    nullptr = None
    workspaceSize, executor = aclnnIncreFlashAttentionV4GetWorkspaceSize(
        queryTensor, tensorKeyList, tensorValueList, nullptr, attenTensor, actualSeqLengths, nullptr, nullptr,
        nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, numHeads, scaleValue, layerOut,
        numKeyValueHeads, blockSize, innerPrecise, outTensor)
    workspaceAddr = torch.empty(workspaceSize, dtype=torch.uint8) if workspaceSize > 0 else None
    ret = aclnnIncreFlashAttentionV4(workspaceAddr, workspaceSize, executor, None)
    assert ret == ACL_SUCCESS
    assert torch.equal(outTensor, torch.ones(outShape, dtype=torch.float16))


# ---------------------------------------------------------------------------------------------- same results as eager
def test_v2_matches_eager_prefill_mask_lengths_lse():
    g = gen(501)
    b, n, kvn, sq, skv, d = 2, 4, 2, 5, 19, 16
    q, k, v = randn((b, sq, n * d), g), randn((b, skv, kvn * d), g), randn((b, skv, kvn * d), g)
    mask = torch.rand(b, 1, sq, skv, generator=g) < 0.3
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BSH", atten_mask=mask, scale=0.3,
              actual_seq_lengths=[5, 3], actual_seq_lengths_kv=[19, 11], softmax_lse_flag=True, inner_precise=2)
    ref_out, ref_lse = fia.npu_fused_infer_attention_score(q, k, v, **kw)
    out = torch.full_like(ref_out, float("nan"))
    lse = torch.full_like(ref_lse, float("nan"))
    args = v2_args(q, [k], [v], out, lse, num_heads=n, kv_heads=kvn, layout="BSH", lse_flag=True,
                   attenMaskOptional=mask, scaleValue=0.3, actualSeqLengthsOptional=[5, 3],
                   actualSeqLengthsKvOptional=[19, 11], innerPrecise=2)
    plan_and_run_v2(*args)
    assert torch.equal(out, ref_out)
    assert torch.equal(lse, ref_lse)


def test_v4_matches_eager_tnd():
    """V4-only layout (TND, cumulative lengths) with softmaxLse [T, N, 1]."""
    g = gen(502)
    n, d, lens_q, lens_kv = 2, 128, [3, 1, 4], [5, 7, 2]       # TND: D 128 (SPEC 14b.4 T16)
    cq, ckv = [3, 4, 8], [5, 12, 14]
    bf = torch.bfloat16                          # strict mode: TND without rope is bfloat16
    q, k, v = randn((8, n, d), g, bf), randn((14, n, d), g, bf), randn((14, n, d), g, bf)
    kw = dict(num_heads=n, input_layout="TND", actual_seq_lengths=cq, actual_seq_lengths_kv=ckv,
              softmax_lse_flag=True, scale=0.25)
    ref_out, ref_lse = fia.npu_fused_infer_attention_score(q, k, v, **kw)
    assert tuple(ref_lse.shape) == (8, n, 1)
    out, lse = torch.full_like(ref_out, float("nan")), torch.full((8, n, 1), float("nan"))   # NaN until written
    opt = [None] * 25
    opt[2], opt[3] = cq, ckv                      # actualSeqLengthsOptional, actualSeqLengthsKvOptional
    ws, ex = aclnnFusedInferAttentionScoreV4GetWorkspaceSize(
        q, [k], [v], *opt, n, 0.25, INT_MAX, INT_MAX, "TND", 0, 0, 0, 0, 0, True, 0, 0, 0, out, lse)
    assert aclnnFusedInferAttentionScoreV4(None, ws, ex) == ACL_SUCCESS
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    del lens_q, lens_kv


def test_v2_paged_kv_one_tensor_list_is_the_cache():
    """A one-tensor aclTensorList holding every batch is ordinary KV -- here a paged cache."""
    g = gen(503)
    b, n, d, bs = 2, 2, 16, 16
    kc, vc = randn((5, bs, n * d), g), randn((5, bs, n * d), g)
    table = torch.tensor([[4, 0, 2], [1, 3, -1]], dtype=torch.int32)
    q = randn((b, 1, n * d), g)
    kw = dict(num_heads=n, input_layout="BSH", block_table=table, block_size=bs, actual_seq_lengths_kv=[40, 20])
    ref, _ = fia.npu_fused_infer_attention_score(q, kc, vc, **kw)
    out = torch.zeros_like(ref)
    plan_and_run_v2(*v2_args(q, [kc], [vc], out, num_heads=n, layout="BSH", blockTableOptional=table,
                             blockSize=bs, actualSeqLengthsKvOptional=[40, 20]))
    assert torch.equal(out, ref)


def test_ifa_tensor_list_kv_matches_eager():
    """Several batch-1 tensors: tensor-list KV with individual lengths."""
    g = gen(504)
    n, d, lens = 2, 16, [4, 9, 6]
    q = randn((3, n, 1, d), g)
    ks = [randn((1, n, s, d), g) for s in lens]
    vs = [randn((1, n, s, d), g) for s in lens]
    ref = fia.npu_incre_flash_attention(q, ks, vs, num_heads=n, input_layout="BNSD", scale_value=0.2)
    out = torch.full_like(ref, float("nan"))                     # NaN until written
    ws, ex = aclnnIncreFlashAttentionV4GetWorkspaceSize(q, ks, vs, None, None, None, None, None, None, None, None,
                                                        None, None, None, None, n, 0.2, "BNSD", 0, 0, 1, out)
    assert aclnnIncreFlashAttentionV4(None, ws, ex) == ACL_SUCCESS
    assert torch.equal(out, ref)


# ---------------------------------------------------------------------------------------------- phase semantics
def _small():
    g = gen(510)
    q, k, v = randn((1, 2, 1, 16), g), randn((1, 2, 8, 16), g), randn((1, 2, 8, 16), g)
    out = torch.full((1, 2, 1, 16), 7.0, dtype=F16)
    return q, k, v, out


def test_phase1_plans_without_computing(monkeypatch):
    calls = []
    for b in registry.backends():                     # spy on whichever backends are registered
        monkeypatch.setattr(b, "run", lambda p, real=b.run: calls.append(1) or real(p))
    q, k, v, out = _small()
    lse = torch.full((1, 2, 1, 1), 5.0)
    ws, ex = aclnnFusedInferAttentionScoreV2GetWorkspaceSize(*v2_args(q, [k], [v], out, lse, num_heads=2,
                                                                      lse_flag=True))
    assert ws == 0 and isinstance(ex, aclnn.AclOpExecutor)
    assert calls == [] and torch.all(out == 7.0) and torch.all(lse == 5.0)
    assert aclnnFusedInferAttentionScoreV2(None, ws, ex) == ACL_SUCCESS
    assert calls == [1]
    ref_out, ref_lse = fia.npu_fused_infer_attention_score(q, k, v, num_heads=2, input_layout="BNSD",
                                                           softmax_lse_flag=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_phase2_reads_tensor_data_at_run_time():
    """The executor holds the caller's tensors (device addresses), not copies: data written between the
    phases is what phase 2 computes with."""
    q, k, v, out = _small()
    ws, ex = aclnnFusedInferAttentionScoreV2GetWorkspaceSize(*v2_args(q, [k], [v], out, num_heads=2))
    v.fill_(0.5)
    aclnnFusedInferAttentionScoreV2(None, ws, ex)
    assert torch.all(out == 0.5)


def test_executor_runs_once():
    q, k, v, out = _small()
    ws, ex = aclnnFusedInferAttentionScoreV2GetWorkspaceSize(*v2_args(q, [k], [v], out, num_heads=2))
    assert aclnnFusedInferAttentionScoreV2(None, ws, ex) == ACL_SUCCESS
    with pytest.raises(fia.FiaInputError, match="executor: .*runs once") as e:
        aclnnFusedInferAttentionScoreV2(None, ws, ex)
    assert e.value.status == 161002


def test_executor_of_another_op_or_not_an_executor():
    q, k, v, out = _small()
    ws, ex = aclnnFusedInferAttentionScoreV2GetWorkspaceSize(*v2_args(q, [k], [v], out, num_heads=2))
    with pytest.raises(fia.FiaInputError, match="executor: expected an executor of aclnnFusedInferAttentionScoreV4"):
        aclnnFusedInferAttentionScoreV4(None, ws, ex)
    with pytest.raises(fia.FiaInputError, match="executor") as e:
        aclnnFusedInferAttentionScoreV2(None, 0, object())
    assert e.value.status == 161002
    assert aclnnFusedInferAttentionScoreV2(None, ws, ex) == ACL_SUCCESS     # still unused: runs


def test_lse_left_as_passed_when_flag_false():
    q, k, v, out = _small()
    lse = torch.full((3,), 9.0)                      # any tensor: not validated, not written
    ws, ex = aclnnFusedInferAttentionScoreV2GetWorkspaceSize(*v2_args(q, [k], [v], out, lse, num_heads=2))
    aclnnFusedInferAttentionScoreV2(None, ws, ex)
    assert torch.equal(lse, torch.full((3,), 9.0)) and ex.softmaxLse is lse


# ---------------------------------------------------------------------------------------------- status codes
@pytest.mark.parametrize("missing", [0, 1, 2, 37], ids=["query", "key", "value", "attentionOut"])
def test_161001_required_tensor_is_none(missing):
    q, k, v, out = _small()
    args = v2_args(q, [k], [v], out, num_heads=2)
    name = {0: "query", 1: "key", 2: "value", 37: "attentionOut"}[missing]
    assert len(args) == 39
    args[missing] = None
    with pytest.raises(fia.FiaInputError, match=f"^{name}: ") as e:
        aclnnFusedInferAttentionScoreV2GetWorkspaceSize(*args)
    assert e.value.status == 161001


def test_161001_ifa_attention_out_none():
    q, k, v, _ = _small()
    with pytest.raises(fia.FiaInputError) as e:
        aclnnIncreFlashAttentionV4GetWorkspaceSize(q, [k], [v], *[None] * 12, 2, 1.0, "BNSD", 0, 0, 1, None)
    assert e.value.status == 161001 and e.value.argument == "attentionOut"


def test_161001_lse_none_with_flag():
    q, k, v, out = _small()
    with pytest.raises(fia.FiaInputError, match="softmaxLse: .*softmaxLseFlag is true") as e:
        aclnnFusedInferAttentionScoreV2GetWorkspaceSize(*v2_args(q, [k], [v], out, None, num_heads=2,
                                                                 lse_flag=True))
    assert e.value.status == 161001


@pytest.mark.parametrize("bad", ["shape", "dtype", "layout_out"])
def test_161002_wrong_attention_out_rejected_in_phase1(bad):
    q, k, v, out = _small()
    layout = "BNSD"
    if bad == "shape":
        out = torch.empty(1, 2, 1, 8, dtype=F16)
    elif bad == "dtype":
        out = torch.empty(1, 2, 1, 16, dtype=torch.float32)
    else:   # BSH query -> BSH output (1, 1, 32); a BNSD-shaped output is rejected
        q, k, v = to_layout(q, "BSH"), to_layout(k, "BSH"), to_layout(v, "BSH")
        layout = "BSH"
    with pytest.raises(fia.FiaInputError, match="attentionOut: expected a (float16 )?tensor") as e:
        aclnnFusedInferAttentionScoreV2GetWorkspaceSize(*v2_args(q, [k], [v], out, num_heads=2, layout=layout))
    assert e.value.status == 161002 and e.value.argument == "attentionOut"
    assert "(1, 1, 32)" in str(e.value) or "(1, 2, 1, 16)" in str(e.value)


def test_161002_wrong_lse_shape():
    q, k, v, out = _small()
    with pytest.raises(fia.FiaInputError, match=r"softmaxLse: expected a float32 tensor of shape \(1, 2, 1, 1\)"):
        aclnnFusedInferAttentionScoreV2GetWorkspaceSize(*v2_args(q, [k], [v], out, torch.empty(1, 2, 1),
                                                                 num_heads=2, lse_flag=True))


def test_161002_invalid_argument_named_as_in_the_prototype():
    q, k, v, out = _small()
    with pytest.raises(fia.FiaInputError, match="^numHeads: ") as e:
        aclnnFusedInferAttentionScoreV2GetWorkspaceSize(*v2_args(q, [k], [v], out, num_heads=3))
    assert e.value.status == 161002 and e.value.argument == "numHeads"
    with pytest.raises(fia.FiaInputError, match="^attenMaskOptional: .*dtype") as e:
        aclnnFusedInferAttentionScoreV2GetWorkspaceSize(
            *v2_args(q, [k], [v], out, num_heads=2, attenMaskOptional=torch.zeros(1, 8, dtype=torch.float32)))
    assert e.value.status == 161002
    with pytest.raises(fia.FiaInputError, match="^attenMask: .*dtype") as e:          # IFA names
        aclnnIncreFlashAttentionV4GetWorkspaceSize(q, [k], [v], None, torch.zeros(1, 8), *[None] * 10, 2, 1.0,
                                                   "BNSD", 0, 0, 1, out)
    assert e.value.argument == "attenMask"
    with pytest.raises(fia.FiaInputError, match="^actualSeqLengths: ") as e:          # IFA: KV lengths
        aclnnIncreFlashAttentionV4GetWorkspaceSize(q, [k], [v], None, None, [99], *[None] * 9, 2, 1.0,
                                                   "BNSD", 0, 0, 1, out)
    with pytest.raises(fia.FiaInputError, match="^query: .*decode only") as e:         # IFA: Q_S must be 1
        aclnnIncreFlashAttentionV4GetWorkspaceSize(torch.cat([q, q], 2), [k], [v], *[None] * 12, 2, 1.0,
                                                   "BNSD", 0, 0, 1, out)


def test_161002_valid_but_unsupported():
    """Valid input no backend runs (here: tensors on the meta device) -> FiaUnsupportedError, 161002."""
    q, k, v, out = (t.to("meta") for t in _small())
    with pytest.raises(fia.FiaUnsupportedError) as e:
        aclnnFusedInferAttentionScoreV2GetWorkspaceSize(*v2_args(q, [k], [v], out, num_heads=2))
    assert e.value.status == 161002


def test_361001_computation_fails(monkeypatch):
    """A backend fails while computing (e.g. out of memory): FiaRuntimeError, status 361001, cause chained."""
    q, k, v, out = _small()
    ws, ex = aclnnFusedInferAttentionScoreV2GetWorkspaceSize(*v2_args(q, [k], [v], out, num_heads=2))

    def boom(p):
        raise MemoryError("simulated allocation failure")
    monkeypatch.setattr(ex.backend, "run", boom)
    with pytest.raises(fia.FiaRuntimeError) as e:
        aclnnFusedInferAttentionScoreV2(None, ws, ex)
    assert e.value.status == 361001 and isinstance(e.value.__cause__, MemoryError)
    assert "aclnnFusedInferAttentionScoreV2: the computation failed (MemoryError" in str(e.value)
    assert torch.all(out == 7.0)                      # nothing written


def test_361001_storage_released_between_phases():
    """The key's storage is released between the phases: the computation itself fails (reference backend:
    it re-slices its inputs, and PyTorch bounds-checks every view)."""
    q, k, v, out = _small()
    with fia.use_backend("reference"):
        ws, ex = aclnnFusedInferAttentionScoreV2GetWorkspaceSize(*v2_args(q, [k], [v], out, num_heads=2))
    k.untyped_storage().resize_(0)
    with pytest.raises(fia.FiaRuntimeError) as e:
        aclnnFusedInferAttentionScoreV2(None, ws, ex)
    assert e.value.status == 361001 and e.value.__cause__ is not None


def test_workspace_size_checked():
    q, k, v, out = _small()
    ws, ex = aclnnFusedInferAttentionScoreV2GetWorkspaceSize(*v2_args(q, [k], [v], out, num_heads=2))
    with pytest.raises(fia.FiaInputError, match="workspaceSize") as e:
        aclnnFusedInferAttentionScoreV2(None, -1, ex)
    assert e.value.status == 161002


def test_name_tables_follow_the_prototypes():
    import inspect
    for op, fn, n_opt in (("aclnnFusedInferAttentionScoreV2", aclnnFusedInferAttentionScoreV2GetWorkspaceSize, 21),
                          ("aclnnFusedInferAttentionScoreV4", aclnnFusedInferAttentionScoreV4GetWorkspaceSize, 25),
                          ("aclnnIncreFlashAttentionV4", aclnnIncreFlashAttentionV4GetWorkspaceSize, 12)):
        params = list(inspect.signature(fn).parameters)
        assert params[:-2 if op != "aclnnIncreFlashAttentionV4" else -1] == list(aclnn.names(op))
        assert params.index("numHeads") - 3 == n_opt
    assert list(inspect.signature(aclnnFusedInferAttentionScoreV4GetWorkspaceSize).parameters)[-3:] == [
        "queryQuantMode", "attentionOut", "softmaxLse"]
