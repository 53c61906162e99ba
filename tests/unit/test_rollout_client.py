"""RolloutClient against two real CPU engines: order, load spreading, token ids, logprobs."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_trainer.rollout import RolloutClient, RolloutError, Sample, prompt_seed

EOS = 1
# different lengths, so a mix-up of prompts would show
PROMPTS = [[6, 10, 4, 7, 15], [3, 15], [12, 11, 10, 9, 8, 7, 6, 5, 15], [5, 13, 8, 15],
           [4, 4, 4, 4, 4, 4, 15], [9, 14, 3, 15], [7, 15], [8, 8, 13, 3, 3, 15]]


@pytest.fixture(scope="module")
def engines(tiny_model_dir, start_engines):
    with start_engines(tiny_model_dir, 2) as urls:
        yield urls


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def test_samples_in_prompt_order_from_both_endpoints(engines, hf_model):
    client = RolloutClient(engines, max_concurrency=8)
    client.wait_ready(30)
    before = [httpx.get(u + "/stats").json()["num_requests"] for u in engines]
    groups = client.generate_sync(PROMPTS, n=3, max_tokens=10, temperature=1.0, seed=42)
    after = [httpx.get(u + "/stats").json()["num_requests"] for u in engines]

    assert len(groups) == len(PROMPTS)
    for prompt, samples in zip(PROMPTS, groups):
        assert len(samples) == 3 and all(isinstance(s, Sample) for s in samples)
        for s in samples:
            assert s.prompt_token_ids == prompt
            assert 1 <= len(s.token_ids) == len(s.logprobs) <= 10
            assert s.finish_reason == ("stop" if s.token_ids[-1] == EOS else "length")
            with torch.no_grad():
                logits = hf_model(torch.tensor([prompt + s.token_ids])).logits[0]
            lp = torch.log_softmax(logits.float(), -1)
            ref = [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(s.token_ids)]
            assert s.logprobs == pytest.approx(ref, abs=1e-4)
    # one request per prompt, spread over both servers
    assert sum(client.requests_sent.values()) == len(PROMPTS)
    assert all(client.requests_sent[u] > 0 for u in engines)
    assert [a - b for a, b in zip(after, before)] == [client.requests_sent[u] for u in engines]
    # the same seed reproduces the samples, wherever each prompt lands
    again = RolloutClient(list(reversed(engines))).generate_sync(
        PROMPTS, n=3, max_tokens=10, temperature=1.0, seed=42)
    assert [[s.token_ids for s in g] for g in again] == [[s.token_ids for s in g] for g in groups]


def test_stop_token_ids_and_greedy(engines):
    client = RolloutClient(engines)
    groups = asyncio.run(client.generate([[6, 10, 4, 7, 15]], n=2, max_tokens=20,
                                         temperature=0.0, stop_token_ids=[10]))
    # this model's greedy continuation is 12, 10, 10, ...: it stops at the first 10
    assert [s.token_ids for s in groups[0]] == [[12, 10], [12, 10]]
    assert [s.finish_reason for s in groups[0]] == ["stop", "stop"]


def test_dead_endpoint_is_retried_elsewhere(engines):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    client = RolloutClient([dead, engines[0]], backoff_s=0.01)
    groups = client.generate_sync(PROMPTS[:4], n=1, max_tokens=4, temperature=1.0, seed=1)
    assert [g[0].prompt_token_ids for g in groups] == PROMPTS[:4]
    assert client.requests_sent[dead] >= 1  # tried, failed, retried on the live one

    with pytest.raises(RolloutError, match="after 3 attempts"):
        RolloutClient([dead], max_retries=2, backoff_s=0.01).generate_sync(
            PROMPTS[:1], n=1, max_tokens=4, temperature=1.0)


def test_server_error_is_reported_with_endpoint_and_body(engines):
    with pytest.raises(RolloutError, match=r"127\.0\.0\.1.*HTTP 400.*top_p"):
        RolloutClient(engines).generate_sync(PROMPTS[:1], n=1, max_tokens=4,
                                             temperature=1.0, top_p=0.0)


def test_prompt_seeds_are_distinct_and_stable():
    seeds = [prompt_seed(7, i) for i in range(1000)]
    assert len(set(seeds)) == 1000 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [prompt_seed(7, i) for i in range(1000)]
    assert prompt_seed(8, 0) != seeds[0]
