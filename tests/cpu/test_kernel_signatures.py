"""One compiled signature per kernel variant: the arguments the backends hand their Numba kernels are normalized
(dtypes, layouts), so the calls `fia.warmup` makes compile every signature other calls produce and no call
compiles inside itself. A child process runs the warm-up calls, then calls of other shapes, layouts (strided
views), masks, paged caches of one and of several work entries, int8 factors; no kernel gains a signature."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from paths import child_env

pytestmark = pytest.mark.backend_independent      # one child process, whatever backend the suite runs

_CHILD = r"""
import json, torch, fia
from fia import kernel_warmup as W
from fia.backends.decode import kernels as K
from fia.backends.prefill import flash, kernels as P

ENTRIES = {"attend_items": K.attend_items, "attend_merge": K.attend_merge, "merge": K.merge,
           "split_work": K.split_work, "fill_factors": K.fill_factors, "flash_items": P.flash_items,
           "pack_items": P.pack_items}
sigs = lambda: {n: sorted(str(s) for s in d.signatures) for n, d in ENTRIES.items()}
W.run_decode(); W.run_decode_generic(); W.run_prefill()
warm = sigs()
g = torch.Generator().manual_seed(5)
rn = lambda *s, dt=torch.bfloat16: torch.randn(*s, generator=g).to(dt)
f = fia.npu_fused_infer_attention_score
torch.set_num_threads(2)
with fia.validation_mode("portable"):
    with fia.use_backend("decode"):
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            q, k, v = rn(2, 8, 1, 64, dt=dt), rn(2, 300, 2, 64, dt=dt), rn(2, 300, 2, 64, dt=dt)   # BSND
            f(q.transpose(1, 2), k, v, num_heads=8, num_key_value_heads=2, input_layout="BSND", scale=0.1)
            f(q, k.transpose(1, 2), v.transpose(1, 2), num_heads=8, num_key_value_heads=2, input_layout="BNSD",
              actual_seq_lengths_kv=[300, 17], scale=0.1)                                   # strided K / V
        for n in (1, 9):                                                   # paged: one work entry, several
            kc, vc = rn(n * 2, 64, 128), rn(n * 2, 64, 128)
            t = torch.arange(n * 2, dtype=torch.int32).reshape(2, n)
            f(rn(2, 1, 256), kc, vc, num_heads=4, num_key_value_heads=2, input_layout="BSH", block_table=t,
              block_size=64, actual_seq_lengths_kv=[n * 64, n * 64 - 5], scale=0.1)
        k8 = torch.randint(-100, 100, (2, 2, 200, 64), generator=g, dtype=torch.int8)
        f(rn(2, 4, 1, 64, dt=torch.float16), k8, k8, num_heads=4, num_key_value_heads=2, input_layout="BNSD",
          key_antiquant_scale=rn(2, 200, dt=torch.float32).abs(), value_antiquant_scale=rn(2, 200, dt=torch.float32).abs(),
          key_antiquant_mode=1, value_antiquant_mode=1)
    own = [dt for dt, on in flash.ENABLED_FOR.items() if on()]
    with fia.use_backend("prefill"):
        for dt in own:
            q, k = rn(1, 96, 4, 64, dt=dt), rn(1, 96, 2, 64, dt=dt)                           # BSND: strided views
            f(q, k, k, num_heads=4, num_key_value_heads=2, input_layout="BSND", scale=0.1, sparse_mode=3,
              atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1))
            f(q, k, k, num_heads=4, num_key_value_heads=2, input_layout="BSND", scale=0.1)   # no mask
print(json.dumps({"warm": warm, "after": sigs()}))
"""


def test_no_call_adds_a_kernel_signature_beyond_the_warmup():
    env = dict(os.environ, FIA_JIT="sync")
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=child_env(env),
                       timeout=900, cwd=os.path.dirname(__file__))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for name, after in got["after"].items():
        new = sorted(set(after) - set(got["warm"][name]))
        assert not new, f"{name}: signatures the warm-up did not compile:\n" + "\n".join(new)
    assert len(got["warm"]["merge"]) == 1 and len(got["warm"]["split_work"]) == 1
