"""TRL's whole reward contract (rewards/forms.py, as TRL 1.16's GRPOTrainer._calculate_rewards
calls a reward function): `trainer_state`, `log_metric` and `log_extra` through a real
orchestrator step (a stand-in rollout client, the real sampler and reward), dotted import
paths and `trl.rewards`' own functions, None and NaN as "does not apply", async functions
awaited together, and `reward.kwargs` from the contract to the call."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from types import SimpleNamespace

import pytest

from rlhf_contract.api import validate_job
from rlhf_contract.api.task import RewardSpec
from rlhf_contract.trainer_config import TrainerConfig
from rlhf_trainer.data.rendering import PromptRecord
from rlhf_trainer.orchestrator.orchestrator import Orchestrator
from rlhf_trainer.orchestrator.sampler import Sampler
from rlhf_trainer.preflight.rewards import reward_problems
from rlhf_trainer import rewards as rewards_module
from rlhf_trainer.rewards import Sample, build_reward
from rlhf_trainer.rewards.custom import RewardError
from rlhf_trainer.rewards.forms import RewardConfigError, load_function, python_reward, trainer_state
from rlhf_trainer.tracking import Trackers

REWARDS = '''
import asyncio, time

def staged(completions, answer, trainer_state, log_metric, log_extra, **kwargs):
    """Reads TRL's trainer_state, logs two metrics and a column, as TRL's docs show."""
    rewards = [float(c == a) for c, a in zip(completions, answer)]
    log_metric("global_step", trainer_state.global_step)
    log_metric("progress", trainer_state.global_step / trainer_state.max_steps)
    log_metric("accuracy", sum(rewards) / len(rewards))
    log_extra("gold", list(answer))
    return rewards

def by_kwargs(**kwargs):
    """The keyword TRL's users index: kwargs["trainer_state"] (the bug of issue 52)."""
    return [float(kwargs["trainer_state"].global_step)] * len(kwargs["completions"])

def skips(completions, **kwargs):
    return [None if c == "1" else float("nan") if c == "2" else 1.0 for c in completions]

def per_response_skips(response, answer, extra_info):
    return None if response == "1" else float("nan") if response == "2" else {"reward": 1.0}

async def slow_group(completions, **kwargs):
    await asyncio.sleep(0.2)
    return [1.0] * len(completions)

async def slow_each(response, answer, extra_info, delay=0.2):
    await asyncio.sleep(delay)
    return 1.0

def shaped(completions, answer, scale, tags, **kwargs):
    return [scale * float(c == a) + len(tags) for c, a in zip(completions, answer)]

def shaped_each(response, answer, extra_info, scale=1.0):
    return scale * float(response == answer)

def verl_shaped(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    return {"score": scale * float(solution_str == ground_truth)}

def bad_metric(completions, log_metric, **kwargs):
    log_metric("x", "high")
    return [0.0] * len(completions)
'''


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "trl_contract.py"
    path.write_text(REWARDS)
    return str(path)


def job(reward: dict, **spec) -> TrainerConfig:
    return TrainerConfig.from_job(validate_job({
        "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "trl"},
        "spec": {"model": {"path": "m"}, "data": {"path": "builtin://last-digit"}, "rollout": {"engine": "cpu"},
                 "reward": reward, **spec}}))


class Tokenizer:
    """Token i is the digit str(i)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(str(i) for i in ids)


class Client:
    """The rollout client's `generate`: sample j of each prompt is the token j % 4."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s

    async def generate(self, prompts, *, n, first_index, **_):
        await asyncio.sleep(self.delay_s)
        return [[SimpleNamespace(token_ids=[j % 4], prompt_token_ids=list(prompts[0]), logprobs=[-0.5],
                                 finish_reason="stop", versions=None) for j in range(n)]]


class Data:
    """Prompts whose answer is "1"; `position` and `num_rows` as PromptSource has them."""

    num_rows = 8

    def __init__(self):
        self.position = 0

    def next_batch(self, n):
        self.position += n
        return [PromptRecord(f"{i}1:", [i, 1], "1", {"prompt": f"{i}1:", "answer": "1"}) for i in range(n)]


def orchestrator(config: TrainerConfig, tmp_path, delay_s: float = 0.0) -> Orchestrator:
    sampler = Sampler(config, Client(delay_s), build_reward(config.reward), Tokenizer())
    return Orchestrator(config, data=Data(), sampler=sampler, output_dir=tmp_path)


def test_trainer_state_log_metric_and_log_extra_reach_the_step(reward_file, tmp_path):
    config = job({"type": "python", "name": "trl", "file": reward_file, "function": "staged"},
                 schedule={"totalSteps": 10, "promptsPerStep": 2, "saveEvery": 5},
                 rollout={"engine": "cpu", "samplesPerPrompt": 4})
    orch = orchestrator(config, tmp_path)
    batch = orch.collect(step=5)
    # every group: responses "0" "1" "2" "3" against the answer "1": accuracy 1/4
    assert batch.stats.reward_counters == {"trl/global_step": 4.0, "trl/progress": 0.4, "trl/accuracy": 0.25}
    assert [r.reward for r in batch.rows] == [0.0, 1.0, 0.0, 0.0] * 2
    assert [r.extra for r in batch.rows] == [{"gold": "1"}] * 8
    assert orch.collect(step=6).stats.reward_counters["trl/global_step"] == 5.0  # drained each step
    state = orch.trainer_state(7)
    assert (state.global_step, state.max_steps, state.save_steps, state.train_batch_size) == (6, 10, 5, 2)
    assert state.epoch == pytest.approx(4 / 8) and state.num_train_epochs == 3  # 4 prompts of 8 so far; 20 in all
    # the samples table gets the logged column (TensorBoard's markdown, W&B's and MLflow's tables alike)
    table = Trackers.sample_table(SimpleNamespace(spec=SimpleNamespace(samples_per_table=2)), 6, batch.rows,
                                  Tokenizer().decode)
    assert table[1] == {"step": 6, "prompt": "01", "completion": "1", "reward": 1.0, "score": 1.0, "gold": "1"}


def test_a_function_indexing_kwargs_for_trainer_state_runs(reward_file):
    spec = RewardSpec(type="python", file=reward_file, function="by_kwargs")
    reward = build_reward(spec)
    reward.begin_step(trainer_state(global_step=7, max_steps=9))
    assert reward.score_batch([Sample("1", "1", {})] * 2) == [(7.0, 7.0)] * 2
    with pytest.raises(RewardError, match=r"'bad_metric' in .* log_metric\('x', 'high'\); the value must be a number"):
        python_reward(reward_file, "bad_metric")([Sample("1", "1", {})])


def test_metrics_of_components_are_named_by_function_and_averaged_over_the_step(reward_file):
    spec = RewardSpec(type="exact_match", components=[
        {"name": "a", "type": "python", "file": reward_file, "function": "staged", "weight": 0.0}])
    reward = build_reward(spec)
    reward.begin_step(trainer_state(global_step=1, max_steps=4))
    reward.score_batch([Sample("1", "1", {}), Sample("0", "1", {})])
    reward.score_batch([Sample("1", "1", {}), Sample("1", "1", {})])
    assert reward.drain_metrics() == {"a/global_step": 1.0, "a/progress": 0.25, "a/accuracy": 0.75}  # (0.5 + 1) / 2
    assert reward.drain_metrics() == {}


def test_dotted_import_paths_as_trls_cli_takes_them(tmp_path, monkeypatch, reward_file):
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    batch = [Sample("1", "1", {}), Sample("2", "1", {})]
    assert python_reward(None, "my_pkg.rewards.shaped_each")(batch) == [(1.0, 1.0), (0.0, 0.0)]
    assert python_reward(None, "my_pkg.rewards:shaped_each")(batch) == [(1.0, 1.0), (0.0, 0.0)]
    with pytest.raises(RewardConfigError, match=r"'my_pkg.rewards' has no function 'nope'"):
        load_function(None, "my_pkg.rewards.nope")
    # the contract takes a dotted path without a file; a bare name still needs the file
    assert job({"type": "python", "function": "my_pkg.rewards.shaped_each"}).reward.function == "my_pkg.rewards.shaped_each"
    with pytest.raises(ValueError, match=r"reward.file: is required when reward.type is python, unless reward.function "
                                         r"is an import path \(package.module.function"):
        job({"type": "python", "function": "accuracy_reward"})


def chat(response: str, **columns) -> Sample:
    return Sample(response, "", {"prompt": [{"role": "user", "content": "q"}], **columns},
                  [{"role": "user", "content": "q"}], [1] * len(response))


def test_trls_own_reward_functions_by_import_path():
    think = python_reward(None, "trl.rewards.think_format_reward")
    assert think([chat("<think>\nhm\n</think>\n4"), chat("4")]) == [(1.0, 1.0), (0.0, 0.0)]
    accuracy = build_reward(RewardSpec(type="python", function="trl.rewards.accuracy_reward"))
    columns: dict = {}
    batch = [chat(r"so \boxed{\frac{1}{3}}", solution=r"$\frac{1}{3}$"), chat(r"\boxed{2}", solution=r"$\frac{1}{3}$"),
             chat(r"\boxed{2}", solution="no math here")]
    assert accuracy.score_batch(batch, columns) == [(1.0, 1.0), (0.0, 0.0), (0.0, 0.0)]  # the 3rd: None, counts 0
    assert accuracy.score_all(batch)[2] is None
    assert set(columns) == {"solution", "gold_parsed", "answer_parsed"} and columns["answer_parsed"][2] == "[skipped]"
    # a factory of trl.rewards is made with reward.kwargs: DAPO's soft overlong punishment, L=4, cache 2
    overlong = python_reward(None, "trl.rewards.get_soft_overlong_punishment",
                             kwargs={"max_completion_len": 4, "soft_punish_cache": 2})
    assert [r for r, _ in overlong([chat("ab"), chat("abc"), chat("abcde")])] == [0.0, -0.5, -1.0]
    assert reward_problems(job({"type": "python", "function": "trl.rewards.get_soft_overlong_punishment",
                                "kwargs": {"max_completion_len": 4}})) == [
        "spec.reward.kwargs: trl.rewards.get_soft_overlong_punishment makes the reward function from reward.kwargs: "
        "get_soft_overlong_punishment() missing 1 required positional argument: 'soft_punish_cache'"]


def test_none_and_nan_do_not_apply_in_every_form_and_all_none_counts_zero(reward_file, caplog, monkeypatch):
    batch = [Sample("1", "1", {}), Sample("2", "1", {}), Sample("3", "1", {})]
    assert python_reward(reward_file, "skips")(batch) == [None, None, (1.0, 1.0)]
    assert python_reward(reward_file, "per_response_skips")(batch) == [None, None, (1.0, 1.0)]
    spec = RewardSpec(type="python", file=reward_file, function="skips", name="skips", components=[
        {"name": "exact", "type": "exact_match", "weight": 2.0}])
    results = build_reward(spec).score_batch(batch)  # TRL's nansum over functions, nanmean per function
    assert [total for total, _, _ in results] == [2.0, 0.0, 1.0]
    assert math.isnan(results[1][2]["skips"]) and results[2][2] == {"skips": 1.0, "exact": 0.0}
    monkeypatch.setattr(rewards_module, "_warned_unscorable", False)
    with caplog.at_level(logging.WARNING):  # every function skipped "1" and "2": reward 0, said once
        assert build_reward(RewardSpec(type="python", file=reward_file, function="skips")).score_batch(batch) == [
            (0.0, 0.0), (0.0, 0.0), (1.0, 1.0)]
        build_reward(RewardSpec(type="python", file=reward_file, function="skips")).score_batch(batch)
    assert caplog.text.count("every reward function returned None for 2 responses of a batch: each gets reward 0") == 1


def test_async_functions_are_awaited_together(reward_file, tmp_path):
    each = python_reward(reward_file, "slow_each")
    start = time.monotonic()
    assert each([Sample("1", "1", {})] * 10) == [(1.0, 1.0)] * 10
    assert time.monotonic() - start < 10 * 0.2 / 3  # 10 calls of 0.2 s together, not 2 s
    # a TRL-form async function: one call per group, and the sampler scores the groups at once
    config = job({"type": "python", "file": reward_file, "function": "slow_group"},
                 schedule={"totalSteps": 10, "promptsPerStep": 10}, rollout={"engine": "cpu", "samplesPerPrompt": 2})
    orch = orchestrator(config, tmp_path)
    assert orch.sampler.reward.concurrent
    start = time.monotonic()
    batch = orch.collect(step=1)
    assert len(batch.rows) == 20 and time.monotonic() - start < 10 * 0.2 / 3
    # one event loop for every call: a client kept between calls stays usable
    from rlhf_trainer.rewards.calls import reward_loop

    assert reward_loop() is reward_loop()


def test_reward_kwargs_reach_every_form(reward_file):
    batch = [Sample("1", "1", {}), Sample("2", "1", {})]
    trl = build_reward(RewardSpec(type="python", file=reward_file, function="shaped",
                                  kwargs={"scale": 3.0, "tags": ["a", "b"]}))
    assert trl.score_batch(batch) == [(5.0, 5.0), (2.0, 2.0)]
    assert python_reward(reward_file, "shaped_each", kwargs={"scale": 4})(batch) == [(4.0, 4.0), (0.0, 0.0)]
    assert python_reward(reward_file, "verl_shaped", kwargs={"scale": 5})(batch) == [(5.0, 5.0), (0.0, 0.0)]
    # the preflight knows reward.kwargs: "scale" and "tags" are given, a missing one is named
    assert reward_problems(job({"type": "python", "file": reward_file, "function": "shaped",
                                "kwargs": {"scale": 1, "tags": []}})) == []
    [problem] = reward_problems(job({"type": "python", "file": reward_file, "function": "shaped", "kwargs": {"scale": 1}}))
    assert problem.startswith("spec.reward.function: reward function 'shaped'") and "requires tags" in problem
    [problem] = reward_problems(job({"type": "python", "file": reward_file, "function": "shaped_each",
                                     "kwargs": {"weight": 1}}))
    assert "fits no reward form" in problem and "reward.kwargs (weight)" in problem


def test_reward_kwargs_in_the_contract():
    spec = job({"type": "python", "function": "m.f", "kwargs": {"scale": 2, "nested": {"a": [1, None, "x"]}},
                "components": [{"name": "c", "type": "python", "function": "m.g", "kwargs": {"k": True}}]})
    assert spec.reward.kwargs == {"scale": 2, "nested": {"a": [1, None, "x"]}} and spec.reward.components[0].kwargs == {"k": True}
    with pytest.raises(ValueError, match=r"spec.reward.kwargs: keys \['trainer_state'\] are passed by the trainer itself"):
        job({"type": "python", "function": "m.f", "kwargs": {"trainer_state": 1}})
    with pytest.raises(ValueError, match=r"keys \['max-len'\] are not Python keyword-argument names"):
        job({"type": "python", "function": "m.f", "kwargs": {"max-len": 1}})
    from rlhf_contract.api.crd import crd

    [version] = crd()["spec"]["versions"]
    kwargs = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["reward"]["properties"]["kwargs"]
    assert kwargs["type"] == "object" and kwargs["x-kubernetes-preserve-unknown-fields"] is True  # kept as written
    assert json.dumps(spec.reward.kwargs)  # JSON as written
