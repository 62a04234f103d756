"""`python -m fia.bench --transformers`: greedy decoding of a transformers model with attn_implementation "fia"
against "sdpa", per prompt length, batch size, dtype and KV cache.

For each (context, batch, dtype): prefill of `context` random tokens, then `steps` greedy decode steps. The rows --
fia with transformers' DynamicCache, fia with FiaCache (model dtype) and FiaCache(quantize="int8"), sdpa with
DynamicCache -- run models with the same weights and take turns in every repeat (the order reversed every other
repeat), so that a shared machine's slow phases hit them alike; each row reports its best repeat (after a warm-up
run of the full prefill and 4 steps). Columns:

- decode ms / step and tokens / s (batch / step time);
- attn share: the time spent inside the attention function calls of the decode steps / the decode time (FIA's
  function for impl fia, SDPA's for sdpa): while the benchmark runs, transformers' attention registry maps each
  implementation to a wrapper that times the call with time.perf_counter (~0.3 us added per call); attn us / call:
  that time per layer call (decode time inside the calls / (steps x layers));
- x SDPA: SDPA's decode ms / step with DynamicCache / the row's (> 1: faster than SDPA); prefill ms and its x SDPA;
- same tokens: the fraction of the B x (steps + 1) greedy tokens equal to SDPA's.

The model is a small Llama-shaped decoder with random weights (from_config, nothing downloaded): GQA 8/2 heads of
64, hidden 512, 4 layers, vocabulary 8192 by default. Writes transformers.json / .md / .png under --out. Needs
transformers (pip install 'fia[transformers]').
"""
from __future__ import annotations

import copy
import datetime
import gc
import os
import sys
import time
from typing import Optional

import torch

DEFAULT = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, head_dim=64, vocab_size=8192, max_position_embeddings=4096)
CACHES = ("dynamic", "fia", "fia_int8")
DTYPES = ("bfloat16", "float16", "float32")
COLUMNS = ["context", "batch", "dtype", "impl", "cache", "decode ms/step", "tok/s", "attn share", "attn us/call",
           "x SDPA", "prefill ms", "prefill x SDPA", "same tokens"]
WARM_STEPS = 4


def make_model(impl: str, dtype=torch.bfloat16, config=None, seed: int = 0, positions: int = 0):
    """The benchmark's model (DEFAULT, or a copy of `config`) with attn_implementation `impl`; random weights from
    `seed`; max_position_embeddings raised to `positions` when smaller."""
    import transformers
    if impl == "fia":
        import fia.integrations.transformers  # noqa: F401  (registers "fia")
    cfg = copy.deepcopy(config) if config is not None else transformers.LlamaConfig(**DEFAULT)
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, positions)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=dtype).eval()


def make_cache(kind: str, model):
    """A new KV cache for one run: "dynamic" -> transformers' DynamicCache, "fia" -> FiaCache in the model's dtype,
    "fia_int8" -> FiaCache with int8 K / V."""
    if kind == "dynamic":
        from transformers import DynamicCache
        return DynamicCache(config=model.config)
    from fia.integrations.transformers import FiaCache
    return FiaCache(model.config) if kind == "fia" else FiaCache(model.config, quantize="int8")


def cache_missing(kind: str) -> Optional[str]:
    """Why caches of `kind` cannot be built here, or None."""
    if kind == "dynamic":
        return None
    try:
        from fia.integrations.transformers import FiaCache  # noqa: F401
    except ImportError as e:
        return f"FiaCache is not available ({e})"
    return None


class AttentionTimer:
    """Seconds spent inside the attention functions of the implementations `names` (those in transformers'
    ALL_ATTENTION_FUNCTIONS; "eager" is not): inside `with`, each name maps to a wrapper around its function
    that adds the call's perf_counter time to `seconds`; the previous mapping comes back on exit."""

    def __init__(self, names):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        self.registry = ALL_ATTENTION_FUNCTIONS
        self.names = [n for n in names if n in self.registry]
        self.seconds = 0.0
        self._saved = {}

    def _wrap(self, fn):
        clock = time.perf_counter

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += clock() - t0
        return timed

    def __enter__(self) -> "AttentionTimer":
        local = getattr(self.registry, "_local_mapping", {})
        for n in self.names:
            self._saved[n] = local.get(n)               # None: the name had no instance-local override
            self.registry[n] = self._wrap(self.registry[n])
        return self

    def __exit__(self, *exc) -> None:
        for n, fn in self._saved.items():
            if fn is None:
                del self.registry[n]
            else:
                self.registry[n] = fn
        self._saved = {}


@torch.no_grad()
def run_once(model, ids: torch.Tensor, steps: int, cache, timer: AttentionTimer) -> dict:
    """Prefill of `ids` into `cache`, then `steps` greedy decode steps; seconds of each phase, attention seconds
    of each phase, and the generated tokens [B, steps + 1]. Each call gets the attention mask generate() passes
    (ones over the tokens so far). The garbage collector waits until the end."""
    b, n = ids.shape
    mask = torch.ones(b, n + steps + 1, dtype=torch.long)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        a0, t0 = timer.seconds, time.perf_counter()
        out = model(ids, attention_mask=mask[:, :n], cache=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1:].argmax(-1)
        a1, t1 = timer.seconds, time.perf_counter()
        toks = [nxt]
        for i in range(steps):
            out = model(nxt, attention_mask=mask[:, :n + i + 1], cache=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            toks.append(nxt)
        a2, t2 = timer.seconds, time.perf_counter()
    finally:
        if was_enabled:
            gc.enable()
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "prefill_attn_s": a1 - a0, "decode_attn_s": a2 - a1,
            "tokens": torch.cat(toks, 1)}


def row_kinds(impls, caches) -> list:
    """(impl, cache) of each row: fia with every cache asked for, other implementations with DynamicCache."""
    return [(impl, c) for impl in impls for c in (caches if impl == "fia" else ("dynamic",))]


def measure_point(models: dict, context: int, batch: int, steps: int, repeats: int, caches, dtype_name: str,
                  out=print) -> list:
    """The records of one (context, batch, dtype): every row's best repeat, its ratios to SDPA's row."""
    vocab = next(iter(models.values())).config.vocab_size
    ids = torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(1))
    kinds = row_kinds(list(models), caches)
    runs = {k: [] for k in kinds}
    errors = {}

    def one(kind, n):
        try:
            return run_once(models[kind[0]], ids, n, make_cache(kind[1], models[kind[0]]), timer)
        except Exception as e:                                        # a row that fails is reported, not fatal
            errors[kind] = f"error: {type(e).__name__}: {e}"
            return None

    with AttentionTimer(list(models)) as timer:
        for kind in kinds:                                            # warm-up: kernels, plans, allocator
            one(kind, min(steps, WARM_STEPS))
        for r in range(max(1, repeats)):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                if kind not in errors:
                    res = one(kind, steps)
                    if res is not None:
                        runs[kind].append(res)
    layers = next(iter(models.values())).config.get_text_config(decoder=True).num_hidden_layers
    records = [_record(kind, runs[kind], errors.get(kind), context, batch, steps, dtype_name, layers)
               for kind in kinds]
    base = next((r for r in records if (r["impl"], r["cache"]) == ("sdpa", "dynamic") and r["status"] == "ok"), None)
    for r in records:
        if r["status"] != "ok" or base is None:
            continue
        r["x_sdpa"] = base["decode_ms_per_step"] / r["decode_ms_per_step"]
        r["prefill_x_sdpa"] = base["prefill_ms"] / r["prefill_ms"]
        r["same_tokens_as_sdpa"] = float((r["_tokens"] == base["_tokens"]).float().mean())
    for r in records:
        r.pop("_tokens", None)
        out("  " + "  ".join(f"{h} {c}" for h, c in zip(COLUMNS[3:], table_row(r)[3:]) if c), flush=True)
    return records


def _record(kind, runs: list, error: Optional[str], context: int, batch: int, steps: int, dtype_name: str,
            layers: int = 1) -> dict:
    rec = {"context": context, "batch": batch, "dtype": dtype_name, "impl": kind[0], "cache": kind[1],
           "steps": steps, "status": error or "ok", "repeats": len(runs)}
    if error or not runs:
        return rec
    best = min(runs, key=lambda r: r["decode_s"])
    prefill_s = min(r["prefill_s"] for r in runs)
    step_s = best["decode_s"] / max(1, steps)
    rec.update(decode_ms_per_step=step_s * 1e3, decode_tok_s=batch / step_s, prefill_ms=prefill_s * 1e3,
               prefill_tok_s=batch * context / prefill_s,
               attn_share=best["decode_attn_s"] / best["decode_s"] if best["decode_s"] > 0 else None,
               attn_us_per_call=best["decode_attn_s"] / (max(1, steps) * max(1, layers)) * 1e6,
               prefill_attn_share=best["prefill_attn_s"] / best["prefill_s"],
               x_sdpa=None, prefill_x_sdpa=None, same_tokens_as_sdpa=None,
               decode_ms_per_step_all=[r["decode_s"] / max(1, steps) * 1e3 for r in runs],
               prefill_ms_all=[r["prefill_s"] * 1e3 for r in runs], _tokens=best["tokens"])
    if kind[0] not in ("fia", "sdpa"):
        rec["attn_share"] = rec["prefill_attn_share"] = rec["attn_us_per_call"] = None     # not timed (no entry)
    return rec


def _num(v, fmt: str) -> str:
    return "" if v is None else fmt.format(v)


def table_row(r: dict) -> list:
    if r["status"] != "ok":
        return [str(r["context"]), str(r["batch"]), r["dtype"], r["impl"], r["cache"], r["status"][:60]] + [""] * 7
    ms = r["decode_ms_per_step"]
    return [str(r["context"]), str(r["batch"]), r["dtype"], r["impl"], r["cache"],
            f"{ms:.2f}" if ms < 100 else f"{ms:.0f}", f"{r['decode_tok_s']:.1f}", _num(r["attn_share"], "{:.0%}"),
            _num(r.get("attn_us_per_call"), "{:.0f}"),
            _num(r["x_sdpa"], "{:.2f}"), f"{r['prefill_ms']:.1f}", _num(r["prefill_x_sdpa"], "{:.2f}"),
            _num(r["same_tokens_as_sdpa"], "{:.0%}")]


NOTES = """\
- Greedy decoding: prefill of `context` random tokens, then `steps` decode steps (one token per sequence each),
  every call with the attention mask generate() passes (ones over the tokens so far). Every run starts from a new
  cache; a row reports its best repeat (decode time) and its best prefill; tok/s = batch / decode step time.
- Rows take turns in every repeat (the order reversed every other repeat); the fia and sdpa models have the same
  weights. Caches: dynamic = transformers' DynamicCache; fia = FiaCache (K / V in the model's dtype);
  fia_int8 = FiaCache(quantize="int8").
- attn share: time inside the attention function calls of the decode steps / decode time (FIA's for impl fia,
  SDPA's for impl sdpa), each call timed with time.perf_counter; the rest is the model (linears, norms, rope,
  sampling) and the cache. attn us/call: that time per layer call (decode steps x layers calls).
- x SDPA: SDPA's (DynamicCache) ms / this row's ms, decode per step and prefill; > 1 = faster than SDPA.
- same tokens: fraction of the greedy tokens (batch x (steps + 1)) equal to SDPA's; bfloat16 / float16 roundings
  differ between the implementations, so a near tie can flip a token and the rest of the sequence with it.
"""


def _rate_text(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def plot(records: list, meta: dict, path: str) -> Optional[str]:
    """Grouped bars per dtype, decode (left) and prefill (right): for each (context, batch) one bar per
    implementation and cache, its height the speed relative to SDPA with DynamicCache (x SDPA; the SDPA bar is 1,
    a dashed line marks it), its label the tokens / s; without an SDPA row the heights are the tokens / s.
    None without matplotlib or rows."""
    from .report import host_line, pyplot
    plt = pyplot()
    ok = [r for r in records if r["status"] == "ok"]
    if plt is None or not ok:
        return None
    relative = any(r.get("x_sdpa") for r in ok)
    dtypes = list(dict.fromkeys(r["dtype"] for r in ok))
    kinds = list(dict.fromkeys((r["impl"], r["cache"]) for r in ok))
    points = list(dict.fromkeys((r["context"], r["batch"]) for r in ok))
    colors = {("fia", "dynamic"): "tab:blue", ("fia", "fia"): "tab:green", ("fia", "fia_int8"): "tab:purple",
              ("sdpa", "dynamic"): "tab:orange"}
    label = {"dynamic": "DynamicCache", "fia": "FiaCache", "fia_int8": "FiaCache int8"}
    width = 0.8 / len(kinds)
    fig, axes = plt.subplots(len(dtypes), 2, figsize=(max(11.0, 0.75 * len(points) * len(kinds) + 2),
                                                      3.8 * len(dtypes) + 1.4), squeeze=False, layout="constrained")
    by = {(r["dtype"], r["context"], r["batch"], r["impl"], r["cache"]): r for r in ok}
    for row, dt in enumerate(dtypes):
        for col, (what, key, ratio) in enumerate((("decode", "decode_tok_s", "x_sdpa"),
                                                  ("prefill", "prefill_tok_s", "prefill_x_sdpa"))):
            ax = axes[row, col]
            top = 0.0
            for i, kind in enumerate(kinds):
                bars = [(j - 0.4 + width * (i + 0.5), by.get((dt, ctx, b) + kind)) for j, (ctx, b) in enumerate(points)]
                bars = [(x, r[ratio] if relative else r[key], r[key]) for x, r in bars
                        if r is not None and (r.get(ratio) or not relative)]
                if not bars:
                    continue
                xs, ys, rates = zip(*bars)
                top = max((top,) + ys)
                ax.bar(xs, ys, width=width * 0.92, color=colors.get(kind, "tab:gray"),
                       label=f"{kind[0]} + {label.get(kind[1], kind[1])}")
                for x, y, v in zip(xs, ys, rates):
                    ax.text(x, y, " " + _rate_text(v), ha="center", va="bottom", rotation=90, fontsize=8)
            if relative:
                ax.axhline(1.0, color="tab:orange", lw=1, ls="--", zorder=0)
            ax.set_ylim(0, top * 1.3 or 1)
            ax.set_xticks(range(len(points)))
            ax.set_xticklabels([f"context {c}\nbatch {b}" for c, b in points], fontsize=8)
            ax.set_ylabel("x SDPA (higher = faster)" if relative else "tokens / s", fontsize=9)
            ax.set_title(f"{what}, {dt}: " + ("speed relative to sdpa + DynamicCache (labels: tokens/s)" if relative
                                              else "tokens/s"), fontsize=10)
            ax.grid(axis="y", alpha=0.3)
            ax.set_axisbelow(True)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(kinds), fontsize=9, frameon=False)
    who = host_line(meta.get("host", {}))
    fig.suptitle(f"transformers greedy decoding, attn_implementation fia vs sdpa, {meta.get('steps')} decode steps\n"
                 f"{meta.get('model', '')}" + (f"\n{who}" if who else ""), fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(records: list, meta: dict) -> str:
    from .report import host_line, markdown_table
    out = ["# FIA in transformers: greedy decoding, fia vs sdpa", "",
           f"- {host_line(meta['host'])}, OMP_WAIT_POLICY {meta['host'].get('omp_wait_policy')}, "
           f"transformers {meta.get('transformers_version')}",
           f"- model: {meta['model']}; {meta['steps']} decode steps, best of {meta['repeats']} repeats",
           f"- run: {meta['argv']} — {meta.get('duration_s', 0):.0f} s, {meta['started']}"]
    out += [f"- note: {n}" for n in meta.get("notes", [])]
    out += [""] + markdown_table(COLUMNS, [table_row(r) for r in records]) + ["", "## Notes", "", NOTES]
    return "\n".join(out)


def _model_text(config) -> str:
    cfg = DEFAULT if config is None else config.to_dict()
    return (f"{(config.model_type if config is not None else 'llama')}, {cfg['num_hidden_layers']} layers, hidden "
            f"{cfg['hidden_size']}, GQA {cfg['num_attention_heads']}/{cfg['num_key_value_heads']} x "
            f"{cfg.get('head_dim') or cfg['hidden_size'] // cfg['num_attention_heads']}, vocabulary "
            f"{cfg['vocab_size']}, random weights")


def run(contexts=(512,), batches=(1,), dtypes=("float32",), steps: int = 64, repeats: int = 3, caches=CACHES,
        impls=("fia", "sdpa"), config=None, out=print) -> tuple:
    """(records, notes): a record per (dtype, context, batch, impl, cache), the notes on skipped caches."""
    notes, usable = [], []
    for c in caches:
        why = cache_missing(c) if "fia" in impls else None
        if why:
            notes.append(f"cache {c} skipped: {why}")
            out(f"note: {notes[-1]}", flush=True)
        else:
            usable.append(c)
    records = []
    for dt in dtypes:
        models = {}
        for impl in impls:
            models[impl] = make_model(impl, getattr(torch, dt), config, positions=max(contexts) + steps + 1)
            if len(models) > 1:                                          # the same weights, whatever the init
                models[impl].load_state_dict(models[impls[0]].state_dict())
        for ctx in contexts:
            for b in batches:
                out(f"{dt}, context {ctx}, batch {b}:", flush=True)
                records += measure_point(models, ctx, b, steps, repeats, usable, dt, out)
        del models
        gc.collect()
    return records, notes


def _list(text: str, conv=str) -> list:
    return [conv(x.strip()) for x in text.split(",") if x.strip()]


def main(argv=None, config=None) -> int:
    """The CLI; `config` replaces the default model's configuration (a transformers config)."""
    import argparse

    import transformers

    import fia
    from . import machine, report
    p = argparse.ArgumentParser(prog="fia-bench --transformers",
                                description="Greedy decoding of a transformers model: attn_implementation fia vs "
                                            "sdpa, per context, batch, dtype and KV cache.")
    p.add_argument("--transformers", action="store_true")
    p.add_argument("--context", "--prompt", default="512,2048,8192", help="prompt lengths (default 512,2048,8192)")
    p.add_argument("--batch", default="1,4", help="batch sizes (default 1,4)")
    p.add_argument("--dtype", default="bfloat16,float32", help="model dtypes (default bfloat16,float32)")
    p.add_argument("--steps", type=int, default=64, help="decode steps after the prefill (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row; the best is reported (default 3)")
    p.add_argument("--caches", default=",".join(CACHES), help="KV caches of the fia rows (default dynamic,fia,fia_int8)")
    p.add_argument("--impls", default="fia,sdpa", help="attention implementations (default fia,sdpa)")
    p.add_argument("--out", default="bench-results", help="output directory (default bench-results)")
    a, _ = p.parse_known_args(argv)
    contexts, batches, dtypes = _list(a.context, int), _list(a.batch, int), _list(a.dtype)
    caches, impls = _list(a.caches), _list(a.impls)
    bad = [x for x in dtypes if x not in DTYPES] + [x for x in caches if x not in CACHES]
    if bad or not (contexts and batches and dtypes and impls) or a.steps < 1 or min(contexts + batches) < 1:
        p.error(f"invalid option values {bad or ''}: dtypes {DTYPES}, caches {CACHES}, positive sizes and steps")
    fia.warmup(progress=False)                    # FIA's compiled kernels (from the cache, or built now)
    host = machine.host()
    meta = {"argv": " ".join(["fia-bench"] + list(argv if argv is not None else sys.argv[1:])),
            "started": datetime.datetime.now().isoformat(timespec="seconds"), "host": host,
            "transformers_version": transformers.__version__, "fia_version": getattr(fia, "__version__", None),
            "model": _model_text(config), "steps": a.steps, "repeats": a.repeats, "contexts": contexts,
            "batches": batches, "dtypes": dtypes, "caches": caches, "impls": impls}
    print(f"transformers {transformers.__version__}: {meta['model']}; {report.host_line(host)}, OMP_WAIT_POLICY "
          f"{host['omp_wait_policy']}", flush=True)
    t0 = time.perf_counter()
    records, meta["notes"] = run(contexts, batches, dtypes, a.steps, a.repeats, caches, impls, config)
    meta["duration_s"] = time.perf_counter() - t0
    paths = report.write_files(a.out, "transformers", {"meta": meta, "records": records}, markdown(records, meta),
                               lambda path: plot(records, meta, path))
    print()
    print("\n".join(report.markdown_table(COLUMNS, [table_row(r) for r in records])))
    for n in meta["notes"]:
        print(f"note: {n}")
    print(f"\nwritten: {', '.join(paths.values())}  ({meta['duration_s']:.0f} s)")
    if "png" in paths:
        print(f"plot (decode and prefill tokens/s, x SDPA per context / batch / dtype and cache): "
              f"{os.path.abspath(paths['png'])}")
    else:
        print("no plot: matplotlib is not installed (pip install matplotlib, or the fia[plot] extra)")
    return 0
