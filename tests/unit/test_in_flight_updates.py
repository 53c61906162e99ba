"""In-flight weight updates (`rollout.inFlightUpdates`) on the CPU engine: the real sender
pushes new weights with pause mode "keep" while requests generate; no request is dropped,
each keeps the tokens it had, and every token carries the version of the weights that
sampled it (vLLM's `weight_versions` spans)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
from helpers import free_port, hf_causal_lm

from rlhf_inference.cpu_engine.protocol import weight_version_spans
from rlhf_trainer.rollout.client import token_versions
from rlhf_trainer.weight_sync import WeightSyncSender

PROMPT = [6, 10, 4, 7, 15]  # "3714:"


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir, start_engines):
    with start_engines(tiny_model_dir, 1, "--max-num-seqs", "64") as urls:
        yield urls[0]


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    """The served model (version 1) and a far-off one (version 2)."""
    old = hf_causal_lm(tiny_model_dir)
    new = hf_causal_lm(tiny_model_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    return old, new


def push(sender: WeightSyncSender, model, version: str) -> None:
    params = {n: p.detach() for n, p in model.named_parameters()}
    sender.send([(n, list(t.shape), t.dtype) for n, t in params.items()], iter(params.values()),
                weight_version=version)


def full_forward_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), -1)
    return [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens)]


def post_in_thread(url: str, body: dict) -> tuple[threading.Thread, dict]:
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(httpx.post(url + "/v1/completions", json=body,
                                                                      timeout=120).json()))
    worker.start()
    return worker, result


def wait_for_steps(url: str, after: int, more: int = 3) -> None:
    deadline = time.monotonic() + 60
    while httpx.get(url + "/stats").json()["num_forward_steps"] < after + more:
        assert time.monotonic() < deadline, "generation did not start"
        time.sleep(0.005)


N = 100  # tokens per request: prompt and response within the tiny model's 128 positions


def pause_mid_generation(url: str, body: dict, tries: int = 5):
    """Start `body`, let it generate a few steps, then pause with mode "keep" and post one more
    request. On a loaded machine the first request can finish before the pause lands: then
    resume and try again, so the test always checks a pause that parked a request mid-way."""
    for _ in range(tries):
        before = httpx.get(url + "/stats").json()["num_forward_steps"]
        worker, result = post_in_thread(url, body)
        wait_for_steps(url, before)
        httpx.post(url + "/pause", params={"mode": "keep"})
        late, late_result = post_in_thread(url, {**body, "prompt": [PROMPT]})  # queued, not refused
        time.sleep(0.3)
        if not result:
            assert not late_result  # both held while paused
            return (worker, result), (late, late_result)
        httpx.post(url + "/resume")  # it finished before the pause landed: again
        worker.join(120)
        late.join(120)
    raise AssertionError(f"the request finished before the pause in each of {tries} tries")


def test_a_keep_update_mid_generation_labels_tokens_and_drops_no_request(engine_url, models):
    old, new = models
    sender = WeightSyncSender([engine_url], "127.0.0.1", free_port(), bucket_bytes=1 << 16, timeout_s=60,
                              pause_mode="keep")
    try:
        sender.init()
        push(sender, old, "1")  # the served weights, labelled 1
        body = {"prompt": [PROMPT] * 4, "max_tokens": N, "ignore_eos": True, "return_token_ids": True,
                "logprobs": 0, "temperature": 0.0}
        (worker, result), (late, late_result) = pause_mid_generation(engine_url, body)
        push(sender, new, "2")  # pauses (keep), loads, resumes
        assert sender.calls[0] == "POST /pause" and sender.calls[-1] == "POST /resume"
        worker.join(120)
        late.join(120)
    finally:
        sender.close()
        httpx.post(engine_url + "/resume")  # a failure above must not leave the engine paused for the next test
    choices = result["choices"]
    assert [c["finish_reason"] for c in choices] == ["length"] * 4  # none aborted, none dropped
    for choice in choices:
        spans = choice["weight_versions"]
        assert [s["version"] for s in spans] == ["1", "2"]
        cut = spans[0]["end"]
        assert spans == [{"version": "1", "start": 0, "end": cut}, {"version": "2", "start": cut, "end": N}]
        assert 3 <= cut < N
        tokens, got = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        assert len(tokens) == N  # the tokens before the pause were kept
        # before the update: exactly the old model's numbers; after it: not the old model's
        want_old = full_forward_logprobs(old, PROMPT, tokens)
        assert got[:cut] == pytest.approx(want_old[:cut], abs=2e-3)
        assert max(abs(a - b) for a, b in zip(got[cut:], want_old[cut:])) > 0.1
        assert token_versions(spans, len(tokens)) == [1] * cut + [2] * (N - cut)
    # the request that arrived while paused ran wholly on the new weights
    late_choice = late_result["choices"][0]
    assert late_choice["weight_versions"] == [{"version": "2", "start": 0, "end": N}]
    assert late_choice["logprobs"]["token_logprobs"] == pytest.approx(
        full_forward_logprobs(new, PROMPT, late_choice["token_ids"]), abs=2e-3)


def test_a_wait_update_lets_requests_finish_on_the_old_weights(engine_url, models):
    """Today's async mode for contrast: "wait" drains the requests in flight first, so each
    response has one version."""
    old, _ = models
    sender = WeightSyncSender([engine_url], "127.0.0.1", free_port(), bucket_bytes=1 << 16, timeout_s=60)
    try:
        sender.init()
        push(sender, old, "5")
        before = httpx.get(engine_url + "/stats").json()["num_forward_steps"]
        worker, result = post_in_thread(engine_url, {"prompt": [PROMPT] * 2, "max_tokens": 40, "ignore_eos": True,
                                                     "return_token_ids": True, "logprobs": 0})
        wait_for_steps(engine_url, before)
        push(sender, old, "6")
        worker.join(120)
    finally:
        sender.close()
    assert [c["weight_versions"] for c in result["choices"]] == [[{"version": "5", "start": 0, "end": 40}]] * 2


def test_spans_follow_vllms_rules_and_the_client_reads_them_back():
    """vLLM's `_weight_version_spans`: a new span where the label changes, unlabelled tokens
    extend the span before them, none at all: None."""
    assert weight_version_spans([]) is None and weight_version_spans([None, None]) is None
    assert weight_version_spans(["3", "3", "4", None, "4", "5"]) == [
        {"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5},
        {"version": "5", "start": 5, "end": 6}]
    assert weight_version_spans([None, "7", "7"]) == [{"version": "7", "start": 1, "end": 3}]
    spans = weight_version_spans(["3", "3", "4", None, "4", "5"])
    assert token_versions(spans, 6) == [3, 3, 4, 4, 4, 5]
    assert token_versions(weight_version_spans([None, "7", "7"]), 3) == [None, 7, 7]
    assert token_versions([{"version": "ckpt-a", "start": 0, "end": 2}], 2) == [None, None]
    assert token_versions(None, 4) is None
