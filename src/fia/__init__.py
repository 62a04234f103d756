"""FIA — the Ascend fused inference attention operators on any PyTorch device, CPU first.

`import fia as torch_npu` runs torch_npu attention code unchanged.
"""
from . import aclnn, graph
from .api import (_npu_fused_infer_attention_score_get_max_workspace, _npu_fused_infer_attention_score_infer_output,
                  _npu_fused_infer_attention_score_v2_get_max_workspace,
                  _npu_fused_infer_attention_score_v2_infer_output, npu_attention_update,
                  npu_fused_infer_attention_score, npu_fused_infer_attention_score_v2, npu_incre_flash_attention,
                  npu_prompt_flash_attention)
from .config import (get_backend, get_validation_mode, set_backend, set_validation_mode, use_backend,
                     validation_mode)
from .kernel_warmup import warmup
from .dispatch_report import DispatchReport, explain
from .errors import FiaBackendUnavailable, FiaError, FiaInputError, FiaMemoryError, FiaRuntimeError, FiaUnsupportedError


def install_as_torch_npu():
    """Let code written for Ascend run unchanged: afterwards ``import torch_npu`` yields FIA's torch_npu namespace
    (fia.torch_npu) and ``torch.ops.npu.<op>`` resolves for every operator FIA implements. Idempotent; refuses
    (FiaUnsupportedError, nothing changed) where the real torch_npu is importable. ``python -m fia run SCRIPT``
    runs a script with it installed."""
    from .torch_npu import install
    return install()


__version__ = "0.1.0"  # the one version source (pyproject.toml reads it: dynamic version)

__all__ = [
    "npu_fused_infer_attention_score", "npu_incre_flash_attention", "npu_prompt_flash_attention",
    "npu_fused_infer_attention_score_v2", "npu_attention_update",
    "_npu_fused_infer_attention_score_get_max_workspace", "_npu_fused_infer_attention_score_v2_get_max_workspace",
    "_npu_fused_infer_attention_score_infer_output", "_npu_fused_infer_attention_score_v2_infer_output",
    "FiaError", "FiaInputError", "FiaUnsupportedError", "FiaRuntimeError", "FiaMemoryError",
    "get_validation_mode", "set_validation_mode", "validation_mode",
    "get_backend", "set_backend", "use_backend",
    "explain", "DispatchReport", "aclnn", "graph", "warmup", "FiaBackendUnavailable", "install_as_torch_npu",
]
