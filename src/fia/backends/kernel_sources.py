"""Which sources a Numba-cached kernel module compiles into its machine code, and their hash.

Numba's on-disk cache (`cache=True`) keys each compiled function on the bytes of the file that defines it,
and nothing else: decode_kernels' machine code also holds the LLVM IR that decode_simd / decode_fma /
decode_vnni / decode_amx emit, and prefill_kernels' holds decode_kernels' functions and prefill_simd's IR.
An edit to one of those files alone -- or an upgrade of FIA that changes only them, with the old
`__pycache__` left in place -- would load the old kernels. So each cached module carries `SOURCES_SHA`, the
hash of its dependencies (`sources_sha`), as a literal: a change to a dependency changes the module's bytes,
which invalidates its cache. tests/test_kernel_cache.py fails, naming the new value, when a literal is stale.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

_HERE = Path(__file__).resolve().parent

# module -> the files (in this package) whose code its compiled functions embed
DEPENDENCIES = {
    "decode_kernels": ("decode_simd.py", "decode_fma.py", "decode_vnni.py", "decode_amx.py"),
    "prefill_kernels": ("decode_kernels.py", "decode_simd.py", "decode_fma.py", "decode_vnni.py", "decode_amx.py",
                        "prefill_simd.py"),
}


def sources_sha(module: str) -> str:
    """The first 16 hex digits of the SHA-256 of the module's dependencies (line endings normalized)."""
    h = hashlib.sha256()
    for name in DEPENDENCIES[module]:
        h.update(name.encode() + b"\0" + (_HERE / name).read_bytes().replace(b"\r\n", b"\n") + b"\0")
    return h.hexdigest()[:16]
