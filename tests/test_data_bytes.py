"""Data files as other tools write them (issue 44 item 6): a UTF-8 byte-order mark, Windows line endings and blank
lines are read as `datasets` reads them, and the pack's own readers (the row checks, DPO's and KTO's rows as written)
agree with it on the rows and name a row by its line as an editor counts lines; a byte that is not UTF-8 (which
pyarrow loads and a rank then fails to decode, naming no file) and a file of blank lines only are one line with the
file (and the line) before any rank starts."""

import json

import pytest
from recipe_variant import recipe_variant
from test_bad_input import assert_one_line_error
from trl import DatasetMixtureConfig, ScriptArguments

from fsdp_recipes.data import formats, loading
from fsdp_recipes.data.rows import row_at
from fsdp_recipes.errors import UserError
from fsdp_recipes.train.kinds import dpo


def chat(i):
    return {"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
            "completion": [{"role": "assistant", "content": str(i + 1)}]}


def write(path, lines, bom=False, newline="\n", encoding="utf-8"):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = newline.join(lines) + newline
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode(encoding))
    return path


def load(path):
    return loading.load_sft_datasets(ScriptArguments(dataset_name=str(path)), DatasetMixtureConfig(), False)[0]


@pytest.mark.parametrize("bom, newline", [(True, "\n"), (False, "\r\n"), (True, "\r\n")],
                         ids=["bom", "crlf", "bom-crlf"])
def test_a_bom_windows_line_endings_and_blank_lines_read_as_datasets_reads_them(tmp_path, bom, newline):
    lines = [json.dumps(chat(0)), "", json.dumps(chat(1)), "   ", "", json.dumps(chat(2))]
    train = load(write(tmp_path / "d.jsonl", lines, bom, newline))
    assert [r["completion"][0]["content"] for r in train] == ["1", "2", "3"]
    assert row_at(str(tmp_path / "d.jsonl"), "train", 2) == f"{tmp_path / 'd.jsonl'}:6"


def test_preference_pairs_with_a_bom_are_checked_as_written(tmp_path):
    """DPO's and KTO's checks read the file's rows as written: a BOM used to stop json.loads there."""
    pair = lambda good, bad: json.dumps({"prompt": "2 + 3 =", "chosen": good, "rejected": bad})  # noqa: E731
    path = write(tmp_path / "pairs.jsonl", [pair("5", "6"), "", pair("7", "7")], bom=True, newline="\r\n")
    ds = loading.load_splits(ScriptArguments(dataset_name=str(path)), DatasetMixtureConfig(), False,
                             dpo.check_columns)[0]
    with pytest.raises(UserError, match=f"{path}:3: `chosen` and `rejected` are the same answer"):
        formats.check_rows(ds, str(path), "train")  # DPO's check_data: the preference format's checks


def test_a_bad_row_after_blank_lines_is_named_by_its_editor_line(tmp_path, checks):
    bad = {"prompt": [{"role": "robot", "content": "hi"}], "completion": [{"role": "assistant", "content": "1"}]}
    folder = tmp_path / "data"
    write(folder / "train.jsonl", [json.dumps(chat(0)), "", "", json.dumps(chat(1)), json.dumps(bad)], bom=True,
          newline="\r\n")
    write(folder / "test.jsonl", [json.dumps(chat(5))])
    res = checks([recipe_variant(tmp_path, dataset_name=str(folder))])
    assert_one_line_error(res, f"{folder / 'train.jsonl'}:5: role 'robot' is not one of")


PREFIX = '{"prompt": [{"role": "user", "content": "'


@pytest.mark.parametrize("encoding, text, byte, at", [
    ("latin-1", "caf\u00e9", 0xE9, 4),  # é as Latin-1's one byte, the 4th character of the text
    ("cp1252", "\u201csmart quotes\u201d", 0x93, 1),  # Word's quotes
], ids=["latin-1", "cp1252"])
def test_a_stray_non_utf8_byte_is_one_line_with_file_and_line(tmp_path, checks, encoding, text, byte, at):
    folder = tmp_path / "data"
    write(folder / "train.jsonl", [json.dumps(chat(i)) for i in range(3)])
    line = PREFIX + text + '"}], "completion": [{"role": "assistant", "content": "1"}]}'
    path = write(folder / "test.jsonl", [json.dumps(chat(5)), "", line], encoding=encoding)
    res = checks([recipe_variant(tmp_path, dataset_name=str(folder))])
    assert_one_line_error(res, f"{path}:3: byte 0x{byte:02x} at column {len(PREFIX) + at} is not UTF-8")
    assert "iconv" in res.stderr


@pytest.mark.parametrize("content", [b"\n\n   \n", b"\xef\xbb\xbf\r\n\r\n"], ids=["blank", "bom-crlf"])
def test_a_file_of_blank_lines_only_is_one_line(tmp_path, checks, content):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    res = checks([recipe_variant(tmp_path, dataset_name=str(path), eval_strategy="no")])
    assert_one_line_error(res, f"the dataset file {path} holds only blank lines, no rows")


def test_a_malformed_line_after_a_bom_and_blank_lines_is_named_by_its_line(tmp_path):
    path = write(tmp_path / "d.jsonl", [json.dumps(chat(0)), "", '{"prompt": "x"'], bom=True, newline="\r\n")
    with pytest.raises(UserError, match=f"malformed JSON line in the dataset: {path}:3: "):
        load(path)


@pytest.mark.parametrize("sep, name", [(";", "semicolons"), ("\t", "tabs")])
def test_a_csv_file_separated_otherwise_than_by_commas_is_one_line_naming_the_separator(tmp_path, sep, name):
    """A spreadsheet's CSV in many locales: datasets read `prompt;completion` as one column, and the line said the
    columns were wrong (SFT needs prompt + completion ...), not why."""
    data = write(tmp_path / "wine.csv", [f"prompt{sep}completion", f"Wine 1?{sep} class_0", f"Wine 2?{sep} class_1"])
    with pytest.raises(UserError, match=f"wine.csv:1: the header `prompt{sep}completion` separates its columns "
                                        f"with {name}, .* Fix: save the file with commas"):
        load(data)
    assert load(write(tmp_path / "ok.csv", ["prompt,completion", "a;b, c"]))[0] == {"prompt": "a;b",
                                                                                     "completion": " c"}


def test_a_folder_that_is_not_a_dataset_is_named_for_what_it_is(tmp_path):
    """A model folder given as dataset_name (CastError: Couldn't cast), and a folder of data files with different
    columns (KeyError: Field "150" does not exist), each said `check that the file is valid JSON Lines`."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (model / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128, "chat_template": "x"}))
    (model / "model.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(UserError, match=f"the dataset {model} is a model folder .* a model goes in model_name_or_path"):
        load(model)
    mixed = tmp_path / "mixed"
    write(mixed / "iris.csv", ["sepal,species", "5.1,setosa"])
    write(mixed / "wine.csv", ["alcohol,proline,class", "14.2,1065,0"])
    with pytest.raises(UserError, match=r"datasets reads its 2 data files \(iris.csv, wine.csv\) together, .* Fix: "
                                        "point dataset_name at one file"):
        load(mixed)


def test_a_binary_file_under_a_text_files_name_is_named_for_what_it_is(tmp_path):
    """A Parquet file saved as .jsonl was 'byte 0xb4 at column 45 is not UTF-8 (... Latin-1 or Windows-1252). Fix:
    iconv'; a gzip file without .gz likewise."""
    import gzip

    import pandas as pd

    pd.DataFrame({"prompt": ["2 + 2 ="], "completion": [" 4"]}).to_parquet(tmp_path / "rows.jsonl")
    with pytest.raises(UserError, match=r"rows.jsonl is a Parquet file .* Fix: rename it to rows.parquet\.$"):
        load(tmp_path / "rows.jsonl")
    (tmp_path / "zipped.jsonl").write_bytes(gzip.compress(json.dumps(chat(0)).encode()))
    with pytest.raises(UserError, match=r"zipped.jsonl is gzip-compressed .* Fix: rename it to zipped.jsonl.gz\.$"):
        load(tmp_path / "zipped.jsonl")
    (tmp_path / "zipped.jsonl").rename(tmp_path / "zipped.jsonl.gz")
    assert len(load(tmp_path / "zipped.jsonl.gz")) == 1  # the name the line gives is one datasets reads


def test_a_relative_path_that_is_not_there_names_the_absolute_one_and_where_it_is_taken_from(tmp_path, monkeypatch):
    """Trial: `dataset not found: mine.jsonl`, written from the recipe's folder, said nowhere where it was looked for
    (the model's line did); both now say it, and that relative paths are taken from where the command runs."""
    from fsdp_recipes.config import model_found
    from fsdp_recipes.data import files

    monkeypatch.chdir(tmp_path)
    note = "a relative path is taken from the folder the command runs in, not from the recipe's folder"
    with pytest.raises(UserError) as err:
        files.check_found("mine.jsonl")
    assert str(err.value).startswith(f"dataset not found: mine.jsonl ({tmp_path}/mine.jsonl; {note}). Fix: ")
    with pytest.raises(UserError) as err:
        files.check_found(str(tmp_path / "mine.jsonl"))  # absolute: as it was
    assert str(err.value).startswith(f"dataset not found: {tmp_path}/mine.jsonl. Fix: ")
    with pytest.raises(UserError) as err:
        model_found.check_local_model("./models/mine")
    assert str(err.value).startswith(f"model not found: ./models/mine does not exist ({tmp_path}/models/mine; {note})"
                                     ". Fix: ")


def test_a_missing_dataset_names_a_close_file_and_the_tiny_builder_only_for_the_cache(tmp_path, cache_dir):
    """`dataset not found: data/iris_alpaka.jsonl. Fix: ... build the tiny default's data with tiny_assets` for a
    user's own misspelt file."""
    write(tmp_path / "iris_alpaca.jsonl", [json.dumps(chat(0))])
    with pytest.raises(UserError, match=rf"dataset not found: {tmp_path}/iris_alpaka.jsonl. Fix: did you mean "
                                        rf"{tmp_path}/iris_alpaca.jsonl\?$"):
        load(tmp_path / "iris_alpaka.jsonl")
    with pytest.raises(UserError, match=r"Fix: check dataset_name \(a file, or a folder of train.jsonl"):
        load(tmp_path / "wine.csv")
    with pytest.raises(UserError, match="tiny_assets"):
        load(cache_dir / "no-such-data")


@pytest.mark.parametrize("text, fragment", [
    (json.dumps({f"k{i:04d}": f"language {i}" for i in range(8000)}, indent=4),
     "is a single JSON object (8,000 keys: ['k0000', 'k0001', 'k0002', 'k0003', 'k0004', ...] and 7,995 more), not a "
     "list of rows or a JSON Lines file"),
    (json.dumps({"version": 2, "data": [chat(i) for i in range(3)]}, indent=2),
     "its rows look to be the 3 objects under `data`: jq -c '.data[]' one.json > rows.jsonl"),
    (json.dumps({"prompt": ["1 + 1?", "2 + 2?"], "completion": ["2", "4"]}),
     "holds its rows as columns: one JSON object of 2 lists (['completion', 'prompt'])"),
], ids=["pretty-printed", "rows-under-a-key", "columns"])
def test_a_file_of_one_json_object_is_one_short_line_naming_it(tmp_path, text, fragment):
    """A .json file holding one object (datasets' own languages.json): datasets read it as ONE row with a column per
    key, and the column check's line listed all 8,000 of them (56 KB)."""
    path = tmp_path / "one.json"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        load(path)
    line = str(err.value)
    assert fragment in line and "Fix: " in line and "\n" not in line and len(line.replace(str(path), "F")) < 360, line
    one_row = write(tmp_path / "one_row.jsonl", [json.dumps(chat(1))])  # one object on one line: a row of JSON Lines
    assert load(one_row)[0] == chat(1)


def test_a_column_list_in_an_error_is_cut_short(tmp_path):
    """Any column list an error prints: the first 20 names and how many more."""
    path = write(tmp_path / "wide.jsonl", [json.dumps({f"c{i:03d}": "x" for i in range(300)})] * 2)
    with pytest.raises(UserError) as err:
        load(path)
    line = str(err.value)
    assert "has columns ['c000', 'c001', " in line and "'c019', ...] and 280 more, but SFT needs" in line, line
    assert len(line) < 1000, len(line)


def test_a_line_cut_short_is_named_by_its_own_column(tmp_path):
    """A line truncated after `"completion":` was parsed with its newline, which JSON reads as line 2: `(column 1)`.
    The column is the line's own, where the value is missing (one past its last character)."""
    cut = '{"prompt": "What is 41 + 1?", "completion":'
    path = write(tmp_path / "bad.jsonl", [json.dumps(chat(i)) for i in range(3)] + [cut], newline="\r\n")
    with pytest.raises(UserError, match=rf"{path}:4: Expecting value \(column {len(cut) + 1}\)\. Fix: "):
        load(path)
