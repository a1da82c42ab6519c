"""LoRA on the fused experts of a mixture-of-experts model (config/expert_lora.py), in process: the launcher's
one-line refusals on a meta-device model, and the merged model's experts against base + adapter computed here by
hand. Training under FSDP2 on 2 processes is the architecture matrix's `qwen3-moe-experts` and `mixtral-experts`
cases (`make arch-matrix`)."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from trl import ModelConfig

from conftest import expert_lora_pair
from fsdp_recipes.config import model_check
from fsdp_recipes.errors import UserError

SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, vocab_size=64, tie_word_embeddings=False)
MOE = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
       "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
FSDP2 = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}}
FSDP1 = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 1}}


def config(model_type: str):
    return AutoConfig.for_model(model_type, **SHAPE, **MOE[model_type])


def meta_model(model_type: str):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config(model_type))


def check(model_type: str, acc=FSDP2, **lora):
    args = ModelConfig(use_peft=True, **lora)
    return model_check.check_recipe_fits_model(meta_model(model_type), acc, "r/accelerate.yaml", args)


@pytest.mark.parametrize("model_type,names", [("qwen3_moe", ["q_proj", "gate_proj", "up_proj", "down_proj"]),
                                               ("mixtral", ["q_proj", "w1", "w2", "w3"])])
def test_expert_projections_named_as_linear_layers_are_one_line_naming_target_parameters(model_type, names):
    with pytest.raises(UserError) as err:
        check(model_type, lora_target_modules=names)
    line = str(err.value)
    assert "\n" not in line and f"lora_target_modules names {', '.join(names[1:])}, " in line
    assert "transformers 5 fuses its experts into 3-D parameters (mlp.experts.down_proj, mlp.experts.gate_up_proj)" \
           in line
    assert "Fix: put LoRA on the experts with lora_target_parameters: [mlp.experts.down_proj, " \
           "mlp.experts.gate_up_proj] and lora_dropout: 0.0" in line


def test_lora_on_the_experts_passes_under_fsdp2_and_is_refused_under_fsdp1_with_what_works():
    lora = dict(lora_target_modules=["q_proj", "v_proj"], lora_target_parameters=EXPERTS, lora_dropout=0.0)
    check("qwen3_moe", **lora)  # FSDP2: trains (the architecture matrix)
    with pytest.raises(UserError, match=r"fails under FSDP1 \(r/accelerate\.yaml: fsdp_version 1\): .*"
                                        r"huggingface/peft#3080\)\. Fix: fsdp_version: 2 in that file \(FSDP2 trains "
                                        r"it\), or LoRA on the attention layers only, or full fine-tuning\.$"):
        check("qwen3_moe", acc=FSDP1, **lora)
    check("qwen3_moe", acc=FSDP1, lora_target_modules=["q_proj", "v_proj"])  # attention only: FSDP1 is fine


def test_dropout_with_lora_on_parameters_is_one_line_also_where_peft_turns_all_linear_into_experts():
    with pytest.raises(UserError, match=r"^lora_target_parameters \(.*\): PEFT applies LoRA to a parameter without "
                                        r"dropout and refuses lora_dropout 0\.05 there\. Fix: set lora_dropout: 0\.0"):
        check("mixtral", lora_target_modules=["q_proj"], lora_target_parameters=EXPERTS, lora_dropout=0.05)
    # PEFT 0.21's transformers-5 conversion: all-linear on Mixtral adapts the experts and the router as parameters
    with pytest.raises(UserError, match=r"^PEFT turns lora_target_modules 'all-linear' into LoRA on "
                                        r"MixtralForCausalLM's fused experts and router too \(target_parameters "
                                        r"down_proj, gate\.weight, gate_up_proj\): .* lora_dropout 0\.05"):
        check("mixtral", lora_target_modules="all-linear", lora_dropout=0.05)
    check("mixtral", lora_target_modules="all-linear", lora_dropout=0.0)


def test_a_target_parameter_matching_nothing_is_one_line_listing_the_expert_parameters():
    with pytest.raises(UserError, match=r"^lora_target_parameters \['experts\.w1'\] match no parameter of "
                                        r"Qwen3MoeForCausalLM \(its 3-D expert parameters: mlp\.experts\.down_proj, "
                                        r"mlp\.experts\.gate_up_proj\)\. Fix: use names from that list\.$"):
        check("qwen3_moe", lora_target_modules=["q_proj"], lora_target_parameters=["experts.w1"], lora_dropout=0.0)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_the_merged_experts_equal_base_plus_the_adapters_product_computed_by_hand(model_type, tmp_path):
    """The pack's merge (train/final_save.py save_merged: PEFT's merge_and_unload) of an adapter on the experts;
    expected: each expert's W + (alpha / r) * B_e @ A_e, from the saved matrices. PEFT keeps A as (r * experts, in),
    expert e's r rows in one block, and B as (out, r * experts), expert e's columns every `experts`-th."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from fsdp_recipes.train.final_save import save_merged

    torch.manual_seed(0)
    base_dir, adapter_dir, merged_dir = tmp_path / "base", tmp_path / "adapter", tmp_path / "merged"
    AutoModelForCausalLM.from_config(config(model_type)).save_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj"],
                                                  target_parameters=EXPERTS))
    with torch.no_grad():  # a trained adapter: B is zero at init
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    peft_model.save_pretrained(adapter_dir)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
                            ).save_pretrained(adapter_dir)
    save_merged(str(base_dir), str(adapter_dir), str(merged_dir), ModelConfig(dtype="float32"))

    # as transformers loads them, experts fused (it saves them one by one, in transformers 4's layout)
    base, merged = (AutoModelForCausalLM.from_pretrained(path).state_dict() for path in (base_dir, merged_dir))
    adapter = load_file(adapter_dir / "adapter_model.safetensors")
    scaling = json.loads((adapter_dir / "adapter_config.json").read_text())["lora_alpha"] / 2
    experts = [name for name, w in base.items() if w.ndim == 3]
    assert len(experts) == 4  # gate_up_proj and down_proj in each of 2 layers
    for name in experts:
        w = base[name]
        n, out_features, in_features = w.shape
        a, b = expert_lora_pair(adapter, name, in_features, out_features)
        for e in range(n):
            expected = w[e] + scaling * b[:, e::n] @ a[e * 2:(e + 1) * 2]
            assert (expected - w[e]).abs().max() > 1e-3, f"{name}[{e}]: the adapter's delta is not there to test"
            torch.testing.assert_close(merged[name][e], expected, rtol=1e-5, atol=1e-6, msg=f"{name} expert {e}")
    router = [name for name in base if name.endswith("mlp.gate.weight")]
    assert router and all(torch.equal(merged[name], base[name]) for name in router)  # the router stays frozen
