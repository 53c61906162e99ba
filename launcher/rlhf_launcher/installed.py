"""What this install of rlhfctl has: `pip install rlhf-operator` brings no torch (`validate`,
`render`, `submit`, ... run the trainer's checks with tokenizers and configs alone); the `plan`
extra adds it for `rlhfctl plan`, which measures the model with torch."""

from __future__ import annotations

import importlib.util
import os

PLAN_EXTRA = "pip install 'rlhf-operator[plan]'"


def torch_installed() -> bool:
    """Whether torch is installed here (found, not imported)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def quiet_transformers_without_torch() -> None:
    """transformers warns at import that it found no PyTorch: with the CLI alone that is no
    news (no model is loaded), so its advisory warnings are off when torch is not installed."""
    if not torch_installed():
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
