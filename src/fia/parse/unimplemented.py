"""Arguments accepted by the signatures whose features are not implemented yet (SPEC 7-12).

They raise FiaUnsupportedError (valid input, no backend implements it) with the reason, so callers
can tell "you passed something wrong" from "FIA cannot do this yet".
"""
from __future__ import annotations

from ..errors import FiaUnsupportedError

# argument -> feature it belongs to (none now: key_rope_antiquant_scale is reserved, an input error unless None --
# parse/core.py RESERVED_TENSORS, DECISIONS 39)
_LATER: dict = {}


def reject_unimplemented(ctx, args: dict, implemented: frozenset = frozenset()) -> None:
    for name, feature in _LATER.items():
        if name in implemented:
            continue
        if args.get(name) is not None:
            raise FiaUnsupportedError(
                f"{ctx.n(name)}: {feature} is valid per the documents but not implemented by any FIA backend yet",
                {"reference": [f"{feature} not implemented"]})
