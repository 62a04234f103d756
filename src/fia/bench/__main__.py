"""`python -m fia.bench` / `fia-bench`: ceilings, then the case table, then the reports.

  --quick          12 cases (decode KV_S 4096: fp16/bf16 x dense/paged/int8 per-channel/per-token;
                   prefill S 1024: bf16 causal/band/pse, fp16 causal), 3 repeats, tight budgets (< 2 min)
  --out DIR        output directory for bench.json, bench.md, bench.png (default bench-results/)
  --cases REGEX    run only the cases of the table (quick or full) whose name matches (re.search),
                   e.g. 'decode-bf16' or 'prefill.*s1024' (--list shows the names)
  --repeats N      timed calls per implementation (default 10, quick 3; fewer when a call is slow)
  --list           print the case names and exit
  --demo           run the paged-KV decode loop of the README (fia.bench.demo) and exit
  --cold           cold start per call family: fresh processes with empty kernel caches (fia.bench.cold)
  --transformers   greedy decoding of a transformers model, attn_implementation fia (DynamicCache, FiaCache, int8
                   FiaCache) vs sdpa: decode ms/step, tokens/s, attention share, x SDPA, prefill, same tokens;
                   transformers.json / .md / .png under --out (fia.bench.transformers_bench; lists: --context,
                   --batch, --dtype, --caches, --impls; --steps, --repeats)
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fia-bench", description="Benchmark FIA against torch SDPA on this machine.")
    p.add_argument("--quick", action="store_true", help="small case table and few repeats (< 2 minutes)")
    p.add_argument("--out", default="bench-results", help="output directory (default: bench-results)")
    p.add_argument("--cases", default=None, metavar="REGEX", help="only cases whose name matches REGEX")
    p.add_argument("--repeats", type=int, default=None, metavar="N", help="timed calls per implementation")
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")
    p.add_argument("--demo", action="store_true", help="run the paged-KV decode demo and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--cold", action="store_true", help="cold start: time to first answer and to warm speed")
    return p.parse_args(argv)


def main(argv=None) -> int:
    if "--transformers" in (argv if argv is not None else sys.argv[1:]):
        from .transformers_bench import main as transformers_main
        return transformers_main(argv)
    args = parse_args(argv)
    if args.demo:
        from .demo import demo
        demo()
        return 0
    if args.cold:
        from .cold import main as cold
        cold()
        return 0
    from . import cases as C
    table = C.quick_table() if args.quick else C.full_table()
    table = C.select(table, args.cases)
    if args.list:
        print("\n".join(c.name for c in table))
        return 0
    if not table:
        print(f"no case matches {args.cases!r}", file=sys.stderr)
        return 2

    import fia
    from . import machine, report, runner
    # the compiled kernels first (the cache's, or built now with progress): the table times FIA's own kernels,
    # not the torch backend that stands in while they build
    fia.warmup()
    t0 = time.perf_counter()
    started = datetime.datetime.now().isoformat(timespec="seconds")
    print("measuring machine ceilings ...", flush=True)
    before = machine.measure_ceilings(quick=args.quick)
    print("\n".join(report.ceilings_lines(before.to_dict())), flush=True)

    opts = runner.Options.quick(args.repeats) if args.quick else runner.Options(repeats=args.repeats or 10)
    probe = None
    if any(c.kind == "decode" for c in table):                # the read bandwidth next to each decode case
        probe = machine.ReadProbe((256 if args.quick else 512) << 20, 3 if args.quick else 5)
    records = runner.run_all(table, before, opts, fia, progress=not args.no_progress, probe=probe)
    del probe
    after = machine.measure_ceilings(quick=args.quick)        # again: the better of the two is the ceiling
    ceil = machine.Ceilings.best(before, after)
    runner.apply_ceilings(records, ceil)
    cdict = dict(ceil.to_dict(), before=before.to_dict(), after=after.to_dict())
    meta = {"argv": " ".join(["fia-bench"] + list(argv if argv is not None else sys.argv[1:])),
            "started": started, "duration_s": time.perf_counter() - t0, "quick": args.quick,
            "options": vars(opts), "fia_version": getattr(fia, "__version__", None)}
    paths = report.write_all(records, cdict, meta, args.out)
    print()
    print(report.terminal_table(records, cdict))
    print(f"\nwritten: {', '.join(paths.values())}  ({meta['duration_s']:.0f} s)")
    if "png" in paths:
        print(f"plot (FIA vs ceiling and SDPA per case): {os.path.abspath(paths['png'])}")
    else:
        print("no plot: matplotlib is not installed (pip install matplotlib, or the fia[plot] extra)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
