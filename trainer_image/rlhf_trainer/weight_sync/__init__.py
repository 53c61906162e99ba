"""Weight sync, sender side: trainer rank 0 pushes full HF-named weights to the rollout
servers over vLLM's weight-transfer HTTP API plus a packed broadcast group (NCCL for vLLM,
gloo for the CPU engine; one sender, two transports); `push_weights` gathers a
sharded policy on every rank and sends it from rank 0."""

from .buckets import DEFAULT_BUCKET_BYTES, bucket_ranges, dtype_name, pack_buckets
from .push import push_weights
from .sender import WeightSyncError, WeightSyncSender
from .transport import GlooTransport, NcclTransport, make_transport

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "GlooTransport",
    "NcclTransport",
    "WeightSyncError",
    "WeightSyncSender",
    "bucket_ranges",
    "dtype_name",
    "make_transport",
    "pack_buckets",
    "push_weights",
]
