"""Run a Python script so that `perf` names FIA's numba kernels (developer tool).

The machines of this project have no PMU in their VMs, but `perf record -e cpu-clock` samples work; numba's
JIT code shows up there as bare addresses. This runner hooks numba before FIA loads its kernels (from the
on-disk cache or freshly compiled), runs the script, and at exit writes /tmp/perf-<pid>.map -- the file perf
reads for JIT symbols -- with every function of every compiled FIA kernel library (the top-level njit
functions and the LLVM-IR kernels such as fia_qk_fma). numba's NRT_incref / NRT_decref are compiled apart
and stay unnamed: two hot addresses 16 bytes apart (their `lock add`s, what reference-counting an array
argument of a call costs).

    perf record -e cpu-clock -F 5000 -o /tmp/fia.data -- .venv/bin/python scripts/perf_jit.py my_loop.py
    perf report -i /tmp/fia.data --stdio --sort dso,sym

Functions numba keeps local (inlined helpers' leftovers) may still show as addresses inside a library.
"""
from __future__ import annotations

import atexit
import os
import re
import runpy
import subprocess
import sys
import tempfile

import numba.core.codegen as _cg

_LIBS: list = []
_set = _cg.CPUCodeLibrary._set_compiled_object


def _keep(self, value):
    """Keep each library's object code (loaded from the cache, numba drops its module)."""
    _LIBS.append((self, value))
    _set(self, value)


_cg.CPUCodeLibrary._set_compiled_object = _keep


def _short(name: str) -> str:
    """`_ZN3fia8backends6decode7kernels5mergeB...` -> `kernels.merge`."""
    m = re.match(r"_ZN(.*)", name)
    if not m:
        return name
    rest, parts = m.group(1), []
    while rest[:1].isdigit():
        n = re.match(r"\d+", rest).group(0)
        rest = rest[len(n):]
        parts.append(rest[:int(n)])
        rest = rest[int(n):]
    return ".".join(parts[-2:]) if parts else name


def write_map() -> str:
    """Write /tmp/perf-<pid>.map for every library loaded so far; returns its path."""
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        obj = os.path.join(tmp, "lib.o")
        for lib, code in _LIBS:
            with open(obj, "wb") as f:
                f.write(code)
            out = subprocess.run(["nm", "-S", "--defined-only", obj], capture_output=True, text=True).stdout
            syms = [(int(p[0], 16), int(p[1], 16), p[3]) for p in map(str.split, out.splitlines())
                    if len(p) == 4 and p[2] in "tT"]
            base = None
            for off, _, name in syms:                 # one exported symbol places the object in memory
                try:
                    addr = lib.get_pointer_to_function(name)
                except Exception:
                    addr = 0
                if addr:
                    base = addr - off
                    break
            if base is not None:
                lines += [f"{base + off:x} {size:x} {_short(name)}\n" for off, size, name in syms]
    path = f"/tmp/perf-{os.getpid()}.map"
    with open(path, "w") as f:
        f.writelines(lines)
    return path


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: perf_jit.py SCRIPT [ARGS...]")
    atexit.register(write_map)
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
