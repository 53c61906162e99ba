"""`method: distill` learns: an untrained student, distilled from a teacher that earns the
task's reward, reaches that reward through the teacher's per-token signal alone
(`rewardWeight: 0`), with the reverse KL falling on the way. The teacher is trained here
in a few seconds (plain supervised steps) on a task whose answer is the same for every
prompt, so that the run can be short; the demo's copying task takes the student about 120
steps (docs/methods.md, measured with examples/local-distill.yaml)."""

from __future__ import annotations

import json
import random
from statistics import mean

import pytest
import torch

from jobs import small_job

pytestmark = pytest.mark.slow

ANSWER = "7"


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(str(rng.randrange(10)) for _ in range(rng.randint(3, 6))) + ":" for _ in range(n)]


def make_teacher(out, seed: int = 1):
    """The built-in model (other weights than the student's) trained to answer ANSWER<eos>
    to every prompt; returns its directory and its mean probability of ANSWER's token (its
    expected reward when a response is that one token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_trainer.models.builtin import materialize

    path = materialize("builtin://tiny-qwen2", out, seed=seed)
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = [tok(p + ANSWER, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for p in prompts(64, seed=1)]
    width = max(map(len, ids))
    x = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in ids])
    labels = torch.full_like(x, -100)
    for i, s in enumerate(ids):
        labels[i, len(s) - 2:len(s)] = x[i, len(s) - 2:len(s)]  # the answer and EOS
    attention = (torch.arange(width)[None] < torch.tensor([len(s) for s in ids])[:, None]).long()
    for _ in range(40):
        opt.zero_grad()
        model(input_ids=x, attention_mask=attention, labels=labels).loss.backward()
        opt.step()
    model.save_pretrained(path)
    with torch.no_grad():
        logp = model(input_ids=x, attention_mask=attention).logits.log_softmax(-1)
    return path, mean(float(logp[i, len(s) - 3, s[-2]].exp()) for i, s in enumerate(ids))


def test_distilled_student_reaches_the_teachers_reward(run_trainer, tiny_model_dir, tmp_path):
    teacher, p_teacher = make_teacher(tmp_path / "teacher")
    assert p_teacher > 0.9, p_teacher  # the teacher earns the reward (at temperature 1; one token suffices)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": ANSWER}) + "\n" for p in prompts(256, seed=2)))
    config = small_job(tiny_model_dir, tmp_path / "out", method="distill",
                       data={"path": str(data), "maxPromptLength": 16}, reward={"type": "exact_match"},
                       distillation={"teacher": {"path": str(teacher)}, "baseline": "position"},
                       rollout={"samplesPerPrompt": 2, "maxTokens": 1},
                       trainer={"learningRate": 3e-3, "maxTokensPerMicroBatch": 1024},
                       schedule={"totalSteps": 16, "promptsPerStep": 64, "saveEvery": 0})
    rows = run_trainer(config)
    kl = [r["distill_reverse_kl"] for r in rows]
    reward = [r["reward_mean"] for r in rows]
    assert mean(reward[:2]) < 0.3, reward  # the untrained student does not answer 7
    assert mean(reward[-3:]) >= 0.85 * p_teacher, (reward, p_teacher)  # ... and then does, as its teacher
    assert mean(kl[-3:]) < 0.2 * mean(kl[:2]), kl
    for r in rows:  # the two log-probs are logged beside their difference
        assert r["distill_student_logprob"] - r["distill_teacher_logprob"] == pytest.approx(r["distill_reverse_kl"])
    assert rows[0]["kl"] is None  # no reference model: klCoef resolves to 0 for distill
