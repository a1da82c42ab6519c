"""The planner on decoder families the recipes do not use. A new-user trial planned a copy of a recipe pointed at a
GPT-NeoX model and got a traceback (`'GPTNeoXForCausalLM' object has no attribute 'model'`): the planner read the
layers from model.model.layers and the widths from Llama's config names. GPT-NeoX keeps its layers in gpt_neox.layers,
GPT-2 and Falcon in transformer.h (GPT-2's linears are Conv1D), OPT in model.decoder.layers; none of them has
num_key_value_heads, and GPT-2, OPT and Falcon name their MLP's width otherwise. Each tiny model's counts are checked
against the model itself with PEFT's LoRA applied, never against the planner's functions."""

from types import SimpleNamespace

import pytest

from conftest import REPO
from fsdp_recipes import decoder
from fsdp_recipes.planning import memory_budget

# model_type -> (its config's settings, where its layers are, its hidden width, its key/value width, its MLP's width,
# LoRA targets by name): the widths by hand from the settings (4 heads of 64 / 4 = 16)
FAMILIES = {
    "gpt_neox": (dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4),
                 "gpt_neox.layers", 64, 64, 256, ["query_key_value", "dense"]),
    # n_inner None: 4 x 64; c_attn, c_proj, c_fc are Conv1D (weight stored in x out)
    "gpt2": (dict(n_embd=64, n_layer=2, n_head=4, n_positions=128), "transformer.h", 64, 64, 256, ["c_attn", "c_fc"]),
    "opt": (dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64),
            "model.decoder.layers", 64, 64, 128, ["q_proj", "v_proj", "fc1"]),
    # Falcon 7B's multi-query attention (the default): one key/value head of 16; ffn_hidden_size unset: 4 x 64
    "falcon": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4), "transformer.h", 64, 16, 256,
               ["query_key_value", "dense_h_to_4h"]),
    "llama": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2), "model.layers", 64, 32, 128, ["q_proj", "k_proj", "down_proj"]),
}


def tiny(model_type: str, device: str = "meta"):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=512, **FAMILIES[model_type][0])
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config)


def lora_args(targets) -> SimpleNamespace:
    return SimpleNamespace(use_peft=True, lora_target_modules=targets, lora_r=8, lora_dropout=0.0,
                           lora_modules_to_save=None, lora_target_parameters=None)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_decoder_layers_are_found_where_the_family_keeps_them(model_type):
    prefix, layers = decoder.layers(tiny(model_type))
    assert (prefix, len(layers)) == (FAMILIES[model_type][1], 2)


@pytest.mark.parametrize("targets", ["named", "all-linear"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_shape_of_counts_what_peft_trains(model_type, targets):
    """shape_of's counts equal the model's own with PEFT applied: the trainable adapters (all-linear leaves the output
    embedding out, by what get_output_embeddings returns; GPT-2's Conv1D layers count), all parameters, one layer's;
    and the widths are the family's (no num_key_value_heads: as many key/value heads as query heads)."""
    from peft import LoraConfig, get_peft_model

    _, prefix, hidden, kv_dim, mlp, named = FAMILIES[model_type]
    chosen = named if targets == "named" else "all-linear"
    shape = memory_budget.shape_of(tiny(model_type), lora_args(chosen))
    peft = get_peft_model(tiny(model_type, "cpu"), LoraConfig(r=8, lora_alpha=16, target_modules=chosen))
    trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    layer = peft.get_submodule("base_model.model." + prefix + ".0")
    assert trainable > 0
    assert shape.trainable == trainable
    assert shape.params == sum(p.numel() for p in peft.parameters())
    assert shape.layer_params == sum(p.numel() for p in layer.parameters())
    assert shape.layer_trainable == sum(p.numel() for p in layer.parameters() if p.requires_grad)
    assert shape.root_params == shape.params - 2 * shape.layer_params
    assert (shape.layers, shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate) == (2, hidden, 64, kv_dim, mlp)


def test_layers_of_two_kinds_are_budgeted_by_the_larger():
    """Jamba alternates Mamba and attention layers (layer 0 a Mamba one here): the layer FSDP gathers at once is
    the larger, and what is outside the layers is what is left of the parameters (it read layer 0's self_attn)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("jamba", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_experts=1, vocab_size=512,
                                  attn_layer_period=2, attn_layer_offset=1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    assert sizes[0] != sizes[1]
    shape = memory_budget.shape_of(model, SimpleNamespace(use_peft=False))
    assert shape.layer_params == max(sizes)
    assert shape.root_params == sum(p.numel() for p in model.parameters()) - sum(sizes)


@pytest.fixture
def neox_folder(tmp_path):
    """A local model folder with a GPT-NeoX config.json, as the trial's models/neox-tiny (the planner reads only it)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("gpt_neox", vocab_size=1024, **FAMILIES["gpt_neox"][0])
    config.architectures = ["GPTNeoXForCausalLM"]
    config.save_pretrained(tmp_path / "neox-tiny")
    return tmp_path / "neox-tiny"


def test_plan_of_a_gpt_neox_model_on_a_llama_recipe(neox_folder, monkeypatch, capsys):
    """The trial's command: `fsdp-recipes plan llama-3.1-8b-lora --model_name_or_path models/neox-tiny
    --lora_target_modules query_key_value dense` (a traceback, exit 1): now the plan, exit 0."""
    from test_plan_questions import run

    monkeypatch.chdir(REPO)
    code, out, err = run(capsys, "llama-3.1-8b-lora", "--gpus", "8", "--gpu", "H100", "--model_name_or_path",
                         str(neox_folder), "--lora_target_modules", "query_key_value", "dense")
    assert code == 0, err
    assert out.startswith("recipe llama-3.1-8b-lora: GPTNeoXForCausalLM, 0.24M parameters") and "fits:" in out


def test_the_mesh_answer_of_a_model_without_num_key_value_heads(neox_folder, monkeypatch, capsys):
    """--fit where FSDP over the node does not fit proposes a mesh by the model's heads: GPT-NeoX's config has no
    num_key_value_heads (the search divided None)."""
    from test_plan_questions import run

    monkeypatch.chdir(REPO)
    code, out, err = run(capsys, "llama-3.1-8b-lora", "--gpus", "1", "--gpu", "H100", "--fit", "--model_name_or_path",
                         str(neox_folder), "--lora_target_modules", "query_key_value", "dense",
                         "--max_length", "131072", "--per_device_train_batch_size", "1024")
    assert code == 1 and "does not fit" in err, err
    assert "  mesh: " in out and "Traceback" not in err


def test_the_4bit_plan_of_a_gpt_neox_model(neox_folder, monkeypatch, capsys):
    """The QLoRA recipe planned for another family read `model.model.layers` (speed/four_bit.py planner_shape): an
    AttributeError traceback for any model not kept there."""
    from test_plan_questions import run

    monkeypatch.chdir(REPO)
    code, out, err = run(capsys, "smollm2-135m-qlora", "--gpus", "2", "--gpu", "H100", "--model_name_or_path",
                         str(neox_folder), "--lora_target_modules", "query_key_value", "dense")
    assert code == 0 and "Traceback" not in err, err
    assert out.startswith("recipe smollm2-135m-qlora: GPTNeoXForCausalLM"), out
