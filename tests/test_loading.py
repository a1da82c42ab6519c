"""Dataset loading: JSONL and Parquet files, directories with splits, and clear errors."""

import json

import pytest
from trl import DatasetMixtureConfig, ScriptArguments

from fsdp_recipes.errors import UserError
from fsdp_recipes.data.loading import load_sft_datasets

ROWS = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(6)]


def args(name, **kw):
    return ScriptArguments(dataset_name=str(name), **kw), DatasetMixtureConfig()


def write_jsonl(path, rows=ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_file(tmp_path):
    train, ev = load_sft_datasets(*args(write_jsonl(tmp_path / "d.jsonl")), want_eval=False)
    assert len(train) == 6 and ev is None


def test_parquet_file(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "d.parquet"))
    train, _ = load_sft_datasets(*args(tmp_path / "d.parquet"), want_eval=False)
    assert train[0]["messages"][0]["content"] == "q0"


def test_directory_with_train_and_test_splits(tmp_path):
    write_jsonl(tmp_path / "train.jsonl")
    write_jsonl(tmp_path / "test.jsonl", ROWS[:2])
    train, ev = load_sft_datasets(*args(tmp_path), want_eval=True)
    assert (len(train), len(ev)) == (6, 2)


def test_custom_split_names(tmp_path):
    write_jsonl(tmp_path / "train.jsonl")
    with pytest.raises(UserError, match="no `train_sft` split"):
        load_sft_datasets(*args(tmp_path, dataset_train_split="train_sft"), want_eval=False)


def test_text_field_is_accepted(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"body": "hello"}])
    with pytest.raises(UserError, match="has columns"):
        load_sft_datasets(*args(path), want_eval=False)
    train, _ = load_sft_datasets(*args(path), want_eval=False, text_field="body")
    assert train[0]["body"] == "hello"


def test_unsupported_file_type(tmp_path):
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(UserError, match="use a .json, .jsonl, .parquet or .csv"):
        load_sft_datasets(*args(tmp_path / "d.txt"), want_eval=False)
