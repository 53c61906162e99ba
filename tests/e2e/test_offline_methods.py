"""`method: sft | rm | dpo` end to end with `rlhfctl run` on the examples: each learns,
FSDP over 2 processes equals 1 process, no rollout server starts, and the reward model
is exported as a Hugging Face sequence classifier that scores like the trainer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from statistics import mean

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run(method: str, out: Path, *overrides: str) -> list[dict]:
    cmd = [sys.executable, "-m", "rlhf_launcher.cli", "run", str(ROOT / "examples" / f"local-{method}.yaml"),
           "--output", str(out)]
    for item in overrides:
        cmd += ["--set", item]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=400)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "0 rollout server(s)" in res.stderr  # trained from data alone
    assert not (out / "logs" / "rollout-0.log").exists()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    root = tmp_path_factory.mktemp("offline")
    return {m: (root / m, run(m, root / m)) for m in ("sft", "rm", "dpo")}


def test_sft_halves_its_loss(runs):
    _, rows = runs["sft"]
    first, last = mean(r["loss"] for r in rows[:10]), mean(r["loss"] for r in rows[-10:])
    assert last <= 0.5 * first, (first, last)
    evals = [r["eval/held_out/loss"] for r in rows if r.get("eval/held_out/loss") is not None]
    assert len(evals) >= 3 and evals[-1] < 0.5 * evals[0]  # held out: at the start, every 20 steps, at the end
    from rlhf_trainer.metrics import JSONL_ONLY, route

    numbers = {k for r in rows for k, v in r.items() if isinstance(v, (int, float))}
    assert all(route(k) is not None for k in numbers - JSONL_ONLY)  # every number an offline run writes is exported


@pytest.mark.parametrize("method", ["rm", "dpo"])
def test_preference_methods_reach_held_out_accuracy(runs, method):
    _, rows = runs[method]
    assert rows[-1]["eval/held_out/accuracy"] >= 0.9
    assert rows[0]["eval/held_out/accuracy"] < 0.9  # measured before any step: learned, not given
    margins = [r["reward_margin"] for r in rows]
    assert mean(margins[-10:]) > mean(margins[:10]) > -1e-9  # the margin rises
    if method == "dpo":
        assert rows[-1]["chosen_logratio"] > rows[-1]["rejected_logratio"]


def test_reward_model_exports_a_sequence_classifier_scoring_like_the_trainer(runs):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_trainer.data.balanced_packing import pack
    from rlhf_trainer.models.score import ScoreModel
    from rlhf_trainer.parallel.context_parallel import apply_cp, cp_inputs

    final = runs["rm"][0] / "final"
    hf = AutoModelForSequenceClassification.from_pretrained(final).eval()
    tok = AutoTokenizer.from_pretrained(final)
    assert hf.config.num_labels == 1 and hf.config.architectures == ["Qwen2ForSequenceClassification"]
    texts = ["12:468<eos>", "12:137<eos>", "905:2<eos>", "3:99<eos>"]
    with torch.no_grad():
        want = hf(**tok(texts, return_tensors="pt", padding=True)).logits.squeeze(-1)
        trainer = ScoreModel(str(final), tok.pad_token_id).eval()  # the trained head is kept, not re-zeroed
        apply_cp(trainer, None)  # the trainer's per-document attention over one packed row
        seqs = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        scores = trainer(**cp_inputs(pack(seqs), None))[0]
        ends = torch.tensor([sum(len(s) for s in seqs[:i + 1]) - 1 for i in range(len(seqs))])
    assert torch.allclose(scores[ends], want, atol=1e-4), (scores[ends], want)
    assert want[0] > want[1] and want[2] > want[3]  # even digits preferred, as trained


def even_fraction(out: Path, steps: range) -> float:
    """Fraction of sampled responses made only of even digits (what the toy reward model prefers)."""
    rows = [json.loads(line) for s in steps for line in (out / "rollouts" / f"step-{s}.jsonl").read_text().splitlines()]
    texts = [r["response"].replace("<eos>", "") for r in rows]
    return sum(bool(t) and all(c in "02468" for c in t) for t in texts) / len(texts)


def rlhf(out: Path, rm_final: Path, *overrides: str) -> list[dict]:
    cmd = [sys.executable, "-m", "rlhf_launcher.cli", "run", str(ROOT / "examples" / "local-rlhf.yaml"),
           "--output", str(out), "--set", f"reward.model.path={rm_final}", "--set", "output.saveRollouts=true"]
    for item in overrides:
        cmd += ["--set", item]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=400)
    assert res.returncode == 0, res.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_rl_against_the_learned_reward_model(runs, tmp_path):
    # the reward model that local-rm.yaml trained, then GRPO against it (reward.type: model)
    rows = rlhf(tmp_path / "rlhf", runs["rm"][0] / "final")
    first, last = even_fraction(tmp_path / "rlhf", range(1, 11)), even_fraction(tmp_path / "rlhf", range(51, 61))
    assert last >= 3 * first and last > 0.3, (first, last)  # the preferred behaviour, learned from the RM alone
    scores = [r["rm_score_mean"] for r in rows]
    assert mean(scores[-10:]) > mean(scores[:10]) + 0.3
    assert all(r["reward_mean"] == pytest.approx(r["rm_score_mean"], abs=1e-5) for r in rows)  # type model, weight 1
