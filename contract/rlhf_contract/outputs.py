"""The output directory's layout, shared by the trainer (which writes it), local mode and
the operator's users (which read it):

  metrics.jsonl            one JSON object per step
  checkpoints/step-N/      a checkpoint; it counts only once `step-N/COMPLETE` exists
                           (written last, after every rank finished; it lists every file
                           with its size, so a shard damaged later is found: `damage`)
  checkpoints/damaged-step-N/  a complete checkpoint found damaged at resume, set aside
  final/                   the Hugging Face model, renamed into place when complete
  hub/step-N/              with `output.hub.every`: the model of step N on its way to the
                           Hub (rank 0 deletes it once pushed)
  rollouts/step-N.jsonl    samples, with `output.saveRollouts`
"""

from __future__ import annotations

import json
from pathlib import Path

CHECKPOINTS = "checkpoints"
MARKER = "COMPLETE"
METRICS_FILE = "metrics.jsonl"
FINAL = "final"
HUB_MODELS = "hub"


def checkpoint_step(path: Path) -> int:
    """N of a `step-N` directory."""
    return int(path.name.split("-", 1)[1])


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Checkpoints whose completion marker exists, oldest first."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step-*") if (p / MARKER).exists()), key=checkpoint_step)


def manifest(path: Path) -> dict[str, int]:
    """{relative path: size} of every file of a checkpoint directory (what COMPLETE holds)."""
    return {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*"))
            if f.is_file() and f.name != MARKER}


def damage(path: Path) -> str | None:
    """What is wrong with a complete checkpoint: a COMPLETE that cannot be read (cut short
    mid-write, empty), or a file it lists that is missing or of another size; None when it
    is whole."""
    try:
        files = json.loads((path / MARKER).read_text())["files"]
        listed = [(str(name), int(size)) for name, size in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{path / MARKER} cannot be read ({type(err).__name__}): the checkpoint is incomplete"
    for name, size in listed:
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != size:
            return f"{f} has {f.stat().st_size} bytes, {size} were written"
    return None


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None
