"""fia.distributed against single-process FIA on the whole sequence, in real gloo process groups on 127.0.0.1.

Each group is one set of processes (tests/clients/_distributed_worker.py) that runs a list of cases and writes one record
per case; the tests below check the records. Every process has a wall-clock timeout and is killed if it
outlives it, the process group has a short timeout, so a hang fails the test instead of blocking the suite.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fia
from _distributed_worker import suite
from fia import distributed as fd
from paths import ROOT

pytestmark = pytest.mark.backend_independent      # one run, not one per backend: the workers pick backends

WORKER = Path(__file__).resolve().parent / "_distributed_worker.py"
GROUP_TIMEOUT_S = 8          # torch.distributed's timeout inside the workers
PROCESS_TIMEOUT_S = 120      # a whole group of workers, cases included


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_group(world: int, name: str, tmp: Path) -> dict:
    """Start `world` workers on suite `name`; -> {"records": [per rank list], "codes": [...], "wall": s}."""
    port = _free_port()
    env = dict(os.environ, FIA_JIT="off", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("FIA_BACKEND", None)
    procs, outs = [], []
    t0 = time.monotonic()
    try:
        for r in range(world):
            out = tmp / f"{name}-{world}-{r}.json"
            outs.append(out)
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), str(r), str(world), str(port), name, str(out), str(GROUP_TIMEOUT_S)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        codes, logs = [], []
        for p in procs:
            left = max(1.0, PROCESS_TIMEOUT_S - (time.monotonic() - t0))
            try:
                log, _ = p.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                p.kill()
                log, _ = p.communicate()
                pytest.fail(f"distributed workers of suite {name!r} (world {world}) hung past {PROCESS_TIMEOUT_S} s:"
                            f"\n{log[-3000:]}")
            codes.append(p.returncode)
            logs.append(log)
    finally:
        for p in procs:                               # never leave a worker behind
            if p.poll() is None:
                p.kill()
                p.wait()
    records = [json.loads(o.read_text()) if o.exists() else None for o in outs]
    return {"records": records, "codes": codes, "logs": logs, "wall": time.monotonic() - t0}


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """Each group runs once per module, on first use."""
    cache = {}

    def get(world: int, name: str) -> dict:
        if (world, name) not in cache:
            cache[(world, name)] = _run_group(world, name, tmp_path_factory.mktemp(f"{name}{world}"))
        return cache[(world, name)]
    return get


def _records(res: dict, case: str) -> list:
    out = []
    for r, recs in enumerate(res["records"]):
        assert recs is not None, f"rank {r} wrote no results (exit {res['codes'][r]}):\n{res['logs'][r][-3000:]}"
        found = [x for x in recs if x["case"] == case]
        assert found, f"rank {r} did not reach case {case!r}:\n{res['logs'][r][-3000:]}"
        out.append(found[0])
    return out


VALUE_CASES = [(w, n, c) for w, n in ((2, "main"), (4, "main4")) for c, _ in suite(n, w)
               if c.startswith(("decode-", "ring-", "after-"))]


@pytest.mark.parametrize("world,suite_name,case", VALUE_CASES, ids=[f"w{w}-{c}" for w, _, c in VALUE_CASES])
def test_matches_single_process(groups, world, suite_name, case):
    res = groups(world, suite_name)
    for r, rec in enumerate(_records(res, case)):
        assert "error" not in rec, f"rank {r}: {rec.get('error')}: {rec.get('message')}"
        assert rec["shape_ok"] and rec["dtype_ok"], f"rank {r}: shape / dtype differ: {rec}"
        assert rec["out"] <= rec["tol"], f"rank {r}: max |out - ref| = {rec['out']} > {rec['tol']}"
        assert rec["lse"] <= 1e-4, f"rank {r}: max |lse - ref| = {rec['lse']}"


def test_workers_exit_cleanly(groups):
    for world, name in ((2, "main"), (4, "main4")):
        res = groups(world, name)
        assert res["codes"] == [0] * world, "\n".join(log[-2000:] for log in res["logs"])


def test_mismatched_call_raises_on_every_rank(groups):
    recs = _records(groups(2, "main"), "err-mismatch")
    for r, rec in enumerate(recs):
        assert rec.get("error") == "FiaInputError", f"rank {r}: {rec}"
        assert rec["argument"] == "query" and "every rank" in rec["message"], rec["message"]
        assert "rank 0" in rec["message"] and "rank 1" in rec["message"], rec["message"]


def test_one_rank_failing_raises_on_the_others(groups):
    rec0, rec1 = _records(groups(2, "main"), "err-local")
    assert rec1.get("error") == "FiaInputError" and rec1["argument"] == "num_heads", rec1
    assert rec0.get("error") == "FiaRuntimeError", rec0
    assert "rank 1" in rec0["message"] and "num_heads" in rec0["message"], rec0["message"]


def test_ring_block_failure_raises_on_every_rank(groups):
    rec0, rec1 = _records(groups(2, "main"), "err-ring-local")
    assert rec1.get("error") == "FiaInputError", rec1
    assert rec0.get("error") == "FiaRuntimeError" and "rank 1" in rec0["message"], rec0


def test_zigzag_shard_round_trip():
    x = torch.randn(2, 24, 3)                                                   # [B, S, H]
    for world in (1, 2, 3):
        parts = [fd.zigzag_shard(x, r, world, dim=1) for r in range(world)]
        assert all(p.shape[1] == 24 // world for p in parts)
        assert torch.equal(fd.zigzag_unshard(parts, dim=1), x)
    w, lens = 2, [8, 4, 12]
    t = torch.randn(sum(lens), 2, 5)                                           # [T, N, D]
    cu = fd.args.lengths_to_cumulative(lens)
    shards = [fd.zigzag_shard(t, r, w, dim=0, cu_seqlens=cu) for r in range(w)]
    assert shards[0][1] == [4, 6, 12]
    assert torch.equal(fd.zigzag_unshard([p for p, _ in shards], dim=0, cu_seqlens=[c for _, c in shards]), t)
    # rank 0 of world 2 holds chunks 0 and 3 of each sequence
    assert torch.equal(shards[0][0][:2], t[0:2]) and torch.equal(shards[0][0][2:4], t[6:8])
    with pytest.raises(fia.FiaInputError, match="divisible"):
        fd.zigzag_shard(x[:, :10], 0, 3, dim=1)


def test_without_process_group_clear_error():
    q = torch.randn(1, 2, 1, 16)
    with pytest.raises(fia.FiaInputError, match="init_process_group"):
        fd.decode_attention(q, q, q, num_heads=2, input_layout="BNSD")


def test_position_dependent_arguments_rejected(groups):
    for rec in _records(groups(2, "main"), "err-mask-no-offset"):
        assert rec.get("error") == "FiaInputError" and rec["argument"] == "atten_mask", rec
        assert "key_offset" in rec["message"], rec["message"]
    for rec in _records(groups(2, "main"), "err-ring-mask"):
        assert rec.get("error") == "FiaUnsupportedError" and rec["message"].startswith("sparse_mode"), rec


def test_dead_rank_ends_in_an_error_not_a_hang(groups):
    res = groups(2, "dies")
    assert res["codes"][1] == 3, res["logs"][1][-2000:]
    recs = res["records"][0]
    assert recs is not None, res["logs"][0][-3000:]
    assert recs[0].get("error") == "FiaRuntimeError", recs[0]
    assert "decode_attention" in recs[0]["message"], recs[0]["message"]
    assert res["wall"] < PROCESS_TIMEOUT_S
