"""Token lengths (data/lengths.py, data/length_report.py) and `make data` (launch/data_preview.py): the statistics
worked out by hand on rows whose tokens are known under the tiny recipe's tokenizer, the max_length that keeps 99% of
rows whole, the one warning where max_length cuts answers, the launcher's table, and the preview's output. In this
process, nothing trains; one test runs `make data` itself.

Under the tiny tokenizer (assets/tiny_assets.py: digits are single tokens; the chat template renders
`<s>[INST] {user} [/INST] {assistant}</s>`) the question "What is 1 + 1?" is a 13-token prompt
(<s> [INST] Ġ What Ġis Ġ 1 Ġ+ Ġ 1 ? Ġ [/INST]) and an answer of n digits is n + 2 tokens (Ġ, the digits, </s>).
"""

import dataclasses
import json
import os
import subprocess
import sys

import datasets
import pytest
from conftest import REPO, RanksWouldStart, launcher_until_ranks
from recipe_variant import recipe_variant
from test_bad_input import assert_one_line_error

from fsdp_recipes.data import length_report, lengths, recipe_tokenizer
from fsdp_recipes.data.tokenizing import Truncation
from fsdp_recipes.errors import UserError

PROMPT = 13  # tokens of the chat prompt "What is 1 + 1?"
SOURCE = "tiny-mistral's tokenizer and chat template"


def qa(a="2", q="What is 1 + 1?"):
    return {"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": a}]}


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok(cache_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cache_dir / "tiny-mistral")


def measure(rows, tok, t=Truncation(64), **kw):
    return lengths.measure(datasets.Dataset.from_list(rows), tok, "train", t, **kw)


def test_lengths_worked_out_by_hand(tok):
    # answers of 1, 2, 4, 40 and 100 digits: 3, 4, 6, 42 and 102 tokens after the same 13-token prompt
    m = measure([qa("2"), qa("22"), qa("2222"), qa("9" * 40), qa("9" * 100)], tok)
    assert m.prompt == [PROMPT] * 5
    assert m.answers == {"answer": [3, 4, 6, 42, 102]}
    assert m.whole == [16, 17, 19, 55, 115]
    # nearest rank of 5 rows: the median is the 3rd, p95 and p99 the 5th
    assert (lengths.spread(m.answers["answer"]), lengths.spread(m.whole)) == ("6 / 102 / 102",
                                                                                        "19 / 115 / 115")
    assert m.cut(Truncation(64)) == (1, 0, 0)  # the 115-token row
    assert m.cut(Truncation(16)) == (4, 0, 0)  # all but the 16-token row
    assert m.cut(Truncation(13)) == (5, 5, 0)  # the prompt alone fills max_length: nothing of any answer is left
    assert m.cut(Truncation(None)) == (0, 0, 0)
    assert length_report.table([m], Truncation(64), SOURCE) == [
        f"token lengths under {SOURCE}, median / p95 / max:",
        "  split  rows  prompt        answer         whole           cut at max_length 64",
        "  train  5     13 / 13 / 13  6 / 102 / 102  19 / 115 / 115  1 (20%)"]
    assert length_report.table([m], Truncation(128), SOURCE)[-1] == "max_length 128 cuts no answer; 115 keeps 99% " \
                                                                   "of rows whole"


def test_the_max_length_that_keeps_99_percent_of_rows_whole(tok):
    # 98 rows of 16 tokens, one of 55, one of 115: the 99th of 100 in order is 55
    m = measure([qa()] * 98 + [qa("9" * 40), qa("9" * 100)], tok)
    assert m.keeps() == 55 and lengths.percentile(m.whole, 99) == 55
    assert lengths.percentile(list(range(1, 101)), 95) == 95
    assert length_report.cut_warning([m], Truncation(32)) == (
        "max_length 32 cuts the answers of 2 of the 100 `train` rows (2%). Fix: max_length 55 keeps 99% of rows "
        "whole (--max_length 55, or max_length: 55 in the recipe)")
    # max_length 64 keeps 99% whole already; the one row it cuts is still named, and the fix keeps every row
    assert length_report.cut_warning([m], Truncation(64)) == (
        "max_length 64 cuts the answers of 1 of the 100 `train` rows (1%). Fix: max_length 115 keeps every row "
        "whole (--max_length 115, or max_length: 115 in the recipe)")
    assert length_report.cut_warning([m], Truncation(115)) is None


def test_a_split_of_more_rows_is_measured_on_a_seeded_sample(tok):
    rows = [qa("9" * n) for n in range(1, 11)]
    m = measure(rows, tok, sample=4)
    assert (m.rows, m.sampled) == (10, 4) and m.index == sorted(m.index)
    assert measure(rows, tok, sample=4).index == m.index  # the same rows every time
    assert m.whole == [PROMPT + n + 2 for n in (i + 1 for i in m.index)]
    table = length_report.table([m], Truncation(64), SOURCE)
    assert "(rows: a seeded sample of a larger split)" in table[0] and table[2].split()[1:4] == ["4", "of", "10"]


def test_every_sft_layout_and_pairs(tok):
    # messages: the prompt is everything before the last assistant turn (13 + " 22</s>" 4 + "[INST] ... [/INST]" 12)
    turns = qa("22")["prompt"] + qa("22")["completion"] + qa("2")["prompt"] + qa("2")["completion"]
    m = measure([{"messages": turns}], tok)
    assert (m.prompt, m.answers, m.whole, m.first_trained) == ([29], {"answer": [3]}, [32], [0])
    # assistant_only_loss: the loss starts at the first answer, so max_length 13 leaves nothing to learn, 20 does
    only = measure([{"messages": turns}], tok, Truncation(13, assistant_only_loss=True))
    assert only.first_trained == [PROMPT] and only.cut(Truncation(13, assistant_only_loss=True)) == (1, 1, 0)
    assert only.cut(Truncation(20, assistant_only_loss=True)) == (1, 0, 0)
    # a text field: no prompt; TRL adds </s>
    m = measure([{"text": "999"}, {"text": "12345"}], tok)
    assert (m.has_prompt, m.answers, m.whole) == (False, {"answer": [4, 6]}, [4, 6])
    assert length_report.table([m], Truncation(64), SOURCE)[1].split() == ["split", "rows", "answer", "whole", "cut",
                                                                          "at", "max_length", "64"]
    # text prompt + completion (</s> added to the completion), and a preference pair
    m = measure([{"prompt": "123", "completion": "45"}], tok)
    assert (m.prompt, m.answers, m.whole) == ([3], {"answer": [3]}, [6])
    m = measure([{"prompt": "123", "chosen": "4", "rejected": "56"}], tok)
    assert (m.prompt, m.answers, m.whole) == ([3], {"chosen": [2], "rejected": [3]}, [6])
    assert "cuts the chosen or rejected answers of 1 of the 1" in length_report.cut_warning([m], Truncation(5))


def test_keep_end_and_packing(tok):
    m = measure([qa("2"), qa("22"), qa("2222"), qa("9" * 40), qa("9" * 100)], tok)
    keep_end = Truncation(50, keep_end=True)
    assert m.cut(keep_end) == (1, 0, 1)  # the 102-token answer is cut; the 55-token row loses its prompt's start
    assert length_report.table([m], keep_end, SOURCE)[-1] == ("truncation_mode keep_end: 1 row(s) longer than "
                                                              "max_length 50 lose the start of their prompt instead")
    wrapped = Truncation(16, packing="wrapped")
    assert m.cut(wrapped) == (0, 0, 0) and length_report.cut_warning([m], wrapped) is None
    assert "nothing is cut" in length_report.table([m], wrapped, SOURCE)[-1]
    assert m.cut(Truncation(16, packing="bfd")) == (4, 0, 0)  # bfd truncates as it packs


def test_truncation_follows_the_trainer_config(tmp_path):
    from trl import SFTConfig

    cfg = SFTConfig(output_dir=str(tmp_path), max_length=32, packing=True, packing_strategy="wrapped",
                    assistant_only_loss=True, truncation_mode="keep_end", use_cpu=True, report_to="none")
    assert Truncation.of(cfg) == Truncation(32, False, "wrapped", None, True, "text")


def test_no_answer_left_anywhere_is_one_line(tok):
    m = measure([qa(q="1" * 60)] * 3, tok)  # a 65-token prompt
    with pytest.raises(UserError) as err:
        length_report.check_learnable([m], Truncation(64), "data.jsonl")
    assert str(err.value) == (
        "every row of the `train` split of data.jsonl has a prompt of max_length 64 tokens or more, so truncation "
        "leaves no completion to learn. Fix: max_length 68 keeps 99% of rows whole (--max_length 68, or max_length: "
        "68 in the recipe), or shorten the prompts.")
    length_report.check_learnable([m], Truncation(128), "data.jsonl")


def test_the_launcher_prints_the_table_and_one_warning(tmp_path, cache_dir, monkeypatch, capsys):
    data = tmp_path / "qa"
    # two rows with a system turn, which the tiny template leaves out (no token more): one warning of its own
    system = {"role": "system", "content": "Answer with the number only."}
    with_system = {**qa(), "prompt": [system, *qa()["prompt"]]}
    write_jsonl(data / "train.jsonl", [qa()] * 4 + [with_system] * 2 + [qa("9" * 100)] * 2 + [qa(q="1" * 60)])
    write_jsonl(data / "test.jsonl", [qa()] * 3)
    folder = recipe_variant(tmp_path, dataset_name=str(data), output_dir=str(tmp_path / "run"))
    with pytest.raises(RanksWouldStart):
        launcher_until_ranks([str(folder)], monkeypatch, capsys)
    lines = capsys.readouterr().out.splitlines()
    at = lines.index(f"[launch] token lengths under {SOURCE}, median / p95 / max:")
    assert lines[at + 1].split() == ["[launch]", "split", "rows", "prompt", "answer", "whole", "cut", "at",
                                     "max_length", "64"]
    assert lines[at + 2].split() == ["[launch]", "train", "9", "13", "/", "65", "/", "65", "3", "/", "102", "/", "102",
                                     "16", "/", "115", "/", "115", "3", "(33%)"]
    assert lines[at + 3].split()[:2] == ["[launch]", "test"]
    warned = [line for line in lines if "cuts the answers" in line]
    assert warned == ["[launch] warning: max_length 64 cuts the answers of 3 of the 9 `train` rows (33%); 1 of them "
                      "loses the whole answer (the prompt alone fills max_length). Fix: max_length 115 keeps 99% of "
                      "rows whole (--max_length 115, or max_length: 115 in the recipe)"]
    warned = [line for line in lines if "system turns" in line]
    assert len(warned) == 1 and warned[0].startswith(
        "[launch] warning: tiny-mistral's chat template leaves out system turns: 2 of the 9 rows of `train` have one"
        f", and its text is not in the conversation the trainer renders (first: {data / 'train.jsonl'}:5, system "
        "'Answer with the number only.'), so the model never sees it. Fix: "), warned


def test_rank_0_measures_where_the_launcher_cannot(tmp_path, cache_dir, tok):
    """A hub model (or hub data): the launcher has no tokenizer before the ranks start, so rank 0 prints the table
    and the warning as [train] lines, with the tokenizer the trainer loaded (train/train/build.py build_trainer)."""
    import types

    from fsdp_recipes.config.run_config import parse_args

    data = write_jsonl(tmp_path / "qa" / "train.jsonl", [qa()] * 3 + [qa("9" * 100)])
    recipe = ["--config", str(REPO / "recipes/tiny-cpu-lora/sft.yaml"), "--dataset_name", str(data)]
    assert length_report.measured_by_launcher(parse_args(recipe))
    cfg = parse_args([*recipe, "--model_name_or_path", "some-org/some-model"])
    assert not length_report.measured_by_launcher(cfg)
    splits = (datasets.Dataset.from_list([qa()] * 3 + [qa("9" * 100)]), None)
    lines = length_report.in_rank(cfg, splits, types.SimpleNamespace(processing_class=tok))
    assert lines[0] == "token lengths under some-model's tokenizer and chat template, median / p95 / max:"
    assert lines[-1] == ("warning: max_length 64 cuts the answers of 1 of the 4 `train` rows (25%). Fix: max_length "
                         "115 keeps 99% of rows whole (--max_length 115, or max_length: 115 in the recipe)")


# ----------------------------------------------------------------------------------------------- make data

def preview(args, capsys):
    from fsdp_recipes.launch import data_preview

    try:
        code = data_preview.main([str(a) for a in args])
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def test_make_data_names_a_users_own_pairs_the_demo_would_replace(cache_dir, capsys, monkeypatch, tmp_path):
    """`make data RECIPE=smollm2-135m-dpo ARGS="--dataset_name mine.jsonl"` said the user's file held pairs "made from
    the SFT model's own answers by the first launch"; it is the launch's refusal (assets/addition_preferences.py)."""
    monkeypatch.chdir(REPO)
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    res = preview(["smollm2-135m-dpo", "--dataset_name", mine, "--model_name_or_path", cache_dir / "tiny-mistral"],
                  capsys)  # a model that is here: the SFT run's is not
    errors = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(errors) == 1, res.stdout + res.stderr
    assert f"it would replace what {mine} holds" in errors[0] and "Fix: --addition_preferences false" in errors[0]


@pytest.mark.parametrize("trainer, fields, fragment", [
    ("grpo", {"reward_funcs": []}, "a GRPO recipe needs reward_funcs"),
    ("kto", {"per_device_train_batch_size": 1}, "per_device_train_batch_size 1 with KTO's KL term"),
], ids=["grpo-without-rewards", "kto-one-row-batches"])
def test_make_data_refuses_what_the_launcher_refuses_of_the_trainer_kind(cache_dir, capsys, tmp_path, trainer,
                                                                         fields, fragment):
    """make data passed recipes whose trainer-kind settings the launch refuses: the kind's check_config is run."""
    from recipe_variant import recipe_variant

    drop = ("max_length", "per_device_eval_batch_size") if trainer == "grpo" else ()
    folder = recipe_variant(tmp_path, f"tiny-{trainer}", trainer=trainer, drop=drop, eval_strategy="no", **fields)
    res = preview([folder], capsys)
    errors = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(errors) == 1, res.stdout + res.stderr
    assert fragment in errors[0] and "Fix:" in errors[0], errors[0]


def test_make_data_checks_a_vllm_recipe_without_the_gpus_it_runs_on(cache_dir, capsys, tmp_path):
    """make data parses as on a CPU (use_cpu, as make plan): the sampling backend is the run's machine's to decide
    (the launcher's and each rank's settle_generation), so `generation_backend: vllm` was refused on every machine."""
    from recipe_variant import recipe_variant

    from fsdp_recipes.errors import UserError
    from fsdp_recipes.train import kinds

    folder = recipe_variant(tmp_path, "tiny-grpo", trainer="grpo", drop=("max_length", "per_device_eval_batch_size"),
                            eval_strategy="no", generation_backend="vllm",
                            reward_funcs=["fsdp_recipes.rewards.exact_answer"])
    res = preview([folder], capsys)
    assert res.returncode == 0, res.stdout + res.stderr
    from fsdp_recipes.launch import data_preview  # the run's own decision still refuses vLLM where it cannot run

    cfg = data_preview.load_config(str(folder), [])[1]
    with pytest.raises(UserError, match="generation_backend vllm, but"):
        kinds.load("grpo").settle_generation(cfg)


def test_make_data_on_the_tiny_recipe(cache_dir, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    res = preview(["tiny-cpu-lora"], capsys)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    lines = res.stdout.splitlines()
    data = cache_dir / "tiny-arith"
    assert lines[:4] == [
        f"[data] recipe tiny-cpu-lora (recipes/tiny-cpu-lora), trainer sft, data {data}",
        f"[data] data {data}: prompt/completion (prompt, completion) (as TRL takes it) (detected; declare it with "
        "`dataset_format: prompt_completion`)",
        "[data] train split: `train`, 4000 rows",
        "[data] eval split: the `test` split (64 rows)"]
    assert f"[data] token lengths under {SOURCE}, median / p95 / max (rows: a seeded sample of a larger split):" \
           in lines
    assert "[data] max_length 64 cuts no answer; 17 keeps 99% of rows whole" in lines
    assert ("[data] 3 example(s), rendered and tokenized as the trainer will; the loss counts the completion, the "
            "tokens it skips are «between guillemets»") in lines
    first = lines.index(f"[data] example 1 of 3 (train row 1, {data / 'train.jsonl'}:1): 17 tokens, 4 trained")
    assert lines[first + 1:first + 3] == ["    «<s>[INST] What is 6 + 6? [/INST]» 12</s>",
                                          "    trained tokens: ' ' '1' '2' '</s>'"]
    assert lines[-1].startswith("[data] read, checked and tokenized in ")


def test_make_data_on_a_users_alpaca_file(tmp_path, cache_dir, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    rows = [{"instruction": "What is 1 + 1?", "input": "", "output": "2"}] * 8 + \
           [{"instruction": "What is 1 + 1?", "input": "", "output": "9" * 100}] * 2
    path = write_jsonl(tmp_path / "mine.jsonl", rows)
    res = preview(["tiny-cpu-lora", "--dataset_name", path, "--eval_split_size", "2", "--examples", "3"], capsys)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    lines = res.stdout.splitlines()
    assert (f"[data] data {path}: Alpaca (instruction, output, input) -> chat prompt + completion (detected; declare "
            "it with `dataset_format: alpaca`)") in lines
    assert "[data] train split: `train`, 8 rows" in lines
    assert "[data] eval split: 2 of the 10 rows of `train` held out (eval_split_size 2, seed 42)" in lines
    cut = [line for line in lines if line.startswith("[data] warning: max_length 64 cuts the answers of")]
    assert len(cut) == 1 and "Fix: max_length 115 keeps" in cut[0], lines
    # the third example is the longest training row, cut where max_length ends it
    longest = next(line for line in lines if "the longest of the 8 measured" in line)
    assert longest.endswith(": 115 tokens, 51 trained, 51 cut by max_length 64"), longest
    text = lines[lines.index(longest) + 1]
    assert text.startswith("    «<s>[INST] What is 1 + 1? [/INST]» 9999") and "|max_length 64 cuts here| «" in text


def test_make_data_refuses_an_eval_split_size_that_leaves_a_rank_without_training_rows(tmp_path, cache_dir, capsys,
                                                                                       monkeypatch):
    """Trial: `make data RECIPE=tiny-cpu-lora ARGS="--dataset_name mine.jsonl --eval_split_size 20"` on 10 rows said
    train 1 row, eval 9. tiny-cpu-lora runs 2 processes (its accelerate.yaml): 9 held out leaves 1 row for 2 ranks."""
    monkeypatch.chdir(REPO)
    path = write_jsonl(tmp_path / "mine.jsonl", [qa(str(i)) for i in range(10)])
    assert_one_line_error(preview(["tiny-cpu-lora", "--dataset_name", path, "--eval_split_size", "20"], capsys),
                          f"eval_split_size 20 holds out 20 rows, and `train` in {path} has 10, leaving none to "
                          "train on. Fix: hold out at most 8")
    assert_one_line_error(preview(["tiny-cpu-lora", "--dataset_name", path, "--eval_split_size", "9"], capsys),
                          "leaving 1 to train on for 2 ranks")


def test_make_data_bad_input_is_one_line(tmp_path, cache_dir, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert_one_line_error(preview(["tiny-cpu-lora", "--dataset_name", tmp_path / "none.jsonl"], capsys),
                          "dataset not found")
    bad = write_jsonl(tmp_path / "bad.jsonl", [qa(), {"question": "q"}])
    assert_one_line_error(preview(["tiny-cpu-lora", "--dataset_name", bad], capsys),
                          f"{bad}:2: `prompt` is missing, not a list of chat turns")
    assert_one_line_error(preview(["tiny-cpu-lora", "--examples", "many"], capsys), "--examples 'many'")
    assert_one_line_error(preview(["no-such-recipe"], capsys), "unknown recipe")


@pytest.mark.slow
def test_make_data_runs_from_the_makefile(cache_dir):
    venv = os.path.dirname(os.path.dirname(sys.executable))
    # -o: the venv is there already (a stale stamp must not reinstall it); as from a shell, not as a sub-make
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    env["FSDP_RECIPES_CACHE"] = str(cache_dir)
    res = subprocess.run(["make", "--no-print-directory", "data", "RECIPE=tiny-cpu-lora", f"VENV={venv}",
                          "-o", f"{venv}/.installed", "ARGS=--examples 1 --max_length 16"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[data] warning: max_length 16 cuts the answers of" in res.stdout
    assert "[data] example 1 of 1 (train row 1" in res.stdout


# ----------------------------------------------------------------------------------------------- as TRL does

MARKED = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST] {{ message['content'] }}"
          " [/INST]{% elif message['role'] == 'assistant' %} {% generation %}{{ message['content'] }}{{ eos_token }}"
          "{% endgeneration %}{% endif %}{% endfor %}")  # the tiny template, its answers marked for assistant_only_loss


@pytest.mark.parametrize("layout", ["chat prompt/completion", "messages", "text", "text prompt/completion",
                                    "assistant_only_loss", "completion_only_loss off"])
def test_lengths_and_masks_are_trls_own(layout, cache_dir, tmp_path):
    """Against TRL's own preparation of the same rows (SFTTrainer._prepare_dataset, called without a model and
    without max_length): each row's whole length and where its loss starts (measure), and the trained tokens
    (example)."""
    import types

    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(cache_dir / "tiny-mistral")
    pairs = [("What is 1 + 1?", "2"), ("What is 12 + 30?", "42"), ("What is 7 + 8?", "15")]
    chat = [qa(a, q) for q, a in pairs]
    settings = {}
    rows = {"chat prompt/completion": chat, "completion_only_loss off": chat,
            "messages": [{"messages": chat[0]["prompt"] + chat[0]["completion"] + r["prompt"] + r["completion"]}
                         for r in chat],
            "text": [{"text": f"{q} {a}"} for q, a in pairs],
            "text prompt/completion": [{"prompt": q, "completion": f" {a}"} for q, a in pairs]}
    if layout == "assistant_only_loss":
        template = tmp_path / "marked.jinja"
        template.write_text(MARKED)
        rows[layout] = rows["messages"]
        settings = {"assistant_only_loss": True, "chat_template_path": str(template)}
    if layout == "completion_only_loss off":
        settings = {"completion_only_loss": False}
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_length=None, use_cpu=True, report_to="none", **settings)
    chat_template = recipe_tokenizer.chat_template(tok, args)
    ds = datasets.Dataset.from_list(rows[layout])
    trainer = types.SimpleNamespace(_tokenizer=tok, chat_template=chat_template, _is_vlm=False,
                                    completion_only_loss=settings.get("completion_only_loss", "prompt" in ds[0]))
    prepared = SFTTrainer._prepare_dataset(trainer, ds, tok, args, False, None, "train")
    labels = [[label != -100 for label in row] for row in prepared["labels"]]
    t = Truncation.of(args)
    m = lengths.measure(ds, tok, "train", t, chat_template)
    assert m.whole == [len(ids) for ids in prepared["input_ids"]]
    if layout == "assistant_only_loss":  # measured where the generation prompt ends; this template's markers
        # start one token later, after the space (data/lengths.py Lengths.first_trained)
        assert m.first_trained == [PROMPT] * 3 and [mask.index(True) for mask in labels] == [PROMPT + 1] * 3
    else:
        assert m.first_trained == [mask.index(True) for mask in labels]
    for row, ids, mask in zip(ds, prepared["input_ids"], labels):
        (seq,) = lengths.example(row, tok, t, chat_template)
        assert (seq.ids, seq.trained) == (ids, mask)


def test_pair_lengths_are_dpos_own(cache_dir, tmp_path):
    """Preference pairs, chat and text, against TRL's DPOTrainer._prepare_dataset: prompt, chosen and rejected."""
    import types

    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(cache_dir / "tiny-mistral")
    chat = [{**qa(q=f"What is {i} + 9?"), "chosen": qa(str(i + 9))["completion"],
             "rejected": qa(str(i))["completion"]} for i in (2, 30, 7)]
    for row in chat:
        del row["completion"]
    text = [{"prompt": f"{i} + 9 =", "chosen": f" {i + 9}", "rejected": f" {i}"} for i in (2, 30, 7)]
    args = DPOConfig(output_dir=str(tmp_path), max_length=None, use_cpu=True, report_to="none")
    for rows in (chat, text):
        ds = datasets.Dataset.from_list(rows)
        prepared = DPOTrainer._prepare_dataset(types.SimpleNamespace(_tokenizer=tok, _is_vlm=False), ds, tok, args,
                                               "train")
        m = lengths.measure(ds, tok, "train", Truncation.of(args))
        assert m.prompt == [len(ids) for ids in prepared["prompt_ids"]]
        assert m.answers == {name: [len(ids) for ids in prepared[f"{name}_ids"]] for name in ("chosen", "rejected")}


def test_make_data_on_preference_pairs(tmp_path, cache_dir, capsys, monkeypatch):
    """DPO: prompt, chosen and rejected columns, each answer's sequence shown; KTO reads the same pairs unpaired,
    two rows each, which no line of the file holds as such (so none is named)."""
    from fsdp_recipes.assets.tiny_assets import ensure_assets

    monkeypatch.chdir(REPO)
    pairs = ensure_assets(quiet=True)["preferences"]
    dpo = recipe_variant(tmp_path, "tiny-dpo", trainer="dpo", dataset_name=str(pairs))
    lines = preview([dpo, "--examples", "1"], capsys).stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("[data] token lengths"))
    assert lines[at + 1].split()[1:] == ["split", "rows", "prompt", "chosen", "rejected", "whole", "cut", "at",
                                         "max_length", "64"]
    shown = [line for line in lines if line.startswith("[data] example 1 of 1")]
    assert [line.split("), ")[-1].split(":")[0] for line in shown] == ["chosen", "rejected"], shown
    assert f"{pairs / 'train.jsonl'}:1)" in shown[0]
    kto = recipe_variant(tmp_path, "tiny-kto", trainer="kto", dataset_name=str(pairs))
    lines = preview([kto, "--examples", "2"], capsys).stdout.splitlines()
    shown = [line for line in lines if line.startswith("[data] example ")]
    assert [line.split(": ")[0] for line in shown] == ["[data] example 1 of 2 (train row 1), label true",
                                                       "[data] example 2 of 2 (train row 2), label false"], shown


def test_a_model_folder_without_a_tokenizer_is_one_line(tmp_path, cache_dir):
    """A model saved with model.save_pretrained alone: transformers' "Couldn't instantiate the backend tokenizer
    from one of:" became 'ValueError while checking the recipe ... Fix: correct the setting or file it names'."""
    import shutil
    from types import SimpleNamespace

    model = tmp_path / "model-only"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(cache_dir / "tiny-mistral" / name, model / name)
    cfg = SimpleNamespace(model=SimpleNamespace(model_name_or_path=str(model)), training=SimpleNamespace())
    with pytest.raises(UserError, match=rf"model_name_or_path {model} holds no tokenizer .* Fix: save the tokenizer "
                                        r"there too \(tokenizer.save_pretrained"):
        recipe_tokenizer.load_tokenizer(cfg)
    shutil.copy(cache_dir / "tiny-mistral" / "tokenizer.json", model / "tokenizer.json")
    shutil.copy(cache_dir / "tiny-mistral" / "tokenizer_config.json", model / "tokenizer_config.json")
    assert recipe_tokenizer.load_tokenizer(cfg)[0] is not None


def neox_folder(folder, cache_dir=None, tokenizer: bool = False):
    """A GPT-NeoX model folder (vocab_size 1024) without tokenizer files: transformers 5 builds an empty 2-token
    GPTNeoXTokenizer from it, with no error; `tokenizer`: tiny-mistral's tokenizer files copied in (another model's,
    of fewer tokens than the model's vocab_size)."""
    import shutil

    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=1024, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, max_position_embeddings=64)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json") if tokenizer else ():
        shutil.copy(cache_dir / "tiny-mistral" / name, folder / name)
    return folder


def test_a_model_folder_whose_tokenizer_would_be_empty_or_another_models_is_one_line(tmp_path, cache_dir):
    """Trial: a GPT-NeoX folder saved without its tokenizer passed every check (transformers 5 built an empty
    tokenizer, no error): `make data` showed every row as `1 tokens`, a launch trained on nothing (loss 0) and failed at
    its end on an IncompleteSave line. Now one line before launch, from the launcher's model check and the tokenizer
    load that the launcher and make data share; the pack's tiny model passes."""
    from types import SimpleNamespace

    from fsdp_recipes.config import model_found

    def cfg(model):
        return SimpleNamespace(model=SimpleNamespace(model_name_or_path=str(model)), training=SimpleNamespace())

    bare = neox_folder(tmp_path / "neox-notok")
    fix = r"Fix: save the tokenizer there too \(tokenizer.save_pretrained"
    with pytest.raises(UserError, match=rf"model_name_or_path {bare} holds no tokenizer .*{fix}"):
        recipe_tokenizer.load_tokenizer(cfg(bare))
    with pytest.raises(UserError, match=rf"model_name_or_path {bare} holds no tokenizer .*{fix}"):
        model_found.check_model_found(str(bare))  # the launcher's, before anything else: hub data too
    other = neox_folder(tmp_path / "neox-other", cache_dir, tokenizer=True)
    with pytest.raises(UserError, match=rf"the tokenizer of model_name_or_path {other} has \d+ tokens, and the model's "
                                        rf"config.json says vocab_size 1,024: not the model's own tokenizer .*{fix}"):
        recipe_tokenizer.load_tokenizer(cfg(other))
    tokenizer, _ = recipe_tokenizer.load_tokenizer(cfg(cache_dir / "tiny-mistral"))  # the pack's own: passes
    assert len(tokenizer) > 256
    assert model_found.check_model_found(str(cache_dir / "tiny-mistral")) is None


def test_rows_of_one_token_or_fewer_are_one_counted_warning(tok, cache_dir):
    """The second guard: rows that tokenize to their end-of-text token alone (a tokenizer with no vocabulary the
    checks above miss, or empty text) are one counted line, naming the first."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(model=SimpleNamespace(model_name_or_path=str(cache_dir / "tiny-mistral")),
                          training=SimpleNamespace(max_length=64))
    short = lengths.Lengths("train", 3, ("answer",), prompt=[0, 0, 0], answers={"answer": [1, 1, 5]},
                            whole=[1, 1, 5], index=[0, 1, 2], has_prompt=False)
    fine = lengths.Lengths("test", 2, ("answer",), prompt=[0, 0], answers={"answer": [4, 5]}, whole=[4, 5],
                           index=[0, 1], has_prompt=False)
    line = length_report.short_warning([short, fine], tok, cfg, "mine.jsonl")
    assert line.startswith("2 of the 3 rows of `train` tokenize to 1 token or fewer (first: mine.jsonl (train "
                           "split), row 1): nothing there to learn. Fix: check that model_name_or_path holds the "
                           "model's own tokenizer files"), line
    assert length_report.short_warning([fine], tok, cfg, "mine.jsonl") is None
    every = length_report.short_warning([dataclasses.replace(short, whole=[1, 1, 1])], tok, cfg, "mine.jsonl")
    assert f"row 1): tiny-mistral's tokenizer has {len(tok):,} tokens, nothing" in every
    _, warnings = length_report.report([short, fine], cfg, tok, "mine.jsonl")
    assert any("tokenize to 1 token or fewer" in w for w in warnings)


# ----------------------------------------------------------------------------------------- what a launch would say

SYSTEM = {"role": "system", "content": "Answer with the number only."}


def with_system(q="What is 1 + 1?", a="2"):
    return {"messages": [SYSTEM, {"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def test_a_system_turn_the_template_leaves_out_is_one_warning(tok, tmp_path, cache_dir, capsys, monkeypatch):
    """tiny-mistral's template (as Mistral's and Llama 2's older ones) renders user and assistant turns only: a row's
    system prompt was trained without, and nothing said so (`make data` showed `<s>[INST] 0 + 0? [/INST] 0</s>`).
    Only templates that raise on a system turn were caught (chat_render.refused)."""
    from fsdp_recipes.data import chat_render

    rows = [with_system()] * 3 + [{"messages": with_system()["messages"][1:]}]
    assert measure(rows, tok).system_dropped == chat_render.Dropped(3, "row 1 of `train`", SYSTEM["content"])
    renders = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert measure(rows, tok, template=renders).system_dropped is None  # a template that renders the system role
    monkeypatch.chdir(REPO)
    sharegpt = [{"conversations": [{"from": "system", "value": SYSTEM["content"]}, {"from": "human", "value": "0 + 0?"},
                                   {"from": "gpt", "value": "0"}]}] * 3
    path = write_jsonl(tmp_path / "sys.jsonl", sharegpt)
    res = preview(["tiny-cpu-lora", "--dataset_name", path, "--eval_strategy", "no", "--examples", "1"], capsys)
    warned = [line for line in res.stdout.splitlines() if "system turn" in line]
    assert res.returncode == 0 and warned == [
        "[data] warning: tiny-mistral's chat template leaves out system turns: 3 of the 3 rows of `train` have one, "
        f"and its text is not in the conversation the trainer renders (first: {path}:1, system 'Answer with the "
        "number only.'), so the model never sees it. Fix: set chat_template_path to a template that renders the "
        "system role (or use a model whose template does), or fold the system text into the first user turn in the "
        "data (the pack does not fold it)"], res.stdout


def test_make_data_refuses_data_without_an_eval_split_as_the_launch_does(tmp_path, cache_dir, capsys, monkeypatch):
    """tiny-cpu-lora evaluates (eval_strategy: steps): its launch refuses a file with no eval split, and `make data`
    exited 0 saying "nothing is scored as held out". Now the preview shows the data, then the launch's own line."""
    from trl import DatasetMixtureConfig, ScriptArguments

    from fsdp_recipes.data import loading

    monkeypatch.chdir(REPO)
    path = write_jsonl(tmp_path / "only_train.jsonl", [qa()] * 4)
    with pytest.raises(UserError) as launch:  # what a launch says: the trainer kinds load with want_eval True
        loading.load_sft_datasets(ScriptArguments(dataset_name=str(path)), DatasetMixtureConfig(), True)
    res = preview(["tiny-cpu-lora", "--dataset_name", path, "--examples", "1"], capsys)
    assert res.returncode == 2 and res.stderr.splitlines() == [f"error: {launch.value}"], res.stderr
    assert (f"[data] eval split: none in {path}, and eval_strategy is \"steps\": a launch of tiny-cpu-lora stops here "
            "(the error below)") in res.stdout.splitlines(), res.stdout
    assert "[data] example 1 of 1 " in res.stdout  # the data is still shown
    res = preview(["tiny-cpu-lora", "--dataset_name", path, "--examples", "1", "--eval_strategy", "no"], capsys)
    assert res.returncode == 0 and "nothing is scored as held out" in res.stdout, res.stdout + res.stderr
