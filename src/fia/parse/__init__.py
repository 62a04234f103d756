"""The only code that knows Ascend argument names and quirks: raw arguments -> AttentionProblem."""
from .core import parse_fused
from .entries import parse_incre, parse_prompt, parse_v2
from .outputs import infer_outputs
from .paged import reread_table

__all__ = ["parse_fused", "parse_incre", "parse_prompt", "parse_v2", "reread_table", "infer_outputs"]
