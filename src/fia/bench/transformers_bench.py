"""`python -m fia.bench --transformers`: a transformers model end to end with attn_implementation "fia", "sdpa" and
"eager" -- prefill of 512 tokens, then 64 greedy decode steps over a DynamicCache; tokens/s of each phase.

The model is a small Llama-shaped decoder with random weights (from_config, nothing downloaded): GQA 8/2 heads of
64, hidden 512, 4 layers, vocabulary 8192 by default (float32: faster than bfloat16 matmuls on most CPUs). Needs transformers (pip install 'fia[transformers]').
"""
from __future__ import annotations

import copy
import time

import torch

DEFAULT = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, head_dim=64, vocab_size=8192, max_position_embeddings=4096)


def make_model(impl: str, dtype=torch.bfloat16, config=None, seed: int = 0):
    import transformers
    if impl == "fia":
        import fia.integrations.transformers  # noqa: F401  (registers "fia")
    cfg = copy.deepcopy(config) if config is not None else transformers.LlamaConfig(**DEFAULT)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=dtype).eval()


@torch.no_grad()
def run_once(model, ids: torch.Tensor, steps: int):
    """(prefill seconds, decode seconds, generated tokens [B, steps])."""
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1:].argmax(-1)
    t1 = time.perf_counter()
    toks = [nxt]
    for _ in range(steps - 1):
        out = model(nxt, cache=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        toks.append(nxt)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, torch.cat(toks, 1)


def bench(impls=("fia", "sdpa", "eager"), prompt: int = 512, steps: int = 64, batch: int = 1,
          dtype=torch.float32, repeats: int = 3, config=None, out=print,
          warmup: bool = True) -> dict:
    """tokens/s per implementation: {impl: {"prefill_tok_s", "decode_tok_s", "prefill_s", "decode_s"}}, the best of
    `repeats` runs after a warm-up (the full prefill + 4 steps: first calls load kernels and plans); the
    implementations take turns in every repeat, so that a busy machine slows them alike."""
    if warmup:
        import fia
        fia.warmup()                                        # FIA's compiled kernels (from the cache, or built now)
    g = torch.Generator().manual_seed(1)
    vocab = (config.vocab_size if config is not None else DEFAULT["vocab_size"])
    ids = torch.randint(0, vocab, (batch, prompt), generator=g)
    models = {impl: make_model(impl, dtype, config) for impl in impls}
    best = {impl: [float("inf"), float("inf"), None] for impl in impls}
    for model in models.values():
        run_once(model, ids, 4)                                                 # warm-up
    for _ in range(max(1, repeats)):
        for impl, model in models.items():
            p, d, toks = run_once(model, ids, steps)
            b = best[impl]
            b[0], b[1], b[2] = min(b[0], p), min(b[1], d), toks
    res, ref_tokens = {}, best[impls[0]][2]
    for impl in impls:
        best_p, best_d, toks = best[impl]
        same = None if impl == impls[0] else float((toks == ref_tokens).float().mean())
        res[impl] = {"prefill_s": best_p, "decode_s": best_d, "prefill_tok_s": batch * prompt / best_p,
                     "decode_tok_s": batch * (steps - 1) / best_d, "same_tokens_as_first": same}
        out(f"{impl:6s} prefill {prompt} tok: {res[impl]['prefill_tok_s']:9.1f} tok/s ({best_p * 1e3:7.1f} ms)   "
            f"decode {steps} steps: {res[impl]['decode_tok_s']:7.1f} tok/s ({best_d / max(1, steps - 1) * 1e3:6.2f} "
            f"ms/step)" + ("" if same is None else f"   same greedy tokens as {impls[0]}: {same:.0%}"))
    return res


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="fia-bench --transformers")
    p.add_argument("--transformers", action="store_true")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--impls", default="fia,sdpa,eager")
    a, _ = p.parse_known_args(argv)
    print(f"transformers Llama-shaped model {DEFAULT}, {a.dtype}, batch {a.batch}, torch threads "
          f"{torch.get_num_threads()}", flush=True)
    bench(tuple(a.impls.split(",")), a.prompt, a.steps, a.batch, getattr(torch, a.dtype), a.repeats)
    return 0
