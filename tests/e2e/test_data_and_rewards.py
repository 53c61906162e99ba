"""Datasets and reward functions wired through a real trainer run."""

import json
import os
from pathlib import Path

import pytest

from jobs import small_job

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_jsonl_data_and_a_user_reward_file(run_trainer, engine, tiny_model_dir, tmp_path, monkeypatch):
    """veRL's layout (the answer at reward_model.ground_truth, the row's extra_info column), our
    per-response function, TRL-style functions from a file and an import path, veRL's
    compute_score, and an LLM judge (the run's own CPU rollout server as the judge: the
    plumbing, counted, not the judgement), in one run."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}{b}{c}:", "reward_model": {"ground_truth": str(c)},
                                        "data_source": "digits", "extra_info": {"level": a}}) + "\n"
                            for a, b, c in [(1, 2, 3), (4, 5, 6), (7, 8, 9), (3, 3, 3), (9, 9, 9999)]))
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(
        "def grade(response, answer, extra_info):\n"
        "    correct = float(response.strip() == answer)\n"
        "    # reward shaped by a column of the row; score is plain accuracy\n"
        "    return {'reward': correct + 0.5 * extra_info['extra_info']['level'], 'score': correct}\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    assert data_source == 'digits' and 'level' in extra_info\n"
        "    return {'score': float(solution_str.strip() == ground_truth)}\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(  # trl_style: "installed" (before what was on the path)
        [str(ROOT / "examples" / "rewards"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    trl_file = str(ROOT / "examples" / "rewards" / "trl_style.py")
    out = tmp_path / "out"
    components = [
        {"name": "correct", "type": "exact_match", "weight": 2.0},
        {"name": "trl_file", "type": "python", "file": trl_file, "function": "digits_only", "weight": 0.0},
        {"name": "trl_import", "type": "python", "function": "trl_style:exact_answer", "weight": 0.0},
        {"name": "verl", "type": "python", "file": str(reward_file), "function": "compute_score", "weight": 0.0},
        {"name": "judge", "type": "judge", "weight": 0.0, "judge": {
            "url": engine + "/v1", "model": "tiny", "api": "completions", "template": "{response}=", "maxTokens": 2}}]
    rows = run_trainer(small_job(
        tiny_model_dir, out,
        data={"path": str(data), "promptKey": "question", "answerKey": "reward_model.ground_truth",
              "maxPromptLength": 5},
        reward={"type": "python", "file": str(reward_file), "function": "grade", "name": "grade",
                "components": components},
        schedule={"totalSteps": 2, "promptsPerStep": 4, "saveEvery": 1},
        tracking={"samplesEvery": 1, "samplesPerTable": 3}))
    # the 5th row is 7 tokens long and dropped; the other 4 are all seen each step
    for r in rows:  # the main reward + 2 x the exact-match component; the score is the main function's
        assert r["reward/grade_mean"] == pytest.approx(r["score_mean"] + 0.5 * (1 + 4 + 7 + 3) / 4)
        assert r["reward/correct_mean"] == pytest.approx(r["score_mean"])
        assert r["reward/trl_import_mean"] == r["reward/verl_mean"] == pytest.approx(r["score_mean"])
        assert 0 <= r["reward/trl_file_mean"] <= 1 or r["reward/trl_file_mean"] != r["reward/trl_file_mean"]  # NaN
        assert r["reward_mean"] == pytest.approx(r["reward/grade_mean"] + 2 * r["reward/correct_mean"])
        assert r["reward_min"] <= r["reward_mean"] <= r["reward_max"] and r["reward_std"] > 0  # levels differ
        assert r["reward_min"] >= 0.5 and r["reward_max"] <= 2 + 1 + 0.5 * 7
        assert r["response_length_min"] <= r["response_length_mean"] <= r["response_length_max"]
        assert 0.0 <= r["zero_std_group_fraction"] <= 1.0
        # the judge: 16 answers a step, each either a score in 0..1 or a counted parse failure
        assert 0 <= r["reward/judge_parse_failures"] <= 16 and r["reward/judge_judge_tokens"] >= 16 * 2
        assert r["reward/judge_parse_failures"] == 16 or 0 <= r["reward/judge_mean"] <= 1
    assert sum(r["reward/judge_parse_failures"] for r in rows) > 0  # a tiny random model: some answers are not numbers
    # TensorBoard (on by default): every number of every row, and the sample tables
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for key in ("reward_mean", "reward/correct_mean", "reward_std", "loss", "response_length_max"):
        assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in events.Scalars(key)] == [
            (r["step"], r[key]) for r in rows]
    samples = [t for t in events.Tags()["tensors"] if t.startswith("samples")]
    assert samples and [e.step for e in events.Tensors(samples[0])] == [1, 2]
    table = events.Tensors(samples[0])[0].tensor_proto.string_val[0].decode()
    assert table.count("\n") == 1 + 3  # header, rule, 3 rows
    assert json.loads((out / "checkpoints" / "step-2" / "trainer_state.json").read_text())["orchestrator"]["data"]["position"] == 8
    log_text = (out / "metrics.jsonl").read_text()
    assert log_text.count("\n") == 2


def test_a_trl_reward_reading_trainer_state_and_logging_metrics_learns_the_demo_task(tmp_path):
    """TRL's whole reward contract through `rlhfctl run`: a TRL-form function
    (examples/rewards/trl_style.py: exact_answer_logged) reads `trainer_state`, logs metrics
    with `log_metric` and a column with `log_extra`, and gets `reward.kwargs`; the demo task is
    learned with it (short: one-token answers, no KL, 60 steps: about 5 minutes on 2 loaded
    cores; accuracy 0.09 over the first 10 steps, 0.29 over the last 10)."""
    import subprocess
    import sys

    out = tmp_path / "run"
    reward = json.dumps({"type": "python", "name": "trl", "file": str(ROOT / "examples" / "rewards" / "trl_style.py"),
                         "function": "exact_answer_logged", "kwargs": {"correct": 2.0}})
    sets = ["rollout.replicas=1", "rollout.maxTokens=1", "algorithm.klCoef=0", "schedule.totalSteps=60",
            "schedule.saveEvery=0", "output.saveRollouts=true", "tracking.samplesEvery=30", f"reward={reward}"]
    res = subprocess.run([sys.executable, "-m", "rlhf_launcher.cli", "run", str(ROOT / "examples" / "local-grpo.yaml"),
                          "--output", str(out), *[a for s in sets for a in ("--set", s)]],
                         capture_output=True, text=True, cwd=ROOT, timeout=580, env=dict(os.environ))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 61))
    for r in rows:
        assert r["reward/trl/global_step"] == r["step"] - 1  # TRL's global_step: the steps already trained
        assert r["reward/trl/progress"] == pytest.approx((r["step"] - 1) / 60)
        assert r["reward/trl/accuracy"] == pytest.approx(r["score_mean"] / 2)  # reward.kwargs: correct = 2
        assert r["reward_mean"] == pytest.approx(r["score_mean"])
    accuracy = [r["reward/trl/accuracy"] for r in rows]
    first, last = sum(accuracy[:10]) / 10, sum(accuracy[-10:]) / 10
    assert last >= 0.2 and last >= 2.5 * first, (first, last)  # from chance (1 in 10) to 0.29 here
    saved = [json.loads(line) for line in (out / "rollouts" / "step-60.jsonl").read_text().splitlines()]
    assert saved and all(s["extra"]["gold"] == s["prompt"].strip().rstrip(":")[-1] for s in saved)  # log_extra
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("reward/trl/global_step")] == list(range(60))
    table = events.Tensors([t for t in events.Tags()["tensors"] if t.startswith("samples")][0])[0]
    assert table.tensor_proto.string_val[0].decode().splitlines()[0] == "| step | prompt | completion | reward | score | gold |"
