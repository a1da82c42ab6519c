"""A local model of another family than the recipe's (issue 42, item 5): a tiny random Qwen2 built here, saved with
save_pretrained beside the tiny tokenizer. FSDP's wrap class comes from the model when accelerate.yaml names none,
can be given on the command line, and a wrong one names both fixes; `make smoke` builds its tiny model from the
recipe's real model; a model that is not there is one line before any process starts. All in this process, up to
the ranks (conftest's launcher_checks / launcher_until_ranks): nothing here trains."""

import importlib
import json
import os
import shutil

import pytest
import yaml

from conftest import REPO, RanksWouldStart, launcher_checks, launcher_until_ranks

QWEN_LAYERS = 3  # not the smoke run's 2 nor the tiny Mistral's 4: a count only this model has
WRAP = "fsdp_transformer_layer_cls_to_wrap"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, cache_dir):
    """A tiny random Qwen2ForCausalLM with the tiny tokenizer (its chat template too), as a user's local folder."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("models") / "qwen"
    tokenizer = AutoTokenizer.from_pretrained(cache_dir / "tiny-mistral")
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=QWEN_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def copied(name: str, tmp_path, wrap: str | None = None, **sft):
    """recipes/<name> copied, its accelerate.yaml's wrap class set to `wrap` (None: the key removed) and its trainer
    YAML's fields `sft` set, as a user edits a copy."""
    folder = tmp_path / name
    shutil.copytree(REPO / "recipes" / name, folder)
    acc = yaml.safe_load((folder / "accelerate.yaml").read_text())
    acc["fsdp_config"].pop(WRAP)
    if wrap:
        acc["fsdp_config"][WRAP] = wrap
    (folder / "accelerate.yaml").write_text(yaml.safe_dump(acc))
    config = next(folder.glob("sft.yaml"))
    config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), **sft}))
    return folder


def until_ranks(args, monkeypatch, capsys):
    """The `accelerate launch` command the launcher would start and what it printed: every check passed."""
    with pytest.raises(RanksWouldStart) as started:
        launcher_until_ranks([str(a) for a in args], monkeypatch, capsys)
    return started.value.cmd, capsys.readouterr().out


def one_line(res) -> str:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr and "Fix:" in lines[0]
    return lines[0]


def test_without_a_wrap_class_fsdp_wraps_the_models_own_layers(qwen, tmp_path, monkeypatch, capsys):
    folder = copied("tiny-cpu-lora", tmp_path, wrap=None, model_name_or_path=str(qwen))
    cmd, out = until_ranks([folder, "--output_dir", tmp_path / "run"], monkeypatch, capsys)
    assert (f"[launch] FSDP wraps each Qwen2DecoderLayer ({QWEN_LAYERS} of them) in Qwen2ForCausalLM: its own layer "
            f"classes (its _no_split_modules), which accelerate takes where {folder}/accelerate.yaml sets no "
            f"{WRAP}") in out.splitlines()
    assert f"--{WRAP}" not in cmd  # accelerate falls back by itself: nothing is added to its command


def test_the_wrap_class_given_on_the_command_line(qwen, tmp_path, monkeypatch, capsys):
    """The copy still names the Mistral class; the command line's class wins, in the checks and in accelerate."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    folder = copied("tiny-cpu-lora", tmp_path, wrap="MistralDecoderLayer", model_name_or_path=str(qwen))
    cmd, out = until_ranks([folder, f"--{WRAP}", "Qwen2DecoderLayer", "--output_dir", tmp_path / "run"],
                           monkeypatch, capsys)
    assert (f"[launch] FSDP wraps each Qwen2DecoderLayer ({QWEN_LAYERS} of them) in Qwen2ForCausalLM, as --{WRAP} "
            "on the command line says") in out.splitlines()
    entry = cmd.index("fsdp_recipes.train.entry")
    assert f"--{WRAP}" not in cmd[entry:]  # not a recipe field: the ranks' parser never sees it
    args = launch_command_parser().parse_args(cmd[2:entry - 1] + ["-m", "x"])  # accelerate's own reading
    _validate_launch_command(args)
    assert args.fsdp_transformer_layer_cls_to_wrap == "Qwen2DecoderLayer"  # over the config file's Mistral class


def test_a_wrong_wrap_class_offers_both_fixes(qwen, tmp_path, monkeypatch, capsys):
    folder = copied("tiny-cpu-lora", tmp_path, wrap="MistralDecoderLayer", model_name_or_path=str(qwen))
    line = one_line(launcher_checks([str(folder), "--output_dir", str(tmp_path / "run")], monkeypatch, capsys))
    assert line == (f"error: {WRAP} in {folder}/accelerate.yaml is MistralDecoderLayer, which Qwen2ForCausalLM does "
                    "not have, so FSDP could not wrap its layers. Fix: set it to Qwen2DecoderLayer (for one run: "
                    f"--{WRAP} Qwen2DecoderLayer on the command line), or remove the key: the pack then wraps "
                    "Qwen2ForCausalLM's own layer classes (Qwen2DecoderLayer, its _no_split_modules).")
    line = one_line(launcher_checks([str(folder), f"--{WRAP}", "LlamaDecoderLayer", "--output_dir",
                                     str(tmp_path / "run")], monkeypatch, capsys))
    assert line.startswith(f"error: --{WRAP} on the command line is LlamaDecoderLayer, which Qwen2ForCausalLM")
    assert f"Fix: pass --{WRAP} Qwen2DecoderLayer instead, or leave the option out" in line


def test_the_wrap_class_option_needs_a_config_that_wraps_by_class(tmp_path, monkeypatch, capsys, cache_dir):
    line = one_line(launcher_checks(["ddp-baseline", f"--{WRAP}", "Qwen3DecoderLayer"], monkeypatch, capsys))
    assert f"--{WRAP} applies to FSDP wrapping by layer class" in line and "distributed_type MULTI_GPU" in line


def smoke_until_ranks(args, monkeypatch, capsys):
    monkeypatch.setenv("FSDP_RECIPES_SMOKE", "1")
    return until_ranks(args, monkeypatch, capsys)


def test_smoke_builds_the_recipes_model_not_its_stale_copy(qwen, tmp_path, monkeypatch, capsys, cache_dir):
    """llama-3.1-8b-lora copied and pointed at the Qwen2 folder: its model_config.json is still Llama's."""
    folder = copied("llama-3.1-8b-lora", tmp_path, wrap=None, model_name_or_path=str(qwen))
    cmd, out = smoke_until_ranks([folder, "--output_dir", tmp_path / "run"], monkeypatch, capsys)
    tiny = json.loads((cache_dir / "smoke" / folder.name / "config.json").read_text())
    assert tiny["architectures"] == ["Qwen2ForCausalLM"] and tiny["num_hidden_layers"] == 2
    assert f"[smoke] model: {qwen} (Qwen2ForCausalLM, its own config.json {qwen}/config.json)" in out
    assert "[launch] FSDP wraps each Qwen2DecoderLayer (2 of them) in Qwen2ForCausalLM" in out
    assert f"[smoke] accelerate: {folder}/accelerate.yaml with 8 process(es)" in out  # not recipes/<name>/...
    stale = copied("llama-3.1-8b-lora", tmp_path / "stale", wrap="LlamaDecoderLayer", model_name_or_path=str(qwen))
    monkeypatch.setenv("FSDP_RECIPES_SMOKE", "1")
    line = one_line(launcher_checks([str(stale), "--output_dir", str(tmp_path / "run")], monkeypatch, capsys))
    assert "is LlamaDecoderLayer, which Qwen2ForCausalLM does not have" in line
    assert "Fix: set it to Qwen2DecoderLayer" in line  # not back to the Llama class the copy's config names


@pytest.fixture
def no_hub(tmp_path):
    """A machine without network or hub cache: HF_HUB_OFFLINE=1 and an empty HF_HOME. huggingface_hub reads both
    when it is imported, so its constants are read again now and again after the test."""
    from huggingface_hub import constants

    keys = ("HF_HUB_OFFLINE", "HF_HOME", "HF_HUB_CACHE", "TRANSFORMERS_OFFLINE")
    saved = {k: os.environ.get(k) for k in keys}
    for k in keys:
        os.environ.pop(k, None)
    home = tmp_path / "hf-home"
    home.mkdir()
    os.environ.update(HF_HUB_OFFLINE="1", HF_HOME=str(home))
    importlib.reload(constants)
    yield home
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    importlib.reload(constants)


def cached_hub_model(home, repo_id: str, config_json: str) -> None:
    """`repo_id`'s config.json in the hub cache under `home`, laid out as huggingface_hub keeps it."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text(config_json)


def test_smoke_of_a_hub_id_uses_its_cached_config_else_refuses_the_stale_copy(qwen, no_hub, tmp_path, monkeypatch,
                                                                               capsys, cache_dir):
    folder = copied("llama-3.1-8b-lora", tmp_path, wrap=None, model_name_or_path="someorg/qwen-tiny")
    monkeypatch.setenv("FSDP_RECIPES_SMOKE", "1")
    line = one_line(launcher_checks([str(folder), "--output_dir", str(tmp_path / "run")], monkeypatch, capsys))
    assert line.startswith(f"error: {folder}/model_config.json is the config of meta-llama/Llama-3.1-8B-Instruct, "
                           "but the recipe trains someorg/qwen-tiny, which is not here")
    cached_hub_model(no_hub, "someorg/qwen-tiny", (qwen / "config.json").read_text())
    cmd, out = smoke_until_ranks([folder, "--output_dir", tmp_path / "run"], monkeypatch, capsys)
    tiny = json.loads((cache_dir / "smoke" / folder.name / "config.json").read_text())
    assert tiny["architectures"] == ["Qwen2ForCausalLM"]
    assert "[smoke] model: someorg/qwen-tiny (Qwen2ForCausalLM, its own config.json " in out


@pytest.mark.parametrize("model, says", [
    ("./models/qwen", "error: model not found: ./models/qwen does not exist ({cwd}/models/qwen; a relative path is "
                      "taken from the folder the command runs in, not from the recipe's folder)"),
    ("models/qwen", "error: model not found: there is no folder models/qwen here ({cwd}/models/qwen; a relative path "
                    "is taken from the folder the command runs in, not from the recipe's folder), and as a hub id it "
                    "is not in the hub cache ({home}/hub), and HF_HUB_OFFLINE is set. Fix: point "
                    "model_name_or_path at the model's folder"),
    ("someorg/qwen-tiny", "error: model not found: there is no folder someorg/qwen-tiny here"),
], ids=["dot-relative-path", "relative-path", "hub-id"])
def test_a_model_that_is_not_there_is_one_line_before_any_process(model, says, no_hub, tmp_path, monkeypatch,
                                                                   capsys, cache_dir):
    """With the ranks started before the checks (the launcher's default): the line comes before they would start.
    The launcher runs in the repository (launcher_until_ranks), where neither path exists."""
    res = launcher_until_ranks(["tiny-cpu-lora", "--model_name_or_path", model, "--output_dir",
                                str(tmp_path / "run")], monkeypatch, capsys, checks_first=False)
    assert one_line(res).startswith(says.format(cwd=REPO, home=no_hub))


def test_a_cached_hub_id_passes_and_is_checked_from_its_config(qwen, no_hub, tmp_path, monkeypatch, capsys):
    """Offline, a hub id in the cache is found: its config.json, not the recipe's copy, decides the wrap class (the
    recipe's Mistral class gives way to the Qwen2's own: the model is named on the command line)."""
    cached_hub_model(no_hub, "someorg/qwen-tiny", (qwen / "config.json").read_text())
    folder = copied("tiny-cpu-lora", tmp_path, wrap="MistralDecoderLayer")
    cmd, out = until_ranks([folder, "--model_name_or_path", "someorg/qwen-tiny", "--output_dir", tmp_path / "run"],
                           monkeypatch, capsys)
    assert f"[launch] FSDP wraps each Qwen2DecoderLayer ({QWEN_LAYERS} of them) in Qwen2ForCausalLM, the model on the " \
           "command line" in out
    assert cmd[cmd.index(f"--{WRAP}") + 1] == "Qwen2DecoderLayer"


def fsdp2(wrap: str | None = None) -> dict:
    """The FSDP2 config the recipes use, wrapping by layer class: `wrap` named, or (None) the key left out."""
    fsdp = {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
    return {"distributed_type": "FSDP", "fsdp_config": {**fsdp, **({WRAP: wrap} if wrap else {})}}


def test_classes_accelerate_would_not_find_are_one_line(qwen):
    """Checked on meta-device models, as the launcher does: a space after a comma (accelerate splits the value at
    commas and keeps the space), and a model whose _no_split_modules names a class it does not contain (Gemma 3's
    multimodal class lists Siglip's SiglipTextEmbeddings, which it does not build), where accelerate's fallback
    would raise in every rank."""
    from transformers import Gemma3Config

    from fsdp_recipes.config import model_check
    from fsdp_recipes.errors import UserError

    model = model_check.meta_model(model_check.load_config(qwen / "config.json"))
    with pytest.raises(UserError, match="Fix: write it as Qwen2DecoderLayer,Qwen2RMSNorm."):
        model_check.check_wrap_classes(model, fsdp2("Qwen2DecoderLayer, Qwen2RMSNorm"), "acc.yaml")
    line, warning, _ = model_check.check_wrap_classes(model, fsdp2("Qwen2DecoderLayer,Qwen2RMSNorm"), "acc.yaml")
    assert not warning and line.startswith(f"FSDP wraps each Qwen2DecoderLayer ({QWEN_LAYERS} of them) and each "
                                           f"Qwen2RMSNorm ({2 * QWEN_LAYERS + 1} of them) in Qwen2ForCausalLM")
    small = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, vocab_size=64)
    gemma = model_check.meta_model(Gemma3Config(text_config=small, vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
        patch_size=14), mm_tokens_per_image=4))
    with pytest.raises(UserError, match="has no SiglipTextEmbeddings module") as refused:
        model_check.check_wrap_classes(gemma, fsdp2(), "acc.yaml")
    assert (f"Fix: set {WRAP}: Gemma3DecoderLayer,SiglipEncoderLayer,SiglipMultiheadAttentionPoolingHead,"
            "SiglipVisionEmbeddings in acc.yaml.") in str(refused.value)


def test_a_model_named_on_the_command_line_gets_its_own_wrap_class(qwen, tmp_path, monkeypatch, capsys):
    """`make finetune ARGS="--model_name_or_path <a local Qwen2>"`: the recipe's accelerate.yaml names a class
    written for its own model (tiny-cpu-lora: MistralDecoderLayer; the default: LlamaDecoderLayer), which the Qwen2
    lacks. The model's own layer classes are wrapped instead (its _no_split_modules: what accelerate takes where no
    class is named), said on the [launch] line and passed to accelerate launch. With the checks overlapping the
    ranks' imports (the default), the ranks were started with the recipe's command before the checks chose: they
    are stopped and started again after the checks, with the class. The recipe's own model, and a class written on
    the command line (test_a_wrong_wrap_class_offers_both_fixes), stay refused."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    from fsdp_recipes.launch import launcher

    started = []

    class Ranks:  # launch/ranks.py's, as far as the launcher uses it here
        def __init__(self, cmd, torchrun_logs, gated=True):
            self.cmd, self.gated, self.aborted = cmd, gated, False
            shutil.rmtree(torchrun_logs, ignore_errors=True)
            started.append(self)

        def abort(self):
            self.aborted = True

        def release(self, log_dir):
            raise RanksWouldStart(self.cmd)

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("FSDP_RECIPES_OVERLAP_CHECKS", "1")
    monkeypatch.setattr(launcher, "Ranks", Ranks)
    saved = dict(os.environ)
    try:
        with pytest.raises(RanksWouldStart):
            launcher.main(["tiny-cpu-lora", "--model_name_or_path", str(qwen), "--output_dir", str(tmp_path / "run")])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    out = capsys.readouterr().out.splitlines()
    assert (f"[launch] FSDP wraps each Qwen2DecoderLayer ({QWEN_LAYERS} of them) in Qwen2ForCausalLM, the model on "
            f"the command line: its own layer classes (its _no_split_modules), since recipes/tiny-cpu-lora/"
            f"accelerate.yaml names MistralDecoderLayer, written for the recipe's model, which Qwen2ForCausalLM does "
            f"not have (accelerate launch gets --{WRAP} Qwen2DecoderLayer)") in out, out
    assert f"[launch] the ranks started before the checks stop; they start again with --{WRAP} Qwen2DecoderLayer" \
        in out
    first, second = started
    assert first.gated and first.aborted and f"--{WRAP}" not in first.cmd
    assert not second.gated and not second.aborted
    entry = second.cmd.index("fsdp_recipes.train.entry")
    args = launch_command_parser().parse_args(second.cmd[2:entry - 1] + ["-m", "x"])  # accelerate's own reading
    _validate_launch_command(args)
    assert args.fsdp_transformer_layer_cls_to_wrap == "Qwen2DecoderLayer"  # over the config file's Mistral class

    # the same model written in the recipe's own YAML and named again on the command line: the recipe's own
    folder = copied("tiny-cpu-lora", tmp_path / "own", wrap="MistralDecoderLayer", model_name_or_path=str(qwen))
    line = one_line(launcher_checks([str(folder), "--model_name_or_path", str(qwen), "--output_dir",
                                     str(tmp_path / "run")], monkeypatch, capsys))
    assert "is MistralDecoderLayer, which Qwen2ForCausalLM does not have" in line


def test_lora_targets_that_match_nothing_list_what_lora_can_target(qwen):
    """The list the fix points at: GPT-2's projections are transformers' Conv1D (c_attn, c_fc, c_proj), which PEFT
    targets like Linear layers (its all-linear takes both), and the LM head is left out (a LoRA on it is refused
    before launch: check_lora_on_output_layer). It listed `lm_head` alone for GPT-2, the one name refused next."""
    from transformers import GPT2Config
    from trl import ModelConfig

    from fsdp_recipes.config import model_check
    from fsdp_recipes.errors import UserError

    gpt2 = model_check.meta_model(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=64))
    qwen2 = model_check.meta_model(model_check.load_config(qwen / "config.json"))
    lora = ModelConfig(use_peft=True, lora_target_modules=["q_proj", "v_proj"])
    with pytest.raises(UserError) as refused:
        model_check.check_recipe_fits_model(gpt2, fsdp2(), "acc.yaml", lora)
    assert "match no module of GPT2LMHeadModel (its linear layers: c_attn, c_fc, c_proj). Fix:" in str(refused.value)
    lora = ModelConfig(use_peft=True, lora_target_modules=["qkv", "v_proj"])
    with pytest.raises(UserError) as refused:
        model_check.check_recipe_fits_model(qwen2, fsdp2(), "acc.yaml", lora)
    assert ("['qkv'] match no module of Qwen2ForCausalLM (its linear layers: down_proj, gate_proj, k_proj, o_proj, "
            "q_proj, up_proj, v_proj). Fix:") in str(refused.value)  # its untied lm_head left out


def test_a_model_without_no_split_modules_gets_its_layer_class_named_in_the_fix():
    """BioGPT lists no _no_split_modules: the fix said `<its decoder layer class>`, a placeholder to look up."""
    from transformers import AutoConfig

    from fsdp_recipes.config import model_check
    from fsdp_recipes.errors import UserError

    config = AutoConfig.for_model("biogpt", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64)
    model = model_check.meta_model(config)
    assert not getattr(model, "_no_split_modules", None)  # the premise, transformers' own
    with pytest.raises(UserError) as refused:
        model_check.check_wrap_classes(model, fsdp2("NoSuchLayer"), "acc.yaml")
    assert "set it to BioGptDecoderLayer" in str(refused.value), refused.value
