"""Every process-wide cache of fia, under one policy.

The caches (each made here with a name; `registered()` lists them):

* parse.memo: signatures -> stored problems (parse/memo.py), and the signatures seen once (admission);
* backends.choice: the registry's backend choice per parse-memo key (backends/registry.py);
* decode.plans: the decode backend's plans per parse-memo key and tuning (backends/decode/plan.py);
* decode.out_layouts, prefill.band_tiles: small pure functions of their arguments (`memoize`);
* replay.table / replay.seen: the call replays (replay.py), and the lengths-replay keys seen once;
* replay.site.*: the replays a caller's call site found (replay.Site: the transformers integration's);
* transformers.mask_plans: the transformers integration's analysis of each attention mask tensor.

Policy: every cache has a size bound and is cleared when full (one rule for all of them). Not least-recently-used
eviction: the hot path of a cache is a hit -- a parse memo lookup, a plan lookup per small decode call -- and a
cleared-when-full cache hits at the cost of a plain dict lookup, while LRU bookkeeping would reorder the entry on
every hit. Clearing costs only recomputation, and a workload that cycles through more keys than the bound would
miss an LRU cache as well. Results never depend on a cache: an entry is exactly what a miss recomputes (tests
clear them, `clear_all`, and compare).

Per-object caches (a decode replay's re-planned lengths) use the same classes unregistered (`register=False`):
they go with their owner, as does an FiaCache layer's memo of its replay (replay.Lane).
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, Hashable, List, Union

__all__ = ["BoundedCache", "BoundedSet", "memoize", "clear_all", "registered"]

_REGISTRY: Dict[str, Union["BoundedCache", "BoundedSet"]] = {}


class BoundedCache(dict):
    """A dict of at most `limit` entries: `put` clears it when full. Reads are a dict's (`get`, `in`, `[]`)."""

    __slots__ = ("name", "limit")

    def __init__(self, name: str, limit: int, register: bool = True):
        super().__init__()
        _name(self, name, limit, register)

    def put(self, key: Hashable, value):
        """Store value under key (the cache cleared first when full); returns value."""
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value


class BoundedSet(set):
    """A set of at most `limit` items: `put` clears it when full (admission: keys seen once)."""

    __slots__ = ("name", "limit")

    def __init__(self, name: str, limit: int, register: bool = True):
        super().__init__()
        _name(self, name, limit, register)

    def put(self, item: Hashable) -> None:
        if len(self) >= self.limit:
            self.clear()
        self.add(item)


def memoize(name: str, limit: int) -> Callable:
    """Decorator: a pure function's results per (hashable) positional arguments, in a registered BoundedCache
    (functools.lru_cache's role, under this module's policy). The wrapper's `cache` is that cache."""
    def wrap(fn: Callable) -> Callable:
        cache = BoundedCache(name, limit)
        get = cache.get

        @functools.wraps(fn)
        def memoized(*args):
            r = get(args)
            if r is None:
                r = cache.put(args, fn(*args))
            return r
        memoized.cache = cache
        return memoized
    return wrap


def _name(cache, name: str, limit: int, register: bool) -> None:
    cache.name, cache.limit = name, limit
    if register:
        _REGISTRY[name] = cache             # (a module imported again replaces its caches)


def registered() -> List[Union[BoundedCache, BoundedSet]]:
    """The process-wide caches."""
    return list(_REGISTRY.values())


def clear_all() -> None:
    """Empty every process-wide cache (results are the same; the next calls recompute)."""
    for c in _REGISTRY.values():
        c.clear()
