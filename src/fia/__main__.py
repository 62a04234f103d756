"""python -m fia warmup [set ...]: compile every kernel set this CPU uses into the on-disk cache."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fia", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("warmup", help="compile (or load) the CPU kernels ahead of the first call")
    w.add_argument("sets", nargs="*", help="kernel sets (default: every set this CPU uses)")
    args = ap.parse_args(argv)
    from .kernel_warmup import warmup
    from .cpu.jit import KERNEL_SETS
    unknown = [s for s in args.sets if s not in KERNEL_SETS]
    if unknown:
        ap.error(f"unknown kernel set(s) {unknown}; known: {sorted(KERNEL_SETS)}")
    done = warmup(args.sets or None)
    total = sum(done.values())
    print(f"fia warmup: {len(done)} kernel set(s) ready in {total:.1f} s: "
          + ", ".join(f"{n} {t:.1f} s" for n, t in done.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
