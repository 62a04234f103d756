"""Context-parallel attention over torch.distributed: FIA's operators on every rank's share of the sequence,
partial results merged through their log-sum-exp exactly as npu_attention_update merges them.

* decode_attention: the KV cache sharded across the ranks, the same query everywhere, one all_gather of the
  partial outputs and LSEs per step; every rank returns the whole result.
* ring_attention: prefill with the sequence split across the ranks; K/V slices travel the ring (isend / irecv
  overlapped with the local attention); full or causal attention, optionally in the load-balanced zigzag layout
  (zigzag_shard / zigzag_unshard).

Works with any torch.distributed backend (gloo on CPU, NCCL on GPUs; torchrun across machines). Initialize the
process group with a timeout (init_process_group(..., timeout=datetime.timedelta(seconds=...))): a rank that
dies or never makes the call then ends in a FiaRuntimeError on the others instead of a hang. Differing calls
(shapes, dtypes, layout, flags) are detected before any data moves and raise on every rank.
See docs/distributed.md.
"""
from .comm import reset_traffic, traffic
from .decode import decode_attention
from .ring import ring_attention
from .zigzag import zigzag_shard, zigzag_unshard

__all__ = ["decode_attention", "ring_attention", "zigzag_shard", "zigzag_unshard", "traffic", "reset_traffic"]
