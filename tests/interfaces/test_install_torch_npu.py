"""fia.install_as_torch_npu and `python -m fia run`: Ascend code that does `import torch_npu` and calls
torch.ops.npu.* runs unchanged (docs/PORTING.md). Installing changes the process (sys.modules, a torch.ops
namespace), so every case runs in a child process."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from paths import ROOT, child_env

pytestmark = pytest.mark.backend_independent      # process-level: run once (conftest)

OPS = ("npu_fused_infer_attention_score", "npu_fused_infer_attention_score_v2", "npu_incre_flash_attention",
       "npu_prompt_flash_attention", "npu_attention_update", "_npu_fused_infer_attention_score_get_max_workspace",
       "_npu_fused_infer_attention_score_v2_get_max_workspace", "_npu_fused_infer_attention_score_infer_output",
       "_npu_fused_infer_attention_score_v2_infer_output")

_INSTALLED = textwrap.dedent('''
    import sys, torch, fia
    mod = fia.install_as_torch_npu()
    import torch_npu
    assert torch_npu is mod is fia.torch_npu and fia.install_as_torch_npu() is mod      # idempotent
    for name in %r:
        assert hasattr(torch.ops.npu, name), name
        assert str(getattr(torch.ops.npu, name).default._schema).split("::", 1)[1] == \\
            str(getattr(torch.ops.fia, name).default._schema).split("::", 1)[1], name   # torch_npu's schemas
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g).half()
    q, k, v = r(2, 8, 1, 64), r(2, 2, 96, 64), r(2, 2, 96, 64)
    kw = dict(num_heads=8, num_key_value_heads=2, input_layout="BNSD", scale=0.125, actual_seq_lengths_kv=[96, 40])
    want, want_lse = fia.npu_fused_infer_attention_score(q, k, v, softmax_lse_flag=True, **kw)
    got, got_lse = torch.ops.npu.npu_fused_infer_attention_score(q, k, v, softmax_lse_flag=True, **kw)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    assert not torch.isnan(want).any() and want.abs().max() > 0
    out, lse = torch.full_like(want, float("nan")), torch.full_like(want_lse, float("nan"))
    torch.ops.npu.npu_fused_infer_attention_score.out(q, k, v, softmax_lse_flag=True, attention_out=out,
                                                      softmax_lse=lse, **kw)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    inc = torch.ops.npu.npu_incre_flash_attention(q, k, v, num_heads=8, num_key_value_heads=2, input_layout="BNSD",
                                                  scale_value=0.125, actual_seq_lengths=[96, 40])
    assert torch.equal(inc, want)
    qp = r(2, 8, 5, 64)
    pro = torch.ops.npu.npu_prompt_flash_attention(qp, k, v, num_heads=8, num_key_value_heads=2, input_layout="BNSD",
                                                   scale_value=0.125)
    assert torch.equal(pro, fia.npu_prompt_flash_attention(qp, k, v, num_heads=8, num_key_value_heads=2,
                                                           input_layout="BNSD", scale_value=0.125))
    o2, _ = torch.ops.npu.npu_fused_infer_attention_score_v2(q, k, v, num_query_heads=8, num_key_value_heads=2,
                                                             input_layout="BNSD", softmax_scale=0.125,
                                                             actual_seq_kvlen=[96, 40])
    assert torch.equal(o2, want)
    lses = [torch.randn(6, generator=g) for _ in range(2)]
    outs = [torch.randn(6, 16, generator=g) for _ in range(2)]
    m1 = torch.ops.npu.npu_attention_update(lses, outs, 0)[0]
    assert torch.equal(m1, fia.npu_attention_update(lses, outs, 0)[0])
    shape = torch.ops.npu._npu_fused_infer_attention_score_infer_output(q, v, num_heads=8, num_key_value_heads=2,
                                                                        input_layout="BNSD")[0].shape
    assert shape == want.shape
    f = torch.compile(lambda q, k, v: torch.ops.npu.npu_fused_infer_attention_score(q, k, v, **kw)[0],
                      fullgraph=True, backend="aot_eager")
    assert torch.equal(f(q, k, v), want)
    print("ok")
''' % (OPS,))


def _child(code: str, extra_path: str = "") -> subprocess.CompletedProcess:
    env = child_env(dict(os.environ))
    if extra_path:
        env["PYTHONPATH"] = extra_path + os.pathsep + env["PYTHONPATH"]
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


def test_installed_torch_npu_and_torch_ops_npu_give_fias_results():
    r = _child(_INSTALLED)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "ok", r.stderr[-4000:]


def test_a_real_torch_npu_is_never_shadowed(tmp_path):
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n")
    r = _child(textwrap.dedent('''
        import sys, torch, fia
        try:
            fia.install_as_torch_npu()
        except fia.FiaUnsupportedError as e:
            assert "real torch_npu is importable" in str(e) and "nothing was changed" in str(e), str(e)
        else:
            raise AssertionError("installed over a real torch_npu")
        assert "torch_npu" not in sys.modules
        assert not hasattr(torch.ops.npu, "npu_fused_infer_attention_score")
        import torch_npu
        assert torch_npu.REAL
        print("ok")
    '''), extra_path=str(tmp_path))
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "ok", r.stderr[-4000:]


def test_python_m_fia_run_runs_a_script_unchanged(tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent('''
        import sys, torch
        import torch_npu                       # an Ascend script, unchanged
        q, k = torch.randn(1, 4, 1, 32).half(), torch.randn(1, 4, 50, 32).half()
        out, _ = torch.ops.npu.npu_fused_infer_attention_score(q, k, k, num_heads=4, input_layout="BNSD")
        print("argv", sys.argv[1:], tuple(out.shape), __name__)
        sys.exit(int(sys.argv[1]))
    '''))
    env = child_env(dict(os.environ))
    r = subprocess.run([sys.executable, "-m", "fia", "run", str(script), "3", "--flag"], capture_output=True,
                       text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 3, r.stderr[-4000:]
    assert r.stdout.strip() == "argv ['3', '--flag'] (1, 4, 1, 32) __main__"
