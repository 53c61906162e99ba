"""The train step on fixed rows, one process: log-probs and entropy against the naive
computation, temperature, non-finite gradients, LR schedules, memory of the log-prob head,
and the preflight check of the pod's own command."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_contract.api.models import AlgorithmSpec
from rlhf_contract.api.presets import PRESETS
from rlhf_trainer.models.builtin import build_tiny_qwen2
from rlhf_trainer.data.sequences import Row
from rlhf_trainer.orchestrator.types import RolloutBatch, RolloutStats
from rlhf_trainer.parallel.parallelize import Layout, parallelize_models
from rlhf_trainer.optim import lr_factor
from rlhf_trainer.data.micro_batches import plan
from rlhf_trainer.models.forward import policy_forward
from rlhf_trainer.models.logprob_head import attach_logprob_head, chunked_token_stats, token_stats
from rlhf_trainer.engine import Fsdp2Engine
from rlhf_trainer.rl.models import Models
from rlhf_trainer.rl.step import TrainStep

ROOT = Path(__file__).resolve().parents[2]


def rows(n: int = 8, seed: int = 0) -> list[Row]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = int(torch.randint(2, 6, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
        reward = float(i % 2)
        out.append(Row(torch.randint(3, 16, (p,), generator=gen).tolist(), torch.randint(3, 16, (r,), generator=gen).tolist(),
                       (-torch.rand(r, generator=gen)).tolist(), reward, reward, False))
    return out


def algorithm(**fields) -> AlgorithmSpec:
    base = {k: v for k, v in PRESETS["grpo"].items()}
    return AlgorithmSpec(**{**base, "kl_coef": 0.0, **fields})


def step_for(a: AlgorithmSpec, temperature: float = 1.0) -> TrainStep:
    policy = build_tiny_qwen2(0)
    layout = parallelize_models(policy, ref=None, critic=None, world_size=1, tp=1, cp=1,
                                activation_checkpointing=False, device_type="cpu")
    attach_logprob_head(policy)
    return TrainStep(a, Models(Fsdp2Engine(policy, torch.optim.AdamW(policy.parameters(), lr=1e-2))), layout,
                     max_tokens_per_micro_batch=32, max_grad_norm=1.0, temperature=temperature,
                     device=torch.device("cpu"))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_and_entropy_equal_the_naive_computation(temperature):
    policy = build_tiny_qwen2(1)
    parallelize_models(policy, ref=None, critic=None, world_size=1, tp=1, cp=1, activation_checkpointing=False,
                       device_type="cpu")
    attach_logprob_head(policy)
    naive_model = build_tiny_qwen2(1)
    data = rows(6, seed=4)
    [mb] = plan(data, list(range(6)), budget=64, dp_size=1, cp_size=1)[0]
    logp, ent = policy_forward(policy, mb, None, torch.device("cpu"), temperature)
    within = torch.zeros_like(logp)  # positions predicting a response token: the only ones computed
    for k in range(len(mb.rows)):
        within[0, mb.positions(k).start:mb.positions(k).stop] = 1
    assert not (logp * (1 - within)).any() and not (ent * (1 - within)).any()  # prompt positions: never computed
    ((logp * within).sum() + (ent * within).sum()).backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    total = 0.0
    for k, i in enumerate(mb.rows):  # each sequence alone, full fp32 logits, plain log_softmax
        ids = torch.tensor([data[i].prompt_ids + data[i].response_ids])
        lp = torch.log_softmax(naive_model(ids).logits[0] / temperature, -1)
        targets = ids[0, 1:]
        per_tok = lp[:-1].gather(-1, targets[:, None])[:, 0][len(data[i].prompt_ids) - 1:]
        entropy = -(lp.exp() * lp).sum(-1)[:-1][len(data[i].prompt_ids) - 1:]
        start, n = mb.positions(k).start, len(mb.positions(k))
        assert torch.allclose(logp[0, start:start + n], per_tok, atol=1e-5)
        assert torch.allclose(ent[0, start:start + n], entropy, atol=1e-5)
        total = total + per_tok.sum() + entropy.sum()
    total.backward()
    for n, p in naive_model.named_parameters():
        assert torch.allclose(grads[n], p.grad, atol=1e-5, rtol=1e-4), n


def test_chunking_does_not_change_values():
    logits = torch.randn(1, 37, 50)
    targets = torch.randint(0, 50, (1, 37))
    whole = chunked_token_stats(token_stats, logits, (), targets, 0.8, chunk=1000)
    chunked = chunked_token_stats(token_stats, logits, (), targets, 0.8, chunk=5)
    assert torch.allclose(whole, chunked)


def test_temperature_gives_ratio_one_for_an_unchanged_policy():
    # TIS needs the old log-probs: they are taken at the sampling temperature, as the step's
    a = algorithm(tis_cap=2.0)
    batch = RolloutBatch(rows(), 4, RolloutStats(*[0] * 12))
    step = step_for(a, temperature=0.5)
    tensors = step.prepare(batch)
    metrics = step(batch, tensors)
    assert metrics["approx_kl"] == pytest.approx(0.0, abs=1e-12) and metrics["clip_fraction"] == 0.0
    # and the temperature matters: at 1.0 the same policy gives other log-probs
    step1 = step_for(a, temperature=1.0)
    assert not torch.allclose(step1.prepare(batch).old_logprobs, tensors.old_logprobs)


def test_the_step_masks_tokens_by_the_rollout_correction_and_logs_the_masked_fraction():
    """token-mask [lower, upper] on the trainer's and the rows' rollout log-probs: the step's
    weights are rho where lower <= rho <= upper (0 elsewhere), and its metrics carry the
    masked fraction, both worked out here from the tables, token by token."""
    from rlhf_contract.api.models import RolloutCorrectionSpec

    batch = RolloutBatch(rows(), 4, RolloutStats(*[0] * 12))
    a = algorithm(rollout_correction=RolloutCorrectionSpec(mode="two-sided-mask", lower=0.1, upper=1.0))
    step = step_for(a)
    t = step.prepare(batch)
    masked = valid = 0
    for i, row in enumerate(batch.rows):
        for j, rollout in enumerate(row.rollout_logprobs):
            rho = math.exp(t.old_logprobs[i, j].item() - rollout)
            valid += 1
            masked += not 0.1 <= rho <= 1.0
            assert t.correction[i, j].item() == (pytest.approx(rho, rel=1e-6) if 0.1 <= rho <= 1.0 else 0.0)
    assert 0 < masked < valid  # both kinds occur in this batch
    assert t.reward_metrics["rollout_correction_masked_fraction"] == pytest.approx(masked / valid)
    metrics = step(batch, t)
    assert math.isfinite(metrics["loss"])


def test_non_finite_gradient_skips_the_step():
    batch = RolloutBatch(rows(), 4, RolloutStats(*[0] * 12))
    step = step_for(algorithm())
    before = {n: p.detach().clone() for n, p in step.m.policy.named_parameters()}
    step.m.policy.model.norm.weight.register_hook(lambda g: g * float("nan"))
    metrics = step(batch, step.prepare(batch))
    assert metrics["skipped_steps"] == 1
    for n, p in step.m.policy.named_parameters():
        assert torch.equal(p, before[n]), n  # nothing applied, not even Adam's decay


def test_finite_step_moves_the_weights_and_counts_no_skip():
    batch = RolloutBatch(rows(), 4, RolloutStats(*[0] * 12))
    step = step_for(algorithm())
    before = step.m.policy.lm_head.weight.detach().clone()
    metrics = step(batch, step.prepare(batch))
    assert metrics["skipped_steps"] == 0 and metrics["grad_norm"] > 0
    assert not torch.equal(step.m.policy.lm_head.weight, before)


def test_lr_schedules():
    assert [lr_factor(s, total=10, warmup=2) for s in range(3)] == [0.5, 1.0, 1.0]
    linear = [lr_factor(s, total=11, warmup=1, kind="linear") for s in range(11)]
    assert linear[0] == 1.0 and linear[1] == 1.0 and linear[-1] == 0.0
    steps = [x - y for x, y in zip(linear[1:], linear[2:])]
    assert steps == pytest.approx([1 / 9] * 9)  # an even decay from the end of warmup to the last step
    cosine = [lr_factor(s, total=11, kind="cosine", min_ratio=0.1) for s in range(11)]
    assert cosine[0] == 1.0 and cosine[-1] == pytest.approx(0.1) and cosine[5] == pytest.approx(0.55)


MEMORY_PROBE = """
import resource, sys, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from rlhf_trainer.data.balanced_packing import pack
from rlhf_trainer.data.micro_batches import MicroBatch
from rlhf_trainer.models.forward import policy_forward
from rlhf_trainer.models.logprob_head import attach_logprob_head
from rlhf_trainer.parallel.context_parallel import apply_cp
torch.manual_seed(0)
config = Qwen2Config(vocab_size=65536, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192, tie_word_embeddings=True)
model = apply_cp(Qwen2ForCausalLM(config), None)
attach_logprob_head(model)
n = int(sys.argv[1])
docs = [torch.randint(0, 65536, (256,)).tolist() for _ in range(n // 256)]
mb = MicroBatch(list(range(len(docs))), pack(docs), [256 * i for i in range(len(docs))], [1] * len(docs), [255] * len(docs))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
logp, ent = policy_forward(model, mb, None, torch.device("cpu"), 1.0)
(logp.sum() - 0.01 * ent.sum()).backward()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
"""


def test_peak_memory_of_a_train_step_grows_little_with_the_budget():
    def peak_kib(tokens: int) -> int:
        res = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tokens)], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert res.returncode == 0, res.stderr[-2000:]
        return int(res.stdout.split()[-1])

    small, large = peak_kib(1024), peak_kib(4096)
    # fp32 logits of 4096 tokens x 65536 would be 1 GiB alone; chunked, the head holds 1024 tokens at a time
    assert large < 1.5 * small, (small, large)
