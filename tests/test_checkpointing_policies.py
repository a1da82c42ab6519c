"""Activation checkpointing policies (speed/activation_checkpointing.py, issue 57 item 2): each policy trains to the
reference's loss and gradients, applied the pack's way (the policy onto TrainingArguments' fields, then what
transformers' Trainer and TRL's SFTTrainer do with them); `make plan`'s pick against arithmetic done by hand here."""

import math
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO
from fsdp_recipes.config.option_registry import ActivationCheckpointingArguments
from fsdp_recipes.errors import UserError
from fsdp_recipes.planning import plan
from fsdp_recipes.speed import activation_checkpointing as ac

GIB = 1024**3
USABLE_H100 = 79.6 * 0.9 * GIB  # plan.GPUS["H100"] x the planner's 90%, which the gates' 0.95 and 0.1 leave alone


def cfg_with(policy, trainer="sft"):
    from trl import SFTConfig

    training = SFTConfig(output_dir="/tmp/unused-ckpt57", report_to="none", use_cpu=True)
    args = ActivationCheckpointingArguments(activation_checkpointing_policy=policy)
    return SimpleNamespace(training=training, trainer=trainer, option=lambda name: args)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def apply_as_the_trainers_do(model, training) -> None:
    """transformers 5.23 Trainer (_inner_training_loop) and TRL 1.16 SFTTrainer (__init__) with the settled fields."""
    from trl.models import enable_selective_activation_checkpointing

    if not training.activation_checkpointing:
        return
    kwargs = dict(training.activation_checkpointing_kwargs or {})
    if kwargs.get("selective"):
        enable_selective_activation_checkpointing(model)
    every = kwargs.pop("every_n_layers", 1)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None, every_n_layers=every)


def loss_and_grads(policy):
    model = tiny_llama()
    model.train()
    cfg = cfg_with(policy)
    ac.settle(cfg)
    apply_as_the_trainers_do(model, cfg.training)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    checkpointed = [layer.gradient_checkpointing for layer in model.model.layers]
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, checkpointed, model


@pytest.mark.parametrize("policy, layers", [("full", [True] * 4), ("every_2", [True, False, True, False]),
                                            ("ops", [True] * 4)])
def test_each_policy_gives_the_references_loss_and_gradients(policy, layers):
    """fp32, no dropout: recomputing gives the same numbers up to summation order. Tolerance: 1e-6 relative on
    the loss, 1e-5 absolute on every gradient element (measured: identical to the last bit on this CPU)."""
    ref_loss, ref_grads, ref_layers, _ = loss_and_grads("none")
    loss, grads, checkpointed, model = loss_and_grads(policy)
    assert ref_layers == [False] * 4 and checkpointed == layers  # the policy really changed what is recomputed
    if policy == "ops":  # TRL's selective policy: torch's create_selective_checkpoint_contexts as context_fn
        assert "context_fn" in model.model.layers[0]._gradient_checkpointing_func.keywords
    assert math.isclose(loss, ref_loss, rel_tol=1e-6)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-5)


def test_policies_map_onto_the_trainers_fields_and_refuse_mistakes():
    cfg = cfg_with("every_4")
    ac.settle(cfg)
    t = cfg.training
    assert t.activation_checkpointing and t.gradient_checkpointing
    assert t.activation_checkpointing_kwargs == {"use_reentrant": False, "every_n_layers": 4}
    assert ac.written_policy(t) == "every_4"
    cfg = cfg_with("none")
    ac.settle(cfg)
    assert not cfg.training.activation_checkpointing and ac.written_policy(cfg.training) == "none"
    for bad, why in (("every_1", "not a policy"), ("sometimes", "not a policy")):
        with pytest.raises(UserError, match=why):
            ac.check_config(cfg_with(bad))
    with pytest.raises(UserError, match="only SFTTrainer applies"):
        ac.check_config(cfg_with("ops", trainer="dpo"))
    with pytest.raises(UserError, match="auto is decided by the planner"):
        ac.settle(cfg_with("auto"))


# llama-3.1-8b-lora on 1 H100 at NeMo Automodel's setting: micro-batch 2 x 4096 = 8,192 tokens, bf16 (c = 2),
# FSDP2 over 1 GPU. By hand, from the model's shapes (tests/test_plan_questions.py counts the layer and root):
#   weights: 8,030,261,248 frozen bf16 x 2 + 41,943,040 LoRA fp32 x 4 = 16,228,294,656 (the H100 probe's figure)
#   gradients 41,943,040 x 4 = 167,772,160; AdamW 41,943,040 x 8 = 335,544,320
#   comm buffers: (2 x 219,422,720 + 1,050,677,248) x 2 + one layer's 1,310,720 LoRA gradients x 4 = 2,984,288,256
#   runtime 2 GiB; LM head: the 4096 x 32768 fp32 tile 536,870,912; final norm in/out fp32 + hidden states' fp32
#   gradient 8,192 x 4096 x 12 = 402,653,184
# one layer's set per token: 2h(4 + c) + c(2q + 2kv + 4I + r x 7) = 49,152 + 2 x (8192 + 2048 + 57344 + 112) = 184,544
#   and with lora_dropout 0.05 each targeted linear's dropped-out input and mask: 3 x (6 x 4096 + 14336) = 116,736
FIXED = 16_228_294_656 + 167_772_160 + 335_544_320 + 2_984_288_256 + 2 * GIB + 536_870_912 + 402_653_184
TOKENS, LAYERS, BOUNDARY = 8192, 32, 4096 * 2


def per_token(policy: str, layer: int) -> int:
    if policy == "none":
        return LAYERS * layer
    k = {"every_4": 4, "every_2": 2, "ops": 1, "full": 1}[policy]
    kept = LAYERS // k  # layers 0, k, 2k, ... (32 divides)
    return kept * (BOUNDARY + (4096 * 2 if policy == "ops" else 0)) + (LAYERS - kept) * layer + layer


@pytest.mark.parametrize("dropout, layer, pick", [("0", 184_544, "none"), ("0.05", 184_544 + 116_736, "every_2")])
def test_the_planners_pick_for_nemos_setting_by_hand(dropout, layer, pick):
    totals = {p: FIXED + TOKENS * per_token(p, layer) for p in ("none", "every_4", "every_2", "ops", "full")}
    assert totals["none"] == (71_180_009_472 if dropout == "0" else 101_781_651_456)
    assert next(p for p, t in totals.items() if t <= USABLE_H100) == pick
    p = plan.prepare("llama-3.1-8b-lora", 1, 1, "H100", REPO / "recipes",
                     ["--per_device_train_batch_size", "2", "--lora_dropout", dropout,
                      "--activation_checkpointing_policy", "auto"])
    assert p.checkpointing.totals == totals and p.checkpointing.pick == pick
    assert p.budgets["FSDP"]["total"] == totals[pick] and p.fits


def test_nemos_setting_pinned_is_not_refused_where_it_fits(capsys):
    """NeMo Automodel's own configuration (no checkpointing, 2 x 4096) on one 80 GB H100: 71,180,009,472 B =
    66.3 GiB <= 71.6 usable without LoRA dropout; with the recipe's 0.05 it is 94.8 GiB and refused."""
    args = ["llama-3.1-8b-lora", "--gpus", "1", "--gpu", "H100", "--per_device_train_batch_size", "2",
            "--activation_checkpointing_policy", "none"]
    assert plan.main([*args, "--lora_dropout", "0"]) == 0
    out = capsys.readouterr().out
    assert "pick none (the recipe's)" in out and "fits: 66.3 GiB of 71.6 GiB" in out
    assert plan.main(args) == 1
    assert "none 94.8 GiB (over)" in capsys.readouterr().out


GPU_RECIPES = sorted(d.name for d in (REPO / "recipes").iterdir()
                     if "min_gpus: 0" not in "".join(f.read_text() for f in d.glob("*.yaml"))
                     and any("min_gpus:" in f.read_text() for f in d.glob("*.yaml")))


def test_every_gpu_recipe_pins_the_planners_pick_for_its_own_hardware():
    import yaml

    gpus_of = yaml.safe_load((REPO / "accelerate_configs" / "recipes.yaml").read_text())
    assert len(GPU_RECIPES) == 15
    for name in GPU_RECIPES:
        folder = REPO / "recipes" / name
        acc = yaml.safe_load((folder / "accelerate.yaml").read_text())
        nodes = int(acc.get("num_machines", 1))
        gpus = max(int(acc.get("num_processes", 1)) // nodes, 1)
        gpu = (gpus_of.get(name) or {}).get("gpu", "H100")
        pinned = plan.prepare(name, gpus, nodes, gpu, REPO / "recipes")
        auto = plan.prepare(name, gpus, nodes, gpu, REPO / "recipes", ["--activation_checkpointing_policy", "auto"])
        assert pinned.checkpointing.pinned and pinned.checkpointing.pick == auto.checkpointing.pick, name
        assert pinned.fits, name
