"""The parse memo (fia/parse/memo.py) and the memoized backend choice: a call that only differs in what the
memo must not conflate (types, float signs, validation mode, tensor metadata) parses as if it were new."""
import gc
import weakref

import pytest
import torch

import fia
from fia import api
from fia.backends import registry
from fia.errors import FiaInputError
from fia.parse import core, memo

B, N, KV_N, S, D = 2, 4, 2, 16, 32


def call_args(q=None, k=None, v=None, **kw):
    """The argument dict npu_fused_infer_attention_score hands its parse step (defaults filled in)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, N, 1, D, generator=g).to(torch.float16) if q is None else q
    k = torch.randn(B, KV_N, S, D, generator=g).to(torch.float16) if k is None else k
    v = torch.randn(B, KV_N, S, D, generator=g).to(torch.float16) if v is None else v
    a = dict(api.npu_fused_infer_attention_score.__kwdefaults__)
    a.update(num_heads=N, num_key_value_heads=KV_N, input_layout="BNSD", scale=0.125)
    a.update(kw)
    return dict(query=q, key=k, value=v, **a)


def fields(p):
    """Every field of a problem except its tensors (compared by their metadata)."""
    d = dict(p.__dict__)
    d.pop("memo_key")
    q, kv = d.pop("query"), d.pop("kv")
    return d, (q.dtype, q.shape, q.stride()), (kv.kind, kv.key.shape, kv.key.stride(), kv.value.shape)


@pytest.mark.parametrize("layout", ["BNSD", "BSH", "BSND", "TND"])
def test_recalled_problem_equals_a_full_parse(layout):
    if layout == "TND":
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(t, n, D, generator=g).to(torch.bfloat16) for t, n in ((3, N), (20, KV_N), (20, KV_N)))
        a = call_args(q, k, v, input_layout="TND", actual_seq_lengths=[1, 3], actual_seq_lengths_kv=[12, 20])
    else:
        from util import to_layout
        a = call_args()
        a = call_args(*(to_layout(a[n], layout) for n in ("query", "key", "value")), input_layout=layout)
    first = core.parse_fused(a)
    again = core.parse_fused(dict(a))
    assert first.memo_key is not None and again.memo_key == first.memo_key
    assert fields(again) == fields(core._parse(a, "npu_fused_infer_attention_score", None, False))
    assert again.query.data_ptr() == a["query"].data_ptr() and again.kv.key.data_ptr() == a["key"].data_ptr()


def test_new_tensors_same_metadata_are_read():
    a = call_args()
    core.parse_fused(a)
    b = call_args(*(torch.ones_like(a[n]) for n in ("query", "key", "value")))
    out, _ = fia.npu_fused_infer_attention_score(b.pop("query"), b.pop("key"), b.pop("value"), **b)
    assert torch.equal(out, torch.ones_like(out))


@pytest.mark.parametrize("name,good,bad", [("num_heads", N, float(N)), ("sparse_mode", 0, False),
                                           ("inner_precise", 1, True), ("actual_seq_lengths_kv", [S], [True]),
                                           ("actual_seq_lengths_kv", [S], (S, 2.0))])
def test_types_are_part_of_the_signature(name, good, bad):
    core.parse_fused(call_args(**{name: good}))
    with pytest.raises(FiaInputError):
        core.parse_fused(call_args(**{name: bad}))


def test_float_sign_is_part_of_the_signature():
    assert core.parse_fused(call_args(scale=0.0)).scale == 0.0
    p = core.parse_fused(call_args(scale=-0.0))
    assert str(p.scale) == "-0.0"


def test_validation_mode_is_part_of_the_signature():
    a = call_args(*(t.float() for t in call_args().values() if isinstance(t, torch.Tensor)))
    with fia.validation_mode("portable"):
        core.parse_fused(a)
        core.parse_fused(a)
    with pytest.raises(FiaInputError, match="float32"):
        core.parse_fused(a)          # float32 is a hardware-only rule: strict mode rejects it


def test_strides_are_part_of_the_signature():
    a = call_args()
    p = core.parse_fused(a)
    k = a["key"].transpose(2, 3).contiguous().transpose(2, 3)        # same shape, other strides
    q = core.parse_fused(call_args(a["query"], k, a["value"]))
    assert q.memo_key != p.memo_key and q.kv.key.stride() == k.stride()


def test_calls_with_other_tensors_are_not_memoized():
    mask = torch.zeros(B, 1, S, dtype=torch.bool)
    a = call_args(atten_mask=mask)
    assert memo.signature(a, "x", None, False) is None
    assert core.parse_fused(a).memo_key is None
    assert memo.signature(call_args(actual_seq_lengths_kv=torch.tensor([S])), "x", None, False) is None
    assert memo.signature(call_args(q=torch.nn.Parameter(call_args()["query"])), "x", None, False) is None


def test_memo_keeps_no_tensor_alive():
    a = call_args()
    core.parse_fused(a)
    ref = weakref.ref(a["key"])
    del a
    gc.collect()
    assert ref() is None


def test_backend_choice_follows_the_forced_backend():
    a = call_args()
    p = core.parse_fused(a)
    with fia.use_backend(None):
        auto = registry.select(p)
    with fia.use_backend("reference"):
        assert registry.select(p).name == "reference"
    with fia.use_backend(None):
        assert registry.select(core.parse_fused(a)) is auto


def run(a: dict, backend: str) -> torch.Tensor:
    a = dict(a)
    with fia.use_backend(backend):
        return fia.npu_fused_infer_attention_score(a.pop("query"), a.pop("key"), a.pop("value"), **a)[0]


@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
def test_decode_plan_reuse_reads_each_calls_data(layout):
    """The decode backend plans once per signature: every later call still reads its own tensors."""
    pytest.importorskip("numba")
    from util import to_layout
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (to_layout(torch.randn(B, n, s, D, generator=g).to(torch.bfloat16), layout)
                   for n, s in ((N, 1), (KV_N, S), (KV_N, S)))
        a = call_args(q, k, v, input_layout=layout, actual_seq_lengths_kv=[S, 5])
        torch.testing.assert_close(run(a, "decode"), run(a, "reference"), atol=1e-2, rtol=1e-2)
