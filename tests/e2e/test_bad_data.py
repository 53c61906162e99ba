"""Bad data ends the job at once, before any model loads: the trainer pod's own command
(`python -m rlhf_trainer.launch`, as in pods and local mode) exits 2 naming the field, for
every case of the bad-data table in docs/operations.md. The model directory here holds no weights,
so a run that got as far as loading the model would fail otherwise (exit 1); the output
directory staying absent shows that torchrun never started."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_contract.api import validate_job
from rlhf_contract.pod import trainer_process
from rlhf_contract.trainer_config import TrainerConfig

MAX_SECONDS = 30
"""Time to failure, with imports and the tokenizer on a shared 2-core CPU (a run that loads the
model takes ~40 s on the same machine before it reaches its data)."""

RL = {"rollout": {"engine": "cpu", "maxTokens": 2}}
PROMPTS = [{"prompt": "12:", "answer": "2"}, {"prompt": "345:", "answer": "5"}]

# id: (files under the data folder: name -> rows or text, spec, field named, detail in the message)
CASES = {
    "no such path": ({}, {**RL, "data": {"path": "absent.jsonl"}}, "spec.data.path", "does not exist in the trainer"),
    "empty file": ({"p.jsonl": ""}, {**RL, "data": {"path": "p.jsonl"}}, "spec.data.path", "has no rows"),
    "no prompt column": ({"p.jsonl": [{"question": "1+1=", "answer": "2"}]}, {**RL, "data": {"path": "p.jsonl"}},
                         "spec.data.promptKey", "its columns are question, answer"),
    "no prompt column, parquet": ({"p.parquet": [{"question": "1+1=", "answer": "2"}] * 50_000},
                                  {**RL, "data": {"path": "p.parquet"}}, "spec.data.promptKey", "question"),
    "no split": ({"d/train.jsonl": PROMPTS, "d/test.jsonl": PROMPTS}, {**RL, "data": {"path": "d", "split": "valid"}},
                 "spec.data.split", "has no split 'valid'; it has test, train"),
    "no answer for math": ({"p.jsonl": [{"prompt": "1+1="}]},
                           {**RL, "data": {"path": "p.jsonl"}, "reward": {"type": "math"}},
                           "spec.data.answerKey", "reward.type math"),
    "no test cases for code": ({"p.jsonl": PROMPTS}, {**RL, "data": {"path": "p.jsonl"}, "reward": {"type": "code"}},
                               "spec.reward.type", "'test_cases'"),
    "chat rows, no chat template": ({"p.jsonl": [{"messages": [{"role": "user", "content": "1+1="}], "answer": "2"}]},
                                    {**RL, "data": {"path": "p.jsonl"}}, "spec.data.path", "chat template"),
    "every prompt too long": ({"p.jsonl": [{"prompt": "1234567890:", "answer": "0"}] * 3},
                              {**RL, "data": {"path": "p.jsonl", "maxPromptLength": 4}},
                              "spec.data.maxPromptLength", "longer than 4 tokens"),
    "built-in task, maxPromptLength 1": ({}, {**RL, "data": {"path": "builtin://last-digit", "maxPromptLength": 1}},
                                         "spec.data.maxPromptLength", "builtin://last-digit"),
    "empty evaluation set": ({"p.jsonl": PROMPTS, "held.jsonl": ""},
                             {**RL, "data": {"path": "p.jsonl"},
                              "evaluation": {"datasets": [{"name": "held", "path": "held.jsonl"}]}},
                             "spec.evaluation.datasets[held].path", "has no rows"),
    "sft without responses": ({"p.jsonl": PROMPTS}, {"method": "sft", "data": {"path": "p.jsonl"}},
                              "spec.data.responseKey", "method sft"),
    "offline examples over the budget": ({}, {"method": "dpo", "data": {"path": "builtin://prefer-even"},
                                             "trainer": {"maxTokensPerMicroBatch": 4}},
                                         "spec.trainer.maxTokensPerMicroBatch", "each side of a pair gets half of 4"),
    "a reward function of no form": ({"p.jsonl": PROMPTS, "r.py": "def grade(text, gold):\n    return 1.0\n"},
                                     {**RL, "data": {"path": "p.jsonl"},
                                      "reward": {"type": "python", "file": "r.py", "function": "grade"}},
                                     "spec.reward.function", "fits no reward form"),
    "dpo without rejected": ({"p.jsonl": [{"prompt": "1:", "chosen": "2"}]},
                             {"method": "dpo", "data": {"path": "p.jsonl"}}, "spec.data.rejectedKey", "method dpo"),
}


@pytest.fixture(scope="module")
def weightless_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model's config and tokenizer without its weights."""
    target = tmp_path_factory.mktemp("weightless") / "model"
    shutil.copytree(tiny_model_dir, target, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    return target


def write_files(folder: Path, files: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content)
        elif path.suffix == ".parquet":
            pq.write_table(pa.Table.from_pylist(content), path)
        else:
            path.write_text("".join(json.dumps(row) + "\n" for row in content))


def resolve(spec: dict, folder: Path) -> dict:
    """Relative data and reward file paths of `spec` -> paths under `folder`."""
    spec = json.loads(json.dumps(spec))
    data = spec["data"]
    if not data["path"].startswith("builtin://"):
        data["path"] = str(folder / data["path"])
    for d in spec.get("evaluation", {}).get("datasets", []):
        d["path"] = str(folder / d["path"])
    if spec.get("reward", {}).get("file"):
        spec["reward"]["file"] = str(folder / spec["reward"]["file"])
    return spec


def launch(tmp_path: Path, model: Path, spec: dict) -> tuple[subprocess.CompletedProcess, float, str]:
    """The trainer pod's command for `spec`: (result, seconds to exit, termination message)."""
    job = validate_job({"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "bad-data"},
                        "spec": {"model": {"path": str(model)}, **spec}})
    config = tmp_path / "trainer.json"
    config.write_text(TrainerConfig.from_job(job).to_json())
    proc = trainer_process(job, config_path=str(config), rollout_endpoints=["http://127.0.0.1:9"],
                           weight_sync_addr="127.0.0.1:9", output_dir=str(tmp_path / "out"), python=sys.executable)
    termination = tmp_path / "termination-log"
    termination.write_text("")
    start = time.monotonic()
    res = subprocess.run(proc.command, env={**os.environ, **proc.env, "RLHF_TERMINATION_LOG": str(termination)},
                         capture_output=True, text=True, timeout=120)
    return res, time.monotonic() - start, termination.read_text()


@pytest.mark.parametrize("case", list(CASES))
def test_bad_data_exits_2_naming_the_field_before_any_model_loads(case, tmp_path, weightless_model):
    files, spec, field, detail = CASES[case]
    write_files(tmp_path / "data", files)
    res, seconds, termination = launch(tmp_path, weightless_model, resolve(spec, tmp_path / "data"))
    assert res.returncode == 2, res.stderr[-3000:]
    assert re.search(re.escape(field) + ": [^\n]*" + re.escape(detail), res.stderr), res.stderr[-3000:]
    assert field in termination  # the pod's Failed reason
    assert not (tmp_path / "out").exists() and "torch.distributed" not in res.stderr  # torchrun never started
    assert seconds < MAX_SECONDS, seconds



def test_many_malformed_rows_past_the_sample_end_the_job_with_exit_2(tmp_path, tiny_model_dir):
    """The preflight reads a sample (the first rows): rows after it can only be found by the
    trainer's full read. More than 5% of them malformed is a data error: torchrun's worker
    fails, and the launcher still exits 2 (never retried) with the message."""
    good = [{"prompt": f"{i}:", "response": str(i % 10)} for i in range(300)]
    bad = [{"prompt": f"{i}:"} for i in range(100)]  # no response column: 100 of 400 rows
    write_files(tmp_path / "data", {"p.jsonl": good + bad})
    spec = resolve({"method": "sft", "data": {"path": "p.jsonl"}}, tmp_path / "data")
    res, _, termination = launch(tmp_path, tiny_model_dir, spec)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "100 of the 400 rows" in res.stderr and "malformed" in termination
