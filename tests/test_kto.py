"""KTO (train/kinds/kto.py): labelled answers or pairs, checked before any rank starts, one line each; pairs read as
labelled rows that alternate. The launcher's checks run in this process (`launcher_checks`) on a copy of the tiny
recipe made a KTO recipe; exact resume is tests/test_preemption.py's, the CPU demo tests/test_default_recipe.py's."""

import json
from types import SimpleNamespace

import pytest
from conftest import RanksWouldStart, launcher_until_ranks
from recipe_variant import recipe_variant
from test_bad_input import assert_one_line_error

PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]


def kto_recipe(tmp_path, rows: list | None = None, **fields):
    """tiny-cpu-lora as a KTO recipe (kto.yaml, trainer: kto) on `rows` (default: tiny_assets' pairs)."""
    from fsdp_recipes.assets.tiny_assets import ensure_assets

    data = ensure_assets(quiet=True)["preferences"]
    if rows is not None:
        data = tmp_path / "labelled"
        data.mkdir()
        (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fields = {"dataset_name": str(data), "dataset_test_split": "none", "eval_strategy": "no",
              "output_dir": str(tmp_path / "run"), "per_device_train_batch_size": 2, **fields}
    return recipe_variant(tmp_path, "tiny-kto", trainer="kto", **fields)


def row(answer: str, label) -> dict:
    return {"prompt": PROMPT, "completion": [{"role": "assistant", "content": answer}], "label": label}


def test_pairs_are_read_as_alternating_labelled_rows_whose_neighbours_answer_other_prompts():
    from datasets import Dataset

    from fsdp_recipes.train.kinds import kto

    pairs = Dataset.from_dict({"prompt": [f"q{i}" for i in range(5)], "chosen": [f"good{i}" for i in range(5)],
                               "rejected": [f"bad{i}" for i in range(5)]})
    rows = [(r["prompt"], r["completion"], r["label"]) for r in kto.unpaired(pairs)]
    assert rows == [("q0", "good0", True), ("q2", "bad2", False), ("q1", "good1", True), ("q3", "bad3", False),
                    ("q2", "good2", True), ("q4", "bad4", False), ("q3", "good3", True), ("q0", "bad0", False),
                    ("q4", "good4", True), ("q1", "bad1", False)]


def test_kto_forwards_per_trained_token():
    from fsdp_recipes.train.kinds import kto

    t = dict(loss_type="kto", precompute_ref_log_probs=False)
    # the reference over the answer and over the mismatched one, and the policy over the mismatched one
    assert kto.extra_forwards(SimpleNamespace(**t)) == {"reference": 2.0, "kl_policy": 1.0}
    assert kto.extra_forwards(SimpleNamespace(**{**t, "loss_type": "apo_zero_unpaired"})) == {"reference": 1.0}
    assert kto.extra_forwards(SimpleNamespace(**{**t, "precompute_ref_log_probs": True})) == {"kl_policy": 1.0}


@pytest.mark.parametrize("fields, fragment", [
    ({"per_device_train_batch_size": 1}, "per_device_train_batch_size 1 with KTO's KL term"),
    ({"train_sampling_strategy": "random"}, "train_sampling_strategy random with KTO's KL term"),
], ids=["one-row-batches", "random-sampler"])
def test_settings_the_kl_term_cannot_work_with_are_one_line(tmp_path, checks, fields, fragment):
    assert_one_line_error(checks([kto_recipe(tmp_path, **fields)]), fragment)


def test_one_row_batches_pass_without_the_kl_term(tmp_path, cache_dir, monkeypatch, capsys):
    folder = kto_recipe(tmp_path, rows=[row("5", True), row("6", False)], per_device_train_batch_size=1,
                        loss_type="apo_zero_unpaired")
    with pytest.raises(RanksWouldStart):
        launcher_until_ranks([str(folder)], monkeypatch, capsys)


@pytest.mark.parametrize("rows, fragment", [
    ([row("5", True), row("6", "no")], "labelled/train.jsonl:2: `label` is 'no', not true or false"),
    ([row("5", "true"), row("6", False)], 'labelled/train.jsonl:1: `label` is the string "true" (in quotes), which '
     'is text, not the JSON boolean true. Fix: write it without quotes in the file, "label": true.'),
    ([row("5", True), {"prompt": PROMPT, "completion": [], "label": False}],
     "labelled/train.jsonl:2: `completion` is missing or empty"),
    ([{"prompt": PROMPT, "answer": "5"}], "but KTO needs `prompt`, `completion` and `label`"),
], ids=["label-not-bool", "label-quoted", "empty-answer", "columns"])
def test_bad_labelled_rows_are_one_line_with_file_and_line(tmp_path, checks, rows, fragment):
    assert_one_line_error(checks([kto_recipe(tmp_path, rows=rows)]), fragment)


def test_one_label_only_is_a_warning(tmp_path, cache_dir, monkeypatch, capsys):
    with pytest.raises(RanksWouldStart):
        launcher_until_ranks([str(kto_recipe(tmp_path, rows=[row("5", True), row("6", True)]))], monkeypatch, capsys)
    out = capsys.readouterr()
    assert "has no undesirable answers (2 desirable, 0 undesirable)" in out.out + out.err


def test_pairs_with_the_prompt_inside_their_answers_get_it_back_before_unpairing():
    from datasets import Dataset

    from fsdp_recipes.train.kinds import kto

    q = {"role": "user", "content": "What is 2 + 3?"}
    pairs = Dataset.from_list([{"chosen": [q, {"role": "assistant", "content": f"{5 + i}"}],
                                "rejected": [q, {"role": "assistant", "content": f"{6 + i}"}]} for i in range(3)])
    rows = list(kto.unpaired(pairs))
    assert rows[0] == {"prompt": [q], "completion": [{"role": "assistant", "content": "5"}], "label": True}
    assert rows[1] == {"prompt": [q], "completion": [{"role": "assistant", "content": "8"}], "label": False}


def test_fewer_than_three_pairs_cannot_feed_the_kl_term(tmp_path, checks):
    pair = {"prompt": PROMPT, "chosen": [{"role": "assistant", "content": "5"}],
            "rejected": [{"role": "assistant", "content": "6"}]}
    assert_one_line_error(checks([kto_recipe(tmp_path, rows=[pair, pair])]), "has 2 preference pair(s)")


@pytest.mark.parametrize("fields, fragment", [
    ({"beta": 0.0}, "beta is 0: KTO's kto loss scales the preference margin by beta"),
    ({"desirable_weight": 0.0, "undesirable_weight": 0.0}, "both 0 weigh every answer's loss 0"),
    ({"undesirable_weight": -1.0}, "a negative weight trains towards the answers"),
], ids=["beta-0", "weights-0", "weight-negative"])
def test_kto_settings_that_train_nothing_are_one_line(tmp_path, cache_dir, checks, fields, fragment):
    assert_one_line_error(checks([kto_recipe(tmp_path, **fields)]), fragment)
