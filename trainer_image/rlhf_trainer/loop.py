"""The RL step, run by every trainer process under torchrun.

One step:
  1. rank 0 samples prompts and sends them (token ids) to the rollout servers, `n`
     samples per prompt; reads back token ids and logprobs (never re-tokenizes); scores
     the responses (plus DAPO's overlong penalty), and with dynamic sampling drops groups
     whose rewards are all equal and samples more prompts to refill; broadcasts the rows;
  2. every rank takes its contiguous share of rows and computes, without gradients, the
     old log-probs, the reference log-probs and the critic's values it needs; these are
     all-gathered so that every rank computes the same advantages on the whole batch
     (group statistics and batch whitening are exact whatever the number of processes);
  3. policy (and critic) updates over `algorithm.numMiniBatches` mini-batches of
     micro-batches, losses normalised by the step's global token / sequence counts;
  4. weight sync: every rank gathers full tensors, rank 0 streams them in packed buckets
     to all rollout servers (every parameter, Hugging Face names);
  5. metrics (`metrics.jsonl`), checkpoint every `schedule.saveEvery` steps.

Simplifications: with one mini-batch and no KL-in-reward or truncated IS, the old
log-probs are the current ones detached (ratio 1, the usual GRPO shortcut); sequences are
padded rather than packed; logprobs use temperature 1 (as vLLM's raw logprobs).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlhf_contract.pod import ENV_OUTPUT_DIR, ENV_RESUME, ENV_ROLLOUT_ENDPOINTS, ENV_TRAINER_CONFIG, ENV_WEIGHT_SYNC_ADDR
from rlhf_contract.trainer_config import TrainerConfig

from .algorithms.advantages import compute_advantages, gae, groups_with_signal, overlong_penalty
from .algorithms.kl import kl_penalty
from .algorithms.losses import (agg_weights, entropy_from_logits, explained_variance, ppo_token_loss,
                                truncated_is_weights, value_token_loss)
from .batch import Row, pad_rows
from .parallel.grad_norm import clip_grad_norm
from .packed import MicroBatch, critic_forward, local, plan, policy_forward, whole_row
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, save_final
from .data.prompts import PromptSource
from .distributed import DistInfo, broadcast_object, init_distributed
from .metrics import MetricsWriter
from .rewards import build_scorer

log = logging.getLogger("rlhf_trainer")


def _load_policy(path: str, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)


class Trainer:
    def __init__(self, config: TrainerConfig, info: DistInfo, *, endpoints: list[str], weight_sync_addr: str, output_dir: str):
        from transformers import AutoTokenizer

        self.spec, self.info = config, info
        a, t = self.spec.algorithm, self.spec.optim
        self.output_dir = Path(output_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.spec.model_path)
        torch.manual_seed(self.spec.schedule.seed)
        self.model = _load_policy(self.spec.model_path, info.device)
        self.ref_model = _load_policy(self.spec.model_path, info.device).eval().requires_grad_(False) if a.kl_coef > 0 else None
        self.critic = None
        if a.critic:
            from .critic import ValueModel

            self.critic = ValueModel(self.spec.model_path).to(info.device)
        p = t.parallelism
        self.dp_size = max(1, info.world_size // (t.parallelism.tensor_parallel * t.parallelism.context_parallel))
        self.cp_mesh, self.dp_rank, self.reduce_group = None, 0, None
        if info.world_size > 1:
            self._parallelize(p)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay)
        self.critic_optimizer = None
        if self.critic is not None:
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=a.critic_learning_rate or t.learning_rate,
                                                      weight_decay=t.weight_decay)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_id = self.tokenizer.eos_token_id
        self.step = 0
        self.policy_version = 0
        self.data = self.client = self.sender = self.metrics = self.env_step = None
        if info.is_main:
            from .rollout import RolloutClient
            from .weight_sync import WeightSyncSender

            self.data = PromptSource(self.spec.data, self.tokenizer, seed=self.spec.schedule.seed)
            self.scorer = build_scorer(self.spec.reward)
            if self.spec.environment is not None:
                from .rollout.multi_turn import load_environment

                self.env_step = load_environment(self.spec.environment.file)
            self.client = RolloutClient(endpoints)
            host, port = weight_sync_addr.rsplit(":", 1)
            self.sender = WeightSyncSender(endpoints, host, int(port))
            self.metrics = MetricsWriter(self.output_dir)

    def _parallelize(self, p) -> None:
        """TP -> CP -> activation checkpointing -> FSDP2 (parallel/parallelize.py) for the
        policy; the reference model and the critic are laid out on the same meshes."""
        from .parallel.context_parallel import apply_cp
        from .parallel.parallelize import apply_fsdp_summed, parallelize
        from .parallel.tensor_parallel import apply_tp

        tp, cp = p.tensor_parallel, p.context_parallel
        if tp > 1 and self.critic is not None:
            raise ValueError("trainer.parallelism.tensorParallel > 1 with algorithm.critic is not supported yet; "
                             "use tensorParallel: 1 (FSDP and context parallel work with the critic)")
        meshes = parallelize(self.model, world_size=self.info.world_size, dp_shard=self.dp_size, tp=tp, cp=cp,
                             activation_checkpointing=p.activation_checkpointing, device_type=self.info.device.type)
        for extra in (self.ref_model, self.critic):
            if extra is None:
                continue
            if tp > 1:
                apply_tp(extra, meshes.tp)
            if cp > 1:  # the critic's decoder is the Hugging Face model
                apply_cp(extra.model if extra is self.critic else extra, meshes.cp)
            if self.dp_size * cp > 1:
                apply_fsdp_summed(extra, meshes.dp_shard_cp)
        self.cp_mesh = meshes.cp if cp > 1 else None
        self.dp_rank = meshes.dp_shard.get_local_rank()
        self.reduce_group = meshes.dp_shard_cp.get_group() if self.dp_size * cp > 1 else None

    @property
    def parts(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        parts = {"policy": (self.model, self.optimizer)}
        if self.critic is not None:
            parts["critic"] = (self.critic, self.critic_optimizer)
        return parts

    # ---- 1. rollout (rank 0) ----------------------------------------------------------

    def _sample_groups(self, num_prompts: int, round_: int) -> list[list[Row]]:
        r = self.spec.sampling
        prompts = self.data.next_batch(num_prompts)
        sampling = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                    "stop_token_ids": [self.eos_id] if self.eos_id is not None else None}
        seed = (self.spec.schedule.seed * 1_000_003 + self.step) * 64 + round_
        if self.env_step is not None:
            from .rollout.multi_turn import collect

            trajectories = collect(self.client, self.env_step, self.tokenizer, prompts, n=r.samples_per_prompt,
                                   max_turns=self.spec.environment.max_turns, max_tokens=r.max_tokens,
                                   sampling=sampling, seed=seed)
            return [[Row(t.prompt_ids, t.response_ids, t.logprobs, t.reward, t.score, t.truncated, t.loss_mask)
                     for t in group] for group in trajectories]
        groups = self.client.generate_sync([p.token_ids for p in prompts], n=r.samples_per_prompt,
                                           max_tokens=r.max_tokens, seed=seed, **sampling)
        items = [(self.tokenizer.decode(s.token_ids, skip_special_tokens=True), p.answer, p.extra_info)
                 for p, samples in zip(prompts, groups) for s in samples]
        results = iter(self.scorer.score_batch(items))
        buffer = self.spec.algorithm.overlong_buffer
        out = []
        for samples in groups:
            rows = []
            for sample in samples:
                reward, score = next(results)
                if buffer:
                    reward += float(overlong_penalty(torch.tensor([len(sample.token_ids)]), r.max_tokens, buffer)[0])
                rows.append(Row(list(sample.prompt_token_ids), list(sample.token_ids), list(sample.logprobs), reward,
                                score, sample.finish_reason == "length"))
            out.append(rows)
        return out

    def _rollout(self) -> tuple[list[Row], dict[str, float]]:
        a, need = self.spec.algorithm, self.spec.schedule.prompts_per_step
        kept: list[list[Row]] = []
        dropped: list[list[Row]] = []
        sampled = 0
        for round_ in range(a.max_sampling_rounds if a.dynamic_sampling else 1):
            groups = self._sample_groups(need - len(kept), round_)
            sampled += len(groups)
            for g in groups:
                scores = torch.tensor([row.score for row in g])  # DAPO filters on accuracy, not shaped reward
                if a.dynamic_sampling and not bool(groups_with_signal(scores, len(g))[0]):
                    dropped.append(g)
                else:
                    kept.append(g)
            if len(kept) == need:
                break
        # out of rounds: fill with dropped groups (their group advantages are zero)
        kept += dropped[:need - len(kept)]
        rows = [row for g in kept for row in g]
        if self.spec.output.save_rollouts:
            self._save_rollouts(rows)
        lengths = [len(row.response_ids) for row in rows]
        stats = {
            "reward_mean": sum(r.reward for r in rows) / len(rows),
            "score_mean": sum(r.score for r in rows) / len(rows),
            "response_length_mean": sum(lengths) / len(lengths),
            "truncated_fraction": sum(r.truncated for r in rows) / len(rows),
            "dropped_group_fraction": len(dropped) / sampled,
            "num_tokens": float(sum(len(r.prompt_ids) + len(r.response_ids) for r in rows)),
        }
        return rows, stats

    def _save_rollouts(self, rows: list[Row]) -> None:
        folder = self.output_dir / "rollouts"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"step-{self.step}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps({
                    "prompt": self.tokenizer.decode(r.prompt_ids), "response": self.tokenizer.decode(r.response_ids),
                    "prompt_ids": r.prompt_ids, "response_ids": r.response_ids, "loss_mask": r.mask(),
                    "logprobs": r.rollout_logprobs, "reward": r.reward, "score": r.score, "truncated": r.truncated,
                }) + "\n")

    # ---- 2. log-probs, values, advantages (all ranks) ---------------------------------

    def _plan(self, rows: list[Row], indices: list[int]) -> list[MicroBatch]:
        cp = self.cp_mesh.size() if self.cp_mesh is not None else 1
        return plan(rows, indices, self.spec.optim.max_tokens_per_micro_batch, self.dp_size, cp)[self.dp_rank]

    def _prepare(self, rows: list[Row]) -> dict[str, torch.Tensor]:
        """Full-batch tensors [B, T]: mask, old/ref log-probs, values, advantages, returns."""
        a, info, dev = self.spec.algorithm, self.info, self.info.device
        need_old = a.num_mini_batches > 1 or (a.kl_coef > 0 and a.kl_mode == "reward") or a.tis_cap is not None
        passes = {}
        if need_old:
            passes["old_logprobs"] = lambda mb: policy_forward(self.model, mb, self.cp_mesh, dev)[1]
        if self.ref_model is not None:
            passes["ref_logprobs"] = lambda mb: policy_forward(self.ref_model, mb, self.cp_mesh, dev)[1]
        if self.critic is not None:
            passes["values"] = lambda mb: critic_forward(self.critic, mb, self.cp_mesh, dev)
        self.model.eval()
        if self.critic is not None:
            self.critic.eval()
        local: dict[str, dict[int, list[float]]] = {k: {} for k in passes}
        with torch.no_grad():
            for mb in self._plan(rows, list(range(len(rows)))):
                for name, fn in passes.items():
                    for i, values in zip(mb.rows, mb.gather(whole_row(fn(mb), self.cp_mesh))):
                        local[name][i] = values
        if info.world_size > 1 and passes:
            parts: list[Any] = [None] * info.world_size
            dist.all_gather_object(parts, local)
            for part in parts:  # tensor / context parallel peers hold identical copies
                for name in passes:
                    local[name].update(part[name])
        keys = sorted(local)
        gathered = [[local[k][i] for k in keys] for i in range(len(rows))]
        width = max(max(len(r.response_ids) for r in rows), 1)
        out = {k: pad_rows([g[j] for g in gathered], width) for j, k in enumerate(keys)}
        mask = pad_rows([r.mask() for r in rows], width)
        out["mask"] = mask
        out["rollout_logprobs"] = pad_rows([r.rollout_logprobs for r in rows], width)
        token_rewards = torch.zeros_like(mask)
        for i, r in enumerate(rows):
            if r.response_ids:
                token_rewards[i, len(r.response_ids) - 1] = r.reward
        if self.ref_model is not None and a.kl_mode == "reward":
            token_rewards = token_rewards - a.kl_coef * kl_penalty(out["old_logprobs"], out["ref_logprobs"], a.kl_estimator) * mask
        if a.advantage_estimator == "gae":
            _, out["returns"] = gae(token_rewards, out["values"], mask, a.gamma, a.lam)
        adv = compute_advantages(a.advantage_estimator, token_rewards, mask, group_size=self.spec.sampling.samples_per_prompt,
                                 values=out.get("values"), gamma=a.gamma, lam=a.lam, norm_std=a.norm_std)
        out["advantages"] = adv
        return out

    # ---- 3. updates (all ranks) -------------------------------------------------------

    def _train(self, rows: list[Row], full: dict[str, torch.Tensor]) -> dict[str, float]:
        a, dev = self.spec.algorithm, self.info.device
        per_mini = len(rows) // a.num_mini_batches
        # loss, clip*tok, approx_kl*tok, entropy, kl, tokens, value loss, padding, slots: summed over data x context ranks
        sums = torch.zeros(9, dtype=torch.float64)
        grad_norms = [0.0, 0.0]
        self.model.train()
        if self.critic is not None:
            self.critic.train()
        for k in range(a.num_mini_batches):
            base = k * per_mini
            idx = list(range(base, base + per_mini))
            mask_k = full["mask"][idx]
            width = max(max(len(rows[i].response_ids) for i in idx), 1)
            coef = agg_weights(mask_k, a.loss_agg, num_tokens=float(mask_k.sum()), num_seqs=per_mini, width=width)
            value_coef = agg_weights(mask_k, "token-mean")
            self.optimizer.zero_grad(set_to_none=True)
            if self.critic_optimizer is not None:
                self.critic_optimizer.zero_grad(set_to_none=True)
            for mb in self._plan(rows, idx):
                cp_size = self.cp_mesh.size() if self.cp_mesh is not None else 1
                sums[7] += mb.packed.num_padding / cp_size  # each CP rank counts its share of the row
                sums[8] += mb.length / cp_size

                def row_tensor(table: torch.Tensor, relative: bool = False) -> torch.Tensor:
                    values = [table[i - base if relative else i, :len(rows[i].response_ids)] for i in mb.rows]
                    return local(mb.scatter(values), self.cp_mesh, dev)

                c = row_tensor(coef, relative=True)
                m = row_tensor(full["mask"])
                logits, logp = policy_forward(self.model, mb, self.cp_mesh, dev)
                old = row_tensor(full["old_logprobs"]) if "old_logprobs" in full else logp.detach()
                token_loss, clip_active = ppo_token_loss(logp, old, row_tensor(full["advantages"]), clip_low=a.clip_low,
                                                         clip_high=a.clip_high, dual_clip=a.dual_clip)
                if a.tis_cap is not None:
                    token_loss = token_loss * truncated_is_weights(old, row_tensor(full["rollout_logprobs"]), a.tis_cap)
                loss = (token_loss * c).sum()
                entropy = entropy_from_logits(logits)
                if a.entropy_coef:
                    loss = loss - a.entropy_coef * (entropy * c).sum()
                if self.ref_model is not None:
                    kl = kl_penalty(logp, row_tensor(full["ref_logprobs"]), a.kl_estimator)
                    if a.kl_mode == "loss":
                        loss = loss + a.kl_coef * (kl * c).sum()
                    sums[4] += float((kl.detach() * m).sum())
                # gradients are SUMMED over data x context ranks: each rank's loss is its share
                loss.backward()
                sums[0] += float(loss)
                sums[1] += float((clip_active.float() * m).sum())
                sums[2] += float((0.5 * (logp.detach() - old).square() * m).sum())
                sums[3] += float((entropy.detach() * m).sum())
                sums[5] += float(m.sum())
                if self.critic is not None:
                    values = critic_forward(self.critic, mb, self.cp_mesh, dev)
                    vl, _ = value_token_loss(values, row_tensor(full["values"]), row_tensor(full["returns"]), a.value_clip)
                    vloss = (vl * row_tensor(value_coef, relative=True)).sum()
                    vloss.backward()
                    sums[6] += float(vloss)
            grad_norms[0] += self._clip_and_step(self.model, self.optimizer)
            if self.critic is not None:
                grad_norms[1] += self._clip_and_step(self.critic, self.critic_optimizer)
        if self.reduce_group is not None:
            dist.all_reduce(sums, group=self.reduce_group)
        tokens = max(float(sums[5]), 1.0)
        mask, adv = full["mask"], full["advantages"]
        n_valid = mask.sum().clamp(min=1.0)
        adv_mean = float((adv * mask).sum() / n_valid)
        metrics = {
            "loss": float(sums[0]) / a.num_mini_batches,
            "clip_fraction": float(sums[1]) / tokens,
            "approx_kl": float(sums[2]) / tokens,
            "entropy": float(sums[3]) / tokens,
            "kl": float(sums[4]) / tokens if self.ref_model is not None else None,
            "grad_norm": grad_norms[0] / a.num_mini_batches,
            "advantage_mean": adv_mean,
            "advantage_std": float((((adv - adv_mean) ** 2) * mask).sum() / n_valid) ** 0.5,
            "padding_fraction": float(sums[7]) / max(float(sums[8]), 1.0),
        }
        if self.critic is not None:
            metrics["value_loss"] = float(sums[6]) / a.num_mini_batches
            metrics["critic_grad_norm"] = grad_norms[1] / a.num_mini_batches
            metrics["explained_variance"] = float(explained_variance(full["values"], full["returns"], mask))
        return metrics

    def _clip_and_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
        norm = clip_grad_norm(model.parameters(), self.spec.optim.max_grad_norm)
        optimizer.step()
        return norm

    # ---- 4. weight sync (all ranks gather, rank 0 sends) ------------------------------

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
        state = load_checkpoint(path, self.parts)
        self.step = int(state["step"])
        self.policy_version = int(state.get("policy_version", self.step))
        if self.data is not None:
            self.data.load_state_dict(state["data"])
            self.metrics.truncate_after(self.step)
        log.info("resumed from %s (step %d)", path, self.step)

    def run_step(self) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        rows, roll = self._rollout() if self.info.is_main else (None, None)
        rows, roll = broadcast_object((rows, roll))
        t1 = time.perf_counter()
        full = self._prepare(rows)
        train = self._train(rows, full)
        t2 = time.perf_counter()
        self.policy_version += 1
        sync_s = self.sync_weights()
        step_s = time.perf_counter() - t0
        if not self.info.is_main:
            return None
        return {
            "step": self.step, **{k: v for k, v in roll.items() if k != "num_tokens"}, **train,
            "learning_rate": self.spec.optim.learning_rate, "step_seconds": step_s,
            "rollout_seconds": t1 - t0, "train_seconds": t2 - t1, "weight_sync_seconds": sync_s,
            "tokens_per_second": roll["num_tokens"] / step_s, "policy_version": self.policy_version,
        }

    def run(self) -> None:
        s = self.spec.schedule
        if self.info.is_main:
            self.client.wait_ready(300)
            self.sender.init()
        self.sync_weights()  # servers start from exactly the trainer's weights (also after a resume)
        while self.step < s.total_steps:
            self.step += 1
            row = self.run_step()
            if row is not None:
                self.metrics.write(row)
                log.info("step %d/%d reward %.3f loss %.4f %.2fs", self.step, s.total_steps, row["reward_mean"], row["loss"],
                         row["step_seconds"])
            if s.save_every and self.step % s.save_every == 0:
                self.save()
        if s.save_every:
            self.save()
        save_final(self.output_dir, self.model, self.tokenizer)
        if self.info.is_main:
            log.info("rollout requests per endpoint: %s", json.dumps(self.client.requests_sent))

    def save(self) -> None:
        state = {"policy_version": self.policy_version,
                 "data": self.data.state_dict() if self.data is not None else None}
        state = broadcast_object(state)
        save_checkpoint(self.output_dir, self.step, self.parts, state, keep=self.spec.output.keep_checkpoints)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = TrainerConfig.from_json(Path(os.environ[ENV_TRAINER_CONFIG]).read_text())
    info = init_distributed()
    try:
        endpoints = [e for e in os.environ.get(ENV_ROLLOUT_ENDPOINTS, "").split(",") if e]
        if not endpoints:
            raise SystemExit("RLHF_ROLLOUT_ENDPOINTS is empty: the trainer needs at least one rollout server")
        trainer = Trainer(config, info, endpoints=endpoints, weight_sync_addr=os.environ[ENV_WEIGHT_SYNC_ADDR],
                          output_dir=os.environ.get(ENV_OUTPUT_DIR) or config.output.dir or "/output")
        if os.environ.get(ENV_RESUME, "1") == "1":
            trainer.resume_if_possible()
        trainer.run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
