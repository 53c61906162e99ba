"""Everything checked and decided before a job starts, in one place: the config and the
environment (checks.py), the data (data.py), and the GPU memory plan (memory_plan.py, with
what it measures of a model in memory_shapes.py), which also decides activation
checkpointing when the spec leaves it unset. `check(config, world_size)` returns every
problem a user can fix (the launcher exits 2 on any); `with_checkpointing_decided` is
applied once in each trainer process, before models load. Nothing here loads a model's
weights or starts a process."""

from .checks import check, gpu_memory_bytes, memory_problems, tracking_problems
from .memory_plan import with_checkpointing_decided

__all__ = ["check", "gpu_memory_bytes", "memory_problems", "tracking_problems", "with_checkpointing_decided"]
