"""The output directory's layout, shared by the trainer (which writes it), local mode and
the operator's users (which read it):

  metrics.jsonl            one JSON object per step
  checkpoints/step-N/      a checkpoint; it counts only once `step-N/COMPLETE` exists
                           (written last, after every rank finished)
  final/                   the Hugging Face model, renamed into place when complete
  rollouts/step-N.jsonl    samples, with `output.saveRollouts`
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINTS = "checkpoints"
MARKER = "COMPLETE"
METRICS_FILE = "metrics.jsonl"
FINAL = "final"


def checkpoint_step(path: Path) -> int:
    """N of a `step-N` directory."""
    return int(path.name.split("-", 1)[1])


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Checkpoints whose completion marker exists, oldest first."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step-*") if (p / MARKER).exists()), key=checkpoint_step)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None
