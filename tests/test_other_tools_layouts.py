"""The layouts other tools write (data/chat.py, data/formats/, data/rows.py, data/chat_render.py): LLaMA-Factory's and
OpenAI's variants of the chat layouts, a JSON array in a .jsonl or .json file, numbers where text goes. Each is
converted as the tool that writes it means it (the rows it becomes written here by hand), or refused in one line
naming the file and the line or row (from 1) with a fix that works when followed. In-process: the data room's
loading and checks, and `make data` (launch/data_preview.py) on the tiny recipe."""

import json

import pytest
from conftest import REPO
from test_bad_input import assert_one_line_error
from test_data_lengths import preview
from trl import DatasetMixtureConfig, ScriptArguments
from trl.scripts.utils import DatasetConfig

from fsdp_recipes.config.run_config import PackArguments
from fsdp_recipes.data import formats, lengths, loading, recipe_tokenizer
from fsdp_recipes.data.tokenizing import Truncation
from fsdp_recipes.errors import UserError


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load(path, fmt=None):
    train, _ = loading.load_sft_datasets(ScriptArguments(dataset_name=str(path)), DatasetMixtureConfig(), False,
                                         pack=PackArguments(dataset_format=fmt))
    return train


def checked(path, fmt=None):
    """The rows as converted, and the launcher's row checks' warnings."""
    train = load(path, fmt)
    return train, formats.check_rows(train, str(path), "train")


def refusal(path, fmt=None) -> str:
    with pytest.raises(UserError) as err:
        checked(path, fmt)
    line = str(err.value)
    assert "\n" not in line and "Fix:" in line, line
    return line


WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


# ------------------------------------------------------------------------------------------------ LLaMA-Factory

def test_llama_factorys_system_column_is_the_conversations_system_turn(tmp_path):
    """LLaMA-Factory's sharegpt `system` column: the system turn, unless the conversation opens with its own."""
    rows = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}],
             "system": "Be brief."},
            {"conversations": [{"from": "system", "value": "Inner."}, {"from": "human", "value": "Hi"},
                               {"from": "gpt", "value": "Hello"}], "system": "Outer."},
            {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}], "system": ""}]
    train, warned = checked(write_jsonl(tmp_path / "lf.jsonl", rows))
    assert train.column_names == ["messages"] and warned == []
    assert train.to_list() == [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"}]},
        {"messages": [{"role": "system", "content": "Inner."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    assert loading.NOTES[0].startswith(f"data {tmp_path / 'lf.jsonl'}: ShareGPT (conversations, system) -> messages")


def test_llama_factorys_function_call_and_observation_turns_with_a_tools_column(tmp_path):
    """A `function_call` turn is the assistant's tool call (its value the call's JSON), `observation` its result,
    `tools` a JSON string of bare schemas: TRL's messages with tool_calls and a tools column."""
    rows = [{"conversations": [{"from": "human", "value": "Weather in Paris?"},
                               {"from": "function_call",
                                "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
                               {"from": "observation", "value": "18C"},
                               {"from": "gpt", "value": "18C in Paris."}],
             "tools": json.dumps([WEATHER])}]
    train, warned = checked(write_jsonl(tmp_path / "lf.jsonl", rows))
    assert warned == [] and sorted(train.column_names) == ["messages", "tools"]
    assert train[0]["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18C"},
        {"role": "assistant", "content": "18C in Paris."}]
    assert train[0]["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_a_function_call_that_is_not_a_call_is_one_line_and_its_fix_works(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "Weather?"}, {"from": "function_call", "value": "sunny"},
                               {"from": "gpt", "value": "Sunny."}]}]
    line = refusal(write_jsonl(tmp_path / "lf.jsonl", [rows[0], rows[0]]))
    assert line.startswith(f"{tmp_path / 'lf.jsonl'}:1: turn 2 is a function_call whose value 'sunny' is not the "
                           "JSON of a call. Fix: "), line
    # followed: `function_call=assistant` keeps the value as the assistant's text
    train, _ = checked(tmp_path / "lf.jsonl", "sharegpt function_call=assistant")
    assert train[0]["messages"][1] == {"role": "assistant", "content": "sunny"}


def test_alpacas_system_and_history_columns(tmp_path):
    """LLaMA-Factory's alpaca: `system` the system turn, `history` the turns before the row's own."""
    rows = [{"instruction": "And 2 + 2?", "input": "", "output": "4", "system": "Answer with digits.",
             "history": [["What is 1 + 1?", "2"]]}]
    train, _ = checked(write_jsonl(tmp_path / "alpaca.jsonl", rows))
    assert train.to_list() == [{
        "prompt": [{"role": "system", "content": "Answer with digits."}, {"role": "user", "content": "What is 1 + 1?"},
                   {"role": "assistant", "content": "2"}, {"role": "user", "content": "And 2 + 2?"}],
        "completion": [{"role": "assistant", "content": "4"}]}]


# ------------------------------------------------------------------------------------------------ OpenAI

def openai_tool_row():
    return {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "assistant", "content": "18C in Paris."}],
        "tools": [{"type": "function", "function": WEATHER}]}


def test_openai_tool_calls_become_what_transformers_templates_take(tmp_path, cache_dir):
    """OpenAI writes arguments as a JSON string and content null beside the calls; transformers' templates take the
    arguments as an object (a string is rendered quoted), and a template adding text to null content fails."""
    train, warned = checked(write_jsonl(tmp_path / "oa.jsonl", [openai_tool_row()]))
    assert warned == []
    assert train[0]["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert train[0]["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "18C"}
    assert train[0]["tools"] == [{"type": "function", "function": WEATHER}]
    # rendered as TRL renders it (the row's tools passed): the call's arguments an object, not a quoted string
    from fsdp_recipes.data.tokenizing import Batch

    template = ("{% for m in messages %}{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
                "call {{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}|{% endfor %}"
                "{% if tools %}tools {{ tools | map(attribute='function') | map(attribute='name') | join(',') }}"
                "{% endif %}")
    batch = Batch(tiny_tokenizer(), template)
    ref = batch.chat(train[0]["messages"], train[0])
    assert batch.texts[True][ref[1]] == ('user:Weather in Paris?|assistant:call get_weather{"city": "Paris"}|'
                                         'tool:18C|assistant:18C in Paris.|tools get_weather')


def test_openais_legacy_function_call_is_the_turns_tool_call(tmp_path):
    row = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                        {"role": "assistant", "content": None,
                         "function_call": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                        {"role": "function", "name": "get_weather", "content": "18C"},
                        {"role": "assistant", "content": "18C in Paris."}]}
    train, _ = checked(write_jsonl(tmp_path / "oa.jsonl", [row]), "messages function=tool")
    assert train[0]["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert train[0]["messages"][2] == {"role": "tool", "name": "get_weather", "content": "18C"}


def test_arguments_that_are_not_a_json_object_are_one_line(tmp_path):
    row = openai_tool_row()
    row["messages"][1]["tool_calls"][0]["function"]["arguments"] = "city=Paris"
    line = refusal(write_jsonl(tmp_path / "oa.jsonl", [openai_tool_row(), row]))
    assert line.startswith(f"{tmp_path / 'oa.jsonl'}:2: turn 2's call of 'get_weather' has arguments 'city=Paris', "
                           "not a JSON object. Fix: write them as one"), line


# ------------------------------------------------------------------------------------------------ turn orders

STRICT = ("{{ bos_token }}{% for message in messages %}"  # Mistral's v0.1 template: roles alternate, user first
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
          "{% elif message['role'] == 'assistant' %} {{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def tiny_tokenizer():
    import os
    from pathlib import Path

    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(os.environ["FSDP_RECIPES_CACHE"]) / "tiny-mistral")


def turns(*roles):
    return {"messages": [{"role": r, "content": f"{r} {i}"} for i, r in enumerate(roles)]}


def merged(first: str, second: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": f"{first}\n\n{second}"}, {"role": "assistant",
                                                                               "content": answer}]}


@pytest.mark.parametrize("bad, fix, fixed", [
    (turns("user", "user", "assistant"), "merge its consecutive user turns (1 and 2) into one turn",
     merged("user 0", "user 1", "assistant 2")),
    (turns("user", "system", "assistant"), "move its system turn (2) to the start (or fold it into the next user "
                                           "turn)", merged("user 0", "system 1", "assistant 2")),
    (turns("system", "user", "assistant"), "fold its system turn into the first user turn (the template takes none)",
     merged("system 0", "user 1", "assistant 2")),
], ids=["two-users", "system-not-first", "system-refused"])
def test_a_strict_template_refusing_a_row_names_its_file_and_line(tmp_path, cache_dir, bad, fix, fixed):
    good = turns("user", "assistant")
    path = write_jsonl(tmp_path / "chat.jsonl", [good, good, bad, good, bad])
    train = load(path)
    tok = tiny_tokenizer()
    with pytest.raises(UserError) as err:
        lengths.measure(train, tok, "train", Truncation(64), STRICT, where=str(path))
    line = str(err.value)
    roles = ", ".join(t["role"] for t in bad["messages"])
    assert line == (f"{path}:3: the chat template refuses this row ({roles}): TemplateError: Conversation roles must "
                    f"alternate user/assistant/user/assistant/...; 1 more row has these turns. Fix: {fix}, or remove "
                    "the row; or set chat_template_path to a template that renders this order."), line
    # followed, every row renders
    done = load(write_jsonl(tmp_path / "fixed.jsonl", [good, good, fixed, good, fixed]))
    assert lengths.measure(done, tok, "train", Truncation(64), STRICT, where=str(tmp_path / "fixed.jsonl")).rows == 5


def test_make_data_names_the_row_a_template_refuses_not_a_template_error_while_previewing(tmp_path, cache_dir,
                                                                                          capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    template = tmp_path / "strict.jinja"
    template.write_text(STRICT)
    path = write_jsonl(tmp_path / "chat.jsonl", [turns("user", "assistant")] * 3 + [turns("user", "user",
                                                                                          "assistant")])
    res = preview(["tiny-cpu-lora", "--dataset_name", path, "--chat_template_path", template], capsys)
    assert_one_line_error(res, f"{path}:4: the chat template refuses this row (user, user, assistant): "
                               "TemplateError: Conversation roles must alternate")
    assert "while previewing" not in res.stderr


def test_a_conversation_that_ends_on_a_user_turn_is_a_warning_with_its_line(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [turns("user", "assistant"), turns("user", "assistant", "user")])
    _, warned = checked(path)
    assert warned == [f"1 of 2 rows of the `train` split end on a user turn that nothing answers (first: {path}:2): "
                      "unless assistant_only_loss, the model learns to write it. Fix: drop the last turn of those "
                      "rows, or assistant_only_loss: true"]


def test_rows_that_answer_nothing_are_one_counted_warning_with_the_first_ones_line(tmp_path):
    """A row with no assistant turn, and one whose only assistant turn is empty (`"content": ""`, which still trains
    its end-of-turn token: it was not counted), are the same warning."""
    empty = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [turns("user", "assistant"), turns("user"), empty,
                                                 turns("user", "assistant")])
    _, warned = checked(path)
    assert warned == [f"2 of 4 rows of the `train` split have no assistant turn (or only empty ones; first: "
                      f"{path}:2): they teach no answer, and an empty one still trains its end-of-turn token (the "
                      "model learns to say nothing). Fix: fill in or drop those rows"]


def test_an_empty_conversation_is_one_line_with_its_line(tmp_path):
    """`"messages": []` was counted as a row without an assistant turn, then the token-length check (launcher and
    make data) stopped on the chat template's "Cannot apply chat template to an empty conversation" as an internal
    error, and TRL would in every rank."""
    path = write_jsonl(tmp_path / "chat.jsonl", [turns("user", "assistant"), {"messages": []}])
    assert refusal(path) == f"{path}:2: `messages` holds no turns. Fix: give the row its turns, or remove the row."


# ------------------------------------------------------------------------------------------------ files and types

@pytest.mark.parametrize("name", ["array.jsonl", "array.json"])
def test_a_json_array_is_read_and_its_rows_named_by_their_place_in_it(tmp_path, name):
    path = tmp_path / name
    path.write_text(json.dumps([{"prompt": "1 + 1 =", "completion": "2"}, {"prompt": "2 + 2 =", "completion": "4"}],
                               indent=1))
    train, _ = checked(path)
    assert train.to_list() == [{"prompt": "1 + 1 =", "completion": "2"}, {"prompt": "2 + 2 =", "completion": "4"}]
    path.write_text(json.dumps([{"prompt": "1 + 1 =", "completion": "2"}, {"prompt": "2 + 2 =", "completion": None}]))
    line = refusal(path)
    assert line.startswith(f"{path}, row 2 of its JSON array: `completion` is missing"), line


def test_a_malformed_json_array_is_named_by_its_line(tmp_path):
    path = tmp_path / "array.jsonl"
    path.write_text('[{"prompt": "1 + 1 =", "completion": "2"},\n {"prompt": "2 + 2 =", "completion": "4"}\n'
                    ' {"prompt": "3 + 3 =", "completion": "6"}]\n')
    with pytest.raises(UserError) as err:
        load(path)
    assert str(err.value) == (f"malformed JSON in the dataset: {path}:3: Expecting ',' delimiter (column 2) of its "
                              "JSON array. Fix: correct the array there (or write one JSON object per line).")


def test_csv_cells_are_read_as_the_text_they_are(tmp_path):
    """pandas' guess made `2` an integer, `007` 7 and `6.50` 6.5: a CSV has no types, so every cell is text; a column
    of true and false stays a label."""
    path = tmp_path / "qa.csv"
    path.write_text('prompt,completion,label\nWhat is 1 + 1?,2,true\n"What is\n3 + 4?",007,False\nHalf of 13?,6.50,'
                    'TRUE\n')
    ds = loading.load_local(path)["train"]
    assert ds.to_list() == [{"prompt": "What is 1 + 1?", "completion": "2", "label": True},
                            {"prompt": "What is\n3 + 4?", "completion": "007", "label": False},
                            {"prompt": "Half of 13?", "completion": "6.50", "label": True}]
    train, _ = checked(path, "prompt_completion")
    assert train["completion"] == ["2", "007", "6.50"]
    mixture = DatasetMixtureConfig(datasets=[DatasetConfig(path="csv", data_files=str(path))])  # a source too
    train, _ = loading.load_sft_datasets(ScriptArguments(dataset_name=None), mixture, False,
                                         pack=PackArguments(dataset_format="prompt_completion"))  # label: not trained
    assert train["completion"] == ["2", "007", "6.50"]
    path.write_text('prompt,completion\nWhat is 1 + 1?,2\n"What is\n3 + 4?",\n')  # the second row's answer empty
    line = refusal(path)
    assert line.startswith(f"{path}:3: `completion` is missing"), line  # its line: the quoted cell spans two


def test_a_json_number_where_text_goes_is_one_line_whose_fix_works(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"prompt": "What is 1 + 1?", "completion": "2"},
                                               {"prompt": "What is 2 + 2?", "completion": 4}])
    line = refusal(path)
    assert line == (f"{path}:2: `completion` is the number 4, not text. Fix: write it as text in the file, "
                    "\"completion\": \"4\".")
    write_jsonl(path, [{"prompt": "What is 1 + 1?", "completion": "2"}, {"prompt": "What is 2 + 2?",
                                                                         "completion": "4"}])
    assert checked(path)[0]["completion"] == ["2", "4"]
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "What is 2 + 2?", "chosen": "4", "rejected": 5}])
    train, _ = loading.load_splits(ScriptArguments(dataset_name=str(pairs)), DatasetMixtureConfig(), False,
                                   lambda ds, where: None, PackArguments())  # loaded as DPO loads them
    with pytest.raises(UserError) as err:
        formats.check_rows(train, str(pairs), "train")
    assert str(err.value) == (f"{pairs}:1: `rejected` is the number 5, not text. Fix: write it as text in the file, "
                              "\"rejected\": \"5\".")
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "What is 2 + 2?", "output": 4}])
    assert refusal(alpaca) == (f"{alpaca}:1: Alpaca's `output` is the number 4, not text. Fix: write it as text in "
                               "the file, \"output\": \"4\".")


def test_trls_sft_trainer_takes_the_converted_tool_rows_as_the_lengths_measure_them(tmp_path, cache_dir):
    """The rows LLaMA-Factory's and OpenAI's tool files become are what TRL's SFTTrainer prepares (its own
    _prepare_dataset, called without a model), token for token as the launcher's lengths measure them."""
    import types

    from trl import SFTConfig, SFTTrainer

    lf = {"conversations": [{"from": "human", "value": "Weather in Paris?"},
                            {"from": "function_call",
                             "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
                            {"from": "observation", "value": "18C"}, {"from": "gpt", "value": "18C in Paris."}],
          "system": "You call tools.", "tools": json.dumps([WEATHER])}
    template = tmp_path / "tools.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}"
                        "call {{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}"
                        "{% if tools %}tools: {{ tools | tojson }}{% endif %}{{ eos_token }}")
    tok = tiny_tokenizer()
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_length=None, use_cpu=True, report_to="none",
                     chat_template_path=str(template))
    chat_template = recipe_tokenizer.chat_template(tok, args)
    for name, rows in (("lf.jsonl", [lf, lf]), ("oa.jsonl", [openai_tool_row()] * 2)):
        ds = load(write_jsonl(tmp_path / name, rows))
        trainer = types.SimpleNamespace(_tokenizer=tok, chat_template=chat_template, _is_vlm=False,
                                        completion_only_loss=False)
        prepared = SFTTrainer._prepare_dataset(trainer, ds, tok, args, False, None, "train")
        text = tok.decode(prepared["input_ids"][0])
        assert 'call get_weather{"city": "Paris"}' in text and '"name": "get_weather"' in text, text
        m = lengths.measure(ds, tok, "train", Truncation(None), chat_template, where=str(tmp_path / name))
        assert m.whole == [len(ids) for ids in prepared["input_ids"]]
