"""One offline optimizer step (and the held-out evaluation), on every trainer process:
the step's examples are planned over the data-parallel ranks and into packed
micro-batches (an example's sequences together: data/micro_batches.py), each micro-batch
gives this rank's share of the loss, and the shared `optim.step_or_skip` clips and steps.

  sft  token-mean negative log-likelihood of the response (assistant) tokens
  rm   Bradley-Terry on the scores of a value head at each sequence's last token
  dpo  DPO (or IPO) of the policy's sequence log-probs against the frozen starting model

Each micro-batch's loss is its share of the step's loss (divided by the step's token or
pair count), so FSDP's sum of gradients over ranks is the step's gradient.
"""

from __future__ import annotations

import torch

from rlhf_contract.trainer_config import TrainerConfig

from ..accumulator import MetricAccumulator
from ..data.micro_batches import MicroBatch, plan
from ..data.sequences import Row
from ..models.forward import last_token_scores, policy_forward
from ..engine import Engine
from ..optim import optimizer_step
from ..parallel.parallelize import Layout
from .data import Example
from .losses import bradley_terry_loss, dpo_loss, sft_loss_sum

METRICS = ["loss", "nll", "accuracy", "reward_margin", "chosen_reward", "rejected_reward", "chosen_logratio",
           "rejected_logratio", "grad_norm", "skipped_steps", "tokens"]


def as_rows(examples: list[Example]) -> tuple[list[Row], list[list[int]]]:
    """Rows of every sequence, and each example's row indices (planned together)."""
    rows, units = [], []
    for ex in examples:
        units.append(list(range(len(rows), len(rows) + len(ex.sequences))))
        rows += [Row(s.prompt_ids, s.response_ids, [], 0.0, 0.0, False, s.loss_mask) for s in ex.sequences]
    return rows, units


def sizes(examples: list[Example]) -> tuple[float, int]:
    """(trained tokens, examples) of a batch, at least 1 each."""
    tokens = sum(sum(s.loss_mask) for ex in examples for s in ex.sequences)
    return float(max(tokens, 1)), max(len(examples), 1)


class OfflineStep:
    def __init__(self, config: TrainerConfig, engine: Engine, ref: torch.nn.Module | None, layout: Layout,
                 device: torch.device):
        self.config, self.engine, self.model, self.ref = config, engine, engine.model, ref
        self.layout, self.device = layout, device

    def plan(self, examples: list[Example]) -> tuple[list[Row], list[MicroBatch]]:
        """This rank's micro-batches of `examples`."""
        rows, units = as_rows(examples)
        per_rank = plan(rows, units, self.config.optim.max_tokens_per_micro_batch, self.layout.dp_size)
        return rows, per_rank[self.layout.dp_rank]

    def _sequence_logps(self, model: torch.nn.Module, rows: list[Row], mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-sequence sum of trained-token log-probs [n], the token log-probs [1, L])."""
        logp, _ = policy_forward(model, mb, None, self.device, entropy="none")
        sums = [(logp[0, p.start:p.stop] * torch.tensor(rows[i].mask(), device=logp.device)).sum()
                for i, p in zip(mb.rows, (mb.positions(k) for k in range(len(mb.rows))))]
        return (torch.stack(sums) if sums else logp.new_zeros(0)), logp

    def _pairs(self, rows: list[Row], mb: MicroBatch, acc: MetricAccumulator):
        """RM / DPO: (per-pair losses, chosen and rejected rewards, a zero that keeps the
        graph of an empty micro-batch: FSDP's collectives run on every rank)."""
        pref = self.config.preference
        if self.config.method == "rm":
            picked = last_token_scores(self.model, mb, None, self.device)
            chosen, rejected = picked[0::2], picked[1::2]
            return bradley_terry_loss(chosen, rejected, pref.label_smoothing), chosen.detach(), rejected.detach(), \
                picked.sum() * 0.0
        policy, anchor_logp = self._sequence_logps(self.model, rows, mb)
        with torch.no_grad():
            ref, _ = self._sequence_logps(self.ref, rows, mb)
        losses, reward_c, reward_r = dpo_loss(policy[0::2], policy[1::2], ref[0::2], ref[1::2], beta=pref.beta,
                                              loss_type=pref.loss_type, label_smoothing=pref.label_smoothing)
        acc.add("chosen_logratio", reward_c.sum() / pref.beta, len(reward_c))
        acc.add("rejected_logratio", reward_r.sum() / pref.beta, len(reward_r))
        return losses, reward_c, reward_r, anchor_logp.sum() * 0.0

    def micro_batch_loss(self, rows: list[Row], mb: MicroBatch, acc: MetricAccumulator, *, num_tokens: float,
                         num_pairs: int) -> torch.Tensor:
        """This rank's share of the step's loss on one micro-batch (metrics into `acc`)."""
        if self.config.method == "sft":
            logp, _ = policy_forward(self.model, mb, None, self.device, entropy="none")
            mask = mb.scatter([rows[i].mask() for i in mb.rows]).to(self.device)
            nll = sft_loss_sum(logp, mask)
            acc.add("nll", nll, mask.sum())
            acc.add("tokens", mask.sum())
            return nll / num_tokens
        losses, reward_c, reward_r, anchor = self._pairs(rows, mb, acc)
        acc.add("accuracy", (reward_c > reward_r).float().sum(), len(reward_c))
        acc.add("reward_margin", (reward_c - reward_r).sum(), len(reward_c))
        acc.add("chosen_reward", reward_c.sum(), len(reward_c))
        acc.add("rejected_reward", reward_r.sum(), len(reward_r))
        acc.add("nll", losses.detach().sum(), len(losses))
        return losses.sum() / num_pairs + anchor

    def __call__(self, examples: list[Example], lr_factor: float) -> dict[str, float | None]:
        """One optimizer step on `examples` at `lr_factor` x the base learning rate."""
        acc = MetricAccumulator(METRICS, self.device)
        rows, micro = self.plan(examples)
        num_tokens, num_pairs = sizes(examples)
        self.model.train()

        def run_micro(mb, last: bool) -> None:  # gradients reduce-scattered after each micro-batch (FSDP2's default)
            loss = self.micro_batch_loss(rows, mb, acc, num_tokens=num_tokens, num_pairs=num_pairs)
            # gradients are summed over data-parallel ranks: each loss is its share
            self.engine.backward(loss, last=last)
            acc.add("loss", loss.detach())

        optimizer_step([(self.engine, "grad_norm")], micro, run_micro, max_grad_norm=self.config.optim.max_grad_norm,
                       acc=acc, lr_factor=lr_factor)
        return self.summary(acc, train=True)

    @torch.no_grad()
    def evaluate(self, held_out: list[Example]) -> dict[str, float | None]:
        """Collective: the held-out examples' loss and, for pairs, accuracy and margin."""
        acc = MetricAccumulator(METRICS, self.device)
        self.model.eval()
        size = self.config.schedule.prompts_per_step
        num_tokens, num_pairs = sizes(held_out)
        for start in range(0, len(held_out), size):
            rows, micro = self.plan(held_out[start:start + size])
            for mb in micro:
                acc.add("loss", self.micro_batch_loss(rows, mb, acc, num_tokens=num_tokens, num_pairs=num_pairs))
        return self.summary(acc, train=False)

    def summary(self, acc: MetricAccumulator, *, train: bool) -> dict[str, float | None]:
        acc.reduce(self.layout.reduce_group)
        host = acc.to_host()

        def mean(name: str) -> float | None:
            total, count = host[name]
            return total / count if count else None

        method = self.config.method
        out: dict[str, float | None] = {"loss": mean("nll") if method == "sft" else host["loss"][0]}
        if method != "sft":  # sft: the token mean over the whole batch (what the shares add up to)
            out.update({k: mean(k) for k in ("accuracy", "reward_margin", "chosen_reward", "rejected_reward")})
            if method == "dpo":
                out.update({k: mean(k) for k in ("chosen_logratio", "rejected_logratio")})
        if train:
            out["grad_norm"] = mean("grad_norm")
            out["skipped_steps"] = host["skipped_steps"][0] / self.layout.reduce_size
        return out
