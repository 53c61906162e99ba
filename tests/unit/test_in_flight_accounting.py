"""Exactly-once accounting with in-flight weight updates: the real orchestrator (data source,
sampler, rollout client) generates ahead on the prefetch thread (maxStaleness 2) against a
real CPU engine, while this test plays the trainer: take a batch, "train", push new weights
with pause mode "keep" (the real sender), so updates land while the next batches'
responses are being generated. Every prompt the data source handed out is trained once, in
order, with all its samples; none is dropped or sent twice; responses that spanned an
update carry both versions, and no token lags more than k versions.

Partial rollouts (orchestrator/partial.py): the same parts with the pool of groups kept
generating; responses up to 64 tokens have long-tailed lengths (the untrained model ends
with EOS at a roughly constant rate), so groups finish out of order and a step takes the
first ones to complete while the longest go on into later steps; every prompt is trained
once, and a run checkpointed mid-way and resumed trains exactly the prompts left."""

from __future__ import annotations

import time

import httpx
import torch
from helpers import free_port, hf_causal_lm
from transformers import AutoTokenizer

from rlhf_contract.api import validate_job
from rlhf_contract.trainer_config import TrainerConfig
from rlhf_trainer.data.prompts import PromptSource
from rlhf_trainer.orchestrator.orchestrator import Orchestrator
from rlhf_trainer.orchestrator.partial import PartialPrefetcher, supports_partial
from rlhf_trainer.orchestrator.prefetch import Prefetcher
from rlhf_trainer.orchestrator.sampler import Sampler
from rlhf_trainer.rewards import build_reward
from rlhf_trainer.rollout import RolloutClient
from rlhf_trainer.weight_sync import WeightSyncSender

STEPS, PROMPTS, N, K = 6, 4, 2, 2


def config(model_dir, maxTokens=48) -> TrainerConfig:
    return TrainerConfig.from_job(validate_job({
        "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "inflight"},
        "spec": {"model": {"path": str(model_dir)}, "data": {"path": "builtin://last-digit", "maxPromptLength": 24},
                 "reward": {"type": "exact_match"},
                 "rollout": {"engine": "cpu", "samplesPerPrompt": N, "maxTokens": maxTokens, "maxStaleness": K,
                             "inFlightUpdates": True},
                 "schedule": {"totalSteps": STEPS, "promptsPerStep": PROMPTS, "saveEvery": 0}}}))


class RecordingSource(PromptSource):
    """The real data source, remembering every prompt it handed out."""

    handed_out: list[list[int]]

    def next_batch(self, n):
        batch = super().next_batch(n)
        self.handed_out = getattr(self, "handed_out", []) + [list(r.token_ids) for r in batch]
        return batch


def test_each_sample_is_trained_once_across_in_flight_updates(tiny_model_dir, start_engines, tmp_path):
    cfg = config(tiny_model_dir)
    assert cfg.sampling.weight_update_pause_mode == "keep"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = hf_causal_lm(tiny_model_dir)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    meta = [(n, list(t.shape), t.dtype) for n, t in params.items()]
    with start_engines(tiny_model_dir, 1) as (url,):
        data = RecordingSource(cfg.data, tokenizer, seed=0)
        client = RolloutClient([url], timeout_s=120)
        orch = Orchestrator(cfg, data=data, sampler=Sampler(cfg, client, build_reward(cfg.reward), tokenizer),
                            output_dir=tmp_path)
        sender = WeightSyncSender([url], "127.0.0.1", free_port(), bucket_bytes=1 << 16, timeout_s=60,
                                  pause_mode=cfg.sampling.weight_update_pause_mode)
        served = {"v": 0}
        taken = []
        try:
            sender.init()
            sender.send(meta, iter(params.values()), weight_version="0")
            requests_before = httpx.get(url + "/stats").json()["num_requests"]
            pre = Prefetcher(orch, max_staleness=K, first_step=1, last_step=STEPS, served_version=lambda: served["v"])
            for step in range(1, STEPS + 1):
                batch = pre.take(step)
                taken.append(batch)
                time.sleep(0.1)  # "train"
                for p in params.values():  # the new policy
                    p.add_(torch.randn_like(p) * 0.05)
                sender.send(meta, iter(params.values()), weight_version=str(step))
                served["v"] = step
            pre.close()
            requests = httpx.get(url + "/stats").json()["num_requests"] - requests_before
        finally:
            sender.close()
            orch.close()
    # every prompt handed out was trained once, in order, with all of its samples
    trained = [batch.rows[g * N].prompt_ids for batch in taken for g in range(PROMPTS)]
    assert trained == data.handed_out and len(trained) == STEPS * PROMPTS
    for batch in taken:
        assert len(batch.rows) == PROMPTS * N
        for g in range(PROMPTS):
            assert len({tuple(r.prompt_ids) for r in batch.rows[g * N:(g + 1) * N]}) == 1
    assert requests == STEPS * PROMPTS  # one request per prompt: none re-sent, none lost
    assert orch.requests_sent == {url: STEPS * PROMPTS}
    # per token: versions never decrease within a response, never newer than the trained policy
    # nor older than the batch's start; some responses spanned an update
    for step, batch in enumerate(taken, start=1):
        start, trained_version = batch.policy_version, step - 1
        for row in batch.rows:
            assert row.versions is not None and len(row.versions) == len(row.response_ids)
            assert row.versions == sorted(row.versions)
            assert all(start <= v <= trained_version for v in row.versions)
        s = batch.token_staleness
        assert s["staleness_max"] <= K and s["stale_token_fraction"] == 0.0
    assert sum(b.token_staleness["mixed_version_fraction"] for b in taken) > 0


# ---- partial rollouts: the pool (orchestrator/partial.py) -----------------------------------


class IndexedSource(PromptSource):
    """The real data source, remembering the index of every prompt it handed out."""

    def next_prompt(self):
        index, prompt = super().next_prompt()
        self.handed_out = getattr(self, "handed_out", []) + [index]
        return index, prompt


def run_pool(orch, sender, params, meta, served, *, first_step, last_step, stop_after=None):
    """Play the trainer over steps first_step..last_step (or up to `stop_after`, then close the
    pool as a checkpoint-and-exit would): take, "train", push new weights (mode keep)."""
    pre = PartialPrefetcher(orch, max_staleness=K, first_step=first_step, last_step=last_step,
                            served_version=lambda: served["v"])
    taken = []
    try:
        for step in range(first_step, (stop_after or last_step) + 1):
            taken.append(pre.take(step))
            time.sleep(0.05)  # "train"
            for p in params.values():
                p.add_(torch.randn_like(p) * 0.05)
            sender.send(meta, iter(params.values()), weight_version=str(served["v"] + 1))
            served["v"] += 1  # versions go on across runs (a resumed run keeps the policy version)
    finally:
        pre.close()
    return taken


def test_partial_rollouts_take_completed_groups_and_resume_exactly(tiny_model_dir, start_engines, tmp_path):
    torch.manual_seed(0)
    cfg = config(tiny_model_dir, maxTokens=64)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    params = {n: p.detach().clone() for n, p in hf_causal_lm(tiny_model_dir).named_parameters()}
    meta = [(n, list(t.shape), t.dtype) for n, t in params.items()]
    with start_engines(tiny_model_dir, 1) as (url,):
        client = RolloutClient([url], timeout_s=120)
        sender = WeightSyncSender([url], "127.0.0.1", free_port(), bucket_bytes=1 << 16, timeout_s=60,
                                  pause_mode="keep")
        served = {"v": 0}

        def orchestrator(state=None) -> Orchestrator:
            data = IndexedSource(cfg.data, tokenizer, seed=0)
            orch = Orchestrator(cfg, data=data, sampler=Sampler(cfg, client, build_reward(cfg.reward), tokenizer),
                                output_dir=tmp_path)
            if state is not None:
                orch.load_state_dict({"data": state})
            assert supports_partial(orch)
            return orch

        try:
            sender.init()
            sender.send(meta, iter(params.values()), weight_version="0")
            requests_before = httpx.get(url + "/stats").json()["num_requests"]
            # one run of all the steps
            full = orchestrator()
            whole = run_pool(full, sender, params, meta, served, first_step=1, last_step=STEPS)
            requests = httpx.get(url + "/stats").json()["num_requests"] - requests_before
            # a run checkpointed after step 3 (and exiting), then resumed from that checkpoint
            first = orchestrator()
            before = run_pool(first, sender, params, meta, served, first_step=1, last_step=STEPS, stop_after=3)
            checkpoint = before[-1].data_position
            second = orchestrator(checkpoint)
            after = run_pool(second, sender, params, meta, served, first_step=4, last_step=STEPS)
        finally:
            sender.close()
            client.close()
    total = STEPS * PROMPTS
    # every prompt handed out is trained exactly once, with all of its samples, and nothing else
    indices = [i for b in whole for i in b.prompt_indices]
    assert sorted(indices) == list(range(total)) == sorted(full.data.handed_out)
    assert requests == total  # one request per prompt: none re-sent, none lost
    example = IndexedSource(cfg.data, tokenizer, seed=0)._example
    for batch in whole + before + after:
        assert len(batch.rows) == PROMPTS * N and len(batch.prompt_indices) == PROMPTS
        for g, index in enumerate(batch.prompt_indices):
            assert all(r.prompt_ids == list(example(index).token_ids) for r in batch.rows[g * N:(g + 1) * N])
        for row in batch.rows:  # per token: versions never decrease
            assert row.versions == sorted(row.versions)
    for batch in whole:  # ... and are never newer than the trained policy
        assert all(r.versions[-1] <= batch.step - 1 for r in batch.rows)
    # groups finish out of order: a step takes groups started after one still generating, which a
    # later step trains; that one is among the longest
    late = [(i, s) for s, b in enumerate(whole) for i in b.prompt_indices
            if i < max((j for a in whole[:s] for j in a.prompt_indices), default=-1)]
    assert late, [b.prompt_indices for b in whole]
    lengths = {i: max(len(r.response_ids) for r in b.rows[g * N:(g + 1) * N])
               for b in whole for g, i in enumerate(b.prompt_indices)}
    assert max(lengths[i] for i, _ in late) > sorted(lengths.values())[len(lengths) // 2]
    assert sum(b.token_staleness["mixed_version_fraction"] for b in whole) > 0
    # checkpoint and resume: the position lists the prompts handed out and not trained; the
    # resumed run trains exactly those and the rest, nothing twice, nothing lost
    trained_before = [i for b in before for i in b.prompt_indices]
    assert set(checkpoint.get("pending", [])) == set(range(checkpoint["position"])) - set(trained_before)
    trained_after = [i for b in after for i in b.prompt_indices]
    assert sorted(trained_before + trained_after) == list(range(total))
    assert set(checkpoint.get("pending", [])) <= set(trained_after)
