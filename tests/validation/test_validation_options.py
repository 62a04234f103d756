"""Input validation (SPEC 14), part 2: actual lengths, TND cumulative lists, masks per sparse mode,
sparse_mode range, pre/next tokens, inner_precise, pse_shift, tensor-list KV, the per-API rules of
npu_incre_flash_attention / npu_prompt_flash_attention, and softmax_lse_flag.

Every invalid case must raise fia.FiaInputError (never FiaUnsupportedError: what the documents forbid is
an input error, SPEC 14) with status 161002 and a message that names the torch_npu argument.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fia
from _validation_util import BASES, BF16, F16, F32, case, check_case, params, run_ok, t, template, zmask

PRE_NEXT = ("pre_tokens", "next_tokens")

# --- actual_seq_lengths / actual_seq_lengths_kv (SPEC 4) -------------------------------------------------
LENGTH_CASES = [
    # size rule: length 1, or >= B; anything else is an error
    case("q-lengths-empty", "prefill_bnsd", "actual_seq_lengths", actual_seq_lengths=[]),
    case("kv-lengths-empty", "prefill_bnsd", "actual_seq_lengths_kv", actual_seq_lengths_kv=[]),
    case("q-lengths-2-entries-B3", "prefill_b3", "actual_seq_lengths", actual_seq_lengths=[4, 4]),
    case("kv-lengths-2-entries-B3", "prefill_b3", "actual_seq_lengths_kv", actual_seq_lengths_kv=[6, 6]),
    # values in [0, S]
    case("q-lengths-gt-Q_S", "prefill_bnsd", "actual_seq_lengths", actual_seq_lengths=[5]),
    case("q-lengths-gt-Q_S-second-batch", "prefill_bnsd", "actual_seq_lengths", actual_seq_lengths=[4, 5]),
    case("kv-lengths-gt-KV_S", "prefill_bnsd", "actual_seq_lengths_kv", actual_seq_lengths_kv=[7]),
    case("kv-lengths-gt-KV_S-second-batch", "prefill_bnsd", "actual_seq_lengths_kv",
         actual_seq_lengths_kv=[6, 7]),
    case("kv-lengths-gt-KV_S-decode", "decode_bnsd", "actual_seq_lengths_kv", actual_seq_lengths_kv=[7]),
    case("kv-lengths-gt-KV_S-BSH", "prefill_bsh", "actual_seq_lengths_kv", actual_seq_lengths_kv=[7, 2]),
    case("kv-lengths-gt-own-S-tensor-list", "tensor_list", "actual_seq_lengths_kv",
         actual_seq_lengths_kv=[6, 7]),
    case("q-lengths-negative", "prefill_bnsd", "actual_seq_lengths", actual_seq_lengths=[-1]),
    case("q-lengths-negative-second", "prefill_bnsd", "actual_seq_lengths", actual_seq_lengths=[2, -1]),
    case("kv-lengths-negative", "prefill_bnsd", "actual_seq_lengths_kv", actual_seq_lengths_kv=[-1]),
    case("kv-lengths-negative-decode", "decode_bnsd", "actual_seq_lengths_kv", actual_seq_lengths_kv=[3, -2]),
    # element / container types: integers only
    case("q-lengths-float", "prefill_bnsd", "actual_seq_lengths", actual_seq_lengths=[1.5]),
    case("kv-lengths-float", "prefill_bnsd", "actual_seq_lengths_kv", actual_seq_lengths_kv=[2.5, 3.0]),
    case("q-lengths-str", "prefill_bnsd", "actual_seq_lengths", actual_seq_lengths=["3"]),
    case("kv-lengths-str", "prefill_bnsd", "actual_seq_lengths_kv", actual_seq_lengths_kv="66"),
    case("kv-lengths-nested", "prefill_bnsd", "actual_seq_lengths_kv", actual_seq_lengths_kv=[[3], [4]]),
    case("kv-lengths-float-tensor", "prefill_bnsd", "actual_seq_lengths_kv",
         actual_seq_lengths_kv=torch.tensor([3.0, 4.0])),
    case("kv-lengths-float-ndarray", "prefill_bnsd", "actual_seq_lengths_kv",
         actual_seq_lengths_kv=np.array([3.0, 4.0])),
    # npu_incre_flash_attention: actual_seq_lengths are the KV lengths
    case("incre-lengths-gt-KV_S", "incre_bsh", "actual_seq_lengths", actual_seq_lengths=[7]),
    case("incre-lengths-negative", "incre_bsh", "actual_seq_lengths", actual_seq_lengths=[-1, 3]),
    case("incre-lengths-empty", "incre_bsh", "actual_seq_lengths", actual_seq_lengths=[]),
    case("incre-lengths-float", "incre_bnsd", "actual_seq_lengths", actual_seq_lengths=[2.5]),
    # npu_prompt_flash_attention
    case("prompt-q-lengths-gt-Q_S", "prompt_bsh", "actual_seq_lengths", actual_seq_lengths=[5]),
    case("prompt-kv-lengths-gt-KV_S", "prompt_bsh", "actual_seq_lengths_kv", actual_seq_lengths_kv=[7]),
    case("prompt-q-lengths-negative", "prompt_bsh", "actual_seq_lengths", actual_seq_lengths=[-3]),
]


@pytest.mark.parametrize("c", params(LENGTH_CASES))
def test_actual_seq_lengths(c):
    check_case(c)


@pytest.mark.parametrize("lengths", [
    [4], [4, 6], [2, 6, 1], (3, 6), np.array([3, 6], dtype=np.int64), np.array([3, 6], dtype=np.int32),
    torch.tensor([3, 6], dtype=torch.int64), torch.tensor([3, 6], dtype=torch.int32), [0], [6, 0],
], ids=["len1", "lenB", "len>B", "tuple", "np-int64", "np-int32", "tensor-int64", "tensor-int32", "zero",
        "zero-second"])
def test_kv_lengths_accepted_forms(lengths):
    call = BASES["prefill_bnsd"]()
    call["actual_seq_lengths_kv"] = lengths
    out = run_ok(call)
    assert out.shape == (2, 2, 4, 16)


@pytest.mark.parametrize("lengths", [[4], [4, 3], [1, 4, 3], (2, 3), torch.tensor([2, 4], dtype=torch.int32), [0]],
                         ids=["len1", "lenB", "len>B", "tuple", "tensor-int32", "zero"])
def test_q_lengths_accepted_forms(lengths):
    call = BASES["prefill_bnsd"]()
    call["actual_seq_lengths"] = lengths
    run_ok(call)


@pytest.mark.case(q_s=1)
def test_incre_lengths_accepted():
    call = BASES["incre_bsh"]()
    call["actual_seq_lengths"] = [6, 2]
    run_ok(call)


# --- TND: cumulative lists, required, <= 4096 entries, T <= 1048576 (SPEC 2) -----------------------------
def _huge_t_query():
    # T = 1048577 as a stride-0 view (no 268 MB allocation)
    return torch.zeros(1, 2, 128, dtype=BF16).expand(1048577, 2, 128)


TND_CASES = [
    case("TND-q-lengths-missing", "tnd", "actual_seq_lengths", actual_seq_lengths=None),
    case("TND-kv-lengths-missing", "tnd", "actual_seq_lengths_kv", actual_seq_lengths_kv=None),
    case("TND-q-lengths-decreasing", "tnd_b3", "actual_seq_lengths", actual_seq_lengths=[3, 1, 6]),
    case("TND-kv-lengths-decreasing", "tnd_b3", "actual_seq_lengths_kv", actual_seq_lengths_kv=[6, 3, 9]),
    case("TND-q-last-lt-T", "tnd", "actual_seq_lengths", actual_seq_lengths=[2, 5]),
    case("TND-q-last-gt-T", "tnd", "actual_seq_lengths", actual_seq_lengths=[2, 7]),
    case("TND-q-per-batch-not-cumulative", "tnd", "actual_seq_lengths", actual_seq_lengths=[2, 4]),
    case("TND-kv-last-lt-T", "tnd", "actual_seq_lengths_kv", actual_seq_lengths_kv=[3, 7]),
    case("TND-kv-last-gt-T", "tnd", "actual_seq_lengths_kv", actual_seq_lengths_kv=[3, 9]),
    case("TND-q-negative", "tnd", "actual_seq_lengths", actual_seq_lengths=[-1, 6]),
    case("TND-more-than-4096-entries", "tnd", "actual_seq_lengths",
         actual_seq_lengths=[0] * 4096 + [6], actual_seq_lengths_kv=[0] * 4096 + [8]),
    case("TND-T-gt-1048576", "tnd", ("query", "actual_seq_lengths"),
         query=_huge_t_query(), actual_seq_lengths=[1048577], actual_seq_lengths_kv=[8]),
    # V4, TND constraints (D != 512): bfloat16 only; D = 128 (or Q_D = K_D = 192)
    case("TND-fp16", "tnd", "query", query=lambda b: b["query"].half(), key=lambda b: b["key"].half(),
         value=lambda b: b["value"].half()),
    # V4, TND constraints: sparse mode 0 without mask, or 3 with mask (SPEC 9 also allows 4)
    case("TND-sparse-2", "tnd", ("sparse_mode", "input_layout"), sparse_mode=2,
         atten_mask=template(2048, 2048)),
    # sparse 3 needs act_q <= act_kv per batch (SPEC 15.11 relaxes "<" to "<=")
    case("TND-sparse-3-q-longer-than-kv", "tnd", ("actual_seq_lengths", "sparse_mode"), sparse_mode=3,
         atten_mask=template(2048, 2048), actual_seq_lengths_kv=[1, 8]),
]


@pytest.mark.parametrize("c", params(TND_CASES))
def test_tnd(c):
    check_case(c)


def test_tnd_accepted_variants():
    # zero-length request inside the cumulative list (SPEC 15.11): a repeated value
    call = BASES["tnd"]()
    call.update(actual_seq_lengths=[2, 2, 6], actual_seq_lengths_kv=[3, 3, 8])
    out = run_ok(call)
    assert out.shape == (6, 2, 128)
    # sparse 3 with the template; act_q == act_kv is allowed (SPEC 15.11)
    call = BASES["tnd"]()
    call.update(sparse_mode=3, atten_mask=template(2048, 2048), actual_seq_lengths_kv=[2, 8])
    run_ok(call)
    # tensors for the lengths
    call = BASES["tnd"]()
    call.update(actual_seq_lengths=torch.tensor([2, 6]), actual_seq_lengths_kv=np.array([3, 8]))
    run_ok(call)


# --- atten_mask shape per sparse mode (SPEC 5) ----------------------------------------------------------
MASK_CASES = [
    # sparse 0 / 1: (Q_S, KV_S), (1|B, Q_S, KV_S), (1|B, 1, Q_S, KV_S), possibly larger (padded)
    case("mask-too-few-columns", "prefill_mask", "atten_mask", atten_mask=zmask(4, 5)),
    case("mask-too-few-rows", "prefill_mask", "atten_mask", atten_mask=zmask(3, 6)),
    case("mask-3d-too-few-columns", "prefill_mask", "atten_mask", atten_mask=zmask(2, 4, 5)),
    case("mask-rank-1", "prefill_mask", "atten_mask", atten_mask=zmask(6)),
    case("mask-rank-5", "prefill_mask", "atten_mask", atten_mask=zmask(1, 1, 1, 4, 6)),
    case("mask-batch-3-for-B2", "prefill_mask", "atten_mask", atten_mask=zmask(3, 4, 6)),
    case("mask-4d-batch-3-for-B2", "prefill_mask", "atten_mask", atten_mask=zmask(3, 1, 4, 6)),
    case("mask-4d-head-dim-2", "prefill_mask", "atten_mask", atten_mask=zmask(2, 2, 4, 6)),
    case("mask-BSH-too-small", "prefill_bsh", "atten_mask", atten_mask=zmask(4, 5)),
    case("mask-sparse1-missing", "prefill_bnsd", "atten_mask", sparse_mode=1),
    case("mask-sparse1-too-small", "prefill_mask", "atten_mask", sparse_mode=1, atten_mask=zmask(4, 5)),
    # sparse 2 / 3 / 4: the template must be present and (2048,2048), (1,2048,2048) or (1,1,2048,2048)
    *[case(f"mask-sparse{m}-missing", "prefill_bnsd", "atten_mask", sparse_mode=m) for m in (2, 3, 4)],
    *[case(f"mask-sparse{m}-full-size-not-template", "prefill_mask", "atten_mask", sparse_mode=m)
      for m in (2, 3, 4)],
    case("mask-sparse2-2048x2047", "prefill_sparse2", "atten_mask", atten_mask=zmask(2048, 2047)),
    case("mask-sparse3-4096x4096", "prefill_sparse2", "atten_mask", sparse_mode=3, atten_mask=zmask(4096, 4096)),
    case("mask-sparse2-batch-2", "prefill_sparse2", "atten_mask", atten_mask=zmask(2, 2048, 2048)),
    case("mask-sparse4-4d-head-2", "prefill_sparse4", "atten_mask", atten_mask=zmask(1, 2, 2048, 2048)),
    case("mask-sparse3-rank-1", "prefill_sparse2", "atten_mask", sparse_mode=3, atten_mask=zmask(2048)),
    # Q_S == 1: (B, KV_S), (B, 1, KV_S), (B, 1, 1, KV_S)
    case("mask-decode-too-few-columns", "decode_mask", "atten_mask", atten_mask=zmask(2, 1, 1, 5)),
    case("mask-decode-2d-too-few-columns", "decode_mask", "atten_mask", atten_mask=zmask(2, 5)),
    case("mask-decode-batch-3", "decode_mask", "atten_mask", atten_mask=zmask(3, 1, 1, 6)),
    case("mask-decode-2d-batch-3", "decode_mask", "atten_mask", atten_mask=zmask(3, 6)),
    case("mask-decode-head-dim-2", "decode_mask", "atten_mask", atten_mask=zmask(2, 2, 1, 6)),
    case("mask-decode-rank-1", "decode_mask", "atten_mask", atten_mask=zmask(6)),
    case("incre-mask-too-small", "incre_bsh", "atten_mask", atten_mask=zmask(2, 1, 1, 5)),
    case("prompt-mask-too-small", "prompt_mask", "atten_mask", atten_mask=zmask(4, 5)),
]


@pytest.mark.parametrize("c", params(MASK_CASES))
def test_mask_shape(c):
    check_case(c)


@pytest.mark.parametrize("shape", [(4, 6), (1, 4, 6), (2, 4, 6), (1, 1, 4, 6), (2, 1, 4, 6), (8, 16),
                                   (2, 1, 8, 16)], ids=str)
@pytest.mark.parametrize("sparse_mode", [0, 1])
def test_mask_shapes_accepted_prefill(shape, sparse_mode):
    call = BASES["prefill_mask"]()
    call.update(atten_mask=zmask(*shape), sparse_mode=sparse_mode)
    run_ok(call)


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("shape", [(2, 6), (2, 1, 6), (2, 1, 1, 6), (2, 1, 1, 16)], ids=str)
def test_mask_shapes_accepted_decode(shape):
    call = BASES["decode_mask"]()
    call["atten_mask"] = zmask(*shape)
    run_ok(call)


@pytest.mark.parametrize("shape", [(2048, 2048), (1, 2048, 2048), (1, 1, 2048, 2048)], ids=str)
@pytest.mark.parametrize("sparse_mode", [2, 3, 4])
def test_template_shapes_accepted(shape, sparse_mode):
    call = BASES["prefill_sparse4"]()
    call.update(atten_mask=template(*shape), sparse_mode=sparse_mode)
    run_ok(call)


@pytest.mark.case(q_s=1)
def test_decode_with_causal_sparse_mode_and_template_accepted():
    # SPEC 15.11: decode (Q_S = 1, no rope) with sparse 2..4 and the template mask is accepted
    call = BASES["decode_bnsd"]()
    call.update(sparse_mode=3, atten_mask=template(2048, 2048))
    run_ok(call)


# --- sparse_mode range (SPEC 5, 14: 5..8 and others are input errors, not "unsupported") ------------------
SPARSE_CASES = [
    *[case(f"sparse_mode-{m}", "prefill_mask", "sparse_mode", sparse_mode=m) for m in (-1, 5, 6, 7, 8, 9, 10, 15)],
    case("sparse_mode-5-no-mask", "prefill_bnsd", "sparse_mode", sparse_mode=5),
    case("sparse_mode-5-BSH", "prefill_bsh", "sparse_mode", sparse_mode=5),
    case("sparse_mode-str", "prefill_mask", "sparse_mode", sparse_mode="0"),
    case("sparse_mode-float", "prefill_mask", "sparse_mode", sparse_mode=1.5),
    *[case(f"prompt-sparse_mode-{m}", "prompt_mask", "sparse_mode", sparse_mode=m) for m in (-1, 5, 8, 9, 15)],
]


@pytest.mark.parametrize("c", params(SPARSE_CASES))
def test_sparse_mode(c):
    check_case(c)


@pytest.mark.parametrize("mode", [10, 11])
def test_prompt_high_precision_modes_10_11(mode):
    # npu_prompt_flash_attention: sparse_mode 10..14 = high precision with sparse_mode - 10 (SPEC 1.1)
    call = BASES["prompt_mask"]()
    ref = dict(call)
    call["sparse_mode"] = mode
    ref["sparse_mode"] = mode - 10
    out = run_ok(call)
    assert out.shape == (2, 4, 32)
    torch.testing.assert_close(out.float(), run_ok(ref).float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("mode", [12, 13, 14])
def test_prompt_high_precision_modes_12_14(mode):
    call = BASES["prompt_bsh"]()
    call.update(sparse_mode=mode, atten_mask=template(2048, 2048), pre_tokens=3, next_tokens=1)
    ref = dict(call)
    ref["sparse_mode"] = mode - 10
    torch.testing.assert_close(run_ok(call).float(), run_ok(ref).float(), atol=2e-3, rtol=2e-3)


# --- pre_tokens / next_tokens (SPEC 5, 14) -----------------------------------------------------------------
# prefill_mask: Q_S = 4, KV_S = 6, sparse 0 with a mask, so pre/next are in force.
PRE_NEXT_CASES = [
    case("both-negative", "prefill_mask", PRE_NEXT, pre_tokens=-1, next_tokens=-1),
    case("minus-next-gt-pre", "prefill_mask", PRE_NEXT, pre_tokens=1, next_tokens=-2),
    case("minus-next-gt-negative-pre", "prefill_mask", PRE_NEXT, pre_tokens=-3, next_tokens=2),
    case("mode0-abs-next-ge-Q_S", "prefill_mask", PRE_NEXT, pre_tokens=10, next_tokens=-4),
    case("mode0-abs-pre-ge-KV_S", "prefill_mask", PRE_NEXT, pre_tokens=-6, next_tokens=10),
    case("band-both-negative", "prefill_sparse4", PRE_NEXT, pre_tokens=-1, next_tokens=-1),
    case("band-minus-next-gt-pre", "prefill_sparse4", PRE_NEXT, pre_tokens=1, next_tokens=-3),
    case("pre_tokens-str", "prefill_mask", "pre_tokens", pre_tokens="1"),
    case("next_tokens-float", "prefill_mask", "next_tokens", next_tokens=1.5),
    # npu_prompt_flash_attention: next_tokens defaults to 0, so pre_tokens = -1 gives -next > pre
    case("prompt-pre-negative-next-default", "prompt_mask", PRE_NEXT, pre_tokens=-1),
    case("prompt-both-negative", "prompt_mask", PRE_NEXT, pre_tokens=-2, next_tokens=-1),
]


@pytest.mark.parametrize("c", params(PRE_NEXT_CASES))
def test_pre_next_tokens(c):
    check_case(c)


@pytest.mark.parametrize("base,pre,nxt", [
    ("prefill_mask", 2, -1),            # valid band with a negative next
    ("prefill_mask", -1, 3),            # valid band with a negative pre
    ("prefill_mask", 0, 0),             # the diagonal only
    ("prefill_mask", 2 ** 40, 2 ** 40),  # above 214748647: clamped (SPEC 5)
    ("prefill_sparse4", 2, 0),
    ("prefill_bnsd", -1, -1),           # sparse 0 without mask: pre/next ignored (V2/V4 sparseMode 0)
    ("decode_mask", -1, -1),            # Q_S = 1 without rope: pre/next ignored (SPEC 5)
], ids=["band-neg-next", "band-neg-pre", "diagonal", "huge-clamped", "band-mode4", "mode0-no-mask-ignored",
        "decode-ignored"])
def test_pre_next_accepted(base, pre, nxt):
    call = BASES[base]()
    call.update(pre_tokens=pre, next_tokens=nxt)
    run_ok(call)


@pytest.mark.parametrize("base,mode", [("prefill_mask", 1), ("prefill_sparse2", 2), ("prefill_sparse2", 3)])
def test_pre_next_ignored_in_modes_1_2_3(base, mode):
    # V2/V4: "sparseMode = 1、2、3的场景忽略入参preTokens、nextTokens并按照相关规则赋值"
    call = BASES[base]()
    call.update(sparse_mode=mode, pre_tokens=-1, next_tokens=-1)
    run_ok(call)


# --- inner_precise (SPEC 6) ---------------------------------------------------------------------------------
INNER_CASES = [
    *[case(f"decode-{v}", "decode_bnsd", "inner_precise", inner_precise=v) for v in (2, 3, 4, -1)],
    *[case(f"prefill-{v}", "prefill_bnsd", "inner_precise", inner_precise=v) for v in (4, 5, -1)],
    *[case(f"incre-{v}", "incre_bsh", "inner_precise", inner_precise=v) for v in (2, 3, -1)],
    case("inner_precise-str", "prefill_bnsd", "inner_precise", inner_precise="0"),
    case("inner_precise-float", "decode_bnsd", "inner_precise", inner_precise=0.5),
]


@pytest.mark.parametrize("c", params(INNER_CASES))
def test_inner_precise(c):
    check_case(c)


@pytest.mark.parametrize("base,value", [("decode_bnsd", 0), ("decode_bnsd", 1), ("prefill_mask", 0),
                                        ("prefill_mask", 1), ("prefill_mask", 2), ("prefill_mask", 3),
                                        ("incre_bsh", 0), ("incre_bsh", 1)])
def test_inner_precise_accepted(base, value):
    call = BASES[base]()
    call["inner_precise"] = value
    run_ok(call)


# --- pse_shift (SPEC 3) ---------------------------------------------------------------------------------------
PSE_CASES = [
    case("pse-batch-3-for-B2", "prefill_pse", "pse_shift", pse_shift=t(3, 2, 4, 6)),
    case("pse-heads-1-for-N2", "prefill_pse", "pse_shift", pse_shift=t(2, 1, 4, 6)),
    case("pse-heads-3-for-N2", "prefill_pse", "pse_shift", pse_shift=t(2, 3, 4, 6)),
    case("pse-heads-KV_N-under-GQA", "prefill_gqa", "pse_shift", pse_shift=t(2, 2, 4, 6)),
    case("pse-Q_S-too-small", "prefill_pse", "pse_shift", pse_shift=t(2, 2, 3, 6)),
    case("pse-KV_S-too-small", "prefill_pse", "pse_shift", pse_shift=t(2, 2, 4, 5)),
    case("pse-rank-3", "prefill_pse", "pse_shift", pse_shift=t(2, 4, 6)),
    case("pse-rank-5", "prefill_pse", "pse_shift", pse_shift=t(2, 2, 4, 6, 1)),
    case("pse-decode-KV_S-too-small", "decode_pse", "pse_shift", pse_shift=t(2, 2, 1, 5)),
    case("pse-decode-batch-3", "decode_pse", "pse_shift", pse_shift=t(3, 2, 1, 6)),
    case("pse-BSH-heads-1", "prefill_bsh", "pse_shift", pse_shift=t(2, 1, 4, 6)),
    # decode pse needs D % 16 == 0 (V4 pseShift table; torch_npu.npu_incre_flash_attention pse_shift)
    case("pse-decode-D24", "decode_d24", "pse_shift", pse_shift=t(2, 2, 1, 6)),
    case("incre-pse-D24", "incre_bsh", "pse_shift", query=t(2, 1, 48), key=t(2, 6, 48), value=t(2, 6, 48),
         pse_shift=t(2, 2, 1, 6)),
    case("incre-pse-too-small", "incre_bsh", "pse_shift", pse_shift=t(2, 2, 1, 5)),
]


@pytest.mark.parametrize("c", params(PSE_CASES))
def test_pse_shift(c):
    check_case(c)


@pytest.mark.parametrize("base,shape", [("prefill_pse", (1, 2, 4, 6)), ("prefill_pse", (2, 2, 8, 16)),
                                        ("prefill_gqa", (2, 4, 4, 6)), ("decode_pse", (1, 2, 1, 6)),
                                        ("decode_pse", (2, 2, 1, 16))], ids=str)
def test_pse_shapes_accepted(base, shape):
    call = BASES[base]()
    call["pse_shift"] = t(*shape)
    run_ok(call)


# --- tensor-list key/value (SPEC 8) ---------------------------------------------------------------------
def _list(*shapes, dtype=F16):
    return [t(*s, dtype=dtype) for s in shapes]


TLIST_CASES = [
    case("list-3-tensors-for-B2", "tensor_list", "key", key=_list((1, 2, 5, 16), (1, 2, 7, 16), (1, 2, 3, 16)),
         value=_list((1, 2, 5, 16), (1, 2, 7, 16), (1, 2, 3, 16))),
    case("list-1-tensor-for-B2", "tensor_list", "key", key=_list((1, 2, 5, 16)), value=_list((1, 2, 5, 16))),
    case("list-empty", "tensor_list", "key", key=[], value=[]),
    case("list-element-batch-2", "tensor_list", "key", key=_list((2, 2, 5, 16), (1, 2, 7, 16)),
         value=_list((2, 2, 5, 16), (1, 2, 7, 16))),
    case("list-element-N-differs", "tensor_list", "key", key=_list((1, 2, 5, 16), (1, 1, 7, 16)),
         value=_list((1, 2, 5, 16), (1, 1, 7, 16))),
    case("list-element-D-differs", "tensor_list", "key", key=_list((1, 2, 5, 16), (1, 2, 7, 32)),
         value=_list((1, 2, 5, 16), (1, 2, 7, 32))),
    case("list-element-rank-3", "tensor_list", "key", key=_list((1, 2, 5, 16), (1, 14, 16)),
         value=_list((1, 2, 5, 16), (1, 14, 16))),
    case("list-element-dtype-differs", "tensor_list", "key",
         key=[t(1, 2, 5, 16), t(1, 2, 7, 16, dtype=BF16)], value=[t(1, 2, 5, 16), t(1, 2, 7, 16, dtype=BF16)]),
    case("list-value-S-differs-from-key", "tensor_list", "value", value=_list((1, 2, 5, 16), (1, 2, 6, 16))),
    case("list-key-value-tensor", "tensor_list", "value", value=t(2, 2, 7, 16)),
    case("tensor-key-list-value", "tensor_list", ("value", "key"), key=t(2, 2, 7, 16)),
    case("list-value-shorter", "tensor_list", "value", value=_list((1, 2, 5, 16))),
    case("list-prefill-element-batch-2", "tensor_list_prefill", "key", key=_list((2, 2, 5, 16), (1, 2, 7, 16)),
         value=_list((2, 2, 5, 16), (1, 2, 7, 16))),
    # B <= 256 with tensor lists (strict mode; a tensor-list limit of the NPU)
    case("list-B-257", "tensor_list", ("key", "query"), query=t(257, 1, 1, 16), num_heads=1,
         key=_list(*[(1, 1, 2, 16)] * 257), value=_list(*[(1, 1, 2, 16)] * 257)),
]


@pytest.mark.parametrize("c", params(TLIST_CASES))
def test_tensor_list(c):
    check_case(c)


@pytest.mark.case(q_s=1)
def test_tensor_list_limits_accepted():
    call = dict(api="fused", query=t(256, 1, 1, 16), key=_list(*[(1, 1, 2, 16)] * 256),
                value=_list(*[(1, 1, 2, 16)] * 256), num_heads=1, input_layout="BNSD")
    assert run_ok(call).shape == (256, 1, 1, 16)
    # B = 257 is a tensor-list (hardware) limit: accepted in portable mode
    call = dict(api="fused", query=t(257, 1, 1, 16), key=_list(*[(1, 1, 2, 16)] * 257),
                value=_list(*[(1, 1, 2, 16)] * 257), num_heads=1, input_layout="BNSD")
    assert run_ok(call, "portable").shape == (257, 1, 1, 16)


# --- npu_incre_flash_attention: decode only ------------------------------------------------------------
INCRE_CASES = [
    case("incre-Q_S-4-BSH", "incre_bsh", "query", query=t(2, 4, 32)),
    case("incre-Q_S-4-BNSD", "incre_bnsd", "query", query=t(2, 2, 4, 16)),
    case("incre-Q_S-2-BSND", "incre_bnsd", "query", query=t(2, 2, 2, 16), key=t(2, 6, 2, 16),
         value=t(2, 6, 2, 16), input_layout="BSND"),
]


@pytest.mark.parametrize("c", params(INCRE_CASES))
def test_incre_requires_single_query_token(c):
    check_case(c)


# --- softmax_lse_flag -------------------------------------------------------------------------------------
LSE_CASES = [
    case("lse-flag-str", "prefill_bnsd", "softmax_lse_flag", softmax_lse_flag="yes"),
    case("lse-flag-list", "decode_bnsd", "softmax_lse_flag", softmax_lse_flag=[True]),
    case("lse-flag-tensor-float", "prefill_bnsd", "softmax_lse_flag", softmax_lse_flag=torch.tensor([0.5, 1.0])),
]


@pytest.mark.parametrize("c", params(LSE_CASES))
def test_softmax_lse_flag_type(c):
    check_case(c)


@pytest.mark.parametrize("flag", [True, False])
def test_softmax_lse_flag_accepted(flag):
    call = BASES["prefill_bnsd"]()
    call.pop("api")
    q, k, v = call.pop("query"), call.pop("key"), call.pop("value")
    out, lse = fia.npu_fused_infer_attention_score(q, k, v, softmax_lse_flag=flag, **call)
    assert lse.dtype == F32
    assert tuple(lse.shape) == ((2, 2, 4, 1) if flag else (0,))
