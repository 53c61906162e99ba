"""Weight sync, sender side: trainer rank 0 pushes full HF-named weights to the rollout
servers over vLLM's weight-transfer HTTP API plus a packed broadcast group."""

from .packing import dtype_name, pack_buckets
from .sender import DEFAULT_BUCKET_BYTES, WeightSyncError, WeightSyncSender
from .transport import GlooBroadcastGroup

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "GlooBroadcastGroup",
    "WeightSyncError",
    "WeightSyncSender",
    "dtype_name",
    "pack_buckets",
]
