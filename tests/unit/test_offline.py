"""Offline methods: the data layouts (multi-turn SFT masks, preference columns) and
admission. The losses are tested in offline/test_offline_losses.py."""

from __future__ import annotations

import pytest
import torch

from rlhf_contract.api import validate_job
from rlhf_contract.api.load import JobError
from rlhf_trainer.models.builtin import build_tokenizer
from rlhf_trainer.data.examples import Tokenize
from rlhf_trainer.offline.data import OfflineData
from rlhf_contract.api.models import DataSpec


CHAT = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}")


class CharTokenizer:
    """Characters as tokens, with a chat template (the built-in tokenizer has none)."""

    eos_token_id = 0
    chat_template = CHAT

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(ch) for ch in text]}

    def apply_chat_template(self, turns, add_generation_prompt=False, tokenize=False):
        from jinja2 import Template

        return Template(CHAT).render(messages=turns, add_generation_prompt=add_generation_prompt)


def test_multi_turn_sft_trains_on_assistant_turns_only():
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
             {"role": "user", "content": "ok?"}, {"role": "assistant", "content": "no"}]
    ex = Tokenize("sft", DataSpec(path="x"), CharTokenizer())({"messages": turns})
    (seq,) = ex.sequences
    text = "".join(chr(t) for t in seq.prompt_ids + seq.response_ids)
    assert text == "<u>hi<a>yo<u>ok?<a>no"
    trained = "".join(chr(t) for t, m in zip(seq.response_ids, seq.loss_mask) if m)
    assert trained == "yono"  # the assistant's words, not the user's nor the template's
    assert "".join(chr(t) for t in seq.prompt_ids) == "<u>hi<a>"


def test_preference_rows_accept_text_messages_and_message_lists():
    tok = CharTokenizer()
    t = Tokenize("dpo", DataSpec(path="x"), tok)
    a = t({"prompt": "p:", "chosen": "good", "rejected": "bad"})
    b = t({"messages": [{"role": "user", "content": "p"}],
           "chosen": {"role": "assistant", "content": "good"},
           "rejected": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "bad"}]})
    for ex in (a, b):
        chosen, rejected = ex.sequences
        assert chosen.prompt_ids == rejected.prompt_ids
        assert chosen.response_ids == [ord(c) for c in "good"] + [0]  # ends with EOS
        assert rejected.response_ids == [ord(c) for c in "bad"] + [0]
    with pytest.raises(ValueError, match=r"data\.rejectedKey: a row has no column 'rejected'"):
        t({"prompt": "p", "chosen": "x"})


def test_builtin_task_must_fit_the_method_and_held_out_examples_are_disjoint():
    tok = build_tokenizer()
    with pytest.raises(ValueError, match=r"data\.path: 'builtin://last-digit' is not a built-in dpo task; "
                                         r"choose one of builtin://prefer-even"):
        OfflineData("dpo", DataSpec(path="builtin://last-digit"), tok, seed=0, batch_size=4, budget=64)
    data = OfflineData("rm", DataSpec(path="builtin://prefer-even"), tok, seed=0, batch_size=4, budget=64)
    train = {tuple(s.prompt_ids + s.response_ids) for step in range(1, 20) for ex in data.batch(step)
             for s in ex.sequences}
    held = {tuple(s.prompt_ids + s.response_ids) for ex in data.eval for s in ex.sequences}
    assert len(data.eval) == 200 and data.batch(3) == data.batch(3)  # a pure function of the step
    assert len(train & held) < 0.1 * len(held)  # short toy strings may repeat; the indices never do


def test_dataset_file_split_into_train_and_held_out(tmp_path):
    rows = [{"prompt": f"{i}:", "response": str(i % 10)} for i in range(50)]
    (tmp_path / "d.jsonl").write_text("\n".join(__import__("json").dumps(r) for r in rows))
    data = OfflineData("sft", DataSpec(path=str(tmp_path / "d.jsonl")), build_tokenizer(),
                       seed=0, batch_size=8, budget=64, held_out_fraction=0.2)
    assert len(data.eval) == 10 and len(data.train) == 40
    assert not {id(e) for e in data.eval} & {id(e) for e in data.train}


def offline_job(**spec):
    return {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "x"},
            "spec": {"method": "sft", "model": {"path": "/m"}, "data": {"path": "/d"}, **spec}}


@pytest.mark.parametrize("field", ["rollout", "reward", "algorithm", "environment"])
def test_rl_only_fields_are_refused_for_offline_methods(field):
    with pytest.raises(JobError, match=rf"spec\.{field}: only methods rl and distill read it; remove it"):
        validate_job(offline_job(**{field: {"file": "env.py"} if field == "environment" else {}}))


def test_evaluation_is_one_vocabulary_with_each_methods_own_source():
    held = validate_job(offline_job(evaluation={"everySteps": 5, "heldOutFraction": 0.1})).spec.evaluation
    assert (held.every_steps, held.held_out_fraction, held.datasets) == (5, 0.1, [])
    sets = {"datasets": [{"name": "d", "path": "/e"}]}
    with pytest.raises(JobError, match=r"spec\.evaluation\.datasets: prompt sets .* are for method rl"):
        validate_job(offline_job(evaluation=sets))
    rl = rl_job(type="exact_match")
    rl["spec"]["evaluation"] = {"heldOutFraction": 0.1}
    with pytest.raises(JobError, match=r"spec\.evaluation\.heldOutFraction: is for the offline methods"):
        validate_job(rl)
    rl["spec"]["evaluation"] = sets
    assert validate_job(rl).spec.evaluation.datasets[0].name == "d"


def test_offline_methods_refuse_context_parallel_and_rm_refuses_tensor_parallel():
    with pytest.raises(JobError, match=r"spec\.trainer\.parallelism\.contextParallel: must be 1 for method sft"):
        validate_job(offline_job(trainer={"nprocPerNode": 2, "parallelism": {"contextParallel": 2}}))
    with pytest.raises(JobError, match=r"spec\.trainer\.parallelism\.tensorParallel: must be 1 for method rm"):
        validate_job(offline_job(method="rm", trainer={"nprocPerNode": 2, "parallelism": {"tensorParallel": 2}}))
    job = validate_job(offline_job(method="dpo", trainer={"nprocPerNode": 2, "parallelism": {"tensorParallel": 2},
                                                          "maxTokensPerMicroBatch": 64}))
    assert job.spec.offline  # TP is fine for dpo; the RL budget rule (prompt + maxTokens) does not apply


EXAMPLES = sorted((__import__("pathlib").Path(__file__).resolve().parents[2] / "examples").rglob("*.yaml"))


@pytest.mark.parametrize("path", [p for p in EXAMPLES if p.stem in ("sft", "rm", "dpo") or p.stem in
                                  ("local-sft", "local-rm", "local-dpo", "local-tools-sft")], ids=lambda p: p.stem)
def test_offline_examples_validate_and_build_a_trainer_alone(path):
    from rlhf_contract.api.load import load_job
    from rlhf_operator.backends import build_children

    job = load_job(path)
    assert job.spec.offline
    if "pipeline" in path.parts:  # cluster jobs: the operator creates the trainer alone
        job.metadata.namespace, job.metadata.uid = "ns", "uid"
        kinds = {c["kind"] for c in build_children(job, 0)}
        assert "PyTorchJob" in kinds and "StatefulSet" not in kinds


def rl_job(**reward):
    return {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "x"},
            "spec": {"model": {"path": "/m"}, "data": {"path": "/d"}, "reward": reward}}


def test_model_reward_needs_a_model_and_refuses_dynamic_sampling():
    with pytest.raises(JobError, match=r"spec\.reward\.model: is required when reward\.type is model"):
        validate_job(rl_job(type="model"))
    doc = rl_job(type="math", model={"path": "/rm", "weight": 0.5})
    doc["spec"]["algorithm"] = {"preset": "dapo"}
    with pytest.raises(JobError, match=r"spec\.algorithm\.dynamicSampling: cannot be true with reward\.model"):
        validate_job(doc)
    doc["spec"]["algorithm"]["dynamicSampling"] = False
    assert validate_job(doc).spec.reward.model.weight == 0.5  # combined with math, weighted


def test_model_reward_adds_weighted_scores_and_reports_the_step_reward():
    from rlhf_trainer.rl.reward_model import ModelRewards

    rewards = [1.0, 0.0]
    model_rewards = ModelRewards(torch.tensor([2.0, -1.0]), 0.5)
    assert model_rewards.total(rewards) == [2.0, -0.5]
    assert rewards == [1.0, 0.0]  # returned, never written back
    assert model_rewards.metrics(rewards) == {"rm_score_mean": 0.5, "rm_score_std": 1.5,
                                              "reward_mean": pytest.approx(0.75), "reward_std": pytest.approx(1.25),
                                              "reward_min": -0.5, "reward_max": 2.0}
