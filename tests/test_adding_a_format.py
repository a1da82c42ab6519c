"""Adding a data format (docs/architecture.md "Adding a data format"): a format is one module, registered by
data/formats/__init__.py's DataFormat.from_module. A made-up layout registered here is detected, declared, converted,
checked with file and line, and measured through the path the pack's own formats take (the launcher's checks run in
this process, `checks` and `launcher_until_ranks`, on copies of the tiny recipe); a module that lacks a member fails
when it is registered, naming the member."""

import json
from types import ModuleType

import pytest
from conftest import RanksWouldStart, launcher_until_ranks
from recipe_variant import recipe_variant
from test_bad_input import assert_one_line_error
from trl import DatasetMixtureConfig, ScriptArguments

from fsdp_recipes.config.run_config import PackArguments
from fsdp_recipes.data import formats, loading
from fsdp_recipes.data.rows import row_at
from fsdp_recipes.errors import UserError


def qa_module() -> ModuleType:
    """A layout no real format has: {"q": ..., "a": ...}, converted to a chat prompt + completion; its own check:
    every question ends with a question mark."""
    module = ModuleType("fsdp_recipes.data.formats.qa_pairs")
    module.LABEL = "question/answer"
    module.COLUMNS = ("q", "a")
    module.HELP = '{"q": ..., "a": ...}'
    module.ORDER = 90
    module.LAYOUT = "prompt_completion"
    module.BECOMES = "chat prompt + completion"

    def convert(ds, spec, at, text_field="text"):
        q, a = spec.column("q"), spec.column("a")

        def chat(row, i):
            if not isinstance(row[a], str) or not row[a].strip():
                raise UserError(f"{at(i)}: the answer `{a}` is empty. Fix: give the row its answer, or remove it.")
            return {"prompt": [{"role": "user", "content": row[q]}],
                    "completion": [{"role": "assistant", "content": row[a]}]}

        return ds.map(chat, with_indices=True, remove_columns=[q, a])

    def check_rows(ds, where, split):
        for i, row in enumerate(ds):
            if not row["prompt"][-1]["content"].rstrip().endswith("?"):
                raise UserError(f"{row_at(where, split, i)}: the question does not end with `?`. Fix: ask it as a "
                                "question, or remove the row.")
        return []

    module.convert, module.check_rows = convert, check_rows
    return module


@pytest.fixture
def qa_registered(monkeypatch):
    """qa_pairs in the registry for one test (the registry is restored after it)."""
    monkeypatch.setattr(formats, "FORMATS", dict(formats.FORMATS))
    return formats.register(formats.DataFormat.from_module("qa_pairs", qa_module()))


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


QA = [{"q": f"What is {i} + 1?", "a": str(i + 1)} for i in range(6)]


def load(path, fmt=None):
    return loading.load_sft_datasets(ScriptArguments(dataset_name=str(path)), DatasetMixtureConfig(), False,
                                     pack=PackArguments(dataset_format=fmt))[0]


def test_a_new_format_is_detected_declared_and_converted(tmp_path, qa_registered):
    path = write_jsonl(tmp_path / "qa.jsonl", QA)
    train = load(path)
    assert train[0] == {"prompt": [{"role": "user", "content": "What is 0 + 1?"}],
                        "completion": [{"role": "assistant", "content": "1"}]}
    assert loading.NOTES[0] == (f"data {path}: question/answer (q, a) -> chat prompt + completion (detected; declare "
                                "it with `dataset_format: qa_pairs`)")
    renamed = write_jsonl(tmp_path / "named.jsonl", [{"question": r["q"], "answer": r["a"]} for r in QA])
    train = load(renamed, "qa_pairs q=question a=answer")
    assert train[1]["completion"] == [{"role": "assistant", "content": "2"}]
    assert loading.NOTES[0].endswith("; question as q; answer as a (declared by dataset_format)")
    assert formats.names()[-1] == "qa_pairs" and formats.layout(qa_registered).name == "prompt_completion"


def test_a_new_formats_conversion_names_the_row(tmp_path, qa_registered):
    path = write_jsonl(tmp_path / "qa.jsonl", [QA[0], {"q": "What is 2 + 2?", "a": " "}])
    with pytest.raises(UserError, match=f"{path}:2: the answer `a` is empty"):
        load(path)


def test_the_launcher_checks_and_measures_a_new_format(tmp_path, qa_registered, checks, cache_dir, monkeypatch,
                                                       capsys):
    """The launcher's checks: the format's line, its own row check with the file and line (the SFT kind's
    check_data asks formats.check_rows), and the lengths table of the layout it becomes."""
    good = write_jsonl(tmp_path / "qa-good" / "train.jsonl", QA)
    with pytest.raises(RanksWouldStart):
        launcher_until_ranks([str(recipe_variant(tmp_path, "good-recipe", dataset_name=str(good.parent),
                                                 eval_strategy="no"))], monkeypatch, capsys)
    out = capsys.readouterr().out.splitlines()
    assert f"[launch] data {good.parent}: question/answer (q, a) -> chat prompt + completion (detected; declare it " \
           "with `dataset_format: qa_pairs`)" in out
    header = next(i for i, line in enumerate(out) if line.startswith("[launch] token lengths under"))
    assert out[header + 1].split()[1:5] == ["split", "rows", "prompt", "answer"]
    bad = write_jsonl(tmp_path / "qa-bad" / "train.jsonl", [*QA[:3], {"q": "Say 5", "a": "5"}])
    res = checks([recipe_variant(tmp_path, "bad-recipe", dataset_name=str(bad.parent), eval_strategy="no")])
    assert_one_line_error(res, f"{bad}:4: the question does not end with `?`")


def test_a_format_lacking_a_member_fails_when_it_is_registered(monkeypatch):
    monkeypatch.setattr(formats, "FORMATS", dict(formats.FORMATS))
    module = qa_module()
    del module.check_rows
    with pytest.raises(TypeError, match=r"data format qa_pairs \(fsdp_recipes.data.formats.qa_pairs\) lacks "
                                        r"check_rows"):
        formats.DataFormat.from_module("qa_pairs", module)
    module = qa_module()  # a layout TRL takes as it is says how its rows are measured
    del module.LAYOUT
    with pytest.raises(TypeError, match=r"data format qa_pairs .* lacks ANSWERS"):
        formats.DataFormat.from_module("qa_pairs", module)
    module = qa_module()
    module.LAYOUT = "qa"
    with pytest.raises(TypeError, match=r"data format qa_pairs: LAYOUT 'qa' is not a registered layout"):
        formats.register(formats.DataFormat.from_module("qa_pairs", module))
    assert "qa_pairs" not in formats.FORMATS


def test_every_format_module_is_registered_with_its_members():
    """The registry is the folder: one module each, none left out, each with its layout's measuring members."""
    import pkgutil

    modules = {m.name for m in pkgutil.iter_modules(formats.__path__) if not m.name.startswith("_")}
    assert set(formats.names()) == modules
    for fmt in formats.FORMATS.values():
        layout = formats.layout(fmt)
        assert not layout.LAYOUT and layout.ANSWERS and callable(layout.plan_row), fmt.name
