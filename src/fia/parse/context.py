"""Per-call parse context: which entry point is parsing, argument aliases, strict/portable mode.

Every error names the argument as the *caller* spelled it (npu_incre_flash_attention calls the scale
`scale_value`, npu_prompt_flash_attention calls dequant_scale1 `deq_scale1`, ...).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, Iterable

import torch

from ..errors import ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR, FiaInputError, input_error


def describe(x) -> str:
    """Short description of a received value for error messages."""
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {str(x.dtype).replace('torch.', '')}"
    if isinstance(x, (list, tuple)) and x and all(isinstance(t, torch.Tensor) for t in x):
        return f"list of {len(x)} tensors"
    r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


@dataclass
class Ctx:
    api: str
    strict: bool
    aliases: Dict[str, str] = field(default_factory=dict)

    def n(self, name: str) -> str:
        """The caller's spelling of an argument."""
        return self.aliases.get(name, name)

    def spell(self, text: str) -> str:
        """Other arguments named inside a message, in the caller's spelling too (npu_fused_infer_attention_score_v2
        says `dequant_scale_key`, not `key_antiquant_scale`). Only snake_case names are rewritten: a plain word
        like "scale" is also ordinary English."""
        names = [c for c, n in self.aliases.items() if "_" in c and c != n]
        if not names:
            return text
        pat = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(map(re.escape, names)) + r")(?![A-Za-z0-9_])")
        return pat.sub(lambda m: self.aliases[m.group(1)], text)

    def err(self, name: str | None, expected: str, received, hint: str | None = None,
            *, status: int = ACLNN_ERR_PARAM_INVALID) -> FiaInputError:
        arg = self.n(name) if name else None
        got = received if isinstance(received, str) else describe(received)
        return input_error(arg, self.spell(expected), got, self.spell(hint) if hint else hint, status=status)

    def hw(self, name: str, expected: str, received, hint: str | None = None) -> FiaInputError | None:
        """A hardware-only rule: an error in strict mode, nothing in portable mode."""
        if not self.strict:
            return None
        h = "NPU hardware constraint; fia.validation_mode('portable') lifts it"
        return self.err(name, expected, received, f"{hint}; {h}" if hint else h)

    def require(self, name: str, x):
        if x is None:
            raise self.err(name, "a tensor", "None", status=ACLNN_ERR_PARAM_NULLPTR)
        return x

    def tensor(self, name: str, x, *, optional: bool = True):
        """x must be a torch.Tensor (or None when optional)."""
        if x is None:
            if optional:
                return None
            raise self.err(name, "a tensor", "None", status=ACLNN_ERR_PARAM_NULLPTR)
        if not isinstance(x, torch.Tensor):
            raise self.err(name, "a torch.Tensor", describe(x))
        return x

    def dtype_in(self, name: str, t: torch.Tensor, allowed: Iterable[torch.dtype], what: str | None = None):
        allowed = tuple(allowed)
        if t.dtype not in allowed:
            exp = what or ("dtype " + " or ".join(dtype_name(d) for d in allowed))
            raise self.err(name, exp, f"dtype {dtype_name(t.dtype)}")

    def host(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A tensor whose *values* are read on the host (lengths, block ids, padding sizes, per-tensor int8
        scales, scalar tensors): a meta tensor has no values to read -- an input error, not torch's
        NotImplementedError / RuntimeError from .item() / .tolist()."""
        if t.device.type == "meta":
            raise self.err(name, "a tensor with data (its values are read on the host)", "a meta tensor")
        return t

    def integer(self, name: str, x) -> int:
        if isinstance(x, bool) or not isinstance(x, int):
            try:
                import numpy as np
                if isinstance(x, np.integer):
                    return int(x)
            except ImportError:  # pragma: no cover
                pass
            if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_floating_point() \
                    and x.dtype != torch.bool:
                return int(self.host(name, x).item())
            raise self.err(name, "an integer", describe(x))
        return int(x)

    def number(self, name: str, x) -> float:
        try:
            return self._number(name, x)
        except OverflowError:            # a Python int beyond float64 (10**400): not torch's bare OverflowError
            raise self.err(name, "a number within the float64 range (|x| < 1.8e308)", describe(x)) from None

    def _number(self, name: str, x) -> float:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            try:
                import numpy as np
                if isinstance(x, (np.integer, np.floating)):
                    return float(x)
            except ImportError:  # pragma: no cover
                pass
            if isinstance(x, torch.Tensor) and x.numel() == 1 and x.dtype != torch.bool \
                    and not x.is_complex():
                return float(self.host(name, x).item())
            raise self.err(name, "a number", describe(x))
        return float(x)

    def int_list(self, name: str, x):
        """Lengths lists: list / tuple / numpy integer array / int32|int64 tensor -> tuple of ints (or None)."""
        if x is None:
            return None
        if isinstance(x, torch.Tensor):
            if x.dtype not in (torch.int32, torch.int64):
                raise self.err(name, "a list of ints or an int32/int64 tensor", x)
            if x.dim() > 1:
                raise self.err(name, "a 1-D sequence of ints", x)
            return tuple(int(v) for v in self.host(name, x).reshape(-1).tolist())
        try:
            import numpy as np
            if isinstance(x, np.ndarray):
                if not np.issubdtype(x.dtype, np.integer) or x.ndim > 1:
                    raise self.err(name, "a 1-D integer array", f"array of dtype {x.dtype}, shape {x.shape}")
                return tuple(int(v) for v in x.reshape(-1).tolist())
        except ImportError:  # pragma: no cover
            pass
        if isinstance(x, (list, tuple)):
            out = []
            for v in x:
                out.append(self.integer(name, v) if not isinstance(v, bool) else self._bad_list(name, x))
            return tuple(out)
        raise self.err(name, "a list of ints", describe(x))

    def _bad_list(self, name, x):
        raise self.err(name, "a list of ints", describe(x))
