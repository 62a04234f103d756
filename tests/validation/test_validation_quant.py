"""Input validation of the quantization arguments (SPEC 10-12, 14).

Every invalid case mutates one aspect of a small valid base call (each base is run by a positive control) and
must raise fia.FiaInputError with status 161002 and a message naming the argument (as the caller spelled it).
"""
from __future__ import annotations

from typing import Any, Callable, Dict

import pytest
import torch

import fia
from _validation_util import INVALID, assert_input_error, run

F16, BF16, F32, I8, I32, I64 = torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.int32, torch.int64
INT_MAX = 2147483647

_G = torch.Generator().manual_seed(4321)


def t(*shape, dtype=F16):
    return torch.randn(*shape, generator=_G).to(dtype)


def i8(*shape):
    return torch.randint(-128, 128, shape, generator=_G, dtype=torch.int64).to(I8)


def i4(*shape):
    """int32 words holding packed int4 values (any bit pattern is a valid set of eight nibbles)."""
    return torch.randint(-2 ** 31, 2 ** 31, shape, generator=_G, dtype=torch.int64).to(I32)


def pos(*shape, dtype=F16):
    return (torch.rand(*shape, generator=_G) * 0.02 + 0.001).to(dtype)


def one(x=0.01, dtype=F32):
    return torch.tensor([x], dtype=dtype)


def tmpl():
    return torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


def table(b=2, mb=2, nb=4):
    return torch.arange(b * mb, dtype=I32).reshape(b, mb) % nb


# --- valid bases ---------------------------------------------------------------------------------------
# B = 2, N = KV_N = 2, KV_S = 6, D = 64 for decode (int4 needs D % 64), D = 32 for prefill (int8: D % 32).
def _dec_comb():
    return dict(api="fused", query=t(2, 2, 1, 64), key=i8(2, 2, 6, 64), value=i8(2, 2, 6, 64),
                num_heads=2, input_layout="BNSD", scale=0.125, antiquant_scale=pos(2, 2, 1, 64))


def _dec_comb_tok():
    b = _dec_comb()
    b.update(antiquant_scale=pos(2, 2, 6, dtype=F32), antiquant_offset=t(2, 2, 6, dtype=F32), antiquant_mode=1)
    return b


def _dec_sep():
    b = _dec_comb()
    del b["antiquant_scale"]
    b.update(key_antiquant_scale=pos(1, 2, 1, 64), value_antiquant_scale=pos(1, 2, 1, 64))
    return b


def _dec_sep_off():
    b = _dec_sep()
    b.update(key_antiquant_offset=t(1, 2, 1, 64), value_antiquant_offset=t(1, 2, 1, 64))
    return b


def _dec_sep_m(mode, kshape, vshape=None, dtype=F32):
    def base():
        b = _dec_comb()
        del b["antiquant_scale"]
        b.update(key_antiquant_scale=pos(*kshape, dtype=dtype), value_antiquant_scale=pos(*(vshape or kshape),
                                                                                           dtype=dtype),
                 key_antiquant_mode=mode, value_antiquant_mode=mode)
        return b
    return base


def _dec_k0v1():
    b = _dec_sep()
    b.update(value_antiquant_scale=pos(1, 2, 6, dtype=F32), value_antiquant_mode=1)
    return b


def _paged_m(mode):
    """Decode, paged int8 cache (blocknum 4, block_size 32, 3-D), B = 2 with max_blocks 2."""
    def base():
        b = dict(api="fused", query=t(2, 1, 128), key=i8(4, 32, 128), value=i8(4, 32, 128), num_heads=2,
                 input_layout="BSH", scale=0.125, block_table=table(), block_size=32, actual_seq_lengths_kv=[40, 64])
        if mode == 4:
            b.update(key_antiquant_scale=pos(4, 32, dtype=F32), value_antiquant_scale=pos(4, 32, dtype=F32))
        elif mode == 5:
            b.update(key_antiquant_scale=pos(4, 2, 32, dtype=F32), value_antiquant_scale=pos(4, 2, 32, dtype=F32))
        elif mode == 1:
            b.update(key_antiquant_scale=pos(1, 2, 64, dtype=F32), value_antiquant_scale=pos(1, 2, 64, dtype=F32))
        elif mode == "c1":
            b.update(antiquant_scale=pos(2, 2, 64, dtype=F32), antiquant_mode=1)
            return b
        else:
            b.update(key_antiquant_scale=pos(1, 128), value_antiquant_scale=pos(1, 128))
        b.update(key_antiquant_mode=mode, value_antiquant_mode=mode)
        return b
    return base


def _pre_comb():
    return dict(api="fused", query=t(2, 2, 4, 32), key=i8(2, 2, 6, 32), value=i8(2, 2, 6, 32),
                num_heads=2, input_layout="BNSD", scale=0.17, antiquant_scale=pos(2, 2, 1, 32),
                antiquant_offset=t(2, 2, 1, 32))


def _pre_sep():
    return dict(api="fused", query=t(2, 2, 4, 32, dtype=BF16), key=i8(2, 2, 6, 32), value=i8(2, 2, 6, 32),
                num_heads=2, input_layout="BNSD", scale=0.17, key_antiquant_scale=pos(2, 32, dtype=BF16),
                value_antiquant_scale=pos(2, 32, dtype=BF16))


def _pre_sep_tok():
    b = _pre_sep()
    b.update(key_antiquant_scale=pos(2, 6, dtype=F32), value_antiquant_scale=pos(2, 6, dtype=F32),
             key_antiquant_mode=1, value_antiquant_mode=1)
    return b


def _int4():
    return dict(api="fused", query=t(2, 2, 1, 64), key=i4(2, 2, 6, 8), value=i4(2, 2, 6, 8),
                num_heads=2, input_layout="BNSD", scale=0.125, key_antiquant_scale=pos(1, 2, 1, 64),
                value_antiquant_scale=pos(1, 2, 1, 64))


def _full8():
    return dict(api="fused", query=i8(2, 2, 4, 32), key=i8(2, 2, 6, 32), value=i8(2, 2, 6, 32), num_heads=2,
                input_layout="BNSD", scale=0.17, dequant_scale1=one(1e-3), quant_scale1=one(127.0),
                dequant_scale2=one(1e-3))


def _full8_out():
    b = _full8()
    b.update(quant_scale2=one(2.0), quant_offset2=one(1.0))
    return b


def _prompt8():
    return dict(api="prompt", query=i8(2, 4, 64), key=i8(2, 6, 64), value=i8(2, 6, 64), num_heads=2,
                input_layout="BSH", scale_value=0.17, deq_scale1=one(1e-3), quant_scale1=one(127.0),
                deq_scale2=one(1e-3))


def _qdq():
    return dict(api="fused", query=i8(2, 2, 4, 32), key=t(2, 2, 6, 32), value=t(2, 2, 6, 32), num_heads=2,
                input_layout="BNSD", scale=0.17, dequant_scale_query=pos(2, 2, 4, dtype=F32), query_quant_mode=3)


def _fp16_pre():
    return dict(api="fused", query=t(2, 2, 4, 32), key=t(2, 2, 6, 32), value=t(2, 2, 6, 32), num_heads=2,
                input_layout="BNSD", scale=0.17)


def _bf16_pre():
    b = _fp16_pre()
    for k in ("query", "key", "value"):
        b[k] = b[k].to(BF16)
    return b


def _oq():
    b = _fp16_pre()
    b.update(quant_scale2=one(20.0), quant_offset2=one(1.0))
    return b


def _oq_pc():
    b = _fp16_pre()
    b.update(quant_scale2=pos(2, 32, dtype=F32), quant_offset2=t(2, 32, dtype=F32))
    return b


def _oq_bf16():
    b = _bf16_pre()
    b.update(quant_scale2=one(20.0, BF16), quant_offset2=one(1.0, BF16))
    return b


def _oq_mask():
    b = _oq()
    b.update(atten_mask=torch.zeros(4, 6, dtype=torch.bool))
    return b


def _oq_s4():
    b = _oq()
    del b["quant_offset2"]
    b.update(atten_mask=tmpl(), sparse_mode=4, pre_tokens=3, next_tokens=1)
    return b


def _incre():
    return dict(api="incre", query=t(2, 1, 128), key=i8(2, 6, 128), value=i8(2, 6, 128), num_heads=2,
                input_layout="BSH", scale_value=0.125, antiquant_scale=pos(2, 128))


def _incre_fp16():
    return dict(api="incre", query=t(2, 1, 128), key=t(2, 6, 128), value=t(2, 6, 128), num_heads=2,
                input_layout="BSH", scale_value=0.125)


def _v2_sep():
    return dict(api="v2", query=t(2, 2, 1, 64), key=i8(2, 2, 6, 64), value=i8(2, 2, 6, 64), num_query_heads=2,
                input_layout="BNSD", softmax_scale=0.125, dequant_scale_key=pos(1, 2, 1, 64),
                dequant_scale_value=pos(1, 2, 1, 64))


BASES: Dict[str, Callable[[], Dict[str, Any]]] = {
    "dec_comb": _dec_comb, "dec_comb_tok": _dec_comb_tok, "dec_sep": _dec_sep, "dec_sep_off": _dec_sep_off,
    "dec_m1": _dec_sep_m(1, (1, 2, 6)), "dec_m2": _dec_sep_m(2, (2,), dtype=F16), "dec_m3": _dec_sep_m(3, (2, 2, 6)),
    "dec_k0v1": _dec_k0v1, "paged_m0": _paged_m(0), "paged_m1": _paged_m(1), "paged_m4": _paged_m(4),
    "paged_m5": _paged_m(5), "paged_c1": _paged_m("c1"), "pre_comb": _pre_comb, "pre_sep": _pre_sep,
    "pre_sep_tok": _pre_sep_tok, "int4": _int4, "full8": _full8, "full8_out": _full8_out, "prompt8": _prompt8,
    "qdq": _qdq, "fp16_pre": _fp16_pre, "bf16_pre": _bf16_pre, "oq": _oq, "oq_pc": _oq_pc, "oq_bf16": _oq_bf16,
    "oq_mask": _oq_mask, "oq_s4": _oq_s4, "incre": _incre, "incre_fp16": _incre_fp16, "v2_sep": _v2_sep,
}


def _run(call):
    call = dict(call)
    if call.get("api") == "v2":
        call.pop("api")
        q, k, v = call.pop("query"), call.pop("key"), call.pop("value")
        return fia.npu_fused_infer_attention_score_v2(q, k, v, **call)[0]
    return run(call)


def build(base: str, changes: Dict[str, Any]) -> Dict[str, Any]:
    call = BASES[base]()
    for k, v in changes.items():
        if v is DROP:
            call.pop(k, None)
        else:
            call[k] = v(call) if callable(v) and not isinstance(v, torch.Tensor) else v
    return call


DROP = object()


@pytest.mark.parametrize("base", list(BASES))
def test_bases_are_valid(base):
    """Positive controls: every base call runs (strict mode)."""
    with fia.validation_mode("strict"):
        out = _run(build(base, {}))
    assert out.numel() > 0


def C(id, base, names, mode="strict", **changes):
    if isinstance(names, str):
        names = (names,)
    return pytest.param(base, names, mode, changes, id=id)


def _prefix8(c):
    return i8(1, 2, 3, c["key"].shape[-1])


CASES = [
    # ---- SPEC 11: forbidden mixes with float inputs
    C("fp16-query+dequant_scale1", "fp16_pre", "dequant_scale1", dequant_scale1=one()),
    C("fp16-query+quant_scale1", "fp16_pre", "quant_scale1", quant_scale1=one(127.0)),
    C("fp16-query+dequant_scale2", "fp16_pre", "dequant_scale2", dequant_scale2=one()),
    C("bf16-query+dequant_scale1", "bf16_pre", "dequant_scale1", dequant_scale1=one()),
    C("fp16-out-quant+dequant_scale2", "oq", "dequant_scale2", dequant_scale2=one()),
    C("antiquant+dequant_scale1", "dec_comb", "dequant_scale1", dequant_scale1=one()),
    C("incre-fp16+quant_scale1", "incre_fp16", "quant_scale1", quant_scale1=one(127.0)),
    C("incre-fp16+dequant_scale1", "incre_fp16", "dequant_scale1", dequant_scale1=one()),
    C("prompt-fp16+deq_scale1", "prompt8", "deq_scale1", query=lambda c: t(2, 4, 64), key=lambda c: t(2, 6, 64),
      value=lambda c: t(2, 6, 64)),
    # ---- SPEC 11: int8 query needs the three scales; no all-int8 decode; int8 Q needs int8 K/V or query dequant
    C("int8-missing-dequant_scale1", "full8", "dequant_scale1", dequant_scale1=None),
    C("int8-missing-quant_scale1", "full8", "quant_scale1", quant_scale1=None),
    C("int8-missing-dequant_scale2", "full8", "dequant_scale2", dequant_scale2=None),
    C("int8-missing-all-scales", "full8", ("dequant_scale1", "quant_scale1", "dequant_scale2"),
      dequant_scale1=None, quant_scale1=None, dequant_scale2=None),
    C("prompt-int8-missing-deq_scale2", "prompt8", "deq_scale2", deq_scale2=None),
    C("int8-decode", "full8", "query", query=lambda c: i8(2, 2, 1, 32)),
    C("int8-decode-incre", "incre", ("query", "key"), query=lambda c: i8(2, 1, 128), antiquant_scale=None,
      dequant_scale1=one(), quant_scale1=one(127.0), dequant_scale2=one()),
    C("int8-query-fp16-kv-no-dsq", "full8", ("key", "dequant_scale_query"), key=lambda c: t(2, 2, 6, 32),
      value=lambda c: t(2, 2, 6, 32), dequant_scale1=None, quant_scale1=None, dequant_scale2=None),
    C("int8-key-fp16-value", "full8", "value", value=lambda c: t(2, 2, 6, 32)),
    C("int8-quant_offset2-without-quant_scale2", "full8", ("quant_scale2", "quant_offset2"),
      quant_offset2=one(1.0)),
    C("full-int8+antiquant_scale", "full8", "antiquant_scale", antiquant_scale=pos(2, 2, 1, 32)),
    C("full-int8+key_antiquant_scale", "full8", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(1, 2, 1, 32), value_antiquant_scale=pos(1, 2, 1, 32)),
    C("dequant_scale1-fp16", "full8", "dequant_scale1", dequant_scale1=one(1e-3, F16)),
    C("dequant_scale1-int32", "full8", "dequant_scale1", dequant_scale1=torch.tensor([5], dtype=I32)),
    C("dequant_scale2-bf16", "full8", "dequant_scale2", dequant_scale2=one(1e-3, BF16)),
    C("quant_scale1-int64", "full8", "quant_scale1", quant_scale1=torch.tensor([1], dtype=I64)),
    C("quant_scale1-fp16", "full8", "quant_scale1", quant_scale1=one(127.0, F16)),
    C("dequant_scale1-2-elements", "full8", "dequant_scale1", dequant_scale1=torch.ones(2)),
    C("quant_scale1-per-channel", "full8", "quant_scale1", quant_scale1=torch.ones(2, 32)),
    C("dequant_scale2-not-tensor", "full8", "dequant_scale2", dequant_scale2=0.5),
    C("int8-query+shared-prefix", "full8", "key_shared_prefix", key_shared_prefix=_prefix8,
      value_shared_prefix=_prefix8),
    # ---- DECISIONS 46: combinations the documents do not define (input errors in both modes)
    C("full8+rope", "full8", "query_rope", query_rope=lambda c: t(2, 2, 4, 64, dtype=BF16),
      key_rope=lambda c: t(2, 2, 6, 64, dtype=BF16)),
    C("full8+rope-portable", "full8", "query_rope", "portable", query_rope=lambda c: t(2, 2, 4, 64, dtype=BF16),
      key_rope=lambda c: t(2, 2, 6, 64, dtype=BF16)),
    C("per-token+shared-prefix", "dec_comb_tok", "key_shared_prefix", key_shared_prefix=_prefix8,
      value_shared_prefix=_prefix8),
    C("per-token+shared-prefix-portable", "dec_comb_tok", "key_shared_prefix", "portable",
      key_shared_prefix=_prefix8, value_shared_prefix=_prefix8),
    C("int8-query+paged", "full8", "block_table", key=lambda c: i8(4, 128, 64), value=lambda c: i8(4, 128, 64),
      query=lambda c: i8(2, 4, 64), input_layout="BSH", block_table=table(), block_size=128,
      actual_seq_lengths_kv=[100, 200]),
    C("int8-D16-unaligned", "full8", ("query", "key"), query=lambda c: i8(2, 2, 4, 16), key=lambda c: i8(2, 2, 6, 16),
      value=lambda c: i8(2, 2, 6, 16)),
    C("int8-query+bf16-pse", "full8", "pse_shift", pse_shift=t(2, 2, 4, 6, dtype=BF16)),
    C("int8-out-quant-bf16-scale", "full8_out", "quant_scale2", quant_scale2=one(2.0, BF16),
      quant_offset2=one(1.0, BF16)),
    # ---- SPEC 11: query dequantization (dequant_scale_query, query_quant_mode 3)
    C("dsq-with-fp16-query", "fp16_pre", "dequant_scale_query", dequant_scale_query=pos(2, 2, 4, dtype=F32),
      query_quant_mode=3),
    C("query_quant_mode3-fp16-query", "fp16_pre", "query_quant_mode", query_quant_mode=3),
    C("dsq-query_quant_mode0", "qdq", "query_quant_mode", query_quant_mode=0),
    C("dsq-query_quant_mode1", "qdq", "query_quant_mode", query_quant_mode=1),
    C("query_quant_mode3-without-dsq", "qdq", "dequant_scale_query", dequant_scale_query=None),
    C("dsq-fp16", "qdq", "dequant_scale_query", dequant_scale_query=pos(2, 2, 4, dtype=F16)),
    C("dsq-shape-(B,N)", "qdq", "dequant_scale_query", dequant_scale_query=pos(2, 2, dtype=F32)),
    C("dsq-shape-wrong-N", "qdq", "dequant_scale_query", dequant_scale_query=pos(2, 3, 4, dtype=F32)),
    C("dsq-shape-wrong-B", "qdq", "dequant_scale_query", dequant_scale_query=pos(3, 2, 4, dtype=F32)),
    C("dsq-shape-short-Q_S", "qdq", "dequant_scale_query", dequant_scale_query=pos(2, 2, 3, dtype=F32)),
    C("dsq+dequant_scale1", "qdq", "dequant_scale1", dequant_scale1=one(), quant_scale1=one(127.0),
      dequant_scale2=one()),
    # ---- SPEC 10.1 combined parameters
    C("int8-kv-no-scales", "dec_comb", ("antiquant_scale", "key_antiquant_scale"), antiquant_scale=None),
    C("int8-kv-prefill-no-scales", "pre_comb", ("antiquant_scale", "key_antiquant_scale"), antiquant_scale=None,
      antiquant_offset=None),
    C("antiquant_offset-without-scale", "dec_comb", ("antiquant_scale", "antiquant_offset"), antiquant_scale=None,
      antiquant_offset=t(2, 2, 1, 64)),
    C("comb-scale-wrong-D", "dec_comb", "antiquant_scale", antiquant_scale=pos(2, 2, 1, 32)),
    C("comb-scale-wrong-KVN", "dec_comb", "antiquant_scale", antiquant_scale=pos(2, 3, 1, 64)),
    C("comb-scale-leading-1", "dec_comb", "antiquant_scale", antiquant_scale=pos(1, 2, 1, 64)),
    C("comb-scale-no-leading-2", "dec_comb", "antiquant_scale", antiquant_scale=pos(2, 1, 64)),
    C("comb-scale-(3,)", "dec_comb", "antiquant_scale", antiquant_scale=pos(3)),
    C("comb-scale-(2,H+1)", "dec_comb", "antiquant_scale", antiquant_scale=pos(2, 129)),
    C("comb-scale-bf16-fp16-query", "dec_comb", "antiquant_scale", antiquant_scale=pos(2, 2, 1, 64, dtype=BF16)),
    C("comb-scale-fp16-bf16-query", "dec_comb", "antiquant_scale", query=lambda c: c["query"].to(BF16)),
    C("comb-offset-shape", "dec_comb", "antiquant_offset", antiquant_offset=t(2, 2, 64)),
    C("comb-offset-dtype", "dec_comb", "antiquant_offset", antiquant_offset=t(2, 2, 1, 64, dtype=F32)),
    C("comb-per-token-fp16", "dec_comb_tok", "antiquant_scale", antiquant_scale=pos(2, 2, 6),
      antiquant_offset=t(2, 2, 6)),
    C("comb-per-token-short", "dec_comb_tok", "antiquant_scale", antiquant_scale=pos(2, 2, 5, dtype=F32),
      antiquant_offset=t(2, 2, 5, dtype=F32)),
    C("comb-per-token-wrong-B", "dec_comb_tok", "antiquant_scale", antiquant_scale=pos(2, 3, 6, dtype=F32),
      antiquant_offset=t(2, 3, 6, dtype=F32)),
    C("comb-per-token-offset-shape", "dec_comb_tok", "antiquant_offset", antiquant_offset=t(2, 2, 7, dtype=F32)),
    C("comb-per-channel-with-mode1", "dec_comb", "antiquant_scale", antiquant_mode=1),
    C("antiquant_mode-2", "dec_comb", "antiquant_mode", antiquant_mode=2),
    C("antiquant_mode-neg", "dec_comb", "antiquant_mode", antiquant_mode=-1),
    C("antiquant_mode-1-prefill", "pre_comb", "antiquant_mode", antiquant_mode=1,
      antiquant_scale=pos(2, 2, 6, dtype=F32), antiquant_offset=t(2, 2, 6, dtype=F32)),
    C("comb-prefill-bf16-query", "pre_comb", ("antiquant_scale", "query"), query=lambda c: c["query"].to(BF16),
      antiquant_scale=pos(2, 2, 1, 32, dtype=BF16), antiquant_offset=t(2, 2, 1, 32, dtype=BF16)),
    C("paged-comb-per-token-short", "paged_c1", "antiquant_scale", antiquant_scale=pos(2, 2, 63, dtype=F32)),
    C("int8-kv-prefill-D16", "pre_comb", ("query", "key"), query=lambda c: t(2, 2, 4, 16),
      key=lambda c: i8(2, 2, 6, 16), value=lambda c: i8(2, 2, 6, 16), antiquant_scale=pos(2, 2, 1, 16),
      antiquant_offset=t(2, 2, 1, 16)),
    C("int8-paged-decode-block_size-16", "paged_m0", "block_size", key=lambda c: i8(8, 16, 128),
      value=lambda c: i8(8, 16, 128), block_size=16, block_table=torch.arange(8, dtype=I32).reshape(2, 4)),
    C("incre-antiquant-scale-shape", "incre", "antiquant_scale", antiquant_scale=pos(2, 64)),
    C("incre-antiquant-offset-shape", "incre", "antiquant_offset", antiquant_offset=t(1, 128)),
    # ---- SPEC 10.2 separate parameters
    C("key-scale-only", "dec_sep", "value_antiquant_scale", value_antiquant_scale=None),
    C("value-scale-only", "dec_sep", "key_antiquant_scale", key_antiquant_scale=None),
    C("key-offset-only", "dec_sep_off", "value_antiquant_offset", value_antiquant_offset=None),
    C("value-offset-only", "dec_sep_off", "key_antiquant_offset", key_antiquant_offset=None),
    C("sep-offsets-without-scales", "dec_sep_off", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=None, value_antiquant_scale=None),
    C("key_antiquant_mode-7", "dec_sep", "key_antiquant_mode", key_antiquant_mode=7, value_antiquant_mode=7),
    C("key_antiquant_mode-neg", "dec_sep", "key_antiquant_mode", key_antiquant_mode=-1, value_antiquant_mode=-1),
    C("value_antiquant_mode-9", "dec_sep", "value_antiquant_mode", value_antiquant_mode=9),
    C("modes-k1-v0", "dec_m1", ("key_antiquant_mode", "value_antiquant_mode"), value_antiquant_mode=0,
      value_antiquant_scale=pos(1, 2, 1, 64)),
    C("modes-k2-v3", "dec_m2", ("key_antiquant_mode", "value_antiquant_mode"), value_antiquant_mode=3,
      value_antiquant_scale=pos(2, 2, 6, dtype=F32)),
    C("modes-k0-v2", "dec_sep", ("key_antiquant_mode", "value_antiquant_mode"), value_antiquant_mode=2,
      value_antiquant_scale=pos(2)),
    C("modes-k3-v1", "dec_m3", ("key_antiquant_mode", "value_antiquant_mode"), value_antiquant_mode=1,
      value_antiquant_scale=pos(1, 2, 6, dtype=F32)),
    C("modes-k1-v3", "dec_m1", ("key_antiquant_mode", "value_antiquant_mode"), value_antiquant_mode=3,
      value_antiquant_scale=pos(2, 2, 6, dtype=F32)),
    C("sep-shape-mismatch-same-mode", "dec_sep", ("value_antiquant_scale", "key_antiquant_scale"),
      value_antiquant_scale=pos(1, 2, 64)),
    C("sep-offset-shape-mismatch", "dec_sep_off", ("value_antiquant_offset", "key_antiquant_offset"),
      value_antiquant_offset=t(1, 2, 64)),
    C("sep-key-offset-vs-own-scale", "dec_sep_off", "key_antiquant_offset", key_antiquant_offset=t(1, 128),
      value_antiquant_offset=t(1, 128)),
    C("sep-key-offset-dtype", "dec_sep_off", "key_antiquant_offset", key_antiquant_offset=t(1, 2, 1, 64, dtype=F32),
      value_antiquant_offset=t(1, 2, 1, 64, dtype=F32)),
    C("sep-m0-wrong-D", "dec_sep", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(1, 2, 1, 32), value_antiquant_scale=pos(1, 2, 1, 32)),
    C("sep-m0-bf16-fp16-query", "dec_sep", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(1, 2, 1, 64, dtype=BF16), value_antiquant_scale=pos(1, 2, 1, 64, dtype=BF16)),
    C("sep-m1-fp16", "dec_m1", ("key_antiquant_scale", "value_antiquant_scale"), key_antiquant_scale=pos(1, 2, 6),
      value_antiquant_scale=pos(1, 2, 6)),
    C("sep-m1-short", "dec_m1", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(1, 2, 5, dtype=F32), value_antiquant_scale=pos(1, 2, 5, dtype=F32)),
    C("sep-m1-wrong-B", "dec_m1", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(1, 3, 6, dtype=F32), value_antiquant_scale=pos(1, 3, 6, dtype=F32)),
    C("sep-m2-wrong-KVN", "dec_m2", ("key_antiquant_scale", "value_antiquant_scale"), key_antiquant_scale=pos(3),
      value_antiquant_scale=pos(3)),
    C("sep-m2-per-channel-shape", "dec_m2", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(1, 2, 1, 64), value_antiquant_scale=pos(1, 2, 1, 64)),
    C("sep-m2-bf16-fp16-query", "dec_m2", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(2, dtype=BF16), value_antiquant_scale=pos(2, dtype=BF16)),
    C("sep-m3-wrong-KVN", "dec_m3", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(2, 3, 6, dtype=F32), value_antiquant_scale=pos(2, 3, 6, dtype=F32)),
    C("sep-m3-short", "dec_m3", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(2, 2, 5, dtype=F32), value_antiquant_scale=pos(2, 2, 5, dtype=F32)),
    C("sep-m3-bf16", "dec_m3", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(2, 2, 6, dtype=BF16), value_antiquant_scale=pos(2, 2, 6, dtype=BF16)),
    C("sep-m3-2d", "dec_m3", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(2, 6, dtype=F32), value_antiquant_scale=pos(2, 6, dtype=F32)),
    C("sep-m4-without-block_table", "dec_sep", ("key_antiquant_mode", "block_table"), key_antiquant_mode=4,
      value_antiquant_mode=4, key_antiquant_scale=pos(2, 32, dtype=F32), value_antiquant_scale=pos(2, 32, dtype=F32)),
    C("sep-m5-without-block_table", "dec_sep", ("key_antiquant_mode", "block_table"), key_antiquant_mode=5,
      value_antiquant_mode=5, key_antiquant_scale=pos(2, 2, 32, dtype=F32),
      value_antiquant_scale=pos(2, 2, 32, dtype=F32)),
    C("paged-m4-wrong-block_size", "paged_m4", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(4, 16, dtype=F32), value_antiquant_scale=pos(4, 16, dtype=F32)),
    C("paged-m4-wrong-blocknum", "paged_m4", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(3, 32, dtype=F32), value_antiquant_scale=pos(3, 32, dtype=F32)),
    C("paged-m4-fp16", "paged_m4", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(4, 32), value_antiquant_scale=pos(4, 32)),
    C("paged-m5-no-head-axis", "paged_m5", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(4, 32, dtype=F32), value_antiquant_scale=pos(4, 32, dtype=F32)),
    C("paged-m5-wrong-KVN", "paged_m5", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(4, 3, 32, dtype=F32), value_antiquant_scale=pos(4, 3, 32, dtype=F32)),
    C("paged-m1-short", "paged_m1", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(1, 2, 63, dtype=F32), value_antiquant_scale=pos(1, 2, 63, dtype=F32)),
    C("v2-dequant_scale_key-only", "v2_sep", "dequant_scale_value", dequant_scale_value=None),
    C("v2-key_quant_mode-7", "v2_sep", "key_quant_mode", key_quant_mode=7, value_quant_mode=7),
    # ---- SPEC 10.2, Q_S > 1
    C("pre-sep-mode2", "pre_sep", "key_antiquant_mode", key_antiquant_mode=2, value_antiquant_mode=2,
      key_antiquant_scale=pos(2, dtype=BF16), value_antiquant_scale=pos(2, dtype=BF16)),
    C("pre-sep-mode3", "pre_sep", "key_antiquant_mode", key_antiquant_mode=3, value_antiquant_mode=3,
      key_antiquant_scale=pos(2, 2, 6, dtype=F32), value_antiquant_scale=pos(2, 2, 6, dtype=F32)),
    C("pre-sep-k0v1", "pre_sep", ("key_antiquant_mode", "value_antiquant_mode"), value_antiquant_mode=1,
      value_antiquant_scale=pos(2, 6, dtype=F32)),
    C("pre-sep-Q_S-17", "pre_sep", "query", query=lambda c: t(2, 2, 17, 32, dtype=BF16)),
    C("pre-sep-fp16-query", "pre_sep", ("query", "key_antiquant_scale"), query=lambda c: t(2, 2, 4, 32),
      key_antiquant_scale=pos(2, 32), value_antiquant_scale=pos(2, 32)),
    C("pre-sep-m0-wrong-shape", "pre_sep", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(2, 16, dtype=BF16), value_antiquant_scale=pos(2, 16, dtype=BF16)),
    C("pre-sep-m1-fp16", "pre_sep_tok", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(2, 6, dtype=BF16), value_antiquant_scale=pos(2, 6, dtype=BF16)),
    C("pre-sep-m1-short", "pre_sep_tok", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(2, 5, dtype=F32), value_antiquant_scale=pos(2, 5, dtype=F32)),
    C("pre-sep-tensor-list", "pre_sep", ("key_antiquant_scale", "key", "value"),
      key=lambda c: [i8(1, 2, 5, 32), i8(1, 2, 6, 32)], value=lambda c: [i8(1, 2, 5, 32), i8(1, 2, 6, 32)]),
    C("pre-sep-left-padding", "pre_sep", ("key_antiquant_scale", "kv_padding_size", "query_padding_size"),
      kv_padding_size=torch.tensor([1]), actual_seq_lengths_kv=[4, 5]),
    C("pre-sep-paged", "pre_sep", ("key_antiquant_scale", "block_table"), key=lambda c: i8(4, 128, 64),
      value=lambda c: i8(4, 128, 64), query=lambda c: t(2, 4, 64, dtype=BF16), input_layout="BSH",
      block_table=table(), block_size=128, actual_seq_lengths_kv=[100, 200]),
    C("key0-value1-int8-bf16-query", "dec_k0v1", ("query", "key_antiquant_scale"),
      query=lambda c: c["query"].to(BF16), key_antiquant_scale=pos(1, 2, 1, 64, dtype=BF16)),
    # ---- SPEC 10.4 int4
    C("int4-combined", "int4", "antiquant_scale", key_antiquant_scale=None, value_antiquant_scale=None,
      antiquant_scale=pos(2, 2, 1, 64)),
    C("int4-mode2", "int4", ("key_antiquant_mode", "value_antiquant_mode"), key_antiquant_mode=2,
      value_antiquant_mode=2, key_antiquant_scale=pos(2), value_antiquant_scale=pos(2)),
    C("int4-D32", "int4", ("key", "query"), query=lambda c: t(2, 2, 1, 32), key=lambda c: i4(2, 2, 6, 4),
      value=lambda c: i4(2, 2, 6, 4), key_antiquant_scale=pos(1, 2, 1, 32), value_antiquant_scale=pos(1, 2, 1, 32)),
    C("int4-quant_scale2", "int4", "quant_scale2", quant_scale2=one(2.0)),
    C("int4-paged", "int4", "block_table", query=lambda c: t(2, 1, 128), key=lambda c: i4(4, 32, 16),
      value=lambda c: i4(4, 32, 16), input_layout="BSH", block_table=table(), block_size=32,
      actual_seq_lengths_kv=[40, 64], key_antiquant_scale=pos(1, 128), value_antiquant_scale=pos(1, 128)),
    C("int4-left-padding", "int4", "kv_padding_size", kv_padding_size=torch.tensor([1]),
      actual_seq_lengths_kv=[4, 5]),
    C("int4-key-int8-value", "int4", "value", value=lambda c: i8(2, 2, 6, 64)),
    C("int4-wrong-scale-D", "int4", ("key_antiquant_scale", "value_antiquant_scale"),
      key_antiquant_scale=pos(1, 2, 1, 8), value_antiquant_scale=pos(1, 2, 1, 8)),
    # ---- SPEC 12 output quantization
    C("quant_scale2-bf16-fp16-query", "oq", "quant_scale2", quant_scale2=one(20.0, BF16),
      quant_offset2=one(1.0, BF16)),
    C("quant_scale2-fp16", "oq", "quant_scale2", quant_scale2=one(20.0, F16), quant_offset2=one(1.0, F16)),
    C("quant_scale2-int8-query-bf16", "full8_out", "quant_scale2", quant_scale2=one(2.0, BF16),
      quant_offset2=one(1.0, BF16)),
    C("quant_scale2-bad-numel", "oq_pc", "quant_scale2", quant_scale2=pos(2, 31, dtype=F32),
      quant_offset2=t(2, 31, dtype=F32)),
    C("quant_scale2-(3,)", "oq", "quant_scale2", quant_scale2=pos(3, dtype=F32), quant_offset2=t(3, dtype=F32)),
    C("quant_offset2-shape", "oq_pc", "quant_offset2", quant_offset2=t(64, dtype=F32)),
    C("quant_offset2-numel", "oq", "quant_offset2", quant_offset2=t(2, 32, dtype=F32)),
    C("quant_offset2-dtype", "oq_bf16", "quant_offset2", quant_offset2=one(1.0, F32)),
    C("quant_offset2-without-scale", "oq", ("quant_scale2", "quant_offset2"), quant_scale2=None),
    C("quant_scale2-not-tensor", "oq", "quant_scale2", quant_scale2=20.0, quant_offset2=None),
    C("per-channel+query-left-padding", "oq_pc", ("quant_scale2", "query_padding_size"),
      query_padding_size=torch.tensor([1]), actual_seq_lengths=[2, 3]),
    C("per-channel+kv-left-padding", "oq_pc", ("quant_scale2", "kv_padding_size"), kv_padding_size=torch.tensor([1]),
      actual_seq_lengths_kv=[2, 5]),
    C("per-channel-no-offset+kv-left-padding", "oq_pc", ("quant_scale2", "kv_padding_size"),
      kv_padding_size=torch.tensor([0]), actual_seq_lengths_kv=[2, 5], quant_offset2=None),
    C("int8-out-prefill-D16", "oq", "query", query=lambda c: t(2, 2, 4, 16), key=lambda c: t(2, 2, 6, 16),
      value=lambda c: t(2, 2, 6, 16)),
    C("sparse4-negative-pre", "oq_s4", "pre_tokens", pre_tokens=-1, next_tokens=3),
    C("sparse4-negative-next", "oq_s4", "next_tokens", pre_tokens=4, next_tokens=-1),
    C("offset-s0-mask-S1-S2-pre>0", "oq_mask", "quant_offset2", pre_tokens=1, next_tokens=10,
      actual_seq_lengths=[4, 4], actual_seq_lengths_kv=[6, 2]),
    C("offset-s0-mask-next<0", "oq_mask", "quant_offset2", pre_tokens=6, next_tokens=-1),
    C("offset-s3-S2<S1", "oq", "quant_offset2", atten_mask=tmpl(), sparse_mode=3, actual_seq_lengths=[3, 4],
      actual_seq_lengths_kv=[6, 2]),
    C("offset-s4-next+S2-S1<0", "oq", "quant_offset2", atten_mask=tmpl(), sparse_mode=4, pre_tokens=3,
      next_tokens=0, actual_seq_lengths=[4, 4], actual_seq_lengths_kv=[6, 2]),
    C("offset-int8-s3-S2<S1", "full8_out", "quant_offset2", atten_mask=tmpl(), sparse_mode=3,
      actual_seq_lengths_kv=[6, 3]),
    C("incre-quant_scale2-bf16", "incre_fp16", "quant_scale2", quant_scale2=one(2.0, BF16)),
    C("incre-quant_offset2-without-scale", "incre_fp16", ("quant_scale2", "quant_offset2"),
      quant_offset2=one(1.0)),
    C("v2-quant_offset_out-dtype", "v2_sep", "quant_offset_out", quant_scale_out=one(2.0),
      quant_offset_out=one(1.0, F16)),
]


@pytest.mark.parametrize("base,names,mode,changes", CASES)
def test_invalid(base, names, mode, changes):
    call = build(base, changes)
    api = call.get("api")
    if api == "v2":
        with fia.validation_mode(mode):
            with pytest.raises(fia.FiaInputError) as ei:
                _run(call)
        from _validation_util import names_argument
        assert ei.value.status == INVALID, ei.value.status
        assert any(names_argument(str(ei.value), n) for n in names), (str(ei.value), names)
        return
    assert_input_error(call, names, INVALID, mode)


# --- positive controls of the rules above (the boundary cases must stay valid) ---------------------------
VALID = [
    pytest.param("oq_s4", dict(), id="sparse4-nonneg-pre-next-int8-out"),
    pytest.param("oq_s4", dict(pre_tokens=-1, next_tokens=3, quant_scale2=None), id="sparse4-negative-float-out"),
    pytest.param("oq_mask", dict(pre_tokens=1, next_tokens=10, actual_seq_lengths=[4, 4],
                                 actual_seq_lengths_kv=[6, 2], quant_offset2=None),
                 id="s0-mask-S1-S2-pre>0-no-offset"),
    pytest.param("oq_mask", dict(pre_tokens=2, next_tokens=0, actual_seq_lengths=[4, 4],
                                 actual_seq_lengths_kv=[6, 2]), id="s0-mask-S1-S2-pre=0-offset"),
    pytest.param("oq", dict(atten_mask=tmpl(), sparse_mode=3, actual_seq_lengths=[3, 4], actual_seq_lengths_kv=[6, 4]),
                 id="s3-S2=S1-offset"),
    pytest.param("oq", dict(atten_mask=tmpl(), sparse_mode=2, actual_seq_lengths=[4, 4], actual_seq_lengths_kv=[6, 1]),
                 id="s2-offset-never-rejected"),
    pytest.param("oq", dict(query_padding_size=torch.tensor([1]), actual_seq_lengths=[2, 3]),
                 id="per-tensor+left-padding"),
    pytest.param("oq", dict(actual_seq_lengths=[2, 0], actual_seq_lengths_kv=[0, 6]), id="offset-empty-rows-no-band"),
    pytest.param("oq_pc", dict(kv_padding_size=torch.tensor([1])), id="per-channel+inactive-kv-padding"),
    pytest.param("oq_pc", dict(query_padding_size=torch.tensor([1]), actual_seq_lengths_kv=[4, 5]),
                 id="per-channel+inactive-query-padding"),
    pytest.param("oq_bf16", dict(quant_scale2=one(20.0, F32), quant_offset2=one(1.0, F32)), id="bf16-query-f32-scale"),
    pytest.param("oq_pc", dict(quant_scale2=pos(1, 2, 1, 32, dtype=F32), quant_offset2=t(1, 2, 1, 32, dtype=F32)),
                 id="per-channel-(1,N,1,D)-BNSD"),
    pytest.param("full8", dict(dequant_scale1=torch.tensor([1], dtype=I64),
                               dequant_scale2=torch.tensor([2], dtype=I64)), id="uint64-form-dequant-scales"),
    pytest.param("dec_sep", dict(antiquant_scale=pos(2, 2, 1, 64)), id="separate-and-combined"),
    pytest.param("dec_comb", dict(antiquant_scale=pos(2, dtype=F16), antiquant_offset=t(2)), id="comb-per-tensor"),
    pytest.param("dec_sep", dict(key_antiquant_scale=pos(1), value_antiquant_scale=pos(1)), id="sep-per-tensor"),
    pytest.param("dec_sep", dict(key_antiquant_scale=pos(1, 2, 64), value_antiquant_scale=pos(1, 2, 64)),
                 id="sep-(1,KVN,D)"),
    pytest.param("dec_m3", dict(key_antiquant_scale=pos(1, 2, 6, dtype=F32),
                                value_antiquant_scale=pos(1, 2, 6, dtype=F32)), id="sep-m3-(1,KVN,S)"),
    pytest.param("int4", dict(key_antiquant_mode=1, value_antiquant_mode=1,
                              key_antiquant_scale=pos(1, 2, 6, dtype=F32),
                              value_antiquant_scale=pos(1, 2, 6, dtype=F32)), id="int4-mode1"),
    pytest.param("int4", dict(key_antiquant_mode=3, value_antiquant_mode=3,
                              key_antiquant_scale=pos(2, 2, 6, dtype=F32),
                              value_antiquant_scale=pos(2, 2, 6, dtype=F32)), id="int4-mode3"),
    pytest.param("int4", dict(value_antiquant_mode=1, value_antiquant_scale=pos(1, 2, 6, dtype=F32),
                              query=lambda c: c["query"].to(BF16), key_antiquant_scale=pos(1, 2, 1, 64, dtype=BF16)),
                 id="int4-k0v1-bf16"),
    pytest.param("pre_sep", dict(query=lambda c: t(2, 2, 16, 32, dtype=BF16)), id="pre-sep-Q_S-16"),
    pytest.param("pre_sep", dict(key_antiquant_scale=pos(64, dtype=BF16), value_antiquant_scale=pos(64, dtype=BF16)),
                 id="pre-sep-(H)"),
    pytest.param("pre_sep", dict(key_antiquant_scale=pos(2, 1, 32, dtype=BF16),
                                 value_antiquant_scale=pos(2, 1, 32, dtype=BF16)), id="pre-sep-(KVN,1,D)"),
]


@pytest.mark.parametrize("base,changes", VALID)
def test_valid_boundaries(base, changes):
    with fia.validation_mode("strict"):
        out = _run(build(base, changes))
    assert out.numel() > 0


@pytest.mark.parametrize("base,changes", [
    ("dec_sep", dict(key_antiquant_mode=6, value_antiquant_mode=6)),
    ("v2_sep", dict(key_quant_mode=6, value_quant_mode=6)),
], ids=["fused", "v2"])
def test_mode6_fp4_unsupported(base, changes):
    """Mode 6 (per-token-group FLOAT8_E8M0 scales) with int8 K/V and fp16 scales: an input error (SPEC 14b.6
    F3 / F1, line 1946: E8M0 scales, FP4 K/V only), in portable mode too -- not the 'unsupported' class."""
    for mode in ("strict", "portable"):
        with fia.validation_mode(mode), pytest.raises(fia.FiaInputError) as ei:
            _run(build(base, changes))
        assert ei.value.status == INVALID
        assert ei.value.argument in ("key_antiquant_scale", "dequant_scale_key"), str(ei.value)


@pytest.mark.parametrize("base,changes,names", [
    ("pre_sep", dict(query=lambda c: t(2, 2, 17, 32, dtype=BF16)), "query"),
    ("pre_sep", dict(query=lambda c: t(2, 2, 4, 32), key_antiquant_scale=pos(2, 32), value_antiquant_scale=pos(2, 32)),
     "query"),
    ("int4", dict(query=lambda c: t(2, 2, 1, 32), key=lambda c: i4(2, 2, 6, 4), value=lambda c: i4(2, 2, 6, 4),
                  key_antiquant_scale=pos(1, 2, 1, 32), value_antiquant_scale=pos(1, 2, 1, 32)), "key"),
    ("pre_comb", dict(query=lambda c: c["query"].to(BF16), antiquant_scale=pos(2, 2, 1, 32, dtype=BF16),
                      antiquant_offset=t(2, 2, 1, 32, dtype=BF16)), "query"),
], ids=["sep-Q_S-17", "sep-prefill-fp16", "int4-D32", "comb-prefill-bf16"])
def test_hardware_only_rules_lifted_in_portable(base, changes, names):
    """SPEC 1.4: Q_S <= 16 and bf16-only for separate prefill, int4 D % 64, fp16-only combined prefill are
    hardware constraints: strict rejects, portable accepts."""
    call = build(base, changes)
    with fia.validation_mode("portable"):
        out = _run(call)
    assert out.numel() > 0
