"""Activation checkpointing policies (speed/activation_checkpointing.py, issue 57 item 2): each policy trains to the
reference's loss and gradients, applied the pack's way (the policy onto TrainingArguments' fields, then what
transformers' Trainer and TRL's SFTTrainer do with them); `make plan`'s pick against arithmetic done by hand here."""

import math
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO
from test_configs import YamlReads
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
    # what run_args.json's speed_options records: the trainer's fields as the Trainer will apply them
    assert ac.prepare_trainer(SimpleNamespace(args=t), cfg) == {
        "policy": "every_4", "kwargs": {"use_reentrant": False, "every_n_layers": 4}}
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
#   runtime 2 GiB; LM head: the 4096 x 32768 fp32 tile 536,870,912; the final norm's fp32 input and the head's bf16
#   copy of its output (tests/test_norm_activations.py) + the hidden states' fp32 gradient 8,192 x 4096 x 10 =
#   335,544,320
# one layer's set per token: 2h(4 + c) + c(2q + 2kv + 4I + r x 7) = 49,152 + 2 x (8192 + 2048 + 57344 + 112) = 184,544
#   and with lora_dropout 0.05 each targeted linear's dropped-out input and mask: 3 x (6 x 4096 + 14336) = 116,736
FIXED = 16_228_294_656 + 167_772_160 + 335_544_320 + 2_984_288_256 + 2 * GIB + 536_870_912 + 335_544_320
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
    assert totals["none"] == (71_112_900_608 if dropout == "0" else 101_714_542_592)
    assert next(p for p, t in totals.items() if t <= USABLE_H100) == pick
    p = plan.prepare("llama-3.1-8b-lora", 1, 1, "H100", REPO / "recipes",
                     ["--per_device_train_batch_size", "2", "--lora_dropout", dropout,
                      "--activation_checkpointing_policy", "auto"])
    assert p.checkpointing.totals == totals and p.checkpointing.pick == pick
    assert p.budgets["FSDP"]["total"] == totals[pick] and p.fits


def test_nemos_setting_pinned_is_not_refused_where_it_fits(capsys):
    """NeMo Automodel's own configuration (no checkpointing, 2 x 4096) on one 80 GB H100: 71,112,900,608 B =
    66.2 GiB <= 71.6 usable without LoRA dropout; with the recipe's 0.05 it is 94.7 GiB and refused."""
    args = ["llama-3.1-8b-lora", "--gpus", "1", "--gpu", "H100", "--per_device_train_batch_size", "2",
            "--activation_checkpointing_policy", "none"]
    assert plan.main([*args, "--lora_dropout", "0"]) == 0
    out = capsys.readouterr().out
    assert "pick none (the recipe's)" in out and "fits: 66.2 GiB of 71.6 GiB" in out
    assert plan.main(args) == 1
    assert "none 94.7 GiB (over)" in capsys.readouterr().out


# Each GPU recipe by hand, from its model_config.json and YAMLs: (GPU memory in GiB as plan.GPUS has it, decoder
# layers, hidden h, q = heads x head_dim, kv = kv heads x head_dim, intermediate I, LoRA r x targeted linears, the
# targeted linears' in_features with dropout 0.05 (q, k, v, gate, up take h; o takes q; down takes I), tokens per
# micro-batch (SFT: batch x max_length; DPO: x 2, chosen and rejected; GRPO and RLOO: batch x (512 prompt +
# max_completion_length 1024)), the policy the planner must pick for the recipe's `auto`). bf16 mixed precision
# everywhere: c = 2.
LLAMA8 = (32, 4096, 4096, 1024, 14336)
LLAMA70 = (80, 8192, 8192, 1024, 28672)
LARGE = (88, 12288, 12288, 1024, 28672)
SMALL = (40, 5120, 4096, 1024, 32768)
QWEN8 = (36, 4096, 4096, 1024, 12288)
QWEN30_A3B = (48, 2048, 32 * 128, 4 * 128, 768)
MIXTRAL = (32, 4096, 4096, 1024, 14336)
BY_HAND = {
    "ddp-baseline": (79.6, (28, 1024, 2048, 1024, 3072), 0, 0, 8 * 2048, "none"),
    "llama-3.1-70b-qlora-2xh100": (79.6, LLAMA70, 16 * 7, 5 * 8192 + 8192 + 28672, 2 * 4096, "ops"),
    "llama-3.1-70b-qlora-4x24gb": (22.1, LLAMA70, 16 * 7, 5 * 8192 + 8192 + 28672, 1 * 1024, "full"),
    "llama-3.1-8b-lora": (79.6, LLAMA8, 16 * 7, 5 * 4096 + 4096 + 14336, 1 * 4096, "none"),
    "llama-3.1-8b-lora-32k": (79.6, LLAMA8, 16 * 7, 5 * 4096 + 4096 + 14336, 1 * 32768, "ops"),
    "llama-3.1-8b-lora-dpo": (79.6, LLAMA8, 16 * 7, 5 * 4096 + 4096 + 14336, 2 * 4 * 2048, "full"),
    "llama-3.1-8b-lora-grpo": (79.6, LLAMA8, 16 * 7, 0, 8 * (512 + 1024), "every_2"),
    "llama-3.1-8b-lora-kto": (79.6, LLAMA8, 16 * 7, 5 * 4096 + 4096 + 14336, 4 * 2048, "every_4"),
    "llama-3.1-8b-lora-rloo": (79.6, LLAMA8, 16 * 7, 0, 8 * (512 + 1024), "every_2"),
    "mistral-7b-full": (79.6, LLAMA8, 0, 0, 2 * 4096, "none"),
    "mistral-large-hsdp": (79.6, LARGE, 16 * 4, 3 * 12288 + 12288, 1 * 4096, "ops"),
    "mistral-large-qlora-4xh100": (79.6, LARGE, 16 * 4, 3 * 12288 + 12288, 2 * 4096, "ops"),
    "mistral-small-lora": (79.6, SMALL, 16 * 4, 3 * 5120 + 4096, 1 * 4096, "every_4"),
    "mistral-small-lora-2xh200": (139.8, SMALL, 16 * 4, 3 * 5120 + 4096, 1 * 4096, "none"),
    "qwen3-8b-full": (79.6, QWEN8, 0, 0, 2 * 4096, "every_4"),  # none until the trained norms' term: 70.3 GiB, now 74.8
    "qwen3-8b-full-dpo": (79.6, QWEN8, 0, 0, 2 * 2 * 2048, "every_2"),  # every_4 until the head norms: 69.1, now 75.7
    # mixtures of experts (intermediate: one expert's), LoRA on the attention (q, k, v take h; o takes q)
    "qwen3-30b-a3b-lora": (139.8, QWEN30_A3B, 16 * 4, 3 * 2048 + 4096, 4 * 4096, "ops"),
    "qwen3-30b-a3b-full": (79.6, QWEN30_A3B, 0, 0, 2 * 4096, "full"),
    "mixtral-8x7b-lora": (79.6, MIXTRAL, 16 * 4, 3 * 4096 + 4096, 4 * 4096, "ops"),
}
# their routing, (experts, top_k), from the published configs (recipes/<name>/model_config.json)
ROUTED = {"qwen3-30b-a3b-lora": (128, 8), "qwen3-30b-a3b-full": (128, 8), "mixtral-8x7b-lora": (8, 2)}
# Qwen3's q_norm and k_norm: query + key/value heads, one normalized row each a token (model_config.json)
HEAD_NORM_ROWS = {"ddp-baseline": 16 + 8, "qwen3-8b-full": 32 + 8, "qwen3-8b-full-dpo": 32 + 8,
                  "qwen3-30b-a3b-lora": 32 + 4, "qwen3-30b-a3b-full": 32 + 4}
ORDER = ("none", "every_4", "every_2", "ops", "full")  # fastest first: less recomputed


def hand_per_token(policy, layers, h, q, kv, inter, rank_width, dropout_width, routed=None,
                   norms_trained=False, head_rows=0) -> int:
    c = 2
    mlp, routing = 4 * inter, 0
    if routed:  # each of top_k routes: input, gate, up, SiLU, product, output, weight; the router's input; fp32
        experts, top_k = routed  # probabilities; 32 B of int64 indices per route (docs/planner.md)
        mlp, routing = top_k * (4 * inter + 2 * h + 1) + h, 4 * experts + 32 * top_k
    # each norm's fp32 input and output, and in full fine-tuning the normalized input its trained weight keeps
    norms = 2 * h * (4 + c + (c if norms_trained else 0))
    layer = norms + c * (2 * q + 2 * kv + mlp + rank_width) + routing + (c + 1) * dropout_width
    # Qwen3's head norms: each an fp32 input over q and kv, an fp32 rsqrt a head, trained a normalized copy (c)
    layer += (4 + (c if norms_trained else 0)) * (q + kv) + 4 * head_rows if head_rows else 0
    if policy == "none":
        return layers * layer
    kept = layers // {"every_4": 4, "every_2": 2}.get(policy, 1)  # each model's layers divide by 4
    boundary = c * h + (c * q if policy == "ops" else 0)
    return kept * boundary + (layers - kept) * layer + layer


@pytest.mark.parametrize("name", sorted(BY_HAND))
def test_each_gpu_recipes_pick_by_hand(name):
    """Every GPU recipe (min_gpus > 0, `activation_checkpointing_policy: auto`) on its own hardware: each policy's
    total differs from full checkpointing's by the tokens x the per-token difference worked out above, and the pick
    is the fastest whose total fits 90% of the GPU (the gates' 0.95 and 1 - 0.1 are looser)."""
    import yaml

    capacity, (layers, h, q, kv, inter), rank_width, dropout_width, tokens, pick = BY_HAND[name]
    acc = yaml.safe_load((REPO / "recipes" / name / "accelerate.yaml").read_text())
    nodes = int(acc.get("num_machines", 1))
    gpu = {79.6: "H100", 139.8: "H200", 22.1: "L4"}[capacity]
    p = plan.prepare(name, max(int(acc["num_processes"]) // nodes, 1), nodes, gpu, REPO / "recipes")
    c = p.checkpointing
    assert p.setup.tokens == tokens and list(c.totals) == [n for n in ORDER if n in c.totals]
    assert ("ops" in c.totals) == (p.cfg.trainer == "sft")
    full_ft = not p.cfg.model.use_peft
    per = {n: hand_per_token(n, layers, h, q, kv, inter, rank_width, dropout_width, ROUTED.get(name), full_ft,
                             HEAD_NORM_ROWS.get(name, 0))
           for n in c.totals}
    for n, total in c.totals.items():
        assert total - c.totals["full"] == tokens * (per[n] - per["full"]), n
    limit = capacity * 0.9 * GIB
    assert c.limit == pytest.approx(limit)
    assert not c.pinned and c.pick == pick == next(n for n, total in c.totals.items() if total <= limit)
    assert p.fits


# A mesh divides the per-token terms above (cp the tokens a rank holds, tp the head- and MLP-wide activations): the
# division is worked by hand in tests/test_long_rows.py (test_a_mesh_divides_...) on a synthetic shape; these two
# recipes' own policy tables are not worked by hand yet
MESH_RECIPES = {"llama-3.1-8b-lora-128k", "llama-3.1-70b-full-tp"}


def test_the_hand_table_covers_every_gpu_recipe():
    import yaml

    gpu_recipes, meshes = set(), set()
    for folder in (REPO / "recipes").iterdir():
        trainer_yaml = next(f for f in folder.glob("*.yaml") if f.name != "accelerate.yaml")
        if (yaml.safe_load(trainer_yaml.read_text()).get("min_gpus") or 0) > 0:
            gpu_recipes.add(folder.name)
        par = (yaml.safe_load((folder / "accelerate.yaml").read_text()) or {}).get("parallelism_config") or {}
        if any(int(par.get(f"parallelism_config_{d}_size", 1)) > 1 for d in ("tp", "cp")):
            meshes.add(folder.name)
    assert meshes == MESH_RECIPES and gpu_recipes == set(BY_HAND) | MESH_RECIPES


def test_the_launcher_resolves_auto_for_the_gpus_it_finds(monkeypatch):
    """launch/launcher.py place(): the option's launch_overrides with the planner's pick for this machine's GPUs
    (nvidia-smi's memory.total, faked: 81,559 MiB = 79.6 GiB, an H100's). llama-3.1-8b-lora at its own 1 x 4096 on
    one GPU: none, 16,228,294,656 + ... as above with 4,096 tokens, fits; at 2 x 4096 none is 101,714,542,592 B, over,
    every_4 too, every_2 fits (test_the_planners_pick_for_nemos_setting_by_hand)."""
    from fsdp_recipes import speed
    from fsdp_recipes.config import hardware, recipes
    from fsdp_recipes.planning import launch_pick

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(hardware, "nvidia_smi", lambda *args: "81559\n")
    for overrides, gpus, expected in (([], 1, "none"), (["--per_device_train_batch_size", "2"], 1, "every_2")):
        recipe = recipes.load("llama-3.1-8b-lora", overrides)
        with monkeypatch.context() as reading:  # the planner plans the recipe the launcher loaded: no YAML read again
            reads = YamlReads(reading)
            decided, notes = speed.launch_overrides(recipe.field, gpus,
                                                    lambda: launch_pick.checkpointing_pick(recipe, gpus))
        assert not reads.counts
        assert decided == ["--activation_checkpointing_policy", expected]
        assert notes[0].startswith(f"activation checkpointing: auto -> {expected} (the fastest that fits")
        # the limit named: 90% of 81,559 / 1,024 = 79.65 GiB is 71.68
        assert "of 71.7 GiB per GPU (the usable budget: 90% of 79.6 GiB) on 1 x 79.6 GiB" in notes[0], notes[0]
    decided, notes = speed.launch_overrides(recipe.field, 0, None)  # no GPUs: TRL's default, no plan
    assert decided == ["--activation_checkpointing_policy", "full"] and "without GPUs" in notes[0]
    pinned = recipes.load("llama-3.1-8b-lora", ["--activation_checkpointing_policy", "ops"])
    assert speed.launch_overrides(pinned.field, 1, None) == ([], [])  # a pinned policy is the recipe's
    monkeypatch.setattr(hardware, "nvidia_smi", lambda *args: None)
    assert launch_pick.checkpointing_pick(recipe, 1)[0] == "full"
