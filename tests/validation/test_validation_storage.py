"""Input validation of KV storage and sequence features (SPEC 4, 7, 8, 9, 14): paged KV, left padding,
shared prefix, MLA rope, and the combinations the documents forbid.

Same discipline as the other validation tests: every invalid case mutates ONE thing of a small valid base
call, every base is run by a positive control, and the error must be fia.FiaInputError with status 161002
(161001 only for a None query/key/value) and a message naming the argument.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Tuple

import pytest
import torch

from _validation_util import BF16, F16, INVALID, NULLPTR, assert_input_error, run_ok, t

I32, I64, I8 = torch.int32, torch.int64, torch.int8


def pad(x, dtype=I64):
    return torch.tensor([x], dtype=dtype)


# --- valid bases ------------------------------------------------------------------------------------------
# Paged decode: B=2, N=2, D=16, block_size 16, 4 blocks, lengths [20, 9] (blocks 2 + 1, one -1 entry).
BT = [[3, 0], [1, -1]]


def _paged_decode_bnsd():
    return dict(api="fused", query=t(2, 2, 1, 16), key=t(4, 16, 32), value=t(4, 16, 32), num_heads=2,
                input_layout="BNSD", scale=0.25, block_table=torch.tensor(BT, dtype=I32), block_size=16,
                actual_seq_lengths_kv=[20, 9])


def _paged_decode_4d():
    b = _paged_decode_bnsd()
    b.update(key=t(4, 2, 16, 16), value=t(4, 2, 16, 16))
    return b


def _paged_decode_bsh():
    b = _paged_decode_bnsd()
    b.update(query=t(2, 1, 32), input_layout="BSH")
    return b


def _paged_decode_bsnd():
    b = _paged_decode_bnsd()
    b.update(query=t(2, 1, 2, 16), input_layout="BSND")
    return b


def _paged_prefill():
    # Q_S = 4 > 1: block_size 128; lengths [200, 50] -> 2 + 1 blocks of 3
    return dict(api="fused", query=t(2, 2, 4, 16), key=t(3, 2, 128, 16), value=t(3, 2, 128, 16), num_heads=2,
                input_layout="BNSD", scale=0.25, block_table=torch.tensor([[2, 0], [1, -1]], dtype=I32),
                block_size=128, actual_seq_lengths_kv=[200, 50], actual_seq_lengths=[4, 3])


def _paged_tnd():
    # TND decode (every query length 1), per-batch KV lengths with paged KV; block_size 128 (SPEC 14b.4 T14:
    # 128, 512 or 1024 for paged TND)
    return dict(api="fused", query=t(3, 2, 128, dtype=BF16), key=t(4, 128, 256, dtype=BF16),
                value=t(4, 128, 256, dtype=BF16), num_heads=2, input_layout="TND", scale=0.1,
                block_table=torch.tensor([[0, 2], [1, -1], [3, -1]], dtype=I32), block_size=128,
                actual_seq_lengths=[1, 2, 3], actual_seq_lengths_kv=[20, 9, 16])


def _paged_incre():
    return dict(api="incre", query=t(2, 1, 32), key=t(4, 16, 32), value=t(4, 16, 32), num_heads=2,
                input_layout="BSH", scale_value=0.25, block_table=torch.tensor(BT, dtype=I32), block_size=16,
                actual_seq_lengths=[20, 9])


def _paged_int8():
    # int8 K/V (antiquant, per-tensor) on a paged cache: block_size 32 for int8 decode
    return dict(api="fused", query=t(2, 2, 1, 32), key=torch.randint(-9, 9, (3, 32, 64), dtype=I8),
                value=torch.randint(-9, 9, (3, 32, 64), dtype=I8), num_heads=2, input_layout="BNSD",
                scale=0.2, block_table=torch.tensor([[2], [0]], dtype=I32), block_size=32,
                actual_seq_lengths_kv=[20, 32], antiquant_scale=torch.tensor([0.05, 0.05], dtype=F16))


def _paged_mla():
    # DeepSeek: latent (D 512) as key and value, rope 64, KV_N 1, BSND, Q_S 2, sparse 3 + template
    latent = t(2, 128, 512, dtype=BF16)
    return dict(api="fused", query=t(1, 2, 16, 512, dtype=BF16), key=latent, value=latent,
                query_rope=t(1, 2, 16, 64, dtype=BF16), key_rope=t(2, 128, 64, dtype=BF16), num_heads=16,
                num_key_value_heads=1, input_layout="BSND", scale=0.07, block_table=torch.tensor([[1, 0]], dtype=I32),
                block_size=128, actual_seq_lengths_kv=[200], sparse_mode=3,
                atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1))


def _left_pad():
    return dict(api="fused", query=t(2, 2, 4, 16), key=t(2, 2, 6, 16), value=t(2, 2, 6, 16), num_heads=2,
                input_layout="BNSD", scale=0.25, query_padding_size=pad(1), kv_padding_size=pad(1),
                actual_seq_lengths=[2, 3], actual_seq_lengths_kv=[4, 5])


def _tnd():
    return dict(api="fused", query=t(6, 2, 128, dtype=BF16), key=t(8, 2, 128, dtype=BF16),
                value=t(8, 2, 128, dtype=BF16), num_heads=2, input_layout="TND", scale=0.1,
                actual_seq_lengths=[2, 6], actual_seq_lengths_kv=[3, 8])


def _prefix():
    return dict(api="fused", query=t(2, 2, 4, 16), key=t(2, 2, 6, 16), value=t(2, 2, 6, 16), num_heads=2,
                input_layout="BNSD", scale=0.25, key_shared_prefix=t(1, 2, 5, 16), value_shared_prefix=t(1, 2, 5, 16),
                actual_shared_prefix_len=[3])


def _prefix_bsh():
    return dict(api="fused", query=t(2, 4, 32), key=t(2, 6, 32), value=t(2, 6, 32), num_heads=2,
                input_layout="BSH", scale=0.25, key_shared_prefix=t(1, 5, 32), value_shared_prefix=t(1, 5, 32))


def _prefix_mask():
    b = _prefix()
    b.update(atten_mask=torch.zeros(4, 3 + 6, dtype=torch.bool), sparse_mode=1)
    return b


def _prefix_pse():
    b = _prefix()
    b.update(pse_shift=t(2, 2, 4, 3 + 6))
    return b


def _int8_full():
    # full int8 quantization (prefill): the combination prefix / paged must be refused
    return dict(api="fused", query=torch.randint(-9, 9, (2, 2, 4, 32), dtype=I8),
                key=torch.randint(-9, 9, (2, 2, 6, 32), dtype=I8), value=torch.randint(-9, 9, (2, 2, 6, 32), dtype=I8),
                num_heads=2, input_layout="BNSD", scale=0.2, dequant_scale1=torch.tensor([0.01]),
                quant_scale1=torch.tensor([100.0]), dequant_scale2=torch.tensor([0.01]))


def _rope():
    return dict(api="fused", query=t(2, 2, 4, 16), key=t(2, 2, 6, 16), value=t(2, 2, 6, 16), num_heads=2,
                input_layout="BNSD", scale=0.25, query_rope=t(2, 2, 4, 64), key_rope=t(2, 2, 6, 64))


def _rope_bsh_decode():
    return dict(api="fused", query=t(2, 1, 32), key=t(2, 6, 32), value=t(2, 6, 32), num_heads=2,
                input_layout="BSH", scale=0.25, query_rope=t(2, 1, 128), key_rope=t(2, 6, 128))


def _tensor_list():
    return dict(api="fused", query=t(2, 2, 1, 16), key=[t(1, 2, 5, 16), t(1, 2, 7, 16)],
                value=[t(1, 2, 5, 16), t(1, 2, 7, 16)], num_heads=2, input_layout="BNSD", scale=0.25)


BASES: Dict[str, Callable[[], Dict[str, Any]]] = {
    "paged_decode_bnsd": _paged_decode_bnsd, "paged_decode_4d": _paged_decode_4d, "paged_decode_bsh": _paged_decode_bsh,
    "paged_decode_bsnd": _paged_decode_bsnd, "paged_prefill": _paged_prefill, "paged_tnd": _paged_tnd,
    "paged_incre": _paged_incre, "paged_int8": _paged_int8, "paged_mla": _paged_mla, "left_pad": _left_pad,
    "tnd": _tnd, "prefix": _prefix, "prefix_bsh": _prefix_bsh, "prefix_mask": _prefix_mask,
    "prefix_pse": _prefix_pse, "int8_full": _int8_full, "rope": _rope, "rope_bsh_decode": _rope_bsh_decode,
    "tensor_list": _tensor_list,
}


@dataclass
class Case:
    id: str
    base: str
    names: Tuple[str, ...]
    changes: Dict[str, Any] = field(default_factory=dict)
    status: int = INVALID
    mode: str = "strict"

    def build(self) -> Dict[str, Any]:
        call = BASES[self.base]()
        for k, v in self.changes.items():
            call[k] = v(call) if callable(v) and not isinstance(v, torch.Tensor) else v
        return call


def case(id, base, names, status=INVALID, mode="strict", **changes):
    return Case(id, base, (names,) if isinstance(names, str) else tuple(names), changes, status, mode)


def params(cases):
    return [pytest.param(c, id=c.id) for c in cases]


# --- positive controls ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("base", sorted(BASES))
def test_base_call_is_valid(base):
    out = run_ok(BASES[base]())
    assert isinstance(out, torch.Tensor)
    assert torch.isfinite(out.float()).all()


def _cache(nb, bs, h, dtype=F16):
    return t(nb, bs, h, dtype=dtype)


# --- paged KV -----------------------------------------------------------------------------------------------
PAGED = [
    # required tensors keep 161001 with paged KV
    case("paged-key-None", "paged_decode_bnsd", "key", status=NULLPTR, key=None),
    case("paged-value-None", "paged_decode_bnsd", "value", status=NULLPTR, value=None),
    # block_size (SPEC 8): positive, <= 512, alignment (strict)
    case("block_size-0", "paged_decode_bnsd", "block_size", block_size=0),
    case("block_size-0-portable", "paged_decode_bnsd", "block_size", mode="portable", block_size=0),
    case("block_size-negative", "paged_decode_bnsd", "block_size", block_size=-16),
    case("block_size-float", "paged_decode_bnsd", "block_size", block_size=16.0),
    case("block_size-528-strict", "paged_decode_bnsd", "block_size", block_size=528,
         key=_cache(2, 528, 32), value=_cache(2, 528, 32), block_table=torch.tensor([[1], [0]], dtype=I32)),
    case("block_size-1024-strict-prefill", "paged_prefill", "block_size", block_size=1024,
         key=t(2, 2, 1024, 16), value=t(2, 2, 1024, 16), block_table=torch.tensor([[1], [0]], dtype=I32)),
    case("block_size-24-fp16-decode-strict", "paged_decode_bnsd", "block_size", block_size=24,
         key=_cache(3, 24, 32), value=_cache(3, 24, 32)),
    case("block_size-8-bf16-decode-strict", "paged_tnd", "block_size", block_size=8,
         key=_cache(8, 8, 256, BF16), value=_cache(8, 8, 256, BF16),
         block_table=torch.tensor([[0, 1, 2], [3, 4, -1], [5, 6, -1]], dtype=I32)),
    case("block_size-16-int8-decode-strict", "paged_int8", "block_size", block_size=16,
         key=torch.zeros(4, 16, 64, dtype=I8), value=torch.zeros(4, 16, 64, dtype=I8),
         block_table=torch.tensor([[0, 1], [2, 3]], dtype=I32)),
    case("block_size-64-prefill-strict", "paged_prefill", "block_size", block_size=64,
         key=t(5, 2, 64, 16), value=t(5, 2, 64, 16),
         block_table=torch.tensor([[0, 1, 2, 3], [4, -1, -1, -1]], dtype=I32)),
    case("block_size-16-mla-prefill-strict", "paged_mla", "block_size", block_size=16,
         key=lambda b: t(13, 16, 512, dtype=BF16), value=lambda b: b["key"], key_rope=t(13, 16, 64, dtype=BF16),
         block_table=torch.arange(13, dtype=I32)[None]),
    case("block_size-vs-cache-block-axis", "paged_decode_bnsd", "block_size", block_size=32),
    case("block_size-vs-cache-block-axis-4d", "paged_decode_4d", "block_size", block_size=32),
    # block_table rank / dtype / shape
    case("table-1d", "paged_decode_bnsd", "block_table", block_table=lambda b: b["block_table"][0]),
    case("table-3d", "paged_decode_bnsd", "block_table", block_table=lambda b: b["block_table"][None]),
    case("table-int64-strict", "paged_decode_bnsd", "block_table", block_table=lambda b: b["block_table"].long()),
    case("table-float32", "paged_decode_bnsd", "block_table", block_table=lambda b: b["block_table"].float()),
    case("table-float32-portable", "paged_decode_bnsd", "block_table", mode="portable",
         block_table=lambda b: b["block_table"].float()),
    case("table-int16", "paged_decode_bnsd", "block_table", block_table=lambda b: b["block_table"].short()),
    case("table-list", "paged_decode_bnsd", "block_table", block_table=BT),
    case("table-rows-gt-B", "paged_decode_bnsd", "block_table",
         block_table=torch.tensor(BT + [[2, -1]], dtype=I32)),
    case("table-rows-lt-B", "paged_decode_bnsd", "block_table", block_table=torch.tensor(BT[:1], dtype=I32)),
    # the documents put this rule on block_table (max_blocks >= ceil(max act_kv / block_size)); it involves
    # actual_seq_lengths_kv just as much
    case("table-too-few-columns", "paged_decode_bnsd", ("block_table", "actual_seq_lengths_kv"),
         block_table=torch.tensor([[3], [1]], dtype=I32)),
    case("table-rows-vs-tnd-batches", "paged_tnd", "block_table",
         block_table=torch.tensor([[0, 2], [1, -1]], dtype=I32)),
    # block ids of used entries in [0, blocknum) (SPEC 8, 15.7) -- semantic: also in portable mode
    case("id-eq-blocknum", "paged_decode_bnsd", "block_table", block_table=torch.tensor([[3, 4], [1, -1]], dtype=I32)),
    case("id-huge", "paged_decode_bnsd", "block_table", block_table=torch.tensor([[3, 0], [2 ** 31 - 1, -1]], dtype=I32)),
    case("id-minus1-used", "paged_decode_bnsd", "block_table", block_table=torch.tensor([[3, -1], [1, -1]], dtype=I32)),
    case("id-negative-used-portable", "paged_decode_bnsd", "block_table", mode="portable",
         block_table=torch.tensor([[-2, 0], [1, -1]], dtype=I32)),
    case("id-out-of-range-last-partial-block", "paged_prefill", "block_table",
         block_table=torch.tensor([[2, 0], [3, -1]], dtype=I32)),
    case("id-out-of-range-4d", "paged_decode_4d", "block_table", block_table=torch.tensor([[3, 0], [9, -1]], dtype=I32)),
    case("id-out-of-range-tnd", "paged_tnd", "block_table",
         block_table=torch.tensor([[0, 2], [1, -1], [4, -1]], dtype=I32)),
    case("id-out-of-range-incre", "paged_incre", "block_table",
         block_table=torch.tensor([[3, 0], [1, 4]], dtype=I32), actual_seq_lengths=[20, 17]),
    # KV lengths: required, within max_blocks x block_size
    case("kv-lengths-missing", "paged_decode_bnsd", "actual_seq_lengths_kv", actual_seq_lengths_kv=None),
    case("kv-lengths-missing-prefill", "paged_prefill", "actual_seq_lengths_kv", actual_seq_lengths_kv=None),
    case("kv-lengths-missing-tnd", "paged_tnd", "actual_seq_lengths_kv", actual_seq_lengths_kv=None),
    case("kv-lengths-missing-incre", "paged_incre", "actual_seq_lengths", actual_seq_lengths=None),
    case("kv-lengths-over-capacity", "paged_decode_bnsd", "actual_seq_lengths_kv", actual_seq_lengths_kv=[33, 9]),
    case("kv-lengths-negative", "paged_decode_bnsd", "actual_seq_lengths_kv", actual_seq_lengths_kv=[20, -1]),
    case("kv-lengths-count-tnd", "paged_tnd", "actual_seq_lengths_kv", actual_seq_lengths_kv=[20, 9]),
    # cache tensors
    case("cache-4d-with-BSH", "paged_decode_bsh", "key", key=t(4, 2, 16, 16), value=t(4, 2, 16, 16)),
    case("cache-4d-with-BSND", "paged_decode_bsnd", "key", key=t(4, 2, 16, 16), value=t(4, 2, 16, 16)),
    case("cache-4d-kv-heads-axis", "paged_decode_4d", "key", key=t(4, 1, 16, 16),
         value=t(4, 1, 16, 16)),
    case("cache-3d-H-not-divisible", "paged_decode_bnsd", "key", key=t(4, 16, 33),
         value=t(4, 16, 33)),
    case("cache-rank-2", "paged_decode_bnsd", "key", key=t(64, 32), value=t(64, 32)),
    case("cache-key-D-vs-query", "paged_decode_4d", "key", key=t(4, 2, 16, 32), value=t(4, 2, 16, 32)),
    case("cache-value-blocknum", "paged_decode_bnsd", "value", value=t(5, 16, 32)),
    case("cache-value-block-axis", "paged_decode_4d", "value", value=t(4, 2, 32, 16)),
    case("cache-value-rank", "paged_decode_bnsd", "value", value=t(4, 2, 16, 16)),
    case("cache-value-dtype", "paged_decode_bnsd", ("value", "key"), value=lambda b: b["value"].to(BF16)),
    case("cache-value-D-differs-without-rope", "paged_decode_4d", "value", value=t(4, 2, 16, 32)),
    # masks / pse must cover max_blocks x block_size positions
    case("mask-cols-lt-blocks-decode", "paged_decode_bnsd", "atten_mask",
         atten_mask=torch.zeros(2, 20, dtype=torch.bool)),
    case("mask-cols-lt-blocks-prefill", "paged_prefill", "atten_mask", sparse_mode=1,
         atten_mask=torch.zeros(4, 200, dtype=torch.bool)),
    case("pse-cols-lt-blocks-decode", "paged_decode_bnsd", "pse_shift", pse_shift=t(2, 2, 1, 20)),
    case("pse-cols-lt-blocks-prefill", "paged_prefill", "pse_shift", pse_shift=t(2, 2, 4, 255)),
    case("per-token-scale-lt-blocks", "paged_int8", "antiquant_scale", antiquant_mode=1,
         antiquant_scale=torch.full((2, 2, 31), 0.05)),
    # key_rope cache follows the key cache
    case("key_rope-cache-blocknum", "paged_mla", "key_rope", key_rope=t(3, 128, 64, dtype=BF16)),
    case("key_rope-cache-rank", "paged_mla", "key_rope", key_rope=t(2, 1, 128, 64, dtype=BF16)),
    case("key_rope-cache-D", "paged_mla", "key_rope", key_rope=t(2, 128, 32, dtype=BF16)),
    # unsupported combinations (SPEC 8)
    case("paged-with-query-left-padding", "paged_prefill", ("query_padding_size", "block_table"),
         query_padding_size=pad(1)),
    case("paged-with-kv-left-padding", "paged_decode_bnsd", ("kv_padding_size", "block_table"),
         kv_padding_size=pad(0)),
    case("paged-with-kv-left-padding-incre", "paged_incre", ("kv_padding_size", "block_table"),
         kv_padding_size=pad(2)),
    case("paged-with-tensor-list", "tensor_list", ("block_table", "key"), block_table=torch.tensor(BT, dtype=I32),
         block_size=16, actual_seq_lengths_kv=[5, 7]),
    case("paged-with-prefix", "paged_decode_4d", ("key_shared_prefix", "block_table"),
         key_shared_prefix=t(1, 2, 5, 16), value_shared_prefix=t(1, 2, 5, 16)),
    case("paged-with-int8-query", "int8_full", ("block_table", "query"), key=torch.zeros(2, 2, 128, 32, dtype=I8),
         value=torch.zeros(2, 2, 128, 32, dtype=I8), block_table=torch.tensor([[0], [1]], dtype=I32), block_size=128,
         actual_seq_lengths_kv=[6, 6]),
]


@pytest.mark.parametrize("c", params(PAGED))
def test_paged_invalid(c):
    assert_input_error(c.build(), c.names, c.status, c.mode)


def test_block_id_error_is_clear():
    """SPEC 15.7: a bad id is a clear error naming the table, the id and the pool size."""
    call = _paged_decode_bnsd()
    call["block_table"] = torch.tensor([[3, 0], [7, -1]], dtype=I32)
    err = assert_input_error(call, ["block_table"])
    msg = str(err)
    assert "7" in msg and "4" in msg, msg


@pytest.mark.case(q_s=1)
def test_3d_cache_h_over_65535():
    """(blocknum, block_size, H) with H = KV_N*D > 65535: a hardware error in strict mode (hint: the 4-D
    cache); portable mode and the 4-D cache accept the same data."""
    n, d = 128, 512                              # H = 65536
    q = t(1, n, 1, d)
    kc = torch.zeros(1, 16, n * d, dtype=F16)
    call = dict(api="fused", query=q, key=kc, value=kc, num_heads=n, input_layout="BNSD", scale=0.05,
                block_table=torch.tensor([[0]], dtype=I32), block_size=16, actual_seq_lengths_kv=[16])
    assert_input_error(call, ["key", "value"])
    out = run_ok(call, mode="portable")
    assert out.shape == q.shape and (out == 0).all()
    call4 = dict(call, key=kc.reshape(1, 16, n, d).transpose(1, 2), value=kc.reshape(1, 16, n, d).transpose(1, 2))
    assert run_ok(call4).shape == q.shape
    call_ok = dict(call, query=t(1, n, 1, d - 16), key=torch.zeros(1, 16, n * (d - 16), dtype=F16),
                   value=torch.zeros(1, 16, n * (d - 16), dtype=F16))   # H = 63488 <= 65535
    assert run_ok(call_ok).shape == (1, n, 1, d - 16)


def test_nz_cache_reads_like_the_4d_cache():
    """SPEC 8b: the 5-D NZ cache (blocknum, KV_N, D/16, block_size, 16) holds the 4-D cache's values in 16-element
    fragments: the same call gives the same result on either (tests/semantics/test_storage_nz.py: the V4 scenarios)."""
    call = _paged_decode_4d()
    nz = {name: call[name].reshape(4, 2, 16, 1, 16).permute(0, 1, 3, 2, 4).contiguous() for name in ("key", "value")}
    assert torch.equal(run_ok(dict(call, **nz), mode="portable"), run_ok(call, mode="portable"))


@pytest.mark.case(q_s=1)
@pytest.mark.parametrize("bs", [1, 24, 520], ids=lambda x: f"bs{x}")
def test_portable_mode_lifts_block_size_rules(bs):
    """The block_size rules are hardware-only (SPEC 1.4): portable mode accepts any positive block size."""
    call = _paged_decode_bnsd()
    nblk = (20 + bs - 1) // bs
    call.update(block_size=bs, key=_cache(2 * nblk, bs, 32), value=_cache(2 * nblk, bs, 32),
                block_table=torch.arange(2 * nblk, dtype=I32).reshape(2, nblk))
    assert_input_error(call, ["block_size"])
    assert run_ok(call, mode="portable").shape == call["query"].shape


def test_portable_prefill_block_size_16():
    call = _paged_prefill()
    call.update(block_size=16, key=t(17, 2, 16, 16), value=t(17, 2, 16, 16),
                block_table=torch.arange(26, dtype=I32).clamp(max=16).reshape(2, 13))
    assert_input_error(call, ["block_size"])
    assert run_ok(call, mode="portable").shape == call["query"].shape


@pytest.mark.case(q_s=1)
def test_portable_int64_table():
    call = _paged_decode_bnsd()
    call["block_table"] = call["block_table"].long()
    assert_input_error(call, ["block_table"])
    run_ok(call, mode="portable")


# --- left padding ---------------------------------------------------------------------------------------------
PADDING = [
    # one element or B (= 2) elements are valid (DECISIONS 41): three are not
    case("query_padding_size-three-elements", "left_pad", "query_padding_size",
         query_padding_size=torch.tensor([1, 2, 3])),
    case("kv_padding_size-two-elements", "left_pad", "kv_padding_size", kv_padding_size=torch.tensor([[1], [1]])),
    case("query_padding_size-empty", "left_pad", "query_padding_size",
         query_padding_size=torch.tensor([], dtype=I64)),
    case("query_padding_size-float", "left_pad", "query_padding_size", query_padding_size=torch.tensor([1.0])),
    case("kv_padding_size-float", "left_pad", "kv_padding_size", kv_padding_size=torch.tensor([1.0])),
    case("kv_padding_size-bool", "left_pad", "kv_padding_size", kv_padding_size=torch.tensor([True])),
    case("kv_padding_size-string", "left_pad", "kv_padding_size", kv_padding_size="1"),
    case("query_padding_size-with-TND", "tnd", "query_padding_size", query_padding_size=pad(0)),
    case("kv_padding_size-with-TND", "tnd", "kv_padding_size", kv_padding_size=pad(1)),
    case("left-padding-lengths-still-checked", "left_pad", "actual_seq_lengths_kv", actual_seq_lengths_kv=[4, 7]),
]


@pytest.mark.parametrize("c", params(PADDING))
def test_left_padding_invalid(c):
    assert_input_error(c.build(), c.names, c.status, c.mode)


# --- shared prefix -------------------------------------------------------------------------------------------
PREFIX = [
    case("key_shared_prefix-alone", "prefix", "value_shared_prefix", value_shared_prefix=None),
    case("value_shared_prefix-alone", "prefix", "key_shared_prefix", key_shared_prefix=None),
    case("key_shared_prefix-batch-2", "prefix", "key_shared_prefix",
         key_shared_prefix=t(2, 2, 5, 16), value_shared_prefix=t(2, 2, 5, 16)),
    case("value_shared_prefix-batch-2", "prefix", "value_shared_prefix", value_shared_prefix=t(2, 2, 5, 16)),
    case("key_shared_prefix-rank", "prefix", "key_shared_prefix", key_shared_prefix=t(2, 5, 16),
         value_shared_prefix=t(2, 5, 16)),
    case("key_shared_prefix-dtype", "prefix", "key_shared_prefix",
         key_shared_prefix=lambda b: b["key_shared_prefix"].to(BF16),
         value_shared_prefix=lambda b: b["value_shared_prefix"].to(BF16)),
    case("value_shared_prefix-dtype", "prefix", "value_shared_prefix",
         value_shared_prefix=lambda b: b["value_shared_prefix"].to(BF16)),
    case("key_shared_prefix-not-tensor", "prefix", "key_shared_prefix",
         key_shared_prefix=lambda b: b["key_shared_prefix"].tolist()),
    case("key_shared_prefix-N", "prefix", "key_shared_prefix", key_shared_prefix=t(1, 1, 5, 16),
         value_shared_prefix=t(1, 1, 5, 16)),
    case("key_shared_prefix-D", "prefix", "key_shared_prefix", key_shared_prefix=t(1, 2, 5, 32),
         value_shared_prefix=t(1, 2, 5, 32)),
    case("value_shared_prefix-D", "prefix", "value_shared_prefix", value_shared_prefix=t(1, 2, 5, 32)),
    case("value_shared_prefix-S", "prefix", ("value_shared_prefix", "key_shared_prefix"),
         value_shared_prefix=t(1, 2, 4, 16)),
    case("key_shared_prefix-BSH-H", "prefix_bsh", "key_shared_prefix", key_shared_prefix=t(1, 5, 16),
         value_shared_prefix=t(1, 5, 16)),
    case("value_shared_prefix-BSH-H", "prefix_bsh", "value_shared_prefix", value_shared_prefix=t(1, 5, 64)),
    case("actual_shared_prefix_len-gt-S", "prefix", "actual_shared_prefix_len", actual_shared_prefix_len=[6]),
    case("actual_shared_prefix_len-negative", "prefix", "actual_shared_prefix_len", actual_shared_prefix_len=[-1]),
    case("actual_shared_prefix_len-two", "prefix", "actual_shared_prefix_len", actual_shared_prefix_len=[2, 2]),
    case("actual_shared_prefix_len-empty", "prefix", "actual_shared_prefix_len", actual_shared_prefix_len=[]),
    case("actual_shared_prefix_len-float", "prefix", "actual_shared_prefix_len", actual_shared_prefix_len=[2.5]),
    case("actual_shared_prefix_len-tensor-2d", "prefix", "actual_shared_prefix_len",
         actual_shared_prefix_len=torch.tensor([[3]])),
    case("actual_shared_prefix_len-without-prefix", "prefix", "actual_shared_prefix_len",
         key_shared_prefix=None, value_shared_prefix=None),
    # masks / pse count the prefix columns first: P + KV_S columns are needed
    case("mask-without-prefix-columns", "prefix_mask", "atten_mask", atten_mask=torch.zeros(4, 6, dtype=torch.bool)),
    case("mask-decode-without-prefix-columns", "prefix", "atten_mask", query=t(2, 2, 1, 16),
         atten_mask=torch.zeros(2, 8, dtype=torch.bool)),
    case("pse-without-prefix-columns", "prefix_pse", "pse_shift", pse_shift=t(2, 2, 4, 8)),
    # SPEC 14: in mode 0 |pre_tokens| < KV_S + prefix when negative (KV_S 6 + P 3 = 9)
    case("prefix-negative-pre-reaches-KV_S-plus-P", "prefix_mask", "pre_tokens", sparse_mode=0, pre_tokens=-9,
         next_tokens=20),
    # not combinable (SPEC 7)
    case("prefix-with-paged", "paged_decode_4d", ("key_shared_prefix", "block_table"),
         key_shared_prefix=t(1, 2, 5, 16), value_shared_prefix=t(1, 2, 5, 16)),
    case("prefix-with-query-left-padding", "prefix", ("key_shared_prefix", "query_padding_size"),
         query_padding_size=pad(1), actual_seq_lengths=[2, 3]),
    case("prefix-with-kv-left-padding", "prefix", ("key_shared_prefix", "kv_padding_size"),
         kv_padding_size=pad(1), actual_seq_lengths_kv=[2, 3]),
    case("prefix-with-tensor-list", "tensor_list", ("key_shared_prefix", "key"),
         key_shared_prefix=t(1, 2, 5, 16), value_shared_prefix=t(1, 2, 5, 16)),
    case("prefix-with-int8-query", "int8_full", ("key_shared_prefix", "query"),
         key_shared_prefix=torch.zeros(1, 2, 5, 32, dtype=I8), value_shared_prefix=torch.zeros(1, 2, 5, 32, dtype=I8)),
    case("prefix-with-TND", "tnd", "key_shared_prefix", key_shared_prefix=t(3, 2, 128, dtype=BF16),
         value_shared_prefix=t(3, 2, 128, dtype=BF16)),
    case("prefix-with-rope", "rope", ("key_shared_prefix", "query_rope"), key_shared_prefix=t(1, 2, 5, 16),
         value_shared_prefix=t(1, 2, 5, 16)),
]


@pytest.mark.parametrize("c", params(PREFIX))
def test_prefix_invalid(c):
    assert_input_error(c.build(), c.names, c.status, c.mode)


# --- MLA rope ------------------------------------------------------------------------------------------------
ROPE = [
    case("query_rope-alone", "rope", "key_rope", key_rope=None),
    case("key_rope-alone", "rope", "query_rope", query_rope=None),
    case("query_rope-alone-paged", "paged_mla", "key_rope", key_rope=None),
    case("key_rope-alone-paged", "paged_mla", "query_rope", query_rope=None),
    case("rope-D32-strict", "rope", "query_rope", query_rope=t(2, 2, 4, 32), key_rope=t(2, 2, 6, 32)),
    case("rope-D128-strict", "rope", "query_rope", query_rope=t(2, 2, 4, 128), key_rope=t(2, 2, 6, 128)),
    case("rope-BSH-H-strict", "rope_bsh_decode", "query_rope", query_rope=t(2, 1, 64), key_rope=t(2, 6, 64)),
    case("key_rope-D-vs-query_rope", "rope", "key_rope", key_rope=t(2, 2, 6, 32)),
    case("key_rope-D-vs-query_rope-portable", "rope", "key_rope", mode="portable",
         query_rope=t(2, 2, 4, 32), key_rope=t(2, 2, 6, 16)),
    case("query_rope-dtype", "rope", "query_rope", query_rope=lambda b: b["query_rope"].to(BF16)),
    case("key_rope-dtype", "rope", "key_rope", key_rope=lambda b: b["key_rope"].to(BF16)),
    case("query_rope-float32-portable", "rope", "query_rope", mode="portable",
         query_rope=lambda b: b["query_rope"].float()),
    case("query_rope-Q_S", "rope", "query_rope", query_rope=t(2, 2, 3, 64)),
    case("query_rope-N", "rope", "query_rope", query_rope=t(2, 1, 4, 64)),
    case("query_rope-B", "rope", "query_rope", query_rope=t(1, 2, 4, 64)),
    case("query_rope-rank", "rope", "query_rope", query_rope=t(2, 4, 128)),
    case("key_rope-S", "rope", "key_rope", key_rope=t(2, 2, 5, 64)),
    case("key_rope-N", "rope", "key_rope", key_rope=t(2, 1, 6, 64)),
    case("query_rope-not-tensor", "rope", "query_rope", query_rope=lambda b: b["query_rope"].tolist()),
    case("rope-with-tensor-list", "tensor_list", "key_rope", query_rope=t(2, 2, 1, 64),
         key_rope=t(2, 2, 7, 64)),
]


@pytest.mark.parametrize("c", params(ROPE))
def test_rope_invalid(c):
    assert_input_error(c.build(), c.names, c.status, c.mode)


def test_rope_portable_other_dims_ok():
    call = _rope()
    call.update(query_rope=t(2, 2, 4, 32), key_rope=t(2, 2, 6, 32))
    assert run_ok(call, mode="portable").shape == call["query"].shape


def test_rope_dv_differs_ok_dense_not_without_rope():
    """Dv != D is accepted with rope (output D = Dv) and refused without it (BNSD, SPEC 2)."""
    call = _rope()
    call["value"] = t(2, 2, 6, 32)
    assert run_ok(call).shape == (2, 2, 4, 32)
    call.pop("query_rope"), call.pop("key_rope")
    assert_input_error(call, ["value"])


def test_prefix_negative_pre_below_kv_s_plus_p_is_valid():
    """-pre_tokens = KV_S + P - 1 is still valid in mode 0 (the prefix extends the KV axis)."""
    call = _prefix_mask()
    call.update(sparse_mode=0, pre_tokens=-8, next_tokens=20)
    assert run_ok(call).shape == call["query"].shape
