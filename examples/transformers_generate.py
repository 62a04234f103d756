"""Run a small transformers model end to end with FIA as its attention, and with torch SDPA; print tokens/s.

    pip install 'fia[transformers]'
    python examples/transformers_generate.py [--prompt 256] [--new 32] [--batch 2] [--dtype float32|bfloat16]

The model is a Llama-shaped decoder (GQA) with random weights built from a config: nothing is downloaded. With a
checkpoint, the only change is `AutoModelForCausalLM.from_pretrained(name, attn_implementation="fia")`.
The batch is left-padded (as generate() pads decoder-only prompts): FIA receives per-batch KV lengths and
kv_padding_size instead of a mask.
"""
import argparse
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import fia
import fia.integrations.transformers  # registers attn_implementation="fia"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    cfg = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, head_dim=64, vocab_size=8192, max_position_embeddings=4096)
    fia.warmup()                                                  # FIA's compiled CPU kernels, once per machine
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (a.batch, a.prompt), generator=g)
    mask = torch.ones_like(ids)
    mask[1:, : a.prompt // 4] = 0                                 # left padding in every row but the first
    outputs = {}
    for impl in ("fia", "sdpa"):
        torch.manual_seed(0)                                      # the same random weights for both
        model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), attn_implementation=impl, dtype=dtype).eval()
        kw = dict(attention_mask=mask, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False)
        with torch.no_grad():
            model.generate(ids, **dict(kw, max_new_tokens=2, min_new_tokens=2))         # warm-up
            t0 = time.perf_counter()
            out = model.generate(ids, **kw)
            dt = time.perf_counter() - t0
        outputs[impl] = out[:, a.prompt:]
        print(f"{impl:5s}: {a.batch} x ({a.prompt} prompt + {a.new} new tokens) in {dt:6.2f} s: "
              f"{a.batch * a.new / dt:7.1f} generated tokens/s, {a.batch * (a.prompt + a.new) / dt:8.1f} tokens/s "
              "processed")
    same = (outputs["fia"] == outputs["sdpa"]).float().mean().item()
    print(f"greedy tokens identical to sdpa: {same:.0%}" + ("" if a.dtype == "float32" else " (low precision: ties "
                                                             "may break differently)"))


if __name__ == "__main__":
    main()
