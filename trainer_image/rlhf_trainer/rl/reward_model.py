"""A learned reward model in the trainer processes (`reward.model`): every rank scores its
own micro-batches of the step's sequences (packed, per-document attention, no gradients,
laid out like the reference model), and one all-reduce gives every rank every score, so
advantages see `reward = verifiable reward + weight x score` on the whole batch.

The score of a sequence is the reward model's output at its last token (what a Hugging
Face `*ForSequenceClassification` returns for an unpadded sequence). The scores are
returned (`ModelRewards`); the batch's rows keep the verifiable rewards they came with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..data.micro_batches import MicroBatch
from ..models.forward import last_token_scores


@dataclass
class ModelRewards:
    scores: torch.Tensor
    """[B] the reward model's score of each row (on the CPU)."""
    weight: float

    def total(self, rewards: list[float]) -> list[float]:
        """Each row's reward plus weight x its score."""
        return [r + self.weight * s for r, s in zip(rewards, self.scores.tolist())]

    def metrics(self, rewards: list[float]) -> dict[str, float]:
        """The scores' mean and std, and the total reward's (what trains) mean, std, min, max."""
        values, totals = self.scores.tolist(), self.total(rewards)
        n = max(len(values), 1)
        mean, total_mean = sum(values) / n, sum(totals) / n
        return {"rm_score_mean": mean, "rm_score_std": (sum((v - mean) ** 2 for v in values) / n) ** 0.5,
                "reward_mean": total_mean, "reward_std": (sum((v - total_mean) ** 2 for v in totals) / n) ** 0.5,
                "reward_min": min(totals, default=0.0), "reward_max": max(totals, default=0.0)}


@torch.no_grad()
def reward_model_scores(reward_model: torch.nn.Module, num_rows: int, micro_batches: list[MicroBatch], cp_mesh,
               world_size: int, *, contributes: bool, device: torch.device) -> torch.Tensor:
    """[num_rows] scores of every row of the batch, the same on every rank, on the CPU (see
    gather_passes in rl/tensors.py for why one all-reduce of zero-filled tables is exact)."""
    scores = torch.zeros(num_rows, dtype=torch.float32, device=device)
    for mb in micro_batches:
        picked = last_token_scores(reward_model, mb, cp_mesh, device, whole=True)
        if contributes and mb.rows:
            scores[torch.tensor(mb.rows, device=device)] = picked.float()
    if world_size > 1:
        dist.all_reduce(scores)
    return scores.cpu()
