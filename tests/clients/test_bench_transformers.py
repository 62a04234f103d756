"""`python -m fia.bench --transformers` on a tiny Llama config: the three report files, the table's numbers, greedy
tokens equal to SDPA's in float32, the attention registry restored, rows of caches that cannot be built skipped."""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("fia.integrations.transformers")

from fia.bench import transformers_bench as TB  # noqa: E402

pytestmark = pytest.mark.backend_independent      # whole models: automatic backend selection, one run

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, initializer_range=0.3)


def _table(text: str) -> list:
    """The printed Markdown table's body rows, as lists of cells."""
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert lines[0].strip("| ").split(" | ") == TB.COLUMNS
    return [ln.strip("| ").split(" | ") for ln in lines[1:]]


def test_cli_tiny_model(tmp_path, capsys):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    before = {n: ALL_ATTENTION_FUNCTIONS[n] for n in ("fia", "sdpa")}
    out = tmp_path / "res"
    assert TB.main(["--transformers", "--context", "12,40", "--batch", "1,2", "--dtype", "float32,bfloat16",
                    "--steps", "3", "--repeats", "1", "--out", str(out)], config=transformers.LlamaConfig(**TINY)) == 0
    text = capsys.readouterr().out
    png = out / "transformers.png"
    assert (out / "transformers.md").stat().st_size > 0 and png.stat().st_size > 10_000
    assert text.strip().splitlines()[-1].endswith(os.path.abspath(png))
    assert {n: ALL_ATTENTION_FUNCTIONS[n] for n in ("fia", "sdpa")} == before      # the timers are gone

    records = json.loads((out / "transformers.json").read_text())["records"]
    kinds = [("fia", "dynamic"), ("fia", "fia"), ("fia", "fia_int8"), ("sdpa", "dynamic")]
    assert len(records) == 2 * 2 * 2 * len(kinds)
    assert [(r["impl"], r["cache"]) for r in records[:4]] == kinds
    for r in records:
        assert r["status"] == "ok" and r["repeats"] == 1
        assert r["decode_ms_per_step"] > 0 and r["prefill_ms"] > 0 and r["x_sdpa"] > 0 and r["prefill_x_sdpa"] > 0
        assert r["decode_tok_s"] == pytest.approx(r["batch"] * 1e3 / r["decode_ms_per_step"])
        assert r["prefill_tok_s"] == pytest.approx(r["batch"] * r["context"] * 1e3 / r["prefill_ms"])
        assert 0 < r["attn_share"] < 1 and 0 < r["prefill_attn_share"] < 1
        calls = r["steps"] * TINY["num_hidden_layers"]               # the share's time over its layer calls
        assert r["attn_us_per_call"] == pytest.approx(
            r["attn_share"] * r["decode_ms_per_step"] * r["steps"] * 1e3 / calls, rel=1e-9)
        assert 0 <= r["same_tokens_as_sdpa"] <= 1
        if r["impl"] == "sdpa":
            assert r["x_sdpa"] == 1.0 and r["same_tokens_as_sdpa"] == 1.0
        if r["dtype"] == "float32" and r["cache"] in ("dynamic", "fia"):
            assert r["same_tokens_as_sdpa"] == 1.0, r

    rows = _table(text)
    assert len(rows) == len(records)
    for row, r in zip(rows, records):
        assert row[:5] == [str(r["context"]), str(r["batch"]), r["dtype"], r["impl"], r["cache"]]
        nums = [float(c.rstrip("%")) for c in row[5:]]
        # rounded for print: a small share may show as 0 (the records above hold the values, checked > 0)
        assert all(v >= 0 for v in nums[:-1]) and 0 <= nums[-1] <= 100, row     # (the last: same tokens, %)
        assert nums[0] == pytest.approx(r["decode_ms_per_step"], rel=0.01, abs=0.01)


def test_missing_cache_rows_are_skipped(monkeypatch, capsys):
    monkeypatch.setattr(TB, "cache_missing", lambda kind: None if kind == "dynamic" else "not here")
    records, notes = TB.run((8,), (1,), ("float32",), steps=2, repeats=1, config=transformers.LlamaConfig(**TINY))
    assert [(r["impl"], r["cache"]) for r in records] == [("fia", "dynamic"), ("sdpa", "dynamic")]
    assert notes == ["cache fia skipped: not here", "cache fia_int8 skipped: not here"]
    assert "note: cache fia skipped: not here" in capsys.readouterr().out
    assert records[0]["same_tokens_as_sdpa"] == 1.0


def test_failing_row_is_reported(monkeypatch):
    real = TB.make_cache

    def broken(kind, model):
        if kind == "fia":
            raise RuntimeError("no buffers")
        return real(kind, model)

    monkeypatch.setattr(TB, "make_cache", broken)
    records, _ = TB.run((8,), (1,), ("float32",), steps=2, repeats=2, caches=("dynamic", "fia"),
                        config=transformers.LlamaConfig(**TINY))
    by = {(r["impl"], r["cache"]): r for r in records}
    assert by[("fia", "fia")]["status"] == "error: RuntimeError: no buffers" and by[("fia", "fia")]["repeats"] == 0
    assert by[("fia", "dynamic")]["repeats"] == 2 and by[("fia", "dynamic")]["x_sdpa"] > 0
    assert TB.table_row(by[("fia", "fia")])[5] == "error: RuntimeError: no buffers"


def test_attention_timer_counts_calls():
    """The timer adds the wrapped function's time and restores an instance-local override it replaced."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def local(*a, **k):
        return torch.zeros(1), None

    ALL_ATTENTION_FUNCTIONS["sdpa"] = local
    try:
        with TB.AttentionTimer(["sdpa", "eager"]) as timer:
            assert timer.names == ["sdpa"]
            fn = ALL_ATTENTION_FUNCTIONS["sdpa"]
            assert fn is not local and fn()[1] is None and timer.seconds > 0
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is local
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert ALL_ATTENTION_FUNCTIONS["sdpa"].__name__ == "sdpa_attention_forward"
