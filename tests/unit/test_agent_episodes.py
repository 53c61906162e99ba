"""Agent episodes (`rollout.agent`, rollout/agent_episodes.py and agent_endpoint.py): real agent
processes (the example agents: examples/calculator_agent.py, urllib alone, and
examples/calculator_agent_openai.py, the real `openai` client; and plain-HTTP agents that
misbehave), the real endpoint, tokenizer and chat template of builtin://tiny-qwen2-tools, the
real sampler, orchestrator and reward; a scripted policy stands in for the rollout server
(helpers.ScriptedPolicy: it emits chosen token ids and log-probs, as the engine would), so what
the trainer receives can be compared token by token with what the engine emitted."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from helpers import PromptList, ScriptedPolicy
from rlhf_contract.api.load import validate_job
from rlhf_contract.trainer_config import TrainerConfig
from rlhf_trainer.models.builtin import CALL_CLOSE, CALL_OPEN, IM_END
from rlhf_trainer.orchestrator.orchestrator import Orchestrator
from rlhf_trainer.orchestrator.sampler import Sampler
from rlhf_trainer.rewards import build_reward
from rlhf_trainer.rollout.agent_episodes import AgentRollout

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_AGENT = ROOT / "examples" / "calculator_agent.py"
EXAMPLE_AGENTS = {"urllib": EXAMPLE_AGENT, "openai": ROOT / "examples" / "calculator_agent_openai.py"}
# a plain-HTTP agent (no OpenAI library) whose behaviour depends on its prompt
HOSTILE = r'''
import json, os, sys, time, urllib.error, urllib.request

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]


def chat(messages, key=None):
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "policy", "messages": messages, "tools": TOOLS}).encode(),
        headers={"Authorization": "Bearer " + (key or os.environ["OPENAI_API_KEY"]),
                 "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


log = os.environ.get("AGENT_LOG")
if log:
    with open(log, "a") as f:
        f.write(f"{time.monotonic()} 1\n")
messages = json.load(sys.stdin)["messages"]
prompt = messages[-1]["content"]
if prompt == "4+4=":
    sys.exit(0)  # never calls
if prompt == "5+5=":  # another key is refused
    status, _ = chat(messages, key="not-the-key")
    if status != 401:
        sys.exit(f"a wrong key got {status}")
status, reply = chat(messages)
if status != 200:
    sys.exit(f"{status}: {reply}")
message = reply["choices"][0]["message"]
if prompt == "1+1=":
    time.sleep(3600)
if prompt == "2+2=":
    print("the agent broke", file=sys.stderr)
    sys.exit(1)
if prompt == "3+3=":  # rewrites history: its own words in place of the model's call
    messages = messages + [{"role": "assistant", "content": "I add."}, {"role": "tool", "content": "6"}]
else:
    for call in message.get("tool_calls") or []:
        messages = messages + [message, {"role": "tool", "tool_call_id": call["id"], "content": "10"}]
status, reply = chat(messages)
if log:
    time.sleep(0.3)
    with open(log, "a") as f:
        f.write(f"{time.monotonic()} -1\n")
sys.exit(0 if status in (200, 400) else f"{status}: {reply}")
'''
CONVERSATION_REWARD = '''
def reward(response, answer, extra_info):
    """The number of recorded messages, plus one for the right answer."""
    return len(extra_info["conversation"]) + float(response == answer)
'''


def config(agent: dict, reward: dict | None = None, **rollout) -> TrainerConfig:
    return TrainerConfig.from_job(validate_job({
        "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "agent"},
        "spec": {"model": {"path": "m"}, "data": {"path": "builtin://sum-mod-10"},
                 "algorithm": {"preset": "reinforce_pp"},  # one sample per prompt
                 **({"reward": reward} if reward else {}),
                 "rollout": {"engine": "cpu", "samplesPerPrompt": 1, "maxTokens": 64, "agent": agent, **rollout}}}))


def collect(tok, cfg: TrainerConfig, policy: ScriptedPolicy, prompts, tmp_path):
    cfg = cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={"prompts_per_step": len(prompts)})})
    sampler = Sampler(cfg, policy, build_reward(cfg.reward), tok, tools=AgentRollout(cfg.agent, tok))
    return Orchestrator(cfg, data=PromptList(prompts), sampler=sampler, output_dir=tmp_path).collect(step=1)


def call(expression: str) -> str:
    return CALL_OPEN + expression + CALL_CLOSE


@pytest.mark.parametrize("client", sorted(EXAMPLE_AGENTS))
def test_the_trainer_gets_the_engines_tokens_of_an_openai_client_agent(tools_tokenizer, tmp_path, client):
    """Each example agent (urllib alone; the openai package) calls the endpoint three times (a
    call; two calls at once; the answer): the trainer's row is exactly the engine's tokens with
    the template's tool messages between them, mask 0 on exactly those, each model token with
    the engine's log-prob; the reward gets the recorded conversation."""
    if client == "openai":
        pytest.importorskip("openai")
    tok = tools_tokenizer
    reward_file = tmp_path / "conversation_reward.py"
    reward_file.write_text(CONVERSATION_REWARD)
    cfg = config({"command": ["python", str(EXAMPLE_AGENTS[client])]},
                 reward={"type": "python", "file": str(reward_file), "function": "reward"})
    policy = ScriptedPolicy(tok, {"7+5=": [call("7+5") + IM_END, call("1+2") + call("3") + IM_END, "2" + IM_END]})
    batch = collect(tok, cfg, policy, [("7+5=", "2")], tmp_path)
    [row] = batch.rows
    e1, e2, e3 = policy.emitted["7+5="]
    obs1 = policy.ids("\n<|im_start|>user\n<tool_response>12</tool_response><|im_end|>\n<|im_start|>assistant\n")
    obs2 = policy.ids("\n<|im_start|>user\n<tool_response>3</tool_response>\n<tool_response>3</tool_response>"
                      "<|im_end|>\n<|im_start|>assistant\n")
    assert row.prompt_ids == policy.ids("<|im_start|>system\n<tools>calculator</tools><|im_end|>\n<|im_start|>user\n"
                                        "7+5=<|im_end|>\n<|im_start|>assistant\n")
    assert e2.prompt_token_ids == row.prompt_ids + e1.token_ids + obs1  # each call continues the recorded tokens
    assert e3.prompt_token_ids == row.prompt_ids + e1.token_ids + obs1 + e2.token_ids + obs2
    assert row.response_ids == e1.token_ids + obs1 + e2.token_ids + obs2 + e3.token_ids
    assert row.mask() == [1.0] * len(e1.token_ids) + [0.0] * len(obs1) + [1.0] * len(e2.token_ids) \
        + [0.0] * len(obs2) + [1.0] * len(e3.token_ids)
    assert row.rollout_logprobs == e1.logprobs + [0.0] * len(obs1) + e2.logprobs + [0.0] * len(obs2) + e3.logprobs
    assert row.extra == {"end": "answer", "turns": 3, "tool_calls": 3, "tool_errors": 0, "segments": 1}
    # user, call, result, two calls, two results, answer; and the answer is right
    assert (row.reward, row.truncated) == (7 + 1.0, False)
    assert batch.stats.tools == {"tool_calls_mean": 3.0, "tool_errors": 0.0, "turns_mean": 3.0,
                                 "tool_failed_fraction": 0.0, "agent_failed_fraction": 0.0}


def test_a_hanging_failing_silent_or_rewriting_agent_ends_only_its_episode(tools_tokenizer, tmp_path):
    tok = tools_tokenizer
    agent = tmp_path / "hostile_agent.py"
    agent.write_text(HOSTILE)
    cfg = config({"command": [sys.executable, str(agent)], "timeoutSeconds": 4})
    prompts = [("1+1=", "2"), ("2+2=", "4"), ("3+3=", "6"), ("4+4=", "8"), ("5+5=", "0")]
    scripts = {p: [call(p[:-1]) + IM_END, a + IM_END] for p, a in prompts}
    policy = ScriptedPolicy(tok, scripts)
    start = time.monotonic()
    batch = collect(tok, cfg, policy, prompts, tmp_path)
    assert time.monotonic() - start < 60  # the hanging agent (an hour) was killed at its 4 s limit
    rows = dict(zip((p for p, _ in prompts), batch.rows))
    ends = {p: (r.extra["end"], r.extra["segments"], r.reward) for p, r in rows.items()}
    assert ends == {"1+1=": ("agent_timeout", 1, 0.0), "2+2=": ("agent_failed", 1, 0.0), "3+3=": ("answer", 2, 1.0),
                    "4+4=": ("agent_failed", 0, 0.0), "5+5=": ("answer", 1, 1.0)}
    assert "timeoutSeconds" in rows["1+1="].extra["agent_error"]
    assert rows["2+2="].extra["agent_error"] == "exit status 1: the agent broke"
    assert "without a chat completion call" in rows["4+4="].extra["agent_error"]
    assert batch.stats.tools["agent_failed_fraction"] == pytest.approx(3 / 5)
    for p in ("1+1=", "2+2="):  # what was recorded before the agent went wrong: the model's call
        [emitted] = policy.emitted[p]
        assert rows[p].response_ids == emitted.token_ids and rows[p].mask() == [1.0] * len(emitted.token_ids)
    assert rows["4+4="].mask() == [0.0]  # nothing recorded: nothing to train on
    # the rewritten history is a new segment: the template's rendering of what the agent sent,
    # then the engine's answer; the first segment (the model's call) is not trained on
    first, second = policy.emitted["3+3="]
    assert rows["3+3="].prompt_ids == second.prompt_token_ids == policy.ids(
        "<|im_start|>system\n<tools>calculator</tools><|im_end|>\n<|im_start|>user\n3+3=<|im_end|>\n"
        "<|im_start|>assistant\nI add.<|im_end|>\n<|im_start|>user\n<tool_response>6</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert rows["3+3="].response_ids == second.token_ids and rows["3+3="].mask() == [1.0] * len(second.token_ids)


def test_episodes_run_concurrently_up_to_the_limit_and_budgets_truncate(tools_tokenizer, tmp_path, monkeypatch):
    tok = tools_tokenizer
    agent = tmp_path / "agent.py"
    agent.write_text(HOSTILE)
    log = tmp_path / "running.log"
    monkeypatch.setenv("AGENT_LOG", str(log))
    cfg = config({"command": [sys.executable, str(agent)], "maxConcurrentEpisodes": 2})
    prompts = [(f"{i}+5=", str((i + 5) % 10)) for i in range(5, 10)]
    policy = ScriptedPolicy(tok, {p: [call(p[:-1]) + IM_END, a + IM_END] for p, a in prompts}, delay_s=0.05)
    batch = collect(tok, cfg, policy, prompts, tmp_path)
    assert [r.extra["end"] for r in batch.rows] == ["answer"] * 5
    running, most = 0, 0
    for line in sorted(log.read_text().splitlines(), key=lambda x: float(x.split()[0])):
        running += int(line.split()[1])
        most = max(most, running)
    assert most == 2
    # one call allowed: the second is refused (400) and the episode is truncated on the model's call
    log.unlink()
    cfg = config({"command": [sys.executable, str(agent)], "maxTurns": 1})
    policy = ScriptedPolicy(tok, {"7+5=": [call("7+5") + IM_END, "2" + IM_END]})
    [row] = collect(tok, cfg, policy, [("7+5=", "2")], tmp_path).rows
    assert (row.extra["end"], row.truncated, row.extra["turns"]) == ("turn_budget", True, 1)
    assert row.response_ids == policy.emitted["7+5="][0].token_ids
    # a token budget: the answer is cut at what is left of rollout.maxTokens (6 call tokens, 13 of
    # the tool message, 3 left)
    cfg = config({"command": [sys.executable, str(agent)]}, maxTokens=22)
    policy = ScriptedPolicy(tok, {"7+5=": [call("7+5") + IM_END, "2222222" + IM_END]})
    [row] = collect(tok, cfg, policy, [("7+5=", "2")], tmp_path).rows
    assert (row.extra["end"], row.truncated, len(row.response_ids)) == ("token_budget", True, 22)
    assert row.mask()[-1] == 1.0


def test_a_failing_rollout_server_fails_the_step_not_the_agent(tools_tokenizer, tmp_path):
    """A generation request that fails is the servers' fault: the agent gets a 502 and the
    collection raises the rollout error (the run restarts), rather than training on it."""
    from rlhf_trainer.rollout.client import RolloutError

    class Down(ScriptedPolicy):
        async def generate(self, prompts, **_):
            raise RolloutError("http://rollout-0: connection refused")

    agent = tmp_path / "agent.py"
    agent.write_text(HOSTILE)
    cfg = config({"command": [sys.executable, str(agent)]})
    with pytest.raises(RolloutError, match="connection refused"):
        collect(tools_tokenizer, cfg, Down(tools_tokenizer, {}), [("7+5=", "2")], tmp_path)


def test_rollout_agent_excludes_the_tool_loop_and_environments():
    base = {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "agent"},
            "spec": {"model": {"path": "m"}, "data": {"path": "builtin://sum-mod-10"},
                     "rollout": {"agent": {"command": ["python", "agent.py"]}}}}
    tools = {"functions": [{"file": str(ROOT / "examples" / "calculator_tool.py"), "function": "calculator"}]}
    with pytest.raises(ValueError, match=r"spec.rollout.agent: cannot be set with rollout.tools"):
        validate_job({**base, "spec": {**base["spec"], "rollout": {**base["spec"]["rollout"], "tools": tools}}})
    with pytest.raises(ValueError, match=r"spec.rollout.agent: cannot be set with spec.environment"):
        validate_job({**base, "spec": {**base["spec"], "environment": {"file": "env.py"}}})
    with pytest.raises(ValueError, match=r"rollout.agent.command"):
        validate_job({**base, "spec": {**base["spec"], "rollout": {"agent": {"command": []}}}})


def test_the_preflight_names_an_agent_that_cannot_start(tmp_path):
    from rlhf_trainer.preflight import check

    problems = check(config({"command": ["no-such-agent-program", "--fast"]}), 1)
    assert any(p.startswith("spec.rollout.agent.command[0]: no-such-agent-program is not a program") for p in problems)
    problems = check(config({"command": ["python", str(tmp_path / "missing.py")]}), 1)
    assert any(p.startswith("spec.rollout.agent.command[1]: cannot read") for p in problems)
    assert not [p for p in check(config({"command": ["python", str(EXAMPLE_AGENT)]}), 1) if "rollout.agent" in p]
