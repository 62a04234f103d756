"""Reports: terminal table, JSON, Markdown and a PNG plot (achieved vs ceiling)."""
from __future__ import annotations

import json
import os
from typing import Optional

COLUMNS = ["case", "backend", "FIA ms", "FIA rate", "% ceil", "% near", "ref ms", "SDPA ms", "SDPA rate",
           "x SDPA", "x dense", "peak MB FIA/SDPA", "check"]


def _rate(rec: dict, impl: str) -> str:
    r = rec[impl].get("rate")
    if r is None:
        return ""
    return f"{r:.1f} GB/s" if rec["metric"] == "GB/s" else f"{r:.3f} TF/s"


def _ms(res: dict, width: int) -> str:
    if "median_ms" in res:
        return f"{res['median_ms']:.3f}" if res['median_ms'] < 1 else f"{res['median_ms']:.2f}"
    st = res.get("status", "")
    return st if len(st) <= width else st[: width - 1] + "…"


def _mb(v: Optional[float]) -> str:
    return "-" if v is None else (f"{v:.1f}" if v < 10 else f"{v:.0f}")


def rows(records: list[dict], width: int = 24) -> list[list[str]]:
    out = []
    for r in records:
        f, ref, s = r["fia"], r["reference"], r["sdpa"]
        chk = r["check"]
        check = chk.get("status", "")
        if "rel_err" in chk:
            check += f" ({chk['rel_err']:.1e})"
        check = check if len(check) <= width else check[: width - 1] + "…"
        out.append([
            r["name"], f.get("backend") or "-", _ms(f, width), _rate(r, "fia"),
            f"{f['pct_ceiling']:.0f}%" if "pct_ceiling" in f else "",
            f"{f['pct_near']:.0f}%" if "pct_near" in f else "",
            _ms(ref, width), _ms(s, width), _rate(r, "sdpa"),
            f"{r['speedup_vs_sdpa']:.2f}" if r.get("speedup_vs_sdpa") else "",
            f"{r['speedup_vs_dense']:.2f}" if r.get("speedup_vs_dense") else "",
            f"{_mb(f.get('peak_mb'))}/{_mb(s.get('peak_mb'))}", check,
        ])
    return out


def ceilings_lines(c: dict) -> list[str]:
    mm = ", ".join(f"{k} {v:.3g} TFLOP/s (n={c['mm_n'][k]})" for k, v in c["mm_tflops"].items())
    return ([f"CPU {c['cpu']} ({c['cpu_capability']}), {c['threads']} torch threads, torch {c['torch_version']}, "
             f"OMP_WAIT_POLICY {c.get('omp_wait_policy', 'unset')}"]
            + ([f"FIA's kernels: CPU {c['cpu_class']}"] if c.get("cpu_class") else [])
            + [f"read bandwidth {c['read_gbps']:.1f} GB/s (x.sum, median); cross-check: copy {c['copy_gbps']:.1f} "
               f"GB/s (read+write), {100 * (c['copy_gbps'] / c['read_gbps'] - 1):+.0f}%",
               f"matmul: {mm}"]
            + (["(each the better of a measurement before and after the cases)"] if "before" in c else [])
            + _drift_lines(c) + _cache_lines(c))


def _cache_lines(c: dict) -> list[str]:
    """The last-level cache, when it is large enough to hold a decode case's K / V (or a good part of the read
    probe): a case whose K / V fit can read partly from the cache between calls, so its rate and % ceil are
    not DRAM rates (Intel Xeon with AMX: 480 MB L3; the 4096-key cases (134 MB) took 7-8 ms on the first call after a
    768 MB fill and 5 ms from the fourth on; the 16384-key ones (536 MB) 25.5 ms throughout). The read probe
    streams: x.sum read 30-32 GB/s there at 256 MB to 2 GB alike."""
    llc = c.get("llc_mb") or 0
    if llc < 64:
        return []
    return [f"note: last-level cache {llc:.0f} MB (as the OS reports it; shared on a VM): decode cases whose K/V "
            f"are smaller can read partly from it between calls"]


def _drift_lines(c: dict) -> list[str]:
    """A warning when the read bandwidth measured before and after the cases differ by more than 15 %: the
    machine's state changed during the run (on a shared VM: 50 vs 84 GB/s once), so "% ceil" is uncertain."""
    if "before" not in c or "after" not in c:
        return []
    a, b = c["before"]["read_gbps"], c["after"]["read_gbps"]
    if max(a, b) <= 1.15 * min(a, b):
        return []
    return [f"warning: read bandwidth {a:.1f} GB/s before the cases, {b:.1f} after ({100 * (max(a, b) / min(a, b) - 1):.0f} % "
            f"apart): the machine changed during the run; % ceil uses the higher one"]


def text_table(columns: list[str], body: list[list[str]], left=(0,)) -> list[str]:
    """Aligned plain-text lines (header, rule, rows); the columns whose index is in `left` align left."""
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(columns)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i in left else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    return [fmt(columns), "  ".join("-" * w for w in widths)] + [fmt(r) for r in body]


def markdown_table(columns: list[str], body: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
            + ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in body])


def terminal_table(records: list[dict], ceilings: dict) -> str:
    lines = ceilings_lines(ceilings) + [""] + text_table(COLUMNS, rows(records), left=(0, 1, len(COLUMNS) - 1))
    return "\n".join(lines + [""] + kernel_lines(records))


def kernel_lines(records: list[dict]) -> list[str]:
    """FIA's kernel choices (fia.explain's line for the selected backend), each with the cases that run it."""
    cases: dict = {}
    for r in records:
        k = r.get("fia", {}).get("kernels")
        if k:
            cases.setdefault(k, []).append(r["name"])
    if not cases:
        return []
    return ["FIA's kernel choices on this CPU (fia.explain):"] + [f"- {k}: {', '.join(v)}" for k, v in cases.items()]


NOTES = """\
- Times are medians over the timed repeats after warm-up, in one process, on identical inputs.
- Decode rate: bytes of K and V as stored (int8: 1 byte/element plus scales; paged: the used blocks) per
  second; ceiling = streaming read bandwidth (% ceil: the run's ceiling, the better of before / after the cases;
  % near: the better of two reads of the same kind right before and after the case's FIA-SDPA-FIA blocks,
  since a shared host's bandwidth drifts within minutes). Prefill rate: 4·B·N·D·(unmasked (i, j) pairs) per second;
  ceiling = the best of the dtype's and float32's torch.mm rate (fp32 when native bf16/fp16 mm is slower).
- SDPA = torch.nn.functional.scaled_dot_product_attention on the same problem, everything inside the timed
  call: enable_gqa=True; paged KV gathered to a dense tensor first; int8 KV dequantized first; causal via
  is_causal; band as a bool mask; pse_shift as the float additive mask (with the causal mask: pse with -inf
  above the diagonal).
- x dense (paged, int8 and token-major "-bsnd" / "-bsh" decode cases): FIA on the same problem with a dense BNSD
  K / V cache of the case's dtype (its "dense twin", checked like a case), timed in the same blocks: FIA / twin /
  SDPA / twin / FIA, so the ratio (twin ms / case ms: > 1 = faster than dense) is not the host's drift between
  two cases. The "-int8-nz" cases' twin is the same int8 pool as a 4-D paged cache (SPEC 8b: NZ within 15 % of
  it means x dense >= 0.87).
- Check: FIA's automatic backend against the reference backend — on the whole case when the reference is
  cheap enough, otherwise on KV head 0 and its query heads (head groups are independent); SDPA in float32
  on that slice when the reference cannot run the case. Error = max|out − ref| / max|ref|. A wrong output
  is not timed. SDPA's output gets the same check (sdpa_rel_err in the JSON).
- The reference backend is timed only when one call is estimated (slice time × KV_N) below the budget.
- Peak MB: extra resident memory of one warm call above the inputs (malloc_trim, then VmHWM reset via
  /proc/self/clear_refs; peak = VmHWM after − VmRSS before). SDPA's includes its gather/dequantize copies.
- Timings on a busy machine are unreliable: ceilings and cases are measured at different moments.
"""


def markdown(records: list[dict], ceilings: dict, meta: dict) -> str:
    out = ["# FIA benchmark", ""]
    out += [f"- {line}" for line in ceilings_lines(ceilings)]
    out += [f"- run: {meta.get('argv')} — {meta.get('duration_s', 0):.0f} s, {meta.get('started')}", ""]
    out += markdown_table(COLUMNS, rows(records, width=200))
    kernels = kernel_lines(records)
    out += (["", "## " + kernels[0].rstrip(":"), ""] + kernels[1:]) if kernels else []
    out += ["", "## Notes", "", NOTES]
    return "\n".join(out)


def _short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def host_line(info: dict) -> str:
    """'CPU ..., N threads, torch ...' from a dict with some of cpu / threads / torch_version."""
    return ", ".join(str(x) for x in (info.get("cpu"), info.get("cpu_class") and f"CPU {info['cpu_class']}",
                                      info.get("threads") and f"{info['threads']} threads",
                                      info.get("torch_version") and f"torch {info['torch_version']}") if x)


def plot(records: list[dict], ceilings: dict, path: str) -> Optional[str]:
    """FIA's achieved rate per case against the machine's ceiling and torch SDPA: one panel per kind (decode: GB/s
    of K/V read, ceiling = read bandwidth; prefill: TFLOP/s, ceiling = the torch.mm rate). Linear axes, so the
    blue bar's length inside the grey ceiling band is its share of the ceiling; the column at the right gives the
    numbers (rate, % of ceiling, x SDPA). None when matplotlib is missing (pip install matplotlib) or no case ran."""
    plt = pyplot()
    if plt is None:
        return None
    groups = [(k, [r for r in records if r["kind"] == k]) for k in ("decode", "prefill")]
    groups = [(k, rs) for k, rs in groups if rs]
    if not groups:
        return None
    sizes = [len(rs) for _, rs in groups]
    fig, axes = plt.subplots(len(groups), 1, figsize=(12, 0.5 * sum(sizes) + 1.7 * len(groups) + 0.9),
                             gridspec_kw={"height_ratios": [n + 2.5 for n in sizes]}, squeeze=False)
    for ax, (kind, rs) in zip(axes[:, 0], groups):
        unit = "GB/s" if kind == "decode" else "TFLOP/s"
        num = "{:.1f}" if kind == "decode" else "{:.3f}"
        ys = list(range(len(rs)))
        ceil = [r.get("ceiling") or 0.0 for r in rs]
        fia_rate = [r["fia"].get("rate") or 0.0 for r in rs]
        sdpa_rate = [r["sdpa"].get("rate") or 0.0 for r in rs]
        ax.barh(ys, ceil, height=0.86, color="#e8e8e8", edgecolor="#9a9a9a", label="machine ceiling")
        ax.barh([y - 0.19 for y in ys], fia_rate, height=0.36, color="tab:blue", label="FIA (auto backend)")
        ax.barh([y + 0.19 for y in ys], sdpa_rate, height=0.36, color="tab:orange", label="torch SDPA")
        top = max(ceil + fia_rate + sdpa_rate) or 1.0
        ax.set_xlim(0, top * 1.65)
        x_text = top * 1.04
        for y, r in zip(ys, rs):
            f, s = r["fia"], r["sdpa"]
            if f.get("rate"):
                txt = f"FIA {num.format(f['rate'])} {unit}"
                if "pct_ceiling" in f:
                    txt += f" = {f['pct_ceiling']:.0f}% of ceiling"
                if r.get("speedup_vs_sdpa"):
                    txt += f", {r['speedup_vs_sdpa']:.1f}x SDPA"
            else:
                txt = "FIA " + _short(f.get("status") or "not run")
            ax.text(x_text, y - 0.19, txt, va="center", fontsize=8, color="tab:blue")
            stxt = f"SDPA {num.format(s['rate'])}" if s.get("rate") else "SDPA " + _short(s.get("status") or "not run")
            ax.text(x_text, y + 0.19, stxt, va="center", fontsize=8, color="#b35900")
        basis = {}
        for r in rs:                                            # "read bandwidth 33.5", "bf16 mm 0.423", ...
            if r.get("ceiling"):
                basis.setdefault(r.get("ceiling_basis") or "ceiling", r["ceiling"])
        ax.set_title(f"{kind}: achieved {unit} per case (ceiling: "
                     + ", ".join(f"{b} {num.format(c)} {unit}" for b, c in basis.items()) + ")", fontsize=10)
        ax.set_yticks(ys)
        ax.set_yticklabels([r["name"] for r in rs], fontsize=8)
        ax.set_ylim(len(rs) - 0.5, -0.5)                          # first case on top
        ax.set_xlabel("GB/s of K/V read (as stored)" if kind == "decode" else "TFLOP/s (4·B·N·D per unmasked pair)",
                      fontsize=9)
        ax.set_xticks([t for t in ax.get_xticks() if 0 <= t <= top])   # no ticks under the text column
        ax.set_xlim(0, top * 1.65)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    who = host_line(ceilings)
    fig.suptitle("FIA vs the machine's ceiling and torch SDPA" + (f" ({who})" if who else ""), fontsize=11)
    fig.legend(handles, labels, loc="upper center", ncol=3, fontsize=9, frameon=False, bbox_to_anchor=(0.5, 0.965))
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_files(out_dir: str, stem: str, data: dict, markdown_text: str, draw) -> dict:
    """`stem`.json (data), `stem`.md and `stem`.png (draw(path), which returns None when it drew nothing) under
    out_dir: {"json", "markdown", "png"} -> path, without "png" when there is no plot."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, f"{stem}.json"), "markdown": os.path.join(out_dir, f"{stem}.md"),
             "png": os.path.join(out_dir, f"{stem}.png")}
    with open(paths["json"], "w") as f:
        json.dump(data, f, indent=1, default=str)
    with open(paths["markdown"], "w") as f:
        f.write(markdown_text)
    if draw(paths["png"]) is None:
        paths.pop("png")
    return paths


def write_all(records: list[dict], ceilings: dict, meta: dict, out_dir: str) -> dict:
    return write_files(out_dir, "bench", {"meta": meta, "ceilings": ceilings, "cases": records},
                       markdown(records, ceilings, meta), lambda path: plot(records, ceilings, path))
