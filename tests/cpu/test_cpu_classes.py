"""The CPU class FIA's kernels follow (fia.cpu.classes), named by fia.explain and the benchmark: each x86 class
emulated in a child process through the CPU Numba targets (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import fia
from fia.cpu.classes import cpu_class

pytestmark = pytest.mark.backend_independent      # process-level: run once (conftest)

# class -> (Numba CPU name, features): what a CPU of the class offers (the kernels' choices read only these)
EMULATED = {
    1: ("znver3", "+avx,+avx2,+fma,+f16c,+sse4.2,+sse4a"),
    2: ("icelake-server", "+avx,+avx2,+fma,+f16c,+avx512f,+avx512bw,+avx512vl,+avx512vnni"),
    3: ("znver4", "+avx,+avx2,+fma,+f16c,+sse4a,+avx512f,+avx512bw,+avx512vl,+avx512vnni,+avx512bf16"),
    4: ("sapphirerapids", "+avx,+avx2,+fma,+f16c,+avx512f,+avx512bw,+avx512vl,+avx512vnni,+avx512bf16,"
                          "+amx-tile,+amx-bf16,+amx-int8"),
}
VENDOR = {1: "AMD", 2: "Intel", 3: "AMD", 4: "Intel"}
# the decode kernels' per-CPU defaults on each class's emulated CPU: (prefetch policy, touch pass for items of all
# KV heads) -- decode.kernels.params PREFETCH_DEFAULT / TOUCH_DEFAULT (AMD Zen 4 runs without the touch pass)
DECODE_CHOICES = {1: ("nta-v", True), 2: ("t1", True), 3: ("t1", False), 4: ("t1", True)}
_CHILD = ("import json; from fia.cpu.classes import cpu_class; from fia.backends.decode.kernels import params as P; "
          "c = cpu_class(); print(json.dumps([c.number, c.vendor, P.PREFETCH_POLICY, bool(P.DP_FLAGS & P.DP_TOUCH)]))")


@pytest.mark.parametrize("number", sorted(EMULATED))
def test_each_x86_class_is_recognized_with_its_decode_choices(number):
    name, feats = EMULATED[number]
    env = {k: v for k, v in os.environ.items() if k not in ("FIA_DECODE_PREFETCH", "FIA_DECODE_TOUCH")}
    env.update(NUMBA_CPU_NAME=name, NUMBA_CPU_FEATURES=feats)
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [number, VENDOR[number], *DECODE_CHOICES[number]]


def test_explain_names_the_class():
    q = torch.randn(1, 8, 1, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    text = str(fia.explain(q, k, k, num_heads=8, num_key_value_heads=2, input_layout="BNSD"))
    assert text.splitlines()[-1] == f"cpu: {cpu_class()}"
    assert f"class {cpu_class().number}: " in text
