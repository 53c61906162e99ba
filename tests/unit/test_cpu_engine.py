"""The CPU engine against the official openai client and the HF model's own numbers."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from helpers import hf_causal_lm

PROMPT = [6, 10, 4, 7, 15]  # "3714:"
EOS = 1


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir, start_engines):
    with start_engines(tiny_model_dir, 1, "--max-num-seqs", "64") as urls:
        yield urls[0]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return hf_causal_lm(tiny_model_dir)


@pytest.fixture(scope="module")
def client(engine_url):
    return openai.OpenAI(base_url=engine_url + "/v1", api_key="x", max_retries=0)


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """log_softmax of the model's own full forward pass at each generated position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens)]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_openai_client_token_ids_logprobs_and_finish_reason(client, hf_model):
    resp = client.completions.create(
        model="tiny", prompt=[PROMPT], max_tokens=12, n=4, logprobs=0, temperature=1.0,
        seed=11, extra_body={"return_token_ids": True})
    assert resp.object == "text_completion" and resp.model == "tiny"
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    total = 0
    for choice in resp.choices:
        assert choice.prompt_token_ids == PROMPT
        tokens = choice.token_ids
        total += len(tokens)
        assert 1 <= len(tokens) <= 12
        if tokens[-1] == EOS:
            assert choice.finish_reason == "stop" and EOS not in tokens[:-1]
        else:
            assert choice.finish_reason == "length" and len(tokens) == 12
        got = choice.logprobs.token_logprobs
        assert got == pytest.approx(hf_logprobs(hf_model, PROMPT, tokens), abs=1e-4)
        # logprobs=0: only the sampled token in each top_logprobs entry
        assert [len(d) for d in choice.logprobs.top_logprobs] == [1] * len(tokens)
        assert [list(d.values())[0] for d in choice.logprobs.top_logprobs] == got
        assert len(choice.logprobs.tokens) == len(choice.logprobs.text_offset) == len(tokens)
    assert resp.usage.prompt_tokens == len(PROMPT)
    assert resp.usage.completion_tokens == total


def test_greedy_equals_hf_generate_for_every_prompt_form(client, hf_model):
    prompts = [PROMPT, [3, 13, 4, 14, 15], [12, 11, 10, 9, 8, 7, 6, 5, 15], [5, 15]]
    resp = client.completions.create(model="tiny", prompt=prompts, max_tokens=20,
                                     temperature=0, extra_body={"return_token_ids": True})
    for prompt, choice in zip(prompts, resp.choices):  # one batch, left-padded
        assert choice.prompt_token_ids == prompt
        assert choice.token_ids == hf_greedy(hf_model, prompt, 20)
    # text prompts go through the tokenizer: "3714:" is PROMPT
    text = client.completions.create(model="tiny", prompt="3714:", max_tokens=20,
                                      temperature=0, extra_body={"return_token_ids": True})
    assert text.choices[0].prompt_token_ids == PROMPT
    assert text.choices[0].token_ids == resp.choices[0].token_ids


def test_stop_token_id_ends_with_stop(client, hf_model):
    greedy = hf_greedy(hf_model, PROMPT, 20)
    stop = greedy[1]  # [12, 10, 10, ...] for this model: stop on the first 10
    stop_at = greedy.index(stop)
    assert stop != EOS and 1 <= stop_at < 19
    resp = client.completions.create(
        model="tiny", prompt=[PROMPT], max_tokens=20, temperature=0,
        extra_body={"return_token_ids": True, "stop_token_ids": [stop]})
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    assert choice.token_ids == greedy[:stop_at + 1]


def test_ignore_eos_runs_to_max_tokens(engine_url):
    body = {"prompt": [[3, 15]] * 8, "max_tokens": 30, "temperature": 1.0, "seed": 5,
            "ignore_eos": True, "return_token_ids": True}
    choices = httpx.post(engine_url + "/v1/completions", json=body, timeout=60).json()["choices"]
    assert all(c["finish_reason"] == "length" and len(c["token_ids"]) == 30 for c in choices)


def test_same_seed_same_samples_and_n_samples_differ(client):
    def sample(seed):
        resp = client.completions.create(model="tiny", prompt=[PROMPT], max_tokens=16, n=4,
                                         temperature=1.0, seed=seed, logprobs=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
        return [(c.token_ids, c.logprobs.token_logprobs) for c in resp.choices]

    first, again, other = sample(1234), sample(1234), sample(99)
    assert first == again
    assert len({tuple(t) for t, _ in first}) == 4  # the n samples differ
    assert [t for t, _ in first] != [t for t, _ in other]


def test_concurrent_requests_share_batched_forward_steps(engine_url, hf_model):
    prompts = [[3 + i % 10, 3 + (i * 7) % 10, 14, 3 + (i * 3) % 10, 15] for i in range(24)]
    max_tokens = 10
    before = httpx.get(engine_url + "/stats").json()

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            replies = await asyncio.gather(*(
                http.post(engine_url + "/v1/completions", json={
                    "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True})
                for p in prompts))
        return [r.json()["choices"][0]["token_ids"] for r in replies]

    outputs = asyncio.run(run())
    after = httpx.get(engine_url + "/stats").json()
    steps = after["num_forward_steps"] - before["num_forward_steps"]
    assert after["num_requests"] - before["num_requests"] == len(prompts)
    # one request at a time would take 24 x 10 forward passes
    assert steps <= 3 * max_tokens, steps
    assert after["max_batch_size"] > 1
    for prompt, tokens in zip(prompts[:6], outputs[:6]):  # batching changes no result
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
        assert tokens == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1), ("n", 0), ("top_p", 0.0), ("temperature", -1.0), ("top_k", -2),
    ("logprobs", -3), ("prompt", [[3, 99]]), ("stop_token_ids", [500]), ("stream", True),
    ("max_tokens", 1000), ("n", "many"),
])
def test_bad_request_is_400_naming_the_field(engine_url, field, value):
    body = {"prompt": [PROMPT], "max_tokens": 4, field: value}
    resp = httpx.post(engine_url + "/v1/completions", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and error["code"] == 400 and error["message"]


def test_openai_client_raises_on_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="n must be at least 1"):
        client.completions.create(model="tiny", prompt=[PROMPT], max_tokens=4, n=0)


def test_info_endpoints(engine_url):
    assert httpx.get(engine_url + "/get_world_size").json() == {"world_size": 1}
    models = httpx.get(engine_url + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 128
    checksums = httpx.post(engine_url + "/weight_checker", json={"action": "checksum"}).json()
    assert len(checksums["checksums"]) == 27
    compare = httpx.post(engine_url + "/weight_checker",
                         json={"action": "compare", "baseline": checksums["checksums"]}).json()
    assert compare == {"match": True, "mismatches": []}


def test_pause_holds_new_generation_until_resume(engine_url):
    assert httpx.post(engine_url + "/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    try:
        assert httpx.get(engine_url + "/is_paused").json() == {"is_paused": True}
        assert httpx.get(engine_url + "/health").status_code == 200
        # as vLLM: checksums while paused are fine (the weights are not changing)
        assert httpx.post(engine_url + "/weight_checker", json={"action": "checksum"}).status_code == 200
        result = {}
        worker = threading.Thread(target=lambda: result.update(httpx.post(
            engine_url + "/v1/completions",
            json={"prompt": [PROMPT], "max_tokens": 3}, timeout=30).json()))
        worker.start()
        time.sleep(0.7)
        assert not result  # still waiting
    finally:
        assert httpx.post(engine_url + "/resume").json() == {"status": "resumed"}
    worker.join(timeout=30)
    assert result["choices"][0]["finish_reason"] in ("stop", "length")
    assert httpx.get(engine_url + "/is_paused").json() == {"is_paused": False}


def test_pause_abort_ends_waiting_requests(engine_url):
    httpx.post(engine_url + "/pause", params={"mode": "keep"})
    result = {}
    worker = threading.Thread(target=lambda: result.update(httpx.post(
        engine_url + "/v1/completions",
        json={"prompt": [PROMPT] * 3, "max_tokens": 50, "return_token_ids": True},
        timeout=30).json()))
    worker.start()
    time.sleep(0.5)
    assert httpx.post(engine_url + "/pause", params={"mode": "abort"}, timeout=30).status_code == 200
    worker.join(timeout=30)
    httpx.post(engine_url + "/resume")
    assert [c["finish_reason"] for c in result["choices"]] == ["abort"] * 3
    assert [c["token_ids"] for c in result["choices"]] == [[]] * 3


def test_pause_abort_ends_a_parked_running_batch(engine_url):
    before = httpx.get(engine_url + "/stats").json()["num_forward_steps"]
    result = {}
    worker = threading.Thread(target=lambda: result.update(httpx.post(
        engine_url + "/v1/completions",
        json={"prompt": [PROMPT] * 32, "max_tokens": 120, "ignore_eos": True,
              "return_token_ids": True}, timeout=30).json()))
    worker.start()
    deadline = time.monotonic() + 30
    while httpx.get(engine_url + "/stats").json()["num_forward_steps"] == before:
        assert time.monotonic() < deadline, "generation did not start"
        time.sleep(0.005)
    httpx.post(engine_url + "/pause", params={"mode": "keep"})  # parked mid-generation
    assert httpx.post(engine_url + "/pause", params={"mode": "abort"}, timeout=30).status_code == 200
    worker.join(timeout=30)
    httpx.post(engine_url + "/resume")
    choices = result["choices"]
    assert [c["finish_reason"] for c in choices] == ["abort"] * 32
    assert all(0 < len(c["token_ids"]) < 120 for c in choices)


def test_pause_wait_lets_inflight_requests_finish(engine_url):
    result = {}
    worker = threading.Thread(target=lambda: result.update(httpx.post(
        engine_url + "/v1/completions",
        json={"prompt": [PROMPT] * 8, "max_tokens": 60, "ignore_eos": True}, timeout=30).json()))
    worker.start()
    time.sleep(0.05)
    assert httpx.post(engine_url + "/pause", params={"mode": "wait"}, timeout=30).status_code == 200
    httpx.post(engine_url + "/resume")
    worker.join(timeout=30)
    assert [c["finish_reason"] for c in result["choices"]] == ["length"] * 8


def _completion(engine_url, **extra):
    return httpx.post(engine_url + "/v1/completions",
                      json={"prompt": [PROMPT], "max_tokens": 3, **extra}, timeout=30)


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_pause_wait_and_abort_reject_new_requests_with_503_until_resume(engine_url, mode):
    assert httpx.post(engine_url + "/pause", params={"mode": mode}, timeout=30).status_code == 200
    try:
        reply = _completion(engine_url)
        assert reply.status_code == 503
        assert reply.json()["error"]["type"] == "ServiceUnavailableError"
    finally:
        httpx.post(engine_url + "/resume")
    assert _completion(engine_url).status_code == 200


def test_sleep_needs_the_sleep_mode_flag_as_vllm(engine_url):
    reply = httpx.post(engine_url + "/sleep", params={"level": 1}, timeout=30)
    assert reply.status_code == 400 and "--enable-sleep-mode" in reply.text
    assert httpx.get(engine_url + "/is_sleeping").json() == {"is_sleeping": False}


def test_reset_prefix_cache_succeeds_when_idle_and_is_counted(engine_url):
    before = httpx.get(engine_url + "/stats").json()["prefix_cache_resets"]
    assert httpx.post(engine_url + "/reset_prefix_cache").json() == {"success": True}
    assert httpx.get(engine_url + "/stats").json()["prefix_cache_resets"] == before + 1


def test_version_and_server_info_report_the_pinned_protocol_and_gloo(engine_url):
    from rlhf_contract.images import VLLM_VERSION

    assert httpx.get(engine_url + "/version").json() == {"version": VLLM_VERSION}
    info = httpx.get(engine_url + "/server_info", params={"config_format": "json"}).json()
    assert info["vllm_config"]["weight_transfer_config"] == {"backend": "gloo"}


def test_weight_update_state_machine_follows_vllms_worker(engine_url):
    """vLLM's gpu_worker: update needs start, start refuses an active update, finish needs
    one, shutdown refuses during one; a failed update ends the session."""
    post = lambda path, body=None: httpx.post(engine_url + path, json=body, timeout=30)  # noqa: E731
    info = {"update_info": {"names": [], "dtype_names": [], "shapes": []}}
    reply = post("/update_weights", info)
    assert reply.status_code == 500 and "start_weight_update must be called before" in reply.text
    reply = post("/finish_weight_update", {})
    assert reply.status_code == 500 and "without a matching start_weight_update" in reply.text
    assert post("/start_weight_update").status_code == 200
    reply = post("/start_weight_update")
    assert reply.status_code == 500 and "already active" in reply.text
    reply = post("/shutdown_weight_transfer_engine")
    assert reply.status_code == 500 and "during a weight update" in reply.text
    assert httpx.get(engine_url + "/is_paused").json() == {"is_paused": False}  # start does not pause
    # no group yet: the update fails, and that ends the session
    reply = post("/update_weights", info)
    assert reply.status_code == 500 and "not initialized" in reply.text
    assert httpx.get(engine_url + "/stats").json()["weight_update_active"] is False
    assert post("/start_weight_update").status_code == 200
    assert post("/finish_weight_update", {"weight_version": "7"}).status_code == 200
    assert httpx.get(engine_url + "/weight_info").json() == {"weight_version": "7"}
    assert post("/shutdown_weight_transfer_engine").status_code == 200


@pytest.mark.parametrize("init_info, field", [
    ({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
      "bucket_size": 5}, "init_info"),  # unknown key: vLLM's dataclass raises
    ({"master_address": "127.0.0.1", "master_port": 1, "world_size": 2}, "init_info"),  # rank_offset missing
    ({"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2}, "init_info.master_address"),
    ({"nccl_unique_id_b64": "AAAA", "rank_offset": 1, "world_size": 2}, "init_info.nccl_unique_id_b64"),
    ({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2}, "init_info.rank_offset"),
])
def test_bad_init_info_is_400_naming_the_field(engine_url, init_info, field):
    reply = httpx.post(engine_url + "/init_weight_transfer_engine", json={"init_info": init_info}, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field


def test_update_info_with_packed_keys_is_rejected_as_vllm_does(engine_url):
    """Since vLLM 0.28 the packed settings live in init_info: update_info refuses them."""
    assert httpx.post(engine_url + "/start_weight_update").status_code == 200
    reply = httpx.post(engine_url + "/update_weights", json={"update_info": {
        "names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[16, 64]], "packed": True}}, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "update_info"
    assert "packed" in reply.json()["error"]["message"]
    assert httpx.get(engine_url + "/stats").json()["weight_update_active"] is False


def test_generation_config_auto_fills_omitted_fields_and_vllm_does_not(tmp_path, tiny_model_dir, start_engines):
    """vLLM's --generation-config: 'auto' takes omitted sampling fields from the model's
    generation_config.json; 'vllm' (what our launcher passes) ignores the file."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.05, "temperature": 0.0}))
    with start_engines(model, 1) as (auto,), start_engines(model, 1, "--generation-config", "vllm") as (neutral,):
        reply = _completion(auto)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "repetition_penalty"
        assert _completion(auto, repetition_penalty=1.0).status_code == 200  # sent explicitly: honoured
        assert _completion(neutral).status_code == 200


def test_processed_logprobs_are_those_of_the_sampled_distribution():
    """`--logprobs-mode processed_logprobs` (what the pod contract passes): the log-probs
    at the temperature, the trainer's; raw ones are before it."""
    from rlhf_inference.cpu_engine.generator import BatchGenerator, SamplingParams, Sequence
    from rlhf_trainer.models.builtin import build_tiny_qwen2

    model = build_tiny_qwen2(3).eval()
    prompt = [5, 6, 7]
    got = {}
    for mode in ("raw_logprobs", "processed_logprobs"):
        gen = BatchGenerator(model, eos_token_ids=set(), pad_token_id=0, max_model_len=64, logprobs_mode=mode)
        seq = Sequence(prompt_token_ids=list(prompt), params=SamplingParams(temperature=0.5, max_tokens=4),
                       generator=torch.Generator().manual_seed(0))
        gen.generate([seq])
        got[mode] = (seq.token_ids, seq.logprobs)
    assert got["raw_logprobs"][0] == got["processed_logprobs"][0]  # same draws
    ids = torch.tensor([prompt + got["raw_logprobs"][0]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    tokens = torch.tensor(got["raw_logprobs"][0])
    at_t = torch.log_softmax(logits / 0.5, -1).gather(-1, tokens[:, None])[:, 0]
    raw = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    assert torch.allclose(torch.tensor(got["processed_logprobs"][1]), at_t, atol=1e-4)
    assert torch.allclose(torch.tensor(got["raw_logprobs"][1]), raw, atol=1e-4)


def test_a_request_arriving_mid_generation_joins_the_running_batch(engine_url, hf_model):
    """Continuous batching: a short request sent while a long one is decoding joins its
    loop (no new batch), answers before the long one ends, and gets what it would alone."""
    long_prompt, short_prompt = [6, 10, 4, 7, 15], [3, 9, 9, 14, 8, 8, 2, 15]  # different lengths: padding
    body = {"temperature": 0, "ignore_eos": True, "return_token_ids": True, "logprobs": 0}
    finished: dict[str, float] = {}
    before = httpx.get(engine_url + "/stats").json()

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            async def send(name, prompt, max_tokens, after_steps):
                while after_steps:  # send once the long request's loop is decoding
                    stats = (await http.get(engine_url + "/stats")).json()
                    if stats["num_forward_steps"] >= before["num_forward_steps"] + after_steps:
                        break
                    await asyncio.sleep(0.001)
                reply = await http.post(engine_url + "/v1/completions",
                                        json={**body, "prompt": prompt, "max_tokens": max_tokens})
                finished[name] = time.monotonic()
                return reply.json()["choices"][0]
            return await asyncio.gather(send("long", long_prompt, 110, 0), send("short", short_prompt, 6, 3))

    long_choice, short_choice = asyncio.run(run())
    after = httpx.get(engine_url + "/stats").json()
    assert len(long_choice["token_ids"]) == 110
    assert finished["short"] < finished["long"]  # it did not wait for the long loop to end
    assert after["num_batches"] - before["num_batches"] == 1  # it joined the running loop
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([short_prompt]), max_new_tokens=6, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    assert short_choice["token_ids"] == ref[0, len(short_prompt):].tolist()  # as if generated alone
    want = hf_logprobs(hf_model, short_prompt, short_choice["token_ids"])
    got = short_choice["logprobs"]["token_logprobs"]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4


@pytest.mark.parametrize("dtype, want", [("auto", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16")])
def test_the_contracts_command_parses_and_sets_the_model_dtype(dtype, want):
    """The CPU engine's own parser reads the command the contract builds for it;
    `model.dtype` reaches it (auto: float32, the trainer's master weights)."""
    import yaml

    from rlhf_contract.api import validate_job
    from rlhf_contract.pod import serve_command
    from rlhf_inference.cpu_engine.__main__ import parse_args

    root = Path(__file__).resolve().parents[2]
    doc = yaml.safe_load((root / "examples" / "local-grpo.yaml").read_text())
    doc["spec"]["model"]["dtype"] = dtype
    command = serve_command(validate_job(doc).spec, model_path="m", host="127.0.0.1", port=8000, name="n")
    assert command[1:3] == ["-m", "rlhf_inference.cpu_engine"]
    args = parse_args(command[3:])
    assert args.dtype == want and args.generation_config == "vllm" and args.served_model_name == "n"
