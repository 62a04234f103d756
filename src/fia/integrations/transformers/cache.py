"""FIA's KV cache for transformers' ``generate()``: preallocated head-major buffers appended in place.

    from fia.integrations.transformers import FiaCache
    model.generate(ids, cache=FiaCache(model.config), ...)              # or cache_implementation="fia"
    model.generate(ids, cache=FiaCache(model.config, quantize="int8"))  # or cache_implementation="fia_int8"

Each layer keeps K and V in [B, KV_N, capacity, D] buffers (BNSD, the fastest layout of FIA's decode kernels) and
writes a step's tokens at their positions: no O(context) copy per step (transformers' DynamicCache concatenates the
whole K and V every step). update() returns the whole buffers -- the same tensors from step to step -- and
``get_mask_sizes`` reports the positions written, as a DynamicCache does: without padding transformers builds no
mask, and the attention function passes FIA the layer's length (the unused tail is right padding); with one, the
mask covers the written positions. Every decode step is the same call signature with new lengths, which FIA
replays (fia.replay) without parsing or planning it again. A generation that outgrows the
buffers moves them into larger ones (1.5x the tokens needed, in blocks of ``BLOCK`` positions; an O(context) copy
at each growth only). ``capacity=`` preallocates (generate passes its maximum length when it builds the cache from
``cache_implementation``).

``quantize="int8"``: K and V are quantized when appended, symmetric int8 per token and KV head (scale = max |x| /
127 over the head dim, float32 scales [B, KV_N, capacity]; one compiled pass per layer and step, cpu/kv_append.py,
and the same torch ops off the CPU or until it is compiled), and decode steps hand FIA the int8 buffers with the
scales as per-token-per-head dequantization (key / value_antiquant_mode 3, SPEC 10): FIA's int8 decode kernels
read half the bytes of bf16. A prefill over an empty cache attends over the unquantized states; a later call
with several query tokens attends over the dequantized buffers. Tolerance: with random weights the logits stay
within ``INT8_LOGITS_TOLERANCE`` (relative to the largest logit) of the bf16 FiaCache (tests/test_integration_
transformers_cache.py); DECISIONS 47 records the design.

Beam search (reorder_cache), batch_repeat_interleave, batch_select_indices and crop are supported; a batch index
out of range, a dtype the cache cannot hold (float64, or another dtype than its first update's) raise ValueError
naming the argument.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from fia.cpu import kv_append
from fia.replay import Lane

BLOCK = 256                     # capacity granularity (positions)
INT8_LOGITS_TOLERANCE = 0.05    # int8 vs bf16 FiaCache: max |logit difference| / max |logit| (tested)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
QUANTIZE = (None, "int8")


def _blocks(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def _grown(need: int) -> int:
    """The capacity a layer takes when `need` positions do not fit (or at its first update)."""
    return _blocks(need + max(BLOCK, need // 2))


def quantize_int8(x: torch.Tensor):
    """x [..., T, D] -> (int8 codes [..., T, D], float32 scales [..., T]): symmetric, per token and head."""
    xf = x.float()
    scale = xf.abs().amax(-1) / 127.0                                  # [..., T]
    scale = torch.where(scale > 0, scale, 1.0)                         # (an all-zero row: codes 0, any scale)
    codes = (xf / scale.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    return codes, scale


class FiaLayer(CacheLayerMixin):
    """One layer's buffers: keys / values [B, KV_N, capacity, D] (int8 with ``quantize="int8"``, then scales
    [B, KV_N, capacity] float32), ``length`` positions written."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, quantize: Optional[str] = None, capacity: int = 0):
        super().__init__()
        if quantize not in QUANTIZE:
            raise ValueError(f"quantize: expected one of {QUANTIZE}, got {quantize!r}")
        self.quantize = quantize
        self.capacity = _blocks(capacity) if capacity > 0 else 0
        self.length = 0
        self.dtype = None
        self.key_scales = self.value_scales = None
        self.lane = Lane()              # the attention function's replay of this layer's decode steps (fia.replay)

    # ---- allocation
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dtype not in _DTYPES or value_states.dtype != key_states.dtype:
            raise ValueError(f"key_states: FiaCache holds {', '.join(str(d) for d in _DTYPES)} key / value states "
                             f"(the same dtype); got {key_states.dtype} / {value_states.dtype}")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        self.is_initialized = True
        self._allocate(max(self.capacity, _grown(key_states.shape[-2])))

    def _allocate(self, capacity: int) -> None:
        """(Re)allocate the buffers for `capacity` positions, keeping the first `length`."""
        b, h, n = self.batch_size, self.num_heads, self.length
        store = torch.int8 if self.quantize else self.dtype
        keys = torch.zeros((b, h, capacity, self.k_head_dim), dtype=store, device=self.device)     # [B, KV_N, C, D]
        values = torch.zeros((b, h, capacity, self.v_head_dim), dtype=store, device=self.device)
        if self.keys is not None and n:
            keys[:, :, :n] = self.keys[:, :, :n]
            values[:, :, :n] = self.values[:, :, :n]
        self.keys, self.values = keys, values
        if self.quantize:
            ks = torch.ones((b, h, capacity), dtype=torch.float32, device=self.device)             # [B, KV_N, C]
            vs = torch.ones((b, h, capacity), dtype=torch.float32, device=self.device)
            if self.key_scales is not None and n:
                ks[:, :, :n] = self.key_scales[:, :, :n]
                vs[:, :, :n] = self.value_scales[:, :, :n]
            self.key_scales, self.value_scales = ks, vs
        self._tag()
        self.capacity = capacity

    def _tag(self) -> None:
        """Mark the buffers as this layer's: the attention function reads the layer's length (and int8 scales)
        from the key it is handed (transformers may pass no mask when nothing is padded)."""
        ref = weakref.ref(self)
        self.keys._fia_layer = self.values._fia_layer = ref

    # ---- transformers' layer interface
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new states [B, KV_N, T, D] at positions [length, length + T); return the whole buffers
        (T > 1 on an int8 cache: the unquantized states over an empty cache, else the dequantized buffers)."""
        fresh = not self.is_initialized or self.length == 0
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.dtype != self.dtype or value_states.dtype != self.dtype:
            raise ValueError(f"key_states: this FiaCache holds {self.dtype} states; got {key_states.dtype} / "
                             f"{value_states.dtype}")
        if key_states.shape[0] != self.batch_size:
            raise ValueError(f"key_states: batch size {self.batch_size} (this FiaCache's), got {key_states.shape[0]}")
        t, n = key_states.shape[-2], self.length
        if n + t > self.capacity:
            self._allocate(_grown(n + t))
        if not self.quantize:
            self.keys[:, :, n:n + t] = key_states
            self.values[:, :, n:n + t] = value_states
        elif not kv_append.append(key_states, value_states, self.keys, self.values, self.key_scales,
                                  self.value_scales, n):        # (one compiled pass where it runs: the same codes)
            if key_states.shape == value_states.shape:                 # one pass over both (a step's ops halved)
                (kc, vc), (ksc, vsc) = quantize_int8(torch.stack((key_states, value_states)))
            else:
                (kc, ksc), (vc, vsc) = quantize_int8(key_states), quantize_int8(value_states)
            self.keys[:, :, n:n + t] = kc
            self.values[:, :, n:n + t] = vc
            self.key_scales[:, :, n:n + t] = ksc
            self.value_scales[:, :, n:n + t] = vsc
        self.length = n + t
        if self.quantize and t > 1:
            if fresh:
                return key_states, value_states
            return self._dequantized()
        return self.keys, self.values

    def _dequantized(self):
        ks, vs = self.key_scales.unsqueeze(-1), self.value_scales.unsqueeze(-1)
        k, v = (self.keys.float() * ks).to(self.dtype), (self.values.float() * vs).to(self.dtype)
        k._fia_layer = v._fia_layer = weakref.ref(self)             # (their length: the layer's)
        return k, v

    def get_mask_sizes(self, query_length: int) -> tuple:
        """(kv_length, kv_offset) of the next update's result: the positions written after it, as a DynamicCache
        reports them. Without padding transformers then builds no decode mask at all (the attention function takes
        the length from the layer: layer_of); a mask covers the written positions, not the unused tail."""
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0

    def crop(self, max_length: int) -> None:
        """Drop -max_length positions when negative (transformers' form), else keep the first max_length."""
        if max_length < 0:
            max_length = self.length - abs(max_length)
        self.length = max(0, min(self.length, max_length))

    def _select(self, index: torch.Tensor, what: str) -> None:
        if not self.is_initialized:
            return
        index = torch.as_tensor(index, device=self.device)
        if index.dtype == torch.bool and index.shape == (self.batch_size,):      # a row mask, as indexing takes it
            index = index.nonzero().flatten()
        if index.dim() != 1 or index.dtype == torch.bool or index.is_floating_point():
            raise ValueError(f"{what}: expected a 1-D integer tensor of batch indices, got {index.dtype} of shape "
                             f"{tuple(index.shape)}")
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.batch_size):
            raise ValueError(f"{what}: expected batch indices in [0, {self.batch_size}), got values in "
                             f"[{int(index.min())}, {int(index.max())}]")
        tensors = ("keys", "values") + (("key_scales", "value_scales") if self.quantize else ())
        for name in tensors:
            setattr(self, name, getattr(self, name).index_select(0, index))
        self.batch_size = index.numel()
        self._tag()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row b takes row beam_idx[b] (the same number of rows)."""
        if self.is_initialized and torch.as_tensor(beam_idx).numel() != self.batch_size:
            raise ValueError(f"beam_idx: expected {self.batch_size} indices (one per cached row), got "
                             f"{torch.as_tensor(beam_idx).numel()}")
        self._select(beam_idx, "beam_idx")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select(torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats), "repeats")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices, "indices")


class FiaCache(Cache):
    """A transformers Cache of FiaLayer's, one per decoder layer (see the module docstring).

    config: the model's config (its text config's ``num_hidden_layers``); quantize: None or "int8"; capacity:
    positions to preallocate per layer (rounded up to BLOCK; more are added when needed)."""

    def __init__(self, config=None, quantize: Optional[str] = None, capacity: int = 0, num_layers: Optional[int] = None):
        if num_layers is None:
            if config is None:
                raise ValueError("config: expected the model's config (or num_layers=), got None")
            text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            num_layers = int(text.num_hidden_layers)
        if quantize not in QUANTIZE:
            raise ValueError(f"quantize: expected one of {QUANTIZE}, got {quantize!r}")
        super().__init__(layers=[FiaLayer(quantize, capacity) for _ in range(num_layers)])
        self.quantize = quantize


def layer_of(key: torch.Tensor) -> Optional[FiaLayer]:
    """The FiaLayer whose buffer `key` is, or None."""
    ref = getattr(key, "_fia_layer", None)
    return None if ref is None else ref()


IMPLEMENTATIONS = {"fia": None, "fia_int8": "int8"}     # cache_implementation= names -> quantize


def allow_cache_implementations() -> None:
    """Let generate(cache_implementation="fia" / "fia_int8") build a FiaCache (idempotent; other names go through
    transformers' code unchanged)."""
    from transformers.generation import configuration_utils as cu
    from transformers.generation.utils import GenerationMixin
    if "fia" not in cu.ALL_CACHE_IMPLEMENTATIONS:
        cu.ALL_CACHE_IMPLEMENTATIONS = tuple(cu.ALL_CACHE_IMPLEMENTATIONS) + tuple(IMPLEMENTATIONS)
    original = GenerationMixin._prepare_cache_for_generation
    if getattr(original, "_fia", False):
        return

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        impl = generation_config.cache_implementation
        if impl in IMPLEMENTATIONS and model_kwargs.get("cache") is None and generation_config.use_cache is not False:
            model_kwargs["cache"] = FiaCache(self.config, quantize=IMPLEMENTATIONS[impl], capacity=max_cache_length)
            return None
        return original(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)

    _prepare_cache_for_generation._fia = True
    _prepare_cache_for_generation.__wrapped__ = original
    GenerationMixin._prepare_cache_for_generation = _prepare_cache_for_generation
