"""The ``.out`` variants and workspace queries of the fused functions (SPEC 1.1b), built from the functional ones.

    ws = fia._npu_fused_infer_attention_score_get_max_workspace(q, k, v, **kw)
    out, lse = fia.npu_fused_infer_attention_score.out(q, k, v, **kw, workspace=ws, out=[attention_out, lse_buf])

This is how graph-capture code (vllm-ascend, sglang) calls the NPU: outputs allocated once, written in place.
Nothing here knows an argument of attention: the arguments are bound to the *functional* function's
signature and go through its own argument -> problem step (`problem_of`), so the ``.out`` variant accepts,
rejects and computes exactly what the functional call does. What is added:

* the caller's outputs, spelled ``out=[attention_out, softmax_lse]`` (list or tuple; the torch_npu Python
  spelling) or ``attention_out=..., softmax_lse=...`` (the operator-schema spelling) -- one of the two;
* their check (fia.finalize.check_outputs, shared with aclnn) after parsing and BEFORE anything runs, so an
  invalid call leaves the caller's tensors untouched. With the lse flag off, softmax_lse is a placeholder
  of any shape and dtype that is never written (DECISIONS 17);
* ``workspace``: accepted and ignored (DECISIONS 18): the CPU needs no device scratch buffer.
"""
from __future__ import annotations

import inspect
from typing import Callable, Tuple

import torch

from .backends import registry
from .backends.base import run_inference
from .errors import ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR, input_error
from .finalize import check_outputs, write_outputs

__all__ = ["caller_outputs", "empty_workspace", "out_variant", "workspace_query"]

def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {str(x.dtype).replace('torch.', '')} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def caller_outputs(out, attention_out, softmax_lse) -> Tuple[torch.Tensor, torch.Tensor, Tuple[str, str]]:
    """The caller's (attention_out, softmax_lse) from either spelling, and the names errors give them."""
    schema_spelling = attention_out is not None or softmax_lse is not None
    if out is not None and schema_spelling:
        raise input_error("out", "either out=[attention_out, softmax_lse] or the attention_out= / softmax_lse= "
                          "keywords, not both", "both")
    if out is None and not schema_spelling:
        raise input_error("out", "the caller's outputs: out=[attention_out, softmax_lse] (or attention_out= and "
                          "softmax_lse=)", "None", status=ACLNN_ERR_PARAM_NULLPTR)
    if out is not None:
        if not isinstance(out, (list, tuple)) or len(out) != 2:
            raise input_error("out", "a list or tuple of two tensors [attention_out, softmax_lse]",
                              f"{len(out)} elements" if isinstance(out, (list, tuple)) else _describe(out))
        attention_out, softmax_lse = out
        names = ("out[0]", "out[1]")
    else:
        names = ("attention_out", "softmax_lse")
    # softmax_lse must be a tensor even when it is only a placeholder (the operator schema takes a Tensor)
    for name, t in zip(names, (attention_out, softmax_lse)):
        if not isinstance(t, torch.Tensor):
            raise input_error(name, "a tensor (the caller-allocated output)", "None" if t is None else _describe(t),
                              status=ACLNN_ERR_PARAM_NULLPTR if t is None else ACLNN_ERR_PARAM_INVALID)
    return attention_out, softmax_lse, names


def _check_workspace(workspace) -> None:
    if workspace is not None and not isinstance(workspace, torch.Tensor):
        raise input_error("workspace", "a tensor or None (it is not used on this device)", _describe(workspace))


def _binder(fn: Callable):
    """(query, key, value, kwargs) -> the functional call's full argument dict (defaults filled in).

    Binding to the functional signature rejects an unknown keyword exactly as the functional call does
    (TypeError, or for the v2 function, whose signature collects them, its own input error)."""
    sig = inspect.signature(fn)

    def bind(query, key, value, kwargs: dict) -> dict:
        bound = sig.bind(query, key, value, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)
    return bind, sig


def _extended_signature(sig: inspect.Signature, extra) -> inspect.Signature:
    """The functional signature plus keyword-only `extra` parameters (before a trailing **kwargs)."""
    params = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD]
    var = [p for p in sig.parameters.values() if p.kind == p.VAR_KEYWORD]
    return sig.replace(parameters=params + list(extra) + var)


def out_variant(fn: Callable, problem_of: Callable[[dict], object], lse_flag: str) -> Callable:
    """`fn.out`: the functional `fn` writing into caller tensors. `problem_of(args)` is fn's parse step;
    `lse_flag` names fn's lse keyword (for the error message)."""
    bind, sig = _binder(fn)

    def out_fn(query, key, value, *, workspace=None, out=None, attention_out=None, softmax_lse=None, **kwargs):
        attention_out, softmax_lse, names = caller_outputs(out, attention_out, softmax_lse)
        _check_workspace(workspace)
        problem = problem_of(bind(query, key, value, kwargs))
        check_outputs(problem, attention_out, softmax_lse, names, f" ({lse_flag} is true)")
        backend = registry.select(problem)
        write_outputs(problem, run_inference(backend, problem), attention_out, softmax_lse)
        return attention_out, softmax_lse

    kw = inspect.Parameter.KEYWORD_ONLY
    out_fn.__signature__ = _extended_signature(
        sig, [inspect.Parameter("workspace", kw, default=None), inspect.Parameter("out", kw, default=None),
              inspect.Parameter("attention_out", kw, default=None), inspect.Parameter("softmax_lse", kw, default=None)])
    out_fn.__name__ = out_fn.__qualname__ = "out"
    out_fn.__module__ = fn.__module__
    out_fn.__doc__ = (f"{fn.__name__}.out(query, key, value, *, <the keywords of {fn.__name__}>, workspace=None, "
                      "out=[attention_out, softmax_lse]) -> (attention_out, softmax_lse)\n\n"
                      f"Computes {fn.__name__} into the caller's tensors (shape, dtype and device checked before "
                      f"anything runs) and returns them. With {lse_flag} off, softmax_lse is a placeholder: any "
                      "tensor, left untouched. `workspace` is ignored. See fia.outvariants.")
    return out_fn


def empty_workspace(like: torch.Tensor) -> torch.Tensor:
    """The workspace on this device: empty uint8 [0] on `like`'s device (also the graph-mode fake result)."""
    return like.new_empty(0, dtype=torch.uint8)


def workspace_query(fn: Callable, problem_of: Callable[[dict], object], name: str) -> Callable:
    """`_<fn>_get_max_workspace`: validates and plans exactly like `fn`, returns the workspace for `.out`.

    The CPU needs no device scratch memory: the workspace is an empty uint8 tensor on the query's device
    (SPEC 1.1b allows an empty one); the ``.out`` variants accept and ignore it."""
    bind, sig = _binder(fn)

    def get_max_workspace(query, key, value, **kwargs) -> torch.Tensor:
        problem = problem_of(bind(query, key, value, kwargs))
        registry.select(problem)      # a valid call no backend implements fails here, as the call would
        return empty_workspace(problem.query)

    get_max_workspace.__signature__ = sig.replace(return_annotation=torch.Tensor)
    get_max_workspace.__name__ = get_max_workspace.__qualname__ = name
    get_max_workspace.__module__ = fn.__module__
    get_max_workspace.__doc__ = (f"{name}(query, key, value, *, <the keywords of {fn.__name__}>) -> workspace\n\n"
                                 f"Validates the arguments exactly like {fn.__name__} and returns the workspace "
                                 "its .out variant takes: an empty uint8 tensor here (no device scratch needed).")
    return get_max_workspace
