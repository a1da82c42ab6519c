"""Mixture of experts, in process on a tiny Qwen3-MoE built here: active parameters in the FLOPs, the MFU and the
planner (hand-counted), the router's load-balancing loss in the loss and the logs, the expert load in the report."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from fsdp_recipes.metrics import expert_load, flops, run_report
from fsdp_recipes.metrics.run_report import RunReportCallback

REPO = Path(__file__).resolve().parent.parent

# 2 layers, hidden 16, 2 heads of 8 (1 KV head), 4 experts of width 8, 2 chosen per token, vocabulary 100.
TINY = dict(vocab_size=100, hidden_size=16, intermediate_size=48, moe_intermediate_size=8, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
            tie_word_embeddings=False, attention_dropout=0.0)
# By hand, per layer: q 16x16 + k 8x16 + v 8x16 + o 16x16 = 768; q_norm, k_norm 8 + 8; two RMSNorms 2 x 16;
# the router 4 x 16 = 64: 880 outside the experts. Experts: gate_up 4 x (2 x 8) x 16 = 1,024, down 4 x 16 x 8 = 512:
# 1,536, of which a token passes through 2 of 4: 768. Outside the layers: final norm 16, LM head 100 x 16 = 1,600,
# input embedding 1,600 (a lookup: no FLOPs).
NON_EXPERT, EXPERTS, ACTIVE_EXPERTS = 880, 1536, 768
NON_EMBEDDING = 2 * (NON_EXPERT + EXPERTS) + 16 + 1600  # 6,448
ACTIVE_NON_EMBEDDING = 2 * (NON_EXPERT + ACTIVE_EXPERTS) + 16 + 1600  # 4,912
TOTAL, ACTIVE = NON_EMBEDDING + 1600, ACTIVE_NON_EMBEDDING + 1600  # 8,048 and 6,512
assert (NON_EMBEDDING, ACTIVE_NON_EMBEDDING, TOTAL, ACTIVE) == (6448, 4912, 8048, 6512)


def attention_flops(length):
    return 12 * 2 * 2 * 8 * length  # 12 x layers x heads x head_dim x length


def tiny_model(device=None, **over):
    torch.manual_seed(0)
    config = Qwen3MoeConfig(**{**TINY, **over})
    if device == "meta":
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    return AutoModelForCausalLM.from_config(config)


def test_active_parameters_of_a_tiny_qwen3_moe_by_hand():
    counts = flops.count_params(tiny_model("meta"))
    assert counts["total"] == TOTAL and counts["expert"] == 2 * EXPERTS
    assert counts["active"] == ACTIVE
    assert counts["trainable_non_embedding"] == NON_EMBEDDING  # what memory holds
    assert counts["trainable_active_non_embedding"] == ACTIVE_NON_EMBEDDING  # what a token's FLOPs pass through
    assert flops.experts_of(Qwen3MoeConfig(**TINY)) == (2, 4)
    assert flops.experts_of(tiny_model("meta").config.get_text_config()) == (2, 4)


def test_mixtral_names_its_experts_num_local_experts():
    from transformers import MistralConfig, MixtralConfig

    assert flops.experts_of(MixtralConfig(num_local_experts=8, num_experts_per_tok=2)) == (2, 8)
    assert flops.experts_of(MistralConfig()) is None  # dense: every parameter is active


def test_mfu_counts_the_active_parameters_not_all_of_them(tmp_path, monkeypatch):
    """The run report's FLOPs per token: 6 x active + attention. Over all parameters it would be 6 x 6,448 + ..."""
    monkeypatch.setattr(run_report.cpu_peak, "best_rate", lambda *a, **k: None)
    cb = RunReportCallback(str(tmp_path), {}, recipe="moe")
    cb.on_train_begin(None, SimpleNamespace(global_step=0, log_history=[]), None, model=tiny_model("meta"))
    tokens = {"sequences": 4, "non_padding": 40, "padded": 40, "squared_lengths": 400}  # 4 sequences of 10
    figures = cb.mfu_figures(tokens, 1e9, 1, {"type": "cuda", "name": "NVIDIA H100 80GB HBM3"})
    assert figures["flops_per_token"] == 6 * 4912 + attention_flops(10)
    assert figures["mfu"] == pytest.approx((6 * 4912 + attention_flops(10)) * 1e9 / 989e12)  # H100 SXM: 989 TFLOP/s


def test_the_planner_prints_and_counts_active_parameters_but_holds_all_of_them():
    from fsdp_recipes.planning import comms, memory_budget

    m = memory_budget.shape_of(tiny_model("meta"), SimpleNamespace(use_peft=False))
    assert (m.params, m.active, m.experts, m.top_k, m.intermediate) == (TOTAL, ACTIVE, 4, 2, 8)
    assert comms.flops_per_token(m, 10) == 6 * 4912 + attention_flops(10)
    setup = memory_budget.Setup(shard=2, world=2, strategy="FSDP", load_bytes=4, compute_bytes=4,
                                mixed_precision=False, tokens=10, checkpointed=False, optimizer_bytes=8, runtime_bytes=0)
    parts = memory_budget.budget(m, setup)
    # every expert's weights, gradients and AdamW moments, float32, sharded over 2
    assert (parts["weights"], parts["gradients"], parts["optimizer_states"]) == (8048 * 4 / 2, 8048 * 4 / 2,
                                                                                 8048 * 8 / 2)


def test_the_planner_counts_lora_on_the_experts_parameters():
    """lora_target_parameters on the fused experts (r 2): PEFT keeps A (r x experts, in) and B (out, r x experts) per
    tensor, reading gate_up (4, 16, 16) and down (4, 16, 8) as (experts, in, out): 2 x 4 x (16 + 16) = 256 and
    2 x 4 x (16 + 8) = 192, 448 per layer, 896 in the 2 layers; with q_proj too, 2 x (16 + 16) = 64 per layer more."""
    from peft import LoraConfig, get_peft_model

    from fsdp_recipes.planning import memory_budget

    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    for modules, by_hand in (([], 896), (["q_proj"], 896 + 2 * 64)):
        args = SimpleNamespace(use_peft=True, lora_r=2, lora_target_modules=modules, lora_target_parameters=experts,
                               lora_dropout=0.0, lora_modules_to_save=None)
        m = memory_budget.shape_of(tiny_model("meta"), args)
        assert m.trainable == by_hand and m.params == TOTAL + by_hand
        peft_model = get_peft_model(tiny_model(), LoraConfig(r=2, target_modules=modules, target_parameters=experts))
        assert sum(p.numel() for p in peft_model.parameters() if p.requires_grad) == by_hand  # PEFT agrees


@pytest.mark.parametrize("name, total, active", [("qwen3-30b-a3b-lora", 30.5e9, 3.3e9),
                                                 ("mixtral-8x7b-lora", 46.7e9, 12.9e9)])
def test_the_recipes_real_models_have_their_published_total_and_active_sizes(name, total, active):
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B activated (its model card); Mixtral 8x7B: 46.7B, 12.9B (Mistral's post)."""
    from fsdp_recipes.config.model_check import load_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(REPO / "recipes" / name / "model_config.json"))
    counts = flops.count_params(model)
    assert counts["total"] == pytest.approx(total, rel=0.01) and counts["active"] == pytest.approx(active, rel=0.02)


def test_expert_counts_sum_to_positions_times_top_k_and_match_the_router_logits():
    model = tiny_model()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    load = expert_load.ExpertLoad(model, 2, 4)
    assert [layer for layer, _ in load.routers] == [0, 1]
    model.train()
    ids = torch.randint(0, 100, (3, 7))
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()  # checkpointing recomputes each layer's forward here: not counted twice
    with torch.no_grad():
        model.eval()
        model(input_ids=ids)  # evaluation: not training load
    report = load.report()
    for entry, logits in zip(report["layers"], out.router_logits):
        expected = torch.bincount(torch.topk(logits, 2, dim=-1).indices.reshape(-1), minlength=4).tolist()
        assert entry["tokens_per_expert"] == expected
        assert sum(entry["tokens_per_expert"]) == 3 * 7 * 2 and entry["tokens"] == 21
        assert entry["max"] == max(expected) and entry["mean"] == 42 / 4
        assert entry["idle_experts"] == [e for e in range(4) if expected[e] == 0]
    assert report["scope"] == "rank0_only"  # no on_train_end yet


def test_a_dense_model_gets_no_expert_load():
    from transformers import MistralConfig

    trainer = SimpleNamespace(model=AutoModelForCausalLM.from_config(MistralConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1)))
    assert expert_load.attach(trainer, SimpleNamespace()) is None


def recipe_coefficient(name: str) -> float:
    return yaml.safe_load((REPO / "recipes" / name / "sft.yaml").read_text())["router_aux_loss_coef"]


def sft_trainer(model, tokenizer, tmp_path, coef, report=None, **args):
    from datasets import Dataset
    from trl import SFTConfig

    from fsdp_recipes.train.build import make_trainer_class

    torch.manual_seed(1)
    rows = Dataset.from_dict({"input_ids": torch.randint(3, 100, (8, 12)).tolist()})
    config = SFTConfig(output_dir=str(tmp_path), router_aux_loss_coef=coef, report_to=[], use_cpu=True,
                       per_device_train_batch_size=4, max_length=12, save_strategy="no", logging_steps=1,
                       disable_tqdm=True, **args)
    trainer = make_trainer_class("sft")(model=model, args=config, train_dataset=rows, processing_class=tokenizer,
                                        callbacks=[report] if report else None)
    return trainer, trainer.data_collator([rows[i] for i in range(4)])


@pytest.mark.parametrize("name", ["qwen3-30b-a3b-lora", "qwen3-30b-a3b-full", "mixtral-8x7b-lora"])
def test_the_moe_recipes_turn_the_load_balancing_loss_on(name):
    from fsdp_recipes.config.model_check import load_config

    coef = recipe_coefficient(name)
    # the model's own coefficient, written in the recipe so that it shows (0.0 would turn it off)
    assert coef > 0 and coef == load_config(REPO / "recipes" / name / "model_config.json").router_aux_loss_coef


def test_the_load_balancing_loss_is_added_to_the_loss(cache_dir, tmp_path):
    """The same batch through the pack's SFT trainer with the recipe's coefficient and with 0: the losses differ by
    coefficient x the load-balancing loss of the router logits (transformers' load_balancing_loss_func)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from fsdp_recipes.assets.tiny_assets import ensure_assets

    tokenizer = AutoTokenizer.from_pretrained(ensure_assets(quiet=True)["model"])
    coef = recipe_coefficient("qwen3-30b-a3b-lora") * 100  # the recipe's, scaled: a difference well above rounding
    assert coef > 0
    model = tiny_model()
    with_aux, batch = sft_trainer(model, tokenizer, tmp_path / "a", coef)
    loss_with = with_aux.compute_loss(model, dict(batch))
    without, _ = sft_trainer(model, tokenizer, tmp_path / "b", 0.0)
    loss_without = without.compute_loss(model, dict(batch))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], output_router_logits=True).router_logits
    aux = load_balancing_loss_func(logits, 4, 2, batch.get("attention_mask"))
    assert float(aux) > 0
    assert float((loss_with - loss_without).detach()) == pytest.approx(coef * float(aux), rel=1e-3)
    assert with_aux._metrics["train"]["aux_loss"] and not without._metrics["train"]["aux_loss"]


def test_a_training_run_reports_the_aux_loss_and_the_expert_load(cache_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from fsdp_recipes.assets.tiny_assets import ensure_assets
    from fsdp_recipes.train import kinds

    monkeypatch.setattr(run_report.cpu_peak, "best_rate", lambda *a, **k: None)
    tokenizer = AutoTokenizer.from_pretrained(ensure_assets(quiet=True)["model"])
    report = RunReportCallback(str(tmp_path), {}, recipe="moe", trainer="sft",
                               reported_logs=kinds.load("sft").REPORTED_LOGS)
    trainer, _ = sft_trainer(tiny_model(), tokenizer, tmp_path, 0.01, report, max_steps=2,
                             activation_checkpointing=True)
    trainer.token_counter = report.tokens
    assert expert_load.attach(trainer, report) is not None
    trainer.train()
    metrics = report.finalize("completed")
    assert metrics["sft"]["aux_loss"]["first"] > 0 and metrics["params"]["active"] == ACTIVE
    load = metrics["expert_load"]
    assert load["scope"] == "all_ranks" and (load["experts"], load["top_k"]) == (4, 2)
    for layer in load["layers"]:  # 2 steps of 4 sequences of 12 positions, 2 experts each
        assert layer["tokens"] == 2 * 4 * 12 and sum(layer["tokens_per_expert"]) == 2 * 4 * 12 * 2
    assert load["max_over_mean"] == max(layer["max"] / layer["mean"] for layer in load["layers"])


def test_the_summary_says_the_aux_loss_and_the_expert_load():
    from fsdp_recipes.train.kinds import sft

    metrics = {"sft": {"aux_loss": {"first": 1.25, "last": 1.0, "eval_last": None}},
               "expert_load": {"experts": 4, "max_over_mean": 1.5, "idle_experts": 1, "layers": [{}, {}]}}
    assert sft.summary_lines(metrics) == [
        "aux loss    1.25 -> 1 (the router's load-balancing loss, before its coefficient)",
        "experts     busiest 1.50x the mean (worst of 2 layers); 1 of 8 received no token"]
    assert sft.summary_lines({"sft": None}) == []  # a dense model


def test_the_planners_expert_activations_are_what_autograd_keeps():
    """The planner's mixture-of-experts MLP term (memory_budget.activations_per_token_per_layer) against the bytes
    autograd saves inside a tiny Mixtral's sparse block (transformers 5's eager expert loop, float32), counted by
    distinct storage with a saved-tensor hook. 2026-11-28: 4,468 B per token measured, 4,456 estimated."""
    import dataclasses

    from transformers import MixtralConfig

    from fsdp_recipes.planning import memory_budget

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MixtralConfig(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2))
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    block = model.model.layers[0].mlp
    block.register_forward_pre_hook(lambda *a: hooks.__enter__())
    block.register_forward_hook(lambda *a: hooks.__exit__(None, None, None))
    tokens = 4 * 64
    model(input_ids=torch.randint(0, 100, (4, 64))).logits.sum().backward()
    m = memory_budget.shape_of(model, SimpleNamespace(use_peft=False))
    setup = memory_budget.Setup(shard=1, world=1, strategy="single", load_bytes=4, compute_bytes=4,
                                mixed_precision=False, tokens=tokens, checkpointed=False, optimizer_bytes=8,
                                runtime_bytes=0)
    dense_rest = dataclasses.replace(m, experts=0, top_k=0, intermediate=0)  # the norms and attention terms only
    estimate = (memory_budget.activations_per_token_per_layer(m, setup)
                - memory_budget.activations_per_token_per_layer(dense_rest, setup))
    assert sum(saved.values()) / tokens == pytest.approx(estimate, rel=0.02)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b-lora", "qwen3-30b-a3b-full", "mixtral-8x7b-lora"])
def test_make_data_on_the_moe_recipes_with_local_data_and_tokenizer(name, cache_dir, capsys, monkeypatch):
    """`make data RECIPE=<moe recipe>` offline: the hub's ultrachat and the model's tokenizer replaced by the tiny
    ones, as `ARGS=` would; the recipe's own settings (max_length 4096, its splits named) otherwise."""
    from fsdp_recipes.assets.tiny_assets import ensure_assets
    from fsdp_recipes.launch import data_preview

    assets = ensure_assets(quiet=True)
    monkeypatch.chdir(REPO)
    code = data_preview.main([name, "--dataset_name", str(assets["data"]), "--dataset_train_split", "train",
                              "--dataset_test_split", "test", "--model_name_or_path", str(assets["model"]),
                              "--examples", "1"])
    out, err = capsys.readouterr()
    assert code in (0, None) and err == "", err
    lines = out.splitlines()
    assert lines[0] == f"[data] recipe {name} (recipes/{name}), trainer sft, data {assets['data']}"
    assert "[data] max_length 4096 cuts no answer; 17 keeps 99% of rows whole" in lines
    assert lines[-1].startswith("[data] read, checked and tokenized in ")


QWEN3_30B_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def qwen3_30b_shape(targets):
    from fsdp_recipes.config.model_check import load_config
    from fsdp_recipes.planning import memory_budget

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(REPO / "recipes" / "qwen3-30b-a3b-lora" / "model_config.json"))
    return memory_budget.shape_of(model, SimpleNamespace(
        use_peft=True, lora_r=16, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        lora_target_parameters=targets, lora_dropout=0.0, lora_modules_to_save=None))


@pytest.mark.parametrize("policy, copies", [("none", 48 + 1), ("every_2", 24 + 2), ("ops", 2), ("full", 2)])
def test_the_planner_counts_paramwrappers_merged_copy_of_qwen3_30b_experts_by_hand(policy, copies):
    """LoRA on Qwen3-30B-A3B's experts: PEFT's ParamWrapper computes W + B@A for both expert tensors of a layer in its
    forward. By hand: 128 experts x (gate_up 1,536 x 2,048 + down 2,048 x 768) = 603,979,776 elements, in bf16
    1,207,959,552 bytes (1.125 GiB) per layer. Kept: one per layer not checkpointed (48 without checkpointing; 24
    with every_2, which checkpoints layers 0, 2, ...), plus the layer in its backward (the gradient of its copy, and
    for a checkpointed layer its recomputed copy too)."""
    from fsdp_recipes.planning import memory_budget
    from fsdp_recipes.speed import activation_checkpointing

    per_layer = 128 * (1536 * 2048 + 2048 * 768)
    assert per_layer == 603_979_776
    m = qwen3_30b_shape(QWEN3_30B_EXPERTS)
    assert m.merged_copy == per_layer and m.layers == 48
    setup = memory_budget.Setup(shard=1, world=1, strategy="FSDP", load_bytes=2, compute_bytes=2,
                                mixed_precision=True, tokens=4 * 4096, optimizer_bytes=8, runtime_bytes=0,
                                **activation_checkpointing.setup_fields(policy))
    assert memory_budget.budget(m, setup)["lora_merged_copies"] == copies * 1_207_959_552
    # the recipe as shipped (LoRA on the attention only) has no merged copy
    assert "lora_merged_copies" not in memory_budget.budget(qwen3_30b_shape([]), setup)


def test_paramwrappers_merged_copies_are_what_autograd_keeps():
    """The planner's per-layer copy against the bytes autograd saves in a tiny Qwen3-MoE's last MoE block with LoRA
    on both expert tensors (float32, eager experts): tensors the size of a layer's experts that are no parameter,
    counted by distinct storage. (The first layer keeps no copy of gate_up: its input needs no gradient.)"""
    from peft import LoraConfig, get_peft_model

    from fsdp_recipes.planning import memory_budget

    model = get_peft_model(tiny_model(experts_implementation="eager"), LoraConfig(
        r=2, target_modules=[], target_parameters=QWEN3_30B_EXPERTS))
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = {4 * 4 * 16 * 16, 4 * 4 * 16 * 8}  # float32 gate_up (4, 16, 16) and down (4, 16, 8)
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes() in sizes:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    block = model.base_model.model.model.layers[1].mlp
    block.register_forward_pre_hook(lambda *a: hooks.__enter__())
    block.register_forward_hook(lambda *a: hooks.__exit__(None, None, None))
    model(input_ids=torch.randint(0, 100, (3, 7))).logits.sum().backward()
    m = memory_budget.shape_of(tiny_model("meta"), SimpleNamespace(
        use_peft=True, lora_r=2, lora_target_modules=[], lora_target_parameters=QWEN3_30B_EXPERTS, lora_dropout=0.0,
        lora_modules_to_save=None))
    assert m.merged_copy == 4 * 16 * 16 + 4 * 16 * 8  # gate_up and down of one layer, by hand (TINY)
    assert sorted(saved.values()) == [4 * 4 * 16 * 8, 4 * 4 * 16 * 16]  # one merged copy of each
    setup = memory_budget.Setup(shard=1, world=1, strategy="single", load_bytes=4, compute_bytes=4,
                                mixed_precision=False, tokens=21, checkpointed=False, optimizer_bytes=8, runtime_bytes=0)
    # without checkpointing: each of the 2 layers' copies (measured above in the last), and one gradient
    assert memory_budget.budget(m, setup)["lora_merged_copies"] == (2 + 1) * sum(saved.values())
