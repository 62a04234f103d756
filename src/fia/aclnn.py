"""The two-phase (aclnn-style) interface (SPEC 1.2): Python renderings of the C prototypes.

    workspace_size, executor = aclnnFusedInferAttentionScoreV2GetWorkspaceSize(query, key, value, ...,
                                                                               attentionOut, softmaxLse)
    aclnnFusedInferAttentionScoreV2(workspace, workspace_size, executor, stream)      # -> 0 (ACLNN_SUCCESS)

The same for ``aclnnFusedInferAttentionScoreV4*`` and ``aclnnIncreFlashAttentionV4*``.

Rendering rules
* Parameters: the prototypes' names and order (they win over the documents' sample programs: the V4
  sample passes one optional input and ``queryQuantMode`` fewer than its prototype). Every parameter is
  required, as in C: pass ``None`` for ``nullptr``. The C out-parameters ``workspaceSize`` /
  ``executor`` become the return value ``(workspace_size, executor)``.
* ``aclTensor`` -> ``torch.Tensor``; ``aclTensorList`` (key, value) -> a list of tensors: one tensor
  holding every batch is ordinary (dense or paged) KV, several tensors of batch 1 are tensor-list KV;
  ``aclIntArray`` -> a list of ints (tuples, NumPy arrays, int tensors work too); ``char*`` -> ``str``.
* Phase 1 validates every argument through the same parse layer as the PyTorch functions (plus the
  caller-allocated ``attentionOut`` / ``softmaxLse``: shape, dtype, device), selects the backend and
  returns an executor. It computes nothing and writes nothing. Host-side inputs (the lengths arrays,
  block ids, padding sizes, per-tensor scales) are read now, as the NPU does; tensor *data* is read in
  phase 2.
* Phase 2 runs the plan and writes into ``attentionOut`` (and ``softmaxLse`` when ``softmaxLseFlag``).
  With ``softmaxLseFlag`` false, ``softmaxLse`` is left as passed; when it is None, a ``(1,)`` float32
  zero tensor stands for it (``executor.softmaxLse``). An executor runs once.
* Failures raise (instead of returning a status) an exception whose ``status`` is the documented code:
  161001 ``ACLNN_ERR_PARAM_NULLPTR`` -- query, key, value or attentionOut is None (or softmaxLse with
  softmaxLseFlag true); 161002 ``ACLNN_ERR_PARAM_INVALID`` -- any other invalid argument, a used or
  foreign executor, a too small workspace, and valid inputs no backend implements
  (``FiaUnsupportedError``); 361001 ``ACLNN_ERR_RUNTIME_ERROR`` -- the computation failed
  (``FiaRuntimeError``, the original exception chained).
* Error messages name the offending argument as the prototype does (``attenMaskOptional``,
  ``numHeads``, ...); ``FiaInputError.argument`` carries that name. Argument names mentioned further
  inside a message may be the torch_npu keyword (see ``names(...)`` for the table).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

import torch

from . import parse
from .backends import registry
from .backends.base import run_inference
from .config import is_strict
from .errors import ACLNN_ERR_PARAM_NULLPTR, ACLNN_SUCCESS, FiaError, FiaInputError, FiaRuntimeError, input_error
from .finalize import check_outputs, write_outputs
from .parse.context import Ctx
from .parse.entries import FUSED_DEFAULTS

__all__ = [
    "aclnnFusedInferAttentionScoreV2GetWorkspaceSize", "aclnnFusedInferAttentionScoreV2",
    "aclnnFusedInferAttentionScoreV4GetWorkspaceSize", "aclnnFusedInferAttentionScoreV4",
    "aclnnIncreFlashAttentionV4GetWorkspaceSize", "aclnnIncreFlashAttentionV4",
    "AclOpExecutor", "names", "ACLNN_SUCCESS",
]

# ------------------------------------------------------------------------------------------ name tables
# (aclnn parameter, torch_npu keyword) in prototype order, inputs and attributes (not the outputs)
_V2_INPUTS = [
    ("query", "query"), ("key", "key"), ("value", "value"),
    ("pseShiftOptional", "pse_shift"), ("attenMaskOptional", "atten_mask"),
    ("actualSeqLengthsOptional", "actual_seq_lengths"), ("actualSeqLengthsKvOptional", "actual_seq_lengths_kv"),
    ("deqScale1Optional", "dequant_scale1"), ("quantScale1Optional", "quant_scale1"),
    ("deqScale2Optional", "dequant_scale2"), ("quantScale2Optional", "quant_scale2"),
    ("quantOffset2Optional", "quant_offset2"), ("antiquantScaleOptional", "antiquant_scale"),
    ("antiquantOffsetOptional", "antiquant_offset"), ("blockTableOptional", "block_table"),
    ("queryPaddingSizeOptional", "query_padding_size"), ("kvPaddingSizeOptional", "kv_padding_size"),
    ("keyAntiquantScaleOptional", "key_antiquant_scale"), ("keyAntiquantOffsetOptional", "key_antiquant_offset"),
    ("valueAntiquantScaleOptional", "value_antiquant_scale"),
    ("valueAntiquantOffsetOptional", "value_antiquant_offset"),
    ("keySharedPrefixOptional", "key_shared_prefix"), ("valueSharedPrefixOptional", "value_shared_prefix"),
    ("actualSharedPrefixLenOptional", "actual_shared_prefix_len"),
]
_V4_EXTRA_INPUTS = [
    ("queryRopeOptional", "query_rope"), ("keyRopeOptional", "key_rope"),
    ("keyRopeAntiquantScaleOptional", "key_rope_antiquant_scale"),
    ("dequantScaleQueryOptional", "dequant_scale_query"),
]
_V2_ATTRS = [
    ("numHeads", "num_heads"), ("scaleValue", "scale"), ("preTokens", "pre_tokens"), ("nextTokens", "next_tokens"),
    ("inputLayout", "input_layout"), ("numKeyValueHeads", "num_key_value_heads"), ("sparseMode", "sparse_mode"),
    ("innerPrecise", "inner_precise"), ("blockSize", "block_size"), ("antiquantMode", "antiquant_mode"),
    ("softmaxLseFlag", "softmax_lse_flag"), ("keyAntiquantMode", "key_antiquant_mode"),
    ("valueAntiquantMode", "value_antiquant_mode"),
]
_V4_EXTRA_ATTRS = [("queryQuantMode", "query_quant_mode")]

# IncreFlashAttentionV4 maps onto npu_incre_flash_attention's keywords (its actualSeqLengths are KV lengths)
_IFA = [
    ("query", "query"), ("key", "key"), ("value", "value"), ("pseShift", "pse_shift"), ("attenMask", "atten_mask"),
    ("actualSeqLengths", "actual_seq_lengths"), ("dequantScale1", "dequant_scale1"),
    ("quantScale1", "quant_scale1"), ("dequantScale2", "dequant_scale2"), ("quantScale2", "quant_scale2"),
    ("quantOffset2", "quant_offset2"), ("antiquantScale", "antiquant_scale"),
    ("antiquantOffset", "antiquant_offset"), ("blocktable", "block_table"), ("kvPaddingSize", "kv_padding_size"),
    ("numHeads", "num_heads"), ("scaleValue", "scale_value"), ("inputLayout", "input_layout"),
    ("numKeyValueHeads", "num_key_value_heads"), ("blockSize", "block_size"), ("innerPrecise", "inner_precise"),
]

_OPS = {
    "aclnnFusedInferAttentionScoreV2": _V2_INPUTS + _V2_ATTRS,
    "aclnnFusedInferAttentionScoreV4": _V2_INPUTS + _V4_EXTRA_INPUTS + _V2_ATTRS + _V4_EXTRA_ATTRS,
    "aclnnIncreFlashAttentionV4": _IFA,
}


def names(op: str) -> Dict[str, str]:
    """aclnn parameter -> torch_npu keyword for `op` (e.g. "aclnnFusedInferAttentionScoreV4")."""
    return dict(_OPS[op])


# ------------------------------------------------------------------------------------------ executor
class AclOpExecutor:
    """The plan of one call (aclOpExecutor): the parsed problem, the chosen backend, the output tensors.

    `attentionOut` / `softmaxLse` are the caller's tensors (softmaxLse: the (1,) zero stand-in when the
    caller passed None). It runs once.
    """

    def __init__(self, op: str, problem, backend, attention_out: torch.Tensor, softmax_lse: torch.Tensor,
                 write_lse: bool, workspace_size: int):
        self.op = op
        self.problem = problem
        self.backend = backend
        self.attentionOut = attention_out
        self.softmaxLse = softmax_lse
        self.write_lse = write_lse
        self.workspace_size = workspace_size
        self.consumed = False

    def __repr__(self) -> str:
        state = "used" if self.consumed else "ready"
        return f"<AclOpExecutor {self.op} backend={self.backend.name} {state}>"


# ------------------------------------------------------------------------------------------ phase 1
def _rename(e: FiaError, table: Dict[str, str]) -> FiaError:
    """Name the offending argument as the prototype does (message prefix and .argument)."""
    arg = getattr(e, "argument", None)
    if isinstance(e, FiaInputError) and arg in table and table[arg] != arg:
        new = table[arg]
        msg = str(e)
        if msg.startswith(arg + ":"):
            msg = new + msg[len(arg):]
        e.args = (msg,)
        e.argument = new
    return e


def _kv(x):
    """aclTensorList -> what the parse layer takes: one tensor holding every batch = ordinary KV."""
    if isinstance(x, (list, tuple)) and len(x) == 1 and isinstance(x[0], torch.Tensor):
        return x[0]
    return x


def _back(op: str) -> Dict[str, str]:
    """torch_npu keyword -> aclnn parameter of `op` (how errors name the arguments)."""
    return {v: k for k, v in _OPS[op]}


def _plan(op: str, a: dict, attention_out, softmax_lse) -> Tuple[int, AclOpExecutor]:
    back = _back(op)
    for name in ("query", "key", "value"):
        if a[name] is None:
            raise input_error(name, "a tensor" if name == "query" else "a tensor list", "None (nullptr)",
                              status=ACLNN_ERR_PARAM_NULLPTR)
    if attention_out is None:
        raise input_error("attentionOut", "a tensor (the caller-allocated output)", "None (nullptr)",
                          status=ACLNN_ERR_PARAM_NULLPTR)
    try:
        problem = _parse(op, a)
        check_outputs(problem, attention_out, softmax_lse, ("attentionOut", "softmaxLse"), " (softmaxLseFlag is true)")
        lse_flag = problem.want_lse
        if not lse_flag and softmax_lse is None and op != "aclnnIncreFlashAttentionV4":
            softmax_lse = torch.zeros(1, dtype=torch.float32, device=problem.device)
        backend = registry.select(problem)
    except FiaError as e:
        raise _rename(e, back)
    return 0, AclOpExecutor(op, problem, backend, attention_out, softmax_lse, lse_flag, 0)


def _parse(op: str, a: dict):
    """The aclnn arguments of `op` (inputs and attributes, no outputs) -> the parsed problem."""
    table = dict(_OPS[op])
    if isinstance(a["inputLayout"], bytes):                # char*
        a = dict(a, inputLayout=a["inputLayout"].decode())
    if op == "aclnnIncreFlashAttentionV4":
        args = {table[k]: v for k, v in a.items()}
        args.update(padding_mask=None, key=_kv(args["key"]), value=_kv(args["value"]))
        return parse.parse_incre(args)
    args = dict(FUSED_DEFAULTS)
    args.update({table[k]: v for k, v in a.items()})
    args.update(key=_kv(args["key"]), value=_kv(args["value"]))
    return parse.parse_fused(args, api=op, aliases=_back(op))


def parse_call(op: str, a: dict):
    """`op`'s phase-1 parse without the outputs (fia.explain): errors name the prototype's arguments."""
    try:
        return _parse(op, a)
    except FiaError as e:
        raise _rename(e, _back(op))


# ------------------------------------------------------------------------------------------ phase 2
def _execute(op: str, workspace, workspace_size, executor, stream) -> int:
    if not isinstance(executor, AclOpExecutor):
        raise input_error("executor", f"the executor returned by {op}GetWorkspaceSize", type(executor).__name__)
    if executor.op != op:
        raise input_error("executor", f"an executor of {op}", f"one of {executor.op}")
    if executor.consumed:
        raise input_error("executor", "an executor that has not run yet (an executor runs once)",
                          "an executor that already ran", f"call {op}GetWorkspaceSize again")
    if not isinstance(workspace_size, int) or workspace_size < executor.workspace_size:
        raise input_error("workspaceSize", f"an int >= {executor.workspace_size} (from {op}GetWorkspaceSize)",
                          repr(workspace_size))
    executor.consumed = True
    p = executor.problem
    if p.kv.kind == "paged":                  # phase 2 reads the table as it is now, checked again
        back = _back(op)
        try:
            p = dataclasses.replace(p, kv=parse.reread_table(Ctx(op, is_strict(), back), p.kv))
        except FiaError as e:
            raise _rename(e, back)
    try:
        write_outputs(p, run_inference(executor.backend, p), executor.attentionOut, executor.softmaxLse)
    except FiaError:
        raise
    except Exception as e:   # the computation itself failed (ACLNN_ERR_RUNTIME_ERROR)
        raise FiaRuntimeError(f"{op}: the computation failed ({type(e).__name__}: {e})") from e
    return ACLNN_SUCCESS


# ------------------------------------------------------------------------------------------ FusedInferAttentionScoreV2
def aclnnFusedInferAttentionScoreV2GetWorkspaceSize(
        query, key, value, pseShiftOptional, attenMaskOptional, actualSeqLengthsOptional,
        actualSeqLengthsKvOptional, deqScale1Optional, quantScale1Optional, deqScale2Optional, quantScale2Optional,
        quantOffset2Optional, antiquantScaleOptional, antiquantOffsetOptional, blockTableOptional,
        queryPaddingSizeOptional, kvPaddingSizeOptional, keyAntiquantScaleOptional, keyAntiquantOffsetOptional,
        valueAntiquantScaleOptional, valueAntiquantOffsetOptional, keySharedPrefixOptional,
        valueSharedPrefixOptional, actualSharedPrefixLenOptional, numHeads, scaleValue, preTokens, nextTokens,
        inputLayout, numKeyValueHeads, sparseMode, innerPrecise, blockSize, antiquantMode, softmaxLseFlag,
        keyAntiquantMode, valueAntiquantMode, attentionOut, softmaxLse) -> Tuple[int, AclOpExecutor]:
    """Phase 1 of FusedInferAttentionScoreV2: validate and plan. Returns (workspace_size, executor)."""
    a = dict(locals())
    out, lse = a.pop("attentionOut"), a.pop("softmaxLse")
    return _plan("aclnnFusedInferAttentionScoreV2", a, out, lse)


def aclnnFusedInferAttentionScoreV2(workspace, workspaceSize, executor, stream=None) -> int:
    """Phase 2: run the executor, writing attentionOut (and softmaxLse). Returns 0 (ACLNN_SUCCESS)."""
    return _execute("aclnnFusedInferAttentionScoreV2", workspace, workspaceSize, executor, stream)


# ------------------------------------------------------------------------------------------ FusedInferAttentionScoreV4
def aclnnFusedInferAttentionScoreV4GetWorkspaceSize(
        query, key, value, pseShiftOptional, attenMaskOptional, actualSeqLengthsOptional,
        actualSeqLengthsKvOptional, deqScale1Optional, quantScale1Optional, deqScale2Optional, quantScale2Optional,
        quantOffset2Optional, antiquantScaleOptional, antiquantOffsetOptional, blockTableOptional,
        queryPaddingSizeOptional, kvPaddingSizeOptional, keyAntiquantScaleOptional, keyAntiquantOffsetOptional,
        valueAntiquantScaleOptional, valueAntiquantOffsetOptional, keySharedPrefixOptional,
        valueSharedPrefixOptional, actualSharedPrefixLenOptional, queryRopeOptional, keyRopeOptional,
        keyRopeAntiquantScaleOptional, dequantScaleQueryOptional, numHeads, scaleValue, preTokens, nextTokens,
        inputLayout, numKeyValueHeads, sparseMode, innerPrecise, blockSize, antiquantMode, softmaxLseFlag,
        keyAntiquantMode, valueAntiquantMode, queryQuantMode, attentionOut,
        softmaxLse) -> Tuple[int, AclOpExecutor]:
    """Phase 1 of FusedInferAttentionScoreV4 (adds MLA rope, query dequant, TND layouts): validate and plan.

    25 optional inputs between `value` and `numHeads`; the attributes end with `queryQuantMode` (the
    prototype, which wins over the document's sample program). Returns (workspace_size, executor).
    """
    a = dict(locals())
    out, lse = a.pop("attentionOut"), a.pop("softmaxLse")
    return _plan("aclnnFusedInferAttentionScoreV4", a, out, lse)


def aclnnFusedInferAttentionScoreV4(workspace, workspaceSize, executor, stream=None) -> int:
    """Phase 2: run the executor, writing attentionOut (and softmaxLse). Returns 0 (ACLNN_SUCCESS)."""
    return _execute("aclnnFusedInferAttentionScoreV4", workspace, workspaceSize, executor, stream)


# ------------------------------------------------------------------------------------------ IncreFlashAttentionV4
def aclnnIncreFlashAttentionV4GetWorkspaceSize(
        query, key, value, pseShift, attenMask, actualSeqLengths, dequantScale1, quantScale1, dequantScale2,
        quantScale2, quantOffset2, antiquantScale, antiquantOffset, blocktable, kvPaddingSize, numHeads,
        scaleValue, inputLayout, numKeyValueHeads, blockSize, innerPrecise,
        attentionOut) -> Tuple[int, AclOpExecutor]:
    """Phase 1 of IncreFlashAttentionV4 (decode, Q_S = 1; actualSeqLengths are the KV lengths).

    Returns (workspace_size, executor).
    """
    a = dict(locals())
    out = a.pop("attentionOut")
    return _plan("aclnnIncreFlashAttentionV4", a, out, None)


def aclnnIncreFlashAttentionV4(workspace, workspaceSize, executor, stream=None) -> int:
    """Phase 2: run the executor, writing attentionOut. Returns 0 (ACLNN_SUCCESS)."""
    return _execute("aclnnIncreFlashAttentionV4", workspace, workspaceSize, executor, stream)
