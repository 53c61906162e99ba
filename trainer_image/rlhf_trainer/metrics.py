"""Per-step metrics: `metrics.jsonl` in the output directory and Prometheus gauges.

Keys (one JSON object per step): step, reward_mean, score_mean, kl (null without a
reference model), entropy, response_length_mean, truncated_fraction, loss, clip_fraction,
approx_kl, grad_norm, padding_fraction (padding tokens / token slots of the packed
micro-batches), learning_rate, step_seconds, rollout_seconds, train_seconds,
weight_sync_seconds, tokens_per_second (prompt + response tokens of the step / step_seconds),
policy_version. Prometheus names are the same keys with the `rlhf_` prefix; served on rank
0 when RLHF_METRICS_PORT is set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._gauges: dict[str, Any] = {}
        port = os.environ.get("RLHF_METRICS_PORT")
        self._prometheus = bool(port)
        if port:
            from prometheus_client import start_http_server

            start_http_server(int(port))

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps after `step` (a resumed run rewrites them)."""
        if not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in keep))

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._prometheus:
            from prometheus_client import Gauge

            for key, value in row.items():
                if isinstance(value, (int, float)):
                    if key not in self._gauges:
                        self._gauges[key] = Gauge(f"rlhf_{key}", f"{key} of the last RL step")
                    self._gauges[key].set(value)
