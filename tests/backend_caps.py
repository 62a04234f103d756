"""What each backend can run, from a test case's description (conftest's ``@pytest.mark.case``).

The backends decide from the parsed problem (Backend.not_supported_reasons); a test case is described before
any tensor exists, by the few features those decisions read:

  q_s         the query rows per batch (the largest, for packed layouts)
  decode      a decode problem (every batch 1 query row); default: q_s == 1
  full_quant  int8 query, key and value (SPEC 11)
  compute     the compute dtype (torch.float64 for a float64 query, else torch.float32)

can_run(backend, **features) -> True, or the reason it cannot (a string), read from the backend's declared
Capabilities (fia.backends.base). Unknown / None features constrain
nothing: a case described too little still runs on every backend, and the backend's own refusal at run time
stays a (reported) skip. FIA_TEST_AUDIT=1 (conftest) checks every exclusion made here against the backends.
"""
from __future__ import annotations

from fia.backends import registry


def can_run(backend: str, *, q_s=None, decode=None, full_quant=False, compute=None):
    """Read from the backend's declared Capabilities (the same data its not_supported_reasons checks)."""
    caps = registry.by_name(backend).capabilities
    if decode is None and q_s is not None:
        decode = q_s == 1
    if caps.max_q_s is not None and q_s is not None and q_s > caps.max_q_s:
        return f"{backend}: Q_S = {q_s} > {caps.max_q_s}"
    if not caps.decode and decode:
        return f"{backend}: a decode problem (Q_S = 1)"
    if not caps.full_quant and full_quant:
        return f"{backend}: full int8 quantization"
    if compute is not None and compute not in caps.compute_dtypes:
        return f"{backend}: compute dtype {compute}"
    return True
