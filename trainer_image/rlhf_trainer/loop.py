"""The RL step (GRPO family), run by every trainer process under torchrun.

One step:
  1. rank 0 samples prompts and sends them (token ids) to the rollout servers, `n`
     samples per prompt; reads back token ids and logprobs (never re-tokenizes);
  2. rank 0 scores responses and computes group advantages, then broadcasts the batch;
  3. every rank takes its contiguous share of rows and runs forward/backward over
     micro-batches (loss normalised by the step's global token / sequence counts, so the
     result does not depend on the number of processes or micro-batches);
  4. optimizer step(s) (`algorithm.numMiniBatches` per RL step);
  5. weight sync: every rank gathers full tensors, rank 0 streams them in packed buckets
     to all rollout servers (every parameter, Hugging Face names);
  6. metrics (`metrics.jsonl`), checkpoint every `schedule.saveEvery` steps.

Simplifications: the old log-probs of a single-mini-batch step are the current
log-probs detached (ratio = 1, as in GRPO implementations); sequences are padded rather
than packed; a reference model is loaded only when `algorithm.klCoef` > 0.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlhf_operator.api.models import RLHFJob

from .algorithms.advantages import compute_advantages
from .algorithms.kl import kl_penalty
from .algorithms.losses import agg_loss, entropy_from_logits, policy_loss
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, save_final
from .data.prompts import PromptSource
from .distributed import DistInfo, all_reduce_sum, broadcast_object, init_distributed
from .metrics import MetricsWriter
from .rewards import get_reward_fn

log = logging.getLogger("rlhf_trainer")


@dataclass
class Row:
    """One sampled sequence: prompt and response token ids, reward and advantage."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    reward: float
    advantage: float
    truncated: bool


def _load_model(path: str, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.to(device)


def pad_batch(rows: list[Row], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Prompts left-padded to a common column P, responses right-padded after it, so every
    response starts at column P. Returns input_ids, attention_mask, position_ids [b, P+T],
    response_mask [b, T] and the start column."""
    p_len = max(len(r.prompt_ids) for r in rows)
    t_len = max(max(len(r.response_ids) for r in rows), 1)
    b = len(rows)
    ids = torch.full((b, p_len + t_len), pad_id, dtype=torch.long)
    attn = torch.zeros((b, p_len + t_len), dtype=torch.long)
    resp_mask = torch.zeros((b, t_len), dtype=torch.float32)
    for i, r in enumerate(rows):
        p, t = len(r.prompt_ids), len(r.response_ids)
        ids[i, p_len - p:p_len] = torch.tensor(r.prompt_ids)
        ids[i, p_len:p_len + t] = torch.tensor(r.response_ids, dtype=torch.long)
        attn[i, p_len - p:p_len + t] = 1
        resp_mask[i, :t] = 1.0
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": ids.to(device), "attention_mask": attn.to(device), "position_ids": pos.to(device),
        "response_mask": resp_mask.to(device), "start": p_len,
    }


def response_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits [b, T, V] that predict each response token."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], use_cache=False)
    t_len = batch["response_mask"].shape[1]
    start = batch["start"]
    return out.logits[:, start - 1:start - 1 + t_len].float()


def token_logprobs(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    start, t_len = batch["start"], batch["response_mask"].shape[1]
    targets = batch["input_ids"][:, start:start + t_len]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


class Trainer:
    def __init__(self, job: RLHFJob, info: DistInfo, *, endpoints: list[str], weight_sync_addr: str, output_dir: str):
        from transformers import AutoTokenizer

        self.job, self.spec, self.info = job, job.spec, info
        self.output_dir = Path(output_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.spec.model.path)
        torch.manual_seed(self.spec.schedule.seed)
        self.model = _load_model(self.spec.model.path, info.device)
        self.ref_model = None
        if self.spec.algorithm.kl_coef > 0:
            self.ref_model = _load_model(self.spec.model.path, info.device).eval().requires_grad_(False)
        if info.world_size > 1:
            from torch.distributed.device_mesh import init_device_mesh

            from .parallel.fsdp import apply_fsdp

            mesh = init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("dp",))
            apply_fsdp(self.model, mesh)
            if self.ref_model is not None:
                apply_fsdp(self.ref_model, mesh)
        t = self.spec.trainer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay)
        self.reward_fn = get_reward_fn(self.spec.reward.type)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_id = self.tokenizer.eos_token_id
        self.step = 0
        self.policy_version = 0
        self.data = None
        self.client = self.sender = self.metrics = None
        if info.is_main:
            from .rollout import RolloutClient
            from .weight_sync import WeightSyncSender

            d = self.spec.data
            self.data = PromptSource(d.path, self.tokenizer, seed=self.spec.schedule.seed, prompt_key=d.prompt_key,
                                     answer_key=d.answer_key, max_prompt_length=d.max_prompt_length, shuffle=d.shuffle)
            self.client = RolloutClient(endpoints)
            host, port = weight_sync_addr.rsplit(":", 1)
            self.sender = WeightSyncSender(endpoints, host, int(port))
            self.metrics = MetricsWriter(self.output_dir)

    # ---- rollout (rank 0) -------------------------------------------------------------

    def _rollout(self) -> tuple[list[Row], dict[str, float]]:
        s, r = self.spec, self.spec.rollout
        prompts = self.data.next_batch(s.schedule.prompts_per_step)
        groups = self.client.generate_sync(
            [p.token_ids for p in prompts], n=r.samples_per_prompt, max_tokens=r.max_tokens,
            temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            stop_token_ids=[self.eos_id] if self.eos_id is not None else None,
            seed=s.schedule.seed * 1_000_003 + self.step,
        )
        rows, rewards = [], []
        for prompt, samples in zip(prompts, groups):
            for sample in samples:
                ids = list(sample.token_ids)
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                rewards.append(self.reward_fn(text, prompt.answer))
                rows.append(Row(list(sample.prompt_token_ids), ids, list(sample.logprobs), rewards[-1], 0.0,
                                sample.finish_reason == "length"))
        t_len = max(max(len(row.response_ids) for row in rows), 1)
        mask = torch.zeros(len(rows), t_len)
        token_rewards = torch.zeros(len(rows), t_len)
        for i, row in enumerate(rows):
            n = len(row.response_ids)
            mask[i, :n] = 1.0
            if n:
                token_rewards[i, n - 1] = row.reward
        adv = compute_advantages(self.spec.algorithm.advantage_estimator, token_rewards, mask, group_size=r.samples_per_prompt)
        for i, row in enumerate(rows):
            row.advantage = float(adv[i, 0]) if len(row.response_ids) else 0.0
        lengths = [len(row.response_ids) for row in rows]
        stats = {
            "reward_mean": sum(rewards) / len(rewards),
            "score_mean": sum(rewards) / len(rewards),
            "response_length_mean": sum(lengths) / len(lengths),
            "truncated_fraction": sum(row.truncated for row in rows) / len(rows),
            "num_tokens": float(sum(len(row.prompt_ids) + len(row.response_ids) for row in rows)),
        }
        return rows, stats

    # ---- update (all ranks) -----------------------------------------------------------

    def _train(self, rows: list[Row]) -> dict[str, float]:
        a, t, info = self.spec.algorithm, self.spec.trainer, self.info
        per_rank = len(rows) // info.world_size
        mine = rows[info.rank * per_rank:(info.rank + 1) * per_rank]
        per_mini = per_rank // a.num_mini_batches
        # [loss, clip_fraction*tok, approx_kl*tok, entropy_sum, kl_sum, tokens, grad_norm]
        sums = torch.zeros(7, dtype=torch.float64)
        self.model.train()
        for k in range(a.num_mini_batches):
            # every rank sees all rows, so the global counts of mini-batch k are local sums
            global_rows = [r for q in range(info.world_size)
                           for r in rows[q * per_rank + k * per_mini:q * per_rank + (k + 1) * per_mini]]
            num_tokens = float(sum(len(r.response_ids) for r in global_rows))
            num_seqs = float(len(global_rows))
            mini = mine[k * per_mini:(k + 1) * per_mini]
            old = self._old_logprobs(mini) if a.num_mini_batches > 1 else None
            self.optimizer.zero_grad(set_to_none=True)
            for m in range(0, len(mini), t.micro_batch_size):
                micro = mini[m:m + t.micro_batch_size]
                batch = pad_batch(micro, self.pad_id, info.device)
                mask = batch["response_mask"]
                logits = response_logits(self.model, batch)
                logp = token_logprobs(logits, batch)
                old_logp = old[m // t.micro_batch_size] if old is not None else logp.detach()
                adv = torch.tensor([r.advantage for r in micro], device=info.device).unsqueeze(-1) * mask
                loss, pg = policy_loss(logp, old_logp, adv, mask, clip_low=a.clip_low, clip_high=a.clip_high,
                                       dual_clip=a.dual_clip, agg=a.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
                tokens = float(mask.sum())
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref_logp = token_logprobs(response_logits(self.ref_model, batch), batch)
                    kl = kl_penalty(logp, ref_logp, a.kl_estimator)
                    loss = loss + a.kl_coef * agg_loss(kl, mask, a.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
                    sums[4] += float((kl.detach() * mask).sum())
                # FSDP averages gradients over ranks; the loss is already a global mean
                (loss * info.world_size).backward()
                with torch.no_grad():
                    sums[0] += float(loss)
                    sums[1] += float(pg["clip_fraction"]) * tokens
                    sums[2] += float(pg["approx_kl"]) * tokens
                    sums[3] += float((entropy_from_logits(logits.detach()) * mask).sum())
                    sums[5] += tokens
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.max_grad_norm)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            sums[6] += float(grad_norm) / info.world_size
            self.optimizer.step()
        all_reduce_sum(sums)
        tokens = max(float(sums[5]), 1.0)
        return {
            "loss": float(sums[0]) / a.num_mini_batches,
            "clip_fraction": float(sums[1]) / tokens,
            "approx_kl": float(sums[2]) / tokens,
            "entropy": float(sums[3]) / tokens,
            "kl": float(sums[4]) / tokens if self.ref_model is not None else None,
            "grad_norm": float(sums[6]) / a.num_mini_batches,
        }

    @torch.no_grad()
    def _old_logprobs(self, rows: list[Row]) -> list[torch.Tensor]:
        mb = self.spec.trainer.micro_batch_size
        out = []
        for m in range(0, len(rows), mb):
            batch = pad_batch(rows[m:m + mb], self.pad_id, self.info.device)
            out.append(token_logprobs(response_logits(self.model, batch), batch))
        return out

    # ---- weight sync (all ranks gather, rank 0 sends) ---------------------------------

    def sync_weights(self) -> float:
        start = time.perf_counter()
        params = list(self.model.named_parameters())

        def full_tensors():
            for _, p in params:
                yield (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()

        if self.info.is_main:
            metadata = [(name, list(p.shape), p.dtype) for name, p in params]
            self.sender.send(metadata, full_tensors(), weight_version=str(self.policy_version))
        else:
            for _ in full_tensors():
                pass
        dist.barrier()
        return time.perf_counter() - start

    # ---- the run ---------------------------------------------------------------------

    def resume_if_possible(self) -> None:
        path = latest_checkpoint(self.output_dir)
        if path is None:
            return
        state = load_checkpoint(path, self.model, self.optimizer)
        self.step = int(state["step"])
        self.policy_version = int(state.get("policy_version", self.step))
        if self.data is not None:
            self.data.load_state_dict(state["data"])
            self.metrics.truncate_after(self.step)
        log.info("resumed from %s (step %d)", path, self.step)

    def run(self) -> None:
        s = self.spec.schedule
        if self.info.is_main:
            self.client.wait_ready(300)
            self.sender.init()
        self.sync_weights()  # servers start from exactly the trainer's weights (also after a resume)
        while self.step < s.total_steps:
            self.step += 1
            t0 = time.perf_counter()
            rows, roll = self._rollout() if self.info.is_main else (None, None)
            rows, roll = broadcast_object((rows, roll))
            t1 = time.perf_counter()
            train = self._train(rows)
            t2 = time.perf_counter()
            self.policy_version += 1
            sync_s = self.sync_weights()
            step_s = time.perf_counter() - t0
            if self.info.is_main:
                row = {
                    "step": self.step, **{k: v for k, v in roll.items() if k != "num_tokens"}, **train,
                    "learning_rate": self.spec.trainer.learning_rate, "step_seconds": step_s,
                    "rollout_seconds": t1 - t0, "train_seconds": t2 - t1, "weight_sync_seconds": sync_s,
                    "tokens_per_second": roll["num_tokens"] / step_s, "policy_version": self.policy_version,
                }
                self.metrics.write(row)
                log.info("step %d/%d reward %.3f loss %.4f %.2fs", self.step, s.total_steps, row["reward_mean"], row["loss"], step_s)
            if s.save_every and self.step % s.save_every == 0 and self.step < s.total_steps:
                self.save()
        if s.save_every:
            self.save()
        save_final(self.output_dir, self.model, self.tokenizer)

    def save(self) -> None:
        state = {"policy_version": self.policy_version,
                 "data": self.data.state_dict() if self.data is not None else None}
        state = broadcast_object(state)
        save_checkpoint(self.output_dir, self.step, self.model, self.optimizer, state,
                        keep=self.spec.output.keep_checkpoints)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    job = RLHFJob.model_validate(json.loads(Path(os.environ["RLHF_JOB_CONFIG"]).read_text()))
    info = init_distributed()
    try:
        endpoints = [e for e in os.environ.get("RLHF_ROLLOUT_ENDPOINTS", "").split(",") if e]
        if not endpoints:
            raise SystemExit("RLHF_ROLLOUT_ENDPOINTS is empty: the trainer needs at least one rollout server")
        trainer = Trainer(job, info, endpoints=endpoints, weight_sync_addr=os.environ["RLHF_WEIGHT_SYNC_ADDR"],
                          output_dir=os.environ.get("RLHF_OUTPUT_DIR") or job.spec.output.dir or "/output")
        if os.environ.get("RLHF_RESUME", "1") == "1":
            trainer.resume_if_possible()
        trainer.run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
