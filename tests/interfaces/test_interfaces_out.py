"""The .out variants, the workspace queries and their graph-mode operators (SPEC 1.1b, 1.3).

`.out` must equal the functional call exactly (same backend), write into the caller's tensors and return
them, check them before anything runs (an invalid call writes nothing), and leave the lse placeholder alone
when no lse is requested (DECISIONS 17). Equality tests run once per backend (conftest); validation, compile
and opcheck tests check plumbing and run once (the `Once` classes).
"""
import inspect

import pytest
import torch

import fia
from fia import graph
from util import gen, randn, seed_of, template_mask

F16 = torch.float16
V1, V2 = "npu_fused_infer_attention_score", "npu_fused_infer_attention_score_v2"
WS = {V1: "_npu_fused_infer_attention_score_get_max_workspace",
      V2: "_npu_fused_infer_attention_score_v2_get_max_workspace"}
B, N, KVN, D = 2, 4, 2, 32
BS = 128                                   # block size valid for prefill and decode (strict mode)


@pytest.mark.backend_independent
class Once:
    """Interface plumbing, not a backend: run once, with automatic backend selection (conftest)."""


def case(kind: str, storage: str, seed: int):
    """(q, k, v, v1 keywords without the lse flag). kind: prefill | decode; storage: dense | paged."""
    g = gen(seed)
    sq = 1 if kind == "decode" else 7
    q = randn((B, sq, N * D), g)                                               # BSH
    kw = dict(num_heads=N, num_key_value_heads=KVN, input_layout="BSH", scale=0.17)
    if storage == "dense":
        k, v = randn((B, 40, KVN * D), g), randn((B, 40, KVN * D), g)
        kw["actual_seq_lengths_kv"] = [40, 23]
    else:
        k, v = randn((5, BS, KVN * D), g), randn((5, BS, KVN * D), g)          # block pool [blocks, BS, H]
        kw.update(block_table=torch.tensor([[3, 0], [1, 4]], dtype=torch.int32), block_size=BS,
                  actual_seq_lengths_kv=[200, 77])
    if kind == "prefill":
        kw.update(actual_seq_lengths=[7, 4], atten_mask=template_mask(), sparse_mode=3)
    return q, k, v, kw


_V2_NAMES = {"num_heads": "num_query_heads", "scale": "softmax_scale", "actual_seq_lengths": "actual_seq_qlen",
             "actual_seq_lengths_kv": "actual_seq_kvlen", "softmax_lse_flag": "return_softmax_lse"}


def keywords(api: str, kw: dict, lse: bool) -> dict:
    """v1 keywords (+ the lse flag) in the spelling of `api`."""
    kw = dict(kw, softmax_lse_flag=lse)
    return kw if api == V1 else {_V2_NAMES.get(k, k): v for k, v in kw.items()}


def fn(api: str, module=fia):
    return getattr(module, api)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (NaN-safe)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                    b.contiguous().view(torch.uint8))


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


# ---------------------------------------------------------------------------------------------- .out == functional
@pytest.mark.parametrize("lse", [True, False], ids=["lse", "nolse"])
@pytest.mark.parametrize("storage", ["dense", "paged"])
@pytest.mark.parametrize("kind", ["prefill", "decode"])
@pytest.mark.parametrize("api", [V1, V2], ids=["v1", "v2"])
def test_out_equals_functional_and_writes_the_callers_tensors(api, kind, storage, lse):
    q, k, v, kw = case(kind, storage, seed_of("out", api, kind, storage, lse))
    kw = keywords(api, kw, lse)
    out, l = fn(api)(q, k, v, **kw)
    assert not torch.isnan(out).any() and not torch.isnan(l).any()
    attention_out = nan_like(out)
    if lse:
        softmax_lse = nan_like(l)
    else:                                     # vllm-ascend's placeholder: never written
        softmax_lse = randn((1,), gen(5), F16)
    placeholder = softmax_lse.clone()
    ws = fn(WS[api])(q, k, v, **kw)
    spelling = [attention_out, softmax_lse]
    res = fn(api).out(q, k, v, **kw, workspace=ws, out=spelling if api == V1 else tuple(spelling))
    assert isinstance(res, tuple) and len(res) == 2
    assert res[0] is attention_out and res[1] is softmax_lse
    assert torch.equal(attention_out, out)                     # every NaN overwritten, values identical
    if lse:
        assert torch.equal(softmax_lse, l)
    else:
        assert same_bits(softmax_lse, placeholder)


@pytest.mark.parametrize("api", [V1, V2], ids=["v1", "v2"])
def test_out_operator_spelling_and_keyword_qkv(api):
    """The op-overload spelling (attention_out= / softmax_lse=), query/key/value as keywords (vllm-ascend)."""
    q, k, v, kw = case("decode", "paged", seed_of("spelling", api))
    kw = keywords(api, kw, True)
    out, l = fn(api)(q, k, v, **kw)
    a, s = nan_like(out), nan_like(l)
    res = fn(api).out(query=q, key=k, value=v, **kw, attention_out=a, softmax_lse=s)
    assert res[0] is a and res[1] is s and torch.equal(a, out) and torch.equal(s, l)


def test_out_tnd_lse_shape():
    """Packed layouts: attention_out [T, N, Dv], softmax_lse [T, N, 1]."""
    g = gen(seed_of("tnd"))
    d = 128                                                       # TND: D 128 (SPEC 14b.4 T16)
    q, k, v = randn((9, N, d), g, torch.bfloat16), randn((13, KVN, d), g, torch.bfloat16), \
        randn((13, KVN, d), g, torch.bfloat16)
    kw = dict(num_heads=N, num_key_value_heads=KVN, input_layout="TND", actual_seq_lengths=[4, 9],
              actual_seq_lengths_kv=[6, 13], softmax_lse_flag=True, sparse_mode=3, atten_mask=template_mask())
    out, l = fia.npu_fused_infer_attention_score(q, k, v, **kw)
    assert tuple(l.shape) == (9, N, 1)
    a, s = nan_like(out), nan_like(l)
    fia.npu_fused_infer_attention_score.out(q, k, v, **kw, out=[a, s])
    assert torch.equal(a, out) and torch.equal(s, l)


# ---------------------------------------------------------------------------------------------- validation
def _lse_shape(kind):
    return (B, N, 1 if kind == "decode" else 7, 1)


def _outputs(kind="decode"):
    sq = 1 if kind == "decode" else 7
    g = gen(seed_of("outputs", kind))
    return randn((B, sq, N * D), g), randn(_lse_shape(kind), g, torch.float32)


class TestValidation(Once):
    @pytest.mark.parametrize("spelling", ["out", "keywords"])
    @pytest.mark.parametrize("bad", ["out_shape", "out_dtype", "out_device", "lse_shape", "lse_dtype"])
    @pytest.mark.parametrize("api", [V1, V2], ids=["v1", "v2"])
    def test_wrong_output_is_an_input_error_and_nothing_is_written(self, api, bad, spelling):
        q, k, v, kw = case("decode", "dense", seed_of("bad", api, bad))
        kw = keywords(api, kw, True)
        a, s = _outputs()
        if bad == "out_shape":
            a = a[:, :, :-1]
        elif bad == "out_dtype":
            a = a.to(torch.bfloat16)
        elif bad == "out_device":
            a = a.to("meta")
        elif bad == "lse_shape":
            s = s[..., 0]
        else:
            s = s.to(F16)
        before = [t.clone() for t in (a, s) if t.device.type != "meta"]
        name = ("out[0]" if spelling == "out" else "attention_out") if bad.startswith("out") else \
            ("out[1]" if spelling == "out" else "softmax_lse")
        call = dict(out=[a, s]) if spelling == "out" else dict(attention_out=a, softmax_lse=s)
        with pytest.raises(fia.FiaInputError) as e:
            fn(api).out(q, k, v, **kw, **call)
        msg = str(e.value)
        assert e.value.argument == name and msg.startswith(name + ": expected") and e.value.status == 161002
        if bad == "out_device":
            assert "cpu" in msg and "meta" in msg
        else:
            exp = f"shape {(B, 1, N * D)}" if bad.startswith("out") else f"shape {_lse_shape('decode')}"
            got = f"shape {tuple((a if bad.startswith('out') else s).shape)}"
            assert exp in msg and got in msg
            assert ("float16" if bad.startswith("out") else "float32") in msg
        assert all(same_bits(x, y) for x, y in zip([t for t in (a, s) if t.device.type != "meta"], before))

    @pytest.mark.parametrize("placeholder", ["query_dtype_1", "bn1", "empty", "int"])
    @pytest.mark.parametrize("api", [V1, V2], ids=["v1", "v2"])
    def test_lse_off_accepts_any_placeholder_untouched(self, api, placeholder):
        q, k, v, kw = case("decode", "dense", seed_of("ph", api))
        kw = keywords(api, kw, False)
        g = gen(3)
        s = {"query_dtype_1": randn((1,), g, F16), "bn1": randn((B, N, 1), g, torch.float32),
             "empty": torch.empty(0), "int": torch.randint(-9, 9, (3, 5), generator=g)}[placeholder]
        before = s.clone()
        a = nan_like(_outputs()[0])
        res = fn(api).out(q, k, v, **kw, out=[a, s])
        assert res[1] is s and same_bits(s, before)
        assert torch.equal(a, fn(api)(q, k, v, **kw)[0])

    @pytest.mark.parametrize("api", [V1, V2], ids=["v1", "v2"])
    def test_output_spellings(self, api):
        q, k, v, kw = case("decode", "dense", seed_of("spell", api))
        kw = keywords(api, kw, True)
        a, s = _outputs()
        before = (a.clone(), s.clone())
        bad_calls = {
            "both": dict(out=[a, s], attention_out=a),
            "both_lse": dict(out=(a, s), softmax_lse=s),
            "neither": {},
            "three": dict(out=[a, s, s]),
            "not_a_list": dict(out=a),
        }
        for what, call in bad_calls.items():
            with pytest.raises(fia.FiaInputError, match="^out: expected") as e:
                fn(api).out(q, k, v, **kw, **call)
            assert e.value.argument == "out", what
            assert e.value.status == (161001 if what == "neither" else 161002), what
        with pytest.raises(fia.FiaInputError, match="^out: expected either out=.* not both, got both"):
            fn(api).out(q, k, v, **kw, out=[a, s], attention_out=a, softmax_lse=s)
        for call, name in ((dict(out=[a, None]), "out[1]"), (dict(attention_out=a), "softmax_lse"),
                           (dict(softmax_lse=s), "attention_out"), (dict(out=[[1.0], s]), "out[0]")):
            with pytest.raises(fia.FiaInputError, match=rf"^{name.replace('[', '.').replace(']', '.')}: expected a "
                                                        "tensor") as e:
                fn(api).out(q, k, v, **kw, **call)
            assert e.value.argument == name
        assert same_bits(a, before[0]) and same_bits(s, before[1])

    @pytest.mark.parametrize("api", [V1, V2], ids=["v1", "v2"])
    def test_workspace_is_accepted_and_ignored(self, api):
        q, k, v, kw = case("decode", "dense", seed_of("ws", api))
        kw = keywords(api, kw, False)
        ref = fn(api)(q, k, v, **kw)[0]
        for ws in (None, torch.empty(0, dtype=torch.uint8), randn((3, 4), gen(4)), fn(WS[api])(q, k, v, **kw)):
            a = nan_like(ref)
            fn(api).out(q, k, v, **kw, workspace=ws, out=[a, torch.empty(1)])
            assert torch.equal(a, ref)
        with pytest.raises(fia.FiaInputError, match="^workspace: expected a tensor or None"):
            fn(api).out(q, k, v, **kw, workspace=1024, out=[nan_like(ref), torch.empty(1)])

    @pytest.mark.parametrize("api", [V1, V2], ids=["v1", "v2"])
    def test_invalid_arguments_raise_like_the_functional_call_and_write_nothing(self, api):
        q, k, v, kw = case("prefill", "dense", seed_of("inv", api))
        a, s = _outputs("prefill")
        before = (a.clone(), s.clone())
        bad = [dict(num_heads=3), dict(actual_seq_lengths_kv=[41, 3]), dict(sparse_mode=7),
               dict(input_layout="BSND")]
        for change in bad:
            kwb = keywords(api, dict(kw, **change), True)
            with pytest.raises(fia.FiaInputError) as functional:
                fn(api)(q, k, v, **kwb)
            for call in (fn(api).out, fn(WS[api])):
                with pytest.raises(fia.FiaInputError) as e:
                    call(q, k, v, **kwb, **(dict(out=[a, s]) if call is not fn(WS[api]) else {}))
                assert str(e.value) == str(functional.value) and e.value.argument == functional.value.argument
        assert same_bits(a, before[0]) and same_bits(s, before[1])

    def test_unknown_keyword_like_the_functional_call(self):
        q, k, v, kw = case("decode", "dense", 1)
        a, s = _outputs()
        for call in (fia.npu_fused_infer_attention_score, fia.npu_fused_infer_attention_score.out,
                     fia._npu_fused_infer_attention_score_get_max_workspace):
            with pytest.raises(TypeError, match="no_such_keyword"):
                call(q, k, v, **kw, no_such_keyword=1, **({"out": [a, s]} if call.__name__ == "out" else {}))
        kw2 = keywords(V2, kw, False)
        for call in (fia.npu_fused_infer_attention_score_v2, fia.npu_fused_infer_attention_score_v2.out,
                     fia._npu_fused_infer_attention_score_v2_get_max_workspace):
            with pytest.raises(fia.FiaInputError, match="^antiquant_scale: .*only reachable"):
                call(q, k, v, **kw2, antiquant_scale=torch.ones(1),
                     **({"out": [a, s]} if call.__name__ == "out" else {}))

    @pytest.mark.parametrize("api", [V1, V2], ids=["v1", "v2"])
    def test_get_max_workspace_returns_an_empty_workspace(self, api):
        q, k, v, kw = case("prefill", "paged", seed_of("gmw", api))
        ws = fn(WS[api])(q, k, v, **keywords(api, kw, True))
        assert isinstance(ws, torch.Tensor) and ws.dtype == torch.uint8 and tuple(ws.shape) == (0,)
        assert ws.device == q.device

    def test_reachable_as_clients_call_them(self):
        import fia as torch_npu
        import fia.torch_npu as drop_in
        for api in (V1, V2):
            assert fn(api, drop_in).out is fn(api, torch_npu).out
            assert callable(fn(api, fia.api).out) and callable(fn(api, torch_npu).out)
            assert getattr(drop_in, WS[api]) is getattr(torch_npu, WS[api])
            assert WS[api] in drop_in.__all__ and WS[api] in fia.__all__
        sig = inspect.signature(fia.npu_fused_infer_attention_score.out)
        functional = inspect.signature(fia.npu_fused_infer_attention_score)
        assert list(sig.parameters) == list(functional.parameters) + ["workspace", "out", "attention_out",
                                                                      "softmax_lse"]
        assert inspect.signature(fia._npu_fused_infer_attention_score_v2_get_max_workspace).parameters == \
            inspect.signature(fia.npu_fused_infer_attention_score_v2).parameters


# ---------------------------------------------------------------------------------------------- graph mode
def compiled(f, backend="aot_eager"):
    torch._dynamo.reset()
    return torch.compile(f, fullgraph=True, backend=backend)


class TestGraphMode(Once):
    def test_out_schemas(self):
        for api in (V1, V2):
            schema = graph.op(api, out=True)._schema
            names = [a.name for a in schema.arguments]
            assert names == list(inspect.signature(fn(api, fia.api)).parameters)[:len(names) - 3] + \
                ["workspace", "attention_out", "softmax_lse"]
            mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            assert mutated == ["attention_out", "softmax_lse"]
            assert [r.alias_info is not None and r.alias_info.is_write for r in schema.returns] == [True, True]
            ws = graph.op(WS[api])._schema
            assert [a.name for a in ws.arguments] == [a.name for a in graph.op(api)._schema.arguments]
        v2 = {a.name: str(a.type) for a in graph.op(V2)._schema.arguments}
        assert v2["actual_seq_kvlen"] == "Optional[List[int]]" and v2["query_dtype"] == "Optional[int]"
        assert str(torch.ops.fia.npu_attention_update.default._schema) == \
            "fia::npu_attention_update(Tensor[] lse, Tensor[] local_out, int update_type=0) -> (Tensor, Tensor?)"

    def test_compile_workspace_and_out_fullgraph_equal_eager(self):
        """The graph-capture pattern: get_max_workspace, then .out into preallocated buffers (v1 with lse,
        v2 without: its placeholder untouched). One graph, custom-op nodes only."""
        q, k, v, kw = case("decode", "paged", seed_of("compile-out"))
        kw1, kw2 = keywords(V1, kw, True), keywords(V2, kw, False)

        def step(q, k, v, a1, s1, a2, s2):
            ws = fia._npu_fused_infer_attention_score_get_max_workspace(q, k, v, **kw1)
            r1 = fia.npu_fused_infer_attention_score.out(q, k, v, **kw1, workspace=ws, out=[a1, s1])
            ws2 = fia._npu_fused_infer_attention_score_v2_get_max_workspace(q, k, v, **kw2)
            r2 = fia.npu_fused_infer_attention_score_v2.out(q, k, v, **kw2, workspace=ws2, attention_out=a2,
                                                            softmax_lse=s2)
            return r1, r2

        o1, l1 = fia.npu_fused_infer_attention_score(q, k, v, **kw1)
        o2 = fia.npu_fused_infer_attention_score_v2(q, k, v, **kw2)[0]
        graphs = []

        def recording(gm, example_inputs):
            graphs.append(gm)
            return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

        bufs = [nan_like(o1), nan_like(l1), nan_like(o2), randn((1,), gen(9), F16)]
        placeholder = bufs[3].clone()
        (r1, r2) = compiled(step, recording)(q, k, v, *bufs)
        assert r1[0] is bufs[0] and r1[1] is bufs[1] and r2[0] is bufs[2] and r2[1] is bufs[3]
        assert torch.equal(bufs[0], o1) and torch.equal(bufs[1], l1) and torch.equal(bufs[2], o2)
        assert same_bits(bufs[3], placeholder)
        targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
        assert targets == [graph.op(WS[V1]), graph.op(V1, out=True), graph.op(WS[V2]), graph.op(V2, out=True)]

    def test_compile_v2_and_attention_update_fullgraph_equal_eager(self):
        q, k, v, kw = case("prefill", "dense", seed_of("compile-v2"))
        kw2 = keywords(V2, kw, True)
        g = gen(seed_of("update"))
        lse = [randn((6,), g, torch.float32) for _ in range(3)]
        parts = [randn((6, 16), g, torch.bfloat16) for _ in range(3)]

        def model(q, k, v, l0, l1, l2, p0, p1, p2):
            out, l = fia.npu_fused_infer_attention_score_v2(q, k, v, **kw2)
            nolse = fia.npu_fused_infer_attention_score_v2(q, k, v, **dict(kw2, return_softmax_lse=False))
            merged = fia.npu_attention_update([l0, l1, l2], [p0, p1, p2], 1)
            plain = fia.npu_attention_update([l0, l1], [p0, p1], 0)
            return out, l, nolse[1], merged, plain

        args = (q, k, v, *lse, *parts)
        eager, graph = model(*args), compiled(model)(*args)
        for e, r in zip(eager[:3], graph[:3]):
            assert torch.equal(e, r)
        assert tuple(graph[2].shape) == (1,) and graph[2].dtype == torch.float32
        assert torch.equal(graph[3][0], eager[3][0]) and torch.equal(graph[3][1], eager[3][1])
        assert torch.equal(graph[4][0], eager[4][0]) and graph[4][1] is None

    def test_compile_wrong_output_fails_at_trace_time_naming_it(self):
        q, k, v, kw = case("decode", "dense", seed_of("compile-bad"))
        kw = keywords(V1, kw, True)
        a, s = _outputs()
        f = lambda q, k, v, a, s: fia.npu_fused_infer_attention_score.out(q, k, v, **kw, out=[a, s])  # noqa: E731
        before = s.clone()
        with pytest.raises(Exception, match="softmax_lse: expected a float32 tensor of shape"):
            compiled(f, "eager")(q, k, v, a, s[..., 0])
        assert same_bits(s, before)

    def test_opcheck_out_ops(self):
        for api, storage, lse in ((V1, "paged", True), (V2, "dense", False)):
            q, k, v, kw = case("decode", storage, seed_of("opcheck", api))
            kw = keywords(api, kw, lse)
            out, l = fn(api)(q, k, v, **kw)
            # opcheck compares the returned buffers (eager vs traced) with NaN != NaN: the outputs the op
            # writes start as NaN, so an element it left unwritten fails every run; the placeholder it leaves
            # alone (lse flag off) holds a defined value, never uninitialized memory
            s = nan_like(l) if lse else torch.full((1,), 0.5, dtype=F16)
            torch.library.opcheck(graph.op(api, out=True), (q, k, v),
                                  dict(kw, attention_out=nan_like(out), softmax_lse=s),
                                  test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))

    def test_opcheck_v2_workspace_and_update(self):
        q, k, v, kw = case("prefill", "dense", seed_of("opcheck-v2"))
        kw2 = keywords(V2, kw, True)
        torch.library.opcheck(graph.op(V2), (q, k, v), kw2, test_utils=("test_schema", "test_faketensor"))
        for api in (V1, V2):
            torch.library.opcheck(graph.op(WS[api]), (q, k, v), keywords(api, kw, False))
        g = gen(seed_of("opcheck-update"))
        lse = [randn((5,), g, torch.float32) for _ in range(2)]
        parts = [randn((5, 8), g, F16) for _ in range(2)]
        for update_type in (0, 1):
            torch.library.opcheck(torch.ops.fia.npu_attention_update.default, (lse, parts, update_type))

    def test_out_operator_called_eagerly(self):
        """torch.ops.fia.<name>.out on plain tensors is the eager .out: same result, the caller's tensors,
        checked before anything is computed."""
        q, k, v, kw = case("decode", "dense", seed_of("eager-op"))
        kw = keywords(V2, kw, True)
        out, l = fia.npu_fused_infer_attention_score_v2(q, k, v, **kw)
        a, s = nan_like(out), nan_like(l)
        res = graph.op(V2, out=True)(q, k, v, **kw, attention_out=a, softmax_lse=s)
        assert res[0] is a and res[1] is s and torch.equal(a, out) and torch.equal(s, l)
        a = nan_like(out)
        with pytest.raises(fia.FiaInputError, match=r"^softmax_lse: expected .*\(return_softmax_lse is true\)"):
            graph.op(V2, out=True)(q, k, v, **kw, attention_out=a, softmax_lse=s.double())
        assert torch.isnan(a).all()

    def test_fake_out_checks_the_callers_tensors(self):
        """The traced .out decomposition checks the caller tensors against the functional op's fake outputs."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        q, k, v, kw = case("decode", "paged", seed_of("fake"))
        kw = keywords(V1, kw, True)
        a, s = _outputs()
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fq, fk, fv, fa, fs = (mode.from_tensor(t) for t in (q, k, v, a, s))
            res = graph.op(V1, out=True)(fq, fk, fv, **kw, attention_out=fa, softmax_lse=fs)
            assert res[0] is fa and res[1] is fs
            with pytest.raises(fia.FiaInputError, match=r"^attention_out: expected a float16 tensor of shape"):
                graph.op(V1, out=True)(fq, fk, fv, **kw, attention_out=fa[:1], softmax_lse=fs)
