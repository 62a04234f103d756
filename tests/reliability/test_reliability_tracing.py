"""Graph mode reliability: fake / meta tensors, make_fx, torch.jit.trace and torch.compile decode loops.

Outside torch.compile, a call on tensors FIA cannot compute on (FakeTensor, FunctionalTensor, meta, any subclass)
or under a tracer that cannot see FIA's kernels (a dispatch mode such as make_fx's, torch.jit.trace) takes the
custom op: its fake kernel shapes the outputs, and a trace records one op node that replays the real kernel.
Every traced function here is run again on fresh random inputs and compared with the eager call on them.
"""
import random
import subprocess
import sys
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_map

import fia
from util import gen, randn, template_mask, to_layout

pytestmark = pytest.mark.backend_independent      # one run with automatic backend selection (conftest)

F16, BF16 = torch.float16, torch.bfloat16
_FIA_OPS = {"npu_fused_infer_attention_score", "npu_incre_flash_attention", "npu_prompt_flash_attention",
            "npu_fused_infer_attention_score_v2"}


# ---------------------------------------------------------------------------------------------- random cases
class Case:
    """A valid call: `fn(*tensors)` with its other arguments fixed, and `inputs(seed)` fresh tensors for it."""

    def __init__(self, name, fn, inputs):
        self.name, self.fn, self.inputs = name, fn, inputs

    def __repr__(self):
        return self.name


def _dense(g, b, n, kvn, qs, s, d, layout, dtype):
    q = to_layout(randn((b, n, qs, d), g, dtype), layout)                  # query in `layout`
    k = to_layout(randn((b, kvn, s, d), g, dtype), layout)
    v = to_layout(randn((b, kvn, s, d), g, dtype), layout)
    return q, k, v


def decode_case(seed) -> Case:
    """Decode (Q_S <= 2): fused (lse or not), incre or v2, any dense layout, GQA, per-batch KV lengths."""
    r = random.Random(seed)
    b, kvn, grp, d = r.randint(1, 3), r.choice([1, 2]), r.choice([1, 2, 4]), r.choice([16, 32, 64])
    n, s, dtype, layout = kvn * grp, r.randint(8, 80), r.choice([F16, BF16]), r.choice(["BNSD", "BSH", "BSND"])
    api = r.choice(["fused", "incre", "v2"])
    qs = 1 if api == "incre" else r.choice([1, 2])
    lens = [r.randint(1, s) for _ in range(b)]
    scale, lse = r.uniform(0.05, 0.3), r.random() < 0.5

    def fn(q, k, v):
        if api == "fused":
            return fia.npu_fused_infer_attention_score(q, k, v, num_heads=n, num_key_value_heads=kvn, scale=scale,
                                                       input_layout=layout, actual_seq_lengths_kv=lens,
                                                       softmax_lse_flag=lse)
        if api == "incre":
            return fia.npu_incre_flash_attention(q, k, v, num_heads=n, num_key_value_heads=kvn, scale_value=scale,
                                                 input_layout=layout, actual_seq_lengths=lens)
        return fia.npu_fused_infer_attention_score_v2(q, k, v, num_query_heads=n, num_key_value_heads=kvn,
                                                      softmax_scale=scale, input_layout=layout,
                                                      actual_seq_kvlen=lens, return_softmax_lse=lse)

    return Case(f"decode-{seed}-{api}-{layout}", fn,
                lambda sd: _dense(gen(sd), b, n, kvn, qs, s, d, layout, dtype))


def prefill_case(seed) -> Case:
    """Prefill: fused or prompt, a random bool mask or the causal template (sparse_mode 3), query and KV lengths."""
    r = random.Random(seed)
    b, kvn, grp, d = r.randint(1, 2), r.choice([1, 2]), r.choice([1, 2]), r.choice([16, 32])
    n, qs, dtype, layout = kvn * grp, r.randint(3, 24), r.choice([F16, BF16]), r.choice(["BNSD", "BSH", "BSND"])
    s = r.randint(qs, 48)
    api, causal = r.choice(["fused", "prompt"]), r.random() < 0.5
    q_lens, kv_lens = [r.randint(1, qs) for _ in range(b)], [r.randint(qs, s) for _ in range(b)]
    scale = r.uniform(0.05, 0.3)

    def fn(q, k, v, m):
        mode = 3 if causal else 0                          # m: the causal template, or a random user mask
        if api == "fused":
            return fia.npu_fused_infer_attention_score(q, k, v, atten_mask=m, sparse_mode=mode, num_heads=n,
                                                       num_key_value_heads=kvn, scale=scale, input_layout=layout,
                                                       actual_seq_lengths=q_lens, actual_seq_lengths_kv=kv_lens,
                                                       softmax_lse_flag=True)
        return fia.npu_prompt_flash_attention(q, k, v, atten_mask=m, sparse_mode=mode, num_heads=n,
                                              num_key_value_heads=kvn, scale_value=scale, input_layout=layout,
                                              actual_seq_lengths=q_lens, actual_seq_lengths_kv=kv_lens,
                                              next_tokens=2147483647)

    def inputs(sd):
        g = gen(sd)
        q, k, v = _dense(g, b, n, kvn, qs, s, d, layout, dtype)
        return q, k, v, template_mask() if causal else torch.rand(b, 1, qs, s, generator=g) < 0.3   # [B,1,Q_S,S]

    return Case(f"prefill-{seed}-{api}-{layout}-{'causal' if causal else 'mask'}", fn, inputs)


def paged_case(seed) -> Case:
    """Paged decode (BSH, (blocknum, block_size, H) caches): the block table is a traced input."""
    r = random.Random(seed)
    b, kvn, d, bs, nb = 2, r.choice([1, 2]), 32, 16, 6
    n, lens = 2 * kvn, [r.randint(1, 48), r.randint(1, 48)]

    def fn(q, kc, vc, table):
        return fia.npu_fused_infer_attention_score(q, kc, vc, num_heads=n, num_key_value_heads=kvn,
                                                   input_layout="BSH", block_table=table, block_size=bs,
                                                   actual_seq_lengths_kv=lens, softmax_lse_flag=True)

    def inputs(sd):
        g = gen(sd)
        table = torch.randperm(nb, generator=g)[:b * 3].reshape(b, 3).to(torch.int32)    # [B, blocks per batch]
        return randn((b, 1, n * d), g), randn((nb, bs, kvn * d), g), randn((nb, bs, kvn * d), g), table

    return Case(f"paged-{seed}", fn, inputs)


def tnd_case(seed) -> Case:
    """TND prefill: cumulative query / KV lengths (their last entries are the T axes)."""
    r = random.Random(seed)
    qs1, qs2 = r.randint(1, 9), r.randint(1, 9)
    ks1, ks2 = r.randint(qs1, 14), r.randint(qs2, 14)
    n, d = 2, 128                                  # TND: D 128 (SPEC 14b.4 T16)

    def fn(q, k, v, tmpl):
        return fia.npu_fused_infer_attention_score(q, k, v, num_heads=n, input_layout="TND", sparse_mode=3,
                                                   atten_mask=tmpl, softmax_lse_flag=True,
                                                   actual_seq_lengths=[qs1, qs1 + qs2],
                                                   actual_seq_lengths_kv=[ks1, ks1 + ks2])

    def inputs(sd):
        g = gen(sd)
        q, k, v = (randn((t, n, d), g, BF16) for t in (qs1 + qs2, ks1 + ks2, ks1 + ks2))    # [T, N, D]
        return q, k, v, template_mask()

    return Case(f"tnd-{seed}", fn, inputs)


def kv_list_case(seed) -> Case:
    """Decode over tensor-list KV (one tensor per batch, its own length): the op's .kv_list overload."""
    r = random.Random(seed)
    n, d, lens = 2, 32, [r.randint(1, 30), r.randint(1, 30)]

    def fn(q, ks, vs):
        return fia.npu_incre_flash_attention(q, ks, vs, num_heads=n, input_layout="BNSD", scale_value=0.125)

    def inputs(sd):
        g = gen(sd)
        return (randn((2, n, 1, d), g), [randn((1, n, s, d), g) for s in lens], [randn((1, n, s, d), g) for s in lens])

    return Case(f"kv-list-{seed}", fn, inputs)


def out_case(seed) -> Case:
    """The .out variant writing into outputs the traced function allocates (decode, BSH)."""
    r = random.Random(seed)
    b, n, d, s = 2, 4, 32, r.randint(8, 40)
    lens = [s, r.randint(1, s)]

    def fn(q, k, v):
        # NaN until written: a replay that skips the op (or an element it leaves unwritten) fails every run
        out, lse = torch.full((b, 1, n * d), float("nan"), dtype=F16), torch.full((b, n, 1, 1), float("nan"))
        return fia.npu_fused_infer_attention_score.out(q, k, v, num_heads=n, input_layout="BSH",
                                                       actual_seq_lengths_kv=lens, softmax_lse_flag=True,
                                                       out=[out, lse])

    return Case(f"out-{seed}", fn, lambda sd: _dense(gen(sd), b, n, n, 1, s, d, "BSH", F16))


# seeds picked so the cases cover fused / incre / v2 / prompt, the three dense layouts, masks and the template
CASES = ([decode_case(s) for s in (0, 1, 3, 4, 6)] + [prefill_case(s) for s in (2, 3, 4, 6)] +
         [paged_case(0), tnd_case(0), kv_list_case(0), out_case(0)])


def _flat(res):
    return list(res) if isinstance(res, (tuple, list)) else [res]


def _strides(t):
    """The strides that address memory (a size-1 axis may have any stride)."""
    return tuple(st for sz, st in zip(t.shape, t.stride()) if sz > 1)


def _fia_targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and
            getattr(n.target, "namespace", None) == "fia"]


def _assert_equal(got, want):
    got, want = _flat(got), _flat(want)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------- fake / meta
def test_eager_decode_under_fake_tensor_mode_does_not_crash():
    """Once a segmentation fault: the decode kernels ran on fake data pointers. In a child process."""
    code = ("import torch, fia\n"
            "from torch._subclasses.fake_tensor import FakeTensorMode\n"
            "with FakeTensorMode():\n"
            "    q = torch.empty(2, 4, 1, 32, dtype=torch.float16)\n"
            "    k = torch.empty(2, 2, 64, 32, dtype=torch.float16)\n"
            "    out, lse = fia.npu_fused_infer_attention_score(q, k, k, num_heads=4, num_key_value_heads=2,\n"
            "                                                   input_layout='BNSD', softmax_lse_flag=True)\n"
            "    o2 = fia.npu_incre_flash_attention(q, k, k, num_heads=4, num_key_value_heads=2,\n"
            "                                       input_layout='BNSD', actual_seq_lengths=[64, 3])\n"
            "print(type(out).__name__, tuple(out.shape), tuple(lse.shape), tuple(o2.shape))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["FakeTensor", "(2,", "4,", "1,", "32)", "(2,", "4,", "1,", "1)", "(2,", "4,",
                                  "1,", "32)"]


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_fake_tensor_mode_shapes_and_dtypes_equal_eager(case):
    real = case.inputs(11)
    want = _flat(case.fn(*real))
    with FakeTensorMode() as mode:
        got = _flat(case.fn(*tree_map(mode.from_tensor, real)))
    assert [type(t).__name__ for t in got] == ["FakeTensor"] * len(want)
    assert [(t.shape, t.dtype, _strides(t)) for t in got] == [(t.shape, t.dtype, _strides(t)) for t in want]


def test_meta_tensors_and_out_variant_take_the_shape_only_path():
    q, k, v = (t.to("meta") for t in _dense(gen(12), 2, 4, 2, 1, 40, 32, "BNSD", F16))
    out, lse = fia.npu_fused_infer_attention_score(q, k, v, num_heads=4, num_key_value_heads=2, input_layout="BNSD",
                                                   actual_seq_lengths_kv=[40, 9], softmax_lse_flag=True)
    assert out.is_meta and tuple(out.shape) == (2, 4, 1, 32) and tuple(lse.shape) == (2, 4, 1, 1)
    ws = fia._npu_fused_infer_attention_score_get_max_workspace(q, k, v, num_heads=4, num_key_value_heads=2,
                                                                input_layout="BNSD")
    assert ws.is_meta and ws.dtype == torch.uint8
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in _dense(gen(13), 2, 4, 2, 1, 40, 32, "BNSD", F16))
        a, l = torch.empty(2, 4, 1, 32, dtype=F16), torch.empty(2, 4, 1, 1)
        ra, rl = fia.npu_fused_infer_attention_score.out(fq, fk, fv, num_heads=4, num_key_value_heads=2,
                                                         input_layout="BNSD", softmax_lse_flag=True, out=[a, l])
    assert ra is a and rl is l


def test_fake_tensor_mode_invalid_call_raises_the_eager_error():
    q, k, v = _dense(gen(14), 1, 2, 2, 1, 8, 16, "BNSD", F16)
    with pytest.raises(fia.FiaInputError) as eager:
        fia.npu_fused_infer_attention_score(q, k, v, num_heads=3, input_layout="BNSD")
    with FakeTensorMode() as mode:
        with pytest.raises(fia.FiaInputError) as fake:
            fia.npu_fused_infer_attention_score(*(mode.from_tensor(t) for t in (q, k, v)), num_heads=3,
                                                input_layout="BNSD")
    assert str(fake.value) == str(eager.value)


# ---------------------------------------------------------------------------------------------- make_fx
@pytest.mark.parametrize("mode", ["fake", "symbolic"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_make_fx_graph_has_the_op_and_replays_eager_numbers(case, mode):
    gm = make_fx(case.fn, tracing_mode=mode)(*case.inputs(21))
    assert len(_fia_targets(gm)) == 1
    fresh = case.inputs(22)
    _assert_equal(gm(*fresh), case.fn(*fresh))


# ---------------------------------------------------------------------------------------------- torch.jit.trace
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_jit_trace_records_the_op_and_replays_eager_numbers(case):
    """Once silently wrong: the trace held only the output allocation (the kernel is invisible to the tracer), so
    a replay returned uninitialized memory. Replayed on new random inputs of the same shapes."""
    traced = torch.jit.trace(case.fn, case.inputs(31))                 # (its own check re-runs the trace)
    kinds = [n.kind() for n in traced.graph.nodes()]
    assert sum(k.startswith("fia::") for k in kinds) == 1, kinds
    for seed in (32, 33):
        fresh = case.inputs(seed)
        _assert_equal(traced(*fresh), case.fn(*fresh))


def test_jit_trace_of_decode_matches_the_reference_backend():
    """The traced replay against the independent reference (float32 per batch), not only against eager."""
    case = decode_case(7)
    traced = torch.jit.trace(case.fn, case.inputs(41), check_trace=False)
    fresh = case.inputs(42)
    got = _flat(traced(*fresh))
    with fia.use_backend("reference"):
        want = _flat(case.fn(*fresh))
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)


def test_jit_trace_with_a_lengths_tensor_records_its_values_with_a_warning():
    q, k, v = _dense(gen(43), 2, 2, 2, 1, 24, 16, "BNSD", F16)
    lens = torch.tensor([24, 5])
    fn = lambda q, k, v: fia.npu_incre_flash_attention(q, k, v, num_heads=2, input_layout="BNSD",  # noqa: E731
                                                       actual_seq_lengths=lens)
    with pytest.warns(torch.jit.TracerWarning, match="actual_seq_lengths"):
        traced = torch.jit.trace(fn, (q, k, v), check_trace=False)
    q2, k2, v2 = _dense(gen(44), 2, 2, 2, 1, 24, 16, "BNSD", F16)
    assert torch.equal(traced(q2, k2, v2), fn(q2, k2, v2))


def test_fake_lengths_tensor_is_refused_naming_the_argument():
    q, k, v = _dense(gen(45), 2, 2, 2, 1, 24, 16, "BNSD", F16)
    with FakeTensorMode() as mode:
        fq, fk, fv, fl = (mode.from_tensor(t) for t in (q, k, v, torch.tensor([24, 5])))
        with pytest.raises(fia.FiaInputError, match="^actual_seq_lengths_kv: expected a list of ints"):
            fia.npu_fused_infer_attention_score(fq, fk, fv, num_heads=2, input_layout="BNSD",
                                                actual_seq_lengths_kv=fl)


# ---------------------------------------------------------------------------------------------- torch.compile
def _counting_backend():
    """aot_eager that counts the graphs Dynamo hands it (one per compilation)."""
    from torch._dynamo.backends.common import aot_autograd
    graphs = []

    def fw(gm, example_inputs):
        return gm.forward

    aot = aot_autograd(fw_compiler=fw)

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot(gm, example_inputs)
    return backend, graphs


@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
def test_compiled_decode_loop_compiles_a_bounded_number_of_times(layout):
    """Once a recompile per step (the lengths were specialized: int[] in the schema), and with fullgraph=True a
    failure at torch's recompile limit (8). 14 steps, growing lengths, a growing KV cache view too."""
    b, n, kvn, s, d = 2, 4, 2, 64, 32
    q, k, v = _dense(gen(51), b, n, kvn, 1, s, d, layout, F16)

    def step(q, k, v, lens):
        return fia.npu_fused_infer_attention_score(q, k, v, num_heads=n, num_key_value_heads=kvn,
                                                   input_layout=layout, actual_seq_lengths_kv=lens,
                                                   softmax_lse_flag=True)

    backend, graphs = _counting_backend()
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    seq = 1 if layout == "BSH" else 2                                   # the KV sequence axis
    for i in range(14):
        lens = [20 + i, 7 + 3 * i]
        kk, vv = (t.narrow(seq, 0, 40 + i) for t in (k, v))            # the cache filled so far
        got = compiled(q, kk, vv, lens)
        _assert_equal(got, step(q, kk, vv, lens))
    assert 1 <= len(graphs) <= 2
    assert all(len(_fia_targets(g)) == 1 for g in graphs)


def test_compiled_loop_validates_each_steps_lengths():
    """The graph is built on example lengths; a later step with lengths out of range fails with FIA's error."""
    q, k, v = _dense(gen(52), 2, 2, 2, 1, 32, 16, "BNSD", F16)
    step = lambda q, k, v, lens: fia.npu_incre_flash_attention(q, k, v, num_heads=2,  # noqa: E731
                                                               input_layout="BNSD", actual_seq_lengths=lens)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for i in range(3):
        _assert_equal(compiled(q, k, v, [10 + i, 20 - i]), step(q, k, v, [10 + i, 20 - i]))
    with pytest.raises(fia.FiaInputError, match="^actual_seq_lengths: "):
        compiled(q, k, v, [33, 5])


def test_compiled_lengths_from_tensor_data_are_refused_clearly():
    """Lengths read from a tensor inside the graph (unbacked ints) have no example value to parse: an
    unsupported error naming the argument, not a torch internal error."""
    q, k, v = _dense(gen(55), 2, 2, 2, 1, 32, 16, "BNSD", F16)
    step = lambda q, k, v, lt: fia.npu_incre_flash_attention(q, k, v, num_heads=2, input_layout="BNSD",  # noqa: E731
                                                             actual_seq_lengths=lt.tolist())
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        with pytest.raises(Exception, match="actual_seq_lengths: graph mode needs lengths known when the graph"):
            torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, torch.tensor([20, 5]))


def test_lengths_tensor_still_works_eagerly():
    q, k, v = _dense(gen(53), 3, 4, 2, 1, 40, 32, "BSH", F16)
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BSH", softmax_lse_flag=True)
    lens = [40, 13, 1]
    want = fia.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=lens, **kw)
    for t in (torch.tensor(lens), torch.tensor(lens, dtype=torch.int32)):
        _assert_equal(fia.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=t, **kw), want)
    with fia.use_backend("reference"):
        ref = fia.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths_kv=torch.tensor(lens), **kw)
    torch.testing.assert_close(want[0].float(), ref[0].float(), atol=1e-2, rtol=1e-2)


def test_plain_eager_calls_keep_the_direct_path():
    """Plain tensors (and Parameters) never take the dispatcher hop: the op's real kernel is not entered."""
    from fia import graph
    q, k, v = _dense(gen(54), 1, 2, 2, 1, 16, 16, "BNSD", F16)
    spec = graph.OPS["npu_incre_flash_attention"]
    calls = []
    orig = spec.fn
    try:
        spec.fn = lambda *a, **kw: calls.append(1) or orig(*a, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            a = fia.npu_incre_flash_attention(q, k, v, num_heads=2, input_layout="BNSD")
            b = fia.npu_incre_flash_attention(torch.nn.Parameter(q, requires_grad=False), k, v, num_heads=2,
                                              input_layout="BNSD", atten_mask=torch.rand(1, 1, 1, 16) < 0.3)
    finally:
        spec.fn = orig
    assert calls == [] and a.shape == b.shape
