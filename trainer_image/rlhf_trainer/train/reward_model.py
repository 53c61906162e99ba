"""A learned reward model in the trainer processes (`reward.model`): every rank scores its
own micro-batches of the step's sequences (packed, per-document attention, no gradients,
laid out like the reference model), and one all-reduce gives every rank every score, so
advantages see `reward = verifiable reward + weight x score` on the whole batch.

The score of a sequence is the reward model's output at its last token (what a Hugging
Face `*ForSequenceClassification` returns for an unpadded sequence).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..orchestrator.types import RolloutBatch
from .micro_batches import MicroBatch, _model_inputs, whole_row


def load_reward_model(path: str, device: torch.device, pad_token_id: int | None) -> torch.nn.Module:
    """The reward model of `path` (frozen, fp32; FSDP computes in bf16 on GPUs)."""
    from ..offline.loop import ScoreModel

    model = ScoreModel(path, pad_token_id, require_head=True)
    if model.config.num_labels != 1:
        raise ValueError(f"reward.model.path: {path} has {model.config.num_labels} labels; a reward model has 1 "
                         "(what method: rm exports)")
    return model.to(device).eval().requires_grad_(False)


@torch.no_grad()
def score_rows(scorer: torch.nn.Module, batch: RolloutBatch, micro_batches: list[MicroBatch], cp_mesh,
               world_size: int, *, contributes: bool, device: torch.device) -> torch.Tensor:
    """[B] scores of every row of the batch, the same on every rank (see gather_passes in
    tensors.py for why one all-reduce of zero-filled tables is exact)."""
    scores = torch.zeros(len(batch.rows), dtype=torch.float32, device=device)
    for mb in micro_batches:
        row = whole_row(scorer(**_model_inputs(mb, cp_mesh, device)), cp_mesh)[0]
        last = [mb.starts[k] + mb.prompt_lengths[k] + mb.response_lengths[k] - 1 for k in range(len(mb.rows))]
        if contributes and mb.rows:
            scores[torch.tensor(mb.rows, device=device)] = row[torch.tensor(last, device=device)].float()
    if world_size > 1:
        dist.all_reduce(scores)
    return scores


def add_model_rewards(batch: RolloutBatch, scores: torch.Tensor, weight: float) -> dict[str, float]:
    """reward += weight x score for every row (in place), the step's reward statistics
    updated; returns the reward model's metrics."""
    values = scores.cpu().tolist()
    for row, s in zip(batch.rows, values):
        row.reward += weight * s
    n = max(len(values), 1)
    batch.stats.reward_mean = sum(r.reward for r in batch.rows) / n
    mean = sum(values) / n
    return {"rm_score_mean": mean, "rm_score_std": (sum((v - mean) ** 2 for v in values) / n) ** 0.5}
