"""Mixture of experts, the whole CPU path under FSDP2 on 2 processes: tiny Qwen3-MoE and Mixtral models, LoRA on the
fused experts (PEFT's target_parameters, the attention by name, the router frozen) and full fine-tuning, each 4 steps
with a checkpoint at step 2 and a second run resumed from it.

One launch for all of it (about 45 s of both cores): the architecture matrix's ranks (scripts/arch_matrix.py
`--cases ... --resume`) run each case as a launch of the pack would, the launcher's checks then the rank lifecycle
(`train/entry.py` `train_once`: the pack's SFT trainer, the load-balancing loss, the run report, the final save and
its checks, the merge). The checks here are the test's own, from the files the runs wrote: a falling loss, an exact
resume (per-step losses and the final weights), each merged expert against base + (alpha / r) B_e A_e computed here
from the saved adapter (not by PEFT's merge), and the run report's active parameters, FLOPs, aux loss and expert load
by hand. (The in-process checks of the same machinery: tests/test_moe.py, tests/test_expert_lora.py.)"""

import json
import sys

import pytest
import torch

from conftest import REPO, expert_lora_pair, run

CASES = ["qwen3-moe-experts:lora", "mixtral-experts:lora", "qwen3-moe:full", "mixtral:full"]
STEPS, SAVE_AT = 4, 2
EXPERTS, TOP_K, LAYERS = 4, 2, 2  # scripts/arch_families.py: QWEN3_MOE, MIXTRAL and SHAPE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("moe") / "matrix"
    res = run([sys.executable, str(REPO / "scripts" / "arch_matrix.py"), "--cases", ",".join(CASES), "--steps",
               str(STEPS), "--resume", "--out", str(out)], cache_dir, timeout=480)
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else []
    assert res.returncode == 0 and len(results) == len(CASES), res.stdout[-3000:] + res.stderr[-3000:]
    return out


def case(out, name):
    family, method = name.split(":")
    return out / "runs" / family / method


def losses(run_dir) -> dict[int, float]:
    history = json.loads((run_dir / "log_history.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def metrics(run_dir) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.mark.parametrize("name", CASES)
def test_each_case_trained_sharded_over_two_ranks_and_its_loss_fell(matrix, name):
    results = {f"{r['family']}:{r['method']}": r for r in json.loads((matrix / "results.json").read_text())}
    assert results[name]["outcome"] == "pass", results[name]["reason"]
    m = metrics(case(matrix, name))
    assert (m["status"], m["steps"], m["world_size"], m["fsdp_version"]) == ("completed", STEPS, 2, 2)
    shards = m["param_shards"]  # FSDP2's DTensor parameters, each rank holding half
    assert shards["dtensor_params"] > 0 and shards["local_numel_per_rank"] == [shards["global_numel"] // 2] * 2
    steps = losses(case(matrix, name))
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert steps[STEPS] < steps[1], steps


@pytest.mark.parametrize("name", CASES)
def test_a_run_resumed_from_its_step_2_checkpoint_repeats_the_uninterrupted_one(matrix, name):
    """The same per-step losses and the same final weights (the adapter, or the whole model)."""
    from fsdp_recipes.checkpoint.save_check import read_saved

    straight = case(matrix, name)
    resumed = straight.with_name(straight.name + "-resumed")
    assert metrics(resumed)["resumed_from"] == str(straight / f"checkpoint-{SAVE_AT}")
    a, b = losses(straight), losses(resumed)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (step, a, b)
    wa, wb = read_saved(straight), read_saved(resumed)
    assert wa.keys() == wb.keys() and wa
    moved = 0
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-5, atol=1e-6, msg=key)
    # the weights compared are the trained ones: a resume that restored nothing would differ from these
    checkpoint = read_saved(straight / f"checkpoint-{SAVE_AT}") if name.endswith(":lora") else None
    if checkpoint is not None:
        moved = sum(not torch.equal(checkpoint[k], wa[k]) for k in wa if k in checkpoint)
        assert moved, "steps 3-4 changed no adapter weight: nothing to compare"


def merged_experts_by_hand(base_dir, run_dir, merged_dir) -> int:
    """Each expert of `merged_dir` against base + (alpha / r) * B_e @ A_e from the saved adapter's matrices, the
    router against the base's; returns how many experts' deltas were nonzero. PEFT keeps A as (r * experts, in),
    expert e's r rows in one block, and B as (out, r * experts), expert e's columns every `experts`-th; transformers
    loads both models with their experts fused (experts, out, in)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base, merged = (AutoModelForCausalLM.from_pretrained(p).state_dict() for p in (base_dir, merged_dir))
    adapter = load_file(run_dir / "adapter_model.safetensors")
    config = json.loads((run_dir / "adapter_config.json").read_text())
    scaling, r = config["lora_alpha"] / config["r"], config["r"]
    fused = [name for name, w in base.items() if w.ndim == 3]
    assert len(fused) == 2 * LAYERS, fused  # gate_up_proj and down_proj in each layer
    moved = 0
    for name in fused:
        w = base[name]
        n, out_features, in_features = w.shape
        a, b = expert_lora_pair(adapter, name, in_features, out_features)
        assert n == EXPERTS and a.shape == (r * n, in_features) and b.shape == (out_features, r * n)
        for e in range(n):
            delta = scaling * b[:, e::n] @ a[e * r:(e + 1) * r]
            torch.testing.assert_close(merged[name][e], w[e] + delta, rtol=1e-5, atol=1e-6,
                                       msg=f"{merged_dir}: {name} expert {e}")
            moved += bool(delta.abs().max() > 1e-4)
    routers = [name for name in base if name.endswith("mlp.gate.weight")]
    assert len(routers) == LAYERS and all(torch.equal(merged[k], base[k]) for k in routers)  # the router: frozen
    return moved


@pytest.mark.parametrize("name", [c for c in CASES if c.endswith(":lora")])
def test_the_merged_experts_are_base_plus_the_adapter_computed_by_hand(matrix, name):
    run_dir = case(matrix, name)
    base_dir = matrix / "models" / name.split(":")[0]
    assert merged_experts_by_hand(base_dir, run_dir, run_dir / "merged") >= EXPERTS  # trained experts moved
    # the check can fail: the base model, a merge that dropped the experts' deltas, does not pass it
    with pytest.raises(AssertionError, match="expert"):
        merged_experts_by_hand(base_dir, run_dir, base_dir)


def test_the_report_counts_active_parameters_the_aux_loss_and_the_expert_load(matrix):
    """Mixtral in full, by hand: per layer 4 experts of (2 x 128 x 64 + 64 x 128) = 98,304 weights, a token through
    2 of them; FLOPs per token 6 x (active - input embedding) + 12 x layers x q_dim x the run's sequence length; the
    load-balancing loss logged; each layer's expert counts sum to its positions x top_k."""
    config = json.loads((matrix / "models" / "mixtral" / "config.json").read_text())
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    attention = hidden * hidden + 2 * (hidden // 2) * hidden + hidden * hidden  # q, o: 64 x 64; k, v: 2 heads of 16
    experts = EXPERTS * (2 * inter * hidden + hidden * inter)
    layer = attention + 2 * hidden + EXPERTS * hidden + experts  # two norms, the router
    total = LAYERS * layer + hidden + 2 * vocab * hidden  # final norm, embedding and untied head
    active = total - LAYERS * experts * (EXPERTS - TOP_K) // EXPERTS
    m = metrics(case(matrix, "mixtral:full"))
    assert (m["params"]["total"], m["params"]["active"], experts) == (total, active, 98304)
    assert m["flops_per_token"] == pytest.approx(6 * (active - vocab * hidden)
                                                 + 12 * LAYERS * hidden * m["flops_seq_len"], rel=1e-9)
    assert m["sft"]["aux_loss"]["first"] > 0 and m["sft"]["aux_loss"]["last"] > 0
    load = m["expert_load"]
    assert (load["experts"], load["top_k"], load["scope"], len(load["layers"])) == (EXPERTS, TOP_K, "all_ranks", 2)
    for entry in load["layers"]:
        # every position of both ranks' training forwards, padding included
        assert entry["tokens"] == m["tokens"]["padded"] and sum(entry["tokens_per_expert"]) == entry["tokens"] * TOP_K
