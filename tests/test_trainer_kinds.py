"""A recipe names its trainer; DPO's preference data and settings are checked before any rank starts, one line each
with the file and the line. Every case runs the launcher's `main` in this process (`launcher_checks`) on a copy of a
tiny DPO recipe with one thing broken."""

import json
import shutil

import pytest
import yaml

from conftest import REPO, launcher_until_ranks, RanksWouldStart
from recipe_variant import recipe_variant
from test_bad_input import assert_one_line_error

GOOD = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}],
        "chosen": [{"role": "assistant", "content": "5"}], "rejected": [{"role": "assistant", "content": "6"}]}


@pytest.fixture(autouse=True)
def checks_before_ranks(monkeypatch):
    monkeypatch.setenv("FSDP_RECIPES_OVERLAP_CHECKS", "0")


def dpo_recipe(tmp_path, cache_dir, rows: list | None = None, **fields) -> "Path":  # noqa: F821
    """tiny-cpu-lora as a DPO recipe (dpo.yaml, trainer: dpo) on `rows` (default: tiny_assets' pairs)."""
    from fsdp_recipes.assets.tiny_assets import ensure_assets

    data = ensure_assets(quiet=True)["preferences"]
    if rows is not None:
        data = tmp_path / "pairs"
        data.mkdir()
        (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        shutil.copy(ensure_assets(quiet=True)["preferences"] / "test.jsonl", data / "test.jsonl")
    return recipe_variant(tmp_path, "tiny-dpo", trainer="dpo", dataset_name=str(data), eval_strategy="no",
                          output_dir=str(tmp_path / "run"), **fields)


def test_a_good_dpo_recipe_reaches_the_ranks_with_its_own_yaml(tmp_path, cache_dir, monkeypatch, capsys):
    folder = dpo_recipe(tmp_path, cache_dir)
    with pytest.raises(RanksWouldStart) as started:
        launcher_until_ranks([str(folder)], monkeypatch, capsys)
    written = yaml.safe_load((folder / "dpo.yaml").read_text())  # what the ranks are handed is that YAML's
    assert {k: started.value.settings[k] for k in written if k != "output_dir"} == {
        k: v for k, v in written.items() if k != "output_dir"}
    assert "trainer dpo" in capsys.readouterr().out


@pytest.mark.parametrize("broken, where, fragment", [
    ({"rejected": None}, 2, "`rejected` is missing or empty"),
    ({"chosen": []}, 2, "`chosen` is missing or empty"),
    ({"rejected": [{"role": "assistant", "content": "5"}]}, 2, "`chosen` and `rejected` are the same answer"),
    ({"prompt": []}, 2, "the prompt is empty"),
    ({"prompt": "   "}, 2, "the prompt is empty"),
    ({"chosen": [{"role": "assistant", "content": 5}]}, 2, "content of type int, not text"),
    ({"rejected": [{"role": "robot", "content": "6"}]}, 2, "role 'robot'"),
    ({"chosen": 5}, 2, "`chosen` is the number 5, not text. Fix: write it as text in the file, \"chosen\": \"5\""),
    ({"prompt": "What is 2 + 3?"}, 2, "chosen, rejected are chat turns but prompt plain text"),
], ids=["no-rejected", "empty-chosen", "identical", "empty-prompt", "blank-prompt", "non-string", "bad-role",
        "number", "mixed-layout"])
def test_bad_preference_pairs_are_one_line_with_file_and_line(tmp_path, cache_dir, checks, broken, where, fragment):
    rows = [GOOD, {**GOOD, **broken}, GOOD]
    folder = dpo_recipe(tmp_path, cache_dir, rows)
    res = checks([folder])
    assert_one_line_error(res, fragment)
    assert f"{tmp_path / 'pairs' / 'train.jsonl'}:{where}:" in res.stderr


def test_no_usable_pairs(tmp_path, cache_dir, checks):
    folder = dpo_recipe(tmp_path, cache_dir, max_length=4)  # every prompt fills max_length: no answer is left
    assert_one_line_error(checks([folder]), "no usable pair")


def test_an_empty_split_and_missing_columns(tmp_path, cache_dir, checks):
    folder = dpo_recipe(tmp_path, cache_dir, [])
    assert_one_line_error(checks([folder]), "train.jsonl is empty")
    sft_data = tmp_path / "sft"
    shutil.copytree(REPO / "recipes" / "tiny-cpu-lora", tmp_path / "ignored")  # any folder; the data is what matters
    from fsdp_recipes.assets.tiny_assets import ensure_assets

    shutil.copytree(ensure_assets(quiet=True)["data"], sft_data)
    assert_one_line_error(checks([folder, "--dataset_name", sft_data]), "DPO needs `prompt`, `chosen` and `rejected`")


def test_precomputed_reference_with_full_fine_tuning_is_refused(tmp_path, cache_dir, checks):
    folder = dpo_recipe(tmp_path, cache_dir)
    res = checks([folder, "--use_peft", "false", "--precompute_ref_log_probs", "true", "--use_cpu", "false"])
    assert_one_line_error(res, "precompute_ref_log_probs with full fine-tuning")


@pytest.mark.parametrize("yaml_field, fragment", [
    ({"trainer": "sft"}, "names trainer `sft`, but a recipe's sft settings live in sft.yaml"),
    ({"trainer": "ppo"}, "unknown trainer `ppo`"),
    ({"beta": 0.1, "trainer": "dpo", "packing": True}, "unknown config key `packing`"),
])
def test_trainer_kind_mistakes(tmp_path, cache_dir, checks, yaml_field, fragment):
    folder = dpo_recipe(tmp_path, cache_dir)
    raw = yaml.safe_load((folder / "dpo.yaml").read_text())
    (folder / "dpo.yaml").write_text(yaml.safe_dump({**raw, **yaml_field}))
    assert_one_line_error(checks([folder]), fragment)


def test_a_trainer_flag_against_the_recipes_file_names_the_flag_not_the_yaml(checks):
    """`--trainer dpo` on an SFT recipe said `sft.yaml names trainer dpo`, which the YAML does not."""
    assert_one_line_error(checks(["tiny-cpu-lora", "--trainer", "dpo"]),
                          "--trainer dpo on the command line asks for a dpo run of recipes/tiny-cpu-lora/sft.yaml, "
                          "whose settings are sft's. Fix: drop --trainer")
    assert_one_line_error(checks(["tiny-cpu-lora", "--trainer", "ppo"]),
                          "unknown trainer `ppo` in --trainer ppo on the command line")


def test_two_trainer_yamls_in_one_folder(tmp_path, cache_dir, checks):
    folder = dpo_recipe(tmp_path, cache_dir)
    shutil.copy(REPO / "recipes" / "tiny-cpu-lora" / "sft.yaml", folder / "sft.yaml")
    assert_one_line_error(checks([folder]), "holds sft.yaml, dpo.yaml: a recipe trains with one trainer")


def test_the_dpo_demo_without_its_sft_run_names_the_command(tmp_path, cache_dir, checks):
    res = checks(["smollm2-135m-dpo", "--model_name_or_path", tmp_path / "missing" / "merged"])
    assert_one_line_error(res, "run `make finetune RECIPE=smollm2-135m-lora` first")


def test_every_recipe_folder_has_one_trainer_yaml_matching_its_trainer():
    from fsdp_recipes.config import recipes

    names = recipes.available(REPO / "recipes")
    kinds = {}
    for name in names:
        loaded = recipes.load(REPO / "recipes" / name)
        assert loaded.config_path.name == f"{loaded.trainer}.yaml"
        kinds.setdefault(loaded.trainer, []).append(name)
    assert {"sft", "dpo"} <= set(kinds) and len(kinds["dpo"]) >= 3, kinds


def test_the_planner_counts_the_reference_model_only_for_full_fine_tuning():
    from fsdp_recipes.planning import plan

    full = plan.prepare("qwen3-8b-full-dpo", 8, 1, "H100", REPO / "recipes")
    lora = plan.prepare("llama-3.1-8b-lora-dpo", 8, 1, "H100", REPO / "recipes")
    sft = plan.prepare("qwen3-8b-full", 8, 1, "H100", REPO / "recipes")
    # Qwen3-8B (hidden 4096, 32 query and 8 key/value heads of 128, intermediate 12288, 36 layers, an untied
    # 151,936-token vocabulary): a layer holds 2*4096*4096 + 2*4096*1024 + 3*4096*12288 + 2*4096 + 2*128 weights and
    # the root unit 2*151936*4096 + 4096. In bf16: the copy sharded over 8 GPUs, plus the reference's own all-gather
    # of two layers and its root unit
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128
    root = 2 * 151936 * 4096 + 4096
    expected = (36 * layer + root) * 2 / 8 + (2 * layer + root) * 2
    assert full.budgets["FSDP"]["reference_model"] == pytest.approx(expected, rel=1e-3)
    assert lora.budgets["FSDP"]["reference_model"] == 0
    assert "reference_model" not in sft.budgets["FSDP"]
    text = plan.report(full)
    assert "reference model (dpo): a second copy of the weights" in text and "preference pairs" in text


def test_continues_from_names_the_recipe_only_for_its_output_path(tmp_path):
    from fsdp_recipes.config.model_found import check_local_model
    from fsdp_recipes.errors import UserError

    check_local_model("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-lora")  # a hub id: from_pretrained's
    with pytest.raises(UserError, match="run `make finetune RECIPE=smollm2-135m-lora` first"):
        check_local_model("runs/nowhere/merged", "smollm2-135m-lora")


def test_pairs_need_a_mistake(tmp_path, monkeypatch):
    """An SFT model that answers every training question right leaves no pair: one line, and no stamp that would call
    an empty file current."""
    from fsdp_recipes.assets import addition_preferences as prefs
    from fsdp_recipes.errors import UserError

    monkeypatch.setenv(prefs.QUESTIONS_ENV, "4,2")
    always_right = lambda model, prompts, batch_size: [  # noqa: E731
        str(sum(map(int, p[-1]["content"][8:-1].split(" + ")))) for p in prompts]
    (tmp_path / "model").mkdir()
    with pytest.raises(UserError, match="answered all 4 training questions right"):
        prefs.write(tmp_path / "model", tmp_path / "pairs", always_right, say=lambda *a: None)
    assert not (tmp_path / "pairs" / prefs.STAMP).exists()


def test_pairs_never_replace_data_they_did_not_write(tmp_path, monkeypatch, cache_dir):
    """`--dataset_name mine/` on the DPO demo, addition_preferences left on: the user's train.jsonl and test.jsonl
    were replaced by the demo's pairs and trained on, exit 0. Now one line before any answer is generated; a folder
    the demo stamped (for another model, or stopped half-way) is still rewritten."""
    from fsdp_recipes.assets import addition_preferences as prefs
    from fsdp_recipes.errors import UserError

    monkeypatch.setenv(prefs.QUESTIONS_ENV, "4,2")
    asked = []
    wrong = lambda model, prompts, batch_size: asked.append(len(prompts)) or ["0"] * len(prompts)  # noqa: E731
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "train.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    one_file = tmp_path / "pairs.jsonl"
    one_file.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    for data in (mine, one_file):
        with pytest.raises(UserError, match=f"replace what {data} holds .* Fix: --addition_preferences false"):
            prefs.ensure(str(tmp_path / "model"), str(data), wrong, quiet=True)
    assert asked == [] and sorted(p.name for p in mine.iterdir()) == ["train.jsonl"]
    assert one_file.read_text() == '{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
    ours = tmp_path / "ours"
    prefs.ensure(str(tmp_path / "model"), str(ours), wrong, quiet=True)  # absent: written
    (ours / "test.jsonl").unlink()
    (ours / prefs.STAMP).write_text('{"writing": {}}')  # stopped half-way: still the demo's, rewritten
    prefs.ensure(str(tmp_path / "model"), str(ours), wrong, quiet=True)
    assert asked == [4, 2, 4, 2] and prefs.is_current(ours, tmp_path / "model")
    # another folder of the cache (the SFT demo's two-digit-addition, which the pairs' questions are read from) and
    # a user's folder with a source.json of its own are not the demo's to replace
    sft = cache_dir / f"sft-{tmp_path.name}"
    sft.mkdir()
    (sft / "train.jsonl").write_text('{"prompt": "1 + 1", "completion": "2"}\n')
    (mine / prefs.STAMP).write_text('{"url": "https://example.org/my-pairs"}')
    for data in (sft, mine):
        with pytest.raises(UserError, match=f"replace what {data} holds"):
            prefs.ensure(str(tmp_path / "model"), str(data), wrong, quiet=True)
    assert (sft / "train.jsonl").read_text() == '{"prompt": "1 + 1", "completion": "2"}\n'
    shutil.rmtree(sft)
    # the recipes' own folder in the cache, stamped or not (a name of this test's: the session's cache is shared)
    monkeypatch.setattr(prefs, "OWN_FOLDER", f"pairs-{tmp_path.name}")
    cached = cache_dir / prefs.OWN_FOLDER
    cached.mkdir()
    (cached / "train.jsonl").write_text("{}\n")
    prefs.ensure(str(tmp_path / "model"), str(cached), wrong, quiet=True)
    assert prefs.is_current(cached, tmp_path / "model")
    shutil.rmtree(cached)


def test_every_registered_kind_provides_the_interface():
    """The registry is built from the kind modules at import: each registered kind has every member the launcher,
    checks, planner, smoke run, resume comparison, summary and run report ask for, of the right sort."""
    import dataclasses

    import trl
    from transformers import Trainer

    from fsdp_recipes.config.recipes import TRAINERS
    from fsdp_recipes.train import kinds

    assert kinds.names() == tuple(TRAINERS) and kinds.DEFAULT in kinds.names()  # config/kind_registry.py's kinds
    for name in kinds.names():
        kind = kinds.load(name)
        assert kind.name == name and kind.module.__name__ == f"fsdp_recipes.train.kinds.{name}"
        for f in dataclasses.fields(kinds.TrainerKind):
            value = getattr(kind, f.name)
            if f.type in ("Callable", "Callable | None"):
                assert value is None or callable(value), (name, f.name)
            elif f.type in ("tuple", "dict", "int", "str"):
                assert isinstance(value, {"tuple": tuple, "dict": dict, "int": int, "str": str}[f.type]), (name, f.name)
        assert kind.config_class == TRAINERS[name].config_class and hasattr(trl, kind.config_class), name  # <kind>.yaml's fields
        assert issubclass(kind.trainer_class(), Trainer), name


def test_a_kind_module_missing_a_member_fails_when_the_registry_is_built():
    from types import ModuleType

    from fsdp_recipes.train import kinds

    half = ModuleType("fsdp_recipes.train.kinds.half")
    for member in kinds.required_members():
        setattr(half, member, getattr(kinds.load("sft").module, member))
    assert kinds.TrainerKind.from_module("half", half, "SFTConfig").generation_setup(None, 80) == {}  # defaults
    del half.sequence_length
    with pytest.raises(TypeError, match=r"trainer kind half \(fsdp_recipes.train.kinds.half\) lacks sequence_length"):
        kinds.TrainerKind.from_module("half", half, "SFTConfig")


def test_no_kind_name_outside_the_kinds_folder():
    """Everything outside train/kinds/ and the registry (config/kind_registry.py) asks the registry and the kind: no
    module tests a kind's name or reads a kind's section of metrics.json by name (issue 47)."""
    import re

    from fsdp_recipes.config.kind_registry import TRAINERS

    names = "|".join(TRAINERS)
    pattern = re.compile(rf"""(["'])({names})\1|\.get\((["'])({names})\3\)|({names})_(config|args)\b""")
    found = []
    for path in sorted((REPO / "src" / "fsdp_recipes").rglob("*.py")):
        if "kinds" in path.parts or path.name == "kind_registry.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code):
                found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_a_kind_takes_the_members_it_lacks_from_the_module_it_shares_with():
    """grpo.py and rloo.py define their trainer, forwards and resume settings; the rest is sampling.py's."""
    from fsdp_recipes.train import kinds
    from fsdp_recipes.train.kinds import grpo, rloo, sampling

    for kind, module in (("grpo", grpo), ("rloo", rloo)):
        spec = kinds.load(kind)
        assert spec.check_data is sampling.check_data and spec.generation_setup is sampling.generation_setup
        assert spec.extra_forwards is module.extra_forwards and spec.RESUME_SETTINGS is module.RESUME_SETTINGS
    assert kinds.load("grpo").extra_forwards is not kinds.load("rloo").extra_forwards


# ---- issue 44: settings with which DPO would train nothing, refused before any rank starts

@pytest.mark.parametrize("fields, fragment", [
    ({"beta": 0.0}, "beta is 0: DPO's sigmoid loss scales the preference margin by beta, so its gradient is 0"),
    ({"beta": -0.1}, "beta is -0.1: DPO's sigmoid loss scales the preference margin by beta, so the rejected"),
    ({"beta": 0.0, "loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 1.0]}, "DPO's sigmoid loss scales"),
    ({"loss_type": ["sigmoid", "sft"], "loss_weights": [0.0, 0.0]}, "loss_weights [0.0, 0.0] are all 0 for loss_type "
                                                                    "['sigmoid', 'sft']"),
], ids=["beta-0", "beta-negative", "beta-0-with-sft", "weights-0"])
def test_dpo_settings_that_train_nothing_are_one_line(tmp_path, cache_dir, checks, fields, fragment):
    assert_one_line_error(checks([dpo_recipe(tmp_path, cache_dir, **fields)]), fragment)


def test_beta_0_passes_where_no_loss_it_scales_is_weighted(tmp_path):
    from trl import DPOConfig

    from fsdp_recipes.train.kinds import dpo

    for kwargs in ({"loss_type": ["sft"]}, {"loss_type": ["sigmoid", "sft"], "loss_weights": [0.0, 1.0]}):
        dpo.check_trains_something(DPOConfig(output_dir=str(tmp_path), beta=0.0, use_cpu=True, **kwargs))


def test_labelled_answers_given_to_dpo_point_at_kto_not_sft():
    """A new user's prompt/completion/label rows under a DPO recipe were told to use an SFT recipe, which would train
    on the answers labelled bad too."""
    from datasets import Dataset

    from fsdp_recipes.errors import UserError
    from fsdp_recipes.train.kinds import dpo

    labelled = Dataset.from_dict({"prompt": ["2+2?"], "completion": ["5"], "label": [False]})
    with pytest.raises(UserError, match=r"Fix: rename the columns, or use a KTO recipe for these labelled answers"):
        dpo.check_columns(labelled, "rows.jsonl")
    with pytest.raises(UserError, match=r"or use an SFT recipe for this data\.$"):
        dpo.check_columns(labelled.remove_columns("label"), "rows.jsonl")
