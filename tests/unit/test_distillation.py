"""On-policy distillation: its per-token advantage gives the gradient of the reverse KL
(computed here in closed form over the vocabulary, not from the trainer's helpers), the
contract's rules for `method: distill`, and the preflight's refusal of a teacher with
another tokenizer or none."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from rlhf_contract.api import validate_job
from rlhf_contract.api.load import JobError
from rlhf_contract.api.models import AlgorithmSpec
from rlhf_contract.api.presets import PRESETS
from rlhf_contract.trainer_config import TrainerConfig
from rlhf_trainer.algorithms.losses import compose_loss
from rlhf_trainer.rl.tensors import distillation_advantages, distillation_metrics

V = 7


def test_the_advantage_is_the_reverse_kl_policy_gradient():
    """Every vocabulary token as a one-token response, weighted by the student's probability
    (the exact expectation over samples): the loss's gradient equals the gradient of
    KL(student || teacher), and its mean advantage is -KL."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(V, generator=gen, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(V, generator=gen, dtype=torch.float64), -1)
    student = torch.log_softmax(logits, -1)
    probs = student.exp().detach()
    kl = (probs * (student.detach() - teacher)).sum()
    exact = torch.autograd.grad((student.exp() * (student - teacher)).sum(), logits, retain_graph=True)[0]  # dKL(s||t)

    logp = student.reshape(V, 1)
    mask = torch.ones(V, 1, dtype=torch.float64)
    adv = distillation_advantages(logp.detach(), teacher.reshape(V, 1), mask)
    assert torch.allclose((adv[:, 0] * probs).sum(), -kl)
    a = AlgorithmSpec(**PRESETS["grpo"], preset="grpo")
    loss, _ = compose_loss(a, logp=logp, entropy=torch.zeros_like(logp), old=logp.detach(), advantages=adv,
                           coef=probs.reshape(V, 1))
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.allclose(grad, exact, atol=1e-12)
    assert kl > 0.1  # the two distributions differ: the check above is not 0 == 0


def test_reward_weight_adds_the_task_advantage_and_metrics_are_per_token_means():
    student = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    teacher = torch.tensor([[-0.5, -1.0, -9.0], [-2.5, -9.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    task = torch.tensor([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]])
    assert distillation_advantages(student, teacher, mask).tolist() == [[0.5, 1.0, 0.0], [-2.0, 0.0, 0.0]]
    assert distillation_advantages(student, teacher, mask, task, 0.5).tolist() == [[1.0, 1.5, 0.0], [-2.5, 0.0, 0.0]]
    m = distillation_metrics(student, teacher, mask)
    assert m == pytest.approx({"distill_reverse_kl": (-0.5 - 1.0 + 2.0) / 3, "distill_teacher_logprob": -4.0 / 3,
                               "distill_student_logprob": -3.5 / 3})


JOB = {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "d"},
       "spec": {"method": "distill", "model": {"path": "builtin://tiny-qwen2"}, "data": {"path": "builtin://last-digit"},
                "distillation": {"teacher": {"path": "/models/teacher"}}, "rollout": {"maxTokens": 4}}}


def problems(**spec) -> dict[str, str]:
    data = copy.deepcopy(JOB)
    data["spec"].update(spec)
    try:
        validate_job(data)
    except JobError as err:
        return {p.path: p.message for p in err.problems}
    return {}


def test_distill_rules():
    assert problems() == {}
    assert validate_job(JOB).spec.algorithm.kl_coef == 0.0  # the grpo preset's 0.04 does not apply
    assert "spec.distillation" in problems(distillation=None)
    assert "spec.distillation" in problems(method="rl")
    assert "spec.algorithm.klCoef" in problems(algorithm={"klCoef": 0.01})
    assert "spec.algorithm.dynamicSampling" in problems(algorithm={"preset": "dapo"})
    assert "spec.algorithm.critic" in problems(algorithm={"preset": "ppo"})
    assert problems(algorithm={"preset": "gspo"}, distillation={"teacher": {"path": "/t"}, "rewardWeight": 0.5}) == {}


def test_preflight_refuses_a_teacher_with_another_tokenizer(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from rlhf_trainer.preflight import check

    def config(teacher: str) -> TrainerConfig:
        data = copy.deepcopy(JOB)
        data["spec"]["model"]["path"] = str(tiny_model_dir)
        data["spec"]["distillation"]["teacher"]["path"] = teacher
        return TrainerConfig.from_job(validate_job(data))

    assert check(config(str(tiny_model_dir)), 1) == []
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    (problem,) = check(config(str(other)), 1)
    assert problem.startswith("spec.distillation.teacher.path: the teacher's tokenizer differs from the student's")
    assert "vocabulary" in problem
    (problem,) = check(config(str(tmp_path / "missing")), 1)
    assert problem.startswith("spec.distillation.teacher.path:") and "does not exist" in problem


def test_the_teacher_pass_is_aligned_with_the_students():
    """A teacher with the student's weights scores every sampled token exactly as the
    student does (same packing, same head): zero reverse KL, zero advantages; another
    teacher gives the log-probs of its own naive forward."""
    from rlhf_contract.api.models import DistillationSpec
    from rlhf_trainer.models.builtin import build_tiny_qwen2
    from rlhf_trainer.models.logprob_head import attach_logprob_head
    from rlhf_trainer.orchestrator.types import RolloutBatch, RolloutStats
    from test_train_step import algorithm, rows, step_for

    distill = DistillationSpec(teacher={"path": "/unused"})
    data = rows(8, seed=2)
    for seed in (0, 1):
        step = step_for(algorithm(kl_coef=0.0))
        step.distillation = distill
        step.m.teacher = build_tiny_qwen2(seed).eval().requires_grad_(False)
        attach_logprob_head(step.m.teacher)
        t = step.prepare(RolloutBatch(data, 4, RolloutStats(*[0] * 12)))
        if seed == 0:  # the policy of step_for is build_tiny_qwen2(0)
            assert torch.allclose(t.teacher_logprobs, t.old_logprobs, atol=1e-6)  # the policy is laid out, this
            assert t.advantages.abs().max() < 1e-6  # teacher is not: float order only
            continue
        naive = build_tiny_qwen2(1)
        for i, r in enumerate(data):
            ids = torch.tensor([r.prompt_ids + r.response_ids])
            lp = torch.log_softmax(naive(ids).logits[0].float(), -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
            want = lp[len(r.prompt_ids) - 1:]
            assert torch.allclose(t.teacher_logprobs[i, :len(want)], want, atol=1e-5)
            assert torch.allclose(t.advantages[i, :len(want)], want - t.old_logprobs[i, :len(want)], atol=1e-6)
