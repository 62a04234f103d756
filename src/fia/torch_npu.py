"""Drop-in namespace for code written against torch_npu's attention operators.

    import fia.torch_npu as torch_npu        # or: import fia as torch_npu
    out = torch_npu.npu_incre_flash_attention(q, k, v, num_heads=40, input_layout="BSH", scale_value=s)

Every ``npu_*`` function of ``fia`` is available here under the same name, with the ``.out`` variants
(``torch_npu.npu_fused_infer_attention_score.out(...)``) and the ``_npu_*_get_max_workspace`` queries of
graph-capture code (the graph-mode aware versions: ``torch.compile(..., fullgraph=True)`` records them as
single ``torch.ops.fia`` nodes). Only the attention
operators exist: device management (``torch_npu.npu.*``, ``tensor.npu()``) is not emulated -- drop the
``.npu()`` calls, the tensors stay on the CPU (or wherever they are).

Code you do not edit (an inference engine, a library module that does ``import torch_npu`` or calls
``torch.ops.npu.npu_fused_infer_attention_score``) runs after ``fia.install_as_torch_npu()`` (see install) or
under ``python -m fia run SCRIPT [ARGS...]``; docs/PORTING.md.
"""
from __future__ import annotations

import importlib.util
import sys

from . import api as _api
from .errors import FiaUnsupportedError as _Unsupported

_PREFIXES = ("npu_", "_npu_")      # the operators and their workspace queries

__all__ = [n for n in _api.__all__ if n.startswith(_PREFIXES)]


def __getattr__(name: str):
    # the public functions of fia.api (the same objects as fia.npu_*)
    if name.startswith(_PREFIXES) and name in _api.__all__:
        return getattr(_api, name)
    raise AttributeError(f"module 'fia.torch_npu' has no attribute {name!r} (FIA implements only the attention "
                         "operators of torch_npu)")


def __dir__():
    return sorted(set(globals()) | set(__all__))


def install():
    """fia.install_as_torch_npu: make ``import torch_npu`` yield this module and define FIA's operators in the
    ``torch.ops.npu`` namespace (the schemas, overloads and kernels of ``torch.ops.fia``). Idempotent. Where the
    real torch_npu is importable it raises FiaUnsupportedError and changes nothing. Returns this module."""
    me = sys.modules[__name__]
    present = sys.modules.get("torch_npu")
    if present is me:
        return me
    if present is not None or importlib.util.find_spec("torch_npu") is not None:
        where = getattr(present, "__file__", None) or importlib.util.find_spec("torch_npu").origin
        raise _Unsupported(
            f"install_as_torch_npu: the real torch_npu is importable ({where}); FIA would shadow it, so nothing "
            "was changed. Call FIA's functions (fia.npu_*) or torch.ops.fia.* directly instead.")
    from . import graph
    graph.register("npu")
    sys.modules["torch_npu"] = me
    return me
