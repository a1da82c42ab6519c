"""Data formats (data/formats/, data/declaration.py, data/loading.py): ShareGPT, Alpaca, prompt/response, messages, a
text field and the preference layouts, declared with `dataset_format:` or detected, converted once with datasets' map;
the launcher's one line saying what it found; a row that fits no format is one line with its file and line. The
launcher's checks run in this process (`checks`, `launcher_until_ranks`) on copies of the tiny recipe."""

import json

import pytest
from conftest import REPO, RanksWouldStart, launcher_until_ranks
from recipe_variant import recipe_variant
from test_bad_input import assert_one_line_error
from trl import DatasetMixtureConfig, ScriptArguments

from fsdp_recipes.config.run_config import PackArguments
from fsdp_recipes.data import declaration, formats, loading
from fsdp_recipes.data.spec import Spec
from fsdp_recipes.errors import UserError
from fsdp_recipes.train.kinds import dpo, kto


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sharegpt(i, bot="gpt"):
    return {"conversations": [{"from": "system", "value": "Answer with the number."},
                              {"from": "human", "value": f"What is {i} + 1?"}, {"from": bot, "value": str(i + 1)}]}


def alpaca(i):
    return {"instruction": f"What is {i} + 1?", "input": "" if i % 2 else "Answer with digits.", "output": str(i + 1)}


def load(path, fmt=None, want_eval=False, **pack):
    return loading.load_sft_datasets(ScriptArguments(dataset_name=str(path)), DatasetMixtureConfig(), want_eval,
                                     pack=PackArguments(dataset_format=fmt, **pack))


def test_a_sharegpt_file_becomes_messages_with_chat_roles(tmp_path):
    train, _ = load(write_jsonl(tmp_path / "sg.jsonl", [sharegpt(i) for i in range(4)]))
    assert train.column_names == ["messages"]
    assert train[0]["messages"] == [{"role": "system", "content": "Answer with the number."},
                                    {"role": "user", "content": "What is 0 + 1?"},
                                    {"role": "assistant", "content": "1"}]
    assert loading.NOTES[0] == (f"data {tmp_path / 'sg.jsonl'}: ShareGPT (conversations) -> messages; roles human "
                                "-> user, gpt -> assistant (detected; declare it with `dataset_format: sharegpt`)")


def test_an_alpaca_file_becomes_chat_prompt_and_completion(tmp_path):
    train, _ = load(write_jsonl(tmp_path / "alpaca.jsonl", [alpaca(i) for i in range(4)]))
    assert sorted(train.column_names) == ["completion", "prompt"]
    assert train[0]["prompt"] == [{"role": "user", "content": "What is 0 + 1?\n\nAnswer with digits."}]
    assert train[1]["prompt"] == [{"role": "user", "content": "What is 1 + 1?"}]  # an empty input adds nothing
    assert train[1]["completion"] == [{"role": "assistant", "content": "2"}]
    assert "Alpaca (instruction, output, input) -> chat prompt + completion (detected" in loading.NOTES[0]


def test_a_clean_alpaca_file_is_converted_without_looking_up_its_rows_lines(tmp_path, monkeypatch):
    """A row's line is found (by reading the file up to it) for an error only: looked up for every row, a
    20,000-row Alpaca file took 53 s to convert, in the launcher, each rank and the summary."""
    from fsdp_recipes.data import rows

    looked_up = []
    monkeypatch.setattr(rows, "place_of", lambda path, index: looked_up.append(index) or f"{path}:{index}")
    train, _ = load(write_jsonl(tmp_path / "alpaca.jsonl", [alpaca(i) for i in range(6)]))
    assert len(train) == 6 and looked_up == []
    bad = [alpaca(0), {**alpaca(1), "history": [["only the question"]]}]
    with pytest.raises(UserError, match=r"alpaca2.jsonl:1: Alpaca's `history` holds \['only the question'\]"):
        load(write_jsonl(tmp_path / "alpaca2.jsonl", bad))  # line 1: the stand-in above names the index


def test_a_chat_file_is_read_once_to_name_its_rows(tmp_path, monkeypatch):
    """Each converted turn is handed its row's place (file:line): finding it read the file up to the row, for every
    turn, so a 20,000-row ShareGPT file took a minute (and a carved one's summary failed on the stale rows)."""
    import builtins

    from fsdp_recipes.data import rows

    data = write_jsonl(tmp_path / "sg.jsonl", [sharegpt(i) for i in range(40)])
    opened = []
    monkeypatch.setattr(rows, "open", lambda path, *a, **k: opened.append(path) or builtins.open(path, *a, **k),
                        raising=False)
    train, _ = load(data)
    assert len(train) == 40 and len(opened) <= 3  # its layout and its lines, each read once
    assert rows.line_of(data, 39) == 40 and rows.place_of(data, 0) == f"{data}:1"


def test_sft_on_labelled_answers_refuses_the_undesirable_ones(tmp_path):
    """KTO's rows under an SFT recipe: the answers labelled false were trained on as the answers to give (exit 0)."""
    rows = [{"prompt": f"What is {i} + 1?", "completion": f" {i + (1 if i % 3 else 2)}", "label": i % 3 != 0}
            for i in range(6)]
    with pytest.raises(UserError, match=r"labelled answers \(`label`\), 2 of its 6 rows labelled undesirable .* Fix: "
                                        r"train it with a KTO recipe.*where `label` means something else, declare "
                                        r"`dataset_format: prompt_completion`"):
        load(write_jsonl(tmp_path / "kto.jsonl", rows))
    good = [r for r in rows if r["label"]]
    assert len(load(write_jsonl(tmp_path / "good.jsonl", good))[0]) == 4  # only desirable answers: SFT takes them
    assert len(load(tmp_path / "kto.jsonl", "prompt_completion")[0]) == 6  # declared: the label is not the point


def test_prompt_response_text_and_messages(tmp_path):
    train, _ = load(write_jsonl(tmp_path / "pr.jsonl", [{"prompt": "2 + 2 =", "response": " 4"}] * 2))
    assert train[0] == {"prompt": "2 + 2 =", "completion": " 4"}
    messages = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    train, _ = load(write_jsonl(tmp_path / "m.jsonl", messages))
    assert train[0] == messages[0] and "OpenAI chat (messages) (as TRL takes it)" in loading.NOTES[0]
    train, _ = load(write_jsonl(tmp_path / "t.jsonl", [{"text": "a b c"}]))
    assert train[0] == {"text": "a b c"} and "a text field (text)" in loading.NOTES[0]


def test_a_declared_format_maps_columns_and_roles(tmp_path):
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(3)]
    train, _ = load(write_jsonl(tmp_path / "qa.jsonl", rows), "prompt_completion prompt=question completion=answer")
    assert train[0] == {"prompt": "What is 0 + 1?", "completion": "1"}
    assert loading.NOTES[0].endswith("; question as prompt; answer as completion (declared by dataset_format)")
    train, _ = load(write_jsonl(tmp_path / "bot.jsonl", [sharegpt(i, bot="bot") for i in range(2)]),
                    "sharegpt bot=assistant")
    assert train[0]["messages"][-1] == {"role": "assistant", "content": "1"}
    rows = [{"q": "What is 1 + 1?", "a": "2"}]
    train, _ = load(write_jsonl(tmp_path / "alp.jsonl", rows), "alpaca instruction=q, output=a")
    assert train[0]["completion"] == [{"role": "assistant", "content": "2"}]


@pytest.mark.parametrize("spec, fragment", [
    ("shargpt", "dataset_format 'shargpt' is not one of messages, sharegpt, alpaca"),
    ("alpaca question=instruction", "'question' is not a column of the alpaca format (instruction, output, input,"),
    ("sharegpt bot", "'bot' is not slot=column or name=role"),
    ("prompt_completion completion='Adj. Close*", "no closing quotation. Fix: close the quotes"),
], ids=["name", "slot", "pair", "quote"])
def test_a_mistyped_declaration_is_one_line_before_any_data_is_read(tmp_path, checks, spec, fragment):
    assert_one_line_error(checks([recipe_variant(tmp_path, dataset_format=spec)]), fragment)


def test_a_declared_column_the_file_lacks_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"declared `dataset_format: alpaca` but has no column `instruction`"):
        load(write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "output": "a"}]), "alpaca")


@pytest.mark.parametrize("rows, fragment", [
    ([sharegpt(1), sharegpt(2), sharegpt(3, bot="bot")],
     "sg.jsonl:3: role 'bot' is not a chat role (system, user, assistant, tool) nor one the pack maps (human -> "
     "user, gpt -> assistant"),
    ([alpaca(1), {"instruction": "What is 2 + 2?", "input": "", "output": None}],
     "sg.jsonl:2: Alpaca's `output` is None, not text"),
], ids=["sharegpt-role", "alpaca-output"])
def test_a_row_that_fits_no_format_is_one_line_with_file_and_line(tmp_path, rows, fragment):
    with pytest.raises(UserError, match="Fix:") as err:
        load(write_jsonl(tmp_path / "sg.jsonl", rows))
    assert fragment in str(err.value)


def test_the_preference_layouts_pass_through(tmp_path):
    q = [{"role": "user", "content": "What is 2 + 3?"}]
    pairs = [{"prompt": q, "chosen": [{"role": "assistant", "content": "5"}],
              "rejected": [{"role": "assistant", "content": "6"}]}] * 3
    script = ScriptArguments(dataset_name=str(write_jsonl(tmp_path / "pairs.jsonl", pairs)))
    train, _ = loading.load_splits(script, DatasetMixtureConfig(), False, dpo.check_columns)
    assert train[0] == pairs[0] and "preference pairs (chosen, rejected, prompt) (as TRL takes it)" in loading.NOTES[0]
    labelled = [{"prompt": q, "completion": [{"role": "assistant", "content": "5"}], "label": True}] * 2
    script = ScriptArguments(dataset_name=str(write_jsonl(tmp_path / "labelled.jsonl", labelled)))
    train, _ = loading.load_splits(script, DatasetMixtureConfig(), False, kto.check_columns)
    assert train[0] == labelled[0] and "labelled answers (prompt, completion, label)" in loading.NOTES[0]


@pytest.mark.parametrize("kind", [dpo, kto], ids=["dpo", "kto"])
def test_sft_data_under_a_preference_kind_is_named_as_the_file_holds_it(tmp_path, kind):
    """DPO on an Alpaca file said it 'has columns ['completion', 'prompt']', which the file does not have."""
    script = ScriptArguments(dataset_name=str(write_jsonl(tmp_path / "alpaca.jsonl", [alpaca(i) for i in range(3)])))
    with pytest.raises(UserError, match=r"alpaca.jsonl holds Alpaca rows \(SFT data\), read as columns \['completion', "
                                        r"'prompt'\], but (DPO|KTO) needs"):
        loading.load_splits(script, DatasetMixtureConfig(), False, kind.check_columns)


def test_a_mixture_converts_each_source_from_its_own_format(tmp_path):
    sg = write_jsonl(tmp_path / "sg.jsonl", [sharegpt(i) for i in range(3)])
    al = write_jsonl(tmp_path / "al.jsonl", [alpaca(i) for i in range(2)])
    mixture = DatasetMixtureConfig(datasets=[{"path": "json", "data_files": str(sg)},
                                             {"path": "json", "data_files": str(al)}])
    train, _ = loading.load_sft_datasets(ScriptArguments(), mixture, False)
    assert len(train) == 5 and train.column_names == ["messages"]
    assert train[3]["messages"] == [{"role": "user", "content": "What is 0 + 1?\n\nAnswer with digits."},
                                    {"role": "assistant", "content": "1"}]
    assert [n.split(":")[0] for n in loading.NOTES[:2]] == [f"data {sg}", f"data {al}"]
    bad = write_jsonl(tmp_path / "bad.jsonl", [sharegpt(1), sharegpt(2, bot="bot")])
    mixture.datasets[1].data_files = str(bad)
    with pytest.raises(UserError, match=f"{bad}:2: role 'bot'"):
        loading.load_sft_datasets(ScriptArguments(), mixture, False)


def test_the_launcher_says_what_it_found_and_how_it_maps(tmp_path, cache_dir, monkeypatch, capsys):
    data = tmp_path / "sharegpt"
    write_jsonl(data / "train.jsonl", [sharegpt(i) for i in range(8)])
    write_jsonl(data / "validation.jsonl", [sharegpt(i) for i in range(20, 24)])
    with pytest.raises(RanksWouldStart):
        launcher_until_ranks([str(recipe_variant(tmp_path, dataset_name=str(data)))], monkeypatch, capsys)
    out = capsys.readouterr().out.splitlines()
    assert (f"[launch] data {data}: ShareGPT (conversations) -> messages; roles human -> user, gpt -> assistant "
            "(detected; declare it with `dataset_format: sharegpt`)") in out
    assert "[launch] eval split: the `validation` split (4 rows)" in out


def test_parse_spec_round_trips_the_documented_examples():
    assert declaration.parse_spec("alpaca instruction=question output=answer") == Spec(
        "alpaca", {"instruction": "question", "output": "answer"}, {})
    assert declaration.parse_spec("sharegpt bot=assistant") == Spec("sharegpt", {}, {"bot": "assistant"})
    assert declaration.parse_spec(None) is None and declaration.parse_spec(" ") is None


def test_a_column_name_with_spaces_is_quoted_as_in_a_shell(tmp_path):
    """matplotlib's msft.csv names a column `Adj. Close*`: `completion='Adj. Close*'` was split at the space into
    `completion='Adj.` and `Close*'`, "not slot=column"."""
    assert declaration.parse_spec("prompt_completion prompt=Date completion='Adj. Close*'") == Spec(
        "prompt_completion", {"prompt": "Date", "completion": "Adj. Close*"}, {})
    assert declaration.parse_spec('alpaca "instruction=the question", output=a') == Spec(
        "alpaca", {"instruction": "the question", "output": "a"}, {})
    # a quote inside a name, or a backslash, is part of it (they were "no closing quotation", and a lost backslash)
    assert declaration.parse_spec("prompt_completion prompt=Q completion=it's") == Spec(
        "prompt_completion", {"prompt": "Q", "completion": "it's"}, {})
    assert declaration.parse_spec(r"prompt_completion prompt=a\b completion='c\d e'") == Spec(
        "prompt_completion", {"prompt": r"a\b", "completion": r"c\d e"}, {})
    csv = tmp_path / "msft.csv"
    csv.write_text("Date,Open,Adj. Close*\n19-Sep-03 ,29.76,29.79\n18-Sep-03 ,28.49,29.53\n")
    train, _ = load(csv, "prompt_completion prompt=Date completion='Adj. Close*'")
    assert (train[0]["prompt"], train[0]["completion"]) == ("19-Sep-03 ", "29.79"), train[0]


def test_an_alpaca_answer_reaches_grpo_rewards_as_text(tmp_path):
    """GRPO and RLOO read a completion as `answer`: Alpaca's converted chat completion gives its text."""
    from fsdp_recipes.train.kinds import sampling

    train, _ = load(write_jsonl(tmp_path / "alpaca.jsonl", [alpaca(i) for i in range(3)]))
    assert sampling.with_answer(train)["answer"] == ["1", "2", "3"]


def test_every_row_the_readme_shows_is_detected_as_its_format_and_converts(tmp_path):
    """README's one row per format (issue 42 item 7): each, as a JSON Lines file loaded by datasets, is detected as
    the format named beside it and converts to a layout TRL takes, so the front door cannot drift from the code."""
    import re

    from datasets import load_dataset


    text = (REPO / "README.md").read_text()
    block = text[text.index("```text\nmessages "):]
    rows = re.findall(r"^(\w+)\s+(\{.*\})", block[:block.index("\n```\n", 8)], flags=re.M)
    assert [name for name, _ in rows] == list(formats.names())
    for name, row in rows:
        path = tmp_path / f"{name}.jsonl"
        path.write_text((row + "\n") * 3)
        ds = load_dataset("json", data_files=str(path), split="train")
        spec = declaration.resolve(ds, str(path), None)
        assert spec is not None and spec.name == name, (name, spec)
        out = declaration.convert(ds, spec, lambda i: f"{path}:{i + 1}")
        assert len(out) == 3 and set(out.column_names) & {"messages", "prompt", "text"}, (name, out.column_names)


def test_text_prompts_that_run_into_their_answers_are_one_counted_warning():
    """TRL joins a plain-text prompt and its answer as written (`prompt + completion` in SFTTrainer's, DPOTrainer's
    and KTOTrainer's tokenize_fn), so "What is 2+2?" + "4" trains "What is 2+2?4". The pack leaves the text as TRL
    takes it and says so once per split, counted, in what the launcher's checks and `make data` print (the trainer
    kind's check_data). In memory: rows 1 and 4 of 5 run together; a space or newline on either side, and chat rows
    (the template separates the turns), do not."""
    import datasets
    from types import SimpleNamespace

    from fsdp_recipes.train import kinds

    def cfg(where):
        return SimpleNamespace(script=SimpleNamespace(dataset_name=where, dataset_train_split="train",
                                                      dataset_test_split="test"),
                               training=SimpleNamespace(dataset_text_field="text"),
                               model=SimpleNamespace(model_name_or_path="unused"))

    rows = [{"prompt": "What is 2+2?", "completion": "4"}, {"prompt": "What is 3+3?", "completion": " 6"},
            {"prompt": "What is 4+4?\n", "completion": "8"}, {"prompt": "What is 15+15?", "completion": "30"},
            {"prompt": "Sum:\t", "completion": "9"}]
    fix = ("TRL joins them as written. Fix: end the prompts with a separator (a space or a newline), or use a chat "
           "model's conversational format (prompt and completion as lists of chat turns)")
    warned = kinds.load("sft").check_data(cfg("mem-joined"), (datasets.Dataset.from_list(rows), None), None)
    assert warned == ["2 of 5 rows of the `train` split: the prompt ends and the completion starts without a space "
                      "or newline, so the model learns 'What is 2+2?4' (first: mem-joined (train split), row 1): "
                      + fix]
    train, test = datasets.Dataset.from_list(rows[1:3]), datasets.Dataset.from_list(rows[3:4])
    assert kinds.load("sft").check_data(cfg("mem-split"), (train, test), None) == [
        "1 of 1 rows of the `test` split: the prompt ends and the completion starts without a space or newline, so "
        "the model learns '...at is 15+15?30' (first: mem-split (test split), row 1): " + fix]
    chat = [{"prompt": [{"role": "user", "content": "What is 2+2?"}],
             "completion": [{"role": "assistant", "content": "4"}]}] * 2
    assert kinds.load("sft").check_data(cfg("mem-chat"), (datasets.Dataset.from_list(chat), None), None) == []

    pairs = [{"prompt": "2 + 3 =", "chosen": " 5", "rejected": " 6"}, {"prompt": "2 + 4 =", "chosen": "6",
                                                                      "rejected": " 7"}]
    assert kinds.load("dpo").check_data(cfg("mem-pairs"), (datasets.Dataset.from_list(pairs), None), None) == [
        "1 of 2 rows of the `train` split: the prompt ends and the answer starts without a space or newline, so the "
        "model learns '2 + 4 =6' (first: mem-pairs (train split), row 2): " + fix]
    labelled = [{"prompt": "2 + 3 =", "completion": "5", "label": True},
                {"prompt": "2 + 4 =", "completion": " 7", "label": False}]
    assert kinds.load("kto").check_data(cfg("mem-labelled"), (datasets.Dataset.from_list(labelled), None), None) == [
        "1 of 2 rows of the `train` split: the prompt ends and the completion starts without a space or newline, so "
        "the model learns '2 + 3 =5' (first: mem-labelled (train split), row 1): " + fix]


@pytest.mark.parametrize("prompt, completion", [
    ("Hello", ", how are you?"),  # punctuation written against the text before it
    ("The dog", "'s bone"),
    ("(see the note", ")"),
    ("[INST] What is 2+2? [/INST]", "4"),  # Mistral's rendered generation prompt: its template puts the answer there
    ("<｜User｜>What is 2+2?<｜Assistant｜>", "4"),  # DeepSeek's
    ("<|user|>What is 2+2?<|assistant|>", "4"),
    ("2加2等于几？", "等于4。"),  # a script written without spaces
])
def test_a_join_that_is_how_the_text_is_written_is_not_warned(prompt, completion):
    """The joined-text warning is for two words glued together ("What is 2+2?" + "4"); a completion that starts with
    punctuation, a prompt rendered by a chat template up to its generation prompt, and Chinese text join as they are
    meant to, and a warning on every row of such a dataset would teach users to ignore it."""
    import datasets

    from fsdp_recipes.data import row_checks

    ds = datasets.Dataset.from_list([{"prompt": prompt, "completion": completion}])
    assert row_checks.joined_without_separator(ds, "mem", "train", ("completion",)) == []
    glued = datasets.Dataset.from_list([{"prompt": "What is 2+2?", "completion": "4"}])
    assert len(row_checks.joined_without_separator(glued, "mem", "train", ("completion",))) == 1


def test_the_column_error_suggests_the_files_own_columns(tmp_path):
    """Trial: a CSV whose only column is `joke` was told `e.g. prompt_completion prompt=question completion=answer`;
    one text column is a text field (the declaration the line gives reads it), two are prompt and completion."""
    jokes = tmp_path / "jokes.csv"
    jokes.write_text("joke\nUbuntu users are apt to get this joke.\n\"A second one, with a comma.\"\n")
    with pytest.raises(UserError) as err:
        load(jokes)
    assert str(err.value).endswith("Fix: train on the text of `joke`: `dataset_format: text text=joke` in the recipe "
                                   "(on the command line --dataset_format \"text text=joke\"), or dataset_text_field: "
                                   "joke; the other formats: docs/training.md#dataset-formats.")
    train, _ = load(jokes, "text text=joke")  # the suggestion works as written
    assert train.column_names == ["text"] and train[0]["text"].startswith("Ubuntu")
    qa = write_jsonl(tmp_path / "qa.jsonl", [{"q": "2 + 3?", "a": "5", "n": 1}])
    with pytest.raises(UserError, match=r"Fix: name your columns with `dataset_format:` \(e.g. `prompt_completion "
                                        r"prompt=q completion=a`"):
        load(qa)
