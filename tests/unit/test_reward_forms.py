"""`reward.type: python` in each form (rewards/forms.py): ours per response, TRL's batched
signature as TRL calls it, veRL's compute_score, from a file and from an import path; None
as "does not apply"; what a user function can get wrong, each a clear error; and the
preflight's reward checks (exit 2 before any model loads)."""

from __future__ import annotations

import math

import pytest

from rlhf_contract.api import validate_job
from rlhf_contract.api.task import RewardSpec
from rlhf_contract.trainer_config import TrainerConfig
from rlhf_trainer.preflight.rewards import reward_problems
from rlhf_trainer.rewards import Sample, build_reward
from rlhf_trainer.rewards.custom import RewardError
from rlhf_trainer.rewards.forms import RewardConfigError, form_of, load_function, python_reward

TRL_STYLE = '''
import asyncio

def accuracy(completions, solution, **kwargs):
    """As TRL's docs write them: completions are text, or [{"role": "assistant", ...}]."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if t.strip() == s else 0.0 for t, s in zip(texts, solution)]

def seen(prompts, completions, completion_ids, level, **kwargs):
    """What TRL passes, echoed: the length of each argument's entry, the row's level column."""
    assert "prompt" not in kwargs and "solution" in kwargs
    return [len(p) * 100 + len(ids) * 10 + lv if isinstance(p, str) else -len(p)
            for p, ids, lv in zip(prompts, completion_ids, level)]

def only_long(completions, **kwargs):
    return [float(len(c)) if len(c) > 2 else None for c in completions]

async def async_batch(completions, **kwargs):
    await asyncio.sleep(0)
    return [0.5 for _ in completions]

def short(completions, **kwargs):
    return [1.0]

def nan(completions, **kwargs):
    return [float("nan")] * len(completions)

def raises(completions, **kwargs):
    raise KeyError("solution")

def everything(**kwargs):
    return [float(sorted(kwargs) == ["answer", "completion_ids", "completions", "level", "log_extra", "log_metric",
                                     "prompts", "solution", "trainer_state"])] * len(kwargs["completions"])

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """veRL's per-response form: a dict's score is the reward."""
    return {"score": float(solution_str.strip() == ground_truth) + (extra_info or {}).get("bonus", 0), "acc": 1}

def two(text, gold):
    return 1.0
'''


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "trl_rewards.py"
    path.write_text(TRL_STYLE)
    return str(path)


def samples(chat: bool = False) -> list[Sample]:
    prompt = [{"role": "user", "content": "12:"}] if chat else "12:"
    rows = [("2", "2", {"prompt": prompt, "solution": "2", "level": 1}, [5, 6]),
            ("23", "2", {"prompt": prompt, "solution": "2", "level": 2}, [5, 6, 7]),
            (" 2 ", "2", {"prompt": prompt, "solution": "2", "level": 3}, [5])]
    return [Sample(r, a, e, prompt, ids) for r, a, e, ids in rows]


def test_trl_functions_get_what_trl_passes_text_or_chat(reward_file):
    assert python_reward(reward_file, "accuracy")(samples()) == [(1.0, 1.0), (0.0, 0.0), (1.0, 1.0)]
    assert python_reward(reward_file, "accuracy")(samples(chat=True)) == [(1.0, 1.0), (0.0, 0.0), (1.0, 1.0)]
    # prompt text of 3 characters, completion_ids of 2, 3 and 1 tokens, the level column as a keyword
    assert [r for r, _ in python_reward(reward_file, "seen")(samples())] == [321.0, 332.0, 313.0]
    assert [r for r, _ in python_reward(reward_file, "seen")(samples(chat=True))] == [-1.0] * 3  # one chat turn
    assert python_reward(reward_file, "async_batch")(samples()) == [(0.5, 0.5)] * 3
    assert python_reward(reward_file, "everything")(samples()) == [(1.0, 1.0)] * 3  # **kwargs alone: TRL's form
    assert python_reward(reward_file, "only_long")(samples()) == [None, None, (3.0, 3.0)]


def test_none_does_not_apply_it_adds_nothing_and_leaves_the_functions_mean(reward_file):
    spec = RewardSpec(type="python", file=reward_file, function="only_long", name="long",
                      components=[{"name": "acc", "type": "python", "file": reward_file, "function": "accuracy",
                                   "weight": 2.0}])
    results = build_reward(spec).score_batch(samples())
    assert [total for total, _, _ in results] == [2.0, 0.0, 3.0 + 2.0]
    assert [score for _, score, _ in results] == [0.0, 0.0, 3.0]
    assert math.isnan(results[0][2]["long"]) and results[2][2] == {"long": 3.0, "acc": 1.0}
    from rlhf_trainer.data.sequences import Row
    from rlhf_trainer.orchestrator.orchestrator import rollout_stats

    rows = [Row([1], [2], [0.0], total, score, False, components=parts) for total, score, parts in results]
    stats = rollout_stats([rows], sampled=1, dropped=0)
    assert stats.components == {"long": 3.0, "acc": pytest.approx(2 / 3)}  # long: the one response it applied to
    single = RewardSpec(type="python", file=reward_file, function="only_long")
    assert build_reward(single).score_batch(samples()) == [(0.0, 0.0), (0.0, 0.0), (3.0, 3.0)]


def test_verl_compute_score_natively(reward_file):
    batch = samples()
    batch[0] = batch[0]._replace(extra_info={**batch[0].extra_info, "data_source": "gsm8k", "extra_info": {"bonus": 0.5}})
    assert python_reward(reward_file, "compute_score")(batch) == [(1.5, 1.5), (0.0, 0.0), (1.0, 1.0)]


def test_an_import_path_names_a_function_of_an_installed_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_pkg").mkdir()
    (tmp_path / "my_rewards_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_rewards_pkg" / "scoring.py").write_text(TRL_STYLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert python_reward(None, "my_rewards_pkg.scoring:accuracy")(samples()) == [(1.0, 1.0), (0.0, 0.0), (1.0, 1.0)]
    with pytest.raises(RewardConfigError, match=r"cannot import 'no_such_pkg.mod' \(ModuleNotFoundError.*install its package"):
        load_function(None, "no_such_pkg.mod:fn")
    with pytest.raises(RewardConfigError, match=r"'my_rewards_pkg.scoring' has no function 'nope'"):
        load_function(None, "my_rewards_pkg.scoring:nope")
    with pytest.raises(RewardConfigError, match=r"'reward_fn' is not an import path \(package.module.function"):
        load_function(None, "reward_fn")


def test_what_a_function_gets_wrong_is_an_error_naming_it(reward_file):
    with pytest.raises(RewardError, match=r"'short' in .*returned 1 rewards for 3 completions"):
        python_reward(reward_file, "short")(samples())
    assert python_reward(reward_file, "nan")(samples()) == [None] * 3  # NaN: does not apply, as in TRL
    with pytest.raises(RewardError, match=r"'raises' in .*raised KeyError: 'solution'"):
        python_reward(reward_file, "raises")(samples())
    with pytest.raises(RewardConfigError, match=r"'two' in .* fits no reward form \(too many positional arguments\); "
                                               r"it must accept \(response, answer, extra_info\) per response; TRL's"):
        python_reward(reward_file, "two")
    fn, where = load_function(reward_file, "accuracy")
    assert form_of(fn, where, {"prompt", "solution"}) == "trl"
    with pytest.raises(RewardConfigError, match=r"requires solution \(the data's columns: label\)"):
        form_of(fn, where, {"prompt", "label"})


def job(**reward) -> TrainerConfig:
    return TrainerConfig.from_job(validate_job({
        "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "forms"},
        "spec": {"model": {"path": "m"}, "data": {"path": "builtin://last-digit"}, "rollout": {"engine": "cpu"},
                 "reward": reward}}))


def test_the_preflight_finds_a_function_that_cannot_work(reward_file, tmp_path):
    assert reward_problems(job(type="python", file=reward_file, function="only_long")) == []
    [problem] = reward_problems(job(type="python", file=reward_file, function="accuracy"))
    assert problem.startswith("spec.reward.function: reward function 'accuracy'") and "requires solution" in problem
    [problem] = reward_problems(job(type="exact_match", components=[
        {"name": "x", "type": "python", "function": "no_such_pkg.mod:fn"}]))
    assert problem.startswith("spec.reward.components[0].function: cannot import 'no_such_pkg.mod'")
