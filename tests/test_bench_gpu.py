"""make bench-gpu: the ladder's plumbing on CPU (`--dry-run`), the model sizes, the synthetic data, the goal logic.

Nothing here measures or asserts a GPU figure: the dry run trains a tiny Mistral on CPU processes, and the goal and
table tests use made-up figures to check the arithmetic and the wording.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import statistics
from statistics import NormalDist

import pytest

from bench import gpu as bench_gpu
from bench import suite as bench
from conftest import REPO, library_server, qlora_site, torchao_site
from fsdp_recipes.records import file_stamp

RUNG_IDS = ["0", "1", "2", "3", "4", "5", "6a", "6b", "7a", "7b", "7c"]


@pytest.fixture(scope="module")
def dry(tmp_path_factory, cache_dir):
    """One dry-run ladder (~1 minute on 2 cores), with rung 6a given a setting the entry point rejects; torchao
    from FLOAT8_SITE is on the path of the ladder and its rungs, so rung 5 (float8) runs too."""
    site = torchao_site()
    out = tmp_path_factory.mktemp("bench-gpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(site)
        for name, value in library_server(site).items():  # PYTHONPATH with site, and a fork server importing from it
            mp.setenv(name, value)
        result, text, path = bench_gpu.run(["--dry-run", "--results", str(out), "--inject-failure", "6a"])
    return result, text, path


@pytest.mark.slow
def test_dry_run_ladder_runs_end_to_end_and_says_it_is_plumbing(dry):
    result, text, path = dry
    saved = json.loads(path.read_text())
    assert saved["ladders"] == json.loads(json.dumps(result["ladders"]))
    assert path.name == f"bench-gpu-cpu-plumbing-{file_stamp(saved['date'])}.json"
    assert dt.datetime.fromisoformat(saved["date"]).tzinfo is not None
    assert saved["plumbing_only"] is True and saved["gpu_count"] == 0 and saved["device"]["type"] == "cpu"
    for pkg in ("python", "torch", "transformers", "trl", "accelerate"):
        assert saved["versions"][pkg], pkg
    assert "NOT benchmarks" in text and "not evaluated: plumbing run" in text
    import matplotlib.image  # the picture beside the JSON: one panel for the one ladder

    height, width, _ = matplotlib.image.imread(path.with_suffix(".png")).shape
    assert width > height > 300

    (lad,) = saved["ladders"]
    assert (lad["size"], lad["processes"]) == ("tiny", 1)
    rungs = {r["id"]: r for r in lad["rungs"]}
    assert list(rungs) == RUNG_IDS
    for r in lad["rungs"]:
        if r["status"] == "measured":
            f = r["figures"]
            assert f["tokens_per_s_per_gpu"] > 0 and f["measured_time_s"] > 0, r["id"]
            assert f["peak_allocated_gib"] is None  # CPU: no device memory; MFU against the measured matmul rate
            assert 0 < f["mfu"] < 1 and r["metrics_json"]["peak_flops_source"].startswith("against the best")
            assert f["warmup_peak_allocated_gib"] is None and f["warmup_host_rss_gib"] > 0  # recorded at warm-up end
            assert r["metrics_json"]["status"] == "completed" and "accelerate.commands.launch" in r["command"]
        elif r["status"] == "skipped":
            assert r["reason"], r["id"]
        else:
            assert r["id"] == "6a", r  # the injected failure only
    # Liger and checkpoint offload need CUDA; everything else really ran (float8 on torch's reference CPU float8
    # matmul, the long row at 8 x the ladder's max_length)
    assert {i for i, r in rungs.items() if r["status"] == "skipped"} == {"2", "7a", "7c"}
    assert all("CUDA" in rungs[i]["reason"] for i in ("2", "7a", "7c"))
    assert {i for i, r in rungs.items() if r["status"] == "measured"} == {"0", "1", "3", "4", "5", "6b", "7b"}


@pytest.mark.slow
def test_dry_run_rungs_run_what_they_claim(dry):
    result, _, _ = dry
    rungs = {r["id"]: r for r in result["ladders"][0]["rungs"]}
    sizes = result["sizes"]
    r0, r1 = rungs["0"], rungs["3"]
    # warm-up excluded: the report's counters hold the measured steps' sequences only
    assert r0["metrics_json"]["steps"] == sizes["warmup"] + sizes["steps"]
    assert r0["metrics_json"]["samples"] == sizes["steps"] * sizes["baseline_batch"]
    # rung 0 pads, rung 3 is padding-free packing (one flattened row with position_ids: no padding at all)
    assert r0["figures"]["padding_fraction"] > 0.2 and r1["figures"]["padding_fraction"] == 0
    # `auto` handed to the pack, whose attention option picks on the device: SDPA on a CPU, and says so
    assert r1["config"]["packing"] and r1["config"]["attn"] == "auto"
    assert r1["speed_options"]["attention"]["ran"] == "sdpa" and "CUDA" in r1["speed_options"]["attention"]["why"]
    full = sizes["steps"] * sizes["pack_rows"] * sizes["max_length"]  # best-fit packing leaves a few tokens free
    assert 0.9 * full <= r1["metrics_json"]["tokens"]["padded"] == r1["metrics_json"]["tokens"]["non_padding"] <= full
    # regional compile through accelerate's own path (the rung's YAML), and it really compiled: dynamo made graphs
    assert rungs["4"]["dynamo_config"]["dynamo_backend"] == "AOT_EAGER" and rungs["0"]["dynamo_config"] is None
    assert rungs["4"]["figures"]["compiled_graphs"] > 0 and rungs["0"]["figures"]["compiled_graphs"] == 0
    # float8 as the recipe setting: the entry point converted the tiny model's 8 decoder linears, not the LM head
    assert "--float8 true" in rungs["5"]["command"] and "--float8 false" in r0["command"]
    assert rungs["5"]["speed_options"]["float8"] == {"converted": 14, "linear": 15}
    assert rungs["1"]["config"]["activation_checkpointing"] == "none"
    assert "--padding_free true" in r1["command"] and "--padding_free" not in r0["command"]
    assert r0["metrics_json"]["sharding_strategy"] == "FULL_SHARD"
    assert rungs["6b"]["metrics_json"]["sharding_strategy"] == "SHARD_GRAD_OP"  # reshard_after_forward False
    assert r0["metrics_json"]["fsdp_version"] == 2 and r0["metrics_json"]["world_size"] == 1
    # issue 60's long row: one wrapped row of 8 x max_length a step, full causal attention (no padding-free)
    long = rungs["7b"]
    assert "--max_length 1024" in long["command"] and "--packing_strategy wrapped" in long["command"]
    tokens = long["metrics_json"]["tokens"]  # no padding; the wrapped data's last row of an epoch may be short
    assert "--padding_free" not in long["command"] and tokens["padded"] == tokens["non_padding"]
    assert sizes["steps"] * sizes["max_length"] < tokens["padded"] <= sizes["steps"] * 1024
    assert rungs["7c"]["config"]["offload"] and rungs["7c"]["config"]["long_row"] == 8
    # cumulative: every rung is built on the fastest measured before it (a long row's tokens/s is not comparable)
    best, best_tps = None, 0.0
    for r in result["ladders"][0]["rungs"]:
        assert r["built_on"] == best, r["id"]
        if r["status"] == "measured" and not r["config"].get("long_row") and \
                r["figures"]["tokens_per_s_per_gpu"] > best_tps:
            best, best_tps = r["id"], r["figures"]["tokens_per_s_per_gpu"]


@pytest.mark.slow
def test_a_failed_rung_is_recorded_and_the_ladder_goes_on(dry):
    result, text, _ = dry
    rungs = {r["id"]: r for r in result["ladders"][0]["rungs"]}
    failed = rungs["6a"]
    assert failed["status"] == "failed" and failed["returncode"] not in (0, None)
    assert "no_such_setting" in failed["error"] and "ChildFailedError" not in failed["error"]
    assert rungs["6b"]["status"] == "measured" and rungs["6b"]["built_on"] != "6a"
    assert "| 6a | activation_checkpointing_policy: ops | - |" in text and "failed: " in text


# Parameter counts of the benchmark's untied Mistrals, by hand from their shapes (no biases; not from the module's
# docstring or flops.count_params). Per decoder layer: q_proj and o_proj hidden x (heads x head_dim), k_proj and v_proj
# hidden x (kv_heads x head_dim), gate/up/down hidden x intermediate, two RMSNorm weights of hidden. Then the final
# norm (hidden) and the LM head (vocab x hidden): the "non-embedding" count the FLOPs use. The input embedding
# (vocab x hidden) makes the total.
#
# 1b: hidden 2048, intermediate 8192, 16 layers, 32 heads x 64 = 2048, 8 kv heads x 64 = 512, vocab 32768
#   per layer 2 x 2048 x 2048 + 2 x 2048 x 512 + 3 x 2048 x 8192 + 2 x 2048
#           = 8,388,608 + 2,097,152 + 50,331,648 + 4,096 = 60,821,504; x 16 = 973,144,064
ONE_B_NON_EMBEDDING = 16 * (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048) + 2048 + 32768 * 2048
ONE_B_TOTAL = ONE_B_NON_EMBEDDING + 32768 * 2048  # + 67,108,864
# 8b: hidden 4096, intermediate 12288, 36 layers, 32 heads x 128 = 4096, 8 kv heads x 128 = 1024, vocab 131072
#   per layer 2 x 4096 x 4096 + 2 x 4096 x 1024 + 3 x 4096 x 12288 + 2 x 4096
#           = 33,554,432 + 8,388,608 + 150,994,944 + 8,192 = 192,946,176; x 36 = 6,946,062,336
EIGHT_B_NON_EMBEDDING = 36 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096) + 4096 + 131072 * 4096
EIGHT_B_TOTAL = EIGHT_B_NON_EMBEDDING + 131072 * 4096  # + 536,870,912
# tiny (--dry-run): hidden 64, intermediate 128, 2 layers, 2 heads x 32 = 64, 2 kv heads x 32 = 64, vocab 268
#   per layer 4 x 64 x 64 + 3 x 64 x 128 + 2 x 64 = 16,384 + 24,576 + 128 = 41,088
TINY_NON_EMBEDDING = 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64 + 268 * 64
TINY_TOTAL = TINY_NON_EMBEDDING + 268 * 64  # + 17,152
# LoRA r 16 on all seven projections (recipes/llama-3.1-8b-lora): r x (in + out) per linear, 2 layers:
#   q, k, v, o 16 x (64 + 64) = 2,048 each; gate, up, down 16 x (64 + 128) = 3,072 each -> 17,408 per layer
TINY_LORA = 2 * 16 * (4 * (64 + 64) + 3 * (64 + 128))


def test_hand_counts_add_up():
    assert (ONE_B_NON_EMBEDDING, ONE_B_TOTAL) == (1_040_254_976, 1_107_363_840)
    assert (EIGHT_B_NON_EMBEDDING, EIGHT_B_TOTAL) == (7_482_937_344, 8_019_808_256)
    assert (TINY_NON_EMBEDDING, TINY_TOTAL, TINY_LORA) == (99_392, 116_544, 34_816)


def test_model_sizes_on_the_meta_device():
    one, eight = bench_gpu.param_counts("1b"), bench_gpu.param_counts("8b")
    # dense models: every parameter active, no experts (metrics/flops.py counts a mixture's experts at top_k / E)
    assert one == {"total": ONE_B_TOTAL, "trainable": ONE_B_TOTAL, "trainable_non_embedding": ONE_B_NON_EMBEDDING,
                   "frozen_non_embedding": 0, "active": ONE_B_TOTAL, "expert": 0,
                   "trainable_active_non_embedding": ONE_B_NON_EMBEDDING, "frozen_active_non_embedding": 0}
    assert eight == {"total": EIGHT_B_TOTAL, "trainable": EIGHT_B_TOTAL,
                     "trainable_non_embedding": EIGHT_B_NON_EMBEDDING, "frozen_non_embedding": 0,
                     "active": EIGHT_B_TOTAL, "expert": 0, "trainable_active_non_embedding": EIGHT_B_NON_EMBEDDING,
                     "frozen_active_non_embedding": 0}
    assert bench_gpu.mistral_config("8b").model_type == "mistral"


def test_llama3_8b_shape_has_the_published_parameter_count():
    """Meta's model card: Llama 3 8B has 8.03B parameters; the safetensors index of Meta-Llama-3-8B totals
    16,060,522,496 bytes in bf16, i.e. 8,030,261,248 parameters (untied embeddings, vocabulary 128,256)."""
    count = bench_gpu.param_counts("llama3-8b")
    assert count["total"] == 16_060_522_496 // 2
    assert count["total"] - count["trainable_non_embedding"] == 128_256 * 4096  # the input embedding


def clipped_lognormal(median: float, sigma: float, lo: float, hi: float) -> dict:
    """Figures of min(max(X, lo), hi) for X lognormal (ln X ~ N(ln median, sigma^2)), from the distribution's formulas
    rather than from samples: quantiles exp(mu + sigma z_p); P(X > hi) = 1 - Phi((ln hi - mu) / sigma); and the mean
    lo P(X < lo) + E[X; lo < X < hi] + hi P(X > hi), where E[X; lo < X < hi] = exp(mu + sigma^2 / 2)
    (Phi((ln hi - mu) / sigma - sigma) - Phi((ln lo - mu) / sigma - sigma)) (the lognormal's partial expectation)."""
    z, mu = NormalDist(), math.log(median)
    a, b = (math.log(lo) - mu) / sigma, (math.log(hi) - mu) / sigma
    partial = math.exp(mu + sigma**2 / 2) * (z.cdf(b - sigma) - z.cdf(a - sigma))
    return {"median": median, "p10": math.exp(mu + sigma * z.inv_cdf(0.1)),
            "p90": math.exp(mu + sigma * z.inv_cdf(0.9)), "fraction_at_max": 1 - z.cdf(b),
            "mean": lo * z.cdf(a) + partial + hi * (1 - z.cdf(b))}


def test_synthetic_lengths_have_the_claimed_spread():
    lengths = bench_gpu.synthetic_lengths(20_000)
    assert lengths == bench_gpu.synthetic_lengths(20_000)  # seeded
    s = bench_gpu.length_stats(lengths)
    # median 800 and sigma 0.9, clipped to [16, 4096]. By hand: b = (ln 4096 - ln 800) / 0.9 = 1.8146, so 3.48% are
    # cut at 4096; the unclipped mean 800 e^0.405 = 1,199.4, of which Phi(b - 0.9) = 0.8198 lies below 4096:
    # 983.3 + 4096 x 0.0348 = 1,125.8; p10 and p90 800 e^(-+1.2816 x 0.9) = 252.5 and 2,535.2
    want = clipped_lognormal(800, 0.9, 16, 4096)
    assert want["mean"] == pytest.approx(1125.8, abs=0.1) and want["fraction_at_max"] == pytest.approx(0.0348, abs=1e-4)
    assert (want["p10"], want["p90"]) == (pytest.approx(252.5, abs=0.1), pytest.approx(2535.2, abs=0.1))
    # the 20,000 samples against them, within about 4 standard errors of each figure (rounding to whole tokens aside)
    assert s["min"] >= 16 and s["max"] == 4096
    assert statistics.median(lengths) == pytest.approx(want["median"], rel=0.03)
    assert s["mean"] == pytest.approx(want["mean"], rel=0.02)
    assert s["p10"] == pytest.approx(want["p10"], rel=0.05) and s["p90"] == pytest.approx(want["p90"], rel=0.05)
    assert s["fraction_at_max"] == pytest.approx(want["fraction_at_max"], abs=0.005)
    small = bench_gpu.synthetic_lengths(2000, max_length=128)  # the same shape scaled by 128 / 4096: median 25
    assert max(small) == 128 and statistics.median(small) == pytest.approx(800 * 128 / 4096, rel=0.1)


def _measured(rid, tps, mfu=None):
    return {"id": rid, "name": rid, "status": "measured", "built_on": None, "config": {"attn": "sdpa"},
            "figures": {"tokens_per_s_per_gpu": tps, "mfu": mfu, "peak_allocated_gib": 10.0,
                        "peak_reserved_gib": 12.0, "host_rss_gib": 1.0}}


def test_goals_are_judged_from_measured_figures_only():
    lad = {"size": "1b", "processes": 1, "rungs": [_measured("0", 1000.0, 0.2), _measured("1", 1600.0, 0.41),
                                                   {"id": "2", "name": "x", "status": "skipped", "reason": "r"}]}
    g = bench_gpu.goals(lad, dry_run=False)
    assert g["tuned_rung"] == "1" and g["speedup"].startswith("met: 1.60x") and g["mfu"].startswith("not met: 41.0%")
    lad["rungs"][0] = {"id": "0", "name": "x", "status": "failed", "error": "OOM"}
    g = bench_gpu.goals(lad, dry_run=False)
    assert g["speedup"].startswith("not evaluated")
    lad8 = {"size": "8b", "processes": 1, "rungs": [_measured("0", 100.0, 0.5)]}
    assert bench_gpu.goals(lad8, dry_run=False)["mfu"].startswith("not applicable")
    assert bench_gpu.goals(lad8, dry_run=True)["speedup"].startswith("not evaluated: plumbing")


def test_table_and_skip_reasons(monkeypatch):
    result = {"plumbing_only": False, "ladders": [{
        "size": "1b", "processes": 1, "parameters": {"total": 1_107_363_840},
        "rungs": [_measured("0", 1000.0, 0.2), _measured("5a", 1500.0, 0.3)],
        "goals": {"tuned_rung": "5a", "speedup": "met: 1.50x", "mfu": "not met: 30.0%"}}]}
    result["ladders"][0]["rungs"][1]["memory_estimate_gib"] = 13.5  # 2 GiB of it the runtime allowance
    text = bench_gpu.table(result)
    assert "| 0 | 0 (sdpa) | 1,000 | 20.0% | 10.0 / 12.0 | - | 1.00x | measured |" in text
    assert "| 5a | 5a (sdpa) | 1,500 | 30.0% | 10.0 / 12.0 | 11.5 (+15%) | 1.50x | measured |" in text
    assert "NOT benchmarks" not in text and "met: 1.50x" in text
    cpu = {"type": "cpu"}
    h100 = {"type": "cuda", "capability": [9, 0]}
    a100 = {"type": "cuda", "capability": [8, 0]}
    f8 = next(r for r in bench_gpu.RUNGS if r["id"] == "5")
    full, lora = bench_gpu.BASELINE, {**bench_gpu.BASELINE, "method": "lora"}
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    assert "torchao is not importable" in bench_gpu.why_skip(f8, full, h100)
    assert "torchao is not importable" in bench_gpu.why_skip(f8, full, cpu)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torchao" else real(name, *a))
    assert "8.9" in bench_gpu.why_skip(f8, full, a100) and bench_gpu.why_skip(f8, full, h100) is None
    assert bench_gpu.why_skip(f8, full, cpu) is None  # CPU: torch's reference float8 matmul (plumbing runs)
    assert "refuses it under LoRA" in bench_gpu.why_skip(f8, lora, h100)
    assert bench_gpu.why_skip(next(r for r in bench_gpu.RUNGS if r["id"] == "1"), full, h100) is None


def test_memory_estimate_skips_8b_on_one_80gb_gpu():
    packed_full_ac = bench_gpu.resolve({**bench_gpu.BASELINE, "packing": True, "batch": "pack"},
                                       bench_gpu.GPU_RUN, {"type": "cuda"})
    eight = bench_gpu.memory_estimate("8b", packed_full_ac, 1, 4096)
    one = bench_gpu.memory_estimate("1b", bench_gpu.resolve(bench_gpu.BASELINE, bench_gpu.GPU_RUN, {"type": "cuda"}),
                                    1, 4096)
    assert eight > 80 * bench_gpu.GIB  # 16 bytes per parameter alone is ~120 GiB
    assert one < 40 * bench_gpu.GIB
    # LoRA: the frozen 8B weights in bf16 (16 GB) and adapters: packed with full checkpointing fits an 80 GB GPU
    # with room to spare, without checkpointing it does not
    lora = {**packed_full_ac, "method": "lora"}
    assert 20 * bench_gpu.GIB < bench_gpu.memory_estimate("8b", lora, 1, 4096) < 40 * bench_gpu.GIB
    no_ac = bench_gpu.memory_estimate("8b", {**lora, "activation_checkpointing": "none"}, 1, 4096)
    assert no_ac > bench_gpu.FIT_FRACTION * 80e9
    # rung 1's policy: the first of none, every_4, every_2, ops, full that fits the GPU as the fit check wants
    h100 = {"type": "cuda", "memory_bytes": 80e9}
    fits = {name: bench_gpu.memory_estimate("8b", {**lora, "activation_checkpointing": name}, 1, 4096)
            <= bench_gpu.FIT_FRACTION * 80e9 for name in ("none", "every_4", "every_2", "ops", "full")}
    assert not fits["none"] and fits["full"]
    assert bench_gpu.planner_pick("8b", lora, 1, 4096, h100) == next(name for name, ok in fits.items() if ok)
    assert bench_gpu.planner_pick("8b", lora, 1, 4096, {"type": "cpu"}) == "none"  # plumbing: the policy's path
    # issue 60's rungs 7b-7c: a 32,768-token row of the 8B LoRA, every layer checkpointed; offloaded, its 36 layers'
    # inputs (the 8b size is Ministral-8B's shape: 36 x 4,096 x 2 B a token) leave the GPU for host memory
    row = {**lora, "batch": 1, "activation_checkpointing": "full", "long_row": 8}
    kept = bench_gpu.memory_estimate("8b", row, 1, 32768)
    assert kept - bench_gpu.memory_estimate("8b", {**row, "offload": True}, 1, 32768) == 36 * 4096 * 2 * 32768


def test_lora_ladder_uses_the_8b_lora_recipes_adapters():
    lora = bench_gpu.lora_settings()
    assert lora == {"lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "lora_target_modules": [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}  # recipes/llama-3.1-8b-lora
    eight = bench_gpu.param_counts("8b", "lora")
    # r x (in + out) per targeted linear: q, o 4096->4096; k, v 4096->1024; gate, up 4096->12288; down back; 36 layers
    per_layer = 16 * (2 * 8192 + 2 * 5120 + 3 * 16384)
    assert eight["trainable"] == eight["trainable_non_embedding"] == 36 * per_layer == 43_646_976
    assert eight["total"] == EIGHT_B_TOTAL + 43_646_976
    assert eight["frozen_non_embedding"] == EIGHT_B_NON_EMBEDDING  # every base weight but the input embedding: 4N
    s = bench_gpu.resolve({**bench_gpu.BASELINE, "method": "lora"}, bench_gpu.GPU_RUN, {"type": "cuda"})
    args = bench_gpu.sft_args(s, "m", "d", "o", bench_gpu.GPU_RUN, bf16=True)
    assert args[args.index("--use_peft") + 1] == "true"
    i = args.index("--lora_target_modules")
    assert args[i + 1:i + 8] == lora["lora_target_modules"]
    full = bench_gpu.sft_args({**s, "method": "full"}, "m", "d", "o", bench_gpu.GPU_RUN, bf16=True)
    assert full[full.index("--use_peft") + 1] == "false" and "--lora_r" not in full


def test_a_model_that_cannot_be_built_fails_its_rungs_without_launching(monkeypatch, tmp_path):
    def no_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 16.00 GiB\nmore")

    monkeypatch.setattr(bench_gpu, "build_model", no_memory)
    monkeypatch.setattr(bench_gpu, "run_rung", lambda *a, **k: pytest.fail("launched without a model"))
    lad = {"size": "tiny", "processes": 1, "rungs": []}
    ctx = dict(sizes=bench_gpu.DRY_RUN, device={"type": "cpu"}, work=tmp_path, dry_run=True, t0=0.0,
               deadline_s=None, fit_check=True, build_device="cpu", inject_failure=set(), carried={},
               rungs_named=True, resume_from=None)
    bench_gpu.ladder(lad, ctx, ["0", "1"], lambda: None)
    assert [(r["id"], r["status"]) for r in lad["rungs"]] == [("0", "failed"), ("1", "failed")]
    assert lad["rungs"][1]["error"] == "building the tiny model failed: RuntimeError: CUDA out of memory. " \
                                       "Tried to allocate 16.00 GiB"
    assert lad["goals"]["tuned_rung"] is None and "no rung measured" in bench_gpu.table(
        {"plumbing_only": True, "ladders": [{**lad, "parameters": {"total": 1}}]})


def test_error_line_names_the_real_error_not_the_launchers_wrapper():
    log = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
           "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n=====\n"
           "subprocess.CalledProcessError: Command '[...]' returned non-zero exit status 1.\n")
    assert bench_gpu.error_line(log, None).startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert bench_gpu.error_line(log, {"error": "ValueError: bad\nmore"}) == "ValueError: bad"


def test_make_bench_runs_the_ladder_only_where_a_cuda_device_is_seen(monkeypatch, tmp_path):
    import torch

    calls = []
    monkeypatch.setattr(bench_gpu, "run", lambda argv: calls.append(argv) or ({}, "TABLE", tmp_path / "x.json"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.gpu_part(tmp_path) == bench.GPU_PENDING and not calls
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert bench.gpu_part(tmp_path).startswith("TABLE") and calls == [["--results", str(tmp_path)]]


@pytest.mark.slow
def test_ladder_picture_with_gpu_shaped_figures(dry, tmp_path):
    """The picture's GPU branch (MFU and device memory on the bars), on the dry run's ladder with those two fields
    filled in by hand: a fixture for the drawing code, not a figure anyone publishes."""
    from bench import plot as bench_plot

    result = json.loads(json.dumps(dry[0]))
    for r in result["ladders"][0]["rungs"]:
        if r["status"] == "measured":
            r["figures"].update(mfu=0.4, peak_allocated_gib=10.0, peak_reserved_gib=12.0)
    path = bench_plot.plot_gpu_ladders(result, tmp_path / "ladder.png")
    assert path.stat().st_size > 10_000


@pytest.mark.slow
def test_resume_carries_the_earlier_rungs_and_builds_on_them(dry, tmp_path):
    # the 10-minute command limit cuts a GPU ladder in two: the second command goes on from the first one's JSON
    _, _, first = dry
    result, _, path = bench_gpu.run(["--dry-run", "--results", str(tmp_path), "--resume", str(first), "--rungs", "6b"])
    rungs = {r["id"]: r for r in result["ladders"][0]["rungs"]}
    # measured and failed rungs come over as they were; skipped ones (2: Liger needs CUDA, 7a and 7c: offload) are
    # not; 6b, named, runs again
    assert list(rungs) == ["0", "1", "3", "4", "5", "6a", "6b", "7b"]
    assert all(rungs[i]["carried_from"] == str(first) for i in ("0", "1", "3", "4", "5", "6a", "7b"))
    assert "carried_from" not in rungs["6b"] and rungs["6b"]["status"] == "measured"
    # carried by (size, GPUs, method): the full fine-tuning ladder's rungs never seed a LoRA ladder
    assert set(bench_gpu.resume_rungs(first, True, result["device"], result["sizes"])) == {("tiny", 1, "full")}
    old = {r["id"]: r for r in json.loads(first.read_text())["ladders"][0]["rungs"]}
    fastest = max((r for r in old.values() if r["status"] == "measured" and r["id"] not in ("6b", "7b")),
                  key=lambda r: r["figures"]["tokens_per_s_per_gpu"])
    assert rungs["6b"]["built_on"] == fastest["id"]  # on the fastest carried rung, not on TRL's defaults
    assert json.loads(path.read_text())["resumed_from"] == str(first)


@pytest.mark.slow
def test_dry_run_lora_ladder(tmp_path, cache_dir):
    """`--methods lora`: the entry point trains LoRA adapters (the 8B LoRA recipe's settings) under accelerate's
    regional compile; float8 is skipped as the pack refuses it with LoRA; MFU's FLOPs count 4N for frozen weights."""
    result, text, path = bench_gpu.run(["--dry-run", "--methods", "lora", "--rungs", "4,5", "--results",
                                        str(tmp_path)])
    assert path.name.endswith("-lora.json") and result["lora"]["recipe"] == "llama-3.1-8b-lora"
    (lad,) = result["ladders"]
    assert lad["method"] == "lora" and lad["parameters"] == {  # counted by hand above
        "total": TINY_TOTAL + TINY_LORA, "trainable": TINY_LORA, "trainable_non_embedding": TINY_LORA,
        "frozen_non_embedding": TINY_NON_EMBEDDING, "active": TINY_TOTAL + TINY_LORA, "expert": 0,
        "trainable_active_non_embedding": TINY_LORA, "frozen_active_non_embedding": TINY_NON_EMBEDDING}
    compiled, f8 = lad["rungs"]
    assert compiled["status"] == "measured" and compiled["config"]["method"] == "lora", compiled.get("error")
    assert compiled["figures"]["compiled_graphs"] > 0  # the LoRA layers went through dynamo
    m = compiled["metrics_json"]
    assert m["params"] == {"total": 151_360, "trainable": 34_816, "active": 151_360}  # 116,544 + 34,816 adapters
    # 6N for the trained adapters, 4N for the frozen weights (flops.py's LoRA convention), plus 12 L H d_head T
    # (PaLM appendix B), with the tiny model's 2 layers of 2 heads of 32
    attention = 12 * 2 * 2 * 32 * m["flops_seq_len"]
    assert m["flops_per_token"] == pytest.approx(6 * 34_816 + 4 * 99_392 + attention)
    assert f8["status"] == "skipped" and "refuses it under LoRA" in f8["reason"]
    assert "tiny LoRA (151,360 parameters, 34,816 trained), 1 process(s)" in text
    assert "MFU goal is for 1B full fine-tuning" in bench_gpu.goals({**lad, "size": "1b"}, dry_run=False)["mfu"]


@pytest.mark.slow
def test_resume_refuses_figures_measured_differently(dry, tmp_path):
    _, _, first = dry
    with pytest.raises(SystemExit, match="measured differently.*steps"):
        bench_gpu.run(["--dry-run", "--results", str(tmp_path), "--resume", str(first), "--steps", "3"])
    with pytest.raises(SystemExit, match="unknown rung"):
        bench_gpu.run(["--dry-run", "--results", str(tmp_path), "--rungs", "0,9"])


def test_a_rung_without_time_to_finish_is_skipped_not_started(tmp_path, cache_dir):
    result, _, _ = bench_gpu.run(["--dry-run", "--results", str(tmp_path), "--deadline-s", "1", "--rungs", "0,4"])
    rungs = result["ladders"][0]["rungs"]
    assert [r["status"] for r in rungs] == ["skipped", "skipped"]
    assert all(r["reason"].startswith("time budget") and "--resume" in r["reason"] for r in rungs)
    assert "under 10 s left" in rungs[1]["reason"]  # a compiled rung needs twice the minimum


@pytest.mark.parametrize("keep_carried", [True, False])
def test_the_plans_ladders_keep_carried_rungs_that_they_name(keep_carried, monkeypatch, tmp_path):
    """scripts/device_run.sh names every rung of a ladder and passes the earlier JSONs (--resume-if-comparable): a
    rung measured in an earlier session is carried, not measured again; plain --resume with --rungs reruns it."""
    monkeypatch.setattr(bench_gpu, "run_rung", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.setattr(bench_gpu, "build_model", lambda *a, **k: pytest.fail("built"))
    rung0 = {**_measured("0", 100.0), "config": dict(bench_gpu.BASELINE, batch=8, method="full")}
    ctx = dict(sizes=bench_gpu.DRY_RUN, device={"type": "cpu"}, work=tmp_path, dry_run=True, t0=0.0,
               deadline_s=0.0, fit_check=True, build_device="cpu", inject_failure=set(),
               carried={("tiny", 1, "full"): {"0": rung0}}, rungs_named=True, keep_carried=keep_carried,
               resume_from="bench-gpu-earlier.json")
    lad = {"size": "tiny", "processes": 1, "rungs": []}
    bench_gpu.ladder(lad, ctx, ["0", "1"], lambda: None)  # deadline 0: a rung that would run is skipped instead
    first = lad["rungs"][0]
    if keep_carried:
        assert first["status"] == "measured" and first["carried_from"] == "bench-gpu-earlier.json"
    else:
        assert first["status"] == "skipped" and first["reason"].startswith("time budget")
    assert lad["rungs"][1]["status"] == "skipped"


# ---- the 4-bit step of the GPU plan (bench/qlora_gpu.py, scripts/device_run.sh qlora) ------------------------------

# The dry run's tiny Llama layer (launch/smoke.py's shape): hidden 64, 4 heads of 16 (q 64), 2 key/value heads (k, v
# 32), intermediate 128. Its seven linears: q, o 64 x 64 = 4,096 each; k, v 64 x 32 = 2,048 each; gate, up, down
# 64 x 128 = 8,192 each -> 36,864 weights, 18,432 bytes of NF4. LoRA r 16 of the 70B recipe on all seven: r x (in +
# out): q, o 16 x 128 = 2,048; k, v 16 x 96 = 1,536; gate, up, down 16 x 192 = 3,072 -> 16,384 adapter weights.
TINY_LAYER_4BIT = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128
TINY_LAYER_LORA = 16 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 128))


def test_the_qlora_steps_dry_run_counts_one_layer_as_the_plan_does(tmp_path, cache_dir, monkeypatch):
    """The plan's `qlora` step on CPU: the 70B recipe's layer probe at 1 and 2 layers with tiny shapes, in 4 bits
    with LoRA, one training step each; one layer's counted bytes against the planner's; the launch of the default in
    4 bits named, not started (tests/test_qlora.py launches that path on CPU). In this process: a few seconds."""
    monkeypatch.syspath_prepend(qlora_site())
    from bench import qlora_gpu

    result, path = qlora_gpu.run(["--dry-run", "--results", str(tmp_path)])
    saved = json.loads(path.read_text())
    assert saved["dry_run"] is True and saved["device"]["type"] == "cpu"
    layers = saved["layers"]
    assert [p["layers"] for p in layers["probes"]] == [1, 2] and all(p["loss"] > 0 for p in layers["probes"])
    per = layers["per_layer"]
    assert (TINY_LAYER_4BIT, TINY_LAYER_LORA) == (36_864, 16_384)
    # NF4 at half a byte per weight, bf16 adapters (2 bytes): counted as the planner counts them
    assert per["counted_bytes"]["packed_4bit"] == TINY_LAYER_4BIT // 2
    assert per["counted_bytes"]["trainable"] == TINY_LAYER_LORA * 2 == per["planned_bytes"]["gradients"]
    assert per["planned_bytes"]["optimizer_states"] == TINY_LAYER_LORA * 4  # AdamW's two bf16 moments
    assert per["measured_peak_bytes"] is None and per["peak_vs_planned"] is None  # CPU: no device memory
    default = saved["default_4bit"]
    assert default["status"].startswith("not launched: dry run") and "smollm2-135m-qlora" in default["command"]


def test_the_qlora_steps_launch_verdicts(tmp_path):
    """Part 2's verdicts from a run's files, hand-written: a CUDA run with bf16 storage and a plain merged model
    passes; a uint8 storage, a merged model still quantized and a missing final save fail."""
    from bench.qlora_gpu import judge_default

    out = tmp_path / "run"
    (out / "merged").mkdir(parents=True)
    metrics = {"status": "completed", "device": {"type": "cuda", "name": "H100"}, "mfu": 0.1, "world_size": 1,
               "peak_memory": {"device_allocated_bytes": 1, "device_reserved_bytes": 2, "device_total_bytes": 3},
               "gates": {"verdict": "pass"}, "final_save_check": {"tensors": 210}}
    run_args = {"model_args": {"load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16"},
                "sft_config": {"bf16": True}, "patches_applied": []}
    (out / "metrics.json").write_text(json.dumps(metrics))
    (out / "run_args.json").write_text(json.dumps(run_args))
    (out / "merged" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    judged = judge_default(out, 0)
    assert {it["result"] for it in judged["items"]} == {"pass"}, judged["items"]
    assert "error" in judged["memory_truth"]  # no command recorded here: the figure says why, the verdicts stand

    run_args["model_args"]["bnb_4bit_quant_storage"] = "uint8"
    (out / "run_args.json").write_text(json.dumps(run_args))
    (out / "merged" / "config.json").write_text(json.dumps({"quantization_config": {"load_in_4bit": True}}))
    (out / "metrics.json").write_text(json.dumps({**metrics, "final_save_check": None}))
    failed = {it["item"] for it in judge_default(out, 0)["items"] if it["result"] == "FAIL"}
    assert failed == {"default in 4 bits: bf16 storage under bf16", "default in 4 bits: final save checked",
                      "default in 4 bits: merged/ is a plain model (the dequantised base + adapter)"}


# ---- the mixture-of-experts step of the GPU plan (bench/moe_gpu.py, scripts/device_run.sh moe) ---------------------

def test_the_moe_steps_dry_run_puts_one_layer_beside_the_plan(tmp_path, cache_dir):
    """The plan's `moe` step on CPU: qwen3-30b-a3b-lora's layer with tiny shapes (hidden 64, 8 experts of 32) at 1 and
    2 layers, LoRA on the attention and the experts, grouped_mm, one step each. PEFT's merged copy of the last layer's
    experts, found among autograd's saved tensors, is the planner's by hand: 8 x (64 x 64 + 64 x 32) bf16 elements =
    98,304 bytes; the counted weights are the planner's; both kernels ran. In this process: seconds."""
    from bench import moe_gpu

    result, path = moe_gpu.run(["--dry-run", "--results", str(tmp_path)])
    saved = json.loads(path.read_text())
    assert saved["dry_run"] is True and saved["device"]["type"] == "cpu" and saved["recipe"] == "qwen3-30b-a3b-lora"
    probes = saved["layers"]["probes"]
    assert [p["layers"] for p in probes] == [1, 2] and {p["kernel"] for p in probes} == {"grouped_mm"}
    per = saved["layers"]["per_layer"]
    assert per["merged_copies_bytes"] == per["merged_copy_planned_bytes"] == 8 * (64 * 64 + 64 * 32) * 2 == 98_304
    assert per["planned_bytes"]["lora_merged_copies"] == 98_304  # one more layer: one more copy (no checkpointing)
    assert per["counted_bytes"] == per["planned_bytes"]["weights"]
    assert per["moe_block_saved_bytes_per_token"] > 0 and per["moe_block_planned_bytes_per_token"] > 0
    assert per["measured_peak_bytes"] is None and per["peak_vs_planned"] is None  # CPU: no device memory
    assert {k: v["ran"] for k, v in saved["kernels"].items()} == {"grouped_mm": "grouped_mm", "eager": "eager"}


def test_the_gpu_plan_names_the_moe_step_in_its_second_call():
    """Issue 58's order: a call's speed ladder first (priority 1), MoE after it (priority 3)."""
    text = (REPO / "scripts" / "device_run.sh").read_text()
    assert "call-2) TOTAL_S=${CALL_S[call-2]}; run_named ladder-8b-lora; run_named moe; run_named varlen ;;" in text
    assert "call-1) TOTAL_S=${CALL_S[call-1]}; run_named ladder-1b; run_named qlora; run_named launch ;;" in text
    assert 'moe) step moe 60 s_moe ;;' in text and '"$PY" -m bench.moe_gpu' in text


def test_a_gpu_benchmark_without_a_gpu_is_one_error_line_and_exit_2(capsys, monkeypatch):
    """`make bench-gpu` on a CPU machine said "bench_gpu: no CUDA device here. Use --dry-run ..." and exited 1."""
    import torch

    from bench import gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        gpu.main(["--sizes", "tiny"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == "error: bench_gpu: no CUDA device here. Fix: --dry-run tests the plumbing on CPU.\n"
