"""Splits that tell the truth (data/loading.py held_out, launch/summary.py): an eval split found by its usual names
or carved off with eval_split_size (seeded, in run_args.json), never a training row called held out, eval rows that
are training rows too counted; the summary scores `messages` data and plain-text prompt/completion and writes
sample_generations.json for them. In process: the loading, the launcher's checks and the summary with its
generations replaced by a stand-in (no model is loaded)."""

import dataclasses
import json

import pytest
from conftest import RanksWouldStart, launcher_until_ranks
from recipe_variant import recipe_variant
from test_bad_input import assert_one_line_error
from trl import DatasetMixtureConfig, ScriptArguments

from fsdp_recipes.config.run_config import PackArguments
from fsdp_recipes.data import formats, loading
from fsdp_recipes.data.rows import row_at
from fsdp_recipes.errors import UserError
from fsdp_recipes.evaluation import scoring
from fsdp_recipes.launch import summary


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat(i):
    return {"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                         {"role": "assistant", "content": str(i + 1)}]}


def load(name, want_eval=True, seed=42, **pack):
    script = ScriptArguments(dataset_name=str(name))
    train, ev = loading.load_sft_datasets(script, DatasetMixtureConfig(), want_eval, pack=PackArguments(**pack),
                                          seed=seed)
    return train, ev, script


@pytest.mark.parametrize("file, split", [("validation", "validation"), ("dev", "validation"), ("eval", "test")])
def test_an_eval_split_is_found_by_its_usual_names(tmp_path, file, split):
    """datasets reads dev.jsonl as the `validation` split and eval.jsonl as `test` (its SPLIT_KEYWORDS)."""
    write_jsonl(tmp_path / "train.jsonl", [chat(i) for i in range(6)])
    write_jsonl(tmp_path / f"{file}.jsonl", [chat(i) for i in range(10, 13)])
    train, ev, script = load(tmp_path)
    assert (len(train), len(ev)) == (6, 3) and script.dataset_test_split == split  # so run_args.json says which
    named = "" if file == split else f"{file}.jsonl, "
    assert loading.NOTES[-1] == f"eval split: the `{split}` split ({named}3 rows)"
    assert loading.WARNINGS == []
    assert row_at(str(tmp_path), split, 1) == f"{tmp_path / file}.jsonl:2"


@pytest.mark.parametrize("suffix, opener", [(".jsonl.gz", "gzip"), (".json.bz2", "bz2"), (".csv.xz", "lzma")])
def test_a_compressed_file_is_read_as_datasets_reads_it(tmp_path, suffix, opener):
    """A file as packages ship data (HumanEval.jsonl.gz): datasets decompresses it by its extension; the pack once
    refused it as `not a .json, .jsonl, .parquet or .csv file`."""
    import importlib

    rows = [{"prompt": f"What is {i} + 1?", "completion": str(i + 1)} for i in range(8)]
    text = ("prompt,completion\n" + "".join(f"{r['prompt']},{r['completion']}\n" for r in rows)
            if suffix.startswith(".csv") else "".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / f"qa{suffix}"
    with importlib.import_module(opener).open(path, "wt") as f:
        f.write(text)
    train, ev, _ = load(path, eval_split_size=2)
    assert (len(train), len(ev)) == (6, 2)
    assert {str(r["completion"]) for r in [*train, *ev]} == {str(i + 1) for i in range(8)}
    (tmp_path / "qa.jsonl.rar").write_text("")
    with pytest.raises(UserError, match="cannot read .*qa.jsonl.rar: use a .json, .jsonl, .parquet or .csv file"):
        load(tmp_path / "qa.jsonl.rar")


def test_a_split_named_otherwise_is_still_one_line(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [chat(i) for i in range(6)])
    write_jsonl(tmp_path / "validation.jsonl", [chat(i) for i in range(10, 13)])
    with pytest.raises(UserError, match="no `test_sft` split"):  # a name the recipe chose is not guessed at
        loading.load_sft_datasets(ScriptArguments(dataset_name=str(tmp_path), dataset_test_split="test_sft"),
                                  DatasetMixtureConfig(), True)


def test_a_named_eval_split_the_data_lacks_is_refused_naming_the_splits_it_has(tmp_path):
    """Trial: `--dataset_test_split validation` on a folder of train.jsonl and test.jsonl said `eval split: none in
    ... (looked for test, validation, ...)` although test was there, and trained with no held-out rows; a wrong
    dataset_train_split was already one line naming the splits. The default `test` keeps its quiet lookup."""
    folder = tmp_path / "capitals"
    write_jsonl(folder / "train.jsonl", [chat(i) for i in range(6)])
    write_jsonl(folder / "test.jsonl", [chat(i) for i in range(10, 13)])
    script = ScriptArguments(dataset_name=str(folder), dataset_test_split="validation")
    for want_eval in (True, False, loading.IF_ANY):  # eval on or off, and make data's
        with pytest.raises(UserError) as err:
            loading.load_sft_datasets(script, DatasetMixtureConfig(), want_eval)
        assert str(err.value) == (f"dataset {folder} has no `validation` split, which dataset_test_split names (it has "
                                  "['train', 'test']). Fix: set dataset_test_split to `test` (--dataset_test_split "
                                  "test).")
    with pytest.raises(UserError, match=r"has no `holdout` split, which dataset_test_split names"):  # not carved
        loading.load_sft_datasets(ScriptArguments(dataset_name=str(folder), dataset_test_split="holdout"),
                                  DatasetMixtureConfig(), False, pack=PackArguments(eval_split_size=2))
    train, ev, script = load(folder)  # named none: found as before
    assert (len(train), len(ev), script.dataset_test_split) == (6, 3, "test")
    # data of the training split alone: no split it could mean; eval_split_size carves that name, else none is said
    data = write_jsonl(tmp_path / "alone" / "train.jsonl", [chat(i) for i in range(6)])
    script = ScriptArguments(dataset_name=str(data), dataset_test_split="validation")
    assert loading.load_sft_datasets(script, DatasetMixtureConfig(), False)[1] is None
    assert loading.NOTES[-1].startswith(f"eval split: none in {data} (no `validation` split): nothing is scored")
    with pytest.raises(UserError, match=r"no `validation` split \(it has \['train'\]; a split named otherwise is "
                                        r"not looked for\)"):
        loading.load_sft_datasets(script, DatasetMixtureConfig(), True)
    train, ev = loading.load_sft_datasets(script, DatasetMixtureConfig(), True, pack=PackArguments(eval_split_size=2))
    assert (len(train), len(ev)) == (4, 2)


@pytest.mark.parametrize("size, says", [
    (20, "eval_split_size 20 holds out 20 rows, and `train` in {data} has 10, leaving none to train on. Fix: hold "
         "out at most 9 (eval_split_size 9, or a share such as 0.1), or give the data an eval split of its own (a "
         "validation.jsonl beside train.jsonl)."),
    (0.99, "eval_split_size 0.99 holds out 10 of the 10 rows of `train` in {data}, leaving none to train on. Fix: "
           "hold out at most 9"),
    (10, "eval_split_size 10 holds out 10 of the 10 rows of `train` in {data}, leaving none to train on."),
])
def test_an_eval_split_size_as_large_as_the_data_is_refused_not_capped(tmp_path, size, says):
    """Trial: eval_split_size 20 (or 0.99, or 10) of a 10-row file trained on 1 row and held out 9, without a word."""
    data = write_jsonl(tmp_path / "mine.jsonl", [chat(i) for i in range(10)])
    with pytest.raises(UserError) as err:
        load(data, eval_split_size=size)
    assert str(err.value).startswith(says.format(data=data)), str(err.value)
    assert [len(x) for x in load(data, eval_split_size=9)[:2]] == [1, 9]  # one process: one row is enough


def test_the_held_out_rows_leave_a_training_row_for_each_rank(tmp_path):
    """The job's ranks (the launcher's and make data's config sees the accelerate config's num_processes; a rank's,
    its process group) need a training row each."""
    from types import SimpleNamespace

    data = write_jsonl(tmp_path / "mine.jsonl", [chat(i) for i in range(10)])
    script = ScriptArguments(dataset_name=str(data))
    with pytest.raises(UserError, match=r"eval_split_size 9 holds out 9 of the 10 rows of `train` in .*, leaving 1 to "
                                        r"train on for 2 ranks. Fix: hold out at most 8 \(eval_split_size 8, or a "
                                        r"share such as 0.1; each of the 2 ranks needs a training row\)"):
        loading.load_splits(script, DatasetMixtureConfig(), False, loading.check_columns,
                            PackArguments(eval_split_size=9), ranks=2)
    train, _ = loading.load_splits(script, DatasetMixtureConfig(), False, loading.check_columns,
                                   PackArguments(eval_split_size=8), ranks=2)
    assert len(train) == 2
    assert loading.job_ranks(SimpleNamespace(world_size=4)) == 4 and loading.job_ranks(SimpleNamespace()) == 1


def test_eval_split_size_holds_out_seeded_rows_that_are_never_trained_on(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", [chat(i) for i in range(20)])
    train, ev, _ = load(data, eval_split_size=0.25)
    asked = lambda ds: [r["messages"][0]["content"] for r in ds]  # noqa: E731
    assert (len(train), len(ev)) == (15, 5) and not set(asked(train)) & set(asked(ev))
    assert loading.NOTES[-1] == "eval split: 5 of the 20 rows of `train` held out (eval_split_size 0.25, seed 42)"
    assert asked(load(data, eval_split_size=0.25)[1]) == asked(ev)  # the same rows in every rank and the summary
    assert asked(load(data, eval_split_size=0.25, seed=7)[1]) != asked(ev)
    assert len(load(data, eval_split_size=3)[1]) == 3  # a number of rows
    # held out even where the run evaluates nothing: the summary scores those rows
    train, ev, _ = load(data, want_eval=False, eval_split_size=0.25)
    assert len(train) == 15 and ev is None


def test_a_carved_off_row_is_still_named_by_its_line(tmp_path):
    rows = [chat(i) for i in range(10)]
    rows[7] = {"messages": [{"role": "robot", "content": "hi"}]}
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    text = data.read_text().splitlines()
    data.write_text("\n".join(text[:3] + ["", "   "] + text[3:]) + "\n")  # blank lines move row 7 to line 10
    train, ev, _ = load(data, eval_split_size=0.5)
    for split, ds in (("train", train), ("test", ev)):
        if any(t["role"] == "robot" for r in ds for t in r["messages"]):
            with pytest.raises(UserError, match=f"{data}:10: role 'robot'"):
                formats.check_rows(ds, str(data), split)


def test_eval_split_size_is_recorded_in_run_args(cache_dir):
    from conftest import REPO

    from fsdp_recipes.config.run_config import parse_args

    cfg = parse_args(["--config", str(REPO / "recipes" / "tiny-cpu-lora" / "sft.yaml"), "--eval_split_size", "0.1",
                      "--dataset_format", "messages"])
    resolved = cfg.resolved()
    assert resolved["pack_args"]["eval_split_size"] == 0.1 and resolved["pack_args"]["dataset_format"] == "messages"
    assert resolved["sft_config"]["seed"] == 42  # the seed that chose the rows


def test_no_eval_split_is_one_line_and_eval_rows_in_training_are_counted(tmp_path, cache_dir, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "qa.jsonl", [chat(i) for i in range(6)])
    with pytest.raises(RanksWouldStart):
        launcher_until_ranks([str(recipe_variant(tmp_path, "a", dataset_name=str(data), eval_strategy="no"))],
                             monkeypatch, capsys)
    out = capsys.readouterr().out
    assert ("[launch] eval split: none in " f"{data} (looked for test, validation, valid, eval, dev): nothing is "
            "scored as held out. Fix: eval_split_size: 0.1 holds out 10% of the training rows") in out
    folder = tmp_path / "overlap"
    write_jsonl(folder / "train.jsonl", [chat(i) for i in range(6)])
    write_jsonl(folder / "eval.jsonl", [chat(1), chat(2), chat(30)])
    with pytest.raises(RanksWouldStart):
        launcher_until_ranks([str(recipe_variant(tmp_path, "b", dataset_name=str(folder)))], monkeypatch, capsys)
    out = capsys.readouterr().out
    assert "[launch] eval split: the `test` split (eval.jsonl, 3 rows)" in out
    assert ("[launch] warning: 2 of the 3 eval rows also appear in the training data: their scores are not held "
            "out") in out


def test_eval_on_without_any_eval_split_names_the_way_out(tmp_path, checks):
    data = write_jsonl(tmp_path / "qa.jsonl", [chat(i) for i in range(6)])
    res = checks([recipe_variant(tmp_path, dataset_name=str(data))])
    assert_one_line_error(res, "no `test` split (it has ['train']; also looked for validation, valid, eval, dev)")
    assert "eval_split_size: 0.1" in res.stderr


def fake_run(tmp_path, dataset, **pack):
    """A finished SFT run on `dataset` with a merged model, as far as the summary reads it (no weights)."""
    run = tmp_path / "run"
    (run / "merged").mkdir(parents=True)
    (run / "merged" / "config.json").write_text("{}")
    (run / "run_args.json").write_text(json.dumps({
        "script_args": dataclasses.asdict(ScriptArguments(dataset_name=str(dataset))),
        "dataset_mixture": dataclasses.asdict(DatasetMixtureConfig()),
        "pack_args": dataclasses.asdict(PackArguments(**pack)), "sft_config": {"seed": 42},
        "model_args": {"model_name_or_path": "base-model"}}))
    (run / "metrics.json").write_text(json.dumps({
        "recipe": "mine", "status": "completed", "wall_clock_s": 10.0, "tokens_per_second": None, "mfu": None,
        "mfu_note": "cpu", "peak_memory": {"host_rss_bytes": 2**30}, "sharding_strategy": "FULL_SHARD",
        "fsdp_version": 2, "world_size": 2, "num_nodes": 1, "device": {"type": "cpu", "name": "cpu"}}))
    return run


def stand_in(calls):
    """scoring.score_stage without a model: the trained model answers the sum and has loss 0.5, the base model
    answers 'no' and has loss 2.0; `calls` gets the (prompt, reference) items each stage was given."""
    import math

    def score(model, items, pairs):
        calls.append(items)
        base = model == "base-model"
        asked = [p if isinstance(p, str) else p[-1]["content"] for p, _ in items if p is not None]
        loss = 2.0 if base else 0.5
        return {"loss": {"loss": loss, "perplexity": math.exp(loss), "rows": len(items), "tokens": 3 * len(items),
                         "rows_cut": 0, "max_tokens": 2048},
                "answers": ["no" if base else str(int(q.split()[2].rstrip("?")) + 1) for q in asked],
                "long_answers": 0}
    return score


def summarised(tmp_path, monkeypatch, capsys, data, **fields):
    """The summary of a finished run on `data` (fake_run), its scores a stand-in: (run, calls, its output)."""
    run = fake_run(tmp_path, data, **fields)
    calls = []
    monkeypatch.setattr(scoring, "score_stage", stand_in(calls))
    monkeypatch.setenv(summary.FORCE_ENV, "1")
    assert summary.main([str(run)]) == 0
    return run, calls, capsys.readouterr().out


def test_the_summary_scores_messages_data_by_its_last_assistant_turn(tmp_path, monkeypatch, capsys):
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, *chat(i)["messages"]]} for i in range(8)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    run, calls, out = summarised(tmp_path, monkeypatch, capsys, data, eval_split_size=0.5)
    assert ("exact match on 4 eval prompts: base model 0/4 (0.0-49.0%) -> trained 4/4 (51.0-100.0%): no change "
            "(p=0.12; 0 right only before, 4 only after)") in out  # 4 of 4 discordant rows one way: 2 x 1/16
    assert "held-out loss on 4 eval rows (12 answer tokens): base model 2.000 (perplexity 7.39) -> trained 0.500 " \
           "(perplexity 1.65)" in out
    prompt, reference = calls[0][0]
    assert prompt[0] == {"role": "system", "content": "Be brief."} and len(prompt) == 2  # up to the answer
    assert prompt[1]["content"] == f"What is {int(reference) - 1} + 1?"
    written = json.loads((run / "sample_generations.json").read_text())
    assert written["held_out"] is True and written["split"].startswith("4 of the 8 rows of `train` held out")
    train_rows = [json.loads(line)["messages"][1]["content"] for line in data.read_text().splitlines()]
    held = {ex["prompt"] for ex in written["examples"]}
    assert len(held) == 4 and held <= set(train_rows)
    ev = json.loads((run / "metrics.json").read_text())["eval"]
    assert (ev["prompts"], ev["trained_correct"], ev["eval_rows_in_train"]) == (4, 4, 0)
    assert ev["held_out_loss"]["base"] == 2.0 and ev["held_out_loss"]["trained"] == 0.5


def test_the_reference_is_the_last_assistant_turn_of_a_longer_conversation(tmp_path, monkeypatch, capsys):
    """A conversation of several exchanges, ending on a user turn: the prompt is every turn before the last
    assistant turn, the reference that turn's content."""
    turns = lambda i: [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},  # noqa: E731
                       {"role": "user", "content": f"What is {i} + 1?"}, {"role": "assistant", "content": str(i + 1)},
                       {"role": "user", "content": "Thanks"}]
    write_jsonl(tmp_path / "long" / "train.jsonl", [{"messages": turns(i)} for i in range(4)])
    write_jsonl(tmp_path / "long" / "test.jsonl", [{"messages": turns(i)} for i in (7, 8)])
    run, calls, out = summarised(tmp_path, monkeypatch, capsys, tmp_path / "long")
    assert calls[0] == [(turns(i)[:3], str(i + 1)) for i in (7, 8)]
    assert "exact match on 2 eval prompts: base model 0/2" in out


def test_the_summary_reads_a_carved_alpaca_file_after_the_launchers_checks(tmp_path, monkeypatch, capsys):
    """The launcher checks the data, then summarises, in one process: the summary's load of the whole file once
    named its rows by the checks' carved-off split and failed at the first held-out row (IndexError: list index
    out of range, after a finished run)."""
    rows = [{"instruction": f"What is {i} + 1?", "input": "", "output": str(i + 1)} for i in range(8)]
    data = write_jsonl(tmp_path / "alpaca.jsonl", rows)
    load(data, eval_split_size=0.5)  # the launcher's checks
    run, calls, out = summarised(tmp_path, monkeypatch, capsys, data, eval_split_size=0.5)
    assert "exact match on 4 eval prompts: base model 0/4 (0.0-49.0%) -> trained 4/4" in out


SFT_FORMATS = {  # a row of each SFT format the pack reads, whose reference answer is "5" to "What is 4 + 1?"
    "messages": {"messages": [{"role": "user", "content": "What is 4 + 1?"}, {"role": "assistant", "content": "5"}]},
    "sharegpt": {"conversations": [{"from": "human", "value": "What is 4 + 1?"}, {"from": "gpt", "value": "5"}]},
    "alpaca": {"instruction": "What is 4 + 1?", "input": "", "output": "5"},
    "prompt_completion (chat)": {"prompt": [{"role": "user", "content": "What is 4 + 1?"}],
                                 "completion": [{"role": "assistant", "content": "5"}]},
    "prompt_completion (text)": {"prompt": "What is 4 + 1?", "completion": " 5"},
    "prompt_response": {"prompt": "What is 4 + 1?", "response": " 5"},
}


@pytest.mark.parametrize("fmt", list(SFT_FORMATS))
def test_every_sft_format_is_scored_after_its_conversion(tmp_path, monkeypatch, capsys, fmt):
    folder = tmp_path / "data"
    write_jsonl(folder / "train.jsonl", [SFT_FORMATS[fmt]] * 3)
    write_jsonl(folder / "test.jsonl", [SFT_FORMATS[fmt]] * 2)
    run, calls, out = summarised(tmp_path, monkeypatch, capsys, folder)
    assert len(calls) == 2  # the base and the trained model, each on the eval split's 2 rows
    prompt, reference = calls[0][0]
    asked = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    assert asked == "What is 4 + 1?" and reference.strip() == "5"
    assert "exact match on 2 eval prompts: base model 0/2 (0.0-65.8%) -> trained 2/2 (34.2-100.0%)" in out
    assert "loss on 2 eval rows" in out  # "held-out" where the training rows are others: not these 3 copies
    written = json.loads((run / "sample_generations.json").read_text())
    assert [(ex["expected"], ex["trained"]) for ex in written["examples"]] == [("5", "5")] * 2


def test_the_summary_scores_plain_prompt_completion_and_never_calls_training_rows_held_out(tmp_path, monkeypatch,
                                                                                           capsys):
    data = write_jsonl(tmp_path / "plain.jsonl",
                       [{"prompt": f"What is {i} + 1? ", "completion": f" {i + 1}"} for i in range(5)])
    run, calls, out = summarised(tmp_path, monkeypatch, capsys, data)
    assert "exact match on 5 training prompts (not held out): base model 0/5 (0.0-43.4%) -> trained 5/5" in out
    assert "loss on 5 training rows (not held out) (15 answer tokens): base model 2.000" in out
    assert "held-out loss" not in out
    assert "the data has no eval split (test, validation, valid, eval, dev): these rows were trained on" in out
    assert "eval prompts" not in out
    assert calls[0][0] == ("What is 0 + 1? ", " 1")  # a text prompt, generated from as it is; the completion unstripped
    ev = json.loads((run / "metrics.json").read_text())["eval"]
    assert ev["held_out"] is False and ev["split"].startswith("training rows, not held out")
    assert json.loads((run / "sample_generations.json").read_text())["examples"][0]["expected"] == "1"


def test_text_data_is_scored_by_its_loss_alone(tmp_path, monkeypatch, capsys):
    data = tmp_path / "t"
    write_jsonl(data / "train.jsonl", [{"text": "a b"}] * 3)
    write_jsonl(data / "test.jsonl", [{"text": "c d"}] * 2)
    run, calls, out = summarised(tmp_path, monkeypatch, capsys, data)
    assert calls == [[(None, "c d")] * 2] * 2  # each model: the eval texts, no prompt
    assert "held-out loss on 2 eval rows (6 tokens): base model 2.000 (perplexity 7.39) -> trained 0.500" in out
    assert "exact match not scored: text rows (`text`) have no prompt to answer: the loss is the measure" in out
    written = json.loads((run / "sample_generations.json").read_text())
    assert written["examples"] == [] and written["exact_match"] is False
    ev = json.loads((run / "metrics.json").read_text())["eval"]
    assert ev["base_correct"] is None and ev["held_out_loss"]["trained_perplexity"] == pytest.approx(1.6487, abs=1e-4)


@pytest.mark.parametrize("size", ["-0.1", "2.5"])
def test_an_eval_split_size_that_is_neither_a_share_nor_a_count_is_one_line(tmp_path, checks, size):
    res = checks([recipe_variant(tmp_path), "--eval_split_size", size])
    assert_one_line_error(res, f"eval_split_size is {float(size):g}: give a share of the training rows below 1")


# ---- make serve-check asks the rows the summary scores (serving/engine_check.py)


@pytest.fixture
def tokenizer_folder(cache_dir):
    from fsdp_recipes.assets.tiny_assets import ensure_assets

    return ensure_assets(quiet=True)["model"]


def test_serve_check_asks_the_rows_the_run_held_out(tmp_path, tokenizer_folder):
    """A dataset with no eval split, 4 of its 8 rows carved off by the run: those 4 are asked, not the training
    split (serve-check read the training split whole when the data had no `test` split), each answer stripped as
    the engines' answers are; as many as the run's summary asked (its metrics.json), 128 at most without one."""
    from fsdp_recipes.serving import engine_check

    rows = [chat(i) for i in range(8)]
    for r in rows:
        r["messages"][1]["content"] = f" {r['messages'][1]['content']}\n"  # "5" written as " 5\n"
    run = fake_run(tmp_path, write_jsonl(tmp_path / "qa.jsonl", rows), eval_split_size=4)
    questions, asked, tokens = engine_check.held_out(run, tokenizer_folder)
    assert asked == "4 questions from 4 of the 8 rows of `train` held out (eval_split_size 4, seed 42)"
    assert len(questions) == 4 and tokens == 8  # answers of 1 character: the engines' 8 tokens
    for q in questions:  # each a row of the data, asked as its user turn, its answer expected
        i = int(q["prompt"][-1]["content"].split()[2])
        assert q["prompt"] == rows[i]["messages"][:1] and q["expected"] == str(i + 1)
    trained, _, _ = load(tmp_path / "qa.jsonl", eval_split_size=4)  # what the ranks train on
    assert not {q["prompt"][-1]["content"] for q in questions} & {r["messages"][0]["content"] for r in trained}

    metrics = json.loads((run / "metrics.json").read_text())
    (run / "metrics.json").write_text(json.dumps({**metrics, "eval": {"prompts": 2}}))  # FSDP_RECIPES_SUMMARY_PROMPTS=2
    two, asked, _ = engine_check.held_out(run, tokenizer_folder)
    assert two == questions[:2] and asked.startswith("2 questions from 4 of the 8 rows")  # the first 2 held out


def test_serve_check_refuses_text_prompts_and_long_answers_in_one_line(tmp_path, tokenizer_folder):
    """Its engines answer chat prompts, scored by exact match: plain-text prompts, or answers over 16 tokens (which
    the summary does not score either), are one line. Answers of 9-16 tokens get room to end: their length + 2."""
    from fsdp_recipes.serving import engine_check

    text = write_jsonl(tmp_path / "text" / "train.jsonl", [{"prompt": f"{i} + 1 =", "completion": str(i + 1)}
                                                            for i in range(4)])
    write_jsonl(tmp_path / "text" / "test.jsonl", [{"prompt": "7 + 1 =", "completion": "8"}])
    with pytest.raises(UserError, match=r"asks chat questions, and the rows .* is scored on \(the `test` split.*\) "
                                        r"hold plain-text prompts\. Fix: .*make gguf RUN="):
        engine_check.held_out(fake_run(tmp_path / "a", text.parent), tokenizer_folder)

    def answered(answer: str) -> list[dict]:  # the tiny tokenizer: one token per character here
        return [{"messages": [{"role": "user", "content": f"Spell {i}."}, {"role": "assistant", "content": answer}]}
                for i in range(8)]

    long = write_jsonl(tmp_path / "long.jsonl", answered("one two three four"))  # 18 tokens
    with pytest.raises(UserError, match=r"scores answers of up to 16 tokens by exact match, as the summary does, "
                                        r"and the reference answers of .* run to 18\. Fix: .*make gguf RUN="):
        engine_check.held_out(fake_run(tmp_path / "b", long, eval_split_size=4), tokenizer_folder)
    eleven = write_jsonl(tmp_path / "eleven.jsonl", answered("12345678901"))  # 11 tokens
    assert engine_check.held_out(fake_run(tmp_path / "c", eleven, eval_split_size=4), tokenizer_folder)[2] == 13
