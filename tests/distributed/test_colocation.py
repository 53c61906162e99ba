"""Colocated placement's server side: the CPU engine's sleep mode (vLLM's /sleep, /wake_up,
/is_sleeping) and the stricter refusals that keep rollouts off discarded weights, driven by
the trainer's own ServerSleep and WeightSyncSender over real HTTP and a real gloo group."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_launcher.local import free_port
from rlhf_trainer.rl.colocation import ColocationError, ServerSleep
from rlhf_trainer.weight_sync import WeightSyncSender

PROMPTS = [[6, 10, 4, 7, 15], [3, 15], [12, 11, 10, 9, 8, 7, 6, 5, 15]]


def served(url: str) -> httpx.Response:
    body = {"prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def greedy(model) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def state(url: str) -> dict:
    return httpx.get(url + "/stats").json()["sleep"]


@pytest.fixture(scope="module")
def url(tiny_model_dir, start_engines):
    with start_engines(tiny_model_dir, 1, "--enable-sleep-mode") as urls:
        yield urls[0]


def test_level_1_keeps_the_weights_and_nothing_generates_until_every_tag_is_awake(url):
    before = served(url).json()
    control = ServerSleep([url], timeout_s=30)
    try:
        full = state(url)["resident_parameter_bytes"]
        control.sleep(1)
        assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
        assert state(url)["resident_parameter_bytes"] == 0 < full
        reply = served(url)
        assert reply.status_code == 409 and "asleep" in reply.text
        # the weights cannot be updated while they sleep (checked before any broadcast)
        assert httpx.post(url + "/start_weight_update").status_code == 200
        reply = httpx.post(url + "/update_weights", json={"update_info": {
            "names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[16, 64]]}})
        assert reply.status_code == 500 and "weights are asleep" in reply.text
        assert httpx.get(url + "/stats").json()["weight_update_active"] is False  # as vLLM: a failed update ends it
        assert control.wake_up(["weights"]) == [{"status": "sleeping", "tags": ["weights"]}]
        assert served(url).status_code == 409  # the KV cache still sleeps
        assert control.wake_up(["kv_cache"]) == [{"status": "awake", "tags": ["kv_cache"]}]
        assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
        assert state(url)["resident_parameter_bytes"] == full
        assert served(url).json()["choices"] == before["choices"]  # the same weights came back
    finally:
        control.close()


def test_level_2_discards_the_weights_and_generation_waits_for_every_one_of_them(url, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    gen = torch.Generator().manual_seed(3)
    new = {n: p.detach() + 0.3 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
    meta = [(n, list(t.shape), t.dtype) for n, t in new.items()]
    control = ServerSleep([url], timeout_s=30)
    sender = WeightSyncSender([url], "127.0.0.1", free_port(), bucket_bytes=16 * 1024, timeout_s=60)
    try:
        sender.init()
        control.sleep(2)
        assert state(url)["resident_parameter_bytes"] == 0
        with pytest.raises(ColocationError, match="unknown tags"):
            control.wake_up(["weights", "kv"])
        assert control.wake_up(["weights", "kv_cache"]) == [{"status": "awake", "tags": ["weights", "kv_cache"]}]
        reply = served(url)  # awake, on uninitialised memory: refused, never sampled from
        assert reply.status_code == 409 and "discarded by a level-2 sleep" in reply.text
        # a push of half the tensors is not enough
        half = meta[: len(meta) // 2]
        sender.send(half, iter([new[n] for n, _, _ in half]), weight_version="half")
        reply = served(url)
        assert reply.status_code == 409 and "were not updated" in reply.text
        sender.send(meta, iter(new.values()), weight_version="all")
        reply = served(url)
        assert reply.status_code == 200, reply.text
        model.load_state_dict(new)
        assert [c["token_ids"] for c in reply.json()["choices"]] == greedy(model)
    finally:
        sender.close()
        control.close()
