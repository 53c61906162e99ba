"""Exactly-once accounting with in-flight weight updates: the real orchestrator (data source,
sampler, rollout client) generates ahead on the prefetch thread (maxStaleness 2) against a
real CPU engine, while this test plays the trainer: take a batch, "train", push new weights
with pause mode "keep" (the real sender), so updates land while the next batches'
responses are being generated. Every prompt the data source handed out is trained once, in
order, with all its samples; none is dropped or sent twice; responses that spanned an
update carry both versions, and no token lags more than k versions."""

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
from rlhf_trainer.orchestrator.prefetch import Prefetcher
from rlhf_trainer.orchestrator.sampler import Sampler
from rlhf_trainer.rewards import build_reward
from rlhf_trainer.rollout import RolloutClient
from rlhf_trainer.weight_sync import WeightSyncSender

STEPS, PROMPTS, N, K = 6, 4, 2, 2


def config(model_dir) -> TrainerConfig:
    return TrainerConfig.from_job(validate_job({
        "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "inflight"},
        "spec": {"model": {"path": str(model_dir)}, "data": {"path": "builtin://last-digit", "maxPromptLength": 24},
                 "reward": {"type": "exact_match"},
                 "rollout": {"engine": "cpu", "samplesPerPrompt": N, "maxTokens": 48, "maxStaleness": K,
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
