"""Graph mode (SPEC 1.3): the torch_npu functions as PyTorch custom operators.

Every public function has an operator in the ``fia`` namespace, with the keyword names, defaults and
return convention of torch_npu::

    torch.ops.fia.npu_fused_infer_attention_score(query, key, value, *, ...)    -> (Tensor, Tensor)
    torch.ops.fia.npu_fused_infer_attention_score_v2(query, key, value, *, ...) -> (Tensor, Tensor)
    torch.ops.fia.npu_incre_flash_attention(query, key, value, *, ...)          -> Tensor
    torch.ops.fia.npu_prompt_flash_attention(query, key, value, *, ...)         -> Tensor
    torch.ops.fia._npu_fused_infer_attention_score[_v2]_get_max_workspace(query, key, value, *, ...) -> Tensor
    torch.ops.fia.npu_fused_infer_attention_score[_v2].out(query, key, value, *, ..., Tensor? workspace=None,
        Tensor(a!) attention_out, Tensor(b!) softmax_lse) -> (Tensor(a!), Tensor(b!))
    torch.ops.fia.npu_attention_update(Tensor[] lse, Tensor[] local_out, int update_type=0) -> (Tensor, Tensor?)

``.default`` takes ``key`` / ``value`` as tensors (dense or paged KV); the ``.kv_list`` overload takes
them as ``Tensor[]`` (tensor-list KV, SPEC 1.1). The schemas are generated from the signatures in
``fia.api`` (one source of truth): tensors become ``Tensor?``, the lengths lists ``SymInt[]?`` (so that
``torch.compile`` keeps a decode loop's changing lengths symbolic instead of recompiling for each step).

The ``.out`` overloads have torch_npu's schema (mutated outputs returned as aliases). PyTorch cannot
functionalize a custom op whose outputs alias its inputs, so ``.out`` is not a kernel of its own: it is a
``CompositeImplicitAutograd`` decomposition into the functional op (whose fake kernel gives the expected
output metadata) + a check of the caller's tensors + ``copy_`` -- which ``torch.compile`` turns into an
ordinary input mutation. Called eagerly on plain tensors it is the eager ``.out`` (check before compute).
``npu_attention_update``'s fake kernel is the function itself: it only does tensor arithmetic, which fake
tensors carry out on metadata.

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
node and never traces the Python of the parse layer (``fullgraph=True`` works). They call it as well
whenever FIA's kernels must not run on the call's tensors (`_graph_call`): a Python dispatch mode is active
(FakeTensorMode, ``make_fx`` in any tracing mode, functionalization), ``torch.jit.trace`` records (the
Numba kernels are invisible to it: the trace gets one op node that replays the real kernel), the query is
a meta tensor, or a tensor is a subclass (FakeTensor, FunctionalTensor, ...). On plain tensors that check
costs ~0.1-0.3 us a call (two C calls once the replay key has vouched for the tensors).

Inference-only, as on the NPU: no autograd formula is registered, so backward through a graph-mode
node is not supported (PyTorch warns that the op has no autograd kernel).

Under torch.compile the lengths lists must be Python ints (lists / tuples / NumPy arrays; a lengths
*tensor* would need a host read inside the graph and is rejected by the schema). Dynamo makes the entries
of a list that changes between calls symbolic after its first recompile; the fake kernel parses their
example values (`_hinted`: output shapes never depend on the lengths), so a decode loop compiles twice (a
static graph, then one with symbolic lengths), and each call's real kernel validates its own lengths (an
out-of-range entry raises FIA's error when the graph runs). Outside torch.compile (jit.trace, make_fx,
FakeTensorMode) a lengths tensor holding real values is read and recorded as constants (with a
TracerWarning under jit.trace); a fake or meta one is an input error. An invalid call otherwise fails at
trace time: Dynamo wraps the FIA error in ``torch._dynamo.exc.TorchRuntimeError``, whose message contains
the FIA message.
"""
from __future__ import annotations

import functools
import inspect
import operator
import warnings
from typing import Callable, Dict, Optional

import torch

from . import api, parse, replay
from .backends.base import BackendResult
from .errors import FiaUnsupportedError, input_error
from .finalize import check_output, finalize
from .outvariants import caller_outputs, empty_workspace

__all__ = ["npu_fused_infer_attention_score", "npu_incre_flash_attention", "npu_prompt_flash_attention",
           "npu_fused_infer_attention_score_v2", "npu_attention_update",
           "_npu_fused_infer_attention_score_get_max_workspace",
           "_npu_fused_infer_attention_score_v2_get_max_workspace", "OPS", "op_schema", "op_out_schema"]

NAMESPACE = "fia"

# keyword arguments that are host-side lists of ints (everything else defaulting to None is a tensor)
_INT_LISTS = frozenset({"actual_seq_lengths", "actual_seq_lengths_kv", "actual_shared_prefix_len",
                        "actual_seq_qlen", "actual_seq_kvlen"})
# v2's reserved dtype arguments: torch_npu declares them int? (a dtype enum); only None is accepted
_OPT_INTS = frozenset({"query_dtype", "key_dtype", "value_dtype", "query_rope_dtype", "key_rope_dtype",
                       "key_shared_prefix_dtype", "value_shared_prefix_dtype", "dequant_scale_query_dtype",
                       "dequant_scale_key_dtype", "dequant_scale_value_dtype", "dequant_scale_key_rope_dtype"})

# arguments whose *values* parse reads on the host -> fill value of the stand-in used by the fake kernel
_HOST_READ = {"block_table": 0, "query_padding_size": 0, "kv_padding_size": 0, "dequant_scale1": 1,
              "quant_scale1": 1, "dequant_scale2": 1, "deq_scale1": 1, "deq_scale2": 1}


class _OpSpec:
    """One torch_npu function as a custom op: its eager function, its parse entry and its signature.

    `returns` is the schema's return type; `results(problem)` builds the (fake) outputs from the parsed
    problem; `lse_flag` names the lse keyword of a function that also gets a ``.out`` overload."""

    def __init__(self, fn: Callable, parser: Callable, returns: str, results: Callable, lse_flag: str = ""):
        self.fn = fn
        self.name = fn.__name__
        self.parser = parser
        self.returns = returns
        self.results = results
        self.lse_flag = lse_flag
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
        return "SymInt[]?" if name in _INT_LISTS else "int?" if name in _OPT_INTS else "Tensor?"
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


def _schema_arguments(spec: _OpSpec, kv_list: bool) -> list:
    kv = "Tensor[]" if kv_list else "Tensor"
    pos = [f"Tensor {spec.positional[0]}"] + [f"{kv} {n}" for n in spec.positional[1:]]
    kw = [f"{_schema_type(n, d)} {n}={_schema_default(d)}" for n, d in spec.defaults.items()]
    return pos + ["*"] + kw


def op_schema(spec: _OpSpec, kv_list: bool) -> str:
    """The operator schema (without the namespace), e.g. ``name.kv_list(Tensor query, Tensor[] key, ...)``."""
    name = spec.name + (".kv_list" if kv_list else "")
    return f"{name}({', '.join(_schema_arguments(spec, kv_list))}) -> {spec.returns}"


def op_out_schema(spec: _OpSpec) -> str:
    """torch_npu's ``.out`` schema: the functional arguments, then the workspace and the mutated outputs."""
    args = _schema_arguments(spec, False) + ["Tensor? workspace=None", "Tensor(a!) attention_out",
                                             "Tensor(b!) softmax_lse"]
    return f"{spec.name}.out({', '.join(args)}) -> (Tensor(a!), Tensor(b!))"


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


def _hinted(name: str, v):
    """A lengths list with its symbolic entries (torch.compile's dynamic ints) replaced by their example values,
    read without a guard: output shapes never depend on the lengths (they only bound the windows), so parse
    checks the example and the real kernel checks every call's values."""
    if not isinstance(v, (list, tuple)) or all(type(x) is int for x in v):
        return v
    out = []
    for x in v:
        if isinstance(x, torch.SymInt):
            if not x.node.has_hint():             # unbacked: computed from tensor data in the graph
                raise FiaUnsupportedError(f"{name}: graph mode needs lengths known when the graph is built (a "
                                          f"list of ints, or ints torch.compile made symbolic); received {v}, "
                                          "computed from tensor data inside the graph", {})
            x = int(x.node.hint)
        out.append(x)
    return out


def _fake_kernel(spec: _OpSpec):
    def kernel(*args, **kwargs):
        a = spec.bind(args, kwargs)
        for name in _INT_LISTS.intersection(a):
            a[name] = _hinted(name, a[name])
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
        return spec.results(problem)
    return kernel


def _attention_results(returns_lse: bool, post: Callable = None) -> Callable:
    """Fake outputs of an attention function: the epilogue applied to empty canonical results, then the
    function's own return convention (`post`, e.g. v2's (1,) lse)."""
    def results(problem):
        q = problem.query
        out = q.new_empty(problem.out_shape(), dtype=problem.compute_dtype)
        lse = q.new_empty(problem.lse_shape(), dtype=torch.float32) if problem.want_lse else None
        out, lse = finalize(problem, BackendResult(out, lse))
        if post is not None:
            out, lse = post(problem, out, lse)
        return (out, lse) if returns_lse else out
    return results


def _workspace_result(problem):
    return empty_workspace(problem.query)


def _plain_eager(tensors) -> bool:
    """Real tensors outside any tracing (no dispatch mode, no tensor subclass, not meta)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    return _get_current_dispatch_mode() is None and all(
        type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type != "meta" for t in tensors)


def _tensors(values) -> list:
    flat = []
    for v in values:
        if isinstance(v, torch.Tensor):
            flat.append(v)
        elif isinstance(v, (list, tuple)):
            flat.extend(t for t in v if isinstance(t, torch.Tensor))
    return flat


def _out_kernel(spec: _OpSpec):
    """CompositeImplicitAutograd kernel of ``.out`` (see the module docstring for why it decomposes)."""
    def kernel(*args, workspace=None, attention_out, softmax_lse, **kwargs):
        a = spec.bind(args, kwargs)
        if _plain_eager(_tensors([*a.values(), workspace, attention_out, softmax_lse])):
            # eager dispatcher call: the eager .out checks the caller's tensors before computing anything
            return spec.fn.out(**a, workspace=workspace, attention_out=attention_out, softmax_lse=softmax_lse)
        out, lse = op(spec.name)(*args, **kwargs)           # traced: one functional node, no data touched
        want_lse = bool(a[spec.lse_flag])
        check_output("attention_out", attention_out, tuple(out.shape), out.dtype, out.device)
        if want_lse:
            check_output("softmax_lse", softmax_lse, tuple(lse.shape), lse.dtype, lse.device,
                         f" ({spec.lse_flag} is true)")
        with torch.no_grad():         # as the eager write: an inference op records no autograd history
            attention_out.copy_(out)
            if want_lse:
                softmax_lse.copy_(lse)
        return attention_out, softmax_lse
    return kernel


# ---------------------------------------------------------------------------------------------- registry
_PAIR = "(Tensor, Tensor)"
OPS: Dict[str, _OpSpec] = {s.name: s for s in (
    _OpSpec(api.npu_fused_infer_attention_score, api.fused_problem, _PAIR, _attention_results(True),
            lse_flag="softmax_lse_flag"),
    _OpSpec(api.npu_incre_flash_attention, parse.parse_incre, "Tensor", _attention_results(False)),
    _OpSpec(api.npu_prompt_flash_attention, parse.parse_prompt, "Tensor", _attention_results(False)),
    _OpSpec(api.npu_fused_infer_attention_score_v2, api.v2_problem, _PAIR,
            _attention_results(True, api.v2_results), lse_flag="return_softmax_lse"),
    _OpSpec(api._npu_fused_infer_attention_score_get_max_workspace, api.fused_problem, "Tensor",
            _workspace_result),
    _OpSpec(api._npu_fused_infer_attention_score_v2_get_max_workspace, api.v2_problem, "Tensor",
            _workspace_result),
)}

_LIB = torch.library.Library(NAMESPACE, "DEF")
for _spec in OPS.values():
    for _kv_list in (False, True):
        _LIB.define(op_schema(_spec, _kv_list))
        _overload = _spec.name + (".kv_list" if _kv_list else "")
        _LIB.impl(_overload, _real_kernel(_spec), "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{_overload}", _fake_kernel(_spec), lib=_LIB)
    if _spec.lse_flag:
        _LIB.define(op_out_schema(_spec))
        _LIB.impl(_spec.name + ".out", _out_kernel(_spec), "CompositeImplicitAutograd")

_LIB.define("npu_attention_update(Tensor[] lse, Tensor[] local_out, int update_type=0) -> (Tensor, Tensor?)")
_LIB.impl("npu_attention_update", api.npu_attention_update, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NAMESPACE}::npu_attention_update", api.npu_attention_update, lib=_LIB)


def op(name: str, kv_list: bool = False, out: bool = False):
    """The OpOverload of a function: ``op("npu_incre_flash_attention")`` -> torch.ops.fia.....default."""
    packet = getattr(getattr(torch.ops, NAMESPACE), name)
    return packet.out if out else packet.kv_list if kv_list else packet.default


# ---------------------------------------------------------------------------------------------- routing
_dispatch_modes = torch._C._len_torch_dispatch_stack      # () -> active Python dispatch modes
_jit_tracing = torch._C._is_tracing                        # torch.jit.is_tracing() without its Python frame
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
    it stays (the schema rejects it: a host read inside the graph); elsewhere (FakeTensorMode, make_fx,
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


def _traced_call(spec: _OpSpec, query, key, value, kwargs: dict, out: bool = False, outside_compile: bool = False):
    kw = {k: (_host_ints(k, v, outside_compile) if k in _INT_LISTS and v is not None else v)
          for k, v in kwargs.items()}
    if isinstance(key, (list, tuple)) and isinstance(value, (list, tuple)):
        if out:
            raise FiaUnsupportedError(f"{spec.name}.out: graph mode has no .out overload for tensor-list "
                                      "key/value; call the functional form", {})
        return op(spec.name, kv_list=True)(query, list(key), list(value), **kw)
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


def _routed(spec: _OpSpec, pair: Optional[bool] = None):
    """The public function of spec: the custom op while torch.compile traces (or `_graph_call`), else the eager
    function. With `pair` set (the attention entry points: True returns (out, lse), False out alone), repeated
    eager calls replay their backend's prepared launch (fia.replay)."""
    fn = spec.fn
    name = spec.name

    @functools.wraps(fn)
    def wrapper(query, key, value, **kwargs):
        if torch.compiler.is_compiling():
            return _traced_call(spec, query, key, value, kwargs)
        # a replay key means plain CPU tensors only: then only modes and jit tracing are left to rule out (~90 ns)
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


def _routed_out(spec: _OpSpec):
    eager = spec.fn.out

    @functools.wraps(eager)
    def out_fn(query, key, value, *, workspace=None, out=None, attention_out=None, softmax_lse=None, **kwargs):
        compiling = torch.compiler.is_compiling()
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


npu_fused_infer_attention_score = _routed(OPS["npu_fused_infer_attention_score"], pair=True)
npu_incre_flash_attention = _routed(OPS["npu_incre_flash_attention"], pair=False)
npu_prompt_flash_attention = _routed(OPS["npu_prompt_flash_attention"], pair=False)
npu_fused_infer_attention_score_v2 = _routed(OPS["npu_fused_infer_attention_score_v2"])
_npu_fused_infer_attention_score_get_max_workspace = _routed(OPS["_npu_fused_infer_attention_score_get_max_workspace"])
_npu_fused_infer_attention_score_v2_get_max_workspace = _routed(
    OPS["_npu_fused_infer_attention_score_v2_get_max_workspace"])
npu_attention_update = _routed_update(api.npu_attention_update)
# functools.wraps copied the eager .out attribute; the public one routes too
npu_fused_infer_attention_score.out = _routed_out(OPS["npu_fused_infer_attention_score"])
npu_fused_infer_attention_score_v2.out = _routed_out(OPS["npu_fused_infer_attention_score_v2"])
