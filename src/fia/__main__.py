"""python -m fia warmup [set ...]: compile every kernel set this CPU uses into the on-disk cache.
python -m fia run SCRIPT [ARGS...]: run a script written for Ascend with fia.install_as_torch_npu() in effect."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fia", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("warmup", help="compile (or load) the CPU kernels ahead of the first call")
    w.add_argument("sets", nargs="*", help="kernel sets (default: every set this CPU uses)")
    r = sub.add_parser("run", help="run SCRIPT with `import torch_npu` and torch.ops.npu served by FIA")
    r.add_argument("script")
    r.add_argument("script_args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.command == "run":
        return _run_script(args.script, args.script_args)
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


def _run_script(script: str, script_args: list) -> int:
    """Run `script` as __main__ (its own sys.argv and sys.path[0], as `python SCRIPT` would) after
    fia.install_as_torch_npu(); its exit status is the command's."""
    import os
    import runpy
    from .torch_npu import install
    install()
    sys.argv = [script] + list(script_args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
