"""The train step, run by every trainer process on the same `RolloutBatch`:

  prepare(batch)           no-grad passes and advantages -> StepTensors
  __call__(batch, t, lr)   `algorithm.numMiniBatches` optimizer steps, each over this rank's
                           packed micro-batches (micro_step), then clip and step
  micro_step(...)          one forward/backward; the loss comes from `compose_loss`

Loss convention: every per-token term is weighted by the aggregation coefficients of
`algorithms.losses.agg_weights`, computed on the WHOLE mini-batch, so summing the
micro-batch losses of all data x context ranks gives the mini-batch loss; FSDP sums
gradients over those ranks (`parallel/parallelize.py`). Metrics accumulate on the device
(`MetricAccumulator`) and are reduced and read once per step. Gradients are reduce-scattered after every
micro-batch (FSDP2's default): the unsharded fp32 gradients of the whole model never
stay on a GPU between micro-batches. A non-finite gradient norm skips that optimizer
step (counted as `skipped_steps`); the caller then skips the weight sync.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlhf_contract.api.models import AlgorithmSpec, DistillationSpec

from ..accumulator import MetricAccumulator
from ..algorithms.losses import agg_weights, compose_loss, explained_variance, sequence_means, value_token_loss
from ..data.micro_batches import MicroBatch, plan
from ..data.sequences import Row
from ..models.forward import critic_forward, local, policy_forward, whole_row
from ..optim import optimizer_step
from ..orchestrator.types import RolloutBatch
from ..parallel.parallelize import Layout
from .models import Models
from .reward_model import ModelRewards, reward_model_scores
from .tensors import StepTensors, build_step_tensors, gather_passes, needs_old_logprobs

METRICS = ["loss", "clip_fraction", "approx_kl", "entropy", "kl", "value_loss", "padding", "grad_norm",
           "critic_grad_norm", "skipped_steps"]


class TrainStep:
    def __init__(self, algorithm: AlgorithmSpec, models: Models, layout: Layout, *, max_tokens_per_micro_batch: int,
                 max_grad_norm: float, temperature: float, device: torch.device, reward_model_weight: float = 1.0,
                 distillation: DistillationSpec | None = None):
        self.a, self.m, self.layout, self.distillation = algorithm, models, layout, distillation
        self.reward_model_weight = reward_model_weight
        self.budget, self.max_grad_norm, self.temperature, self.device = (
            max_tokens_per_micro_batch, max_grad_norm, temperature, device)

    def _plan(self, rows: list[Row], indices: list[int]) -> list[MicroBatch]:
        lay = self.layout
        return plan(rows, indices, self.budget, lay.dp_size, lay.cp_size)[lay.dp_rank]

    def _mini_batches(self, n: int) -> list[list[int]]:
        """The rows of each mini-batch (contiguous slices; rows past the last whole one, if
        any, in a list of their own). The no-grad passes plan their micro-batches per
        mini-batch as the updates do, so a sequence's old and reference log-probs come from
        the same packed micro-batch as its log-prob in the update: equal weights then give
        bit-equal log-probs (ratio exactly 1 and KL exactly 0 at the first micro-step).
        Packed differently, the head's matmul over another number of rows may round
        differently, and Adam turns such 1e-8 gradients into learning-rate-sized updates."""
        per = n // self.a.num_mini_batches
        slices = [list(range(k * per, (k + 1) * per)) for k in range(self.a.num_mini_batches)] if per else []
        return slices + ([list(range(per * self.a.num_mini_batches, n))] if per * self.a.num_mini_batches < n else [])

    # ---- no-grad passes and advantages ------------------------------------------------

    def prepare(self, batch: RolloutBatch) -> StepTensors:
        m, dev, cp = self.m, self.device, self.layout.cp_mesh
        passes = {}
        if needs_old_logprobs(self.a, distill=self.distillation is not None):
            passes["old_logprobs"] = lambda mb: policy_forward(m.policy, mb, cp, dev, self.temperature, "none")[0]
        if m.ref is not None:
            passes["ref_logprobs"] = lambda mb: policy_forward(m.ref, mb, cp, dev, self.temperature, "none")[0]
        if m.teacher is not None:  # at the sampling temperature, as the student's
            passes["teacher_logprobs"] = lambda mb: policy_forward(m.teacher, mb, cp, dev, self.temperature, "none")[0]
        if m.critic is not None:
            passes["values"] = lambda mb: critic_forward(m.critic, mb, cp, dev)
        m.policy.eval()
        if m.critic is not None:
            m.critic.eval()
        micro = [mb for idx in self._mini_batches(len(batch.rows)) for mb in self._plan(batch.rows, idx)]
        rewards, reward_metrics = [r.reward for r in batch.rows], {}
        if m.reward_model is not None:  # the learned reward joins the rewards before advantages
            scores = reward_model_scores(m.reward_model, len(batch.rows), micro, cp, self.layout.world_size,
                                         contributes=self.layout.owns_rows, device=dev)
            model_rewards = ModelRewards(scores, self.reward_model_weight)
            rewards, reward_metrics = model_rewards.total(rewards), model_rewards.metrics(rewards)
        tables = gather_passes(batch.rows, micro, passes, cp, self.layout.world_size,
                               contributes=self.layout.owns_rows, device=dev)
        tensors = build_step_tensors(batch.rows, tables, self.a, batch.group_size, rewards, self.distillation)
        tensors.reward_metrics.update(reward_metrics)
        return tensors

    # ---- updates ----------------------------------------------------------------------

    def __call__(self, batch: RolloutBatch, t: StepTensors,
                 lr_factor: Callable[[int], float] | None = None) -> dict[str, float | None]:
        """The step's updates; `lr_factor(k)` scales each optimizer's base learning rate
        (`initial_lr` of its parameter groups) at the step's k-th optimizer step."""
        a, m, rows = self.a, self.m, batch.rows
        acc = MetricAccumulator(METRICS, self.device)
        per_mini = len(rows) // a.num_mini_batches  # the slices of _mini_batches
        m.policy.train()
        if m.critic is not None:
            m.critic.train()
        parts = [(m.engine, "grad_norm")] + ([(m.critic_engine, "critic_grad_norm")] if m.critic_engine else [])
        for k in range(a.num_mini_batches):
            idx = list(range(k * per_mini, (k + 1) * per_mini))
            mask_k = t.mask[idx]
            width = max(max(len(rows[i].response_ids) for i in idx), 1)
            coef = agg_weights(mask_k, a.loss_agg, num_tokens=float(mask_k.sum()), num_seqs=per_mini, width=width)
            value_coef = agg_weights(mask_k, "token-mean")

            def run_micro(mb, last: bool, idx=idx, coef=coef, value_coef=value_coef) -> None:
                # FSDP reduce-scatters each micro-batch's gradients
                self.micro_step(rows, t, mb, coef, value_coef, base=idx[0], acc=acc, last=last)

            optimizer_step(parts, self._plan(rows, idx), run_micro, max_grad_norm=self.max_grad_norm, acc=acc,
                           lr_factor=lr_factor(k) if lr_factor is not None else None)
        acc.reduce(self.layout.reduce_group)
        host = acc.to_host()
        tokens = max(host["clip_fraction"][1], 1.0)

        def per_token(name: str) -> float:
            return host[name][0] / tokens

        mask, adv = t.mask, t.advantages
        n_valid = mask.sum().clamp(min=1.0)
        adv_mean = float((adv * mask).sum() / n_valid)
        out: dict[str, float | None] = {
            "loss": host["loss"][0] / a.num_mini_batches,
            "clip_fraction": per_token("clip_fraction"),
            "approx_kl": per_token("approx_kl"),
            "entropy": per_token("entropy"),
            "kl": per_token("kl") if m.ref is not None else None,
            # the optimizer-step metrics are the same on every rank: undo the reduction's sum
            "grad_norm": host["grad_norm"][0] / max(host["grad_norm"][1], 1.0),
            "skipped_steps": host["skipped_steps"][0] / self.layout.reduce_size,
            "advantage_mean": adv_mean,
            "advantage_std": float((((adv - adv_mean) ** 2) * mask).sum() / n_valid) ** 0.5,
            "padding_fraction": host["padding"][0] / max(host["padding"][1], 1.0),
        }
        if m.critic is not None:
            out["value_loss"] = host["value_loss"][0] / a.num_mini_batches
            out["critic_grad_norm"] = host["critic_grad_norm"][0] / max(host["critic_grad_norm"][1], 1.0)
            out["explained_variance"] = float(explained_variance(t.values, t.returns, mask))
        return out

    def micro_step(self, rows: list[Row], t: StepTensors, mb: MicroBatch, coef: torch.Tensor,
                   value_coef: torch.Tensor, *, base: int, acc: MetricAccumulator, last: bool = True) -> None:
        """One forward/backward of the policy (and the critic) on one packed micro-batch
        (`last`: the optimizer step's last, DeepSpeed's accumulation boundary)."""
        a, m, dev, cp_mesh = self.a, self.m, self.device, self.layout.cp_mesh
        cp = self.layout.cp_size
        acc.add("padding", mb.packed.num_padding / cp, mb.length / cp)  # each CP rank counts its share

        def per_token(table: torch.Tensor, relative: bool = False) -> torch.Tensor:
            values = [table[i - base if relative else i, :len(rows[i].response_ids)] for i in mb.rows]
            return local(mb.scatter(values), cp_mesh, dev)

        c, mask = per_token(coef, relative=True), per_token(t.mask)
        logp, entropy = policy_forward(m.policy, mb, cp_mesh, dev, self.temperature,
                                       "grad" if a.entropy_coef else "value")
        old = per_token(t.old_logprobs) if t.old_logprobs is not None else logp.detach()
        seq_log_ratio = None
        if a.policy_loss == "gspo":  # each sequence's mean of logp - old, over its tokens on every CP rank
            whole = whole_row(logp.detach() - old, cp_mesh).cpu()
            segments = [mb.positions(k) for k in range(len(mb.rows))]
            seq_log_ratio = local(sequence_means(whole, mb.scatter([t.mask[i, :len(rows[i].response_ids)]
                                                                    for i in mb.rows]), segments), cp_mesh, dev)
        loss, terms = compose_loss(
            a, logp=logp, entropy=entropy, old=old, advantages=per_token(t.advantages), coef=c,
            ref=per_token(t.ref_logprobs) if t.ref_logprobs is not None else None,
            correction=per_token(t.correction) if t.correction is not None else None, seq_log_ratio=seq_log_ratio)
        m.engine.backward(loss, last=last)  # gradients are SUMMED over data x context ranks: each loss is a share
        num_tokens = mask.sum()
        acc.add("loss", loss)
        acc.add("clip_fraction", (terms.clip_active.float() * mask).sum(), num_tokens)
        acc.add("approx_kl", (0.5 * (logp.detach() - old).square() * mask).sum(), num_tokens)
        acc.add("entropy", (entropy.detach() * mask).sum(), num_tokens)
        if terms.kl is not None:
            acc.add("kl", (terms.kl.detach() * mask).sum(), num_tokens)
        if m.critic is not None:
            values = critic_forward(m.critic, mb, cp_mesh, dev)
            vl, _ = value_token_loss(values, per_token(t.values), per_token(t.returns), a.value_clip)
            vloss = (vl * per_token(value_coef, relative=True)).sum()
            m.critic_engine.backward(vloss, last=last)
            acc.add("value_loss", vloss)
