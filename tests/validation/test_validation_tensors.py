"""Input validation (SPEC 14), part 1: required tensors, dtypes, ranks, layouts, head counts, limits,
key/value shapes, and the strict/portable split (SPEC 1.4).

Every invalid case must raise fia.FiaInputError with the documented status (161001 for a None
query/key/value, 161002 otherwise) and a message that names the torch_npu argument.
"""
from __future__ import annotations

import pytest
import torch

import fia
from _validation_util import (BASES, BF16, F16, F32, NULLPTR, assert_input_error, case, check_case,
                              params, run_ok, t, zmask)


# --- positive controls: every base call used by the invalid cases works ---------------------------------
@pytest.mark.parametrize("base", sorted(BASES))
def test_base_call_is_valid(base):
    call = BASES[base]()
    q = call["query"]
    out = run_ok(call)
    assert isinstance(out, torch.Tensor)
    assert out.shape == q.shape
    assert out.dtype == q.dtype
    assert torch.isfinite(out.float()).all()


# --- required tensors (161001) ----------------------------------------------------------------------------
NULL_CASES = [
    case(f"{api}-{name}-None", base, name, status=NULLPTR, **{name: None})
    for api, base in (("fused", "prefill_bnsd"), ("fused-decode", "decode_bnsd"), ("incre", "incre_bsh"),
                      ("prompt", "prompt_bsh"))
    for name in ("query", "key", "value")
]


@pytest.mark.parametrize("c", params(NULL_CASES))
def test_required_tensor_none(c):
    check_case(c)


# --- dtypes -------------------------------------------------------------------------------------------
def _all(dtype):
    return dict(query=lambda b: b["query"].to(dtype), key=lambda b: b["key"].to(dtype),
                value=lambda b: b["value"].to(dtype))


DTYPE_CASES = [
    # query: fp16 / bf16 (int8 only on the quantization paths, out of scope here)
    case("query-float32-strict", "prefill_bnsd", "query", **_all(F32)),
    case("query-float32-strict-decode", "decode_bnsd", "query", **_all(F32)),
    case("query-float64-strict", "prefill_bnsd", "query", **_all(torch.float64)),
    case("query-float32-incre", "incre_bsh", "query", **_all(F32)),
    case("query-float32-prompt", "prompt_bsh", "query", **_all(F32)),
    case("query-int64", "prefill_bnsd", "query", query=lambda b: b["query"].to(torch.int64)),
    case("query-int32", "prefill_bnsd", "query", query=lambda b: b["query"].to(torch.int32)),
    case("query-bool", "prefill_bnsd", "query", query=lambda b: b["query"] > 0),
    case("query-not-a-tensor", "prefill_bnsd", "query", query=lambda b: b["query"].tolist()),
    # key/value must match the query dtype (or be int8/int4 on the antiquant path)
    case("key-bf16-query-fp16", "prefill_bnsd", "key", key=lambda b: b["key"].to(BF16),
         value=lambda b: b["value"].to(BF16)),
    case("key-fp16-query-bf16", "prefill_bnsd_bf16", "key", key=lambda b: b["key"].to(F16),
         value=lambda b: b["value"].to(F16)),
    case("key-float32-query-fp16", "prefill_bnsd", "key", key=lambda b: b["key"].to(F32),
         value=lambda b: b["value"].to(F32)),
    case("value-bf16-key-fp16", "prefill_bnsd", ("value", "key"), value=lambda b: b["value"].to(BF16)),
    case("value-bf16-key-fp16-decode", "decode_bnsd", ("value", "key"), value=lambda b: b["value"].to(BF16)),
    case("key-int64", "prefill_bnsd", "key", key=lambda b: b["key"].to(torch.int64),
         value=lambda b: b["value"].to(torch.int64)),
    # atten_mask: bool, int8, uint8 only
    case("mask-float32", "prefill_mask", "atten_mask", atten_mask=zmask(4, 6, dtype=F32)),
    case("mask-int32", "prefill_mask", "atten_mask", atten_mask=zmask(4, 6, dtype=torch.int32)),
    case("mask-int64", "prefill_mask", "atten_mask", atten_mask=zmask(4, 6, dtype=torch.int64)),
    case("mask-float32-decode", "decode_mask", "atten_mask", atten_mask=zmask(2, 1, 1, 6, dtype=F32)),
    # SPEC 6: a float16 (legacy) mask together with inner_precise bit 1 is an error
    case("mask-float16-with-row-invalid", "prefill_mask", ("atten_mask", "inner_precise"),
         atten_mask=zmask(4, 6, dtype=F16), inner_precise=2),
    # pse_shift: the query dtype
    case("pse-float32-query-fp16", "prefill_pse", "pse_shift", pse_shift=lambda b: b["pse_shift"].float()),
    case("pse-fp16-query-bf16", "prefill_pse", "pse_shift",
         query=lambda b: b["query"].to(BF16), key=lambda b: b["key"].to(BF16),
         value=lambda b: b["value"].to(BF16)),
    case("pse-bf16-query-fp16-decode", "decode_pse", "pse_shift",
         pse_shift=lambda b: b["pse_shift"].to(BF16)),
]


@pytest.mark.parametrize("c", params(DTYPE_CASES))
def test_dtype(c):
    check_case(c)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.uint8], ids=str)
@pytest.mark.parametrize("base,shape", [("prefill_mask", (4, 6)), ("decode_mask", (2, 1, 1, 6))])
def test_mask_dtype_accepted(dtype, base, shape):
    call = BASES[base]()
    call["atten_mask"] = zmask(*shape, dtype=dtype)
    run_ok(call)


# --- ranks per layout; unknown layouts ------------------------------------------------------------
RANK_CASES = [
    case("BNSD-query-3d", "prefill_bnsd", "query", query=lambda b: b["query"].reshape(2, 8, 16)),
    case("BNSD-key-3d", "prefill_bnsd", "key", key=lambda b: b["key"].reshape(2, 12, 16),
         value=lambda b: b["value"].reshape(2, 12, 16)),
    case("BNSD-value-3d", "prefill_bnsd", "value", value=lambda b: b["value"].reshape(2, 12, 16)),
    case("BSH-query-4d", "prefill_bsh", "query", query=lambda b: b["query"].reshape(2, 4, 2, 16)),
    case("BSH-key-4d", "prefill_bsh", "key", key=lambda b: b["key"].reshape(2, 6, 2, 16),
         value=lambda b: b["value"].reshape(2, 6, 2, 16)),
    case("BSND-query-5d", "prefill_bsnd", "query", query=lambda b: b["query"].reshape(2, 4, 2, 4, 4)),
    case("TND-query-4d", "tnd", "query", query=lambda b: b["query"].reshape(1, 6, 2, 128)),
    case("query-2d", "prefill_bsh", "query", query=lambda b: b["query"].reshape(8, 32)),
    case("incre-BSH-query-4d", "incre_bsh", "query", query=lambda b: b["query"].reshape(2, 1, 2, 16)),
    case("prompt-BSH-query-4d", "prompt_bsh", "query", query=lambda b: b["query"].reshape(2, 4, 2, 16)),
]


@pytest.mark.parametrize("c", params(RANK_CASES))
def test_rank(c):
    check_case(c)


LAYOUT_CASES = [
    case("layout-unknown", "prefill_bnsd", "input_layout", input_layout="XYZ"),
    case("layout-SBH", "prefill_bsh", "input_layout", input_layout="SBH"),
    case("layout-empty", "prefill_bsh", "input_layout", input_layout=""),
    case("layout-not-a-string", "prefill_bsh", "input_layout", input_layout=3),
    # BNSD_BSND needs Q_S > 1 (FusedInferAttentionScoreV2 inputLayout; V4: Q_S=1 -> BSH/BSND/BNSD)
    case("layout-BNSD_BSND-decode", "decode_bnsd", "input_layout", input_layout="BNSD_BSND"),
    # npu_incre_flash_attention: BSH, BNSD, BSND only
    case("incre-layout-TND", "incre_bsh", "input_layout", input_layout="TND"),
    case("incre-layout-unknown", "incre_bsh", "input_layout", input_layout="XYZ"),
    case("prompt-layout-unknown", "prompt_bsh", "input_layout", input_layout="XYZ"),
]


@pytest.mark.parametrize("c", params(LAYOUT_CASES))
def test_input_layout(c):
    check_case(c)


@pytest.mark.parametrize("layout,qshape,kshape", [
    ("BSH", (2, 4, 32), (2, 6, 32)),
    ("BSND", (2, 4, 2, 16), (2, 6, 2, 16)),
    ("BNSD", (2, 2, 4, 16), (2, 2, 6, 16)),
    ("BNSD_BSND", (2, 2, 4, 16), (2, 2, 6, 16)),
])
def test_layouts_accepted(layout, qshape, kshape):
    out, _ = fia.npu_fused_infer_attention_score(t(*qshape), t(*kshape), t(*kshape), num_heads=2,
                                                 input_layout=layout)
    expected = (2, 4, 2, 16) if layout == "BNSD_BSND" else qshape
    assert tuple(out.shape) == expected


# --- num_heads / num_key_value_heads ----------------------------------------------------------------------
HEAD_CASES = [
    case("num_heads-ne-query-N", "prefill_bnsd", "num_heads", num_heads=1),
    case("num_heads-ne-query-N-BSND", "prefill_bsnd", "num_heads", num_heads=4),
    case("num_heads-ne-query-N-decode", "decode_bnsd", "num_heads", num_heads=4),
    case("num_heads-not-dividing-H-BSH", "prefill_bsh", "num_heads", num_heads=3),
    case("num_heads-zero", "prefill_bnsd", "num_heads", num_heads=0),
    case("num_heads-negative", "prefill_bnsd", "num_heads", num_heads=-2),
    case("num_heads-not-int", "prefill_bnsd", "num_heads", num_heads="2"),
    case("num_heads-zero-BSH", "prefill_bsh", "num_heads", num_heads=0),
    case("incre-num_heads-not-dividing-H", "incre_bsh", "num_heads", num_heads=3),
    case("prompt-num_heads-not-dividing-H", "prompt_bsh", "num_heads", num_heads=3),
    case("num_kv_heads-ne-key-N", "prefill_gqa", "num_key_value_heads", num_key_value_heads=1),
    case("num_kv_heads-default-but-key-N-differs", "prefill_gqa", ("num_key_value_heads", "key"),
         num_key_value_heads=0),
    case("num_kv_heads-ne-key-N-decode", "decode_bnsd", "num_key_value_heads", num_key_value_heads=1),
    case("num_kv_heads-negative", "prefill_gqa", "num_key_value_heads", num_key_value_heads=-1),
    case("num_heads-not-multiple-of-kv-heads", "prefill_gqa", ("num_key_value_heads", "num_heads"),
         query=t(2, 3, 4, 16), num_heads=3),
    case("BSH-kv-heads-ne-key-H", "prefill_bsh_gqa", ("num_key_value_heads", "key"), num_key_value_heads=2),
    case("BSH-kv-heads-default-key-H-differs", "prefill_bsh_gqa", ("num_key_value_heads", "key"),
         num_key_value_heads=0),
    case("incre-kv-heads-ne-key-N", "incre_bnsd", "num_key_value_heads", num_key_value_heads=1),
    case("num_kv_heads-gt-num_heads", "prefill_bnsd", "num_key_value_heads", key=t(2, 4, 6, 16),
         value=t(2, 4, 6, 16), num_key_value_heads=4),
    case("num_kv_heads-not-int", "prefill_gqa", "num_key_value_heads", num_key_value_heads="2"),
    case("num_heads-bool", "prefill_bnsd", "num_heads", num_heads=True),
    case("BSH-key-H-not-multiple-of-D", "prefill_bsh", ("key", "num_key_value_heads"), key=t(2, 6, 24),
         value=t(2, 6, 24)),
    # G = Q_N / KV_N <= 64
    case("group-65", "prefill_bnsd", ("num_key_value_heads", "num_heads"),
         query=t(1, 65, 2, 16), key=t(1, 1, 3, 16), value=t(1, 1, 3, 16), num_heads=65, num_key_value_heads=1),
    case("group-65-decode", "decode_bnsd", ("num_key_value_heads", "num_heads"),
         query=t(1, 65, 1, 16), key=t(1, 1, 3, 16), value=t(1, 1, 3, 16), num_heads=65, num_key_value_heads=1),
]


@pytest.mark.parametrize("c", params(HEAD_CASES))
def test_heads(c):
    check_case(c)


def test_group_64_accepted():
    out, _ = fia.npu_fused_infer_attention_score(t(1, 64, 2, 16), t(1, 1, 3, 16), t(1, 1, 3, 16), num_heads=64,
                                                 num_key_value_heads=1, input_layout="BNSD")
    assert out.shape == (1, 64, 2, 16)


# --- limits: N <= 256, B <= 65536, D <= 512, D alignment ---------------------------------------------------
def _big_batch(b, qs=1):
    # stride-0 views: B = 65537 without allocating 65537 rows
    q = torch.zeros(1, 1, qs, 16, dtype=F16).expand(b, 1, qs, 16)
    k = torch.zeros(1, 1, 2, 16, dtype=F16).expand(b, 1, 2, 16)
    return q, k


LIMIT_CASES = [
    case("N-257", "prefill_bnsd", ("num_heads", "query"),
         query=t(1, 257, 2, 16), key=t(1, 257, 2, 16), value=t(1, 257, 2, 16), num_heads=257),
    case("N-257-decode", "decode_bnsd", ("num_heads", "query"),
         query=t(1, 257, 1, 16), key=t(1, 257, 2, 16), value=t(1, 257, 2, 16), num_heads=257),
    case("B-65537-decode", "decode_bnsd", ("query", "key"),
         query=_big_batch(65537)[0], key=_big_batch(65537)[1], value=_big_batch(65537)[1], num_heads=1),
    case("B-65537-prefill", "prefill_bnsd", ("query", "key"),
         query=_big_batch(65537, 2)[0], key=_big_batch(65537)[1], value=_big_batch(65537)[1], num_heads=1),
    case("D-528", "prefill_bnsd", ("query", "key"),
         query=t(1, 1, 2, 528), key=t(1, 1, 2, 528), value=t(1, 1, 2, 528), num_heads=1),
    case("D-528-decode", "decode_bnsd", ("query", "key"),
         query=t(1, 1, 1, 528), key=t(1, 1, 2, 528), value=t(1, 1, 2, 528), num_heads=1),
    # D alignment: 16 for fp16/bf16 prefill (FusedInferAttentionScoreV4, Q_S > 1, D轴限制)
    case("D-12-prefill-fp16", "prefill_bnsd", ("query", "key"),
         query=t(2, 2, 4, 12), key=t(2, 2, 6, 12), value=t(2, 2, 6, 12)),
    case("D-24-prefill-bf16", "prefill_bnsd_bf16", ("query", "key"),
         query=t(2, 2, 4, 24, dtype=BF16), key=t(2, 2, 6, 24, dtype=BF16), value=t(2, 2, 6, 24, dtype=BF16)),
    case("D-8-prefill-BSH", "prefill_bsh", ("query", "key", "num_heads"), num_heads=4),
    case("D-12-prompt", "prompt_bsh", ("query", "key"),
         query=t(2, 4, 24), key=t(2, 6, 24), value=t(2, 6, 24)),
]


@pytest.mark.parametrize("c", params(LIMIT_CASES))
def test_limits(c):
    check_case(c)


def test_limits_at_the_boundary_accepted():
    # N = 256, D = 512: the largest documented values
    out, _ = fia.npu_fused_infer_attention_score(t(1, 256, 2, 16), t(1, 256, 2, 16), t(1, 256, 2, 16),
                                                 num_heads=256, input_layout="BNSD")
    assert out.shape == (1, 256, 2, 16)
    out, _ = fia.npu_fused_infer_attention_score(t(1, 1, 2, 512), t(1, 1, 2, 512), t(1, 1, 2, 512),
                                                 num_heads=1, input_layout="BNSD")
    assert out.shape == (1, 1, 2, 512)


@pytest.mark.case(q_s=1)
def test_decode_unaligned_d_accepted_in_strict():
    # only prefill carries the 16-alignment rule for fp16/bf16 (V4, "当Q_S大于1时", D轴限制)
    out = run_ok(BASES["decode_d24"]())
    assert out.shape == (2, 2, 1, 24)


# --- key/value shapes; query/key batch ---------------------------------------------------------------------
SHAPE_CASES = [
    case("value-S-ne-key-S", "prefill_bnsd", ("value", "key"), value=t(2, 2, 5, 16)),
    case("value-N-ne-key-N", "prefill_gqa", ("value", "key"), value=t(2, 1, 6, 16)),
    case("value-D-ne-key-D-BNSD", "prefill_bnsd", ("value",), value=t(2, 2, 6, 32)),
    case("value-H-ne-key-H-BSH", "prefill_bsh", ("value",), value=t(2, 6, 64)),
    case("value-S-ne-key-S-decode", "decode_bnsd", ("value", "key"), value=t(2, 2, 5, 16)),
    case("key-D-ne-query-D", "prefill_bnsd", ("key",), key=t(2, 2, 6, 32), value=t(2, 2, 6, 32)),
    case("key-batch-ne-query-batch", "prefill_bnsd", ("key", "query"), key=t(3, 2, 6, 16), value=t(3, 2, 6, 16)),
    case("key-batch-1-query-batch-2", "prefill_bnsd", ("key", "query"), key=t(1, 2, 6, 16),
         value=t(1, 2, 6, 16)),
    case("key-batch-ne-query-batch-decode", "decode_bnsd", ("key", "query"),
         key=t(3, 2, 6, 16), value=t(3, 2, 6, 16)),
    case("key-batch-ne-query-batch-BSH", "prefill_bsh", ("key", "query"), key=t(3, 6, 32), value=t(3, 6, 32)),
    case("incre-value-S-ne-key-S", "incre_bsh", ("value", "key"), value=t(2, 5, 32)),
    case("prompt-key-batch-ne-query-batch", "prompt_bsh", ("key", "query"), key=t(3, 6, 32), value=t(3, 6, 32)),
    case("TND-key-D-ne-query-D", "tnd", ("key",), key=t(8, 2, 64, dtype=BF16), value=t(8, 2, 64, dtype=BF16)),
]


@pytest.mark.parametrize("c", params(SHAPE_CASES))
def test_shapes(c):
    check_case(c)


def test_tnd_value_head_dim_may_differ():
    # TND: Q_D = K_D = 192 with V_D = 128 is documented (V4, TND constraints); output D is V_D (SPEC 2).
    out, _ = fia.npu_fused_infer_attention_score(
        t(6, 2, 192, dtype=BF16), t(8, 2, 192, dtype=BF16), t(8, 2, 128, dtype=BF16), num_heads=2,
        input_layout="TND", actual_seq_lengths=[2, 6], actual_seq_lengths_kv=[3, 8], scale=0.1)
    assert out.shape == (6, 2, 128)


# --- strict vs portable (SPEC 1.4) -------------------------------------------------------------------------
def _float_call(dtype):
    b = BASES["prefill_bnsd"]()
    for n in ("query", "key", "value"):
        b[n] = b[n].to(dtype)
    return b


@pytest.mark.parametrize("dtype", [F32, torch.float64], ids=str)
def test_portable_accepts_float_inputs(dtype):
    call = _float_call(dtype)
    with pytest.raises(fia.FiaInputError):
        run_ok(call, "strict")
    out = run_ok(_float_call(dtype), "portable")
    assert out.dtype == dtype and out.shape == (2, 2, 4, 16)


@pytest.mark.case(q_s=1)
def test_portable_accepts_float32_decode():
    b = BASES["decode_bnsd"]()
    for n in ("query", "key", "value"):
        b[n] = b[n].float()
    out = run_ok(b, "portable")
    assert out.dtype == F32


def test_portable_accepts_unaligned_d():
    call = dict(api="fused", query=t(2, 2, 4, 12), key=t(2, 2, 6, 12), value=t(2, 2, 6, 12), num_heads=2,
                input_layout="BNSD")
    with pytest.raises(fia.FiaInputError):
        run_ok(dict(call), "strict")
    out = run_ok(dict(call), "portable")
    assert out.shape == (2, 2, 4, 12)


def test_portable_accepts_larger_limits():
    # N > 256 and D > 512 are hardware limits (SPEC 1.4: "B/N/D limits")
    out = run_ok(dict(api="fused", query=t(1, 257, 2, 16), key=t(1, 257, 2, 16), value=t(1, 257, 2, 16),
                      num_heads=257, input_layout="BNSD"), "portable")
    assert out.shape == (1, 257, 2, 16)
    out = run_ok(dict(api="fused", query=t(1, 1, 2, 528), key=t(1, 1, 2, 528), value=t(1, 1, 2, 528),
                      num_heads=1, input_layout="BNSD"), "portable")
    assert out.shape == (1, 1, 2, 528)


PORTABLE_SEMANTIC_CASES = [
    case("portable-num_heads-ne-query-N", "prefill_bnsd", "num_heads", mode="portable", num_heads=1),
    case("portable-value-S-ne-key-S", "prefill_bnsd", ("value", "key"), mode="portable", value=t(2, 2, 5, 16)),
    case("portable-key-batch", "prefill_bnsd", ("key", "query"), mode="portable",
         key=t(3, 2, 6, 16), value=t(3, 2, 6, 16)),
    case("portable-layout-unknown", "prefill_bnsd", "input_layout", mode="portable", input_layout="XYZ"),
    case("portable-rank", "prefill_bnsd", "query", mode="portable", query=lambda b: b["query"].reshape(2, 8, 16)),
    case("portable-query-None", "prefill_bnsd", "query", status=NULLPTR, mode="portable", query=None),
    case("portable-kv-lengths-gt-S", "prefill_bnsd", "actual_seq_lengths_kv", mode="portable",
         actual_seq_lengths_kv=[7]),
    case("portable-sparse-mode-5", "prefill_mask", "sparse_mode", mode="portable", sparse_mode=5),
    case("portable-inner-precise-decode-2", "decode_bnsd", "inner_precise", mode="portable", inner_precise=2),
    case("portable-pre-next-both-negative", "prefill_mask", ("pre_tokens", "next_tokens"), mode="portable",
         pre_tokens=-1, next_tokens=-1),
    case("portable-TND-lengths-missing", "tnd", "actual_seq_lengths", mode="portable", actual_seq_lengths=None),
    case("portable-TND-last-ne-T", "tnd", "actual_seq_lengths_kv", mode="portable", actual_seq_lengths_kv=[3, 7]),
    case("portable-mask-too-small", "prefill_mask", "atten_mask", mode="portable", atten_mask=zmask(4, 5)),
    case("portable-template-missing", "prefill_bnsd", "atten_mask", mode="portable", sparse_mode=3),
    case("portable-pse-shape", "prefill_pse", "pse_shift", mode="portable", pse_shift=t(2, 2, 4, 5)),
    case("portable-list-count", "tensor_list", "key", mode="portable", key=[t(1, 2, 5, 16)],
         value=[t(1, 2, 5, 16)]),
]


@pytest.mark.parametrize("c", params(PORTABLE_SEMANTIC_CASES))
def test_portable_keeps_semantic_checks(c):
    check_case(c)


# --- scalar attributes: type checks name the caller's spelling ---------------------------------------------
SCALAR_CASES = [
    case("scale-str", "prefill_bnsd", "scale", scale="0.5"),
    case("incre-scale_value-str", "incre_bsh", "scale_value", scale_value="0.5"),
    case("prompt-scale_value-str", "prompt_bsh", "scale_value", scale_value="0.5"),
]


@pytest.mark.parametrize("c", params(SCALAR_CASES))
def test_scalar_attribute_types(c):
    check_case(c)


@pytest.mark.parametrize("arg,value", [("num_heads", "2"), ("sparse_mode", "0"), ("input_layout", "")])
def test_message_shows_received_string_as_a_string(arg, value):
    # SPEC 14: the error says what was received. A string "2" must not read as the integer 2
    # ("num_heads: expected an integer, got 2" is self-contradictory), and an empty layout must be visible.
    call = BASES["prefill_mask"]()
    call[arg] = value
    err = assert_input_error(call, (arg,))
    assert repr(value) in str(err), str(err)
