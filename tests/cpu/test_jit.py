"""Tiered execution (fia.cpu.jit): background builds into the on-disk cache, their failure modes, FIA_JIT modes,
and the tier switch of automatic backend selection. Each case runs in a child process with its own Numba cache
folder (Numba reads NUMBA_CACHE_DIR at import), on a toy kernel set (tests/cpu/jit_toy) or, for the switch, the
decode backend itself."""
import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.backend_independent      # one run with automatic backend selection (conftest)

HERE = os.path.dirname(os.path.abspath(__file__))


PRELUDE = """
import json, os, sys, time
from fia.cpu import jit
jit.register(jit.KernelSet("toy", "toy_kernels", ("twice",), "toy_kernels:warm"))
"""


def _env(cache: str, mode: str, mod: str, **env) -> dict:
    """The toy module lives in `mod` (a copy per test: Numba may fall back to a __pycache__ beside it)."""
    if not os.path.exists(os.path.join(mod, "toy_kernels.py")):
        os.makedirs(mod, exist_ok=True)
        shutil.copy(os.path.join(HERE, "jit_toy", "toy_kernels.py"), mod)
    return dict(os.environ, NUMBA_CACHE_DIR=cache, FIA_JIT=mode,
                PYTHONPATH=mod + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)


def _child(code: str, cache: str, *, mode="background", timeout=300, mod=None, **env) -> dict:
    """Run `code` (which prints one JSON line last) in a fresh interpreter with the toy set registered."""
    e = _env(cache, mode, mod or os.path.join(os.path.dirname(cache), "mod"), **env)
    r = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], env=e, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


WAIT_AND_USE = """
    first = jit.ready(["toy"])
    jit.request(["toy"])
    ok = jit.wait(["toy"], timeout=240)
    import toy_kernels
    val = toy_kernels.twice(2.0) if ok else None
    tw = toy_kernels.twice
    print(json.dumps(dict(first=first, ok=ok, val=val, describe=jit.describe("toy"),
                          misses=len(tw._cache_misses), hits=sum(tw._cache_hits.values()))))
"""


def test_background_build_then_load_without_compiling(tmp_path):
    r = _child(WAIT_AND_USE, str(tmp_path / "cache"))
    assert r["first"] is False and r["ok"] is True and r["val"] == 4.0
    assert r["misses"] == 0 and r["hits"] == 1                     # loaded from the child's build, not compiled
    assert r["describe"] == "toy kernels compiled (in the cache)"
    again = _child("print(json.dumps(dict(ready=jit.ready(['toy']))))", str(tmp_path / "cache"))
    assert again["ready"] is True                                   # a later process finds the cache


def test_build_that_crashes_leaves_the_set_unavailable(tmp_path):
    r = _child(WAIT_AND_USE, str(tmp_path / "cache"), TOY_WARM_EXIT="7")
    assert r["ok"] is False and r["val"] is None
    assert "exited with status 7" in r["describe"]


def test_cache_folder_that_cannot_be_written(tmp_path):
    """No folder Numba could cache in (files where its folders would go): the build cannot help, the set stays
    unavailable and nothing hangs."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    mod = tmp_path / "mod"
    mod.mkdir()
    (mod / "__pycache__").write_text("not a folder")
    r = _child(WAIT_AND_USE.replace("import toy_kernels\n    val = toy_kernels.twice(2.0) if ok else None",
                                    "val = None").replace("tw = toy_kernels.twice", "").replace(
                   "misses=len(tw._cache_misses), hits=sum(tw._cache_hits.values())", "misses=0, hits=0"),
               str(blocker / "cache"), mod=str(mod), HOME=str(blocker), XDG_CACHE_HOME=str(blocker / "x"))
    assert r["ok"] is False and "unavailable" in r["describe"], r


def test_two_processes_build_once(tmp_path):
    cache, log = str(tmp_path / "cache"), str(tmp_path / "log")
    e = _env(cache, "background", str(tmp_path / "mod"), TOY_WARM_LOG=log)
    ps = [subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(WAIT_AND_USE)], env=e,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in ps]
    for p, (out, err) in zip(ps, outs):
        assert p.returncode == 0, err[-3000:]
        r = json.loads(out.strip().splitlines()[-1])
        assert r["ok"] is True and r["val"] == 4.0
    with open(log) as f:
        assert len(f.read().split()) == 1                          # the second build found the first one's


def test_mode_off_never_builds_but_loads(tmp_path):
    cache = str(tmp_path / "cache")
    r = _child(WAIT_AND_USE, cache, mode="off", timeout=120)
    assert r["ok"] is False and "never compiled" in r["describe"]
    assert not os.path.exists(cache) or not any(n.endswith(".nbi") for _, _, fs in os.walk(cache) for n in fs)
    _child(WAIT_AND_USE, cache)                                     # built once in background mode ...
    r = _child(WAIT_AND_USE, cache, mode="off")
    assert r["first"] is True and r["val"] == 4.0 and r["misses"] == 0     # ... then used from the cache


def test_mode_sync_compiles_in_process(tmp_path):
    r = _child(WAIT_AND_USE, str(tmp_path / "cache"), mode="sync")
    assert r["first"] is True and r["val"] == 4.0 and r["misses"] == 1


def test_first_decode_call_runs_on_the_torch_backend_while_decode_builds(tmp_path):
    """Automatic selection with an empty cache: the torch backend answers at once, right; explain and the log
    say what is happening; the build is a child process (stopped here: compiling it takes minutes)."""
    code = """
        import logging, torch, fia
        from fia.backends import registry
        logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
        g = torch.Generator().manual_seed(5)
        q = torch.randn(2, 8, 1, 128, generator=g).to(torch.bfloat16)
        k = torch.randn(2, 2, 300, 128, generator=g).to(torch.bfloat16)
        v = torch.randn(2, 2, 300, 128, generator=g).to(torch.bfloat16)
        kw = dict(num_heads=8, num_key_value_heads=2, input_layout="BNSD", scale=0.088, softmax_lse_flag=True)
        t = time.perf_counter()
        out, lse = fia.npu_fused_infer_attention_score(q, k, v, **kw)
        first = time.perf_counter() - t
        with fia.use_backend("reference"):
            ro, rl = fia.npu_fused_infer_attention_score(q, k, v, **kw)
        err = float((out.float() - ro.float()).abs().max())
        rep = str(fia.explain(q, k, v, **kw))
        b = jit._BUILDS["decode"]
        alive = b.proc.poll() is None
        b.proc.kill()
        print(json.dumps(dict(first=first, err=err, rep=rep, alive=alive, lse=float((lse - rl).abs().max()))))
    """
    r = _child(code, str(tmp_path / "cache"))
    assert r["err"] < 2e-2 and r["lse"] < 1e-3
    assert r["first"] < 30                                            # no compiler in the call (import aside)
    assert "backend: torch" in r["rep"] and "being built in the background" in r["rep"], r["rep"]
    assert r["alive"]


@pytest.mark.parametrize("kv,d,generic", [(torch.bfloat16, 128, False), (torch.float16, 64, False),
                                          (torch.int8, 128, False), (torch.float32, 128, False),
                                          (torch.float32, 40, True), (torch.bfloat16, 72, True)], ids=str)
def test_decode_asks_for_the_generic_build_only_where_it_runs_it(kv, d, generic, monkeypatch):
    """The generic float32 loops (about half the decode build) are their own kernel set: a call needs them only for
    K / V the IR kernels do not cover -- decided from metadata as the launch decides it per source (float32 K / V
    only without the kernel switch DP_F32)."""
    import fia
    from fia import parse
    from fia.backends import registry
    q = torch.randn(2, 4, 1, d).to(torch.float16 if kv == torch.int8 else kv)
    k = (torch.randint(-9, 9, (2, 2, 64, d), dtype=torch.int8) if kv == torch.int8
         else torch.randn(2, 2, 64, d).to(kv))
    args = dict(query=q, key=k, value=k)
    for name, prm in inspect.signature(fia.eager.npu_fused_infer_attention_score).parameters.items():
        args.setdefault(name, prm.default)
    args.update(num_heads=4, num_key_value_heads=2, input_layout="BNSD")
    if kv == torch.int8:
        args.update(antiquant_scale=torch.rand(2, 2, 1, d).to(torch.float16), antiquant_mode=0)
    with fia.validation_mode("portable"):
        p = parse.parse_fused(args)
    sets = registry.by_name("decode").kernel_sets(p)
    assert sets == (("decode", "decode-generic") if generic else ("decode",))
    from fia.backends.decode import kernels as K
    monkeypatch.setattr(K, "DP_FLAGS", K.DP_FLAGS & ~K.DP_F32)
    generic = generic or kv == torch.float32
    assert registry.by_name("decode").kernel_sets(p) == (("decode", "decode-generic") if generic else ("decode",))


def test_warmup_command_builds_a_set_and_reports(tmp_path):
    """`python -m fia warmup SET` compiles into the cache, shows progress and a summary; a second run finds it."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "fia", "warmup", "prefill-pse"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "[1/1] prefill-pse kernels: compiling..." in first.stderr and "1 kernel set(s) ready" in first.stderr
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert "prefill-pse: found in the cache" in again.stderr
    bad = subprocess.run([sys.executable, "-m", "fia", "warmup", "nosuchset"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "unknown kernel set" in bad.stderr
