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

# the classes' CPUs: (class, vendor, Numba CPU name, features: what the CPU offers, the kernels' choices read only
# these, and the decode kernels' per-CPU defaults there: prefetch policy, touch pass for items of all KV heads --
# decode.kernels.params PREFETCH_DEFAULT / TOUCH_DEFAULT: the touch pass only where the policy is not "t1")
EMULATED = {
    "1-amd": (1, "AMD", "znver3", "+avx,+avx2,+fma,+f16c,+sse4.2,+sse4a", "nta-v", True),
    "1-intel": (1, "Intel", "skylake", "+avx,+avx2,+fma,+f16c,+sse4.2", "t1", False),
    "2-intel": (2, "Intel", "icelake-server", "+avx,+avx2,+fma,+f16c,+avx512f,+avx512bw,+avx512vl,+avx512vnni",
                "t1", False),
    "3-amd": (3, "AMD", "znver4", "+avx,+avx2,+fma,+f16c,+sse4a,+avx512f,+avx512bw,+avx512vl,+avx512vnni,+avx512bf16",
              "t1", False),
    "3-amd-zen5": (3, "AMD", "znver4", "+avx,+avx2,+fma,+f16c,+sse4a,+avx512f,+avx512bw,+avx512vl,+avx512vnni,"
                   "+avx512bf16,+avxvnni", "nta+ahead", True),
    "3-intel": (3, "Intel", "sapphirerapids", "+avx,+avx2,+fma,+f16c,+avx512f,+avx512bw,+avx512vl,+avx512vnni,"
                "+avx512bf16,+avx512fp16,+avxvnni", "t1", False),
    "4-intel": (4, "Intel", "sapphirerapids", "+avx,+avx2,+fma,+f16c,+avx512f,+avx512bw,+avx512vl,+avx512vnni,"
                "+avx512bf16,+avx512fp16,+avxvnni,+amx-tile,+amx-bf16,+amx-int8", "t1", False),
}
_CHILD = ("import json; from fia.cpu.classes import cpu_class; from fia.backends.decode.kernels import params as P; "
          "from fia.backends.prefill import flash as F; c = cpu_class(); print(json.dumps([c.number, c.vendor, "
          "P.PREFETCH_POLICY, bool(P.DP_FLAGS & P.DP_TOUCH), bool(P.DP_FLAGS & P.DP_QK), F.BF16_DP, F.ENABLED_F16, "
          "F.small_aten_limit(64), F.small_aten_limit(128)]))")
# the decode kernels' bf16 form: vdpbf16ps on AMD's class 3 and where AMX tiles run (DP_QK), float32 FMAs elsewhere;
# the prefill kernel's choices: bf16 by vdpbf16ps on AMD only (BF16_DP), float16 on ATen's kernel on Intel's AVX-512
# CPUs (ENABLED_F16), whole bf16 calls on ATen's kernel up to 64 x 64 positions per head on AMD, far more on Intel
# (small_aten_limit at head dims 64 and 128)
SMALL_ATEN = {"AMD": [64 * 64, 64 * 64], "Intel": [23 * 320 * 320, 320 * 320]}


@pytest.mark.parametrize("cpu", sorted(EMULATED))
def test_each_x86_class_is_recognized_with_its_kernel_choices(cpu):
    number, vendor, name, feats, policy, touch = EMULATED[cpu]
    env = {k: v for k, v in os.environ.items()
           if k not in ("FIA_DECODE_PREFETCH", "FIA_DECODE_TOUCH", "FIA_DECODE_DP", "FIA_PREFILL_DP", "FIA_PREFILL_OWN")}
    env.update(NUMBA_CPU_NAME=name, NUMBA_CPU_FEATURES=feats)
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    bf16_dp = number == 3 and vendor == "AMD"
    own_f16 = vendor == "AMD" or number == 1
    decode_dp = bf16_dp or number == 4             # bf16 decode by vdpbf16ps (and AMX tiles), else FMAs
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == [number, vendor, policy, touch, decode_dp, bf16_dp, own_f16, *SMALL_ATEN[vendor]]


def test_explain_names_the_class():
    q = torch.randn(1, 8, 1, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    text = str(fia.explain(q, k, k, num_heads=8, num_key_value_heads=2, input_layout="BNSD"))
    assert text.splitlines()[-1] == f"cpu: {cpu_class()}"
    assert f"class {cpu_class().number}: " in text
