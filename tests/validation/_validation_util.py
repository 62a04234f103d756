"""Shared helpers of the input-validation tests (tests/validation/test_validation_*.py).

Every invalid case is built by mutating ONE field of a small valid "base" call; every base is run by a
positive-control test, so an invalid case cannot pass because the call fails for an unrelated reason.

A case names the torch_npu keyword(s) one of which the error message must contain; several names are
allowed only where the documents do not say which argument carries the rule (e.g. G <= 64 concerns
num_heads and num_key_value_heads alike).
"""
from __future__ import annotations

import re

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Sequence, Tuple

import pytest
import torch

import fia

F16 = torch.float16
BF16 = torch.bfloat16
F32 = torch.float32

NULLPTR = 161001   # ACLNN_ERR_PARAM_NULLPTR: query/key/value is None
INVALID = 161002   # ACLNN_ERR_PARAM_INVALID: any other invalid input

_GEN = torch.Generator().manual_seed(1234)


def t(*shape, dtype=F16) -> torch.Tensor:
    """A small random tensor (seeded, so failures reproduce)."""
    return torch.randn(*shape, generator=_GEN).to(dtype)


def zmask(*shape, dtype=torch.bool) -> torch.Tensor:
    """An all-zero (nothing masked) mask."""
    return torch.zeros(*shape, dtype=dtype)


def template(*shape) -> torch.Tensor:
    """The 2048x2048 triu(ones, 1) template of sparse modes 2..4, in the requested leading shape."""
    m = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    return m.reshape(*shape)


APIS: Dict[str, Callable] = {
    "fused": fia.npu_fused_infer_attention_score,
    "incre": fia.npu_incre_flash_attention,
    "prompt": fia.npu_prompt_flash_attention,
}


def run(call: Dict[str, Any]):
    """Run a call description {api, query, key, value, **keywords}; return the attention output."""
    call = dict(call)
    fn = APIS[call.pop("api")]
    q, k, v = call.pop("query"), call.pop("key"), call.pop("value")
    out = fn(q, k, v, **call)
    if isinstance(out, tuple):  # fused: (attention_out, softmax_lse)
        out = out[0]
    return out


# --- valid base calls -------------------------------------------------------------------------------
# B=2, N=2, Q_S=4, KV_S=6, D=16 (16-aligned, fp16): every documented constraint of strict mode holds.

def _prefill_bnsd():
    return dict(api="fused", query=t(2, 2, 4, 16), key=t(2, 2, 6, 16), value=t(2, 2, 6, 16),
                num_heads=2, input_layout="BNSD", scale=0.25)


def _prefill_bsh():
    return dict(api="fused", query=t(2, 4, 32), key=t(2, 6, 32), value=t(2, 6, 32),
                num_heads=2, input_layout="BSH", scale=0.25)


def _prefill_bsnd():
    return dict(api="fused", query=t(2, 4, 2, 16), key=t(2, 6, 2, 16), value=t(2, 6, 2, 16),
                num_heads=2, input_layout="BSND", scale=0.25)


def _prefill_bnsd_bf16():
    b = _prefill_bnsd()
    for n in ("query", "key", "value"):
        b[n] = b[n].to(BF16)
    return b


def _prefill_b3():
    # B=3 so that a lengths list of 2 entries is neither 1 nor >= B.
    return dict(api="fused", query=t(3, 2, 4, 16), key=t(3, 2, 6, 16), value=t(3, 2, 6, 16),
                num_heads=2, input_layout="BNSD", scale=0.25)


def _prefill_gqa():
    # Q_N=4, KV_N=2 (G=2).
    return dict(api="fused", query=t(2, 4, 4, 16), key=t(2, 2, 6, 16), value=t(2, 2, 6, 16),
                num_heads=4, num_key_value_heads=2, input_layout="BNSD", scale=0.25)


def _prefill_bsh_gqa():
    # BSH: D = 32 / 2 = 16, KV_N = 16 / 16 = 1.
    return dict(api="fused", query=t(2, 4, 32), key=t(2, 6, 16), value=t(2, 6, 16),
                num_heads=2, num_key_value_heads=1, input_layout="BSH", scale=0.25)


def _prefill_mask():
    b = _prefill_bnsd()
    b["atten_mask"] = zmask(4, 6)
    return b


def _prefill_pse():
    b = _prefill_bnsd()
    b["pse_shift"] = t(2, 2, 4, 6)
    return b


def _prefill_sparse2():
    b = _prefill_bnsd()
    b.update(atten_mask=template(2048, 2048), sparse_mode=2)
    return b


def _prefill_sparse4():
    b = _prefill_bnsd()
    b.update(atten_mask=template(2048, 2048), sparse_mode=4, pre_tokens=3, next_tokens=1)
    return b


def _decode_bnsd():
    return dict(api="fused", query=t(2, 2, 1, 16), key=t(2, 2, 6, 16), value=t(2, 2, 6, 16),
                num_heads=2, input_layout="BNSD", scale=0.25)


def _decode_mask():
    b = _decode_bnsd()
    b["atten_mask"] = zmask(2, 1, 1, 6)
    return b


def _decode_pse():
    b = _decode_bnsd()
    b["pse_shift"] = t(2, 2, 1, 6)
    return b


def _decode_d24():
    # Decode has no fp16/bf16 D-alignment rule (only int4 needs 64), so D=24 is valid in strict mode.
    return dict(api="fused", query=t(2, 2, 1, 24), key=t(2, 2, 6, 24), value=t(2, 2, 6, 24),
                num_heads=2, input_layout="BNSD", scale=0.25)


def _tnd():
    # TND (D != 512): bf16 only, Q_D = K_D = V_D = 128 (FusedInferAttentionScoreV4, TND constraints).
    # Query lengths 2, 4 (T=6); KV lengths 3, 5 (T=8); cumulative lists.
    return dict(api="fused", query=t(6, 2, 128, dtype=BF16), key=t(8, 2, 128, dtype=BF16),
                value=t(8, 2, 128, dtype=BF16), num_heads=2, input_layout="TND", scale=0.1,
                actual_seq_lengths=[2, 6], actual_seq_lengths_kv=[3, 8])


def _tnd_b3():
    return dict(api="fused", query=t(6, 2, 128, dtype=BF16), key=t(9, 2, 128, dtype=BF16),
                value=t(9, 2, 128, dtype=BF16), num_heads=2, input_layout="TND", scale=0.1,
                actual_seq_lengths=[1, 3, 6], actual_seq_lengths_kv=[3, 6, 9])


def _tensor_list():
    # Tensor-list KV: B tensors of batch 1 with individual KV_S (decode, BNSD).
    return dict(api="fused", query=t(2, 2, 1, 16),
                key=[t(1, 2, 5, 16), t(1, 2, 7, 16)], value=[t(1, 2, 5, 16), t(1, 2, 7, 16)],
                num_heads=2, input_layout="BNSD", scale=0.25)


def _tensor_list_prefill():
    return dict(api="fused", query=t(2, 2, 4, 16),
                key=[t(1, 2, 5, 16), t(1, 2, 7, 16)], value=[t(1, 2, 5, 16), t(1, 2, 7, 16)],
                num_heads=2, input_layout="BNSD", scale=0.25)


def _incre_bsh():
    return dict(api="incre", query=t(2, 1, 32), key=t(2, 6, 32), value=t(2, 6, 32),
                num_heads=2, input_layout="BSH", scale_value=0.25)


def _incre_bnsd():
    return dict(api="incre", query=t(2, 2, 1, 16), key=t(2, 2, 6, 16), value=t(2, 2, 6, 16),
                num_heads=2, input_layout="BNSD", scale_value=0.25)


def _prompt_bsh():
    return dict(api="prompt", query=t(2, 4, 32), key=t(2, 6, 32), value=t(2, 6, 32),
                num_heads=2, input_layout="BSH", scale_value=0.25)


def _prompt_mask():
    b = _prompt_bsh()
    b["atten_mask"] = zmask(4, 6)
    return b


BASES: Dict[str, Callable[[], Dict[str, Any]]] = {
    "prefill_bnsd": _prefill_bnsd,
    "prefill_bsh": _prefill_bsh,
    "prefill_bsnd": _prefill_bsnd,
    "prefill_bnsd_bf16": _prefill_bnsd_bf16,
    "prefill_b3": _prefill_b3,
    "prefill_gqa": _prefill_gqa,
    "prefill_bsh_gqa": _prefill_bsh_gqa,
    "prefill_mask": _prefill_mask,
    "prefill_pse": _prefill_pse,
    "prefill_sparse2": _prefill_sparse2,
    "prefill_sparse4": _prefill_sparse4,
    "decode_bnsd": _decode_bnsd,
    "decode_mask": _decode_mask,
    "decode_pse": _decode_pse,
    "decode_d24": _decode_d24,
    "tnd": _tnd,
    "tnd_b3": _tnd_b3,
    "tensor_list": _tensor_list,
    "tensor_list_prefill": _tensor_list_prefill,
    "incre_bsh": _incre_bsh,
    "incre_bnsd": _incre_bnsd,
    "prompt_bsh": _prompt_bsh,
    "prompt_mask": _prompt_mask,
}


# --- cases ------------------------------------------------------------------------------------------
@dataclass
class Case:
    """An invalid call: `base` with `changes` applied. A change value that is callable receives the base
    dict and returns the new value (e.g. `lambda b: b["query"].float()`)."""

    id: str
    base: str
    names: Tuple[str, ...]
    changes: Dict[str, Any] = field(default_factory=dict)
    status: int = INVALID
    mode: str = "strict"

    def build(self) -> Dict[str, Any]:
        call = BASES[self.base]()
        for k, v in self.changes.items():
            call[k] = v(call) if callable(v) and not isinstance(v, torch.Tensor) else v
        return call


def case(id: str, base: str, names, status: int = INVALID, mode: str = "strict", **changes) -> Case:
    if isinstance(names, str):
        names = (names,)
    return Case(id=id, base=base, names=tuple(names), changes=changes, status=status, mode=mode)


def params(cases: Sequence[Case]):
    return [pytest.param(c, id=c.id) for c in cases]


def assert_input_error(call: Dict[str, Any], names: Sequence[str], status: int = INVALID,
                       mode: str = "strict") -> fia.FiaInputError:
    """The call must raise FiaInputError with `status` and a message naming one of `names`."""
    with fia.validation_mode(mode):
        with pytest.raises(fia.FiaInputError) as excinfo:
            run(call)
    err = excinfo.value
    assert isinstance(err, ValueError) and isinstance(err, TypeError)
    assert err.status == status, f"status {err.status} != {status}; message: {err}"
    msg = str(err)
    assert any(names_argument(msg, n) for n in names), f"message {msg!r} names none of {list(names)}"
    # The argument the error is about (FiaInputError.argument, the message's leading "<argument>:") must be
    # one of `names` -- not merely a word somewhere in the explanation ("... the N axis of key ...").
    if err.argument is not None:
        assert any(names_argument(err.argument, n) for n in names), \
            f"error is about {err.argument!r}, expected one of {list(names)}; message: {msg!r}"
    return err


def names_argument(msg: str, name: str) -> bool:
    """`name` occurs in `msg` as a whole identifier ("actual_seq_lengths" does not match inside
    "actual_seq_lengths_kv", "key" not inside "key_rope")."""
    return re.search(r"(?<![A-Za-z0-9_])" + re.escape(name) + r"(?![A-Za-z0-9_])", msg) is not None


def check_case(c: Case) -> None:
    assert_input_error(c.build(), c.names, c.status, c.mode)


def run_ok(call: Dict[str, Any], mode: str = "strict"):
    with fia.validation_mode(mode):
        return run(call)
