"""Graph mode (SPEC 1.3): the torch_npu functions as PyTorch custom operators.

Every public function has an operator in the ``fia`` namespace, with the keyword names, defaults and
return convention of torch_npu::

    torch.ops.fia.npu_fused_infer_attention_score(query, key, value, *, ...) -> (Tensor, Tensor)
    torch.ops.fia.npu_incre_flash_attention(query, key, value, *, ...)       -> Tensor
    torch.ops.fia.npu_prompt_flash_attention(query, key, value, *, ...)      -> Tensor

``.default`` takes ``key`` / ``value`` as tensors (dense or paged KV); the ``.kv_list`` overload takes
them as ``Tensor[]`` (tensor-list KV, SPEC 1.1). The schemas are generated from the signatures in
``fia.api`` (one source of truth): tensors become ``Tensor?``, the lengths lists ``int[]?``.

* The real kernel *is* the eager function (``fia.api``): same parse, same backend, same errors.
* The fake kernel runs the same parse layer on the fake (or meta) tensors and shapes the outputs with
  the same epilogue (``fia.finalize``) applied to empty canonical results, so shapes and dtypes cannot
  drift from eager. It never reads tensor data: the few arguments parse reads on the host (block ids,
  padding sizes, per-tensor int8 scales; ``_HOST_READ``) are replaced by zero-filled stand-ins of the
  same shape and dtype, which pass every metadata check and change no output shape.

Routing: ``fia.npu_fused_infer_attention_score`` & co. (the names exported by ``fia`` and
``fia.torch_npu``) are thin wrappers from this module. Eagerly they call ``fia.api`` directly -- no
dispatcher hop, identical behaviour and messages. While ``torch.compile`` traces
(``torch.compiler.is_compiling()``) they call the custom op instead, so Dynamo records a single graph
node and never traces the Python of the parse layer (``fullgraph=True`` works).

Inference-only, as on the NPU: no autograd formula is registered, so backward through a graph-mode
node is not supported (PyTorch warns that the op has no autograd kernel).

Under tracing the lengths lists must be Python ints (lists / tuples / NumPy arrays; a lengths *tensor*
would need a host read inside the graph and is rejected by the schema). An invalid call fails at trace
time: Dynamo wraps the FIA error in ``torch._dynamo.exc.TorchRuntimeError``, whose message contains
the FIA message.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable, Dict

import torch

from . import api, parse
from .backends.base import BackendResult
from .errors import FiaUnsupportedError
from .finalize import finalize

__all__ = ["npu_fused_infer_attention_score", "npu_incre_flash_attention", "npu_prompt_flash_attention",
           "OPS", "op_schema"]

NAMESPACE = "fia"

# keyword arguments that are host-side lists of ints (everything else defaulting to None is a tensor)
_INT_LISTS = frozenset({"actual_seq_lengths", "actual_seq_lengths_kv", "actual_shared_prefix_len"})

# arguments whose *values* parse reads on the host -> fill value of the stand-in used by the fake kernel
_HOST_READ = {"block_table": 0, "query_padding_size": 0, "kv_padding_size": 0, "dequant_scale1": 1,
              "quant_scale1": 1, "dequant_scale2": 1, "deq_scale1": 1, "deq_scale2": 1}


class _OpSpec:
    """One torch_npu function as a custom op: its eager function, its parse entry and its signature."""

    def __init__(self, fn: Callable, parser: Callable, returns_lse: bool):
        self.fn = fn
        self.name = fn.__name__
        self.parser = parser
        self.returns_lse = returns_lse
        sig = inspect.signature(fn)
        self.positional = [p.name for p in sig.parameters.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
        self.defaults = {p.name: p.default for p in sig.parameters.values() if p.kind == p.KEYWORD_ONLY}
        self.names = self.positional + list(self.defaults)      # the schema's argument order

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"

    def bind(self, args: tuple, kwargs: dict) -> dict:
        """Dispatcher call -> the full argument dict of the eager function (defaults filled in)."""
        a = dict(self.defaults)
        a.update(zip(self.names, args))
        a.update(kwargs)
        return a


def _schema_type(name: str, default) -> str:
    if default is None:
        return "int[]?" if name in _INT_LISTS else "Tensor?"
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int):
        return "int"
    if isinstance(default, float):
        return "float"
    if isinstance(default, str):
        return "str"
    raise TypeError(f"no schema type for {name}={default!r}")  # pragma: no cover - a new kind of default


def _schema_default(default) -> str:
    if default is None:
        return "None"
    if isinstance(default, bool):
        return "True" if default else "False"
    if isinstance(default, str):
        return '"' + default + '"'
    return repr(default)


def op_schema(spec: _OpSpec, kv_list: bool) -> str:
    """The operator schema (without the namespace), e.g. ``name.kv_list(Tensor query, Tensor[] key, ...)``."""
    kv = "Tensor[]" if kv_list else "Tensor"
    pos = [f"Tensor {spec.positional[0]}"] + [f"{kv} {n}" for n in spec.positional[1:]]
    kw = [f"{_schema_type(n, d)} {n}={_schema_default(d)}" for n, d in spec.defaults.items()]
    ret = "(Tensor, Tensor)" if spec.returns_lse else "Tensor"
    name = spec.name + (".kv_list" if kv_list else "")
    return f"{name}({', '.join(pos)}, *, {', '.join(kw)}) -> {ret}"


# ---------------------------------------------------------------------------------------------- kernels
def _real_kernel(spec: _OpSpec):
    def kernel(*args, **kwargs):
        a = spec.bind(args, kwargs)
        return spec.fn(**a)
    return kernel


def _unset_fake():
    """Context manager suspending an active FakeTensorMode (a no-op context when there is none)."""
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # pragma: no cover - older torch
        import contextlib
        return contextlib.nullcontext()
    return unset_fake_temporarily()


def _stand_in(t, fill):
    """A real CPU tensor with t's shape and dtype (created outside fake mode), or t itself if not a tensor."""
    if not isinstance(t, torch.Tensor):
        return t
    return torch.full(tuple(int(s) for s in t.shape), fill, dtype=t.dtype)


def _fake_kernel(spec: _OpSpec):
    def kernel(*args, **kwargs):
        a = spec.bind(args, kwargs)
        with _unset_fake():
            for name, fill in _HOST_READ.items():
                if a.get(name) is not None:
                    a[name] = _stand_in(a[name], fill)
            try:
                problem = spec.parser(a)
            except RuntimeError as e:   # DataDependentOutputException & co: a host read parse does not declare
                if "data-dependent" in str(e).lower() or "DataDependent" in type(e).__name__:
                    raise FiaUnsupportedError(
                        f"{spec.name}: graph mode cannot trace an argument whose values are read on the host "
                        f"({e}); call it eagerly", {}) from e
                raise
        q = problem.query
        out = q.new_empty(problem.out_shape(), dtype=problem.compute_dtype)
        lse = q.new_empty(problem.lse_shape(), dtype=torch.float32) if problem.want_lse else None
        out, lse = finalize(problem, BackendResult(out, lse))
        return (out, lse) if spec.returns_lse else out
    return kernel


# ---------------------------------------------------------------------------------------------- registry
OPS: Dict[str, _OpSpec] = {s.name: s for s in (
    _OpSpec(api.npu_fused_infer_attention_score,
            lambda a: parse.parse_fused(a, api="npu_fused_infer_attention_score"), True),
    _OpSpec(api.npu_incre_flash_attention, parse.parse_incre, False),
    _OpSpec(api.npu_prompt_flash_attention, parse.parse_prompt, False),
)}

_LIB = torch.library.Library(NAMESPACE, "DEF")
for _spec in OPS.values():
    for _kv_list in (False, True):
        _LIB.define(op_schema(_spec, _kv_list))
        _overload = _spec.name + (".kv_list" if _kv_list else "")
        _LIB.impl(_overload, _real_kernel(_spec), "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{_overload}", _fake_kernel(_spec), lib=_LIB)


def op(name: str, kv_list: bool = False):
    """The OpOverload of a function: ``op("npu_incre_flash_attention")`` -> torch.ops.fia.....default."""
    packet = getattr(getattr(torch.ops, NAMESPACE), name)
    return packet.kv_list if kv_list else packet.default


# ---------------------------------------------------------------------------------------------- routing
def _host_ints(v):
    """Lengths for the op schema: tuples / NumPy arrays -> list of ints (a tensor stays: eager only)."""
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v]
    if hasattr(v, "tolist") and not isinstance(v, torch.Tensor):      # NumPy array
        return [int(x) for x in v.tolist()]
    return v


def _traced_call(spec: _OpSpec, query, key, value, kwargs: dict):
    kw = {k: (_host_ints(v) if k in _INT_LISTS and v is not None else v) for k, v in kwargs.items()}
    if isinstance(key, (list, tuple)) and isinstance(value, (list, tuple)):
        return op(spec.name, kv_list=True)(query, list(key), list(value), **kw)
    return op(spec.name)(query, key, value, **kw)


def _routed(spec: _OpSpec):
    fn = spec.fn

    @functools.wraps(fn)
    def wrapper(query, key, value, **kwargs):
        if torch.compiler.is_compiling():
            return _traced_call(spec, query, key, value, kwargs)
        return fn(query, key, value, **kwargs)
    return wrapper


npu_fused_infer_attention_score = _routed(OPS["npu_fused_infer_attention_score"])
npu_incre_flash_attention = _routed(OPS["npu_incre_flash_attention"])
npu_prompt_flash_attention = _routed(OPS["npu_prompt_flash_attention"])
