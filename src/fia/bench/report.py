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
    return [f"CPU {c['cpu']} ({c['cpu_capability']}), {c['threads']} torch threads, torch {c['torch_version']}, "
            f"OMP_WAIT_POLICY {c.get('omp_wait_policy', 'unset')}",
            f"read bandwidth {c['read_gbps']:.1f} GB/s (x.sum, median); cross-check: copy {c['copy_gbps']:.1f} GB/s "
            f"(read+write), {100 * (c['copy_gbps'] / c['read_gbps'] - 1):+.0f}%",
            f"matmul: {mm}"] + (["(each the better of a measurement before and after the cases)"]
                                if "before" in c else []) + _drift_lines(c) + _cache_lines(c)


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


def terminal_table(records: list[dict], ceilings: dict) -> str:
    body = rows(records)
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(COLUMNS)]
    left = (0, 1, len(COLUMNS) - 1)
    fmt = lambda cells: "  ".join(c.ljust(w) if i in left else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    lines = ceilings_lines(ceilings) + ["", fmt(COLUMNS), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in body]
    return "\n".join(lines)


NOTES = """\
- Times are medians over the timed repeats after warm-up, in one process, on identical inputs.
- Decode rate: bytes of K and V as stored (int8: 1 byte/element plus scales; paged: the used blocks) per
  second; ceiling = streaming read bandwidth (% ceil: the run's ceiling, the better of before / after the cases;
  % near: the better of two reads of the same kind right before and after the case's FIA-SDPA-FIA blocks,
  since a shared host's bandwidth drifts within minutes). Prefill rate: 4·B·N·D·(unmasked (i, j) pairs) per second;
  ceiling = the best of the dtype's and float32's torch.mm rate (fp32 when native bf16/fp16 mm is slower).
- SDPA = torch.nn.functional.scaled_dot_product_attention on the same problem, everything inside the timed
  call: enable_gqa=True; paged KV gathered to a dense tensor first; int8 KV dequantized first; causal via
  is_causal; band as a bool mask; pse_shift as the float additive mask.
- x dense (paged, int8 and token-major "-bsnd" / "-bsh" decode cases): FIA on the same problem with a dense BNSD
  K / V cache of the case's dtype (its "dense twin", checked like a case), timed in the same blocks: FIA / twin /
  SDPA / twin / FIA, so the ratio (twin ms / case ms: > 1 = faster than dense) is not the host's drift between
  two cases.
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
    out += ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    out += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows(records, width=200)]
    out += ["", "## Notes", "", NOTES]
    return "\n".join(out)


def plot(records: list[dict], ceilings: dict, path: str) -> Optional[str]:
    """Horizontal bars of the achieved rate per case and implementation, with each case's ceiling."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups = [(k, [r for r in records if r["kind"] == k]) for k in ("decode", "prefill")]
    groups = [(k, rs) for k, rs in groups if rs]
    if not groups:
        return None
    fig, axes = plt.subplots(1, len(groups), figsize=(7 * len(groups), 0.32 * max(len(rs) for _, rs in groups) + 2),
                             squeeze=False)
    impls = [("fia", "FIA (auto)", "tab:blue"), ("reference", "FIA reference", "tab:gray"),
             ("sdpa", "torch SDPA", "tab:orange")]
    for ax, (kind, rs) in zip(axes[0], groups):
        h = 0.27
        for k, (impl, label, color) in enumerate(impls):
            ys = [i + (k - 1) * h for i in range(len(rs))]
            ax.barh(ys, [r[impl].get("rate", 0.0) for r in rs], height=h, color=color, label=label)
        ax.scatter([r["ceiling"] for r in rs], range(len(rs)), marker="|", s=300, color="red", label="ceiling")
        rates = [r[i].get("rate", 0.0) for r in rs for i, _, _ in impls] + [r["ceiling"] for r in rs]
        pos = [x for x in rates if x > 0]
        if pos and max(pos) / min(pos) > 30:                   # rates spanning decades: log axis
            ax.set_xscale("log")
        ax.set_yticks(range(len(rs)))
        ax.set_yticklabels([r["name"] for r in rs], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("GB/s of K/V read" if kind == "decode" else "TFLOP/s (unmasked work)")
        ax.set_title(f"{kind}: achieved vs ceiling")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(records: list[dict], ceilings: dict, meta: dict, out_dir: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "bench.json"), "markdown": os.path.join(out_dir, "bench.md"),
             "png": os.path.join(out_dir, "bench.png")}
    with open(paths["json"], "w") as f:
        json.dump({"meta": meta, "ceilings": ceilings, "cases": records}, f, indent=1, default=str)
    with open(paths["markdown"], "w") as f:
        f.write(markdown(records, ceilings, meta))
    if plot(records, ceilings, paths["png"]) is None:
        paths.pop("png")
    return paths
