"""The public functions: each routes a call to the eager implementation (`fia.eager`), to a replay of the
previous identical call's prepared launch (`fia.replay`), or to its graph-mode custom op (`fia.graph`).

Routing: ``fia.npu_fused_infer_attention_score`` & co. (the names exported by ``fia`` and
``fia.torch_npu``) are thin wrappers from this module. Eagerly they call ``fia.eager`` directly -- no
dispatcher hop, identical behaviour and messages. While ``torch.compile`` traces
(``torch.compiler.is_compiling()``) they call the custom op instead, so Dynamo records a single graph
node and never traces the Python of the parse layer (``fullgraph=True`` works). They call it as well
whenever FIA's kernels must not run on the call's tensors (`_graph_call`): a Python dispatch mode is active
(FakeTensorMode, ``make_fx`` in any tracing mode, functionalization), ``torch.jit.trace`` records (the
Numba kernels are invisible to it: the trace gets one op node that replays the real kernel), the query is
a meta tensor, or a tensor is a subclass (FakeTensor, FunctionalTensor, ...). On plain tensors that check
costs ~0.1-0.3 us a call (two C calls once the replay key has vouched for the tensors).
"""
from __future__ import annotations

import functools
import inspect
import operator
import warnings
from typing import Optional

import torch

from . import eager, replay
from .errors import FiaUnsupportedError, input_error
from .graph import INT_LISTS, OPS, OpSpec, op
from .outvariants import caller_outputs
from .parse.entries import unknown_keyword
from .parse.outputs import DTYPE_NUMBERS

__all__ = ["npu_fused_infer_attention_score", "npu_incre_flash_attention", "npu_prompt_flash_attention",
           "npu_fused_infer_attention_score_v2", "npu_attention_update",
           "_npu_fused_infer_attention_score_get_max_workspace",
           "_npu_fused_infer_attention_score_v2_get_max_workspace",
           "_npu_fused_infer_attention_score_infer_output", "_npu_fused_infer_attention_score_v2_infer_output"]

_dispatch_modes, _jit_tracing = replay.dispatch_modes, replay.jit_tracing     # (one definition: fia.replay's)
_Tensor = torch.Tensor
_PLAIN = (_Tensor, torch.nn.Parameter)
_SCALARS = frozenset({type(None), bool, int, float, str})


def _host_int(x):
    """One lengths entry for the op schema: ints and torch.compile's symbolic ints as they are (int() would
    specialize the graph on each step's lengths: a recompile per decode step), NumPy integers as ints; anything
    else is left for the schema to reject, naming the argument."""
    if type(x) is int or isinstance(x, torch.SymInt):
        return x
    try:
        return operator.index(x)
    except TypeError:
        return x


def _host_ints(name: str, v, outside_compile: bool):
    """Lengths for the op schema: lists / tuples / NumPy arrays -> lists of ints. A tensor: under torch.compile
    it stays (the op's tensor_lengths overload reads it when the graph runs); elsewhere (FakeTensorMode, make_fx,
    torch.jit.trace) its values are read if it has any, and recorded as constants like every other int."""
    if isinstance(v, (list, tuple)):
        return [_host_int(x) for x in v]
    if isinstance(v, torch.Tensor):
        return _tensor_lengths(name, v) if outside_compile else v
    if hasattr(v, "tolist"):                                           # NumPy array
        return [_host_int(x) for x in v.tolist()]
    return v


def _tensor_lengths(name: str, t: torch.Tensor) -> list:
    """A lengths tensor in a traced call outside torch.compile -> its values (a list of ints)."""
    if type(t) not in _PLAIN or t.is_meta or not t.is_cpu:
        raise input_error(name, "a list of ints, or a CPU tensor holding real values, when the call is traced or "
                          "run on fake / meta tensors (the lengths are host values)",
                          f"a {type(t).__name__} on {t.device.type}")
    if t.dtype not in (torch.int32, torch.int64) or t.dim() > 1:
        raise input_error(name, "a 1-D int32/int64 tensor or a list of ints",
                          f"a {str(t.dtype).replace('torch.', '')} tensor of shape {tuple(t.shape)}")
    if _jit_tracing():
        warnings.warn(f"{name}: the lengths tensor's values are recorded in the trace as constants; a call with "
                      "other lengths replays these", torch.jit.TracerWarning, stacklevel=4)
    with warnings.catch_warnings():                     # (the tracer's own, unnamed warning: the one above says it)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return [int(x) for x in t.detach().numpy().tolist()]


def _schema_dtype(kw: dict) -> dict:
    """out_dtype given as a torch.dtype -> torch_npu's dtype number (the schema's `int?`)."""
    v = kw.get("out_dtype")
    if isinstance(v, torch.dtype) and v in DTYPE_NUMBERS:
        kw["out_dtype"] = DTYPE_NUMBERS[v]
    return kw


def _traced_call(spec: OpSpec, query, key, value, kwargs: dict, out: bool = False, outside_compile: bool = False):
    kw = _schema_dtype({k: (_host_ints(k, v, outside_compile) if k in INT_LISTS and v is not None else v)
                        for k, v in kwargs.items()})
    if isinstance(key, (list, tuple)) and isinstance(value, (list, tuple)):
        if out:
            raise FiaUnsupportedError(f"{spec.name}.out: graph mode has no .out overload for tensor-list "
                                      "key/value; call the functional form", {})
        return op(spec.name, kv_list=True)(query, list(key), list(value), **kw)
    if not outside_compile and not out and any(isinstance(kw.get(n), _Tensor) for n in INT_LISTS):
        # lengths as int tensors inside torch.compile: read by the real kernel when the graph runs (validated there),
        # never by the trace, so a decode loop's new lengths neither break the graph nor recompile it
        return op(spec.name, tensor_lengths=True)(query, key, value, **kw)
    return op(spec.name, out=out)(query, key, value, **kw)


def _graph_call(query, key, value, kwargs: dict) -> bool:
    """Whether a call outside torch.compile must take the custom op (its fake kernel, or a tracer's record of
    it; never FIA's kernels on these tensors): a dispatch mode is active (FakeTensorMode, make_fx,
    functionalization), torch.jit.trace records, the query is a meta tensor (a shape-only call), or a tensor is
    not a plain tensor (FakeTensor, FunctionalTensor, any other subclass). A meta tensor beside a real query is
    the eager call's device error."""
    if _dispatch_modes() or _jit_tracing():
        return True
    if isinstance(query, _Tensor) and query.is_meta:
        return True
    if type(query) is _Tensor and type(key) is _Tensor and type(value) is _Tensor and \
            _SCALARS.issuperset(map(type, kwargs.values())):
        return False                                        # the common call: no other tensor
    for x in (query, key, value, *kwargs.values()):
        t = type(x)
        if t in _SCALARS or t is _Tensor:
            continue
        if t is list or t is tuple:                         # tensor-list KV, lengths
            for y in x:
                if isinstance(y, _Tensor) and type(y) not in _PLAIN:
                    return True
        elif isinstance(x, _Tensor) and t not in _PLAIN:
            return True
    return False


def _keywords(fn) -> frozenset:
    """The keyword arguments fn (an eager entry point) takes by name."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(n for n, p in inspect.signature(fn).parameters.items() if p.kind in kinds)


def _check_keywords(name: str, known: frozenset, kwargs: dict) -> None:
    """FIA's input error for a keyword the entry point does not take -- the same on every path (eager, meta /
    fake tensors, tracing), before any of them looks at the call."""
    for k in kwargs:
        if k not in known:
            raise unknown_keyword(name, k, sorted(known))


def _routed(fn, pair: Optional[bool] = None):
    """The public function of the eager implementation `fn` (fia.eager): its custom op (fia.graph.OPS, by name)
    while torch.compile traces (or `_graph_call`), else `fn` itself. With `pair` set (the attention entry points:
    True returns (out, lse), False out alone), repeated eager calls replay their backend's prepared launch
    (fia.replay)."""
    name = fn.__name__
    spec = OPS[name]
    known = _keywords(fn)

    @functools.wraps(fn)
    def wrapper(query, key, value, **kwargs):
        if torch.compiler.is_compiling():         # (an unknown keyword: the op schema's error; Dynamo cannot
            return _traced_call(spec, query, key, value, kwargs)     # build FIA's)
        if not known.issuperset(kwargs):
            _check_keywords(name, known, kwargs)
        # a replay key means plain CPU tensors only: then only modes and jit tracing are left to rule out, which is
        # cheap (docs/performance.md, "Kernel choices: the measurements")
        rk = replay.key_of(name, query, key, value, kwargs) if pair is not None else None
        if rk is None:
            if _graph_call(query, key, value, kwargs):
                return _traced_call(spec, query, key, value, kwargs, outside_compile=True)
            return fn(query, key, value, **kwargs)
        if _dispatch_modes() or _jit_tracing():
            return _traced_call(spec, query, key, value, kwargs, outside_compile=True)
        res = replay.run(rk, query, key, value, kwargs)
        if res is not None:
            return res if pair else res[0]
        res, ran = replay.capture(fn, query, key, value, **kwargs)
        replay.admit(rk, ran, query, key, value, res if pair else (res,), kwargs)
        return res
    return wrapper


def _routed_out(fn):
    """The public `.out` variant of the eager implementation `fn`: its custom op's out overload while tracing."""
    spec = OPS[fn.__name__]
    eager = fn.out
    known = _keywords(fn)

    @functools.wraps(eager)
    def out_fn(query, key, value, *, workspace=None, out=None, attention_out=None, softmax_lse=None, **kwargs):
        compiling = torch.compiler.is_compiling()
        if not compiling and not known.issuperset(kwargs):
            _check_keywords(fn.__name__, known, kwargs)
        # (the inputs decide: a caller's output on the wrong device is the eager .out's input error)
        if compiling or _graph_call(query, key, value, kwargs):
            a, lse, _ = caller_outputs(out, attention_out, softmax_lse)
            _traced_call(spec, query, key, value, dict(kwargs, workspace=workspace, attention_out=a,
                                                       softmax_lse=lse), out=True, outside_compile=not compiling)
            return a, lse             # the caller's own tensors (the op mutated them)
        return eager(query, key, value, workspace=workspace, out=out, attention_out=attention_out,
                     softmax_lse=softmax_lse, **kwargs)
    return out_fn


def _routed_update(fn):
    @functools.wraps(fn)
    def wrapper(lse, local_out, update_type=0):
        if torch.compiler.is_compiling() and isinstance(lse, (list, tuple)) and isinstance(local_out, (list, tuple)):
            return torch.ops.fia.npu_attention_update(list(lse), list(local_out), update_type)
        return fn(lse, local_out, update_type)
    return wrapper


# public function = route(eager implementation): fia.eager runs the call (parse -> backend -> finalize)
npu_fused_infer_attention_score = _routed(eager.npu_fused_infer_attention_score, pair=True)
npu_incre_flash_attention = _routed(eager.npu_incre_flash_attention, pair=False)
npu_prompt_flash_attention = _routed(eager.npu_prompt_flash_attention, pair=False)
npu_fused_infer_attention_score_v2 = _routed(eager.npu_fused_infer_attention_score_v2)
_npu_fused_infer_attention_score_get_max_workspace = _routed(eager._npu_fused_infer_attention_score_get_max_workspace)
_npu_fused_infer_attention_score_v2_get_max_workspace = _routed(
    eager._npu_fused_infer_attention_score_v2_get_max_workspace)
npu_attention_update = _routed_update(eager.npu_attention_update)


def _routed_infer_output(fn):
    """An `_infer_output` helper: its custom op while tracing (one graph node), else the eager function."""
    @functools.wraps(fn)
    def wrapper(query, value, **kwargs):
        if torch.compiler.is_compiling() or _dispatch_modes() or _jit_tracing():
            return getattr(torch.ops.fia, fn.__name__).default(query, value, **_schema_dtype(dict(kwargs)))
        return fn(query, value, **kwargs)
    return wrapper


_npu_fused_infer_attention_score_infer_output = _routed_infer_output(eager._npu_fused_infer_attention_score_infer_output)
_npu_fused_infer_attention_score_v2_infer_output = _routed_infer_output(
    eager._npu_fused_infer_attention_score_v2_infer_output)
# functools.wraps copied the eager .out attribute; the public one routes too
npu_fused_infer_attention_score.out = _routed_out(eager.npu_fused_infer_attention_score)
npu_fused_infer_attention_score_v2.out = _routed_out(eager.npu_fused_infer_attention_score_v2)
