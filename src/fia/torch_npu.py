"""Drop-in namespace for code written against torch_npu's attention operators.

    import fia.torch_npu as torch_npu        # or: import fia as torch_npu
    out = torch_npu.npu_incre_flash_attention(q, k, v, num_heads=40, input_layout="BSH", scale_value=s)

Every ``npu_*`` function of ``fia`` is available here under the same name, with the ``.out`` variants
(``torch_npu.npu_fused_infer_attention_score.out(...)``) and the ``_npu_*_get_max_workspace`` queries of
graph-capture code (the graph-mode aware versions: ``torch.compile(..., fullgraph=True)`` records them as
single ``torch.ops.fia`` nodes). Only the attention
operators exist: device management (``torch_npu.npu.*``, ``tensor.npu()``) is not emulated -- drop the
``.npu()`` calls, the tensors stay on the CPU (or wherever they are).
"""
from __future__ import annotations

import fia as _fia

_PREFIXES = ("npu_", "_npu_")      # the operators and their workspace queries

__all__ = [n for n in _fia.__all__ if n.startswith(_PREFIXES)]


def __getattr__(name: str):
    # resolved lazily so functions added to fia later appear here too
    if name.startswith(_PREFIXES) and hasattr(_fia, name):
        return getattr(_fia, name)
    raise AttributeError(f"module 'fia.torch_npu' has no attribute {name!r} (FIA implements only the attention "
                         "operators of torch_npu)")


def __dir__():
    return sorted(set(globals()) | {n for n in dir(_fia) if n.startswith(_PREFIXES)})
