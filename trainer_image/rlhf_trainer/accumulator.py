"""Step metrics accumulated on the training device and read once per step.

Each metric is a (sum, count) pair in one float64 tensor on the device: `add` updates it
in place (no host sync), `reduce` all-reduces every pair with ONE collective over a group
(NCCL needs device tensors; gloo takes CPU ones), `to_host` copies it once. The names are
declared up front, so a typo is an error, not a silent new metric.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class MetricAccumulator:
    """Named sums and counts on `device`; `means()` divides them."""

    def __init__(self, names: list[str], device: torch.device):
        self.names = list(names)
        self._index = {n: i for i, n in enumerate(self.names)}
        self.values = torch.zeros(2, len(self.names), dtype=torch.float64, device=device)

    def add(self, name: str, total: torch.Tensor | float, count: torch.Tensor | float = 1.0) -> None:
        """Add `total` to the metric's sum and `count` to its count (tensors stay on the device)."""
        i = self._index[name]
        self.values[0, i] += total.detach().double() if isinstance(total, torch.Tensor) else total
        self.values[1, i] += count.detach().double() if isinstance(count, torch.Tensor) else count

    def reduce(self, group: dist.ProcessGroup | None) -> None:
        """Sum every metric over `group` (None: no-op) with one all-reduce."""
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(self.values, group=group)

    def to_host(self) -> dict[str, tuple[float, float]]:
        """{name: (sum, count)}, one device-to-host copy."""
        sums, counts = self.values.tolist()
        return {n: (s, c) for n, s, c in zip(self.names, sums, counts)}

    def means(self) -> dict[str, float | None]:
        """{name: sum / count} (None where nothing was counted)."""
        return {n: (s / c if c else None) for n, (s, c) in self.to_host().items()}
