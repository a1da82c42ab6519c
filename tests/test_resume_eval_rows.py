"""A resume that would change which rows are held out (checkpoint/resume_settings.py EVAL_ROWS): another seed,
eval_split_size, dataset or split carves another eval split, so rows the first part trained on would be scored as
held out. Refused in one line like the learning rate; under override_resumed_settings the summary says the held-out
rows changed and does not call them held out. In-process: resume_settings' functions on a recipe's data settings
(TRL's ScriptArguments and DatasetMixtureConfig, the pack's PackArguments) against the settings saved from them."""

import copy
from types import SimpleNamespace

import pytest
from trl import DatasetMixtureConfig, ScriptArguments
from trl.scripts.utils import DatasetConfig

from fsdp_recipes.checkpoint.resume_settings import check, current, eval_rows_changed
from fsdp_recipes.config.run_config import PackArguments
from fsdp_recipes.errors import UserError


def recipe(mixture=None):
    """The data settings of a recipe as the rank parses them (the rest as the sampling kinds' test writes it)."""
    training = SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=1, learning_rate=1e-4,
                               seed=42, max_steps=10)
    return SimpleNamespace(training=training, trainer="sft", model=SimpleNamespace(dtype="float32"), kind_args=None,
                           script=ScriptArguments(dataset_name=None if mixture else "data/qa.jsonl"),
                           mixture=mixture or DatasetMixtureConfig(), pack=PackArguments(eval_split_size=0.1))


SOURCES = [DatasetConfig(path="json", data_files="a.jsonl"), DatasetConfig(path="json", data_files="b.jsonl")]

CHANGES = [  # (the setting as the resuming command changes it, its saved and new value as the line names them)
    (lambda c: setattr(c.training, "seed", 7), "seed 42 -> 7"),
    (lambda c: setattr(c.pack, "eval_split_size", 0.2), "eval_split_size 0.1 -> 0.2"),
    (lambda c: setattr(c.script, "dataset_name", "data/other.jsonl"),
     "dataset_name 'data/qa.jsonl' -> 'data/other.jsonl'"),
    (lambda c: setattr(c.script, "dataset_config", "hard"), "dataset_config None -> 'hard'"),
    (lambda c: setattr(c.script, "dataset_train_split", "all"), "dataset_train_split 'train' -> 'all'"),
    (lambda c: setattr(c.script, "dataset_test_split", "holdout"), "dataset_test_split 'test' -> 'holdout'"),
]


@pytest.mark.parametrize("change, named", CHANGES, ids=[n.split()[0] for _, n in CHANGES])
def test_a_resume_that_changes_the_eval_rows_is_refused_in_one_line(change, named):
    cfg = recipe()
    saved = current(cfg, 2, ("packing",))
    now_cfg = copy.deepcopy(cfg)
    change(now_cfg)
    now = current(now_cfg, 2, ("packing",))
    with pytest.raises(UserError) as err:
        check("run/checkpoint-4", 4, saved, now, override=False)
    line = str(err.value)
    assert "\n" not in line and f"with other settings ({named})" in line, line
    assert f"{named} chooses other eval rows than the first part held out, so rows it trained on would be scored " \
           "as held out" in line, line
    assert line.endswith("--override_resumed_settings true to apply the new values from step 5 (the summary then "
                         "scores no rows as held out)."), line
    # the override applies it, and the run report's resumed_with_changes names it as choosing other eval rows
    report = check("run/checkpoint-4", 4, saved, now, override=True)
    key = named.split()[0]
    assert list(eval_rows_changed(report)) == [key]


def test_a_mixtures_sources_and_test_split_size_decide_the_eval_rows_too():
    cfg = recipe(DatasetMixtureConfig(datasets=SOURCES, test_split_size=0.1))
    saved = current(cfg, 2)
    assert saved["datasets"][1]["data_files"] == "b.jsonl" and saved["test_split_size"] == 0.1
    fewer = copy.deepcopy(cfg)
    fewer.mixture.datasets = SOURCES[:1]
    with pytest.raises(UserError, match=r"datasets \[.*'b.jsonl'.*\] -> \[.*\] chooses other eval rows"):
        check("run/checkpoint-4", 4, saved, current(fewer, 2), override=False)
    bigger = copy.deepcopy(cfg)
    bigger.mixture.test_split_size = 0.3
    with pytest.raises(UserError, match=r"test_split_size 0.1 -> 0.3 chooses other eval rows"):
        check("run/checkpoint-4", 4, saved, current(bigger, 2), override=False)


def test_the_eval_split_found_under_another_usual_name_is_no_change():
    """The launcher compares after its checks loaded the data, which sets dataset_test_split to the split it found
    (`validation` where `test` is missing); the ranks saved it before: the same split, no change."""
    cfg = recipe()
    saved = current(cfg, 2)
    loaded = copy.deepcopy(cfg)
    loaded.script.dataset_test_split = "validation"
    assert check("run/checkpoint-4", 4, saved, current(loaded, 2), override=False) == {}


def test_another_learning_rate_changes_no_eval_rows():
    cfg = recipe()
    saved = current(cfg, 2)
    other = copy.deepcopy(cfg)
    other.training.learning_rate = 1e-5
    with pytest.raises(UserError) as err:
        check("run/checkpoint-4", 4, saved, current(other, 2), override=False)
    assert "eval rows" not in str(err.value) and "the summary" not in str(err.value)
    assert eval_rows_changed(check("run/checkpoint-4", 4, saved, current(other, 2), override=True)) == {}


def test_under_the_override_the_summary_does_not_call_the_rows_held_out():
    from fsdp_recipes.evaluation.scores import exact_match, held_out_loss
    from fsdp_recipes.evaluation.scoring import chosen_again, eval_section
    from fsdp_recipes.launch.summary import rows_note

    run_args = {"resumed_with_changes": {"checkpoint": "run/checkpoint-4", "step": 4,
                                         "changed": {"eval_split_size": [0.1, 0.2], "learning_rate": [1e-4, 1e-5]}}}
    check_ = {"n": 2, "rows": 2, "held_out": True, "split": "2 of the 20 rows of `train` held out (eval_split_size "
              "0.2, seed 42)", "eval_rows_in_train": 0, "exact_match": True,
              "stages": [{"stage": "base", "correct": 0}, {"stage": "trained", "correct": 2}], "changes": [],
              "loss": {"rows": 2, "tokens": 10}, "base_model": "base", "trained_model": "run/merged", "examples": []}
    check_["stages"][0]["loss"], check_["stages"][1]["loss"] = 2.0, 0.5
    chosen_again(check_, run_args)
    assert check_["held_out"] is False and check_["eval_rows_changed"] == {"eval_split_size": [0.1, 0.2]}
    assert check_["split"].endswith(", chosen again on resume (eval_split_size 0.1 -> 0.2): rows the first part "
                                    "trained on may be among them")
    assert rows_note(check_) == ["            the held-out rows changed on resume (eval_split_size 0.1 -> 0.2): rows "
                                 "the first part trained on may be among these, so they are not held out"]
    assert exact_match.lines(check_)[0].startswith("exact match on 2 eval prompts (not held out: chosen again on "
                                                   "resume): ")
    assert held_out_loss.lines(check_)[0].startswith("loss on 2 eval rows (not held out: chosen again on resume)")
    assert eval_section(check_)["held_out"] is False
    assert eval_section(check_)["eval_rows_changed"] == {"eval_split_size": [0.1, 0.2]}
    # a resume that changed only the learning rate keeps its rows held out
    kept = {"held_out": True, "split": "the `test` split (4 rows)"}
    chosen_again(kept, {"resumed_with_changes": {"changed": {"learning_rate": [1e-4, 1e-5]}}})
    assert kept == {"held_out": True, "split": "the `test` split (4 rows)"}


def test_a_data_file_changed_in_place_is_refused_in_one_line(tmp_path):
    """The same dataset_name, its rows shuffled in place between an interruption and the resume: it went ahead
    silently, and the summary called rows the first part trained on held out (eval_split_size carves by row index).
    The local data's fingerprint (checkpoint/fingerprint.py: size and its first and last MiB) is a resume setting."""
    import os
    import random

    LOCAL_DATA = "local_data"  # noqa: N806 - resume_settings.LOCAL_DATA, the settings' name for it

    data = tmp_path / "qa.jsonl"
    rows = [f'{{"prompt": "q{i}", "completion": "a{i}"}}\n' for i in range(50)]
    data.write_text("".join(rows))
    cfg = recipe()
    cfg.script.dataset_name = str(data)
    saved = current(cfg, 2, ("packing",))
    os.utime(data, (1, 1))  # touched, or copied back: the same rows
    assert check("run/checkpoint-4", 4, saved, current(cfg, 2, ("packing",)), override=False) == {}
    random.Random(0).shuffle(rows)
    data.write_text("".join(rows))  # the same size, other order
    now = current(cfg, 2, ("packing",))
    with pytest.raises(UserError) as err:
        check("run/checkpoint-4", 4, saved, now, override=False)
    assert str(err.value) == (
        f"cannot resume from run/checkpoint-4: {data} changed in place since it was saved, so the resumed steps would "
        "read other rows than the ones it counts as trained, and rows it trained on could be scored as held out. Fix: "
        "put the data back as it was, or use a new --output_dir, or --override_resumed_settings true to go on (the "
        "summary then scores no rows as held out).")
    assert set(saved[LOCAL_DATA]) == {str(data)}
    report = check("run/checkpoint-4", 4, saved, now, override=True)
    assert list(eval_rows_changed(report)) == [LOCAL_DATA]  # the summary calls no row held out
    from fsdp_recipes.checkpoint.resume_settings import described

    assert described(eval_rows_changed(report)) == f"the local data: {data} changed in place"
    # a checkpoint saved before the fingerprint was recorded resumes as before
    old = {k: v for k, v in saved.items() if k != LOCAL_DATA}
    assert check("run/checkpoint-4", 4, old, now, override=False) == {}


def test_a_hub_dataset_has_no_local_fingerprint():
    from fsdp_recipes.checkpoint import fingerprint

    assert fingerprint.data_fingerprint(["trl-lib/Capybara", None]) is None  # a hub id: not local


def test_a_data_folders_files_are_fingerprinted(tmp_path):
    from fsdp_recipes.checkpoint import fingerprint

    folder = tmp_path / "capitals"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
    (folder / "test.jsonl").write_text('{"a": 3}\n')
    before = fingerprint.data_fingerprint([str(folder)])
    (folder / "cache-0123.arrow").write_bytes(b"written by datasets' map()")  # not the user's data
    assert fingerprint.data_fingerprint([str(folder)]) == before
    (folder / "train.jsonl").write_text('{"a": 2}\n{"a": 1}\n')
    after = fingerprint.data_fingerprint([str(folder)])
    assert fingerprint.data_changed(before, after) == f"files in the folder {folder} changed"
    # another path is another dataset_name, which is compared by name: not a change of the local data
    assert fingerprint.same_paths_changed(before, {str(tmp_path / "other"): "0"}) == []


def test_the_summary_names_changed_local_data_in_words():
    """Resumed over data changed in place with --override_resumed_settings, the summary printed the two hash dicts."""
    from fsdp_recipes.launch.summary import rows_note

    line = rows_note({"eval_rows_changed": {"local_data": [{"data/x.jsonl": "88fd"}, {"data/x.jsonl": "12ab"}]}})
    assert line == ["            the held-out rows changed on resume (the local data: data/x.jsonl changed in place): "
                    "rows the first part trained on may be among these, so they are not held out"]
