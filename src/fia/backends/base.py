"""Backend protocol: capabilities as data + not_supported_reasons() + plan() / launch() (run() = both) + replay()."""
from __future__ import annotations

from dataclasses import dataclass, field
import math
from typing import Dict, List, Optional, Tuple

import torch

from ..errors import FiaMemoryError
from ..problem.attention import AttentionProblem

# backend ranks (Backend.priority): the CPU backends above the torch backend above the reference
PRIORITY_REFERENCE, PRIORITY_TORCH, PRIORITY_PREFILL, PRIORITY_DECODE = 0, 10, 50, 60


@dataclass(frozen=True)
class Capabilities:
    """What a backend runs, declared once as data (as xFormers' attention ops declare theirs): the base
    not_supported_reasons checks every problem against it, the tests generate each backend's cases from it
    (tests/backend_caps.py), and the README's feature table is rendered from it (feature_table; tested)."""
    devices: Tuple[str, ...] = ("cpu", "cuda")     # device types; "*": any device whose tensors hold data
    decode: bool = True                             # decode problems (Q_S = 1)
    max_q_s: Optional[int] = None                   # the longest query (rows per batch) it runs; None: any
    full_quant: bool = True                         # full int8 quantization (int8 query, key and value, SPEC 11)
    compute_dtypes: Tuple[torch.dtype, ...] = (torch.float32, torch.float64)
    strided_kv: bool = True                         # key / value (rope, prefix) with a non-contiguous last dim
    numba: str = "no"                               # whether it needs Numba (the README's words)
    notes: Dict[str, str] = field(default_factory=dict)    # FEATURES key -> a table cell that says more than yes / no
    why: Dict[str, str] = field(default_factory=dict)      # check -> the reason's explanation (not_supported_reasons)

    def cell(self, key: str) -> str:
        """This backend's cell of the README feature table's row `key` (FEATURES)."""
        if key in self.notes:
            return self.notes[key]
        if key == "devices":
            return ("any device with data (not meta)" if "*" in self.devices
                    else ", ".join(d.upper() for d in self.devices))
        if key == "query length":
            if self.max_q_s is not None:
                return f"Q_S <= {self.max_q_s}"
            return "any" if self.decode else "Q_S > 1"
        if key == "full quant":
            return "yes" if self.full_quant else "no"
        if key == "float64":
            return "yes" if torch.float64 in self.compute_dtypes else "no"
        if key == "strided kv":
            return "yes" if self.strided_kv else "no"
        if key == "numba":
            return self.numba
        return "yes"                                # what every backend runs (FEATURES without a field)


# the README feature table's rows: (key, label); the keys with a Capabilities field are read from it
FEATURES = (
    ("devices", "devices"),
    ("query length", "query length"),
    ("layouts", "all layouts (BSH / BSND / BNSD / TND / NTD, `*_BSND` / `*_NBSD` / `*_NTD` outputs), GQA"),
    ("masks", "masks, sparse modes 0–4, pre / next tokens"),
    ("pse", "`pse_shift` (position bias)"),
    ("lengths", "per-batch lengths, left padding"),
    ("paged", "paged KV cache, tensor-list KV"),
    ("antiquant", "int8 / int4 K / V dequantization (antiquant)"),
    ("fp4", "FP4 E2M1 K / V with FLOAT8_E8M0 per-token-group scales (antiquant mode 6; decode only, dense and paged)"),
    ("full quant", "full int8 quantization (int8 query, key and value)"),
    ("nz", '5-D "NZ" paged caches (SPEC 8b: GQA int8 C8 decode / MTP with per-channel / per-token scales; MLA fp16 '
           "/ bf16 / int8 with the NZ rope cache)"),
    ("mla quant", "MLA full quantization (SPEC 10b.3: int8 query with per-token `dequant_scale_query`, int8 NZ K / V, "
                  "bf16 rope and output)"),
    ("outputs", "int8 output quantization, softmax LSE, learnable sinks"),
    ("rope", "MLA rope (`query_rope` / `key_rope`)"),
    ("prefix", "shared prefix"),
    ("float64", "float64 inputs (portable mode)"),
    ("strided kv", "key / value (rope, prefix) with a non-contiguous last dimension"),
    ("numba", "needs Numba"),
)


def feature_table(backends) -> str:
    """The README's feature table (Markdown) of `backends`, from their Capabilities."""
    rows = ["| feature | " + " | ".join(b.name for b in backends) + " |",
            "|---" * (len(backends) + 1) + "|"]
    rows += ["| " + label + " | " + " | ".join(b.capabilities.cell(key) for b in backends) + " |"
             for key, label in FEATURES]
    return "\n".join(rows)


def kv_tensors(p: AttentionProblem) -> list:
    """Every K / V tensor of p (rope and shared prefix included; None where absent)."""
    kv = p.kv
    ts = (list(kv.keys) + list(kv.values) + list(kv.key_ropes or ())) if kv.kind == "list" else \
        [kv.key, kv.value, kv.key_rope]
    if p.prefix is not None:
        ts += [p.prefix.key, p.prefix.value]
    return ts


def inner_contiguous(t: Optional[torch.Tensor]) -> bool:
    """t's last dimension is contiguous (or t is None / has a single element there)."""
    return t is None or t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1


@dataclass
class BackendResult:
    """Canonical results: out [B, N, Q_S, Dv] (packed [N, T, Dv]) in the compute dtype or the output dtype;
    lse [B, N, Q_S] (packed [N, T]) float32 or float64, or None when not requested."""
    out: torch.Tensor
    lse: Optional[torch.Tensor]


class Backend:
    name: str = "?"
    priority: int = 0                 # higher runs first (the PRIORITY_* ranks below)
    replay_trial: bool = True         # fia.replay admits its replays after a trial run (False: see fia.replay)
    capabilities: Capabilities = Capabilities()

    @property
    def devices(self) -> Tuple[str, ...]:
        return self.capabilities.devices

    def not_supported_reasons(self, p: AttentionProblem) -> List[str]:
        """Why this backend cannot run p (empty: it can), checked against its Capabilities; a backend adds what
        they do not express. Reads p's metadata only, never tensor data, like `preference`: registry.select
        memoizes both per AttentionProblem.memo_key."""
        caps, why = self.capabilities, self.capabilities.why
        reasons = []
        dev = p.device.type
        if ("*" in caps.devices and dev == "meta") or ("*" not in caps.devices and dev not in caps.devices):
            reasons.append(why.get("devices", f"device {dev} not in {caps.devices}").format(dev=dev))
        if not caps.decode and p.is_decode:
            reasons.append(why.get("decode", "decode (Q_S = 1)"))
        if caps.max_q_s is not None and p.Q_S > caps.max_q_s:
            reasons.append(f"Q_S = {p.Q_S} > {caps.max_q_s} ({self.name} backend: Q_S <= {caps.max_q_s})")
        if not caps.full_quant and p.full_quant is not None:
            reasons.append(why.get("full quant", "full int8 quantization (int8 query, key and value)"))
        if p.compute_dtype not in caps.compute_dtypes:
            reasons.append(f"compute dtype {p.compute_dtype} ({why.get('compute', 'not supported')})")
        if not caps.strided_kv and not all(inner_contiguous(t) for t in kv_tensors(p)):
            reasons.append("key/value (or rope/prefix) with a non-contiguous last dimension")
        return reasons

    def preference(self, p: AttentionProblem) -> int:
        """Rank of this backend for p among those that can run it (higher wins; default: priority). A speed
        preference that depends on the problem belongs here, not in not_supported_reasons: a backend
        forced with fia.use_backend still runs every problem it supports."""
        return self.priority

    def kernel_sets(self, p: AttentionProblem) -> Tuple[str, ...]:
        """The compiled kernel sets (fia.cpu.jit.KERNEL_SETS) running p needs; () for a backend that compiles
        nothing. While they are not loaded, automatic selection runs p on the best backend whose sets are."""
        return ()

    def describe(self, p: AttentionProblem) -> Optional[str]:
        """How this backend would run p (e.g. the kernels it picks on this CPU), for fia.explain; None: no
        more to say than its name. Only called for a problem it supports."""
        return None

    def memory_need(self, p: AttentionProblem) -> List[Tuple[object, int]]:
        """(what, bytes) of the largest buffers running p allocates at once: by default the canonical output in
        float32 and the returned one (finalize converts it). A backend with larger working buffers adds them.
        `what` is a name or a function making it (named only when the call does not fit: this runs every call)."""
        out = math.prod(p.out_shape()) * 4
        return [(lambda: f"attention_out {list(p.out_shape())} float32", out), ("the returned attention_out", out)]

    # ---- plan / launch (FlashInfer's plan / run): plan decides from metadata, launch reads the data
    def plan(self, p: AttentionProblem) -> object:
        """What running p needs that follows from its metadata alone (work split, launch parameters, shapes):
        never tensor data, so it can be kept per AttentionProblem.memo_key and re-launched on another call of the
        same metadata (fia.replay does). Default None: a backend that plans nothing."""
        return None

    def launch(self, p: AttentionProblem, plan: object) -> BackendResult:
        """Run p on `plan` (this backend's plan(p), or one it made for a problem of the same metadata). A
        backend that implements run alone plans nothing: its launch is run."""
        if type(self).run is Backend.run:  # pragma: no cover - interface
            raise NotImplementedError(f"backend {self.name!r} implements neither launch nor run")
        return self.run(p)

    def run(self, p: AttentionProblem) -> BackendResult:
        """p's results: launch(p, plan(p)). A backend may fuse the two (sharing what both read of p)."""
        return self.launch(p, self.plan(p))

    def replay(self, p: AttentionProblem, query, key, value, lengths: bool = False, extras: tuple = (),
               kv_axis: Optional[int] = None):
        """fia.replay's prepared launch of p's call (a callable returning what the full path returns), or None:
        the call always takes the full path (the default). See fia.replay for `lengths`, `extras`, `kv_axis`."""
        return None


def non_finite(res: BackendResult) -> bool:
    """Whether res holds a NaN or an infinity where a computed answer is finite: in the output, or in the lse
    other than the +inf of rows without keys (SPEC 6). Such results are the reference's (DECISIONS 52)."""
    out, lse = res.out, res.lse
    if out.is_floating_point() and out.numel():
        lo, hi = torch.aminmax(out)               # one pass; a NaN makes both NaN (isfinite: ~30x slower on bf16)
        if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
            return True
    return lse is not None and lse.numel() > 0 and not float(lse.amin()) > -math.inf


CHECK_FROM = 1 << 30         # calls needing less than this never read the machine's free memory


def run_inference(backend: Backend, p: AttentionProblem) -> BackendResult:
    """backend.run(p) with no autograd history on any backend, whatever the inputs carry: these are inference
    ops (torch_npu's have no backward), so every backend returns results that do not require grad. A call whose
    buffers would not fit in the CPU's available memory fails first, naming the largest one (torch's allocator
    would fail only after seconds of paging, or the kernel would be killed)."""
    if p.device.type == "cpu":
        need = backend.memory_need(p)
        total = sum(b for _, b in need)
        if total >= CHECK_FROM:
            avail = available_memory()
            if avail is not None and total > avail:
                what, big = max(need, key=lambda x: x[1])
                what = what() if callable(what) else what
                raise FiaMemoryError(
                    f"{backend.name} backend: this call needs {total / 2**30:.1f} GiB of working memory, more than "
                    f"the {avail / 2**30:.1f} GiB available; the largest part is {what}: {big / 2**30:.1f} GiB",
                    tensor=what, need=total, available=avail)
    with torch.no_grad():
        return backend.run(p)


def available_memory() -> Optional[int]:
    """Bytes of memory the machine can still give (Linux MemAvailable), or None where that is unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
