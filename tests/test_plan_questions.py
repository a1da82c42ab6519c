"""`make plan`'s answers beyond "does it fit": the run's overrides, --fit, --comms/--scale, --time. In-process (the
planner's main with argv), every expected figure derived by hand below from the recipes' model_config.json, never
recomputed with the planner's functions."""

import dataclasses
import math

import pytest

from conftest import REPO
from fsdp_recipes.config import run_config
from fsdp_recipes.errors import UserError
from fsdp_recipes.planning import answers, comms, fabric, fit, plan

GIB = 2**30
USABLE_H100 = 79.6 * 0.9 * GIB  # plan.GPUS["H100"] x the 90% headroom, bytes

# ---- hand counts (model_config.json of recipes/mistral-7b-full and recipes/llama-3.1-8b-lora; see test_plan.py)
# Both: hidden h 4096, 32 layers, q width 4096, kv width 1024, intermediate 14336.
LAYER_7B = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096  # 218,112,000
MISTRAL_ROOT = 4096 + 2 * 32768 * 4096  # final norm + embedding + LM head (vocab 32768): 268,439,552
MISTRAL_PARAMS = 32 * LAYER_7B + MISTRAL_ROOT  # 7,248,023,552
LLAMA_LORA_LAYER = 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))  # r 16, 7 targets: 1,310,720
LLAMA_LAYER = LAYER_7B + LLAMA_LORA_LAYER  # 219,422,720
LLAMA_ROOT = 4096 + 2 * 128256 * 4096  # vocab 128256: 1,050,677,248
LLAMA_TRAINABLE = 32 * LLAMA_LORA_LAYER  # 41,943,040


# The hand counts below are for these recipes' settings before issue 57 (micro-batch 4 x 4 accumulation, full
# activation checkpointing; mistral-large-hsdp: full checkpointing): pinned here, ahead of each test's own overrides.
# The recipes' own settings (auto: the planner's pick) are worked out by hand in tests/test_checkpointing_policies.py.
FULL = ["--activation_checkpointing_policy", "full"]
AS_DERIVED = {"mistral-7b-full": ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4", *FULL],
              "llama-3.1-8b-lora": ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4", *FULL],
              "mistral-large-hsdp": FULL}


def run(capsys, recipe, *argv):
    """plan.main in this process, the recipe pinned as derived: (exit code, stdout, stderr)."""
    pins = AS_DERIVED.get(recipe.rsplit("/", 1)[-1], [])
    try:
        code = plan.main([recipe, *pins, *argv])
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    return int(code or 0), out.out, out.err


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # recipe names resolve under ./recipes, as `make plan` runs them


@pytest.fixture(scope="module")
def mistral():
    return plan.prepare("mistral-7b-full", 8, 1, "H100", REPO / "recipes", AS_DERIVED["mistral-7b-full"])


@pytest.fixture(scope="module")
def llama():
    return plan.prepare("llama-3.1-8b-lora", 8, 1, "H100", REPO / "recipes", AS_DERIVED["llama-3.1-8b-lora"])


def test_hand_counts():
    assert (LAYER_7B, MISTRAL_ROOT, MISTRAL_PARAMS) == (218_112_000, 268_439_552, 7_248_023_552)
    assert (LLAMA_LAYER, LLAMA_ROOT, LLAMA_TRAINABLE) == (219_422_720, 1_050_677_248, 41_943_040)


# ------------------------------------------------------------------ --fit: the boundaries

# mistral-7b-full on 8 H100 (FSDP2 over 8, bf16 mixed: c = 2, fp32 master 4 B, AdamW 8 B, checkpointing on):
#   weights = gradients = 7,248,023,552 x 4 / 8 = 3,624,011,776; optimizer = 7,248,023,552 x 8 / 8 = 7,248,023,552
#   comm buffers = (2 layers + root) x 2 + one layer's gradients x 4 = (436,224,000 + 268,439,552) x 2 + 872,448,000
#   runtime 2 GiB; LM head: the fp32 head-weight gradient 32768 x 4096 x 4 and the 4096-token x 32768 tile x 4
# per token (T = batch x max_length): checkpointed layer inputs 32 x 4096 x 2 = 262,144; one layer's full set
#   2h(4 + 2c) + c(2q + 2kv + 4I) = 65,536 + 2 x (8192 + 2048 + 57344) = 200,704 (the trained norms keep their
#   normalized input, 2h x c: 184,320 as LoRA's frozen ones would); the final norm's fp32 input 4h, the head's copy of
#   its output and its normalized input 2 x 2h, and the hidden states' fp32 gradient 4h = 49,152 -> 512,000 B per token
MISTRAL_FIXED = (2 * 3_624_011_776 + 7_248_023_552 + (436_224_000 + 268_439_552) * 2 + 872_448_000 + 2 * GIB
                 + 32768 * 4096 * 4 + 4096 * 32768 * 4)
MISTRAL_PER_TOKEN = 262_144 + 200_704 + 49_152
# llama-3.1-8b-lora on 8 H100 (bf16 weights frozen, LoRA r 16 on 7 linears with dropout 0.05, checkpointing on):
#   weights (8,030,261,248 x 2 + 41,943,040 x 4) / 8 = 2,028,536,832; gradients 41,943,040 x 4 / 8; AdamW x 8 / 8
#   comm buffers (2 x 219,422,720 + 1,050,677,248) x 2 + 1,310,720 x 4; runtime 2 GiB; the head tile; no head grad
# per token: 262,144 + one layer: 49,152 + 2 x (8192 + 2048 + 57344 + 16 x 7) + dropout (2 + 1) x (6 x 4096 + 14336)
#   = 49,152 + 135,392 + 116,736 = 301,280; + the final norm's fp32 input 4h and the head's copy of its output 2h (the
#   norm frozen: no normalized input kept) + the hidden states' fp32 gradient 4h = 40,960 -> 604,384 B per token
LLAMA_FIXED = (2_028_536_832 + 41_943_040 * 4 // 8 + 41_943_040 + (2 * LLAMA_LAYER + LLAMA_ROOT) * 2
               + LLAMA_LORA_LAYER * 4 + 2 * GIB + 4096 * 32768 * 4)
LLAMA_PER_TOKEN = 262_144 + 49_152 + 135_392 + 116_736 + 40_960


@pytest.mark.parametrize("name, fixed, per_token", [
    ("mistral", MISTRAL_FIXED, MISTRAL_PER_TOKEN), ("llama", LLAMA_FIXED, LLAMA_PER_TOKEN)])
def test_fit_boundaries_by_hand(name, fixed, per_token, request):
    p = request.getfixturevalue(name)
    total = lambda tokens: fixed + per_token * tokens  # noqa: E731  (tokens >= 4096: the head tile is full)
    # the plain plan's total at the recipe's own batch 4 x 4096 is this formula
    assert p.budgets["FSDP"]["total"] == total(4 * 4096)
    best_batch = math.floor((USABLE_H100 - fixed) / (per_token * 4096))
    best_length = math.floor((USABLE_H100 - fixed) / (per_token * 4))
    assert total(best_batch * 4096) <= USABLE_H100 < total((best_batch + 1) * 4096)
    assert total(4 * best_length) <= USABLE_H100 < total(4 * (best_length + 1))
    b = fit.batch(p.shape, p.setup, 4096, p.usable)
    n = fit.length(p.shape, p.setup, 4, p.usable, None)
    assert (b.value, b.fits_bytes) == (best_batch, total(best_batch * 4096))
    assert b.next_bytes == total((best_batch + 1) * 4096)
    assert (n.value, n.fits_bytes, n.next_bytes) == (best_length, total(4 * best_length), total(4 * best_length + 4))


def test_fit_answers_printed(capsys):
    """The printed --fit section for mistral-7b-full on 8 H100, with the figures derived above (27 and 27,794; 28 and
    28,713 before the trained norms' term)."""
    assert math.floor((USABLE_H100 - MISTRAL_FIXED) / (MISTRAL_PER_TOKEN * 4096)) == 27
    assert math.floor((USABLE_H100 - MISTRAL_FIXED) / (MISTRAL_PER_TOKEN * 4)) == 27_794
    code, out, _ = run(capsys, "mistral-7b-full", "--gpus", "8", "--fit")
    assert code == 0
    assert f"per_device_train_batch_size: 27 fits ({MISTRAL_FIXED + MISTRAL_PER_TOKEN * 27 * 4096:,} B" in out
    assert f"28 does not ({MISTRAL_FIXED + MISTRAL_PER_TOKEN * 28 * 4096:,} B" in out
    assert "max_length: 27,794 fits" in out and "27,795 does not" in out
    assert "activation checkpointing: needed" in out  # off it holds every layer's full set: 32 x 200,704 B per token


def test_overrides_change_the_plan_and_fit_finds_the_smallest_topology(capsys):
    """The run's overrides, as make finetune takes them: mistral-7b-full with --max_length 8192 on 1 GPU. Sharded
    over n GPUs the states are 7,248,023,552 x 16 / n; the batch is 4 x 8192 = 32,768 tokens."""
    tokens = 4 * 8192
    activations = MISTRAL_PER_TOKEN * tokens + 32768 * 4096 * 4 + 4096 * 32768 * 4
    rest = (436_224_000 + 268_439_552) * 2 + 872_448_000 + 2 * GIB + activations
    total = lambda n: math.ceil(MISTRAL_PARAMS * 4 / n) * 2 + math.ceil(MISTRAL_PARAMS * 8 / n) + rest  # noqa: E731
    assert total(2) > USABLE_H100 >= total(3)  # 1 and 2 GPUs do not fit, 3 do
    code, out, err = run(capsys, "mistral-7b-full", "--gpus", "1", "--fit", "--max_length", "8192")
    assert code == 1 and err.startswith("error: recipe mistral-7b-full does not fit") and len(err.splitlines()) == 1
    assert "sequences of up to 8192 tokens" in out
    assert f"smallest topology: GPUS=3 NODES=1 (FSDP over 3; 2 would need {total(2) / GIB:,.2f} GiB)" in out


def test_hsdp_smallest_topology(capsys):
    """mistral-large-hsdp: under HSDP per-GPU memory depends on the shard group only, so the answer is a shard group
    (GPUs per node) at the minimum of 2 nodes."""
    code, out, _ = run(capsys, "mistral-large-hsdp", "--gpus", "8", "--nodes", "2", "--fit")
    assert code == 0 and "smallest topology: NODES=2 GPUS=" in out


# ------------------------------------------------------------------ --comms: bytes per collective per step


def test_fsdp_bytes_per_step_by_hand(mistral, llama):
    """Per optimizer step of 4 micro-batches on 8 H100 (NVLink 4, 450 GB/s per direction), bf16 gathers and reduces.
    All-gather: each micro-batch gathers every layer twice (forward, and backward after reshard_after_forward) and the
    root once; ring all-gather sends 7/8 of the payload. Reduce-scatter: once per step (no_sync on the others)."""
    f = fabric.fabric("H100")
    cases = [(mistral, LAYER_7B, MISTRAL_ROOT, MISTRAL_PARAMS), (llama, LLAMA_LAYER, LLAMA_ROOT, LLAMA_TRAINABLE)]
    for p, layer, root, trainable in cases:
        e = comms.estimate(p.shape, answers.topology(p), answers.work(p, 0.4), f)
        gather, reduce = e.collectives
        assert (gather.op, gather.group, reduce.op) == ("all-gather", 8, "reduce-scatter")
        assert gather.payload == 4 * (2 * 32 * layer + root) * 2
        assert gather.sent == round(7 / 8 * 4 * (2 * 32 * layer + root) * 2)
        assert reduce.payload == trainable * 2 and reduce.sent == round(7 / 8 * trainable * 2)
        assert gather.link == "NVLink 4" and gather.seconds == pytest.approx(gather.sent / 450e9)
    # mistral: 4 x 14,227,607,552 x 2 = 113,820,860,416 B gathered; 99,593,252,864 B sent by each GPU in 0.221 s
    assert comms.estimate(mistral.shape, answers.topology(mistral), answers.work(mistral, 0.4),
                          f).collectives[0].sent == 99_593_252_864


def test_hsdp_all_reduce_and_one_dimensional_fsdp_across_nodes(mistral):
    """4 nodes of 8: HSDP reduce-scatters in the node, then all-reduces its 1/8 gradient shard over 4 replicas on the
    network (2 x 3/4 of the payload, 50 GB/s NDR); 1-D FSDP over 32 sends 31/32 of everything over the network."""
    f = fabric.fabric("H100")
    w = answers.work(mistral, 0.4)
    hsdp = comms.estimate(mistral.shape, comms.Topology("HSDP", 8, 4, 8), w, f)
    ar = hsdp.collectives[-1]
    assert (ar.op, ar.group, ar.payload) == ("all-reduce", 4, MISTRAL_PARAMS * 2 // 8)
    assert ar.sent == round(2 * 3 / 4 * (MISTRAL_PARAMS * 2 // 8)) and ar.gbps == 50
    flat = comms.estimate(mistral.shape, comms.Topology("FSDP", 8, 4, 32), w, f)
    assert flat.collectives[0].sent == round(31 / 32 * 4 * (2 * 32 * LAYER_7B + MISTRAL_ROOT) * 2)
    assert flat.collectives[0].link.startswith("network") and flat.collectives[0].gbps == 50
    assert any("one-dimensional FSDP across 4 nodes" in x for x in flat.warnings)
    nvl = fabric.fabric("H100-NVL")  # an NVLink domain of 2: a shard group of 8 runs over PCIe Gen5
    assert any("larger than the 2-GPU" in x for x in comms.estimate(mistral.shape, comms.Topology("FSDP", 8, 1, 8),
                                                                     w, nvl).warnings)


# Compute, mistral-7b-full: matmul weights = all but the input embedding: 7,248,023,552 - 32768 x 4096
# = 7,113,805,824; 6 FLOPs each per token (full fine-tuning) + attention 12 x 32 layers x 4096 x max_length.
def test_verdict_compute_bound(capsys):
    """The recipe as written on 8 H100: 4 x 4 x 4096 = 65,536 tokens per GPU per step."""
    per_token = 6 * 7_113_805_824 + 12 * 32 * 4096 * 4096  # 49,125,285,888 FLOP
    compute = 65_536 * per_token / (989e12 * 0.4)  # 8.14 s
    comm = round(7 / 8 * 4 * (2 * 32 * LAYER_7B + MISTRAL_ROOT) * 2) / 450e9 + round(7 / 8 * MISTRAL_PARAMS * 2) / 450e9
    assert comm < compute
    code, out, _ = run(capsys, "mistral-7b-full", "--gpus", "8", "--comms")
    assert code == 0
    assert f"49.13 GFLOP/token" in out and f"= {compute:,.2f} s" in out
    assert f"verdict: compute-bound (communication {comm:,.2f} s vs compute {compute:,.2f} s" in out


def test_verdict_communication_bound(capsys):
    """The same model with one 512-token sequence per step, FSDP over 4 nodes of 8 (1-D, the NDR network)."""
    per_token = 6 * 7_113_805_824 + 12 * 32 * 4096 * 512
    compute = 512 * per_token / (989e12 * 0.4)  # 0.056 s
    comm = (round(31 / 32 * (2 * 32 * LAYER_7B + MISTRAL_ROOT) * 2) + round(31 / 32 * MISTRAL_PARAMS * 2)) / 50e9
    assert comm > compute  # 0.83 s
    code, out, _ = run(capsys, "mistral-7b-full", "--gpus", "8", "--nodes", "4", "--comms", "--max_length", "512",
                       "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1")
    assert code == 0, out
    assert f"verdict: communication-bound (communication {comm:,.2f} s vs compute {compute:,.2f} s" in out
    assert "warning: one-dimensional FSDP across 4 nodes" in out


def test_scale_table_shows_why_hsdp(capsys):
    code, out, _ = run(capsys, "mistral-large-hsdp", "--gpus", "8", "--nodes", "2", "--scale", "1,4,64")
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("| 4 |") or line.startswith("| 64 |")]
    assert len(rows) == 4
    assert all(r.endswith("communication-bound |") for r in rows if "FSDP over" in r)
    assert all(r.endswith("compute-bound |") for r in rows if "HSDP" in r)


# ------------------------------------------------------------------ --time


def test_time_by_hand(capsys):
    """200,000 rows of 1,400 tokens, 1 epoch, global batch 4 x 4 x 8 = 128: ceil(200,000 / 32) = 6,250 micro-batches
    per rank, ceil(6,250 / 4) = 1,563 steps; 280,000,000 tokens at 6 x 7,113,805,824 + 12 x 32 x 4096 x 1400
    = 42,682,834,944 + 2,202,009,600 = 44,884,844,544 FLOP/token (attention at the mean row length), at 40% of
    989 TFLOP/s on 8 GPUs."""
    per_token = 6 * 7_113_805_824 + 12 * 32 * 4096 * 1400
    assert per_token == 44_884_844_544
    seconds = 280_000_000 * per_token / (8 * 989e12 * 0.4)
    code, out, _ = run(capsys, "mistral-7b-full", "--gpus", "8", "--time", "--rows", "200000", "--tokens-per-row",
                       "1400")
    assert code == 0
    assert "steps: 1,563 (1 epoch(s), global batch 128 = 4 x 4 x 8)" in out
    assert "tokens: 280,000,000 (200,000 rows read x 1,400.0), 44.88 GFLOP/token" in out
    assert f"time: {seconds / 3600:,.2f} h = 1,563 steps x {seconds / 1563:,.3g} s" in out


def test_time_from_the_local_dataset_matches_the_measured_run(capsys, cache_dir):
    """tiny-cpu-lora's own dataset, tokenized with its own tokenizer: 300 steps of 32 rows read 9,600 rows; the
    README's measured end-to-end run counted 157,920 non-padding tokens in those 300 steps. The planner's mean is
    over every 4th row (1,000 of 4,000) and the run's 9,600 rows are 2.4 shuffled epochs: within 0.5%."""
    code, out, _ = run(capsys, "tiny-cpu-lora", "--gpus", "2", "--time")
    assert code == 0
    assert "how long: 4,000 rows from" in out and "steps: 300 (max_steps 300, global batch 32 = 16 x 1 x 2)" in out
    tokens = int(out.split("tokens: ", 1)[1].split(" ", 1)[0].replace(",", ""))
    assert abs(tokens / 157_920 - 1) < 0.005, tokens


# ------------------------------------------------------------------ bad input: one line, exit 2


def test_an_override_the_run_rejects_is_the_runs_line(capsys):
    with pytest.raises(UserError) as run_error:
        run_config.parse_args(["--config", str(REPO / "recipes/mistral-7b-full/sft.yaml"), "--max_lenght", "10"])
    code, _, err = run(capsys, "mistral-7b-full", "--max_lenght", "10")
    assert code == 2 and err.strip() == f"error: {run_error.value}"


@pytest.mark.parametrize("args, message", [
    (["--learning_rate", "-1"], "learning_rate is -1.0"),
    (["--comms", "--network", "myrinet"], "unknown network 'myrinet'"),
    (["--gpu", "K80", "--comms"], "unknown GPU 'K80'"),
    (["--scale", "1,x"], "--scale 1,x"),
    (["--nodes", "3", "--gpus", "8", "--mfu", "2"], "--mfu 2.0"),
])
def test_bad_input_is_one_line(capsys, args, message):
    code, _, err = run(capsys, "mistral-7b-full", *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err


def test_hsdp_groups_that_cannot_fit_the_topology(capsys):
    code, _, err = run(capsys, "mistral-large-hsdp", "--gpus", "6", "--nodes", "2", "--comms")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "does not fit inside a node of 6" in err


def test_a_recipe_folder_path_is_a_recipe(capsys):
    code, out, _ = run(capsys, str(REPO / "recipes" / "llama-3.1-8b-lora"), "--gpus", "8")
    assert code == 0 and out.startswith("recipe llama-3.1-8b-lora:")


# ------------------------------------------------------------------ against measurement: bf16 compute, checkpointing


def test_bf16_and_checkpointed_activations_against_the_probes_count(cache_dir, tmp_path):
    """The activation formula at the compute width of bf16 mixed precision (c = 2), with and without activation
    checkpointing, against what memory_probe counts (its own saved-tensor hook, distinct storages, parameters
    excluded) in the decoder layers of the tiny recipe's LoRA model, in this process: the model cast to bf16 as
    FSDP's param_dtype does, under accelerate's autocast. With checkpointing the probe sees what the forward keeps
    (each layer's input); the one layer's set the budget adds is alive only during that layer's recompute."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    from trl import get_peft_config

    from fsdp_recipes.metrics.memory_probe import MemoryProbeCallback
    from fsdp_recipes.patches.versions import RENAMED_TRAINING_FIELDS
    from fsdp_recipes.planning import memory_budget

    p = plan.prepare("tiny-cpu-lora", 2, 1, "H100", REPO / "recipes")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(cache_dir / "tiny-mistral", dtype=torch.float32),
                           get_peft_config(p.cfg.model)).to(torch.bfloat16)
    decoder = model.base_model.model.model
    batch, length = 1, 16  # bf16 matmuls are slow on CPUs without bf16 units: few tokens
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))

    def measure() -> int:
        probe = MemoryProbeCallback(model, str(tmp_path), 0)
        hooks = torch.autograd.graph.saved_tensors_hooks(probe._pack, lambda t: t)
        # the decoder layers: from the embedding's output to the final norm's input. Not the layers' own hooks:
        # transformers 5.17 checkpoints a layer's __call__, hooks included, so they would run again in the recompute
        # and inside the checkpoint's own saved-tensor hooks (5.23 checkpoints forward only)
        first = decoder.embed_tokens.register_forward_hook(lambda *a: hooks.__enter__())
        last = decoder.norm.register_forward_pre_hook(lambda *a: hooks.__exit__(None, None, None))
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model.base_model.model.model(input_ids=ids).last_hidden_state
            out.float().sum().backward()
        finally:
            first.remove()
            last.remove()
        return sum(probe.saved.values())

    setup = dataclasses.replace(p.setup, compute_bytes=2, mixed_precision=True, tokens=batch * length)
    per_layer = memory_budget.activations_per_token_per_layer(p.shape, setup)
    model.train()
    full = measure()
    # 2026-11-24: 665,024 B measured, 675,840 estimated (1.6% over; the same at 32 tokens, 2.1% at 4 x 64);
    # test_plan.py's fp32 check of the whole step allows 10%
    assert abs(full / (batch * length * p.shape.layers * per_layer) - 1) < 0.05, (full, per_layer)
    inner = model.base_model.model
    # transformers 5.17 has only the old name, gradient_checkpointing_enable (patches/versions.py maps the fields)
    name = "activation_checkpointing" if hasattr(inner, "activation_checkpointing_enable") else \
        RENAMED_TRAINING_FIELDS["activation_checkpointing"]
    getattr(inner, f"{name}_enable")(**{f"{name}_kwargs": {"use_reentrant": False}})
    model.enable_input_require_grads()
    kept = measure()
    assert kept == batch * length * p.shape.layers * p.shape.hidden * 2  # each layer's bf16 input, nothing else


# ------------------------------------------------------------------ a mesh: only what the launcher starts (issue 60)


def test_fit_proposes_no_cp_mesh_for_dpo(capsys):
    """llama-3.1-8b-lora-dpo at 65,536 tokens fits no FSDP: cp would (cp 8 was proposed), but the launcher splits
    rows for SFT only (config/mesh.py), and tp 8 alone does not fit: no launchable mesh."""
    code, out, _ = run(capsys, "llama-3.1-8b-lora-dpo", "--max_length", "65536", "--fit")
    mesh_lines = [line for line in out.splitlines() if line.strip().startswith("mesh:")]
    assert mesh_lines and "cp 8" not in out and "parallelism_config_cp_size: 8" not in out
    assert mesh_lines[0].strip().startswith("mesh: none the launcher starts fits up to 128 nodes of 8"), mesh_lines


def test_fit_names_the_recipe_keys_a_cp_mesh_needs(capsys):
    """The 128k recipe's own mesh (dp_shard 4 x cp 2): its proposal names the SFT keys cp needs, 2 x cp = 4."""
    code, out, _ = run(capsys, "llama-3.1-8b-lora-128k", "--fit")
    assert code == 0
    assert "  mesh: NODES=1 GPUS=8: dp_shard 4 x tp 1 x cp 2" in out
    assert "    recipe: packing: false, pad_to_multiple_of: 4 (context parallel splits whole padded rows)" in out


def test_fit_topology_of_a_cp_recipe_starts_at_tp_x_cp(capsys):
    """On 2 GPUs the 128k recipe's cp 2 is the whole world: no smaller one runs its mesh (1 GPU was offered)."""
    code, out, _ = run(capsys, "llama-3.1-8b-lora-128k", "--gpus", "2", "--fit")
    assert "  smallest topology: GPUS=2 NODES=1 (the fewest the recipe's mesh runs on)" in out
    assert "1 would need" not in out


@pytest.mark.parametrize("overrides, said", [
    (["--packing", "true"], "cp 2 needs whole padded rows to split, and packing is on (TRL refuses packing under "
                            "context parallel). Fix: packing: false in the recipe."),
    (["--pad_to_multiple_of", "6"], "cp 2 splits each batch into 4 equal chunks, so its length must be a multiple "
                                    "of 4, and pad_to_multiple_of is 6. Fix: pad_to_multiple_of: 4 in the recipe."),
])
def test_plan_refuses_the_mesh_the_launcher_refuses(capsys, overrides, said):
    """The launcher's one line (config/mesh.py's check_context_parallel), from make plan, not at launch."""
    code, _, err = run(capsys, "llama-3.1-8b-lora-128k", *overrides)
    assert code == 2 and err.strip() == f"error: recipes/llama-3.1-8b-lora-128k/accelerate.yaml: {said}", err
