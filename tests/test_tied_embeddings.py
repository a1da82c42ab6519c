"""Tied input and output embeddings (SmolLM2, Llama 3.2 1B/3B, Qwen3 0.6B-4B, Gemma) through the pack's FSDP2 path,
in one process on a tiny tied Llama: accelerate's own preparation with the pack's LM-head workaround
(patches/peft_fsdp.py, workaround 2), the final-save check against the live shards (checkpoint/save_check.py),
the checkpoint save and load a resume makes (accelerate's FSDP2 adapter-only path), and the merge.

Issue 18 item 6. The 2-process run of a tied model (training, a checkpoint, the verified final save, the merge) is
`make smoke RECIPE=smollm2-135m-lora` in tests/test_smoke.py: that recipe's tiny model keeps SmolLM2's tied
embeddings; the real 135M model runs in tests/test_default_recipe.py.
"""

import types

import pytest
import torch

from fsdp_recipes.patches.peft_fsdp import RestoreOutputEmbeddings, hide_wrapped_output_layer

SHARED_TWICE = "shared with a parameter already managed by another FSDP group"


def tied_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def with_lora(model, train_head: bool):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                                            modules_to_save=["lm_head"] if train_head else None))


def prepare(model, ram_efficient: bool = False):
    """accelerate 1.15's own FSDP2 preparation (what the Trainer calls), with the recipe's settings. `ram_efficient`:
    with RAM-efficient loading, as every recipe's FSDP2 YAML sets it: the model moved to meta, `tie_weights()`,
    sharded, rank 0's weights loaded, `tie_weights()` again."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                            cpu_ram_efficient_loading=ram_efficient)
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None,
                                        parallelism_config=None, is_main_process=True, mixed_precision="no",
                                        device=torch.device("cpu"))
    return fsdp2_prepare_model(accelerator, model)


def step(model):
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


def test_lora_on_a_tied_model_keeps_one_shared_parameter(world_of_one):
    model = with_lora(tied_llama(), train_head=False)
    assert not hide_wrapped_output_layer(model)  # nothing to hide: accelerate groups embedding and head itself
    prepared = prepare(model)
    inner = prepared.base_model.model
    assert inner.lm_head.weight is inner.model.embed_tokens.weight  # still tied, one (sharded) Parameter
    assert torch.isfinite(step(prepared))


def test_a_trained_tied_head_needs_the_input_embedding_hidden_too(world_of_one):
    """With `lora_modules_to_save: [lm_head]` on a tied model, hiding only the output layer (the workaround before
    this fix) makes torch 2.13 refuse the model; the fix hides the tied input embedding as well. torch 2.11's FSDP2
    does not check (no `_validate_no_duplicate_params`): there the old workaround put the tied weight into two FSDP
    groups without a word, so only the fix is tested."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    if hasattr(FSDPState, "_validate_no_duplicate_params"):
        model = with_lora(tied_llama(), train_head=True)
        model.get_output_embeddings = lambda: None  # the old workaround
        with pytest.raises(ValueError, match=SHARED_TWICE):  # at the first forward, where FSDP2 initialises
            step(prepare(model))

    model = with_lora(tied_llama(), train_head=True)
    assert hide_wrapped_output_layer(model)
    prepared = prepare(model)
    RestoreOutputEmbeddings(model).on_train_begin(None, None, None)
    inner = prepared.base_model.model
    head = inner.lm_head
    assert head.original_module.weight is inner.model.embed_tokens.weight  # the frozen head stays tied
    assert prepared.get_output_embeddings() is head and prepared.get_input_embeddings() is inner.model.embed_tokens
    assert torch.isfinite(step(prepared))
    trained = head.modules_to_save["default"].weight
    assert trained.grad is not None and inner.model.embed_tokens.weight.grad is None  # only the copy trains


def test_final_save_check_of_a_tied_model_compares_every_shard(world_of_one, tmp_path):
    """save_pretrained stores a tied head once; the live-shard check must expect exactly that, and still catch a
    wrong value in the shared tensor."""
    from safetensors.torch import load_file, save_file

    from fsdp_recipes.checkpoint.save_check import IncompleteSave, verify_live_shards

    model = tied_llama()
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in saved and "model.embed_tokens.weight" in saved
    prepared = prepare(model)
    assert verify_live_shards(prepared, tmp_path) == len(saved)  # every saved tensor, the shared one once
    saved["model.embed_tokens.weight"][0, 0] += 1.0
    save_file(saved, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(IncompleteSave, match="embed_tokens"):
        verify_live_shards(prepared, tmp_path)


def test_a_tied_models_adapter_and_head_resume_through_accelerates_loader(world_of_one, tmp_path, monkeypatch):
    """The checkpoint round trip a resume makes (FULL_STATE_DICT, adapter only, what the recipes use): accelerate's
    own FSDP2 save and load of a tied model whose LM head is trained in full. Every trainable tensor comes back, and
    the frozen head is still the input embedding's Parameter."""
    import logging

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils import fsdp_utils

    # accelerate's logger insists on an initialised accelerate state; the Trainer has one, this test does not
    monkeypatch.setattr(fsdp_utils, "logger", logging.getLogger("accelerate.utils.fsdp_utils"))
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                            cpu_ram_efficient_loading=False, state_dict_type="FULL_STATE_DICT")
    accelerator = types.SimpleNamespace(num_processes=1, process_index=0, is_main_process=True, is_fsdp2=True,
                                        wait_for_everyone=lambda: None)

    def prepared_with_head():
        model = with_lora(tied_llama(), train_head=True)
        hide_wrapped_output_layer(model)
        prepared = prepare(model)
        RestoreOutputEmbeddings(model).on_train_begin(None, None, None)
        return prepared

    def trainable(model):
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in model.named_parameters() if p.requires_grad}

    saved = prepared_with_head()
    step(saved)
    with torch.no_grad():  # LoRA B starts at zero: make every trainable tensor differ from a fresh model's
        for p in saved.parameters():
            if p.requires_grad:
                p.add_(0.1)
    fsdp_utils.save_fsdp_model(plugin, accelerator, saved, str(tmp_path), adapter_only=True)
    resumed = prepared_with_head()
    before = trainable(resumed)
    fsdp_utils.load_fsdp_model(plugin, accelerator, resumed, str(tmp_path), adapter_only=True)
    want, got = trainable(saved), trainable(resumed)
    assert len(want) == 2 * 2 * 2 + 1  # LoRA A and B on q and v in 2 layers, and the head's trained copy
    assert all(not torch.equal(before[n], want[n]) for n in want)  # the load had something to restore
    assert all(torch.equal(got[n], want[n]) for n in want)
    inner = resumed.base_model.model
    assert inner.lm_head.original_module.weight is inner.model.embed_tokens.weight


def test_merging_a_tied_model_keeps_a_trained_head(tmp_path):
    """save_merged (the pack's `merged/`, plain transformers and PEFT): with the LM head trained in full on a tied
    model, the merged model must hold the trained head and the base's input embedding, untied; re-tying on save or
    load would silently drop the trained head."""
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from fsdp_recipes.train.final_save import save_merged

    base = tied_llama()
    base.save_pretrained(tmp_path / "base")
    adapted = with_lora(tied_llama(), train_head=True)
    with torch.no_grad():
        for p in adapted.parameters():
            if p.requires_grad:
                p.add_(0.1)
    head = adapted.base_model.model.lm_head.modules_to_save["default"].weight.detach().clone()
    adapted.save_pretrained(tmp_path / "adapter")
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
                            ).save_pretrained(tmp_path / "adapter")
    save_merged(str(tmp_path / "base"), str(tmp_path / "adapter"), str(tmp_path / "merged"),
                types.SimpleNamespace(dtype="float32"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.equal(merged.lm_head.weight, head)
    assert torch.equal(merged.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert merged.lm_head.weight is not merged.model.embed_tokens.weight


def test_a_gathered_state_dict_keeps_one_copy_of_a_tied_weight():
    """FSDP gathers each name of a tied weight on its own: two separate full copies, which save_pretrained (deduping
    by shared storage) wrote both of. The final save drops the second name first (save_check.without_tied_copies)."""
    from fsdp_recipes.checkpoint.save_check import without_tied_copies

    model = tied_llama()
    gathered = {k: v.clone() for k, v in model.state_dict().items()}  # one copy per name, as a gather returns them
    assert gathered["lm_head.weight"].data_ptr() != gathered["model.embed_tokens.weight"].data_ptr()
    kept = without_tied_copies(model, gathered)
    assert "lm_head.weight" not in kept and "model.embed_tokens.weight" in kept
    assert len(kept) == len(model.state_dict()) - 1


# ---- issue 44: a trained copy of a tied input embedding is refused before any rank, in one line

def test_a_trained_copy_of_the_tied_input_embedding_is_what_fsdp2_refuses(world_of_one):
    """The gap the launcher's check closes: `lora_modules_to_save: [embed_tokens]` (with or without lm_head) on a
    tied model reached FSDP2's own error at the first step of every rank, even with the pack's LM-head workaround."""
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    if not hasattr(FSDPState, "_validate_no_duplicate_params"):
        pytest.skip("this torch's FSDP2 does not check for a parameter in two groups")
    for modules in (["embed_tokens"], ["lm_head", "embed_tokens"]):
        model = get_peft_model(tied_llama(), LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=modules))
        hide_wrapped_output_layer(model)
        with pytest.raises(ValueError, match=SHARED_TWICE):
            step(prepare(model))


@pytest.mark.parametrize("recipe, modules, refused", [
    ("smollm2-135m-lora", ["embed_tokens"], "lora_modules_to_save names embed_tokens, the input embedding of "
                                            "LlamaForCausalLM, whose LM head lm_head is tied to it"),
    ("smollm2-135m-lora", ["lm_head", "embed_tokens"], "Fix: train the head instead (lora_modules_to_save: "
                                                       "['lm_head']"),
    ("smollm2-135m-lora", ["embed_tokens"], "or a LoRA on the embedding (embed_tokens in lora_target_modules: the "
                                            "head keeps the base weights)"),  # issue 61: that trains and merges
    ("smollm2-135m-lora", ["lm_head"], None),  # works: patches/peft_fsdp.py workarounds 2 and 4
    ("llama-3.1-8b-lora", ["embed_tokens"], None),  # untied: the embedding's copy is its own
], ids=["tied-embedding", "tied-both", "tied-embedding-lora-way", "tied-head", "untied-embedding"])
def test_the_tie_check_on_the_recipes_model_configs(recipe, modules, refused):
    from conftest import REPO
    from fsdp_recipes.config import model_check
    from fsdp_recipes.errors import UserError

    model = model_check.meta_model(model_check.load_config(REPO / "recipes" / recipe / "model_config.json"))
    if refused is None:
        model_check.check_tied_modules_to_save(model, modules)
        return
    with pytest.raises(UserError) as err:
        model_check.check_tied_modules_to_save(model, modules)
    assert refused in str(err.value) and "\n" not in str(err.value)


# ---- issue 61: every way a recipe trains the head or the input embedding of a tied model, prepared as the recipes'
# FSDP2 YAMLs prepare it (fsdp_cpu_ram_efficient_loading: true), and merged

# The ways that train (the recipe's lora_target_modules, lora_target_parameters, lora_modules_to_save, as TRL's
# get_peft_config passes them to LoraConfig). A LoRA on the head (lm_head as a target, or its weight as a target
# parameter) is refused before launch (test_a_lora_on_the_lm_head_is_refused_with_the_way_that_works): TRL never
# trains it; the embedding's copy (embed_tokens to save) is refused above (issue 44); PEFT's trainable_token_indices
# is no recipe setting (tests/test_bad_input.py).
TIED_OPTIONS = {
    "embed_tokens-lora": dict(target_modules=["q_proj", "v_proj", "embed_tokens"]),
    "embed_tokens-parameter": dict(target_modules=["q_proj", "v_proj"], target_parameters=["embed_tokens.weight"]),
    "lm_head-saved": dict(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
    "lm_head-saved+embed_tokens-lora": dict(target_modules=["q_proj", "v_proj", "embed_tokens"],
                                            modules_to_save=["lm_head"]),
}


def tied_with(option: str):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tied_llama(), LoraConfig(r=2, **TIED_OPTIONS[option]))


@pytest.mark.parametrize("option", list(TIED_OPTIONS))
def test_each_tied_head_option_prepares_under_ram_efficient_fsdp2_and_trains_only_its_adapter(option, world_of_one):
    """Before the fix (peft_fsdp.py workaround 4), every option that wraps the head failed in accelerate's
    `tie_weights()` with KeyError "attribute 'weight' already exists", on every rank before the first step (the
    default with lm_head to save, launched on 2 processes: issue 61)."""
    from fsdp_recipes.patches.peft_fsdp import prepare_wrapped_embeddings_for_fsdp2, unwrapped

    model = tied_with(option)
    with torch.no_grad():  # LoRA B starts at zero: make every trainable tensor take part in the loss
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert prepare_wrapped_embeddings_for_fsdp2(model)
    prepared = prepare(model, ram_efficient=True)
    RestoreOutputEmbeddings(model).on_train_begin(None, None, None)
    assert "tie_weights" not in vars(model) and "get_output_embeddings" not in vars(model)
    inner = prepared.base_model.model
    frozen_head, embedding = unwrapped(inner.lm_head), unwrapped(inner.model.embed_tokens)
    assert frozen_head.weight is embedding.weight  # the tie kept: one Parameter, one FSDP group
    assert torch.isfinite(step(prepared))
    got = {n for n, p in prepared.named_parameters() if p.grad is not None}
    assert got == trainable and embedding.weight.grad is None


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("option", [*TIED_OPTIONS, "projections only"])
def test_each_tied_head_option_merges_into_the_model_it_trained(option, tmp_path):
    """save_merged (the pack's merged/) against base + adapter: before the fix a LoRA on the embedding was merged
    into the one tensor the head shares, so the head changed too (logits 66 apart). Merged untied where the adapter
    changes either; a LoRA on the projections only keeps the merged model tied."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from fsdp_recipes.train.final_save import save_merged

    tied_llama().save_pretrained(tmp_path / "base")
    config = TIED_OPTIONS.get(option, dict(target_modules=["q_proj", "v_proj"]))
    adapted = get_peft_model(tied_llama(), LoraConfig(r=2, **config))
    torch.manual_seed(2)
    with torch.no_grad():
        for p in adapted.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    adapted.save_pretrained(tmp_path / "adapter")
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
                            ).save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    want = logits_of(PeftModel.from_pretrained(tied_llama(), tmp_path / "adapter").eval(), ids)
    save_merged(str(tmp_path / "base"), str(tmp_path / "adapter"), str(tmp_path / "merged"),
                types.SimpleNamespace(dtype="float32"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert torch.allclose(logits_of(merged, ids), want, atol=1e-5), (logits_of(merged, ids) - want).abs().max()
    untied = option != "projections only"
    assert merged.config.tie_word_embeddings is not untied
    assert (merged.lm_head.weight is merged.model.embed_tokens.weight) is not untied


@pytest.mark.parametrize("recipe", ["smollm2-135m-lora", "llama-3.1-8b-lora"], ids=["tied", "untied"])
@pytest.mark.parametrize("targets, parameters, setting", [
    (["q_proj", "lm_head"], None, "lora_target_modules ['q_proj', 'lm_head']"),
    (r".*(q_proj|lm_head)", None, "lora_target_modules '.*(q_proj|lm_head)'"),
    (["q_proj"], ["lm_head.weight"], "lora_target_parameters ['lm_head.weight']"),
], ids=["list", "regex", "parameter"])
def test_a_lora_on_the_lm_head_is_refused_with_the_way_that_works(recipe, targets, parameters, setting):
    """TRL 1.16's trainers compute the log-probabilities from lm_head.weight and refuse an adapter on the head in
    every rank ("Applying a PEFT adapter to `lm_head` is not supported", the default launched with lm_head as a LoRA
    target, issue 61): one line before launch, tied or not, naming the whole head (which trains) instead."""
    from conftest import REPO
    from fsdp_recipes.config import model_check
    from fsdp_recipes.errors import UserError

    model = model_check.meta_model(model_check.load_config(REPO / "recipes" / recipe / "model_config.json"))
    with pytest.raises(UserError) as err:
        model_check.check_lora_on_output_layer(model, targets, parameters)
    line = str(err.value)
    assert line.startswith(f"{setting} puts a LoRA adapter on lm_head, the LM head of LlamaForCausalLM: ") and \
        "\n" not in line
    assert "Fix: train the whole head instead (lora_modules_to_save: [lm_head]" in line
    assert ("an untied trained copy" in line) is (recipe == "smollm2-135m-lora")
    for fine in (("all-linear", None), (["q_proj", "embed_tokens"], None), (["q_proj"], ["embed_tokens.weight"]),
                 (r".*q_proj", None), (None, None)):
        model_check.check_lora_on_output_layer(model, *fine)
