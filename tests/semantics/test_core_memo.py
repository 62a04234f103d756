"""The parse memo (fia/parse/memo.py) and the memoized backend choice: a call that only differs in what the
memo must not conflate (types, float signs, validation mode, tensor metadata) parses as if it were new."""
import gc
import itertools
import weakref

import pytest
import torch

import fia
from fia import eager
from fia.backends import registry
from fia.errors import FiaInputError
from fia.parse import core, memo

B, N, KV_N, S, D = 2, 4, 2, 16, 32
FRESH = itertools.count(1000)          # scales no other call used: one-off signatures


@pytest.fixture(autouse=True)
def memo_on(monkeypatch):
    """Every call computes its signature (the suite's other calls may have made the memo probe only)."""
    monkeypatch.setattr(memo, "_TRIAL", 1 << 30)


def call_args(q=None, k=None, v=None, **kw):
    """The argument dict npu_fused_infer_attention_score hands its parse step (defaults filled in)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, N, 1, D, generator=g).to(torch.float16) if q is None else q
    k = torch.randn(B, KV_N, S, D, generator=g).to(torch.float16) if k is None else k
    v = torch.randn(B, KV_N, S, D, generator=g).to(torch.float16) if v is None else v
    a = dict(eager.npu_fused_infer_attention_score.__kwdefaults__)
    a.update(num_heads=N, num_key_value_heads=KV_N, input_layout="BNSD", scale=0.125)
    a.update(kw)
    return dict(query=q, key=k, value=v, **a)


def parse(a: dict):
    """parse_fused of a call seen before (the memo stores a signature the second time it is parsed)."""
    core.parse_fused(dict(a))
    return core.parse_fused(dict(a))


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
        q, k, v = (torch.randn(t, n, 128, generator=g).to(torch.bfloat16)          # TND: D 128 (SPEC 14b.4 T16)
                   for t, n in ((3, N), (20, KV_N), (20, KV_N)))
        a = call_args(q, k, v, input_layout="TND", actual_seq_lengths=[1, 3], actual_seq_lengths_kv=[12, 20])
    else:
        from util import to_layout
        a = call_args()
        a = call_args(*(to_layout(a[n], layout) for n in ("query", "key", "value")), input_layout=layout)
    first = parse(a)
    again = core.parse_fused(dict(a))
    assert first.memo_key is not None and again.memo_key == first.memo_key
    assert fields(again) == fields(core._parse(a, "npu_fused_infer_attention_score", None, False))
    assert again.query.data_ptr() == a["query"].data_ptr() and again.kv.key.data_ptr() == a["key"].data_ptr()


def test_lookups_that_do_not_pay_off_only_probe(monkeypatch):
    monkeypatch.setattr(memo, "_TRIAL", 4)
    monkeypatch.setattr(memo, "_debt", 0)
    monkeypatch.setattr(memo, "_calls", 0)
    a = call_args()
    parse(a)                                              # stored
    for _ in range(4):                                    # 4 one-off signatures: misses
        core.parse_fused(call_args(scale=float(next(FRESH))))
    assert memo._debt == 4
    tried = [memo._wanted() for _ in range(3 * memo._PROBE)]
    assert sum(tried) == 3
    for _ in range(memo._PROBE):
        core.parse_fused(dict(a))                         # the probe among these hits: lookups resume
    assert memo._debt < 4 and all(memo._wanted() for _ in range(memo._PROBE))
    for _ in range(100):
        core.parse_fused(call_args(scale=float(next(FRESH))))
    assert memo._debt <= 2 * memo._TRIAL                 # capped: recovery takes a few probes, not 50


def test_a_signature_is_stored_the_second_time():
    a = call_args()
    memo._MEMO.clear()
    memo._SEEN.clear()
    assert core.parse_fused(dict(a)).memo_key is None
    second = core.parse_fused(dict(a))
    assert second.memo_key is not None and core.parse_fused(dict(a)).memo_key == second.memo_key


@pytest.mark.case(q_s=1)
def test_new_tensors_same_metadata_are_read():
    a = call_args()
    parse(a)
    b = call_args(*(torch.ones_like(a[n]) for n in ("query", "key", "value")))
    out, _ = fia.npu_fused_infer_attention_score(b.pop("query"), b.pop("key"), b.pop("value"), **b)
    assert torch.equal(out, torch.ones_like(out))


@pytest.mark.parametrize("name,good,bad", [("num_heads", N, float(N)), ("sparse_mode", 0, False),
                                           ("inner_precise", 1, True), ("actual_seq_lengths_kv", [S], [True]),
                                           ("actual_seq_lengths_kv", [S], (S, 2.0))])
def test_types_are_part_of_the_signature(name, good, bad):
    parse(call_args(**{name: good}))
    with pytest.raises(FiaInputError):
        core.parse_fused(call_args(**{name: bad}))


def test_float_sign_is_part_of_the_signature():
    assert parse(call_args(scale=0.0)).scale == 0.0
    p = parse(call_args(scale=-0.0))
    assert str(p.scale) == "-0.0"


def test_validation_mode_is_part_of_the_signature():
    a = call_args(*(t.float() for t in call_args().values() if isinstance(t, torch.Tensor)))
    with fia.validation_mode("portable"):
        parse(a)
        parse(a)
    with pytest.raises(FiaInputError, match="float32"):
        core.parse_fused(a)          # float32 is a hardware-only rule: strict mode rejects it


def test_strides_are_part_of_the_signature():
    a = call_args()
    p = parse(a)
    k = a["key"].transpose(2, 3).contiguous().transpose(2, 3)        # same shape, other strides
    q = parse(call_args(a["query"], k, a["value"]))
    assert q.memo_key != p.memo_key and q.kv.key.stride() == k.stride()


def test_calls_with_other_tensors_are_not_memoized():
    mask = torch.zeros(B, 1, S, dtype=torch.bool)
    a = call_args(atten_mask=mask)
    assert memo.signature(a, "x", None, False) is None
    assert parse(a).memo_key is None
    assert memo.signature(call_args(actual_seq_lengths_kv=torch.tensor([S])), "x", None, False) is None
    assert memo.signature(call_args(q=torch.nn.Parameter(call_args()["query"])), "x", None, False) is None


@pytest.mark.parametrize("mode", [2, 3, 4])
def test_template_masks_are_keyed_by_their_metadata(mode):
    """sparse modes 2-4 take the 2048 x 2048 template, which parse checks for shape and dtype only: a call with it
    is memoized by the mask's metadata (another template tensor recalls the problem; a mask of another shape or
    dtype is another signature and raises parse's error), and recalls equal a full parse."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(B, N, 6, D, generator=g).to(torch.float16)
    k, v = (torch.randn(B, KV_N, S, D, generator=g).to(torch.float16) for _ in range(2))
    tmpl = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
    extra = dict(pre_tokens=5, next_tokens=0) if mode == 4 else {}
    a = call_args(q, k, v, sparse_mode=mode, atten_mask=tmpl, **extra)
    first = parse(a)
    again = core.parse_fused(dict(a, atten_mask=torch.rand(2048, 2048, generator=g) > 0.5))   # (values ignored)
    assert first.memo_key is not None and again.memo_key == first.memo_key
    assert fields(again) == fields(core._parse(a, "npu_fused_infer_attention_score", None, False))
    assert memo.signature(dict(a, atten_mask=tmpl.to(torch.uint8)), "x", None, False) != \
        memo.signature(a, "x", None, False)
    for bad in (tmpl[:1024, :1024], tmpl.float()):
        with pytest.raises(FiaInputError, match="atten_mask"):
            parse(dict(a, atten_mask=bad))
    assert memo.signature(call_args(q, k, v, sparse_mode=0, atten_mask=tmpl[:6, :S]), "x", None, False) is None


@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
def test_paged_calls_are_recalled_over_their_own_cache_and_table(layout, monkeypatch):
    """A paged call is parsed twice, then recalled: the caches and the block table of each call (4-D and
    3-D caches), its block ids range-checked again (an id out of range runs the full parse and its error)."""
    g = torch.Generator().manual_seed(3)
    if layout == "BNSD":
        cache = torch.randn(6, KV_N, 16, D, generator=g).to(torch.float16)         # 6 blocks of 16
        q = None
    else:
        cache = torch.randn(6, 16, KV_N * D, generator=g).to(torch.float16)         # (blocknum, bs, H)
        q = torch.randn(B, 1, N * D, generator=g).to(torch.float16)
    a = call_args(q=q, k=cache, v=cache, input_layout=layout, block_size=16, actual_seq_lengths_kv=[S, 9],
                  block_table=torch.tensor([[0], [3]], dtype=torch.int32))
    first = parse(a)
    parses = []
    real = core._parse
    monkeypatch.setattr(core, "_parse", lambda *x: parses.append(1) or real(*x))
    cache2 = torch.randn(cache.shape, generator=g).to(torch.float16)
    b2 = dict(a, key=cache2, value=cache2, block_table=torch.tensor([[5], [1]], dtype=torch.int32))
    again = core.parse_fused(dict(b2))
    assert not parses, "a paged call of a stored signature must be recalled"
    assert first.memo_key is not None and again.memo_key == first.memo_key
    assert again.kv.table_host == ((5,), (1,)) and again.kv.block_table is b2["block_table"]
    assert again.kv.key.data_ptr() == cache2.data_ptr() and again.kv.key.shape == (6, KV_N, 16, D)
    monkeypatch.setattr(core, "_parse", real)
    full = core._parse(dict(b2), "npu_fused_infer_attention_score", None, False)
    assert fields(again) == fields(full) and again.kv.key.stride() == full.kv.key.stride()
    assert again.kv.blocks_used == full.kv.blocks_used == (1, 1)
    with pytest.raises(FiaInputError, match=r"block ids .* 6 at \[0, 0\]"):
        core.parse_fused(dict(a, block_table=torch.tensor([[6], [1]], dtype=torch.int32)))
    with pytest.raises(FiaInputError, match=r"-1 at \[1, 0\]"):
        core.parse_fused(dict(a, block_table=torch.tensor([[2], [-1]], dtype=torch.int32)))
    # columns past a batch's length are not in use: any id is accepted there
    wide = dict(a, block_table=torch.tensor([[0, 99], [3, -7]], dtype=torch.int32))
    parse(wide)
    assert core.parse_fused(dict(wide)).kv.table_host == ((0, 99), (3, -7))


def test_memo_keeps_no_tensor_alive():
    a = call_args()
    parse(a)
    ref = weakref.ref(a["key"])
    del a
    gc.collect()
    assert ref() is None


def test_backend_choice_follows_the_forced_backend():
    a = call_args()
    p = parse(a)
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


def _int8_call(mode: str, seed: int):
    """An int8-KV call with antiquant parameters: combined / separate, per-channel / per-token, offsets."""
    g = torch.Generator().manual_seed(seed)
    qdt = torch.float16 if mode == "separate-chan-token" else torch.bfloat16   # (the hardware's pairing)
    q = torch.randn(B, N, 1, D, generator=g).to(qdt)
    k, v = (torch.randint(-128, 128, (B, KV_N, S, D), generator=g, dtype=torch.int8) for _ in range(2))
    rnd = lambda *s, dt=qdt: (torch.rand(*s, generator=g) / 50 + 0.002).to(dt)  # noqa: E731
    kw = dict(actual_seq_lengths_kv=[S, 11], softmax_lse_flag=True)
    if mode == "combined-channel":
        kw.update(antiquant_scale=rnd(2, KV_N, 1, D), antiquant_offset=rnd(2, KV_N, 1, D), antiquant_mode=0)
    elif mode == "combined-token":
        kw.update(antiquant_scale=rnd(2, B, S, dt=torch.float32), antiquant_mode=1)
    elif mode == "separate-channel":
        kw.update(key_antiquant_scale=rnd(KV_N, D), value_antiquant_scale=rnd(KV_N, D),
                  key_antiquant_offset=rnd(KV_N, D), value_antiquant_offset=rnd(KV_N, D))
    else:                                                  # key per-channel + value per-token
        kw.update(key_antiquant_scale=rnd(1, KV_N, 1, D), value_antiquant_scale=rnd(1, B, S, dt=torch.float32),
                  key_antiquant_mode=0, value_antiquant_mode=1)
    return call_args(q, k, v, **kw)


MODES = ["combined-channel", "combined-token", "separate-channel", "separate-chan-token"]


@pytest.mark.parametrize("mode", MODES)
def test_antiquant_calls_are_recalled_over_their_own_scales(mode, monkeypatch):
    first = parse(_int8_call(mode, 0))
    assert first.memo_key is not None and first.antiquant is not None
    parses = []
    real = core._parse
    monkeypatch.setattr(core, "_parse", lambda *x: parses.append(1) or real(*x))
    b = _int8_call(mode, 1)
    again = core.parse_fused(dict(b))
    assert not parses, "an antiquant call of a stored signature must be recalled"
    monkeypatch.setattr(core, "_parse", real)
    full = core._parse(dict(b), "npu_fused_infer_attention_score", None, False)
    assert again.memo_key == first.memo_key
    d_again, d_full = fields(again), fields(full)
    aq_a, aq_f = d_again[0].pop("antiquant"), d_full[0].pop("antiquant")
    assert d_again == d_full
    for x, y in ((aq_a.key, aq_f.key), (aq_a.value, aq_f.value)):
        assert x.granularity == y.granularity
        for s, t in ((x.scale, y.scale), (x.offset, y.offset)):
            assert (s is None) == (t is None)
            if s is not None:                               # the call's own tensors, viewed as parse does
                assert s.data_ptr() == t.data_ptr() and s.shape == t.shape and s.stride() == t.stride()
                assert torch.equal(s, t)


@pytest.mark.parametrize("mode", MODES)
def test_antiquant_recall_computes_with_each_calls_scales(mode):
    """Decode (plan memoized per signature) and reference agree call after call with new scales each time."""
    pytest.importorskip("numba")
    for seed in range(3):
        a = _int8_call(mode, 10 + seed)
        torch.testing.assert_close(run(a, "decode"), run(a, "reference"), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("mode", MODES)
def test_antiquant_recipe_is_checked_against_its_parse(mode):
    """A recipe is only stored when replaying it over the parsed call gives back parse's own views."""
    a = _int8_call(mode, 3)
    p = core._parse(dict(a), "npu_fused_infer_attention_score", None, False)
    r = memo._AntiquantRecipe.of(p.antiquant, a)
    assert r is not None
    assert memo._AntiquantRecipe.of(p.antiquant, _int8_call(mode, 4)) is None      # other tensors: no match
