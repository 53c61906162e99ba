"""Weight sync: the trainer-side sender pushes every parameter to TWO engine processes
over a gloo group; checksums are bit-exact, generation uses the new weights, the HTTP
calls come in the order vLLM requires, and a failed or stuck round ends the group."""

from __future__ import annotations

import hashlib
import threading
import time
import random
import socket

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_inference.cpu_engine.weights import packed_buckets
from rlhf_trainer.weight_sync import WeightSyncError, WeightSyncSender, bucket_ranges, pack_buckets
from rlhf_trainer.weight_sync.buckets import checked_bytes
from rlhf_launcher.local import free_port  # noqa: E402  (one definition)

PROMPTS = [[6, 10, 4, 7, 15], [3, 15], [12, 11, 10, 9, 8, 7, 6, 5, 15], [5, 13, 8, 15]]




def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.3 * torch.randn(p.shape, generator=gen)
            for n, p in model.named_parameters()}


def greedy(model, prompt, max_new_tokens=12) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def served_greedy(url: str) -> list[list[int]]:
    body = {"prompt": PROMPTS, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    return [c["token_ids"] for c in httpx.post(url + "/v1/completions", json=body,
                                               timeout=60).json()["choices"]]


@pytest.fixture(scope="module")
def engines(tiny_model_dir, start_engines):
    with start_engines(tiny_model_dir, 2) as urls:
        yield urls


def test_packing_layout_matches_the_receiver():
    """Sender buckets == receiver buckets (vLLM's rule: close once size > buffer)."""
    rng = random.Random(0)
    for _ in range(50):
        sizes = [rng.choice([1, 3, 8, 100, 5000]) for _ in range(rng.randint(1, 30))]
        buffer = rng.choice([1, 7, 64, 1000, 10**6])
        tensors = [torch.full((s,), i % 251, dtype=torch.uint8) for i, s in enumerate(sizes)]
        expected = [torch.cat([tensors[i] for i in idx])
                    for idx in packed_buckets(sizes, buffer)]
        got = list(pack_buckets(tensors, buffer))
        assert [list(r) for r in bucket_ranges(sizes, buffer)] == list(packed_buckets(sizes, buffer))
        assert len(got) == len(expected)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        # every bucket but the last exceeds the buffer, and dropping its last tensor would not
        for idx in list(packed_buckets(sizes, buffer))[:-1]:
            assert sum(sizes[i] for i in idx) > buffer >= sum(sizes[i] for i in idx[:-1])


ROUND_CALLS = ["pause?mode=wait", "start_weight_update", "update_weights", "finish_weight_update",
               "reset_prefix_cache", "resume"]


def weight_calls(url: str) -> list[str]:
    return httpx.get(url + "/stats").json()["weight_calls"]


def test_two_rounds_to_two_engines_bit_exact(engines, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    original = served_greedy(engines[0])
    assert original == [greedy(model, p) for p in PROMPTS]

    sender = WeightSyncSender(engines, "127.0.0.1", free_port(), bucket_bytes=16 * 1024,
                              timeout_s=60)
    try:
        sender.init()
        assert sender.backend == "gloo"  # asked from the servers' /server_info
        assert sender.world_size == 3 and sender.rank_offsets == [1, 2]
        group = sender.group
        for round_, seed in enumerate([1, 2]):
            calls_before = [weight_calls(url) for url in engines]
            resets_before = [httpx.get(url + "/stats").json()["prefix_cache_resets"] for url in engines]
            new = perturbed(model, seed)
            meta = [(n, list(t.shape), t.dtype) for n, t in new.items()]
            # round 2 sends the same metadata: update_info goes with empty lists (vLLM reuses the last)
            stats = sender.send(meta, iter(new.values()), weight_version=f"v{round_}")
            total = sum(t.numel() * t.element_size() for t in new.values())
            assert stats["bytes"] == total and stats["num_tensors"] == len(new) == 27
            assert stats["buckets"] == len(list(pack_buckets(
                [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8)
                 for t in new.values()], 16 * 1024))) > 3
            assert sender.group is group  # the group is reused across rounds
            assert sender.calls == ["POST /" + c.split("?")[0] for c in ROUND_CALLS]

            model.load_state_dict(new)
            expected_greedy = [greedy(model, p) for p in PROMPTS]
            for url, before, resets in zip(engines, calls_before, resets_before):
                assert weight_calls(url)[len(before):] == ROUND_CALLS  # vLLM's order, on every server
                assert httpx.get(url + "/stats").json()["prefix_cache_resets"] > resets
                checksums = httpx.post(url + "/weight_checker",
                                       json={"action": "checksum"}).json()["checksums"]
                assert checksums == {n: sha256(t) for n, t in new.items()}
                assert httpx.get(url + "/weight_info").json() == {"weight_version": f"v{round_}"}
                assert httpx.get(url + "/is_paused").json() == {"is_paused": False}
                assert served_greedy(url) == expected_greedy
            assert expected_greedy != original  # the new weights really change the output
    finally:
        sender.close()


def test_rejected_update_ends_the_group_and_a_new_init_recovers(engines, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    sender = WeightSyncSender(engines, "127.0.0.1", free_port(), bucket_bytes=4096, timeout_s=60)
    try:
        sender.init()
        bad = {"model.layers.0.mlp.nope.weight": torch.zeros(3, 4)}
        with pytest.raises(WeightSyncError, match=r"127\.0\.0\.1.*HTTP 400.*nope"):
            sender.send([(n, list(t.shape), t.dtype) for n, t in bad.items()],
                        iter(bad.values()))
        assert sender.group is None  # as with NCCL, a failed round leaves no usable group
        for url in engines:
            assert weight_calls(url)[-1] == "shutdown_weight_transfer_engine"
        with pytest.raises(WeightSyncError, match="call init"):
            sender.send([], iter([]))
        sender.listen_port = free_port()
        sender.init()
        for url in engines:  # the failed round left them paused; the next round resumes them
            assert httpx.get(url + "/is_paused").json() == {"is_paused": True}
        params = {n: p.detach() for n, p in model.named_parameters()}
        sender.send([(n, list(t.shape), t.dtype) for n, t in params.items()],
                    iter(params.values()), weight_version="restored")
        for url in engines:
            checksums = httpx.post(url + "/weight_checker",
                                   json={"action": "checksum"}).json()["checksums"]
            assert checksums == {n: sha256(t) for n, t in params.items()}
            assert httpx.get(url + "/is_paused").json() == {"is_paused": False}
    finally:
        sender.close()


def test_tensor_not_matching_metadata_raises():
    with pytest.raises(WeightSyncError, match=r"'w' is \(3,\) torch.float32, metadata says \(2, 2\)"):
        list(checked_bytes([("w", [2, 2], torch.float32)], iter([torch.zeros(3)]), torch.device("cpu")))
    with pytest.raises(WeightSyncError, match="ended before 'v'"):
        list(checked_bytes([("w", [3], torch.float32), ("v", [1], torch.float32)],
                            iter([torch.zeros(3)]), torch.device("cpu")))


def test_sync_lets_inflight_requests_finish_then_updates(engines, tiny_model_dir):
    """/pause?mode=wait: a batch in flight runs to its end on the old weights; then the
    update; then generation resumes on the new ones."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    url = engines[0]
    result = {}
    body = {"prompt": PROMPTS * 16, "max_tokens": 110, "ignore_eos": True, "temperature": 1.0,
            "return_token_ids": True}
    worker = threading.Thread(target=lambda: result.update(
        httpx.post(url + "/v1/completions", json=body, timeout=60).json()))
    before = httpx.get(url + "/stats").json()
    worker.start()
    deadline = time.monotonic() + 30
    while httpx.get(url + "/stats").json()["num_forward_steps"] == before["num_forward_steps"]:
        assert time.monotonic() < deadline, "generation did not start"
        time.sleep(0.005)
    sender = WeightSyncSender(engines, "127.0.0.1", free_port(), bucket_bytes=1 << 20, timeout_s=60)
    try:
        sender.init()
        new = perturbed(model, 3)
        sender.send([(n, list(t.shape), t.dtype) for n, t in new.items()], iter(new.values()))
        assert result, "the sync finished before the request in flight"
    finally:
        sender.close()
    worker.join(timeout=60)
    assert [c["finish_reason"] for c in result["choices"]] == ["length"] * 64
    assert all(len(c["token_ids"]) == 110 for c in result["choices"])
    checksums = httpx.post(url + "/weight_checker", json={"action": "checksum"}).json()
    assert checksums["checksums"] == {n: sha256(t) for n, t in new.items()}


def test_stuck_round_times_out_and_the_watchdog_fires(engines, tiny_model_dir):
    """The tensor generator hangs (as a trainer stuck in a full_tensor() collective would):
    the watchdog fires while this thread is still stuck, and once it returns the round
    fails with a clear error and the group is given up."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    url = engines[1]
    fired = threading.Event()
    messages = []
    sender = WeightSyncSender([url], "127.0.0.1", free_port(), bucket_bytes=4096, timeout_s=1.5,
                              watchdog_grace_s=0.5, on_watchdog=lambda m: (messages.append(m), fired.set()))
    params = {n: p.detach() for n, p in model.named_parameters()}

    def stalling():
        for i, tensor in enumerate(params.values()):
            if i == 5:
                time.sleep(4.0)
                assert fired.is_set(), "the watchdog did not fire while the round was stuck"
            yield tensor

    try:
        sender.init()
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match="timed out"):
            sender.send([(n, list(t.shape), t.dtype) for n, t in params.items()], stalling())
        assert 3.5 < time.monotonic() - start < 30
        assert fired.is_set() and "did not finish within 2 s" in messages[0]
        assert sender.group is None
    finally:
        httpx.post(url + "/resume")
        sender.close()


def test_weights_travel_in_the_servers_dtype_cast_from_the_fp32_masters(tiny_model_dir, start_engines):
    """A bf16 server (vLLM's model_config.dtype, in /server_info) receives bf16: half the
    bytes of the trainer's fp32 weights, each the round-to-nearest cast of the master."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    new = perturbed(model, 7)
    assert all(t.dtype == torch.float32 for t in new.values())
    meta = [(n, list(t.shape), t.dtype) for n, t in new.items()]
    with start_engines(tiny_model_dir, 1, "--dtype", "bfloat16") as (url,):
        info = httpx.get(url + "/server_info", params={"config_format": "json"}).json()
        assert info["vllm_config"]["model_config"]["dtype"] == "torch.bfloat16"
        sender = WeightSyncSender([url], "127.0.0.1", free_port(), bucket_bytes=16 * 1024, timeout_s=60)
        try:
            sender.init()
            assert sender.serving_dtype == torch.bfloat16
            stats = sender.send(meta, iter(new.values()), weight_version="bf16")
        finally:
            sender.close()
        assert stats["bytes"] == sum(t.numel() * 2 for t in new.values())  # bf16: 2 bytes per value
        checksums = httpx.post(url + "/weight_checker", json={"action": "checksum"}).json()["checksums"]
        assert checksums == {n: sha256(t.to(torch.bfloat16)) for n, t in new.items()}
