"""Issue 60's single-GPU levers and the planner's mesh terms, in-process on CPU: checkpoint offload computes what the
run without it computes, TRL's chunked loss what the full logits give, YaRN's checks; the planner's cp and tp
division, its offload, full-logits, ring and all-reduce terms and the mesh --fit proposes, each against arithmetic
worked by hand in the comments (not by the planner)."""

import dataclasses
import functools

import pytest
import torch

from conftest import REPO
from fsdp_recipes import speed
from fsdp_recipes.errors import UserError
from fsdp_recipes.planning import comms, fabric, fit, memory_budget, mesh_fit
from fsdp_recipes.speed import yarn

TINY = REPO / "recipes" / "tiny-cpu-lora" / "sft.yaml"


def tiny_model(cache_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(cache_dir / "tiny-mistral", dtype=torch.float32)
    model.train()
    model.config.use_cache = False
    return model


def batch(model):
    ids = torch.randint(4, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :10] = -100  # a prompt the loss skips, as SFT's completion-only loss does
    return ids, labels


def loss_and_grads(model, ids, labels, **kwargs):
    out = model(input_ids=ids, labels=labels, **kwargs)
    loss = out.loss if out.loss is not None else -out.log_probs.sum() / (labels[:, 1:] != -100).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ---- the levers compute the same thing ------------------------------------------------------------------------


def test_checkpoint_offload_gives_the_loss_and_gradients_of_the_run_without_it(cache_dir, monkeypatch):
    """transformers' offload path (activation_checkpointing_enable(offload=True): save_on_cpu around every
    checkpoint) against plain checkpointing, bit for bit. On a CPU torch has no pinned allocator, so save_on_cpu is
    given pin_memory=False (the one difference); every saved input is counted going through its pack hook."""
    import transformers.modeling_utils as modeling_utils
    from torch.autograd.graph import save_on_cpu

    packed = []

    class Unpinned(save_on_cpu):
        def __init__(self, pin_memory=False, device_type="cuda"):
            super().__init__(pin_memory=False, device_type=device_type)
            pack = self.pack_hook
            self.pack_hook = lambda t: (packed.append(t.shape), pack(t))[1]

    monkeypatch.setattr(modeling_utils, "save_on_cpu", Unpinned)
    runs = []
    for offload in (False, True):
        model = tiny_model(cache_dir)
        model.activation_checkpointing_enable(offload=offload)
        runs.append(loss_and_grads(model, *batch(model)))
    (loss, grads), (loss_off, grads_off) = runs
    assert packed, "the offload path did not run"
    assert torch.equal(loss, loss_off)
    assert grads.keys() == grads_off.keys() and all(torch.equal(grads[n], grads_off[n]) for n in grads)


def test_trls_chunked_loss_equals_the_full_logits_loss(cache_dir):
    """TRL 1.16's fused LM head (what every kind's trainer calls, fused_lm_head=True) against the model's own
    cross-entropy over the full logits: the loss and the gradients."""
    from trl.trainer.utils import add_fused_lm_head

    full_model = tiny_model(cache_dir)
    ids, labels = batch(full_model)
    full, full_grads = loss_and_grads(full_model, ids, labels)
    fused_model = tiny_model(cache_dir)
    add_fused_lm_head(fused_model)
    fused, fused_grads = loss_and_grads(fused_model, ids, labels, fused_lm_head=True)
    assert torch.allclose(fused, full, rtol=0, atol=1e-6), (fused, full)
    assert all(torch.allclose(fused_grads[n], full_grads[n], rtol=1e-4, atol=1e-6) for n in full_grads)


@functools.cache
def parsed(*overrides):
    from fsdp_recipes.config.run_config import parse_args

    return parse_args(["--config", str(TINY), *overrides])


def test_offload_rides_on_the_checkpointing_kwargs_and_needs_checkpointing(cache_dir):
    from fsdp_recipes.config.run_config import parse_args

    cfg = parse_args(["--config", str(TINY), "--activation_checkpointing_policy", "every_2",
                      "--activation_checkpointing_offload", "true"])
    speed.check_config(cfg)
    speed.settle(cfg)
    assert cfg.training.activation_checkpointing_kwargs == {"use_reentrant": False, "every_n_layers": 2,
                                                            "offload": True}
    off = parse_args(["--config", str(TINY), "--activation_checkpointing_policy", "none",
                      "--activation_checkpointing_offload", "true"])
    with pytest.raises(UserError, match=r"checkpoints no layer\. Fix: activation_checkpointing_policy full"):
        speed.check_config(off)
    # on a CPU the launcher refuses it (torch has no pinned allocator there) and make smoke turns it off
    with pytest.raises(UserError, match=r"train on CPU.*Fix: --activation_checkpointing_offload false on CPU"):
        speed.check_launch(cfg, {"use_cpu": True}, "accelerate.yaml")
    overrides, notes = speed.smoke(lambda name, default: "true" if name == "activation_checkpointing_offload"
                                   else default, 0)
    assert overrides[-2:] == ["--activation_checkpointing_offload", "false"] and any("offload" in n for n in notes)


def test_yarn_factor_and_its_refusals(cache_dir):
    from transformers import AutoConfig, GPT2Config

    config = AutoConfig.from_pretrained(cache_dir / "tiny-mistral")  # max_position_embeddings 512, rope default
    rope = yarn.rope_parameters_for(config, 2048)
    # 2048 / 512 = 4.0; the config's own rope_theta kept
    assert rope == {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    with pytest.raises(UserError, match=r"max_length 512 is within .* trained length \(512.*factor would be 1\.00"):
        yarn.rope_parameters_for(config, 512)
    with pytest.raises(UserError, match=r"GPT2LMHeadModel has no rotary position embedding"):
        yarn.rope_parameters_for(GPT2Config(architectures=["GPT2LMHeadModel"]), 4096)
    llama3 = AutoConfig.from_pretrained(REPO / "recipes" / "llama-3.1-8b-lora" / "model_config.json")
    with pytest.raises(UserError, match=r"already scaled \(rope_type llama3, to 131,072 tokens\)"):
        yarn.rope_parameters_for(llama3, 262144)
    # through the recipe: checked before launch against the tiny model's own config, and what from_pretrained gets
    from fsdp_recipes.config.run_config import parse_args

    cfg = parse_args(["--config", str(TINY), "--yarn_rope_scaling", "true", "--max_length", "2048"])
    speed.check_config(cfg)
    assert speed.model_init_kwargs(cfg)["rope_parameters"] == rope
    with pytest.raises(UserError, match=r"max_length 64 is within MistralForCausalLM's trained length"):
        speed.check_config(parse_args(["--config", str(TINY), "--yarn_rope_scaling", "true"]))
    # the model from_pretrained builds with the option's kwargs is YaRN's: attention scaled by 0.1 ln 4 + 1
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cache_dir / "tiny-mistral", rope_parameters=rope)
    assert model.model.rotary_emb.rope_type == "yarn"
    assert model.model.rotary_emb.attention_scaling == pytest.approx(0.1 * 1.3862943611198906 + 1)


def test_the_chunked_loss_plans_full_logits_only_where_the_trainer_computes_them(cache_dir):
    from fsdp_recipes.config.run_config import parse_args

    assert speed.planner_setup(None, parsed().training, parsed())["full_logits"] is False
    smoothed = parse_args(["--config", str(TINY), "--label_smoothing_factor", "0.1"])
    assert speed.planner_setup(None, smoothed.training, smoothed)["full_logits"] is True
    # dft: SFTTrainer's label smoother skips it, so the smoothing would be dropped silently: one line
    dft = parse_args(["--config", str(TINY), "--label_smoothing_factor", "0.1", "--loss_type", "dft"])
    assert speed.planner_setup(None, dft.training, dft)["full_logits"] is False
    with pytest.raises(UserError, match=r"label_smoothing_factor 0.1 with loss_type dft: .* unsmoothed, silently"):
        speed.check_config(dft)


# ---- the planner's terms, by hand -------------------------------------------------------------------------------

# A made-up model with round numbers: full fine-tuning of 8,000 parameters, 2 layers of 3,000 and a root of 2,000;
# hidden 16, 4 heads (q width 16) and 2 key/value heads (kv width 8), intermediate 32, vocabulary 64.
SHAPE = memory_budget.ModelShape(
    params=8000, trainable=8000, layers=2, hidden=16, q_dim=16, kv_dim=8, intermediate=32, vocab=64,
    layer_params=3000, layer_trainable=3000, root_params=2000, lora_dropout_width=0, lora_rank_width=0)
# bf16 mixed precision (fp32 master weights: 4 B), AdamW (8 B), 1,024 tokens a micro-batch, FSDP over 8 GPUs
FLAT = memory_budget.Setup(shard=8, world=8, strategy="FSDP", load_bytes=2, compute_bytes=2, mixed_precision=True,
                           tokens=1024, checkpointed=False, optimizer_bytes=8, runtime_bytes=0)


def test_a_mesh_divides_states_by_tp_x_dp_shard_x_cp_and_activations_by_cp():
    # tp 2 x cp 2 x dp_shard 2 on 8 GPUs: FSDP's group is dp_shard x cp = 4, tp splits that 4-way share once more
    s = dataclasses.replace(FLAT, shard=4, tp=2, cp=2)
    b = memory_budget.budget(SHAPE, s)
    assert b["weights"] == 8000 * 4 // 8 == 4000  # trainable at fp32 over tp x dp_shard x cp = 8
    assert b["gradients"] == 4000
    assert b["optimizer_states"] == 8000 * 8 // 8 == 8000
    # per token per layer: norms 2 x 16 x (4 + 2) = 192; saved 2 x (2x16 + 2x8 + 4x32) = 352, halved by tp: 176
    # -> 368; a GPU holds 1024 / cp = 512 tokens: 2 layers x 368 x 512 = 376,832
    # + final norm (its fp32 input, the head's bf16 copy of its output) 512 x 16 x (4 + 2) = 49,152 + the chunked
    # head's tile 512 x 64 x 4 = 131,072
    # + fp32 gradients: hidden 512 x 16 x 4 = 32,768, the head's 64 x 16 x 4 / tp = 2,048
    assert b["activations"] == 376_832 + 49_152 + 131_072 + 32_768 + 2_048 == 591_872
    # two layers and the root gathered at 2 B: (2 x 3000 + 2000) x 2 = 16,000, + one layer's fp32 gradients
    # 3000 x 4 = 12,000; each of them split by tp: 28,000 / 2
    assert b["communication_buffers"] == 14_000
    # the ring's K and V chunks, computed-on and arriving: 2 x 2 x 512 tokens x 8 / tp x 2 B
    assert b["cp_ring_buffers"] == 16_384
    assert b["total"] == 4000 + 4000 + 8000 + 591_872 + 14_000 + 16_384 == 638_256


def test_offload_moves_the_checkpoint_inputs_to_host_memory():
    ckpt = dataclasses.replace(FLAT, checkpointed=True, cp=2)  # 512 tokens a GPU
    kept = memory_budget.budget(SHAPE, ckpt)["activations"]
    moved = memory_budget.budget(SHAPE, dataclasses.replace(ckpt, checkpoint_offload=True))["activations"]
    # each of 2 layers' input, 16 x 2 B a token, for 512 tokens: 32,768 B from the GPU to the host
    assert kept - moved == 2 * 16 * 2 * 512 == 32_768
    assert memory_budget.host_bytes(SHAPE, dataclasses.replace(ckpt, checkpoint_offload=True)) == 32_768
    assert memory_budget.host_bytes(SHAPE, ckpt) == 0


def test_full_logits_replace_the_tile():
    tile = memory_budget.budget(SHAPE, FLAT)["activations"]
    full = memory_budget.budget(SHAPE, dataclasses.replace(FLAT, full_logits=True))["activations"]
    # 1,024 tokens x 64 entries x (2 B logits + 4 B fp32 log-softmax + 4 B its gradient) = 655,360, for the tile's
    # 1,024 x 64 x 4 = 262,144
    assert full - tile == 655_360 - 262_144


def test_comms_counts_cp_ring_hops_and_tp_all_reduces():
    h100 = fabric.fabric("H100", None, None)
    t = comms.Topology("FSDP", gpus=8, nodes=1, shard=4, tp=2, cp=2)
    w = comms.Work(accumulation=2, micro_batch=1, max_length=1024, gather_bytes=2, reduce_bytes=2)
    by = {c.op: c for c in comms.estimate(SHAPE, t, w, h100).collectives}
    # 2 micro-batches x 1,024 tokens = 2,048 a step; K and V of a layer: 2 x 2,048 x 8 / tp x 2 B = 32,768;
    # 3 passes (forward; backward K/V and their gradients) x 2 layers: 196,608; each GPU sends (cp - 1)/cp of it
    assert by["ring K/V (cp)"].payload == 196_608 and by["ring K/V (cp)"].sent == 98_304
    # the GPU's 1,024 tokens (2,048 / cp) x hidden 16 = 16,384 elements an all-reduce. Per layer 2 in the forward
    # (o_proj, down_proj) and 5 in the backward (q, k, v, gate, up input gradients), plus 2 outside the layers
    # (embedding output, LM head input gradient), as measured on tiny Mistral (comms.py): (2 x 2 + 2 x 5 + 2) = 16
    # all-reduces x 16,384 x 2 B = 524,288; an all-reduce over 2 sends 2 x (2 - 1)/2 of it
    assert by["all-reduce (tp)"].payload == 524_288 and by["all-reduce (tp)"].sent == 524_288
    # the LM head's logits gathered over tp: 1,024 tokens x vocab 64 x 2 B = 131,072, each GPU sending half
    assert by["all-gather logits (tp)"].payload == 131_072 and by["all-gather logits (tp)"].sent == 65_536
    # FSDP's all-gather: 2 micro-batches x (2 x 2 layers x 3,000 + 2,000) x 2 B = 56,000, split by tp: 28,000
    assert by["all-gather"].payload == 28_000
    again = {c.op: c for c in comms.estimate(SHAPE, t, dataclasses.replace(w, recompute=True), h100).collectives}
    # the recompute adds one ring pass (4 x 65,536) and two forward all-reduces a layer (20 x 32,768)
    assert again["ring K/V (cp)"].payload == 262_144 and again["all-reduce (tp)"].payload == 655_360
    # the ops policy saves each layer's attention output: its recompute re-runs the projections and the MLP (the
    # two all-reduces) but not SDPA, so no fourth ring pass
    ops = dataclasses.replace(w, recompute=True, attention_saved=True)
    saved = {c.op: c for c in comms.estimate(SHAPE, t, ops, h100).collectives}
    assert saved["ring K/V (cp)"].payload == 196_608 and saved["all-reduce (tp)"].payload == 655_360


@pytest.mark.parametrize("ops, saved", [(True, True), (False, False)])
def test_the_plan_tells_comms_whether_attention_is_recomputed(ops, saved):
    from types import SimpleNamespace

    from fsdp_recipes.planning import answers
    training = SimpleNamespace(gradient_accumulation_steps=1, per_device_train_batch_size=1, max_length=1024)
    setup = dataclasses.replace(FLAT, shard=4, cp=2, checkpointed=True, checkpoint_ops=ops)
    cfg = SimpleNamespace(training=training, trainer="sft", model=SimpleNamespace(use_peft=False))
    w = answers.work(SimpleNamespace(cfg=cfg, setup=setup, own="FSDP"), 0.4)
    assert w.recompute and w.attention_saved is saved


def test_fit_proposes_the_first_mesh_that_fits():
    # heads 4, kv heads 2: tp 1 or 2; cp up to 8 (1,024 a multiple of 2 x cp); tp x cp dividing a node of 8;
    # ordered by tp x cp, cp first
    assert mesh_fit.splits(8, 4, 2, 1024) == [(1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (1, 8), (2, 4)]
    # FSDP over 8, by hand: states 4,000 + 4,000 + 8,000; activations 1,024 x (2 x 544) = 1,114,112 + final norm
    # 1,024 x 16 x (4 + 2) = 98,304 + tile 262,144 + fp32 gradients 65,536 + 4,096 = 1,544,192; buffers 28,000 ->
    # 1,588,192. cp 2: 512 x 1,088 = 557,056 + 49,152 + 131,072 + 32,768 + 4,096 = 774,144; buffers 28,000; ring
    # 2 x 2 x 512 x 8 x 2 = 32,768 -> 16,000 + 774,144 + 28,000 + 32,768 = 850,912
    answer = mesh_fit.propose(SHAPE, FLAT, 1_000_000, 8, 4, 2, 1024)
    assert (answer.nodes, answer.tp, answer.cp, answer.dp_shard, answer.total) == (1, 1, 2, 4, 850_912)
    assert mesh_fit.propose(SHAPE, FLAT, 1_700_000, 8, 4, 2, 1024).cp == 1  # FSDP alone fits: no split


def stand_in(trainer="sft", **training):
    """What config/mesh.py's checks read of a parsed recipe (RunConfig)."""
    from types import SimpleNamespace
    return SimpleNamespace(trainer=trainer, model=SimpleNamespace(use_peft=False, lora_modules_to_save=None),
                           training=SimpleNamespace(**{"packing": True, "pad_to_multiple_of": None, **training}))


FSDP2 = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}}


@pytest.mark.parametrize("cfg, tp, cp, said", [
    (stand_in("dpo"), 1, 2, "cp 2 splits rows for the trainer kinds whose loss is split-aware"),
    (stand_in(), 2, 2, "splits both layers (tp) and rows (cp)"),
    (stand_in(), 1, 2, None),  # SFT: packing and pad_to_multiple_of are the keys the proposal names
    (stand_in("dpo"), 2, 1, None),
])
def test_a_proposed_mesh_is_one_the_launcher_starts(cfg, tp, cp, said):
    refused = mesh_fit.refusal(FSDP2, cfg, 8, tp, cp, 4, 2, 1024)
    assert (refused is None) if said is None else (said in refused), refused


def test_fit_skips_the_meshes_the_launcher_refuses():
    # under 1,300,000 B FSDP alone (1,620,960) does not fit; cp 2 (867,296, test_fit_proposes_the_first_mesh_that_fits)
    # comes first in the search's order (1, 2), (2, 1); a DPO recipe's cp is refused, so the search goes on to tp 2
    def launchable(cfg):
        return lambda world, tp, cp: mesh_fit.refusal(FSDP2, cfg, world, tp, cp, 4, 2, 1024) is None

    dpo = mesh_fit.propose(SHAPE, FLAT, 1_300_000, 8, 4, 2, 1024, launchable=launchable(stand_in("dpo")))
    assert (dpo.tp, dpo.cp) == (2, 1)
    sft = mesh_fit.propose(SHAPE, FLAT, 1_300_000, 8, 4, 2, 1024, launchable=launchable(stand_in()))
    assert (sft.tp, sft.cp) == (1, 2)
    assert mesh_fit.recipe_keys(stand_in().training, 2) == "packing: false, pad_to_multiple_of: 4"
    assert mesh_fit.recipe_keys(stand_in(padding_free=True).training, 4) == ("packing: false, pad_to_multiple_of: 8, "
                                                                            "padding_free: false")


def test_the_smallest_world_of_a_mesh_is_a_multiple_of_tp_x_cp():
    # everything fits 10**9 B: the fewest GPUs is the mesh itself, tp x cp, never fewer
    assert fit.smallest_fsdp_world(SHAPE, FLAT, 1e9, 64) == 1
    assert fit.smallest_fsdp_world(SHAPE, dataclasses.replace(FLAT, cp=2), 1e9, 64) == 2
    assert fit.smallest_fsdp_world(SHAPE, dataclasses.replace(FLAT, tp=2, cp=2), 1e9, 64) == 4


# ---- the run report ---------------------------------------------------------------------------------------------


def test_the_run_report_records_the_mesh_and_counts_a_rows_tokens_once(monkeypatch):
    """mesh_info from accelerate's own ParallelismConfig (no process group needed); the report's counters divide the
    ranks' summed counts by tp x cp, so that tokens/s and MFU (over all world_size GPUs) count each row once."""
    from accelerate.parallelism_config import ParallelismConfig

    from fsdp_recipes.metrics import environment, run_report

    info = environment.mesh_info(ParallelismConfig(dp_shard_size=4, cp_size=2))
    # accelerate's mesh order is dp_replicate, dp_shard, cp, sp, tp, with only the dimensions above 1
    assert info == {"mesh": {"dp_replicate": 1, "dp_shard": 4, "tp": 1, "cp": 2, "axis_names": ["dp_shard", "cp"],
                             "shape": [4, 2]}, "ranks_per_row": 2}
    assert environment.mesh_info(ParallelismConfig(dp_shard_size=2, tp_size=2, cp_size=2))["ranks_per_row"] == 4

    class Counter:
        def counts(self):
            return {"non_padding": 1000, "padded": 1024, "sequences": 2, "squared_lengths": 500_000, "generated": 0}

    report = run_report.RunReportCallback.__new__(run_report.RunReportCallback)
    report.tokens, report.train_start = Counter(), 0.0
    report.prior = {"non_padding": 100, "padded": 100, "sequences": 1, "squared_lengths": 10_000, "generated": 0,
                    "train_time_s": 0.0}
    # 8 ranks of dp_shard 4 x cp 2 each counted the 1,000 tokens of its pair's rows: summed 8,000, each row twice
    monkeypatch.setattr(run_report, "all_reduce", lambda values, op: [8 * v for v in values])
    monkeypatch.setattr(run_report, "mesh_info", lambda: info)
    totals = report.counters_so_far(10.0)
    assert (totals["non_padding"], totals["padded"], totals["sequences"]) == (4000 + 100, 4096 + 100, 8 + 1)


def test_a_smoke_run_keeps_cp_and_tp():
    from fsdp_recipes.launch.smoke import scale_accelerate

    acc = {"distributed_type": "FSDP", "num_processes": 8, "num_machines": 1}
    mesh = lambda **sizes: {f"parallelism_config_{k}_size": v for k, v in sizes.items()}  # noqa: E731
    cp = dict(acc, parallelism_config=mesh(dp_shard=4, cp=2))
    assert scale_accelerate(cp)["parallelism_config"] == mesh(dp_shard=1, cp=2)  # CPU: cp 2 over 2 processes
    assert scale_accelerate(cp, gpus=8)["parallelism_config"] == mesh(dp_shard=4, cp=2)
    assert scale_accelerate(cp, gpus=4)["parallelism_config"] == mesh(dp_shard=2, cp=2)
    assert "parallelism_config" not in scale_accelerate(cp, gpus=3)  # cp 2 does not divide 3 GPUs: plain FSDP
    tp = dict(acc, parallelism_config=mesh(dp_shard=2, tp=8), num_processes=16, num_machines=2)
    assert scale_accelerate(tp)["parallelism_config"] == mesh(dp_shard=1, tp=2)  # CPU: tp 2 over 2 processes
    assert scale_accelerate(tp)["num_processes"] == 2 and scale_accelerate(tp)["num_machines"] == 1
    assert scale_accelerate(tp, gpus=8)["parallelism_config"] == mesh(dp_shard=4, tp=2)  # the tiny model: 2 KV heads
    assert scale_accelerate(tp, gpus=2)["parallelism_config"] == mesh(dp_shard=1, tp=2)
    assert "parallelism_config" not in scale_accelerate(tp, gpus=3)  # tp 2 does not divide 3 GPUs: plain FSDP
    assert scale_accelerate(tp, gpus=3)["num_processes"] == 3
