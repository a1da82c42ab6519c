"""`make plan`: the memory estimate against hand arithmetic for two recipes, the topology rules, bad input. (Against
what a real 2-process run holds: tests/test_end_to_end.py, on that run's memory probe.)"""

import dataclasses
import subprocess

import pytest
import yaml

from conftest import REPO
from fsdp_recipes.config import recipes
from fsdp_recipes.planning import memory_budget, plan

RECIPES = recipes.available(REPO / "recipes")
CPU_RECIPES = ("tiny-cpu-lora", "smollm2-135m-lora")  # min_gpus 0: nothing for the GPU planner to budget


@pytest.mark.parametrize("name", [r for r in RECIPES if r not in CPU_RECIPES])
def test_every_recipe_fits_its_own_hardware(name):
    """Each GPU recipe, on the hardware its README names, plans as fitting (exit 0) and reports a budget."""
    gpu = yaml.safe_load((REPO / "accelerate_configs" / "recipes.yaml").read_text())[name].get("gpu", "H100")
    report = plan.budget_markdown(name, REPO / "recipes", gpu)
    assert "fits:" in report and "| **total** |" in report and "global batch" in report


def plan_here(monkeypatch, capsys, *args) -> subprocess.CompletedProcess:
    """plan.main in this process (a planner process spends seconds importing); test_make_plan_runs_the_planner
    below runs the real command."""
    from test_plan_questions import run

    monkeypatch.chdir(REPO)
    code, out, err = run(capsys, *args)
    return subprocess.CompletedProcess(args, code, out, err)


def test_plan_refuses_what_does_not_fit(monkeypatch, capsys):
    res = plan_here(monkeypatch, capsys, "mistral-7b-full", "--gpus", "1", "--gpu", "H100")
    assert res.returncode == 1
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: recipe mistral-7b-full does not fit"), res.stderr
    assert "| optimizer states |" in res.stdout  # the budget that explains why


# Parameters of the two 7-8B recipes' models, counted by hand from their model_config.json (not by the planner).
# Both: hidden 4096, intermediate 14336, 32 layers, 32 heads of 4096 / 32 = 128, 8 key/value heads (kv width
# 8 x 128 = 1024), untied embeddings, no biases. Per decoder layer:
#   q_proj, o_proj  4096 x 4096  = 16,777,216 each  -> 33,554,432
#   k_proj, v_proj  4096 x 1024  =  4,194,304 each  ->  8,388,608
#   gate, up, down  4096 x 14336 = 58,720,256 each  -> 176,160,768
#   two RMSNorm weights          =      4,096 each  ->      8,192
#                                                     218,112,000 per layer; x 32 = 6,979,584,000
DECODER_LAYERS_7B = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096)
# + final norm (4096) + input embedding and LM head (vocab x 4096 each)
MISTRAL_7B_PARAMS = DECODER_LAYERS_7B + 4096 + 2 * 32768 * 4096  # recipes/mistral-7b-full: vocab 32768
LLAMA_8B_PARAMS = DECODER_LAYERS_7B + 4096 + 2 * 128256 * 4096  # recipes/llama-3.1-8b-lora: vocab 128256
# LoRA of recipes/llama-3.1-8b-lora/sft.yaml: r 16 on all seven projections, r x (in + out) weights per linear:
#   q, o 16 x (4096 + 4096) = 131,072 each; k, v 16 x (4096 + 1024) = 81,920 each; gate, up, down 16 x (4096 + 14336)
#   = 294,912 each -> 1,310,720 per layer; x 32 layers
LLAMA_8B_LORA = 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))


def test_hand_counts_add_up():
    assert DECODER_LAYERS_7B == 6_979_584_000
    assert MISTRAL_7B_PARAMS == 7_248_023_552  # Mistral-7B-v0.3's published 7.25B
    assert LLAMA_8B_PARAMS == 8_030_261_248  # Llama-3.1-8B's published 8.03B
    assert LLAMA_8B_LORA == 41_943_040


def recipe_budget(name: str, gpus: int):
    """The planner's shape and per-GPU budget of a recipe on one node of `gpus`, as `make plan` computes them."""
    _, acc, cfg, model = plan.load_recipe(name, REPO / "recipes")
    setup = plan.setups(acc, cfg.training, cfg.model, gpus=gpus, nodes=1)["FSDP"]
    assert (setup.strategy, setup.shard) == ("FSDP", gpus)  # FULL_SHARD over the node
    shape = plan.model_shape(model, cfg.model)
    return shape, memory_budget.budget(shape, setup)


@pytest.mark.parametrize("gpus", [1, 8])
def test_full_finetuning_states_per_gpu_by_hand(gpus):
    """recipes/mistral-7b-full: every parameter trains. With bf16 mixed precision accelerate keeps the trainable
    weights in fp32 (4 bytes), gradients have the weights' dtype (4 bytes), AdamW keeps two fp32 moments (8 bytes):
    16 bytes per parameter, divided by the GPUs FSDP shards over (ZeRO-3)."""
    shape, b = recipe_budget("mistral-7b-full", gpus)
    assert (shape.params, shape.trainable) == (7_248_023_552, 7_248_023_552)
    assert b["weights"] == 7_248_023_552 * 4 // gpus  # 1 GPU: 28,992,094,208 B (27.0 GiB); 8 GPUs: 3,624,011,776
    assert b["gradients"] == 7_248_023_552 * 4 // gpus
    assert b["optimizer_states"] == 7_248_023_552 * 8 // gpus  # 1 GPU: 57,984,188,416 B (54.0 GiB); 8: 7,248,023,552
    if gpus == 8:
        assert b["weights"] + b["gradients"] + b["optimizer_states"] == 14_496_047_104  # 13.5 GiB per GPU


def test_lora_states_per_gpu_by_hand():
    """recipes/llama-3.1-8b-lora on 8 GPUs: the 8.03B base weights stay frozen in bf16 (2 bytes), the 41.9M LoRA
    weights train in fp32 (4 bytes) with fp32 gradients and AdamW's two fp32 moments; FSDP shards all of it by 8."""
    shape, b = recipe_budget("llama-3.1-8b-lora", 8)
    assert (shape.params, shape.trainable) == (8_030_261_248 + 41_943_040, 41_943_040)
    # (8,030,261,248 x 2 + 41,943,040 x 4) / 8 = (16,060,522,496 + 167,772,160) / 8
    assert b["weights"] == 2_028_536_832
    assert b["gradients"] == 41_943_040 * 4 // 8 == 20_971_520
    assert b["optimizer_states"] == 41_943_040 * 8 // 8 == 41_943_040


@pytest.mark.parametrize("args, message", [
    (["nope"], "unknown recipe 'nope'"),
    (["mistral-7b-full", "--gpu", "K80"], "unknown GPU 'K80'"),
    (["mistral-7b-full", "--gpu", "V100"], "does not support"),
    (["mistral-large-hsdp", "--gpus", "8", "--nodes", "1"], "NODES=1"),
    (["mistral-large-hsdp", "--gpus", "4", "--nodes", "4"], "does not fit inside a node of 4"),
    (["ddp-baseline", "--gpus", "0"], "must be at least 1"),
])
def test_bad_input_is_one_line(args, message, monkeypatch, capsys):
    res = plan_here(monkeypatch, capsys, *args)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], res.stderr
    assert "Fix:" in lines[0], lines[0]  # the problem and the fix (errors.py)


def test_a_local_model_the_launcher_refuses_is_the_launchers_line(tmp_path, monkeypatch, capsys):
    """A missing folder and a LoRA run's adapter folder: the launcher's own line (config/model_found.py), not "the
    config is not available offline" with a fix about model_config.json."""
    from fsdp_recipes.config.model_found import check_local_model
    from fsdp_recipes.errors import UserError

    adapter = tmp_path / "lora-run"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "mistralai/Mistral-7B-v0.3"}')
    for path in (str(tmp_path / "nothere"), str(adapter)):
        res = plan_here(monkeypatch, capsys, "mistral-7b-full", "--gpus", "8", "--model_name_or_path", path)
        with pytest.raises(UserError) as launcher:
            check_local_model(path)
        assert res.returncode == 2 and res.stderr.strip() == f"error: {launcher.value}", res.stderr


@pytest.mark.slow
def test_make_plan_runs_the_planner():
    res = subprocess.run(["make", "--no-print-directory", "plan", "RECIPE=ddp-baseline", "GPUS=8", "GPU=H200"],
                         cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "decision rule" in res.stdout and "DDP" in res.stdout


@pytest.mark.parametrize("fsdp_config, expected", [
    ({"fsdp_reshard_after_forward": False}, False), ({"fsdp_reshard_after_forward": True}, True),
    ({"fsdp_reshard_after_forward": "SHARD_GRAD_OP"}, False), ({"fsdp_reshard_after_forward": "FULL_SHARD"}, True),
    ({"fsdp_sharding_strategy": "SHARD_GRAD_OP"}, False), ({"fsdp_sharding_strategy": "FULL_SHARD"}, True),
    ({"fsdp_sharding_strategy": "HYBRID_SHARD_ZERO2"}, False), ({"fsdp_sharding_strategy": "HYBRID_SHARD"}, True),
    ({"fsdp_sharding_strategy": 2}, False), ({"fsdp_sharding_strategy": "1"}, True),
    ({"fsdp_reshard_after_forward": "no"}, False), ({"fsdp_reshard_after_forward": "true"}, True),
    ({}, True),
])
def test_reshard_after_forward_read_from_the_accelerate_config(fsdp_config, expected):
    assert plan.reshards_after_forward({"distributed_type": "FSDP", "fsdp_config": fsdp_config}) is expected


def test_without_resharding_the_whole_models_gathered_copy_is_counted():
    """recipes/smollm2-135m-lora keeps FSDP2's gathered bf16 parameters from forward to backward
    (fsdp_reshard_after_forward false). On an H100 (2026-11-26, world size 1, bf16) torch's max_memory_allocated was
    1,355,032,064 B, 289 MB above the estimate that counted two layers' gathered copies; counting the whole model's
    brought the estimate to 1,350,865,792 B (bench/results/first-contact-nvidia-h100-80gb-hbm3-2026-11-26T1454Z.json,
    recomputed). By hand: SmolLM2-135M has 134,515,008 parameters; LoRA r 16 on the seven projections of its 30
    layers (hidden 576, k/v 192, intermediate 1536) adds 16 x (2 x 1152 + 2 x 768 + 3 x 2112) = 162,816 per layer."""
    _, acc, cfg, model = plan.load_recipe("smollm2-135m-lora", REPO / "recipes")
    assert plan.reshards_after_forward(acc) is False
    setup = plan.setups(acc, cfg.training, cfg.model, gpus=1, nodes=1)["FSDP"]
    setup = dataclasses.replace(setup, compute_bytes=2, mixed_precision=True)  # as placed on a GPU: bf16
    shape = plan.model_shape(model, cfg.model)
    assert shape.params == 134_515_008 + 30 * 162_816
    gathered = memory_budget.budget(shape, setup)["communication_buffers"]
    assert gathered == (134_515_008 + 30 * 162_816) * 2 + 162_816 * 4  # bf16 copies + one layer's fp32 LoRA grads
    resharded = memory_budget.budget(shape, dataclasses.replace(setup, reshard_after_forward=True))
    assert resharded["communication_buffers"] == (2 * shape.layer_params + shape.root_params) * 2 + 162_816 * 4


def test_each_memory_limit_is_named_and_the_gates_is_in_gib():
    """A new user saw "limit 39.8 GiB per GPU" beside "71.6 GiB usable" (smollm2-135m-lora on an H100) and could not
    tell which applies. The 39.8 is right: the recipe's peak_memory_max_fraction gate, 50% of the H100's 79.6 GiB,
    which the checkpointing pick respects because the run is judged on it (peak reserved / device total,
    metrics/gates.py); the 71.6 is the planner's usable 90%. Each line now names its figure. By hand:
    0.5 x 79.6 = 39.8; 0.9 x 79.6 = 71.64; 0.8 x 79.6 = 63.68; a 95% gate, 75.62, is looser than usable; the
    estimates 3.2 / 79.6 = 4.0% and 45.0 / 79.6 = 56.5%."""
    from types import SimpleNamespace

    from fsdp_recipes.planning import checkpointing

    default = SimpleNamespace(mfu_min=0.01, peak_memory_max_fraction=0.5, memory_headroom_warning=0.1,
                              gates_warn_only=True)
    assert checkpointing.limit_share(default, 0.9, 79.6) == (
        0.5, "the peak_memory_max_fraction gate: 50% of 79.6 GiB, stricter than the 71.6 GiB usable")
    looser = SimpleNamespace(peak_memory_max_fraction=0.95, memory_headroom_warning=0.1)
    assert checkpointing.limit_share(looser, 0.9, 79.6) == (0.9, "the usable budget: 90% of 79.6 GiB")
    margin = SimpleNamespace(peak_memory_max_fraction=None, memory_headroom_warning=0.2)
    assert checkpointing.limit_share(margin, 0.9, 79.6) == (
        0.8, "the memory_headroom_warning margin: 80% of 79.6 GiB, stricter than the 71.6 GiB usable")

    assert plan.gate_lines(default, 3.2, 79.6) == [
        "gates: MFU >= 1% (mfu_min), peak memory <= 50% of the GPU (peak_memory_max_fraction: the gate's limit "
        "39.8 GiB of 79.6; this estimate: 3.2 GiB, 4%, under it); warn only (gates_warn_only)"]
    enforced = SimpleNamespace(mfu_min=None, peak_memory_max_fraction=0.5, gates_warn_only=False)
    assert plan.gate_lines(enforced, 45.0, 79.6) == [
        "gates: peak memory <= 50% of the GPU (peak_memory_max_fraction: the gate's limit 39.8 GiB of 79.6; this "
        "estimate: 45.0 GiB, 57%, over it: the run would fail this gate); a failed gate exits 3"]

    # the trial's recipe, planned as make plan plans it: the pick's limit says it is the gate's, the usable is 71.6
    p = plan.prepare("smollm2-135m-lora", 8, 1, "H100", REPO / "recipes")
    text = plan.report(p)
    assert ("limit 39.8 GiB per GPU (the peak_memory_max_fraction gate: 50% of 79.6 GiB, stricter than the 71.6 GiB "
            "usable) -> pick none (the recipe's)") in text
    assert "fits: 3.2 GiB of 71.6 GiB usable per GPU" in text
    assert "the gate's limit 39.8 GiB of 79.6; this estimate: 3.2 GiB, 4%, under it" in text
    # --fit answers against the usable 71.64 GiB, and says the gate's 39.80 (0.5 x 79.6) is lower
    from fsdp_recipes.planning import answers

    assert ("  a lower limit: 39.80 GiB per GPU (the peak_memory_max_fraction gate: 50% of 79.6 GiB, stricter than "
            "the 71.6 GiB usable), which the activation-checkpointing pick uses; an answer above it fits the usable "
            "budget, not that limit") in answers.fit_section(p).splitlines()


@pytest.mark.parametrize("name, overrides, batch", [
    ("llama-3.1-8b-lora-dpo", [], 4),  # 4 pairs x 2 sequences x 2,048 tokens: 16,384 tokens a micro-batch
    ("llama-3.1-8b-lora-rloo", [], 8),  # 8 completions x (512 + 1,024): GRPOConfig/RLOOConfig have no max_length
    ("smollm2-135m-grpo", ["--generation_backend", "transformers"], 16),  # + the generate KV cache of 16 x 1
    ("llama-3.1-8b-lora", [], 1),
])
def test_fit_searches_the_batch_as_the_plain_plan_counts_it(name, overrides, batch):
    """--fit's batch answer is a search over the plain plan's own total: with the usable set to the recipe's own
    total, the largest batch that fits is the recipe's own (from its YAML); and the answer on the H100, planned
    plainly at that batch and one more (with the same checkpointing), is the two totals --fit prints. It was 8 for
    the DPO recipe (a pair counted as one sequence: every DPO answer about twice too large), a traceback for GRPO
    and RLOO (no max_length), and the policy's generate kept the recipe's KV cache at every batch."""
    from fsdp_recipes.planning import answers

    p = plan.prepare(name, 8, 1, "H100", REPO / "recipes", overrides)
    own_total = p.budgets[p.own]["total"]
    at_own = dataclasses.replace(p, capacity=(own_total + 1) / memory_budget.GIB / plan.HEADROOM)
    first = answers.fit_section(at_own).splitlines()[1]
    assert first.startswith(f"  per_device_train_batch_size: {batch} fits ({own_total:,} B"), first

    answer = answers.fit_section(p).splitlines()[1]
    b = int(answer.split(": ")[1].split(" fits")[0])
    pinned = [*overrides, "--activation_checkpointing_policy", p.checkpointing.pick]
    totals = [plan.prepare(name, 8, 1, "H100", REPO / "recipes", [*pinned, "--per_device_train_batch_size", str(n)])
              .budgets[p.own]["total"] for n in (b, b + 1)]
    assert answer.startswith(f"  per_device_train_batch_size: {b} fits ({totals[0]:,} B = ") and \
        f"; {b + 1} does not ({totals[1]:,} B = " in answer, (answer, totals)


@pytest.mark.parametrize("name, max_steps", [("smollm2-135m-grpo", 56), ("smollm2-135m-rloo", 40)])
def test_a_sampling_kinds_comms_scale_and_time_read_its_sequence_length(name, max_steps):
    """GRPOConfig and RLOOConfig have no max_length: --comms and --scale (answers.work) and --time read it, a
    traceback (AttributeError). A trained sequence is the planned prompt (sampling.PROMPT_TOKENS, 512) + the recipe's
    max_completion_length 6 = 518 tokens, 16 completions a micro-batch: 8,288 tokens a step on a GPU. --time does not
    model a sampling kind (a row is a prompt, sampling is not counted) and says so in one line."""
    from fsdp_recipes.errors import UserError
    from fsdp_recipes.planning import answers, fabric

    p = plan.prepare(name, 8, 1, "H100", REPO / "recipes")
    net = fabric.fabric(plan.gpu_spec("H100")[0], None, None)
    text, _ = answers.comms_section(p, net, 0.4)
    assert "1 micro-batch(es) of 16 x 518 tokens" in text and "compute: 8,288 tokens x " in text, text
    assert "(1 x 16 x 518 tokens per GPU" in answers.scale_section(p, net, 0.4, [1])
    with pytest.raises(UserError, match=rf"^--time does not model {name.split('-')[-1]}: a row is a prompt .* Fix: "
                                        rf"time a short run .* to max_steps {max_steps}$") as err:
        answers.time_section(p, net, 0.4, 1000, None)
    assert "\n" not in str(err.value)


def test_dpo_comms_count_a_pairs_two_sequences():
    """A DPO micro-batch of 4 pairs puts 8 sequences through the policy (chosen and rejected concatenated), as the
    plain plan's memory counts them: --comms counted 4 x 2,048 tokens, half the step's compute. By hand:
    llama-3.1-8b-lora-dpo, 4 pairs x 2 x 2,048 = 16,384 tokens a micro-batch, 4 micro-batches: 65,536 a step."""
    from fsdp_recipes.planning import answers, fabric

    p = plan.prepare("llama-3.1-8b-lora-dpo", 8, 1, "H100", REPO / "recipes")
    text, _ = answers.comms_section(p, fabric.fabric(plan.gpu_spec("H100")[0], None, None), 0.4)
    assert "4 micro-batch(es) of 8 x 2,048 tokens" in text and "compute: 65,536 tokens x " in text, text


def test_dpos_comms_and_time_count_a_pair_as_two_sequences():
    """A DPO pair is 2 sequences (chosen and rejected), as the plain plan and --fit count it; --comms and --time
    counted a micro-batch as batch x max_length. qwen3-8b-full-dpo: 2 pairs a micro-batch, 8 micro-batches, max_length
    2,048: 8 x 4 x 2,048 = 65,536 tokens a step on a GPU (32,768 before). --time over 1,000 rows on 8 GPUs: 63
    micro-batches a GPU, 8 steps; every sequence 2,048 long (the worst case) is 4,096 tokens a row, 4,096,000 in all,
    attention at 2,048; 3,000 tokens a row given (both sequences) is 1,500 a sequence, not cut at 2,048."""
    from fsdp_recipes.planning import answers, duration, fabric

    p = plan.prepare("qwen3-8b-full-dpo", 8, 1, "H100", REPO / "recipes")
    net = fabric.fabric(plan.gpu_spec("H100")[0], None, None)
    text, _ = answers.comms_section(p, net, 0.4)
    assert "8 micro-batch(es) of 4 x 2,048 tokens (2 rows of 2 sequences)" in text, text
    assert "compute: 65,536 tokens x " in text, text
    assert "(8 x 4 x 2,048 tokens per GPU" in answers.scale_section(p, net, 0.4, [1])
    worst = answers.time_section(p, net, 0.4, 1000, None)
    assert "every sequence (2 a row) max_length (2,048) long, the worst case" in worst, worst
    assert "  steps: 8 (1 epoch(s), global batch 128 = 2 x 8 x 8)" in worst, worst
    assert "  tokens: 4,096,000 (1,000 rows read x 4,096.0), " in worst, worst
    assert "(incl. the reference forward; attention at 2,048 tokens)" in worst, worst
    given = answers.time_section(p, net, 0.4, 1000, 3000)
    assert "  tokens: 3,000,000 (1,000 rows read x 3,000.0), " in given, given
    assert "(incl. the reference forward; attention at 1,500 tokens)" in given, given
    # a local dataset's pair: each sequence cut at max_length 64 (prompt 10 + chosen 60 = 70: 64; + rejected 5: 15)
    import types

    pair = types.SimpleNamespace(answer_names=["chosen", "rejected"], prompt=[10], answers={"chosen": [60],
                                                                                            "rejected": [5]})
    assert duration.row_tokens(pair, 0, 64) == 64 + 15


def test_max_length_past_the_models_context_is_one_warning(monkeypatch, capsys):
    """Mistral-7B's 32,768 positions: a max_length past them is said in one warning line (the launcher does not
    refuse it: rows that long are what it affects), not only "does not fit. Fix: more GPUs or nodes"."""
    res = plan_here(monkeypatch, capsys, "mistral-7b-full", "--gpus", "8", "--max_length", "1000000")
    warned = [line for line in res.stdout.splitlines() if line.startswith("warning: max_length")]
    assert warned == ["warning: max_length 1,000,000 is beyond MistralForCausalLM's context of 32,768 tokens "
                      "(max_position_embeddings): rows that long, or packed to it, reach positions it was never trained "
                      "on. Fix: --max_length 32768 or less, or yarn_rope_scaling: true to stretch its positions."], \
        res.stdout
    res = plan_here(monkeypatch, capsys, "mistral-7b-full", "--gpus", "8", "--max_length", "32768")
    assert "warning: max_length" not in res.stdout


@pytest.mark.parametrize("params, trainable, said", [
    (3_040_000, 3_040_000, ("3.04M", "3.04M")),  # the tiny model: was "0.00B parameters, 0.003B trainable"
    (3_700_000, 660_000, ("3.70M", "0.66M")),
    (8_072_204_288, 41_943_040, ("8.07B", "0.042B")),  # the recipe READMEs' lines, unchanged
    (8_072_204_288, 200_000, ("8.07B", "0.20M")),  # a few trainable ones: not "0.000B"
])
def test_parameter_counts_keep_their_digits(params, trainable, said):
    from fsdp_recipes.planning.answers import counts

    m = type("Shape", (), {"params": params, "active": params, "trainable": trainable})
    assert (counts(m)[0], counts(m)[2]) == said


def test_a_tiny_models_plan_says_millions(monkeypatch, capsys):
    res = plan_here(monkeypatch, capsys, "tiny-cpu-lora", "--use_peft", "false", "--gpus", "1")
    first = res.stdout.splitlines()[0]
    assert "M parameters, " in first and "M trainable (full fine-tuning)" in first and "0.00B" not in first, first
