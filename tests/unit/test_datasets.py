"""Loading prompt datasets from every local format and rendering them into prompts."""

from __future__ import annotations

import json

import pytest

datasets = pytest.importorskip("datasets")

from rlhf_trainer.data.datasets import load_records  # noqa: E402
from rlhf_trainer.data.rendering import PromptRecord, to_prompts  # noqa: E402

ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+3=", "answer": "5"}]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    """A character-level tokenizer with a chat template, built in code (no download)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    chars_only = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))  # no merges: one per char
    tok = PreTrainedTokenizerFast(tokenizer_object=chars_only, unk_token="<unk>")
    tok.chat_template = TEMPLATE
    return tok


def _write_arrow(path, rows):
    import pyarrow as pa

    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet", ".arrow"])
def test_load_each_file_format(tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif suffix == ".json":
        path.write_text(json.dumps(ROWS))
    elif suffix == ".csv":
        path.write_text("prompt,answer\n1+1=,2\n2+3=,5\n")
    elif suffix == ".parquet":
        datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    else:
        _write_arrow(path, ROWS)
    rows = load_records(str(path))
    assert [(r["prompt"], str(r["answer"])) for r in rows] == [("1+1=", "2"), ("2+3=", "5")]


def test_load_save_to_disk_and_splits(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    assert load_records(str(tmp_path / "single")) == ROWS

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(
        str(tmp_path / "dict"))
    assert load_records(str(tmp_path / "dict"), split="test") == ROWS[:1]
    with pytest.raises(ValueError, match=r"data.split: .* no split 'valid'; it has test, train"):
        load_records(str(tmp_path / "dict"), split="valid")


def test_load_directory_of_files(tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "test.jsonl").write_text(json.dumps(ROWS[1]) + "\n")
    assert load_records(str(tmp_path)) == ROWS
    assert load_records(str(tmp_path), split="test") == ROWS[1:]


def test_load_errors_say_what_to_change(tmp_path):
    with pytest.raises(ValueError, match=r"data.path: does not exist .*point data.path at"):
        load_records(str(tmp_path / "nope.jsonl"))
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(ValueError, match=r"data.path: unknown file extension '.txt'.*\.parquet"):
        load_records(str(tmp_path / "data.txt"))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match=r"data.path: could not read .*bad.jsonl"):
        load_records(str(tmp_path / "bad.jsonl"))


def test_text_prompts_and_system_prompt(tokenizer):
    prompts, dropped, skipped = to_prompts(ROWS, tokenizer=tokenizer, source="f.jsonl",
                                           max_prompt_length=100)
    assert dropped == 0 and skipped == 0
    assert prompts[0] == PromptRecord("1+1=", tokenizer("1+1=")["input_ids"], "2", ROWS[0], "1+1=")
    assert len(prompts[0].token_ids) == 4

    prompts, _, _ = to_prompts(ROWS[:1], tokenizer=tokenizer, source="f.jsonl",
                               system_prompt="Be brief.", max_prompt_length=100)
    assert prompts[0].text == "<system>Be brief.\n<user>1+1=\n<assistant>"
    assert prompts[0].prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}]
    assert len(prompts[0].token_ids) == len(prompts[0].text)


def test_messages_and_colossalchat_rows(tokenizer):
    rows = [
        {"messages": [{"role": "user", "content": "hi"}], "answer": "a", "extra_info": {"id": 7}},
        # ColossalChat: one turn as a dict, the answer under gt_answer, test cases kept
        {"messages": {"role": "user", "content": "sum"}, "gt_answer": "3",
         "test_cases": {"inputs": ["1 2\n"], "outputs": ["3\n"]}},
        # verl: the prompt column holds the chat turns and carries its own system turn
        {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}],
         "answer": 4, "data_source": "gsm8k"},
    ]
    prompts, dropped, skipped = to_prompts(rows, tokenizer=tokenizer, source="f.parquet",
                                           system_prompt="Sys", max_prompt_length=100)
    assert dropped == 0 and skipped == 0
    assert [p.text for p in prompts] == ["<system>Sys\n<user>hi\n<assistant>",
                                         "<system>Sys\n<user>sum\n<assistant>",
                                         "<system>S\n<user>q\n<assistant>"]
    assert [p.answer for p in prompts] == ["a", "3", "4"]
    assert [p.extra_info for p in prompts] == rows  # every column, the prompt's and the answer's too
    assert [p.prompt for p in prompts] == [  # the turns a reward sees: the system prompt where it was added
        [{"role": "system", "content": "Sys"}, {"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Sys"}, {"role": "user", "content": "sum"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]]


def test_dotted_keys_name_nested_fields_as_verl_lays_them_out(tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "2+2"}], "data_source": "gsm8k",
             "reward_model": {"style": "rule", "ground_truth": "4"}},
            {"prompt": [{"role": "user", "content": "3+3"}], "reward_model": {"style": "rule"}},  # no answer: ""
            {"prompt": "p", "reward_model": "not a dict", "reward_model.ground_truth": "7"}]  # a column of that name wins
    prompts, _, skipped = to_prompts(rows, tokenizer=tokenizer, source="f.parquet", answer_key="reward_model.ground_truth",
                                     max_prompt_length=100)
    assert skipped == 0 and [p.answer for p in prompts] == ["4", "", "7"]
    assert prompts[0].extra_info["reward_model"] == {"style": "rule", "ground_truth": "4"}
    prompts, _, _ = to_prompts([{"q": {"text": "abc"}, "a": 1}], tokenizer=tokenizer, source="f", prompt_key="q.text",
                               answer_key="a", max_prompt_length=100)
    assert prompts[0].text == "abc" and prompts[0].prompt == "abc"


def test_custom_column_names_and_long_prompts_dropped(tokenizer):
    rows = [{"question": "short", "label": "x"}, {"question": "y" * 50, "label": "z"},
            {"question": "also short", "label": "w"}]
    prompts, dropped, skipped = to_prompts(rows, tokenizer=tokenizer, source="f.csv",
                                           prompt_key="question", answer_key="label", max_prompt_length=10)
    assert dropped == 1 and skipped == 0
    assert [(p.text, p.answer) for p in prompts] == [("short", "x"), ("also short", "w")]


@pytest.mark.parametrize("row, message", [
    ({"answer": "1"}, r"f.jsonl: row 1 has neither a 'prompt' column .*nor a 'messages'"),
    ({"prompt": 5}, r"f.jsonl: row 1, column 'prompt': expected prompt text or chat turns"),
    ({"messages": [{"role": "user"}]}, r"f.jsonl: row 1, column 'messages': turn 0 must be a dict"),
    ({"messages": []}, r"f.jsonl: row 1, column 'messages' must be a non-empty list"),
    ({"prompt": "p", "answer": ["a"]}, r"f.jsonl: row 1, column 'answer': the answer must be"),
])
def test_malformed_rows_name_file_row_and_column(tokenizer, row, message):
    with pytest.raises(ValueError, match=message):
        to_prompts([ROWS[0], row], tokenizer=tokenizer, source="f.jsonl", max_prompt_length=100)


def test_messages_without_chat_template_is_an_error(tokenizer):
    from copy import deepcopy

    plain = deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(ValueError, match=r"row 0, column 'messages': chat messages need a "
                                         r"tokenizer with a chat template"):
        to_prompts([{"messages": [{"role": "user", "content": "x"}]}], tokenizer=plain,
                   source="f.jsonl", max_prompt_length=100)


def test_prompts_that_tokenize_to_nothing_are_dropped_and_counted(tokenizer):
    rows = [{"prompt": "", "answer": "1"}, {"prompt": "1234:", "answer": "4"}]
    prompts, dropped, skipped = to_prompts(rows, tokenizer=tokenizer, source="f.jsonl", max_prompt_length=64)
    assert [p.answer for p in prompts] == ["4"] and dropped == 1 and skipped == 0
    assert all(p.token_ids for p in prompts)  # nothing empty reaches a rollout server


def test_a_few_malformed_rows_are_skipped_and_counted_many_are_an_error(tokenizer):
    from rlhf_trainer.data.datasets import MAX_MALFORMED_FRACTION

    good = [{"prompt": f"{i}:", "answer": "1"} for i in range(39)]
    prompts, dropped, skipped = to_prompts([*good[:10], {"prompt": 5}, *good[10:]], tokenizer=tokenizer,
                                           source="f.jsonl", max_prompt_length=100)
    assert (len(prompts), dropped, skipped) == (39, 0, 1)  # 1 of 40 <= MAX_MALFORMED_FRACTION
    assert [p.text for p in prompts] == [r["prompt"] for r in good]
    bad = [{"answer": "1"}] * (int(MAX_MALFORMED_FRACTION * 40) + 1)
    with pytest.raises(ValueError, match=rf"data.path: {len(bad)} of the {39 + len(bad)} rows of f.jsonl are "
                                         r"malformed .*the first: f.jsonl: row 39 has neither a 'prompt' column"):
        to_prompts([*good, *bad], tokenizer=tokenizer, source="f.jsonl", max_prompt_length=100)


def test_a_broken_line_deep_in_a_jsonl_file_is_skipped_not_fatal(tmp_path, tokenizer):
    """`datasets` cannot read the file at all (a line that is not JSON, an answer that turns
    from text into a number); the rows are read line by line and the broken one skipped."""
    rows = [{"prompt": f"{i}:", "answer": str(i)} for i in range(50)]
    lines = [json.dumps(r) for r in rows]
    lines.insert(45, "{broken")
    lines.append(json.dumps({"prompt": "7:", "answer": 7}))
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    records = load_records(str(tmp_path / "d.jsonl"))
    assert len(records) == 52 and records[0] == rows[0] and records[51] == {"prompt": "7:", "answer": 7}
    prompts, dropped, skipped = to_prompts(records, tokenizer=tokenizer, source="d.jsonl", max_prompt_length=100)
    assert (len(prompts), dropped, skipped) == (51, 0, 1)
    assert [p.answer for p in prompts][-2:] == ["49", "7"]


def test_an_empty_jsonl_file_has_no_rows(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    assert load_records(str(tmp_path / "empty.jsonl")) == []


def test_built_in_prompts_respect_max_prompt_length(tokenizer):
    from rlhf_contract.api.models import DataSpec
    from rlhf_trainer.data.prompts import PromptSource

    def prompts(limit: int) -> tuple[list[str], int]:
        source = PromptSource(DataSpec(path="builtin://last-digit", max_prompt_length=limit), tokenizer, seed=3)
        return [p.text for p in source.next_batch(200)], source.num_dropped

    free, none_dropped = prompts(1024)  # "3714:" is 5 tokens; prompts have 4 to 7
    short, dropped = prompts(5)
    assert none_dropped == 0 and max(len(t) for t in free) == 7
    assert max(len(t) for t in short) <= 5 and dropped > 0
    assert [a for a, b in zip(free, short) if len(a) <= 5] == [b for a, b in zip(free, short) if len(a) <= 5]
    assert prompts(5) == (short, dropped)  # a pure function of (seed, index): resumable
    with pytest.raises(ValueError, match=r"data.maxPromptLength: 3 tokens is shorter than"):
        prompts(3)
