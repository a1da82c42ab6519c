"""The architecture matrix's pure parts (scripts/arch_matrix.py, scripts/arch_families.py), in process: its family
table, its driver's bookkeeping; and the pack's refusals it found, each one line with its fix. The matrix itself is
`make arch-matrix` (one 2-process launch, outside make test)."""

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fsdp_recipes.errors import UserError

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


families, matrix = load("arch_families"), load("arch_matrix")


class Tokenizer:  # what build_config reads of the tiny recipe's tokenizer
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 3

    def __len__(self):
        return 390


def test_each_family_builds_its_own_config_class_with_its_quirks_kept():
    assert len(families.FAMILIES) >= 10 and len({f.name for f in families.FAMILIES}) == len(families.FAMILIES)
    for family in families.FAMILIES:
        config = families.build_config(family, Tokenizer())
        assert config.model_type == family.model_type, family.name
        assert (config.vocab_size, config.pad_token_id) == (390, 3), family.name
        for key, value in family.quirks.items():  # gpt2's n_embd is its hidden_size: getattr follows attribute_map
            assert getattr(config, key) == value, f"{family.name}: {key}"
        if family.model_type != "gpt2":
            assert (config.num_hidden_layers, config.hidden_size) == (2, 64), family.name


def test_a_named_wrap_class_is_there_only_where_the_models_own_list_names_a_missing_class():
    import torch
    from transformers import AutoModelForCausalLM

    named = [f for f in families.FAMILIES if "fsdp_transformer_layer_cls_to_wrap" in f.fsdp]
    assert [f.name for f in named] == ["qwen3.5"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(families.build_config(named[0], Tokenizer()))
    classes = {type(m).__name__ for m in model.modules()}
    assert "Qwen3_5VisionBlock" in model._no_split_modules and "Qwen3_5VisionBlock" not in classes
    assert named[0].fsdp["fsdp_transformer_layer_cls_to_wrap"] in classes


def test_an_unknown_family_is_one_line_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"^no family named lama\. Fix: name one of llama, mistral, qwen2"):
        families.by_name(["lama"])
    assert matrix.main(["--families", "lama"]) == 2


@pytest.mark.parametrize("cases, said", [
    ("mixtral", "error: case 'mixtral' is not family:method. Fix: --cases family:method,... (e.g. mixtral:lora)"),
    ("llama:lora,:full", "error: case ':full' is not family:method. Fix: --cases family:method,... (e.g. llama:lora)"),
    ("mixtral-experts:full", "error: mixtral-experts runs no 'full' case. Fix: mixtral-experts:<one of lora>"),
    ("lama:lora", "error: no family named lama. Fix: name one of llama,"),
])
def test_a_malformed_case_is_one_line_naming_the_form(cases, said, capsys):
    assert matrix.main(["--cases", cases]) == 2
    err = capsys.readouterr().err
    assert err.startswith(said) and len(err.strip().splitlines()) == 1, err


def test_a_refused_case_is_listed_with_its_reason_and_not_launched(tmp_path, monkeypatch):
    refused = families.Family("x", "llama", refused={"full": "upstream U cannot, and says so"})
    assert families.refusal_line(refused, "full") == "x full: refused: upstream U cannot, and says so"
    monkeypatch.setattr(families, "FAMILIES", (refused,))
    launched = []
    monkeypatch.setattr(matrix, "run_launch", lambda out, todo, attempt: launched.append(todo) or 0)
    monkeypatch.setattr(matrix, "collect", lambda out, attempt, code: [
        matrix.row(refused, "lora", "pass", 1.0, "ok")])
    assert matrix.main(["--out", str(tmp_path / "m"), "--families", "x"]) == 0
    assert launched == [["x:lora"]]  # the refused method never reaches a launch
    results = json.loads((tmp_path / "m" / "results.json").read_text())
    assert [(r["method"], r["outcome"]) for r in results] == [("lora", "pass"), ("full", "refused")]


def test_a_case_that_failed_on_one_rank_is_named_and_the_next_launch_takes_the_rest(tmp_path, monkeypatch, capsys):
    """A rank that fails alone leaves its error file; that launch ended, the next one gets the cases after it."""
    monkeypatch.setattr(families, "FAMILIES", (families.Family("a", "llama"), families.Family("b", "llama")))
    out, launched = tmp_path / "m", []

    def run_launch(out_dir, todo, attempt):
        launched.append(todo)
        if attempt == 1:  # a:lora passes, a:full fails on rank 1 alone
            (out_dir / "results1.json").write_text(json.dumps([{"family": "a", "method": "lora", "outcome": "pass",
                                                               "seconds": 1.0, "reason": "ok"}]))
            (out_dir / "error.rank1.json").write_text(json.dumps({"family": "a", "method": "full", "rank": 1,
                                                                 "reason": "rank 1: RuntimeError: boom"}))
            return 1
        (out_dir / f"results{attempt}.json").write_text(json.dumps(
            [{"family": "b", "method": m, "outcome": "pass", "seconds": 1.0, "reason": "ok"} for m in ("lora", "full")]))
        return 0

    monkeypatch.setattr(matrix, "run_launch", run_launch)
    assert matrix.main(["--out", str(out), "--families", "a,b"]) == 1
    assert launched == [["a:lora", "a:full", "b:lora", "b:full"], ["b:lora", "b:full"]]
    table = capsys.readouterr().out
    assert "a      full   fail       0.0  rank 1: RuntimeError: boom (rank 1 alone: launch 1 was ended)" in table
    assert table.strip().endswith("arch-matrix: 3 passed, 1 failed, 0 refused in 0 s")


def test_a_launch_that_ends_before_its_first_case_fails_the_rest_once(tmp_path, monkeypatch):
    monkeypatch.setattr(families, "FAMILIES", (families.Family("a", "llama"),))
    calls = []
    monkeypatch.setattr(matrix, "run_launch", lambda out, todo, attempt: calls.append(attempt) or 1)
    assert matrix.main(["--out", str(tmp_path / "m"), "--families", "a"]) == 1
    results = json.loads((tmp_path / "m" / "results.json").read_text())
    assert calls == [1] and {r["outcome"] for r in results} == {"fail"}
    assert results[0]["reason"].startswith("not run: launch 1 ended (exit code 1) before any case; ")


def test_each_family_gets_a_recipe_folder_with_its_fsdp_settings(tmp_path):
    from fsdp_recipes.config import recipes

    chosen = families.by_name(["llama", "deepseek-v3"])
    matrix.write_recipes(tmp_path, chosen, steps=3)
    llama, deepseek = (recipes.load(tmp_path / "recipes" / f.name) for f in chosen)
    assert "fsdp_transformer_layer_cls_to_wrap" not in llama.accelerate["fsdp_config"]  # the model's own list
    assert llama.accelerate["fsdp_config"]["fsdp_cpu_ram_efficient_loading"] is True
    assert deepseek.accelerate["fsdp_config"]["fsdp_cpu_ram_efficient_loading"] is False
    assert llama.raw["model_name_or_path"] == str(tmp_path / "models" / "llama")


def test_the_expert_lora_cases_run_lora_only_with_the_router_frozen_and_pass_the_launchers_check():
    """LoRA on the fused experts (PEFT's target_parameters) of Qwen3-MoE and Mixtral: the matrix trains it under
    FSDP2 and checks each merged expert by hand (arch_families.expert_merge)."""
    from trl import ModelConfig

    from fsdp_recipes.config import expert_lora

    args = SimpleNamespace(families="qwen3-moe-experts,mixtral-experts,qwen3-moe", methods="lora,full")
    assert [(f.name, m) for f, m in matrix.cases(args)] == [
        ("qwen3-moe-experts", "lora"), ("mixtral-experts", "lora"), ("qwen3-moe", "lora"), ("qwen3-moe", "full")]
    for name in ("qwen3-moe-experts", "mixtral-experts"):
        family = families.by_name([name])[0]
        flags = " ".join(family.args).split("--")[1:]
        lora = {flag.split()[0]: flag.split()[1:] for flag in flags}
        assert lora["lora_target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        assert "gate" not in lora["lora_target_modules"]  # the router (mlp.gate) is not named
        model_args = ModelConfig(use_peft=True, lora_dropout=matrix.recipe(Path("o"), family, 3)["lora_dropout"], **lora)
        expert_lora.check(meta_model(name), matrix.accelerate_config(), "r/accelerate.yaml", model_args)


def test_the_matrixs_expert_merge_check_fails_on_a_merge_that_dropped_the_experts_deltas(tmp_path):
    import shutil

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    family = families.by_name(["qwen3-moe-experts"])[0]
    base, run = tmp_path / "base", tmp_path / "run"
    model = AutoModelForCausalLM.from_config(families.build_config(family, Tokenizer()))
    model.save_pretrained(base)
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj"],
                                                  target_parameters=["mlp.experts.gate_up_proj",
                                                                     "mlp.experts.down_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    peft_model.save_pretrained(run)
    peft_model.merge_and_unload().save_pretrained(run / "merged")
    assert families.expert_merge(base, run, matrix.ATOL).startswith("16 experts = base + B@A within ")
    shutil.rmtree(run / "merged")
    shutil.copytree(base, run / "merged")  # the experts' deltas dropped
    with pytest.raises(AssertionError, match=r"expert 0: merged differs from base \+ LoRA by "):
        families.expert_merge(base, run, matrix.ATOL)


def test_the_head_method_trains_the_lm_head_of_the_tied_families_only(tmp_path, monkeypatch):
    """`head` (issue 61): LoRA with lora_modules_to_save [lm_head], on the families whose table entry ties the head
    to the input embedding, the case that failed in every rank's FSDP2 setup."""
    chosen = "llama,qwen2,gemma2,phi3,gpt2"
    got = [(f.name, m) for f, m in matrix.cases(SimpleNamespace(families=chosen, methods="lora,full,head"))]
    assert [c for c in got if c[1] == "head"] == [("qwen2", "head"), ("gemma2", "head")]
    assert {f.name for f in families.FAMILIES if families.tied(f)} >= {"qwen2", "qwen3", "gemma2", "smollm3"}
    for var in matrix.FSDP_ENV.values():  # case_settings sets accelerate's variables for the case
        monkeypatch.delenv(var, raising=False)
    qwen2 = families.by_name(["qwen2"])[0]
    matrix.write_recipes(tmp_path, [qwen2], steps=3)
    settings = matrix.case_settings(qwen2, "head", tmp_path, {})
    assert settings[:2] == ["--use_peft", "true"] and "--lora_modules_to_save" in settings
    assert settings[settings.index("--lora_modules_to_save") + 1] == "lm_head"
    assert "--lora_modules_to_save" not in matrix.case_settings(qwen2, "lora", tmp_path, {})


# ---- the pack's refusals the matrix found -------------------------------------------------------------------------

def meta_model(name: str):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(families.build_config(families.by_name([name])[0], Tokenizer()))


def test_ram_efficient_fsdp2_loading_of_a_model_with_buffers_is_refused_with_its_fix():
    from fsdp_recipes.speed.ram_efficient_loading import check_model as check_buffers_under_ram_efficient_loading

    acc = matrix.accelerate_config()
    with pytest.raises(UserError) as err:
        check_buffers_under_ram_efficient_loading(meta_model("deepseek-v3"), acc, "r/accelerate.yaml")
    assert str(err.value) == (
        "r/accelerate.yaml: fsdp_cpu_ram_efficient_loading fails under FSDP2 for DeepseekV3ForCausalLM, whose weights "
        "include 1 buffer(s) (model.layers.1.mlp.gate.e_score_correction_bias): accelerate 1.15 loads every entry as a "
        "sharded parameter (accelerate issue 3898). Fix: set fsdp_cpu_ram_efficient_loading: false in "
        "r/accelerate.yaml.")
    check_buffers_under_ram_efficient_loading(meta_model("deepseek-v3"), matrix.accelerate_config(
        {"fsdp_cpu_ram_efficient_loading": False}), "r/accelerate.yaml")
    check_buffers_under_ram_efficient_loading(meta_model("gemma2"), acc, "r/accelerate.yaml")  # tied, no buffers


def sft_cfg(folder: Path, coef=None):
    return SimpleNamespace(model=SimpleNamespace(model_name_or_path=str(folder)),
                           training=SimpleNamespace(router_aux_loss_coef=coef))


def config_folder(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    families.build_config(families.by_name([name])[0], Tokenizer()).save_pretrained(folder)
    return folder


def test_sft_refuses_llama4_in_one_line(tmp_path):
    from fsdp_recipes.train.kinds import sft

    with pytest.raises(UserError, match=r"is a Llama 4 model \(Llama4TextConfig\), which TRL 1\.16's SFTTrainer "
                                        r"cannot train: .*Fix: none in these releases; train another family\.$"):
        sft.check_config(sft_cfg(config_folder(tmp_path, "llama4-text")))


def test_sft_refuses_trls_load_balancing_loss_where_the_config_has_no_num_experts(tmp_path):
    from fsdp_recipes.train.kinds import sft

    granite = config_folder(tmp_path, "granite-moe")
    with pytest.raises(UserError, match=r"router_aux_loss_coef 0\.001\) and asks its config for num_experts, which "
                                        r"GraniteMoeConfig does not have .* Fix: router_aux_loss_coef: 0\.0 in the "
                                        r"recipe"):
        sft.check_config(sft_cfg(granite))
    sft.check_config(sft_cfg(granite, coef=0.0))  # the fix
    sft.check_config(sft_cfg(config_folder(tmp_path, "qwen3-moe")))  # names num_experts: TRL's loss works
    sft.check_config(sft_cfg(tmp_path / "hub/id"))  # no config.json here: nothing to check offline


def test_a_launch_that_hung_in_a_case_fails_that_case_and_goes_on(tmp_path, monkeypatch):
    """No rank raised (a hang that the case's watchdog ended): the case rank 0 had started is the one that failed."""
    monkeypatch.setattr(families, "FAMILIES", (families.Family("a", "llama"),))
    launched = []

    def run_launch(out_dir, todo, attempt):
        launched.append(todo)
        if attempt == 1:
            (out_dir / "current1.json").write_text(json.dumps({"family": "a", "method": "lora"}))
            return 1
        (out_dir / "results2.json").write_text(json.dumps([{"family": "a", "method": "full", "outcome": "pass",
                                                           "seconds": 1.0, "reason": "ok"}]))
        return 0

    monkeypatch.setattr(matrix, "run_launch", run_launch)
    assert matrix.main(["--out", str(tmp_path / "m"), "--families", "a"]) == 1
    assert launched == [["a:lora", "a:full"], ["a:full"]]
    results = json.loads((tmp_path / "m" / "results.json").read_text())
    assert results[0]["reason"].startswith("launch 1 ended in this case (exit code 1): ")
    assert [r["outcome"] for r in results] == ["fail", "pass"]


@pytest.mark.parametrize("name, layers", [("gpt-neox", "gpt_neox.layers"), ("opt", "model.decoder.layers")])
def test_the_families_outside_model_layers_keep_their_own_config_names(name, layers):
    """GPT-NeoX (a new-user trial's family: the planner and the smoke run stopped on it) and OPT keep their decoder
    layers outside model.layers and have no num_key_value_heads: the matrix's config does not add one (unused, it
    would tell the planner and the launcher's mesh checks of GQA the model does not have), nor OPT an unused
    intermediate_size (its MLP's width is ffn_dim)."""
    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_recipes import decoder

    family = families.by_name([name])[0]
    config = families.build_config(family, Tokenizer())
    assert not {"num_key_value_heads", "head_dim"} & config.to_dict().keys()
    assert decoder.kv_heads(config) == config.num_attention_heads == 4
    assert decoder.intermediate(config) == 128
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert decoder.layers(model)[0] == layers
