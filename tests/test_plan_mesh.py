"""`make plan`'s words for a recipe with a tensor- or context-parallel mesh (planning/mesh_lines.py, answers.py,
comms.py): the header says how the model is split, the decision rule and --fit's topology and mesh keep the recipe's
tp and cp and propose only what config/mesh.py's checks start, and --comms counts tp's collectives as measured and
says what it does not model. In-process (plan.main), each recipe planned once; every expected figure worked by hand
in the comments from the recipes' model_config.json, never with the planner's functions.

Llama 3.1 70B (llama-3.1-70b-full-tp): hidden 8192, 80 layers, 64 heads, 8 key/value heads (kv width 1024),
intermediate 28672, vocab 128256. A layer: q, o 8192 x 8192 + k, v 8192 x 1024 + gate, up, down 8192 x 28672
+ 2 norms of 8192 = 855,654,400; the root: embedding and LM head 128,256 x 8192 each + final norm 8192 =
2,101,354,496; all: 80 x 855,654,400 + 2,101,354,496 = 70,553,706,496."""

import contextlib
import functools
import io
from dataclasses import replace

import pytest

from conftest import REPO
from fsdp_recipes.config import mesh, yaml_keys
from fsdp_recipes.errors import UserError
from fsdp_recipes.planning import comms, fabric, memory_budget, plan

LAYER_70B = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192  # 855,654,400
ROOT_70B = 2 * 128256 * 8192 + 8192  # 2,101,354,496
EMBEDDING_70B = 128256 * 8192  # 1,050,673,152
PARAMS_70B = 80 * LAYER_70B + ROOT_70B  # 70,553,706,496
TP_H200 = ("llama-3.1-70b-full-tp", "--gpus", "8", "--nodes", "2", "--gpu", "H200", "--fit", "--comms",
           "--scale", "2,4")
# every_2 pinned: the auto pick is ops since autocast's cache holds every layer's copy (test_the_70b_tp_recipe...),
# and the hand counts of its recomputed layers below are every_2's
TP_H200_EVERY_2 = (*TP_H200, "--activation_checkpointing_policy", "every_2")
CP_H100 = ("llama-3.1-8b-lora-128k", "--gpus", "8", "--gpu", "H100", "--fit", "--comms")
CP_2_NODES = ("llama-3.1-8b-lora-128k", "--gpus", "8", "--nodes", "2", "--gpu", "H100", "--comms")


@functools.cache
def planned(*argv) -> tuple[int, str]:
    """plan.main's exit code and stdout, once per argv (run from the repository, as `make plan` is)."""
    out = io.StringIO()
    with contextlib.chdir(REPO), contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = plan.main(list(argv))
    return code, out.getvalue()


def line(out: str, start: str) -> str:
    found = [x.strip() for x in out.splitlines() if x.strip().startswith(start)]
    assert len(found) == 1, (start, found)
    return found[0]


def table_row(out: str, op: str) -> list[str]:
    """A --comms table row's cells after the collective's name: GPUs, payload, sent, link, GB/s, seconds."""
    return [c.strip() for c in line(out, f"| {op} |").strip("|").split("|")][1:]


# ------------------------------------------------------------------ 1. the header: how the model is split


def test_the_header_of_a_tp_mesh_says_tensor_parallel_times_fsdp():
    # 2 nodes x 8 = 16 GPUs, tp 8: dp_shard 16 / 8 = 2; every state 1/(8 x 2) = 1/16 a GPU
    code, out = planned(*TP_H200)
    assert code == 0
    assert line(out, "topology") == (
        "topology 2 node(s) x 8 H200 (139.8 GiB each); recipe strategy FSDP with a mesh: tensor parallel over 8 x "
        "FSDP over dp_shard 2 = 16 GPUs: each layer's weights split over the 8 tp ranks, FSDP shards that split over "
        "2, so weights, gradients and optimizer states are 1/16 a GPU")


def test_the_header_of_a_cp_mesh_says_rows_are_split_over_cp():
    # llama-3.1-8b-lora-128k on 8: cp 2, dp_shard 8 / 2 = 4
    code, out = planned(*CP_H100)
    assert code == 0
    assert line(out, "topology").endswith("recipe strategy FSDP with a mesh: FSDP over dp_shard 4 x cp 2 = 8 GPUs; "
                                          "each row's tokens split over the 2 cp ranks")


def test_a_node_smaller_than_tp_is_warned_in_the_header():
    # tp 8 on nodes of 4: each tp group spans 2 nodes
    _, out = planned("llama-3.1-70b-full-tp", "--gpus", "4", "--nodes", "4", "--gpu", "H200", "--fit")
    assert "warning: tp x cp = 8 is more than a node's 4 GPUs" in line(out, "topology")


def test_plain_fsdp_keeps_its_words():
    """The control: mistral-small-lora, FSDP over the node, no mesh."""
    code, out = planned("mistral-small-lora", "--gpus", "8", "--gpu", "H100", "--fit", "--comms")
    assert code == 0
    assert line(out, "topology").endswith("recipe strategy FSDP, parameters sharded over 8 GPU(s)")
    assert line(out, "decision rule").endswith("FSDP, sharded over the node")
    assert "modelled for" not in out and "(exposed)" not in out


# ------------------------------------------------------------------ 2. decisions that keep the mesh


def test_the_decision_keeps_tp_and_gives_the_launchers_reason_against_hsdp():
    # HSDP over the 2 nodes with tp 8 kept: 16 / (2 replicas x tp 8) = dp_shard 1, which config/mesh.py refuses
    _, out = planned(*TP_H200)
    decision = line(out, "decision rule")
    assert "the recipe's mesh, tensor parallel over 8 x FSDP over dp_shard 2 = 16 GPUs" in decision
    assert "HSDP with the mesh kept is refused by the launcher (dp_replicate 2 with dp_shard 1" in decision
    assert "HSDP: shard within each node" not in out  # the rule's HSDP, which ignored tp


def test_the_decision_offers_hsdp_with_cp_kept_where_the_launcher_starts_it():
    """2 nodes x 8 with cp 2: HSDP = dp_replicate 2 x (dp_shard 4 x cp 2 = 8) in each node. Against the plan's own
    layout, FSDP over dp_shard 8 x cp 2 = 16, only the sharded bytes differ, 1/8 instead of 1/16 of them: Llama 3.1
    8B's 8,030,261,248 frozen bf16 weights, and LoRA r 16 on its 7 linears, 16 x (8,192 + 5,120 + 5,120 + 8,192 +
    3 x 18,432) x 32 layers = 41,943,040 trainable at 4 + 4 + 8 B (fp32 weight, gradient, AdamW's 2 moments):
    (8,030,261,248 x 2 + 41,943,040 x 16) / 16 = 1,045,725,696 B = 0.974 GiB more a GPU (activations, the gathered
    layers and cp's ring are the same in both)."""
    _, out = planned(*CP_2_NODES)
    fsdp_16 = float(line(out, "fits:").split()[1])
    decision = line(out, "decision rule")
    assert "HSDP with the mesh kept (dp_replicate 2 x dp_shard 4 x tp 1 x cp 2, a shard group of 8 in each node) " \
           "fits: " in decision
    hsdp = float(decision.rsplit("fits: ", 1)[1].split()[0])
    more = (8_030_261_248 * 2 + 16 * (8192 + 5120 + 5120 + 8192 + 3 * 18432) * 32 * 16) / 16 / 2**30
    assert f"{more:.3f}" == "0.974"
    assert abs(hsdp - (fsdp_16 + more)) <= 0.1 + 1e-9  # both totals printed to 0.1 GiB


def test_scale_keeps_tp_and_offers_no_hsdp_the_launcher_refuses():
    # 2 and 4 nodes of 8 with tp 8: dp_shard 2 and 4, one row each; HSDP with tp 8 kept is refused (dp_shard 1 a
    # replica), so no HSDP row (it was offered without tp before)
    _, out = planned(*TP_H200)
    assert "no HSDP row: the launcher refuses HSDP beside it" in line(out, "scaling")
    assert line(out, "| 2 | 16 |").startswith("| 2 | 16 | FSDP over 2, tp 8 x cp 1 |")
    assert line(out, "| 4 | 32 |").startswith("| 4 | 32 | FSDP over 4, tp 8 x cp 1 |")
    assert "| HSDP" not in out


@pytest.mark.parametrize("gpus, nodes", [("8", "1"), ("4", "4")])
def test_fit_keeps_tp_8_on_nodes_of_8(gpus, nodes):
    """On one node of 8 the recipe needs 148.4 GiB (not 125.8); on nodes of 4 its tp group would span two. Both
    answers: the recipe's tp 8 on 2 nodes of 8 (16 GPUs = tp 8 x dp_shard 2), never a mesh without tp."""
    _, out = planned("llama-3.1-70b-full-tp", "--gpus", gpus, "--nodes", nodes, "--gpu", "H200", "--fit")
    assert line(out, "smallest topology").startswith(
        "smallest topology: 16 GPUs: NODES=2 GPUS=8 (tensor parallel over 8 x FSDP over dp_shard 2 = 16 GPUs")
    assert "HSDP's memory for the alternative" not in out
    assert line(out, "mesh: NODES").startswith("mesh: NODES=2 GPUS=8: dp_shard 2 x tp 8 x cp 1")
    assert "tp 1" not in line(out, "mesh: NODES")


@pytest.mark.parametrize("argv", [
    ("llama-3.1-70b-full-tp", "--gpus", "8", "--nodes", "1", "--gpu", "H200", "--fit"),
    ("llama-3.1-70b-full-tp", "--gpus", "4", "--nodes", "4", "--gpu", "H200", "--fit"),
    CP_H100,
])
def test_the_proposed_mesh_is_one_config_mesh_starts(argv):
    """The proposal's accelerate keys, on its NODES x GPUS, through the launcher's own checks (config/mesh.py)."""
    _, out = planned(*argv)
    nodes, gpus = (int(x.split("=")[1]) for x in line(out, "mesh: NODES").split(":")[1].split()[:2])
    keys = yaml_keys.yaml.safe_load(line(out, "accelerate.yaml:").split(": ", 1)[1])["parallelism_config"]
    recipe = REPO / "recipes" / argv[0]
    acc = dict(yaml_keys.load_yaml(recipe / "accelerate.yaml"), parallelism_config=keys)
    cfg = plan.load_recipe(argv[0], REPO / "recipes", world_size=nodes * gpus)[2]
    checked = mesh.check_mesh(acc, "accelerate.yaml", nodes * gpus)  # raises the launcher's one line if refused
    mesh.check_mesh_fits(checked, "accelerate.yaml", 64 if "70b" in argv[0] else 32, 8, cfg.training.max_length,
                         cfg, on_gpus=True)


def test_hsdp_with_cp_never_proposes_a_replica_of_one_shard(tmp_path):
    """The 128k recipe as HSDP (dp_replicate 2 x dp_shard 4 x cp 2 on 2 nodes of 8). By memory a shard group of 2
    would do (cp 2 alone on 2 GPUs plans 67.0 GiB of 71.6), but that leaves dp_shard 1 in each replica, which
    config/mesh.py refuses; so the smallest is 4 a node: dp_shard 2 x cp 2."""
    import shutil

    recipe = tmp_path / "hsdp-cp"
    shutil.copytree(REPO / "recipes" / "llama-3.1-8b-lora-128k", recipe)
    acc = (recipe / "accelerate.yaml").read_text().replace("num_machines: 1", "num_machines: 2")
    acc = acc.replace("num_processes: 8", "num_processes: 16").replace(
        "parallelism_config:\n", "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n")
    (recipe / "accelerate.yaml").write_text(acc)
    _, out = planned(str(recipe), "--gpus", "8", "--nodes", "2", "--gpu", "H100", "--fit")
    assert line(out, "topology").endswith("recipe strategy HSDP with a mesh: replicated over 2 (HSDP) x FSDP over "
                                          "dp_shard 4 x cp 2 = 16 GPUs; each row's tokens split over the 2 cp ranks")
    assert line(out, "smallest topology").startswith(
        "smallest topology: NODES=2 GPUS=4 (HSDP: a shard group of 4, dp_shard 2 x cp 2 in each node")
    _, two = planned("llama-3.1-8b-lora-128k", "--gpus", "2", "--gpu", "H100")
    # 67.0 GiB while the frozen final norm was counted 8h, not 4h + ch: 65,536 tokens a GPU x 2h = 0.5 GiB
    assert line(two, "fits:").startswith("fits: 66.5 GiB")
    sizes = yaml_keys.load_yaml(recipe / "accelerate.yaml")
    for dp_shard, world in ((1, 4), (2, 8)):  # the launcher's checks: refused, then started
        sizes["parallelism_config"]["parallelism_config_dp_shard_size"] = dp_shard
        if dp_shard == 1:
            with pytest.raises(UserError, match="dp_replicate 2 with dp_shard 1"):
                mesh.check_mesh(sizes, "accelerate.yaml", world)
        else:
            mesh.check_mesh(sizes, "accelerate.yaml", world)


# ------------------------------------------------------------------ 3. --comms under tp and cp


def test_tp_comms_counts_fp32_gathers_over_dp_shard_and_exposed_activation_all_reduces():
    _, out = planned(*TP_H200_EVERY_2)
    assert "all-gather at 4 B/parameter, gradients reduced at 4 B" in line(out, "communication per optimizer step")
    # FSDP over dp_shard 2, across the 2 nodes, fp32 (transformers' FSDP2 has no mixed-precision policy under tp):
    # 64 micro-batches x (2 x 80 layers + the root + the embedding again) x 4 B / tp 8
    gathered = 64 * (160 * LAYER_70B + ROOT_70B + EMBEDDING_70B) * 4 // 8  # 4,481,815,412,736 B
    assert table_row(out, "all-gather")[:4] == ["2", "4,481.82", "2,240.91", "network (ndr: InfiniBand NDR, one "
                                                                            "400 Gb/s NIC per GPU)"]
    assert f"{gathered / 1e9:,.2f}" == "4,481.82"
    # every fp32 gradient / tp 8, reduce-scattered once a step over 2: 70,553,706,496 x 4 / 8 = 35.28 GB
    assert table_row(out, "reduce-scatter")[1:3] == [f"{PARAMS_70B * 4 / 8 / 1e9:,.2f}", "17.64"]
    # tp's all-reduces, per micro-batch on 4,096 tokens x 8,192: forward 2 a layer at 2 B (bf16 autocast), and 2
    # more in each of the 40 layers every_2 recomputes (layers 0, 2, ..., 78); backward 5 a layer
    # + 2 outside at 4 B (the fp32 residual stream): 64 x 4,096 x 8,192 x ((80 + 40) x 2 x 2 + 402 x 4)
    reduced = 64 * 4096 * 8192 * ((80 + 40) * 2 * 2 + (80 * 5 + 2) * 4)  # 4,483,945,857,024 B
    row = table_row(out, "all-reduce (tp) (exposed)")
    assert row[:3] == ["8", f"{reduced / 1e9:,.2f}", f"{reduced * 2 * 7 / 8 / 1e9:,.2f}"] == ["8", "4,483.95",
                                                                                               "7,846.91"]
    assert row[3] == "NVLink 4" and row[5] == f"{reduced * 2 * 7 / 8 / 450e9:.3f}" == "17.438"
    # the LM head's logits gathered over tp: 64 x 4,096 tokens x 128,256 x 2 B = 67.24 GB
    assert table_row(out, "all-gather logits (tp) (exposed)")[1] == f"{64 * 4096 * 128256 * 2 / 1e9:,.2f}"
    # the step: max(compute 37.21 s, overlapped 44.818 + 0.353 s) + exposed 17.438 + 0.131 s = 62.74 s
    assert "the step takes about 62.74 s" in line(out, "verdict")
    assert line(out, "modelled for tp 8: FSDP's all-gathers and reduce-scatters over dp_shard x cp = 2 only")
    # the latency bound's count: 7 a layer (2 forward, 5 backward) + the embedding's and the LM head's, and 2 in
    # each of the 40 recomputed layers: 7 x 80 + 2 + 2 x 40
    assert line(out, "not modelled for tp:").startswith(
        f"not modelled for tp: the latency of {7 * 80 + 2 + 2 * 40} all-reduces") and 7 * 80 + 2 + 2 * 40 == 642
    assert "HSDP with the mesh kept is refused by the launcher" in line(out, "warning:")
    assert "Fix: HSDP" not in out  # the FSDP-only fix, which the launcher would refuse beside tp


def test_cp_comms_says_what_it_models():
    _, out = planned(*CP_H100)
    assert line(out, "modelled for cp 2:").startswith("modelled for cp 2: FSDP over dp_shard x cp = 8 at 2 B")
    assert line(out, "not modelled for cp:")
    assert "(exposed)" not in out  # the ring is counted as overlapped with attention


def test_a_cp_mesh_across_nodes_is_told_the_hsdp_the_launcher_starts():
    """16 GPUs, FSDP over dp_shard 8 x cp 2 across 2 nodes: one warning, whose fix keeps cp 2 (dp_replicate 2 x
    dp_shard 16 / (2 x 2) = 4), checked by config/mesh.py as the launcher checks it; no PCIe warning (the FSDP group
    spans nodes, it is not a larger NVLink group)."""
    _, out = planned(*CP_2_NODES)
    warning = line(out, "warning:")
    assert warning.endswith("Fix: HSDP with the mesh kept (parallelism_config_dp_replicate_size: 2, "
                            "parallelism_config_dp_shard_size: 4)")
    recipe = REPO / "recipes" / "llama-3.1-8b-lora-128k"
    acc = yaml_keys.load_yaml(recipe / "accelerate.yaml")
    acc["parallelism_config"] = dict(acc["parallelism_config"], parallelism_config_dp_replicate_size=2,
                                     parallelism_config_dp_shard_size=4)
    cfg = plan.load_recipe("llama-3.1-8b-lora-128k", REPO / "recipes", world_size=16)[2]
    mesh.check_mesh_fits(mesh.check_mesh(acc, "accelerate.yaml", 16), "accelerate.yaml", 32, 8,
                         cfg.training.max_length, cfg, on_gpus=True)


def test_exposed_collectives_add_to_the_step():
    """comms.py's widths apart (gather 4 B, activations 2 B, residual 4 B) on a made-up model: 2 layers, hidden 16,
    vocab 64; tp 2 on 2 GPUs, 1 micro-batch of 1,024 tokens."""
    shape = memory_budget.ModelShape(
        params=8000, trainable=8000, layers=2, hidden=16, q_dim=16, kv_dim=8, intermediate=32, vocab=64,
        layer_params=3000, layer_trainable=3000, root_params=2000, lora_dropout_width=0, lora_rank_width=0)
    t = comms.Topology("FSDP", gpus=2, nodes=1, shard=1, tp=2)
    w = comms.Work(1, 1, 1024, gather_bytes=4, reduce_bytes=4, activation_bytes=2, residual_bytes=4)
    e = comms.estimate(shape, t, w, fabric.fabric("H100", None, None))
    by = {c.op: c for c in e.collectives}
    # 1,024 x 16 = 16,384 elements an all-reduce: (2 x 2 layers) x 2 B + (2 x 5 + 2) x 4 B = 56 B each
    assert by["all-reduce (tp)"].payload == 16_384 * 56 == 917_504 and by["all-reduce (tp)"].exposed
    # logits 1,024 x 64 x 2 B
    assert by["all-gather logits (tp)"].payload == 131_072 and by["all-gather logits (tp)"].exposed
    assert "all-gather" not in by  # FSDP over 1: nothing to gather
    # both exposed: over NVLink 4 (450 GB/s) 917,504 x 2 x 1/2 + 131,072 x 1/2 = 983,040 B
    assert e.exposed_s == pytest.approx(983_040 / 450e9) and e.overlapped_s == 0


# ------------------------------------------------------------------ the bf16 weight copies autocast keeps under tp


def test_tp_with_fp32_weights_counts_autocasts_kept_bf16_copies():
    """A made-up model: 2 layers of 3,000 parameters (2 norms of hidden 16: 2,968 in linears), vocab 64 (an LM head
    of 64 x 16 = 1,024); tp 2, fp32 weights under bf16."""
    shape = memory_budget.ModelShape(
        params=8000, trainable=8000, layers=2, hidden=16, q_dim=16, kv_dim=8, intermediate=32, vocab=64,
        layer_params=3000, layer_trainable=3000, root_params=2000, lora_dropout_width=0, lora_rank_width=0)
    s = memory_budget.Setup(shard=2, world=4, strategy="FSDP", load_bytes=4, compute_bytes=2, mixed_precision=True,
                            tokens=1024, checkpointed=False, optimizer_bytes=8, runtime_bytes=0, tp=2)
    # both layers' linears and the LM head, 1/tp at 2 B: (2 x 2,968 + 1,024) x 2 / 2 = 6,960; checkpointed alike:
    # autocast's cache holds each cast until the forward's end (memory_budget.py's docstring)
    assert memory_budget.budget(shape, s)["tp_autocast_weight_copies"] == 6_960
    assert memory_budget.budget(shape, replace(s, checkpointed=True))["tp_autocast_weight_copies"] == 6_960
    # a bf16 load (LoRA's base) has nothing to cast; nor does FSDP without tp (its mixed-precision policy gathers bf16)
    assert "tp_autocast_weight_copies" not in memory_budget.budget(shape, replace(s, load_bytes=2))
    assert "tp_autocast_weight_copies" not in memory_budget.budget(shape, replace(s, tp=1))


def test_the_70b_tp_recipe_at_every_2_with_its_fp32_residual_stream():
    """On its 2 nodes of 8 H200 the bf16 weight copies are (80 x (855,654,400 - 2 x 8192) + 128,256 x 8192) x 2 B / 8
    = 17,375,178,752 B = 16.18 GiB a GPU, checkpointed or not (autocast's cache holds every cast to the forward's
    end). The fp32 residual stream (memory_budget.py; worked on a made-up model in tests/test_tp_activations.py) and
    those copies take every_4 and every_2 over the 125.8 usable: the pick is ops. At every_2 (pinned): 40 layers
    checkpointed (0, 2, ..., 78), 41 holding their activations (the recomputed one too).
    A layer a token, tp 8: 2 norms x (4 + 4) x 8,192 + 5 bf16 casts x 2 x 8,192 = 212,992, and 2 x (2 x 8,192 +
    2 x 1,024 + 4 x 28,672) / 8 = 33,280: 246,272 B; 4,096 tokens x (40 x 8,192 x 4 + 41 x 246,272) + the final
    norm's 4,096 x 8,192 x 10, the head's tile 4,096 x 32,768 x 4, the hidden states' fp32 gradient 4,096 x 8,192 x
    4 and the head's 128,256 x 8,192 x 4 / 8 = 48,258,613,248 B = 44.94 GiB; FSDP's fp32 buffers (2 layers and the
    root gathered, a layer's gradients) (2 x 855,654,400 + 2,101,354,496 + 855,654,400) x 4 / 8 = 2.17 GiB."""
    _, out = planned(*TP_H200_EVERY_2)
    copies = (80 * (LAYER_70B - 2 * 8192) + 128256 * 8192) * 2 / 8
    assert f"{copies / 2**30:.2f}" == "16.18"
    assert line(out, "| tp autocast weight copies |").startswith(f"| tp autocast weight copies | {copies / 2**30:.1f} |")
    per_layer = 2 * 8 * 8192 + 5 * 2 * 8192 + 2 * (2 * 8192 + 2 * 1024 + 4 * 28672) // 8
    activations = (4096 * (40 * 8192 * 4 + 41 * per_layer) + 4096 * 8192 * 10 + 4096 * 32768 * 4 + 4096 * 8192 * 4
                   + 128256 * 8192 * 4 // 8)
    assert per_layer == 246_272 and activations == 48_258_613_248
    assert line(out, "| activations |").startswith(f"| activations | {activations / 2**30:.1f} |")
    buffers = (3 * LAYER_70B + ROOT_70B) * 4 / 8
    assert line(out, "| communication buffers |").startswith(f"| communication buffers | {buffers / 2**30:.1f} |")
    _, auto = planned(*TP_H200)
    checkpointing = line(auto, "activation checkpointing (")
    for policy in ("every_4", "every_2"):
        assert checkpointing.split(f"{policy} ")[1].split(",")[0].endswith("(over)"), checkpointing
    assert checkpointing.endswith("-> pick ops (the fastest that fits)")
