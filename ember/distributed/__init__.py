"""Splitting one model over several processes with torch.distributed: where a rank sits (``ParallelContext``),
the collectives the sharded layers call (``comm``), which part of each checkpoint tensor a rank reads
(``sharding``), and the process groups themselves (``groups``)."""

from ember.distributed.context import ParallelContext, layer_range
from ember.distributed.sharding import WeightSlice

__all__ = ["ParallelContext", "WeightSlice", "layer_range"]
