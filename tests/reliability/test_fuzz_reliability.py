"""Seeded reliability fuzzing: the valid random calls of test_fuzz_random, made the way a hostile (or merely
unusual) client makes them. Each case draws one mutation that must not change the answer:

  param     every floating tensor argument an nn.Parameter, in grad mode (how a model holds weights and sinks):
            the numbers of the plain call, results without autograd history;
  neg       the query (and keys / values when they are float tensors) as lazily negated views of their
            negation (torch._neg_view): the numbers of the plain call;
  threads   the call made by three threads at once, each with its own torch.set_num_threads (1, 2, 3), on
            every backend's worker pool: each thread's answer right;

`test_fuzz_fake_tensors` makes every drawn call again under FakeTensorMode (fake copies of every tensor): output
shapes and dtypes of eager, no kernel touched (in one child process: a regression would be a crash).

Beside them, `test_aclnn_table_rewrite` draws paged decode calls whose block table the caller rewrites in place
between the two aclnn phases: to other valid ids (the result is the eager call on the new table, on every
backend) or to an id out of range (an input error naming the table; nothing written).

Every answer is checked against tests/naive.py (float64) through test_fuzz_random's check. FIA_FUZZ_REL_CASES
(default 36) sets the number of seeds.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading

import pytest
import torch

import fia
from fia import aclnn
from fia.errors import FiaBackendUnavailable
from test_fuzz_random import apply_tiles, build, call, check, draw
from util import gen, randn
from paths import child_env

pytestmark = pytest.mark.backend_independent      # one run with automatic backend selection (conftest)

N_CASES = int(os.environ.get("FIA_FUZZ_REL_CASES", "36"))
MUTATIONS = ("param", "neg", "threads")
CASES = [(seed, MUTATIONS[seed % len(MUTATIONS)]) for seed in range(N_CASES)]
INT_MAX = 2147483647


def _floats(x):
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _param(x):
    return torch.nn.Parameter(x.detach().clone()) if _floats(x) else x


def _neg(x):
    return torch._neg_view(-x) if _floats(x) else x


@pytest.mark.parametrize("seed,mutation", CASES, ids=[f"seed_{s}-{m}" for s, m in CASES])
def test_fuzz_reliability(seed, mutation, monkeypatch):
    case = draw(seed)
    apply_tiles(case, monkeypatch)
    bt = build(case)
    if mutation == "param":
        bt.kw = {k: _param(v) for k, v in bt.kw.items()}
        bt.q_in, bt.k_in, bt.v_in = _param(bt.q_in), _param(bt.k_in), _param(bt.v_in)
        with torch.enable_grad():
            out, lse = call(case, bt)
        assert not out.requires_grad and (lse is None or not lse.requires_grad)
        check(case, bt, out.detach(), lse)
    elif mutation == "neg":
        bt.q_in, bt.k_in, bt.v_in = _neg(bt.q_in), _neg(bt.k_in), _neg(bt.v_in)
        for _ in range(3):                                   # the full path, then the memo / replay paths
            check(case, bt, *call(case, bt))
    else:
        results, errors = {}, []

        def worker(n):
            try:
                torch.set_num_threads(n)
                for i in range(3):
                    results[(n, i)] = call(case, bt)
            except BaseException as e:                      # reported below
                errors.append(e)

        before = torch.get_num_threads()
        try:
            ts = [threading.Thread(target=worker, args=(n,)) for n in (1, 2, 3)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        finally:
            torch.set_num_threads(before)
        if errors and not isinstance(errors[0], FiaBackendUnavailable):
            raise errors[0]
        assert len(results) == 9
        for out, lse in results.values():
            check(case, bt, out, lse)


# ---------------------------------------------------------------------------------------------- fake tensors
_FAKE_CHILD = r"""
import json, sys
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
import fia
from test_fuzz_random import build, call, draw

def fake(mode, x):
    if isinstance(x, torch.Tensor):
        return mode.from_tensor(x)
    if isinstance(x, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in x):
        return type(x)(fake(mode, t) for t in x)
    return x

bad = []
for seed in map(int, sys.argv[1:]):
    case = draw(seed)
    bt = build(case)
    want = call(case, bt)
    mode = FakeTensorMode()
    bt.q_in, bt.k_in, bt.v_in = (fake(mode, x) for x in (bt.q_in, bt.k_in, bt.v_in))
    # lengths are host values: a traced / fake call takes them as lists (a fake lengths tensor is an input error)
    bt.kw = {k: v.tolist() if k.startswith("actual_") and isinstance(v, torch.Tensor) else fake(mode, v)
             for k, v in bt.kw.items()}
    try:
        with mode:
            got = call(case, bt)
    except Exception as e:
        bad.append([seed, f"{type(e).__name__}: {e}"[:300]])
        continue
    for w, g in zip(want, got):
        if (w is None) != (g is None) or (w is not None and (w.shape != g.shape or w.dtype != g.dtype)):
            bad.append([seed, f"{None if w is None else (tuple(w.shape), w.dtype)} vs "
                              f"{None if g is None else (tuple(g.shape), g.dtype)}"])
print(json.dumps(bad))
"""


def test_fuzz_fake_tensors():
    """Every drawn case again under FakeTensorMode: eager's shapes and dtypes, nothing computed. One child
    process for all seeds (a regression would be a segmentation fault)."""
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", _FAKE_CHILD] + [str(s) for s, _ in CASES], capture_output=True,
                       text=True, timeout=900, cwd=here, env=child_env(dict(os.environ)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []


# ---------------------------------------------------------------------------------------------- aclnn tables
TABLE_SEEDS = list(range(12))


def _table_case(seed):
    r = random.Random(f"fia-table-{seed}")
    g = gen(1000 + seed)
    b, kvn, group, d = r.randint(1, 3), r.choice([1, 2]), r.choice([1, 2, 4]), r.choice([64, 128])
    bs = r.choice([16, 32, 64])
    lens = [r.randint(1, 4 * bs) for _ in range(b)]
    mb = max((n + bs - 1) // bs for n in lens) + r.randint(0, 1)
    nb = b * mb + r.randint(0, 3)
    dtype = r.choice([torch.float16, torch.bfloat16])
    kc, vc = randn((nb, bs, kvn * d), g, dtype), randn((nb, bs, kvn * d), g, dtype)     # [NB, bs, H]
    q = randn((b, 1, kvn * group * d), g, dtype)
    ids = r.sample(range(nb), b * mb)
    table = torch.tensor(ids, dtype=torch.int32).reshape(b, mb)
    ids2 = r.sample(range(nb), b * mb)
    new = torch.tensor(ids2, dtype=torch.int32).reshape(b, mb)
    return r, q, kc, vc, table, new, lens, kvn * group, kvn, bs


def _v4(q, kc, vc, table, out, lens, n, kvn, bs):
    o = {k: None for k, _ in aclnn._V2_INPUTS[3:] + aclnn._V4_EXTRA_INPUTS}
    o.update(blockTableOptional=table, actualSeqLengthsKvOptional=list(lens))
    attrs = dict(numHeads=n, scaleValue=0.1, preTokens=INT_MAX, nextTokens=INT_MAX, inputLayout="BSH",
                 numKeyValueHeads=kvn, sparseMode=0, innerPrecise=0, blockSize=bs, antiquantMode=0,
                 softmaxLseFlag=False, keyAntiquantMode=0, valueAntiquantMode=0, queryQuantMode=0)
    return aclnn.aclnnFusedInferAttentionScoreV4GetWorkspaceSize(q, [kc], [vc], *o.values(), *attrs.values(),
                                                                   out, None)


@pytest.mark.parametrize("backend", ["reference", "decode"])
@pytest.mark.parametrize("seed", TABLE_SEEDS)
def test_aclnn_table_rewrite(seed, backend):
    r, q, kc, vc, table, new, lens, n, kvn, bs = _table_case(seed)
    out = torch.full((q.shape[0], 1, n * kc.shape[2] // kvn), float("nan"), dtype=q.dtype)
    bad = seed % 3 == 0
    if bad:                                                  # one used entry out of range
        b = r.randrange(len(lens))
        j = r.randrange((lens[b] + bs - 1) // bs)
        new[b, j] = r.choice([kc.shape[0], kc.shape[0] + 7, -1, -3])      # (near: a far one may crash a regression)
    with fia.use_backend(backend):
        ws, ex = _v4(q, kc, vc, table, out, lens, n, kvn, bs)
        table.copy_(new)
        if bad:
            with pytest.raises(fia.FiaInputError, match="blockTableOptional"):
                aclnn.aclnnFusedInferAttentionScoreV4(None, ws, ex)
            assert torch.isnan(out).all()
            return
        assert aclnn.aclnnFusedInferAttentionScoreV4(None, ws, ex) == 0
    with fia.use_backend("reference"):
        want, _ = fia.npu_fused_infer_attention_score(q, kc, vc, num_heads=n, num_key_value_heads=kvn,
                                                      input_layout="BSH", scale=0.1, block_table=new,
                                                      block_size=bs, actual_seq_lengths_kv=lens)
    torch.testing.assert_close(out, want, atol=4e-3, rtol=4e-3)
