"""Arguments accepted by the signatures whose features are not implemented yet (SPEC 7-12).

They raise FiaUnsupportedError (valid input, no backend implements it) with the reason, so callers
can tell "you passed something wrong" from "FIA cannot do this yet".
"""
from __future__ import annotations

from ..errors import FiaUnsupportedError

# argument -> feature it belongs to
_LATER = {
    "block_table": "paged KV cache",
    "query_padding_size": "query left padding",
    "kv_padding_size": "KV left padding",
    "key_shared_prefix": "shared prefix",
    "value_shared_prefix": "shared prefix",
    "actual_shared_prefix_len": "shared prefix",
    "query_rope": "MLA rope",
    "key_rope": "MLA rope",
    "key_rope_antiquant_scale": "MLA rope dequantization",
    "dequant_scale1": "full int8 quantization",
    "quant_scale1": "full int8 quantization",
    "dequant_scale2": "full int8 quantization",
    "quant_scale2": "output quantization",
    "quant_offset2": "output quantization",
    "antiquant_scale": "KV dequantization",
    "antiquant_offset": "KV dequantization",
    "key_antiquant_scale": "KV dequantization",
    "key_antiquant_offset": "KV dequantization",
    "value_antiquant_scale": "KV dequantization",
    "value_antiquant_offset": "KV dequantization",
    "dequant_scale_query": "query dequantization",
}


def reject_unimplemented(ctx, args: dict, implemented: frozenset = frozenset()) -> None:
    for name, feature in _LATER.items():
        if name in implemented:
            continue
        if args.get(name) is not None:
            raise FiaUnsupportedError(
                f"{ctx.n(name)}: {feature} is valid per the documents but not implemented by any FIA backend yet",
                {"reference": [f"{feature} not implemented"]})
