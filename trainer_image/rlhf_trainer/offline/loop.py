"""The run loop of the offline methods (`method: sft | rm | dpo`), on every trainer process.

Each step takes `schedule.promptsPerStep` examples (a pure function of the step, so a
resume needs no data state), packs them over the data-parallel ranks and into
micro-batches of `trainer.maxTokensPerMicroBatch` tokens (a preference pair's two
sequences always in the same micro-batch), and makes one optimizer step:

  sft  token-mean negative log-likelihood of the response (assistant) tokens
  rm   Bradley-Terry on the scores of a value head at each sequence's last token; the
       model is exported as a Hugging Face sequence classifier (`score` head, 1 label)
  dpo  DPO (or IPO) of the policy's sequence log-probs against the frozen starting model

Same parts as RL: the model loading and parallel layouts (FSDP2, TP for sft and dpo), the
packed per-document attention, the chunked (vocabulary-parallel) log-prob head, gradient
clipping, the LR schedule, DCP checkpoints, `metrics.jsonl` and Prometheus, progress on
the job's status, the final export. Held-out examples (`data.evalFraction`) are scored at
the start, every `schedule.evalEvery` steps and at the end (`eval_*` keys).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from rlhf_contract.trainer_config import TrainerConfig

from ..checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, save_final
from ..data.balanced_packing import balanced_micro_batches, pack
from ..distributed import DistInfo
from ..models.loading import empty_causal_lm, fill_from_checkpoint, load_causal_lm, stored_dtype
from ..orchestrator.types import Row
from ..parallel.grad_norm import clip_grad_norm
from ..parallel.parallelize import Layout, parallelize_models
from ..train.lr_schedule import lr_factor
from ..train.metrics import MetricAccumulator
from ..train.micro_batches import MicroBatch, _model_inputs, attach_logprob_head, policy_forward
from ..train.step import _scale_lr, _set_gradient_sync
from .data import Example, OfflineData
from .losses import bradley_terry_loss, dpo_loss, sft_loss_sum

log = logging.getLogger("rlhf_trainer")

METRICS = ["loss", "nll", "accuracy", "reward_margin", "chosen_reward", "rejected_reward", "chosen_logratio",
           "rejected_logratio", "grad_norm", "skipped_steps", "tokens"]


class ScoreModel(torch.nn.Module):
    """A decoder and a linear `score` head: hidden state -> one scalar per position.
    Parameter names (`model.*`, `score.weight`) are those of Hugging Face's
    `*ForSequenceClassification`, whose config it carries, so the export loads as one."""

    def __init__(self, path: str, pad_token_id: int | None, *, require_head: bool = False):
        super().__init__()
        from transformers import AutoModelForSequenceClassification

        classifier, info = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=torch.float32, output_loading_info=True)
        if not hasattr(classifier, "score"):
            raise ValueError(f"model.path: {type(classifier).__name__} has no `score` head; method rm supports "
                             "decoder families with one (Qwen2, Llama, Mistral, ...)")
        self.config = classifier.config
        if self.config.pad_token_id is None:  # Hugging Face pools at the last non-padding token
            self.config.pad_token_id = pad_token_id
        self.config.architectures = [type(classifier).__name__]
        self.model, self.score = classifier.model, classifier.score
        if any(k.startswith("score.") for k in info["missing_keys"]):  # a new head (not a reward model's)
            if require_head:
                raise ValueError(f"reward.model.path: {path} has no trained score head: not a reward model "
                                 "(train one with method: rm)")
            torch.nn.init.zeros_(self.score.weight)  # scores start at 0, equal on every rank
        self._rlhf_export_dtype = stored_dtype(path)

    def set_attn_implementation(self, name: str) -> None:
        self.model.set_attn_implementation(name)

    def activation_checkpointing_enable(self, kwargs: dict) -> None:
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs).last_hidden_state
        return self.score(hidden).squeeze(-1).float()


def build_offline_models(config: TrainerConfig, info: DistInfo, pad_token_id: int | None
                         ) -> tuple[torch.nn.Module, torch.nn.Module | None, Layout]:
    """(trained model, frozen reference for DPO, layout)."""
    p = config.optim.parallelism
    sharded = info.world_size > 1 or info.device.type == "cuda"
    if config.method == "rm":
        model, ref = ScoreModel(config.model_path, pad_token_id).to(info.device), None
    else:
        new = empty_causal_lm if sharded else (lambda path, dtype: load_causal_lm(path, info.device, dtype))
        model = new(config.model_path, torch.float32)
        ref_dtype = torch.bfloat16 if info.device.type == "cuda" else torch.float32
        ref = new(config.model_path, ref_dtype).eval().requires_grad_(False) if config.method == "dpo" else None
    layout = parallelize_models(model, ref=ref, critic=None, world_size=info.world_size, tp=p.tensor_parallel,
                                cp=1, activation_checkpointing=p.activation_checkpointing,
                                device_type=info.device.type)
    if config.method != "rm":
        for m in (model, ref):
            if m is not None:
                if sharded:
                    fill_from_checkpoint(m, config.model_path, info.device)
                attach_logprob_head(m)
    return model, ref, layout


def plan_examples(examples: list[Example], budget: int, dp_size: int) -> tuple[list[Row], list[list[MicroBatch]]]:
    """Rows of every sequence, and each data-parallel rank's micro-batches; an example's
    sequences are packed next to each other in one micro-batch."""
    rows, units = [], []
    for ex in examples:
        units.append(list(range(len(rows), len(rows) + len(ex.sequences))))
        rows += [Row(s.prompt_ids, s.response_ids, [], 0.0, 0.0, False, s.loss_mask) for s in ex.sequences]
    lengths = [sum(len(rows[i].prompt_ids) + len(rows[i].response_ids) for i in u) for u in units]
    out = []
    for rank_batches in balanced_micro_batches(lengths, budget, dp_size):
        micro = []
        for mb in rank_batches:
            chosen = [i for j in mb for i in units[j]]
            seqs = [rows[i].prompt_ids + rows[i].response_ids for i in chosen]
            starts, offset = [], 0
            for s in seqs:
                starts.append(offset)
                offset += len(s)
            micro.append(MicroBatch(chosen, pack(seqs), starts, [len(rows[i].prompt_ids) for i in chosen],
                                    [len(rows[i].response_ids) for i in chosen]))
        out.append(micro)
    return rows, out


class OfflineLoop:
    def __init__(self, config: TrainerConfig, info: DistInfo, *, output_dir: str):
        from transformers import AutoTokenizer

        self.config, self.info = config, info
        self.output_dir = Path(output_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        torch.manual_seed(config.schedule.seed)
        o, s = config.optim, config.schedule
        self.data = OfflineData(config.method, config.data, self.tokenizer, seed=s.seed,
                                batch_size=s.prompts_per_step, budget=o.max_tokens_per_micro_batch)
        self.model, self.ref, self.layout = build_offline_models(config, info, self.tokenizer.pad_token_id)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.learning_rate, weight_decay=o.weight_decay)
        self.step = 0
        self.metrics = self.progress = None
        if info.is_main:
            from ..metrics import MetricsWriter
            from ..progress import ProgressReporter

            self.metrics = MetricsWriter(self.output_dir)
            self.progress = ProgressReporter.from_config(config)

    @property
    def parts(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        return {"policy": (self.model, self.optimizer)}

    def resume_if_possible(self) -> None:
        path = latest_checkpoint(self.output_dir)
        if path is None:
            return
        self.step = int(load_checkpoint(path, self.parts)["step"])
        if self.metrics is not None:
            self.metrics.truncate_after(self.step)
        log.info("resumed from %s (step %d)", path, self.step)

    # ---- forward passes -----------------------------------------------------------------

    def _sequence_logps(self, model: torch.nn.Module, rows: list[Row], mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-sequence sum of trained-token log-probs [n], the token log-probs [1, L])."""
        logp, _ = policy_forward(model, mb, None, self.info.device)
        sums = [(logp[0, p.start:p.stop] * torch.tensor(rows[i].mask(), device=logp.device)).sum()
                for i, p in zip(mb.rows, (mb.positions(k) for k in range(len(mb.rows))))]
        return (torch.stack(sums) if sums else logp.new_zeros(0)), logp

    def _micro_batch(self, rows: list[Row], mb: MicroBatch, acc: MetricAccumulator, *, num_tokens: float,
                     num_pairs: int) -> torch.Tensor:
        """This rank's share of the step's loss on one micro-batch (metrics into `acc`)."""
        method, dev, pref = self.config.method, self.info.device, self.config.preference
        if method == "sft":
            logp, _ = policy_forward(self.model, mb, None, dev)
            mask = mb.scatter([rows[i].mask() for i in mb.rows]).to(dev)
            nll = sft_loss_sum(logp, mask)
            acc.add("nll", nll, mask.sum())
            acc.add("tokens", mask.sum())
            return nll / num_tokens
        if method == "rm":
            scores = self.model(**_model_inputs(mb, None, dev))[0]
            last = [mb.starts[k] + mb.prompt_lengths[k] + mb.response_lengths[k] - 1 for k in range(len(mb.rows))]
            picked = scores[torch.tensor(last, dtype=torch.long, device=dev)] if last else scores[:0]
            chosen, rejected = picked[0::2], picked[1::2]
            losses = bradley_terry_loss(chosen, rejected, pref.label_smoothing)
            reward_c, reward_r = chosen.detach(), rejected.detach()
            anchor = scores.sum() * 0.0  # an empty micro-batch still runs backward (FSDP collectives)
        else:
            policy, anchor_logp = self._sequence_logps(self.model, rows, mb)
            with torch.no_grad():
                ref, _ = self._sequence_logps(self.ref, rows, mb)
            losses, reward_c, reward_r = dpo_loss(policy[0::2], policy[1::2], ref[0::2], ref[1::2], beta=pref.beta,
                                                  loss_type=pref.loss_type, label_smoothing=pref.label_smoothing)
            acc.add("chosen_logratio", reward_c.sum() / pref.beta, len(reward_c))
            acc.add("rejected_logratio", reward_r.sum() / pref.beta, len(reward_r))
            anchor = anchor_logp.sum() * 0.0
        acc.add("accuracy", (reward_c > reward_r).float().sum(), len(reward_c))
        acc.add("reward_margin", (reward_c - reward_r).sum(), len(reward_c))
        acc.add("chosen_reward", reward_c.sum(), len(reward_c))
        acc.add("rejected_reward", reward_r.sum(), len(reward_r))
        acc.add("nll", losses.detach().sum(), len(losses))
        return losses.sum() / num_pairs + anchor

    def _plan(self, examples: list[Example]) -> tuple[list[Row], list[MicroBatch]]:
        rows, per_rank = plan_examples(examples, self.config.optim.max_tokens_per_micro_batch, self.layout.dp_size)
        return rows, per_rank[self.layout.dp_rank]

    @staticmethod
    def _sizes(examples: list[Example]) -> tuple[float, int]:
        tokens = sum(sum(s.loss_mask) for ex in examples for s in ex.sequences)
        return float(max(tokens, 1)), max(len(examples), 1)

    # ---- steps ----------------------------------------------------------------------------

    def train_step(self, examples: list[Example]) -> dict[str, float | None]:
        acc = MetricAccumulator(METRICS, self.info.device)
        rows, micro = self._plan(examples)
        num_tokens, num_pairs = self._sizes(examples)
        self.model.train()
        o = self.config.optim
        _scale_lr([self.optimizer], lr_factor(self.step - 1, total=self.config.schedule.total_steps,
                                              warmup=o.warmup_steps, kind=o.lr_scheduler,
                                              min_ratio=o.min_learning_rate_ratio))
        self.optimizer.zero_grad(set_to_none=True)
        for j, mb in enumerate(micro):
            _set_gradient_sync([self.model], j == len(micro) - 1)
            loss = self._micro_batch(rows, mb, acc, num_tokens=num_tokens, num_pairs=num_pairs)
            loss.backward()  # FSDP sums gradients over data-parallel ranks: each loss is its share
            acc.add("loss", loss.detach())
        norm = clip_grad_norm(self.model.parameters(), o.max_grad_norm)
        if bool(torch.isfinite(norm)):
            self.optimizer.step()
            acc.add("grad_norm", norm)
        else:
            self.optimizer.zero_grad(set_to_none=True)
            acc.add("skipped_steps", 1.0)
        return self._summary(acc, train=True)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float | None]:
        """Collective: the held-out examples' loss and, for pairs, accuracy and margin."""
        held_out = self.data.eval
        if not held_out:
            return {}
        acc = MetricAccumulator(METRICS, self.info.device)
        self.model.eval()
        size = self.config.schedule.prompts_per_step
        num_tokens, num_pairs = self._sizes(held_out)
        for start in range(0, len(held_out), size):
            rows, micro = self._plan(held_out[start:start + size])
            for mb in micro:
                acc.add("loss", self._micro_batch(rows, mb, acc, num_tokens=num_tokens, num_pairs=num_pairs))
        return {f"eval_{k}": v for k, v in self._summary(acc, train=False).items()}

    def _summary(self, acc: MetricAccumulator, *, train: bool) -> dict[str, float | None]:
        acc.reduce(self.layout.reduce_group)
        host = acc.to_host()

        def mean(name: str) -> float | None:
            total, count = host[name]
            return total / count if count else None

        out: dict[str, float | None] = {"loss": host["loss"][0] / (1 if train else 1)}
        if self.config.method == "sft":
            out["loss"] = mean("nll")  # token mean over the whole batch (what the shares add up to)
        else:
            out.update({k: mean(k) for k in ("accuracy", "reward_margin", "chosen_reward", "rejected_reward")})
            if self.config.method == "dpo":
                out.update({k: mean(k) for k in ("chosen_logratio", "rejected_logratio")})
        if train:
            n = self.layout.reduce_size
            out["grad_norm"] = mean("grad_norm")
            out["skipped_steps"] = host["skipped_steps"][0] / n
        return out

    # ---- the loop -------------------------------------------------------------------------

    def save(self) -> None:
        save_checkpoint(self.output_dir, self.step, self.parts, {"method": self.config.method},
                        keep=self.config.output.keep_checkpoints)

    def run(self) -> None:
        s = self.config.schedule
        last_eval = self.evaluate() if self.step == 0 else {}
        try:
            while self.step < s.total_steps:
                self.step += 1
                start = time.perf_counter()
                examples = self.data.batch(self.step)
                row: dict[str, Any] = {"step": self.step, **self.train_step(examples)}
                seconds = time.perf_counter() - start
                o = self.config.optim
                row["learning_rate"] = o.learning_rate * lr_factor(
                    self.step - 1, total=s.total_steps, warmup=o.warmup_steps, kind=o.lr_scheduler,
                    min_ratio=o.min_learning_rate_ratio)
                tokens = sum(seq.length for ex in examples for seq in ex.sequences)
                row.update(step_seconds=seconds, tokens_per_second=tokens / seconds, num_examples=len(examples),
                           dropped_examples=self.data.num_dropped)
                if self.step == s.total_steps or (s.eval_every and self.step % s.eval_every == 0):
                    last_eval = self.evaluate()
                row.update(last_eval if (self.step == 1 or self.step == s.total_steps
                                         or (s.eval_every and self.step % s.eval_every == 0)) else {})
                if s.save_every and self.step % s.save_every == 0:
                    self.save()
                if self.metrics is not None:
                    self.metrics.write(row)
                    newest = latest_checkpoint(self.output_dir)
                    self.progress.report(self.step, last_checkpoint=str(newest) if newest is not None else None)
                    log.info("step %d/%d loss %.4f%s %.2fs", self.step, s.total_steps, row["loss"],
                             f" accuracy {row['accuracy']:.3f}" if row.get("accuracy") is not None else "", seconds)
            if s.save_every:
                self.save()
            save_final(self.output_dir, self.model, self.tokenizer)
        finally:
            if self.progress is not None:
                self.progress.close()
