"""Smoke tests of fia.bench: one tiny case per kind end to end, the reports, the CLI, the demo, the ceilings.

No timing assertions except a loose (35%) agreement of the measured ceilings with an independent copy and
matmul measurement, retried to ride out a busy machine.
"""
import json
import time

import pytest
import torch

import fia
from fia.bench import cases as C
from fia.bench import machine, report, runner
from fia.bench.__main__ import main
from fia.bench.demo import demo

pytestmark = pytest.mark.backend_independent      # one run with automatic backend selection (conftest)


FAKE = machine.Ceilings(read_gbps=10.0, copy_gbps=10.0, mm_tflops={"fp32": 0.1, "bf16": 0.01, "fp16": 0.01},
                        mm_n={"fp32": 1024, "bf16": 512, "fp16": 512})
TINY = [
    C.Case("tiny-decode-paged", "decode", "fp16", 2, 4, 2, 64, 1, 256, storage="paged"),
    C.Case("tiny-decode-int8", "decode", "bf16", 2, 4, 2, 64, 1, 256, storage="int8-tok"),
    C.Case("tiny-prefill-band", "prefill", "bf16", 1, 4, 2, 64, 256, 256, mask="band", pre=32, next=16),
    C.Case("tiny-prefill-pse", "prefill", "fp16", 1, 4, 2, 64, 128, 128, mask="pse"),
    C.Case("tiny-prefill-psecausal", "prefill", "bf16", 1, 4, 2, 64, 128, 128, mask="psecausal"),
    C.Case("tiny-decode-fp32", "decode", "fp32", 1, 4, 2, 64, 1, 256),       # portable mode, automatic backend
]
IMPL_KEYS = {"status", "peak_mb"}
CASE_KEYS = {"name", "kind", "dtype", "metric", "ceiling", "ceiling_basis", "kv_bytes", "flops", "check", "fia",
             "reference", "sdpa", "speedup_vs_sdpa"}


def test_tiny_cases_end_to_end(tmp_path):
    opts = runner.Options(repeats=1, time_budget_s=0.05, ref_budget_s=5.0)
    records = [runner.run_case(c, FAKE, opts, fia) for c in TINY]
    for rec in records:
        assert CASE_KEYS <= rec.keys()
        st = rec["fia"]["status"]
        if st.startswith("n/a:"):            # a backend gap is reported, not a crash
            continue
        assert st == "ok", (rec["name"], st, rec["check"])
        assert rec["check"]["status"] == "ok" and rec["sdpa"]["status"] == "ok", rec["check"]
        assert rec["check"]["sdpa_rel_err"] <= rec["check"]["tol"]   # the SDPA peer computes the same function
        for impl in ("fia", "sdpa"):
            assert IMPL_KEYS <= rec[impl].keys() and rec[impl]["median_ms"] > 0 and rec[impl]["rate"] > 0
        assert rec["speedup_vs_sdpa"] > 0
    best = machine.Ceilings.best(FAKE, machine.Ceilings(20.0, 5.0, {"fp32": 0.05, "bf16": 0.2, "fp16": 0.01},
                                                        {"fp32": 512, "bf16": 2048, "fp16": 512}))
    assert (best.read_gbps, best.copy_gbps, best.mm_tflops["fp32"], best.mm_n["bf16"]) == (20.0, 10.0, 0.1, 2048)
    runner.apply_ceilings(records, best)
    assert all(r["ceiling"] == (20.0 if r["kind"] == "decode" else 0.2 if r["dtype"] == "bf16" else 0.1)
               for r in records)
    meta = {"argv": "test", "started": "now", "duration_s": 0.0}
    paths = report.write_all(records, FAKE.to_dict(), meta, str(tmp_path))
    data = json.loads(open(paths["json"]).read())
    assert {"meta", "ceilings", "cases"} <= data.keys() and len(data["cases"]) == len(TINY)
    md = open(paths["markdown"]).read()
    assert "| case |" in md
    # each case names the kernel choices fia.explain gives for it, in the JSON and grouped below the table
    for rec, case in zip(records, TINY):
        if rec["fia"]["status"] == "ok":
            inp = C.build(case)
            mode = "portable" if inp.extra.get("portable") else fia.get_validation_mode()
            with fia.use_backend(None), fia.validation_mode(mode):
                assert rec["fia"]["kernels"] == fia.explain(*inp.fia_args(), **inp.fia_kwargs()).details
    named = [r for r in records if r["fia"].get("kernels")]
    assert named and all(f"- {r['fia']['kernels']}: " in md and r["name"] in md for r in named)
    text = report.terminal_table(records, FAKE.to_dict())
    assert text.count("tiny-") == len(TINY) + len(named)
    if "png" in paths:
        assert open(paths["png"], "rb").read(4) == b"\x89PNG"


def test_unsupported_is_reported_not_raised(monkeypatch):
    def refuse(*a, **k):
        raise fia.FiaUnsupportedError("no backend here")
    monkeypatch.setattr(fia, "npu_fused_infer_attention_score", refuse)
    rec = runner.run_case(TINY[0], FAKE, runner.Options(repeats=1, time_budget_s=0.05), fia)
    assert rec["fia"]["status"].startswith("n/a: no backend here")
    assert rec["reference"]["status"].startswith("n/a:")


def test_memory_probe_is_a_call_that_compiled_nothing():
    """A call that compiles numba code (a cold kernel cache: the backend's kernels, then a replay's launch) is
    not the memory probe: the guard calls again, at most three times; otherwise two calls."""
    numba = pytest.importorskip("numba")
    calls = []

    def fn(compiling):
        calls.append(None)
        if len(calls) <= compiling:                          # a new function each time: numba compiles it
            numba.njit(lambda x, k=len(calls): x + k)(1)   # noqa: B008 - k bound at definition on purpose
        return torch.zeros(1)

    for compiling, want in ((0, 2), (1, 2), (2, 3), (5, 3)):
        calls.clear()
        out, info, status = runner._guard(fia, lambda c=compiling: fn(c))
        assert status is None and len(calls) == want, (compiling, len(calls))
        assert info["warm_call_s"] is not None
        assert info["peak_mb"] is None or info["peak_mb"] >= 0


def test_wrong_answer_is_not_timed(monkeypatch):
    real = fia.npu_fused_infer_attention_score

    def call(*a, **k):
        out, lse = real(*a, **k)
        return (out if fia.get_backend() == "reference" else out + 1), lse
    monkeypatch.setattr(fia, "npu_fused_infer_attention_score", call)
    rec = runner.run_case(TINY[2], FAKE, runner.Options(repeats=1, time_budget_s=0.05), fia)
    assert rec["fia"]["status"] == "wrong" and "median_ms" not in rec["fia"] and "median_ms" not in rec["sdpa"]


def test_case_table_and_cli_list(capsys):
    names = [c.name for c in C.full_table()]
    assert len(names) == len(set(names)) == 61
    assert {"decode-fp32-dense-kv4096", "decode-fp32-dense-kv16384"} <= set(names)
    assert {"decode-bf16-fp4-kv4096", "decode-bf16-fp4-kv16384", "decode-bf16-int8-nz-kv4096",
            "decode-bf16-int8-nz-kv16384"} <= set(names)
    nz = C.decode_case("bf16", "int8-nz", 4096, N=64)
    assert nz.dense_twin().storage == "int8-paged" and nz.dense_twin().kv_bytes() == nz.kv_bytes()
    mtp = C.multi_token_decode_case(4, 4096)
    assert mtp.name in names and mtp.S_q == 4 and mtp.kv_bytes() == C.decode_case("bf16", "dense", 4096).kv_bytes()
    assert main(["--quick", "--list", "--cases", "prefill"]) == 0
    out = capsys.readouterr().out.split()
    assert out and all("prefill" in n for n in out)
    causal = C.prefill_case("bf16", "causal", 1024)
    assert causal.flops() == 4 * 32 * 128 * (1024 * 1025 // 2)
    assert C.prefill_case("bf16", "psecausal", 1024).flops() == causal.flops()


def test_demo_paged_and_fallback(monkeypatch):
    lines = []
    res = demo(steps=3, log=lines.append)
    assert len(lines) == 4 and res["max_err"] < 1e-2
    real = fia.npu_fused_infer_attention_score

    def no_paged(*a, block_table=None, **k):
        if block_table is not None:
            raise fia.FiaUnsupportedError("paged KV: not yet")
        return real(*a, **k)
    monkeypatch.setattr(fia, "npu_fused_infer_attention_score", no_paged)
    lines = []
    res = demo(steps=2, log=lines.append)
    assert not res["paged"] and "not available yet" in lines[0] and res["max_err"] < 1e-2


def _agree(a, b, tol=0.35):
    return abs(a - b) <= tol * max(a, b)


def test_ceilings_agree_with_independent_measurement():
    """machine's sum bandwidth vs a plain torch copy; machine's fp32 mm vs a plain 2048^3 torch.mm."""
    for _ in range(3):                      # retried: another process may steal the cores for a moment
        bw = machine.measure_read_bandwidth(256 << 20, repeats=3)
        src = torch.ones(64 << 20)          # 256 MiB
        dst = torch.empty_like(src)
        dst.copy_(src)
        t = min(_timed(lambda d=dst, s=src: d.copy_(s)) for _ in range(3))
        if _agree(bw, 2 * src.nbytes / t / 1e9):
            break
    else:
        pytest.fail(f"read bandwidth {bw:.1f} GB/s vs copy {2 * src.nbytes / t / 1e9:.1f} GB/s")
    del src, dst
    for _ in range(3):
        mm, _n = machine.measure_matmul(torch.float32)
        a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
        torch.mm(a, b)
        t = min(_timed(lambda a=a, b=b: torch.mm(a, b)) for _ in range(3))
        if _agree(mm, 2 * 2048 ** 3 / t / 1e12):
            break
    else:
        pytest.fail(f"fp32 mm {mm:.3f} TFLOP/s vs independent {2 * 2048 ** 3 / t / 1e12:.3f}")


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_ceiling_drift_is_flagged():
    """Ceilings measured before and after the cases that disagree by more than 15 % get a warning line (a
    shared VM once read 84 GB/s before and 50 after); agreeing ones do not."""
    c = {"cpu": "c", "cpu_capability": "AVX512", "threads": 2, "torch_version": "t", "read_gbps": 84.0,
         "copy_gbps": 78.0, "mm_tflops": {"fp32": 0.2}, "mm_n": {"fp32": 2048},
         "before": {"read_gbps": 84.0}, "after": {"read_gbps": 50.1}}
    warn = [s for s in report.ceilings_lines(c) if s.startswith("warning")]
    assert len(warn) == 1 and "84.0" in warn[0] and "50.1" in warn[0] and "68 %" in warn[0]
    c["after"]["read_gbps"] = 80.0
    assert not [s for s in report.ceilings_lines(c) if s.startswith("warning")]
    del c["before"], c["after"]
    assert not [s for s in report.ceilings_lines(c) if s.startswith("warning")]


class _Probe:
    """A ReadProbe stand-in: hands out the given bandwidths in turn."""

    def __init__(self, *vals):
        self.vals = list(vals)

    def gbps(self):
        return self.vals.pop(0)


def test_near_ceiling_is_measured_around_the_decode_timing():
    """Decode cases with a probe: the better of the reads right before and after the FIA-SDPA-FIA blocks is
    the case's near ceiling, and % near = rate / near ceiling (shown in the table); prefill cases and calls
    without a probe have none; a real ReadProbe reads a plausible rate."""
    opts = runner.Options(repeats=1, time_budget_s=0.05, ref_budget_s=5.0)
    probe = _Probe(40.0, 50.0)
    rec = runner.run_case(TINY[1], FAKE, opts, fia, probe=probe)
    assert rec["fia"]["status"] == "ok" and probe.vals == []          # read twice: before and after
    assert rec["near_ceiling"] == 50.0
    assert rec["fia"]["pct_near"] == pytest.approx(100.0 * rec["fia"]["rate"] / 50.0)
    assert rec["sdpa"]["pct_near"] == pytest.approx(100.0 * rec["sdpa"]["rate"] / 50.0)
    table = report.terminal_table([rec], FAKE.to_dict()).splitlines()
    head = next(i for i, s in enumerate(table) if s.startswith("case "))
    assert "% near" in table[head] and f"{rec['fia']['pct_near']:.0f}%" in table[head + 2]
    pre = runner.run_case(TINY[3], FAKE, opts, fia, probe=_Probe())    # prefill: never reads the probe
    assert "near_ceiling" not in pre and "pct_near" not in pre["fia"]
    assert "near_ceiling" not in runner.run_case(TINY[1], FAKE, opts, fia)
    assert 0.1 < machine.ReadProbe(8 << 20, 3).gbps() < 10000


def test_cache_note_names_a_large_last_level_cache():
    """A last-level cache that can hold a decode case's K/V is named under the ceilings (the case's rate may
    include cache hits); a small or unknown one is not."""
    from fia.bench.machine import Ceilings, _llc_mb
    from fia.bench.report import _cache_lines
    assert _cache_lines({"llc_mb": 0}) == [] and _cache_lines({"llc_mb": 32.0}) == [] and _cache_lines({}) == []
    big = _cache_lines({"llc_mb": 480.0})
    assert len(big) == 1 and "480 MB" in big[0] and "between calls" in big[0]
    assert len(_cache_lines({"llc_mb": 96.0})) == 1
    assert _llc_mb() >= 0 and Ceilings(1.0, 1.0, {"fp32": 1.0}, {"fp32": 8}).to_dict()["llc_mb"] == _llc_mb()


def test_dense_twin_is_timed_with_paged_and_int8_cases():
    """Paged and int8 decode cases are timed together with FIA on their dense twin (same problem, dense K / V
    of the case's dtype, checked against the reference); the ratio twin ms / case ms is speedup_vs_dense and
    a column of the table. Dense and prefill cases have no twin."""
    assert C.decode_case("bf16", "dense", 4096).dense_twin() is None and TINY[2].dense_twin() is None
    twin = C.decode_case("fp16", "int8-chan", 4096).dense_twin()
    assert (twin.storage, twin.dtype, twin.B, twin.S_kv) == ("dense", "fp16", 8, 4096)
    assert twin.kv_bytes() == 2 * C.decode_case("fp16", "int8-chan", 4096).kv_bytes() - 4 * 8 * 128 * 2
    opts = runner.Options(repeats=2, time_budget_s=0.05, ref_budget_s=5.0)
    for case in TINY[:2]:
        rec = runner.run_case(case, FAKE, opts, fia)
        d = rec["dense"]
        assert d["status"] == "ok" and d["case"] == case.name + ":dense" and d["rel_err"] <= runner.TOL[case.dtype]
        assert d["median_ms"] > 0 and rec["speedup_vs_dense"] == pytest.approx(d["median_ms"] / rec["fia"]["median_ms"])
        assert d["rate"] == pytest.approx(case.dense_twin().kv_bytes() / d["median_ms"] / 1e6)
        table = report.terminal_table([rec], FAKE.to_dict()).splitlines()
        head = next(i for i, s in enumerate(table) if s.startswith("case "))
        assert "x dense" in table[head] and f"{rec['speedup_vs_dense']:.2f}" in table[head + 2]
        runner.apply_ceilings([rec], machine.Ceilings(40.0, 40.0, {"fp32": 1.0}, {"fp32": 8}))
        assert d["pct_ceiling"] == pytest.approx(100.0 * d["rate"] / 40.0)     # the final ceiling, as the case's
    dense = runner.run_case(C.Case("tiny-decode", "decode", "bf16", 2, 4, 2, 64, 1, 256), FAKE, opts, fia)
    assert dense["speedup_vs_dense"] is None and dense["dense"]["status"] == "not run"


@pytest.mark.parametrize("storage,layout", [("dense", "BSND"), ("paged", "BSH")])
def test_token_major_cases(storage, layout):
    """The "-bsnd" / "-bsh" decode cases hand FIA token-major K / V (a token's rows of all KV heads side by
    side: [B, S, KV_N, D], the paged pool [blocks, bs, KV_N * D]) and the query in the same layout; their
    dense twin is the BNSD case, and the output is checked in the canonical layout."""
    case = C.Case("tiny-decode-tm", "decode", "bf16", 2, 4, 2, 64, 1, 256, storage=storage, layout=layout,
                  block_size=64)
    twin = case.dense_twin()
    assert (twin.storage, twin.layout) == ("dense", "BNSD")
    inp = C.build(case)
    q, k, v = inp.fia_args()
    if layout == "BSND":
        assert k.shape == (2, 256, 2, 64) and k.is_contiguous() and q.shape == (2, 1, 4, 64)
    else:
        assert k.shape == (inp.key.shape[0], 64, 2 * 64) and k.is_contiguous() and q.shape == (2, 1, 4 * 64)
    assert torch.equal(inp.canonical_out(inp.fia_args()[0]), inp.q)
    sl = inp.head_slice()
    assert sl.fia_args()[1].is_contiguous() and torch.equal(sl.key, inp.key[:, :1])
    opts = runner.Options(repeats=2, time_budget_s=0.05, ref_budget_s=5.0)
    rec = runner.run_case(case, FAKE, opts, fia)
    assert rec["layout"] == layout and rec["fia"]["status"] == "ok" and rec["check"]["rel_err"] <= runner.TOL["bf16"]
    assert rec["dense"]["status"] == "ok" and rec["speedup_vs_dense"] > 0
    assert C.decode_case("bf16", "paged", 4096, layout="BSH").name == "decode-bf16-paged128-bsh-kv4096"


def test_timing_blocks_are_palindromic():
    """timeit_aba runs half of each function's calls in order, the last one's all, then the other halves in
    reverse: a linear drift of the machine hits every function alike."""
    order = []
    fns = [(n, (lambda n=n: order.append(n))) for n in "abc"]
    res = runner.timeit_aba(fns, 4, 10.0, {n: True for n in "abc"})
    assert "".join(order) == "aabbccccbbaa" and all(res[n]["repeats"] == 4 for n in "abc")
    order.clear()
    runner.timeit_aba(fns[::2], 3, 10.0, {"a": False, "c": True})
    assert "".join(order) == "a" + "a" + "ccc" + "aa"
