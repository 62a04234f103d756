"""Explainable dispatch: fia.explain(...) says which backend would run and why the others cannot."""
from typing import List

import os

import pytest
import torch

import fia
from fia.backends import registry
from fia.backends.base import Backend
from fia.backends.reference import ReferenceBackend
from util import gen, randn

pytestmark = pytest.mark.backend_independent      # one run with automatic backend selection (conftest)


def qkv(device="cpu"):
    g = gen(700)
    q, k, v = randn((2, 8, 1, 64), g), randn((2, 2, 128, 64), g), randn((2, 2, 128, 64), g)
    return q.to(device), k.to(device), v.to(device)


KW = dict(num_heads=8, num_key_value_heads=2, input_layout="BNSD", actual_seq_lengths_kv=[128, 50])


class PickyBackend(Backend):
    """A fast backend that only takes prefill calls with bfloat16 (stands in for the real fast backends)."""
    name = "picky"
    priority = 10

    def not_supported_reasons(self, p) -> List[str]:
        why = super().not_supported_reasons(p)
        if p.is_decode:
            why.append("decode (Q_S = 1) not supported")
        if p.dtype != torch.bfloat16:
            why.append(f"dtype {str(p.dtype).replace('torch.', '')} not in (bfloat16,)")
        return why

    def run(self, p):  # pragma: no cover - never selected here
        raise AssertionError


def spy_runs(monkeypatch):
    """Record every backend run (whichever backends are registered)."""
    calls = []
    for b in registry.backends():
        real = b.run
        monkeypatch.setattr(b, "run", lambda p, real=real, name=b.name: calls.append(name) or real(p))
    return calls


def test_explain_supported_case(monkeypatch):
    """With the registered backends: the report names the backend select() picks, computing nothing."""
    calls = spy_runs(monkeypatch)
    q, k, v = qkv()
    rep = fia.explain(q, k, v, **KW)
    assert isinstance(rep, fia.DispatchReport)
    assert calls == []                                # nothing computed
    assert rep.supported and list(rep.reasons) == [b.name for b in registry.backends()]
    assert rep.reasons[rep.selected] == []
    text = str(rep).splitlines()
    assert text[0] == ("npu_fused_infer_attention_score: B=2 N=8 KV_N=2 Q_S=1 KV_S=128 D=64 Dv=64 float16 BNSD "
                       "decode kv=dense")
    assert text[1] == f"backend: {rep.selected}"
    assert f"  {rep.selected}: can run (selected)" in text
    for name in rep.reasons:                          # one line per backend
        assert any(line.startswith(f"  {name}: ") for line in text)
    fia.npu_fused_infer_attention_score(q, k, v, **KW)
    assert calls == [rep.selected]                    # the call runs the backend the report named


def test_explain_exact_text(monkeypatch):
    monkeypatch.setattr(registry, "_BACKENDS", [ReferenceBackend()])
    q, k, v = qkv()
    assert str(fia.explain(q, k, v, **KW)).splitlines() == [
        "npu_fused_infer_attention_score: B=2 N=8 KV_N=2 Q_S=1 KV_S=128 D=64 Dv=64 float16 BNSD decode kv=dense",
        "backend: reference",
        "  reference: can run (selected)",
    ]


def test_explain_lists_why_other_backends_cannot(monkeypatch):
    monkeypatch.setattr(registry, "_BACKENDS", [PickyBackend(), ReferenceBackend()])
    q, k, v = qkv()
    rep = fia.explain(q, k, v, **KW)
    assert rep.selected == "reference"
    assert rep.reasons["picky"] == ["decode (Q_S = 1) not supported", "dtype float16 not in (bfloat16,)"]
    assert "  picky: decode (Q_S = 1) not supported; dtype float16 not in (bfloat16,)" in str(rep).splitlines()
    with fia.use_backend("reference"):
        forced = fia.explain(q, k, v, **KW)
    assert forced.selected == "reference" and forced.forced == "reference"
    assert "backend: reference (forced)" in str(forced)


def test_explain_unsupported_case_has_the_error_text(monkeypatch):
    """No backend computes on the meta device: the report carries the FiaUnsupportedError's text that the eager
    function raises (the public function answers meta tensors with the shape-only graph-mode kernel)."""
    monkeypatch.setattr(registry, "_BACKENDS", [PickyBackend(), ReferenceBackend()])
    q, k, v = qkv("meta")
    rep = fia.explain(q, k, v, **KW)
    assert not rep.supported and rep.selected is None
    out, _ = fia.npu_fused_infer_attention_score(q, k, v, **KW)
    assert out.device.type == "meta" and out.shape == q.shape
    with pytest.raises(fia.FiaUnsupportedError) as e:
        fia.eager.npu_fused_infer_attention_score(q, k, v, **KW)
    assert e.value.reasons == rep.reasons
    text = str(rep).splitlines()
    for line in str(e.value).splitlines():
        assert line in text
    assert "  reference: device meta not in ('cpu', 'cuda')" in text
    assert text[1] == "backend: none"


def test_explain_invalid_input_raises_like_the_call():
    q, k, v = qkv()
    kw = dict(KW, num_key_value_heads=3)
    with pytest.raises(fia.FiaInputError) as call:
        fia.npu_fused_infer_attention_score(q, k, v, **kw)
    with pytest.raises(fia.FiaInputError) as exp:
        fia.explain(q, k, v, **kw)
    assert str(exp.value) == str(call.value)
    with pytest.raises(TypeError):
        fia.explain(q, k, v, no_such_keyword=1)


def _kernel_line(q, k, v, **kw):
    rep = fia.explain(q, k, v, num_heads=q.shape[1], num_key_value_heads=k.shape[1], input_layout="BNSD", **kw)
    assert rep.selected == "decode", str(rep)
    lines = str(rep).splitlines()
    i = lines.index("  decode: can run (selected)")
    assert lines[i + 1].startswith("    kernels: ") and rep.details == lines[i + 1].strip()
    return rep.details


def test_explain_names_the_decode_kernels(monkeypatch):
    """The decode backend's report line names the kernels its items pick (decode.kernels.params.kernel_flags) on
    this CPU and under the kernel switches (DP_FLAGS), the generic loops for head dims they do not take (and float32
    K / V without DP_F32)."""
    pytest.importorskip("numba")
    from fia.backends.decode import kernels as K
    g = gen(701)
    q = randn((1, 8, 1, 128), g).to(torch.bfloat16)
    k, v = (randn((1, 2, 64, 128), g).to(torch.bfloat16) for _ in range(2))
    # bf16 dot products on AMD's AVX512-BF16 CPUs and with AMX; elsewhere float32 FMAs, bf16 widened in even / odd
    # halves (DP_EO)
    dp = ("bf16 dot products (AVX512-BF16)" if K.DP_FLAGS & K.DP_QK else "float32 FMA (bf16 in even / odd halves)")
    kernels = K.DP_FLAGS & ~K.DP_PREFETCH_BITS
    assert kernels & K.DP_EO
    from fia.backends.decode import plan as DEC_PLAN
    monkeypatch.setattr(K, "DP_FLAGS", kernels | K.PREFETCH_POLICIES["nta+ahead"])
    # a call reading at most PREFETCH_MIN_BYTES of K / V runs without the prefetches (its data may be cached)
    assert _kernel_line(q, k, v) == (f"kernels: QK {dp}, PV {dp}, no software prefetch (at most "
                                     f"{DEC_PLAN.PREFETCH_MIN_BYTES >> 10} KiB of K / V: likely cached)")
    assert _kernel_line(q[..., :40].contiguous(), k[..., :40].contiguous(), v[..., :40].contiguous()) == (
        "kernels: QK generic float32 loops, PV generic float32 loops")      # (never prefetch: nothing to say)
    monkeypatch.setattr(DEC_PLAN, "PREFETCH_MIN_BYTES", -1)            # the small calls below prefetch as large ones
    assert _kernel_line(q, k, v) == f"kernels: QK {dp}, PV {dp}, software prefetch (nta; rows ahead: K, V)"
    assert _kernel_line(q.half(), k.half(), v.half()) == (
        "kernels: QK float32 FMA, PV float32 FMA, software prefetch (nta; rows ahead: K, V)")
    # float32 K / V (portable mode): the same kernels on float32 rows (K.DP_F32), prefetching as "t1+ahead" whatever
    # the policy; without the switch the generic loops
    f32 = "QK float32 FMA on float32 rows, PV float32 FMA on float32 rows"
    monkeypatch.setattr(K, "DP_FLAGS", kernels | K.DP_F32 | K.PREFETCH_POLICIES["nta+ahead"])
    with fia.validation_mode("portable"):
        assert _kernel_line(q.float(), k.float(), v.float()) == (
            f"kernels: {f32}, software prefetch (t1; rows ahead: K, V)")
        monkeypatch.setattr(K, "DP_FLAGS", kernels | K.DP_F32 | K.PREFETCH_POLICIES["nta-v"])
        assert _kernel_line(q.float(), k.float(), v.float()) == (
            f"kernels: {f32}, software prefetch (t1; rows ahead: K, V)")
        monkeypatch.setattr(K, "DP_FLAGS", (kernels & ~K.DP_F32) | K.PREFETCH_POLICIES["nta-v"])
        assert _kernel_line(q.float(), k.float(), v.float()) == (
            "kernels: QK generic float32 loops, PV generic float32 loops")
    monkeypatch.setattr(K, "DP_FLAGS", kernels | K.PREFETCH_POLICIES["nta+ahead"])
    k8, v8 = (torch.randint(-100, 100, (1, 2, 64, 128), generator=g, dtype=torch.int8) for _ in range(2))
    sc = randn((1, 2, 1, 128), g).to(torch.bfloat16)
    i8 = f"int16 x int8 dot products ({K.I8_DOT})" if K.HAS_VNNI else "float32 FMA"
    assert _kernel_line(q, k8, v8, key_antiquant_scale=sc, value_antiquant_scale=sc, key_antiquant_mode=0,
                        value_antiquant_mode=0) == (
        f"kernels: QK {i8}, PV {i8}, software prefetch (nta; rows ahead: K)")
    assert _kernel_line(q[..., :40].contiguous(), k[..., :40].contiguous(), v[..., :40].contiguous()) == (
        "kernels: QK generic float32 loops, PV generic float32 loops")
    monkeypatch.setattr(K, "DP_FLAGS", kernels | K.PREFETCH_POLICIES["nta-v"])
    assert _kernel_line(q, k, v) == f"kernels: QK {dp}, PV {dp}, software prefetch (nta; V rows only)"
    monkeypatch.setattr(K, "DP_FLAGS", kernels | K.PREFETCH_POLICIES["t1"])
    assert _kernel_line(q, k, v) == f"kernels: QK {dp}, PV {dp}, software prefetch (t1)"
    # 8 query rows per KV head: AMX tiles where the CPU has them (K.AMX_MIN_ROWS)
    q8 = randn((1, 16, 1, 128), g).to(torch.bfloat16)
    amx = "bf16 AMX tiles (16-key blocks; the rest AVX512-BF16)" if K.HAS_AMX and K.DP_FLAGS & K.DP_QK else dp
    assert _kernel_line(q8, k, v) == f"kernels: QK {amx}, PV {amx}, software prefetch (t1)"
    monkeypatch.setattr(K, "DP_FLAGS", (kernels & ~K.DP_AMX) | K.PREFETCH_POLICIES["t1"])
    assert _kernel_line(q8, k, v) == f"kernels: QK {dp}, PV {dp}, software prefetch (t1)"
    monkeypatch.setattr(K, "DP_FLAGS", kernels | K.PREFETCH_POLICIES["t1"])
    monkeypatch.setattr(K, "DP_FLAGS", kernels | K.PREFETCH_POLICIES["t1+ahead"])
    assert _kernel_line(q, k8, v8, key_antiquant_scale=sc, value_antiquant_scale=sc, key_antiquant_mode=0,
                        value_antiquant_mode=0) == f"kernels: QK {i8}, PV {i8}, software prefetch (t1; rows ahead: K)"
    monkeypatch.setattr(K, "DP_FLAGS", K.DP_PREFETCH)
    assert _kernel_line(q, k, v) == "kernels: QK float32 FMA, PV float32 FMA, software prefetch (t1)"
    monkeypatch.setattr(K, "DP_FLAGS", 0)
    assert _kernel_line(q, k, v) == "kernels: QK float32 FMA, PV float32 FMA"


def _prefetch_policy_in_subprocess(value):
    import subprocess
    import sys
    env = dict(os.environ, FIA_DECODE_PREFETCH=value)
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from fia.backends.decode import kernels as K\n"
            "print(K.PREFETCH_POLICY, K.PREFETCH_DEFAULT, K.DP_FLAGS & K.DP_PREFETCH_BITS)")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    policy, default, bits = r.stdout.split()
    return policy, default, int(bits), r.stderr


def test_decode_prefetch_policy_follows_the_cpu_and_the_environment():
    """The software-prefetch policy of the decode kernels: by CPU (AMD Zen 5, AVX-512 and AVX-VNNI: nta + own rows
    ahead; AMD without AVX-512: nta, V rows only; Zen 4 and Intel: t1), FIA_DECODE_PREFETCH overrides it, and an
    unknown value warns (naming the variable and the choices) and keeps the default instead of breaking `import fia`."""
    pytest.importorskip("numba")
    from fia.backends.decode import kernels as K
    from fia.cpu.simd import target_has
    amd = target_has("sse4a")
    zen5 = amd and target_has("avx512f", "avxvnni")
    zen4 = amd and target_has("avx512f") and not zen5
    assert K.PREFETCH_DEFAULT == ("nta+ahead" if zen5 else "t1" if zen4 or not amd else "nta-v")
    assert K.PREFETCH_POLICIES["t1"] == K.DP_PREFETCH
    assert K.PREFETCH_POLICIES["nta+ahead"] == K.DP_PREFETCH | K.DP_NTA | K.DP_AHEAD
    assert K.PREFETCH_POLICIES["nta-v"] == K.DP_PREFETCH | K.DP_NTA | K.DP_NO_PV_K
    policy, default, bits, _ = _prefetch_policy_in_subprocess("nta-v")
    assert (policy, bits) == ("nta-v", K.DP_PREFETCH | K.DP_NTA | K.DP_NO_PV_K)
    policy, default, bits, _ = _prefetch_policy_in_subprocess("t1+ahead")
    assert (policy, bits) == ("t1+ahead", K.DP_PREFETCH | K.DP_AHEAD)
    policy, default, bits, err = _prefetch_policy_in_subprocess("fast")
    assert policy == default == K.PREFETCH_DEFAULT and bits == K.PREFETCH_POLICIES[default]
    assert "FIA_DECODE_PREFETCH" in err and "'fast'" in err and "nta+ahead" in err
