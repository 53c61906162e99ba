"""Datasets and reward functions wired through a real trainer run."""

import json

import pytest

from jobs import small_job

pytestmark = pytest.mark.slow


def test_jsonl_data_and_a_user_reward_file(run_trainer, tiny_model_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}{b}{c}:", "label": str(c), "level": a}) + "\n"
                            for a, b, c in [(1, 2, 3), (4, 5, 6), (7, 8, 9), (3, 3, 3), (9, 9, 9999)]))
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(
        "def grade(response, answer, extra_info):\n"
        "    correct = float(response.strip() == answer)\n"
        "    # reward shaped by a column of the row; score is plain accuracy\n"
        "    return {'reward': correct + 0.5 * extra_info['level'], 'score': correct}\n")
    out = tmp_path / "out"
    rows = run_trainer(small_job(
        tiny_model_dir, out,
        data={"path": str(data), "promptKey": "question", "answerKey": "label", "maxPromptLength": 5},
        reward={"type": "python", "file": str(reward_file), "function": "grade"},
        schedule={"totalSteps": 2, "promptsPerStep": 4, "saveEvery": 1}))
    # the 5th row is 7 tokens long and dropped; the other 4 are all seen each step
    for r in rows:
        assert r["reward_mean"] == pytest.approx(r["score_mean"] + 0.5 * (1 + 4 + 7 + 3) / 4)
    assert json.loads((out / "checkpoints" / "step-2" / "trainer_state.json").read_text())["orchestrator"]["data"]["position"] == 8
    log_text = (out / "metrics.jsonl").read_text()
    assert log_text.count("\n") == 2
