"""What each backend can run, from a test case's description (conftest's ``@pytest.mark.case``).

The backends decide from the parsed problem (Backend.not_supported_reasons); a test case is described before
any tensor exists, by the few features those decisions read:

  q_s         the query rows per batch (the largest, for packed layouts)
  decode      a decode problem (every batch 1 query row); default: q_s == 1
  full_quant  int8 query, key and value (SPEC 11)
  compute     the compute dtype (torch.float64 for a float64 query, else torch.float32)

can_run(backend, **features) -> True, or the reason it cannot (a string). Unknown / None features constrain
nothing: a case described too little still runs on every backend, and the backend's own refusal at run time
stays a (reported) skip. FIA_TEST_AUDIT=1 (conftest) checks every exclusion made here against the backends.
"""
from __future__ import annotations

import torch

try:
    from fia.backends.decode.backend import MAX_Q_S as _DECODE_MAX_Q_S
except ImportError:                     # numba missing: the decode backend is not registered anyway
    _DECODE_MAX_Q_S = 16


def can_run(backend: str, *, q_s=None, decode=None, full_quant=False, compute=None):
    if decode is None and q_s is not None:
        decode = q_s == 1
    if backend == "decode":
        if q_s is not None and q_s > _DECODE_MAX_Q_S:
            return f"decode: Q_S = {q_s} > {_DECODE_MAX_Q_S}"
        if full_quant:
            return "decode: full int8 quantization"
        if compute is not None and compute != torch.float32:
            return f"decode: compute dtype {compute}"
    elif backend == "prefill":
        if decode:
            return "prefill: a decode problem (Q_S = 1)"
        if full_quant:
            return "prefill: full int8 quantization"
    return True
