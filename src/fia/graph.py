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
    torch.ops.fia._npu_fused_infer_attention_score[_v2]_infer_output(query, value, *, ...) -> (Tensor, Tensor)

``.default`` takes ``key`` / ``value`` as tensors (dense or paged KV); the ``.kv_list`` overload takes
them as ``Tensor[]`` (tensor-list KV, SPEC 1.1). The schemas are generated from the signatures in
``fia.eager`` (one source of truth): tensors become ``Tensor?``, the lengths lists ``SymInt[]?`` (so that
``torch.compile`` keeps a decode loop's changing lengths symbolic instead of recompiling for each step).

The ``.out`` overloads have torch_npu's schema (mutated outputs returned as aliases). PyTorch cannot
functionalize a custom op whose outputs alias its inputs, so ``.out`` is not a kernel of its own: it is a
``CompositeImplicitAutograd`` decomposition into the functional op (whose fake kernel gives the expected
output metadata) + a check of the caller's tensors + ``copy_`` -- which ``torch.compile`` turns into an
ordinary input mutation. Called eagerly on plain tensors it is the eager ``.out`` (check before compute).
``npu_attention_update``'s fake kernel is the function itself: it only does tensor arithmetic, which fake
tensors carry out on metadata.

* The real kernel *is* the eager function (``fia.eager``): same parse, same backend, same errors.
* The fake kernel runs the same parse layer on the fake (or meta) tensors and shapes the outputs with
  the same epilogue (``fia.finalize``) applied to empty canonical results, so shapes and dtypes cannot
  drift from eager. It never reads tensor data: the few arguments parse reads on the host (block ids,
  padding sizes, per-tensor int8 scales; ``_HOST_READ``) are replaced by zero-filled stand-ins of the
  same shape and dtype, which pass every metadata check and change no output shape.

Inference-only, as on the NPU: no autograd formula is registered, so backward through a graph-mode
node is not supported (PyTorch warns that the op has no autograd kernel).

Under torch.compile the lengths may be int tensors: the call then takes the ``.tensor_lengths`` overload
(lengths typed ``Tensor?``), whose fake kernel parses the call with stand-ins (output shapes never depend on
them: none, or for the packed TND layouts an even share per batch) and whose real kernel reads and validates
them when the graph runs -- no graph break, no recompile when they change (DECISIONS 53). Lengths lists
(lists / tuples / NumPy arrays of ints) take the other overloads: Dynamo makes the entries
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

import inspect
from typing import Callable, Dict

import torch

from . import eager, parse
from .backends.base import BackendResult
from .errors import FiaUnsupportedError
from .finalize import check_output, finalize
from .outvariants import empty_workspace

__all__ = ["OPS", "NAMESPACE", "INT_LISTS", "INFER_OUTPUT", "OpSpec", "op", "op_schema", "op_out_schema",
           "plain_op_schema"]

NAMESPACE = "fia"

# keyword arguments that are host-side lists of ints (everything else defaulting to None is a tensor)
INT_LISTS = frozenset({"actual_seq_lengths", "actual_seq_lengths_kv", "actual_shared_prefix_len",
                        "actual_seq_qlen", "actual_seq_kvlen"})
# v2's reserved dtype arguments: torch_npu declares them int? (a dtype enum); only None is accepted
_OPT_INTS = frozenset({"query_dtype", "key_dtype", "value_dtype", "query_rope_dtype", "key_rope_dtype",
                       "key_shared_prefix_dtype", "value_shared_prefix_dtype", "dequant_scale_query_dtype",
                       "dequant_scale_key_dtype", "dequant_scale_value_dtype", "dequant_scale_key_rope_dtype",
                       "out_dtype"})

# arguments whose *values* parse reads on the host -> fill value of the stand-in used by the fake kernel
_HOST_READ = {"block_table": 0, "query_padding_size": 0, "kv_padding_size": 0, "dequant_scale1": 1,
              "quant_scale1": 1, "dequant_scale2": 1, "deq_scale1": 1, "deq_scale2": 1}


class OpSpec:
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


def _schema_type(name: str, default, tensor_lengths: bool = False) -> str:
    if default is None:
        if name in INT_LISTS:
            return "Tensor?" if tensor_lengths else "SymInt[]?"
        return "int?" if name in _OPT_INTS else "Tensor?"
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


def _schema_arguments(spec: OpSpec, kv_list: bool, tensor_lengths: bool = False) -> list:
    kv = "Tensor[]" if kv_list else "Tensor"
    pos = [f"Tensor {spec.positional[0]}"] + [f"{kv} {n}" for n in spec.positional[1:]]
    kw = [f"{_schema_type(n, d, tensor_lengths)} {n}={_schema_default(d)}" for n, d in spec.defaults.items()]
    return pos + ["*"] + kw


def op_schema(spec: OpSpec, kv_list: bool, tensor_lengths: bool = False) -> str:
    """The operator schema (without the namespace), e.g. ``name.kv_list(Tensor query, Tensor[] key, ...)``;
    ``name.tensor_lengths(...)`` takes the lengths as int tensors (api._traced_call's under torch.compile)."""
    name = spec.name + (".kv_list" if kv_list else ".tensor_lengths" if tensor_lengths else "")
    return f"{name}({', '.join(_schema_arguments(spec, kv_list, tensor_lengths))}) -> {spec.returns}"


def op_out_schema(spec: OpSpec) -> str:
    """torch_npu's ``.out`` schema: the functional arguments, then the workspace and the mutated outputs."""
    args = _schema_arguments(spec, False) + ["Tensor? workspace=None", "Tensor(a!) attention_out",
                                             "Tensor(b!) softmax_lse"]
    return f"{spec.name}.out({', '.join(args)}) -> (Tensor(a!), Tensor(b!))"


# ---------------------------------------------------------------------------------------------- kernels
def _real_kernel(spec: OpSpec):
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


_Q_LENGTHS = frozenset({"actual_seq_lengths", "actual_seq_qlen"})


def _lengths_stand_in(spec: OpSpec, name: str, a: dict):
    """A lengths tensor of the tensor_lengths overload, for the fake kernel (which never reads tensor data): None
    (every row / key) -- the outputs' shapes never depend on the lengths. The packed layouts (TND, NTD) require
    them: there each batch gets an even share of the rows (cumulative), and of the keys (cumulative; a paged cache:
    every block of its table row), which parse accepts wherever the real lengths could be valid."""
    t = a[name]
    if t is None:
        return None
    lay = a.get("input_layout", "BSH")
    if not (isinstance(lay, str) and "TND" in lay):
        return None
    if spec.name == "npu_incre_flash_attention":                  # (its actual_seq_lengths are the KV lengths)
        name = "actual_seq_lengths_kv"
    n = int(t.shape[0]) if t.dim() == 1 else 1
    q_lay = lay.split("_")[0]
    if name in _Q_LENGTHS:
        total = int(a["query"].shape[1 if q_lay == "NTD" else 0])
    elif a.get("block_table") is not None:
        return [int(a["block_table"].shape[-1]) * int(a.get("block_size") or 0)] * n
    else:
        total = int(a["key"].shape[1 if q_lay == "NTD" else 0])
    return [total * (i + 1) // n for i in range(n)]


def _fake_kernel(spec: OpSpec, tensor_lengths: bool = False):
    def kernel(*args, **kwargs):
        a = spec.bind(args, kwargs)
        for name in INT_LISTS.intersection(a):
            a[name] = _lengths_stand_in(spec, name, a) if tensor_lengths else _hinted(name, a[name])
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


def _out_kernel(spec: OpSpec):
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
OPS: Dict[str, OpSpec] = {s.name: s for s in (
    OpSpec(eager.npu_fused_infer_attention_score, eager.fused_problem, _PAIR, _attention_results(True),
            lse_flag="softmax_lse_flag"),
    OpSpec(eager.npu_incre_flash_attention, parse.parse_incre, "Tensor", _attention_results(False)),
    OpSpec(eager.npu_prompt_flash_attention, parse.parse_prompt, "Tensor", _attention_results(False)),
    OpSpec(eager.npu_fused_infer_attention_score_v2, eager.v2_problem, _PAIR,
            _attention_results(True, eager.v2_results), lse_flag="return_softmax_lse"),
    OpSpec(eager._npu_fused_infer_attention_score_get_max_workspace, eager.fused_problem, "Tensor",
            _workspace_result),
    OpSpec(eager._npu_fused_infer_attention_score_v2_get_max_workspace, eager.v2_problem, "Tensor",
            _workspace_result),
)}

# the graph-capture output helpers (torch_npu's `_infer_output`): shape-only functions, so the eager function is
# also the fake kernel (it allocates on the query's device: fake / meta tensors under tracing)
INFER_OUTPUT = (eager._npu_fused_infer_attention_score_infer_output,
                eager._npu_fused_infer_attention_score_v2_infer_output)


def plain_op_schema(fn: Callable, returns: str) -> str:
    """Schema of a function whose positional parameters are tensors and whose keywords have defaults."""
    sig = inspect.signature(fn)
    pos = [f"Tensor {p.name}" for p in sig.parameters.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
    kw = [f"{_schema_type(p.name, p.default)} {p.name}={_schema_default(p.default)}"
          for p in sig.parameters.values() if p.kind == p.KEYWORD_ONLY]
    return f"{fn.__name__}({', '.join(pos + ['*'] + kw)}) -> {returns}"


_LIBS: Dict[str, torch.library.Library] = {}     # namespace -> its library (kept alive: dropping it unregisters)


def register(namespace: str) -> None:
    """Define every operator above in `namespace` (torch.ops.<namespace>.<name>): the same schemas and kernels.
    FIA's own namespace at import; "npu" through fia.install_as_torch_npu (code that calls torch.ops.npu.*)."""
    if namespace in _LIBS:
        return
    lib = torch.library.Library(namespace, "DEF")
    for spec in OPS.values():
        # .default, .kv_list and, for functions with lengths, .tensor_lengths (lengths as int tensors inside
        # torch.compile: api._traced_call)
        variants = ((False, False), (True, False)) + (((False, True),) if INT_LISTS.intersection(spec.defaults)
                                                      else ())
        for kv_list, tensor_lengths in variants:
            schema = op_schema(spec, kv_list, tensor_lengths)
            lib.define(schema)
            overload = schema.split("(", 1)[0]
            lib.impl(overload, _real_kernel(spec), "CompositeExplicitAutograd")
            torch.library.register_fake(f"{namespace}::{overload}", _fake_kernel(spec, tensor_lengths), lib=lib)
        if spec.lse_flag:
            lib.define(op_out_schema(spec))
            lib.impl(spec.name + ".out", _out_kernel(spec), "CompositeImplicitAutograd")
    for fn in INFER_OUTPUT:
        lib.define(plain_op_schema(fn, _PAIR))
        lib.impl(fn.__name__, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{namespace}::{fn.__name__}", fn, lib=lib)
    lib.define("npu_attention_update(Tensor[] lse, Tensor[] local_out, int update_type=0) -> (Tensor, Tensor?)")
    lib.impl("npu_attention_update", eager.npu_attention_update, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{namespace}::npu_attention_update", eager.npu_attention_update, lib=lib)
    _LIBS[namespace] = lib


register(NAMESPACE)


def op(name: str, kv_list: bool = False, out: bool = False, tensor_lengths: bool = False):
    """The OpOverload of a function: ``op("npu_incre_flash_attention")`` -> torch.ops.fia.....default."""
    packet = getattr(getattr(torch.ops, NAMESPACE), name)
    return (packet.out if out else packet.kv_list if kv_list else packet.tensor_lengths if tensor_lengths
            else packet.default)


