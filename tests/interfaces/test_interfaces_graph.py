"""Graph mode (SPEC 1.3): torch.library custom ops, fake kernels, torch.compile(fullgraph=True)."""
import inspect

import pytest
import torch

import fia
from fia import graph
from util import gen, randn, template_mask, to_layout

pytestmark = pytest.mark.backend_independent      # one run with automatic backend selection (conftest)

F16, BF16 = torch.float16, torch.bfloat16
FUSED, INCRE, PROMPT = "npu_fused_infer_attention_score", "npu_incre_flash_attention", "npu_prompt_flash_attention"


def qkv(seed, b, n, kvn, sq, skv, d, layout="BNSD", dtype=F16):
    g = gen(seed)
    q, k, v = randn((b, n, sq, d), g, dtype), randn((b, kvn, skv, d), g, dtype), randn((b, kvn, skv, d), g, dtype)
    return to_layout(q, layout), to_layout(k, layout), to_layout(v, layout)


def paged(seed, b=2, n=4, kvn=2, d=32, bs=16, blocks=6):
    g = gen(seed)
    kc, vc = randn((blocks, bs, kvn * d), g), randn((blocks, bs, kvn * d), g)
    q = randn((b, 1, n * d), g)
    table = torch.tensor([[0, 3, 5], [1, 2, 4]], dtype=torch.int32)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout="BSH", block_table=table, block_size=bs,
              actual_seq_lengths_kv=[40, 17])
    return q, kc, vc, kw


def compiled(fn, backend="aot_eager"):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend)


# ---------------------------------------------------------------------------------------------- schemas
@pytest.mark.parametrize("name", [FUSED, INCRE, PROMPT])
def test_op_schema_mirrors_the_eager_signature(name):
    """Schemas are generated from fia.api: same keywords, same defaults, key/value Tensor or Tensor[]."""
    sig = inspect.signature(getattr(fia.api, name))
    for overload, kv in (("default", "Tensor"), ("kv_list", "List[Tensor]")):
        schema = getattr(getattr(torch.ops.fia, name), overload)._schema
        args = schema.arguments
        assert [a.name for a in args] == list(sig.parameters)
        assert str(args[1].type) == kv and str(args[0].type) == "Tensor"
        for a in args[3:]:
            assert a.kwarg_only
            default = sig.parameters[a.name].default
            assert a.default_value == default, a.name
    assert len(torch.ops.fia.npu_fused_infer_attention_score.default._schema.returns) == 2


# ---------------------------------------------------------------------------------------------- fullgraph == eager
@pytest.mark.parametrize("lse", [True, False], ids=["lse", "nolse"])
def test_compile_fused_fullgraph_equals_eager(lse):
    q, k, v = qkv(601, 2, 4, 2, 5, 23, 16, "BSH")
    mask = torch.rand(2, 1, 5, 23, generator=gen(602)) < 0.3

    class Model(torch.nn.Module):
        def forward(self, q, k, v, mask):
            out, l = fia.npu_fused_infer_attention_score(
                q, k, v, atten_mask=mask, actual_seq_lengths=[5, 2], actual_seq_lengths_kv=(23, 9), num_heads=4,
                num_key_value_heads=2, scale=0.3, input_layout="BSH", inner_precise=2, softmax_lse_flag=lse)
            return out, l

    model = Model()
    eager = model(q, k, v, mask)
    graph = compiled(model)(q, k, v, mask)
    assert torch.equal(graph[0], eager[0]) and torch.equal(graph[1], eager[1])
    assert tuple(graph[1].shape) == ((2, 4, 5, 1) if lse else (0,))


def test_compile_incre_and_prompt_and_tensor_list():
    q1, k, v = qkv(603, 3, 4, 4, 1, 17, 32)
    qp, kp, vp = qkv(604, 2, 2, 2, 9, 9, 16, "BSND")
    lens = [5, 17, 11]
    ks = [k[i:i + 1, :, :s] for i, s in enumerate(lens)]
    vs = [v[i:i + 1, :, :s] for i, s in enumerate(lens)]
    tmpl = template_mask()

    def fn(q1, k, v, qp, kp, vp, ks, vs, tmpl):
        a = fia.npu_incre_flash_attention(q1, k, v, num_heads=4, input_layout="BNSD", scale_value=0.2,
                                          actual_seq_lengths=[17, 3, 8])
        b = fia.npu_prompt_flash_attention(qp, kp, vp, num_heads=2, input_layout="BSND", atten_mask=tmpl,
                                           sparse_mode=3, scale_value=0.25)
        c = fia.npu_incre_flash_attention(q1, ks, vs, num_heads=4, input_layout="BNSD", scale_value=0.2)
        return a, b, c

    args = (q1, k, v, qp, kp, vp, ks, vs, tmpl)
    eager = fn(*args)
    graph = compiled(fn)(*args)
    for e, g in zip(eager, graph):
        assert torch.equal(e, g)


def test_compile_paged_kv():
    q, kc, vc, kw = paged(605)
    fn = lambda q, kc, vc: fia.npu_fused_infer_attention_score(q, kc, vc, **kw)[0]  # noqa: E731
    assert torch.equal(compiled(fn)(q, kc, vc), fn(q, kc, vc))


def test_compile_records_one_custom_op_node():
    q, k, v = qkv(606, 1, 2, 2, 1, 8, 16)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = lambda q, k, v: fia.npu_incre_flash_attention(q, k, v, num_heads=2, input_layout="BNSD")  # noqa: E731
    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend=backend)(q, k, v)
    assert torch.equal(out, fn(q, k, v))
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.fia.npu_incre_flash_attention.default]


def test_torch_export_records_the_op():
    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return fia.npu_incre_flash_attention(q, k, v, num_heads=2, input_layout="BNSD", actual_seq_lengths=[8, 3])

    q, k, v = qkv(608, 2, 2, 2, 1, 8, 16)
    ep = torch.export.export(M(), (q, k, v))
    assert [n.target for n in ep.graph.nodes if n.op == "call_function"] == \
        [torch.ops.fia.npu_incre_flash_attention.default]
    assert torch.equal(ep.module()(q, k, v), M()(q, k, v))


def test_compile_invalid_call_fails_at_trace_time_with_the_fia_message():
    q, k, v = qkv(607, 1, 2, 2, 1, 8, 16)
    fn = lambda q, k, v: fia.npu_incre_flash_attention(q, k, v, num_heads=3, input_layout="BNSD")  # noqa: E731
    with pytest.raises(fia.FiaInputError) as eager:
        fn(q, k, v)
    with pytest.raises(Exception) as traced:
        compiled(fn, "eager")(q, k, v)
    assert str(eager.value) in str(traced.value)


# ---------------------------------------------------------------------------------------------- opcheck
@pytest.mark.parametrize("lse", [False, True], ids=["nolse", "lse"])
def test_opcheck_fused_optional_tensors_absent(lse):
    q, k, v = qkv(610, 2, 4, 2, 1, 33, 64)
    torch.library.opcheck(graph.op(FUSED), (q, k, v),
                          dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD", softmax_lse_flag=lse,
                               actual_seq_lengths_kv=[33, 10]))


def test_opcheck_fused_mask_tnd_lse():
    g = gen(611)
    q, k, v = randn((7, 2, 128), g, BF16), randn((9, 2, 128), g, BF16), randn((9, 2, 128), g, BF16)   # SPEC 14b.4 T16
    torch.library.opcheck(graph.op(FUSED), (q, k, v),
                          dict(num_heads=2, input_layout="TND", actual_seq_lengths=[3, 7],
                               actual_seq_lengths_kv=[4, 9], softmax_lse_flag=True, sparse_mode=3,
                               atten_mask=template_mask()),
                          test_utils=("test_schema", "test_faketensor"))


def test_opcheck_incre_mask_and_paged():
    q, k, v = qkv(612, 2, 4, 4, 1, 20, 32, "BSH")
    mask = torch.rand(2, 1, 1, 20, generator=gen(613)) < 0.5
    torch.library.opcheck(graph.op(INCRE), (q, k, v), dict(num_heads=4, atten_mask=mask, scale_value=0.1))
    q, kc, vc, kw = paged(614)
    kw = dict(kw, actual_seq_lengths=kw.pop("actual_seq_lengths_kv"))
    torch.library.opcheck(graph.op(INCRE), (q, kc, vc), kw, test_utils=("test_schema", "test_faketensor"))


def test_opcheck_prompt_and_kv_list():
    q, k, v = qkv(615, 2, 2, 1, 16, 16, 16, "BNSD")
    torch.library.opcheck(graph.op(PROMPT), (q, k, v),
                          dict(num_heads=2, num_key_value_heads=1, input_layout="BNSD_BSND",
                               actual_seq_lengths=[16, 7]),
                          test_utils=("test_schema", "test_faketensor"))
    q, k, v = qkv(616, 2, 2, 2, 1, 12, 16)
    ks, vs = [k[:1, :, :12], k[1:, :, :5]], [v[:1, :, :12], v[1:, :, :5]]
    torch.library.opcheck(graph.op(INCRE, kv_list=True), (q, ks, vs), dict(num_heads=2, input_layout="BNSD"),
                          test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------- fake kernel
def test_fake_kernel_shapes_dtypes_without_reading_data():
    """Shapes and dtypes come from the parse layer on fake tensors; block ids are never read (an
    out-of-range id fails eagerly, not in the fake kernel)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, kc, vc, kw = paged(620)
    bad = kw["block_table"].clone()
    bad[0, 0] = 99
    with pytest.raises(fia.FiaInputError, match="block_table"):
        fia.npu_fused_infer_attention_score(q, kc, vc, **dict(kw, block_table=bad))
    with FakeTensorMode() as mode:
        fq, fk, fv, fb = (mode.from_tensor(t) for t in (q, kc, vc, bad))
        out, lse = torch.ops.fia.npu_fused_infer_attention_score(fq, fk, fv, **dict(kw, block_table=fb,
                                                                                   softmax_lse_flag=True))
    assert tuple(out.shape) == (2, 1, 4 * 32) and out.dtype == F16
    assert tuple(lse.shape) == (2, 4, 1, 1) and lse.dtype == torch.float32
    # meta tensors take the same kernel
    meta = [t.to("meta") for t in qkv(621, 2, 2, 2, 9, 9, 16, "BNSD")]
    out = torch.ops.fia.npu_prompt_flash_attention(*meta, num_heads=2, input_layout="BNSD_BSND")
    assert out.device.type == "meta" and tuple(out.shape) == (2, 9, 2, 16)


def test_fake_kernel_validates_like_eager():
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, k, v = qkv(622, 1, 2, 2, 1, 8, 16)
    with pytest.raises(fia.FiaInputError) as eager:
        fia.npu_incre_flash_attention(q, k, v, num_heads=2, input_layout="BSND")
    with FakeTensorMode() as mode:
        with pytest.raises(fia.FiaInputError) as fake:
            torch.ops.fia.npu_incre_flash_attention(*(mode.from_tensor(t) for t in (q, k, v)), num_heads=2,
                                                    input_layout="BSND")
    assert str(fake.value) == str(eager.value)


# ---------------------------------------------------------------------------------------------- eager unchanged
def test_eager_path_is_the_api_function():
    """Eagerly the public names call fia.api directly: same results, same exceptions, same signature."""
    assert inspect.signature(fia.npu_fused_infer_attention_score) == \
        inspect.signature(fia.eager.npu_fused_infer_attention_score)
    assert fia.npu_incre_flash_attention.__wrapped__ is fia.eager.npu_incre_flash_attention
    q, k, v = qkv(630, 1, 2, 2, 1, 8, 16)
    for fn in (fia.npu_prompt_flash_attention, fia.eager.npu_prompt_flash_attention):
        with pytest.raises(fia.FiaInputError, match="^num_heads: ") as e:
            fn(q, k, v, num_heads=5, input_layout="BNSD")
        assert e.value.status == 161002
    with pytest.raises(TypeError):
        fia.npu_incre_flash_attention(q, k, v, no_such_keyword=1)
