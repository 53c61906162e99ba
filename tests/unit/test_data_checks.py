"""The preflight's data checks (rlhf_trainer/preflight/data.py) in process: warnings and the
malformed-row fraction, a bounded read of a large dataset, evaluation sets, offline
skipping, and `rlhfctl validate` reporting the same problems. The exit-2 cases through the
trainer's own command are in tests/e2e/test_bad_data.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

from rlhf_contract.api import validate_job  # noqa: E402
from rlhf_contract.trainer_config import TrainerConfig  # noqa: E402
from rlhf_trainer.preflight.data import SAMPLE_ROWS, check_data, load_tokenizer  # noqa: E402
from rlhf_trainer.data.datasets import MAX_MALFORMED_FRACTION, peek_records  # noqa: E402

RL = {"rollout": {"engine": "cpu", "maxTokens": 2}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def config(model: Path, **spec) -> TrainerConfig:
    return TrainerConfig.from_job(validate_job({"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob",
                                                "metadata": {"name": "checks"},
                                                "spec": {"model": {"path": str(model)}, **spec}}))


def jsonl(path: Path, rows: list, *extra_lines: str) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(line + "\n" for line in extra_lines))
    return str(path)


def test_most_prompts_too_long_is_a_warning_with_the_fraction_and_a_length(tmp_path, tiny_model_dir, tokenizer):
    rows = [{"prompt": "1" * n + ":", "answer": "1"} for n in [2] * 3 + [9] * 7]  # 3 tokens x 3, 10 tokens x 7
    cfg = config(tiny_model_dir, **RL, data={"path": jsonl(tmp_path / "p.jsonl", rows), "maxPromptLength": 5})
    report = check_data(cfg, lambda: tokenizer)
    assert report.problems == []
    assert report.warnings == ["spec.data.maxPromptLength: 70% of the 10 sampled prompts of "
                               f"{tmp_path / 'p.jsonl'} are longer than 5 tokens and will be dropped; "
                               "10 keeps 95% of them"]


def test_malformed_rows_of_a_whole_small_dataset_warn_up_to_the_fraction(tmp_path, tiny_model_dir, tokenizer):
    good = [{"prompt": f"{i}:", "answer": "1"} for i in range(39)]
    path = jsonl(tmp_path / "p.jsonl", good, "{not json")  # 1 of 40: 2.5% <= 5%
    report = check_data(config(tiny_model_dir, **RL, data={"path": path}), lambda: tokenizer)
    assert report.problems == [] and len(report.warnings) == 1
    assert report.warnings[0].startswith(f"spec.data.path: 1 of the 40 rows of {path} are malformed")
    assert "line 40 is not JSON" in report.warnings[0]

    path = jsonl(tmp_path / "q.jsonl", good[:18], '{"prompt": 5}', '"just a string"')  # 2 of 20: 10% > 5%
    report = check_data(config(tiny_model_dir, **RL, data={"path": path}), lambda: tokenizer)
    assert MAX_MALFORMED_FRACTION < 0.1
    assert report.problems == [f"spec.data.path: 2 of the 20 rows of {path} are malformed; the first: {path}: row 18, "
                               "column 'prompt': expected prompt text or chat turns, got int"]


def test_a_sample_of_a_larger_dataset_fails_only_when_most_of_it_is_malformed(tmp_path, tiny_model_dir, tokenizer):
    good = [{"prompt": f"{i}:", "answer": "1"} for i in range(SAMPLE_ROWS * 2)]
    broken = ['{"prompt": 5, "answer": "1"}'] * 40  # 40 of the first 256 rows: the trainer judges the file
    path = str(tmp_path / "p.jsonl")
    Path(path).write_text("".join(line + "\n" for line in broken) + "".join(json.dumps(r) + "\n" for r in good))
    report = check_data(config(tiny_model_dir, **RL, data={"path": path}), lambda: tokenizer)
    assert report.problems == [] and "40 of the first 256 rows" in report.warnings[0]
    Path(path).write_text("".join(line + "\n" for line in broken * 10) + json.dumps(good[0]) + "\n")
    report = check_data(config(tiny_model_dir, **RL, data={"path": path}), lambda: tokenizer)
    assert report.problems[0].startswith(f"spec.data.path: {SAMPLE_ROWS} of the first {SAMPLE_ROWS} rows")


def test_a_large_parquet_dataset_is_read_by_its_metadata_and_first_rows(tmp_path, tiny_model_dir, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 400_000
    table = pa.table({"prompt": [f"{i % 1000}:" for i in range(n)], "answer": ["1"] * n})
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=50_000)
    sample = peek_records(str(tmp_path / "p.parquet"), limit=SAMPLE_ROWS)
    assert (len(sample.rows), sample.num_rows, sample.columns) == (SAMPLE_ROWS, n, ["prompt", "answer"])
    assert sample.rows[:2] == [{"prompt": "0:", "answer": "1"}, {"prompt": "1:", "answer": "1"}]
    start = time.monotonic()
    report = check_data(config(tiny_model_dir, **RL, data={"path": str(tmp_path / "p.parquet")}), lambda: tokenizer)
    assert report.problems == [] and report.warnings == []
    assert time.monotonic() - start < 2.0  # loading all 400k rows with `datasets` takes longer


@pytest.mark.parametrize("layout", ["arrow", "save_to_disk", "jsonl", "csv"])
def test_the_row_count_is_exact_where_the_format_gives_it(tmp_path, layout):
    rows = [{"prompt": f"{i}:", "answer": str(i)} for i in range(300)]
    ds = datasets.Dataset.from_list(rows)
    path = tmp_path / ("d" if layout == "save_to_disk" else f"d.{layout}")
    if layout == "arrow":
        import pyarrow as pa

        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, ds.data.table.schema) as writer:
            for start in range(0, 300, 100):
                writer.write_table(ds.data.table.slice(start, 100))
    elif layout == "save_to_disk":
        ds.save_to_disk(str(path))
    elif layout == "jsonl":
        jsonl(path, rows)
    else:
        ds.to_csv(str(path), index=False)
    sample = peek_records(str(path), limit=10)
    assert [r["prompt"] for r in sample.rows] == [f"{i}:" for i in range(10)]
    assert sample.num_rows == (None if layout in ("jsonl", "csv") else 300)  # JSON and CSV: not without reading all
    assert peek_records(str(path), limit=1000).num_rows == 300


def test_an_environment_needs_no_answer_column_and_gem_prompts_are_exempt(tmp_path, tiny_model_dir, tokenizer):
    env = tmp_path / "env.py"
    env.write_text("async def step(state, action, extra_info):\n    return {}\n")
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "1:"}])
    cfg = config(tiny_model_dir, **RL, data={"path": path}, environment={"file": str(env)})
    assert check_data(cfg, lambda: tokenizer).problems == []
    cfg = config(tiny_model_dir, **RL, data={"path": "builtin://gem", "maxPromptLength": 1},
                 environment={"gem": "game:GuessTheNumber-v0-easy"})
    assert check_data(cfg, lambda: pytest.fail("no tokenizer needed")).problems == []


def test_without_a_tokenizer_only_the_columns_are_checked(tmp_path, tiny_model_dir):
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "1234567:", "answer": "1"}])
    report = check_data(config(tiny_model_dir, **RL, data={"path": path, "maxPromptLength": 1}), lambda: None)
    assert report.problems == [] and report.unchecked == [f"{path}: rows and prompt lengths not checked (no tokenizer)"]
    report = check_data(config(tiny_model_dir, **RL, data={"path": str(tmp_path / "absent.jsonl")}), lambda: None,
                        require_paths=False)
    assert report.problems == [] and "is not on this machine" in report.unchecked[0]


def test_offline_rows_are_skipped_and_counted_up_to_the_fraction(tmp_path, tiny_model_dir, tokenizer):
    from rlhf_contract.api.models import DataSpec
    from rlhf_trainer.offline.data import OfflineData

    good = [{"prompt": f"{i}:", "chosen": "2", "rejected": "3"} for i in range(30)]
    path = jsonl(tmp_path / "p.jsonl", good[:15], '{"prompt": "1:", "chosen": "2"}', *map(json.dumps, good[15:]))
    data = OfflineData("dpo", DataSpec(path=path), tokenizer, seed=0, batch_size=4, budget=64)
    assert (data.num_skipped, len(data.train)) == (1, 30)
    path = jsonl(tmp_path / "q.jsonl", good[:5], '{"prompt": "1:", "chosen": "2"}')
    with pytest.raises(ValueError, match=r"1 of the 6 rows .* are malformed .*row 5: data.rejectedKey: expected text"):
        OfflineData("dpo", DataSpec(path=path), tokenizer, seed=0, batch_size=4, budget=64)


def test_the_preflight_prints_warnings_and_goes_on(tmp_path, tiny_model_dir, capsys):
    from rlhf_trainer.preflight import check

    path = jsonl(tmp_path / "p.jsonl", [{"prompt": f"{i}:", "answer": "1"} for i in range(39)], "{not json")
    assert check(config(tiny_model_dir, **RL, data={"path": path}), 1) == []
    assert "warning: spec.data.path: 1 of the 40 rows" in capsys.readouterr().err


def test_rlhfctl_validate_reports_the_data_problems(tmp_path, tiny_model_dir, capsys):
    import yaml
    from rlhf_launcher.cli import main

    job = {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "v"},
           "spec": {"model": {"path": str(tiny_model_dir)}, **RL,
                    "data": {"path": jsonl(tmp_path / "p.jsonl", [{"question": "1+1=", "answer": "2"}])}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["validate", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    assert "spec.data.promptKey:" in err and "its columns are question, answer" in err
    assert main(["validate", str(tmp_path / "job.yaml"), "--set", "data.promptKey=question"]) == 0
    assert main(["validate", str(tmp_path / "job.yaml"), "--set", "data.path=/elsewhere/p.jsonl"]) == 0
    assert "note: spec.data.path: /elsewhere/p.jsonl is not on this machine" in capsys.readouterr().err


def test_a_dotted_answer_key_is_checked_in_the_nested_field(tmp_path, tiny_model_dir, tokenizer):
    """veRL's layout: the answer at reward_model.ground_truth, accepted by data.answerKey."""
    rows = [{"prompt": [{"role": "user", "content": "1+1"}], "reward_model": {"style": "rule", "ground_truth": "2"}}]
    path = jsonl(tmp_path / "p.jsonl", rows)
    cfg = config(tiny_model_dir, **RL, data={"path": path, "answerKey": "reward_model.ground_truth"})
    assert check_data(cfg, lambda: None).problems == []
    cfg = config(tiny_model_dir, **RL, data={"path": path, "answerKey": "reward_model.answer"})
    [problem] = check_data(cfg, lambda: None).problems
    assert problem.startswith("spec.data.answerKey: reward.type exact_match compares") and \
        "no 'reward_model.answer' column" in problem
