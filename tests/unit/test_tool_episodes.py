"""Tool-calling episodes (`rollout.tools`, rollout/tool_episodes.py and tools.py): the real
tokenizer and chat template of builtin://tiny-qwen2-tools, real tool worker processes, the
real sampler, orchestrator and reward; a scripted policy stands in for the rollout server
(it emits chosen token ids and log-probs, as the engine would), so what the trainer receives
can be compared token by token with what the engine emitted and what the template wrote."""

from __future__ import annotations

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
from rlhf_trainer.rollout.tool_episodes import ToolRollout
from rlhf_trainer.rollout.tools import ToolConfigError, load_tools, parse_tool_calls

ROOT = Path(__file__).resolve().parents[2]
CALCULATOR = ROOT / "examples" / "calculator_tool.py"
HOSTILE = '''
import os, sys, time

def calculator(expression: str) -> str:
    """A calculator that misbehaves on some sums.

    Args:
        expression: the sum.
    """
    if expression == "1+1":
        time.sleep(3600)
    if expression == "2+2":
        raise ZeroDivisionError("the tool broke")
    if expression == "3+3":
        print("x" * 100_000_000)
    if expression == "4+4":
        os._exit(3)
    return str(sum(int(t) for t in expression.split("+")))
'''


@pytest.fixture
def tok(tools_tokenizer):
    return tools_tokenizer


def config(tools: dict, **rollout) -> TrainerConfig:
    return TrainerConfig.from_job(validate_job({
        "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "tools"},
        "spec": {"model": {"path": "m"}, "data": {"path": "builtin://sum-mod-10"},
                 "algorithm": {"preset": "reinforce_pp"},  # one sample per prompt
                 "rollout": {"engine": "cpu", "samplesPerPrompt": 1, "maxTokens": 64, "tools": tools, **rollout}}}))


def collect(tok, cfg: TrainerConfig, policy: ScriptedPolicy, prompts, tmp_path):
    tools = ToolRollout(cfg.tools, tok)
    sampler = Sampler(cfg, policy, build_reward(cfg.reward), tok, tools=tools)
    orch = Orchestrator(cfg, data=PromptList(prompts), sampler=sampler, output_dir=tmp_path)
    try:
        return orch.collect(step=1)
    finally:
        tools.close()


def call(expression: str) -> str:
    return CALL_OPEN + expression + CALL_CLOSE


def test_the_trainer_gets_the_engines_tokens_and_the_templates_tool_messages_masked(tok, tmp_path):
    """Three model turns (a call; two calls at once; the answer): the row the trainer trains on
    is exactly the engine's tokens with the template's tool-message tokens between them, mask 0
    on exactly those, each model token with the log-prob the engine gave."""
    cfg = config({"functions": [{"file": str(CALCULATOR), "function": "calculator"}], "maxTurns": 4})
    cfg = cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={"prompts_per_step": 1})})
    policy = ScriptedPolicy(tok, {"7+5=": [call("7+5") + IM_END, call("1+2") + call("3") + IM_END, "2" + IM_END]})
    batch = collect(tok, cfg, policy, [("7+5=", "2")], tmp_path)
    [row] = batch.rows
    e1, e2, e3 = policy.emitted["7+5="]
    # what the template writes for the tool messages, written out by hand (Qwen 2.5's layout)
    obs1 = policy.ids("\n<|im_start|>user\n<tool_response>12</tool_response><|im_end|>\n<|im_start|>assistant\n")
    obs2 = policy.ids("\n<|im_start|>user\n<tool_response>3</tool_response>\n<tool_response>3</tool_response>"
                      "<|im_end|>\n<|im_start|>assistant\n")
    assert row.prompt_ids == policy.ids("<|im_start|>system\n<tools>calculator</tools><|im_end|>\n<|im_start|>user\n"
                                        "7+5=<|im_end|>\n<|im_start|>assistant\n")
    assert e2.prompt_token_ids == row.prompt_ids + e1.token_ids + obs1  # each turn continues the same sequence
    assert row.response_ids == e1.token_ids + obs1 + e2.token_ids + obs2 + e3.token_ids
    assert row.mask() == [1.0] * len(e1.token_ids) + [0.0] * len(obs1) + [1.0] * len(e2.token_ids) \
        + [0.0] * len(obs2) + [1.0] * len(e3.token_ids)
    assert row.rollout_logprobs == e1.logprobs + [0.0] * len(obs1) + e2.logprobs + [0.0] * len(obs2) + e3.logprobs
    # and the whole sequence is what the template renders for the whole conversation
    calls = [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": x}}}
             for x in ("7+5", "1+2", "3")]
    conversation = [{"role": "user", "content": "7+5="},
                    {"role": "assistant", "content": "", "tool_calls": calls[:1]}, {"role": "tool", "content": "12"},
                    {"role": "assistant", "content": "", "tool_calls": calls[1:]}, {"role": "tool", "content": "3"},
                    {"role": "tool", "content": "3"}, {"role": "assistant", "content": "2"}]
    whole = tok.apply_chat_template(conversation, tools=load_tools(cfg.tools), tokenize=False)
    assert row.prompt_ids + row.response_ids == policy.ids(whole.removesuffix("\n"))
    assert (row.reward, row.truncated) == (1.0, False)
    assert row.extra == {"end": "answer", "turns": 3, "tool_calls": 3, "tool_errors": 0}
    assert batch.stats.tools == {"tool_calls_mean": 3.0, "tool_errors": 0.0, "turns_mean": 3.0,
                                 "tool_failed_fraction": 0.0}


def test_a_hanging_raising_flooding_or_dying_tool_ends_only_its_episode(tok, tmp_path):
    file = tmp_path / "hostile.py"
    file.write_text(HOSTILE)
    cfg = config({"functions": [{"file": str(file), "function": "calculator"}], "maxTurns": 3,
                  "timeoutSeconds": 2, "maxOutputBytes": 4096, "maxProcesses": 2})
    prompts = [("1+1=", "2"), ("2+2=", "4"), ("3+3=", "6"), ("4+4=", "8"), ("5+5=", "0"), ("6+6=", "2")]
    cfg = cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={"prompts_per_step": len(prompts)})})
    scripts = {p: [call(p[:-1]) + IM_END, a + IM_END] for p, a in prompts}
    scripts["6+6="] = [CALL_OPEN + "6+6" + IM_END, call("6+6") + IM_END, "2" + IM_END]  # an unclosed call first
    start = time.monotonic()
    policy = ScriptedPolicy(tok, scripts)
    batch = collect(tok, cfg, policy, prompts, tmp_path)
    assert time.monotonic() - start < 60  # the hanging tool (an hour) was killed at its 2 s limit
    ends = {p: (r.extra["end"], r.reward) for (p, _), r in zip(prompts, batch.rows)}
    assert ends == {"1+1=": ("tool_timeout", 0.0), "2+2=": ("tool_raised", 0.0), "3+3=": ("tool_output", 0.0),
                    "4+4=": ("tool_crashed", 0.0), "5+5=": ("answer", 1.0), "6+6=": ("answer", 1.0)}
    raised = batch.rows[1].extra["tool_error"]
    assert "ZeroDivisionError: the tool broke" in raised
    for row in batch.rows[:4]:  # ended on the model's call: no tool message appended
        assert row.mask()[-1] == 1.0 and 0.0 not in row.mask()
    assert batch.rows[5].extra == {"end": "answer", "turns": 3, "tool_calls": 2, "tool_errors": 1}
    e1, e2, e3 = policy.emitted["6+6="]  # the model's mistake is told to it, and it goes on
    told = policy.ids("\n<|im_start|>user\n<tool_response>error: a <tool_call> was not closed with </tool_call>"
                      "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    answer = policy.ids("\n<|im_start|>user\n<tool_response>12</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert batch.rows[5].response_ids == e1.token_ids + told + e2.token_ids + answer + e3.token_ids
    assert batch.stats.tools["tool_failed_fraction"] == pytest.approx(4 / 6)
    assert batch.stats.tools["tool_errors"] == 5.0


def test_episodes_run_concurrently_up_to_the_limit(tok, tmp_path):
    cfg = config({"functions": [{"file": str(CALCULATOR), "function": "calculator"}], "maxConcurrentEpisodes": 3})
    prompts = [(f"{i}+1=", str((i + 1) % 10)) for i in range(8)]
    cfg = cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={"prompts_per_step": 8})})
    policy = ScriptedPolicy(tok, {p: [call(p[:-1]) + IM_END, a + IM_END] for p, a in prompts}, delay_s=0.05)
    batch = collect(tok, cfg, policy, prompts, tmp_path)
    assert [r.reward for r in batch.rows] == [1.0] * 8
    assert policy.most_in_flight == 3


def test_budgets_truncate_and_end_on_the_models_tokens(tok, tmp_path):
    cfg = config({"functions": [{"file": str(CALCULATOR), "function": "calculator"}], "maxTurns": 2})
    cfg = cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={"prompts_per_step": 1})})
    batch = collect(tok, cfg, ScriptedPolicy(tok, {"7+5=": [call("7+5") + IM_END] * 2}), [("7+5=", "2")], tmp_path)
    [row] = batch.rows
    assert (row.extra["end"], row.truncated, row.extra["turns"]) == ("turn_budget", True, 2)
    assert row.mask()[-1] == 1.0
    short = config({"functions": [{"file": str(CALCULATOR), "function": "calculator"}]}, maxTokens=10)
    short = short.model_copy(update={"schedule": short.schedule.model_copy(update={"prompts_per_step": 1})})
    batch = collect(tok, short, ScriptedPolicy(tok, {"7+5=": [call("7+5") + IM_END, "2" + IM_END]}), [("7+5=", "2")], tmp_path)
    [row] = batch.rows
    assert (row.extra["end"], row.truncated, len(row.response_ids)) == ("token_budget", True, 6)
    assert batch.stats.truncated_fraction == 1.0


def test_hermes_tool_calls_are_parsed_and_mistakes_named():
    content, calls = parse_tool_calls('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
                                      '<tool_call>{"name": "sub", "arguments": "{\\"b\\": 2}"}</tool_call>')
    assert content == "Let me add."
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 1}, None), ("sub", {"b": 2}, None)]
    assert parse_tool_calls("4") == ("4", [])
    [bad] = parse_tool_calls("<tool_call>{name: add}</tool_call>")[1]
    assert "not JSON" in bad.error
    [shape] = parse_tool_calls('<tool_call>{"name": "add", "arguments": [1]}</tool_call>')[1]
    assert "arguments" in shape.error
    [unclosed] = parse_tool_calls('<tool_call>{"name": "add"')[1]
    assert "not closed" in unclosed.error


def test_schemas_come_from_the_function_or_the_job(tmp_path):
    cfg = config({"functions": [{"file": str(CALCULATOR), "function": "calculator"}]})
    [schema] = load_tools(cfg.tools)
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["properties"]["expression"]["type"] == "string"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    given = {"name": "calc", "description": "adds", "parameters": {"type": "object", "properties": {}}}
    cfg = config({"functions": [{"file": str(CALCULATOR), "function": "calculator", "schema": given}]})
    assert load_tools(cfg.tools) == [{"type": "function", "function": given}]
    cfg = config({"functions": [{"file": str(CALCULATOR), "function": "missing"}]})
    with pytest.raises(ToolConfigError, match=r"rollout.tools.functions\[0\]: .*defines no function 'missing'"):
        load_tools(cfg.tools)


def test_the_job_spec_names_what_to_change():
    from rlhf_contract.api.load import JobError

    with pytest.raises(Exception, match="appear more than once"):
        config({"functions": [{"file": "a.py", "function": "f"}, {"file": "b.py", "function": "f"}]})
    doc = {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "t"},
           "spec": {"model": {"path": "m"}, "data": {"path": "builtin://sum-mod-10"},
                    "environment": {"file": "env.py"},
                    "rollout": {"tools": {"functions": [{"file": "a.py", "function": "f"}]}}}}
    with pytest.raises((JobError, ValueError), match="rollout.tools.*environment"):
        validate_job(doc)


def test_the_preflight_names_a_tool_that_cannot_load(tmp_path):
    from rlhf_trainer.preflight import check

    broken = tmp_path / "broken.py"
    broken.write_text("def calculator(expression: str) -> str\n")
    problems = check(config({"functions": [{"file": str(CALCULATOR), "function": "add"}]}), 1)
    assert any(p.startswith("spec.rollout.tools.functions[0]: ") and "defines no function 'add'" in p for p in problems)
    problems = check(config({"functions": [{"file": str(broken), "function": "calculator"}]}), 1)
    assert any(p.startswith("spec.rollout.tools.functions[0].file: ") and "line 1" in p for p in problems)


def test_the_cold_start_shows_the_model_what_rl_renders_token_for_token(tok):
    """examples/data/tool-call-format.jsonl (the cold-start SFT of examples/local-tools.yaml)
    must be, token for token, what `rollout.tools` puts before each model turn in RL: the
    prompt the template renders with the calculator's schema (its name is unknown to the tiny
    vocabulary, so `<tools>` holds <unk> tokens in both) and, before the answer, the call the
    SFT teaches (ended by the EOS the SFT appends), then the template's tool message of the
    calculator's own result and the generation prompt. A cold start rendered otherwise would
    leave the SFT model's calls out of distribution in RL. Per sum: every digit once as an
    answer without the tool (a guess), the call rarely (so RL has the call to learn), the
    call's arguments once opened, and the result's last digit after the result; the file is
    what examples/data/make_tools_cold_start.py writes."""
    import contextlib
    import importlib.util
    import io
    import json
    import re
    from collections import Counter

    from rlhf_contract.api.tools import ToolsSpec
    from rlhf_trainer.rollout.tool_episodes import ChatFormat

    def load(path, name):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    calculator = load(CALCULATOR, "calculator_tool")
    maker = load(ROOT / "examples" / "data" / "make_tools_cold_start.py", "make_tools_cold_start")
    written = io.StringIO()
    with contextlib.redirect_stdout(written):
        maker.main()
    path = ROOT / "examples" / "data" / "tool-call-format.jsonl"
    assert written.getvalue() == path.read_text(), "regenerate it with examples/data/make_tools_cold_start.py"
    fmt = ChatFormat(tok, load_tools(ToolsSpec.model_validate({"functions": [{"file": str(CALCULATOR),
                                                                               "function": "calculator"}]})))
    rows = [json.loads(line) for line in path.open()]
    kinds: Counter = Counter()
    for row in rows:
        question = re.search(r"user\n(\d\+\d=)<\|im_end\|>", row["prompt"]).group(1)
        expression, rendered = question[:-1], fmt.prompt_ids(question)
        result = calculator.calculator(expression)
        prompt = fmt.ids(row["prompt"])
        if prompt == rendered and row["response"] == call(expression):
            kind = "call"
        elif prompt == rendered + fmt.ids(CALL_OPEN):
            assert row["response"] == call(expression)[len(CALL_OPEN):], row
            kind = "arguments"
        elif prompt == rendered:
            assert row["response"] in [str(d) for d in range(10)], row
            kind = "guess " + row["response"]
        else:
            generated = fmt.ids(call(expression)) + [tok.eos_token_id]
            assert prompt == rendered + generated + fmt.tool_turn_ids([result], generated), row
            assert row["response"] == result[-1] == str(sum(map(int, expression.split("+"))) % 10)
            kind = "read"
        kinds[question, kind] += 1
    for a in range(10):
        for b in range(10):
            q = f"{a}+{b}="
            assert all(kinds[q, f"guess {d}"] == kinds[q, "guess 0"] for d in range(10))
            assert 0 < kinds[q, "call"] <= kinds[q, "guess 0"] and kinds[q, "arguments"] > 0 and kinds[q, "read"] > 0
    assert sum(kinds.values()) == len(rows)
